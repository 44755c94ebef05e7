"""EPMoE holding FP8 expert weights (``weight_dtype=torch.float8_e4m3fn``) in one process:
DeepSeek-V3's 128×128 block scales and per-expert scales, loaded as FP8 with their
scales or quantized on load, against the oracle on the dequantised weights; the checks
of what ``load_experts`` / ``load_expert`` accept; state dicts; ``model.to(dtype)``.

Shape legend: E experts · K top-k · H hidden · I intermediate · T tokens."""

from __future__ import annotations

import pytest
import torch

import epmoe
from epmoe.reference import TOLERANCES, assert_close, dequantize_block, moe, quantize_block

FP8 = torch.float8_e4m3fn
E, K, H, I = 6, 2, 160, 256  # H: a partial 128-block in both weights (I: whole ones,
# which block scales need: w13 stacks gate and up rows)


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(
        E, H, I, generator=g
    ) / I**0.5


def _layer(scale="block", **kwargs):
    kwargs.setdefault("experts", "torch")
    kwargs.setdefault("device", "cpu")
    return epmoe.EPMoE(
        E, K, H, I, params_dtype=torch.float32, weight_dtype=FP8, weight_scale=scale, **kwargs
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def _tokens(T=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g), torch.randn(T, E, generator=g)


@pytest.mark.parametrize("scale", ["block", "per_expert"])
def test_quantized_on_load_matches_the_oracle_on_the_dequantised_weights(scale):
    w13, w2 = _weights()
    layer = _layer(scale)
    layer.load_experts(w13, w2)
    assert layer.w13.dtype == layer.w2.dtype == FP8
    want_shape = (E, 4, 2) if scale == "block" else (E,)  # ceil(512/128), ceil(160/128)
    assert tuple(layer.w13_scale.shape) == want_shape
    per = scale == "per_expert"
    q13, s13 = quantize_block(w13, per_matrix=per)
    q2, s2 = quantize_block(w2, per_matrix=per)
    assert torch.equal(layer.w13.view(torch.uint8), q13.view(torch.uint8))
    assert torch.equal(layer.w2_scale, s2)
    x, logits = _tokens()
    out = layer(x, logits)
    w, ids = epmoe.select_experts(logits, K)
    exact = moe(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2)
    assert_close(out, exact, 1e-5, name="against the dequantised oracle")
    assert_close(out, moe(x, w13, w2, w, ids), TOLERANCES[FP8], name="against full precision")


def test_fp8_with_scales_load_as_given_per_expert_too():
    w13, w2 = _weights()
    q13, s13 = quantize_block(w13)
    q2, s2 = quantize_block(w2)
    whole, per_expert = _layer(), _layer()
    whole.load_experts(q13, q2, w13_scale=s13, w2_scale=s2)
    for e in range(E):
        assert per_expert.load_expert(e, q13[e], q2[e], w13_scale=s13[e], w2_scale=s2[e])
    for name in ("w13", "w2", "w13_scale", "w2_scale"):
        assert torch.equal(_bits(getattr(whole, name)), _bits(getattr(per_expert, name))), name
    x, logits = _tokens()
    torch.testing.assert_close(whole(x, logits), per_expert(x, logits), rtol=0, atol=0)
    # one full-precision expert is quantized alone, like the whole tensor
    single = _layer()
    single.load_experts(q13, q2, w13_scale=s13, w2_scale=s2)
    single.load_expert(3, w13[3], w2[3])
    assert torch.equal(single.w13_scale[3], s13[3])


def test_a_full_precision_layer_dequantizes_fp8_weights():
    w13, w2 = _weights()
    q13, s13 = quantize_block(w13, per_matrix=True)
    q2, s2 = quantize_block(w2, per_matrix=True)
    layer = epmoe.EPMoE(E, K, H, I, params_dtype=torch.float32, device="cpu")
    layer.load_experts(q13, q2, w13_scale=s13, w2_scale=s2)
    assert layer.w13.dtype == torch.float32 and layer.w13_scale is None
    torch.testing.assert_close(layer.w13, dequantize_block(q13, s13), rtol=0, atol=0)
    q13b, s13b = quantize_block(w13)  # block scales this time, one expert
    q2b, s2b = quantize_block(w2)
    assert layer.load_expert(2, q13b[2], q2b[2], w13_scale=s13b[2], w2_scale=s2b[2])
    torch.testing.assert_close(layer.w13[2], dequantize_block(q13b[2], s13b[2]), rtol=0, atol=0)
    torch.testing.assert_close(layer.w2[2], dequantize_block(q2b[2], s2b[2]), rtol=0, atol=0)


@pytest.mark.parametrize("I_", [200, 192], ids=["I % 128 > 64", "I % 128 <= 64"])
def test_a_full_precision_layer_refuses_block_scaled_fp8_w13_of_straddling_blocks(I_):
    """With ``I % 128 != 0`` the gate's and up's 128-row blocks straddle in w13 [2I, H]: a
    checkpoint's two scale grids stacked are read on one grid over the stacked rows (above
    64 the shapes even agree, and part of the up rows took the gate's scales). Refused with
    the fix; per-expert scales are unambiguous and still load."""
    g = torch.Generator().manual_seed(0)
    gate, up, w2 = (
        torch.randn(I_, H, generator=g),
        torch.randn(I_, H, generator=g),
        torch.randn(H, I_, generator=g),
    )
    (gq, gs), (uq, us), (dq, ds) = (quantize_block(w[None]) for w in (gate, up, w2))
    gq, gs, uq, us, dq, ds = (t[0] for t in (gq, gs, uq, us, dq, ds))
    layer = epmoe.EPMoE(E, K, H, I_, params_dtype=torch.float32, device="cpu")
    want = r"load_expert: FP8 w13 with block scales needs intermediate_size % 128 == 0 .* gate_proj"
    with pytest.raises(ValueError, match=want):
        layer.load_expert(0, torch.cat([gq, uq]), dq, w13_scale=torch.cat([gs, us]), w2_scale=ds)
    q13, s13 = quantize_block(torch.cat([gate, up])[None], per_matrix=True)
    q2, s2 = quantize_block(w2[None], per_matrix=True)
    layer.load_expert(0, q13[0], q2[0], w13_scale=s13[0], w2_scale=s2[0])
    torch.testing.assert_close(layer.w13[0], dequantize_block(q13, s13)[0], rtol=0, atol=0)


def test_a_float64_layer_computes_fp8_weights_in_float64():
    """FP8 values times float32 scales need more than float32's 24 bits: a float64 layer
    (torch experts) dequantizes in float64, as the oracle does, to float64's tolerance."""
    w13, w2 = _weights()
    layer = epmoe.EPMoE(E, K, H, I, params_dtype=torch.float64, weight_dtype=FP8,
                        device="cpu", experts="torch")  # fmt: skip
    layer.load_experts(w13.double(), w2.double())
    x, logits = _tokens()
    x = x.double()
    d13 = dequantize_block(layer.w13, layer.w13_scale, dtype=torch.float64)
    d2 = dequantize_block(layer.w2, layer.w2_scale, dtype=torch.float64)
    ref = moe(x, d13, d2, *epmoe.select_experts(logits, K))
    assert_close(layer(x, logits), ref, TOLERANCES[torch.float64])


def test_what_loading_refuses():
    w13, w2 = _weights()
    q13, s13 = quantize_block(w13)
    q2, s2 = quantize_block(w2)
    layer = _layer()
    with pytest.raises(ValueError, match="FP8 weights need their scales"):
        layer.load_experts(q13, q2)
    with pytest.raises(ValueError, match="scales belong to FP8 weights"):
        layer.load_experts(w13, w2, w13_scale=s13, w2_scale=s2)
    with pytest.raises(ValueError, match=r"w13_scale must be \[6, 4, 2\] for weight_scale='block'"):
        layer.load_experts(q13, q2, w13_scale=s13[:, :1], w2_scale=s2)
    with pytest.raises(TypeError, match="w2_scale must be a float tensor"):
        layer.load_expert(0, q13[0], q2[0], w13_scale=s13[0], w2_scale=1.0)
    with pytest.raises(TypeError, match="w13 and w2 must have one dtype"):
        layer.load_experts(q13, w2, w13_scale=s13, w2_scale=s2)
    # every expert's scales, checked before this rank's are picked from them
    every = r"w13_scale must hold every expert's scales, \[E = 6, ...\]"
    for wrong, got in ((torch.cat([s13, s13]), r"\[12, 4, 2\]"), (1.0, "1.0"),
                       (torch.tensor(1.0), r"\[\]")):  # fmt: skip
        with pytest.raises(ValueError, match=f"{every} .*got {got}"):
            layer.load_experts(q13, q2, w13_scale=wrong, w2_scale=s2)
    for value in (float("nan"), float("inf"), -1.0):
        bad = s2.clone()
        bad[2, 0, 0] = value
        with pytest.raises(ValueError, match="w2_scale holds 1 negative, NaN or infinite"):
            layer.load_experts(q13, q2, w13_scale=s13, w2_scale=bad)
    assert not layer.weights_loaded  # nothing was half loaded


@pytest.mark.parametrize("experts", ["torch", "triton"])
def test_zero_scales_of_all_zero_blocks_load(experts):
    """A checkpoint's all-zero block has scale 0 (DeepSeek-V3's quantizer has no floor);
    the Triton kernels rescale by ratios of scales, so the layer keeps the floor instead:
    the output is the oracle's on the zero scales (it was NaN or garbage)."""
    w13, w2 = _weights()
    q13, s13 = quantize_block(w13)
    q2, s2 = quantize_block(w2)
    q13[1].zero_()  # a zero expert with zero scales, and one zero block of another
    s13[1].zero_()
    q2[4, :128, :128].zero_()
    s2[4, 0, 0] = 0
    # (the Triton kernels on a GPU where there is one, else under the interpreter)
    device = "cuda" if experts == "triton" and torch.cuda.is_available() else "cpu"
    layer = _layer(experts=experts, device=device)
    layer.load_experts(q13, q2, w13_scale=s13, w2_scale=s2)
    assert float(layer.w13_scale.min()) > 0
    x, logits = _tokens(T=5)
    logits[:, [1, 4]] += 10  # every token to the zero expert and the zero block's
    w, ids = epmoe.select_experts(logits, K)
    want = moe(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2)
    out = layer(x.to(device), logits.to(device)).cpu()
    assert torch.isfinite(out).all()
    # (Triton: W8A8 through the interpreter's FP8 casts, 0.1 here without the zero scales;
    # before the floor the error was 1.0, or NaN)
    assert_close(out, want, 1e-5 if experts == "torch" else 0.2, name=experts)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(weight_dtype=torch.float16), "weight_dtype must be None"),
        (dict(weight_dtype=FP8, weight_scale="tensor"), "weight_scale must be 'block'"),
        (dict(weight_dtype=FP8, intermediate_size=136), "intermediate_size % 128 == 0"),
    ],
)
def test_construction_refuses_other_weight_formats(kwargs, match):
    args = dict(intermediate_size=I, params_dtype=torch.float32, device="cpu") | kwargs
    with pytest.raises(ValueError, match=match):
        epmoe.EPMoE(E, K, H, **args)


