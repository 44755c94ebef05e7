"""Run a test body on W ranks of a real process group: gloo on CPU, NCCL on GPUs.

Starting a rank costs seconds (importing torch), so each (world size, backend) gets a pool
of W worker processes, started once ("spawn"), each with ``torch.distributed`` initialised
(WORLD = the W ranks) and reused by every later test. A task is an importable function;
every rank calls ``fn(rank, world_size, *args, **kwargs)`` and its return value comes back.

Writing a distributed test::

    # tests/distributed/test_example.py: the rank body lives at module level (children import it)
    import pytest, torch, torch.distributed as dist
    from tests.harness import requires_world, run_on_ranks, test_device

    def _sum_body(rank, world_size, n):          # WORLD is initialised on every rank
        dev = test_device()                        # "cuda" (NCCL ranks: cuda:rank is current)
        x = torch.arange(n, dtype=torch.float32, device=dev) + rank
        dist.all_reduce(x)
        return x.cpu()                             # return CPU tensors or plain values

    @pytest.mark.parametrize("world_size", [1, 2, 3, 4])
    def test_sum(world_size):
        requires_world(world_size)                 # GPU tier: skip when GPUs are too few
        outs = run_on_ranks(_sum_body, world_size, n=5)   # one result per rank, rank order

Rules for rank bodies:

* Every rank enters the same collectives in the same order; decide skips and early returns
  on all ranks alike, or the others block in a collective (reported as a failure or timeout).
* ``assert`` in a rank body is not rewritten by pytest: give it a message, or use
  ``torch.testing.assert_close`` / ``epmoe.reference.assert_close``.
* Many cases in one task: ``sweep = Sweep()``; ``with sweep.case("W=2 naive"): ...``;
  ``sweep.check()`` at the end. Put a case's assertions after its last collective: a case
  that raises on one rank before a collective desynchronises the group.
* The processes live on: leave no global state changed (default dtype, env, seeds are
  yours to set). Process-wide one-shot state (NVSHMEM init, symmetric-memory backend) needs
  ``run_on_ranks(..., isolated=True)``: a fresh pool, closed afterwards.

Failures: a raising rank gives ``RankFailure`` with every failing rank's traceback; a rank
that dies is reported with its exit code; ``pytest.skip`` in a rank skips the test; past
the timeout (``timeout_s``, else env ``EPMOE_TEST_TIMEOUT``, 120 s) all ranks are killed and
``RankTimeout`` names the unfinished ranks with their Python stacks. A pool that may be out
of step (a rank missing after a failure) is killed and the next call starts a fresh one.
Environment: ``EPMOE_TEST_DEVICE=cuda`` selects NCCL and the GPU tier (default ``cpu``).
``EPMOE_TEST_RANKS_PER_GPU=N`` (GPU tier) puts N ranks on each GPU, for multi-rank
correctness where GPUs are fewer than ranks: NCCL refuses two ranks on one GPU, so their
group is gloo for both devices (``"cpu:gloo,cuda:gloo"``: CUDA tensors staged through the
host) and rank r uses ``cuda:(r // N)``. Kernels that wait for a peer on the same GPU make
progress as the GPU time-slices the processes, so any timing taken this way is
meaningless; collectives gloo lacks for CUDA tensors (send/recv) fail.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import textwrap
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import wait
from typing import Any

import pytest
import torch
import torch.distributed as dist

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_GRACE_S = 3.0  # after a rank fails, how long the others get to reply before the pool is killed
_STOP_S = 5.0  # how long a graceful shutdown may take before the ranks are killed
_OK = ("ok", "ready")  # reply statuses that leave the pool in step


class RankFailure(RuntimeError):
    """One or more ranks raised, died or skipped out of step; the message holds their tracebacks."""


class RankTimeout(TimeoutError):
    """Some ranks did not finish in time; they were killed and the message names them."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for launching torchrun or scripts in a test)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_device() -> str:
    """``"cuda"`` when env ``EPMOE_TEST_DEVICE=cuda`` (the GPU tier), else ``"cpu"``."""
    value = os.environ.get("EPMOE_TEST_DEVICE", "").strip().lower() or "cpu"
    if value not in ("cpu", "cuda"):
        raise ValueError(f"EPMOE_TEST_DEVICE must be 'cpu' or 'cuda', got {value!r}")
    return value


