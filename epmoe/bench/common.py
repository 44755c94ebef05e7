"""Timing, reporting and argument helpers shared by the benchmarks.

Timing follows one rule: warm up, then time each repetition with CUDA events (or the host
clock on CPU after a synchronisation), and report the median. Backends named on a command
line are checked by one parser (:func:`parse_backend_choice`), so that every benchmark
refuses the same mistake with the same message.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from epmoe.comm import backend_class, backend_names
from epmoe.comm.base import AllToAll, Layout
from epmoe.distributed import default_device

T = TypeVar("T")


def timing_events(count: int, device: torch.device) -> tuple[list[torch.cuda.Event], Any]:
    """``count`` timing events, each recorded once already, and the current stream of
    ``device`` to record them on: ``event.record(stream)``.

    An event's first record creates it in the driver and ``record()`` without a stream
    builds a Python ``Stream`` object: together 16 µs of host time per record on one
    H200's host (docs/benchmarks.md), which a host-bound phase timed between two events
    would count as its own (the GPU reaches the event only once the host has queued it)."""
    stream = torch.cuda.current_stream(device)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
    for event in events:
        event.record(stream)
    torch.cuda.synchronize(device)
    return events, stream


def time_fn(
    fn: Callable[[], Any],
    *,
    warmup: int = 5,
    iters: int = 20,
    device: torch.device | str | None = None,
    barrier: Callable[[], None] | None = None,
    back_to_back: bool = False,
) -> list[float]:
    """Run ``fn`` ``warmup`` times, then time ``iters`` runs; returns each run's milliseconds.

    On CUDA each run is bracketed by events on the current stream; on CPU by
    ``time.perf_counter``. ``barrier`` (e.g. a ``dist.barrier``) runs before every timed run
    so that ranks start together in collective benchmarks.

    By default the host waits for each run before it launches the next, so a run's time
    includes the host's latency to launch its first kernel onto an idle GPU (what an eager
    caller sees). ``back_to_back`` (CUDA, no ``barrier``) enqueues every run before it
    waits: while the host keeps ahead of the GPU, each run's events bracket its GPU work
    alone (the first run, which starts on an idle GPU, is dropped from the result) — the
    kernels' own time, as a CUDA graph or a busy serving loop sees it. (An ``fn`` that waits
    for the GPU itself, e.g. ``.item()``, is timed as without it.)
    """
    device = torch.device(device) if device is not None else _default_device()
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if back_to_back and device.type == "cuda" and barrier is None:
        flat, stream = timing_events(2 * (iters + 1), device)
        events = list(zip(flat[::2], flat[1::2]))
        for start, end in events:
            start.record(stream)
            fn()
            end.record(stream)
        events[-1][1].synchronize()  # (the stream the events were recorded on)
        return [start.elapsed_time(end) for start, end in events[1:]]
    times: list[float] = []
    if device.type == "cuda":  # (recorded again each run, after the last run's were waited for)
        (start, end), stream = timing_events(2, device)
    for _ in range(iters):
        if barrier is not None:
            barrier()
        if device.type == "cuda":
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def distributed_setup() -> tuple[Any, int, int, torch.device]:
    """``(group, rank, world_size, device)`` for a benchmark started by torchrun (or alone)."""
    import torch.distributed as dist

    import epmoe

    group = epmoe.init_distributed()
    rank, world = (dist.get_rank(), dist.get_world_size()) if group is not None else (0, 1)
    return group, rank, world, _default_device()


def over_ranks(value: float, device: torch.device, op: str = "max") -> float:
    """``value`` reduced over all ranks (``"max"``: a collective ends with its slowest
    rank; ``"sum"``: totals). The identity without torch.distributed."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return value
    # a NaN on one rank must come out NaN on every rank (MAX would drop it): as inf there
    nan = value != value
    t = torch.tensor([float("inf") if nan else value, float(nan)], dtype=torch.float64)
    t = t.to(device)
    dist.all_reduce(t[:1], op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    dist.all_reduce(t[1:], op=dist.ReduceOp.MAX)
    total, any_nan = t.tolist()
    return float("nan") if any_nan else total


def copy_bandwidth(device: torch.device, timing: dict[str, Any]) -> float:
    """Device copy bandwidth, bytes read + written per second, of a large ``copy_``
    (1 GiB on CUDA, 64 MiB on the CPU), the slowest rank's: what reading weights of a
    given size costs (``timing``: :func:`time_fn`'s keywords)."""
    n = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = over_ranks(median(time_fn(lambda: dst.copy_(src), **timing)), device)
    return 2 * n / (ms * 1e-3)


def median(xs: Iterable[float]) -> float:
    return statistics.median(list(xs))


def _default_device() -> torch.device:
    """Where the benchmark's tensors live: ``epmoe.distributed.default_device`` (CPU for a
    gloo world, else the current CUDA device with its index, else CPU)."""
    return default_device()


def machine_info() -> dict[str, Any]:
    """Where a result was measured: host, devices and software versions."""
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["num_gpus"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    return info


def progress(items: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
    """A progress bar on stderr for a sweep, on rank 0 only: ``tqdm`` when installed
    (``pip install "epmoe[bench]"``), else a plain line (silent when stderr is not a
    terminal)."""
    items = list(items)
    total = len(items) if total is None else total
    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        yield from tqdm(items, desc=desc, total=total, disable=not rank0, leave=False)
        return
    show = sys.stderr.isatty() and rank0
    for i, item in enumerate(items):
        if show:
            width = 30
            done = int(width * i / max(total, 1))
            sys.stderr.write(f"\r{desc} [{'#' * done}{'.' * (width - done)}] {i}/{total}")
            sys.stderr.flush()
        yield item
    if show:
        sys.stderr.write(f"\r{desc} [{'#' * 30}] {total}/{total}\n")


def write_json(records: list[dict[str, Any]], path: str, **meta: Any) -> None:
    """Write ``{"machine": ..., "meta": ..., "records": [...]}`` to ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"machine": machine_info(), "meta": meta, "records": records}, f, indent=1)


def format_table(records: list[dict[str, Any]], columns: list[str]) -> str:
    """A plain-text table of ``columns``: floats of 100 and more as whole numbers, smaller
    ones to 3 significant digits (never an exponent for large values)."""

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            if v != v:  # NaN
                return "nan"
            return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"
        return str(v)

    rows = [[fmt(r.get(c, "")) for c in columns] for r in records]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ backend entries

AUTO = "auto"  # EPMoE's backend="auto": the layer's own choice of a backend


@dataclass(frozen=True)
class EntrySyntax:
    """What one option that names backends accepts (``--backends`` of a benchmark): the
    parts of :func:`parse_backend_choice`'s syntax it takes, and the words of its messages."""

    argument: str  # the option, named in every message: "--backends"
    usage: str  # the entry's form, shown when it has fields the option does not take
    auto: bool = False  # "auto" (the layer's choice) is a name
    layout: bool = True  # NAME:LAYOUT
    more: bool = False  # fields after the layout (bench comm's options), returned unparsed

    def error(self, entry: str, problem: str) -> ValueError:
        """The one form of every message about an entry: the option, the entry, the fix."""
        return ValueError(f"{self.argument} {entry!r}: {problem}")


@dataclass(frozen=True)
class BackendChoice:
    """A backend and layout named on the command line, checked against the registry."""

    name: str  # a registered backend, or "auto" where the syntax takes it
    layout: Layout | None  # None: not given (the backend's default)
    cls: type[AllToAll] | None  # the backend's class; None for auto or where it won't import
    more: tuple[str, ...] = ()  # the fields after the layout, where the syntax takes them


def parse_backend_choice(entry: str, syntax: EntrySyntax) -> BackendChoice:
    """``NAME[:LAYOUT[:MORE...]]`` as far as ``syntax`` takes it → the backend and layout
    it names; a ``ValueError`` naming the option and the fix for an unknown name, layout,
    a layout the backend does not offer, or fields the option does not take. Checked
    before the run (not as a traceback on every rank once it has started) and parsed again
    by the same code for the run. A backend whose module does not import here is not
    checked further: the run records it as skipped, saying why."""
    name, *fields = entry.split(":")
    if (fields and not syntax.layout) or (len(fields) > 1 and not syntax.more):
        raise syntax.error(entry, f"expected {syntax.usage}")
    names = backend_names()
    if name not in names and not (syntax.auto and name == AUTO):
        hint = " ('auto' is the layer's choice of one; name each backend to measure)"
        raise syntax.error(
            entry,
            f"unknown backend {name!r}{hint if name == AUTO else ''}; the backends are "
            f"{', '.join(names)}{' or auto' if syntax.auto else ''}",
        )
    try:
        cls = backend_class(name) if name != AUTO else None
    except ImportError:  # (the run records it as skipped, saying why)
        cls = None
    if not fields:
        return BackendChoice(name, None, cls)
    layouts = [x.value for x in Layout]
    if fields[0] not in layouts:
        raise syntax.error(entry, f"layout {fields[0]!r} is not one of {', '.join(layouts)}")
    layout = Layout(fields[0])
    if cls is not None and layout not in cls.capabilities.layouts:
        offered = ", ".join(x.value for x in cls.capabilities.layouts)
        raise syntax.error(entry, f"{name} has no {layout.value} layout (it offers {offered})")
    return BackendChoice(name, layout, cls, tuple(fields[1:]))
