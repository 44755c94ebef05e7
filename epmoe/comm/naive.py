"""``naive``: all-gather every token to every rank, reduce-scatter the outputs back.

The simplest correct transport and a second oracle for the others: each rank receives all
``R = Σ_s T_s`` tokens of the group (Standard layout, top-k ids remapped to local slots,
-1 elsewhere) and returns partial sums that a reduce-scatter adds up. It moves W times the
bytes a real all-to-all moves; use it for checking, not for speed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epmoe.comm._collectives import all_gather_into, reduce_scatter_into
from epmoe.comm.base import (
    AllToAll,
    Capabilities,
    DispatchResult,
    Layout,
    check_dispatch_args,
)


@dataclass(frozen=True)
class NaiveHandle:
    tokens_per_rank: tuple[int, ...]  # T_s of every rank s
    padded_tokens: int  # T_pad = max_s T_s: every rank's block in the gathered buffer


class NaiveBackend(AllToAll):
    name = "naive"
    capabilities = Capabilities(
        layouts=frozenset({Layout.STANDARD}),
        dtypes=frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16}),
        device_types=frozenset({"cpu", "cuda"}),
    )

    def __init__(self, spec, group, layout=None):
        super().__init__(spec, group, layout)
        lo, hi = spec.rank_offsets[self.rank], spec.rank_offsets[self.rank + 1]
        self._local_lo, self._local_hi = lo, hi

    def dispatch(self, hidden_TH, topk_ids_TK, topk_weights_TK) -> DispatchResult:
        check_dispatch_args(self.spec, hidden_TH, topk_ids_TK, topk_weights_TK, False)
        T, W = hidden_TH.shape[0], self.world_size
        dev = hidden_TH.device
        counts = torch.empty(W, dtype=torch.int64, device=dev)
        all_gather_into(counts, torch.tensor([T], dtype=torch.int64, device=dev), self.group)
        tokens = tuple(counts.tolist())
        T_pad = max(tokens)

        def gather(t: torch.Tensor) -> torch.Tensor:
            padded = t.new_zeros((T_pad, *t.shape[1:]))
            padded[:T] = t
            out = t.new_empty((W * T_pad, *t.shape[1:]))
            all_gather_into(out, padded, self.group)
            return out

        keep = torch.cat(
            [torch.arange(T_s, device=dev) + s * T_pad for s, T_s in enumerate(tokens)]
        )
        hidden = gather(hidden_TH)[keep]
        ids = gather(topk_ids_TK.to(torch.int64))[keep]
        weights = gather(topk_weights_TK.to(torch.float32))[keep]
        local = (ids >= self._local_lo) & (ids < self._local_hi)
        local_ids = torch.where(local, ids - self._local_lo, torch.full_like(ids, -1))
        return DispatchResult(
            layout=Layout.STANDARD,
            hidden=hidden,
            topk_ids=local_ids,
            topk_weights=weights,
            handle=NaiveHandle(tokens, T_pad),
        )

    def combine(self, expert_out, result):
        h: NaiveHandle = result.handle
        W, T_pad = self.world_size, h.padded_tokens
        T = h.tokens_per_rank[self.rank]
        if expert_out.shape != result.hidden.shape:
            raise ValueError(
                f"expert_out must have the dispatched shape {tuple(result.hidden.shape)}, "
                f"got {tuple(expert_out.shape)}"
            )
        padded = expert_out.new_zeros((W * T_pad, expert_out.shape[1]))
        start = 0
        for s, T_s in enumerate(h.tokens_per_rank):
            padded[s * T_pad : s * T_pad + T_s] = expert_out[start : start + T_s]
            start += T_s
        out = padded.new_empty((T_pad, padded.shape[1]))
        reduce_scatter_into(out, padded, self.group)
        return out[:T]
