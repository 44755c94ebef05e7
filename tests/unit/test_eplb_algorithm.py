"""The EPLB re-plan: DeepSeek's golden example, invariants, policies, migration, speed."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

import epmoe
from epmoe.eplb.algorithm import (
    _keep_slots,
    balanced_packing,
    balancedness,
    gpu_loads,
    logical_to_physical,
    rebalance,
    replicate_experts,
)

# deepseek-ai/EPLB README (also vLLM tests/distributed/test_eplb_algo.py).
GOLDEN_WEIGHT = torch.tensor(
    [
        [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
    ]
)
GOLDEN_LOGCNT = [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1], [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]
# The phy2log DeepSeek's implementation prints for it (their README).
DEEPSEEK_PHY2LOG = torch.tensor(
    [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
)


def _loop_gpu_loads(weight: torch.Tensor, phy2log: torch.Tensor, W: int) -> list[list[float]]:
    out = []
    for w, row in zip(weight.tolist(), phy2log.tolist()):
        cnt = [row.count(e) for e in range(len(w))]
        c = len(row) // W
        out.append([sum(w[e] / cnt[e] for e in row[g * c : (g + 1) * c]) for g in range(W)])
    return out


def check_plan(weight, phy2log, log2phy, logcnt, P: int, W: int) -> None:
    """Shapes, replica counts and both maps against plain-Python recomputation."""
    L, E = weight.shape
    assert phy2log.shape == (L, P) and phy2log.dtype == torch.int64
    assert logcnt.shape == (L, E) and (logcnt >= 1).all() and (logcnt.sum(1) == P).all()
    for layer in range(L):
        row = phy2log[layer].tolist()
        for e in range(E):
            replicas = [s for s in range(P) if row[s] == e]
            assert logcnt[layer, e] == len(replicas)
            got = log2phy[layer, e].tolist()
            assert got[: len(replicas)] == replicas and all(x == -1 for x in got[len(replicas) :])
    assert log2phy.shape[2] == int(logcnt.max())


# ------------------------------------------------------------------------ golden example


def test_golden_example_replica_counts_and_balance() -> None:
    phy2log, log2phy, logcnt = rebalance(GOLDEN_WEIGHT, 16, 4, 2, 8)
    assert logcnt.tolist() == GOLDEN_LOGCNT
    check_plan(GOLDEN_WEIGHT, phy2log, log2phy, logcnt, 16, 8)
    ours = balancedness(GOLDEN_WEIGHT, phy2log, 8)
    theirs = torch.tensor(
        [
            sum(x) / len(x) / max(x)
            for x in _loop_gpu_loads(GOLDEN_WEIGHT.double(), DEEPSEEK_PHY2LOG, 8)
        ],
        dtype=torch.float64,
    )
    assert theirs.tolist() == pytest.approx([0.8277, 0.8050], abs=1e-4)
    assert (ours >= theirs - 1e-12).all(), (ours, theirs)


def test_golden_example_keeps_groups_on_nodes() -> None:
    phy2log, _, _ = rebalance(GOLDEN_WEIGHT, 16, 4, 2, 8)
    node_of_slot = torch.arange(16) // 8
    for row in phy2log:
        group_nodes = {}
        for slot, e in enumerate(row.tolist()):
            group_nodes.setdefault(e // 3, set()).add(int(node_of_slot[slot]))
        assert all(len(nodes) == 1 for nodes in group_nodes.values())


# ------------------------------------------------------------------------ invariants


CONFIGS = [
    # (L, E, P, G, N, W)
    pytest.param(3, 16, 16, 1, 1, 4, id="no-redundant"),
    pytest.param(3, 16, 24, 1, 1, 8, id="global"),
    pytest.param(2, 32, 48, 8, 2, 8, id="hierarchical"),
    pytest.param(2, 32, 40, 4, 4, 4, id="one-gpu-per-node"),
    pytest.param(2, 24, 32, 3, 2, 4, id="G%N!=0-global-fallback"),
    pytest.param(2, 12, 16, 4, 1, 1, id="one-gpu"),
    pytest.param(1, 4, 8, 1, 1, 8, id="E<W"),
]


@pytest.mark.parametrize(("L", "E", "P", "G", "N", "W"), CONFIGS)
def test_plan_invariants(L, E, P, G, N, W) -> None:
    weight = torch.rand(L, E, generator=torch.Generator().manual_seed(E * P + W)) * 100
    phy2log, log2phy, logcnt = rebalance(weight, P, G, N, W)
    check_plan(weight, phy2log, log2phy, logcnt, P, W)
    loads = gpu_loads(weight, phy2log, W)
    assert loads.tolist() == [pytest.approx(x) for x in _loop_gpu_loads(weight, phy2log, W)]
    assert loads.sum(1).tolist() == pytest.approx(weight.sum(1).tolist())


def test_hierarchical_keeps_every_group_on_one_node() -> None:
    L, E, P, G, N, W = 4, 64, 80, 8, 4, 16
    weight = torch.rand(L, E, generator=torch.Generator().manual_seed(0)).pow(4) * 1000
    phy2log, _, _ = rebalance(weight, P, G, N, W)
    per_node = P // N
    for row in phy2log:
        nodes_of_group = [set() for _ in range(G)]
        for slot, e in enumerate(row.tolist()):
            nodes_of_group[e // (E // G)].add(slot // per_node)
        assert all(len(s) == 1 for s in nodes_of_group)
        # and each node holds G / N whole groups
        groups_per_node = [0] * N
        for s in nodes_of_group:
            groups_per_node[next(iter(s))] += 1
        assert groups_per_node == [G // N] * N


def _groups_nodes(phy2log_P, E, G, N):
    nodes = [set() for _ in range(G)]
    for slot, e in enumerate(phy2log_P.tolist()):
        nodes[e // (E // G)].add(slot // (len(phy2log_P) // N))
    return nodes


def test_a_current_plan_off_the_hierarchy_is_not_kept() -> None:
    """A migration-aware hierarchical re-plan from a placement made otherwise (global, or
    round-robin) kept it whenever it was as balanced, groups spread over nodes; it now
    competes only where it keeps each group on one node."""
    from types import SimpleNamespace

    from epmoe.eplb.manager import EPLBManager

    L, E, P, G, N, W = 3, 16, 16, 2, 2, 4
    weight = torch.ones(L, E)
    spread = torch.arange(E).view(E // W, W).t().reshape(1, P).repeat(L, 1)  # round robin
    assert not any(len(n) == 1 for n in _groups_nodes(spread[0], E, G, N))
    for tolerance in (0.0, 0.5):
        phy2log, _, _ = rebalance(weight, P, G, N, W, current_phy2log=spread, tolerance=tolerance)
        for row in phy2log:
            assert all(len(n) == 1 for n in _groups_nodes(row, E, G, N)), row.tolist()
    # a current plan on the hierarchy is kept within tolerance, as before
    kept = rebalance(weight, P, G, N, W)[0]
    again = rebalance(weight * 1.01, P, G, N, W, current_phy2log=kept, tolerance=0.01)[0]
    assert torch.equal(again, kept)
    # the manager's own rule, for a current placement of another slot layout
    manager = SimpleNamespace(num_groups=G, num_nodes=N)
    check = EPLBManager._keeps_groups_on_nodes
    assert not check(manager, epmoe.ExpertPlacement.round_robin(E, W))
    assert check(manager, epmoe.ExpertPlacement.linear(E, W))
    assert check(
        SimpleNamespace(num_groups=1, num_nodes=1), epmoe.ExpertPlacement.round_robin(E, W)
    )


def test_global_fallback_when_groups_do_not_split_over_nodes() -> None:
    weight = torch.rand(2, 24, generator=torch.Generator().manual_seed(1)) * 100
    fallback = rebalance(weight, 32, 3, 2, 4)  # 3 groups cannot split over 2 nodes
    global_ = rebalance(weight, 32, 1, 1, 4)
    for a, b in zip(fallback, global_):
        assert torch.equal(a, b)


def test_two_replicas_of_one_expert_may_share_a_gpu() -> None:
    weight = torch.tensor([[100.0, 1.0]])
    phy2log, _, logcnt = rebalance(weight, 4, 1, 1, 2)
    assert logcnt.tolist() == [[3, 1]]
    gpus = phy2log.view(2, 2).tolist()
    assert [0, 0] in gpus  # three replicas on two GPUs of two slots: two share one


def test_zero_load_layer_is_planned_as_uniform() -> None:
    weight = torch.zeros(1, 8)
    phy2log, _, logcnt = rebalance(weight, 8, 1, 1, 4)
    assert logcnt.tolist() == [[1] * 8]
    assert balancedness(weight, phy2log, 4).tolist() == [1.0]


def test_zero_load_layer_with_redundant_slots_spreads_them_as_uniform_load_would() -> None:
    """Uniform load gives every expert the same number of replicas; zero load read as is
    would give every extra slot to expert 0 (all per-replica loads tie at 0)."""
    zero, uniform = torch.zeros(1, 8), torch.ones(1, 8)
    phy2log, _, logcnt = rebalance(zero, 16, 1, 1, 4)
    assert logcnt.tolist() == [[2] * 8]
    assert torch.equal(phy2log, rebalance(uniform, 16, 1, 1, 4)[0])
    assert balancedness(uniform, phy2log, 4).tolist() == [1.0]


# ------------------------------------------------------------------------ the steps


def test_replication_minimises_the_largest_per_replica_load() -> None:
    """Against brute force over every count vector (each >= 1, summing to P)."""
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        w = torch.rand(1, 4, generator=g).double() * 100
        P = 9
        _, cnt = replicate_experts(w, P)
        assert cnt.sum() == P and (cnt >= 1).all()
        best = min(
            max(w[0, e].item() / c[e] for e in range(4))
            for c in itertools.product(range(1, P - 2), repeat=4)
            if sum(c) == P
        )
        assert (w / cnt).max().item() == pytest.approx(best)


def test_replication_breaks_ties_toward_the_lowest_expert_id() -> None:
    """Equal per-replica loads: each extra replica goes to the lowest id among the tied
    experts (the documented rule; every rank must plan the same map)."""
    phy2log, cnt = replicate_experts(torch.full((1, 4), 6.0, dtype=torch.float64), 7)
    assert phy2log.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert cnt.tolist() == [[2, 2, 2, 1]]


def test_balanced_packing_equal_counts_and_refinement_never_worse() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.rand(20, 24, generator=g, dtype=torch.float64) * 100
    for packs in (2, 3, 6, 8):
        loads = {}
        for refine in (False, True):
            pack, rank = balanced_packing(w, packs, refine=refine)
            cap = 24 // packs
            for b in range(20):
                assert torch.bincount(pack[b], minlength=packs).tolist() == [cap] * packs
                # (pack, rank) is a bijection onto the places
                assert sorted((pack[b] * cap + rank[b]).tolist()) == list(range(24))
            loads[refine] = torch.zeros(20, packs).double().scatter_add_(1, pack, w).max(1).values
        assert (loads[True] <= loads[False] + 1e-9).all()
        assert (loads[True] < loads[False] - 1e-9).sum() >= 10  # greedy alone is often worse


def test_balanced_packing_refinement_reaches_optimum_on_small_cases() -> None:
    """Brute force over all equal-size splits of 8 items into 2 packs."""
    g = torch.Generator().manual_seed(4)
    w = torch.rand(30, 8, generator=g).double() * 100
    pack, _ = balanced_packing(w, 2, refine=True)
    for b in range(30):
        total = w[b].sum().item()
        best = min(
            max(s := sum(w[b, list(c)].tolist()), total - s)
            for c in itertools.combinations(range(8), 4)
        )
        got = torch.zeros(2, dtype=torch.float64).scatter_add_(0, pack[b], w[b]).max().item()
        assert got <= best * 1.10  # swaps reach a local optimum close to the best split


def test_logical_to_physical_counts_missing_experts_as_zero() -> None:
    log2phy, logcnt = logical_to_physical(torch.tensor([[2, 0, 2]]), 4)
    assert logcnt.tolist() == [[1, 0, 2, 0]]
    assert log2phy.tolist() == [[[1, -1], [-1, -1], [0, 2], [-1, -1]]]


# ------------------------------------------------------------------------ migration-aware


def _drifted(weight: torch.Tensor, seed: int, spread: float = 0.3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return weight * (1 - spread + 2 * spread * torch.rand(weight.shape, generator=g))


def _slots_kept_per_gpu(new: torch.Tensor, cur: torch.Tensor, W: int) -> None:
    """On every GPU, each expert present before and after keeps min(count) of its slots."""
    c = new.shape[1] // W
    for n_row, c_row in zip(new.view(-1, c).tolist(), cur.view(-1, c).tolist()):
        same = sum(a == b for a, b in zip(n_row, c_row))
        common = sum(min(n_row.count(e), c_row.count(e)) for e in set(n_row))
        assert same == common, (n_row, c_row)


@pytest.mark.parametrize(
    ("E", "P", "G", "N", "W"),
    [
        pytest.param(32, 40, 1, 1, 8, id="global"),
        pytest.param(32, 48, 4, 2, 8, id="hierarchical"),
    ],
)
def test_migration_aware_replan(E, P, G, N, W) -> None:
    L = 6
    weight = torch.rand(L, E, generator=torch.Generator().manual_seed(5)).pow(3) * 1000
    cur, _, _ = rebalance(weight, P, G, N, W)
    new_weight = _drifted(weight, 6)
    fresh, _, _ = rebalance(new_weight, P, G, N, W)

    # Same load: the current plan is as good as a new one, nothing moves.
    same, _, _ = rebalance(weight, P, G, N, W, current_phy2log=cur)
    assert torch.equal(same, cur)
    # A tolerance of 1 keeps any current plan.
    kept, _, _ = rebalance(new_weight, P, G, N, W, current_phy2log=cur, tolerance=1.0)
    assert torch.equal(kept, cur)

    # Tolerance 0: as balanced as the fresh plan, fewer moved slots, old slots kept.
    plan, log2phy, logcnt = rebalance(new_weight, P, G, N, W, current_phy2log=cur)
    check_plan(new_weight, plan, log2phy, logcnt, P, W)
    b_plan, b_fresh = balancedness(new_weight, plan, W), balancedness(new_weight, fresh, W)
    assert (b_plan >= b_fresh - 1e-9).all()
    assert (plan != cur).sum() < (fresh != cur).sum()
    changed = (plan != cur).any(1)
    _slots_kept_per_gpu(plan[changed], cur[changed], W)

    # A small tolerance trades a little balance for fewer moves.
    loose, _, _ = rebalance(new_weight, P, G, N, W, current_phy2log=cur, tolerance=0.05)
    assert (balancedness(new_weight, loose, W) >= b_fresh - 0.05 - 1e-9).all()
    assert (loose != cur).sum() <= (plan != cur).sum()

    if G > 1:  # hierarchical plans stay hierarchical
        for row in plan:
            nodes = {}
            for slot, e in enumerate(row.tolist()):
                nodes.setdefault(e // (E // G), set()).add(slot // (P // N))
            assert all(len(s) == 1 for s in nodes.values())


def test_keep_slots_respects_multiplicity() -> None:
    cur = torch.tensor([[5, 7, 7, 2], [1, 2, 3, 4]])
    new = torch.tensor([[7, 9, 5, 9], [4, 3, 8, 8]])
    out = _keep_slots(new, cur)
    assert out.tolist() == [[5, 7, 9, 9], [8, 8, 3, 4]]


# ------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        pytest.param(dict(num_replicas=18), ValueError, "use 16, 24", id="P%W"),
        pytest.param(dict(num_replicas=8), ValueError, "at least", id="P<E"),
        pytest.param(dict(num_groups=5), ValueError, "num_groups=5", id="E%G"),
        pytest.param(dict(num_nodes=3), ValueError, "num_nodes=3", id="W%N"),
        pytest.param(dict(num_gpus=0), ValueError, "num_gpus", id="W=0"),
        pytest.param(dict(weight=torch.ones(12)), ValueError, "weight\\[None\\]", id="1-D-weight"),
        pytest.param(dict(weight=-torch.ones(1, 12)), ValueError, "non-negative", id="negative"),
        pytest.param(dict(tolerance=2.0), ValueError, "tolerance", id="tolerance"),
        pytest.param(
            dict(current_phy2log=torch.zeros(1, 16, dtype=torch.int64)),
            ValueError,
            "no replica",
            id="current-missing-expert",
        ),
        pytest.param(
            dict(current_phy2log=torch.zeros(1, 12, dtype=torch.int64)),
            ValueError,
            "\\[L=1, P=16\\]",
            id="current-shape",
        ),
        pytest.param(
            dict(current_phy2log=torch.zeros(1, 16)), TypeError, "integer", id="current-float"
        ),
    ],
)
def test_validation(kwargs, error, match) -> None:
    args = dict(weight=torch.rand(1, 12), num_replicas=16, num_groups=4, num_nodes=2, num_gpus=8)
    args.update(kwargs)
    weight = args.pop("weight")
    with pytest.raises(error, match=match):
        rebalance(weight, **args)


# ------------------------------------------------------------------------ speed


def test_replan_speed_sanity() -> None:
    """61 layers, 256 experts, EP64 (+64 redundant): the goal is <= 10 ms per layer on one
    core; this loose bound only catches a regression to per-item Python loops."""
    g = torch.Generator().manual_seed(7)
    zipf = torch.arange(1, 257, dtype=torch.float64).pow(-1.0)
    weight = torch.stack([zipf[torch.randperm(256, generator=g)] for _ in range(61)]) * 6e4
    rebalance(weight[:2], 320, 1, 1, 64)  # warm up
    t0 = time.perf_counter()
    phy2log, _, _ = rebalance(weight, 320, 1, 1, 64)
    elapsed = time.perf_counter() - t0
    assert elapsed < 61 * 0.010 * 3, f"{elapsed * 1e3:.0f} ms for 61 layers"
    assert (balancedness(weight, phy2log, 64) > 0.95).all()


def test_bad_arguments_are_refused_naming_them() -> None:
    import epmoe
    from epmoe.eplb.recorder import LoadRecorder
    from epmoe.placement import ExpertPlacement

    with pytest.raises(TypeError, match="tolerance must be a float in \\[0, 1\\].*got 'x'"):
        ExpertPlacement.balanced(torch.ones(8), 2, tolerance="x")
    with pytest.raises(ValueError, match="one value per expert \\(E >= 1\\)"):
        ExpertPlacement.balanced(torch.zeros(0), 2)
    with pytest.raises(ValueError, match="physical_to_logical must hold .* got none"):
        ExpertPlacement.from_physical_to_logical([], 2)
    with pytest.raises(ValueError, match="num_physical must be a positive int, got True"):
        LoadRecorder(16, 4, "cpu").reset(True)
    layer = epmoe.EPMoE(8, 2, 16, 8, device="cpu", load_window=2)
    with pytest.raises(TypeError, match="layers must be a list of EPMoE layers, got EPMoE"):
        epmoe.EPLBManager(layer)
    with pytest.raises(TypeError, match="tolerance must be a float"):
        epmoe.EPLBManager([layer], tolerance="x")
