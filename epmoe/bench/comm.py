"""Dispatch and combine of each all-to-all backend, against NCCL and the peer-store ceiling.

Run on every rank (torchrun), e.g. on 2 GPUs:

    python launch/run.py --nproc 2 -m epmoe.bench comm --out results/comm.json

(or ``torchrun --nproc-per-node 2 -m epmoe.bench comm``). Uniform routing, linear placement.
For every T per rank (``--tokens``), wire dtype (``--dispatch-dtypes``: the hidden dtype, or
``float8_e4m3fn`` = FP8 e4m3 rows with one float32 scale per 128 columns, for backends whose
``capabilities.fp8_dispatch``; others are skipped with a note) and ``--backends`` entry, one
record per mode:

* ``eager``: each iteration runs ``dispatch`` then ``combine`` from Python, timed apart by
  CUDA events (so the host's launch gaps count, as in an eager model step);
* ``eager_kernels`` (CUDA): the GPU durations of the dispatch and combine kernels
  launched eagerly, from the profiler, with the ranks aligned before each round trip:
  DeepEP's own method for its published figures (:func:`time_kernels`). Host launch gaps
  do not count; kernels not named ``dispatch`` / ``combine`` (an adapter's extra copies,
  the FP8 quantization that ``symm_ht`` and ``deepep_ht`` run before the send) are left
  out, as DeepEP's test leaves them out (its FP8 figures take quantized input); every
  kernel's own median (``kernels_us``, rank 0) is kept and printed: where a phase's time
  goes;
* ``graph`` (``capabilities.graph_safe`` backends on CUDA): ``dispatch`` captured alone in
  one CUDA graph with static inputs, ``combine`` of its result in another, replayed
  alternately (captured collectives must be replayed on every rank the same number of
  times, in the same order);
* ``eager_b2b``: the same calls back to back, ``--iters`` round trips queued with no
  barrier and no host wait between them, an event between phases: the time per phase in a
  steady stream of calls (the GPU's, or the host's launch time where that is longer; the
  events are made beforehand, :func:`epmoe.bench.common.timing_events`, so that their own
  host time does not count);
* ``graph_b2b``: ``STREAM_ROUNDS`` round trips captured in one CUDA graph with timing
  events recorded inside it between phases, replayed ``STREAM_REPLAYS`` times: the GPU's
  time per phase with no host in the way. The events inside the graph cost time of their
  own: ``roundtrip_us`` is a round trip in the same graph without them (events only
  around all rounds), and the ceiling's ``no_events_us`` a store likewise, as the floor
  in FACTS.md was measured.

``eager`` and ``graph`` time one round trip after a barrier, from an idle stream: they add
the launch latency and the ranks' skew leaving the barrier. The low-latency floor in
FACTS.md and DeepEP's own figures are steady-stream times, so the goals are judged on the
``_b2b`` modes; the eager goals are DeepEP's kernel times, so ``eager_kernels`` is held
to them too, beside the host-bound ``eager_b2b``.

Each record has ``dispatch_us`` and ``combine_us`` (the slowest rank's median), ``sms``
(SMs the backend's kernels use: its ``num_sms``), the bytes received (``dispatch_MB``:
received rows × wire row; ``combine_MB``: the same rows in the hidden dtype; DeepEP's
convention, self traffic included) and their rates, and, on eager records,
``a2a_dispatch_us`` and ``a2a_combine_us``: NCCL (gloo) ``all_to_all_single`` moving the
same rows of the same bytes as each phase (dispatch: the wire rows, FP8 with their scales;
combine: rows in the hidden dtype), and ``dispatch_vs_a2a`` / ``combine_vs_a2a``, each
phase against its own (> 1: faster than NCCL). ``roundtrip_error`` checks the mode: with
experts that return their input, combine must return ``x · Σ_k w`` (bf16 ~1e-3, FP8
~3e-2). ``link_GBps`` is a large ``all_to_all_single``'s bandwidth (``null`` on one rank).

Records of kind ``ceiling`` (CUDA, ≥ 2 ranks): :mod:`epmoe.bench.ceiling` storing the same
wire rows into the peers' symmetric buffers, once per (token, destination rank) and once
per (token, expert), eagerly and from a graph, with its SMs and GB/s: the floor under any
one-sided dispatch (and, in bf16, under a combine).

Goals (the ``symm_ll`` issue; EP2 on H200, T = 128, H = 7168, K = 8; ``goal`` column and a
summary, on the ``_b2b`` modes; records at other W get no verdict): CUDA-graph dispatch
≤ 10 µs FP8 / ≤ 13 µs bf16, combine ≤ 15 µs; eager dispatch ≤ 31 µs and combine ≤ 41 µs
(DeepEP low-latency on the same machine: 26–31 / 39–41 µs).

Shape legend: T tokens per rank · H hidden · K top-k · E experts · W ranks.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import epmoe
from epmoe.bench.common import (
    BackendChoice,
    EntrySyntax,
    distributed_setup,
    format_table,
    median,
    over_ranks,
    parse_backend_choice,
    progress,
    time_fn,
    timing_events,
    write_json,
)
from epmoe.comm import (
    available_backends,
    backend_class,
    check_backend_options,
    create_backend,
)
from epmoe.comm.base import (
    FP8_GROUP,
    AllToAll,
    CommSpec,
    DispatchResult,
    Layout,
    wire_row_bytes,
)
from epmoe.distributed import num_sms
from epmoe.reference import relative_error
from epmoe.routing import RoutingSimulator

DEFAULT_BACKENDS = [
    "all_to_all:standard",
    "all_to_all:expert_batched",
    "naive:standard",
    "symm_ll:expert_batched",
    "symm_ht:standard",
]
FP8_NAME = "float8_e4m3fn"
# backends that send every token to every rank: their NCCL baseline moves that gather, not
# the layout's rows, so it is no baseline of the layout (epmoe.bench.plot leaves it out)
GATHERING_BACKENDS = ("naive",)

# The goals: EP2 on H200 at this shape; µs by (phase, mode, wire dtype or None: any).
GOAL_SHAPE = (2, 128, 7168, 8)  # (W, T, H, K): EP2, as the goals were measured
COMM_GOALS_US: dict[tuple[str, str, str | None], float] = {
    ("dispatch", "graph", FP8_NAME): 10.0,
    ("dispatch", "graph", "bfloat16"): 13.0,
    ("combine", "graph", None): 15.0,
    ("dispatch", "eager", None): 31.0,  # DeepEP LL on the same machine: 26–31 µs
    ("combine", "eager", None): 41.0,  # DeepEP LL: 39–41 µs
}
GOAL_BACKEND = "symm_ll"
# the modes whose records are held against the goals, and the goal mode each one meets
GOAL_MODES = {"eager_b2b": "eager", "eager_kernels": "eager", "graph_b2b": "graph"}
MODES = ("eager", "eager_b2b", "eager_kernels", "graph", "graph_b2b")
# a round trip further from x·Σw than this is a wrong result, not a timing (FP8: 3e-2 typical)
ROUNDTRIP_TOLERANCE = {"float8_e4m3fn": 6e-2}
ROUNDTRIP_TOLERANCE_DEFAULT = 1e-2
STREAM_ROUNDS = 10  # round trips captured in one graph for graph_b2b
STREAM_REPLAYS = 3  # replays of that graph timed (after one to warm up)

COMM_COLUMNS = [
    "backend",
    "layout",
    "wire",
    "T",
    "mode",
    "dispatch_us",
    "combine_us",
    "roundtrip_us",
    "goal",
    "sms",
    "a2a_dispatch_us",
    "a2a_combine_us",
    "dispatch_MB",
    "dispatch_GBps",
    "combine_GBps",
    "note",
]
CEILING_COLUMNS = [
    "wire",
    "T",
    "pattern",
    "mode",
    "us",
    "no_events_us",
    "sms",
    "MB",
    "GBps",
    "note",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, nargs="+", default=None, help="T per rank (1 128 512)")
    p.add_argument("--hidden", type=int, default=None, help="H (7168)")
    p.add_argument("--num-experts", type=int, default=None, help="E (256)")
    p.add_argument("--top-k", type=int, default=None, help="K (8)")
    p.add_argument("--dtype", default="bfloat16", help="hidden dtype (combine's output)")
    p.add_argument(
        "--dispatch-dtypes",
        nargs="+",
        default=None,
        help=f"wire dtypes of dispatch: the hidden dtype and/or {FP8_NAME} (default: both)",
    )
    p.add_argument(
        "--backends",
        nargs="+",
        default=DEFAULT_BACKENDS,
        help="name:layout pairs; symm_ht also name:layout:SMs[:ROWS] (an SM budget, rows "
        "stored per flag, 0: one count per program); symm_ll also name:layout:copy, "
        "deepep_ht name:layout:fixed (worst-case rows, graph safe); any backend option as "
        "name:layout:key=value[,key=value] (e.g. deepep_ht:standard:num_sms=24,nvl_chunks=20/8)",
    )
    p.add_argument("--warmup", type=int, default=None, help="5 (2 with --small)")
    p.add_argument("--iters", type=int, default=None, help="30 (5 with --small)")
    p.add_argument(
        "--profile", action="store_true", help="print a torch.profiler table per backend (rank 0)"
    )
    p.add_argument(
        "--small",
        action="store_true",
        help="a quick check (seconds on CPU): H=256, 16 experts, top-4, 1/16/64 tokens, 5 iters "
        "(options given explicitly win)",
    )


# ------------------------------------------------------------------------------ arithmetic


def table(records: list[dict], columns: list[str]) -> str:
    """:func:`format_table` with ``-`` for values that do not exist (``None``)."""
    rows = [{k: "-" if v is None else v for k, v in r.items()} for r in records]
    return format_table(rows, columns)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def comm_goal_us(phase: str, mode: str, wire: str, W: int, T: int, H: int, K: int) -> float | None:
    """The issue's limit for ``phase`` ("dispatch" or "combine") in ``mode`` ("eager" or
    "graph", or their ``_b2b`` records) at this shape, in µs; ``None`` where it sets none."""
    if not at_goal_shape(W, T, H, K):
        return None
    mode = GOAL_MODES.get(mode, mode)
    return COMM_GOALS_US.get((phase, mode, wire), COMM_GOALS_US.get((phase, mode, None)))


def at_goal_shape(W: int, T: int, H: int, K: int) -> bool:
    """Whether the issue's goals apply: EP2 (W = 2 ranks), T = 128 tokens per rank,
    H = 7168, K = 8. They were set at EP2: a wider world moves more rows per token, so
    holding an EP4 or EP8 record to them would call it a miss (or a hit) of another goal."""
    return (W, T, H, K) == GOAL_SHAPE


def verdict(value: float, limit: float) -> str:
    """``"met"`` when ``value <= limit``, else ``"missed"``."""
    return "met" if value <= limit else "missed"


def _rows_per_rank(ids_TK, placement, layout: Layout) -> torch.Tensor:
    """Rows this rank sends to each rank ``[W]``: tokens with an expert there (Standard),
    or (token, expert) pairs (ExpertBatched)."""
    owner_TK = placement.owner_rank.to(ids_TK.device)[ids_TK]
    W = placement.ep_size
    if layout is Layout.EXPERT_BATCHED:
        return torch.bincount(owner_TK.reshape(-1), minlength=W)
    hit_TW = torch.zeros(ids_TK.shape[0], W, dtype=torch.bool, device=ids_TK.device)
    hit_TW.scatter_(1, owner_TK, True)
    return hit_TW.sum(0)


# ------------------------------------------------------------------------------ timing


def time_phases(
    phases: Sequence[Callable[[], Any]],
    *,
    warmup: int,
    iters: int,
    device: torch.device,
    before: Callable[[], None] | None = None,
) -> list[list[float]]:
    """Run ``phases`` one after another ``warmup`` times, then ``iters`` times timing each;
    returns each phase's milliseconds per iteration.

    On CUDA an event is recorded before the first phase and after each one, so a phase's
    time runs from the end of the previous one on the stream (host launch gaps count, as
    in an eager step). On CPU the host clock. ``before`` (a barrier, input copies) runs
    untimed before every timed iteration.
    """
    for _ in range(warmup):
        for phase in phases:
            phase()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    times: list[list[float]] = [[] for _ in phases]
    if cuda:  # (recorded again each iteration, after the last one's were waited for)
        events, stream = timing_events(len(phases) + 1, device)
    for _ in range(iters):
        if before is not None:
            before()
        if cuda:
            events[0].record(stream)
            for phase, event in zip(phases, events[1:]):
                phase()
                event.record(stream)
            events[-1].synchronize()
            for i in range(len(phases)):
                times[i].append(events[i].elapsed_time(events[i + 1]))
        else:
            stamps = [time.perf_counter()]
            for phase in phases:
                phase()
                stamps.append(time.perf_counter())
            for i in range(len(phases)):
                times[i].append((stamps[i + 1] - stamps[i]) * 1e3)
    return times


def time_stream(
    phases: Sequence[Callable[[], Any]],
    *,
    warmup: int,
    iters: int,
    device: torch.device,
    before: Callable[[], None] | None = None,
) -> list[list[float]]:
    """Like :func:`time_phases`, but the ``iters`` rounds run back to back: ``before`` once,
    then every phase of every round queued with no host wait, an event between phases. On
    CUDA a phase's time is the GPU's (the host's launch time shows only where it is the
    longer); on CPU the host clock per phase, as in :func:`time_phases`."""
    if device.type != "cuda":
        return time_phases(phases, warmup=warmup, iters=iters, device=device, before=before)
    for _ in range(warmup):
        for phase in phases:
            phase()
    torch.cuda.synchronize(device)
    # (made before ``before``: a barrier aligns the ranks as the timing starts)
    events, stream = timing_events(iters * len(phases) + 1, device)
    if before is not None:
        before()
    events[0].record(stream)
    i = 1
    for _ in range(iters):
        for phase in phases:
            phase()
            events[i].record(stream)
            i += 1
    events[-1].synchronize()
    times: list[list[float]] = [[] for _ in phases]
    for j in range(len(events) - 1):
        times[j % len(phases)].append(events[j].elapsed_time(events[j + 1]))
    return times


def capture_stream(
    phases: Sequence[Callable[[], Any]],
    rounds: int,
    device: torch.device,
    between: bool = True,
) -> tuple[torch.cuda.CUDAGraph, list[torch.cuda.Event]]:
    """One CUDA graph of ``rounds`` rounds of ``phases`` back to back, with a timing event
    recorded inside the graph between phases (``torch.cuda.Event(external=True)``), or
    with ``between=False`` only before the first and after the last (the events' own cost
    left out: time the graph as one phase and divide by ``rounds``); the caller has warmed
    the phases up on a side stream. See :func:`time_captured`."""
    count = rounds * len(phases) + 1 if between else 2
    events = [torch.cuda.Event(enable_timing=True, external=True) for _ in range(count)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        events[0].record()
        i = 1
        for _ in range(rounds):
            for phase in phases:
                phase()
                if between:
                    events[i].record()
                    i += 1
        if not between:
            events[1].record()
    return graph, events


def time_captured(
    graph: torch.cuda.CUDAGraph,
    events: list[torch.cuda.Event],
    num_phases: int,
    *,
    replays: int,
    device: torch.device,
    before: Callable[[], None] | None = None,
) -> list[list[float]]:
    """Each phase's milliseconds in a graph from :func:`capture_stream`, over ``replays``
    replays: the GPU's time per phase in a steady stream with no host in the way (one
    graph launch per ``rounds`` rounds, not per phase). The first replay warms up."""
    graph.replay()
    torch.cuda.synchronize(device)
    times: list[list[float]] = [[] for _ in range(num_phases)]
    for _ in range(replays):
        if before is not None:
            before()
        graph.replay()
        torch.cuda.synchronize(device)
        for j in range(len(events) - 1):
            times[j % num_phases].append(events[j].elapsed_time(events[j + 1]))
    return times


KERNEL_ROUNDS = 20  # aligned round trips profiled for eager_kernels
BUSY_CYCLES = 1_000_000  # ~0.5 ms of GPU spin before each: the host queues the round meanwhile


def phase_kernel_us(
    kernels: Sequence[tuple[str, float, float]], phases: Sequence[str], delimiter: str
) -> list[list[float]]:
    """Per round, the µs of GPU kernels whose names contain each of ``phases``.

    ``kernels``: ``(name, start_us, duration_us)`` of every GPU kernel of a profile, in any
    order; a kernel whose name contains ``delimiter`` (the GPU spin before each round)
    starts a round. Kernels before the first delimiter, and rounds in which a phase
    ran no kernel, are left out. Returns one list per phase, one sum per round."""
    rounds: list[list[float]] = []
    for name, _, duration in sorted(kernels, key=lambda k: k[1]):
        if delimiter in name:
            rounds.append([0.0] * len(phases))
            continue
        if not rounds:
            continue
        for i, phase in enumerate(phases):
            if phase in name:
                rounds[-1][i] += duration
                break
    rounds = [r for r in rounds if all(v > 0 for v in r)]
    return [[r[i] for r in rounds] for i in range(len(phases))]


def kernel_medians(
    kernels: Sequence[tuple[str, float, float]], delimiter: str, skip_first: str | None = None
) -> dict[str, float]:
    """The median µs per round of each GPU kernel by name: where a phase's time goes, e.g.
    a send half against its receive half, or an adapter's copies. ``kernels`` as in
    :func:`phase_kernel_us`; a kernel whose name contains ``delimiter`` starts a round (the
    kernels before the first are left out), and in each round the first kernel whose name
    contains ``skip_first`` (the all-reduce that aligns the ranks) is left out too. A
    kernel run twice in a round counts as their sum; its median is over the rounds it ran
    in."""
    rounds: list[dict[str, float]] = []
    skipped = True
    for name, _, duration in sorted(kernels, key=lambda k: k[1]):
        if delimiter in name:
            rounds.append({})
            skipped = skip_first is None
        elif rounds:
            if not skipped and skip_first in name:
                skipped = True
                continue
            rounds[-1][name] = rounds[-1].get(name, 0.0) + duration
    names = {n for r in rounds for n in r}
    return {n: median([r[n] for r in rounds if n in r]) for n in sorted(names)}


def time_kernels(
    dispatch: Callable[[], Any],
    combine: Callable[[], Any],
    device: torch.device,
    by_kernel: dict[str, float] | None = None,
) -> tuple[float, float] | str:
    """Median ms of the dispatch and the combine kernels launched eagerly, ranks aligned:
    DeepEP's own method (``bench_kineto`` with ``barrier_comm_profiling``). Before each of
    :data:`KERNEL_ROUNDS` round trips the GPU spins (the host queues the round meanwhile)
    and an all-reduce starts the ranks together; the profiler's kernel durations are summed
    per phase by name (``dispatch`` / ``combine``, as DeepEP's are picked). Host launch
    gaps do not count (``eager_b2b`` has them). A string says why it cannot run.
    ``by_kernel``: filled with this rank's :func:`kernel_medians` (every kernel of the
    rounds but the GPU spin and the all-reduce that aligns them)."""
    if device.type != "cuda" or not dist.is_initialized():
        return "n/a: kernel times need CUDA and a process group"
    from torch.profiler import ProfilerActivity, profile

    token = torch.ones(1, device=device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(KERNEL_ROUNDS):
            torch.cuda._sleep(BUSY_CYCLES)
            dist.all_reduce(token)
            dispatch()
            combine()
        torch.cuda.synchronize(device)
    kernels = [
        (e.name, e.time_range.start, e.time_range.elapsed_us())
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    # each round starts with the GPU spin (also at W = 1, where the all-reduce runs no kernel)
    d_us, c_us = phase_kernel_us(kernels, ("dispatch", "combine"), delimiter="spin_kernel")
    if by_kernel is not None:
        by_kernel.update(kernel_medians(kernels, "spin_kernel", skip_first="AllReduce"))
    if over_ranks(float(not d_us), device) > 0:  # every rank reports, or none
        return "n/a: no kernels named dispatch and combine in each round on every rank"
    return median(d_us) / 1e3, median(c_us) / 1e3


def graph_unavailable_reason(comm: AllToAll) -> str | None:
    """Why ``comm``'s dispatch and combine cannot be replayed from a CUDA graph here."""
    if comm.spec.device.type != "cuda":
        return "CUDA graphs need CUDA"
    if not comm.capabilities.graph_safe:
        return f"{comm.name} is not graph safe"
    return None


