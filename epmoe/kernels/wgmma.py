"""Hopper grouped GEMMs of the Standard layout written in Gluon (Triton's lower-level
dialect: explicit asynchronous warpgroup MMAs, mbarriers, warp specialisation).

Shape legend as in ``grouped_gemm``: R received rows · H hidden size · I intermediate size ·
e local experts · K top-k · P = R·K pairs · P_pad padded positions · B row blocks ·
G = 128 (FP8 group size).

Why a second implementation. In the portable ``tl.dot`` kernels an FP8 K step must rescale
the fp32 accumulator by that step's block scales before the next MMA may add into it, and
Triton then waits for every MMA to finish before the warps rescale (``pendings = 0``): the
tensor cores idle during each rescale (docs/kernels.md). Here each program owns two
accumulator tiles that share the activation tile — GEMM 1's gate and up tiles, or two
halves of a 256-column GEMM 2 tile. The first design issued their MMAs in alternation::

    issue MMA(acc_0, step k)          # acc_0 was rescaled for step k last iteration
    wait until ≤ 1 MMA in flight       # MMA(acc_1, step k-1) is done
    rescale acc_1 for step k           # ... meant to run while MMA(acc_0, step k) does
    issue MMA(acc_1, step k)
    wait until ≤ 1 MMA in flight       # MMA(acc_0, step k) is done
    rescale acc_0 for step k+1         # ... meant to run while MMA(acc_1, step k) does

with the registers of two tiles only. Rescaling keeps ``acc = Σ_g' s_g' · D_g' / s_g``
(``grouped_gemm._rescale``): one multiply per element and step; the scales are loaded two
steps ahead. That loop, as written, is not what the hardware ran: ptxas serialised every
wgmma of it (warning C7514, a wait for zero MMAs after each one in SASS), because acc_1's
registers are read across the loop's back edge while its MMA is in flight. The FP8 loop
therefore retires both MMAs of a step within the step (``_both_mmas``): acc_0's rescale
runs under acc_1's MMA, and nothing is in flight across the back edge, so ptxas keeps the
wgmmas asynchronous (``launch/kernel_resources.py`` reports ``mma_serialized`` from the
SASS). bf16 has no rescale: its loop keeps acc_1's MMA in flight across the back edge.

``pair_gemm_ws_kernel`` (configs with ``kernel="wgmma_ws"``) is the same loop
warp-specialised: a loader partition of 4 warps brings each step's two weight tiles by TMA
(one descriptor over the experts' stacked ``[e·N_w, K]`` weights; their bytes expected on
the stage's ``ready`` mbarrier) and the gathered activation rows by ``cp.async`` (each
thread's copies arrive on ``ready`` when they land); each of the two (or three) MMA
warpgroups is a partition of its own (64 rows of the tile) that waits on ``ready``, and
releases a stage on its ``empty`` mbarrier once its MMAs of that step are done. No CTA
barrier remains in the K loop, so the warpgroups drift apart and one's rescale can run
under the other's MMAs; the loader runs up to ``STAGES`` steps ahead. A warpgroup whose
rows start past its block's end idles (it only releases the stages). The grid is persistent, one program
per SM: the loader claims the next tile from a counter in global memory (so SMs take tiles
in order as they free, and neighbouring tiles share operands in L2), two K steps before
it issues the current tile's last copies, reads its block's entry of the table, and
passes both to the MMA partitions through a two-entry queue in shared memory (no global
load stands between an MMA warpgroup's epilogue and its next tile's MMAs); the stage count
carries across tiles, so the next tile's operands load during the last one's epilogue.

Measured on one H200 (docs/kernels.md, third round), the two GEMMs of the DeepSeek-V3
prefill layer in one process: FP8 2.04 ms on ``wgmma_ws`` (2.22 with one program per tile,
2.55 on ``wgmma``, 2.83 on ``tl.dot``), bf16 3.61 ms (3.62, 4.18, 4.62).

192-row tiles (``block_m`` 192, ``num_warps`` 12): three MMA warpgroups, so that an expert
of up to 192 rows reads each weight tile once (at DeepSeek-V3's prefill shape experts get
128 ± 11 rows, and with 128-row blocks half of them read their weights twice: once for the
block and once for a tail of a few rows). The register file then leaves the loader 32
registers per thread: rows in position order come by TMA, gathered ones by ``cp.async``
from addresses made at each step from the tile's source rows in shared memory. FP8 row
scales are read by position, group-major (``ops.sort_scales`` for GEMM 1's gathered rows,
GEMM 1's epilogue for GEMM 2's): a warpgroup reads a K step's 64 scales as 256 contiguous
bytes. On one H200 (docs/kernels.md, interleaved A/B rounds) the GEMMs take 3.28–3.47 ms in
bf16 against 3.61–3.70 with 128-row tiles, and 1.97 ms in FP8 against 2.11.

Loads in ``pair_gemm_kernel``: ``cp.async`` of 16 bytes per thread into a ring of
``STAGES`` shared-memory stages (the activation rows are gathered, so TMA's box loads do
not apply to them; Hopper has no TMA gather). A stage is refilled two steps after its MMAs
were issued: by then every warpgroup has waited for them and passed the step's CTA
barrier, so neither warpgroup can overwrite operands the other's MMA still reads.

ExpertBatched on ``wgmma_ws`` (``ROWS="slab"`` / ``"index"``): the slabs ``[e, C, ·]`` are
one ``[e·C, ·]`` matrix whose row blocks ``ops.slab_blocks`` writes on the device from the
counts, so the same persistent walk runs decode batches with no host synchronisation. On
one H200 it reads the weights at 0.98–1.04 of the copy bandwidth (GPU time) from C = 256
to 1024 rows of capacity, where the ``tl.dot`` ExpertBatched kernels fall to 0.86 at
C = 512 and to 0.30–0.66 at C = 1024–2048 (they re-read each weight tile for every 16
rows); docs/kernels.md.

Scope: the Standard layout, and ExpertBatched on ``wgmma_ws``; K and the output columns
multiples of the tile; operands with unit stride along K and row strides that are multiples
of 16 elements; for ``wgmma_ws``, each expert's weight rows following the last one's (one
TMA descriptor). ``ops`` checks these
and the device (sm_90): an explicit Hopper config is refused with the reason, and one that
a table or the autotuner picked gives way to the portable kernels.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from epmoe.kernels.grouped_gemm import _tile_ids  # the grouped tile order, shared

ROW_COUNT_ARGS = ["num_pairs", "num_m_blocks"]
# cp.async's builtin: ``async_load`` from Triton 3.9, ``async_copy_global_to_shared`` before
# (Triton 3.6, our GPU image, has only that one). Both run here; CPU CI compiles with 3.9.
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
# TMA's load: ``async_load`` from Triton 3.9, ``async_copy_global_to_shared`` before
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# the CTA barrier: ``thread_barrier`` in Triton 3.6, ``barrier`` from 3.9
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.constexpr_function
def _store_layout(block_n, step=2):
    """One MMA warpgroup's ``[64, block_n]`` accumulator tile as the epilogue stores it
    (``block_n`` >= 32; ``step`` 1 alone, 4 columns per thread, needs 16): each thread 8
    consecutive columns (16 bytes of bf16), four threads
    64 bytes of a row (two whole 32-byte sectors). The wgmma layout gives a thread 2
    columns: its stores and atomic adds write 4 bytes each, half of each sector a quad
    touches. The conversion runs in two steps of one bit each (``step`` 1, then 2: columns
    +2 and +8, then +4 and +16, swap between registers and lanes), which Triton makes
    shuffles within each quad with no shared memory (one step of two bits takes 2 KB of it
    per warpgroup). Stores become ``st.global.v4.b32``, atomic adds ``…v8.bf16``."""
    if step == 1:
        reg = [[0, 1], [0, 2], [8, 0]]
        lane = [[0, 8], [0, 4], [1, 0], [2, 0], [4, 0]]
        c = 16
    else:
        reg = [[0, 1], [0, 2], [0, 4], [8, 0]]
        lane = [[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]]
        c = 32
    while c < block_n:
        reg.append([0, c])
        c *= 2
    return gl.DistributedLinearLayout(reg, lane, [[16, 0], [32, 0]], [], [64, block_n])


@gluon.jit
def _issue_loads(
    a_smem, b0_smem, b1_smem, stage, a_ptrs, a_mask, b_ptrs, b1_off, k_off, STEPS_AHEAD_OK
):
    """One K step's three operand tiles into ``stage`` (one cp.async group, committed even
    when empty so that group counting stays per step)."""
    if STEPS_AHEAD_OK:
        _cp_async(a_smem.index(stage), a_ptrs + k_off, mask=a_mask)
        _cp_async(b0_smem.index(stage), b_ptrs + k_off)
        _cp_async(b1_smem.index(stage), b_ptrs + (k_off + b1_off))
    async_copy.commit_group()


@gluon.constexpr_function
def _load_layout(elem_bits, block_k, warps):
    """16-byte cp.async vectors over a ``[rows, block_k]`` tile, ``warps`` warps along M."""
    vec = 128 // elem_bits  # elements per 16 bytes
    return gl.BlockedLayout(
        size_per_thread=[1, vec],
        threads_per_warp=[32 // (block_k // vec), block_k // vec],
        warps_per_cta=[warps, 1],
        order=[1, 0],
    )


@gluon.constexpr_function
def _smem_layout(elem_bits):
    """128-byte swizzled operand tiles (rows of 128 bytes)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=elem_bits, rank=2)


