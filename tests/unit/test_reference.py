"""Tests of epmoe.reference, the oracle every other test trusts: moe against a per-token
formula, -1 skipping, router weight on input, gelu, FP8 dequantization, and the error
helpers.

Shape legend: T tokens · H hidden · I intermediate · E experts · K top-k.
"""

from __future__ import annotations

import math

import pytest
import torch

from epmoe import reference
from epmoe.reference import (
    TOLERANCES,
    assert_close,
    dequantize_block,
    expert_mlp,
    moe,
    quantize_block,
    quantize_groups,
    relative_error,
)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def _rand(*shape, seed=0, scale=1.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)


def _problem(T=6, H=8, I=5, E=4, K=2, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed + 100)
    x = _rand(T, H, seed=seed, dtype=dtype)
    w13 = _rand(E, 2 * I, H, seed=seed + 1, scale=H**-0.5, dtype=dtype)
    w2 = _rand(E, H, I, seed=seed + 2, scale=I**-0.5, dtype=dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g, dtype=torch.float64) + 0.1
    return x, w13, w2, w, ids


def formula(x, w13, w2, w, ids, activation="silu", on_input=False):
    """Per token and per k, the textbook formula written out in float64."""
    x, w13, w2, w = x.double(), w13.double(), w2.double(), w.double()
    T, H = x.shape
    I = w2.shape[2]
    out = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0:
                continue
            xin = x[t] * w[t, k] if on_input else x[t]
            gate = w13[e, :I] @ xin
            up = w13[e, I:] @ xin
            if activation == "silu":
                act = gate / (1.0 + torch.exp(-gate))
            else:
                act = 0.5 * gate * (1.0 + torch.erf(gate / math.sqrt(2.0)))
            y = w2[e] @ (act * up)
            out[t] += y if on_input else w[t, k] * y
    return out


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize(
    "T, H, I, E, K",
    [
        pytest.param(6, 8, 5, 4, 2, id="small"),
        pytest.param(1, 16, 3, 3, 3, id="one-token-K=E"),
        pytest.param(9, 7, 11, 5, 1, id="odd-sizes-K=1"),
    ],
)
def test_moe_matches_formula(activation, T, H, I, E, K):
    x, w13, w2, w, ids = _problem(T, H, I, E, K)
    out = moe(x, w13, w2, w, ids, activation=activation)
    assert out.dtype == torch.float64 and out.shape == (T, H)
    assert_close(out, formula(x, w13, w2, w, ids, activation), rtol=1e-12)


def test_gelu_and_silu_differ():
    x, w13, w2, w, ids = _problem()
    assert relative_error(moe(x, w13, w2, w, ids, "gelu"), moe(x, w13, w2, w, ids, "silu")) > 1e-3


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float16, torch.bfloat16],
)
def test_low_precision_inputs_computed_in_float64(dtype):
    x, w13, w2, w, ids = _problem(dtype=dtype)
    out = moe(x, w13, w2, w.float(), ids.to(torch.int32))
    assert out.dtype == dtype
    # Exact formula on the same (rounded) inputs, then one rounding to dtype.
    expected = formula(x, w13, w2, w.float(), ids).to(dtype)
    assert torch.equal(out, expected)


def test_compute_dtype_float32_is_close_to_float64():
    x, w13, w2, w, ids = _problem(dtype=torch.float32)
    out32 = moe(x, w13, w2, w, ids, compute_dtype=torch.float32)
    assert_close(out32, moe(x, w13, w2, w, ids), rtol=TOLERANCES[torch.float32])


def test_minus_one_ids_are_skipped():
    x, w13, w2, w, ids = _problem(T=5, E=4, K=3)
    ids[0, 1] = -1
    ids[2, :] = -1  # no expert at all: row 2 must be zero
    ids[4, 0] = -1
    out = moe(x, w13, w2, w, ids)
    assert_close(out, formula(x, w13, w2, w, ids), rtol=1e-12)
    assert torch.equal(out[2], torch.zeros(x.shape[1], dtype=out.dtype))
    assert bool((out[[0, 1, 3, 4]].abs().sum(-1) > 0).all())


