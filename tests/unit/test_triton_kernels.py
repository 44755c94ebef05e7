"""The Triton MoE kernels (epmoe.kernels) and TritonExperts against the float64 oracle.

On CPU the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py before anything imports triton) in fp32 and fp16 — the interpreter gets
bf16 ``tl.dot`` wrong — on small shapes with named edge cases. Its float32 → FP8 cast also
rounds some values near the top of a binade down (e.g. 124.3 → 64), so FP8 checks here
hold the parts that do not depend on that cast tightly (scales, GEMMs fed with FP8 inputs
quantized by torch) and the rest loosely; the GPU tier (tests/gpu) holds FP8 to 6e-2.

Shape legend: R received rows · H hidden · I intermediate · e local experts · K top-k ·
C rows of capacity per expert · P = R·K pairs.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from epmoe.comm.base import DispatchResult, Layout
from epmoe.experts.base import ExpertWeights
from epmoe.reference import (
    TOLERANCES,
    assert_close,
    dequantize_block,
    expert_mlp,
    moe,
    quantize_block,
    quantize_groups,
)

ops = pytest.importorskip("epmoe.kernels.ops", reason="needs triton")
from epmoe.kernels import configs  # noqa: E402
from epmoe.kernels.configs import GemmConfig, MoEConfig  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not ops.interpreted():
    pytest.skip(
        "the Triton kernels were imported without TRITON_INTERPRET=1 on a machine without "
        "CUDA; run through tests/conftest.py",
        allow_module_level=True,
    )

FP8 = torch.float8_e4m3fn
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")]
# Small tiles so that the shapes below span several blocks in every dimension.
SMALL = MoEConfig(16, GemmConfig(32, 32, 2, 4, 1), GemmConfig(32, 32, 2, 4, 1))
SMALL_FP8 = MoEConfig(16, GemmConfig(128, 32, 2, 4, 1), GemmConfig(32, 64, 2, 4, 1))
# GEMM 1 tiles narrower than an FP8 group: fp32 out, quantized in a separate pass.
SMALL_FP8_UNFUSED = MoEConfig(16, GemmConfig(32, 32, 2, 4, 1), GemmConfig(32, 64, 2, 4, 1))
# Half-height tail tiles: 32-row blocks, an expert's last block of <= 16 rows runs 16-row tiles.
HALF = MoEConfig(32, GemmConfig(32, 32, 2, 4, 1), GemmConfig(32, 32, 2, 4, 1), half_tail=True)
HALF_FP8 = MoEConfig(32, GemmConfig(128, 32, 2, 4, 1), GemmConfig(32, 64, 2, 4, 1), half_tail=True)
# GEMM 2 adds each pair's row into its token's output row (no separate top-k sum).
SMALL_ATOMIC = dataclasses.replace(SMALL, atomic_reduce=True)
# Rows per expert around the tile boundaries of HALF: none, one, a half tile exactly, just
# over it, a full block, a full block and a half tile, two full blocks.
HALF_TAIL_COUNTS = [0, 1, 16, 17, 32, 33, 48, 49, 64]
# FP8 GEMMs fed with exactly quantized inputs: exact fp32 sums in the interpreter; on sm_90
# the tensor cores accumulate each 128-wide K step with a shorter mantissa (as DeepGEMM).
FP8_ACC_RTOL = 1e-5 if DEVICE == "cpu" else 2e-3


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _weights(e: int, H: int, I: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    w13 = torch.randn(e, 2 * I, H, generator=g, dtype=torch.float64) * H**-0.5
    w2 = torch.randn(e, H, I, generator=g, dtype=torch.float64) * I**-0.5
    return w13, w2


def _distinct_ids(R: int, K: int, e: int, g: torch.Generator, p_remote: float) -> torch.Tensor:
    """Distinct local ids per row (like a top-k), each -1 with probability ``p_remote``."""
    ids = torch.rand(R, max(e, K), generator=g).argsort(dim=1)[:, :K]
    ids[ids >= e] = -1
    ids[torch.rand(R, K, generator=g) < p_remote] = -1
    return ids


def _ids_for(case: str, R: int, K: int, e: int, seed: int) -> torch.Tensor:
    g = _gen(seed)
    if case == "random":
        return _distinct_ids(R, K, e, g, 0.3)
    if case == "skip_expert":  # expert 1 receives nothing
        ids = _distinct_ids(R, K, e, g, 0.2)
        ids[ids == 1] = -1
        return ids
    if case == "one_expert":
        ids = torch.full((R, K), -1, dtype=torch.int64)
        ids[:, 0] = e - 1
        return ids
    if case == "rows_without_local":
        ids = _distinct_ids(R, K, e, g, 0.2)
        ids[::3] = -1
        return ids
    if case == "none_local":
        return torch.full((R, K), -1, dtype=torch.int64)
    raise ValueError(case)


STANDARD_CASES = [
    # id, R, K, e, H, I, ids, activation
    pytest.param(1, 2, 4, 64, 32, "random", "silu", id="T=1"),
    pytest.param(13, 3, 4, 64, 32, "skip_expert", "silu", id="expert-with-no-tokens"),
    pytest.param(37, 2, 3, 64, 32, "one_expert", "silu", id="all-tokens-one-expert"),
    pytest.param(11, 3, 7, 64, 32, "random", "gelu", id="E-not-pow2-gelu"),
    pytest.param(9, 2, 3, 72, 40, "random", "silu", id="H-I-not-multiple-of-block"),
    pytest.param(10, 3, 4, 64, 32, "rows_without_local", "silu", id="rows-without-local-expert"),
    pytest.param(0, 2, 4, 64, 32, "random", "silu", id="R=0"),
    pytest.param(6, 2, 4, 64, 32, "none_local", "silu", id="counts-all-zero"),
]


@pytest.mark.parametrize("config", [SMALL, SMALL_ATOMIC], ids=["sum-pass", "atomic-reduce"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R,K,e,H,I,ids_case,activation", STANDARD_CASES)
def test_standard_matches_oracle(R, K, e, H, I, ids_case, activation, dtype, config):
    g = _gen(R + 7 * e + H)
    x = torch.randn(R, H, generator=g, dtype=torch.float64)
    w13, w2 = _weights(e, H, I, seed=R + e)
    ids = _ids_for(ids_case, R, K, e, seed=R * K + e)
    w = torch.rand(R, K, generator=g, dtype=torch.float64) + 0.1
    ref = moe(x, w13, w2, w, ids, activation)

    out = ops.fused_moe_standard(
        x.to(dtype).to(DEVICE),
        ids.to(DEVICE),
        w.float().to(DEVICE),
        w13.to(dtype).to(DEVICE),
        w2.to(dtype).to(DEVICE),
        activation=activation,
        config=config,
    )
    assert out.shape == (R, H) and out.dtype == dtype
    assert_close(out.cpu(), ref, TOLERANCES[dtype], name=f"standard {ids_case}")
    if ids_case in ("none_local", "rows_without_local"):
        no_local = (ids < 0).all(dim=1)
        assert torch.count_nonzero(out.cpu()[no_local]) == 0, "rows with no local id must be 0"


BATCHED_CASES = [
    # counts per expert (e = len(counts)), C, H, I
    pytest.param([1, 0, 1], 1, 64, 32, id="T=1"),
    pytest.param([3, 0, 5, 2], 5, 64, 32, id="expert-with-no-tokens"),
    pytest.param([0, 37, 0], 40, 64, 32, id="all-tokens-one-expert"),
    pytest.param([2, 7, 1, 4, 6], 7, 64, 32, id="E-not-pow2"),
    pytest.param([4, 1, 3], 6, 72, 40, id="H-I-not-multiple-of-block"),
    pytest.param([0, 0, 0], 4, 64, 32, id="counts-all-zero"),
    pytest.param([0, 0], 0, 64, 32, id="C=0"),
    pytest.param([9, 2, 0], 5, 64, 32, id="count-above-C"),
]


def _check_batched(out, x, counts, w13, w2, activation, rtol, name):
    for i, n in enumerate(counts):
        if n:
            ref = expert_mlp(x[i, :n].double(), w13[i].double(), w2[i].double(), activation)
            assert_close(out[i, :n].cpu(), ref, rtol, name=f"{name} expert {i}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("counts,C,H,I", BATCHED_CASES)
def test_batched_matches_oracle(counts, C, H, I, dtype):
    e = len(counts)
    x = torch.randn(e, C, H, generator=_gen(C + H), dtype=torch.float64)
    w13, w2 = _weights(e, H, I, seed=e + C)
    out = ops.fused_moe_batched(
        x.to(dtype).to(DEVICE),
        torch.tensor(counts, dtype=torch.int32, device=DEVICE),
        w13.to(dtype).to(DEVICE),
        w2.to(dtype).to(DEVICE),
        activation="gelu" if e == 5 else "silu",
        config=SMALL,
    )
    assert out.shape == (e, C, H) and out.dtype == dtype
    act = "gelu" if e == 5 else "silu"
    _check_batched(
        out, x.to(dtype), counts, w13.to(dtype), w2.to(dtype), act, TOLERANCES[dtype], "batched"
    )


@pytest.mark.parametrize("splits", [1, 2, 3, 5])
def test_batched_row_programs_loop_over_their_blocks(monkeypatch, splits):
    """Each expert's slab is covered by S row programs (``ops.batched_m_splits``), program
    j taking row blocks j, j + S, ...: every S from one program per expert (a full slab
    of 5 blocks in one program) to one per block gives the oracle's rows, also for a
    full slab, an empty one and counts past C, with half-height tails."""
    monkeypatch.setattr(ops, "batched_m_splits", lambda *args: splits)
    counts = [80, 0, 17, 33, 99]  # C = 80 rows: 5 blocks of 16
    e, C, H, I = len(counts), 80, 64, 48
    f32 = torch.float32
    x = torch.randn(e, C, H, generator=_gen(61), dtype=torch.float64).to(f32)
    w13, w2 = (w.to(f32) for w in _weights(e, H, I, seed=62))
    capped = [min(n, C) for n in counts]
    for config in (SMALL, HALF):
        out = ops.fused_moe_batched(
            x.to(DEVICE), torch.tensor(counts, dtype=torch.int32, device=DEVICE),
            w13.to(DEVICE), w2.to(DEVICE), config=config,
        )  # fmt: skip
        _check_batched(out, x, capped, w13, w2, "silu", TOLERANCES[f32], f"S={splits}")


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_batched_reads_rows_in_place_through_an_index(fp8):
    """``row_index_eC``: GEMM 1 reads expert i's row c from ``x[row_index[i, c]]`` of the
    received rows ``[R, H]`` (``symm_ll``'s layout, nothing copied into slabs): the same
    outputs as the slabs gathered from it, bit for bit, in fp32 and in FP8 (rows quantized
    once, where they landed), with a row shared by two experts, an empty expert, counts
    past C and half-height tails; the Experts interface takes it from a DispatchResult."""
    from epmoe.experts.torch_experts import TorchExperts
    from epmoe.experts.triton_experts import TritonExperts

    counts = [5, 0, 17, 40]  # C = 33: one count past it
    e, C, R, H, I = len(counts), 33, 24, 256, 160
    g = _gen(71)
    x_RH = torch.randn(R, H, generator=g)
    index = torch.randint(0, R, (e, C), generator=g, dtype=torch.int32)
    index[3, :2] = index[0, 0]  # one received row used by two experts
    w13, w2 = (w.float() for w in _weights(e, H, I, seed=72))
    scales = {}
    if fp8:
        (w13, scales["w13_scale"]), (w2, scales["w2_scale"]) = (
            quantize_block(w13),
            quantize_block(w2),
        )
    c = torch.tensor(counts, dtype=torch.int32)
    cfg = HALF_FP8 if fp8 else HALF
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    kw = dict(config=cfg, **{k: dev(v) for k, v in scales.items()})
    got = ops.fused_moe_batched(dev(x_RH), dev(c), dev(w13), dev(w2), row_index_eC=dev(index), **kw)
    slabs = x_RH[index.long()]  # [e, C, H]
    want = ops.fused_moe_batched(dev(slabs), dev(c), dev(w13), dev(w2), **kw)
    assert got.shape == (e, C, H)
    for i, n in enumerate(counts):
        torch.testing.assert_close(got[i, :n], want[i, : min(n, C)], rtol=0, atol=0)

    # through the Experts interface: Triton reads in place, torch gets gathered slabs
    res = DispatchResult(Layout.EXPERT_BATCHED, dev(x_RH), counts=dev(c), row_index=dev(index))
    assert res.num_rows == C and res.out_shape == (e, C, H)
    weights = ExpertWeights(dev(w13), dev(w2), *(dev(scales[k]) for k in sorted(scales)))
    via = TritonExperts(config=cfg)(res, weights)
    for i, n in enumerate(counts):  # (rows past the counts are unspecified)
        torch.testing.assert_close(via[i, :n], got[i, :n], rtol=0, atol=0)
    if not fp8:
        ref = TorchExperts()(res, weights)
        for i, n in enumerate(counts):
            n = min(n, C)
            assert_close(ref[i, :n].cpu(), got[i, :n].cpu(), 1e-4, name=f"torch expert {i}")
    with pytest.raises(ValueError, match="row_index_eC must be"):
        ops.fused_moe_batched(
            dev(x_RH), dev(c), dev(w13), dev(w2), row_index_eC=dev(index[:2]), **kw
        )
    with pytest.raises(ValueError, match="received rows"):
        ops.fused_moe_batched(dev(slabs), dev(c), dev(w13), dev(w2), row_index_eC=dev(index), **kw)


def test_batched_m_splits_fills_the_gpu_and_bounds_serial_blocks():
    # DeepSeek-V3 decode on H200 (e 128, C 512, block_m 16: 32 blocks): the grid already
    # holds 128 · 16 column programs, so S is what bounds a full slab to 8 serial blocks
    assert ops.batched_m_splits(512, 16, 128, 16, 132) == 4
    assert ops.batched_m_splits(512, 16, 128, 112, 132) == 4
    # few experts and columns: S grows to fill 4 programs per SM, capped at the blocks
    assert ops.batched_m_splits(4096, 64, 2, 2, 132) == 64
    assert ops.batched_m_splits(64, 64, 2, 2, 132) == 1
    assert ops.batched_m_splits(0, 16, 4, 4, 132) == 1  # C = 0: nothing to run


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["standard", "batched"])
def test_half_tail_matches_oracle(layout, dtype):
    """``half_tail``: blocks of at most block_m / 2 rows run half-height tiles; rows per
    expert on both sides of every tile boundary, against the oracle."""
    counts = HALF_TAIL_COUNTS
    e, H, I = len(counts), 64, 48
    g = _gen(51)
    w13, w2 = _weights(e, H, I, seed=52)
    if layout == "batched":
        C = max(counts)
        x = torch.randn(e, C, H, generator=g, dtype=torch.float64)
        out = ops.fused_moe_batched(
            x.to(dtype).to(DEVICE), torch.tensor(counts, dtype=torch.int32, device=DEVICE),
            w13.to(dtype).to(DEVICE), w2.to(dtype).to(DEVICE), config=HALF,
        )  # fmt: skip
        w13d, w2d = w13.to(dtype), w2.to(dtype)
        _check_batched(out, x.to(dtype), counts, w13d, w2d, "silu", TOLERANCES[dtype], "half")
        return
    # K = 2: each row's first id gives the counts above, its second is another rank's (-1)
    # or a repeat of expert 3 (17 → 17 + R / 4 rows, still spread over the boundaries).
    first = torch.repeat_interleave(torch.arange(e), torch.tensor(counts))
    R = first.numel()
    first = first[torch.randperm(R, generator=g)]
    second = torch.where(torch.rand(R, generator=g) < 0.25, 3, -1)
    second[first == 3] = -1
    ids = torch.stack([first, second], dim=1)
    x = torch.randn(R, H, generator=g, dtype=torch.float64)
    w = torch.rand(R, 2, generator=g, dtype=torch.float64) + 0.1
    ref = moe(x, w13, w2, w, ids)
    out = ops.fused_moe_standard(
        x.to(dtype).to(DEVICE), ids.to(DEVICE), w.float().to(DEVICE),
        w13.to(dtype).to(DEVICE), w2.to(dtype).to(DEVICE), config=HALF,
    )  # fmt: skip
    assert_close(out.cpu(), ref, TOLERANCES[dtype], name="standard, half tails")


@pytest.mark.parametrize("pad", ["full", "half-tail", "warpgroup"])
@pytest.mark.parametrize(
    "R,K,e,block_m,ids_case",
    [
        pytest.param(9, 3, 4, 16, "random", id="random"),
        pytest.param(700, 2, 13, 16, "random", id="many-pairs-E-not-pow2"),
        pytest.param(40, 1, 3, 16, "one_expert", id="one-expert-3-blocks"),
        pytest.param(36, 1, 3, 32, "one_expert", id="one-expert-tail-of-half"),
        pytest.param(5, 2, 4, 32, "none_local", id="none-local"),
        pytest.param(0, 2, 4, 16, "random", id="R=0"),
        pytest.param(6, 2, 1, 64, "random", id="e=1"),
        pytest.param(900, 2, 5, 192, "random", id="192-row-blocks"),
        pytest.param(450, 1, 2, 192, "one_expert", id="192-one-expert"),
    ],
)
def test_align_pairs(R, K, e, block_m, ids_case, pad):
    """Groups padded to ``block_m``, to half of it (half-height tails) or to one
    warpgroup's 64 rows (the Hopper kernel's 192-row blocks) and cut into blocks."""
    if pad == "warpgroup" and block_m % 64:
        pytest.skip("64-row padding needs block_m a multiple of 64")
    ids = _ids_for(ids_case, R, K, e, seed=R + e)
    half_tail = pad != "full"
    pad_m = {"full": block_m, "half-tail": block_m // 2, "warpgroup": 64}[pad]
    a = ops.align_pairs(
        ids.to(torch.int32).to(DEVICE), e, block_m, half_tail, 64 if pad == "warpgroup" else None
    )
    P = R * K
    assert (a.block_m, a.pad_m) == (block_m, pad_m)
    flat = ids.reshape(-1)
    counts = torch.bincount(flat[flat >= 0], minlength=e)
    padded = (counts + pad_m - 1) // pad_m * pad_m
    assert torch.equal(a.expert_counts.cpu().long(), counts)
    assert int(a.num_padded.cpu()) == int(padded.sum())
    # The worst case of B does not depend on pad_m.
    assert a.num_blocks == math.ceil((P + min(e, P) * (block_m - 1)) / block_m)
    if P == 0:
        return
    assert a.tile_counters.tolist() == [0, 0]  # (the persistent Hopper GEMMs' counters)
    sp, pos = a.sorted_pairs.cpu().long(), a.pair_pos.cpu().long()
    be, bs, br = (t.cpu().long() for t in (a.block_expert, a.block_start, a.block_rows))
    start, b = 0, 0
    for i in range(e):
        c, p = int(counts[i]), int(padded[i])
        got = sp[start : start + c]
        assert sorted(got.tolist()) == (flat == i).nonzero().squeeze(1).tolist(), f"expert {i}"
        assert (sp[start + c : start + p] == P).all(), f"padding of expert {i}"
        # Blocks of block_m positions, the last shorter (a multiple of pad_m) when it can be.
        sizes = [block_m] * (p // block_m) + ([p % block_m] if p % block_m else [])
        for j, size in enumerate(sizes):
            assert (be[b], bs[b], br[b]) == (i, start + j * block_m, size), f"block {b}"
            b += 1
        start += p
    assert (be[b:] == -1).all() and (br[b:] == 0).all(), "blocks past the last real one"
    assert int(a.blocks_used.cpu()) == b
    local = flat >= 0
    assert (pos[~local] == -1).all()
    assert torch.equal(sp[pos[local]], local.nonzero().squeeze(1))


def test_experts_interface_both_layouts():
    """TritonExperts through the Experts contract, against TorchExperts and the oracle."""
    from epmoe.experts.torch_experts import TorchExperts
    from epmoe.experts.triton_experts import TritonExperts

    R, K, e, H, I, C = 10, 3, 5, 64, 48, 6
    g = _gen(3)
    x = torch.randn(R, H, generator=g, dtype=torch.float64)
    w13, w2 = _weights(e, H, I, seed=4)
    ids = _ids_for("random", R, K, e, seed=5)
    w = torch.rand(R, K, generator=g, dtype=torch.float64)
    weights = ExpertWeights(w13.float().to(DEVICE), w2.float().to(DEVICE))
    ours, theirs = TritonExperts("silu", config=SMALL), TorchExperts("silu")
    res = DispatchResult(
        Layout.STANDARD, x.float().to(DEVICE), ids.to(DEVICE), w.float().to(DEVICE)
    )
    out = ours(res, weights)
    assert_close(out.cpu(), moe(x, w13, w2, w, ids), TOLERANCES[torch.float32])
    assert_close(out.cpu(), theirs(res, weights).cpu().double(), 1e-5, name="vs TorchExperts")

    xb = torch.randn(e, C, H, generator=g, dtype=torch.float64)
    counts = torch.tensor([2, 0, 6, 1, 3], dtype=torch.int32)
    res_b = DispatchResult(Layout.EXPERT_BATCHED, xb.float().to(DEVICE), counts=counts.to(DEVICE))
    out_b = ours(res_b, weights)
    ref_b = theirs(res_b, weights)
    for i, n in enumerate(counts.tolist()):
        assert_close(out_b[i, :n].cpu(), ref_b[i, :n].cpu().double(), 1e-5, name=f"slot {i}")


# ----------------------------------------------------------------------------- FP8


def _dequant_groups(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    D = q.shape[-1]
    return q.double() * scale.double().repeat_interleave(128, dim=-1)[..., :D]


def test_per_token_group_quant():
    x = torch.randn(5, 300, generator=_gen(0)) * 3
    q, s = ops.per_token_group_quant_fp8(x.to(DEVICE))
    q_ref, s_ref = quantize_groups(x)
    assert q.shape == (5, 300) and s.shape == (5, 3) and q.dtype == FP8
    assert torch.equal(s.cpu(), s_ref), "scales must be bit-equal to amax * float32(1/448)"
    err = (_dequant_groups(q.cpu(), s.cpu()) - x.double()).norm() / x.double().norm()
    assert err < (0.04 if DEVICE == "cuda" else 0.08), err  # interpreter: see module doc
    if DEVICE == "cuda":
        assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))

    xb = torch.randn(3, 4, 256, generator=_gen(1))
    counts = torch.tensor([2, 0, 4], dtype=torch.int32)
    qb, sb = ops.per_token_group_quant_fp8(xb.to(DEVICE), counts=counts.to(DEVICE))
    _, sb_ref = quantize_groups(xb)
    for i, n in enumerate(counts.tolist()):
        assert torch.equal(sb.cpu()[i, :n], sb_ref[i, :n]), f"slot {i}"


@pytest.mark.parametrize("per_tensor", [False, True], ids=["block-scales", "per-expert-scales"])
@pytest.mark.parametrize("batched", [False, True], ids=["standard", "batched"])
def test_fp8_down_exact(batched, per_tensor):
    """GEMM 2 in FP8 fed with torch-quantized activations: only fp32 accumulation error."""
    e, H, I, R, K, C = 3, 200, 136, 7, 2, 5
    g = _gen(11)
    _, w2 = _weights(e, H, I, seed=12)
    q2, s2 = quantize_block(w2, per_matrix=per_tensor)
    w2_deq = dequantize_block(q2, s2, dtype=torch.float64)
    if batched:
        counts = [3, 0, 5]
        h = torch.randn(e, C, I, generator=g)
        hq, hs = quantize_groups(h)
        rows = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
        z = ops.down(
            hq.to(DEVICE),
            q2.to(DEVICE),
            rows,
            SMALL_FP8,
            torch.float32,
            hs.to(DEVICE),
            s2.to(DEVICE),
        )
        for i, n in enumerate(counts):
            ref = _dequant_groups(hq[i, :n], hs[i, :n]) @ w2_deq[i].T
            assert_close(z[i, :n].cpu(), ref, FP8_ACC_RTOL, name=f"expert {i}")
        return
    ids = _ids_for("random", R, K, e, seed=13)
    w = torch.rand(R, K, generator=g)
    aligned = ops.align_pairs(ids.to(DEVICE), e, SMALL_FP8.block_m)
    P_pad = aligned.sorted_pairs.shape[0]
    h = torch.randn(P_pad, I, generator=g)  # activations at every padded position
    hq, hs = quantize_groups(h)
    z = ops.down(
        hq.to(DEVICE), q2.to(DEVICE), aligned, SMALL_FP8, torch.float32, hs.to(DEVICE),
        s2.to(DEVICE), w.to(DEVICE),
    )  # fmt: skip
    pos = aligned.pair_pos.cpu().long()
    flat = ids.reshape(-1)
    for p in (flat >= 0).nonzero().squeeze(1).tolist():
        ref = (_dequant_groups(hq[pos[p]], hs[pos[p]]) @ w2_deq[flat[p]].T) * w.reshape(-1)[p]
        assert_close(z[pos[p]].cpu(), ref, FP8_ACC_RTOL, name=f"pair {p}")


@pytest.mark.parametrize("per_tensor", [False, True], ids=["block-scales", "per-expert-scales"])
def test_fp8_gate_up_scales(per_tensor):
    """GEMM 1 in FP8: the fused re-quantization's scales are exact (amax / 448 of the fp32
    activation); its values are checked loosely under the interpreter."""
    e, H, I, C = 2, 200, 136, 5
    counts = [4, 2]
    w13, _ = _weights(e, H, I, seed=21)
    q13, s13 = quantize_block(w13, per_matrix=per_tensor)
    w13_deq = dequantize_block(q13, s13, dtype=torch.float64)
    x = torch.randn(e, C, H, generator=_gen(22))
    xq, xs = quantize_groups(x)
    rows = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    y, ys = ops.gate_up(
        xq.to(DEVICE), q13.to(DEVICE), rows, SMALL_FP8, "silu", xs.to(DEVICE), s13.to(DEVICE)
    )
    assert y.dtype == FP8 and ys.shape == (e, C, 2)
    for i, n in enumerate(counts):
        gu = _dequant_groups(xq[i, :n], xs[i, :n]) @ w13_deq[i].T
        h = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
        scale_ref = torch.nn.functional.pad(h, (0, 256 - I)).unflatten(-1, (2, 128))
        scale_ref = scale_ref.abs().amax(-1) / 448.0
        rtol = max(1e-4, FP8_ACC_RTOL)
        torch.testing.assert_close(ys[i, :n].cpu().double(), scale_ref, rtol=rtol, atol=1e-9)
        deq = _dequant_groups(y[i, :n].cpu(), ys[i, :n].cpu())
        assert_close(deq, h, 0.04 if DEVICE == "cuda" else 0.1, name=f"expert {i}")


@pytest.mark.parametrize(
    "config",
    [SMALL_FP8, HALF_FP8, SMALL_FP8_UNFUSED, dataclasses.replace(HALF_FP8, atomic_reduce=True)],
    ids=["full", "half-tail", "narrow-gate-up", "half-tail-atomic-reduce"],
)
def test_fp8_pipeline_smoke(config):
    """Whole FP8 layers (bf16 in, FP8 weights) in both layouts against the oracle with the
    dequantized weights; the interpreter's FP8 cast makes this loose on CPU."""
    R, K, e, H, I = 9, 3, 4, 256, 128
    g = _gen(31)
    x = torch.randn(R, H, generator=g, dtype=torch.float64)
    w13, w2 = _weights(e, H, I, seed=32)
    (q13, s13), (q2, s2) = quantize_block(w13), quantize_block(w2)
    ids = _ids_for("random", R, K, e, seed=33)
    w = torch.rand(R, K, generator=g, dtype=torch.float64)
    ref = moe(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2)
    rtol = TOLERANCES[FP8] if DEVICE == "cuda" else 0.15
    dev = [t.to(DEVICE) for t in (q13, q2, s13, s2)]
    out = ops.fused_moe_standard(
        x.float().to(DEVICE), ids.to(DEVICE), w.float().to(DEVICE), dev[0], dev[1],
        w13_scale=dev[2], w2_scale=dev[3], config=config,
    )  # fmt: skip
    assert out.dtype == torch.float32
    assert_close(out.cpu(), ref, rtol, name="fp8 standard")
    if config.atomic_reduce and DEVICE == "cpu":
        return  # (the interpreter has no bf16 atomics: the GPU tier runs the rest)

    # FP8 hidden states as an FP8 dispatch delivers them: bf16 output by default.
    xq, xs = quantize_groups(x.float())
    out8 = ops.fused_moe_standard(
        xq.to(DEVICE), ids.to(DEVICE), w.float().to(DEVICE), dev[0], dev[1],
        hidden_scale=xs.to(DEVICE), w13_scale=dev[2], w2_scale=dev[3], config=config,
    )  # fmt: skip
    assert out8.dtype == torch.bfloat16
    assert_close(out8.cpu(), ref, rtol + 2e-2, name="fp8 standard, fp8 input")

    counts = [3, 0, 2, 1]
    xb = torch.randn(e, 3, H, generator=g)
    outb = ops.fused_moe_batched(
        xb.to(DEVICE), torch.tensor(counts, dtype=torch.int32, device=DEVICE), dev[0], dev[1],
        w13_scale=dev[2], w2_scale=dev[3], config=config,
    )  # fmt: skip
    w13d, w2d = dequantize_block(q13, s13), dequantize_block(q2, s2)
    _check_batched(outb, xb.float(), counts, w13d, w2d, "silu", rtol, "fp8 batched")


