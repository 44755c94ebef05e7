"""Rank bodies of the live-EPLB tests (weight migration and the manager), gloo or NCCL.

Each function runs on every rank of an initialised process group (see ``tests/harness.py``).
Expert weights are random with one shared seed, so each expert's weights are unique: a slot's
content names the logical expert it holds (``_holder`` decodes it for error messages).
Expected migration statistics are recomputed here from the two placements, independently of
``epmoe.eplb.migration``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import epmoe
from epmoe.eplb.manager import EPLBManager, measured_balancedness
from epmoe.eplb.migration import migrate_slots
from epmoe.placement import ExpertPlacement
from epmoe.reference import TOLERANCES, assert_close
from epmoe.routing import RoutingSimulator
from tests.distributed.cases import (
    backends_and_layouts,
    device_for,
    full_weights,
    rank_tokens,
    redundant_slots,
)
from tests.harness import Sweep

H, I = 16, 8  # hidden and intermediate sizes of every case here


# ------------------------------------------------------------------------------ scenarios


def _hand_made_replicas(E: int, W: int) -> tuple[ExpertPlacement, ExpertPlacement]:
    """``old``: every expert once plus the first ones again; ``new``: rank 0 holds two
    replicas of expert E-1, which it did not hold (received once, then copied), and the
    other slots are shifted (local copies) or unchanged."""
    c = -(-E // W) + 1  # slots per rank
    P = c * W
    old = [*range(E), *range(P - E)]
    new = [E - 1, E - 1, *range(E - 1)]
    new += list(range(1, 1 + P - len(new)))
    return (
        ExpertPlacement.from_physical_to_logical(old, W, num_experts=E),
        ExpertPlacement.from_physical_to_logical(new, W, num_experts=E),
    )


def scenarios(W: int) -> list[tuple[str, int, list[ExpertPlacement]]]:
    """``(name, E, [p0, p1, ...])``: a layer starts on ``p0`` and is re-placed onto each
    next placement in turn. The same list on every rank."""
    # e: linear is uneven (6 for W = 4), so the slot count and rank_offsets change twice;
    # f: two or more experts per rank, so round-robin and linear differ
    e, f = (6, 8) if W <= 4 else (W + 2, 2 * W)
    skew = torch.tensor([1.0, 9.0, 2.0, 30.0, 4.0, 5.0]).repeat(-(-e // 6))[:e]
    skew = skew * (1 + torch.arange(e) // 6)  # (W <= 4: the six loads as they were)
    skew_b = skew.flip(0)
    skew_b[1] *= 3.0  # another skew, for the migration-aware re-plan
    r = redundant_slots(e, W, at_least=1)
    bal = ExpertPlacement.balanced(skew, W, num_redundant=r)
    bal_b = ExpertPlacement.balanced(skew_b, W, num_redundant=r, current=bal)
    replicas = _hand_made_replicas(f, W)
    return [
        ("linear->balanced->aware->linear", e,
         [ExpertPlacement.linear(e, W), bal, bal_b, ExpertPlacement.linear(e, W)]),
        ("round_robin->linear", f,
         [ExpertPlacement.round_robin(f, W), ExpertPlacement.linear(f, W)]),
        ("two_replicas_on_one_rank->back", f, [*replicas, replicas[0]]),
        ("unchanged", f, [ExpertPlacement.linear(f, W), ExpertPlacement.linear(f, W)]),
    ]  # fmt: skip


def expected_stats(old: ExpertPlacement, new: ExpertPlacement, rank: int, slot_bytes: int):
    """``(slots_moved, experts_received, bytes_received)`` of ``rank``, from first principles:
    a new slot changes if its index is new or held another expert; the rank receives each
    expert of its changed slots that none of its old slots held, once."""
    before, after = old.local_experts(rank), new.local_experts(rank)
    changed = [s for s, x in enumerate(after) if s >= len(before) or before[s] != x]
    if old.rank_offsets == new.rank_offsets:
        lo, hi = old.rank_offsets[rank], old.rank_offsets[rank + 1]
        assert len(changed) == int(old.moved_slots(new)[lo:hi].sum()), "moved_slots disagrees"
    need = {after[s] for s in changed} - set(before)
    return len(changed), len(need), len(need) * slot_bytes


def _holder(slot_w13: torch.Tensor, w13_full: torch.Tensor) -> str:
    """Which logical expert's weights a slot holds (for messages)."""
    hits = [e for e in range(w13_full.shape[0]) if torch.equal(slot_w13, w13_full[e])]
    return f"expert {hits[0]}" if hits else "no expert's weights"


