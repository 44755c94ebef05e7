"""ExpertPlacement: constructors, derived maps, replica choice, load metrics, value semantics."""

from __future__ import annotations

import pickle

import pytest
import torch

import epmoe
from epmoe.placement import ExpertPlacement

# (E, W) shapes with a name each: even and uneven splits, E == W, primes, one rank.
SHAPES = [
    pytest.param(8, 2, id="E8-W2"),
    pytest.param(10, 4, id="E%W!=0"),
    pytest.param(7, 7, id="E==W"),
    pytest.param(13, 5, id="prime-E-and-W"),
    pytest.param(256, 64, id="E256-W64"),
    pytest.param(9, 1, id="one-rank"),
]


def _rank_of_slot(p: ExpertPlacement, slot: int) -> int:
    return next(r for r in range(p.ep_size) if p.rank_offsets[r] <= slot < p.rank_offsets[r + 1])


def check_invariants(p: ExpertPlacement) -> None:
    """Every derived map against a plain-Python recomputation from physical_to_logical."""
    E, W, P = p.num_experts, p.ep_size, p.num_physical
    p2l = p.physical_to_logical.tolist()
    assert p.physical_to_logical.dtype == torch.int64
    assert len(p.rank_offsets) == W + 1 and p.rank_offsets[0] == 0 and p.rank_offsets[-1] == P
    assert sum(p.num_local(r) for r in range(W)) == P
    assert all(p.num_local(r) >= 1 for r in range(W))
    assert p.owner_rank.tolist() == [_rank_of_slot(p, s) for s in range(P)]
    for e in range(E):
        replicas = [s for s in range(P) if p2l[s] == e]
        assert replicas, f"expert {e} has no replica"
        assert p.replica_count[e].item() == len(replicas)
        row = p.logical_to_physical[e].tolist()
        assert row[: len(replicas)] == replicas  # increasing physical id
        assert all(x == -1 for x in row[len(replicas) :])
    assert p.logical_to_physical.shape == (E, int(p.replica_count.max()))
    for r in range(W):
        a, b = p.rank_offsets[r], p.rank_offsets[r + 1]
        assert p.local_experts(r) == p2l[a:b]
        expected_map = [-1] * E
        for slot in range(b - a - 1, -1, -1):  # the first slot wins
            expected_map[p2l[a + slot]] = slot
        assert p.expert_map(r).tolist() == expected_map


# ------------------------------------------------------------------------ constructors


@pytest.mark.parametrize(("E", "W"), SHAPES)
def test_linear_matches_definition(E: int, W: int) -> None:
    p = ExpertPlacement.linear(E, W)
    check_invariants(p)
    start = 0
    for r in range(W):
        n = E // W + (1 if r < E % W else 0)  # remainder to the first ranks
        assert p.local_experts(r) == list(range(start, start + n))
        start += n
    assert p.max_replicas == 1


@pytest.mark.parametrize(("E", "W"), SHAPES)
def test_round_robin_matches_definition(E: int, W: int) -> None:
    p = ExpertPlacement.round_robin(E, W)
    check_invariants(p)
    for r in range(W):
        assert p.local_experts(r) == list(range(r, E, W))


@pytest.mark.parametrize("ctor", ["linear", "round_robin"])
def test_fewer_experts_than_ranks_is_an_error(ctor: str) -> None:
    with pytest.raises(ValueError, match="at least one") as info:
        getattr(ExpertPlacement, ctor)(4, 8)
    assert "num_redundant=4" in str(info.value)  # the fix: replicate onto every rank


