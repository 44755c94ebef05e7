"""Compile ``symm_ll``'s kernels for sm_90 without a GPU (run as a script, outside the
Triton interpreter): catches what only the compiler sees (globals, types, inline PTX).
The compiles run in forked processes, one per core (up to 4): about 1.7 s each."""

from __future__ import annotations

import multiprocessing
import os

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from epmoe.comm.symm import kernels as k

_JOBS: list[tuple] = []  # (kernel, typed, consts), filled by main(), read by the forks


def _compile(fn, typed: dict[str, str], consts: dict) -> None:
    """Queue ``fn``'s compile. ``typed``: pointer and 64-bit arguments; every other
    non-constexpr one is int32."""
    _JOBS.append((fn, typed, consts))


def _run(i: int) -> None:
    fn, typed, consts = _JOBS[i]
    if "PDL" in fn.arg_names:  # as launched on sm_90 (programmatic dependent launch)
        consts = dict(consts, PDL=True)
    for name in ("ROWS", "RANKS"):  # (one token per step, one rank's row per load)
        if name in fn.arg_names and name not in consts:
            consts = dict(consts, **{name: 1})
    for param in fn.params:  # other meta-parameters at their defaults, as a launch has them
        if param.is_constexpr and param.name not in consts and param.has_default:
            consts = dict(consts, **{param.name: param.default})
    signature = {n: "constexpr" if n in consts else typed.get(n, "i32") for n in fn.arg_names}
    constexprs = {(fn.arg_names.index(n),): v for n, v in consts.items()}
    src = ASTSource(fn, signature, constexprs=constexprs, attrs={})
    options = {"num_warps": 8, "launch_pdl": consts.get("PDL", False)}
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def main() -> None:
    shared = dict(bases_ptr="*i64", err_addr="i64", timeout_ns="i64")
    for fp8 in (False, True):
        wire, wire_ptr = (tl.float8e4nv, "*fp8e4nv") if fp8 else (tl.bfloat16, "*bf16")
        blocks = dict(K=8, BLOCK_K=8, BLOCK_H=8192, FP8=fp8, WIRE=wire)
        send = dict(x_ptr="*bf16", ids_ptr="*i64", w_ptr="*fp32", owner_ptr="*i32")
        send.update(local_ptr="*i32", routes_ptr="*i32", **shared)
        quant = dict(FP8_MAX=448.0, INV_FP8_MAX=1 / 448, EPS=1e-10)
        for batch, fence, counted in ((1, False, False), (4, True, False), (1, False, True)):
            consts = dict(blocks, BLOCK_W=2, BATCH=batch, FENCE=fence, PREQUANT=False, **quant)
            _compile(
                k.dispatch_send_kernel, dict(send, xs_ptr="*bf16"), dict(consts, COUNTED=counted)
            )
        if fp8:  # symm_ht's FP8 send of rows quantized beforehand
            consts = dict(blocks, BLOCK_W=2, BATCH=4, FENCE=True, PREQUANT=True, **quant)
            consts.update(COUNTED=False, ROUTES=True)
            _compile(k.dispatch_send_kernel, dict(send, x_ptr=wire_ptr, xs_ptr="*fp32"), consts)
        # symm_ht's counted send, several tokens at a time (FP8: quantized beforehand, and
        # quantized in the send)
        consts = dict(blocks, BLOCK_W=2, BATCH=1, FENCE=False, PREQUANT=fp8, **quant)
        consts.update(COUNTED=True, ROWS=4, ROUTES=True)
        xs = dict(x_ptr=wire_ptr, xs_ptr="*fp32") if fp8 else dict(xs_ptr="*bf16")
        _compile(k.dispatch_send_kernel, dict(send, **xs), consts)
        if fp8:
            consts.update(PREQUANT=False, ROWS=2)
            _compile(k.dispatch_send_kernel, dict(send, xs_ptr="*bf16"), consts)
        for in_place in (True, False):  # rows read where they landed, or copied
            out = "*i32" if in_place else wire_ptr
            recv = dict(xo_ptr=out, so_ptr="*fp32", cnt_ptr="*i32", pos_ptr="*i32")
            recv.update(recv_t_ptr="*i32", **shared)
            consts = dict(blocks, IN_PLACE=in_place)
            _compile(k.ll_dispatch_recv_kernel, recv, consts)
            fused = dict(consts, BLOCK_W=2, STAMPS=in_place, **quant)
            _compile(k.ll_dispatch_kernel, dict(send, stamps_ptr="*i64", **recv), fused)
    csend = dict(y_ptr="*bf16", pos_ptr="*i32", recv_t_ptr="*i32", cnt_ptr="*i32", **shared)
    _compile(k.ll_combine_send_kernel, csend, dict(K=8, BLOCK_K=8, BLOCK_H=8192, BLOCK_E=256))
    crecv = dict(out_ptr="*bf16", ids_ptr="*i64", owner_ptr="*i32", routes_ptr="*i32", **shared)
    combine = dict(K=8, BLOCK_K=8, BLOCK_W=2, BLOCK_H=8192)
    for counted in (False, True):
        for rows, ranks, prefetch, block_h in ((1, 1, 0, 8192), (4, 2, 0, 4096), (4, 2, 1, 4096)):
            # symm_ll's one token per program, symm_ht's several (rows prefetched or not)
            consts = dict(combine, COUNTED=counted, ROWS=rows, RANKS=ranks, PREFETCH=prefetch)
            _compile(k.combine_recv_kernel, crecv, dict(consts, BLOCK_H=block_h))
    for stamps in (False, True):
        fused = dict(combine, BLOCK_E=256, STAMPS=stamps)
        _compile(k.ll_combine_kernel, dict(csend, stamps_ptr="*i64", **crecv), fused)
    ht = dict(ids_out_ptr="*i64", w_out_ptr="*fp32", recv_t_ptr="*i32", **shared)
    for counted, rows in ((False, 1), (True, 1), (True, 64)):
        _compile(k.ht_dispatch_recv_kernel, ht, dict(K=8, BLOCK_K=8, COUNTED=counted, ROWS=rows))
    hsend = dict(y_ptr="*bf16", ids_out_ptr="*i64", recv_t_ptr="*i32", **shared)
    hsend.update(out_ptr="*bf16", routes_ptr="*i32")
    for batch, fence, counted in ((1, False, False), (4, True, False), (1, False, True)):
        consts = dict(K=8, BLOCK_K=8, BLOCK_H=8192, BATCH=batch, FENCE=fence, COUNTED=counted)
        consts["ROWS"] = 4 if counted else min(batch, 4)  # as ht.py launches it
        _compile(k.ht_combine_send_kernel, hsend, consts)
    # symm_ht's streamed combine: senders and reducers in one launch, the reducers alone
    stream = dict(K=8, BLOCK_K=8, BLOCK_H=8192, BATCH=1, FENCE=False, COUNTED=True, ROWS=4)
    stream.update(STREAM=True, CHUNK=512, BLOCK_W=2, RECV_BLOCK_H=4096, RECV_ROWS=4)
    _compile(k.ht_combine_send_kernel, hsend, dict(stream, RECV_RANKS=2))
    reduce = dict(y_ptr="*bf16", out_ptr="*bf16", routes_ptr="*i32", **shared)
    _compile(k.ht_combine_reduce_kernel, reduce, dict(CHUNK=512, BLOCK_W=2, BLOCK_H=4096))
    send = dict(send, xs_ptr="*bf16")
    chunked = dict(blocks, BLOCK_W=2, BATCH=1, FENCE=False, PREQUANT=False, COUNTED=True)
    _compile(k.dispatch_send_kernel, send, dict(chunked, ROWS=4, ROUTES=True, CHUNK=512))
    workers = max(1, min(4, os.cpu_count() or 1))
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        pool.map(_run, range(len(_JOBS)), chunksize=1)
    print(f"compiled {len(_JOBS)} symm kernels for sm_90")


if __name__ == "__main__":
    main()