def check_slots(layer, placement: ExpertPlacement, w13, w2, rank: int, label: str) -> None:
    """Every local slot holds exactly the weights of the expert ``placement`` gives it."""
    want = placement.local_experts(rank)
    assert layer.w13.shape[0] == len(want) and layer.w2.shape[0] == len(want), (
        f"{label}: rank {rank} has {layer.w13.shape[0]} slots, the placement gives it {len(want)}"
    )
    for s, x in enumerate(want):
        if not (torch.equal(layer.w13[s], w13[x]) and torch.equal(layer.w2[s], w2[x])):
            raise AssertionError(
                f"{label}: rank {rank} slot {s} should hold expert {x}, holds "
                f"{_holder(layer.w13[s], w13)}"
            )


# ------------------------------------------------------------------------------ rank bodies


def check_rebalance(rank, world, device="cpu", dtype_name="float32"):
    """Every scenario × backend × layout: slots hold the right experts after each
    re-placement, only changed slots travel, the byte counts match first principles, and
    the outputs before and after equal the oracle and each other."""
    dtype = getattr(torch, dtype_name)
    dev = device_for(rank, device)
    K = 2
    sweep = Sweep()
    for name, E, chain in scenarios(world):
        for backend, layout in backends_and_layouts():
            with sweep.case(f"W={world} {name} {backend} {layout.value}"):
                layer = epmoe.EPMoE(
                    E,
                    K,
                    H,
                    I,
                    placement=chain[0],
                    backend=backend,
                    layout=layout,
                    experts="torch",
                    params_dtype=dtype,
                    device=dev,
                    max_num_tokens=8,
                    load_window=2,
                )
                w13, w2 = full_weights(E, H, I, dtype, dev, seed=11)
                layer.load_experts(w13, w2)
                x, logits = rank_tokens(rank, [7, 0, 12, 3][rank % 4], H, E, dtype, dev, seed=11)
                ref = epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, K))
                out_before = layer(x, logits)
                slot_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
                for step, (old, new) in enumerate(zip(chain, chain[1:])):
                    label = f"step {step}"
                    param = layer.w13
                    stats = layer.rebalance(new)
                    everyone = [None] * world
                    dist.all_gather_object(everyone, stats)
                    out_after = layer(x, logits)
                    # assertions after the last collective of the step
                    check_slots(layer, new, w13, w2, rank, label)
                    moved, received, bytes_in = expected_stats(old, new, rank, slot_bytes)
                    got = (stats.slots_moved, stats.slots_received, stats.bytes_received)
                    assert got == (moved, received, bytes_in), (
                        f"{label}: rank {rank} (moved, received, bytes in) = {got}, expected "
                        f"{(moved, received, bytes_in)}"
                    )
                    assert stats.slots_copied == moved - received, (label, stats)
                    assert stats.bytes_sent == stats.slots_sent * slot_bytes, (label, stats)
                    sent = sum(s.bytes_sent for s in everyone)
                    recv = sum(s.bytes_received for s in everyone)
                    assert sent == recv, f"{label}: {sent} bytes sent, {recv} received"
                    assert (
                        layer.placement == new and layer.comm.spec.rank_offsets == new.rank_offsets
                    )
                    assert isinstance(layer.w13, nn.Parameter) and not layer.w13.requires_grad
                    same_count = old.num_local(rank) == new.num_local(rank)
                    assert (layer.w13 is param) == same_count, f"{label}: in-place iff same e"
                    assert layer.load_recorder.counts_SP.shape[1] == new.num_physical
                    assert_close(out_after, ref, TOLERANCES[dtype], name=f"{label} vs oracle")
                    assert_close(
                        out_after, out_before, TOLERANCES[dtype], name=f"{label} vs before"
                    )
                if name == "unchanged":
                    assert stats.slots_moved == 0 and stats.bytes_sent == 0, stats
    for name, _E, chain in scenarios(world):
        with sweep.case(f"W={world} {name} migrate_slots of ids and scales"):
            for old, new in zip(chain, chain[1:]):
                want = new.local_experts(rank)
                for in_place in (False, True):  # the same calls on every rank
                    ids = torch.tensor(old.local_experts(rank), device=dev)  # int64 [e]
                    scale = ids[:, None, None].float().expand(-1, 2, 3).contiguous() + 0.5
                    same = old.num_local(rank) == new.num_local(rank)
                    got_ids, got_scale = migrate_slots(
                        old, new, rank, [ids, scale], in_place=in_place and same
                    )
                    assert got_ids.tolist() == want, (in_place, got_ids.tolist(), want)
                    assert torch.equal(got_scale[:, 1, 2], got_ids.float() + 0.5)
                    assert (got_ids is ids) == (in_place and same)
    sweep.check()
    return sweep.passed