def test_fp8_narrow_gate_up_quantizes_like_the_fused_epilogue():
    """GEMM 1 tiles narrower than a group (separate quantization pass) give the same
    layer output as one-group tiles (quantization in the epilogue): same fp32 values,
    same scale formula."""
    R, K, e, H, I = 7, 2, 3, 256, 256
    g = _gen(61)
    w13, w2 = _weights(e, H, I, seed=62)
    (q13, s13), (q2, s2) = quantize_block(w13), quantize_block(w2)
    ids = _ids_for("random", R, K, e, seed=63).to(DEVICE)
    x = torch.randn(R, H, generator=g).to(DEVICE)
    w = torch.rand(R, K, generator=g).to(DEVICE)
    dev = [t.to(DEVICE) for t in (q13, q2, s13, s2)]
    outs = [
        ops.fused_moe_standard(
            x, ids, w, dev[0], dev[1], w13_scale=dev[2], w2_scale=dev[3], config=cfg
        )
        for cfg in (SMALL_FP8, SMALL_FP8_UNFUSED)
    ]
    assert SMALL_FP8.gate_up.block_k == SMALL_FP8_UNFUSED.gate_up.block_k
    if DEVICE == "cpu":  # the interpreter: identical fp32 sums
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)
    else:  # tensor cores: a 1-ulp change of h may move a value to the next FP8 code
        assert_close(outs[1].cpu(), outs[0].cpu().double(), 5e-3, name="narrow vs fused")