@pytest.mark.parametrize(
    ("E", "W", "R"),
    [
        pytest.param(16, 4, 0, id="no-redundant"),
        pytest.param(16, 4, 4, id="R=W"),
        pytest.param(12, 8, 4, id="few-experts-per-rank"),
        pytest.param(4, 8, 4, id="E<W-with-replicas"),
        pytest.param(64, 8, 8, id="E64-W8"),
    ],
)
def test_balanced_invariants_and_equal_slots(E: int, W: int, R: int) -> None:
    load = torch.rand(E, generator=torch.Generator().manual_seed(E + W + R)) * 1000 + 1
    p = ExpertPlacement.balanced(load, W, num_redundant=R)
    check_invariants(p)
    assert p.num_physical == E + R
    assert {p.num_local(r) for r in range(W)} == {(E + R) // W}


def test_balanced_beats_linear_on_skewed_load() -> None:
    E, W = 64, 8
    load = torch.arange(1, E + 1, dtype=torch.float64).pow(-1.0) * 1e5  # hot experts first
    lin = ExpertPlacement.linear(E, W)
    bal = ExpertPlacement.balanced(load, W, num_redundant=8)
    assert lin.balancedness(load) < 0.5
    assert bal.balancedness(load) > 0.95


@pytest.mark.parametrize(
    ("E", "W", "R", "suggest"),
    [
        pytest.param(16, 6, 0, "num_redundant=2", id="E%W"),
        pytest.param(16, 4, 3, "num_redundant=0 or num_redundant=4", id="E+R%W"),
    ],
)
def test_balanced_rejects_uneven_slots_and_says_what_works(E, W, R, suggest) -> None:
    with pytest.raises(ValueError, match="multiple of") as info:
        ExpertPlacement.balanced(torch.ones(E), W, num_redundant=R)
    assert suggest in str(info.value)


def test_balanced_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="expert_load must be"):
        ExpertPlacement.balanced(torch.ones(2, 8), 2)
    with pytest.raises(ValueError, match="num_redundant"):
        ExpertPlacement.balanced(torch.ones(8), 2, num_redundant=-2)
    with pytest.raises(ValueError, match="num_nodes"):
        ExpertPlacement.balanced(torch.ones(8), 4, num_nodes=3)
    cur = ExpertPlacement.linear(8, 2)
    with pytest.raises(ValueError, match="current"):
        ExpertPlacement.balanced(torch.ones(8), 2, num_redundant=2, current=cur)
    # the same P over other slot counts per rank: the planner would misread it (and a
    # "kept" plan would move experts), so it is refused with the fix
    uneven = ExpertPlacement(8, 4, torch.arange(8), (0, 1, 3, 5, 8))
    with pytest.raises(ValueError, match=r"rank_offsets \(0, 1, 3, 5, 8\).*current=None"):
        ExpertPlacement.balanced(torch.ones(8), 4, current=uneven, tolerance=1.0)


def test_balanced_with_current_keeps_it_within_tolerance() -> None:
    g = torch.Generator().manual_seed(3)
    load = torch.rand(32, generator=g) * 100
    cur = ExpertPlacement.balanced(load, 4, num_redundant=4)
    drifted = load * (0.8 + 0.4 * torch.rand(32, generator=g))
    kept = ExpertPlacement.balanced(drifted, 4, num_redundant=4, current=cur, tolerance=1.0)
    assert kept == cur
    fresh = ExpertPlacement.balanced(drifted, 4, num_redundant=4, current=cur)
    assert fresh.balancedness(drifted) >= cur.balancedness(drifted) - 1e-12
    check_invariants(fresh)


def test_balanced_layers_matches_single_layer_calls() -> None:
    g = torch.Generator().manual_seed(5)
    load = torch.rand(3, 24, generator=g) * 100
    many = ExpertPlacement.balanced_layers(load, 4, num_redundant=4)
    assert many == [ExpertPlacement.balanced(row, 4, num_redundant=4) for row in load]


def test_from_physical_to_logical_round_trip_and_defaults() -> None:
    p = ExpertPlacement.round_robin(10, 4)
    q = ExpertPlacement.from_physical_to_logical(
        p.physical_to_logical, 4, rank_offsets=p.rank_offsets
    )
    assert q == p
    r = ExpertPlacement.from_physical_to_logical([3, 0, 1, 2, 0, 3], 3)
    assert r.num_experts == 4 and r.rank_offsets == (0, 2, 4, 6)
    check_invariants(r)
    with pytest.raises(ValueError, match="rank_offsets"):
        ExpertPlacement.from_physical_to_logical([0, 1, 2], 2)


@pytest.mark.parametrize(
    ("p2l", "offsets", "match"),
    [
        pytest.param([0, 1, 1, 3], (0, 2, 4), "experts \\[2\\]", id="missing-expert"),
        pytest.param([0, 1, 4, 2], (0, 2, 4), "physical_to_logical\\[2\\] = 4", id="id>=E"),
        pytest.param([0, -1, 2, 3], (0, 2, 4), "physical_to_logical\\[1\\] = -1", id="negative"),
        pytest.param([0, 1, 2, 3], (0, 2, 3), "entries from 0 to P", id="offsets-end"),
        pytest.param([0, 1, 2, 3], (0, 2), "ep_size \\+ 1", id="offsets-length"),
        pytest.param([0, 1, 2, 3], (0, 0, 4), "at least one", id="empty-rank"),
        pytest.param([[0, 1], [2, 3]], (0, 2, 4), "1-D", id="2-D-map"),
    ],
)
def test_validation_errors(p2l, offsets, match) -> None:
    with pytest.raises(ValueError, match=match):
        ExpertPlacement(4, 2, torch.tensor(p2l), offsets)


