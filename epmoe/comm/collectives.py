"""The collectives epmoe runs on torch.distributed, and the FP8 row format of the wire.

The one home of these helpers: the portable backends (``all_to_all``, ``naive``), the
layer's and the step's agreements, checkpoint loading and EPLB's migration use them.

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

import datetime
import time

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
    return _start_into(out, inp, group, "all_gather_single", "all_gather_into_tensor")


def reduce_scatter_into_async(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None
) -> dist.Work | None:
    """Start ``out [N, ...]`` ← Σ over ranks of this rank's ``N``-row block of
    ``inp [W·N, ...]``."""
    return _start_into(out, inp, group, "reduce_scatter_single", "reduce_scatter_tensor")


def _start_into(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None, name: str, older: str
) -> dist.Work | None:
    """Start ``torch.distributed.<name>`` (``<older>`` on torch versions without it) from
    ``inp`` into ``out``; one rank copies and returns no work."""
    if world_of(group)[1] == 1:
        out.copy_(inp)
        return None
    fn = getattr(dist, name, None) or getattr(dist, older)
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


def all_gather_rows(row_L: torch.Tensor, group, operation: str) -> list[list[int]]:
    """Every rank's ``row_L`` (int64 ``[L]``, the same L on every rank) as W host lists in
    rank order: one all-gather, whose result the host reads.

    When the collective fails (the process group's timeout ran out, or a rank left), the
    ``RuntimeError`` names ``operation`` (e.g. ``"EPMoE.forward agreement (layer #0, call
    7)"``, unique per call) and the group's ranks, and, when the process group's store
    answers, which ranks never arrived (see :func:`_missing_ranks`). On NCCL the group's
    watchdog enforces the timeout (it aborts the process, naming the collective's
    sequence number) unless ``TORCH_NCCL_BLOCKING_WAIT=1`` turns it into this error.
    """
    W, L = world_of(group)[1], row_L.numel()
    if W == 1:
        return [row_L.tolist()]
    out = row_L.new_empty(W * L)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    start = time.monotonic()
    try:
        fn(out, row_L, group=group)
        flat = out.tolist()
    except RuntimeError as exc:  # gloo/NCCL timeouts and closed connections
        waited = time.monotonic() - start
        raise RuntimeError(_failure_message(operation, group, row_L.device, exc, waited)) from exc
    return [flat[r * L : (r + 1) * L] for r in range(W)]


# How long ranks whose collective failed wait for each other's arrival marks in the store.
ARRIVAL_GRACE_S = 2.0


def _failure_message(
    operation: str, group, device: torch.device, exc: BaseException, waited_s: float
) -> str:
    rank, W = world_of(group)
    timeout = _group_timeout(group, device)
    limit = f"{timeout.total_seconds():g} s" if timeout is not None else "its timeout"
    missing = _missing_ranks(group, operation)
    if missing is None:
        who = "the process group's store could not tell which ranks did not arrive"
    elif missing:
        ranks = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {missing}"
        who = (
            f"{ranks} never arrived, not even {ARRIVAL_GRACE_S:g} s later (stopped, stuck "
            f"in other work, or dead; the group's timeout is {limit})"
        )
    else:
        who = "every rank reached this call (one may have come after the others gave up)"
    cause = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
    return (
        f"{operation} failed on rank {rank} of the EP group (ranks 0..{W - 1}) after "
        f"{waited_s:.1f} s: {who}. The process group cannot be trusted after this; restart "
        f"the ranks. Collective error: {cause}"
    )


def _group_timeout(group, device: torch.device) -> datetime.timedelta | None:
    """The timeout ``group``'s collectives run under (``None`` when torch does not say)."""
    try:
        group = group or dist.group.WORLD
        return group._get_backend(device).options._timeout
    except Exception:  # private torch API: only the message loses the number
        return None


def _missing_ranks(group, operation: str) -> list[int] | None:
    """After a failed collective: the group ranks that did not reach ``operation``.

    Each rank that gets here marks its arrival in the default store and waits up to
    ``ARRIVAL_GRACE_S`` for the others' marks (their collectives time out at about the
    same moment); ranks without a mark are the ones that never arrived. Costs nothing on
    the success path. ``None`` when the store cannot be used.
    """
    try:
        from torch.distributed import distributed_c10d as c10d

        store = c10d._get_default_store()
        group = group or dist.group.WORLD
        ranks = dist.get_process_group_ranks(group)  # global rank of each group rank
        name = getattr(group, "group_name", "") or ",".join(map(str, ranks))
        key = f"epmoe/arrived/{name}/{operation}/"
        store.set(key + str(dist.get_rank()), "1")
        deadline = time.monotonic() + ARRIVAL_GRACE_S
        while True:
            missing = [i for i, g in enumerate(ranks) if not store.check([key + str(g)])]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(0.05)
    except Exception:
        return None


# --------------------------------------------------------------------- FP8 rows on the wire


def fp8_wire_rows(x_TH: torch.Tensor) -> torch.Tensor:
    """Quantize rows for FP8 dispatch and pack them for the wire: ``uint8 [T, B]``.

    Each row is its ``H`` e4m3 values (``epmoe.reference.quantize_groups``: per-row groups
    of 128 columns, float32 scale ``amax / 448``) followed by the ``G`` float32 scales as
    ``4·G`` bytes, so values and scales travel in one collective and stay together when
    rows are permuted. uint8 because gloo moves no float8.
    """
    q_TH, scale_TG = quantize_groups(x_TH, FP8_GROUP)
    # (reshape: a rank without tokens gets scales [0, 1] with stride 0, which view refuses)
    T, G = scale_TG.shape
    scale_TB = scale_TG.reshape(-1).view(torch.uint8).reshape(T, 4 * G)
    return torch.cat([q_TH.view(torch.uint8), scale_TB], dim=1)


def fp8_from_wire(rows_NB: torch.Tensor, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack ``fp8_wire_rows`` output: ``(hidden [N, H] float8_e4m3fn, scale [N, G]
    float32)``, both contiguous."""
    q_NH = rows_NB[:, :hidden_size].contiguous().view(FP8_DTYPE)
    scale_NG = rows_NB[:, hidden_size:].contiguous().view(torch.float32)
    return q_NH, scale_NG
