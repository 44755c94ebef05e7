"""Triton grouped GEMMs of the expert MLPs, for both layouts a backend delivers.

Shape legend: R received rows · H hidden size · I intermediate size · e local experts ·
K top-k · C rows of capacity per expert (ExpertBatched) · P = R·K (row, k) pairs ·
P_pad padded pair positions · B row blocks (Standard) · G = 128 (FP8 group size).

Each kernel runs one ``[BLOCK_M, BLOCK_N]`` output tile of one expert per program:

* ``BATCHED=False`` (Standard): row block ``b`` holds ``block_rows[b]`` padded positions of
  expert ``block_expert[b]`` from ``block_start[b]`` (0 rows past the last block: the
  program exits); ``sorted_pairs[pos]`` is the pair ``r·K + k`` at each position, ``P`` at
  padding. Hidden rows are gathered (row ``pair // K``).
* ``BATCHED=True`` (ExpertBatched): a fixed grid (CUDA-graph safe) of ``e · S`` row
  programs per column block; program ``j < S`` of an expert takes its row blocks ``j, j + S,
  ...`` up to ``counts[expert]``. The host picks ``S`` (``ops.batched_m_splits``) from the
  shape alone: decode slabs hold ``C`` rows of capacity but a few valid ones, and a grid of
  ``e · ceil(C / BLOCK_M)`` blocks would launch mostly programs with nothing to do. With
  ``GATHER`` (GEMM 1 only) the input is the received rows ``[R, H]`` where they landed and
  ``sorted_pairs`` the row index ``[e, C]``: row ``c`` of expert ``i`` reads
  ``x[index[i, c]]`` (``symm_ll`` does not copy rows into ``[e, C, H]`` slabs).

With ``HALF_TAIL`` a block of at most ``BLOCK_M / 2`` rows (an expert's last one) runs a
half-height tile: at ≈ 1.1 blocks of rows per expert, 128-row tiles would otherwise compute
≈ 1.5× the useful rows. Both tile heights are inlined in one kernel, so the tail tile runs
beside its expert's full tiles and reads the same weight tiles while they are in L2.

``gate_up_kernel`` computes the gate and up tiles of ``w13`` in one program and stores
``act(gate) · up``; in FP8 mode with ``BLOCK_N == 128`` it quantizes that tile per token
group of 128 for ``down_kernel`` (other widths store fp32, quantized by a separate pass).
``down_kernel`` multiplies by ``w2``; for the Standard layout it scales each row by its
router weight.

FP8 (W8A8, e4m3, DeepSeek-V3 format): activations carry float32 scales per token and group
of 128 columns, weights per 128×128 block (``W_BLOCK_SCALE``) or one per expert. Each
``BLOCK_K`` step (which divides 128) adds ``dot(a, b) · a_scale · b_scale`` to the fp32
accumulator, through ``_rescale`` (one register tile per accumulator, as in bf16).
"""

import triton
import triton.language as tl

# Sizes that change with every batch: Triton would otherwise compile a variant per value
# class (== 1, divisible by 16) of each, i.e. recompile as the batch size moves while
# serving; they only bound loops and masks, so specialising on them gains nothing.
ROW_COUNT_ARGS = ["num_pairs", "capacity", "num_m_blocks", "m_splits"]


