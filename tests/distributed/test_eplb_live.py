"""Live EPLB: weight migration plans (single process) and re-placements on W ranks.

The distributed tests run whole sweeps inside one process group per world size (rank
bodies in ``tests/distributed/eplb_cases.py``); the plan and manager-validation tests need no
process group.
"""

from __future__ import annotations

import pytest
import torch

import epmoe
from epmoe.eplb.manager import EPLBManager, measured_balancedness, measured_rank_load
from epmoe.eplb.migration import MigrationPlan, migrate_slots
from epmoe.eplb.recorder import logical_load
from epmoe.placement import ExpertPlacement
from tests.distributed import eplb_cases
from tests.harness import run_on_ranks, world_ids, world_sizes
from tests.harness import test_device as device_under_test

WORLDS = world_sizes([2, 3, 4], minimum=2)  # EPMOE_TEST_WORLDS=8 on an 8-GPU machine


def _dtype() -> str:
    return "bfloat16" if device_under_test() == "cuda" else "float32"


# ------------------------------------------------------------------ plans (no process group)


def _random_placement(E: int, W: int, c: int, seed: int) -> ExpertPlacement:
    g = torch.Generator().manual_seed(seed)
    extra = torch.randint(0, E, (c * W - E,), generator=g)
    p2l = torch.cat([torch.arange(E), extra])[torch.randperm(c * W, generator=g)]
    return ExpertPlacement.from_physical_to_logical(p2l, W, num_experts=E)


@pytest.mark.parametrize(
    "E,W,c_old,c_new",
    [(8, 2, 4, 5), (8, 4, 3, 3), (12, 3, 5, 4), (5, 5, 1, 2)],
    ids=["grow", "same_P", "shrink", "one_slot_per_rank"],
)
def test_plan_fills_every_new_slot_from_a_holder(E, W, c_old, c_new) -> None:
    """Simulate the plan on expert ids: every new slot ends up with its expert, every
    transfer's source held it, and only changed slots are touched."""
    for seed in range(20):
        old = _random_placement(E, W, c_old, seed)
        new = _random_placement(E, W, c_new, 100 + seed)
        plan = MigrationPlan.build(old, new)
        for t in plan.transfers:
            assert old.local_experts(t.src)[t.src_slot] == t.expert, t
            assert new.local_experts(t.dst)[t.dst_slot] == t.expert, t
            assert t.expert not in old.local_experts(t.dst), f"{t}: the receiver held it"
        for r, rp in enumerate(plan.ranks):
            before, after = old.local_experts(r), new.local_experts(r)
            slots = [None] * len(after)
            for s in rp.keep:
                slots[s] = before[s]
            for s, o in rp.local:
                slots[s] = before[o]
            for s, src in rp.recv:
                (t,) = [t for t in plan.transfers if t.dst == r and t.dst_slot == s]
                assert t.src == src
                slots[s] = t.expert
            for s, f in rp.dup:
                slots[s] = slots[f]
            assert slots == after, (seed, r, slots, after)
            changed = [s for s, x in enumerate(after) if s >= len(before) or before[s] != x]
            assert list(rp.changed) == changed
            assert len({x for x in (after[s] for s, _ in rp.recv)}) == len(rp.recv), "dup recv"


def test_plan_spreads_senders_over_replicas() -> None:
    """Expert 0 is held by ranks 0 and 1 and is the only expert that ranks 2 and 3 need:
    each holder sends one copy."""
    old = [0, 1, 7, 0, 2, 8, 3, 4, 3, 5, 6, 5]
    new = [0, 1, 7, 0, 2, 8, 3, 4, 0, 5, 6, 0]
    plans = [ExpertPlacement.from_physical_to_logical(p, 4) for p in (old, new)]
    plan = MigrationPlan.build(*plans)
    assert sorted((t.src, t.expert) for t in plan.transfers) == [(0, 0), (1, 0)], plan.transfers


def test_migrate_slots_single_process_and_in_place() -> None:
    """W = 1: slots are rearranged with local copies only; in place keeps the storage."""
    old = ExpertPlacement.from_physical_to_logical([0, 1, 2, 3], 1)
    new = ExpertPlacement.from_physical_to_logical([3, 1, 0, 2], 1)
    big = torch.randn(4, 3, 2)
    small = torch.randn(4, 5)
    out = migrate_slots(old, new, 0, [big, small])
    idx = torch.tensor([3, 1, 0, 2])
    assert torch.equal(out[0], big[idx]) and torch.equal(out[1], small[idx])
    grown = ExpertPlacement.from_physical_to_logical([3, 1, 3, 0, 2, 2], 1)
    out = migrate_slots(old, grown, 0, [big])
    assert torch.equal(out[0], big[torch.tensor([3, 1, 3, 0, 2, 2])])
    want = big[idx]
    ptr = big.data_ptr()
    (same,) = migrate_slots(old, new, 0, [big], in_place=True)
    assert same is big and big.data_ptr() == ptr and torch.equal(big, want)
    with pytest.raises(ValueError, match="in_place"):
        migrate_slots(new, grown, 0, [big], in_place=True)
    with pytest.raises(ValueError, match="e_old"):
        migrate_slots(old, new, 0, [big[:3]])
    with pytest.raises(ValueError, match="ep_size"):
        migrate_slots(ExpertPlacement.linear(4, 2), ExpertPlacement.round_robin(4, 2), 0, [big[:2]])


