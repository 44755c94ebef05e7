"""Triton kernels that sort (row, k) pairs by local expert and pad each group to PAD_M.

Shape legend: R received rows · K top-k · e local experts · P = R·K (row, k) pairs ·
P_pad = padded pair positions (worst case ``P + min(e, P)·(BLOCK_M − 1)``) · B GEMM row
blocks (worst case ``P_pad / BLOCK_M``).

Three launches, no host synchronisation (see ``ops.align_pairs``):

1. ``count_pairs_kernel``: histogram of pairs per expert with atomics; each pair keeps the
   slot the atomic handed it (its rank inside the expert's group; order is arbitrary).
2. ``block_table_kernel``: pads each expert's group to a multiple of ``PAD_M`` (``BLOCK_M``,
   ``BLOCK_M / 2`` with half-height tail blocks, or a warpgroup's 64 rows), cuts it into row blocks and writes
   each block's expert (``-1`` past the last real block), first position and size, and
   how many blocks are in use; fills the padding positions with the sentinel.
3. ``scatter_pairs_kernel``: each pair writes its flat index ``r·K + k`` at position
   ``start[expert] + rank`` and that position into ``pair_pos`` (-1 for pairs not local).

``slab_blocks_kernel`` writes the same kind of block table for ExpertBatched slabs (rows
already grouped by expert), for the persistent Hopper kernel (``ops.slab_blocks``);
``sort_scales_kernel`` lays GEMM 1's FP8 row scales out by position for it
(``ops.sort_scales``).
"""

import triton
import triton.language as tl

# Row and pair counts change with every batch: no per-value specialisation (see
# grouped_gemm.ROW_COUNT_ARGS), so a serving loop does not recompile as batches vary.