def capture_agreed(capture: Callable[[], Any], device: torch.device) -> tuple[Any, str | None]:
    """``(capture(), None)`` when every rank captured its graphs, else ``(None, why)`` on
    every rank, so that no rank replays a captured collective its peers do not."""
    try:
        captured, error = capture(), None
    except Exception as exc:  # noqa: BLE001 (reported in the record, then every rank skips)
        captured, error = None, f"{type(exc).__name__}: {exc}"
    if over_ranks(float(error is not None), device) > 0:
        return None, f"capture failed ({error or 'on another rank'})"
    return captured, None


def _replay_timing(loop: dict[str, Any]) -> dict[str, Any]:
    """:func:`time_captured`'s keywords from :func:`_phase_timing`'s."""
    return dict(device=loop["device"], before=loop["before"])


def _phase_timing(timing: dict[str, Any]) -> dict[str, Any]:
    """:func:`time_phases`' keywords from ``time_fn``'s (its barrier runs before each
    timed iteration)."""
    return dict(
        warmup=timing["warmup"],
        iters=timing["iters"],
        device=timing["device"],
        before=timing.get("barrier"),
    )


def warm_up_on_side_stream(fn: Callable[[], Any], times: int) -> None:
    """Eager runs on a side stream before a capture, as ``torch.cuda.graph`` requires."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(times, 1)):
            fn()
    torch.cuda.current_stream().wait_stream(side)


def identity_expert_out(result: DispatchResult, dtype: torch.dtype) -> torch.Tensor:
    """What experts that return their input give combine, in ``dtype``: the dispatched rows
    (FP8 rows times their scales), in the Standard layout weighted by the row's local router
    weights (its experts return weighted partial sums). Combine then returns
    ``x[t] · Σ_k w[t, k]`` whatever the layout."""
    if result.layout is Layout.STANDARD:
        rows, scale = result.hidden, result.hidden_scale
    else:  # (gathered when the rows were left in place)
        rows, scale = result.expert_rows()
    if scale is not None:  # dequantized a slice at a time: [e, W·M, H] in float32 need not fit
        out = torch.empty(rows.shape, dtype=dtype, device=rows.device)
        step = max(1, (1 << 28) // max(rows[0].numel(), 1))  # about 1 GB of float32
        for i in range(0, rows.shape[0], step):
            part = rows[i : i + step].float()
            part *= scale[i : i + step].repeat_interleave(FP8_GROUP, -1)[..., : rows.shape[-1]]
            out[i : i + step] = part
        rows = out
    if result.layout is Layout.STANDARD:
        local_RK = result.topk_ids >= 0
        rows = rows.float() * (result.topk_weights * local_RK).sum(-1, keepdim=True)
    return rows.to(dtype, copy=True)


def measure_dispatch_combine(
    comm: AllToAll,
    x_TH: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    timing: dict[str, Any],
) -> dict[str, Any]:
    """Median dispatch and combine milliseconds of ``comm`` on this rank, eager and (where
    :func:`graph_unavailable_reason` allows) from CUDA graphs, and each mode's round trip.

    ``timing``: ``time_fn``'s keywords (``warmup``, ``iters``, ``device``, ``barrier``).
    Returns ``{mode: (dispatch_ms, combine_ms) or "n/a: why"}`` for every mode of
    :data:`MODES`, and ``"eager_error"``, ``"graph_error"``. Combine is given one static tensor: the
    :func:`identity_expert_out` of the first dispatch. The errors come from one more
    untimed dispatch and combine per mode, that dispatch's identity output copied in
    between: the relative error of the output against ``x · Σ_k w`` (bf16 ~1e-3, FP8
    ~3e-2; rows within an expert may arrive in any order). Collective: every rank calls it.
    """
    device, dtype = x_TH.device, comm.spec.dtype
    loop = _phase_timing(timing)
    weight_sum_T1 = (weights_TK.float() * (ids_TK >= 0)).sum(-1, keepdim=True)
    expected_TH = x_TH.float() * weight_sum_T1
    first = comm.dispatch(x_TH, ids_TK, weights_TK)
    expert_out = identity_expert_out(first, dtype)
    comm.combine(expert_out, first)
    state: dict[str, Any] = {}
    by_kernel: dict[str, float] = {}

    def dispatch() -> None:
        state["result"] = comm.dispatch(x_TH, ids_TK, weights_TK)

    def combine() -> None:
        comm.combine(expert_out, state["result"])

    def both(timer, phases) -> tuple[float, float]:
        d_ms, c_ms = timer(phases, **loop)
        return median(d_ms), median(c_ms)

    out: dict[str, Any] = dict(
        eager=both(time_phases, [dispatch, combine]),
        eager_b2b=both(time_stream, [dispatch, combine]),
        eager_kernels=time_kernels(dispatch, combine, device, by_kernel),
        kernels_us=by_kernel,
        graph_error=None,
    )
    result = comm.dispatch(x_TH, ids_TK, weights_TK)
    expert_out.copy_(identity_expert_out(result, dtype))
    eager_TH = comm.combine(expert_out, result)
    out["eager_error"] = relative_error(eager_TH, expected_TH)
    reason = graph_unavailable_reason(comm)
    if reason is not None:
        out["graph"] = out["graph_b2b"] = f"n/a: {reason}"
        return out

    def capture() -> tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph, Any, torch.Tensor]:
        warm_up_on_side_stream(lambda: (dispatch(), combine()), timing["warmup"])
        dispatch_graph, combine_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(dispatch_graph):
            captured = comm.dispatch(x_TH, ids_TK, weights_TK)
        with torch.cuda.graph(combine_graph):
            combined_TH = comm.combine(expert_out, captured)
        return dispatch_graph, combine_graph, captured, combined_TH

    graphs, reason = capture_agreed(capture, device)
    if graphs is None:
        out["graph"] = out["graph_b2b"] = f"n/a: {reason}"
        return out
    dispatch_graph, combine_graph, captured, combined_TH = graphs
    out["graph"] = both(time_phases, [dispatch_graph.replay, combine_graph.replay])

    def capture_b2b():
        return capture_stream([dispatch, combine], STREAM_ROUNDS, device)

    stream, reason = capture_agreed(capture_b2b, device)
    if stream is None:
        out["graph_b2b"] = f"n/a: {reason}"
    else:
        d_ms, c_ms = time_captured(*stream, 2, replays=STREAM_REPLAYS, **_replay_timing(loop))
        out["graph_b2b"] = (median(d_ms), median(c_ms))
        stream, _ = capture_agreed(
            lambda: capture_stream([dispatch, combine], STREAM_ROUNDS, device, between=False),
            device,
        )
        if stream is not None:
            (ms,) = time_captured(*stream, 1, replays=STREAM_REPLAYS, **_replay_timing(loop))
            out["graph_roundtrip"] = median(ms) / STREAM_ROUNDS
    dispatch_graph.replay()
    expert_out.copy_(identity_expert_out(captured, dtype))
    combine_graph.replay()
    out["graph_error"] = relative_error(combined_TH, expected_TH)
    return out


# ------------------------------------------------------------------------------ backends


def backend_skip_reason(
    name: str,
    layout: Layout | None,
    spec: CommSpec | None,
    device: torch.device,
    group: dist.ProcessGroup | None,
) -> str | None:
    """Why backend ``name`` (with ``layout``; ``None``: its default) cannot be measured
    here for ``spec`` (``None``: any spec), or ``None`` when it can."""
    usable = available_backends(device, group)
    if name not in usable:
        return f"backend {name!r} is not registered in epmoe.comm"
    if usable[name] is not None:
        return f"{name} is unavailable: {usable[name]}"
    cls = backend_class(name)
    if layout is not None and layout not in cls.capabilities.layouts:
        return f"{name} has no {layout.value} layout"
    if spec is not None and spec.fp8_dispatch and not cls.capabilities.fp8_dispatch:
        return f"{name} has no FP8 dispatch"
    reason = cls.supports(spec) if spec is not None else None
    return f"{name} cannot serve this spec: {reason}" if reason is not None else None


def _a2a_cached(
    ctx: dict[str, Any], ids_TK, placement, layout: Layout, row_bytes: int, gathers: bool
) -> tuple[float, int]:
    """:func:`_a2a_reference` for the rows of ``layout`` (every token to every rank where
    the backend ``gathers``) of ``row_bytes`` bytes, measured once per T and key: the
    backends and phases that move the same rows share one baseline."""
    key = (layout, row_bytes, gathers)
    if key not in ctx["a2a"]:
        send_W = _rows_per_rank(ids_TK, placement, layout)
        if gathers:
            send_W = torch.full_like(send_W, ids_TK.shape[0])
        ctx["a2a"][key] = _a2a_reference(send_W, row_bytes, ids_TK.device, ctx["timing"])
    return ctx["a2a"][key]


def _a2a_reference(send_W: torch.Tensor, row_bytes: int, device, timing) -> tuple[float, int]:
    """Median ms (slowest rank) of an ``all_to_all_single`` of rows of ``row_bytes`` bytes
    with this rank sending ``send_W[r]`` rows to rank ``r``, and the most rows any rank
    receives."""
    recv_W = send_W.clone()
    if dist.is_initialized():
        dist.all_to_all_single(recv_W, send_W)
    send_l, recv_l = send_W.tolist(), recv_W.tolist()
    a_in = torch.randint(0, 256, (sum(send_l), row_bytes), dtype=torch.uint8, device=device)
    a_out = torch.empty(sum(recv_l), row_bytes, dtype=torch.uint8, device=device)
    if dist.is_initialized():
        fn = lambda: dist.all_to_all_single(a_out, a_in, recv_l, send_l)  # noqa: E731
    else:
        fn = lambda: a_out.copy_(a_in)  # noqa: E731
    ms = median(time_fn(fn, **timing))
    return over_ranks(ms, device), int(over_ranks(float(sum(recv_l)), device))


def entry_options(text: str) -> dict[str, Any]:
    """``key=value[,key=value]`` of a ``--backends`` entry → backend options: ints,
    ``true``/``false``, ``a/b`` tuples of ints (``nvl_chunks=20/8``)."""
    options: dict[str, Any] = {}
    for item in text.split(","):
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"backend option {item!r}: expected key=value")
        try:
            if raw.lower() in ("true", "false"):
                options[key] = raw.lower() == "true"
            elif "/" in raw:
                options[key] = tuple(int(v) for v in raw.split("/"))
            else:
                options[key] = int(raw)
        except ValueError:
            raise ValueError(
                f"backend option {item!r}: the value must be an int, true/false or ints "
                "joined by / (e.g. nvl_chunks=20/8)"
            ) from None
    return options


def budget_label(options: dict[str, Any]) -> str:
    """The options of a ``--backends`` entry as its series' name: ``num_sms=24,...``."""

    def text(v):
        return "/".join(map(str, v)) if isinstance(v, tuple) else str(v).lower()

    return ",".join(f"{k}={text(v)}" for k, v in options.items())