def test_apply_router_weight_on_input():
    x, w13, w2, w, ids = _problem(K=2)
    out = moe(x, w13, w2, w, ids, apply_router_weight_on_input=True)
    assert_close(out, formula(x, w13, w2, w, ids, on_input=True), rtol=1e-12)
    # The MLP is not homogeneous, so the two placements of the weight really differ.
    assert relative_error(out, moe(x, w13, w2, w, ids)) > 1e-3


def test_duplicate_experts_in_one_row_both_count():
    x, w13, w2, w, _ = _problem(T=3, K=2)
    ids = torch.tensor([[1, 1], [0, 2], [3, 3]])
    assert_close(moe(x, w13, w2, w, ids), formula(x, w13, w2, w, ids), rtol=1e-12)


def test_zero_tokens():
    _, w13, w2, _, _ = _problem()
    out = moe(
        torch.empty(0, 8, dtype=torch.bfloat16),
        w13,
        w2,
        torch.empty(0, 2),
        torch.empty(0, 2, dtype=torch.long),
    )
    assert out.shape == (0, 8) and out.dtype == torch.bfloat16


def test_expert_mlp_matches_formula():
    x, w13, w2, _, _ = _problem(T=4)
    for act in ("silu", "gelu"):
        y = expert_mlp(x, w13[2], w2[2], act)
        ones = torch.ones(4, 1, dtype=torch.float64)
        ids = torch.full((4, 1), 2)
        assert_close(y, formula(x, w13, w2, ones, ids, act), rtol=1e-12)


@pytest.mark.parametrize(
    "x_shape, w13_shape, w2_shape, w13_dtype, err, match",
    [
        pytest.param((6, 8), (10, 8), (8, 4), torch.float64, ValueError, r"\[8, 5\]",
                     id="w2-wrong-I"),
        pytest.param((6, 7), (10, 8), (8, 5), torch.float64, ValueError, r"\[2I, 7\]",
                     id="H-mismatch"),
        pytest.param((6, 8), (9, 8), (8, 5), torch.float64, ValueError, "even", id="odd-2I"),
        pytest.param((6, 8), (10, 8, 1), (8, 5), torch.float64, ValueError, "w13_e",
                     id="3d-w13"),
        pytest.param((6, 8), (10, 8), (8, 5), torch.float32, TypeError, "one dtype",
                     id="dtype-mismatch"),
    ],
)  # fmt: skip
def test_expert_mlp_validation(x_shape, w13_shape, w2_shape, w13_dtype, err, match):
    x, w13, w2 = _rand(*x_shape), _rand(*w13_shape, dtype=w13_dtype), _rand(*w2_shape)
    with pytest.raises(err, match=match):
        expert_mlp(x, w13, w2)
    with pytest.raises(ValueError, match="activation"):
        expert_mlp(_rand(6, 8), _rand(10, 8), _rand(8, 5), "relu")


# --------------------------------------------------------------------------------------
# FP8
# --------------------------------------------------------------------------------------