test_device.__test__ = False  # a helper, not a test, in modules that import it


def ranks_per_gpu() -> int:
    """Env ``EPMOE_TEST_RANKS_PER_GPU`` (default 1): ranks sharing each GPU in the GPU tier."""
    raw = os.environ.get("EPMOE_TEST_RANKS_PER_GPU", "").strip() or "1"
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"EPMOE_TEST_RANKS_PER_GPU must be an integer >= 1, got {raw!r}")
    return value


SHARED_GPU_BACKEND = "cpu:gloo,cuda:gloo"  # the group of ranks that share GPUs


def world_sizes(default: Sequence[int], minimum: int = 1) -> list[int]:
    """The world sizes a multi-rank test runs at: env ``EPMOE_TEST_WORLDS`` (comma-separated,
    e.g. ``"8"`` or ``"4,8"`` on a machine with that many GPUs, or on gloo) when set, else
    ``default``; sizes below ``minimum`` (what the test needs) are left out."""
    env = os.environ.get("EPMOE_TEST_WORLDS", "").strip()
    if not env:
        return [w for w in default if w >= minimum]
    try:
        worlds = [int(w) for w in env.split(",") if w.strip()]
    except ValueError:
        worlds = []
    if not worlds or min(worlds) < 1:
        raise ValueError(
            f"EPMOE_TEST_WORLDS must list world sizes >= 1 separated by commas, e.g. '2,4,8'; "
            f"got {env!r}"
        )
    return [w for w in worlds if w >= minimum]


def world_ids(worlds: Sequence[int]) -> list[str]:
    """pytest ids for ``world_sizes``: ``W=2``, ..."""
    return [f"W={w}" for w in worlds]


def requires_world(world_size: int) -> None:
    """Skip the calling test when a CUDA run has fewer GPUs than ``world_size`` ranks
    need (``ranks_per_gpu()`` on each).

    Call it first in the test body (W is usually a parameter); ``run_on_ranks`` checks too.
    """
    __tracebackhide__ = True
    if test_device() == "cuda":
        _require_gpus(world_size, ranks_per_gpu())


def _require_gpus(world_size: int, per_gpu: int) -> None:
    __tracebackhide__ = True
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have * per_gpu < world_size:
        shared = f" at EPMOE_TEST_RANKS_PER_GPU={per_gpu}" if per_gpu > 1 else ""
        pytest.skip(
            f"needs {-(-world_size // per_gpu)} GPUs for {world_size} ranks{shared}, found {have}"
        )


def _default_timeout_s() -> float:
    raw = os.environ.get("EPMOE_TEST_TIMEOUT", "").strip()
    if not raw:
        return 120.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"EPMOE_TEST_TIMEOUT must be a positive number of seconds, got {raw!r}")
    return value


class Sweep:
    """Run many cases in one task, record each failure, report them all at the end.

    ``with sweep.case(name): ...`` records an ``Exception`` (type, message, last frames) and
    carries on; ``pytest.skip`` inside a case skips only that case. ``check()`` raises one
    ``AssertionError`` listing every failing case. ``passed`` counts the cases that passed.
    """

    def __init__(self) -> None:
        self.passed = 0
        self.skipped: list[tuple[str, str]] = []  # (case, reason)
        self.failures: list[tuple[str, str]] = []  # (case, "Type: message\n<frames>")

    @contextlib.contextmanager
    def case(self, name: str) -> Iterator[None]:
        try:
            yield
        except pytest.skip.Exception as e:
            self.skipped.append((name, e.msg))
        except Exception as e:
            frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename != __file__]
            text = "".join(traceback.format_exception_only(e)).strip()
            self.failures.append((name, text + "\n" + "".join(traceback.format_list(frames[-4:]))))
            where = f"rank {dist.get_rank()}: " if dist.is_initialized() else ""
            print(
                f"[sweep] {where}FAILED {name}: {text.splitlines()[0]}", file=sys.stderr, flush=True
            )
        else:
            self.passed += 1

    def check(self) -> None:
        if not self.failures:
            return
        total = self.passed + len(self.skipped) + len(self.failures)
        lines = [
            f"{len(self.failures)} of {total} sweep cases failed ({self.passed} passed, "
            f"{len(self.skipped)} skipped): " + ", ".join(name for name, _ in self.failures)
        ]
        for name, text in self.failures:
            lines += [f"--- {name}", textwrap.indent(text.rstrip(), "    ")]
        raise AssertionError("\n".join(lines))


