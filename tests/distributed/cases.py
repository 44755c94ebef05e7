"""Rank bodies shared by the distributed tests (CPU gloo and GPU NCCL alike).

Each function runs on every rank inside an initialised process group (see
``tests/harness.py``) and checks its own rank's results against ``epmoe.reference`` with the
full weights on the rank's own tokens.
"""

from __future__ import annotations

import itertools

import torch

import epmoe
from epmoe.comm import create_backend
from epmoe.comm.base import CommSpec, Layout
from epmoe.reference import TOLERANCES, assert_close
from tests.harness import Sweep


def e_top_k(W: int) -> list[tuple[int, int]]:
    """The (E, K) of the oracle sweep at W ranks: the first E not a multiple of W (so
    linear placement is uneven: 7 gives 4 + 3 experts at W = 2, 2, 2, 2, 1 at W = 4) and
    every E at least W + 2 (so every rank holds an expert)."""
    return [(7, 2), (8, 3)] if W <= 4 else [(W + 3, 2), (W + 4, 3)]


def device_for(rank: int, device: str) -> torch.device:
    """A rank's device: its current GPU on CUDA, which the harness set (``cuda:rank``, or the
    GPU it shares under ``EPMOE_TEST_RANKS_PER_GPU``), else the CPU."""
    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def full_weights(E: int, H: int, I: int, dtype, device, seed: int = 0):
    """The same logical weights on every rank (a shared seed); scaled to keep outputs O(1)."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    return w13.to(device, dtype), w2.to(device, dtype)


def rank_tokens(rank: int, T: int, H: int, E: int, dtype, device, seed: int = 0):
    """This rank's own tokens and router logits (a per-rank seed)."""
    g = torch.Generator().manual_seed(1000 * (seed + 1) + rank)
    x = torch.randn(T, H, generator=g).to(device, dtype)
    logits = torch.randn(T, E, generator=g).to(device, torch.float32)
    return x, logits


def redundant_slots(E: int, W: int, at_least: int) -> int:
    """The fewest redundant slots ≥ ``at_least`` that give every rank as many slots."""
    return at_least + (-(E + at_least)) % W


def placements(E: int, W: int):
    """linear, round-robin and balanced-with-redundant placements for (E, W)."""
    load = torch.arange(1, E + 1, dtype=torch.float64) ** 2  # skewed: the last experts are hot
    num_redundant = redundant_slots(E, W, at_least=1)
    yield "linear", epmoe.ExpertPlacement.linear(E, W)
    yield "round_robin", epmoe.ExpertPlacement.round_robin(E, W)
    yield (
        f"balanced+{num_redundant}",
        epmoe.ExpertPlacement.balanced(load, ep_size=W, num_redundant=num_redundant),
    )


def loaded_layer(E, K, H, I, dtype, dev, seed=0, **kwargs):
    """An EPMoE with the shared full weights of ``seed`` loaded; returns it and them."""
    kwargs.setdefault("experts", "torch")
    layer = epmoe.EPMoE(E, K, H, I, params_dtype=dtype, device=dev, **kwargs)
    w13, w2 = full_weights(E, H, I, dtype, dev, seed=seed)
    layer.load_experts(w13, w2)
    return layer, w13, w2


def backends_and_layouts():
    yield "naive", Layout.STANDARD
    yield "all_to_all", Layout.STANDARD
    yield "all_to_all", Layout.EXPERT_BATCHED


def check_layer_against_oracle(rank, world, device="cpu", dtype_name="float32", experts="torch"):
    """Every backend × layout × placement × (E, K) against the oracle, on tokens where rank 1
    has none and the others have uneven counts, in one sweep."""
    dtype = getattr(torch, dtype_name)
    dev = device_for(rank, device)
    H, I = 32, 24
    tokens = [[5, 0, 9, 3][r % 4] for r in range(world)] if world > 1 else [7]
    sweep = Sweep()
    for (E, K), (backend, layout) in itertools.product(e_top_k(world), backends_and_layouts()):
        for pname, placement in placements(E, world):
            with sweep.case(f"W={world} E={E} K={K} {backend} {layout.value} {pname}"):
                layer, w13, w2 = loaded_layer(
                    E, K, H, I, dtype, dev, placement=placement, backend=backend,
                    experts=experts, layout=layout, max_num_tokens=16,
                )  # fmt: skip
                x, logits = rank_tokens(rank, tokens[rank], H, E, dtype, dev)
                out = layer(x, logits)
                w, ids = epmoe.select_experts(logits, K)
                ref = epmoe.reference.moe(x, w13, w2, w, ids)
                assert out.shape == x.shape and out.dtype == dtype
                assert_close(out, ref, TOLERANCES[dtype], name=f"rank {rank}")
    sweep.check()
    return sweep.passed


