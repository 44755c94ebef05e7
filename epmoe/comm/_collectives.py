"""What the portable backends share: torch.distributed collectives and the FP8 row format.

The collective wrappers hide the single-process case (no process group, or one rank: the
identity, done at once) and names that moved between torch releases, so the backends read
as the data flow they implement. Each payload collective has a ``*_async`` form that starts
it and returns its ``dist.Work`` (``None`` when it already finished); the output tensor is
valid only after ``wait_all`` on that work, and the input must stay alive and unchanged
until then. Started collectives are matched across ranks by start order, so every rank
starts them in the same order; they may be waited for in any order.

Shape legend: T tokens · H hidden size · G = ceil(H / 128) FP8 scale groups per row ·
B = H + 4·G bytes of one FP8 row on the wire · W world size · N rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from epmoe.comm.base import FP8_DTYPE, FP8_GROUP
from epmoe.reference import quantize_groups


def world_of(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(rank, world_size)`` of ``group``, ``(0, 1)`` without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def wait_all(*works: dist.Work | None) -> None:
    """Finish started collectives (``None`` entries finished when they started)."""
    for work in works:
        if work is not None:
            work.wait()


# ------------------------------------------------------------------ payload collectives


def all_gather_into_async(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None
) -> dist.Work | None:
    """Start ``out [W·N, ...]`` ← every rank's ``inp [N, ...]`` in rank order."""
    if world_of(group)[1] == 1:
        out.copy_(inp)
        return None
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=True)


def reduce_scatter_into_async(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None
) -> dist.Work | None:
    """Start ``out [N, ...]`` ← Σ over ranks of this rank's ``N``-row block of
    ``inp [W·N, ...]``."""
    if world_of(group)[1] == 1:
        out.copy_(inp)
        return None
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=True)


def all_to_all_async(
    inp: torch.Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, dist.Work | None]:
    """Start sending rows ``inp[sum(send_splits[:r]) : …]`` to rank ``r``.

    Returns ``(out, work)``: ``out [sum(recv_splits), ...]`` receives the rows ordered by
    source rank once ``work`` is finished. Splits are host lists that every rank agrees on
    (rank r's ``send_splits[s]`` is rank s's ``recv_splits[r]``).
    """
    out = inp.new_empty((sum(recv_splits), *inp.shape[1:]))
    if len(send_splits) == 1:  # one rank: nothing leaves the process
        out.copy_(inp)
        return out, None
    work = dist.all_to_all_single(
        out, inp.contiguous(), recv_splits, send_splits, group=group, async_op=True
    )
    return out, work


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """Blocking ``all_gather_into_async``."""
    wait_all(all_gather_into_async(out, inp, group))


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """Blocking ``reduce_scatter_into_async``."""
    wait_all(reduce_scatter_into_async(out, inp, group))


def all_to_all(
    inp: torch.Tensor, send_splits: list[int], recv_splits: list[int], group
) -> torch.Tensor:
    """Blocking ``all_to_all_async``: the received rows ``[sum(recv_splits), ...]``."""
    out, work = all_to_all_async(inp, send_splits, recv_splits, group)
    wait_all(work)
    return out


# ------------------------------------------------------------ host-visible count exchanges


def exchange_counts(send_counts: torch.Tensor, group) -> torch.Tensor:
    """All-to-all of equal-sized count blocks: ``send_counts [W, n]`` (row r goes to rank r)
    → ``[W, n]`` (row s came from rank s). Blocking: the host needs the counts next."""
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


# --------------------------------------------------------------------- FP8 rows on the wire


def fp8_wire_rows(x_TH: torch.Tensor) -> torch.Tensor:
    """Quantize rows for FP8 dispatch and pack them for the wire: ``uint8 [T, B]``.

    Each row is its ``H`` e4m3 values (``epmoe.reference.quantize_groups``: per-row groups
    of 128 columns, float32 scale ``amax / 448``) followed by the ``G`` float32 scales as
    ``4·G`` bytes, so values and scales travel in one collective and stay together when
    rows are permuted. uint8 because gloo moves no float8.
    """
    q_TH, scale_TG = quantize_groups(x_TH, FP8_GROUP)
    return torch.cat([q_TH.view(torch.uint8), scale_TG.view(torch.uint8)], dim=1)


def fp8_from_wire(rows_NB: torch.Tensor, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack ``fp8_wire_rows`` output: ``(hidden [N, H] float8_e4m3fn, scale [N, G]
    float32)``, both contiguous."""
    q_NH = rows_NB[:, :hidden_size].contiguous().view(FP8_DTYPE)
    scale_NG = rows_NB[:, hidden_size:].contiguous().view(torch.float32)
    return q_NH, scale_NG