# ---------------------------------------------------------------------------- worker side


def _die_with_parent() -> None:
    """Have Linux kill this worker when the pytest process dies (no orphans stuck in gloo)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _send(conn: Any, status: str, value: Any) -> None:
    try:
        data = pickle.dumps((status, value))
    except Exception:
        data = pickle.dumps(("error", f"the return value is not picklable:\n{_format_exc()}"))
    conn.send_bytes(data)


def _format_exc() -> str:
    """The current exception's traceback without the worker loop's own frame."""
    _, exc, tb = sys.exc_info()
    if tb is not None and tb.tb_frame.f_code is _worker_main.__code__ and tb.tb_next:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _worker_main(
    rank: int, world_size: int, backend: str, store_port: int, conn: Any, stack_path: str
) -> None:
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    stack_file = open(stack_path, "w")  # noqa: SIM115 -- lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)  # parent asks
    faulthandler.enable(file=stack_file, all_threads=True)  # segfault, abort
    if not torch.cuda.is_available():  # before anything imports triton
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if sys.platform.startswith("linux"):  # gloo on one host: loopback, not the hostname's IP
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        device_id = None
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device_id = torch.device("cuda", rank)
        elif backend == SHARED_GPU_BACKEND:
            torch.cuda.set_device(rank // ranks_per_gpu())
        else:
            torch.set_num_threads(1)
        timeout = datetime.timedelta(seconds=_default_timeout_s())
        store = dist.TCPStore("127.0.0.1", store_port, None, False, timeout=timeout)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, device_id=device_id
        )
    except BaseException:
        _send(conn, "error", f"process group init failed:\n{_format_exc()}")
        return
    _send(conn, "ready", None)
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):  # the parent is gone
            break
        try:
            task = pickle.loads(data)
            if task[0] == "stop":
                break
            _, fn, args, kwargs = task
            status, value = "ok", fn(rank, world_size, *args, **kwargs)
        except pytest.skip.Exception as e:
            status, value = "skip", e.msg
        except BaseException:  # SystemExit and pytest.fail too: the worker lives on
            status, value = "error", _format_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        _send(conn, status, value)
    dist.destroy_process_group()


def _barrier(rank: int, world_size: int) -> None:
    dist.barrier()


# ---------------------------------------------------------------------------- parent side


class _Pool:
    """W spawned ranks of one backend. The parent hosts their TCPStore on a port the OS picks
    (port 0), so there is no window in which another process can take the port."""

    def __init__(self, world_size: int, backend: str) -> None:
        self.world_size, self.backend = world_size, backend
        self.tmpdir = tempfile.mkdtemp(prefix=f"epmoe-{backend}-w{world_size}-")
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        if REPO_ROOT not in sys.path:  # spawn children start from the parent's sys.path
            sys.path.insert(0, REPO_ROOT)
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        for rank in range(world_size):
            conn, child_conn = ctx.Pipe()
            args = (rank, world_size, backend, self.store.port, child_conn, self._stack_path(rank))
            proc = ctx.Process(target=_worker_main, args=args, name=f"rank{rank}", daemon=True)
            proc.start()
            child_conn.close()
            self.procs.append(proc)
            self.conns.append(conn)

    def _stack_path(self, rank: int) -> str:
        return os.path.join(self.tmpdir, f"rank{rank}.stack")

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def send(self, payload: bytes) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):  # a dead rank shows up in collect()
                conn.send_bytes(payload)

    def _poll(self, rank: int) -> tuple[str, Any] | None:
        conn, proc = self.conns[rank], self.procs[rank]
        try:
            if conn.poll():
                return pickle.loads(conn.recv_bytes())
            if proc.is_alive():
                return None
        except (EOFError, OSError):
            pass
        except Exception:
            return ("error", f"could not unpickle the reply:\n{traceback.format_exc()}")
        proc.join(1.0)
        return ("died", proc.exitcode)

    def collect(self, deadline: float) -> dict[int, tuple[str, Any]]:
        """One reply per rank, until ``deadline`` (monotonic); after the first reply that is
        not ok, the others get at most ``_GRACE_S`` more. Ranks without a reply are absent."""
        replies: dict[int, tuple[str, Any]] = {}
        cutoff = deadline
        while len(replies) < self.world_size and time.monotonic() < cutoff:
            pending = [r for r in range(self.world_size) if r not in replies]
            waitables = [self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending]
            wait(waitables, timeout=cutoff - time.monotonic())
            for rank in pending:
                reply = self._poll(rank)
                if reply is not None:
                    replies[rank] = reply
                    if reply[0] not in _OK:
                        cutoff = min(cutoff, time.monotonic() + _GRACE_S)
        return replies

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Python stacks of ``ranks``: live ones are asked (SIGUSR1), dead ones may have left
        one when a fatal signal killed them. Bootstrap frames are trimmed."""
        live = [r for r in ranks if self.procs[r].is_alive()]
        for rank in live:
            with contextlib.suppress(OSError):
                os.kill(self.procs[rank].pid, signal.SIGUSR1)
        time.sleep(0.5 if live else 0.0)
        noise = ("in _worker_main", "/multiprocessing/", 'File "<string>"')
        stacks = {}
        for rank in ranks:
            with contextlib.suppress(OSError), open(self._stack_path(rank)) as f:
                lines = [ln for ln in f.read().splitlines() if not any(n in ln for n in noise)]
                stacks[rank] = "\n".join(lines).strip()
        return stacks

    def close(self, graceful: bool = True) -> None:
        """Ask every rank to leave its process group and exit; kill those that do not."""
        if graceful:
            self.send(pickle.dumps(("stop",)))
        deadline = time.monotonic() + _STOP_S
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()) if graceful else 0.0)
            proc.kill()  # a no-op for a rank that has exited
            proc.join(max(0.0, deadline - time.monotonic()))
        for conn in self.conns:
            conn.close()
        self.store = None
        shutil.rmtree(self.tmpdir, ignore_errors=True)


