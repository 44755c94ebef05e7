"""``EPMoE(backend="auto")`` on one GPU: decode-sized steps on ``symm_ll``, larger ones on
``symm_ht`` (chunks of its buffers), both against the oracle.

Shape legend: T tokens · H hidden · I intermediate · E experts · K top-k.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU too; conftest skips the gpu mark
    pytest.skip("needs CUDA", allow_module_level=True)

import epmoe  # noqa: E402
from epmoe.reference import TOLERANCES, assert_close  # noqa: E402
from tests.distributed.cases import full_weights  # noqa: E402

E, K, H, I = 16, 4, 256, 128
BF16 = torch.bfloat16


def test_auto_takes_symm_ll_for_decode_and_symm_ht_for_prefill():
    dev = torch.device("cuda", torch.cuda.current_device())
    usable = epmoe.available_backends(dev)
    if usable["symm_ll"] is not None or usable["symm_ht"] is not None:
        pytest.skip(f"symm backends cannot run here: {usable}")
    layer = epmoe.EPMoE(E, K, H, I, experts="triton", params_dtype=BF16, device=dev)
    assert (layer.comm.name, layer.decode_comm.name) == ("symm_ht", "symm_ll"), repr(layer)
    assert layer.max_num_tokens == 4096 and layer.decode_max_tokens == 256
    w13, w2 = full_weights(E, H, I, BF16, dev, seed=0)
    layer.load_experts(w13, w2)
    g = torch.Generator(device=dev).manual_seed(0)
    for T in (0, 3, 256, 257, 5000):  # decode, decode, the edge, prefill, two chunks
        x = torch.randn(T, H, generator=g, device=dev).to(BF16)
        logits = torch.randn(T, E, generator=g, device=dev)
        ref = epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, K))
        tol = TOLERANCES[BF16]  # (row by row too: a dropped token hides among 5000)
        assert_close(layer(x, logits), ref, tol, name=f"T={T}", row_rtol=tol)
    layer.comm.close()
    layer.decode_comm.close()