def test_fp8_hidden_with_unquantized_weights():
    """FP8 hidden states (an FP8 dispatch) meeting fp32 weights are dequantized first."""
    from epmoe.experts.triton_experts import TritonExperts

    R, K, e, H, I = 6, 2, 3, 200, 48
    g = _gen(41)
    x = torch.randn(R, H, generator=g)
    xq, xs = quantize_groups(x)
    w13, w2 = _weights(e, H, I, seed=42)
    ids = _ids_for("random", R, K, e, seed=43)
    w = torch.rand(R, K, generator=g)
    ref = moe(_dequant_groups(xq, xs), w13, w2, w.double(), ids)
    experts = TritonExperts(out_dtype=torch.float32, config=SMALL)
    weights = ExpertWeights(w13.float().to(DEVICE), w2.float().to(DEVICE))
    out = experts.standard(xq.to(DEVICE), ids.to(DEVICE), w.to(DEVICE), weights, xs.to(DEVICE))
    assert out.dtype == torch.float32
    assert_close(out.cpu(), ref, 1e-5)


# ----------------------------------------------------------------------------- checks


def test_invalid_inputs_raise():
    e, H, I = 2, 64, 32
    w13, w2 = (t.float().to(DEVICE) for t in _weights(e, H, I, seed=0))
    x = torch.randn(3, H, device=DEVICE)
    ids = torch.zeros(3, 2, dtype=torch.int64, device=DEVICE)
    w = torch.ones(3, 2, device=DEVICE)
    with pytest.raises(ValueError, match="hidden_RH must be"):
        ops.fused_moe_standard(x[:, :10], ids, w, w13, w2)
    with pytest.raises(ValueError, match="topk_weights_RK"):
        ops.fused_moe_standard(x, ids, w[:, :1], w13, w2)
    with pytest.raises(TypeError, match="cast one"):
        ops.fused_moe_standard(x.half(), ids, w, w13, w2)
    with pytest.raises(ValueError, match="activation"):
        ops.fused_moe_standard(x, ids, w, w13, w2, activation="relu")
    with pytest.raises(ValueError, match="w2 must be"):
        ops.fused_moe_standard(x, ids, w, w13, w2[:, :, :5])
    with pytest.raises(ValueError, match="need w13_scale"):
        ops.fused_moe_standard(x, ids, w, w13.to(FP8), w2.to(FP8))
    with pytest.raises(ValueError, match="block scales"):
        s = torch.ones(e, 3, device=DEVICE)
        ops.fused_moe_standard(x, ids, w, w13.to(FP8), w2.to(FP8), w13_scale=s, w2_scale=s)
    with pytest.raises(ValueError, match="need hidden_scale"):
        s13, s2 = torch.ones(e, device=DEVICE), torch.ones(e, device=DEVICE)
        ops.fused_moe_standard(
            x.to(FP8), ids, w, w13.to(FP8), w2.to(FP8), w13_scale=s13, w2_scale=s2
        )
    with pytest.raises(ValueError, match="counts_e"):
        ops.fused_moe_batched(x.view(1, 3, H).expand(e, 3, H), ids[:, 0], w13, w2)
    with pytest.raises(ValueError, match="down.block_k"):
        configs.check_config(MoEConfig(16, SMALL.gate_up, GemmConfig(32, 256)), fp8=True)