@gluon.jit
def _rows(first, rows, sorted_pairs_ptr, num_pairs, GATE_UP: gl.constexpr, TOP_K: gl.constexpr,
          M: gl.constexpr, layout: gl.constexpr, ROWS: gl.constexpr):  # fmt: skip
    """``M`` rows of a tile from position ``first`` in ``layout``: (position, pair, valid,
    source row of the activations), int64. Past ``rows`` (a short block's tile reaches into
    the next block, or past the table) they are invalid.

    ``ROWS`` (see ``pair_gemm_ws_kernel``): ``"pairs"``, the Standard layout (GEMM 1
    gathers each pair's token); ``"slab"``, ExpertBatched rows ``[e·C]`` read in place;
    ``"index"``, ExpertBatched rows whose GEMM 1 input is ``x[row_index[position]]``
    (``sorted_pairs_ptr`` is then ``row_index``). GEMM 2 reads GEMM 1's output by position."""
    offs = gl.arange(0, M, layout=layout)
    pos = first + offs
    if ROWS == "pairs":
        pair = gl.load(sorted_pairs_ptr + pos, mask=offs < rows, other=num_pairs)
        valid = pair < num_pairs
        if GATE_UP:  # the pair's token, gathered
            src = gl.where(valid, pair // TOP_K, 0).to(gl.int64)
        else:
            src = pos
    else:
        pair = pos  # (no router weights in this layout)
        valid = offs < rows
        if GATE_UP and ROWS == "index":
            src = gl.load(sorted_pairs_ptr + pos, mask=valid, other=0).to(gl.int64)
        else:
            src = pos
    return pos, pair, valid, src


@gluon.jit
def _activation_ptrs(a_ptr, src, valid, stride_am, BLOCK_K: gl.constexpr,
                     load_layout: gl.constexpr):  # fmt: skip
    """Step 0's addresses of the activation tile, with its row mask (constant along K:
    16-byte copies)."""
    offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, load_layout))
    return a_ptr + src[:, None] * stride_am + offs_k[None, :], valid[:, None]


@gluon.jit
def _weight_ptrs(w_ptr, expert, n0, nb1, stride_we, stride_wn, BLOCK_N: gl.constexpr,
                 BLOCK_K: gl.constexpr, load_layout: gl.constexpr):  # fmt: skip
    """Step 0's addresses of weight tile 0 (rows ``n0..`` of the expert); weight tile 1
    (rows ``nb1..``) is ``b1_off`` elements further (a scalar: one tensor of addresses in
    registers, not two)."""
    offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, load_layout))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, load_layout)).to(gl.int64)
    b_ptrs = w_ptr + expert * stride_we + (n0 + offs_n)[:, None] * stride_wn + offs_k[None, :]
    return b_ptrs, (nb1 - n0) * stride_wn