@triton.jit
def _local_pairs(topk_ids_ptr, num_pairs, num_experts, BLOCK: tl.constexpr):
    """This program's ``BLOCK`` pairs: (index, in range, local, local slot or 0)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < num_pairs
    ids = tl.load(topk_ids_ptr + offs, mask=in_range, other=-1)
    local = in_range & (ids >= 0) & (ids < num_experts)
    return offs, in_range, local, tl.where(local, ids, 0)


@triton.jit(do_not_specialize=["num_pairs"])
def count_pairs_kernel(
    # pointers
    topk_ids_ptr,  # [P] int32/int64: local slot of pair p = r·K + k; outside [0, e): not local
    counts_ptr,  # [e] int32, zero on entry; pairs per expert on exit
    rank_ptr,  # [P] int32 out: position of the pair inside its expert's group (local pairs only)
    # sizes
    num_pairs,  # P
    num_experts,  # e
    # meta-parameters
    BLOCK: tl.constexpr,
):
    offs, in_range, local, slot = _local_pairs(topk_ids_ptr, num_pairs, num_experts, BLOCK)
    rank = tl.atomic_add(counts_ptr + slot, 1, mask=local)
    tl.store(rank_ptr + offs, rank, mask=local)


@triton.jit
def _pick(own, per_expert):
    """``[BLOCK_E]`` values per expert → ``[BLOCK_B]`` the value of each block's expert
    (``own [BLOCK_B, BLOCK_E]`` marks it)."""
    return tl.sum(tl.where(own, per_expert[None, :], 0), 1)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def block_table_kernel(
    # pointers
    counts_ptr,  # [e] int32: pairs per expert (from count_pairs_kernel)
    block_expert_ptr,  # [B] int32 out: expert of each row block, -1 past the last real block
    block_start_ptr,  # [B] int32 out: first padded position of each row block (0 past the end)
    block_rows_ptr,  # [B] int32 out: padded positions of each block (<= BLOCK_M; 0 past)
    expert_start_ptr,  # [e] int32 out: first padded position of each expert's group
    num_padded_ptr,  # [1] int32 out: total padded positions (a multiple of PAD_M)
    blocks_used_ptr,  # [1] int32 out: row blocks in use (the rest have block_rows 0)
    sorted_pairs_ptr,  # [P_pad] int32 out: the sentinel `num_pairs` at every padding position
    tile_counters_ptr,  # [2] int32 out: zeros (the persistent Hopper GEMMs' tile counters)
    # sizes
    num_pairs,  # P, the sentinel
    num_experts,  # e
    num_blocks,  # B
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_M_P2: tl.constexpr,  # power of two >= BLOCK_M
    PAD_M: tl.constexpr,  # each group is padded to a multiple of PAD_M (a divisor of BLOCK_M)
    BLOCK_B: tl.constexpr,  # row blocks per program
    BLOCK_E: tl.constexpr,  # power of two >= e
):
    """Each expert's group of ``ceil(count / PAD_M) · PAD_M`` positions is cut into row
    blocks of ``BLOCK_M`` positions, the last one shorter (a multiple of ``PAD_M``) when
    ``PAD_M < BLOCK_M`` and the rows fit: a half-height tile, or the warpgroups of the
    Hopper kernel's 192-row tiles that have rows."""
    pid = tl.program_id(0)
    e_offs = tl.arange(0, BLOCK_E)
    e_mask = e_offs < num_experts
    counts = tl.load(counts_ptr + e_offs, mask=e_mask, other=0)
    padded = (counts + PAD_M - 1) // PAD_M * PAD_M
    end = tl.cumsum(padded, 0)  # [BLOCK_E] inclusive prefix sums of positions
    start = end - padded
    blocks_end = tl.cumsum((padded + BLOCK_M - 1) // BLOCK_M, 0)  # ... and of row blocks
    if pid == 0:
        tl.store(expert_start_ptr + e_offs, start, mask=e_mask)
        tl.store(num_padded_ptr, tl.sum(padded, 0))
        tl.store(blocks_used_ptr, tl.sum((padded + BLOCK_M - 1) // BLOCK_M, 0))
        tl.store(tile_counters_ptr + tl.arange(0, 2), tl.zeros((2,), tl.int32))

    blocks = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    b_mask = blocks < num_blocks
    # The expert of a block is the number of experts whose blocks end at or before it
    # (empty experts end where the previous one does, so they are skipped).
    ends_before = (blocks_end[None, :] <= blocks[:, None]) & e_mask[None, :]  # [BLOCK_B, BLOCK_E]
    expert = tl.sum(ends_before.to(tl.int32), 1)
    is_real = expert < num_experts
    own = (e_offs[None, :] == expert[:, None]) & e_mask[None, :]
    own_start, own_end, own_count = _pick(own, start), _pick(own, end), _pick(own, counts)
    own_first_block = _pick(own, blocks_end - (padded + BLOCK_M - 1) // BLOCK_M)
    first = own_start + (blocks - own_first_block) * BLOCK_M  # first position of each block
    rows = tl.where(is_real, tl.minimum(own_end - first, BLOCK_M), 0)
    tl.store(block_expert_ptr + blocks, tl.where(is_real, expert, -1), mask=b_mask)
    tl.store(block_start_ptr + blocks, tl.where(is_real, first, 0), mask=b_mask)
    tl.store(block_rows_ptr + blocks, rows, mask=b_mask)

    # Padding positions of each block: those at or past start + count of its expert.
    m_offs = tl.arange(0, BLOCK_M_P2)
    pos = first[:, None] + m_offs[None, :]  # [BLOCK_B, BLOCK_M_P2]
    in_block = m_offs[None, :] < rows[:, None]
    is_pad = (pos - own_start[:, None]) >= own_count[:, None]
    sentinel = tl.full((BLOCK_B, BLOCK_M_P2), 0, tl.int32) + num_pairs
    tl.store(sorted_pairs_ptr + pos, sentinel, mask=b_mask[:, None] & in_block & is_pad)


@triton.jit(do_not_specialize=["num_pairs"])
def scatter_pairs_kernel(
    # pointers
    topk_ids_ptr,  # [P] int32/int64: local slot per pair (as for count_pairs_kernel)
    rank_ptr,  # [P] int32: position inside the expert's group (from count_pairs_kernel)
    expert_start_ptr,  # [e] int32: first padded position of each group
    sorted_pairs_ptr,  # [P_pad] int32 out: pair index at each real position
    pair_pos_ptr,  # [P] int32 out: padded position of each pair, -1 when not local
    # sizes
    num_pairs,  # P
    num_experts,  # e
    # meta-parameters
    BLOCK: tl.constexpr,
):
    offs, in_range, local, slot = _local_pairs(topk_ids_ptr, num_pairs, num_experts, BLOCK)
    start = tl.load(expert_start_ptr + slot, mask=local, other=0)
    rank = tl.load(rank_ptr + offs, mask=local, other=0)
    pos = start + rank
    tl.store(sorted_pairs_ptr + pos, offs.to(tl.int32), mask=local)
    tl.store(pair_pos_ptr + offs, tl.where(local, pos, -1), mask=in_range)


@triton.jit(do_not_specialize=["capacity"])
def slab_blocks_kernel(
    # pointers
    counts_ptr,  # [e] int32: valid rows of each expert's slab (clamped to [0, C] here)
    block_expert_ptr,  # [B] int32 out: expert of each row block in use
    block_start_ptr,  # [B] int32 out: its first row in the [e·C] slabs
    block_rows_ptr,  # [B] int32 out: its valid rows (1 .. BLOCK_M)
    blocks_used_ptr,  # [1] int32 out: row blocks in use (the first ones; the rest unwritten)
    tile_counter_ptr,  # [1] int32 out: zero (the persistent Hopper GEMM's tile counter)
    # sizes
    num_experts,  # e
    capacity,  # C
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,  # power of two >= e
):
    """The block table of ExpertBatched slabs ``[e, C, ·]`` for the persistent Hopper
    kernel (one program): expert i's valid rows ``[i·C, i·C + count_i)`` in blocks of
    ``BLOCK_M`` rows, experts in order, empty ones skipped."""
    e_offs = tl.arange(0, BLOCK_E)
    e_mask = e_offs < num_experts
    counts = tl.load(counts_ptr + e_offs, mask=e_mask, other=0)
    counts = tl.minimum(tl.maximum(counts, 0), capacity)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    first = tl.cumsum(blocks, 0) - blocks
    tl.store(blocks_used_ptr, tl.sum(blocks, 0))
    tl.store(tile_counter_ptr, 0)
    for b in range(0, tl.max(blocks, 0)):
        has = e_mask & (b < blocks)
        tl.store(block_expert_ptr + first + b, e_offs, mask=has)
        tl.store(block_start_ptr + first + b, e_offs * capacity + b * BLOCK_M, mask=has)
        tl.store(block_rows_ptr + first + b, tl.minimum(counts - b * BLOCK_M, BLOCK_M), mask=has)


@triton.jit(do_not_specialize=["num_pairs"])
def sort_scales_kernel(
    # pointers
    x_scale_ptr,  # [R, G] float32: the FP8 group scales of GEMM 1's input rows
    sorted_pairs_ptr,  # [P_pad] int32: the pair r·K + k at each position, P at padding
    num_padded_ptr,  # [1] int32: positions in use
    out_ptr,  # [G, P_pad] float32 out: x_scale[pair // K, g] at (g, position), 1 at padding
    # sizes
    num_pairs,  # P, the sentinel
    G,
    # strides (elements)
    stride_xsm,
    stride_xsg,
    stride_og,
    # meta-parameters
    TOP_K: tl.constexpr,
    BLOCK_P: tl.constexpr,  # positions per program
    BLOCK_G: tl.constexpr,  # power of two >= G
):
    """GEMM 1's FP8 row scales by position, group-major (``ops.sort_scales``): the Hopper
    kernel's warpgroups then read a K step's scales of 64 positions as 256 contiguous
    bytes instead of 64 scattered ones. Programs past the positions in use return at once."""
    pid = tl.program_id(0)
    n = tl.load(num_padded_ptr)
    if pid * BLOCK_P >= n:
        return
    pos = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    in_use = pos < n
    pair = tl.load(sorted_pairs_ptr + pos, mask=in_use, other=num_pairs)
    valid = pair < num_pairs
    src = tl.where(valid, pair // TOP_K, 0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    g_mask = g < G
    v = tl.load(
        x_scale_ptr + src[None, :] * stride_xsm + g[:, None] * stride_xsg,
        mask=g_mask[:, None] & valid[None, :], other=1.0,
    )  # fmt: skip
    tl.store(out_ptr + g[:, None] * stride_og + pos[None, :], v, mask=g_mask[:, None] & in_use)