def _first_layout(name: str) -> str:
    """The layout of a backend named without one: Standard where it offers it."""
    layouts = backend_class(name).capabilities.layouts
    return (Layout.STANDARD if Layout.STANDARD in layouts else min(layouts, key=str)).value


# markers of a --backends entry that set one option: marker -> (option, value)
ENTRY_MARKERS = {
    "copy": ("rows_in_place", False),  # symm_ll's first design: received rows copied to slabs
    "fixed": ("worst_case_rows", True),  # deepep_ht's worst-case rows: no host sync, graph safe
}


@dataclass(frozen=True)
class BackendEntry:
    """One ``--backends`` entry, parsed once by the same code for the check before the run
    and for the run itself."""

    name: str
    layout: Layout
    options: dict[str, Any]  # the backend's constructor options
    label: str  # the records' ``backend``: the name and every marker and option it was given


# what bench comm's --backends takes (epmoe.bench.common checks the name and layout)
BACKENDS_SYNTAX = EntrySyntax(
    "--backends", "NAME[:LAYOUT[:SMs[:ROWS] | :copy | :fixed][:key=value[,key=value]]]", more=True
)


def parse_backend_entry(entry: str) -> BackendEntry:
    """``name[:layout[:SMs[:ROWS] | :copy | :fixed][:key=value[,key=value]]]`` → the
    backend, layout and options it names.

    The name and layout are checked by :func:`epmoe.bench.common.parse_backend_choice`
    (the layer benchmark's parser too); a name alone: its Standard layout where it offers
    it. ``SMs[:ROWS]``: symm_ht's SM budget and rows stored per flag (``num_sms``,
    ``tokens_per_flag``); ``copy``: symm_ll's ``rows_in_place=False``; ``fixed``:
    deepep_ht's ``worst_case_rows=True``; ``key=value``: any option (see
    :func:`entry_options`). The label keeps the markers and the key=value options, so that
    entries that differ by any of them make different series (the SMs and rows per flag
    are fields of their own: ``sms``, ``per_flag``)."""
    choice = parse_backend_choice(entry, BACKENDS_SYNTAX)
    try:
        options, label = _entry_options(choice)
    except ValueError as exc:
        raise BACKENDS_SYNTAX.error(entry, str(exc)) from None
    layout = choice.layout
    if layout is None:
        layout = Layout(_first_layout(choice.name) if choice.cls is not None else "standard")
    return BackendEntry(choice.name, layout, options, label)


