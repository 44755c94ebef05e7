"""``epmoe.DecodeGraphs`` on GPUs: decode buckets captured once, replayed with padded
batches, equal to the eager forward and to the oracle; padding rows recorded as no load;
stale graphs refused after a re-plan and good again after ``recapture``.

W = 1 without torch.distributed (``pytest tests/gpu/test_decode_graphs.py``), and on W NCCL
ranks with ``EPMOE_TEST_DEVICE=cuda``. Backend: ``symm_ll`` (graph safe), Triton experts.

Shape legend: T tokens on this rank · b bucket · H hidden · I intermediate · E experts ·
K top-k · W world.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU too; conftest skips the gpu mark
    pytest.skip("needs CUDA", allow_module_level=True)

import epmoe  # noqa: E402
from epmoe.reference import TOLERANCES, assert_close, relative_error  # noqa: E402
from tests.distributed.cases import full_weights  # noqa: E402
from tests.harness import requires_world, run_on_ranks  # noqa: E402
from tests.harness import test_device as device_under_test  # noqa: E402

E, K, H, I = 16, 4, 256, 128
SIZES = (1, 4, 8, 16)
BF16 = torch.bfloat16


def decode_graph_replays(rank: int, world: int) -> dict:
    """Rank body: capture the buckets, replay steps of uneven token counts (a rank with
    none included), compare with eager and the oracle, re-plan, refuse, recapture."""
    dev = torch.device("cuda", torch.cuda.current_device())
    reason = epmoe.available_backends(dev)["symm_ll"]
    if reason is not None:
        pytest.skip(f"symm_ll cannot run here: {reason}")
    layer = epmoe.EPMoE(
        E, K, H, I, backend="symm_ll", experts="triton", params_dtype=BF16, device=dev,
        max_num_tokens=max(SIZES), load_window=1,
    )  # fmt: skip
    w13, w2 = full_weights(E, H, I, BF16, dev, seed=0)
    layer.load_experts(w13, w2)
    torch.manual_seed(0)
    router = torch.nn.Linear(H, E, device=dev)  # the same on every rank (a shared seed)

    def forward(x_TH, num_valid_tokens=None):
        return layer(x_TH, router(x_TH.float()), num_valid_tokens=num_valid_tokens)

    graphs = epmoe.DecodeGraphs(
        forward, SIZES, hidden_size=H, dtype=BF16, device=dev, layers=[layer]
    )
    worst = 0.0
    g = torch.Generator(device=dev).manual_seed(17 + rank)
    for i, counts in enumerate([(3, 0, 2, 1), (16, 5, 9, 16), (1, 1, 1, 1), (7, 8, 0, 2)]):
        T = counts[rank % 4]
        x = torch.randn(T, H, generator=g, device=dev).to(BF16)
        with epmoe.step(num_tokens=T, decode=True, graph_max_tokens=graphs.max_tokens) as s:
            got = graphs(x)
            assert got is not None and s.decode, f"step {i}: not a graph step"
            layer.load_recorder.reset()
            eager = forward(x)
        with torch.no_grad():
            ids_w = epmoe.select_experts(router(x.float()), K)
        ref = epmoe.reference.moe(x, w13, w2, *ids_w)
        assert_close(got, eager, 5e-3, name=f"rank {rank} step {i}: graph vs eager")
        assert_close(got, ref, TOLERANCES[BF16], name=f"rank {rank} step {i}: graph vs oracle")
        worst = max(worst, relative_error(got, ref))
    assert graphs.replays == 4

    # the padding rows of a replay are no load: record one replay of T rows
    T = 3
    x = torch.randn(T, H, generator=g, device=dev).to(BF16)
    layer.load_recorder.reset()
    with epmoe.step(num_tokens=T, decode=True, graph_max_tokens=graphs.max_tokens):
        graphs(x)
    recorded = int(layer.load_recorder.window_load().sum())
    assert recorded == T * K, f"rank {rank}: {recorded} expert picks recorded, want {T * K}"

    # a re-plan makes the graphs stale: refused, then good after recapture
    swapped = epmoe.ExpertPlacement.round_robin(E, world)
    layer.rebalance(swapped)
    stale = pytest.raises(RuntimeError, match="call recapture")
    with epmoe.step(num_tokens=T, decode=True, graph_max_tokens=graphs.max_tokens), stale:
        graphs(x)
    graphs.recapture()
    with epmoe.step(num_tokens=T, decode=True, graph_max_tokens=graphs.max_tokens):
        got = graphs(x)
    with torch.no_grad():
        ref = epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(router(x.float()), K))
    assert_close(got, ref, TOLERANCES[BF16], name=f"rank {rank} after recapture")
    layer.comm.close()
    return {"worst_vs_oracle": worst}


def test_decode_graphs_on_one_gpu():
    decode_graph_replays(0, 1)


def test_decode_graphs_on_nccl_ranks():
    if device_under_test() != "cuda":
        pytest.skip("NCCL ranks need EPMOE_TEST_DEVICE=cuda")
    requires_world(2)
    run_on_ranks(decode_graph_replays, 2, isolated=True)
