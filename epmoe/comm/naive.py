"""``naive``: all-gather every token to every rank, reduce-scatter the outputs back.

The simplest correct transport and a second oracle for the others: each rank receives all
``R = Σ_s T_s`` tokens of the group (Standard layout, top-k ids remapped to local slots,
-1 elsewhere) and returns partial sums that a reduce-scatter adds up. It moves W times the
bytes a real all-to-all moves; use it for checking, not for speed.

Split phase: ``dispatch_async`` all-gathers the token counts (the host needs them to size
the buffers: the one host sync) and starts two all-gathers, the rows and their routing;
``wait()`` finishes them and drops the padding. ``combine_async`` starts the
reduce-scatter; ``wait()`` finishes it. Every call allocates its own buffers, so any number
of operations may be in flight, started and finished in the same order on every rank.

FP8 dispatch (``spec.fp8_dispatch``): rows are quantized before the all-gather and travel
as e4m3 values with their float32 scales (see ``fp8_wire_rows``).

Shape legend: T tokens on this rank · T_pad = max_s T_s · H hidden · K top-k · W world ·
R = Σ_s T_s rows received · G = ceil(H / 128) FP8 scale groups · B FP8 wire bytes per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from epmoe.comm.base import (
    AllToAll,
    Capabilities,
    DispatchResult,
    Layout,
    Pending,
    call_tag_error,
    check_combine_args,
    check_dispatch_args,
    ids_error,
    ids_out_of_range,
)
from epmoe.comm.collectives import (
    all_gather_into,
    all_gather_into_async,
    fp8_from_wire,
    fp8_wire_rows,
    reduce_scatter_into_async,
    wait_all,
)


@dataclass(frozen=True)
class NaiveHandle:
    """What ``combine`` needs of a naive dispatch: every rank's token count."""

    tokens_per_rank: tuple[int, ...]  # T_s of every rank s
    padded_tokens: int  # T_pad = max_s T_s: every rank's block in the gathered buffers


class NaiveBackend(AllToAll):
    name = "naive"
    capabilities = Capabilities(
        layouts=frozenset({Layout.STANDARD}),
        dtypes=frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16}),
        device_types=frozenset({"cpu", "cuda"}),
        fp8_dispatch=True,
        max_in_flight=None,  # buffers are allocated per call
    )

    def __init__(self, spec, group, layout=None):
        super().__init__(spec, group, layout)
        self._bind()

    def _bind(self) -> None:
        # physical experts [lo, hi) are this rank's local slots 0 … e-1
        offs = self.spec.rank_offsets
        self._local_lo, self._local_hi = offs[self.rank], offs[self.rank + 1]

    def dispatch_async(self, hidden_TH, topk_ids_TK, topk_weights_TK) -> Pending[DispatchResult]:
        check_dispatch_args(self.spec, hidden_TH, topk_ids_TK, topk_weights_TK, False)
        T, K, W = hidden_TH.shape[0], self.spec.top_k, self.world_size
        dev, P = hidden_TH.device, self.spec.num_physical
        # every rank's (T, ids out of range?, call tag) in one all-gather
        mine_3 = torch.tensor([T, 0, self.call_tag], dtype=torch.int64, device=dev)
        mine_3[1] = ids_out_of_range(topk_ids_TK, P)
        gathered_W3 = torch.empty(W * 3, dtype=torch.int64, device=dev)
        all_gather_into(gathered_W3, mine_3, self.group)
        gathered = gathered_W3.tolist()  # the one host sync
        tokens, bad = tuple(gathered[0::3]), gathered[1::3]
        if (error := call_tag_error(self.name, gathered[2::3])) is not None:
            raise error  # on every rank, before any row moves
        if any(bad):  # every rank raises here, before any row moves
            bad_ranks = [r for r, b in enumerate(bad) if b]
            raise ids_error(self.name, topk_ids_TK, P, bad_ranks, self.rank)
        T_pad = max(tokens)

        # routing as int32 [T, 2K]: physical ids (each receiver maps its own), then the
        # float32 weights' bits
        meta_T2K = torch.cat(
            [topk_ids_TK.to(torch.int32), topk_weights_TK.float().view(torch.int32)], dim=1
        )
        fp8 = self.spec.fp8_dispatch
        rows_T = fp8_wire_rows(hidden_TH) if fp8 else hidden_TH  # [T, H], or uint8 [T, B]
        gathered_rows, rows_work = self._start_gather(rows_T, T_pad)
        gathered_meta, meta_work = self._start_gather(meta_T2K, T_pad)
        keep_R = torch.cat(
            [torch.arange(T_s, device=dev) + s * T_pad for s, T_s in enumerate(tokens)]
        )
        lo, hi, H = self._local_lo, self._local_hi, self.spec.hidden_size

        def finish() -> DispatchResult:
            wait_all(rows_work, meta_work)
            meta_R2K = gathered_meta[keep_R]
            ids_RK = meta_R2K[:, :K].to(torch.int64)
            local_RK = torch.where((ids_RK >= lo) & (ids_RK < hi), ids_RK - lo, -1)
            hidden_R, scale_RG = gathered_rows[keep_R], None
            if fp8:
                hidden_R, scale_RG = fp8_from_wire(hidden_R, H)
            return DispatchResult(
                layout=Layout.STANDARD,
                hidden=hidden_R,
                topk_ids=local_RK,
                topk_weights=meta_R2K[:, K:].contiguous().view(torch.float32),
                counts=None,
                hidden_scale=scale_RG,
                handle=NaiveHandle(tokens, T_pad),
            )

        return Pending(finish)

    def _start_gather(
        self, t_TX: torch.Tensor, T_pad: int
    ) -> tuple[torch.Tensor, dist.Work | None]:
        """Start all-gathering ``t_TX [T, ...]`` padded to ``T_pad`` rows: ``[W·T_pad, ...]``
        (rank s's rows at ``s·T_pad``) once the returned work finishes."""
        padded = t_TX.new_zeros((T_pad, *t_TX.shape[1:]))
        padded[: t_TX.shape[0]] = t_TX
        out = t_TX.new_empty((self.world_size * T_pad, *t_TX.shape[1:]))
        return out, all_gather_into_async(out, padded, self.group)

    def combine_async(self, expert_out, result) -> Pending[torch.Tensor]:
        check_combine_args(expert_out, result)
        h: NaiveHandle = result.handle
        W, T_pad, H = self.world_size, h.padded_tokens, self.spec.hidden_size
        T = h.tokens_per_rank[self.rank]
        # every source's rows back in its padded block; the sum runs in the layer's dtype
        padded = expert_out.new_zeros((W * T_pad, H), dtype=self.spec.dtype)
        start = 0
        for s, T_s in enumerate(h.tokens_per_rank):
            padded[s * T_pad : s * T_pad + T_s] = expert_out[start : start + T_s]
            start += T_s
        out_TH = padded.new_empty((T_pad, H))
        work = reduce_scatter_into_async(out_TH, padded, self.group)

        def finish() -> torch.Tensor:
            wait_all(work)
            return out_TH[:T]

        return Pending(finish)
