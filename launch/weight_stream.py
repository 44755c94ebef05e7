"""How fast one Hopper GPU reads expert weights in the order the persistent expert GEMMs do:
the floor of a weight-bound MoE GEMM, measured beside the copy bandwidth.

``w [e·N, K]`` bf16 (GEMM 1 at the DeepSeek-V3 shape: e = 128, N = 4096, K = 7168; GEMM 2
with ``--shape 7168,2048``). Each work item is one ``[BN, K]`` panel, read as ``[BN, BK]``
TMA boxes along K by programs that claim panels in turn (``grid`` 1 or 2 per SM):

* ``strided``: the weights as they are stored, rows of ``BK`` elements at a stride of K;
* ``tiled``: the same bytes stored box after box (contiguous boxes): what a pre-tiled
  weight layout would buy.

Usage (repository root, GPU): ``python launch/weight_stream.py [--shape 4096,7168]``.
"""

import argparse
import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from epmoe.bench.common import median, time_fn

E = 128


@triton.jit
def _stream(desc, out, n_items, K, BN: tl.constexpr, BK: tl.constexpr, TILED: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BN, BK], tl.float32)
    k_steps = K // BK
    for t in range(pid, n_items, tl.num_programs(0)):
        for k in tl.range(0, k_steps, num_stages=4):
            if TILED:
                x = desc.load([(t * k_steps + k) * BN, 0])
            else:
                x = desc.load([t * BN, k * BK])
            acc += x.to(tl.float32)
    rows = tl.arange(0, BN)[:, None] * BK
    tl.store(out + pid * BN * BK + rows + tl.arange(0, BK)[None, :], acc)


def _ms(fn) -> float:
    """Median of 10 timed runs after 3 warm-up runs (CUDA events, each run waited for)."""
    return median(time_fn(fn, warmup=3, iters=10, device="cuda"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="4096,7168", help="N,K of each expert's weights")
    args = p.parse_args()
    n, k = (int(v) for v in args.shape.split(","))
    w = torch.randn(E * n, k, device="cuda", dtype=torch.bfloat16)
    gb = w.numel() * w.element_size() / 1e9
    dst = torch.empty_like(w)
    t = _ms(functools.partial(dst.copy_, w))
    print(f"e={E} N={n} K={k}: {gb:.2f} GB; copy {t:.3f} ms = {2 * gb / t * 1e3:.0f} GB/s")
    del dst
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for bn, bk in ((128, 64), (256, 64), (128, 128)):
        out = torch.empty(2 * sms, bn * bk, device="cuda")
        tiled = w.view(E * n // bn, bn, k // bk, bk).transpose(1, 2).contiguous().view(-1, bk)
        for name, src, is_tiled in (("strided", w, False), ("tiled", tiled, True)):
            desc = TensorDescriptor.from_tensor(src, [bn, bk])
            for grid in (sms, 2 * sms):
                launch = functools.partial(
                    _stream[(grid,)], desc, out, E * n // bn, k, BN=bn, BK=bk, TILED=is_tiled,
                    num_warps=4,
                )  # fmt: skip
                t = _ms(launch)
                print(
                    f"  box [{bn},{bk}] {name:7s} grid {grid}: {t:.3f} ms = "
                    f"{gb / t * 1e3:.0f} GB/s read"
                )
        del tiled


if __name__ == "__main__":
    main()
