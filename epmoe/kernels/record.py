"""EPLB load recording in one kernel: one step's physical ids counted into the next ring row.

``LoadRecorder.record`` in torch is seven small kernels (a cast, two fills, ``scatter_add``,
``remainder``, ``index_copy`` and the step increment): in a CUDA-graph decode step each
costs a few µs of GPU time, per layer. ``record_load`` does the same in one launch of one
program, with no host synchronisation (capturable; every replay records the next row):

1. read the step count ``steps`` and zero row ``steps % S`` of the ring;
2. add 1 at ``[row, id]`` for every id in ``[0, P)`` (``-1``, no expert, is skipped);
3. store ``steps + 1``.

One program, so the three steps need no grid-wide ordering: a block barrier between them
makes the zeroed row visible to every thread's additions and keeps every thread's read of
``steps`` before its update. The additions are relaxed atomics (their order is free; the
counts are integers, so the sums are exact). One program is quick at decode sizes and slow
at prefill sizes (one H200, P = 256: 3.0 µs at 1024 ids, 34.7 at 32768, where the torch ops
take 16-19 µs at either): ``LoadRecorder`` uses it up to ``FUSED_RECORD_MAX_IDS``.

Shape legend: N ids (T tokens × K top-k) · S steps in the window · P physical experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epmoe.kernels.launcher import check_cuda, launch

BLOCK_N = 1024  # ids per loop iteration
BLOCK_P = 1024  # ring entries zeroed per loop iteration


@triton.jit(do_not_specialize=["N"])
def record_kernel(
    ids_ptr,  # [N] int32 / int64 physical ids, -1 where none
    counts_ptr,  # [S, P] int64 ring, row-major
    steps_ptr,  # [] int64 steps recorded so far
    N,
    P: tl.constexpr,
    S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    steps = tl.load(steps_ptr)
    row_ptr = counts_ptr + (steps % S) * P
    for p0 in tl.static_range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        tl.store(row_ptr + p, tl.zeros([BLOCK_P], dtype=tl.int64), mask=p < P)
    tl.debug_barrier()  # the zeroed row before any addition
    for n0 in range(0, N, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        ids = tl.load(ids_ptr + n, mask=n < N, other=-1).to(tl.int64)
        ok = (ids >= 0) & (ids < P)
        ones = tl.full([BLOCK_N], 1, dtype=tl.int64)
        tl.atomic_add(row_ptr + ids, ones, mask=ok, sem="relaxed")
    tl.debug_barrier()  # every thread has read `steps` (and added) before it moves on
    tl.store(steps_ptr, steps + 1)


def record_load(ids: torch.Tensor, counts_SP: torch.Tensor, steps: torch.Tensor) -> None:
    """Count ``ids`` (any shape, int32/int64, ``-1`` for none) into row ``steps % S`` of
    ``counts_SP [S, P]`` int64 (contiguous, on ``ids``' device), which it overwrites, and
    add 1 to ``steps`` (0-d int64): ``LoadRecorder.record`` in one launch. Ids outside
    ``[-1, P)`` are not counted (the layer has refused them before)."""
    S, P = counts_SP.shape
    if counts_SP.dtype != torch.int64 or steps.dtype != torch.int64 or steps.dim() != 0:
        raise TypeError(
            f"record_load counts into int64 [S, P] with a 0-d int64 step, got "
            f"{counts_SP.dtype} {tuple(counts_SP.shape)} and {steps.dtype} {tuple(steps.shape)}"
        )
    if not counts_SP.is_contiguous():
        raise ValueError("record_load writes counts_SP in place: it must be contiguous")
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"record_load counts int32 or int64 ids, got {ids.dtype}")
    if not ids.device == counts_SP.device == steps.device:  # (the launch passes addresses)
        raise ValueError(
            f"record_load needs ids ({ids.device}), counts_SP ({counts_SP.device}) and steps "
            f"({steps.device}) on one device"
        )
    check_cuda("record_load", ids.device, record_kernel)
    ids_N = ids.reshape(-1)
    if ids_N.numel() and ids_N.stride(0) != 1:
        ids_N = ids_N.contiguous()
    launch(record_kernel)(
        (1,), ids_N, counts_SP, steps, ids_N.numel(), P=P, S=S, BLOCK_N=BLOCK_N,
        BLOCK_P=min(BLOCK_P, triton.next_power_of_2(P)), num_warps=8,
    )  # fmt: skip
