"""``all_to_all``: a count exchange, then ``all_to_all_single`` with uneven splits.

Portable (gloo and NCCL) and exact; the host waits for the counts, so it is not graph safe.

* Standard layout: a token goes once to each rank that holds at least one of its experts;
  rows arrive ordered by source rank with their top-k ids remapped to local slots.
* ExpertBatched layout: a token goes once per selected expert; the receiver packs the rows
  of each local expert into ``[e, C, H]``, rows ``[:counts[i]]`` valid. The host knows the
  counts, so ``C`` is the largest count of this dispatch, not the worst case ``M_max · W``.

Split phase: ``dispatch_async`` exchanges the counts (blocking: the host sizes the buffers
from them, the one host sync; ExpertBatched reads a fixed-size header first, flags, tags
and row counts, then its per-expert counts while the rows travel: a rank in another
layer's dispatch is named before any exchange whose size depends on the layer) and starts
the payload all-to-alls; ``wait()`` finishes them
and lays the rows out for the experts. ``combine_async`` starts the return all-to-all;
``wait()`` finishes it and reduces. Every call allocates its own buffers, so any number of
operations may be in flight, started and finished in the same order on every rank.

FP8 dispatch (``spec.fp8_dispatch``): each token is quantized once before sending and its
rows travel as e4m3 values with their float32 scales (see ``fp8_wire_rows``); the result
carries ``hidden_scale`` ``[R, G]`` (Standard) or ``[e, C, G]`` (ExpertBatched).

Shape legend: T tokens · H hidden · K top-k · W world · P physical experts · e local
experts · S rows this rank sends · R rows it receives · C capacity per expert ·
G = ceil(H / 128) FP8 scale groups · B FP8 wire bytes per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    all_to_all,
    all_to_all_async,
    exchange_counts,
    fp8_from_wire,
    fp8_wire_rows,
    wait_all,
)


@dataclass(frozen=True)
class StandardHandle:
    """What a Standard ``combine`` needs: where the rows went and which token each was."""

    token_of_row_S: torch.Tensor  # int64 [S]: which local token each sent row carries
    send_splits: tuple[int, ...]  # [W] rows sent to each rank
    recv_splits: tuple[int, ...]  # [W] rows received from each rank
    num_tokens: int  # T


@dataclass(frozen=True)
class BatchedHandle:
    """What an ExpertBatched ``combine`` needs: the (token, k) pair of each sent row, the
    router weights, and the buffer row of each received row."""

    pair_order_S: torch.Tensor  # int64 [S]: flat (t, k) index of each sent row, in send order
    weights_TK: torch.Tensor  # [T, K] in the hidden dtype: this rank's router weights (a copy)
    recv_slot_R: torch.Tensor  # int64 [R]: row of the [e·C, H] expert buffer each row went to
    send_splits: tuple[int, ...]  # [W]
    recv_splits: tuple[int, ...]  # [W]
    num_tokens: int  # T


def _true_positions(mask_WT: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of the ``count`` True entries of ``mask_WT`` in row-major order,
    like ``mask_WT.nonzero()`` but without a host sync (``count`` is already known)."""
    flat = mask_WT.reshape(-1)
    pos = torch.cumsum(flat, 0) - 1
    dest = torch.where(flat, pos, count)  # False entries go to a dummy slot past the end
    index = torch.empty(count + 1, dtype=torch.int64, device=flat.device)
    index.scatter_(0, dest, torch.arange(flat.numel(), device=flat.device))
    index = index[:count]
    T = mask_WT.shape[1]
    return index // T, index % T


