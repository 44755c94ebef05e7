"""``epmoe.DecodeGraphs`` on GPUs: decode buckets of two layers captured into one memory
pool, replayed with padded batches, equal to the eager forward and to the oracle; the
warm-up and the padding rows are not recorded as expert load; stale graphs are refused
after a re-plan and good again after ``recapture``.

W = 1 without torch.distributed (``pytest tests/gpu/test_decode_graphs.py``), and on 2 NCCL
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


def _layer(dev, seed):
    layer = epmoe.EPMoE(
        E, K, H, I, backend="symm_ll", experts="triton", params_dtype=BF16, device=dev,
        max_num_tokens=max(SIZES), load_window=8,
    )  # fmt: skip
    w13, w2 = full_weights(E, H, I, BF16, dev, seed=seed)
    layer.load_experts(w13, w2)
    torch.manual_seed(seed)
    router = torch.nn.Linear(H, E, device=dev)  # the same on every rank (a shared seed)

    def forward(x_TH, num_valid_tokens=None):
        return layer(x_TH, router(x_TH.float()), num_valid_tokens=num_valid_tokens)

    def oracle(x_TH):
        with torch.no_grad():
            weights_TK, ids_TK = epmoe.select_experts(router(x_TH.float()), K)
        return epmoe.reference.moe(x_TH, w13, w2, weights_TK, ids_TK)

    return layer, forward, oracle


def decode_graph_replays(rank: int, world: int) -> dict:
    """Rank body: capture two layers' buckets into one pool, replay steps of uneven token
    counts (a rank with none included), compare with eager and the oracle, check the load,
    rows of the wrong dtype on one rank, re-plan, refuse, recapture."""
    dev = torch.device("cuda", torch.cuda.current_device())
    reason = epmoe.available_backends(dev)["symm_ll"]
    if reason is not None:
        pytest.skip(f"symm_ll cannot run here: {reason}")
    (la, fa, oa), (lb, fb, ob) = _layer(dev, 0), _layer(dev, 1)
    pool = torch.cuda.graph_pool_handle()
    kw = dict(hidden_size=H, dtype=BF16, device=dev, pool=pool)
    ga = epmoe.DecodeGraphs(fa, SIZES, layers=[la], **kw)
    gb = epmoe.DecodeGraphs(fb, SIZES, layers=[lb], **kw)
    for layer in (la, lb):  # the warm-up forwards were not recorded
        assert int(layer.load_recorder.window_load().sum()) == 0, "warm-up recorded as load"
    worst = 0.0
    g = torch.Generator(device=dev).manual_seed(17 + rank)
    for i, counts in enumerate([(3, 0, 2, 1), (16, 5, 9, 16), (1, 1, 1, 1), (7, 8, 0, 2)]):
        T = counts[rank % 4]
        x = torch.randn(T, H, generator=g, device=dev).to(BF16)
        with epmoe.step(num_tokens=T, decode=True, graph_max_tokens=ga.max_tokens) as s:
            assert s.decode, f"step {i}: not a graph step"
            h = ga(x)
            got = gb(h)
            eager_h = fa(x)
            eager = fb(h)
        assert_close(h, eager_h, 5e-3, name=f"rank {rank} step {i}: layer a, graph vs eager")
        assert_close(got, eager, 5e-3, name=f"rank {rank} step {i}: layer b, graph vs eager")
        # each layer against the oracle on its own input: layer b's router sees layer a's
        # output, and with a few tokens a bf16 difference there can flip a near-tie in its
        # top-k (a different expert, not an error), so the oracle routes what b was given
        for name, out, ref in (("a", h, oa(x)), ("b", got, ob(h))):
            assert_close(out, ref, TOLERANCES[BF16], name=f"rank {rank} step {i}: {name} vs oracle")
            worst = max(worst, relative_error(out, ref))
    assert ga.replays == gb.replays == 4

    # rows the step cannot take on one rank (float32, on the last): it raises after an
    # empty replay of the bucket, and the others finish the step with their rows right
    bad = rank == world - 1
    x = torch.randn(3, H, generator=g, device=dev)
    with epmoe.step(num_tokens=3, decode=True, graph_max_tokens=ga.max_tokens):
        if bad:
            with pytest.raises(TypeError, match="bfloat16 rows, got torch.float32"):
                ga(x)
        else:
            got = ga(x.to(BF16))
    if not bad:
        assert_close(got, oa(x.to(BF16)), TOLERANCES[BF16], name=f"rank {rank} beside bad rows")

    # the padding rows of a replay are no load: one replay of T rows records T·K picks
    T = 3
    x = torch.randn(T, H, generator=g, device=dev).to(BF16)
    la.load_recorder.reset()
    with epmoe.step(num_tokens=T, decode=True, graph_max_tokens=ga.max_tokens):
        ga(x)
    recorded = int(la.load_recorder.window_load().sum())
    assert recorded == T * K, f"rank {rank}: {recorded} expert picks recorded, want {T * K}"

    # a re-plan makes the graphs stale: refused, then good after recapture
    # (one replica more per rank: a new placement at every W, where round-robin is the
    # same as linear on one rank)
    hot = torch.arange(E, 0, -1, dtype=torch.float64)
    la.rebalance(epmoe.ExpertPlacement.balanced(hot, world, num_redundant=world))
    assert ga.stale and not gb.stale
    stale = pytest.raises(RuntimeError, match="call recapture")
    with epmoe.step(num_tokens=T, decode=True, graph_max_tokens=ga.max_tokens), stale:
        ga(x)
    ga.recapture()
    with epmoe.step(num_tokens=T, decode=True, graph_max_tokens=ga.max_tokens):
        got = ga(x)
    assert_close(got, oa(x), TOLERANCES[BF16], name=f"rank {rank} after recapture")
    la.comm.close()
    lb.comm.close()
    return {"worst_vs_oracle": worst}


def test_decode_graphs_on_one_gpu():
    decode_graph_replays(0, 1)


def test_decode_graphs_on_nccl_ranks():
    if device_under_test() != "cuda":
        pytest.skip("NCCL ranks need EPMOE_TEST_DEVICE=cuda")
    requires_world(2)
    run_on_ranks(decode_graph_replays, 2, isolated=True)


def test_compiled_forward_captured_by_decode_graphs_on_one_gpu():
    """What a serving engine does: ``torch.compile(fullgraph=True)`` of the decode forward
    (router and ``EPMoE``, the layer one opaque custom op), then its own CUDA graphs of the
    compiled code (``DecodeGraphs``; the warm-up compiles each bucket before its capture).
    Replays equal the eager forward and the oracle. (Inductor's own graphs,
    ``mode="reduce-overhead"``, leave the op outside: it is tagged ``cudagraph_unsafe``.)"""
    dev = torch.device("cuda", torch.cuda.current_device())
    reason = epmoe.available_backends(dev)["symm_ll"]
    if reason is not None:
        pytest.skip(f"symm_ll cannot run here: {reason}")
    torch._dynamo.reset()
    layer, forward, oracle = _layer(dev, 2)
    compiled = torch.compile(forward, fullgraph=True)
    graphs = epmoe.DecodeGraphs(
        compiled, SIZES, layers=[layer], hidden_size=H, dtype=BF16, device=dev
    )
    g = torch.Generator(device=dev).manual_seed(5)
    for T in (3, 16, 1):
        x = torch.randn(T, H, generator=g, device=dev).to(BF16)
        with epmoe.step(num_tokens=T, decode=True, graph_max_tokens=graphs.max_tokens):
            got = graphs(x)
            eager = forward(x)
        assert_close(got, eager, 5e-3, name=f"T={T}: compiled graph vs eager")
        assert_close(got, oracle(x), TOLERANCES[BF16], name=f"T={T}: compiled graph vs oracle")
    assert graphs.replays == 3
    layer.comm.close()