def _entry_options(choice: BackendChoice) -> tuple[dict[str, Any], str]:
    """The backend options of the fields after an entry's layout, and the entry's label."""
    name, budget = choice.name, list(choice.more)
    keyvalue = entry_options(budget.pop()) if budget and "=" in budget[-1] else {}
    options: dict[str, Any] = {}
    label = name
    if len(budget) == 1 and budget[0] in ENTRY_MARKERS:
        option, value = ENTRY_MARKERS[budget[0]]
        options[option] = value
        label += f"/{budget.pop()}"
    if len(budget) > 2:
        raise ValueError("after the layout: SMs[:ROWS], copy or fixed, then key=value options")
    for option, text in zip(("num_sms", "tokens_per_flag"), budget):
        if option == "num_sms" and not text:  # (name:layout::ROWS: the default SMs)
            continue
        if not text.isdigit():
            markers = ", ".join(ENTRY_MARKERS)
            raise ValueError(
                f"{text!r} is not a count (after the layout: SMs[:ROWS], one of {markers}, or "
                "key=value options)"
            )
        options[option] = int(text)
    twice = sorted(set(options) & set(keyvalue))
    if twice:
        raise ValueError(f"{', '.join(twice)} given twice")
    options.update(keyvalue)
    if keyvalue:
        label += f"/{budget_label(keyvalue)}"
    if choice.cls is not None:
        check_backend_options(choice.cls, options)
    return options, label