def test_type_errors() -> None:
    with pytest.raises(TypeError, match="integer ids"):
        ExpertPlacement(4, 2, torch.tensor([0.0, 1.0, 2.0, 3.0]), (0, 2, 4))
    with pytest.raises(TypeError, match="sequence of ints"):
        ExpertPlacement(4, 2, torch.arange(4), None)
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        ExpertPlacement(True, 2, torch.arange(4), (0, 2, 4))


def test_inputs_are_copied_and_normalized() -> None:
    p2l = torch.tensor([1, 0, 2, 3], dtype=torch.int32)
    p = ExpertPlacement(4, 2, p2l, [0, 2, 4])
    p2l[0] = 3  # the caller's tensor does not alias the placement's
    assert p.physical_to_logical.tolist() == [1, 0, 2, 3]
    assert p.physical_to_logical.dtype == torch.int64
    assert p.rank_offsets == (0, 2, 4)


# ------------------------------------------------------------------------ replica choice


def _replicated() -> ExpertPlacement:
    """E=6 on W=3, 9 slots: expert 0 has 3 replicas (on ranks 0, 1, 2), expert 1 has 2
    (both on rank 1), the rest 1."""
    p2l = torch.tensor([0, 2, 3, 0, 1, 1, 4, 0, 5])
    return ExpertPlacement(6, 3, p2l, (0, 3, 6, 9))


def test_to_physical_without_replicas_is_the_plain_map() -> None:
    p = ExpertPlacement.round_robin(10, 4)
    ids = torch.randint(0, 10, (37, 3), generator=torch.Generator().manual_seed(0))
    phys = p.to_physical(ids, rank=2)
    assert torch.equal(phys, p.logical_to_physical[:, 0][ids])


@pytest.mark.parametrize("rank", [0, 1, 2])
@pytest.mark.parametrize("prefer_local", [False, True], ids=["any", "prefer-local"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_to_physical_maps_to_a_replica_of_the_same_expert(rank, prefer_local, dtype) -> None:
    p = _replicated()
    ids = torch.randint(0, 6, (50, 4), generator=torch.Generator().manual_seed(rank)).to(dtype)
    ids[3, 1] = -1
    ids[7, :] = -1
    phys = p.to_physical(ids, rank=rank, prefer_local=prefer_local)
    assert phys.dtype == dtype and phys.shape == ids.shape
    valid = ids >= 0
    assert (phys[~valid] == -1).all()
    assert torch.equal(p.physical_to_logical[phys[valid].long()], ids[valid].long())
    assert torch.equal(phys, p.to_physical(ids, rank=rank, prefer_local=prefer_local))


@pytest.mark.parametrize(
    ("k_pos", "K"),
    [
        pytest.param(0, 1, id="K1"),
        pytest.param(0, 6, id="count-divides-K-first-position"),
        pytest.param(4, 6, id="count-divides-K-later-position"),
    ],
)
def test_to_physical_splits_an_expert_evenly_over_replicas(k_pos: int, K: int) -> None:
    """Expert 0 (3 replicas) chosen at the same position by every token: its picks must
    split within one of even, also when the replica count divides K (where a flat-index
    rule would send every pick to one replica)."""
    p = _replicated()
    T = 100
    ids = torch.full((T, K), 4)
    others = [x for x in range(1, 6) if x != 4]
    for k in range(K):
        ids[:, k] = others[k % len(others)] if k != k_pos else 0
    ids[:, k_pos] = 0
    for rank in range(3):
        phys = p.to_physical(ids, rank=rank)[:, k_pos]
        counts = torch.bincount(phys, minlength=9)[[0, 3, 7]]
        assert counts.sum() == T and counts.max() - counts.min() <= 1, counts


def test_to_physical_spreads_decode_tokens_over_ranks() -> None:
    """One token per rank (decode): the rank term sends each rank to another replica."""
    p = _replicated()
    ids = torch.zeros(1, 1, dtype=torch.int64)
    picks = [int(p.to_physical(ids, rank=r)) for r in range(3)]
    assert sorted(picks) == [0, 3, 7]


def test_to_physical_follows_the_documented_replica_rule() -> None:
    """Entry (t, k) on rank r takes replica (t + k + r) mod count of its expert: the rule
    the fused CUDA routing kernel implements too, so both paths must pick alike."""
    p = _replicated()
    replicas = {0: [0, 3, 7], 1: [4, 5]}  # read off _replicated's map by hand
    ids = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1]])
    for rank in range(3):
        phys = p.to_physical(ids, rank=rank).tolist()
        want = [
            [replicas[x][(t + k + rank) % len(replicas[x])] for k, x in enumerate(row)]
            for t, row in enumerate(ids.tolist())
        ]
        assert phys == want, (rank, phys, want)