def test_half_tail_config_and_alignment_must_match():
    half = MoEConfig(64, SMALL.gate_up, SMALL.down, half_tail=True)
    assert MoEConfig.from_dict(json.loads(json.dumps(half.to_dict()))) == half
    assert half.short().startswith("m64h ")
    with pytest.raises(ValueError, match="half_tail needs block_m >= 32"):
        MoEConfig(16, SMALL.gate_up, SMALL.down, half_tail=True)
    with pytest.raises(ValueError, match="'half_tail' must be true or false"):
        MoEConfig.from_dict({**half.to_dict(), "half_tail": "false"})
    # pairs aligned without half tails cannot run a half-tail config (and back)
    ids = torch.tensor([[0, 1], [1, -1]], device=DEVICE)
    x = torch.randn(2, 64, device=DEVICE)
    w13 = torch.randn(2, 64, 64, device=DEVICE)
    aligned = ops.align_pairs(ids, 2, 64)
    with pytest.raises(ValueError, match="pad_m=64.*pad_m=32"):
        ops.gate_up(x, w13, aligned, half)
    # align_for: the pairs as a config's kernels read them
    for cfg in (SMALL, half, configs.wgmma_config("bf16", "wgmma_ws", 192)):
        got = ops.align_for(ids, 2, cfg)
        assert (got.block_m, got.pad_m) == (cfg.block_m, cfg.pad_m)
        want = ops.align_pairs(ids, 2, cfg.block_m, cfg.half_tail, cfg.pad_m)
        assert torch.equal(got.block_rows, want.block_rows)