def _backend_records(entry, spec, x_TH, ids_TK, weights_TK, placement, ctx) -> list[dict]:
    """The eager and graph records of one ``--backends`` entry (or one skip record)."""
    parsed = parse_backend_entry(entry)
    name, layout, options = parsed.name, parsed.layout, parsed.options
    wire = dtype_name(spec.wire_dtype)
    T, H, K = x_TH.shape[0], spec.hidden_size, spec.top_k
    base = dict(
        kind="comm", backend=parsed.label, layout=layout.value, wire=wire, **ctx["shape"], T=T
    )
    if "tokens_per_flag" in options:
        base["per_flag"] = options["tokens_per_flag"]
    reason = backend_skip_reason(name, layout, spec, x_TH.device, ctx["group"])
    if reason is not None:
        return [dict(base, mode="-", note=f"skipped: {reason}")]
    device = x_TH.device
    comm = create_backend(name, spec, ctx["group"], layout, **options)  # (options checked)
    try:
        m = measure_dispatch_combine(comm, x_TH, ids_TK, weights_TK, ctx["timing"])
        if ctx["profile"]:
            _profile(comm, x_TH, ids_TK, weights_TK, ctx["rank"], f"{entry} {wire} T={T}")
        sms = getattr(comm, "num_sms", None)
    finally:
        comm.close()

    row_bytes = wire_row_bytes(H, spec.wire_dtype)
    combine_row_bytes = H * spec.dtype.itemsize  # (combine moves rows in the hidden dtype)
    gathers = name in GATHERING_BACKENDS
    # NCCL moving the same rows as each phase: FP8 dispatch rows are about half a combine's
    a2a_dispatch_ms, recv_rows = _a2a_cached(ctx, ids_TK, placement, layout, row_bytes, gathers)
    a2a_combine_ms, _ = _a2a_cached(ctx, ids_TK, placement, layout, combine_row_bytes, gathers)
    dispatch_bytes = recv_rows * row_bytes
    combine_bytes = recv_rows * combine_row_bytes
    records = []
    for mode in MODES:
        times = m[mode]
        if isinstance(times, str):
            records.append(dict(base, mode=mode, note=times))
            continue
        d_ms, c_ms = (over_ranks(v, device) for v in times)
        rec = dict(
            base,
            mode=mode,
            dispatch_us=d_ms * 1e3,
            combine_us=c_ms * 1e3,
            sms=sms,
            recv_rows=recv_rows,
            dispatch_MB=dispatch_bytes / 1e6,
            combine_MB=combine_bytes / 1e6,
            dispatch_GBps=dispatch_bytes / (d_ms * 1e6),
            combine_GBps=combine_bytes / (c_ms * 1e6),
        )
        if mode == "graph_b2b" and "graph_roundtrip" in m:
            rec["roundtrip_us"] = over_ranks(m["graph_roundtrip"], device) * 1e3
        error = m["graph_error" if mode.startswith("graph") else "eager_error"]
        check_roundtrip(rec, over_ranks(error, device))
        if rec.get("wrong"):  # a wrong result meets no goal
            records.append(rec)
            continue
        if mode == "eager":
            rec.update(a2a_dispatch_us=a2a_dispatch_ms * 1e3, a2a_combine_us=a2a_combine_ms * 1e3)
            rec.update(dispatch_vs_a2a=a2a_dispatch_ms / d_ms)
            rec.update(combine_vs_a2a=a2a_combine_ms / c_ms)
        if mode == "eager_kernels" and m.get("kernels_us"):
            rec["kernels_us"] = dict(m["kernels_us"])  # (this rank's; rank 0's are kept)
        _add_goals(rec, mode, wire, ctx["shape"]["W"], T, H, K)
        records.append(rec)
    return records


