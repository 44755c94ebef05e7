"""Host time of an eager ``symm_ll`` call, step by step, and of an eager decode layer.

One GPU (W = 1), DeepSeek-V3's hidden size and top-8, 128 tokens. Prints, per wire dtype,
the median host µs of each step of ``dispatch`` (its checks, device checks, contiguous
inputs, parity, the kernel launch through ``Launcher``, the result) and of whole
``dispatch`` / ``combine`` calls (whose launches are bound per parity, ``BoundLaunch``); then
an EPMoE layer (128 local experts, Triton experts, bf16) eagerly back to back with and
without ``max_tokens_across_ranks``, its host time per call, and the same forward
replayed from a CUDA graph. Run from the repository root::

    source launch/gpu_env.sh; python3 launch/host_time.py
"""

from __future__ import annotations

import statistics
import time

import torch

import epmoe
from epmoe.bench.comm import identity_expert_out, warm_up_on_side_stream, wire_spec
from epmoe.comm import backend_class
from epmoe.comm.base import Layout, check_dispatch_args
from epmoe.comm.symm.common import _on_device, kernels, launch

H, K, E, I, T = 7168, 8, 128, 2048, 128
WARMUP, CALLS = 100, 300
STEPS = ["checks", "on_device", "tr.check", "contiguous", "parity", "launch", "result"]


def _us(ns: list[int]) -> float:
    return statistics.median(ns) / 1e3


def split_dispatch(wire: torch.dtype, dev: torch.device) -> None:
    """``SymmLL.dispatch``'s steps, timed apart (the same code, inlined), and whole calls."""
    placement = epmoe.ExpertPlacement.linear(E, 1)
    comm = backend_class("symm_ll")(
        wire_spec(H, K, placement, T, torch.bfloat16, dev, wire), None, Layout.EXPERT_BATCHED
    )
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    ids = torch.topk(torch.rand(T, E, device=dev), K, dim=1).indices  # contiguous, as routed
    w = torch.softmax(torch.randn(T, K, device=dev), -1)
    first = comm.dispatch(x, ids, w)
    y = identity_expert_out(first, torch.bfloat16)
    comm.combine(y, first)
    k, spec, tr = kernels(), comm.spec, comm._live()
    steps: dict[str, list[int]] = {name: [] for name in [*STEPS, "dispatch()", "combine()"]}
    for i in range(WARMUP + CALLS):
        t = [time.perf_counter_ns()]
        check_dispatch_args(spec, x, ids, w, True)
        t.append(time.perf_counter_ns())
        dev = tr.device  # (as _dispatch_prologue: the named error only on a mismatch)
        if x.device != dev or ids.device != dev or w.device != dev:
            _on_device(dev, hidden_states=x, topk_ids=ids, topk_weights=w)
        t.append(time.perf_counter_ns())
        tr.check()
        t.append(time.perf_counter_ns())
        xc, ic = x.contiguous(), ids.contiguous()
        wc = (w if w.dtype == torch.float32 else w.float()).contiguous()
        t.append(time.perf_counter_ns())
        c, b = comm._dispatch_consts, tr.take_parity()
        t.append(time.perf_counter_ns())
        reg = tr.regions[b]
        launch(k.ll_dispatch_kernel)(
            (1 + T + tr.M,),
            xc, ic, wc, comm._owner_P, comm._local_P, tr.bases, tr.err_addr,
            tr.out[b], tr.out_scale[b], tr.counts[b], tr.pos[b], tr.recv_t[b], tr.counts[b],
            T, tr.H, spec.num_physical, tr.M, 1, tr.G, tr.C, comm.rank, tr.timeout_ns,
            comm.kernel_tag, reg.flags, reg.x, reg.s, reg.ids, reg.w,
            IN_PLACE=tr.in_place, STAMPS=False, num_warps=tr.num_warps, **c,
        )  # fmt: skip
        t.append(time.perf_counter_ns())
        result = comm._dispatch_result(tr, b, ic, T)
        t.append(time.perf_counter_ns())
        comm.combine(y, result)
        t0 = time.perf_counter_ns()
        result = comm.dispatch(x, ids, w)
        t1 = time.perf_counter_ns()
        comm.combine(y, result)
        t2 = time.perf_counter_ns()
        if i >= WARMUP:
            for j, name in enumerate(STEPS):
                steps[name].append(t[j + 1] - t[j])
            steps["dispatch()"].append(t1 - t0)
            steps["combine()"].append(t2 - t1)
    torch.cuda.synchronize()
    print(f"symm_ll, {wire} on the wire, host µs (medians of {CALLS}):")
    print("  " + ", ".join(f"{name} {_us(ns):.1f}" for name, ns in steps.items()))
    comm.close()


def layer_eager_and_graph(dev: torch.device) -> None:
    """The decode layer: eager GPU time per forward, host time per call, graph replay."""
    layer = epmoe.EPMoE(
        E, K, H, I, backend="symm_ll", experts="triton", device=dev, params_dtype=torch.bfloat16
    )
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    w2 = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    layer.load_experts(w13, w2)
    del w13, w2
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    logits = torch.randn(T, E, device=dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.no_grad():
        for hint in (None, T):
            kwargs = {} if hint is None else dict(max_tokens_across_ranks=hint)
            for _ in range(10):
                layer(x, logits, **kwargs)
            torch.cuda.synchronize()
            host = []
            start.record()
            for _ in range(50):
                t0 = time.perf_counter_ns()
                layer(x, logits, **kwargs)
                host.append(time.perf_counter_ns() - t0)
            end.record()
            torch.cuda.synchronize()
            print(
                f"layer, eager, max_tokens_across_ranks={hint}: "
                f"{start.elapsed_time(end) / 50 * 1e3:.0f} µs per forward back to back, "
                f"host {_us(host):.0f} µs per call"
            )
        warm_up_on_side_stream(lambda: layer(x, logits, max_tokens_across_ranks=T), 3)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layer(x, logits, max_tokens_across_ranks=T)
        for _ in range(5):
            graph.replay()
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        print(f"layer, CUDA graph: {start.elapsed_time(end) / 50 * 1e3:.0f} µs per replay")


def main() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    for wire in (torch.bfloat16, torch.float8_e4m3fn):
        split_dispatch(wire, dev)
    layer_eager_and_graph(dev)


if __name__ == "__main__":
    main()
