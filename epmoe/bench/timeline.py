"""Where the time of a ``symm_ll`` dispatch and combine goes, program by program.

Run on every rank (CUDA, torchrun), e.g. on 2 GPUs:

    python launch/run.py --nproc 2 -m epmoe.bench timeline --tokens 128 --out results/tl.json

The fused kernels of both phases are given a stamp table (``SymmLLBackend.stamps_*``):
each program writes the GPU's global timer when it reaches each of its steps. Rounds of
dispatch then combine (identity experts) are captured in one CUDA graph, as the comm
benchmark's ``graph_b2b`` mode, and replayed; after each replay the last round's stamps
are read. Per (phase, role, step) a record gives the earliest, median and latest program
in µs after the kernel's first program started (medians over replays), and per phase
the span from the first program's start to the last stamp, next to the phase's time
between CUDA events (what the comm benchmark reports): their difference is the launch
and drain around the kernel, and the events' own cost. ``no events``: the phase in the
same rounds captured without events between phases, the dispatch's part from its first
program's start to the combine's (the GPU timer), the combine's the rest of a round
trip (events around all rounds; the split is the last round's, the round trip the mean of
the rounds). ``after dispatch``: from the dispatch's last stamp to the
combine's first program start.

Steps (a stamp a program never writes, e.g. the flag of a combine program with no row
to send, is left out; a receiver whose token does not come stamps its steps when it
learns so, from the count):

* dispatch ``announce`` (its own program): start, count sent;
* dispatch ``send`` (a program per token): start, stores issued, fenced (the stores are
  complete), flags written;
* dispatch ``recv self`` / ``recv peer`` (a program per (source, token slot); the
  rank's own tokens apart from its peers'): start, token seen, rows taken (counter and
  position known), done;
* combine ``send`` (a program per (source, token slot)): start, row stored, flag written;
* combine ``recv`` (a program per token): start, every rank started, rows seen, done.

Shape legend: T tokens per rank · H hidden · K top-k · E experts · W ranks · M = M_max.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist

import epmoe
from epmoe.bench.common import distributed_setup, format_table, median
from epmoe.comm import CommSpec
from epmoe.routing import RoutingSimulator

STEPS = {
    ("dispatch", "announce"): {0: "start", 2: "count sent"},
    ("dispatch", "send"): {0: "start", 1: "stores issued", 2: "fenced", 3: "flags written"},
    ("dispatch", "recv self"): {0: "start", 1: "token seen", 2: "rows taken", 3: "done"},
    ("dispatch", "recv peer"): {0: "start", 1: "token seen", 2: "rows taken", 3: "done"},
    ("combine", "send"): {0: "start", 1: "row stored", 2: "flag written"},
    ("combine", "recv"): {0: "start", 1: "all started", 2: "rows seen", 3: "done"},
}
COLUMNS = ["rank", "wire", "T", "phase", "role", "step", "first_us", "median_us", "last_us"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, nargs="+", default=[128], help="T per rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--num-experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--dispatch-dtypes",
        nargs="+",
        default=None,
        help="wire dtypes of dispatch: the hidden dtype and/or float8_e4m3fn (default: both)",
    )
    p.add_argument("--rounds", type=int, default=10, help="round trips per captured graph")
    p.add_argument("--replays", type=int, default=20)


def _roles(T: int, W: int, M: int, rank: int) -> dict[tuple[str, str], list[int]]:
    """Program ids of each (phase, role) in the fused kernels' grids (the dispatch's
    receivers of this rank's own tokens apart from those of its peers' tokens)."""
    recv = range(1 + T, 1 + T + W * M)
    return {
        ("dispatch", "announce"): [0],
        ("dispatch", "send"): list(range(1, 1 + T)),
        ("dispatch", "recv self"): [p for p in recv if (p - 1 - T) // M == rank],
        ("dispatch", "recv peer"): [p for p in recv if (p - 1 - T) // M != rank],
        ("combine", "send"): list(range(0, W * M)),
        ("combine", "recv"): list(range(W * M, W * M + max(T, 1))),
    }


def _summaries(stamps: dict[str, torch.Tensor], roles) -> dict[tuple, tuple[float, float, float]]:
    """``{(phase, role, step): (first, median, last)}`` µs after each phase's first start,
    and ``(phase, "", "span")``: the last stamp of the phase."""
    out: dict[tuple, tuple[float, float, float]] = {}
    ends = {}
    for phase, table in stamps.items():
        t0 = table[:, 0][table[:, 0] > 0].min()
        ends[phase] = (t0, table.max())
        span = 0.0
        for (ph, role), pids in roles.items():
            if ph != phase or not pids:
                continue
            rows = table[pids]
            for i, step in STEPS[(ph, role)].items():
                col = rows[:, i]
                col = (col[col > 0] - t0).double() / 1e3
                if col.numel():
                    first, mid, last = col.min().item(), col.median().item(), col.max().item()
                    out[(phase, role, step)] = (first, mid, last)
                    span = max(span, last)
        out[(phase, "", "span")] = (span, span, span)
    gap = (ends["combine"][0] - ends["dispatch"][1]).item() / 1e3
    out[("combine", "", "after dispatch")] = (gap, gap, gap)
    return out


def _measure(spec: CommSpec, T: int, group, device, args) -> list[dict[str, Any]]:
    from epmoe.bench.comm import (
        capture_stream,
        identity_expert_out,
        time_captured,
        warm_up_on_side_stream,
    )
    from epmoe.comm.symm import ll

    W = dist.get_world_size(group) if group is not None else 1
    comm = ll.SymmLLBackend(spec, group)
    M = spec.max_num_tokens
    sim = RoutingSimulator(num_experts=args.num_experts, top_k=args.top_k, seed=comm.rank)
    weights, ids = sim.sample(T, device=device)
    x = torch.randn(T, args.hidden, device=device).to(spec.dtype)
    roles = _roles(T, W, M, comm.rank)
    stamps = {
        "dispatch": torch.zeros(1 + T + W * M, 8, dtype=torch.int64, device=device),
        "combine": torch.zeros(W * M + max(T, 1), 8, dtype=torch.int64, device=device),
    }
    try:
        first = comm.dispatch(x, ids, weights)
        y = identity_expert_out(first, spec.dtype)
        comm.combine(y, first)
        comm.stamps_dispatch, comm.stamps_combine = stamps["dispatch"], stamps["combine"]
        state: dict[str, Any] = {}

        def dispatch() -> None:
            state["r"] = comm.dispatch(x, ids, weights)

        def combine() -> None:
            comm.combine(y, state["r"])

        warm_up_on_side_stream(lambda: (dispatch(), combine()), 3)
        graph, events = capture_stream([dispatch, combine], args.rounds, device)
        per_replay, d_ms, c_ms = [], [], []
        for _ in range(args.replays):
            for table in stamps.values():
                table.zero_()
            d, c = time_captured(graph, events, 2, replays=1, device=device)
            d_ms += d
            c_ms += c
            per_replay.append(_summaries({k: v.cpu() for k, v in stamps.items()}, roles))
        # the same rounds with no events between phases: the round trip from the events
        # around them, the dispatch's part from its first program's start to the combine's
        graph, events = capture_stream([dispatch, combine], args.rounds, device, between=False)
        no_events = []
        for _ in range(args.replays):
            for table in stamps.values():
                table.zero_()
            (ms,) = time_captured(graph, events, 1, replays=1, device=device)
            starts = [t[:, 0][t[:, 0] > 0].min().item() for t in stamps.values()]
            d_us = (starts[1] - starts[0]) / 1e3
            no_events.append((d_us, ms[0] * 1e3 / args.rounds - d_us))
        comm.check()
    finally:
        comm.close()
    records = [
        _record(*key, *(median(s[key][i] for s in per_replay) for i in range(3)))
        for key in per_replay[0]
    ]
    for i, (phase, ms) in enumerate((("dispatch", d_ms), ("combine", c_ms))):
        records.append(_record(phase, "", "events", *[median(ms) * 1e3] * 3))
        records.append(_record(phase, "", "no events", *[median(n[i] for n in no_events)] * 3))
    return records


def _record(phase: str, role: str, step: str, first: float, mid: float, last: float) -> dict:
    """One row of the table: a step's earliest, median and latest program, in µs."""
    return dict(phase=phase, role=role, step=step, first_us=first, median_us=mid, last_us=last)


def main(args) -> list[dict] | None:
    group, rank, W, device = distributed_setup()
    if device.type != "cuda":
        raise SystemExit("the timeline reads the GPU's timer: run it on CUDA")
    from epmoe.bench.comm import dtype_name, wire_dtypes, wire_spec

    dtype = getattr(torch, args.dtype)
    wires = wire_dtypes(args, dtype)
    placement = epmoe.ExpertPlacement.linear(args.num_experts, W)
    records: list[dict] = []
    for T in args.tokens:
        for wire in wires:
            spec = wire_spec(args.hidden, args.top_k, placement, T, dtype, device, wire)
            for rec in _measure(spec, T, group, device, args):
                records.append(dict(kind="timeline", rank=rank, wire=dtype_name(wire), T=T, **rec))
    if group is not None:
        gathered: list[Any] = [None] * W
        dist.all_gather_object(gathered, records)
        records = [r for part in gathered for r in part]
        dist.destroy_process_group()
    if rank == 0:
        print(format_table(records, COLUMNS))
    return records if rank == 0 else None
