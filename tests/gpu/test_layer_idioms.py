"""GPU tier, one GPU: the PyTorch idioms of ``EPMoE`` on CUDA with each backend that runs
here: ``.to(dtype)`` rebuilds the backend's buffers for the new dtype at the next forward
(against the oracle), a backward raises with the fix, ``copy.deepcopy`` shares the
backend and gives the same output.

Run with ``pytest tests/gpu/test_layer_idioms.py`` (W = 1, no torch.distributed).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU too; conftest skips the gpu mark
    pytest.skip("needs CUDA", allow_module_level=True)

import epmoe  # noqa: E402
from epmoe.reference import TOLERANCES, assert_close  # noqa: E402
from tests.distributed.cases import full_weights, rank_tokens  # noqa: E402

T, E, K, H, I = 24, 16, 4, 256, 128


@pytest.mark.parametrize("backend", ["symm_ll", "symm_ht", "all_to_all"])
def test_idioms_on_cuda(backend):
    dev = torch.device("cuda", torch.cuda.current_device())
    reason = epmoe.available_backends(dev).get(backend, f"{backend!r} is not registered")
    if reason is not None:
        pytest.skip(f"backend {backend!r} cannot run here: {reason}")
    layer = epmoe.EPMoE(
        E, K, H, I, backend=backend, experts="triton", params_dtype=torch.bfloat16, device="cuda"
    )  # fmt: skip
    w13, w2 = full_weights(E, H, I, torch.float32, dev, seed=3)
    layer.load_experts(w13.bfloat16(), w2.bfloat16())
    x, logits = rank_tokens(0, T, H, E, torch.float32, dev, seed=3)

    before = layer.comm
    layer.to(torch.float16)
    assert layer.params_dtype == torch.float16 == layer.w13.dtype
    out = layer(x.half(), logits)
    assert layer.comm is not before and layer.comm.spec.dtype == torch.float16
    ref = epmoe.reference.moe(
        x.half(), w13.bfloat16().half(), w2.bfloat16().half(), *epmoe.select_experts(logits, K)
    )
    assert out.dtype == torch.float16
    assert_close(out, ref, TOLERANCES[torch.float16], name=f"{backend} after .half()")

    twin = copy.deepcopy(layer)
    assert twin.comm is layer.comm and twin.w13.data_ptr() != layer.w13.data_ptr()
    assert_close(twin(x.half(), logits), out, 2e-3, name="deep copy")  # (atomic sums)

    xg = x.half().requires_grad_()
    out = layer(xg, logits)
    with pytest.raises(RuntimeError, match="no backward"):
        out.sum().backward()


@pytest.mark.parametrize("backend", ["symm_ll", "all_to_all"])
def test_a_layer_built_under_a_cuda_default_device_keeps_its_host_tables_on_the_host(backend):
    """Model builders set a default device (``with torch.device("cuda")``,
    ``set_default_device``): the layer's placement, plans and op id stay host tables (a
    CUDA op id would cost a host sync per compiled call), and the layer matches the
    oracle, in a CUDA graph too."""
    dev = torch.device("cuda", torch.cuda.current_device())
    reason = epmoe.available_backends(dev).get(backend, f"{backend!r} is not registered")
    if reason is not None:
        pytest.skip(f"backend {backend!r} cannot run here: {reason}")
    load = torch.arange(1, E + 1, dtype=torch.float64)
    with torch.device("cuda"):
        placement = epmoe.ExpertPlacement.balanced(load, ep_size=1, num_redundant=4)
        layer = epmoe.EPMoE(E, K, H, I, backend=backend, experts="triton", device="cuda",
                            params_dtype=torch.bfloat16, placement=placement)  # fmt: skip
    assert placement.physical_to_logical.device.type == "cpu"
    assert layer._op_id_t.device.type == "cpu"
    w13, w2 = full_weights(E, H, I, torch.float32, dev, seed=5)
    layer.load_experts(w13.bfloat16(), w2.bfloat16())
    x, logits = rank_tokens(0, T, H, E, torch.bfloat16, dev, seed=5)
    ref = epmoe.reference.moe(x, w13.bfloat16(), w2.bfloat16(), *epmoe.select_experts(logits, K))
    assert_close(layer(x, logits), ref, TOLERANCES[torch.bfloat16], name=f"{backend} eager")
    if backend == "symm_ll":
        layer(x, logits, max_tokens_across_ranks=T)  # (warm-up outside the capture)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x, logits, max_tokens_across_ranks=T)
        graph.replay()
        assert_close(out, ref, TOLERANCES[torch.bfloat16], name=f"{backend} graph")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs in one process")
@pytest.mark.parametrize("backend", ["symm_ll", "symm_ht", "all_to_all"])
def test_a_layer_on_another_gpu_than_the_current_one(backend):
    """One process driving two GPUs (a model split with ``device_map="auto"``): a layer on
    cuda:1 called while cuda:0 is current runs its Triton kernels on cuda:1 and matches
    the oracle; the current device is left as it was."""
    dev = torch.device("cuda", 1)
    reason = epmoe.available_backends(dev).get(backend, f"{backend!r} is not registered")
    if reason is not None:
        pytest.skip(f"backend {backend!r} cannot run here: {reason}")
    with torch.cuda.device(0):
        layer = epmoe.EPMoE(E, K, H, I, backend=backend, experts="triton", device=dev,
                            params_dtype=torch.bfloat16)  # fmt: skip
        w13, w2 = full_weights(E, H, I, torch.float32, dev, seed=7)
        layer.load_experts(w13.bfloat16(), w2.bfloat16())
        x, logits = rank_tokens(0, T, H, E, torch.float32, dev, seed=7)
        for _ in range(2):  # (the second call: the backend built by the first)
            out = layer(x.bfloat16(), logits)
            assert torch.cuda.current_device() == 0 and out.device == dev
        ref = epmoe.reference.moe(
            x.bfloat16(), w13.bfloat16(), w2.bfloat16(), *epmoe.select_experts(logits, K)
        )
        assert_close(out, ref, TOLERANCES[torch.bfloat16], name=f"{backend} on cuda:1")