def check_chunking(rank, world, device="cpu", dtype_name="float32"):
    """T > max_num_tokens: ranks with different chunk counts still agree (zero-token ranks
    included), for both layouts."""
    dtype = getattr(torch, dtype_name)
    dev = device_for(rank, device)
    E, K, H, I = 8, 2, 16, 8
    sweep = Sweep()
    for backend, layout in backends_and_layouts():
        with sweep.case(f"{backend} {layout.value}"):
            layer, w13, w2 = loaded_layer(
                E, K, H, I, dtype, dev, seed=3, backend=backend, layout=layout, max_num_tokens=4
            )
            T = [13, 0, 4, 1][rank % 4]  # 4, 0, 1 and 1 chunks
            x, logits = rank_tokens(rank, T, H, E, dtype, dev, seed=3)
            out = layer(x, logits)
            w, ids = epmoe.select_experts(logits, K)
            assert_close(out, epmoe.reference.moe(x, w13, w2, w, ids), TOLERANCES[dtype])
    sweep.check()


def check_variants(rank, world, device="cpu", dtype_name="float32"):
    """gelu, apply_router_weight_on_input, grouped sigmoid routing with bias and scaling,
    round-robin with prefer_local_replica."""
    dtype = getattr(torch, dtype_name)
    dev = device_for(rank, device)
    E, H, I = 8, 16, 8
    bias = torch.linspace(-0.5, 0.5, E)
    cases = {
        "gelu": (dict(activation="gelu"), 2),
        "weight_on_input": (dict(apply_router_weight_on_input=True), 1),
        "grouped_sigmoid_bias": (
            dict(
                scoring_func="sigmoid",
                num_expert_group=4,
                topk_group=2,
                e_score_correction_bias=bias,
                routed_scaling_factor=2.5,
            ),
            2,
        ),
        "balanced_prefer_local": (
            dict(
                placement=epmoe.ExpertPlacement.balanced(
                    torch.arange(E, dtype=torch.float64) + 1,
                    ep_size=world,
                    num_redundant=redundant_slots(E, world, at_least=world),
                ),
                prefer_local_replica=True,
            ),
            2,
        ),
    }
    sweep = Sweep()
    for name, (kwargs, K) in cases.items():
        for backend, layout in backends_and_layouts():
            with sweep.case(f"{name} {backend} {layout.value}"):
                layer, w13, w2 = loaded_layer(
                    E, K, H, I, dtype, dev, seed=5, backend=backend, layout=layout, **kwargs
                )
                x, logits = rank_tokens(rank, 6 + rank, H, E, dtype, dev, seed=5)
                out = layer(x, logits)
                route = {
                    k: v
                    for k, v in kwargs.items()
                    if k
                    in (
                        "scoring_func",
                        "num_expert_group",
                        "topk_group",
                        "e_score_correction_bias",
                        "routed_scaling_factor",
                    )
                }
                w, ids = epmoe.select_experts(logits, K, **route)
                ref = epmoe.reference.moe(
                    x,
                    w13,
                    w2,
                    w,
                    ids,
                    activation=kwargs.get("activation", "silu"),
                    apply_router_weight_on_input=kwargs.get("apply_router_weight_on_input", False),
                )
                assert_close(out, ref, TOLERANCES[dtype])
    sweep.check()