def test_prefer_local_uses_the_local_replica() -> None:
    p = _replicated()
    ids = torch.arange(6).repeat(5, 1)  # every expert, five tokens
    for rank in range(3):
        local_map = p.expert_map(rank)
        phys = p.to_physical(ids, rank=rank, prefer_local=True)
        plain = p.to_physical(ids, rank=rank)
        for e in range(6):
            if local_map[e] >= 0:  # a local replica exists: always that one (the first)
                assert (phys[:, e] == p.rank_offsets[rank] + local_map[e]).all()
            else:
                assert torch.equal(phys[:, e], plain[:, e])


def test_maps_on_is_cached_per_device() -> None:
    p = _replicated()
    m = p.maps_on("cpu")
    assert p.maps_on(torch.device("cpu")) is m
    assert m.local_physical.shape == (3, 6)
    assert m.local_physical[1].tolist() == [3, 4, -1, -1, -1, -1]


def test_to_physical_rejects_bad_input() -> None:
    p = _replicated()
    with pytest.raises(ValueError, match="\\[T, K\\]"):
        p.to_physical(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(TypeError, match="int32 or int64"):
        p.to_physical(torch.zeros(4, 2))
    with pytest.raises(ValueError, match="rank"):
        p.to_physical(torch.zeros(4, 2, dtype=torch.int64), rank=3)


def test_ranks_and_offsets_are_ints_never_truncated_or_read_from_bools() -> None:
    """``rank_offsets`` took floats (truncated: 1.9 read as 1), strings (``"024"`` read
    digit by digit) and float tensors; a rank of ``True`` was rank 1 and a NumPy rank was
    refused while the constructors take NumPy ints."""
    import numpy as np

    E, W = 4, 2
    for bad in ((0, 1.9, 4), "024", torch.tensor([0.0, 2.5, 4.0]), (False, True, 4)):
        with pytest.raises(TypeError, match="rank_offsets must"):
            epmoe.ExpertPlacement(E, W, torch.arange(E), bad)
    good = epmoe.ExpertPlacement(E, W, torch.arange(E), np.array([0, 1, 4]))
    assert good.rank_offsets == (0, 1, 4) and all(type(o) is int for o in good.rank_offsets)
    p = epmoe.ExpertPlacement.linear(E, W)
    for bad_rank in (True, np.bool_(True), torch.tensor(True), 1.0, "1"):
        with pytest.raises(ValueError, match="rank must be an int in \\[0, ep_size=2\\)"):
            p.local_experts(bad_rank)
    assert p.local_experts(np.int64(1)) == p.local_experts(1) == [2, 3]
    assert p.expert_map(torch.tensor(0)).tolist() == p.expert_map(0).tolist()
    with pytest.raises(ValueError, match="ep_size must be a positive int"):
        epmoe.ExpertPlacement.linear(E, torch.tensor(True))
    with pytest.raises(ValueError, match="one row per layer"):
        epmoe.ExpertPlacement.balanced_layers(torch.ones(0, E), W)


def test_to_physical_with_zero_tokens() -> None:
    p = _replicated()
    out = p.to_physical(torch.empty(0, 8, dtype=torch.int64), rank=1, prefer_local=True)
    assert out.shape == (0, 8)


@pytest.mark.gpu
def test_to_physical_on_cuda_matches_cpu() -> None:
    p = _replicated()
    ids = torch.randint(-1, 6, (333, 8), generator=torch.Generator().manual_seed(1))
    for prefer_local in (False, True):
        cpu = p.to_physical(ids, rank=2, prefer_local=prefer_local)
        gpu = p.to_physical(ids.cuda(), rank=2, prefer_local=prefer_local)
        assert gpu.device.type == "cuda"
        assert torch.equal(gpu.cpu(), cpu)


# ------------------------------------------------------------------------ load metrics


def test_rank_load_and_balancedness_against_a_loop() -> None:
    p = _replicated()
    load = torch.tensor([30.0, 10.0, 5.0, 7.0, 2.0, 11.0])
    expected = [0.0] * 3
    for slot, e in enumerate(p.physical_to_logical.tolist()):
        expected[_rank_of_slot(p, slot)] += load[e].item() / p.replica_count[e].item()
    assert p.rank_load(load).tolist() == pytest.approx(expected)
    assert p.balancedness(load) == pytest.approx(sum(expected) / 3 / max(expected))
    assert p.balancedness(torch.zeros(6)) == 1.0
    with pytest.raises(ValueError, match="expert_load must be"):
        p.rank_load(torch.ones(5))


def test_moved_slots() -> None:
    a = ExpertPlacement.from_physical_to_logical([0, 1, 2, 3, 1, 0], 3)
    b = ExpertPlacement.from_physical_to_logical([0, 1, 3, 2, 1, 2], 3)
    assert a.moved_slots(b).tolist() == [False, False, True, True, False, True]
    assert not a.moved_slots(a).any()
    with pytest.raises(ValueError, match="same slots"):
        a.moved_slots(ExpertPlacement.linear(4, 2))
    # the same P, but the slots belong to other ranks: not comparable slot by slot
    uneven = ExpertPlacement(4, 3, torch.tensor([0, 1, 2, 3, 1, 0]), (0, 1, 3, 6))
    with pytest.raises(ValueError, match="same slots"):
        a.moved_slots(uneven)


# ------------------------------------------------------------------------ value semantics


def test_equality_hash_pickle_and_repr() -> None:
    a = ExpertPlacement.linear(8, 2)
    b = ExpertPlacement.linear(8, 2)
    c = ExpertPlacement.round_robin(8, 2)
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert len({a, b, c}) == 2
    a.maps_on("cpu")  # the cache must not travel or matter
    d = pickle.loads(pickle.dumps(a))
    assert d == a and d._maps == {}
    assert "num_experts=8" in repr(a) and "ep_size=2" in repr(a)
    with pytest.raises(AttributeError):
        a.num_experts = 9  # frozen


def test_placements_with_other_rank_offsets_are_not_equal() -> None:
    """Equal maps over other rank boundaries put experts on other ranks: not equal (and
    equal placements must hash alike, so a set or dict of them stays consistent)."""
    p2l = torch.tensor([0, 1, 2, 3, 4, 5])
    even = ExpertPlacement(6, 2, p2l, (0, 3, 6))
    uneven = ExpertPlacement(6, 2, p2l, (0, 2, 6))
    assert even != uneven
    assert len({even, uneven}) == 2
    assert even == ExpertPlacement(6, 2, p2l.clone(), (0, 3, 6))


@pytest.mark.parametrize("context", ["meta", "cpu"])
def test_placements_and_plans_stay_on_the_host_under_a_default_device_context(context) -> None:
    """Placements and plans are host tables: a caller's ``with torch.device("meta")`` (or
    ``set_default_device``) around model construction must not move them."""
    from epmoe.eplb import algorithm

    load = torch.arange(1, 9, dtype=torch.float64) ** 2
    want = ExpertPlacement.balanced(load, ep_size=2, num_redundant=2)
    with torch.device(context):
        p2l = [0, 1, 2, 3, 4, 5, 6, 7]
        made = [
            ExpertPlacement.linear(8, 2),
            ExpertPlacement.round_robin(8, 3),
            ExpertPlacement(8, 2, p2l, (0, 3, 8)),
            ExpertPlacement.balanced(load, ep_size=2, num_redundant=2),
        ]
        assert made[3] == want
        maps = made[0].maps_on("cpu")
        expert_map, rank_load = made[1].expert_map(1), made[2].rank_load(load)
        phy2log, _, logcnt = algorithm.rebalance(load[None], 10, 1, 1, 2)
    for p in made:
        check_invariants(p)
        assert p.physical_to_logical.device.type == "cpu"
    assert maps.logical_to_physical.device.type == "cpu"
    assert expert_map.tolist() == [-1, 0, -1, -1, 1, -1, -1, 2]
    assert rank_load.tolist() == [float(load[:3].sum()), float(load[3:].sum())]
    assert phy2log.device.type == logcnt.device.type == "cpu"
    assert phy2log[0].tolist() == want.physical_to_logical.tolist()
