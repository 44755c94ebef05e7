#!/usr/bin/env bash
# One H100/H200, about 3 minutes: the FP8 Hopper loop that retires both MMAs of each K step
# (epmoe.kernels.wgmma.FP8_RETIRE_IN_STEP; off until this has run, see docs/kernels.md,
# third round).
#   1. tests/gpu/test_wgmma_kernels.py with the loop switched on
#   2. an A/B of the two FP8 GEMMs at the DeepSeek-V3 prefill shape (4096 tokens, top-8 of
#      256, 128 local experts): tl.dot, wgmma and wgmma_ws, each with the loop off and on,
#      interleaved rounds in one process, medians, and each one's difference from tl.dot
# Usage: bash launch/kernel_retire_ab.sh   (from the repository root)
set -uo pipefail
source launch/gpu_env.sh
export EPMOE_TRITON_AUTOTUNE=0
date -u
timeout 200 python - <<'PY' 2>&1 | grep -v Warn | tail -5
import sys

import pytest

from epmoe.kernels import wgmma

wgmma.FP8_RETIRE_IN_STEP = True
sys.exit(pytest.main(["-q", "-x", "tests/gpu/test_wgmma_kernels.py"]))
PY
timeout 300 python - <<'PY' 2>&1 | grep -v Warn | tail -12
import statistics

import torch

from epmoe.kernels import ops, wgmma
from epmoe.kernels.configs import GemmConfig, MoEConfig, wgmma_config
from epmoe.reference import quantize_block, quantize_groups, relative_error

torch.manual_seed(0)
T, E, e, K, H, I = 4096, 256, 128, 8, 7168, 2048


def median_ms(fn, iters=10, rounds=3):
    times = []
    for _ in range(rounds):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


w13 = torch.randn(e, 2 * I, H, device="cuda").bfloat16() * H**-0.5
w2 = torch.randn(e, H, I, device="cuda").bfloat16() * I**-0.5
(q13, s13), (q2, s2) = quantize_block(w13), quantize_block(w2)
del w13, w2
ids = torch.rand(T, E, device="cuda").argsort(1)[:, :K]
ids = torch.where(ids < e, ids, -1)
weights = torch.rand(T, K, device="cuda")
xq, xs = quantize_groups(torch.randn(T, H, device="cuda").bfloat16())
G = GemmConfig
variants = [("tl.dot, half tails", MoEConfig(128, G(128, 128, 8, 8, 4), G(128, 64, 8, 4, 5), True), False)]
for kernel in ("wgmma", "wgmma_ws"):
    for retire in (False, True):
        variants.append((f"{kernel}, retire={retire}", wgmma_config("fp8", kernel), retire))
times, outs = {}, {}
for _ in range(3):  # interleaved rounds
    for name, cfg, retire in variants:
        wgmma.FP8_RETIRE_IN_STEP = retire
        aligned = ops.align_pairs(ids, e, cfg.block_m, cfg.half_tail)
        y, ys = ops.gate_up(xq, q13, aligned, cfg, "silu", xs, s13)
        outs.setdefault(name, ops.standard_with_config(
            xq, xs, ids, weights, q13, q2, s13, s2, "silu", torch.bfloat16, cfg))
        gu = median_ms(lambda: ops.gate_up(xq, q13, aligned, cfg, "silu", xs, s13), rounds=1)
        dn = median_ms(lambda: ops.down(y, q2, aligned, cfg, torch.bfloat16, ys, s2, weights), rounds=1)
        times.setdefault(name, []).append((gu, dn))
ref = outs[variants[0][0]]
for name, ts in times.items():
    gu = statistics.median(a for a, _ in ts)
    dn = statistics.median(b for _, b in ts)
    print(f"{name:24s} gate_up {gu:.3f}  down {dn:.3f}  GEMMs {gu + dn:.3f} ms  "
          f"vs tl.dot {relative_error(outs[name], ref):.1e}")
PY
