"""In-process A/B of the Standard layout's two expert GEMMs at the DeepSeek-V3 prefill shape
(4096 tokens, top-8 of 256, 128 local experts) on one Hopper GPU: the portable ``tl.dot``
kernels, the Hopper ``wgmma`` kernel, and ``wgmma_ws`` with one program per SM claiming
tiles, with one program per tile, and with 192-row tiles (three MMA warpgroups; the H200
table's), also with the top-k sum in GEMM 2's epilogue (``atomic_reduce``; the others pay
a separate sum pass, timed beside them). Interleaved rounds in one process, medians of each
step, and each output's relative error against ``tl.dot``'s. For kernel work, not for
records: the layer's record is ``python -m epmoe.bench experts``.

Usage (repository root, GPU): ``python launch/kernel_ab.py [--dtype bf16|fp8] [--rounds 3]
[--tokens 4096]``
"""

import argparse
import dataclasses
import functools
import statistics

import torch

from epmoe.kernels import ops
from epmoe.kernels.configs import GemmConfig, MoEConfig, wgmma_config
from epmoe.reference import quantize_block, quantize_groups, relative_error

T, E, e, K, H, I = 4096, 256, 128, 8, 7168, 2048


def _ms(fn, iters=10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", choices=("bf16", "fp8"), default="fp8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=T, help="tokens T (each picks top-8 of 256)")
    p.add_argument(
        "--group-m",
        type=int,
        nargs="*",
        default=[],
        help="also wgmma_ws with these group_m (rows blocks that sweep the columns together)",
    )
    args = p.parse_args()
    torch.manual_seed(0)
    fp8 = args.dtype == "fp8"
    w13 = torch.randn(e, 2 * I, H, device="cuda").bfloat16() * H**-0.5
    w2 = torch.randn(e, H, I, device="cuda").bfloat16() * I**-0.5
    x = torch.randn(args.tokens, H, device="cuda").bfloat16()
    if fp8:
        (w13, s13), (w2, s2) = quantize_block(w13), quantize_block(w2)
        x, xs = quantize_groups(x)
    else:
        s13 = s2 = xs = None
    ids = torch.rand(args.tokens, E, device="cuda").argsort(1)[:, :K]
    ids = torch.where(ids < e, ids, -1)
    weights = torch.rand(args.tokens, K, device="cuda")
    G = GemmConfig
    bk = 128 if fp8 else 64
    shipped = ops._ws_programs

    def one_per_tile(tiles, device):
        return tiles

    ws192 = wgmma_config(args.dtype, "wgmma_ws", 192)
    variants = {
        "tl.dot": (MoEConfig(128, G(128, bk, 8, 8, 4), G(128, 64, 8, 4, 5), True), shipped),
        "wgmma": (wgmma_config(args.dtype, "wgmma"), shipped),
        "wgmma_ws one/tile": (wgmma_config(args.dtype, "wgmma_ws"), one_per_tile),
        "wgmma_ws one/SM": (wgmma_config(args.dtype, "wgmma_ws"), shipped),
        "wgmma_ws 192 rows": (ws192, shipped),
        "wgmma_ws 192 atomic sum": (dataclasses.replace(ws192, atomic_reduce=True), shipped),
    }
    for block_m in (128, 192):
        ws = wgmma_config(args.dtype, "wgmma_ws", block_m)
        for g in args.group_m:
            cfg = dataclasses.replace(
                ws,
                gate_up=dataclasses.replace(ws.gate_up, group_m=g),
                down=dataclasses.replace(ws.down, group_m=g),
            )
            variants[f"wgmma_ws {block_m} group_m={g}"] = (cfg, shipped)
    times, outs = {}, {}
    for _ in range(args.rounds):
        for name, (cfg, programs) in variants.items():
            ops._ws_programs = programs
            aligned = ops.align_for(ids, e, cfg)
            y, ys = ops.gate_up(x, w13, aligned, cfg, "silu", xs, s13)
            if name not in outs:
                outs[name] = ops.standard_with_config(
                    x, xs, ids, weights, w13, w2, s13, s2, "silu", torch.bfloat16, cfg
                )
            gu = _ms(functools.partial(ops.gate_up, x, w13, aligned, cfg, "silu", xs, s13))
            down = functools.partial(ops.down, y, w2, aligned, cfg, torch.bfloat16, ys, s2, weights)
            dn = _ms(down)
            sm = 0.0  # the top-k sum: in GEMM 2 with atomic_reduce, else its own pass
            if not cfg.atomic_reduce:
                sm = _ms(functools.partial(ops.sum_topk, down(), aligned, torch.bfloat16))
            times.setdefault(name, []).append((gu, dn, sm))
    ops._ws_programs = shipped
    ref = outs["tl.dot"]
    for name, ts in times.items():
        gu, dn, sm = (statistics.median(t[i] for t in ts) for i in range(3))
        err = relative_error(outs[name], ref)
        print(
            f"{args.dtype} {name:24s} gate_up {gu:.3f}  down {dn:.3f}  sum {sm:.3f}  "
            f"GEMMs {gu + dn:.3f}  with the sum {gu + dn + sm:.3f} ms  vs tl.dot {err:.1e}"
        )


if __name__ == "__main__":
    main()
