"""``all_to_all``: a count exchange, then ``all_to_all_single`` with uneven splits.

Portable (gloo and NCCL) and exact; the host waits for the counts, so it is not graph safe.

* Standard layout: a token goes once to each rank that holds at least one of its experts;
  rows arrive ordered by source rank with their top-k ids remapped to local slots.
* ExpertBatched layout: a token goes once per selected expert; the receiver packs the rows
  of each local expert into ``[e, C, H]``, rows ``[:counts[i]]`` valid. The host knows the
  counts, so ``C`` is the largest count of this dispatch, not the worst case ``M_max · W``.

Shape legend: T tokens · H hidden · K top-k · W world · e local experts · S rows this rank
sends · R rows it receives · C capacity per expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epmoe.comm._collectives import all_to_all, exchange_counts
from epmoe.comm.base import (
    AllToAll,
    Capabilities,
    DispatchResult,
    Layout,
    check_dispatch_args,
)


@dataclass(frozen=True)
class StandardHandle:
    token_of_row_S: torch.Tensor  # which local token each sent row carries
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank
    num_tokens: int  # T


@dataclass(frozen=True)
class BatchedHandle:
    pair_order_S: torch.Tensor  # flat (t, k) index of each sent row, in send order
    weights_TK: torch.Tensor  # router weights of this rank's tokens
    recv_slot_R: torch.Tensor  # row of the [e·C, H] expert buffer each received row went to
    send_splits: list[int]
    recv_splits: list[int]
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
    )

    def __init__(self, spec, group, layout=None):
        super().__init__(spec, group, layout)
        offs = spec.rank_offsets
        self._rank_sizes = [spec.num_local(r) for r in range(self.world_size)]
        self._num_local = self._rank_sizes[self.rank]
        # owner_P[p]: the rank holding physical expert p (physical ids are rank-major)
        self._owner_P = torch.repeat_interleave(
            torch.arange(self.world_size), torch.tensor(self._rank_sizes)
        ).to(spec.device)
        self._offsets_W = torch.tensor(offs[:-1], dtype=torch.int64, device=spec.device)

    # ---------------------------------------------------------------- Standard layout
    def _dispatch_standard(self, hidden_TH, topk_ids_TK, topk_weights_TK) -> DispatchResult:
        T, K = topk_ids_TK.shape
        W, dev = self.world_size, hidden_TH.device
        ids = topk_ids_TK.to(torch.int64)
        # owner_TK[t, k]: rank of expert ids[t, k]; W (a dummy column) where ids is -1
        owner_TK = torch.where(ids >= 0, self._owner_P[ids.clamp(min=0)], W)
        dest_TW = torch.zeros(T, W + 1, dtype=torch.bool, device=dev)
        dest_TW.scatter_(1, owner_TK, True)
        dest_WT = dest_TW[:, :W].t()  # dest_WT[r, t]: token t has an expert on rank r
        send_counts = dest_WT.sum(1)
        recv_counts = exchange_counts(send_counts[:, None], self.group)[:, 0]
        counts = torch.cat([send_counts, recv_counts]).tolist()  # the one host sync
        send_splits, recv_splits = counts[:W], counts[W:]
        rank_S, token_S = _true_positions(dest_WT, sum(send_splits))  # by rank, then token

        # ids as the receiver sees them: local slot on that rank, -1 for other ranks
        mine = owner_TK[token_S] == rank_S[:, None]
        local_S = torch.where(mine, ids[token_S] - self._offsets_W[rank_S][:, None], -1)
        meta = torch.cat(
            [local_S.to(torch.int32), topk_weights_TK[token_S].float().view(torch.int32)], dim=1
        )
        recv_meta = all_to_all(meta, send_splits, recv_splits, self.group)
        recv_hidden = all_to_all(hidden_TH[token_S], send_splits, recv_splits, self.group)
        return DispatchResult(
            layout=Layout.STANDARD,
            hidden=recv_hidden,
            topk_ids=recv_meta[:, :K].to(torch.int64),
            topk_weights=recv_meta[:, K:].contiguous().view(torch.float32),
            handle=StandardHandle(token_S, send_splits, recv_splits, T),
        )

    def _combine_standard(self, expert_out_RH, result) -> torch.Tensor:
        h: StandardHandle = result.handle
        back_SH = all_to_all(expert_out_RH, h.recv_splits, h.send_splits, self.group)
        out = torch.zeros(
            h.num_tokens, back_SH.shape[1], dtype=torch.float32, device=back_SH.device
        )
        out.index_add_(0, h.token_of_row_S, back_SH.float())
        return out.to(expert_out_RH.dtype)

    # ----------------------------------------------------------- ExpertBatched layout
    def _dispatch_batched(self, hidden_TH, topk_ids_TK, topk_weights_TK) -> DispatchResult:
        T, K = topk_ids_TK.shape
        W, e, dev = self.world_size, self._num_local, hidden_TH.device
        P = self.spec.num_physical
        ids = topk_ids_TK.reshape(-1).to(torch.int64)
        key = torch.where(ids >= 0, ids, P)  # -1 sorts last and is never sent
        order = torch.argsort(key, stable=True)  # rank-major == by physical id
        per_expert_P = torch.bincount(key, minlength=P + 1)[:P]
        # rank r receives the per-expert counts of its own experts from every source
        sizes = self._rank_sizes
        recv_cnt_flat = all_to_all(per_expert_P, sizes, [e] * W, self.group)
        recv_cnt_We = recv_cnt_flat.view(W, e)
        send_counts = torch.zeros(W, dtype=torch.int64, device=dev)
        send_counts.index_add_(0, self._owner_P, per_expert_P)
        counts_e = recv_cnt_We.sum(0)
        most = counts_e.max(0, keepdim=True).values if e > 0 else counts_e.new_zeros(1)
        counts = torch.cat([send_counts, recv_cnt_We.sum(1), most]).tolist()  # one host sync
        send_splits, recv_splits = counts[:W], counts[W : 2 * W]
        order = order[: sum(send_splits)]
        recv_hidden = all_to_all(hidden_TH[order // K], send_splits, recv_splits, self.group)

        # The buffer holds as many rows per expert as the busiest one received (the host
        # knows it already), so a prefill-sized dispatch does not allocate e·M_max·W rows.
        C = max(counts[-1], 1)
        # Received rows come ordered by (source, slot). Row j of block (s, i) goes to
        # buffer row i·C + (rows of slot i from sources before s) + j.
        block_count = recv_cnt_We.reshape(-1)  # blocks in (source, slot) order
        before_src = torch.cumsum(recv_cnt_We, 0) - recv_cnt_We  # [W, e]
        block_base = (torch.arange(e, device=dev) * C + before_src).reshape(-1)
        block_start = torch.cumsum(block_count, 0) - block_count
        rows = sum(recv_splits)
        block_of_row = torch.repeat_interleave(
            torch.arange(W * e, device=dev), block_count, output_size=rows
        )
        recv_slot_R = (
            block_base[block_of_row] + torch.arange(rows, device=dev) - block_start[block_of_row]
        )
        buf = hidden_TH.new_empty((e * C, hidden_TH.shape[1]))  # rows past counts: unused
        buf[recv_slot_R] = recv_hidden
        return DispatchResult(
            layout=Layout.EXPERT_BATCHED,
            hidden=buf.view(e, C, -1),
            counts=counts_e.to(torch.int32),
            handle=BatchedHandle(order, topk_weights_TK, recv_slot_R, send_splits, recv_splits, T),
        )

    def _combine_batched(self, expert_out_eCH, result) -> torch.Tensor:
        h: BatchedHandle = result.handle
        T, K = h.weights_TK.shape
        H = expert_out_eCH.shape[-1]
        rows_RH = expert_out_eCH.reshape(-1, H)[h.recv_slot_R]
        back_SH = all_to_all(rows_RH, h.recv_splits, h.send_splits, self.group)
        # back to (token, k) order without atomics; pairs that were not sent stay zero
        y_TKH = back_SH.new_zeros((T * K, H))
        y_TKH.index_copy_(0, h.pair_order_S, back_SH)
        # out[t] = Σ_k w[t, k] · y[t, k]: one batched matmul in the expert dtype (weights
        # rounded to it) with fp32 accumulation
        w_T1K = h.weights_TK.to(back_SH.dtype).unsqueeze(1)
        return torch.bmm(w_T1K, y_TKH.view(T, K, H)).squeeze(1)

    # ------------------------------------------------------------------- interface
    def dispatch(self, hidden_TH, topk_ids_TK, topk_weights_TK) -> DispatchResult:
        # no fixed buffers: any T goes (the layer chunks to bound memory)
        check_dispatch_args(self.spec, hidden_TH, topk_ids_TK, topk_weights_TK, False)
        if self.layout is Layout.EXPERT_BATCHED:
            return self._dispatch_batched(hidden_TH, topk_ids_TK, topk_weights_TK)
        return self._dispatch_standard(hidden_TH, topk_ids_TK, topk_weights_TK)

    def combine(self, expert_out, result) -> torch.Tensor:
        if expert_out.shape != result.hidden.shape:
            raise ValueError(
                f"expert_out must have the dispatched shape {tuple(result.hidden.shape)}, "
                f"got {tuple(expert_out.shape)}"
            )
        if result.layout is Layout.EXPERT_BATCHED:
            return self._combine_batched(expert_out, result)
        return self._combine_standard(expert_out, result)