def test_a_shard_of_another_weight_dtype_is_refused_not_cast():
    w13, w2 = _weights()
    fp8, plain = _layer(), epmoe.EPMoE(E, K, H, I, params_dtype=torch.float32, device="cpu")
    fp8.load_experts(w13, w2)
    plain.load_experts(w13, w2)
    with pytest.raises(RuntimeError, match="was saved as torch.float8_e4m3fn, this layer holds"):
        plain.load_state_dict(fp8.state_dict(), strict=False)
    with pytest.raises(RuntimeError, match="was saved as torch.float32, this layer holds"):
        fp8.load_state_dict(plain.state_dict(), strict=False)


def test_state_dict_round_trip_and_dtype_conversions_keep_fp8():
    w13, w2 = _weights()
    layer = _layer()
    layer.load_experts(w13, w2)
    state = layer.state_dict()
    assert {"w13", "w2", "w13_scale", "w2_scale"} <= set(state)
    fresh = _layer()
    fresh.load_state_dict(state)
    x, logits = _tokens()
    torch.testing.assert_close(fresh(x, logits), layer(x, logits), rtol=0, atol=0)
    # model.to(dtype) casts every floating tensor; the FP8 weights and their float32
    # scales must come through as they are (the layer's own dtype is float32 here)
    torch.nn.ModuleList([fresh]).to(torch.float32).float()
    assert fresh.w13.dtype == fresh.w2.dtype == FP8
    assert fresh.w13_scale.dtype == fresh.w2_scale.dtype == torch.float32
    torch.testing.assert_close(fresh(x, logits), layer(x, logits), rtol=0, atol=0)


def test_an_fp8_layer_built_on_meta_gets_storage_from_to_empty():
    """FP8 weights and their scales keep their dtype through ``.to()``; on the meta
    device (``init_empty_weights()``) ``to_empty`` must still give them storage, in their
    own dtypes, so that they can be loaded."""
    from epmoe.integrations.huggingface import _parameters_on_meta

    with _parameters_on_meta():
        layer = _layer()
    assert set(layer.meta_slot_tensors()) == {"w13", "w2", "w13_scale", "w2_scale"}
    with pytest.raises(ValueError, match="on the meta device"):
        layer.load_experts(*_weights())
    layer.to_empty(device="cpu")
    assert not layer.meta_slot_tensors() and layer.w13.dtype == FP8
    assert layer.w13_scale.dtype == torch.float32
    w13, w2 = _weights()
    layer.load_experts(w13, w2)
    x, logits = _tokens()
    assert_close(layer(x, logits), moe(x, w13, w2, *epmoe.select_experts(logits, K)),
                 TOLERANCES[FP8])  # fmt: skip