def _quantize_block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-128×128-block FP8 quantization written out with loops (test-side oracle)."""
    E, N, M = w.shape
    nb, mb = math.ceil(N / block), math.ceil(M / block)
    scale = torch.empty(E, nb, mb, dtype=torch.float32)
    q = torch.empty(E, N, M, dtype=FP8)
    for e in range(E):
        for i in range(nb):
            for j in range(mb):
                tile = w[e, i * block : (i + 1) * block, j * block : (j + 1) * block].float()
                s = tile.abs().max().clamp_min(1e-12) / FP8_MAX
                scale[e, i, j] = s
                q[e, i * block : (i + 1) * block, j * block : (j + 1) * block] = (tile / s).to(FP8)
    return q, scale


def test_dequantize_block_elementwise():
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(2, 200, 300, generator=g) * 50).to(FP8)
    scale = torch.rand(2, 2, 3, generator=g) + 0.5
    out = dequantize_block(q, scale, dtype=torch.float64)
    assert out.shape == (2, 200, 300) and out.dtype == torch.float64
    for e, n, m in [(0, 0, 0), (1, 127, 128), (0, 128, 127), (1, 199, 299), (0, 150, 256)]:
        expected = float(q[e, n, m].double()) * float(scale[e, n // 128, m // 128])
        assert float(out[e, n, m]) == pytest.approx(expected, rel=1e-6)
    # Per-matrix [E] scales, a plain float and None.
    per_e = torch.tensor([2.0, 3.0])
    torch.testing.assert_close(dequantize_block(q, per_e), q.float() * per_e[:, None, None])
    torch.testing.assert_close(dequantize_block(q, 0.5), q.float() * 0.5)
    torch.testing.assert_close(dequantize_block(q, None), q.float())


@pytest.mark.parametrize("shape", [(2, 256, 128), (3, 200, 300)], ids=["whole", "partial"])
def test_quantize_block_matches_the_loop_oracle(shape):
    w = _rand(*shape, seed=11, dtype=torch.float32)  # the loop oracle computes in float32
    q, s = quantize_block(w)
    q_ref, s_ref = _quantize_block(w)
    assert s.dtype == torch.float32 and torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    q, s = quantize_block(w, per_matrix=True)
    assert s.shape == (shape[0],)
    torch.testing.assert_close(s, w.abs().amax(dim=(1, 2)) / FP8_MAX)
    assert relative_error(dequantize_block(q, s, dtype=torch.float64), w) < 4e-2


def test_quantize_block_of_an_all_zero_expert_is_zero_not_nan():
    """An all-zero matrix (or tile) quantizes to zeros with the smallest scale, 1e-10 / 448:
    its amax is floored, not divided by (a 0/0 would give NaN weights)."""
    w = _rand(2, 200, 300, seed=13, dtype=torch.float32)
    w[1] = 0.0
    eps_scale = torch.tensor(1e-10 / FP8_MAX, dtype=torch.float32)
    for per_matrix in (True, False):
        q, s = quantize_block(w, per_matrix=per_matrix)
        assert torch.equal(q[1].float(), torch.zeros(200, 300)), per_matrix
        assert torch.equal(s[1], eps_scale.expand_as(s[1])), per_matrix
        assert torch.isfinite(dequantize_block(q, s)).all()


def test_quantize_groups_scales_and_round_trip():
    x = _rand(5, 300, seed=12)  # 3 groups, the last partial
    q, s = quantize_groups(x)
    assert q.shape == x.shape and q.dtype == FP8 and s.shape == (5, 3)
    amax = torch.stack([x[:, g * 128 : (g + 1) * 128].abs().amax(1) for g in range(3)], 1)
    torch.testing.assert_close(s.double(), amax / FP8_MAX, rtol=1e-6, atol=0)
    deq = q.double() * s.double().repeat_interleave(128, dim=-1)[:, :300]
    assert relative_error(deq, x) < 4e-2


def test_dequantize_block_rejects_bad_scale_shape():
    q = torch.zeros(2, 200, 300).to(FP8)
    with pytest.raises(ValueError, match=r"\(2, 2, 3\)"):
        dequantize_block(q, torch.ones(2, 3, 3))


@pytest.mark.parametrize(
    "H, I",
    [pytest.param(256, 128, id="whole-blocks"), pytest.param(200, 72, id="partial-blocks")],
)
def test_fp8_block_round_trip_and_moe(H, I):
    E, T, K = 3, 5, 2
    _, _, _, w, ids = _problem(T=T, H=H, I=I, E=E, K=K)
    x = _rand(T, H, seed=3, dtype=torch.bfloat16)
    w13 = _rand(E, 2 * I, H, seed=4, scale=H**-0.5)
    w2 = _rand(E, H, I, seed=5, scale=I**-0.5)
    q13, s13 = _quantize_block(w13)
    q2, s2 = _quantize_block(w2)
    assert s13.shape == (E, math.ceil(2 * I / 128), math.ceil(H / 128))
    assert s2.shape == (E, math.ceil(H / 128), math.ceil(I / 128))
    # Round trip: e4m3 has 3 mantissa bits, so each element is within 2^-4 relative.
    assert relative_error(dequantize_block(q13, s13, dtype=torch.float64), w13) < 4e-2
    # moe on FP8 + scales == moe on the dequantized weights, and close to the fp64 weights.
    out = moe(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2)
    assert out.dtype == torch.bfloat16
    deq = moe(
        x,
        dequantize_block(q13, s13, dtype=torch.float64),
        dequantize_block(q2, s2, dtype=torch.float64),
        w,
        ids,
    )
    assert torch.equal(out, deq)
    assert_close(out, moe(x, w13, w2, w, ids), rtol=TOLERANCES[FP8])


def test_fp8_per_expert_scale():
    x, w13, w2, w, ids = _problem(H=16, I=8)
    s13 = (w13.abs().amax(dim=(1, 2)) / FP8_MAX).float()
    s2 = (w2.abs().amax(dim=(1, 2)) / FP8_MAX).float()
    q13 = (w13 / s13[:, None, None]).to(FP8)
    q2 = (w2 / s2[:, None, None]).to(FP8)
    out = moe(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2)
    s13, s2 = s13.double()[:, None, None], s2.double()[:, None, None]
    expected = formula(x, q13.double() * s13, q2.double() * s2, w, ids)
    assert_close(out, expected, rtol=1e-12)
    assert_close(out, moe(x, w13, w2, w, ids), rtol=TOLERANCES[FP8])


# --------------------------------------------------------------------------------------
# moe validation
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mutate, err, match",
    [
        pytest.param(lambda a: a.update(hidden_states=a["hidden_states"][0]), ValueError,
                     r"\[T, H\]", id="1d-hidden"),
        pytest.param(lambda a: a.update(w13=a["w13"][0]), ValueError, r"\[E, 2I, H\]",
                     id="2d-w13"),
        pytest.param(lambda a: a.update(w13=a["w13"][:, :9]), ValueError, "even",
                     id="odd-2I"),
        pytest.param(lambda a: a.update(w2=a["w2"][:, :, :4]), ValueError, "w2",
                     id="w2-wrong-I"),
        pytest.param(lambda a: a.update(w2=a["w2"][:3]), ValueError, "w2", id="w2-wrong-E"),
        pytest.param(lambda a: a.update(hidden_states=a["hidden_states"][:, :7]), ValueError,
                     "H=7", id="H-mismatch"),
        pytest.param(lambda a: a.update(topk_ids=a["topk_ids"][:3]), ValueError, "topk_ids",
                     id="ids-wrong-T"),
        pytest.param(lambda a: a.update(topk_weights=a["topk_weights"][:, :1]), ValueError,
                     "same", id="weights-wrong-K"),
        pytest.param(lambda a: a.update(topk_ids=a["topk_ids"].float()), TypeError,
                     "int32 or int64", id="float-ids"),
        pytest.param(lambda a: a.update(topk_ids=a["topk_ids"] + 4), ValueError,
                     r"\[0, 4\)", id="ids-out-of-range"),
        pytest.param(lambda a: a.update(topk_ids=a["topk_ids"] - 3), ValueError,
                     "-1", id="ids-below-minus-one"),
        pytest.param(lambda a: a["topk_ids"].__setitem__((0, 0), -2), ValueError,
                     "-1", id="one-id-of-minus-two"),
        pytest.param(lambda a: a.update(activation="relu"), ValueError, "activation",
                     id="bad-activation"),
        pytest.param(lambda a: a.update(w13_scale=torch.ones(4, 2, 2)), ValueError,
                     "block scales", id="bad-scale-shape"),
    ],
)  # fmt: skip
def test_moe_validation(mutate, err, match):
    x, w13, w2, w, ids = _problem()
    args = dict(hidden_states=x, w13=w13, w2=w2, topk_weights=w, topk_ids=ids)
    mutate(args)
    with pytest.raises(err, match=match):
        moe(**args)


# --------------------------------------------------------------------------------------
# relative_error / assert_close / TOLERANCES
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "out, ref, expected",
    [
        pytest.param([3.0, 4.5], [3.0, 4.0], 0.1, id="known-value"),
        pytest.param([3.0, 4.0], [3.0, 4.0], 0.0, id="equal"),
        pytest.param([], [], 0.0, id="empty"),
        pytest.param([0.0, 0.0], [0.0, 0.0], 0.0, id="both-zero"),
        pytest.param([1e-30, 0.0], [0.0, 0.0], math.inf, id="zero-ref"),
        pytest.param([float("nan"), 1.0], [1.0, 1.0], math.inf, id="nan-in-out"),
        pytest.param([1.0, 1.0], [1.0, float("nan")], math.inf, id="nan-in-ref"),
        pytest.param([float("inf"), 1.0], [1.0, 1.0], math.inf, id="inf-in-out"),
    ],
)
def test_relative_error(out, ref, expected):
    got = relative_error(torch.tensor(out), torch.tensor(ref))
    assert isinstance(got, float)
    assert got == pytest.approx(expected, rel=1e-6) if math.isfinite(expected) else got == expected


def test_relative_error_mixed_dtypes_and_shape_check():
    ref = _rand(4, 8)
    assert relative_error(ref.to(torch.bfloat16), ref) < 1e-2
    with pytest.raises(ValueError, match="equal shapes"):
        relative_error(ref[:3], ref)


def test_assert_close_passes_and_reports_worst_row():
    ref = _rand(6, 16, seed=9)
    out = ref.clone()
    out[:, 0] += 1e-12
    assert_close(out, ref, rtol=1e-10)
    out[3, 5] += 1.0
    out[1, 2] += 0.1
    with pytest.raises(AssertionError) as info:
        assert_close(out, ref, rtol=1e-3, name="case-x")
    msg = str(info.value)
    assert msg.startswith("case-x: relative error")
    assert "worst row 3" in msg and "(6, 16)" in msg and "rtol 1.0e-03" in msg
    assert f"{relative_error(out, ref):.3e}" in msg


def test_assert_close_row_rtol_finds_one_wrong_row_among_many():
    ref = _rand(2733, 64, seed=4)
    out = ref * (1 + 1e-3 * _rand(2733, 64, seed=5))
    out[1000] = _rand(1, 64, seed=6)[0]  # one row wholly wrong: 1/√2733 of the whole
    assert relative_error(out, ref) < 0.03  # the whole does not see it; each row's check does
    with pytest.raises(AssertionError, match=r"row 1000 is off on its own: .* > 8 \* rtol"):
        assert_close(out, ref, rtol=0.03)
    with pytest.raises(AssertionError, match=r"row 1000's relative error .* > row_rtol 4\.0e-03"):
        assert_close(out, ref, rtol=0.03, row_rtol=4e-3)
    out[1000] = ref[1000]
    assert_close(out, ref, rtol=0.03, row_rtol=4e-3)
    zeros = torch.zeros(3, 4, dtype=torch.float64)
    assert_close(zeros, zeros, rtol=0.0, row_rtol=0.0)  # (zero rows of the reference)
    assert_close(torch.empty(0, 4), torch.empty(0, 4), rtol=0.0, row_rtol=0.0)


def test_assert_close_row_floor_is_the_rows_rms_not_the_largest_row():
    """One large row among 100 unit rows: a wrong unit row (error 0.1) is within rtol of
    the whole and of the large row's norm, but 8 * rtol off against the rows' RMS norm
    (≈ 10), which is the documented floor: the check must fail."""
    ref = torch.zeros(100, 4, dtype=torch.float64)
    ref[:, 0] = 1.0
    ref[0, 0] = 100.0
    out = ref.clone()
    out[5, 1] = 0.1
    assert relative_error(out, ref) < 1e-3
    with pytest.raises(AssertionError, match=r"row 5 is off on its own"):
        assert_close(out, ref, rtol=1e-3)


def test_assert_close_checks_each_row_by_default_but_not_near_zero_rows_noise():
    """A zeroed row (a tile's rows never written) among 842 passed the default check of
    the whole at FP8's tolerance; each row is now checked against the larger of its norm
    and the rows' RMS norm. Rows far smaller than the rest keep their absolute error."""
    ref = _rand(842, 64, seed=1)
    out = ref * (1 + 0.03 * _rand(842, 64, seed=2))  # about 3 % everywhere
    ref[7] *= 1e-6  # a near-zero row, its error relative to itself huge
    out[7] = ref[7] + 0.03 * _rand(1, 64, seed=3)[0]
    assert_close(out, ref, rtol=0.06)
    out[841] = 0.0
    with pytest.raises(AssertionError, match="row 841 is off on its own"):
        assert_close(out, ref, rtol=0.06)
    assert_close(out[841:], ref[841:] * 0, rtol=0.0)  # one row: the whole is the row


def test_block_sizes_are_positive_ints():
    from epmoe.reference import dequantize_block, quantize_block

    w = torch.randn(1, 4, 4)
    for bad in (0, 64.9, True, "128"):
        with pytest.raises(ValueError, match="block must be a positive int"):
            quantize_block(w, block=bad)
        with pytest.raises(ValueError, match="block must be a positive int"):
            dequantize_block(w, torch.ones(1, 1, 1), block=bad)


def test_assert_close_nan_shape_and_default_rtol():
    ref = _rand(4, 4).float()
    bad = ref.clone()
    bad[2, 1] = float("nan")
    with pytest.raises(AssertionError, match="worst row 2"):
        assert_close(bad, ref, rtol=1.0)
    with pytest.raises(AssertionError, match="shape mismatch"):
        assert_close(ref[:3], ref, rtol=1.0)
    # Default rtol from TOLERANCES[out.dtype]: bf16 rounding passes, a 10 % error does not.
    assert_close(ref.to(torch.bfloat16), ref)
    with pytest.raises(AssertionError):
        assert_close((ref * 1.1).to(torch.bfloat16), ref)
    assert_close(torch.empty(0, 4), torch.empty(0, 4), rtol=0.0)


def test_tolerances_table():
    assert dict(TOLERANCES) == {
        torch.float64: 1e-10,
        torch.float32: 1e-5,
        torch.float16: 5e-3,
        torch.bfloat16: 2e-2,
        torch.float8_e4m3fn: 6e-2,
    }
    with pytest.raises(TypeError):
        TOLERANCES[torch.float32] = 1.0  # type: ignore[index]


def test_public_names():
    for name in reference.__all__:
        assert hasattr(reference, name)


# --------------------------------------------------------------------------------------
# GPU tier
# --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    x, w13, w2, w, ids = _problem(T=64, H=256, I=128, E=8, K=2, dtype=torch.bfloat16)
    ids[5, 1] = -1
    q13, s13 = _quantize_block(w13.double())
    out_cpu = moe(x, q13, w2, w, ids, w13_scale=s13)
    out_gpu = moe(x.cuda(), q13.cuda(), w2.cuda(), w.cuda(), ids.cuda(), w13_scale=s13.cuda())
    assert out_gpu.device.type == "cuda"
    assert_close(out_gpu.cpu(), out_cpu, rtol=1e-2)
    # Weights left on the CPU are moved to the tokens' device.
    assert_close(moe(x.cuda(), w13, w2, w, ids), moe(x, w13, w2, w, ids), rtol=1e-2)


@pytest.mark.parametrize("H", [128, 160, 300], ids=["whole group", "128+32", "128+128+44"])
def test_torch_experts_dequantize_a_partial_last_group(H):
    """``TorchExperts`` reads FP8 rows with ceil(H/128) scales: the last group may be short."""
    from epmoe.experts.torch_experts import dequantized_hidden

    x = torch.randn(4, 3, H, generator=torch.Generator().manual_seed(H))
    q, s = quantize_groups(x)
    assert s.shape == (4, 3, -(-H // 128))
    got = dequantized_hidden(q, s, torch.float32)
    want = q.float() * s.repeat_interleave(128, -1)[..., :H]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert relative_error(got, x) < 3e-2