_POOLS: dict[tuple[int, str], _Pool] = {}  # the pools that later calls reuse


def shutdown_pools() -> None:
    """Stop every pool (the conftest calls this at session end; also run by ``atexit``)."""
    while _POOLS:
        _POOLS.popitem()[1].close()


def _drop(pool: _Pool, graceful: bool) -> None:
    """Close ``pool`` and forget it, so the next call for its key starts a fresh one."""
    key = (pool.world_size, pool.backend)
    if _POOLS.get(key) is pool:
        del _POOLS[key]
    pool.close(graceful)


def _get_pool(world_size: int, backend: str, isolated: bool) -> _Pool:
    pool = None if isolated else _POOLS.get((world_size, backend))
    if pool is not None:
        if pool.alive():
            return pool
        _drop(pool, graceful=False)  # a rank died between tests
    atexit.unregister(shutdown_pools)  # registered once, however many pools start
    atexit.register(shutdown_pools)
    pool = _Pool(world_size, backend)
    replies = pool.collect(time.monotonic() + _default_timeout_s())
    if len(replies) < world_size or any(status != "ready" for status, _ in replies.values()):
        silent = [r for r in range(world_size) if replies.get(r, ("died",))[0] == "died"]
        stacks = pool.dump_stacks(silent)  # the ranks that hang or died
        pool.close(graceful=False)
        report = _report(replies, stacks, world_size)
        raise RankFailure(f"starting {world_size} {backend} ranks failed:\n{report}")
    if not isolated:
        _POOLS[(world_size, backend)] = pool
    return pool


def _report(replies: dict[int, tuple[str, Any]], stacks: dict[int, str], world_size: int) -> str:
    """One section per rank that did not reply ok: failures first, then the silent ranks."""
    sections = []
    for rank in sorted(range(world_size), key=lambda r: (r not in replies, r)):
        status, value = replies.get(rank, ("missing", None))
        if status == "died":
            how = f"from signal {signal.Signals(-value).name}" if value and value < 0 else ""
            head, text = f"died {how or f'with exit code {value}'}", stacks.get(rank, "")
        elif status == "skip":
            head, text = f"skipped: {value}", ""
        elif status == "missing":
            head, text = "gave no reply; its stack", stacks.get(rank, "(not available)")
        else:
            head, text = "raised", value
        if status not in _OK:
            sections.append(f"===== rank {rank} {head} =====\n{text}".rstrip())
    return "\n".join(sections)