def check_roundtrip(rec: dict, error: float | None) -> None:
    """Store ``roundtrip_error`` in ``rec``; beyond the wire's tolerance (or NaN) the record
    is marked ``wrong`` with a note: its timing measured a wrong result."""
    rec["roundtrip_error"] = error
    if is_wrong(rec):
        tol = ROUNDTRIP_TOLERANCE.get(rec["wire"], ROUNDTRIP_TOLERANCE_DEFAULT)
        rec.update(wrong=True, note=f"WRONG: round trip error {error:.2g} > {tol:g}")


def is_wrong(rec: dict) -> bool:
    """Whether a comm record's round trip missed its wire's tolerance (records written
    before the ``wrong`` mark are judged by their ``roundtrip_error``)."""
    error = rec.get("roundtrip_error")
    tol = ROUNDTRIP_TOLERANCE.get(rec.get("wire", ""), ROUNDTRIP_TOLERANCE_DEFAULT)
    return bool(rec.get("wrong")) or (error is not None and not error <= tol)


def _add_goals(rec: dict, mode: str, wire: str, W: int, T: int, H: int, K: int) -> None:
    if mode not in GOAL_MODES:
        return
    verdicts = []
    for phase in ("dispatch", "combine"):
        limit = comm_goal_us(phase, mode, wire, W, T, H, K)
        if limit is not None:
            rec[f"{phase}_goal_us"] = limit
            rec[f"{phase}_goal"] = verdict(rec[f"{phase}_us"], limit)
            verdicts.append(rec[f"{phase}_goal"])
    if verdicts:
        rec["goal"] = "/".join(verdicts)