@gluon.jit
def _scale_ptrs(a_scale_ptr, w_scale_ptr, src, expert, n0, nb1, stride_asm, stride_wse,
                stride_wsn, W_BLOCK_SCALE: gl.constexpr, BLOCK_K: gl.constexpr):  # fmt: skip
    """Step 0's FP8 scales: the rows' activation groups, the two weight tiles' blocks (or
    the expert's one scale, read at every step)."""
    as_ptrs = a_scale_ptr + src * stride_asm
    ws_base = w_scale_ptr + expert * stride_wse
    if W_BLOCK_SCALE:
        ws0_ptr = ws_base + (n0 // BLOCK_K) * stride_wsn
        ws1_ptr = ws_base + (nb1 // BLOCK_K) * stride_wsn
    else:
        ws0_ptr = ws_base
        ws1_ptr = ws_base
    return as_ptrs, ws0_ptr, ws1_ptr


@gluon.jit
def _scales_at(as_ptrs, ws0_ptr, ws1_ptr, valid, k, num_k, stride_ask, WS_STEP: gl.constexpr):
    """Step ``k``'s scales (activation rows, weight tile 0, weight tile 1); 1 past the last
    step, so that the last rescale is the final multiply."""
    has = k < num_k
    xs = gl.load(as_ptrs + k * stride_ask, mask=valid & has, other=1.0)
    w0 = gl.load(ws0_ptr + k * WS_STEP, mask=has, other=1.0)
    w1 = gl.load(ws1_ptr + k * WS_STEP, mask=has, other=1.0)
    return xs, w0, w1


@gluon.jit
def _to_store(x, step_layout: gl.constexpr, store_layout: gl.constexpr):
    """``x`` in ``store_layout`` through ``step_layout`` (see ``_store_layout``)."""
    return gl.convert_layout(gl.convert_layout(x, step_layout), store_layout)


@gluon.jit
def _epilogue(acc0, acc1, out_ptr, out_scale_ptr, topk_weights_ptr, pos, pair, valid, n0,
              pid_n, stride_om, stride_osm, stride_osk, GATE_UP: gl.constexpr,
              ACTIVATION: gl.constexpr,
              FP8: gl.constexpr, FP8_MAX: gl.constexpr, INV_FP8_MAX: gl.constexpr,
              BLOCK_N: gl.constexpr, store_layout: gl.constexpr, step_layout: gl.constexpr,
              WEIGHTED: gl.constexpr, SUM_TOP_K: gl.constexpr):  # fmt: skip
    """GEMM 1: ``act(acc0) · acc1`` (FP8: quantized per row, one group per tile); GEMM 2:
    both halves, scaled by the pair's router weight when ``WEIGHTED`` (the Standard
    layout). Rows by position; valid rows only. ``SUM_TOP_K`` > 0 (GEMM 2 of the Standard
    layout): each pair's row is added into output row ``pair // SUM_TOP_K`` by atomics
    instead (the top-k sum of the layer, in arrival order). The stores run in
    ``store_layout`` (the accumulators' own, or ``_store_layout``'s, reached through
    ``step_layout``)."""
    dtype = out_ptr.dtype.element_ty
    if GATE_UP:
        if ACTIVATION == "silu":
            act = acc0 / (1.0 + gl.exp(-acc0))
        else:
            act = 0.5 * acc0 * (1.0 + gl.erf(acc0 * 0.7071067811865476))
        h = act * acc1
        if FP8:  # one group of G columns per tile: quantize it for GEMM 2 (as quant.py)
            scale = gl.maximum(gl.max(gl.abs(h), axis=1), 1e-10) * INV_FP8_MAX
            h = gl.minimum(gl.maximum(h * gl.div_rn(1.0, scale)[:, None], -FP8_MAX), FP8_MAX)
            gl.store(out_scale_ptr + pos * stride_osm + pid_n * stride_osk, scale, mask=valid)
        # (converted in the output dtype: half the registers of fp32 or less)
        out0 = _to_store(h.to(dtype), step_layout, store_layout)
    else:
        if WEIGHTED:
            router_w = gl.load(topk_weights_ptr + pair, mask=valid, other=0.0)
            acc0 = acc0 * router_w[:, None]
            acc1 = acc1 * router_w[:, None]
        out0 = acc0.to(dtype)
        out1 = acc1.to(dtype)
    rows_layout: gl.constexpr = gl.SliceLayout(1, store_layout)
    valid = gl.convert_layout(valid, rows_layout)
    offs_c = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, store_layout))
    store_mask = valid[:, None] & (offs_c[None, :] < BLOCK_N)
    if SUM_TOP_K > 0:  # GEMM 2 of the Standard layout: into the pair's token row
        token = gl.where(valid, gl.convert_layout(pair, rows_layout) // SUM_TOP_K, 0)
        rows = out_ptr + token.to(gl.int64)[:, None] * stride_om + n0
    else:
        rows = out_ptr + gl.convert_layout(pos, rows_layout)[:, None] * stride_om + n0
    if GATE_UP:
        gl.store(rows + offs_c[None, :], out0, mask=store_mask)
    elif SUM_TOP_K > 0:
        out0 = _to_store(out0, step_layout, store_layout)
        gl.atomic_add(rows + offs_c[None, :], out0, mask=store_mask, sem="relaxed")
        out1 = _to_store(out1, step_layout, store_layout)
        gl.atomic_add(rows + (BLOCK_N + offs_c)[None, :], out1, mask=store_mask, sem="relaxed")
    else:
        gl.store(
            rows + offs_c[None, :], _to_store(out0, step_layout, store_layout), mask=store_mask
        )
        out1 = _to_store(out1, step_layout, store_layout)
        gl.store(rows + (BLOCK_N + offs_c)[None, :], out1, mask=store_mask)


@gluon.jit
def _both_mmas(a_s, b0_s, b1_s, acc0, acc1, xs_cur, w0_cur, w1_cur, xs_1, w0_1, w1_1):
    """One FP8 step's two MMAs, both retired before it returns: acc0's rescale for the next
    step runs while acc1's MMA does, acc1's after it. Both hold ``Σ s·D / s_k`` and leave
    with ``/ s_{k+1}`` instead (1 past the last step, so the last rescale is the final
    multiply). Nothing stays in flight across the loop's back edge: reading an accumulator
    of an MMA in flight there makes ptxas serialise every wgmma of the loop (C7514)."""
    tok0 = warpgroup_mma(a_s, b0_s.permute((1, 0)), acc0, is_async=True)
    tok1 = warpgroup_mma(a_s, b1_s.permute((1, 0)), acc1, is_async=True)
    acc0 = warpgroup_mma_wait(1, deps=[tok0])
    x_ratio = xs_cur / xs_1
    acc0 = acc0 * (x_ratio * (w0_cur / w0_1))[:, None]
    acc1 = warpgroup_mma_wait(0, deps=[tok1])
    acc1 = acc1 * (x_ratio * (w1_cur / w1_1))[:, None]
    return acc0, acc1


@gluon.jit
def _step_stage(k, num_k, a_smem, b0_smem, b1_smem, a_ptrs, a_mask, b_ptrs, b1_off,
                BLOCK_K: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """Step ``k``'s stage once its tiles have landed (for this thread) and are visible to
    the async proxy (wgmma) of every thread; refills the stage of step k - 2 with step
    k + STAGES - 2 (every warpgroup retired or waited for step k - 2's MMAs before it
    reached the barrier)."""
    async_copy.wait_group(STAGES - 3)
    fence_async_shared()
    _cta_barrier()
    nxt = k + STAGES - 2
    _issue_loads(
        a_smem, b0_smem, b1_smem, nxt % STAGES, a_ptrs, a_mask, b_ptrs, b1_off, nxt * BLOCK_K,
        nxt < num_k,
    )  # fmt: skip
    return k % STAGES


@gluon.jit
def _pair_tile(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, out_scale_ptr, topk_weights_ptr,
    sorted_pairs_ptr, expert, first, rows, pid_n, n0, nb1, N, K, num_pairs,
    stride_am, stride_asm, stride_ask, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    stride_osm, stride_osk,
    GATE_UP: gl.constexpr, TOP_K: gl.constexpr, ACTIVATION: gl.constexpr, FP8: gl.constexpr,
    W_BLOCK_SCALE: gl.constexpr, FP8_MAX: gl.constexpr, INV_FP8_MAX: gl.constexpr,
    TILE_M: gl.constexpr, WARPS_N: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, SUM_ROWS: gl.constexpr,
):  # fmt: skip
    """One ``[TILE_M, 2 · BLOCK_N]`` output tile (see pair_gemm_kernel): the K loop and the
    epilogue, with the warpgroups along M (``WARPS_N = 1``) or, for a half-height tile,
    along N (``WARPS_N = 2``)."""
    ELEM_BITS: gl.constexpr = a_ptr.dtype.element_ty.primitive_bitwidth
    # wgmma accumulators over the warpgroups: along M, or along N for a half-height tile
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0],
        warps_per_cta=[NUM_WARPS // WARPS_N, WARPS_N],
        instr_shape=[16, BLOCK_N // WARPS_N, 256 // ELEM_BITS],
    )
    load_layout: gl.constexpr = _load_layout(ELEM_BITS, BLOCK_K, NUM_WARPS)
    smem_layout: gl.constexpr = _smem_layout(ELEM_BITS)
    rows_mma: gl.constexpr = gl.SliceLayout(1, mma_layout)
    # the tile's rows for the copies, and for the scales and the epilogue
    _, _, valid_l, src_l = _rows(
        first, rows, sorted_pairs_ptr, num_pairs, GATE_UP, TOP_K, TILE_M,
        gl.SliceLayout(1, load_layout), "pairs",
    )  # fmt: skip
    pos_m, pair_m, valid_m, src_m = _rows(
        first, rows, sorted_pairs_ptr, num_pairs, GATE_UP, TOP_K, TILE_M, rows_mma, "pairs"
    )
    a_ptrs, a_mask = _activation_ptrs(a_ptr, src_l, valid_l, stride_am, BLOCK_K, load_layout)
    b_ptrs, b1_off = _weight_ptrs(
        w_ptr, expert, n0, nb1, stride_we, stride_wn, BLOCK_N, BLOCK_K, load_layout
    )
    a_smem = gl.allocate_shared_memory(
        a_ptr.dtype.element_ty, [STAGES, TILE_M, BLOCK_K], smem_layout
    )
    b0_smem = gl.allocate_shared_memory(
        w_ptr.dtype.element_ty, [STAGES, BLOCK_N, BLOCK_K], smem_layout
    )
    b1_smem = gl.allocate_shared_memory(
        w_ptr.dtype.element_ty, [STAGES, BLOCK_N, BLOCK_K], smem_layout
    )

    num_k = K // BLOCK_K
    # Prologue: steps 0 .. STAGES - 3 in flight (a stage is refilled two steps after use).
    for j in gl.static_range(STAGES - 2):
        _issue_loads(
            a_smem, b0_smem, b1_smem, j, a_ptrs, a_mask, b_ptrs, b1_off, j * BLOCK_K, j < num_k
        )

    acc0 = gl.zeros([TILE_M, BLOCK_N], gl.float32, layout=mma_layout)
    acc1 = gl.zeros([TILE_M, BLOCK_N], gl.float32, layout=mma_layout)
    if FP8:  # both MMAs of a step retire within it (_both_mmas)
        WS_STEP: gl.constexpr = 1 if W_BLOCK_SCALE else 0
        # Scales are loaded two steps ahead (their latency stays off the MMA chain).
        as_ptrs, ws0_ptr, ws1_ptr = _scale_ptrs(
            a_scale_ptr, w_scale_ptr, src_m, expert, n0, nb1, stride_asm, stride_wse,
            stride_wsn, W_BLOCK_SCALE, BLOCK_K,
        )  # fmt: skip
        xs_cur, w0_cur, w1_cur = _scales_at(
            as_ptrs, ws0_ptr, ws1_ptr, valid_m, 0, num_k, stride_ask, WS_STEP
        )
        xs_1, w0_1, w1_1 = _scales_at(
            as_ptrs, ws0_ptr, ws1_ptr, valid_m, 1, num_k, stride_ask, WS_STEP
        )
        for k in range(num_k):
            stage = _step_stage(
                k, num_k, a_smem, b0_smem, b1_smem, a_ptrs, a_mask, b_ptrs, b1_off, BLOCK_K,
                STAGES,
            )  # fmt: skip
            xs_2, w0_2, w1_2 = _scales_at(
                as_ptrs, ws0_ptr, ws1_ptr, valid_m, k + 2, num_k, stride_ask, WS_STEP
            )
            acc0, acc1 = _both_mmas(
                a_smem.index(stage), b0_smem.index(stage), b1_smem.index(stage), acc0, acc1,
                xs_cur, w0_cur, w1_cur, xs_1, w0_1, w1_1,
            )  # fmt: skip
            xs_cur, w0_cur, w1_cur = xs_1, w0_1, w1_1
            xs_1, w0_1, w1_1 = xs_2, w0_2, w1_2
    else:  # bf16: acc1's MMA stays in flight across the loop's back edge
        acc1_tok = warpgroup_mma_init(acc1)
        for k in range(num_k):
            stage = _step_stage(
                k, num_k, a_smem, b0_smem, b1_smem, a_ptrs, a_mask, b_ptrs, b1_off, BLOCK_K,
                STAGES,
            )  # fmt: skip
            a_s = a_smem.index(stage)
            tok0 = warpgroup_mma(a_s, b0_smem.index(stage).permute((1, 0)), acc0, is_async=True)
            acc1 = warpgroup_mma_wait(1, deps=[acc1_tok])  # MMA(acc1, k - 1) done
            acc1_tok = warpgroup_mma(a_s, b1_smem.index(stage).permute((1, 0)), acc1, is_async=True)
            acc0 = warpgroup_mma_wait(1, deps=[tok0])  # MMA(acc0, k) done; acc1's runs
        acc1 = warpgroup_mma_wait(0, deps=[acc1_tok])
    async_copy.wait_group(0)
    _epilogue(
        acc0, acc1, out_ptr, out_scale_ptr, topk_weights_ptr, pos_m, pair_m, valid_m, n0,
        pid_n, stride_om, stride_osm, stride_osk, GATE_UP, ACTIVATION, FP8, FP8_MAX,
        INV_FP8_MAX, BLOCK_N, mma_layout, mma_layout, True, TOP_K if SUM_ROWS else 0,
    )  # fmt: skip


@gluon.jit(do_not_specialize=ROW_COUNT_ARGS)
def pair_gemm_kernel(
    # pointers
    a_ptr,  # GATE_UP: x [R, H] (rows gathered by pair // TOP_K); else h [P_pad, I] by position
    a_scale_ptr,  # FP8: [rows of a, K / G] float32 group scales
    w_ptr,  # [e, N_w, K] weights (GATE_UP: w13 with N_w = 2N; else w2 with N_w = N)
    w_scale_ptr,  # FP8: [e, N_w / G, K / G] float32 block scales, or [e] per expert
    out_ptr,  # GATE_UP: y [P_pad, N] (FP8 with y_scale, else a's dtype); else [P_pad, N]
    out_scale_ptr,  # GATE_UP and FP8: [P_pad, N / G] float32 group scales of y
    topk_weights_ptr,  # not GATE_UP: [P] float32 router weight of each pair
    sorted_pairs_ptr,  # [P_pad] int32 pair r·K + k per position, P at padding
    block_expert_ptr,  # [B] int32 expert of each row block, -1 past the last one
    block_start_ptr,  # [B] int32 first padded position of each row block
    block_rows_ptr,  # [B] int32 padded positions of each row block, 0 past the last
    # sizes
    N,  # output columns (GATE_UP: I; else H)
    K,  # reduction (GATE_UP: H; else I)
    num_pairs,  # P (the sentinel)
    num_m_blocks,  # B
    # strides (elements; unit stride along K and along the output columns)
    stride_am,
    stride_asm,
    stride_ask,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_om,
    stride_osm,
    stride_osk,
    # meta-parameters
    GATE_UP: gl.constexpr,  # GEMM 1 (act(gate)·up, tiles n and N + n) else GEMM 2 (n, n + BN)
    TOP_K: gl.constexpr,
    ACTIVATION: gl.constexpr,
    FP8: gl.constexpr,
    W_BLOCK_SCALE: gl.constexpr,
    FP8_MAX: gl.constexpr,
    INV_FP8_MAX: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,  # columns of each of the two accumulator tiles
    BLOCK_K: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    HALF_TAIL: gl.constexpr,  # blocks of <= BLOCK_M / 2 rows run a half-height tile
    SUM_ROWS: gl.constexpr,  # GEMM 2: add each pair's row into out [R, N] row pair // TOP_K
    num_warps: gl.constexpr,
):
    # this program's tile: row block pid_m of the align table, column block pid_n
    TILE_N: gl.constexpr = BLOCK_N if GATE_UP else 2 * BLOCK_N
    num_n_blocks = N // TILE_N
    pid_m, pid_n = _tile_ids(gl.program_id(0), num_m_blocks, num_n_blocks, GROUP_M)
    rows = gl.load(block_rows_ptr + pid_m)
    if rows == 0:
        return
    expert = gl.load(block_expert_ptr + pid_m).to(gl.int64)
    first = gl.load(block_start_ptr + pid_m).to(gl.int64)
    n0 = pid_n * TILE_N
    if GATE_UP:
        nb1 = n0 + N  # the up rows of w13
    else:
        nb1 = n0 + BLOCK_N

    if HALF_TAIL:  # noqa: SIM102
        if rows <= BLOCK_M // 2:
            # an expert's last rows: half the MMA work; the two warpgroups split the columns
            _pair_tile(
                a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, out_scale_ptr,
                topk_weights_ptr, sorted_pairs_ptr, expert, first, rows, pid_n, n0, nb1, N, K,
                num_pairs, stride_am, stride_asm, stride_ask, stride_we, stride_wn, stride_wse,
                stride_wsn, stride_om, stride_osm, stride_osk, GATE_UP, TOP_K, ACTIVATION, FP8,
                W_BLOCK_SCALE, FP8_MAX,
                INV_FP8_MAX, BLOCK_M // 2, 2, BLOCK_N, BLOCK_K, STAGES, num_warps, SUM_ROWS,
            )  # fmt: skip
            return
    _pair_tile(
        a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, out_scale_ptr,
        topk_weights_ptr, sorted_pairs_ptr, expert, first, rows, pid_n, n0, nb1, N, K,
        num_pairs, stride_am, stride_asm, stride_ask, stride_we, stride_wn, stride_wse,
        stride_wsn, stride_om, stride_osm, stride_osk, GATE_UP, TOP_K, ACTIVATION, FP8,
        W_BLOCK_SCALE, FP8_MAX,
        INV_FP8_MAX, BLOCK_M, 1, BLOCK_N, BLOCK_K, STAGES, num_warps, SUM_ROWS,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------
# Warp-specialised and persistent: a loader partition issues the copies; each MMA
# warpgroup is a partition of its own (64 rows of the tile) that waits on mbarriers, never
# on a CTA barrier; every partition walks the same tiles, so the loader fills the next
# tile's stages while the MMA warpgroups run the last one's epilogue.


@gluon.jit
def _ws_claim(claim, GROUP_M: gl.constexpr):
    """The next tile from the launch's counter (each SM takes the next one as it frees, in
    the grouped order) and what every partition needs of it: (tile, rows of its block, its
    first position, its expert), int32; rows 0 past the last tile. ``claim``: (counter,
    row blocks in use, column blocks, the block table's three arrays)."""
    counter_ptr, num_m_blocks, num_n_blocks, block_expert_ptr, block_start_ptr, block_rows_ptr = (
        claim
    )
    t = gl.atomic_add(counter_ptr, 1)
    live = t < num_m_blocks * num_n_blocks
    pid_m, _ = _tile_ids(t, num_m_blocks, num_n_blocks, GROUP_M)
    rows = gl.load(block_rows_ptr + pid_m, mask=live, other=0)
    first = gl.load(block_start_ptr + pid_m, mask=live, other=0)
    expert = gl.load(block_expert_ptr + pid_m, mask=live, other=0)
    return t, rows, first, expert


@gluon.jit
def _claim_at(k, claim_k, t, rows, first, expert, claim, GROUP_M: gl.constexpr):
    """``_ws_claim`` at K step ``claim_k`` of the loader's tile, else the arguments: the
    next tile is claimed, and its block read, while this one's last copies wait for their
    stages, not after them."""
    if k == claim_k:
        t, rows, first, expert = _ws_claim(claim, GROUP_M)
    return t, rows, first, expert


@gluon.jit
def _ws_cols(t, num_m_blocks, num_n_blocks, N, GATE_UP: gl.constexpr, BLOCK_N: gl.constexpr,
             GROUP_M: gl.constexpr):  # fmt: skip
    """Tile ``t``'s first column of each accumulator tile in the weights."""
    _, pid_n = _tile_ids(t, num_m_blocks, num_n_blocks, GROUP_M)
    if GATE_UP:  # gate rows n0.., up rows N + n0.. of w13
        n0 = pid_n * BLOCK_N
        nb1 = n0 + N
    else:  # the two halves of a 2·BLOCK_N-column tile
        n0 = pid_n * 2 * BLOCK_N
        nb1 = n0 + BLOCK_N
    return pid_n, n0, nb1


@gluon.constexpr_function
def _entry_layout(warps):
    """A queue entry's four values, all held by every thread of ``warps`` warps (each
    thread writes and reads the whole entry, so the arriving thread wrote all of it)."""
    return gl.BlockedLayout([4], [32], [warps], [0])


@gluon.jit
def _publish_tile(queue, queue_ready, queue_empty, i, t, rows, first, expert):
    """The loader's ``i``-th tile (``t`` and its block's rows, first position and expert)
    into the queue's slot ``i % 2`` once every MMA partition has read what it held."""
    slot = i % 2
    mbarrier.wait(queue_empty.index(slot), ((i // 2) & 1) ^ 1, pred=i >= 2)
    entry: gl.constexpr = _entry_layout(gl.num_warps())
    j = gl.arange(0, 4, layout=entry)
    v = gl.where(j == 0, t, gl.where(j == 1, rows, gl.where(j == 2, first, expert)))
    queue.index(slot).store(v)
    mbarrier.arrive(queue_ready.index(slot))


@gluon.jit
def _next_tile(queue, queue_ready, queue_empty, i):
    """An MMA partition's ``i``-th tile from the queue: (tile, rows, first position,
    expert); the slot is released at once."""
    slot = i % 2
    mbarrier.wait(queue_ready.index(slot), (i // 2) & 1)
    entry: gl.constexpr = _entry_layout(gl.num_warps())
    j = gl.arange(0, 4, layout=entry)
    v = queue.index(slot).load(entry)
    mbarrier.arrive(queue_empty.index(slot))
    t = gl.sum(gl.where(j == 0, v, 0), axis=0)
    rows = gl.sum(gl.where(j == 1, v, 0), axis=0)
    first = gl.sum(gl.where(j == 2, v, 0), axis=0)
    expert = gl.sum(gl.where(j == 3, v, 0), axis=0)
    return t, rows, first, expert


@gluon.jit
def _ws_loader(
    args,  # the runtime arguments, a tuple: see pair_gemm_ws_kernel
    GATE_UP: gl.constexpr, TOP_K: gl.constexpr, TILE_M: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, ROWS: gl.constexpr,
    A_TMA: gl.constexpr, MMA_WGS: gl.constexpr,
):  # fmt: skip
    """Claims tiles from the launch's counter (``tile_counter_ptr``, zero at launch:
    ``_ws_claim``), passes each with its block to the MMA partitions through ``queue``,
    then loads its K steps (``_ws_load_tile``, which claims the next tile two steps before
    its last): step ``c`` (counted across tiles) into stage ``c % STAGES`` once every MMA
    partition released it.
    The weight tiles come by TMA (``w_desc``: the experts' weights as one ``[e·N_w, K]``
    matrix), their bytes expected on ``ready``; the gathered activation rows by
    ``cp.async``, each thread's copies arriving on ``ready`` when they land — or, with
    ``A_TMA`` (rows in position order), by TMA too (``a_desc``: ``[64, BLOCK_K]`` boxes
    from the block's first position; rows past the block are the next block's or zeros,
    computed and never stored)."""
    (
        a_ptr, a_desc, w_desc, sorted_pairs_ptr, block_expert_ptr, block_start_ptr,
        block_rows_ptr, a_smem, b0_smem, b1_smem, src_smem, ready, empty, queue, queue_ready,
        queue_empty, N, K, num_pairs, blocks_used_ptr, tile_counter_ptr, num_n_blocks,
        stride_am,
    ) = args  # fmt: skip
    ELEM_BITS: gl.constexpr = a_ptr.dtype.element_ty.primitive_bitwidth
    load_layout: gl.constexpr = _load_layout(ELEM_BITS, BLOCK_K, gl.num_warps())
    n_w = 2 * N if GATE_UP else N  # weight rows per expert
    num_m_blocks = gl.load(blocks_used_ptr)  # (every tile of those has rows)
    num_tiles = num_m_blocks * num_n_blocks
    claim = (
        tile_counter_ptr, num_m_blocks, num_n_blocks, block_expert_ptr, block_start_ptr,
        block_rows_ptr,
    )  # fmt: skip
    c = 0  # steps of the earlier tiles
    i = 0  # tiles so far
    t, rows, first, expert = _ws_claim(claim, GROUP_M)
    while t < num_tiles:
        _publish_tile(queue, queue_ready, queue_empty, i, t, rows, first, expert)
        pid_n, n0, nb1 = _ws_cols(t, num_m_blocks, num_n_blocks, N, GATE_UP, BLOCK_N, GROUP_M)
        c, t, rows, first, expert = _ws_load_tile(
            a_ptr, a_desc, w_desc, sorted_pairs_ptr, a_smem, b0_smem, b1_smem, src_smem, ready,
            empty, K, num_pairs, stride_am, c, rows, expert.to(gl.int64), first.to(gl.int64),
            n0, nb1, n_w, claim, load_layout, GATE_UP, TOP_K, TILE_M, BLOCK_N, BLOCK_K,
            GROUP_M, STAGES, ROWS, A_TMA, MMA_WGS,
        )  # fmt: skip
        i += 1
    # Every program ends with one claim past the last tile: the one that gets the last of
    # those values is the launch's last claim, and leaves the counter at zero for the next
    # launch (a graph replay, or GEMM 1 of the same aligned pairs again).
    if t == num_tiles + gl.num_programs(0) - 1:
        gl.store(tile_counter_ptr, 0)
    _publish_tile(queue, queue_ready, queue_empty, i, num_tiles, 0, 0, 0)  # the end


@gluon.jit
def _ws_stage_weights(w_desc, b0_smem, b1_smem, ready, empty, c, k, row0, row1,
                      BYTES: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """Step ``c``'s stage once every MMA partition released it: ``BYTES`` expected on its
    ``ready`` (the weight tiles' and any other TMA copies'), and the two weight tiles of K
    step ``k`` loaded by TMA. Returns the stage."""
    s = c % STAGES
    mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1, pred=c >= STAGES)
    mbarrier.expect(ready.index(s), BYTES)
    _tma_load(w_desc, [row0, k * BLOCK_K], ready.index(s), b0_smem.index(s))
    _tma_load(w_desc, [row1, k * BLOCK_K], ready.index(s), b1_smem.index(s))
    return s


@gluon.jit
def _ws_load_tile(
    a_ptr, a_desc, w_desc, sorted_pairs_ptr, a_smem, b0_smem, b1_smem, src_smem, ready, empty,
    K, num_pairs, stride_am, c, rows, expert, first, n0, nb1, n_w, claim,
    load_layout: gl.constexpr, GATE_UP: gl.constexpr, TOP_K: gl.constexpr,
    TILE_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    STAGES: gl.constexpr, ROWS: gl.constexpr, A_TMA: gl.constexpr, MMA_WGS: gl.constexpr,
):  # fmt: skip
    """The loader's K steps of one tile, step ``c`` (counted across tiles) into stage
    ``c % STAGES``; returns ``c`` past the tile and the next tile (``_ws_claim``), claimed
    two steps before the last. The weight tiles come by TMA; activation rows in position
    order (``A_TMA``) too, 64 per box; gathered rows by ``cp.async``."""
    ELEM_BITS: gl.constexpr = a_ptr.dtype.element_ty.primitive_bitwidth
    W_BYTES: gl.constexpr = 2 * BLOCK_N * BLOCK_K * ELEM_BITS // 8
    A_BYTES: gl.constexpr = MMA_WGS * 64 * BLOCK_K * ELEM_BITS // 8 if A_TMA else 0
    num_k = K // BLOCK_K
    row0 = (expert * n_w + n0).to(gl.int32)
    row1 = (expert * n_w + nb1).to(gl.int32)
    claim_k = gl.maximum(num_k - 2, 0)
    nt = num_k * 0  # the next tile, its block's rows, first position, expert (int32)
    nr = nt
    nf = nt
    ne = nt
    if A_TMA:
        a_row = first.to(gl.int32)
        for k in range(num_k):
            nt, nr, nf, ne = _claim_at(k, claim_k, nt, nr, nf, ne, claim, GROUP_M)
            s = _ws_stage_weights(
                w_desc, b0_smem, b1_smem, ready, empty, c, k, row0, row1, W_BYTES + A_BYTES,
                BLOCK_K, STAGES,
            )  # fmt: skip
            for j in gl.static_range(MMA_WGS):  # each warpgroup's 64 rows
                a_j = a_smem.index(s * MMA_WGS + j)
                _tma_load(a_desc, [a_row + 64 * j, k * BLOCK_K], ready.index(s), a_j)
            c += 1
    elif MMA_WGS == 3:
        # Gathered rows, 64 per warpgroup: too many addresses for the loader's registers,
        # so the tile's source rows wait in shared memory (-1: none) and each step makes
        # its addresses from them.
        rows_l: gl.constexpr = gl.SliceLayout(1, load_layout)
        _cta_barrier()  # (the loader's warps: the last tile's reads are done)
        for j in gl.static_range(MMA_WGS):
            _, _, valid_j, src_j = _rows(
                first + 64 * j, rows - 64 * j, sorted_pairs_ptr, num_pairs, GATE_UP, TOP_K,
                64, rows_l, ROWS,
            )  # fmt: skip
            src_smem.index(j).store(gl.where(valid_j, src_j, -1).to(gl.int32))
        _cta_barrier()
        for k in range(num_k):
            nt, nr, nf, ne = _claim_at(k, claim_k, nt, nr, nf, ne, claim, GROUP_M)
            s = _ws_stage_weights(
                w_desc, b0_smem, b1_smem, ready, empty, c, k, row0, row1, W_BYTES, BLOCK_K,
                STAGES,
            )  # fmt: skip
            for j in gl.static_range(MMA_WGS):
                from_j = src_smem.index(j).load(rows_l)
                a_ptrs, a_mask = _activation_ptrs(
                    a_ptr, from_j.to(gl.int64), from_j >= 0, stride_am, BLOCK_K, load_layout
                )
                _cp_async(a_smem.index(s * MMA_WGS + j), a_ptrs + k * BLOCK_K, mask=a_mask)
            async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
            c += 1
    else:
        _, _, valid, src = _rows(
            first, rows, sorted_pairs_ptr, num_pairs, GATE_UP, TOP_K, TILE_M,
            gl.SliceLayout(1, load_layout), ROWS,
        )  # fmt: skip
        a_ptrs, a_mask = _activation_ptrs(a_ptr, src, valid, stride_am, BLOCK_K, load_layout)
        for k in range(num_k):
            nt, nr, nf, ne = _claim_at(k, claim_k, nt, nr, nf, ne, claim, GROUP_M)
            s = _ws_stage_weights(
                w_desc, b0_smem, b1_smem, ready, empty, c, k, row0, row1, W_BYTES, BLOCK_K,
                STAGES,
            )  # fmt: skip
            _cp_async(a_smem.index(s), a_ptrs + k * BLOCK_K, mask=a_mask)
            async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
            c += 1
    return c, nt, nr, nf, ne


@gluon.jit
def _a_tile(a_smem, s, ROW0: gl.constexpr, MMA_WGS: gl.constexpr):
    """Stage ``s``'s activation rows ``[ROW0, ROW0 + 64)``: a tile of its own with three
    MMA warpgroups (shared-memory shapes are powers of two), else a slice of the stage's."""
    if MMA_WGS == 3:
        return a_smem.index(s * MMA_WGS + ROW0 // 64)
    else:
        return a_smem.index(s).slice(ROW0, 64, dim=0)


@gluon.jit
def _ws_mma(
    args,  # the runtime arguments, a tuple: see pair_gemm_ws_kernel
    GATE_UP: gl.constexpr, TOP_K: gl.constexpr, ACTIVATION: gl.constexpr, FP8: gl.constexpr,
    W_BLOCK_SCALE: gl.constexpr, FP8_MAX: gl.constexpr, INV_FP8_MAX: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
    ROWS: gl.constexpr, MMA_WGS: gl.constexpr, SCALES_BY_POS: gl.constexpr, SUM_ROWS: gl.constexpr,
    ROW0: gl.constexpr,
):  # fmt: skip
    """One MMA warpgroup: rows ``[ROW0, ROW0 + 64)`` of each tile the loader queues, both
    accumulators, the K loop of ``_pair_tile`` on mbarriers, and the epilogue of its rows.
    A block that ends before ``ROW0`` (an expert's last, short one) leaves this warpgroup
    idle: it only releases each stage, and the others have the tensor cores."""
    (
        a_ptr, a_scale_ptr, w_scale_ptr, out_ptr, out_scale_ptr, topk_weights_ptr,
        sorted_pairs_ptr, a_smem, b0_smem, b1_smem, ready, empty, queue, queue_ready,
        queue_empty, N, K, num_pairs, blocks_used_ptr, num_n_blocks, stride_asm, stride_ask,
        stride_wse, stride_wsn, stride_om, stride_osm, stride_osk,
    ) = args  # fmt: skip
    ELEM_BITS: gl.constexpr = a_ptr.dtype.element_ty.primitive_bitwidth
    WG_M: gl.constexpr = 64
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 256 // ELEM_BITS]
    )
    rows_mma: gl.constexpr = gl.SliceLayout(1, mma_layout)
    # the epilogue's store layout, and the step between it and the accumulators' (see
    # _store_layout; the accumulators' own where BLOCK_N is too narrow)
    # (16 columns: the first step's 8 bytes per thread; converting to it twice is one step)
    store_step: gl.constexpr = _store_layout(BLOCK_N, 1) if BLOCK_N >= 16 else mma_layout
    store_layout: gl.constexpr = _store_layout(BLOCK_N) if BLOCK_N >= 32 else store_step
    WS_STEP: gl.constexpr = 1 if W_BLOCK_SCALE else 0
    num_k = K // BLOCK_K
    num_m_blocks = gl.load(blocks_used_ptr)  # (every tile of those has rows)
    c = 0  # steps of the earlier tiles
    i = 0  # tiles so far
    t, rows, first_i, expert_i = _next_tile(queue, queue_ready, queue_empty, 0)
    while t < num_m_blocks * num_n_blocks:
        pid_n, n0, nb1 = _ws_cols(t, num_m_blocks, num_n_blocks, N, GATE_UP, BLOCK_N, GROUP_M)
        first = first_i.to(gl.int64)
        expert = expert_i.to(gl.int64)
        if rows > ROW0:
            pos_m, pair_m, valid_m, src_m = _rows(
                first + ROW0, rows - ROW0, sorted_pairs_ptr, num_pairs, GATE_UP, TOP_K, WG_M,
                rows_mma, ROWS,
            )  # fmt: skip
            acc0 = gl.zeros([WG_M, BLOCK_N], gl.float32, layout=mma_layout)
            acc1 = gl.zeros([WG_M, BLOCK_N], gl.float32, layout=mma_layout)
            if FP8:  # as in _pair_tile: both MMAs of a step retire within it
                # the rows' scales: by source row, or (SCALES_BY_POS) by position
                scale_rows = pos_m if SCALES_BY_POS else src_m
                as_ptrs, ws0_ptr, ws1_ptr = _scale_ptrs(
                    a_scale_ptr, w_scale_ptr, scale_rows, expert, n0, nb1, stride_asm,
                    stride_wse, stride_wsn, W_BLOCK_SCALE, BLOCK_K,
                )  # fmt: skip
                xs_cur, w0_cur, w1_cur = _scales_at(
                    as_ptrs, ws0_ptr, ws1_ptr, valid_m, 0, num_k, stride_ask, WS_STEP
                )
                xs_1, w0_1, w1_1 = _scales_at(
                    as_ptrs, ws0_ptr, ws1_ptr, valid_m, 1, num_k, stride_ask, WS_STEP
                )
                for k in range(num_k):
                    s = (c + k) % STAGES
                    mbarrier.wait(ready.index(s), ((c + k) // STAGES) & 1)
                    fence_async_shared()  # the copies (generic proxy) before the MMAs read them
                    xs_2, w0_2, w1_2 = _scales_at(
                        as_ptrs, ws0_ptr, ws1_ptr, valid_m, k + 2, num_k, stride_ask, WS_STEP
                    )
                    acc0, acc1 = _both_mmas(
                        _a_tile(a_smem, s, ROW0, MMA_WGS), b0_smem.index(s),
                        b1_smem.index(s), acc0, acc1, xs_cur, w0_cur, w1_cur, xs_1, w0_1, w1_1,
                    )  # fmt: skip
                    mbarrier.arrive(empty.index(s))  # both MMAs of the step are done
                    xs_cur, w0_cur, w1_cur = xs_1, w0_1, w1_1
                    xs_1, w0_1, w1_1 = xs_2, w0_2, w1_2
            else:  # bf16: acc1's MMA stays in flight across the loop's back edge
                acc1_tok = warpgroup_mma_init(acc1)
                for k in range(num_k):
                    s = (c + k) % STAGES
                    mbarrier.wait(ready.index(s), ((c + k) // STAGES) & 1)
                    fence_async_shared()
                    a_s = _a_tile(a_smem, s, ROW0, MMA_WGS)
                    tok0 = warpgroup_mma(a_s, b0_smem.index(s).permute((1, 0)), acc0, is_async=True)
                    acc1 = warpgroup_mma_wait(1, deps=[acc1_tok])  # MMA(acc1, k - 1) done
                    # this warpgroup is done with step k - 1's stage
                    mbarrier.arrive(empty.index((c + k + STAGES - 1) % STAGES), pred=k > 0)
                    acc1_tok = warpgroup_mma(
                        a_s, b1_smem.index(s).permute((1, 0)), acc1, is_async=True
                    )
                    acc0 = warpgroup_mma_wait(1, deps=[tok0])
                acc1 = warpgroup_mma_wait(0, deps=[acc1_tok])
                mbarrier.arrive(empty.index((c + num_k - 1) % STAGES))  # the tile's last step
            _epilogue(
                acc0, acc1, out_ptr, out_scale_ptr, topk_weights_ptr, pos_m, pair_m, valid_m,
                n0, pid_n, stride_om, stride_osm, stride_osk, GATE_UP, ACTIVATION, FP8, FP8_MAX,
                INV_FP8_MAX, BLOCK_N, store_layout, store_step, ROWS == "pairs",
                TOP_K if SUM_ROWS else 0,
            )  # fmt: skip
        else:  # idle: release the stages the other warpgroup reads
            for k in range(num_k):
                mbarrier.wait(ready.index((c + k) % STAGES), ((c + k) // STAGES) & 1)
                mbarrier.arrive(empty.index((c + k) % STAGES))
        c += num_k
        i += 1
        t, rows, first_i, expert_i = _next_tile(queue, queue_ready, queue_empty, i)


@gluon.jit(do_not_specialize=ROW_COUNT_ARGS)
def pair_gemm_ws_kernel(
    a_ptr, a_desc, a_scale_ptr, w_desc, w_scale_ptr, out_ptr, out_scale_ptr, topk_weights_ptr,
    sorted_pairs_ptr, block_expert_ptr, block_start_ptr, block_rows_ptr,
    N, K, num_pairs, num_m_blocks,  # (unused here: the tiles come from blocks_used_ptr)
    stride_am, stride_asm, stride_ask, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    stride_osm, stride_osk,
    blocks_used_ptr,  # [1] int32: row blocks in use (align_pairs), the first ones
    tile_counter_ptr,  # [1] int32, zero at launch (and left at zero): the next tile to claim
    GATE_UP: gl.constexpr, TOP_K: gl.constexpr, ACTIVATION: gl.constexpr, FP8: gl.constexpr,
    W_BLOCK_SCALE: gl.constexpr, FP8_MAX: gl.constexpr, INV_FP8_MAX: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    GROUP_M: gl.constexpr, STAGES: gl.constexpr, ROWS: gl.constexpr, A_TMA: gl.constexpr,
    SCALES_BY_POS: gl.constexpr,  # FP8: a_scale's rows are positions (else source rows)
    SUM_ROWS: gl.constexpr,  # GEMM 2, "pairs": add each pair's row into out row pair // TOP_K
    LOAD_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr, MMA_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    """``pair_gemm_kernel`` (one tile height) as partitions over a persistent grid: each
    program claims tiles from ``tile_counter_ptr`` until none are left; this program's 4
    warps and one or two more warpgroups run the MMAs, 64 rows each (``BLOCK_M`` 128 or
    192); ``LOAD_WARPS`` warps claim the tiles and load. The launch picks the number of
    programs.

    ``ROWS`` (see ``_rows``): ``"pairs"``, the Standard layout (``sorted_pairs_ptr`` and the
    block table from ``align_pairs``, router weights in GEMM 2); ``"slab"`` / ``"index"``,
    ExpertBatched (the block table from ``slab_blocks``, positions in ``[e·C]``; for
    ``"index"`` GEMM 1 reads ``a[row_index[position]]`` with ``sorted_pairs_ptr`` the row
    index; no router weights).
    ``A_TMA`` (192-row tiles): the activation rows are in position order (GEMM 2, GEMM 1 of
    ``"slab"``) and come by TMA through ``a_desc``, 64 rows per box; else by ``cp.async``
    from ``a_ptr`` (``a_desc`` unused). With three MMA warpgroups the loader has 32
    registers per thread, too few to hold the addresses of 192 gathered rows: it keeps
    their source rows in shared memory and makes the addresses at each step."""
    num_n_blocks = N // (BLOCK_N if GATE_UP else 2 * BLOCK_N)
    MMA_WGS: gl.constexpr = BLOCK_M // 64
    ELEM_BITS: gl.constexpr = a_ptr.dtype.element_ty.primitive_bitwidth
    smem_layout: gl.constexpr = _smem_layout(ELEM_BITS)
    if MMA_WGS == 3:  # one 64-row tile per warpgroup and stage (shapes: powers of two)
        a_smem = gl.allocate_shared_memory(
            a_ptr.dtype.element_ty, [STAGES * MMA_WGS, 64, BLOCK_K], smem_layout
        )
    else:
        a_smem = gl.allocate_shared_memory(
            a_ptr.dtype.element_ty, [STAGES, BLOCK_M, BLOCK_K], smem_layout
        )
    b0_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    b1_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    # the loader's source rows of a 192-row tile of gathered rows (see _ws_loader)
    src_smem = gl.allocate_shared_memory(
        gl.int32, [4 if MMA_WGS == 3 else 1, 64], gl.SwizzledSharedLayout(1, 1, 1, [0])
    )
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        # the loader's one expect of the TMA bytes (and its threads' cp.async arrivals)
        mbarrier.init(ready.index(i), count=1 if A_TMA else LOAD_WARPS * 32 + 1)
        mbarrier.init(empty.index(i), count=MMA_WGS)
    # the tiles the loader claimed, two in flight (tile, rows, first position, expert), and
    # their mbarriers
    queue = gl.allocate_shared_memory(gl.int32, [2, 4], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    queue_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    queue_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(queue_ready.index(i), count=1)
        mbarrier.init(queue_empty.index(i), count=MMA_WGS)
    mma = (  # (the tiles' blocks come through the queue)
        a_ptr, a_scale_ptr, w_scale_ptr, out_ptr, out_scale_ptr, topk_weights_ptr,
        sorted_pairs_ptr, a_smem, b0_smem, b1_smem, ready, empty, queue, queue_ready,
        queue_empty, N, K, num_pairs, blocks_used_ptr, num_n_blocks, stride_asm, stride_ask,
        stride_wse, stride_wsn, stride_om, stride_osm, stride_osk,
    )  # fmt: skip
    load = (
        a_ptr, a_desc, w_desc, sorted_pairs_ptr, block_expert_ptr, block_start_ptr,
        block_rows_ptr, a_smem, b0_smem, b1_smem, src_smem, ready, empty, queue, queue_ready,
        queue_empty, N, K, num_pairs, blocks_used_ptr, tile_counter_ptr, num_n_blocks,
        stride_am,
    )  # fmt: skip
    # One partition per MMA warpgroup, 64 rows of each tile each (the first on this
    # program's own warps), and the loader.
    if MMA_WGS == 3:
        gl.warp_specialize(
            [
                (_ws_mma, (mma, GATE_UP, TOP_K, ACTIVATION, FP8, W_BLOCK_SCALE, FP8_MAX,
                           INV_FP8_MAX, BLOCK_N, BLOCK_K, GROUP_M, STAGES, ROWS, MMA_WGS,
                           SCALES_BY_POS, SUM_ROWS, 0)),
                (_ws_mma, (mma, GATE_UP, TOP_K, ACTIVATION, FP8, W_BLOCK_SCALE, FP8_MAX,
                           INV_FP8_MAX, BLOCK_N, BLOCK_K, GROUP_M, STAGES, ROWS, MMA_WGS,
                           SCALES_BY_POS, SUM_ROWS, 64)),
                (_ws_mma, (mma, GATE_UP, TOP_K, ACTIVATION, FP8, W_BLOCK_SCALE, FP8_MAX,
                           INV_FP8_MAX, BLOCK_N, BLOCK_K, GROUP_M, STAGES, ROWS, MMA_WGS,
                           SCALES_BY_POS, SUM_ROWS, 128)),
                (_ws_loader, (load, GATE_UP, TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                              STAGES, ROWS, A_TMA, MMA_WGS)),
            ],
            [4, 4, LOAD_WARPS],
            [MMA_REGS, MMA_REGS, LOAD_REGS],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (_ws_mma, (mma, GATE_UP, TOP_K, ACTIVATION, FP8, W_BLOCK_SCALE, FP8_MAX,
                           INV_FP8_MAX, BLOCK_N, BLOCK_K, GROUP_M, STAGES, ROWS, MMA_WGS,
                           SCALES_BY_POS, SUM_ROWS, 0)),
                (_ws_mma, (mma, GATE_UP, TOP_K, ACTIVATION, FP8, W_BLOCK_SCALE, FP8_MAX,
                           INV_FP8_MAX, BLOCK_N, BLOCK_K, GROUP_M, STAGES, ROWS, MMA_WGS,
                           SCALES_BY_POS, SUM_ROWS, 64)),
                (_ws_loader, (load, GATE_UP, TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                              STAGES, ROWS, A_TMA, MMA_WGS)),
            ],
            [4, LOAD_WARPS],
            [MMA_REGS, LOAD_REGS],
        )  # fmt: skip


def weight_descriptor(w, block_n: int, block_k: int) -> TensorDescriptor:
    """The TMA descriptor of ``w [e, N_w, K]`` (experts stacked: ``ops`` checks) as one
    ``[e·N_w, K]`` matrix read in ``[block_n, block_k]`` boxes into 128-byte swizzled tiles,
    for ``pair_gemm_ws_kernel``."""
    return rows_descriptor(w.view(-1, w.shape[-1]), block_n, block_k)


def rows_descriptor(a, block_rows: int, block_k: int) -> TensorDescriptor:
    """The TMA descriptor of a matrix ``a [rows, K]`` (unit stride along K) read in
    ``[block_rows, block_k]`` boxes into 128-byte swizzled tiles (rows past the end read as
    zeros)."""
    layout = gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=a.element_size() * 8, rank=2
    )
    return TensorDescriptor.from_tensor(a, [block_rows, block_k], layout)
