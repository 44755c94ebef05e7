"""What bounds the Standard layout's two expert GEMMs at the DeepSeek-V3 prefill shape on one
Hopper GPU: the same 128 experts' weights, with the rows per expert varied.

Routes: the benchmark's random ones (4096 tokens, top-8 of 256; about 127 rows per local
expert, ±11), and balanced ones where every expert gets exactly ``r`` rows. If the time
hardly moves with ``r``, reading the weights bounds the GEMMs (their floor: compare with
``launch/weight_stream.py``); where it tracks the rows the tiles compute (padded to 64 per
warpgroup), the MMAs do. Useful TFLOP/s counts the routed rows only. ``--dense`` times
instead one expert of 4032 rows (each weight tile reused from L2 by 21 row blocks: the
kernels' MMA rate) against cuBLAS on the same GEMMs.

Usage (repository root, GPU): ``python launch/kernel_rows.py [--dtype bf16|fp8]
[--rows 32,64,128,192] [--configs 192,192+,128] [--rounds 3] [--dense]``. Configs: the
``wgmma_ws`` tilings of ``wgmma_config`` with 192- or 128-row blocks; ``+`` adds
``atomic_reduce``. For kernel work, not for records (``python -m epmoe.bench experts``).
"""

import argparse
import dataclasses
import functools
import statistics

import torch
from kernel_ab import _ms

from epmoe.kernels import ops
from epmoe.kernels.configs import wgmma_config
from epmoe.reference import quantize_block, quantize_groups

T, E, e, K, H, I = 4096, 256, 128, 8, 7168, 2048


def _config(name: str, dtype: str):
    cfg = wgmma_config(dtype, "wgmma_ws", int(name.rstrip("+")))
    return dataclasses.replace(cfg, atomic_reduce=name.endswith("+"))


def _weights(n_experts: int, fp8: bool):
    w13 = torch.randn(n_experts, 2 * I, H, device="cuda").bfloat16() * H**-0.5
    w2 = torch.randn(n_experts, H, I, device="cuda").bfloat16() * I**-0.5
    if fp8:
        (w13, s13), (w2, s2) = quantize_block(w13), quantize_block(w2)
        return w13, s13, w2, s2
    return w13, None, w2, None


def _time(x, xs, ids, weights, w13, s13, w2, s2, n_experts, cfg):
    aligned = ops.align_for(ids, n_experts, cfg)
    y, ys = ops.gate_up(x, w13, aligned, cfg, "silu", xs, s13)
    gu = _ms(functools.partial(ops.gate_up, x, w13, aligned, cfg, "silu", xs, s13))
    down = functools.partial(ops.down, y, w2, aligned, cfg, torch.bfloat16, ys, s2, weights)
    return gu, _ms(down)


def _inputs(tokens: int, fp8: bool):
    x = torch.randn(tokens, H, device="cuda").bfloat16()
    return quantize_groups(x) if fp8 else (x, None)


def rows(args) -> None:
    fp8 = args.dtype == "fp8"
    w13, s13, w2, s2 = _weights(e, fp8)
    x, xs = _inputs(T, fp8)
    weights = torch.rand(T, K, device="cuda")
    ids = torch.rand(T, E, device="cuda").argsort(1)[:, :K]
    routes = {"random": torch.where(ids < e, ids, -1)}
    slot = torch.arange(T * K, device="cuda")  # slot p -> expert p % e: distinct per token
    for r in args.rows:
        routes[f"{r} each"] = torch.where(slot < e * r, slot % e, -1).view(T, K)
    cfgs = {name: _config(name, args.dtype) for name in args.configs}
    times = {}
    for _ in range(args.rounds):
        for rn, ids in routes.items():
            for cn, cfg in cfgs.items():
                t = _time(x, xs, ids, weights, w13, s13, w2, s2, e, cfg)
                times.setdefault((rn, cn), []).append(t)
    for (rn, cn), ts in times.items():
        gu, dn = (statistics.median(t[i] for t in ts) for i in range(2))
        n = int((routes[rn] >= 0).sum())
        tflops = 2 * n * H * 3 * I / ((gu + dn) * 1e-3) / 1e12
        print(
            f"{args.dtype} {rn:9s} {cn:5s} rows {n:6d}  gate_up {gu:.3f}  down {dn:.3f}  "
            f"GEMMs {gu + dn:.3f} ms  useful {tflops:.0f} TFLOP/s"
        )


def dense(args) -> None:
    tokens = 4032
    w13, _, w2, _ = _weights(1, False)
    x, _ = _inputs(tokens, False)
    h = torch.randn(tokens, I, device="cuda").bfloat16()
    ids = torch.zeros(tokens, 1, dtype=torch.long, device="cuda")
    weights = torch.ones(tokens, 1, device="cuda")
    f1, f2 = 2 * tokens * H * 2 * I, 2 * tokens * I * H
    for _ in range(args.rounds):
        a, b = _ms(lambda: x @ w13[0].T), _ms(lambda: h @ w2[0].T)
        print(
            f"cuBLAS gate_up {a:.3f} ms {f1 / a / 1e9:.0f} TF/s  "
            f"down {b:.3f} ms {f2 / b / 1e9:.0f} TF/s"
        )
        for name in args.configs:
            cfg = _config(name, "bf16")
            gu, dn = _time(x, None, ids, weights, w13, None, w2, None, 1, cfg)
            print(
                f"{name:6s} gate_up {gu:.3f} ms {f1 / gu / 1e9:.0f} TF/s  "
                f"down {dn:.3f} ms {f2 / dn / 1e9:.0f} TF/s"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    p.add_argument(
        "--rows", type=lambda s: [int(v) for v in s.split(",")], default=[32, 64, 128, 192]
    )
    p.add_argument("--configs", type=lambda s: s.split(","), default=["192", "192+"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--dense", action="store_true", help="one expert of 4032 rows against cuBLAS (bf16)"
    )
    args = p.parse_args()
    if args.dense and args.dtype != "bf16":
        p.error("--dense compares with cuBLAS in bf16 only; drop --dtype")
    torch.manual_seed(0)
    if args.dense:
        dense(args)
    else:
        rows(args)


if __name__ == "__main__":
    main()