def check_rebalance_errors(rank, world, device="cpu"):
    """Ranks that pass different placements, or an unloaded rank, raise on every rank (no
    hang), and the layer keeps working on its old placement afterwards."""
    import pytest

    dev = device_for(rank, device)
    E, K = 8, 2
    layer = epmoe.EPMoE(E, K, H, I, params_dtype=torch.float32, device=dev, experts="torch")
    w13, w2 = full_weights(E, H, I, torch.float32, dev)
    layer.load_experts(w13, w2)
    mine = ExpertPlacement.round_robin(E, world) if rank == 0 else ExpertPlacement.linear(E, world)
    with pytest.raises(ValueError, match="disagree; placement differs"):
        layer.rebalance(mine)
    with pytest.raises(ValueError, match="ep_size"):
        layer.rebalance(ExpertPlacement.linear(E, world + 1))
    with pytest.raises(TypeError, match="ExpertPlacement"):
        layer.rebalance("balanced")
    fresh = epmoe.EPMoE(E, K, H, I, params_dtype=torch.float32, device=dev, experts="torch")
    if rank != 0:
        fresh.load_experts(w13, w2)
    # rank 0 (no weights) says why; the others name it, in the same call
    with pytest.raises(RuntimeError, match="not loaded" if rank == 0 else "rank 0 rejected"):
        fresh.rebalance(ExpertPlacement.round_robin(E, world))
    # the migration's own entry points: a rank whose arguments do not fit raises its error
    # in the same call as the others, which name it (before, they waited in the all-reduce)
    from epmoe.eplb.migration import rebalance_layer

    linear, uneven = ExpertPlacement.linear(E, world), ExpertPlacement.linear(E, world)
    if rank == 1:
        rest = [3 + (E - 3) * (r + 1) // (world - 1) for r in range(world - 1)]
        uneven = ExpertPlacement(E, world, torch.arange(E), (0, 3, *rest))
    own = "tensors_eX" if rank == 1 else "another EP rank refused"
    with pytest.raises(ValueError if rank == 1 else RuntimeError, match=own):
        migrate_slots(uneven, linear, rank, [layer.w13, layer.w2], check=True)
    bad = (
        ExpertPlacement.linear(E, world + 1) if rank == 0 else ExpertPlacement.round_robin(E, world)
    )
    own = "ep_size" if rank == 0 else "rank 0 rejected its arguments"
    with pytest.raises(ValueError if rank == 0 else RuntimeError, match=own):
        rebalance_layer(layer, bad)
    # one rank's in_place migration that changes its slot count, or a placement that is
    # none: refused in the agreement, on every rank (before, the others waited in the
    # transfers or the all-reduce until the group's timeout)
    offsets = (0, 3, *[3 + (E - 3) * (r + 1) // (world - 1) for r in range(world - 1)])
    grown = ExpertPlacement(E, world, torch.arange(E), offsets)  # rank 0 holds fewer slots
    grows = grown.num_local(rank) != linear.num_local(rank)
    own = "in_place=True needs the same number" if grows else "another EP rank refused"
    with pytest.raises(ValueError if grows else RuntimeError, match=own):
        migrate_slots(linear, grown, rank, [layer.w13, layer.w2], in_place=True)
    new = None if rank == world - 1 else linear
    with pytest.raises(TypeError if rank == world - 1 else RuntimeError,
                       match="new must be an ExpertPlacement, got NoneType"
                       if rank == world - 1 else "another EP rank refused"):  # fmt: skip
        migrate_slots(linear, new, rank, [layer.w13, layer.w2])
    # rebalance_layer is the layer's own rebalance: ranks that walk their layers in other
    # orders are named (before, weights were swapped between the layers silently)
    other = epmoe.EPMoE(E, K, H, I, params_dtype=torch.float32, device=dev, experts="torch")
    other.load_experts(w13, w2)
    rr = ExpertPlacement.round_robin(E, world)
    with pytest.raises(RuntimeError, match="the EP ranks are in different layers"):
        rebalance_layer(layer if rank == 0 else other, rr)
    assert layer.placement == ExpertPlacement.linear(E, world)
    x, logits = rank_tokens(rank, 5, H, E, torch.float32, dev)
    assert_close(
        layer(x, logits), epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, K))
    )


def _window_balancedness(layers, group=None) -> list[float]:
    """Measured balancedness of each layer's recorded window, summed over the ranks."""
    out = []
    for layer in layers:
        load = layer.load_recorder.global_load(group)
        out.append(measured_balancedness(layer.placement, load))
    return out


def check_manager(rank, world, device="cpu", dtype_name="float32"):
    """The manager end to end under skewed routing (Zipf 1.2; three hot experts): two
    layers (Standard and ExpertBatched) on linear placements, re-planned with redundant
    slots after a window, then measured again on fresh steps: balancedness improves,
    outputs equal the oracle, and a migration-aware re-plan with a loose tolerance moves
    nothing."""
    dtype = getattr(torch, dtype_name)
    dev = device_for(rank, device)
    E, K, T, window = 16, 2, 64, 3
    R = redundant_slots(E, world, at_least=E // 8)
    layouts = ["standard", "expert_batched"]
    layers = [
        epmoe.EPMoE(
            E,
            K,
            H,
            I,
            backend="all_to_all",
            layout=lay,
            experts="torch",
            params_dtype=dtype,
            device=dev,
            max_num_tokens=T,
            load_window=window,
        )
        for lay in layouts
    ]
    weights = [full_weights(E, H, I, dtype, dev, seed=20 + i) for i in range(len(layers))]
    for layer, (w13, w2) in zip(layers, weights):
        layer.load_experts(w13, w2)
    # hot experts at low ids, so that linear placement puts them on rank 0 (skewed)
    sims = [
        RoutingSimulator(E, K, "zipf", alpha=1.2),
        RoutingSimulator(E, K, "hot", num_hot=3, hot_fraction=0.6),
    ]
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank)).to(dev, dtype)
    manager = EPLBManager(layers, num_redundant=R, rebalance_interval=window)

    def serve(first_step: int, count_steps: bool) -> list:
        reports = []
        for s in range(first_step, first_step + window):
            for layer, sim in zip(layers, sims):
                layer(x, sim.router_logits(T, step=1000 * rank + s, device=dev))
            reports.append(manager.step() if count_steps else None)
        return reports

    reports = serve(0, count_steps=True)
    before = [r.measured_before for r in reports[-1].layers]
    # fresh steps on the new placements (the recorders were reset), without re-planning
    serve(window, count_steps=False)
    after = _window_balancedness(layers)
    report = reports[-1]
    # a second re-plan from the fresh window: within a loose tolerance nothing moves
    keep = EPLBManager(layers, num_redundant=R, rebalance_interval=1, tolerance=0.25)
    kept = keep.rebalance()
    outs = []
    for layer, (w13, w2), sim in zip(layers, weights, sims):
        logits = sim.router_logits(T, step=99 + rank, device=dev)
        outs.append(
            (layer(x, logits), epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, K)))
        )

    assert reports[:-1] == [None] * (window - 1), "step() re-planned before the interval"
    assert report is not None and report.step == window, report
    for i, row in enumerate(report.layers):
        assert row.planned and row.changed, f"layer {i} was not re-placed: {row}"
        assert row.tokens == world * T * K * window, (row.tokens, world * T * K * window)
        assert row.expected_after > row.expected_before, row
    for i, layer in enumerate(layers):
        assert layer.placement.num_physical == E + R, layer.placement
        assert after[i] > before[i] + 0.05, (
            f"layer {i}: measured balancedness {before[i]:.3f} before, {after[i]:.3f} after"
        )
    assert all(not row.changed for row in kept.layers), kept.summary()
    assert kept.bytes_received == 0 and kept.slots_moved == 0, kept.summary()
    for i, (out, ref) in enumerate(outs):
        assert_close(out, ref, TOLERANCES[dtype], name=f"layer {i} after the re-plan")
    return before, after