def _profile(comm, x_TH, ids_TK, weights_TK, rank: int, title: str) -> None:
    """Where dispatch + combine spend their time: a profiler table on rank 0."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if x_TH.is_cuda:
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(5):
            result = comm.dispatch(x_TH, ids_TK, weights_TK)
            comm.combine(identity_expert_out(result, comm.spec.dtype), result)
        if x_TH.is_cuda:
            torch.cuda.synchronize()
    if rank == 0:
        print(f"--- profile: {title} (5 iterations)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        if x_TH.is_cuda:  # the kernels' own GPU times (what DeepEP's tests report)
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15))


# ------------------------------------------------------------------------------ ceiling


def _ceiling_records(wire_dtype, ids_TK, placement, ctx) -> list[dict]:
    """The peer-store ceiling for this routing and wire dtype: per pattern, eager and
    graph (or one record saying why it cannot run)."""
    T, K = ids_TK.shape
    wire = dtype_name(wire_dtype)
    base = dict(kind="ceiling", wire=wire, **ctx["shape"], T=T)
    if ctx["ceiling"] is None:
        return [dict(base, pattern="-", mode="-", note=f"n/a: {ctx['ceiling_reason']}")]
    from epmoe.bench import ceiling

    device, rank, W = ids_TK.device, ctx["rank"], placement.ep_size
    row_bytes = wire_row_bytes(ctx["shape"]["H"], wire_dtype)
    payload_TB = torch.randint(0, 256, (T, row_bytes), dtype=torch.uint8, device=device)
    owner_TK = placement.owner_rank.to(device)[ids_TK]
    device_sms = num_sms(device)
    loop = _phase_timing(ctx["timing"])
    records = []
    for pattern in ceiling.PATTERNS:
        messages = ceiling.peer_messages(owner_TK, rank, W, pattern)
        store = ceiling.PeerStore(ctx["ceiling"], payload_TB, messages, device_sms)
        stored = int(over_ranks(float(store.bytes_stored), device))  # the busiest sender's
        sms = int(over_ranks(float(store.num_programs), device))
        times, reasons = _ceiling_times(store.launch, loop)
        for mode in MODES:
            if mode == "eager_kernels":  # (a store is one kernel: eager_b2b times it)
                continue
            rec = dict(base, pattern=pattern, mode=mode)
            if mode not in times:
                records.append(dict(rec, note=f"n/a: {reasons[mode]}"))
                continue
            ms = over_ranks(times[mode], device)
            rec.update(us=ms * 1e3, sms=sms, MB=stored / 1e6, GBps=stored / (ms * 1e6))
            if mode == "graph_b2b" and "no_events" in times:
                rec["no_events_us"] = over_ranks(times["no_events"], device) * 1e3
            records.append(rec)
    return records


def _ceiling_times(
    launch: Callable[[], None], loop: dict[str, Any]
) -> tuple[dict[str, float], dict[str, str]]:
    """Median ms of one peer store (``launch``) per mode, ``"no_events"`` for a graph of
    stores without the events between them (per store), and why each mode missing from the
    times could not run: the graph's capture failure for both graph modes, or the stream
    graph's own where only that one failed (collective: every rank calls it)."""
    device = loop["device"]
    times = {
        "eager": median(time_phases([launch], **loop)[0]),
        "eager_b2b": median(time_stream([launch], **loop)[0]),
    }

    def capture() -> torch.cuda.CUDAGraph:
        warm_up_on_side_stream(launch, 1)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch()
        return graph

    graph, reason = capture_agreed(capture, device)
    if graph is None:
        return times, {"graph": str(reason), "graph_b2b": str(reason)}
    reasons: dict[str, str] = {}
    times["graph"] = median(time_phases([graph.replay], **loop)[0])
    stream, reason = capture_agreed(lambda: capture_stream([launch], STREAM_ROUNDS, device), device)
    if stream is None:
        reasons["graph_b2b"] = str(reason)
    else:
        (ms,) = time_captured(*stream, 1, replays=STREAM_REPLAYS, **_replay_timing(loop))
        times["graph_b2b"] = median(ms)
    stream, _ = capture_agreed(
        lambda: capture_stream([launch], STREAM_ROUNDS, device, between=False), device
    )
    if stream is not None:
        (ms,) = time_captured(*stream, 1, replays=STREAM_REPLAYS, **_replay_timing(loop))
        times["no_events"] = median(ms) / STREAM_ROUNDS
    return times, reasons


def _ceiling_unavailable_reason(
    device: torch.device, world_size: int, group: dist.ProcessGroup | None
) -> str | None:
    try:
        from epmoe.bench import ceiling
    except ImportError as exc:  # no triton here
        return f"the peer-store ceiling needs triton ({exc})"
    return ceiling.unavailable_reason(device, world_size, group)


def _ceiling_words(tokens: list[int], K: int, W: int, row_bytes: list[int]) -> int:
    """4-byte words of the receive buffer the largest ceiling case needs (per expert)."""
    from epmoe.bench.ceiling import padded_row_words

    return W * max(tokens) * K * max(padded_row_words(b) for b in row_bytes)


# ------------------------------------------------------------------------------ main


def wire_dtypes(args, dtype: torch.dtype) -> list[torch.dtype]:
    """The wire dtypes ``--dispatch-dtypes`` names (default: the hidden dtype and FP8)."""
    names = args.dispatch_dtypes or [dtype_name(dtype), FP8_NAME]
    out = []
    for name in names:
        if name not in (dtype_name(dtype), FP8_NAME):
            raise ValueError(
                f"--dispatch-dtypes {name}: a wire dtype is the hidden dtype "
                f"({dtype_name(dtype)}, set by --dtype) or {FP8_NAME}"
            )
        out.append(getattr(torch, name))
    return out


def wire_spec(H, K, placement, M, dtype, device, wire: torch.dtype) -> CommSpec:
    """The spec of a benchmark case: ``M`` tokens per rank at most, rows on the wire in
    ``wire`` (the hidden ``dtype``, or FP8)."""
    return CommSpec(
        hidden_size=H,
        top_k=K,
        rank_offsets=placement.rank_offsets,
        max_num_tokens=M,
        dtype=dtype,
        device=device,
        dispatch_dtype=None if wire == dtype else wire,
    )


def _link_bandwidth(dtype, H, W, device, timing) -> float | None:
    """GB/s sent per rank by a large ``all_to_all_single`` (64 MiB to every peer); ``None``
    on one rank, where no link is used (JSON ``null``: a NaN would be written as ``NaN``,
    which is no JSON)."""
    if W == 1:
        return None
    rows = (64 << 20) // (H * dtype.itemsize)
    big = torch.randn(rows * W, H, device=device).to(dtype)
    big_out = torch.empty_like(big)
    ms = over_ranks(median(time_fn(lambda: dist.all_to_all_single(big_out, big), **timing)), device)
    return rows * (W - 1) * H * dtype.itemsize / (ms * 1e6)