def test_slab_blocks_cut_each_experts_valid_rows():
    """``slab_blocks``: ExpertBatched slabs ``[e, C]`` into the persistent Hopper kernel's
    row blocks, on the device: experts in order, empty ones skipped, counts clamped to
    ``[0, C]``, only the blocks in use written."""
    C, block_m = 256, 128
    counts = torch.tensor([0, 3, 128, 129, 300, -2, 64], dtype=torch.int32, device=DEVICE)
    t = ops.slab_blocks(counts, C, block_m)
    assert t.num_blocks == 7 * 2
    used = int(t.blocks_used)
    expected = [(1, 1 * C, 3), (2, 2 * C, 128), (3, 3 * C, 128), (3, 3 * C + 128, 1),
                (4, 4 * C, 128), (4, 4 * C + 128, 128), (6, 6 * C, 64)]  # fmt: skip
    assert used == len(expected)
    got = zip(t.block_expert[:used].tolist(), t.block_start[:used].tolist(),
              t.block_rows[:used].tolist(), strict=True)  # fmt: skip
    assert list(got) == expected
    assert t.tile_counter.tolist() == [0]
    empty = ops.slab_blocks(torch.zeros(3, dtype=torch.int32, device=DEVICE), C, block_m)
    assert int(empty.blocks_used) == 0


