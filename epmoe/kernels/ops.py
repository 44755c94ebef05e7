"""Host wrappers of the MoE Triton kernels: check inputs, allocate outputs, launch.

Shape legend: R received rows · H hidden size · I intermediate size · e local experts ·
K top-k · C rows of capacity per expert · P = R·K (row, k) pairs · P_pad padded pair
positions · B row blocks · G = 128 (FP8 group size).

Device-agnostic: CUDA tensors run compiled kernels; CPU tensors run under the Triton
interpreter (``TRITON_INTERPRET=1`` set before ``epmoe.kernels`` is first imported), which
the CPU tests use. Nothing here reads a tensor's values on the host: sizes come from
shapes only, so there is no host synchronisation and the ExpertBatched path can be
captured in a CUDA graph (with a fixed config: pass ``config`` or ship a tuned table).

Entry points: ``fused_moe_standard`` and ``fused_moe_batched`` run a whole expert MLP
layer; ``align_pairs`` (``align_for``: for a config), ``gate_up``, ``down``, ``sum_topk`` and
``per_token_group_quant_fp8`` are its steps (the benchmark times them one by one).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch

from epmoe.distributed import num_sms
from epmoe.kernels import align, grouped_gemm, launcher, quant, reduce
from epmoe.kernels.configs import (
    FP8_GROUP,
    WGMMA_KERNELS,
    MoEConfig,
    check_config,
    dtype_name,
    heuristic_config,
    select_config,
    wgmma_unavailable,
)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# 1/448 rounded to float32: scales are ``max(amax, FP8_EPS) * INV_FP8_MAX`` (a product, bit-equal
# to torch's ``amax / 448.0`` on CUDA, which multiplies by the reciprocal of a scalar divisor).
INV_FP8_MAX = struct.unpack("f", struct.pack("f", 1.0 / FP8_MAX))[0]
FP8_EPS = 1e-10  # smallest amax a group's scale is computed from (all-zero groups)
COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ACTIVATIONS = ("silu", "gelu")


@dataclass(frozen=True)
class AlignedPairs:
    """The (row, k) pairs of a Standard-layout batch, grouped by local expert.

    Each expert's group is padded to a multiple of ``pad_m`` positions (``block_m``;
    ``block_m / 2`` with half-height tail blocks; 64 for the Hopper kernel's 192-row blocks:
    ``MoEConfig.pad_m``) and cut into row blocks of ``block_m`` positions, the last one
    shorter (a multiple of ``pad_m``) when the rows fit.
    ``sorted_pairs [B·block_m]`` int32: the pair ``r·K + k`` at each padded position, the
    sentinel ``P`` at padding (positions past ``num_padded`` are unspecified).
    ``block_expert [B]`` int32: the expert of each row block, ``-1`` past the last real
    block; ``block_start [B]`` / ``block_rows [B]`` int32: its first position and its size
    (``block_m`` or, for the last, a multiple of ``pad_m``; 0 past the last block).
    ``pair_pos [P]`` int32: the padded
    position of each pair, ``-1`` when its id is not local. ``expert_counts [e]`` int32:
    pairs per expert. ``num_padded [1]`` int32: padded positions in use;
    ``blocks_used [1]`` int32: row blocks in use (the first ones). Only
    ``B = ceil((P + min(e, P)·(block_m − 1)) / block_m)`` (the worst case) is known on the
    host. ``tile_counters [2]`` int32, zero: the tile counters of the persistent Hopper
    kernel's GEMM 1 and GEMM 2 (each launch leaves its counter at zero again; so at most
    one GEMM 1 and one GEMM 2 on the same aligned pairs may run at a time — two at once on
    two streams would share a counter).
    """

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    block_start: torch.Tensor
    block_rows: torch.Tensor
    pair_pos: torch.Tensor
    expert_counts: torch.Tensor
    num_padded: torch.Tensor
    blocks_used: torch.Tensor
    block_m: int
    pad_m: int
    num_rows: int  # R
    top_k: int  # K
    tile_counters: torch.Tensor | None = None

    @property
    def num_pairs(self) -> int:  # P
        return self.num_rows * self.top_k

    @property
    def num_blocks(self) -> int:  # B
        return self.block_expert.shape[0]


def interpreted() -> bool:
    """Whether the kernels were built for the Triton interpreter (CPU tensors)."""
    return launcher.interpreted(grouped_gemm.gate_up_kernel)


def _check_device(*tensors: torch.Tensor | None) -> torch.device:
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type != "cuda" and not interpreted():
        raise RuntimeError(
            f"the Triton MoE kernels run on CUDA tensors, got {device}; on CPU use "
            "experts='torch', or set TRITON_INTERPRET=1 before epmoe.kernels is imported"
        )
    return device


def _cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the host (``triton.cdiv`` is a jitted function: a Python call
    through Triton's launcher machinery, µs each, several per forward)."""
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def align_for(topk_ids_RK: torch.Tensor, num_experts: int, config: MoEConfig) -> AlignedPairs:
    """``align_pairs`` as ``config``'s kernels read the pairs: its ``block_m``, ``half_tail``
    and ``pad_m``."""
    return align_pairs(topk_ids_RK, num_experts, config.block_m, config.half_tail, config.pad_m)


