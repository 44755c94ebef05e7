"""Triton kernel for FP8 (e4m3) quantization per token and group of columns.

DeepSeek-V3's activation format: each row is cut into groups of ``GROUP`` (128) columns,
each group gets one float32 scale ``max(amax, EPS) · INV_FP8_MAX`` (``INV_FP8_MAX`` = 1/448
rounded to float32: a multiplication, exactly what torch computes for ``amax / 448.0`` on CUDA,
where a division by a scalar is a multiplication by its reciprocal) and its values are stored
as ``clamp(x · (1 / scale))`` (a correctly rounded reciprocal per group, then a product) in
``float8_e4m3fn``. Shape legend: M rows · D columns · Gd = ceil(D / GROUP) groups per row.
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def per_token_group_quant_kernel(
    # pointers
    x_ptr,  # [M, D] input rows (unit column stride)
    q_ptr,  # [M, D] float8_e4m3fn out
    scale_ptr,  # [M, Gd] float32 out
    counts_ptr,  # HAS_COUNTS: [M // rows_per_expert] int32; row m is valid iff
    #              m % rows_per_expert < counts[m // rows_per_expert] (others are skipped)
    # sizes
    M,
    D,
    rows_per_expert,  # HAS_COUNTS: C
    # strides (elements)
    stride_xm,
    stride_qm,
    stride_sm,
    stride_sg,
    # meta-parameters
    HAS_COUNTS: tl.constexpr,
    GROUP: tl.constexpr,
    FP8_MAX: tl.constexpr,
    INV_FP8_MAX: tl.constexpr,  # float32(1 / FP8_MAX)
    EPS: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    group = tl.program_id(1)
    row_mask = rows < M
    if HAS_COUNTS:
        count = tl.load(counts_ptr + rows // rows_per_expert, mask=row_mask, other=0)
        row_mask = row_mask & ((rows % rows_per_expert) < count)
    cols = group * GROUP + tl.arange(0, GROUP)
    mask = row_mask[:, None] & (cols < D)[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    # The scale is a float32 product and its reciprocal correctly rounded (not the
    # approximate default), so both match ``amax.clamp(min=EPS) * (1 / 448)`` and
    # ``x * reciprocal(scale)`` in torch bit for bit, on CPU and CUDA alike.
    scale = tl.maximum(tl.max(tl.abs(x), 1), EPS) * INV_FP8_MAX  # [BLOCK_M]
    q = tl.minimum(tl.maximum(x * tl.div_rn(1.0, scale)[:, None], -FP8_MAX), FP8_MAX)
    tl.store(
        q_ptr + rows[:, None] * stride_qm + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask
    )
    tl.store(scale_ptr + rows * stride_sm + group * stride_sg, scale, mask=row_mask)