def check_manager_agreement(rank, world, device="cpu"):
    """Managers that differ between ranks raise on every rank at the re-plan, naming the
    difference: other layers, another tolerance, and another ``rebalance_interval`` (rank
    1 re-plans a step later: the others meet it with a layer's forward, which names both).
    Then a layer idle in the first window (its placement stays linear) does not stop the
    others from being re-planned from where they are: the busy layer moves as many slots
    at its second re-plan as when both layers were busy."""
    import pytest

    dev = device_for(rank, device)
    E, K = 16, 2

    def build(n):
        layers = [
            epmoe.EPMoE(
                E, K, H, I, params_dtype=torch.float32, device=dev, experts="torch", load_window=8
            )  # fmt: skip
            for _ in range(n)
        ]
        w13, w2 = full_weights(E, H, I, torch.float32, dev)
        for layer in layers:
            layer.load_experts(w13, w2)
        return layers

    def tokens(step):
        g = torch.Generator().manual_seed(7 + step)  # the same on every rank
        x, logits = torch.randn(32, H, generator=g), torch.randn(32, E, generator=g)
        logits[:, 0] += 2 + step  # one hot expert, getting hotter
        return x.to(dev), logits.to(dev)

    layers = build(2)
    for kwargs, want in [
        (dict(layers=layers[: 1 + (rank == 0)]), "layers differs"),
        (dict(tolerance=0.1 * rank), "tolerance differs"),
    ]:
        manager = EPLBManager(kwargs.pop("layers", layers), num_redundant=world, **kwargs)
        with pytest.raises(ValueError, match=f"EPLBManager.rebalance .* disagree; {want}"):
            manager.rebalance()
    manager = EPLBManager(layers, num_redundant=world, rebalance_interval=1 + (rank == 1))
    x, logits = tokens(0)
    for layer in layers:
        layer(x, logits)
    with pytest.raises(RuntimeError, match="in different EPMoE calls: .*EPLB re-plan 0"):
        if manager.step() is None:  # (rank 1: not yet, its next forward meets the re-plan)
            layers[0](x, logits)

    moved = []
    for idle in (False, True):
        layers = build(2)
        manager = EPLBManager(layers, num_redundant=world, rebalance_interval=2)
        moves = []
        for step in range(4):
            x, logits = tokens(step)
            layers[0](x, logits)
            quiet = idle and step < 2
            layers[1](x[:0] if quiet else x, logits[:0] if quiet else logits)
            report = manager.step()
            if report is not None:
                moves.append(report.layers[0].migration.slots_moved)
        moved.append(moves)
    assert moved[0] == moved[1], f"busy layer's moves, both busy / one idle: {moved}"