def _single_layers(n: int = 2, **kwargs) -> list[epmoe.EPMoE]:
    return [
        epmoe.EPMoE(
            8, 2, 16, 8, params_dtype=torch.float32, experts="torch", device="cpu", **kwargs
        )
        for _ in range(n)
    ]


def test_manager_rejects_bad_configurations() -> None:
    with pytest.raises(ValueError, match="load_window"):
        EPLBManager(_single_layers())
    layers = _single_layers(load_window=2)
    with pytest.raises(ValueError, match="at least one"):
        EPLBManager([])
    with pytest.raises(ValueError, match="rebalance_interval"):
        EPLBManager(layers, rebalance_interval=0)
    with pytest.raises(ValueError, match="tolerance"):
        EPLBManager(layers, tolerance=2.0)
    with pytest.raises(ValueError, match="num_groups"):
        EPLBManager(layers, num_groups=3)
    other = epmoe.EPMoE(
        6, 2, 16, 8, params_dtype=torch.float32, experts="torch", device="cpu", load_window=2
    )
    with pytest.raises(ValueError, match="E=6"):
        EPLBManager([layers[0], other])
    with pytest.raises(TypeError, match="EPMoE"):
        EPLBManager([torch.nn.Linear(2, 2)])
    EPLBManager(layers, prefer_local_replica=True)
    assert all(layer.prefer_local_replica for layer in layers)


def test_single_process_manager_and_layer_rebalance() -> None:
    """W = 1: one rank is always balanced, so the manager keeps the placement (tolerance
    0.0 moves only for a strictly better plan) and a layer without tokens is not planned;
    an explicit re-placement with redundant slots gives the hot expert the replicas by local
    copies only, and the outputs stay exact."""
    layers = _single_layers(load_window=3)
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(8, 16, 16, generator=g) / 4, torch.randn(8, 16, 8, generator=g) / 3
    for layer in layers:
        layer.load_experts(w13, w2)
    manager = EPLBManager(layers, num_redundant=3, rebalance_interval=2)
    x = torch.randn(10, 16, generator=g)
    logits = torch.randn(10, 8, generator=g)
    logits[:, 5] += 4.0  # expert 5 is picked by every token
    assert manager.step() is None
    layers[0](x, logits)
    report = manager.step()
    assert report is not None and report.step == 2 and report.slots_moved == 0
    first, second = report.layers
    assert first.planned and not first.changed and first.tokens == 20
    assert first.measured_before == first.expected_after == 1.0
    assert not second.planned and not second.changed

    load = logical_load(layers[0].load_recorder.window_load(), torch.arange(8), 8)
    stats = layers[0].rebalance(ExpertPlacement.balanced(load, 1, num_redundant=3))
    counts = layers[0].placement.replica_count
    assert layers[0].placement.num_physical == 11 and layers[0].w13.shape[0] == 11
    assert int(counts[5]) >= 2 and int(counts[5]) == int(counts.max()), counts
    assert stats.bytes_received == 0 and stats.slots_moved > 0 and stats.slots_received == 0
    assert layers[0].load_recorder.window_load().tolist() == [0] * 11
    ref = epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, 2))
    epmoe.reference.assert_close(layers[0](x, logits), ref)


def test_measured_balancedness() -> None:
    p = ExpertPlacement.linear(4, 2)
    assert measured_balancedness(p, torch.tensor([3, 1, 2, 2])) == 1.0
    assert measured_balancedness(p, torch.tensor([6, 0, 2, 0])) == pytest.approx(4 / 6)
    assert measured_balancedness(p, torch.zeros(4)) == 1.0
    with pytest.raises(ValueError, match="P=4"):
        measured_balancedness(p, torch.zeros(5))
    # the per-rank sums behind it (rank 0 owns slots 0-1, rank 1 slots 2-3)
    assert measured_rank_load(p, torch.tensor([6, 0, 2, 0])).tolist() == [6.0, 2.0]
    with pytest.raises(ValueError, match="P=4"):
        measured_rank_load(p, torch.zeros(3))


# ------------------------------------------------------------------ W ranks


@pytest.mark.parametrize("world", WORLDS, ids=world_ids(WORLDS))
def test_rebalance_moves_only_changed_slots(world) -> None:
    run_on_ranks(eplb_cases.check_rebalance, world, device_under_test(), _dtype())


@pytest.mark.parametrize("world", [2, 3], ids=["W=2", "W=3"])
def test_rebalance_errors_raise_on_every_rank(world) -> None:
    run_on_ranks(eplb_cases.check_rebalance_errors, world, device_under_test())


@pytest.mark.parametrize("world", WORLDS, ids=world_ids(WORLDS))
def test_manager_improves_measured_balance(world) -> None:
    results = run_on_ranks(eplb_cases.check_manager, world, device_under_test(), _dtype())
    assert all(r == results[0] for r in results), f"ranks measured differently: {results}"


@pytest.mark.parametrize("world", [2], ids=["W=2"])
def test_managers_that_differ_raise_on_every_rank(world) -> None:
    run_on_ranks(eplb_cases.check_manager_agreement, world, device_under_test())


@pytest.mark.parametrize("world", [3], ids=["W=3"])
def test_a_failed_rebind_after_an_in_place_migration_is_not_served(world) -> None:
    run_on_ranks(eplb_cases.check_failed_rebind_after_in_place_migration, world, "cpu")
