"""Triton grouped GEMMs of the expert MLPs, for both layouts a backend delivers.

Shape legend: R received rows · H hidden size · I intermediate size · e local experts ·
K top-k · C rows of capacity per expert (ExpertBatched) · P = R·K (row, k) pairs ·
P_pad padded pair positions · B row blocks (Standard) · G = 128 (FP8 group size).

Each kernel runs one ``[BLOCK_M, BLOCK_N]`` output tile of one expert per program:

* ``BATCHED=False`` (Standard): row block ``b`` holds ``BLOCK_M`` padded positions of one
  expert (``block_expert[b]``, -1: the program exits); ``sorted_pairs[pos]`` is the pair
  ``r·K + k`` at each position, ``P`` at padding. Hidden rows are gathered (row ``pair // K``).
* ``BATCHED=True`` (ExpertBatched): a fixed grid of ``e · ceil(C / BLOCK_M)`` row blocks;
  programs whose rows all lie past ``counts[expert]`` exit at once (CUDA-graph safe).

``gate_up_kernel`` computes the gate and up tiles of ``w13`` in one program and stores
``act(gate) · up``; in FP8 mode it quantizes that tile per token group of 128 (so
``BLOCK_N == 128``) for ``down_kernel``. ``down_kernel`` multiplies by ``w2``; for the
Standard layout it scales each row by its router weight.

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
ROW_COUNT_ARGS = ["num_pairs", "capacity", "num_m_blocks"]


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
    counts_ptr,  # Batched: [e] int32 valid rows of each expert
    # sizes
    N,  # I
    K,  # H
    num_pairs,  # Standard: P (the sentinel)
    capacity,  # Batched: C
    num_m_blocks,  # Standard: B; Batched: e · ceil(C / BLOCK_M)
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
    ACTIVATION: tl.constexpr,  # "silu" or "gelu"
    FP8: tl.constexpr,
    W_BLOCK_SCALE: tl.constexpr,  # FP8 weights: 128×128 block scales (else one per expert)
    W_SCALE_PER_TILE: tl.constexpr,  # block scales and every tile inside one 128-row block
    GROUP: tl.constexpr,  # FP8 group size (128)
    FP8_MAX: tl.constexpr,
    INV_FP8_MAX: tl.constexpr,  # float32(1 / FP8_MAX)
    DOT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks along K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m, pid_n = _tile_ids(pid, num_m_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)

    if BATCHED:
        m_blocks_per_expert = tl.cdiv(capacity, BLOCK_M)
        expert = pid_m // m_blocks_per_expert
        first_row = (pid_m % m_blocks_per_expert) * BLOCK_M
        count = tl.minimum(tl.load(counts_ptr + expert), capacity)  # never past C
        if first_row >= count:
            return
        rows = (first_row + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < count
        expert = expert.to(tl.int64)
        x_rows = expert * stride_xe + rows * stride_xm
        xs_rows = expert * stride_xse + rows * stride_xsm
        y_rows = expert * stride_ye + rows * stride_ym
        ys_rows = expert * stride_yse + rows * stride_ysm
    else:
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        expert = expert.to(tl.int64)
        pos = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_pairs_ptr + pos, mask=pos < num_m_blocks * BLOCK_M, other=num_pairs)
        row_mask = pair < num_pairs
        token = tl.where(row_mask, pair // TOP_K, 0).to(tl.int64)
        x_rows = token * stride_xm
        xs_rows = token * stride_xsm
        y_rows = pos * stride_ym
        ys_rows = pos * stride_ysm

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + x_rows[:, None] + offs_k[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
    w_base = w_ptr + expert * stride_we
    # [BLOCK_K, BLOCK_N] tiles of the gate rows and of the up rows (I rows further on)
    wg_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    wu_ptrs = wg_ptrs + N * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FP8:
        xs_ptrs = x_scale_ptr + xs_rows  # [BLOCK_M]
        ws_base = w_scale_ptr + expert * stride_wse
        if W_SCALE_PER_TILE:  # the scale of the tile's block row of the gate and of the up
            # rows, loaded as a [BLOCK_M] broadcast (a scalar loop-carried value does not
            # lower in triton 3.6)
            zero_m = tl.zeros((BLOCK_M,), tl.int32)
            wgs_ptrs = ws_base + ((pid_n * BLOCK_N) // GROUP) * stride_wsn + zero_m
            wus_ptrs = ws_base + ((pid_n * BLOCK_N + N) // GROUP) * stride_wsn + zero_m
        else:
            wgs_ptrs = ws_base + (offs_n // GROUP) * stride_wsn  # [BLOCK_N]
            wus_ptrs = ws_base + ((offs_n + N) // GROUP) * stride_wsn
        # The previous K step's scales (see _rescale), started at the first step's; padding
        # rows and columns get 1.
        xs_prev = tl.load(xs_ptrs, mask=row_mask, other=1.0)
        if W_SCALE_PER_TILE:
            wgs_prev = tl.load(wgs_ptrs)
            wus_prev = tl.load(wus_ptrs)
        elif W_BLOCK_SCALE:
            wgs_prev = tl.load(wgs_ptrs, mask=n_mask, other=1.0)
            wus_prev = tl.load(wus_ptrs, mask=n_mask, other=1.0)
        else:
            wgs_prev = tl.load(ws_base + tl.zeros((BLOCK_M,), tl.int32))  # [BLOCK_M] broadcast
            wus_prev = wgs_prev
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
            if W_SCALE_PER_TILE:
                wgs = tl.load(wgs_ptrs + group_k * stride_wsk)
                wus = tl.load(wus_ptrs + group_k * stride_wsk)
            elif W_BLOCK_SCALE:
                wgs = tl.load(wgs_ptrs + group_k * stride_wsk, mask=n_mask, other=1.0)
                wus = tl.load(wus_ptrs + group_k * stride_wsk, mask=n_mask, other=1.0)
            else:
                wgs = wgs_prev
                wus = wus_prev
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
    if FP8:
        # One group of GROUP columns per tile: quantize it for down_kernel (amax / FP8_MAX).
        tl.static_assert(BLOCK_N == GROUP, "FP8 gate_up tiles must be one group wide")
        h = tl.where(n_mask[None, :], h, 0.0)
        scale = tl.maximum(tl.max(tl.abs(h), 1), 1e-10) * INV_FP8_MAX  # [BLOCK_M], as quant.py
        q = tl.minimum(tl.maximum(tl.div_rn(h, scale[:, None]), -FP8_MAX), FP8_MAX)
        tl.store(y_ptrs, q.to(y_ptr.dtype.element_ty), mask=y_mask)
        tl.store(y_scale_ptr + ys_rows + pid_n * stride_ysn, scale, mask=row_mask)
    else:
        tl.store(y_ptrs, h.to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit(do_not_specialize=ROW_COUNT_ARGS)
def down_kernel(
    # pointers
    h_ptr,  # Standard: [P_pad, I] by padded position; Batched: [e, C, I]
    h_scale_ptr,  # FP8: [P_pad, ceil(I/G)] / [e, C, ceil(I/G)] float32 group scales
    w_ptr,  # [e, H, I]
    w_scale_ptr,  # FP8: [e, ceil(H/G), ceil(I/G)] float32 block scales, or [e] per expert
    out_ptr,  # out, Standard: [P_pad, H] router-weighted, by position; Batched: [e, C, H]
    topk_weights_ptr,  # Standard: [P] float32 router weight of pair r·K + k
    sorted_pairs_ptr,  # Standard: [P_pad] int32 pair per position, P at padding
    block_expert_ptr,  # Standard: [B] int32 expert of each row block, -1 past the last one
    counts_ptr,  # Batched: [e] int32 valid rows of each expert
    # sizes
    N,  # H
    K,  # I
    num_pairs,  # Standard: P (the sentinel)
    capacity,  # Batched: C
    num_m_blocks,  # Standard: B; Batched: e · ceil(C / BLOCK_M)
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
    FP8: tl.constexpr,
    W_BLOCK_SCALE: tl.constexpr,
    W_SCALE_PER_TILE: tl.constexpr,
    GROUP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m, pid_n = _tile_ids(pid, num_m_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)

    if BATCHED:
        m_blocks_per_expert = tl.cdiv(capacity, BLOCK_M)
        expert = pid_m // m_blocks_per_expert
        first_row = (pid_m % m_blocks_per_expert) * BLOCK_M
        count = tl.minimum(tl.load(counts_ptr + expert), capacity)  # never past C
        if first_row >= count:
            return
        rows = (first_row + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < count
        expert = expert.to(tl.int64)
        h_rows = expert * stride_he + rows * stride_hm
        hs_rows = expert * stride_hse + rows * stride_hsm
        out_rows = expert * stride_oe + rows * stride_om
    else:
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        expert = expert.to(tl.int64)
        pos = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_pairs_ptr + pos, mask=pos < num_m_blocks * BLOCK_M, other=num_pairs)
        row_mask = pair < num_pairs
        h_rows = pos * stride_hm
        hs_rows = pos * stride_hsm
        out_rows = pos * stride_om

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + h_rows[:, None] + offs_k[None, :] * stride_hk  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FP8:
        hs_ptrs = h_scale_ptr + hs_rows  # [BLOCK_M]
        ws_base = w_scale_ptr + expert * stride_wse
        if W_SCALE_PER_TILE:  # the tile's block row of w2, as a [BLOCK_M] broadcast
            ws_ptrs = (
                ws_base + ((pid_n * BLOCK_N) // GROUP) * stride_wsn + tl.zeros((BLOCK_M,), tl.int32)
            )
        else:
            ws_ptrs = ws_base + (offs_n // GROUP) * stride_wsn  # [BLOCK_N]
        # The previous K step's scales (see _rescale), started at the first step's.
        hs_prev = tl.load(hs_ptrs, mask=row_mask, other=1.0)
        if W_SCALE_PER_TILE:
            ws_prev = tl.load(ws_ptrs)
        elif W_BLOCK_SCALE:
            ws_prev = tl.load(ws_ptrs, mask=n_mask, other=1.0)
        else:
            ws_prev = tl.load(ws_base + tl.zeros((BLOCK_M,), tl.int32))  # [BLOCK_M] broadcast
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
            if W_SCALE_PER_TILE:
                ws = tl.load(ws_ptrs + group_k * stride_wsk)
            elif W_BLOCK_SCALE:
                ws = tl.load(ws_ptrs + group_k * stride_wsk, mask=n_mask, other=1.0)
            else:
                ws = ws_prev
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

    out_ptrs = out_ptr + out_rows[:, None] + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])
