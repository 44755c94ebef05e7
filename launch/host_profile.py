"""Where an eager decode forward's host time goes, function by function.

One GPU (W = 1), ``symm_ll``, Triton experts, bf16, 128 tokens with the hint, EPLB
recording on: the Qwen3-30B-A3B-like layer of ``launch/routing_ab.py``, whose eager
forward is host-bound. After a warm-up, 300 forwards run under ``cProfile``; it prints the
median host µs per forward without the profiler, then the functions by own time and by
cumulative time, per forward. Run from the repository root::

    source launch/gpu_env.sh; python3 launch/host_profile.py [--top 40]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time

import torch

import epmoe

T, K, H, I, E = 128, 8, 2048, 768, 128
N = 300


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=40, help="functions listed per ordering")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("launch/host_profile.py times CUDA launches: run it on a GPU machine")
    dev = torch.device("cuda", torch.cuda.current_device())
    layer = epmoe.EPMoE(
        E, K, H, I, backend="symm_ll", experts="triton", device=dev,
        params_dtype=torch.bfloat16, load_window=64,
    )  # fmt: skip
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    w2 = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    layer.load_experts(w13, w2)
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    logits = torch.randn(T, E, device=dev)
    with torch.no_grad():
        for _ in range(30):
            layer(x, logits, max_tokens_across_ranks=T)
        torch.cuda.synchronize()
        host = []
        for _ in range(N):
            t0 = time.perf_counter_ns()
            layer(x, logits, max_tokens_across_ranks=T)
            host.append(time.perf_counter_ns() - t0)
        torch.cuda.synchronize()
        print(f"host µs per forward, no profiler: {statistics.median(host) / 1e3:.1f} (median)")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(N):
            layer(x, logits, max_tokens_across_ranks=T)
        prof.disable()
        torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    here = os.getcwd() + "/"
    for key, title in (("tottime", "own time"), ("cumulative", "cumulative time")):
        print(f"\nby {title}, µs per forward (profiled, so inflated):")
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2 if key == "tottime" else 3])
        for (path, line, name), (_cc, nc, tt, ct, _callers) in rows[: args.top]:
            where = f"{path.replace(here, '').split('site-packages/')[-1]}:{line}"
            print(
                f"  {tt / N * 1e6:7.1f} own {ct / N * 1e6:7.1f} cum {nc / N:5.1f}x  {name}  {where}"
            )


if __name__ == "__main__":
    main()
