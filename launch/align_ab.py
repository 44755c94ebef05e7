"""Time ``ops.align_pairs`` in one launch against three, for batch sizes from decode to
prefill (top-8 of 256 experts, 128 local), on one GPU: back-to-back calls between CUDA
events, host time per call, and GPU time per call replayed from a CUDA graph. For choosing
``ops.ALIGN_ONE_PROGRAM_PAIRS``.

Usage (repository root, GPU): ``python launch/align_ab.py``
"""

import time

import torch

from epmoe.kernels import ops

E, e, K = 256, 128, 8


def _ms(fn, iters=200) -> tuple[float, float, float]:
    """(GPU ms per call back to back, host ms per call, GPU ms per call replayed from a
    CUDA graph of 20 calls: the launches' own cost, as a captured decode step pays it)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    host = (time.perf_counter() - t0) / iters * 1e3
    end.synchronize()
    eager = start.elapsed_time(end) / iters
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(20):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    end.synchronize()
    return eager, host, start.elapsed_time(end) / 200


def main() -> None:
    torch.manual_seed(0)
    shipped = ops.ALIGN_ONE_PROGRAM_PAIRS
    for T in (16, 64, 128, 256, 512, 1024, 4096):
        ids = torch.rand(T, E, device="cuda").argsort(1)[:, :K]
        ids = torch.where(ids < e, ids, -1).int()
        row = [f"pairs {T * K:6d}"]
        for name, limit in (("one launch", 1 << 30), ("three", 0)):
            ops.ALIGN_ONE_PROGRAM_PAIRS = limit
            gpu, host, graph = _ms(lambda: ops.align_pairs(ids, e, 128, True))  # noqa: B023
            row.append(
                f"{name} {gpu * 1e3:6.1f} us (host {host * 1e3:5.1f}, graph {graph * 1e3:5.1f})"
            )
        print("  ".join(row))
    ops.ALIGN_ONE_PROGRAM_PAIRS = shipped


if __name__ == "__main__":
    main()
