"""The decode layer with routing and load recording by torch kernels against the fused
routing and recording kernels.

One GPU (W = 1), ``symm_ll``, Triton experts, bf16, 128 tokens with the hint, EPLB load
recording over a window of 64 forwards (``EPMOE_ROUTING_AB_WINDOW``; 0 records nothing),
two shapes (a Qwen3-30B-A3B-like layer with softmax routing; a DeepSeek-V3-like one with
sigmoid, bias, grouped top-k and scaling). ``EPMOE_FUSED_ROUTING=0`` and ``1`` alternate
twice; each prints the eager GPU µs per forward back to back, the host µs per call, the
CUDA kernels per forward, and the µs per replay of the forward captured in a CUDA graph;
then the largest difference of the two outputs and of the two recorded windows. Last, the
recorder alone: GPU µs per ``record`` replayed in a CUDA graph, torch ops against the
kernel, at 1024 and 32768 ids (128 and 4096 tokens, top-8). Run from the repository root::

    source launch/gpu_env.sh; python3 launch/routing_ab.py
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

import epmoe
from epmoe.bench.comm import warm_up_on_side_stream
from epmoe.eplb.recorder import LoadRecorder

T, K = 128, 8
WINDOW = int(os.environ.get("EPMOE_ROUTING_AB_WINDOW", "64"))
DSV3_ROUTING = dict(
    scoring_func="sigmoid", num_expert_group=8, topk_group=4, routed_scaling_factor=2.5
)
SHAPES = (  # name, H, I, E, routing options
    ("small (Qwen3-30B-A3B-like: H 2048, I 768, E 128, softmax)", 2048, 768, 128, {}),
    ("DeepSeek-V3-like (H 7168, I 2048, E 128, sigmoid, bias, 8 groups / 4, x2.5)",
     7168, 2048, 128, DSV3_ROUTING),
)  # fmt: skip


def _layer(H: int, I: int, E: int, routing: dict, dev: torch.device) -> epmoe.EPMoE:
    bias = torch.rand(E, device=dev) * 0.1 if routing else None
    layer = epmoe.EPMoE(
        E, K, H, I, backend="symm_ll", experts="triton", device=dev,
        params_dtype=torch.bfloat16, e_score_correction_bias=bias,
        load_window=WINDOW or None, **routing,
    )  # fmt: skip
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    w2 = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    layer.load_experts(w13, w2)
    return layer


def _measure(f: Callable[[], torch.Tensor]) -> str:
    """Eager back to back, host per call, kernels per forward, graph replay."""
    for _ in range(20):
        f()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = []
    start.record()
    for _ in range(100):
        t0 = time.perf_counter_ns()
        f()
        host.append(time.perf_counter_ns() - t0)
    end.record()
    end.synchronize()
    eager = start.elapsed_time(end) / 100 * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            f()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    kernels = sum(1 for ev in prof.events() if ev.device_type == cuda) / 5
    warm_up_on_side_stream(f, 3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        f()
    replays = []
    for _ in range(6):
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        end.synchronize()
        replays.append(start.elapsed_time(end) / 20 * 1e3)
    return (
        f"eager {eager:.0f} µs per forward, host {statistics.median(host) / 1e3:.0f} µs per "
        f"call, {kernels:.0f} CUDA kernels per forward, graph "
        f"{statistics.median(replays[1:]):.1f} µs per replay"
    )


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("launch/routing_ab.py measures CUDA kernels: run it on a GPU machine")
    dev = torch.device("cuda", torch.cuda.current_device())
    for name, H, I, E, routing in SHAPES:
        layer = _layer(H, I, E, routing, dev)
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        logits = torch.randn(T, E, device=dev)

        def f(layer=layer, x=x, logits=logits) -> torch.Tensor:
            return layer(x, logits, max_tokens_across_ranks=T)

        print(name)
        outs, loads = {}, {}
        with torch.no_grad():
            for round_ in (1, 2):
                for fused in ("0", "1"):
                    os.environ["EPMOE_FUSED_ROUTING"] = fused
                    if layer.load_recorder is not None:
                        layer.load_recorder.reset()
                        outs[fused] = f().float()
                        loads[fused] = layer.load_recorder.window_load().cpu()
                    else:
                        outs[fused] = f().float()
                    print(
                        f"  round {round_} EPMOE_FUSED_ROUTING={fused}: {_measure(f)}", flush=True
                    )
        diff = (outs["0"] - outs["1"]).abs().max().item()
        print(
            f"  outputs differ by at most {diff:.3g} (largest {outs['0'].abs().max().item():.3g})"
        )
        if loads:
            same = torch.equal(loads["0"], loads["1"])
            print(f"  one forward's recorded load: {'equal' if same else 'DIFFERENT'}")
        del layer, f
        torch.cuda.empty_cache()
    _recorder_alone(dev)


def _recorder_alone(dev: torch.device, P: int = 256) -> None:
    """GPU µs per ``LoadRecorder.record`` replayed in a CUDA graph (20 per replay)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for N in (1024, 32768):
        ids = torch.randint(-1, P, (N // K, K), device=dev)
        row = []
        for fused in ("0", "1", "0", "1"):
            os.environ["EPMOE_FUSED_ROUTING"] = fused
            rec = LoadRecorder(P, 64, dev)
            warm_up_on_side_stream(lambda rec=rec, ids=ids: rec.record(ids), 3)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(20):
                    rec.record(ids)
            times = []
            for _ in range(6):
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 20 * 1e3)
            row.append(f"{'kernel' if fused == '1' else 'torch'} {statistics.median(times):.2f}")
        print(f"recorder alone, {N} ids, P {P}, µs per record in a graph: {', '.join(row)}")


if __name__ == "__main__":
    main()