def check_exact_dispatch(rank, world, device="cpu"):
    """Tokens that encode (source rank, index) arrive exactly where their experts live.

    Standard: each token once per destination rank, with local ids and weights intact.
    ExpertBatched: each (token, expert) pair once in its expert's rows. And combine of the
    identity expert returns the tokens themselves (weights sum to 1)."""
    dev = device_for(rank, device)
    E, K, H = max(7, world + 3), 3, 4  # (every rank holds an expert)
    T = [5, 0, 3, 6][rank % 4]
    placement = epmoe.ExpertPlacement.linear(E, world)
    spec = CommSpec(
        hidden_size=H,
        top_k=K,
        rank_offsets=placement.rank_offsets,
        max_num_tokens=8,
        dtype=torch.float32,
        device=dev,
    )
    g = torch.Generator().manual_seed(rank)
    # K distinct experts per token: the first K of a random permutation of each row
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].to(dev)
    weights = torch.softmax(torch.randn(T, K, generator=g), -1).to(dev)
    x = torch.zeros(T, H, device=dev)
    x[:, 0] = rank
    x[:, 1] = torch.arange(T, device=dev, dtype=torch.float32)
    x[:, 2] = 1.0
    # what every rank sent: all-gather the routing so each rank can predict what it receives
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, (ids.cpu(), weights.cpu()))
    lo, hi = placement.rank_offsets[rank], placement.rank_offsets[rank + 1]
    sweep = Sweep()
    for backend, layout in backends_and_layouts():
        with sweep.case(f"{backend} {layout.value}"):
            comm = create_backend(backend, spec, None, layout)
            res = comm.dispatch(x, ids, weights)
            if layout is Layout.STANDARD:
                got = {}
                for row, lid, lw in zip(
                    res.hidden.cpu(), res.topk_ids.cpu(), res.topk_weights.cpu()
                ):
                    src, t = int(row[0]), int(row[1])
                    got[(src, t)] = (lid.tolist(), lw.tolist())
                want = {}
                for src, (sids, sw) in enumerate(everyone):
                    for t in range(sids.shape[0]):
                        local = [(i - lo) if lo <= i < hi else -1 for i in sids[t].tolist()]
                        if backend == "naive" or any(v >= 0 for v in local):
                            want[(src, t)] = (local, sw[t].tolist())
                assert got.keys() == want.keys(), (sorted(got), sorted(want))
                for key in want:
                    assert got[key][0] == want[key][0], (key, got[key], want[key])
                    torch.testing.assert_close(
                        torch.tensor(got[key][1]), torch.tensor(want[key][1])
                    )
                y = res.hidden * (res.topk_ids >= 0).to(res.hidden.dtype).mul(res.topk_weights).sum(
                    1, keepdim=True
                )
            else:
                counts = res.counts.cpu().tolist()
                for slot in range(hi - lo):
                    rows = res.hidden[slot, : counts[slot]].cpu()
                    got = sorted((int(r[0]), int(r[1])) for r in rows)
                    want = sorted(
                        (src, t)
                        for src, (sids, _) in enumerate(everyone)
                        for t in range(sids.shape[0])
                        if lo + slot in sids[t].tolist()
                    )
                    assert got == want, (slot, got, want)
                y = res.hidden.clone()
            out = comm.combine(y, res)
            torch.testing.assert_close(out, x)
    sweep.check()


def check_bad_inputs(rank, world, device="cpu"):
    """Errors name the argument and the fix, on every rank, without hanging."""
    import pytest

    dev = device_for(rank, device)
    E, K, H, I = 8, 2, 16, 8
    layer = epmoe.EPMoE(E, K, H, I, params_dtype=torch.float32, device=dev, experts="torch")
    x, logits = rank_tokens(rank, 3, H, E, torch.float32, dev)
    with pytest.raises(RuntimeError, match="load_experts"):
        layer(x, logits)
    w13, w2 = full_weights(E, H, I, torch.float32, dev)
    with pytest.raises(ValueError, match="w13"):
        layer.load_experts(w13[:, :, :-1], w2)
    layer.load_experts(w13, w2)
    with pytest.raises(ValueError, match="hidden_states"):
        layer(x[:, :-1], logits)
    with pytest.raises(ValueError, match="router_logits"):
        layer(x, logits[:, :-1])
    with pytest.raises(ValueError, match="ep_size"):
        epmoe.EPMoE(
            E,
            K,
            H,
            I,
            placement=epmoe.ExpertPlacement.linear(E, world + 1),
            device=dev,
            params_dtype=torch.float32,
        )
    with pytest.raises(ValueError, match="top_k=1"):
        epmoe.EPMoE(E, 2, H, I, apply_router_weight_on_input=True, device=dev)
    with pytest.raises(ValueError, match="unknown backend"):
        epmoe.EPMoE(E, K, H, I, backend="nope", device=dev)
    with pytest.raises(ValueError, match="num_expert_group"):
        epmoe.EPMoE(E, K, H, I, num_expert_group=3, topk_group=1, device=dev)
    with pytest.raises(ValueError, match="layout"):
        epmoe.EPMoE(E, K, H, I, layout="batched", device=dev, params_dtype=torch.float32)
    with pytest.raises(TypeError, match="hidden_states must be floating point"):
        layer(x.to(torch.int64), logits)
    # one rank's bad input raises on every rank (the others learn it in the forward's
    # agreement, an all-gather) instead of leaving them waiting inside a collective
    bad_rank = world - 1
    if rank == bad_rank:
        with pytest.raises(ValueError, match="hidden_states"):
            layer(x[:, :-1], logits)
    else:
        with pytest.raises(RuntimeError, match="another rank"):
            layer(x, logits)
    # the layer itself still works after the errors (no rank left inside a collective)
    out = layer(x, logits)
    assert_close(out, epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, K)), 1e-5)