def align_pairs(
    topk_ids_RK: torch.Tensor,
    num_experts: int,
    block_m: int,
    half_tail: bool = False,
    pad_m: int | None = None,
) -> AlignedPairs:
    """Group the (row, k) pairs by local expert, each group padded to ``block_m`` rows
    (to ``block_m / 2`` with ``half_tail``: an expert's last block may be half a block;
    or to ``pad_m``, a divisor of ``block_m``: ``MoEConfig.pad_m``).

    ``topk_ids_RK [R, K]`` int32/int64 local slots; ids outside ``[0, num_experts)`` (``-1``
    for experts on other ranks) are not local and get no position. Three small launches,
    no host synchronisation; the order of pairs inside a group is arbitrary.
    """
    if topk_ids_RK.dim() != 2 or topk_ids_RK.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"topk_ids must be an int32/int64 [R, K] tensor, got {topk_ids_RK.dtype} "
            f"{tuple(topk_ids_RK.shape)}"
        )
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if block_m < 1 or (block_m & (block_m - 1) and block_m % 64):
        raise ValueError(f"block_m must be a power of two or a multiple of 64, got {block_m}")
    if half_tail and block_m < 2:
        raise ValueError(f"half_tail needs block_m >= 2, got {block_m}")
    if pad_m is None:
        pad_m = block_m // 2 if half_tail else block_m
    elif pad_m < 1 or block_m % pad_m:
        raise ValueError(f"pad_m must divide block_m ({block_m}), got {pad_m}")
    elif pad_m < block_m and not half_tail:
        raise ValueError(
            f"pad_m={pad_m} < block_m={block_m} makes tail blocks: pass half_tail=True "
            "(or align_for(ids, e, config))"
        )
    device = _check_device(topk_ids_RK)
    R, K = topk_ids_RK.shape
    P = R * K
    ids = topk_ids_RK.contiguous().view(-1)
    # ceil(count / pad_m)·pad_m positions need ceil(count / block_m) blocks: the worst case
    # of B does not depend on pad_m.
    num_blocks = _cdiv(P + min(num_experts, P) * (block_m - 1), block_m)
    i32 = dict(dtype=torch.int32, device=device)
    counts = torch.zeros(num_experts, **i32)
    sorted_pairs = torch.empty(num_blocks * block_m, **i32)
    # expert, start, rows: three allocations, so each pointer has the allocator's alignment
    # whatever B is (Triton specialises kernels on 16-byte pointer alignment)
    block_table = [torch.empty(num_blocks, **i32) for _ in range(3)]
    expert_start = torch.empty(num_experts, **i32)
    num_padded, blocks_used = torch.empty(1, **i32), torch.empty(1, **i32)  # (written below)
    pair_pos = torch.empty(P, **i32)
    rank = torch.empty(P, **i32)
    tile_counters = torch.empty(2, **i32)  # (zeroed by block_table_kernel)
    aligned = AlignedPairs(
        sorted_pairs, *block_table, pair_pos, counts, num_padded, blocks_used, block_m, pad_m,
        R, K, tile_counters,
    )  # fmt: skip
    if P == 0:  # no kernel runs: nothing else would write these
        for t in (tile_counters, num_padded, blocks_used):
            t.zero_()
        return aligned
    block = 1024
    align.count_pairs_kernel[(_cdiv(P, block),)](
        ids, counts, rank, P, num_experts, BLOCK=block, num_warps=4
    )
    block_e = _pow2(num_experts)
    block_b = max(1, min(64, 8192 // max(block_e, _pow2(block_m))))  # (a power of two)
    align.block_table_kernel[(_cdiv(num_blocks, block_b),)](
        counts,
        *block_table,
        expert_start,
        num_padded,
        blocks_used,
        sorted_pairs,
        tile_counters,
        P,
        num_experts,
        num_blocks,
        BLOCK_M=block_m,
        BLOCK_M_P2=_pow2(block_m),
        PAD_M=pad_m,
        BLOCK_B=block_b,
        BLOCK_E=block_e,
        num_warps=4,
    )
    align.scatter_pairs_kernel[(_cdiv(P, block),)](
        ids, rank, expert_start, sorted_pairs, pair_pos, P, num_experts, BLOCK=block, num_warps=4
    )
    return aligned


class SlabBlocks(NamedTuple):
    """ExpertBatched slabs ``[e, C, ·]`` cut into row blocks (``slab_blocks``), as the
    persistent Hopper kernel walks them: ``num_blocks`` is the worst case ``e·⌈C/block_m⌉``,
    ``blocks_used [1]`` (on the device) how many of the first entries hold rows. It can
    stand in for the counts as ``gate_up`` / ``down``'s ``rows``, so that both GEMMs of a
    layer walk one table (the tile counter is left at zero by each launch)."""

    block_expert: torch.Tensor  # [num_blocks] int32
    block_start: torch.Tensor  # [num_blocks] int32 first row in the [e·C] slabs
    block_rows: torch.Tensor  # [num_blocks] int32 valid rows
    blocks_used: torch.Tensor  # [1] int32
    num_blocks: int
    tile_counter: torch.Tensor  # [1] int32, zero
    counts: torch.Tensor  # [e] int32, as given
    capacity: int  # C
    block_m: int


def slab_blocks(counts_e: torch.Tensor, capacity: int, block_m: int) -> SlabBlocks:
    """The row blocks of ExpertBatched slabs with ``counts_e [e]`` int32 valid rows each
    (clamped to ``[0, capacity]``): one launch, read on the device only (graph-safe)."""
    e = counts_e.shape[0]
    num_blocks = e * _cdiv(capacity, block_m)
    i32 = dict(dtype=torch.int32, device=counts_e.device)
    # three allocations: each pointer keeps the allocator's alignment (as in align_pairs)
    table = [torch.empty(max(num_blocks, 1), **i32) for _ in range(3)]
    blocks_used, counter = torch.zeros(1, **i32), torch.empty(1, **i32)
    if num_blocks:  # (else no GEMM launches, and the counter is never read)
        align.slab_blocks_kernel[(1,)](
            counts_e, *table, blocks_used, counter, e, capacity, BLOCK_M=block_m,
            BLOCK_E=_pow2(e), num_warps=4,
        )  # fmt: skip
    return SlabBlocks(*table, blocks_used, num_blocks, counter, counts_e, capacity, block_m)


def sort_scales(x_scale_RG: torch.Tensor, aligned: AlignedPairs) -> torch.Tensor:
    """GEMM 1's FP8 row scales ``x_scale [R, G]`` by padded position, group-major:
    ``[G, P_pad]`` with ``x_scale[pair // K]`` at each position in use and 1 at the padding
    (positions past ``num_padded`` unspecified). One launch, no host synchronisation."""
    if x_scale_RG.dim() != 2 or x_scale_RG.shape[0] != aligned.num_rows:
        raise ValueError(
            f"x_scale must be [R={aligned.num_rows}, G], one row per row of the aligned "
            f"pairs; got {tuple(x_scale_RG.shape)}"
        )
    return _sort_scales(
        x_scale_RG, aligned.sorted_pairs, aligned.num_padded, aligned.num_pairs, aligned.top_k
    )


def _sort_scales(x_scale, sorted_pairs, num_padded, num_pairs, top_k):
    P_pad, G = sorted_pairs.shape[0], x_scale.shape[1]
    out = torch.empty((G, P_pad), dtype=torch.float32, device=x_scale.device)
    if P_pad and x_scale.shape[0]:
        block_p = 128
        align.sort_scales_kernel[(_cdiv(P_pad, block_p),)](
            x_scale, sorted_pairs, num_padded, out, num_pairs, G, x_scale.stride(0),
            x_scale.stride(1), out.stride(0), TOP_K=top_k, BLOCK_P=block_p,
            BLOCK_G=_pow2(G), num_warps=4,
        )  # fmt: skip
    return out


def per_token_group_quant_fp8(
    x: torch.Tensor, counts: torch.Tensor | None = None, group_size: int = FP8_GROUP
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., D]`` to ``float8_e4m3fn`` with one float32 scale per row and
    group of ``group_size`` columns: ``scale = max(amax, 1e-10) * float32(1/448)`` and
    ``q = clamp(x · (1 / scale), ±448)`` rounded to nearest even (bit-equal to
    ``epmoe.reference.quantize_groups``; the GPU tests check it).

    Returns ``(q [..., D], scale [..., ceil(D / group_size)])``. With ``counts [e]`` int32,
    ``x`` is ``[e, C, D]`` and only rows ``[:counts[i]]`` of slot ``i`` are written (the
    rest of both outputs is unspecified).
    """
    if x.dim() < 1 or x.dtype not in COMPUTE_DTYPES:
        raise TypeError(f"x must be a bf16/fp16/fp32 tensor, got {x.dtype} {tuple(x.shape)}")
    if group_size < 16 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two >= 16, got {group_size}")
    D = x.shape[-1]
    x2 = x.reshape(-1, D) if x.stride(-1) == 1 else x.contiguous().reshape(-1, D)
    M = x2.shape[0]
    if counts is not None:
        if x.dim() != 3 or counts.shape != (x.shape[0],):
            raise ValueError(
                f"with counts, x must be [e, C, D] and counts [e]; got {tuple(x.shape)} and "
                f"{tuple(counts.shape)}"
            )
        counts = counts.to(torch.int32)
    device = _check_device(x, counts)
    groups = _cdiv(D, group_size)
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=device)
    scale = torch.empty(*x.shape[:-1], groups, dtype=torch.float32, device=device)
    if M == 0 or D == 0:
        return q, scale
    q2, s2 = q.view(-1, D), scale.view(-1, groups)
    block_m = 16
    quant.per_token_group_quant_kernel[(_cdiv(M, block_m), groups)](
        x2,
        q2,
        s2,
        counts if counts is not None else x2,
        M,
        D,
        x.shape[1] if counts is not None else 1,
        x2.stride(0),
        q2.stride(0),
        s2.stride(0),
        s2.stride(1),
        HAS_COUNTS=counts is not None,
        GROUP=group_size,
        FP8_MAX=FP8_MAX,
        INV_FP8_MAX=INV_FP8_MAX,
        EPS=FP8_EPS,
        BLOCK_M=block_m,
        num_warps=4,
    )
    return q, scale


def _weight_scale_strides(
    scale: torch.Tensor | None, w: torch.Tensor, name: str
) -> tuple[bool, tuple[int, int, int]]:
    """(block scales?, strides [e, n-block, k-block]) of an FP8 weight scale."""
    if scale is None:
        return True, (0, 0, 0)
    e, n, k = w.shape
    block = (e, _cdiv(n, FP8_GROUP), _cdiv(k, FP8_GROUP))
    if scale.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {scale.dtype}")
    if tuple(scale.shape) == block:
        return True, (scale.stride(0), scale.stride(1), scale.stride(2))
    if tuple(scale.shape) == (e,):
        return False, (scale.stride(0), 0, 0)
    raise ValueError(
        f"{name} must be block scales {list(block)} (128×128 blocks) or per-expert [{e}], "
        f"got {list(scale.shape)}"
    )


def _row_strides(t: torch.Tensor | None, batched: bool) -> tuple[int, int, int]:
    """(expert, row, column) strides of a ``[rows, cols]`` or ``[e, C, cols]`` tensor."""
    if t is None:
        return 0, 0, 0
    if batched:
        return t.stride(0), t.stride(1), t.stride(2)
    return 0, t.stride(0), t.stride(1)


class _Rows(NamedTuple):
    """Kernel arguments that say where each expert's rows are (unused ones point at any
    tensor: the kernels never read them for the other layout)."""

    batched: bool
    num_m_blocks: int  # Standard: B (Batched: 0, its grid is _launch_rows')
    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    block_start: torch.Tensor
    block_rows: torch.Tensor
    counts: torch.Tensor
    num_pairs: int  # Standard: P, the sentinel
    capacity: int  # Batched: C
    top_k: int
    gather: bool = False  # Batched: x is [R, H], sorted_pairs the row index [e, C]
    blocks_used: torch.Tensor | None = None  # Standard: [1] int32 row blocks in use
    tile_counters: torch.Tensor | None = None  # Standard: [2] int32, zero (GEMM 1, GEMM 2)
    slabs: SlabBlocks | None = None  # Batched: the Hopper kernel's block table, built once
    num_padded: torch.Tensor | None = None  # Standard: [1] int32 positions in use


def _rows(
    rows: AlignedPairs | SlabBlocks | torch.Tensor,
    config: MoEConfig,
    e: int,
    x: torch.Tensor,
    row_index: torch.Tensor | None = None,
) -> _Rows:
    if isinstance(rows, AlignedPairs):
        if (rows.block_m, rows.pad_m) != (config.block_m, config.pad_m):
            raise ValueError(
                f"pairs aligned for block_m={rows.block_m}, pad_m={rows.pad_m}; the config "
                f"needs block_m={config.block_m}, pad_m={config.pad_m} (align the pairs with "
                f"align_for(ids, e, config))"
            )
        if rows.expert_counts.shape[0] != e:
            raise ValueError(
                f"pairs aligned for e={rows.expert_counts.shape[0]} experts, the weights hold "
                f"e={e}: align the pairs with align_for(ids, e, config) for these weights"
            )
        sp = rows.sorted_pairs
        return _Rows(
            False, rows.num_blocks, sp, rows.block_expert, rows.block_start, rows.block_rows,
            sp, rows.num_pairs, 0, rows.top_k, blocks_used=rows.blocks_used,
            tile_counters=rows.tile_counters, num_padded=rows.num_padded,
        )  # fmt: skip
    slabs = None
    if isinstance(rows, SlabBlocks):
        slabs, rows = rows, rows.counts
    if rows.shape != (e,) or rows.dtype != torch.int32:
        raise ValueError(f"counts must be int32 [e={e}], got {rows.dtype} {tuple(rows.shape)}")
    if row_index is None:
        if x.dim() != 3 or x.shape[0] < e:
            raise ValueError(
                f"ExpertBatched rows must be [e={e}, C, columns] (a slab for each expert of "
                f"the weights), got {list(x.shape)}"
            )
        r = _Rows(True, 0, rows, rows, rows, rows, rows, 0, x.shape[1], 1, slabs=slabs)
    else:
        C = _check_row_index(row_index, e, x, "row_index", "x")
        r = _Rows(True, 0, row_index.contiguous(), rows, rows, rows, rows, 0, C, 1, True, slabs=slabs)  # fmt: skip
    if slabs is not None and (slabs.capacity, slabs.block_m) != (r.capacity, config.block_m):
        raise ValueError(
            f"slab blocks built for C={slabs.capacity}, block_m={slabs.block_m}; these slabs "
            f"have C={r.capacity} and the config block_m={config.block_m} (slab_blocks(counts, "
            "C, config.block_m))"
        )
    return r


def _check_row_index(
    row_index: torch.Tensor, e: int, x: torch.Tensor, name: str, x_name: str
) -> int:
    """Checks a row index ``[e, C]`` int32 and the received rows ``x [R, H]`` it indexes
    (errors name the caller's arguments); returns ``C``."""
    if row_index.dim() != 2 or row_index.shape[0] != e:
        raise ValueError(f"{name} must be [e={e}, C], got {tuple(row_index.shape)}")
    if row_index.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {row_index.dtype}")
    if x.dim() != 2:
        raise ValueError(
            f"with {name}, {x_name} must be the received rows [R, H], got {tuple(x.shape)}"
        )
    return row_index.shape[1]


# ExpertBatched GEMMs: how many row programs per expert (S) the fixed grid holds. A decode
# slab has C = W·M rows of capacity per expert but a few valid ones; one program per
# BLOCK_M rows of capacity launched mostly programs with nothing to do (at the DeepSeek-V3
# decode shape, 65536 + 458752 programs for C = 512: 2804 against 2669 µs bf16, 1729
# against 1453 µs FP8 on H200). Each program instead loops over its expert's row blocks
# j, j + S, ... up to the valid rows.
BATCHED_PROGRAMS_PER_SM = 4  # S at least fills this many programs per SM ...
BATCHED_MAX_SERIAL = 8  # ... and no program runs more than this many row blocks


def batched_m_splits(
    capacity: int, block_m: int, num_experts: int, num_n_blocks: int, num_sms: int
) -> int:
    """Row programs per expert (S) of an ExpertBatched GEMM of ``num_n_blocks`` column
    blocks: enough programs to fill the GPU, and at most ``BATCHED_MAX_SERIAL`` row blocks
    per program when one expert's slab is full (all rows to one expert), never more than
    the ``ceil(capacity / block_m)`` blocks there are. Chosen from the shape alone, so the
    grid is the same on every call (CUDA-graph safe)."""
    blocks = _cdiv(capacity, block_m)
    fill = _cdiv(BATCHED_PROGRAMS_PER_SM * num_sms, max(1, num_experts * num_n_blocks))
    return max(1, min(blocks, max(fill, _cdiv(blocks, BATCHED_MAX_SERIAL))))


@functools.cache
def _grid_sms(device: torch.device) -> int:
    """The SMs a grid fills on ``device`` (per device: read once); 4 under the interpreter."""
    return num_sms(device) or 4


def _launch_rows(
    r: _Rows, block_m: int, e: int, num_n_blocks: int, device, m_splits: int | None
) -> tuple[int, int]:
    """``(num_m_blocks, m_splits)`` for a GEMM's grid: Standard's row blocks (S unused),
    or ``e · S`` row programs (``m_splits``, default ``batched_m_splits``)."""
    if not r.batched:
        return r.num_m_blocks, 1
    if m_splits is None:
        m_splits = batched_m_splits(r.capacity, block_m, e, num_n_blocks, _grid_sms(device))
    elif type(m_splits) is not int or m_splits < 1:
        raise ValueError(
            f"m_splits must be a positive int (row programs per expert), got {m_splits!r}"
        )
    return e * m_splits, m_splits


def _check_operands(
    a: torch.Tensor,
    w: torch.Tensor,
    a_scale: torch.Tensor | None,
    w_scale: torch.Tensor | None,
    names: tuple[str, str],
) -> bool:
    """Both GEMM operands in one dtype, the activations' columns the weights' K (their
    last dimension; ``names``: the activations' and the weights' argument names, for the
    error), the activations' scales one per 128 columns, scales exactly in FP8 mode;
    returns FP8 mode."""
    fp8 = w.dtype == FP8_DTYPE
    if w.dtype not in (*COMPUTE_DTYPES, FP8_DTYPE):
        raise TypeError(
            f"{names[1]} must be one of {[*COMPUTE_DTYPES, FP8_DTYPE]}, got {w.dtype} (other "
            "FP8 formats are not kernels' operands: convert to float8_e4m3fn with scales)"
        )
    if a.dtype != w.dtype:
        raise TypeError(f"activations are {a.dtype} but the weights {w.dtype}; they must match")
    for scale, name in ((a_scale, f"{names[0]}'s scales"), (w_scale, f"{names[1]}'s scales")):
        if scale is not None and scale.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {scale.dtype}")
    if w.shape[1] * abs(w.stride(1)) >= 2**31:
        # the kernels index a weight's rows with int32 products (row · stride): an expert's
        # rows must span less than 2**31 elements (contiguous experts always do)
        raise ValueError(
            f"{names[1]} {list(w.shape)} with strides {list(w.stride())}: one expert's rows span "
            f"2**31 elements or more; pass it contiguous (e.g. {names[1]}.contiguous())"
        )
    K = w.shape[-1]
    if a.shape[-1] != K:
        raise ValueError(
            f"{names[0]} has {a.shape[-1]} columns, but {names[1]} {list(w.shape)} takes {K}"
        )
    if fp8 and (a_scale is None or w_scale is None):
        raise ValueError("FP8 operands need both the activation and the weight scales")
    if a_scale is not None and (
        a_scale.shape[-1] != _cdiv(K, FP8_GROUP) or a_scale.shape[:-1] != a.shape[:-1]
    ):
        raise ValueError(
            f"the scales of {names[0]} {list(a.shape)} must be {[*a.shape[:-1], _cdiv(K, FP8_GROUP)]}"
            f" (one per {FP8_GROUP} columns), got {list(a_scale.shape)}"
        )
    return fp8


def _tile_in_block(block_n: int, row_offset: int) -> bool:
    """Whether every ``block_n``-row weight tile starting at ``row_offset + j·block_n`` lies in
    one 128-row scale block (then the kernels use one weight scale per K step and tile)."""
    return block_n <= FP8_GROUP and row_offset % block_n == 0


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit types


def gate_up(
    x: torch.Tensor,
    w13: torch.Tensor,
    rows: AlignedPairs | SlabBlocks | torch.Tensor,
    config: MoEConfig,
    activation: str = "silu",
    x_scale: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    m_splits: int | None = None,
    row_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GEMM 1 with the activation fused: ``act(x @ gate.T) · (x @ up.T)`` per expert.

    ``x`` is ``[R, H]`` with ``rows`` an ``AlignedPairs`` (Standard), or ``[e, C, H]`` with
    ``rows`` the ``counts [e]`` int32 (ExpertBatched) — or ``slab_blocks(counts, C,
    config.block_m)``, the persistent Hopper kernel's block table built once for both GEMMs
    (else each builds it). ``w13 [e, 2I, H]``. In FP8 mode
    (``w13`` is ``float8_e4m3fn``) ``x`` is FP8 with ``x_scale [..., ceil(H/128)]`` and
    ``w13_scale`` is given. Returns ``(y, y_scale)``: ``y`` is ``[B·block_m, I]`` by padded
    position (Standard) or ``[e, C, I]``, in ``x``'s dtype, or FP8 with ``y_scale [...,
    ceil(I/128)]`` float32 (otherwise ``None``; on ``kernel="wgmma_ws"`` a view of
    group-major memory, the layout ``down`` reads fastest there). Rows that hold no pair
    are unspecified.
    ``m_splits``: ExpertBatched row programs per expert (default ``batched_m_splits``).
    ``row_index [e, C]`` int32 (ExpertBatched): ``x`` is ``[R, H]`` and row ``c`` of expert
    ``i`` is ``x[row_index[i, c]]`` (rows read where they landed; ``y`` is ``[e, C, I]``).
    """
    _check_activation(activation)
    fp8 = _check_operands(x, w13, x_scale, w13_scale, ("x", "w13"))
    check_config(config, fp8)
    e, two_i, H = w13.shape
    N = two_i // 2
    cfg = config.gate_up
    r = _rows(rows, config, e, x, row_index)
    if isinstance(rows, AlignedPairs) and x.shape[0] != rows.num_rows:
        raise ValueError(
            f"x must hold the R={rows.num_rows} rows the pairs were aligned for, got "
            f"{list(x.shape)}"
        )
    if config.kernel in WGMMA_KERNELS:
        return _gate_up_wgmma(x, w13, r, config, activation, x_scale, w13_scale, fp8)
    y_shape = (e, r.capacity, N) if r.batched else (r.sorted_pairs.shape[0], N)
    # FP8: tiles one quantization group wide quantize in their epilogue; other widths store
    # fp32 (what the epilogue quantizes) and are quantized below, one more pass over every
    # row of y (Standard: all B·block_m positions; padding rows are never read by down()).
    fused_quant = fp8 and cfg.block_n == FP8_GROUP
    y_dtype = FP8_DTYPE if fused_quant else (torch.float32 if fp8 else x.dtype)
    y = torch.empty(y_shape, dtype=y_dtype, device=x.device)
    y_scale = None
    if fused_quant:
        y_scale = torch.empty(
            (*y_shape[:-1], _cdiv(N, FP8_GROUP)), dtype=torch.float32, device=x.device
        )
    w_block, ws_strides = _weight_scale_strides(w13_scale, w13, "w13_scale")
    n_blocks = _cdiv(N, cfg.block_n)
    m_blocks, m_splits = _launch_rows(r, config.block_m, e, n_blocks, x.device, m_splits)
    grid = (m_blocks * n_blocks,)
    if grid[0] > 0:
        grouped_gemm.gate_up_kernel[grid](
            x,
            x_scale if x_scale is not None else x,
            w13,
            w13_scale if w13_scale is not None else w13,
            y,
            y_scale if y_scale is not None else y,
            r.sorted_pairs,
            r.block_expert,
            r.block_start,
            r.block_rows,
            r.counts,
            N,
            H,
            r.num_pairs,
            r.capacity,
            m_blocks,
            m_splits,
            *_row_strides(x, r.batched and not r.gather),
            *_row_strides(x_scale, r.batched and not r.gather),
            w13.stride(0),
            w13.stride(1),
            w13.stride(2),
            *ws_strides,
            *_row_strides(y, r.batched),
            *_row_strides(y_scale, r.batched),
            TOP_K=r.top_k,
            BATCHED=r.batched,
            GATHER=r.gather,
            ACTIVATION=activation,
            FP8=fp8,
            W_BLOCK_SCALE=w_block,
            W_SCALE_PER_TILE=fp8 and w_block and _tile_in_block(cfg.block_n, N),
            GROUP=FP8_GROUP,
            FP8_MAX=FP8_MAX,
            INV_FP8_MAX=INV_FP8_MAX,
            DOT_PRECISION=_dot_precision(x.dtype),
            EVEN_K=H % cfg.block_k == 0,
            HALF_TAIL=config.half_tail,
            BLOCK_M=config.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            GROUP_M=cfg.group_m,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    if fp8 and not fused_quant:
        y, y_scale = per_token_group_quant_fp8(y, counts=r.counts if r.batched else None)
    return y, y_scale


def down(
    h: torch.Tensor,
    w2: torch.Tensor,
    rows: AlignedPairs | SlabBlocks | torch.Tensor,
    config: MoEConfig,
    out_dtype: torch.dtype,
    h_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    topk_weights_RK: torch.Tensor | None = None,
    m_splits: int | None = None,
) -> torch.Tensor:
    """GEMM 2: ``h @ w2[expert].T`` per row, from ``gate_up``'s output.

    ``h`` and ``rows`` as returned by / given to ``gate_up``; ``w2 [e, H, I]``. Standard:
    returns ``[B·block_m, H]`` by padded position, each row scaled by its router weight
    (``topk_weights_RK [R, K]`` float32, required), or with ``config.atomic_reduce`` the
    layer's output ``[R, H]``: each row the sum of its pairs' weighted rows (zero without a
    local pair; ``sum_topk`` is then not needed). ExpertBatched: ``[e, C, H]`` unweighted.
    Positions or slab rows that hold no pair are unspecified. ``m_splits`` as for
    ``gate_up``.
    """
    fp8 = _check_operands(h, w2, h_scale, w2_scale, ("h", "w2"))
    check_config(config, fp8)
    e, H, I = w2.shape
    cfg = config.down
    r = _rows(rows, config, e, h)
    if isinstance(rows, AlignedPairs) and h.shape[0] < rows.sorted_pairs.shape[0]:
        raise ValueError(
            f"h must be gate_up's rows by padded position [P_pad={rows.sorted_pairs.shape[0]}, "
            f"I], got {list(h.shape)}"
        )
    if out_dtype not in COMPUTE_DTYPES:
        raise TypeError(f"out_dtype must be one of {list(COMPUTE_DTYPES)}, got {out_dtype}")
    weights = None
    if r.batched:
        out = torch.empty((e, r.capacity, H), dtype=out_dtype, device=h.device)
    else:
        if topk_weights_RK is None:
            raise ValueError("the Standard layout needs topk_weights_RK for down()")
        if topk_weights_RK.numel() != r.num_pairs:
            raise ValueError(
                f"topk_weights_RK must be [R, K] = [{rows.num_rows}, {r.top_k}] (one weight per "
                f"pair of rows), got {list(topk_weights_RK.shape)}"
            )
        if config.atomic_reduce:  # the adds start from zero rows (Standard: AlignedPairs)
            out = torch.zeros((rows.num_rows, H), dtype=out_dtype, device=h.device)
        else:
            out = torch.empty((h.shape[0], H), dtype=out_dtype, device=h.device)
        weights = topk_weights_RK.reshape(-1).to(torch.float32)
    if config.kernel in WGMMA_KERNELS:
        _down_wgmma(h, w2, r, config, h_scale, w2_scale, fp8, weights, out)
        return out
    w_block, ws_strides = _weight_scale_strides(w2_scale, w2, "w2_scale")
    n_blocks = _cdiv(H, cfg.block_n)
    m_blocks, m_splits = _launch_rows(r, config.block_m, e, n_blocks, h.device, m_splits)
    grid = (m_blocks * n_blocks,)
    if grid[0] == 0:
        return out
    grouped_gemm.down_kernel[grid](
        h,
        h_scale if h_scale is not None else h,
        w2,
        w2_scale if w2_scale is not None else w2,
        out,
        weights if weights is not None else out,
        r.sorted_pairs,
        r.block_expert,
        r.block_start,
        r.block_rows,
        r.counts,
        H,
        I,
        r.num_pairs,
        r.capacity,
        m_blocks,
        m_splits,
        *_row_strides(h, r.batched),
        *_row_strides(h_scale, r.batched),
        w2.stride(0),
        w2.stride(1),
        w2.stride(2),
        *ws_strides,
        *_row_strides(out, r.batched),
        BATCHED=r.batched,
        SUM_TOP_K=r.top_k if config.atomic_reduce and not r.batched else 0,
        FP8=fp8,
        W_BLOCK_SCALE=w_block,
        W_SCALE_PER_TILE=fp8 and w_block and _tile_in_block(cfg.block_n, 0),
        GROUP=FP8_GROUP,
        DOT_PRECISION=_dot_precision(h.dtype),
        EVEN_K=I % cfg.block_k == 0,
        HALF_TAIL=config.half_tail,
        BLOCK_M=config.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


# ---------------------------------------------------------------------------------------
# The Hopper (sm_90) Gluon kernels (configs with kernel="wgmma" / "wgmma_ws"): the Standard
# layout, and ExpertBatched on "wgmma_ws"


def wgmma_unsupported(
    config: MoEConfig, a: torch.Tensor, w: torch.Tensor, n_cols: int, tile_n: int, batched: bool
) -> str | None:
    """Why ``config``'s ``wgmma`` kernels cannot run this GEMM (``a [rows, K]``, or
    ExpertBatched slabs ``[e, C, K]``, against ``w [e, N_w, K]``, ``n_cols`` output columns
    in tiles of ``tile_n``), or None."""
    if batched and config.kernel != "wgmma_ws":
        return (
            f"kernel={config.kernel!r} runs the Standard layout only (ExpertBatched runs on "
            "kernel='wgmma_ws' or 'dot')"
        )
    if interpreted():
        return "the Triton interpreter does not run Gluon kernels"
    if a.device.type != "cuda":
        return f"they need an sm_90 GPU (H100/H200), got {a.device}"
    unavailable = wgmma_unavailable(a.device.index)
    if unavailable is not None:
        return unavailable
    if a.dtype not in (torch.bfloat16, torch.float16, FP8_DTYPE):
        return f"they take bf16, fp16 or FP8 operands, got {a.dtype}"
    K = a.shape[-1]
    block_k = config.gate_up.block_k
    if block_k * a.element_size() != 128 or config.down.block_k * a.element_size() != 128:
        return f"block_k must be {128 // a.element_size()} for {a.dtype} (128-byte rows)"
    if n_cols % tile_n or K % block_k:
        return (
            f"the output columns ({n_cols}) must be a multiple of {tile_n} and K ({K}) of {block_k}"
        )
    if w.shape[-1] != K:
        return f"the activations have K = {K} columns but the weights {w.shape[-1]}"
    if not _copyable(a):
        return _NOT_COPYABLE.format("activations")
    if a.dim() == 3 and not _experts_stacked(a):
        return (
            f"the ExpertBatched slabs must be one [e·C, K] matrix (strides {tuple(a.stride())}); "
            "pass them .contiguous()"
        )
    return _weights_unsupported(config, w)


_NOT_COPYABLE = (
    "the {} need unit stride along K, row strides that are multiples of 16 elements and "
    "16-byte alignment"
)


def _weights_unsupported(config: MoEConfig, w: torch.Tensor) -> str | None:
    """Why ``config``'s Hopper kernels cannot read ``w [e, N_w, K]``, or None."""
    if not _copyable(w):
        return _NOT_COPYABLE.format("weights")
    if config.kernel == "wgmma_ws" and not _experts_stacked(w):
        return (
            "kernel='wgmma_ws' loads the weights with TMA over [e·N_w, K]: each expert's "
            f"rows must follow the last one's (strides {tuple(w.stride())}); pass "
            "w.contiguous() once at load time"
        )
    return None


def _experts_stacked(w: torch.Tensor) -> bool:
    """``w [e, N_w, K]`` is one ``[e·N_w, K]`` matrix (a view, for a TMA descriptor)."""
    return w.shape[0] <= 1 or w.stride(0) == w.shape[1] * w.stride(1)


def _copyable(t: torch.Tensor) -> bool:
    """Rows the Hopper kernels can copy 16 bytes at a time (Triton proves that from strides
    that are multiples of 16 elements and 16-byte aligned pointers)."""
    return (
        t.stride(-1) == 1 and not any(st % 16 for st in t.stride()[:-1]) and t.data_ptr() % 16 == 0
    )


def _hopper_fits(
    config: MoEConfig, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, batched: bool = False
) -> bool:
    """Whether a *selected* config (table, autotuner: chosen by shape) runs these operands;
    a Hopper config that does not (strides, alignment) gives way to the shape heuristics.
    (GEMM 2 reads GEMM 1's output, which ``gate_up`` allocates: only ``w2`` is checked.)"""
    if config.kernel not in WGMMA_KERNELS:
        return True
    if wgmma_unsupported(config, x, w13, w13.shape[1] // 2, config.gate_up.block_n, batched):
        return False
    return w2.shape[1] % config.down.block_n == 0 and _weights_unsupported(config, w2) is None


def _wgmma_module():
    from epmoe.kernels import wgmma  # Gluon: imported on first use (sm_90 only)

    return wgmma


def _ws_programs(tiles: int, device: torch.device) -> int:
    """Programs of the warp-specialised kernel, which claim tiles from a counter until none
    are left: one per SM (its shared memory holds one program per SM), at most one per
    tile (of the worst case)."""
    return min(tiles, num_sms(device) or tiles)


def _launch_wgmma(
    gate_up: bool,
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    out: torch.Tensor,
    out_scale: torch.Tensor | None,
    topk_weights: torch.Tensor | None,
    r: _Rows,
    config: MoEConfig,
    n_cols: int,
    activation: str,
    fp8: bool,
) -> None:
    cfg = config.gate_up if gate_up else config.down
    block_n = cfg.block_n if gate_up else cfg.block_n // 2
    reason = wgmma_unsupported(config, a, w, n_cols, cfg.block_n, r.batched)
    if reason is not None:
        raise ValueError(
            f"config {config.short()} (kernel={config.kernel!r}) cannot run here: {reason}"
        )
    w_block, ws_strides = _weight_scale_strides(w_scale, w, "w_scale")
    if fp8 and w_block and ws_strides[2] != 1:
        raise ValueError(
            f"kernel={config.kernel!r} needs weight scales with unit stride along K; "
            "pass w_scale.contiguous()"
        )
    rows_mode, num_m_blocks = "pairs", r.num_m_blocks
    blocks = (r.block_expert, r.block_start, r.block_rows, r.blocks_used)
    # 192-row tiles: rows in position order (GEMM 2, slabs) come by TMA, gathered ones
    # (GEMM 1 of the Standard layout, or through a row index) by cp.async
    a_tma = config.kernel == "wgmma_ws" and config.block_m == 192
    if gate_up and (r.gather or not r.batched):
        a_tma = False
    # FP8 GEMM 1 of the Standard layout on wgmma_ws: the gathered rows' scales laid out by
    # position, group-major, first (a warpgroup then reads a K step's scales of its 64 rows
    # as 256 contiguous bytes, not as 64 scattered sectors)
    scales_by_pos = fp8 and gate_up and config.kernel == "wgmma_ws" and not r.batched
    if scales_by_pos:
        a_scale = _sort_scales(a_scale, r.sorted_pairs, r.num_padded, r.num_pairs, r.top_k).T
    # the persistent kernel's tile counter: zero at launch, and zero again after it
    counter = None
    if r.batched:  # slabs [e, C, ·] as [e·C, ·] matrices, cut into blocks on the device
        table = (
            r.slabs if r.slabs is not None else slab_blocks(r.counts, r.capacity, config.block_m)
        )
        blocks, num_m_blocks, counter = table[:4], table.num_blocks, table.tile_counter
        rows_mode = "index" if r.gather else "slab"
        a, out = a.reshape(-1, a.shape[-1]), out.view(-1, out.shape[-1])
        if a_scale is not None:
            a_scale = a_scale.reshape(-1, a_scale.shape[-1])
        if out_scale is not None:
            out_scale = out_scale.view(-1, out_scale.shape[-1])
    elif r.tile_counters is not None:
        counter = r.tile_counters[0:1] if gate_up else r.tile_counters[1:2]
    grid = (num_m_blocks * (n_cols // cfg.block_n),)
    if grid[0] == 0:
        return
    args = (
        a,
        a_scale if a_scale is not None else a,
        w,
        w_scale if w_scale is not None else w,
        out,
        out_scale if out_scale is not None else out,
        topk_weights if topk_weights is not None else out,
        r.sorted_pairs,  # ("index": the row index [e, C]; "slab": unused)
        *blocks[:3],
        n_cols,
        a.shape[-1],
        r.num_pairs,
        num_m_blocks,
        a.stride(0),
        a_scale.stride(0) if a_scale is not None else 0,
        a_scale.stride(1) if a_scale is not None else 0,
        w.stride(0),
        w.stride(1),
        ws_strides[0],
        ws_strides[1],
        out.stride(0),
        out_scale.stride(0) if out_scale is not None else 0,
        out_scale.stride(1) if out_scale is not None else 0,
    )
    kernels = _wgmma_module()
    sum_rows = not gate_up and not r.batched and config.atomic_reduce
    meta = dict(
        GATE_UP=gate_up,
        TOP_K=r.top_k if gate_up or sum_rows else 1,
        ACTIVATION=activation,
        FP8=fp8,
        W_BLOCK_SCALE=w_block,
        FP8_MAX=FP8_MAX,
        INV_FP8_MAX=INV_FP8_MAX,
        BLOCK_M=config.block_m,
        BLOCK_N=block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        STAGES=cfg.num_stages,
        SUM_ROWS=sum_rows,
    )
    if config.kernel == "wgmma_ws":  # (a warpgroup past a short block's rows idles by itself)
        w_desc = kernels.weight_descriptor(w, block_n, cfg.block_k)
        a_desc = kernels.rows_descriptor(a, 64, cfg.block_k) if a_tma else w_desc
        if counter is None:  # (AlignedPairs built by hand carry none)
            counter = torch.zeros(1, dtype=torch.int32, device=a.device)
        # registers per thread: 64K per SM over the MMA warpgroups and the loader's 4 warps
        # (ptxas: no spills with triton 3.6 or 3.9; three warpgroups need >= 160 each)
        load_regs, mma_regs = (32, 160) if config.block_m == 192 else (64, 224)
        kernels.pair_gemm_ws_kernel[(_ws_programs(grid[0], a.device),)](
            args[0],
            a_desc,
            args[1],
            w_desc,
            *args[3:],
            blocks_used_ptr=blocks[3],
            tile_counter_ptr=counter,
            **meta,
            ROWS=rows_mode,
            A_TMA=a_tma,
            SCALES_BY_POS=scales_by_pos,
            LOAD_WARPS=4,
            LOAD_REGS=load_regs,
            MMA_REGS=mma_regs,
            num_warps=4,  # one MMA warpgroup here; the others and the loader in partitions
        )
    else:
        kernels.pair_gemm_kernel[grid](
            *args, **meta, HALF_TAIL=config.half_tail, num_warps=cfg.num_warps
        )


def _gate_up_wgmma(
    x: torch.Tensor,
    w13: torch.Tensor,
    r: _Rows,
    config: MoEConfig,
    activation: str,
    x_scale: torch.Tensor | None,
    w13_scale: torch.Tensor | None,
    fp8: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``gate_up`` on the Hopper kernels: ``y [P_pad, I]`` or ``[e, C, I]`` (ExpertBatched),
    FP8 with its group scales."""
    N = w13.shape[1] // 2
    rows = (w13.shape[0], r.capacity) if r.batched else (r.sorted_pairs.shape[0],)
    y = torch.empty((*rows, N), dtype=x.dtype, device=x.device)
    y_scale = None
    if fp8:
        groups = _cdiv(N, FP8_GROUP)
        if config.kernel == "wgmma_ws":
            # group-major ([..., G] viewed over [G, ...]): GEMM 2's warpgroups read a K
            # step's scales of 64 consecutive positions as 256 contiguous bytes
            t = torch.empty((groups, *rows), dtype=torch.float32, device=x.device)
            y_scale = t.permute(*range(1, t.dim()), 0)
        else:
            y_scale = torch.empty((*rows, groups), dtype=torch.float32, device=x.device)
    _launch_wgmma(True, x, x_scale, w13, w13_scale, y, y_scale, None, r, config, N, activation, fp8)
    return y, y_scale


def _down_wgmma(
    h: torch.Tensor,
    w2: torch.Tensor,
    r: _Rows,
    config: MoEConfig,
    h_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    fp8: bool,
    weights: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """``down`` on the Hopper kernels, into ``out [P_pad, H]`` (router-weighted rows) or
    ``[e, C, H]`` (ExpertBatched, unweighted)."""
    _launch_wgmma(
        False, h, h_scale, w2, w2_scale, out, None, weights, r, config, w2.shape[1], "silu", fp8
    )


def sum_topk(y_pos: torch.Tensor, aligned: AlignedPairs, out_dtype: torch.dtype) -> torch.Tensor:
    """``out[r] = Σ_k y_pos[pair_pos[r·K + k]]`` over local pairs (fp32 sums): ``[R, H]``."""
    R, K = aligned.num_rows, aligned.top_k
    if y_pos.dim() != 2 or y_pos.shape[0] < aligned.sorted_pairs.shape[0]:
        raise ValueError(
            f"sum_topk needs down()'s rows by padded position [P_pad={aligned.sorted_pairs.shape[0]}"
            f", H], got {tuple(y_pos.shape)}; a config with atomic_reduce sums them in down() "
            "already (its output is the layer's [R, H])"
        )
    H = y_pos.shape[1]
    if y_pos.stride(1) != 1:  # (the kernel reads each row's columns one after another)
        y_pos = y_pos.contiguous()
    out = torch.empty((R, H), dtype=out_dtype, device=y_pos.device)
    if R == 0 or H == 0:
        return out
    block_k = _pow2(K)
    block_h = max(16, min(_pow2(H), 8192 // block_k))
    reduce.sum_topk_kernel[(R, _cdiv(H, block_h))](
        y_pos,
        aligned.pair_pos,
        out,
        H,
        y_pos.stride(0),
        out.stride(0),
        TOP_K=K,
        BLOCK_K=block_k,
        BLOCK_H=block_h,
        num_warps=4,
    )
    return out


# ---------------------------------------------------------------------------------------
# Whole layers


def _check_weights(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
) -> tuple[int, int, int]:
    """Validate the weights; returns ``(e, H, I)``."""
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[1] % 2:
        raise ValueError(
            f"w13 must be [e, 2I, H] and w2 [e, H, I], got {tuple(w13.shape)} and {tuple(w2.shape)}"
        )
    e, two_i, H = w13.shape
    I = two_i // 2
    if tuple(w2.shape) != (e, H, I):
        raise ValueError(f"w2 must be [e={e}, H={H}, I={I}] to match w13, got {tuple(w2.shape)}")
    if w13.dtype != w2.dtype or w13.dtype not in (*COMPUTE_DTYPES, FP8_DTYPE):
        raise TypeError(
            f"w13 and w2 must share one dtype of bf16, fp16, fp32 or float8_e4m3fn, got "
            f"{w13.dtype} and {w2.dtype}"
        )
    if w13.dtype == FP8_DTYPE:
        if w13_scale is None or w2_scale is None:
            raise ValueError("FP8 weights need w13_scale and w2_scale (block or per-expert)")
        _weight_scale_strides(w13_scale, w13, "w13_scale")
        _weight_scale_strides(w2_scale, w2, "w2_scale")
    elif w13_scale is not None or w2_scale is not None:
        raise ValueError(f"weight scales are only for float8_e4m3fn weights, got {w13.dtype}")
    return e, H, I


def _prepare_hidden(
    hidden: torch.Tensor,
    hidden_scale: torch.Tensor | None,
    weight_dtype: torch.dtype,
    counts: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Bring the activations to the weights' format: quantize (FP8 weights), dequantize
    (FP8 activations, 16/32-bit weights; a slow path in torch) or pass through."""
    H = hidden.shape[-1]
    if hidden.dtype == FP8_DTYPE:
        groups = _cdiv(H, FP8_GROUP)
        if hidden_scale is None or tuple(hidden_scale.shape) != (*hidden.shape[:-1], groups):
            raise ValueError(
                f"FP8 hidden states {tuple(hidden.shape)} need hidden_scale of shape "
                f"{(*hidden.shape[:-1], groups)} (float32 per 128-column group), got "
                f"{None if hidden_scale is None else tuple(hidden_scale.shape)}"
            )
        if weight_dtype == FP8_DTYPE:
            return hidden, hidden_scale.to(torch.float32)
        full = hidden_scale.to(torch.float32).repeat_interleave(FP8_GROUP, dim=-1)[..., :H]
        return (hidden.to(torch.float32) * full).to(weight_dtype), None
    if hidden.dtype not in COMPUTE_DTYPES:
        raise TypeError(f"hidden states must be bf16, fp16, fp32 or FP8, got {hidden.dtype}")
    if hidden_scale is not None:
        raise ValueError("hidden_scale is only for float8_e4m3fn hidden states")
    if weight_dtype == FP8_DTYPE:
        return per_token_group_quant_fp8(hidden, counts=counts)
    if hidden.dtype != weight_dtype:
        raise TypeError(
            f"hidden states are {hidden.dtype} but the weights are {weight_dtype}; cast one "
            "of them (both GEMM operands share a dtype)"
        )
    return hidden, None


def _out_dtype(hidden: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    if out_dtype is None:
        out_dtype = torch.bfloat16 if hidden.dtype == FP8_DTYPE else hidden.dtype
    if out_dtype not in COMPUTE_DTYPES:
        raise TypeError(f"out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    return out_dtype


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def standard_with_config(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    topk_ids_RK: torch.Tensor,
    topk_weights_RK: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    activation: str,
    out_dtype: torch.dtype,
    config: MoEConfig,
) -> torch.Tensor:
    """The Standard pipeline on prepared inputs (no checks): align, GEMM 1, GEMM 2, sum
    (in GEMM 2 with ``config.atomic_reduce``)."""
    aligned = align_for(topk_ids_RK, w13.shape[0], config)
    y, y_scale = gate_up(x, w13, aligned, config, activation, x_scale, w13_scale)
    z = down(y, w2, aligned, config, out_dtype, y_scale, w2_scale, topk_weights_RK)
    return z if config.atomic_reduce else sum_topk(z, aligned, out_dtype)


def batched_with_config(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    counts_e: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    activation: str,
    out_dtype: torch.dtype,
    config: MoEConfig,
    m_splits: int | None = None,
    row_index_eC: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ExpertBatched pipeline on prepared inputs (no checks): GEMM 1, GEMM 2.
    ``m_splits`` fixes the row programs per expert (default ``batched_m_splits``);
    ``row_index_eC``: ``x`` is ``[R, H]`` rows read in place (see ``gate_up``)."""
    rows: SlabBlocks | torch.Tensor = counts_e
    if config.kernel == "wgmma_ws":  # one block table for both GEMMs
        C = x.shape[1] if row_index_eC is None else row_index_eC.shape[1]
        rows = slab_blocks(counts_e, C, config.block_m)
    y, y_scale = gate_up(
        x, w13, rows, config, activation, x_scale, w13_scale, m_splits, row_index_eC
    )
    return down(y, w2, rows, config, out_dtype, y_scale, w2_scale, m_splits=m_splits)


def fused_moe_standard(
    hidden_RH: torch.Tensor,
    topk_ids_RK: torch.Tensor,
    topk_weights_RK: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    activation: str = "silu",
    hidden_scale: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: MoEConfig | None = None,
    autotune: bool | None = None,
) -> torch.Tensor:
    """Expert MLPs of the Standard layout: ``[R, H]`` → ``[R, H]``.

    ``out[r] = Σ_k topk_weights_RK[r, k] · expert_{topk_ids_RK[r, k]}(hidden_RH[r])`` over
    the ``k`` whose id lies in ``[0, e)`` (``-1``: an expert on another rank); rows with no
    local id are zero. ``hidden_RH`` is bf16/fp16/fp32 like the weights, or FP8 with
    ``hidden_scale [R, ceil(H/128)]``; ``topk_ids_RK [R, K]`` int32/int64;
    ``topk_weights_RK [R, K]`` float32; ``w13 [e, 2I, H]``, ``w2 [e, H, I]`` (FP8 with
    scales, see ``ExpertWeights``). ``out_dtype`` defaults to the hidden dtype (bf16 for
    FP8 input). ``config`` fixes the tiling (else ``configs.select_config``).
    """
    _check_activation(activation)
    e, H, I = _check_weights(w13, w2, w13_scale, w2_scale)
    if hidden_RH.dim() != 2 or hidden_RH.shape[1] != H:
        raise ValueError(f"hidden_RH must be [R, H={H}], got {tuple(hidden_RH.shape)}")
    R = hidden_RH.shape[0]
    if topk_ids_RK.dim() != 2 or topk_ids_RK.shape[0] != R:
        raise ValueError(f"topk_ids_RK must be [R={R}, K], got {tuple(topk_ids_RK.shape)}")
    if topk_ids_RK.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids_RK must be int32 or int64, got {topk_ids_RK.dtype}")
    if tuple(topk_weights_RK.shape) != tuple(topk_ids_RK.shape):
        raise ValueError(
            f"topk_weights_RK {tuple(topk_weights_RK.shape)} must match topk_ids_RK "
            f"{tuple(topk_ids_RK.shape)}"
        )
    if not topk_weights_RK.is_floating_point():
        raise TypeError(f"topk_weights_RK must be floating, got {topk_weights_RK.dtype}")
    device = _check_device(
        hidden_RH, topk_ids_RK, topk_weights_RK, w13, w2, hidden_scale, w13_scale, w2_scale
    )
    out_dtype = _out_dtype(hidden_RH, out_dtype)
    K = topk_ids_RK.shape[1]
    if R == 0 or K == 0:
        return torch.zeros((R, H), dtype=out_dtype, device=device)
    x, x_scale = _prepare_hidden(hidden_RH, hidden_scale, w13.dtype, None)
    weights = topk_weights_RK.to(torch.float32).contiguous()
    run = functools.partial(
        standard_with_config,
        x, x_scale, topk_ids_RK, weights, w13, w2, w13_scale, w2_scale, activation, out_dtype,
    )  # fmt: skip
    if config is None:
        config = select_config("standard", w13.dtype, R, H, I, e, K, device, run, autotune)
        if not _hopper_fits(config, x, w13, w2):
            config = heuristic_config("standard", dtype_name(w13.dtype), R, H, I, e, K, device.type)
        if config.atomic_reduce and torch.are_deterministic_algorithms_enabled():
            config = dataclasses.replace(config, atomic_reduce=False)  # the fp32 sum pass
    elif config.atomic_reduce and torch.are_deterministic_algorithms_enabled():
        message = (
            "config.atomic_reduce sums each row's pairs with atomics in arrival order, which "
            "torch.use_deterministic_algorithms(True) forbids; pass "
            "dataclasses.replace(config, atomic_reduce=False) (or config=None)"
        )
        if not torch.is_deterministic_algorithms_warn_only_enabled():
            raise RuntimeError(message)
        warnings.warn(message, stacklevel=2)
    check_config(config, w13.dtype == FP8_DTYPE)
    return run(config)


def fused_moe_batched(
    hidden_eCH: torch.Tensor,
    counts_e: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    activation: str = "silu",
    hidden_scale: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: MoEConfig | None = None,
    autotune: bool | None = None,
    row_index_eC: torch.Tensor | None = None,
) -> torch.Tensor:
    """Expert MLPs of the ExpertBatched layout: ``[e, C, H]`` → ``[e, C, H]`` unweighted.

    Row ``c < counts_e[i]`` of slot ``i`` becomes ``expert_i(hidden_eCH[i, c])``; rows past
    the count are not written (unspecified). ``counts_e [e]`` int32 (values above ``C`` count as
    ``C``), read only on the device: no host synchronisation.
    ``hidden_scale [e, C, ceil(H/128)]`` for FP8 input; other arguments as for
    ``fused_moe_standard``.

    ``row_index_eC [e, C]`` int32: the rows are read where they landed. ``hidden_eCH`` is
    then the received rows ``[R, H]`` (``hidden_scale [R, ceil(H/128)]``) and row ``c`` of
    slot ``i`` is ``hidden_eCH[row_index_eC[i, c]]`` (each below ``R``); the output is
    ``[e, C, H]`` as without it.
    """
    _check_activation(activation)
    e, H, I = _check_weights(w13, w2, w13_scale, w2_scale)
    if row_index_eC is None:
        if hidden_eCH.dim() != 3 or hidden_eCH.shape[0] != e or hidden_eCH.shape[2] != H:
            raise ValueError(f"hidden_eCH must be [e={e}, C, H={H}], got {tuple(hidden_eCH.shape)}")
        C = hidden_eCH.shape[1]
    else:
        C = _check_row_index(row_index_eC, e, hidden_eCH, "row_index_eC", "hidden_eCH")
        if hidden_eCH.shape[1] != H:
            raise ValueError(
                f"with row_index_eC, hidden_eCH must be the received rows [R, H={H}], got "
                f"{tuple(hidden_eCH.shape)}"
            )
    if counts_e.shape != (e,) or counts_e.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"counts_e must be an int32 [e={e}] tensor, got {counts_e.dtype} "
            f"{tuple(counts_e.shape)}"
        )
    device = _check_device(
        hidden_eCH, counts_e, w13, w2, hidden_scale, w13_scale, w2_scale, row_index_eC
    )
    out_dtype = _out_dtype(hidden_eCH, out_dtype)
    counts = counts_e.to(torch.int32)
    # (in place, every received row is quantized: which ones hold a token is on the device)
    x, x_scale = _prepare_hidden(
        hidden_eCH, hidden_scale, w13.dtype, counts if row_index_eC is None else None
    )
    run = functools.partial(
        batched_with_config,
        x, x_scale, counts, w13, w2, w13_scale, w2_scale, activation, out_dtype,
        row_index_eC=row_index_eC,
    )  # fmt: skip
    if config is None:
        config = select_config("batched", w13.dtype, C, H, I, e, 1, device, run, autotune)
        if not _hopper_fits(config, x, w13, w2, batched=True):
            config = heuristic_config("batched", dtype_name(w13.dtype), C, H, I, e, 1, device.type)
    check_config(config, w13.dtype == FP8_DTYPE)
    return run(config)