def test_wgmma_configs_are_checked_and_refused_where_they_cannot_run():
    """``kernel="wgmma"`` configs: validated when built, kept through JSON, offered to the
    autotuner (ExpertBatched: ``wgmma_ws`` only), and refused with the reason off sm_90 (here:
    CPU) instead of falling through to a wrong kernel."""
    fp8 = configs.wgmma_config("fp8")
    assert fp8.kernel == "wgmma" and configs.wgmma_config("fp32") is None
    assert MoEConfig.from_dict(json.loads(json.dumps(fp8.to_dict()))) == fp8
    assert fp8.short().endswith(" wgmma")
    legacy = {k: v for k, v in fp8.to_dict().items() if k != "kernel"}
    assert MoEConfig.from_dict(legacy).kernel == "dot"  # tables written before the field
    with pytest.raises(ValueError, match="kernel must be one of"):
        MoEConfig(128, fp8.gate_up, fp8.down, kernel="cutlass")
    assert fp8.half_tail  # tail blocks run half-height tiles (the warpgroups split columns)
    with pytest.raises(ValueError, match="block_m = 16 · num_warps"):
        MoEConfig(64, fp8.gate_up, fp8.down, kernel="wgmma")
    with pytest.raises(ValueError, match=r"num_warps 8 or 12 \(two or three MMA warpgroups"):
        gemm = GemmConfig(128, 128, 8, 4, 4), GemmConfig(256, 128, 8, 4, 4)
        MoEConfig(64, *gemm, kernel="wgmma_ws")
    # three MMA warpgroups: 192-row blocks padded to 64 rows, on wgmma_ws only
    ws192 = configs.wgmma_config("fp8", "wgmma_ws", 192)
    assert (ws192.block_m, ws192.pad_m, ws192.gate_up.num_warps) == (192, 64, 12)
    assert MoEConfig.from_dict(json.loads(json.dumps(ws192.to_dict()))) == ws192
    assert configs.wgmma_config("bf16", "wgmma_ws").pad_m == 64 == fp8.pad_m
    with pytest.raises(ValueError, match="or 192 with kernel='wgmma_ws'"):
        MoEConfig(192, ws192.gate_up, ws192.down, kernel="wgmma")
    with pytest.raises(ValueError, match="with block_m = 16 · num_warps"):
        MoEConfig(128, ws192.gate_up, ws192.down, kernel="wgmma_ws")
    with pytest.raises(ValueError, match="num_warps 12 needs kernel='wgmma_ws'"):
        MoEConfig(128, GemmConfig(128, 64, 8, 12, 4), GemmConfig(128, 64, 8, 12, 4))
    for dtype in ("bf16", "fp8"):
        std = configs.candidate_configs("standard", dtype, 4096, 7168, 2048, 128, 8)
        for kernel in configs.WGMMA_KERNELS:
            configs.check_config(configs.wgmma_config(dtype, kernel), dtype == "fp8")
            assert configs.wgmma_config(dtype, kernel) in std
        assert configs.wgmma_config(dtype, "wgmma_ws", 192) in std
        batched = configs.candidate_configs("batched", dtype, 256, 7168, 2048, 128, 8)
        assert [c.kernel for c in batched if c.kernel != "dot"] == ["wgmma_ws"]
    assert not configs._runnable(fp8, torch.device("cpu"))
    assert configs._runnable(SMALL, torch.device("cpu"))

    e, H, I, R = 2, 256, 128, 4
    x = torch.randn(R, H, device=DEVICE)
    w13 = torch.randn(e, 2 * I, H, device=DEVICE)
    w2 = torch.randn(e, H, I, device=DEVICE)
    ids = torch.zeros(R, 1, dtype=torch.int64, device=DEVICE)
    w = torch.ones(R, 1, device=DEVICE)
    bf16 = configs.wgmma_config("bf16")
    reason = ops.wgmma_unsupported(bf16, x, w13, I, 128, batched=False)
    assert reason is not None
    with pytest.raises(ValueError, match="kernel='wgmma'.*cannot run here"):
        ops.fused_moe_standard(x, ids, w, w13, w2, config=bf16)
    assert "Standard layout only" in ops.wgmma_unsupported(bf16, x, w13, I, 128, batched=True)


def test_wgmma_refusals_name_each_reason(monkeypatch):
    """Each condition the Hopper kernels need is checked on its own, as if on an sm_90 GPU
    (the interpreter and the device are stubbed: nothing here launches)."""
    monkeypatch.setattr(ops, "interpreted", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    configs.wgmma_unavailable.cache_clear()  # (asked once per device: the stub's answers)
    cuda = torch.device("cuda", 0)
    cfg = configs.wgmma_config("bf16")
    a = torch.empty(8, 256, dtype=torch.bfloat16)
    w = torch.empty(2, 256, 256, dtype=torch.bfloat16)
    with monkeypatch.context() as m:  # CPU tensors that say they are on cuda:0
        m.setattr(torch.Tensor, "device", property(lambda self: cuda))
        assert ops.wgmma_unsupported(cfg, a, w, 128, 128, False) is None
        assert "multiple of 128" in ops.wgmma_unsupported(cfg, a, w, 96, 128, False)
        a_k = torch.empty(8, 200, dtype=torch.bfloat16)
        assert "K (200)" in ops.wgmma_unsupported(cfg, a_k, w, 128, 128, False)
        strided = torch.empty(8, 512, dtype=torch.bfloat16)[:, ::2]
        assert "unit stride" in ops.wgmma_unsupported(cfg, strided, w, 128, 128, False)
        assert "bf16, fp16 or FP8" in ops.wgmma_unsupported(cfg, a.float(), w, 128, 128, False)
        fp8_cfg = configs.wgmma_config("fp8")
        assert "block_k must be 64" in ops.wgmma_unsupported(fp8_cfg, a, w, 128, 128, False)
        assert "Standard layout only" in ops.wgmma_unsupported(cfg, a, w, 128, 128, True)
        ws = configs.wgmma_config("bf16", "wgmma_ws")  # ExpertBatched: slabs as one matrix
        slab = torch.empty(2, 8, 256, dtype=torch.bfloat16)
        assert ops.wgmma_unsupported(ws, slab, w, 128, 128, True) is None
        gappy = torch.empty(2, 16, 256, dtype=torch.bfloat16)[:, :8]
        assert "one [e·C, K] matrix" in ops.wgmma_unsupported(ws, gappy, w, 128, 128, True)
        padded = torch.empty(8, 264, dtype=torch.bfloat16)[:, :256]  # rows 528 bytes apart
        assert "multiples of 16" in ops.wgmma_unsupported(cfg, padded, w, 128, 128, False)
        w_k = torch.empty(2, 256, 128, dtype=torch.bfloat16)
        assert "K = 256" in ops.wgmma_unsupported(cfg, a, w_k, 128, 128, False)
        m.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
        configs.wgmma_unavailable.cache_clear()
        assert "sm_90" in ops.wgmma_unsupported(cfg, a, w, 128, 128, False)
    configs.wgmma_unavailable.cache_clear()  # not the stub's answers for later tests
    # configs that cannot compile or fit are refused when built
    gu, dn = cfg.gate_up, cfg.down
    with pytest.raises(ValueError, match="block_m 128 with half_tail"):
        MoEConfig(64, GemmConfig(128, 64, 8, 4, 4), GemmConfig(256, 64, 8, 4, 4), True, "wgmma")
    with pytest.raises(ValueError, match="down.block_n 32 to 256"):
        MoEConfig(128, gu, GemmConfig(512, 64, 8, 8, 3), kernel="wgmma")
    with pytest.raises(ValueError, match="gate_up.num_stages within 227 KiB"):
        MoEConfig(128, GemmConfig(128, 64, 8, 8, 5), dn, kernel="wgmma_ws")


def test_a_selected_hopper_config_gives_way_where_it_cannot_run(monkeypatch):
    """A table or autotuner pick is by shape: where the operands do not suit the Hopper
    kernels (on CPU: the interpreter) the layer runs the shape heuristics' config instead of
    failing; an explicit Hopper config is still refused there."""
    picked = []
    hopper = configs.wgmma_config("fp16")
    monkeypatch.setattr(ops, "select_config", lambda *a, **k: picked.append(1) or hopper)
    R, K, e, H, I = 6, 2, 2, 256, 128
    x = torch.randn(R, H, device=DEVICE, dtype=torch.float16)
    w13 = torch.randn(e, 2 * I, H, device=DEVICE, dtype=torch.float16) * H**-0.5
    w2 = torch.randn(e, H, I, device=DEVICE, dtype=torch.float16) * I**-0.5
    ids = torch.tensor([[0, 1]] * R, device=DEVICE)
    w = torch.rand(R, K, device=DEVICE)
    out = ops.fused_moe_standard(x, ids, w, w13, w2)
    assert picked == [1]
    ref = moe(x.double(), w13.double(), w2.double(), w, ids)
    assert_close(out, ref, TOLERANCES[torch.float16], name="fallback")
    if ops.wgmma_unsupported(hopper, x, w13, I, hopper.gate_up.block_n, False) is not None:
        with pytest.raises(ValueError, match="cannot run here"):
            ops.fused_moe_standard(x, ids, w, w13, w2, config=hopper)
    else:  # (an sm_90 GPU with Gluon runs it, explicit or picked)
        explicit = ops.fused_moe_standard(x, ids, w, w13, w2, config=hopper)
        assert_close(explicit, ref, TOLERANCES[torch.float16], name="explicit Hopper config")


def test_deterministic_algorithms_turn_the_atomic_sum_off(monkeypatch):
    """Under ``torch.use_deterministic_algorithms(True)`` a selected config with
    ``atomic_reduce`` runs the fp32 sum pass instead (bitwise equal to the config without
    it); an explicit one is refused with the fix, or warned about with ``warn_only``."""
    R, K, e, H, I = 7, 2, 3, 64, 32
    g = _gen(141)
    x = torch.randn(R, H, generator=g).to(DEVICE)
    w13, w2 = (t.float().to(DEVICE) for t in _weights(e, H, I, seed=142))
    ids = _ids_for("random", R, K, e, seed=143).to(DEVICE)
    w = torch.rand(R, K, generator=g).to(DEVICE)
    ran = []
    real = ops.standard_with_config
    monkeypatch.setattr(ops, "standard_with_config", lambda *a: ran.append(a[-1]) or real(*a))
    monkeypatch.setattr(ops, "select_config", lambda *a, **k: SMALL_ATOMIC)
    before = torch.are_deterministic_algorithms_enabled()
    before_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        out = ops.fused_moe_standard(x, ids, w, w13, w2)
        assert ran == [SMALL] and torch.equal(
            out, ops.fused_moe_standard(x, ids, w, w13, w2, config=SMALL)
        )
        with pytest.raises(RuntimeError, match="atomic_reduce=False"):
            ops.fused_moe_standard(x, ids, w, w13, w2, config=SMALL_ATOMIC)
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning, match="use_deterministic_algorithms"):
            summed = ops.fused_moe_standard(x, ids, w, w13, w2, config=SMALL_ATOMIC)
        assert_close(summed, out, 1e-5, name="atomic sum, warned")
    finally:
        torch.use_deterministic_algorithms(before, warn_only=before_warn_only)
    if not before:
        ran.clear()
        ops.fused_moe_standard(x, ids, w, w13, w2)
        assert ran == [SMALL_ATOMIC]


