"""EPMoE in one process (no torch.distributed): construction checks, moves, forward hints."""

from __future__ import annotations

import pytest
import torch

import epmoe
from epmoe.reference import assert_close


def layer_and_weights(**kwargs):
    E, K, H, I = 8, 2, 16, 8
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) / 4, torch.randn(E, H, I, generator=g) / 3
    layer = epmoe.EPMoE(E, K, H, I, params_dtype=torch.float32, device="cpu", **kwargs)
    layer.load_experts(w13, w2)
    return layer, w13, w2


def test_moving_the_layer_is_refused_before_anything_moves():
    layer, *_ = layer_and_weights()
    layer.to("cpu").float()  # no change: allowed
    with pytest.raises(RuntimeError, match="params_dtype"):
        layer.half()
    with pytest.raises(RuntimeError, match="params_dtype"):
        torch.nn.Sequential(torch.nn.Linear(2, 2), layer).to(torch.bfloat16)
    assert layer.w13.dtype == torch.float32 and layer.w2.dtype == torch.float32


@pytest.mark.parametrize("T", [0, 5, 13], ids=["T=0", "T=5", "T=13 (chunks)"])
def test_max_tokens_across_ranks_hint_gives_the_same_output(T):
    layer, w13, w2 = layer_and_weights(max_num_tokens=4)
    x, logits = torch.randn(T, 16), torch.randn(T, 8)
    ref = epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, 2))
    assert_close(layer(x, logits, max_tokens_across_ranks=max(T, 1)), ref, 1e-5)


def test_a_hint_below_this_ranks_tokens_is_refused():
    layer, *_ = layer_and_weights()
    with pytest.raises(ValueError, match="max_tokens_across_ranks=4 is below"):
        layer(torch.randn(5, 16), torch.randn(5, 8), max_tokens_across_ranks=4)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(max_num_tokens=4.5), ValueError, "max_num_tokens"),
        (dict(scoring_func="softplus"), ValueError, "scoring_func"),
        (dict(layout="batched"), ValueError, "layout"),
        (dict(activation="relu"), ValueError, "activation"),
        (dict(placement="random"), ValueError, "placement"),
        (dict(params_dtype=torch.int32), TypeError, "params_dtype"),
    ],
    ids=["fractional M_max", "unknown scoring", "unknown layout", "unknown activation",
         "unknown placement", "integer params_dtype"],
)  # fmt: skip
def test_construction_rejects_bad_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        epmoe.EPMoE(8, 2, 16, 8, device="cpu", **{"params_dtype": torch.float32, **kwargs})


def test_inputs_on_another_dtype_are_cast_and_returned_in_it():
    layer, w13, w2 = layer_and_weights()
    x, logits = torch.randn(6, 16, dtype=torch.float64), torch.randn(6, 8)
    out = layer(x, logits)
    assert out.dtype == torch.float64
    ref = epmoe.reference.moe(x.float(), w13, w2, *epmoe.select_experts(logits, 2))
    assert_close(out.float(), ref, 1e-5)
