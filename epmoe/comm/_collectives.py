"""Thin wrappers over torch.distributed collectives that the portable backends share.

They hide the single-process case (no process group: the identity) and names that moved
between torch releases, so the backends read as the data flow they implement.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_of(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(rank, world_size)`` of ``group``, ``(0, 1)`` without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """``out [W·N, ...]`` ← every rank's ``inp [N, ...]`` in rank order."""
    if world_of(group)[1] == 1:
        out.copy_(inp)
        return
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """``out [N, ...]`` ← Σ over ranks of this rank's ``N``-row block of ``inp [W·N, ...]``."""
    if world_of(group)[1] == 1:
        out.copy_(inp)
        return
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


def all_to_all(
    inp: torch.Tensor, send_splits: list[int], recv_splits: list[int], group
) -> torch.Tensor:
    """Rows ``inp[sum(send_splits[:r]) : …]`` go to rank ``r``; returns the received rows
    ``[sum(recv_splits), ...]`` ordered by source rank."""
    out = inp.new_empty((sum(recv_splits), *inp.shape[1:]))
    if len(send_splits) == 1:  # one rank: nothing leaves the process
        out.copy_(inp)
        return out
    dist.all_to_all_single(out, inp.contiguous(), recv_splits, send_splits, group=group)
    return out


def exchange_counts(send_counts: torch.Tensor, group) -> torch.Tensor:
    """All-to-all of equal-sized count blocks: ``send_counts [W, n]`` (row r goes to rank r)
    → ``[W, n]`` (row s came from rank s)."""
    if send_counts.shape[0] == 1:
        return send_counts.clone()
    out = torch.empty_like(send_counts)
    dist.all_to_all_single(out, send_counts.contiguous(), group=group)
    return out


def agree_max(values: tuple[int, ...], group, device: torch.device) -> tuple[int, ...]:
    """The element-wise largest ``values`` over the ranks of ``group`` (one all-reduce)."""
    if world_of(group)[1] == 1:
        return values
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return tuple(t.tolist())