def test_atomic_reduce_round_trips_and_is_a_candidate():
    """``atomic_reduce`` survives ``to_dict`` / ``from_dict`` (the tables), shows in
    ``short()``, is among the autotuner's Hopper candidates of the Standard layout, and a
    sum pass over GEMM 2's summed output is refused rather than read out of bounds."""
    cfg = dataclasses.replace(configs.wgmma_config("bf16", "wgmma_ws", 192), atomic_reduce=True)
    assert MoEConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg.short().endswith("+ wgmma_ws") and "+" not in SMALL.short()
    for dtype in ("bf16", "fp8"):
        cands = configs.candidate_configs("standard", dtype, 4096, 7168, 2048, 128, 8)
        assert any(c.atomic_reduce for c in cands)
        batched = configs.candidate_configs("batched", dtype, 256, 7168, 2048, 128, 8)
        assert not any(c.atomic_reduce for c in batched)
    ids = torch.tensor([[0, 1], [1, -1], [0, 0]], device=DEVICE)
    aligned = ops.align_pairs(ids, 2, 16)
    R, H = ids.shape[0], 32
    with pytest.raises(ValueError, match="atomic_reduce"):
        ops.sum_topk(torch.zeros(R, H, device=DEVICE), aligned, torch.float32)


def test_config_tables_and_heuristics(monkeypatch, tmp_path):
    cfg = MoEConfig(64, GemmConfig(128, 64, 8, 4, 4), GemmConfig(128, 64, 8, 4, 4))
    assert MoEConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="block_m"):
        MoEConfig(48, cfg.gate_up, cfg.down)
    with pytest.raises(ValueError, match="block_n"):
        GemmConfig(100, 64)
    assert configs.table_filename("NVIDIA H200") == "NVIDIA_H200.json"
    assert configs.load_table("no such device 0") == {}
    key = configs.problem_key("standard", "bf16", 7168, 2048, 128)
    small = MoEConfig(16, cfg.gate_up, cfg.down)
    table = {key: {64: small, 4096: cfg}}
    assert configs.lookup(table, key, 3000) is cfg
    assert configs.lookup(table, key, 100) is small
    assert configs.lookup(table, "other", 100) is None

    monkeypatch.setenv(configs.AUTOTUNE_ENV, "0")
    assert not configs.autotune_enabled()
    monkeypatch.setenv(configs.AUTOTUNE_ENV, "1")
    assert configs.autotune_enabled()

    for dtype, nbytes in (("bf16", 2), ("fp16", 2), ("fp8", 1), ("fp32", 4)):
        for layout, m in (("standard", 1), ("standard", 4096), ("batched", 8), ("batched", 256)):
            cands = configs.candidate_configs(layout, dtype, m, 7168, 2048, 128, 8)
            for c in cands:
                configs.check_config(c, dtype == "fp8")
                assert configs.smem_bytes(c, nbytes, nbytes) <= 227 * 1024, c
    cpu = configs.select_config("standard", torch.float32, 10, 64, 32, 4, 2, torch.device("cpu"))
    assert cpu == configs.heuristic_config("standard", "fp32", 10, 64, 32, 4, 2, "cpu")


def test_shipped_tables_are_valid():
    from importlib import resources

    folder = resources.files("epmoe.kernels").joinpath("configs")
    files = [f for f in folder.iterdir() if f.name.endswith(".json")] if folder.is_dir() else []
    for f in files:
        raw = json.loads(f.read_text())
        for key, by_m in raw["configs"].items():
            layout, dtype = key.split(":")[:2]
            assert layout in configs.LAYOUTS, f"{f.name}: {key}"
            for m, c in by_m.items():
                configs.check_config(MoEConfig.from_dict(c), dtype == "fp8")
                assert int(m) > 0


def test_h200_table_ships_the_benchmark_shapes():
    """The table measured on one H200 (2026-11-29) loads for the device name torch reports
    and covers the prefill and decode shapes of the benchmark in bf16 and FP8."""
    table = configs.load_table("NVIDIA H200")
    for layout, m in (("standard", 4096), ("batched", 256)):
        for dtype in ("bf16", "fp8"):
            key = configs.problem_key(layout, dtype, 7168, 2048, 128)
            cfg = configs.lookup(table, key, m)
            assert cfg is not None, key
            configs.check_config(cfg, dtype == "fp8")
            assert (
                configs.smem_bytes(cfg, 1 if dtype == "fp8" else 2, 1 if dtype == "fp8" else 2)
                <= 227 * 1024
            )