class AllToAllBackend(AllToAll):
    name = "all_to_all"
    capabilities = Capabilities(
        layouts=frozenset({Layout.STANDARD, Layout.EXPERT_BATCHED}),
        dtypes=frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16}),
        device_types=frozenset({"cpu", "cuda"}),
        multi_node=True,
        fp8_dispatch=True,
        max_in_flight=None,  # buffers are allocated per call
    )

    def __init__(self, spec, group, layout=None):
        super().__init__(spec, group, layout)
        self._bind()

    def _bind(self) -> None:
        """Placement-derived state: rank sizes, the owner of each physical expert and the
        first physical id of each rank (physical ids are rank-major)."""
        spec, W = self.spec, self.world_size
        self._rank_sizes_W = [spec.num_local(r) for r in range(W)]
        self._num_local = self._rank_sizes_W[self.rank]  # e
        # owner_P[p]: the rank holding physical expert p
        self._owner_P = torch.repeat_interleave(
            torch.arange(W, device="cpu"), torch.tensor(self._rank_sizes_W, device="cpu")
        ).to(spec.device)
        self._offsets_W = torch.tensor(
            spec.rank_offsets[:-1], dtype=torch.int64, device=spec.device
        )

    # ------------------------------------------------------------------- interface
    def dispatch_async(self, hidden_TH, topk_ids_TK, topk_weights_TK) -> Pending[DispatchResult]:
        # no fixed buffers: any T goes (the layer chunks to bound memory)
        check_dispatch_args(self.spec, hidden_TH, topk_ids_TK, topk_weights_TK, False)
        if self.layout is Layout.EXPERT_BATCHED:
            return self._dispatch_batched(hidden_TH, topk_ids_TK, topk_weights_TK)
        return self._dispatch_standard(hidden_TH, topk_ids_TK, topk_weights_TK)

    def combine_async(self, expert_out, result) -> Pending[torch.Tensor]:
        check_combine_args(expert_out, result)
        if result.layout is Layout.EXPERT_BATCHED:
            return self._combine_batched(expert_out, result)
        return self._combine_standard(expert_out, result)

    def _wire_rows(self, hidden_TH: torch.Tensor) -> torch.Tensor:
        """Rows as they travel: ``hidden_TH`` itself, or FP8 wire rows ``uint8 [T, B]``."""
        return fp8_wire_rows(hidden_TH) if self.spec.fp8_dispatch else hidden_TH

    def _from_wire(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(hidden, hidden_scale)`` of received rows ``[N, H]`` or FP8 ``uint8 [N, B]``."""
        if self.spec.fp8_dispatch:
            return fp8_from_wire(rows, self.spec.hidden_size)
        return rows, None

    # ---------------------------------------------------------------- Standard layout
    def _dispatch_standard(self, hidden_TH, topk_ids_TK, topk_weights_TK):
        T, K = topk_ids_TK.shape
        W, dev, P = self.world_size, hidden_TH.device, self.spec.num_physical
        ids_TK = topk_ids_TK.to(torch.int64)
        bad = ids_out_of_range(ids_TK, P)
        # owner_TK[t, k]: rank of expert ids[t, k]; W (a dummy column) where ids is -1 (ids
        # out of range are clamped here and refused below, before any row moves)
        owner_TK = torch.where(ids_TK >= 0, self._owner_P[ids_TK.clamp(0, P - 1)], W)
        dest_TW = torch.zeros(T, W + 1, dtype=torch.bool, device=dev)
        dest_TW.scatter_(1, owner_TK, True)
        dest_WT = dest_TW[:, :W].t()  # dest_WT[r, t]: token t has an expert on rank r
        send_counts_W = dest_WT.sum(1)
        # (rows, ids out of range?, call tag) to every rank: flag and tag ride with the counts
        tag = torch.full_like(send_counts_W, self.call_tag)
        send_W3 = torch.stack([send_counts_W, bad.expand(W), tag], dim=1)
        recv_W3 = exchange_counts(send_W3, self.group)
        counts = torch.cat([send_counts_W, recv_W3.t().reshape(-1)]).tolist()  # one host sync
        send_splits, recv_splits = counts[:W], counts[W : 2 * W]
        bad_W, tags_W = counts[2 * W : 3 * W], counts[3 * W :]
        if (error := call_tag_error(self.name, tags_W)) is not None:
            raise error  # on every rank, before any row moves
        if any(bad_W):  # every rank raises here, before any row moves
            bad_ranks = [r for r, b in enumerate(bad_W) if b]
            raise ids_error(self.name, topk_ids_TK, P, bad_ranks, self.rank)
        rank_S, token_S = _true_positions(dest_WT, sum(send_splits))  # by rank, then token

        # ids as the receiver sees them: local slot on that rank, -1 for other ranks; sent
        # as int32 [S, 2K] beside the float32 weights' bits
        mine_SK = owner_TK[token_S] == rank_S[:, None]
        local_SK = torch.where(mine_SK, ids_TK[token_S] - self._offsets_W[rank_S][:, None], -1)
        meta_S2K = torch.cat(
            [local_SK.to(torch.int32), topk_weights_TK[token_S].float().view(torch.int32)], dim=1
        )
        recv_meta_R2K, meta_work = all_to_all_async(meta_S2K, send_splits, recv_splits, self.group)
        rows_S = self._wire_rows(hidden_TH)[token_S]
        recv_rows_R, rows_work = all_to_all_async(rows_S, send_splits, recv_splits, self.group)
        handle = StandardHandle(token_S, tuple(send_splits), tuple(recv_splits), T)

        def finish() -> DispatchResult:
            wait_all(meta_work, rows_work)
            hidden_R, scale_RG = self._from_wire(recv_rows_R)
            return DispatchResult(
                layout=Layout.STANDARD,
                hidden=hidden_R,
                topk_ids=recv_meta_R2K[:, :K].to(torch.int64),
                topk_weights=recv_meta_R2K[:, K:].contiguous().view(torch.float32),
                hidden_scale=scale_RG,
                handle=handle,
            )

        return Pending(finish)

    def _combine_standard(self, expert_out_RH, result) -> Pending[torch.Tensor]:
        h: StandardHandle = result.handle
        dtype = self.spec.dtype
        back_SH, work = all_to_all_async(
            expert_out_RH.to(dtype), list(h.recv_splits), list(h.send_splits), self.group
        )

        def finish() -> torch.Tensor:
            wait_all(work)
            # one partial sum per (token, rank): add them in at least float32
            acc = torch.promote_types(dtype, torch.float32)
            out_TH = back_SH.new_zeros((h.num_tokens, back_SH.shape[1]), dtype=acc)
            out_TH.index_add_(0, h.token_of_row_S, back_SH.to(acc))
            return out_TH.to(dtype)

        return Pending(finish)

    # ----------------------------------------------------------- ExpertBatched layout
    def _dispatch_batched(self, hidden_TH, topk_ids_TK, topk_weights_TK):
        T, K = topk_ids_TK.shape
        W, e, dev = self.world_size, self._num_local, hidden_TH.device
        P = self.spec.num_physical
        ids = topk_ids_TK.reshape(-1).to(torch.int64)
        bad = ids_out_of_range(ids, P)
        # -1 sorts last and is never sent (ids out of range too: refused below)
        key = torch.where((ids >= 0) & (ids < P), ids, P)
        order = torch.argsort(key, stable=True)  # rank-major == by physical id
        per_expert_P = torch.bincount(key, minlength=P + 1)[:P]
        send_counts_W = torch.zeros(W, dtype=torch.int64, device=dev)
        send_counts_W.index_add_(0, self._owner_P, per_expert_P)
        # first a header of the same size in every layer: to each rank this rank's
        # ids-out-of-range flag, call tag and row count. A rank in another layer's dispatch
        # is named here, before any exchange whose size depends on the layer (its per-expert
        # counts: a size mismatch aborts gloo, and NCCL may hang or corrupt memory)
        head_W3 = torch.stack(
            [bad.to(torch.int64).expand(W), send_counts_W.new_full((W,), self.call_tag),
             send_counts_W], 1,
        )  # fmt: skip
        recv_W3 = exchange_counts(head_W3, self.group)
        head = torch.cat([send_counts_W, recv_W3.reshape(-1)]).tolist()  # host sync 1
        send_splits, recv_W3_host = head[:W], head[W:]
        bad_W, tags_W, recv_splits = recv_W3_host[0::3], recv_W3_host[1::3], recv_W3_host[2::3]
        if (error := call_tag_error(self.name, tags_W)) is not None:
            raise error  # on every rank, before any row moves
        if any(bad_W):  # every rank raises here, before any row moves
            bad_ranks = [r for r, b in enumerate(bad_W) if b]
            raise ids_error(self.name, topk_ids_TK, P, bad_ranks, self.rank)
        # the per-expert counts of each rank's own experts (same layer on every rank now)
        recv_cnt_We = all_to_all(per_expert_P, self._rank_sizes_W, [e] * W, self.group)
        recv_cnt_We = recv_cnt_We.view(W, e)
        counts_e = recv_cnt_We.sum(0)
        order_S = order[: sum(send_splits)]
        rows_S = self._wire_rows(hidden_TH)[order_S // K]
        recv_rows_R, work = all_to_all_async(rows_S, send_splits, recv_splits, self.group)

        # The buffer holds as many rows per expert as the busiest one received (host sync
        # 2, while the rows travel), so a prefill-sized dispatch does not allocate e·M_max·W
        C = max(int(counts_e.max()) if e > 0 else 0, 1)
        # Received rows come ordered by (source, slot). Row j of block (s, i) goes to
        # buffer row i·C + (rows of slot i from sources before s) + j.
        block_count = recv_cnt_We.reshape(-1)  # blocks in (source, slot) order
        before_src = torch.cumsum(recv_cnt_We, 0) - recv_cnt_We  # [W, e]
        block_base = (torch.arange(e, device=dev) * C + before_src).reshape(-1)
        block_start = torch.cumsum(block_count, 0) - block_count
        R = sum(recv_splits)
        block_of_row = torch.repeat_interleave(
            torch.arange(W * e, device=dev), block_count, output_size=R
        )
        recv_slot_R = (
            block_base[block_of_row] + torch.arange(R, device=dev) - block_start[block_of_row]
        )
        # (the weights as they are now: the caller may reuse its buffer before the combine)
        weights_TK = topk_weights_TK.to(self.spec.dtype, copy=True)
        handle = BatchedHandle(
            order_S, weights_TK, recv_slot_R, tuple(send_splits), tuple(recv_splits), T
        )

        def finish() -> DispatchResult:
            wait_all(work)
            buf = recv_rows_R.new_empty((e * C, recv_rows_R.shape[1]))  # rows past counts: unused
            buf[recv_slot_R] = recv_rows_R
            hidden, scale = self._from_wire(buf)
            return DispatchResult(
                layout=Layout.EXPERT_BATCHED,
                hidden=hidden.view(e, C, hidden.shape[-1]),
                counts=counts_e.to(torch.int32),
                hidden_scale=None if scale is None else scale.view(e, C, scale.shape[-1]),
                handle=handle,
            )

        return Pending(finish)

    def _combine_batched(self, expert_out_eCH, result) -> Pending[torch.Tensor]:
        h: BatchedHandle = result.handle
        T, K = h.weights_TK.shape
        H, dtype = expert_out_eCH.shape[-1], self.spec.dtype
        rows_RH = expert_out_eCH.reshape(-1, H)[h.recv_slot_R].to(dtype)
        back_SH, work = all_to_all_async(
            rows_RH, list(h.recv_splits), list(h.send_splits), self.group
        )

        def finish() -> torch.Tensor:
            wait_all(work)
            # back to (token, k) order without atomics; pairs that were not sent stay zero
            y_TKH = back_SH.new_zeros((T * K, H))
            y_TKH.index_copy_(0, h.pair_order_S, back_SH)
            # out[t] = Σ_k w[t, k] · y[t, k]: one batched matmul in the layer's dtype
            # (weights rounded to it) with fp32 accumulation
            w_T1K = h.weights_TK.unsqueeze(1)
            return torch.bmm(w_T1K, y_TKH.view(T, K, H)).squeeze(1)

        return Pending(finish)
