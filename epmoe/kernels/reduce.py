"""Triton kernel that folds the per-pair expert outputs back to one row per received token.

Shape legend: R received rows · H hidden size · K top-k · P = R·K (row, k) pairs ·
P_pad padded pair positions.
"""

import triton
import triton.language as tl


@triton.jit
def sum_topk_kernel(
    # pointers
    y_ptr,  # [P_pad, H] router-weighted expert output at each padded position
    pair_pos_ptr,  # [P] int32: padded position of pair r·K + k, -1 when not local
    out_ptr,  # [R, H] out: Σ_k y[pair_pos[r·K + k]] (zero for rows without a local pair)
    # sizes (the grid has one program per row of R and per BLOCK_H columns)
    H,
    # strides (elements)
    stride_ym,
    stride_om,
    # meta-parameters
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,  # power of two >= TOP_K
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < H
    ks = tl.arange(0, BLOCK_K)
    pos = tl.load(pair_pos_ptr + row * TOP_K + ks, mask=ks < TOP_K, other=-1)
    y_ptrs = y_ptr + pos.to(tl.int64)[:, None] * stride_ym + cols[None, :]  # [BLOCK_K, BLOCK_H]
    y = tl.load(y_ptrs, mask=(pos >= 0)[:, None] & col_mask[None, :], other=0.0)
    out = tl.sum(y.to(tl.float32), 0)
    out_ptrs = out_ptr + row.to(tl.int64) * stride_om + cols
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=col_mask)