def check_failed_rebind_after_in_place_migration(rank, world, device="cpu"):
    """A rebalance whose backend rebind fails (e.g. out of memory for larger buffers) after
    rank 0's slots were migrated in place (its slot count stays, the others' change): the
    layer keeps its old placement, so rank 0's weights count as not loaded and the next
    forward raises on every rank, naming it, instead of serving experts in the wrong
    slots. Loading the weights again brings the layer back."""
    import pytest

    dev = device_for(rank, device)
    E, K = 8, 2
    layer = epmoe.EPMoE(E, K, H, I, params_dtype=torch.float32, device=dev, experts="torch")
    w13, w2 = full_weights(E, H, I, torch.float32, dev)
    layer.load_experts(w13, w2)
    old = layer.placement
    offsets = (0, 3, *[3 + (E - 3) * (r + 1) // (world - 1) for r in range(world - 1)])
    new = ExpertPlacement(E, world, torch.arange(E).roll(1), offsets)
    assert new.num_local(0) == old.num_local(0) and new.rank_offsets != old.rank_offsets

    def refuse(rank_offsets):
        raise MemoryError("simulated: no memory for the rebound buffers")

    layer._rebind_comm = refuse
    with pytest.raises(MemoryError, match="simulated"):
        layer.rebalance(new)
    del layer._rebind_comm
    assert layer.placement == old
    assert layer.weights_loaded == (rank != 0)
    x, logits = rank_tokens(rank, 5, H, E, torch.float32, dev)
    own = "not loaded" if rank == 0 else "rank 0 rejected"
    with pytest.raises((ValueError, RuntimeError), match=own):
        layer(x, logits)
    layer.load_experts(w13, w2)
    assert_close(
        layer(x, logits), epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, K))
    )