def _encode_task(fn: Callable[..., Any], args: tuple, kwargs: dict) -> bytes:
    try:
        return pickle.dumps(("run", fn, args, kwargs))
    except Exception as e:
        raise TypeError(
            f"cannot send {fn!r} and its arguments to the ranks ({type(e).__name__}: {e}); "
            "define the rank function at module level of an importable module "
            "(tests/distributed/test_x.py) and pass picklable arguments"
        ) from e


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout_s: float | None = None,
    isolated: bool = False,
    **kwargs: Any,
) -> list:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on every rank of a W-rank process group.

    Returns the ``world_size`` return values in rank order. ``backend`` None means ``"nccl"``
    when ``EPMOE_TEST_DEVICE=cuda`` (``SHARED_GPU_BACKEND`` when ``EPMOE_TEST_RANKS_PER_GPU``
    is above 1), else ``"gloo"``; NCCL with fewer GPUs than ranks skips.
    ``timeout_s`` bounds the task, pool start-up not counted (None: env
    ``EPMOE_TEST_TIMEOUT``, default 120 s). ``isolated`` runs in a fresh pool, closed after.
    Raises ``RankFailure`` or ``RankTimeout``; skips the test when a rank called
    ``pytest.skip`` and none failed. ``backend``, ``timeout_s`` and ``isolated`` are not
    passed on to ``fn``.
    """
    __tracebackhide__ = True  # pytest shows the caller's line and the ranks' report
    if not callable(fn):
        raise TypeError(f"fn must be a module-level function, got {fn!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if backend is None and test_device() == "cuda":
        backend = "nccl" if ranks_per_gpu() == 1 else SHARED_GPU_BACKEND
    backend = backend or "gloo"
    if backend not in ("gloo", "nccl", SHARED_GPU_BACKEND):
        raise ValueError(
            f"backend must be 'gloo', 'nccl', {SHARED_GPU_BACKEND!r} or None, got {backend!r}"
        )
    timeout_s = _default_timeout_s() if timeout_s is None else timeout_s
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if backend != "gloo":  # NCCL: a GPU per rank, whatever EPMOE_TEST_RANKS_PER_GPU says
        _require_gpus(world_size, 1 if backend == "nccl" else ranks_per_gpu())
    payload = _encode_task(fn, args, kwargs)
    pool = _get_pool(world_size, backend, isolated)
    try:
        pool.send(payload)
        replies = pool.collect(time.monotonic() + timeout_s)
    except BaseException:  # e.g. Ctrl-C: the ranks are mid-task, so the pool is out of step
        _drop(pool, graceful=False)
        raise

    missing = [r for r in range(world_size) if r not in replies]
    bad = sorted(r for r, (status, _) in replies.items() if status not in _OK)
    stacks = pool.dump_stacks(missing + [r for r in bad if replies[r][0] == "died"])
    in_step = not missing and all(replies[r][0] != "died" for r in bad)
    if in_step and bad:  # every rank replied; check the group with a barrier before reuse
        pool.send(_encode_task(_barrier, (), {}))
        checks = pool.collect(time.monotonic() + _GRACE_S)
        in_step = len(checks) == world_size and all(s == "ok" for s, _ in checks.values())
    if isolated or not in_step:
        _drop(pool, graceful=in_step)

    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    where = f"{world_size} {backend} rank" + "s" * (world_size > 1)
    report = _report(replies, stacks, world_size)
    failed = [r for r in bad if replies[r][0] != "skip"]
    if failed or (bad and missing):  # a skip on some ranks while others block fails too
        note = ""
        if missing:
            note = (
                f"; rank(s) {missing} gave no reply within {_GRACE_S} s after that (blocked "
                "in a collective?), so all ranks were killed"
            )
        raise RankFailure(f"{name} failed on rank(s) {failed or bad} of {where}{note}:\n{report}")
    if missing:
        raise RankTimeout(
            f"{name} timed out after {timeout_s} s on {where}: rank(s) {missing} did not finish, "
            f"rank(s) {sorted(replies)} did. All ranks were killed; the next call starts a fresh "
            f"pool.\n{report}"
        )
    if bad:
        reasons = {replies[r][1] for r in bad}
        if len(bad) < world_size or len(reasons) > 1:
            reasons = {"; ".join(f"rank {r}: {replies[r][1]}" for r in bad)}
        pytest.skip(reasons.pop())
    return [replies[r][1] for r in range(world_size)]
