"""Batched-expert kernels against dense matmul, ``torch._grouped_mm`` and a cuBLAS loop.

``python -m epmoe.bench experts [--scenario prefill|decode|all] [--dtypes bf16,fp8]
[--configs --configs-out FILE]``

Shape legend: T tokens · H hidden · I intermediate · E experts · e local experts · K top-k ·
W ranks · R received rows · C rows of capacity per expert · N local (row, k) pairs.

Scenarios (one GPU, DeepSeek-V3 expert shapes by default):

* ``prefill``: Standard layout. T tokens route top-K uniformly over E experts; this rank
  holds the first e, so it receives every token with at least one local expert (R rows,
  N ≈ T·K·e/E pairs). Reports TFLOP/s (6·N·H·I flops) of the whole Triton layer (align,
  GEMM 1, GEMM 2, reduce) and of its GEMMs alone, next to the same run's dense bf16
  matmuls of the same FLOPs, ``torch._grouped_mm`` and a per-expert cuBLAS loop (both
  given the rows already sorted by expert, activation in torch).
* ``decode``: ExpertBatched layout, W ranks × M tokens routed over E experts, capacity
  C = W·M per local expert. Reports the weight bytes read per second against the
  measured device copy bandwidth (read + write bytes per second of a large ``copy_``),
  next to a cuBLAS ``bmm`` over the largest count.
* FP8 (``--dtypes ...,fp8``): W8A8 with 128×128 block weight scales and activations
  arriving quantized (as an FP8 dispatch delivers them); speedup over bf16 per scenario.

The baselines run in bf16 for every ``--dtypes`` (``--no-baselines``: none); the prefill
roofline of an FP8 layer takes the dense FP8 ``scaled_mm`` of the same FLOPs.

Times are medians of CUDA-event brackets around runs enqueued back to back: the GPU time
of the layer, which is what a CUDA graph or a busy serving loop pays. With
``--host-latency`` each run waits for the last one first, so its time also holds the host's
latency to launch its first kernel onto an idle GPU (≈ 0.05–0.15 ms for these layers from
Python); records before 2026-12-01 13:10 UTC were taken that way.

``--configs`` sweeps the kernels' tilings (GEMM 1 and GEMM 2 separately for each row
block size, within ``--sweep-budget-s``), reports the best next to the default and writes
a table for ``epmoe/kernels/configs/<device>.json`` with ``--configs-out``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import torch
import torch.nn.functional as F

from epmoe.bench.common import format_table, machine_info, median, time_fn
from epmoe.reference import relative_error

FP8 = torch.float8_e4m3fn
# The baselines run in bf16 whatever --dtypes holds (with bf16 weights of their own where
# bf16 is not among them): torch's bf16 GEMMs are what the layer replaces, fp16 runs at the
# same tensor-core rate, and the FP8 layer's dense ceiling (dense fp8 scaled_mm) is among
# the prefill baselines. A run without them had no vs_* ratios and no roofline.
BASELINE_DTYPE = "bf16"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", choices=("prefill", "decode", "all"), default="all")
    p.add_argument("--dtypes", default="bf16,fp8", help="comma list of bf16, fp16, fp8")
    p.add_argument("--tokens", type=int, default=4096, help="prefill tokens T")
    p.add_argument("--hidden", type=int, default=7168, help="H")
    p.add_argument("--intermediate", type=int, default=2048, help="I")
    p.add_argument("--num-experts", type=int, default=256, help="E (routed over)")
    p.add_argument("--local-experts", type=int, default=128, help="e (held by this rank)")
    p.add_argument("--top-k", type=int, default=8, help="K")
    p.add_argument("--decode-tokens", type=int, default=128, help="decode tokens per rank M")
    p.add_argument("--decode-ranks", type=int, default=2, help="decode ranks W")
    p.add_argument(
        "--decode-full-expert",
        action="store_true",
        help="decode: expert 0 gets a full slab (C rows), the worst case for one expert",
    )
    p.add_argument(
        "--m-splits",
        type=int,
        nargs="+",
        default=[],
        help="decode: also time these row programs per expert (S; default: the heuristic)",
    )
    p.add_argument("--activation", default="silu", choices=("silu", "gelu"))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-baselines", action="store_true", help="time the Triton kernels only")
    p.add_argument(
        "--host-latency",
        action="store_true",
        help="wait for each timed run before launching the next (times then include the "
        "host's latency to launch the first kernel; the default enqueues runs back to back)",
    )
    p.add_argument("--configs", action="store_true", help="sweep kernel tilings")
    p.add_argument("--sweep-budget-s", type=float, default=240.0, help="total sweep time")
    p.add_argument("--configs-out", default=None, help="write the tuned table (JSON) here")
    p.add_argument(
        "--device",
        default="cuda",
        help="cuda, or cpu for a smoke test of tiny shapes under TRITON_INTERPRET=1",
    )
    p.add_argument(
        "--report-kernels", action="store_true", help="print registers/spills of compiled kernels"
    )
    p.add_argument(
        "--candidates",
        default=None,
        help="JSON file: a list of {scenario, dtype, config} (config as MoEConfig.to_dict) to "
        "time in full next to the default; with --configs the fastest goes into the table",
    )


def _dtypes(args: argparse.Namespace) -> list[str]:
    return [d.strip() for d in args.dtypes.split(",") if d.strip()]


def check_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the options that argparse does not check, or ``None``."""
    dtypes = _dtypes(args)
    wrong = [d for d in dtypes if d not in ("bf16", "fp16", "fp8")]
    if wrong or not dtypes:
        return f"--dtypes takes a comma list of bf16, fp16, fp8; got {args.dtypes!r}"
    sizes = ("tokens", "hidden", "intermediate", "num_experts", "local_experts", "top_k",
             "decode_tokens", "decode_ranks", "iters")  # fmt: skip
    for name in sizes:
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}"
    if args.top_k > args.num_experts:
        return f"--top-k {args.top_k} is more than --num-experts {args.num_experts}"
    if args.local_experts > args.num_experts:
        return (
            f"--local-experts {args.local_experts} is more than --num-experts "
            f"{args.num_experts} (e: the experts one rank holds, of the E routed over)"
        )
    if any(s < 1 for s in args.m_splits):
        return f"--m-splits must be positive, got {args.m_splits}"
    if args.configs_out and not args.configs:
        return "--configs-out writes the table --configs tunes: add --configs"
    return None