@triton.jit
def _tile_ids(pid, num_m_blocks, num_n_blocks, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M consecutive row blocks sweep the columns together (L2 reuse
    of both the weight tiles of one expert and the rows)."""
    per_group = GROUP_M * num_n_blocks
    group = pid // per_group
    first_m = group * GROUP_M
    group_rows = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _act_and_mul(gate, up, ACTIVATION: tl.constexpr):
    """``act(gate) · up`` in fp32; silu, or gelu in its exact (erf) form."""
    if ACTIVATION == "silu":
        act = gate * tl.sigmoid(gate)
    else:
        act = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    return act * up


@triton.jit
def _rescale(
    acc, row_factor, col_factor, W_BLOCK_SCALE: tl.constexpr, W_SCALE_PER_TILE: tl.constexpr
):
    """``acc · row_factor[:, None] · col_factor[None, :]`` with block scales that vary along
    the tile, else ``acc · (row_factor · col_factor)[:, None]`` (one weight scale per tile and
    step, broadcast to ``[BLOCK_M]``).

    FP8 block-scaled accumulation without a second register tile: with ``s_g[m, n] =
    a_scale_g[m] · w_scale_g[n]`` the scale of K step ``g``, the loop keeps ``acc = Σ_{g' ≤ g}
    s_g' · D_g' / s_g`` (``D_g`` the raw FP8 dot of step ``g``), so each step is one in-place
    ``dot(a, b, acc · s_{g-1} / s_g)`` and the epilogue multiplies by the last ``s_g``.
    Scales are ≥ 1e-10/448 and finite, so the ratios are finite; each step adds one rounding
    (relative 6e-8) to the running sum. When the tile lies inside one 128-row weight block
    (``W_SCALE_PER_TILE``) the weight factor is a scalar and the rescale one multiply per
    element.
    """
    if W_BLOCK_SCALE and not W_SCALE_PER_TILE:  # column factors vary along the tile
        out = acc * (row_factor[:, None] * col_factor[None, :])
    else:  # one column factor, broadcast to [BLOCK_M]
        out = acc * (row_factor * col_factor)[:, None]
    return out


@triton.jit
def _program_block(
    num_m_blocks,
    m_splits,
    N,
    block_expert_ptr,
    block_start_ptr,
    block_rows_ptr,
    counts_ptr,
    capacity,
    BATCHED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """This program's column block and rows: (pid_n, expert, first, step, end). It runs
    the tiles starting at ``first, first + step, ...`` below ``end``, each of
    ``min(end - start, BLOCK_M)`` rows (none when ``end <= first``).

    Standard: one block of the ``align_pairs`` table (its padded positions).
    Batched: program ``j`` of ``m_splits`` per expert takes the expert's row blocks
    ``j, j + m_splits, ...`` up to its valid rows (never past ``C``)."""
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_m_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    if BATCHED:
        expert = pid_m // m_splits
        first = (pid_m % m_splits) * BLOCK_M
        step = m_splits * BLOCK_M
        end = tl.minimum(tl.load(counts_ptr + expert), capacity)
    else:
        expert = tl.load(block_expert_ptr + pid_m)
        first = tl.load(block_start_ptr + pid_m)
        step = BLOCK_M
        end = first + tl.load(block_rows_ptr + pid_m)
    return pid_n, expert.to(tl.int64), first.to(tl.int64), step, end.to(tl.int64)


@triton.jit
def _tile_rows(
    first,
    rows,
    sorted_pairs_ptr,
    num_pairs,
    TOP_K: tl.constexpr,
    BATCHED: tl.constexpr,
    GATHER: tl.constexpr,
    BM: tl.constexpr,
):
    """The ``BM`` rows of a tile: (valid mask, source row in the input, destination row in
    the output, pair index), int64. Standard: the input row is the pair's token (gathered),
    the output row its padded position. Batched: both are the row in the expert's slab;
    with ``GATHER`` the input row is ``sorted_pairs_ptr[dst]`` instead (the expert's row
    index, received rows read in place)."""
    if BATCHED:
        offs = tl.arange(0, BM)
        valid = offs < rows
        dst = first + offs
        if GATHER:
            src = tl.load(sorted_pairs_ptr + dst, mask=valid, other=0).to(tl.int64)
        else:
            src = dst
        pair = dst
    else:
        dst = first + tl.arange(0, BM)
        pair = tl.load(sorted_pairs_ptr + dst)  # every position of a block is in the table
        valid = pair < num_pairs
        src = tl.where(valid, pair // TOP_K, 0).to(tl.int64)
    return valid, src, dst, pair


@triton.jit
def _w_scale_ptrs(
    ws_base,
    n0,
    stride_wsn,
    W_SCALE_PER_TILE: tl.constexpr,
    GROUP: tl.constexpr,
    BM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Pointers to the FP8 weight scales of a tile whose weight rows start at ``n0``:
    ``[BM]`` copies of the tile's one block row (``W_SCALE_PER_TILE``; a scalar
    loop-carried value does not lower in triton 3.6), else ``[BLOCK_N]`` per column."""
    if W_SCALE_PER_TILE:
        ptrs = ws_base + (n0 // GROUP) * stride_wsn + tl.zeros((BM,), tl.int32)
    else:
        ptrs = ws_base + ((n0 + tl.arange(0, BLOCK_N)) // GROUP) * stride_wsn
    return ptrs


@triton.jit
def _load_w_scale(
    ptrs,
    ws_base,
    n_mask,
    W_BLOCK_SCALE: tl.constexpr,
    W_SCALE_PER_TILE: tl.constexpr,
    BM: tl.constexpr,
):
    """One K step's weight scales (1 for padding columns); per-expert scales: ``[BM]``
    copies of the expert's one scale."""
    if W_SCALE_PER_TILE:
        scale = tl.load(ptrs)
    elif W_BLOCK_SCALE:
        scale = tl.load(ptrs, mask=n_mask, other=1.0)
    else:
        scale = tl.load(ws_base + tl.zeros((BM,), tl.int32))
    return scale


@triton.jit
def _gate_up_tile(
    x_ptr,
    x_scale_ptr,
    w_base,  # w13[expert]
    ws_base,  # w13_scale[expert]
    y_ptr,
    y_scale_ptr,
    sorted_pairs_ptr,
    expert,
    first,
    rows,
    pid_n,
    N,
    K,
    num_pairs,
    stride_xe,
    stride_xm,
    stride_xk,
    stride_xse,
    stride_xsm,
    stride_xsk,
    stride_wn,
    stride_wk,
    stride_wsn,
    stride_wsk,
    stride_ye,
    stride_ym,
    stride_yn,
    stride_yse,
    stride_ysm,
    stride_ysn,
    TOP_K: tl.constexpr,
    BATCHED: tl.constexpr,
    GATHER: tl.constexpr,
    ACTIVATION: tl.constexpr,
    FP8: tl.constexpr,
    W_BLOCK_SCALE: tl.constexpr,
    W_SCALE_PER_TILE: tl.constexpr,
    GROUP: tl.constexpr,
    FP8_MAX: tl.constexpr,
    INV_FP8_MAX: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    BM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One ``[BM, BLOCK_N]`` tile of ``act(x @ gate.T) · (x @ up.T)`` (see gate_up_kernel)."""
    row_mask, src, dst, _ = _tile_rows(
        first, rows, sorted_pairs_ptr, num_pairs, TOP_K, BATCHED, GATHER, BM
    )
    x_rows = expert * stride_xe + src * stride_xm
    y_rows = expert * stride_ye + dst * stride_ym
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + x_rows[:, None] + offs_k[None, :] * stride_xk  # [BM, BLOCK_K]
    # [BLOCK_K, BLOCK_N] tiles of the gate rows and of the up rows (N rows further on)
    wg_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    wu_ptrs = wg_ptrs + N * stride_wn
    acc_g = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    if FP8:
        xs_ptrs = x_scale_ptr + expert * stride_xse + src * stride_xsm  # [BM]
        n0 = pid_n * BLOCK_N
        wgs_ptrs = _w_scale_ptrs(ws_base, n0, stride_wsn, W_SCALE_PER_TILE, GROUP, BM, BLOCK_N)
        wus_ptrs = _w_scale_ptrs(ws_base, n0 + N, stride_wsn, W_SCALE_PER_TILE, GROUP, BM, BLOCK_N)
        # The previous K step's scales (see _rescale), started at the first step's; padding
        # rows and columns get 1.
        xs_prev = tl.load(xs_ptrs, mask=row_mask, other=1.0)
        wgs_prev = _load_w_scale(wgs_ptrs, ws_base, n_mask, W_BLOCK_SCALE, W_SCALE_PER_TILE, BM)
        wus_prev = _load_w_scale(wus_ptrs, ws_base, n_mask, W_BLOCK_SCALE, W_SCALE_PER_TILE, BM)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
            wg = tl.load(wg_ptrs, mask=n_mask[None, :], other=0.0)
            wu = tl.load(wu_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < K - k0
            x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            wg = tl.load(wg_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            wu = tl.load(wu_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if FP8:
            group_k = k0 // GROUP
            xs = tl.load(xs_ptrs + group_k * stride_xsk, mask=row_mask, other=1.0)
            gk = group_k * stride_wsk
            wgs = _load_w_scale(wgs_ptrs + gk, ws_base, n_mask, W_BLOCK_SCALE, W_SCALE_PER_TILE, BM)
            wus = _load_w_scale(wus_ptrs + gk, ws_base, n_mask, W_BLOCK_SCALE, W_SCALE_PER_TILE, BM)
            acc_g = tl.dot(
                x,
                wg,
                _rescale(acc_g, xs_prev / xs, wgs_prev / wgs, W_BLOCK_SCALE, W_SCALE_PER_TILE),
            )
            acc_u = tl.dot(
                x,
                wu,
                _rescale(acc_u, xs_prev / xs, wus_prev / wus, W_BLOCK_SCALE, W_SCALE_PER_TILE),
            )
            xs_prev = xs
            wgs_prev = wgs
            wus_prev = wus
        else:
            acc_g = tl.dot(x, wg, acc_g, input_precision=DOT_PRECISION)
            acc_u = tl.dot(x, wu, acc_u, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        wg_ptrs += BLOCK_K * stride_wk
        wu_ptrs += BLOCK_K * stride_wk
    if FP8:  # undo the last step's division: acc · xs · ws
        acc_g = _rescale(acc_g, xs_prev, wgs_prev, W_BLOCK_SCALE, W_SCALE_PER_TILE)
        acc_u = _rescale(acc_u, xs_prev, wus_prev, W_BLOCK_SCALE, W_SCALE_PER_TILE)

    h = _act_and_mul(acc_g, acc_u, ACTIVATION)
    y_ptrs = y_ptr + y_rows[:, None] + offs_n[None, :] * stride_yn
    y_mask = row_mask[:, None] & n_mask[None, :]
    if FP8 and BLOCK_N == GROUP:
        # One group of GROUP columns per tile: quantize it for down_kernel (amax / FP8_MAX).
        # (Other widths store h in fp32; ops.gate_up quantizes it afterwards.)
        h = tl.where(n_mask[None, :], h, 0.0)
        scale = tl.maximum(tl.max(tl.abs(h), 1), 1e-10) * INV_FP8_MAX  # [BM], as quant.py
        q = tl.minimum(tl.maximum(h * tl.div_rn(1.0, scale)[:, None], -FP8_MAX), FP8_MAX)
        tl.store(y_ptrs, q.to(y_ptr.dtype.element_ty), mask=y_mask)
        ys_ptrs = y_scale_ptr + expert * stride_yse + dst * stride_ysm + pid_n * stride_ysn
        tl.store(ys_ptrs, scale, mask=row_mask)
    else:
        tl.store(y_ptrs, h.to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit
def _gate_up_block(
    x_ptr, x_scale_ptr, w_base, ws_base, y_ptr, y_scale_ptr, sorted_pairs_ptr,
    expert, first, rows, pid_n, N, K, num_pairs,
    stride_xe, stride_xm, stride_xk, stride_xse, stride_xsm, stride_xsk,
    stride_wn, stride_wk, stride_wsn, stride_wsk,
    stride_ye, stride_ym, stride_yn, stride_yse, stride_ysm, stride_ysn,
    TOP_K: tl.constexpr, BATCHED: tl.constexpr, GATHER: tl.constexpr,
    ACTIVATION: tl.constexpr, FP8: tl.constexpr,
    W_BLOCK_SCALE: tl.constexpr, W_SCALE_PER_TILE: tl.constexpr, GROUP: tl.constexpr,
    FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr, HALF_TAIL: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Rows ``[first, first + rows)`` (``rows <= BLOCK_M``) as one tile. Two tile heights,
    one inlined body each: a block of at most ``BLOCK_M / 2`` rows (an expert's last)
    takes the half-height one; without ``HALF_TAIL`` that body is not compiled."""
    if HALF_TAIL:  # noqa: SIM102
        if rows <= BLOCK_M // 2:
            _gate_up_tile(
                x_ptr, x_scale_ptr, w_base, ws_base, y_ptr, y_scale_ptr, sorted_pairs_ptr,
                expert, first, rows, pid_n, N, K, num_pairs,
                stride_xe, stride_xm, stride_xk, stride_xse, stride_xsm, stride_xsk,
                stride_wn, stride_wk, stride_wsn, stride_wsk,
                stride_ye, stride_ym, stride_yn, stride_yse, stride_ysm, stride_ysn,
                TOP_K, BATCHED, GATHER, ACTIVATION, FP8, W_BLOCK_SCALE, W_SCALE_PER_TILE, GROUP,
                FP8_MAX, INV_FP8_MAX, DOT_PRECISION, EVEN_K,
                BLOCK_M // 2, BLOCK_N, BLOCK_K,
            )  # fmt: skip
            return
    _gate_up_tile(
        x_ptr, x_scale_ptr, w_base, ws_base, y_ptr, y_scale_ptr, sorted_pairs_ptr,
        expert, first, rows, pid_n, N, K, num_pairs,
        stride_xe, stride_xm, stride_xk, stride_xse, stride_xsm, stride_xsk,
        stride_wn, stride_wk, stride_wsn, stride_wsk,
        stride_ye, stride_ym, stride_yn, stride_yse, stride_ysm, stride_ysn,
        TOP_K, BATCHED, GATHER, ACTIVATION, FP8, W_BLOCK_SCALE, W_SCALE_PER_TILE, GROUP,
        FP8_MAX, INV_FP8_MAX, DOT_PRECISION, EVEN_K,
        BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip


@triton.jit(do_not_specialize=ROW_COUNT_ARGS)
def gate_up_kernel(
    # pointers
    x_ptr,  # Standard: [R, H] hidden rows; Batched: [e, C, H]; bf16/fp16/fp32 or fp8
    x_scale_ptr,  # FP8: [R, ceil(H/G)] / [e, C, ceil(H/G)] float32 per-token-group scales
    w_ptr,  # [e, 2I, H]: gate rows [0, I), then up rows [I, 2I)
    w_scale_ptr,  # FP8: [e, ceil(2I/G), ceil(H/G)] float32 block scales, or [e] per expert
    y_ptr,  # out, Standard: [P_pad, I] by padded position; Batched: [e, C, I]; act(gate)·up
    y_scale_ptr,  # FP8 out: [P_pad, ceil(I/G)] / [e, C, ceil(I/G)] float32 group scales of y
    sorted_pairs_ptr,  # Standard: [P_pad] int32 pair r·K + k per position, P at padding
    block_expert_ptr,  # Standard: [B] int32 expert of each row block, -1 past the last one
    block_start_ptr,  # Standard: [B] int32 first padded position of each row block
    block_rows_ptr,  # Standard: [B] int32 padded positions of each row block, 0 past the last
    counts_ptr,  # Batched: [e] int32 valid rows of each expert
    # sizes
    N,  # I
    K,  # H
    num_pairs,  # Standard: P (the sentinel)
    capacity,  # Batched: C
    num_m_blocks,  # Standard: B; Batched: e · m_splits
    m_splits,  # Batched: row programs per expert (S)
    # strides (elements), in groups of (expert, row, column)
    # x
    stride_xe,
    stride_xm,
    stride_xk,
    # x_scale
    stride_xse,
    stride_xsm,
    stride_xsk,
    # w
    stride_we,
    stride_wn,
    stride_wk,
    # w_scale
    stride_wse,
    stride_wsn,
    stride_wsk,
    # y
    stride_ye,
    stride_ym,
    stride_yn,
    # y_scale
    stride_yse,
    stride_ysm,
    stride_ysn,
    # meta-parameters
    TOP_K: tl.constexpr,
    BATCHED: tl.constexpr,
    GATHER: tl.constexpr,  # Batched: x is [R, H] received rows, sorted_pairs [e, C] indices
    ACTIVATION: tl.constexpr,  # "silu" or "gelu"
    FP8: tl.constexpr,
    W_BLOCK_SCALE: tl.constexpr,  # FP8 weights: 128×128 block scales (else one per expert)
    W_SCALE_PER_TILE: tl.constexpr,  # block scales and every tile inside one 128-row block
    GROUP: tl.constexpr,  # FP8 group size (128)
    FP8_MAX: tl.constexpr,
    INV_FP8_MAX: tl.constexpr,  # float32(1 / FP8_MAX)
    DOT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks along K
    HALF_TAIL: tl.constexpr,  # blocks of ≤ BLOCK_M / 2 rows run a half-height tile
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_n, expert, first, step, end = _program_block(
        num_m_blocks, m_splits, N, block_expert_ptr, block_start_ptr, block_rows_ptr,
        counts_ptr, capacity, BATCHED, BLOCK_M, BLOCK_N, GROUP_M,
    )  # fmt: skip
    w_base = w_ptr + expert * stride_we
    ws_base = w_scale_ptr + expert * stride_wse
    if BATCHED:
        if GATHER:  # this expert's row index [C]
            rows_ptr = sorted_pairs_ptr + expert * capacity
        else:
            rows_ptr = sorted_pairs_ptr
        for start in range(first, end, step):
            _gate_up_block(
                x_ptr, x_scale_ptr, w_base, ws_base, y_ptr, y_scale_ptr, rows_ptr,
                expert, start, tl.minimum(end - start, BLOCK_M), pid_n, N, K, num_pairs,
                stride_xe, stride_xm, stride_xk, stride_xse, stride_xsm, stride_xsk,
                stride_wn, stride_wk, stride_wsn, stride_wsk,
                stride_ye, stride_ym, stride_yn, stride_yse, stride_ysm, stride_ysn,
                TOP_K, BATCHED, GATHER, ACTIVATION, FP8, W_BLOCK_SCALE, W_SCALE_PER_TILE, GROUP,
                FP8_MAX, INV_FP8_MAX, DOT_PRECISION, EVEN_K,
                HALF_TAIL, BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
    elif end > first:
        _gate_up_block(
            x_ptr, x_scale_ptr, w_base, ws_base, y_ptr, y_scale_ptr, sorted_pairs_ptr,
            expert, first, end - first, pid_n, N, K, num_pairs,
            stride_xe, stride_xm, stride_xk, stride_xse, stride_xsm, stride_xsk,
            stride_wn, stride_wk, stride_wsn, stride_wsk,
            stride_ye, stride_ym, stride_yn, stride_yse, stride_ysm, stride_ysn,
            TOP_K, BATCHED, GATHER, ACTIVATION, FP8, W_BLOCK_SCALE, W_SCALE_PER_TILE, GROUP,
            FP8_MAX, INV_FP8_MAX, DOT_PRECISION, EVEN_K,
            HALF_TAIL, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip


@triton.jit
def _down_tile(
    h_ptr,
    h_scale_ptr,
    w_base,  # w2[expert]
    ws_base,  # w2_scale[expert]
    out_ptr,
    topk_weights_ptr,
    sorted_pairs_ptr,
    expert,
    first,
    rows,
    pid_n,
    N,
    K,
    num_pairs,
    stride_he,
    stride_hm,
    stride_hk,
    stride_hse,
    stride_hsm,
    stride_hsk,
    stride_wn,
    stride_wk,
    stride_wsn,
    stride_wsk,
    stride_oe,
    stride_om,
    stride_on,
    BATCHED: tl.constexpr,
    SUM_TOP_K: tl.constexpr,
    FP8: tl.constexpr,
    W_BLOCK_SCALE: tl.constexpr,
    W_SCALE_PER_TILE: tl.constexpr,
    GROUP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    BM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One ``[BM, BLOCK_N]`` tile of ``h @ w2[expert].T`` (see down_kernel). ``h`` is
    stored by output row (padded position or slab row), so both row offsets use ``dst``."""
    row_mask, _, dst, pair = _tile_rows(
        first, rows, sorted_pairs_ptr, num_pairs, 1, BATCHED, False, BM
    )
    h_rows = expert * stride_he + dst * stride_hm
    out_rows = expert * stride_oe + dst * stride_om
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + h_rows[:, None] + offs_k[None, :] * stride_hk  # [BM, BLOCK_K]
    w_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    if FP8:
        hs_ptrs = h_scale_ptr + expert * stride_hse + dst * stride_hsm  # [BM]
        n0 = pid_n * BLOCK_N
        ws_ptrs = _w_scale_ptrs(ws_base, n0, stride_wsn, W_SCALE_PER_TILE, GROUP, BM, BLOCK_N)
        # The previous K step's scales (see _rescale), started at the first step's.
        hs_prev = tl.load(hs_ptrs, mask=row_mask, other=1.0)
        ws_prev = _load_w_scale(ws_ptrs, ws_base, n_mask, W_BLOCK_SCALE, W_SCALE_PER_TILE, BM)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(h_ptrs, mask=row_mask[:, None], other=0.0)
            b = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < K - k0
            a = tl.load(h_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if FP8:
            group_k = k0 // GROUP
            hs = tl.load(hs_ptrs + group_k * stride_hsk, mask=row_mask, other=1.0)
            gk = group_k * stride_wsk
            ws = _load_w_scale(ws_ptrs + gk, ws_base, n_mask, W_BLOCK_SCALE, W_SCALE_PER_TILE, BM)
            acc = tl.dot(
                a, b, _rescale(acc, hs_prev / hs, ws_prev / ws, W_BLOCK_SCALE, W_SCALE_PER_TILE)
            )
            hs_prev = hs
            ws_prev = ws
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        h_ptrs += BLOCK_K * stride_hk
        w_ptrs += BLOCK_K * stride_wk
    if FP8:  # undo the last step's division: acc · hs · ws
        acc = _rescale(acc, hs_prev, ws_prev, W_BLOCK_SCALE, W_SCALE_PER_TILE)
    if not BATCHED:
        router_w = tl.load(topk_weights_ptr + pair, mask=row_mask, other=0.0)
        acc *= router_w[:, None]

    out_mask = row_mask[:, None] & n_mask[None, :]
    if SUM_TOP_K > 0:  # into the token's row of out [R, N], in arrival order
        token = tl.where(row_mask, pair // SUM_TOP_K, 0).to(tl.int64)
        out_ptrs = out_ptr + token[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.atomic_add(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask, sem="relaxed")
    else:
        out_ptrs = out_ptr + out_rows[:, None] + offs_n[None, :] * stride_on
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _down_block(
    h_ptr, h_scale_ptr, w_base, ws_base, out_ptr, topk_weights_ptr, sorted_pairs_ptr,
    expert, first, rows, pid_n, N, K, num_pairs,
    stride_he, stride_hm, stride_hk, stride_hse, stride_hsm, stride_hsk,
    stride_wn, stride_wk, stride_wsn, stride_wsk, stride_oe, stride_om, stride_on,
    BATCHED: tl.constexpr, SUM_TOP_K: tl.constexpr, FP8: tl.constexpr,
    W_BLOCK_SCALE: tl.constexpr, W_SCALE_PER_TILE: tl.constexpr, GROUP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr, HALF_TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Rows ``[first, first + rows)`` (``rows <= BLOCK_M``) as one tile. Two tile heights,
    one inlined body each: a block of at most ``BLOCK_M / 2`` rows (an expert's last)
    takes the half-height one; without ``HALF_TAIL`` that body is not compiled."""
    if HALF_TAIL:  # noqa: SIM102
        if rows <= BLOCK_M // 2:
            _down_tile(
                h_ptr, h_scale_ptr, w_base, ws_base, out_ptr, topk_weights_ptr, sorted_pairs_ptr,
                expert, first, rows, pid_n, N, K, num_pairs,
                stride_he, stride_hm, stride_hk, stride_hse, stride_hsm, stride_hsk,
                stride_wn, stride_wk, stride_wsn, stride_wsk, stride_oe, stride_om, stride_on,
                BATCHED, SUM_TOP_K, FP8, W_BLOCK_SCALE, W_SCALE_PER_TILE, GROUP, DOT_PRECISION,
                EVEN_K, BLOCK_M // 2, BLOCK_N, BLOCK_K,
            )  # fmt: skip
            return
    _down_tile(
        h_ptr, h_scale_ptr, w_base, ws_base, out_ptr, topk_weights_ptr, sorted_pairs_ptr,
        expert, first, rows, pid_n, N, K, num_pairs,
        stride_he, stride_hm, stride_hk, stride_hse, stride_hsm, stride_hsk,
        stride_wn, stride_wk, stride_wsn, stride_wsk, stride_oe, stride_om, stride_on,
        BATCHED, SUM_TOP_K, FP8, W_BLOCK_SCALE, W_SCALE_PER_TILE, GROUP, DOT_PRECISION,
        EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip


@triton.jit(do_not_specialize=ROW_COUNT_ARGS)
def down_kernel(
    # pointers
    h_ptr,  # Standard: [P_pad, I] by padded position; Batched: [e, C, I]
    h_scale_ptr,  # FP8: [P_pad, ceil(I/G)] / [e, C, ceil(I/G)] float32 group scales
    w_ptr,  # [e, H, I]
    w_scale_ptr,  # FP8: [e, ceil(H/G), ceil(I/G)] float32 block scales, or [e] per expert
    out_ptr,  # out, Standard: [P_pad, H] router-weighted, by position (SUM_TOP_K: [R, H],
    # zero at launch, each pair's row added into row pair // SUM_TOP_K); Batched: [e, C, H]
    topk_weights_ptr,  # Standard: [P] float32 router weight of pair r·K + k
    sorted_pairs_ptr,  # Standard: [P_pad] int32 pair per position, P at padding
    block_expert_ptr,  # Standard: [B] int32 expert of each row block, -1 past the last one
    block_start_ptr,  # Standard: [B] int32 first padded position of each row block
    block_rows_ptr,  # Standard: [B] int32 padded positions of each row block, 0 past the last
    counts_ptr,  # Batched: [e] int32 valid rows of each expert
    # sizes
    N,  # H
    K,  # I
    num_pairs,  # Standard: P (the sentinel)
    capacity,  # Batched: C
    num_m_blocks,  # Standard: B; Batched: e · m_splits
    m_splits,  # Batched: row programs per expert (S)
    # strides (elements), in groups of (expert, row, column)
    # h
    stride_he,
    stride_hm,
    stride_hk,
    # h_scale
    stride_hse,
    stride_hsm,
    stride_hsk,
    # w
    stride_we,
    stride_wn,
    stride_wk,
    # w_scale
    stride_wse,
    stride_wsn,
    stride_wsk,
    # out
    stride_oe,
    stride_om,
    stride_on,
    # meta-parameters
    BATCHED: tl.constexpr,
    SUM_TOP_K: tl.constexpr,  # Standard: K to sum each row's pairs into out (0: by position)
    FP8: tl.constexpr,
    W_BLOCK_SCALE: tl.constexpr,
    W_SCALE_PER_TILE: tl.constexpr,
    GROUP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    HALF_TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_n, expert, first, step, end = _program_block(
        num_m_blocks, m_splits, N, block_expert_ptr, block_start_ptr, block_rows_ptr,
        counts_ptr, capacity, BATCHED, BLOCK_M, BLOCK_N, GROUP_M,
    )  # fmt: skip
    w_base = w_ptr + expert * stride_we
    ws_base = w_scale_ptr + expert * stride_wse
    if BATCHED:
        for start in range(first, end, step):
            _down_block(
                h_ptr, h_scale_ptr, w_base, ws_base, out_ptr, topk_weights_ptr, sorted_pairs_ptr,
                expert, start, tl.minimum(end - start, BLOCK_M), pid_n, N, K, num_pairs,
                stride_he, stride_hm, stride_hk, stride_hse, stride_hsm, stride_hsk,
                stride_wn, stride_wk, stride_wsn, stride_wsk, stride_oe, stride_om, stride_on,
                BATCHED, SUM_TOP_K, FP8, W_BLOCK_SCALE, W_SCALE_PER_TILE, GROUP, DOT_PRECISION,
                EVEN_K, HALF_TAIL, BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
    elif end > first:
        _down_block(
            h_ptr, h_scale_ptr, w_base, ws_base, out_ptr, topk_weights_ptr, sorted_pairs_ptr,
            expert, first, end - first, pid_n, N, K, num_pairs,
            stride_he, stride_hm, stride_hk, stride_hse, stride_hsm, stride_hsk,
            stride_wn, stride_wk, stride_wsn, stride_wsk, stride_oe, stride_om, stride_on,
            BATCHED, SUM_TOP_K, FP8, W_BLOCK_SCALE, W_SCALE_PER_TILE, GROUP, DOT_PRECISION,
            EVEN_K, HALF_TAIL, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