def test_slab_blocks_stand_in_for_the_counts():
    """ExpertBatched GEMMs take ``slab_blocks(counts, C, block_m)`` as their rows (one block
    table for both GEMMs on the Hopper kernel): the same output as the counts on the
    portable kernels, and a table built for another C or block_m is refused with the fix."""
    e, C, H, I = 3, 8, 64, 32
    torch.manual_seed(3)
    x = torch.randn(e, C, H, device=DEVICE)
    w13 = torch.randn(e, 2 * I, H, device=DEVICE) * H**-0.5
    counts = torch.tensor([3, 0, 8], dtype=torch.int32, device=DEVICE)
    y_counts, _ = ops.gate_up(x, w13, counts, SMALL)
    y_slabs, _ = ops.gate_up(x, w13, ops.slab_blocks(counts, C, SMALL.block_m), SMALL)
    for i, n in enumerate(counts.tolist()):
        assert torch.equal(y_slabs[i, :n], y_counts[i, :n])
    with pytest.raises(ValueError, match=r"built for C=16.*slab_blocks\(counts, C, config"):
        ops.gate_up(x, w13, ops.slab_blocks(counts, 16, SMALL.block_m), SMALL)
    with pytest.raises(ValueError, match=r"block_m=64"):
        ops.gate_up(x, w13, ops.slab_blocks(counts, C, 64), SMALL)


def test_the_step_functions_check_their_operands():
    """``gate_up`` / ``down`` are public entry points: an unknown activation, activations
    whose columns are not the weights' K, scales of another shape and router weights that
    are not one per pair are refused before a launch (a launch would read past rows, or
    silently run gelu for any other name)."""
    e, C, H, I, R, K = 2, 4, 64, 32, 3, 2
    x = torch.randn(e, C, H, device=DEVICE)
    w13 = torch.randn(e, 2 * I, H, device=DEVICE)
    w2 = torch.randn(e, H, I, device=DEVICE)
    counts = torch.tensor([2, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="activation"):
        ops.gate_up(x, w13, counts, SMALL, activation="relu")
    with pytest.raises(ValueError, match=r"x has 32 columns, but w13 \[2, 64, 64\] takes 64"):
        ops.gate_up(x[..., : H // 2], w13, counts, SMALL)
    xq, xs = quantize_groups(x)
    q13, s13 = quantize_block(w13)
    with pytest.raises(ValueError, match=r"the scales of x \[2, 4, 64\] must be \[2, 4, 1\]"):
        ops.gate_up(xq, q13, counts, SMALL_FP8, "silu", xs[:, :2], s13)
    h = torch.randn(e, C, I, device=DEVICE)
    with pytest.raises(ValueError, match=r"h has 64 columns, but w2 \[2, 64, 32\] takes 32"):
        ops.down(torch.randn(e, C, H, device=DEVICE), w2, counts, SMALL, torch.float32)
    ids = torch.tensor([[0, 1], [1, -1], [0, 0]], device=DEVICE)
    aligned = ops.align_for(ids, e, SMALL)
    h_std = torch.randn(aligned.num_blocks * SMALL.block_m, I, device=DEVICE)
    w_RK = torch.rand(R, K, device=DEVICE)
    with pytest.raises(ValueError, match=r"topk_weights_RK must be \[R, K\] = \[3, 2\]"):
        ops.down(h_std, w2, aligned, SMALL, torch.float32, topk_weights_RK=w_RK[:1, :1])
    ops.down(h_std, w2, aligned, SMALL, torch.float32, topk_weights_RK=w_RK)
    ops.down(h, w2, counts, SMALL, torch.float32)
    # the rows' extent against the pairs and the weights (a review ran each out of bounds:
    # rows read past x, past w13's experts; down's output written past its end)
    with pytest.raises(ValueError, match=r"x must hold the R=3 rows the pairs were aligned for"):
        ops.gate_up(torch.randn(2, H, device=DEVICE), w13, aligned, SMALL)
    with pytest.raises(ValueError, match=r"h must be gate_up's rows by padded position"):
        ops.down(h_std[:4], w2, aligned, SMALL, torch.float32, topk_weights_RK=w_RK)
    with pytest.raises(ValueError, match=r"pairs aligned for e=3 experts, the weights hold e=2"):
        ops.gate_up(torch.randn(R, H, device=DEVICE), w13, ops.align_for(ids, 3, SMALL), SMALL)
    with pytest.raises(ValueError, match=r"ExpertBatched rows must be \[e=2, C, columns\]"):
        ops.gate_up(x[:1], w13, counts, SMALL)
    with pytest.raises(TypeError, match="out_dtype must be one of"):
        ops.down(h, w2, counts, SMALL, torch.int32)
    # scales are float32 (an fp16 scale floor flushes to 0: 0/0 rescaled to silent zeros),
    # weights a compute dtype or e4m3
    with pytest.raises(TypeError, match="x's scales must be float32, got torch.float16"):
        ops.gate_up(xq, q13, counts, SMALL_FP8, "silu", xs.half(), s13)
    with pytest.raises(TypeError, match="w13 must be one of"):
        ops.gate_up(x.to(torch.float8_e5m2), w13.to(torch.float8_e5m2), counts, SMALL)
    # an expert's rows spanning 2**31 elements (int32 row offsets in the kernels)
    wide = torch.empty_strided((2, 4, 64), (64, 2**30, 1), device="meta")
    with pytest.raises(ValueError, match="one expert's rows span 2\\*\\*31 elements or more"):
        ops._check_operands(torch.empty(3, 64, device="meta"), wide, None, None, ("x", "w13"))


def test_sum_topk_takes_rows_of_any_column_stride():
    ids = torch.tensor([[0, 1], [1, -1], [0, 0]], device=DEVICE)
    aligned = ops.align_for(ids, 2, SMALL)
    y = torch.randn(aligned.sorted_pairs.shape[0], 2 * 16, device=DEVICE)
    want = ops.sum_topk(y[:, ::2].contiguous(), aligned, torch.float32)
    torch.testing.assert_close(ops.sum_topk(y[:, ::2], aligned, torch.float32), want)


def test_sort_scales_lays_gemm1_fp8_scales_out_by_position():
    """``ops.sort_scales`` (the Hopper kernel's FP8 GEMM 1 reads its rows' scales so):
    ``[G, P_pad]`` with each position's pair's row scales, 1 at the padding."""
    R, K, e, G = 50, 3, 5, 9
    ids = _ids_for("random", R, K, e, seed=94).to(DEVICE)
    xs = torch.rand(G, R, generator=_gen(95)).to(DEVICE).T  # (column-major, as some give)
    aligned = ops.align_pairs(ids, e, 192, True, 64)
    out = ops.sort_scales(xs, aligned).cpu()
    n = int(aligned.num_padded)
    pairs = aligned.sorted_pairs[:n].long().cpu()
    valid = pairs < R * K
    assert out.shape == (G, aligned.sorted_pairs.shape[0])
    assert torch.equal(out[:, :n][:, valid], xs.cpu()[pairs[valid] // K].T)
    assert bool((out[:, :n][:, ~valid] == 1).all())
    with pytest.raises(ValueError, match=r"x_scale must be \[R=50, G\]"):
        ops.sort_scales(xs[:40], aligned)


def test_align_pairs_refuses_a_padding_that_no_kernel_runs():
    """``pad_m`` must divide ``block_m``, and a padding below it means tail blocks."""
    ids = torch.zeros(4, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="pad_m must divide block_m"):
        ops.align_pairs(ids, 2, 192, True, 50)
    with pytest.raises(ValueError, match="pass half_tail=True"):
        ops.align_pairs(ids, 2, 192, False, 64)
    assert ops.align_pairs(ids, 2, 192, False, 192).pad_m == 192