# ----------------------------------------------------------------------------- problems


def _route(T: int, E: int, K: int, gen: torch.Generator, device: torch.device):
    """Uniform top-K routing of T tokens over E experts: ids [T, K], weights [T, K]."""
    scores = torch.rand(T, E, generator=gen, device=device)
    w, ids = scores.topk(K, dim=1)
    return ids, (w / w.sum(dim=1, keepdim=True)).float()


def _make_weights(e: int, H: int, I: int, dtype: str, device: torch.device, seed: int):
    """``(w13, w2, w13_scale, w2_scale)``; FP8 with 128×128 block scales."""
    gen = torch.Generator(device=device).manual_seed(seed)
    wdtype = torch.float16 if dtype == "fp16" else torch.bfloat16
    w13 = torch.empty(e, 2 * I, H, dtype=wdtype, device=device)
    w2 = torch.empty(e, H, I, dtype=wdtype, device=device)
    for i in range(e):  # one expert at a time keeps the fp32 temporaries small
        w13[i] = (torch.randn(2 * I, H, generator=gen, device=device) * H**-0.5).to(wdtype)
        w2[i] = (torch.randn(H, I, generator=gen, device=device) * I**-0.5).to(wdtype)
    if dtype != "fp8":
        return w13, w2, None, None
    q13, s13 = _quant_block(w13)
    q2, s2 = _quant_block(w2)
    return q13, q2, s13, s2