def goal_summary(records: list[dict], backend: str = GOAL_BACKEND) -> list[str]:
    """One line per goal of ``backend`` at the goal shape: value, limit, met/missed."""
    W, T, H, K = GOAL_SHAPE
    rows = [r for r in records if r.get("kind") == "comm" and r["backend"] == backend]
    rows = [r for r in rows if at_goal_shape(r["W"], r["T"], r["H"], r["K"])]
    rows = [r for r in rows if r["mode"] in GOAL_MODES or "dispatch_us" not in r]
    if not rows:
        return [
            f"{backend}: no record at W={W}, T={T}, H={H}, K={K} (pass --tokens {T} at that "
            f"shape on {W} ranks)"
        ]
    lines = []
    for r in rows:
        label = f"{backend}:{r['layout']} {r['wire']} {r['mode']}"
        if "dispatch_us" not in r or r.get("wrong"):
            lines.append(f"{label}: {r.get('note', 'not measured')}")
            continue
        for phase in ("dispatch", "combine"):
            if f"{phase}_goal" in r:
                lines.append(
                    f"{label} {phase}: {r[f'{phase}_us']:.1f} µs, goal ≤ "
                    f"{r[f'{phase}_goal_us']:g} µs: {r[f'{phase}_goal']}"
                )
    return lines


SMALL = dict(hidden=256, num_experts=16, top_k=4, tokens=[1, 16, 64], iters=5, warmup=2)
FULL = dict(hidden=7168, num_experts=256, top_k=8, tokens=[1, 128, 512], iters=30, warmup=5)


HIDDEN_DTYPES = ("bfloat16", "float16", "float32")


def _tokens_problem(tokens: list[int] | None) -> str | None:
    if tokens is not None and min(tokens) < 1:
        return (
            f"--tokens must be positive token counts per rank, got {tokens} (a dispatch of "
            "0 tokens is valid, but has nothing to time)"
        )
    return None


def check_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the options that argparse does not check, or ``None``: before the
    process group starts, not as a traceback on every rank once it has."""
    if args.dtype not in HIDDEN_DTYPES:
        return f"--dtype must be one of {', '.join(HIDDEN_DTYPES)}, got {args.dtype!r}"
    try:
        wire_dtypes(args, getattr(torch, args.dtype))
        for entry in args.backends:
            parse_backend_entry(entry)  # (the parser the run uses)
    except ValueError as exc:
        return str(exc)
    problem = _tokens_problem(args.tokens)
    if problem:
        return problem
    defaults = SMALL if args.small else FULL
    for name in ("hidden", "num_experts", "top_k", "iters"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} must be positive, got {value}"
    if args.warmup is not None and args.warmup < 0:
        return f"--warmup must be 0 or more, got {args.warmup}"
    E = args.num_experts or defaults["num_experts"]
    K = args.top_k or defaults["top_k"]
    if K > E:
        return f"--top-k {K} is more than the {E} experts (--num-experts)"
    return None


def main(args) -> list[dict] | None:
    for name, value in (SMALL if args.small else FULL).items():
        if getattr(args, name, None) is None:  # (options given explicitly win)
            setattr(args, name, value)
    problem = _tokens_problem(args.tokens)
    if problem:
        raise SystemExit(problem)
    group, rank, W, device = distributed_setup()
    if device.type == "cpu" and args.hidden * max(args.tokens) > 2**20 and rank == 0:
        print(
            f"note: H={args.hidden} at {max(args.tokens)} tokens on CPU (gloo) takes minutes; "
            "--small checks the benchmark in seconds",
            file=sys.stderr,
            flush=True,
        )
    dtype = getattr(torch, args.dtype)
    wires = wire_dtypes(args, dtype)
    H, E, K = args.hidden, args.num_experts, args.top_k
    placement = epmoe.ExpertPlacement.linear(E, W)
    barrier = (lambda: dist.barrier()) if group is not None else None
    timing = dict(warmup=args.warmup, iters=args.iters, device=device, barrier=barrier)
    link_GBps = _link_bandwidth(dtype, H, W, device, timing)

    ceiling_reason = _ceiling_unavailable_reason(device, W, group)
    buffers = None
    if ceiling_reason is None:
        from epmoe.bench import ceiling

        words = _ceiling_words(args.tokens, K, W, [wire_row_bytes(H, w) for w in wires])
        buffers = ceiling.ReceiveBuffers(words, group, device)
    ctx = dict(
        group=group,
        rank=rank,
        profile=args.profile,
        shape=dict(W=W, H=H, K=K, E=E, dtype=args.dtype),
        timing=timing,
        ceiling=buffers,
        ceiling_reason=ceiling_reason,
    )
    records: list[dict] = []
    for T in progress(args.tokens, "comm"):
        sim = RoutingSimulator(num_experts=E, top_k=K, seed=rank)
        weights, ids = sim.sample(T, device=device)
        x = torch.randn(T, H, device=device).to(dtype)
        ctx["a2a"] = {}  # (layout, row bytes, gathers) -> (ms, rows): _a2a_cached, per T
        for wire in wires:
            records += _ceiling_records(wire, ids, placement, ctx)
            spec = wire_spec(H, K, placement, T, dtype, device, wire)
            for entry in args.backends:
                records += _backend_records(entry, spec, x, ids, weights, placement, ctx)
        if rank == 0 and getattr(args, "out", None):  # what a later T's failure leaves
            write_json(records, args.out, benchmark="comm", partial=f"up to T={T}")
    if buffers is not None:
        buffers.close()
    for rec in records:
        rec["link_GBps"] = link_GBps
    if rank == 0:
        print(table([r for r in records if r["kind"] == "comm"], COMM_COLUMNS))
        print()
        print(table([r for r in records if r["kind"] == "ceiling"], CEILING_COLUMNS))
        if link_GBps is None:
            print("\nlink: none (one rank)")
        else:
            print(
                f"\nlink: a 64 MiB-per-peer all_to_all_single sends {link_GBps:.0f} GB/s per rank"
            )
        print("goals (the symm_ll issue):")
        for line in goal_summary(records):
            print("  " + line)
        broken_down = [r for r in records if r.get("kernels_us")]
        if broken_down:
            print("\nkernels per round trip (eager_kernels, rank 0, median µs):")
        for r in broken_down:
            parts = ", ".join(f"{n[:48]} {us:.1f}" for n, us in r["kernels_us"].items())
            print(f"  {r['backend']}:{r['layout']} {r['wire']} T={r['T']} SMs {r['sms']}: {parts}")
        wrong = [r for r in records if r.get("wrong")]
        for r in wrong:
            print(f"WRONG RESULT: {r['backend']}:{r['layout']} {r['wire']} T={r['T']} "
                  f"{r['mode']}: {r['note']}")  # fmt: skip
    if group is not None:
        dist.destroy_process_group()
    return records if rank == 0 else None