def _quant_block(w: torch.Tensor, chunk: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [e, N, K]`` → FP8 with float32 scales per 128×128 block (``quantize_block``),
    ``chunk`` experts at a time so that the fp32 temporaries stay small."""
    from epmoe.reference import quantize_block

    e, N, K = w.shape
    q = torch.empty(w.shape, dtype=FP8, device=w.device)
    s = torch.empty(e, math.ceil(N / 128), math.ceil(K / 128), device=w.device)
    for i in range(0, e, chunk):
        q[i : i + chunk], s[i : i + chunk] = quantize_block(w[i : i + chunk])
    return q, s


# ----------------------------------------------------------------------------- timing


def _ms(fn, args) -> float:
    """Median GPU milliseconds of ``fn``: runs enqueued back to back (the kernels' time, not
    the host's latency to launch the first one; ``--host-latency`` restores that)."""
    timing = dict(warmup=args.warmup, iters=args.iters, device=args.device)
    return median(time_fn(fn, **timing, back_to_back=not args.host_latency))


def _copy_bandwidth(device: torch.device, args) -> float:
    """Device copy bandwidth, bytes read + written per second, of a 1 GiB ``copy_``."""
    n = 1 << 30 if device.type == "cuda" else 1 << 20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / (_ms(lambda: dst.copy_(src), args) * 1e-3)


def _kernel_report() -> list[dict[str, Any]]:
    """Registers, spills and shared memory of every compiled GEMM variant (best effort:
    reads Triton's per-device kernel cache, an internal of triton 3.x)."""
    from epmoe.kernels import grouped_gemm

    rows: list[dict[str, Any]] = []
    for fn in (grouped_gemm.gate_up_kernel, grouped_gemm.down_kernel):
        try:
            for entry in fn.device_caches.values():
                for k in entry[0].values():
                    md = k.metadata
                    rows.append(
                        {
                            "kernel": fn.__name__,
                            "regs": getattr(k, "n_regs", None),
                            "spills": getattr(k, "n_spills", None),
                            "smem": getattr(md, "shared", None),
                            "warps": getattr(md, "num_warps", None),
                            "stages": getattr(md, "num_stages", None),
                            "consts": _block_constants(k, fn),
                        }
                    )
        except Exception as exc:
            rows.append({"kernel": fn.__name__, "error": repr(exc)[:200]})
    return rows


def _block_constants(k: Any, fn: Any) -> str:
    try:
        consts = getattr(getattr(k, "src", None), "constants", None) or {}
        out = []
        for key, v in consts.items():
            idx = key[0] if isinstance(key, tuple) else key
            name = fn.arg_names[idx] if isinstance(idx, int) else str(idx)
            if name.startswith("BLOCK") or name in ("BATCHED", "FP8", "GROUP_M"):
                out.append(f"{name}={v}")
        return " ".join(out)
    except Exception:
        return ""


# ----------------------------------------------------------------------------- scenarios


class _Prefill:
    """The Standard-layout problem of one rank: received rows, local ids, sorted copies."""

    layout = "standard"

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        gen = torch.Generator(device=device).manual_seed(args.seed)
        T, E, K, e, H = args.tokens, args.num_experts, args.top_k, args.local_experts, args.hidden
        ids, w = _route(T, E, K, gen, device)
        local = ids < e
        keep = local.any(dim=1)  # a token reaches this rank if any of its experts is here
        self.topk_ids = torch.where(local, ids, -1)[keep].contiguous()
        self.topk_weights = w[keep].contiguous()
        self.R = int(keep.sum())
        self.m = self.R  # the config table's row bucket
        self.hidden = torch.randn(self.R, H, generator=gen, device=device).to(torch.bfloat16)
        flat = self.topk_ids.reshape(-1)
        valid = (flat >= 0).nonzero().squeeze(1)
        pairs = valid[torch.argsort(flat[valid], stable=True)]  # local pairs by expert
        self.rows = pairs // K
        self.counts = torch.bincount(flat[pairs], minlength=e)
        self.N = int(pairs.numel())
        self.offsets = torch.cumsum(self.counts, 0).to(torch.int32)
        self.bounds = [0, *self.offsets.tolist()]

    def flops(self, args: argparse.Namespace) -> float:
        return 6.0 * self.N * args.hidden * args.intermediate


class _Decode:
    """The ExpertBatched problem of one rank: W·M tokens routed, C = W·M capacity."""

    layout = "batched"

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        gen = torch.Generator(device=device).manual_seed(args.seed + 1)
        M, W, e = args.decode_tokens, args.decode_ranks, args.local_experts
        ids, _ = _route(M * W, args.num_experts, args.top_k, gen, device)
        ids = ids.reshape(-1)
        self.counts = torch.bincount(ids[ids < e], minlength=e).to(torch.int32)
        self.C = M * W
        if args.decode_full_expert:
            self.counts[0] = self.C
        self.m = self.C
        x = torch.randn(e, self.C, args.hidden, generator=gen, device=device)
        self.hidden = x.to(torch.bfloat16)
        self.counts_host = self.counts.tolist()


def _inputs(problem, dtype: str):
    """Activations as the experts receive them: bf16/fp16, or FP8 + group scales."""
    from epmoe.kernels import ops

    if dtype == "fp8":
        counts = problem.counts if problem.layout == "batched" else None
        return ops.per_token_group_quant_fp8(problem.hidden, counts=counts)
    return problem.hidden.to(torch.float16 if dtype == "fp16" else torch.bfloat16), None


def _runner(problem, args, dtype: str, weights, m_splits: int | None = None):
    """``run(config)``: one forward of the Triton layer on prepared inputs (ExpertBatched:
    ``m_splits`` row programs per expert, default the heuristic's)."""
    from epmoe.kernels import ops

    w13, w2, s13, s2 = weights
    x, xs = _inputs(problem, dtype)
    out_dtype = torch.bfloat16 if dtype == "fp8" else x.dtype
    if problem.layout == "standard":
        ids, tw = problem.topk_ids, problem.topk_weights
        return lambda cfg: ops.standard_with_config(
            x, xs, ids, tw, w13, w2, s13, s2, args.activation, out_dtype, cfg
        )
    counts = problem.counts
    return lambda cfg: ops.batched_with_config(
        x, xs, counts, w13, w2, s13, s2, args.activation, out_dtype, cfg, m_splits
    )


def _valid_rows(out: torch.Tensor, problem) -> torch.Tensor:
    """The rows of an output that hold results (ExpertBatched: those below the counts)."""
    if problem.layout == "standard":
        return out
    C = out.shape[1]
    keep = torch.arange(C, device=out.device)[None, :] < problem.counts[:, None]
    return out[keep]


def _default_config(problem, args, weights, run):
    """What the layer would pick: tuned table, autotuning (unless disabled), heuristics."""
    from epmoe.kernels.configs import select_config

    top_k = args.top_k if problem.layout == "standard" else 1
    w13 = weights[0]
    return select_config(
        problem.layout, w13.dtype, problem.m, args.hidden, args.intermediate,
        args.local_experts, top_k, w13.device, run,
    )  # fmt: skip


def _measure(
    problem, args, dtype: str, weights, cfg, impl: str, m_splits: int | None = None
) -> dict[str, Any]:
    """One record of the Triton layer with ``cfg`` (and ``m_splits``, ExpertBatched)."""
    from epmoe.kernels import ops

    run = _runner(problem, args, dtype, weights, m_splits)
    ms = _ms(lambda: run(cfg), args)
    rec: dict[str, Any] = {"scenario": "prefill" if problem.layout == "standard" else "decode"}
    rec.update(dtype=dtype, impl=impl, ms=ms, config=cfg.short())
    w13, w2, s13, s2 = weights
    if problem.layout == "standard":
        flops = problem.flops(args)
        x, xs = _inputs(problem, dtype)
        out_dtype = torch.bfloat16 if dtype == "fp8" else x.dtype
        ids, tw, e = problem.topk_ids, problem.topk_weights, args.local_experts
        aligned = ops.align_for(ids, e, cfg)

        def gemms():
            y, ys = ops.gate_up(x, w13, aligned, cfg, args.activation, xs, s13)
            return ops.down(y, w2, aligned, cfg, out_dtype, ys, s2, tw)

        gemm_ms = _ms(gemms, args)
        rec.update(R=problem.R, pairs=problem.N, tflops=flops / ms / 1e9)
        rec["weight_bytes"] = sum(t.numel() * t.element_size() for t in weights if t is not None)
        rec.update(gemm_ms=gemm_ms, gemm_tflops=flops / gemm_ms / 1e9)
        rec["align_ms"] = _ms(lambda: ops.align_for(ids, e, cfg), args)
        # Per-step times and the padding of the aligned rows: where the layer's time goes.
        y, ys = ops.gate_up(x, w13, aligned, cfg, args.activation, xs, s13)
        z = ops.down(y, w2, aligned, cfg, out_dtype, ys, s2, tw)
        rec["gate_up_ms"] = _ms(
            lambda: ops.gate_up(x, w13, aligned, cfg, args.activation, xs, s13), args
        )
        rec["down_ms"] = _ms(lambda: ops.down(y, w2, aligned, cfg, out_dtype, ys, s2, tw), args)
        # (with atomic_reduce GEMM 2 sums the pairs: down_ms includes it)
        rec["sum_ms"] = (
            0.0 if cfg.atomic_reduce else _ms(lambda: ops.sum_topk(z, aligned, out_dtype), args)
        )
        padded = int(aligned.num_padded.item())
        rec["pad_ratio"] = padded / max(1, problem.N)  # MMA rows computed per useful row
        # The MMA rate on the padded rows (what the tiles compute, useful or not).
        rec["mma_tflops_padded"] = 6.0 * padded * args.hidden * args.intermediate / gemm_ms / 1e9
        if dtype == "fp8":  # bf16 activations in, quantized by the layer
            x16 = problem.hidden
            rec["ms_with_quant"] = _ms(
                lambda: ops.fused_moe_standard(
                    x16, ids, tw, w13, w2, w13_scale=s13, w2_scale=s2, config=cfg
                ),
                args,
            )
    else:
        H, I = args.hidden, args.intermediate
        active = sum(1 for c in problem.counts_host if c > 0)
        per_expert = 3 * H * I * w13.element_size()
        if s13 is not None:
            per_expert += (s13[0].numel() + s2[0].numel()) * 4
        rec.update(C=problem.C, active_experts=active, max_count=max(problem.counts_host))
        rec["m_splits"] = "auto" if m_splits is None else m_splits
        rec["weight_GBps"] = active * per_expert / (ms * 1e-3) / 1e9
    return rec


def _split_records(problem, args, dtype: str, weights, cfg, run) -> list[dict[str, Any]]:
    """The decode records with each ``--m-splits`` S (row programs per expert), each
    checked against the default grid's output."""
    recs = []
    default = _valid_rows(run(cfg), problem) if args.m_splits else None
    for S in args.m_splits:
        rec = _measure(problem, args, dtype, weights, cfg, f"epmoe triton S={S}", S)
        split = _runner(problem, args, dtype, weights, S)
        rec["diff_vs_default"] = relative_error(_valid_rows(split(cfg), problem), default)
        recs.append(rec)
    return recs


def _dense_ms(N: int, H: int, I: int, device: torch.device, args) -> float:
    """One dense ``[N, H] @ [H, 2I]`` and one ``[N, I] @ [I, H]`` bf16 matmul: the FLOPs of
    the expert layer without the grouping."""
    bf16 = dict(device=device, dtype=torch.bfloat16)
    a, b1 = torch.randn(N, H, **bf16), torch.randn(H, 2 * I, **bf16)
    h, b2 = torch.randn(N, I, **bf16), torch.randn(I, H, **bf16)
    return _ms(lambda: (a @ b1, h @ b2), args)


def _dense_fp8_ms(N: int, H: int, I: int, device: torch.device, args) -> float:
    """``_dense_ms`` in FP8 e4m3 (``torch._scaled_mm``, per-tensor scales, bf16 out)."""
    f8 = torch.float8_e4m3fn
    one = torch.ones((), device=device)
    a = torch.randn(N, H, device=device).to(f8)
    b1 = torch.randn(2 * I, H, device=device).to(f8).t()  # column-major, as cuBLASLt needs
    h = torch.randn(N, I, device=device).to(f8)
    b2 = torch.randn(H, I, device=device).to(f8).t()

    def run():
        kw = dict(scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        return torch._scaled_mm(a, b1, **kw), torch._scaled_mm(h, b2, **kw)

    return _ms(run, args)


def _prefill_baselines(p: _Prefill, w13, w2, args) -> list[dict[str, Any]]:
    H, I = args.hidden, args.intermediate
    flops = p.flops(args)
    dev = w13.device
    ms = _dense_ms(p.N, H, I, dev, args)
    recs: list[dict[str, Any]] = [{"impl": "dense bf16 mm", "ms": ms, "tflops": flops / ms / 1e9}]
    try:  # the FP8 tensor-core rate: the compute ceiling of the FP8 layer
        ms = _dense_fp8_ms(p.N, H, I, dev, args)
        recs.append({"impl": "dense fp8 scaled_mm", "ms": ms, "tflops": flops / ms / 1e9})
    except Exception as exc:  # no FP8 GEMM in this torch / on this GPU
        recs.append({"impl": "dense fp8 scaled_mm", "error": repr(exc)[:200]})

    def act(gu):
        gate, up = gu[..., :I], gu[..., I:]
        return (F.silu(gate) if args.activation == "silu" else F.gelu(gate)) * up

    x_sorted = p.hidden[p.rows]
    if hasattr(torch, "_grouped_mm"):
        w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)

        def grouped():
            gu = torch._grouped_mm(x_sorted, w13t, offs=p.offsets)
            return torch._grouped_mm(act(gu), w2t, offs=p.offsets)

        try:
            ms = _ms(grouped, args)
            recs.append({"impl": "torch._grouped_mm", "ms": ms, "tflops": flops / ms / 1e9})
        except Exception as exc:
            recs.append({"impl": "torch._grouped_mm", "error": repr(exc)[:200]})
    else:
        recs.append({"impl": "torch._grouped_mm", "error": "not in this torch"})

    bounds = p.bounds

    def loop():
        out = torch.empty(p.N, H, dtype=x_sorted.dtype, device=dev)
        for i in range(len(bounds) - 1):
            s, t = bounds[i], bounds[i + 1]
            if t > s:
                out[s:t] = act(x_sorted[s:t] @ w13[i].t()) @ w2[i].t()
        return out

    ms = _ms(loop, args)
    recs.append({"impl": "cuBLAS loop", "ms": ms, "tflops": flops / ms / 1e9})
    return recs


def _baseline_records(problem, weights, args) -> list[dict[str, Any]]:
    """The baselines of ``problem`` on ``weights`` (:data:`BASELINE_DTYPE`), or one record
    saying why they failed."""
    try:
        if problem.layout == "standard":
            return _prefill_baselines(problem, weights[0], weights[1], args)
        return _decode_baselines(problem, weights[0], weights[1], args)
    except Exception as exc:
        return [{"impl": "baselines", "error": repr(exc)[:300]}]


def _decode_baselines(d: _Decode, w13, w2, args) -> list[dict[str, Any]]:
    I = args.intermediate
    m = max(16, -(-max(d.counts_host) // 16) * 16)
    x = d.hidden[:, :m]
    w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)

    act = F.silu if args.activation == "silu" else F.gelu  # (exact, erf: as the kernels)

    def bmm():
        gu = torch.bmm(x, w13t)
        return torch.bmm(act(gu[..., :I]) * gu[..., I:], w2t)

    ms = _ms(bmm, args)
    nbytes = w13.numel() * w13.element_size() + w2.numel() * w2.element_size()
    return [{"impl": f"cuBLAS bmm ({m} rows)", "ms": ms, "weight_GBps": nbytes / ms / 1e6}]


# ----------------------------------------------------------------------------- sweep


# (block_n, block_k, num_warps, num_stages) per regime, chosen from the sm_90 compiler's
# resource report (no register spills, shared memory within 227 KiB): "compute" for
# 64/128-row tiles of prefill, "memory" for the few rows per expert of decode.
# fmt: off
_SWEEP = {
    ("bf16", "compute", "gate_up"): [
        (128, 64, 8, 4), (128, 64, 8, 3), (128, 64, 8, 4, 16), (128, 64, 8, 4, 4),
        (64, 128, 8, 3), (64, 64, 4, 4), (128, 32, 8, 5),
    ],
    ("bf16", "compute", "down"): [
        (128, 64, 8, 4), (256, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4), (64, 64, 4, 5),
        (256, 32, 8, 4), (128, 64, 8, 5),
    ],
    ("bf16", "memory", "gate_up"): [
        (64, 128, 4, 4), (128, 128, 4, 3), (128, 64, 4, 5), (64, 256, 4, 3), (32, 256, 4, 4),
        (128, 64, 8, 4),
    ],
    ("bf16", "memory", "down"): [
        (64, 128, 4, 4), (128, 128, 4, 4), (64, 256, 4, 4), (32, 256, 4, 5), (128, 64, 4, 5),
        (256, 128, 8, 3),
    ],
    ("fp8", "compute", "gate_up"): [
        (128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 8, 5), (128, 128, 8, 4, 16),
        (128, 128, 4, 4),
    ],
    ("fp8", "compute", "down"): [
        (128, 128, 4, 4), (128, 128, 8, 4), (128, 128, 8, 5), (256, 128, 8, 3), (64, 128, 4, 5),
        (128, 64, 4, 5),
    ],
    ("fp8", "memory", "gate_up"): [
        (128, 128, 4, 4), (128, 64, 4, 6), (128, 128, 8, 3),
    ],
    ("fp8", "memory", "down"): [
        (128, 128, 4, 4), (64, 128, 4, 5), (256, 128, 8, 3),
    ],
}
# fmt: on


def _sweep_space(dtype: str, block_m: int, which: str) -> list[Any]:
    """Tilings of one GEMM to time for a row block size (fp16 sweeps like bf16)."""
    from epmoe.kernels.configs import GemmConfig

    regime = "memory" if block_m <= 32 else "compute"
    key = ("fp8" if dtype == "fp8" else "bf16", regime, which)
    out = []
    for n, k, w, st, *group_m in _SWEEP[key]:  # (block_n, block_k, warps, stages[, group_m])
        if block_m == 32 and n >= 128:
            w = 8  # 32-row tiles with 4 warps spill at 128+ columns (sm_90 resource report)
        if dtype == "fp8" and which == "gate_up" and block_m == 128 and w == 4:
            continue  # two 128×128 accumulators need 8 warps
        out.append(GemmConfig(n, k, group_m[0] if group_m else 8, w, st))
    return list(dict.fromkeys(out))


def _sweep_block_ms(problem, dtype: str, base: Any) -> list[tuple[int, bool]]:
    """(block_m, half_tail) row blockings to try, the default first."""
    if problem.layout == "batched":
        options = [(16, False), (32, False), (64, False)]
    else:  # ≈128 rows per expert: 128-row tiles (fewer weight re-reads) with or without
        # half-height tails, or 64 (less padding)
        options = [(128, True), (128, False), (64, False)]
    return list(dict.fromkeys([(base.block_m, base.half_tail), *options]))


def _sweep(problem, args, dtype: str, weights, budget_s: float):
    """Time GEMM 1 then GEMM 2 tilings for each candidate ``block_m`` (within
    ``budget_s``); returns (best config or None, sweep records)."""
    from epmoe.kernels import ops
    from epmoe.kernels.configs import MoEConfig, candidate_configs, check_config, gemm_configs

    w13, w2, s13, s2 = weights
    H, I, e = args.hidden, args.intermediate, args.local_experts
    standard = problem.layout == "standard"
    top_k = args.top_k if standard else 1
    x, xs = _inputs(problem, dtype)
    out_dtype = torch.bfloat16 if dtype == "fp8" else x.dtype
    tw = problem.topk_weights if standard else None
    seeds = candidate_configs(problem.layout, dtype, problem.m, H, I, e, top_k)
    quick = argparse.Namespace(
        warmup=1, iters=5, device=args.device, host_latency=args.host_latency
    )
    records: list[dict[str, Any]] = []
    best: tuple[float, Any] | None = None

    def timed(gemm: str, cfg, fn) -> float:
        tag = {"sweep": problem.layout, "dtype": dtype, "gemm": gemm, "config": cfg.short()}
        try:
            check_config(cfg, dtype == "fp8")
            ms = _ms(fn, quick)
        except Exception as exc:  # e.g. out of shared memory on this device
            records.append({**tag, "error": repr(exc)[:160]})
            return math.inf
        records.append({**tag, "ms": ms})
        return ms

    block_ms = _sweep_block_ms(problem, dtype, seeds[0])
    start, slice_s = time.monotonic(), budget_s / len(block_ms)
    for i, (block_m, half) in enumerate(block_ms):
        # Each block_m gets an equal slice of the budget, half for each GEMM; the default
        # tiling of each GEMM is always timed.
        gu_deadline = start + slice_s * (i + 0.5)
        dn_deadline = start + slice_s * (i + 1)
        seed = next((c for c in seeds if (c.block_m, c.half_tail) == (block_m, half)), None)
        if seed is None:
            seed = MoEConfig(block_m, *gemm_configs(dtype, block_m)[0], half_tail=half)
        rows = ops.align_pairs(problem.topk_ids, e, block_m, half) if standard else problem.counts
        gu_best, gu_ms = seed.gate_up, math.inf
        options = dict.fromkeys([seed.gate_up, *_sweep_space(dtype, block_m, "gate_up")])
        for j, gu in enumerate(options):
            if j and time.monotonic() > gu_deadline:
                break
            cfg = MoEConfig(block_m, gu, seed.down, half)
            ms = timed(
                "gate_up",
                cfg,
                lambda c=cfg, r=rows: ops.gate_up(x, w13, r, c, args.activation, xs, s13),
            )
            if ms < gu_ms:
                gu_best, gu_ms = gu, ms
        y, ys = ops.gate_up(
            x, w13, rows, MoEConfig(block_m, gu_best, seed.down, half), args.activation, xs, s13
        )
        dn_best, dn_ms = seed.down, math.inf
        options = dict.fromkeys([seed.down, *_sweep_space(dtype, block_m, "down")])
        for j, dn in enumerate(options):
            if j and time.monotonic() > dn_deadline:
                break
            cfg = MoEConfig(block_m, gu_best, dn, half)
            ms = timed(
                "down",
                cfg,
                lambda c=cfg, r=rows, h=y, hs=ys: ops.down(h, w2, r, c, out_dtype, hs, s2, tw),
            )
            if ms < dn_ms:
                dn_best, dn_ms = dn, ms
        if math.isfinite(gu_ms + dn_ms) and (best is None or gu_ms + dn_ms < best[0]):
            best = (gu_ms + dn_ms, MoEConfig(block_m, gu_best, dn_best, half))
    return (best[1] if best else None), records


# ----------------------------------------------------------------------------- main


def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    from epmoe.kernels import ops
    from epmoe.kernels.configs import dtype_name, problem_key, table_filename

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "the experts benchmark needs a CUDA GPU; on CPU: TRITON_INTERPRET=1 python -m "
            "epmoe.bench experts --device cpu (tiny shapes, the Triton interpreter)"
        )
    if device.type == "cpu" and not ops.interpreted():
        raise SystemExit("--device cpu needs TRITON_INTERPRET=1 (tiny shapes only)")
    dtypes = _dtypes(args)
    names = ["prefill", "decode"] if args.scenario == "all" else [args.scenario]
    records: list[dict[str, Any]] = []
    table: dict[str, dict[str, Any]] = {}
    budget_each = args.sweep_budget_s / max(1, len(dtypes) * len(names))
    candidates = _load_candidates(args.candidates)
    copy_bw = _copy_bandwidth(device, args) if device.type == "cuda" else None
    problems = {
        "prefill": _Prefill(args, device) if "prefill" in names else None,
        "decode": _Decode(args, device) if "decode" in names else None,
    }
    for dtype in dtypes:
        weights = _make_weights(
            args.local_experts, args.hidden, args.intermediate, dtype, device, args.seed
        )
        for name in names:
            problem = problems[name]
            recs: list[dict[str, Any]] = []
            try:
                run = _runner(problem, args, dtype, weights)
                cfg = _default_config(problem, args, weights, run)
                recs.append(_measure(problem, args, dtype, weights, cfg, "epmoe triton"))
                others: list[tuple[Any, str]] = [
                    (c, "epmoe triton candidate") for c in candidates.get((name, dtype), [])
                ]
                if args.configs:
                    swept, sweep_recs = _sweep(problem, args, dtype, weights, budget_each)
                    records.extend(sweep_recs)
                    if swept is not None:
                        others.append((swept, "epmoe triton swept"))
                best_cfg, best_ms = cfg, recs[0]["ms"]
                for other, impl in others:
                    if other == cfg:
                        continue
                    try:
                        tuned = _measure(problem, args, dtype, weights, other, impl)
                    except Exception as exc:  # e.g. out of resources on this device
                        err = repr(exc)[:300]
                        recs.append({"impl": impl, "config": other.short(), "error": err})
                        continue
                    # Another tiling must compute what the default one does.
                    diff = relative_error(
                        _valid_rows(run(other), problem), _valid_rows(run(cfg), problem)
                    )
                    tuned["diff_vs_default"] = diff
                    recs.append(tuned)
                    if tuned["ms"] < best_ms and diff < 1e-2:
                        best_cfg, best_ms = other, tuned["ms"]
                if problem.layout == "batched":
                    recs += _split_records(problem, args, dtype, weights, cfg, run)
                if args.configs:
                    cfg = best_cfg
                    key = problem_key(
                        problem.layout, dtype_name(weights[0].dtype), args.hidden,
                        args.intermediate, args.local_experts,
                    )  # fmt: skip
                    table.setdefault(key, {})[str(problem.m)] = cfg.to_dict()
            except Exception as exc:
                recs.append({"impl": "epmoe triton", "error": repr(exc)[:300]})
            if not args.no_baselines and dtype == BASELINE_DTYPE:  # (its weights are here)
                recs += _baseline_records(problem, weights, args)
            for r in recs:
                r.setdefault("scenario", name)
                r.setdefault("dtype", dtype)
            records.extend(recs)
        del weights
        torch.cuda.empty_cache()
    if not args.no_baselines and BASELINE_DTYPE not in dtypes:  # every dtype is held to them
        weights = _make_weights(
            args.local_experts, args.hidden, args.intermediate, BASELINE_DTYPE, device, args.seed
        )
        for name in names:
            recs = _baseline_records(problems[name], weights, args)
            records.extend(dict(r, scenario=name, dtype=BASELINE_DTYPE) for r in recs)
        del weights
        torch.cuda.empty_cache()

    _add_ratios(records, copy_bw)
    main_recs = [r for r in records if "sweep" not in r]
    cols = ["scenario", "dtype", "impl", "ms", "tflops", "gemm_tflops", "vs_dense",
            "vs_grouped_mm", "vs_cublas_loop", "roofline_ms", "vs_roofline", "weight_GBps",
            "frac_of_copy", "m_splits", "fp8_speedup", "config", "error"]  # fmt: skip
    print(format_table(main_recs, [c for c in cols if any(c in r for r in main_recs)]))
    steps = [r for r in main_recs if "gate_up_ms" in r]
    if steps:  # where the prefill layer's time goes
        cols = ["dtype", "impl", "ms", "align_ms", "gate_up_ms", "down_ms", "sum_ms",
                "pad_ratio", "mma_tflops_padded", "ms_with_quant"]  # fmt: skip
        print(format_table(steps, [c for c in cols if any(c in r for r in steps)]))
    if copy_bw:
        print(f"device copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s")
        if any("weight_bytes" in r for r in records):
            print("roofline_ms = max(expert weight bytes / copy bandwidth, dense GEMM of the same "
                  "FLOPs in the layer's dtype); vs_roofline = roofline_ms / ms")  # fmt: skip
        records.append({"scenario": "decode", "impl": "device copy", "copy_GBps": copy_bw / 1e9})
    if args.report_kernels:
        rep = _kernel_report()
        cols = ["kernel", "regs", "spills", "smem", "warps", "stages", "consts", "error"]
        print(format_table(rep, [c for c in cols if any(c in r for r in rep)]))
        records.extend({"kernel_report": True, **r} for r in rep)
    if args.configs and table:
        info = machine_info()
        doc = {k: info.get(k) for k in ("gpu", "triton", "torch", "date")}
        doc["configs"] = table
        if args.configs_out:
            with open(args.configs_out, "w") as f:
                json.dump(doc, f, indent=1)
            ship = table_filename(info.get("gpu") or "unknown")
            print(f"tuned table written to {args.configs_out}; ship it as "
                  f"epmoe/kernels/configs/{ship}")  # fmt: skip
        else:
            print(json.dumps(doc, indent=1))
    return records


def _load_candidates(path: str | None) -> dict[tuple[str, str], list[Any]]:
    """``--candidates``: configs to time per (scenario, dtype)."""
    from epmoe.kernels.configs import MoEConfig

    out: dict[tuple[str, str], list[Any]] = {}
    if not path:
        return out
    with open(path) as f:
        items = json.load(f)
    for i, item in enumerate(items):
        try:
            key = (item["scenario"], item["dtype"])
            config = MoEConfig.from_dict(item["config"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"--candidates {path}: item {i} must be {{scenario, dtype, config}} with a "
                f"MoEConfig dict as config ({exc!r})"
            ) from exc
        if key[0] not in ("prefill", "decode") or key[1] not in ("bf16", "fp16", "fp8"):
            raise ValueError(
                f"--candidates {path}: item {i} has scenario {key[0]!r} / dtype {key[1]!r}; "
                "scenario is prefill or decode, dtype bf16, fp16 or fp8"
            )
        out.setdefault(key, []).append(config)
    return out


def _add_ratios(records: list[dict[str, Any]], copy_bw: float | None) -> None:
    """Ratios of each Triton record to the baselines of the same run (> 1: faster)."""

    def find(scenario: str, impl: str, dtype: str | None = None) -> dict[str, Any] | None:
        for r in records:
            same = r.get("scenario") == scenario and r.get("impl") == impl and "ms" in r
            if same and (dtype is None or r.get("dtype") == dtype):
                return r
        return None

    for r in records:
        if "sweep" in r or "ms" not in r or not str(r.get("impl", "")).startswith("epmoe"):
            continue
        sc = r["scenario"]
        if sc == "prefill":
            for key, impl in (
                ("vs_dense", "dense bf16 mm"),
                ("vs_grouped_mm", "torch._grouped_mm"),
                ("vs_cublas_loop", "cuBLAS loop"),
            ):
                b = find(sc, impl)
                if b is not None:
                    r[key] = b["ms"] / r["ms"]
            # The hardware ceiling of this run: reading every expert weight once at the copy
            # bandwidth, or the FLOPs at the dense tensor-core rate of the dtype, whichever
            # takes longer (a grouped GEMM can do no better than both).
            dense = find(sc, "dense fp8 scaled_mm" if r["dtype"] == "fp8" else "dense bf16 mm")
            if copy_bw and dense is not None and "weight_bytes" in r:
                r["roofline_ms"] = max(r["weight_bytes"] / copy_bw * 1e3, dense["ms"])
                r["vs_roofline"] = r["roofline_ms"] / r["ms"]
        elif copy_bw:
            r["frac_of_copy"] = r["weight_GBps"] * 1e9 / copy_bw
        if r["dtype"] == "fp8":  # against the fastest bf16 Triton layer of the same run
            bf16 = [
                b["ms"] for b in records
                if b.get("scenario") == sc and b.get("dtype") == "bf16" and "ms" in b
                and "sweep" not in b and str(b.get("impl", "")).startswith("epmoe")
                and b.get("diff_vs_default", 0.0) < 1e-2  # only tilings that agree
            ]  # fmt: skip
            if bf16:
                r["fp8_speedup"] = min(bf16) / r["ms"]
