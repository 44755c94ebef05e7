"""Launch a script on N ranks per node with torchrun: a free rendezvous port, safe GPU settings.

One node:

    python -m epmoe.launch [--nproc N] [--all-ranks] SCRIPT [ARGS...]
    python -m epmoe.launch [--nproc N] -m MODULE [ARGS...]     e.g. -m epmoe.bench comm

Several nodes (the same command on every node; ``epmoe-run`` is the same launcher):

    # static: node 0 at HOST, ranks numbered node by node
    epmoe-run --nproc 8 --nnodes 2 --node-rank R --master-addr HOST [--master-port P] SCRIPT
    # elastic rendezvous (torchrun's c10d store at HOST:PORT, node ranks assigned)
    epmoe-run --nproc 8 --nnodes 2 --rdzv-endpoint HOST:PORT [--rdzv-id JOB] SCRIPT

N defaults to the number of visible GPUs, or 2 (gloo) on a machine without one. On one
node the ranks meet at 127.0.0.1 on a free port. Only local rank 0's output is shown
unless --all-ranks is given; the other local ranks write theirs to files (``--log-dir``,
default a temporary folder), and when the job fails the end of the stderr of every other
local rank that failed is printed, so the rank that raised first is never hidden behind
rank 0's "another rank ..." (torchrun stops the remaining ranks as soon as one fails). The
NVLink-multicast switches of ``epmoe.distributed.SAFE_GPU_ENV`` are set unless the
environment already sets them.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass

from epmoe.distributed import SAFE_GPU_ENV

DEFAULT_MASTER_PORT = 29500  # torchrun's default; static multi-node launches use it
TAIL_LINES = 40  # lines of a failed rank's stderr printed at the end
_TRACEBACK = "Traceback (most recent call last)"
_NNODES = re.compile(r"^(\d+)(?::(\d+))?$")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_nproc() -> int:
    """Ranks per node when ``--nproc`` is not given: the visible GPUs, else 2 (gloo)."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    except ImportError:
        pass
    return 2


@dataclass(frozen=True)
class Nodes:
    """Where the nodes of a launch meet.

    ``nnodes`` is torchrun's spelling: ``"M"`` or ``"MIN:MAX"`` (the range only with a
    rendezvous endpoint). Static launch: ``master_addr`` (node 0's address), ``master_port``
    and this node's ``node_rank``. Rendezvous launch: ``rdzv_endpoint`` ``"HOST:PORT"`` and
    ``rdzv_id`` (the same on every node of one job); torchrun assigns the node ranks.
    One node with neither: 127.0.0.1 on a free port.
    """

    nnodes: str = "1"
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str = "epmoe"

    def __post_init__(self) -> None:
        object.__setattr__(self, "nnodes", str(self.nnodes))
        match = _NNODES.match(self.nnodes)
        if match is None or int(match.group(1)) < 1:
            raise ValueError(f"--nnodes must be M or MIN:MAX with M >= 1, got {self.nnodes!r}")
        low, high = int(match.group(1)), int(match.group(2) or match.group(1))
        if high < low:
            raise ValueError(f"--nnodes MIN:MAX needs MIN <= MAX, got {self.nnodes!r}")
        if self.rdzv_endpoint is not None:
            if self.master_addr is not None or self.master_port is not None:
                raise ValueError(
                    "give either --rdzv-endpoint HOST:PORT or --master-addr/--master-port, not both"
                )
            if self.node_rank is not None:
                raise ValueError(
                    "--node-rank is for static launches (--master-addr); with --rdzv-endpoint "
                    "torchrun assigns node ranks: leave it out"
                )
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"--rdzv-endpoint must be HOST:PORT, got {self.rdzv_endpoint!r}; e.g. "
                    "node0.example:29400"
                )
            return
        if match.group(2) is not None:
            raise ValueError(
                f"--nnodes {self.nnodes} (a range) needs --rdzv-endpoint HOST:PORT; a static "
                "launch takes a fixed number of nodes"
            )
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"--master-port must be in 1..65535, got {self.master_port}")
        if low > 1:
            if self.master_addr is None:
                raise ValueError(
                    f"--nnodes {low} needs to know where the nodes meet: --master-addr HOST "
                    "(node 0's address) with --node-rank R on each node, or --rdzv-endpoint "
                    "HOST:PORT"
                )
            if self.node_rank is None:
                raise ValueError(
                    f"--nnodes {low} with --master-addr needs --node-rank: 0 on the node at "
                    f"{self.master_addr}, 1 … {low - 1} on the others"
                )
        if self.node_rank is not None and not 0 <= self.node_rank < low:
            raise ValueError(f"--node-rank must be in 0 … {low - 1}, got {self.node_rank}")

    @property
    def single(self) -> bool:
        """Whether every rank runs on this node."""
        return self.nnodes == "1"

    def torchrun_args(self) -> list[str]:
        """torchrun's options for these nodes (``--nnodes`` and where they meet)."""
        args = ["--nnodes", self.nnodes]
        if self.rdzv_endpoint is not None:
            return args + [
                "--rdzv-backend", "c10d",
                "--rdzv-endpoint", self.rdzv_endpoint,
                "--rdzv-id", self.rdzv_id,
            ]  # fmt: skip
        if self.node_rank is not None:
            args += ["--node-rank", str(self.node_rank)]
        addr = self.master_addr or "127.0.0.1"
        if self.master_port is not None:
            port = self.master_port
        else:
            port = free_port() if self.single else DEFAULT_MASTER_PORT
        return args + ["--master-addr", addr, "--master-port", str(port)]


def torchrun_command(
    script: str,
    args: list[str],
    nproc: int,
    all_ranks: bool,
    module: bool = False,
    log_dir: str | None = None,
    nodes: Nodes | None = None,
) -> list[str]:
    """The torchrun command line (argv), built without running anything.

    Without ``all_ranks`` local rank 0 writes to this console and local ranks 1 … N-1 to
    ``log_dir`` (torchrun's ``--redirects``; see :func:`failed_rank_logs`). ``nodes``
    ``None`` is one node.
    """
    nodes = nodes or Nodes()
    cmd = [sys.executable, "-m", "torch.distributed.run", *nodes.torchrun_args()]
    cmd += ["--nproc-per-node", str(nproc)]
    if not all_ranks:
        cmd += ["--local-ranks-filter", "0"]
        if nproc > 1 and log_dir is not None:
            # 3: stdout and stderr. torchrun's per-rank map takes one-digit local ranks:
            # above 10 ranks every rank goes to its files, rank 0 teed to the console too
            if nproc <= 10:
                redirects = ",".join(f"{r}:3" for r in range(1, nproc))
                cmd += ["--log-dir", log_dir, "--redirects", redirects]
            else:
                cmd += ["--log-dir", log_dir, "--redirects", "3", "--tee", "0:3"]
    return cmd + (["-m"] if module else []) + [script, *args]


def rank_stderr(log_dir: str, rank: int) -> str | None:
    """The stderr torchrun saved for local ``rank`` under ``log_dir`` (its latest attempt),
    or ``None`` when there is none."""
    pattern = os.path.join(log_dir, "*", "attempt_*", str(rank), "stderr.log")
    paths = sorted(glob.glob(pattern), key=os.path.getmtime)
    if not paths:
        return None
    with open(paths[-1], errors="replace") as f:
        return f.read()


def failed_rank_logs(log_dir: str, nproc: int, lines: int = TAIL_LINES) -> str:
    """The end of the stderr of every local rank 1 … N-1 that failed (its stderr holds a
    Python traceback), for printing after a failed job; when none holds one, the end of
    every non-empty stderr (a rank killed by a signal leaves no traceback)."""
    logs = {r: rank_stderr(log_dir, r) for r in range(1, nproc)}
    if nproc > 1 and all(text is None for text in logs.values()):
        return (
            "epmoe.launch: torchrun stopped before it started the ranks (no rank wrote a "
            "log); its own error is above"
        )
    logs = {r: text for r, text in logs.items() if text and text.strip()}
    failed = {r: text for r, text in logs.items() if _TRACEBACK in text}
    chosen, what = (failed, "failed") if failed else (logs, "wrote to stderr")
    if not chosen:
        return (
            "epmoe.launch: no rank other than rank 0 wrote to stderr; torchrun's summary "
            "above gives each rank's exit code"
        )
    out = []
    for rank, text in chosen.items():
        tail = text.rstrip().splitlines()[-lines:]
        out.append(
            f"===== local rank {rank} {what}: the last {len(tail)} lines of its stderr "
            f"(epmoe.launch; local rank 0's output is above) ====="
        )
        out.extend(tail)
    return "\n".join(out)


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The launcher's command line (``prog`` names it in the usage line)."""
    p = argparse.ArgumentParser(
        prog=prog or "epmoe-run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nproc", type=int, default=None, help="ranks per node (default: GPUs, else 2)")
    p.add_argument("--all-ranks", action="store_true", help="show every local rank's output")
    p.add_argument(
        "--log-dir",
        default=None,
        help="keep the other ranks' stdout/stderr here (default: a temporary folder, removed)",
    )
    nodes = p.add_argument_group("several nodes (run the same command on every node)")
    nodes.add_argument("--nnodes", default="1", help="nodes: M, or MIN:MAX with --rdzv-endpoint")
    nodes.add_argument(
        "--node-rank", type=int, default=None, help="this node's rank, 0 … M-1 (static launch)"
    )
    nodes.add_argument(
        "--master-addr", default=None, help="node 0's address (static launch; 1 node: 127.0.0.1)"
    )
    nodes.add_argument(
        "--master-port",
        type=int,
        default=None,
        help=f"node 0's port (default: {DEFAULT_MASTER_PORT}; one node: a free port)",
    )
    nodes.add_argument(
        "--rdzv-endpoint",
        default=None,
        help="HOST:PORT of torchrun's c10d rendezvous, instead of --master-addr/--node-rank",
    )
    nodes.add_argument(
        "--rdzv-id", default="epmoe", help="job id, the same on every node (rendezvous)"
    )
    p.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module (python -m)")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    return p


def _source_root() -> str | None:
    """The checkout holding this package when run from source (scripts under ``launch/``
    import epmoe from it), else ``None`` (an installed package is on the path already)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return root if os.path.exists(os.path.join(root, "pyproject.toml")) else None


def _run(cmd: list[str], env: dict[str, str]) -> int:
    """Run torchrun, passing SIGTERM and SIGHUP on to it (a scheduler's or ``timeout``'s
    stop: torchrun stops its ranks, then this launcher cleans up); Ctrl-C reaches the whole
    process group anyway, and torchrun is given a moment to stop its ranks. Returns its
    exit code (128 + the signal's number when a signal ended it)."""
    proc = subprocess.Popen(cmd, env=env)

    def forward(signum, _frame) -> None:
        proc.send_signal(signum)

    main_thread = threading.current_thread() is threading.main_thread()  # (handlers' rule)
    signals = (signal.SIGTERM, signal.SIGHUP) if main_thread else ()
    old = {s: signal.signal(s, forward) for s in signals}
    try:
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    return 128 - rc if rc < 0 else rc


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run the launcher with ``argv`` (default ``sys.argv[1:]``); returns torchrun's exit code."""
    ap = parser(prog)
    opts = ap.parse_args(argv)
    if opts.nproc is not None and opts.nproc <= 0:
        ap.error(f"--nproc must be positive, got {opts.nproc}")
    nproc = opts.nproc or default_nproc()
    if opts.all_ranks and opts.log_dir is not None:
        ap.error("--log-dir keeps the other ranks' output, which --all-ranks shows here: give one")
    try:
        nodes = Nodes(
            nnodes=opts.nnodes,
            node_rank=opts.node_rank,
            master_addr=opts.master_addr,
            master_port=opts.master_port,
            rdzv_endpoint=opts.rdzv_endpoint,
            rdzv_id=opts.rdzv_id,
        )
    except ValueError as exc:
        ap.error(str(exc))
    if not opts.module and not os.path.isfile(opts.script):
        ap.error(f"no script {opts.script!r} (a module? add -m)")
    env = dict(os.environ)
    for key, value in SAFE_GPU_ENV.items():
        env.setdefault(key, value)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    root = _source_root()
    if root is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    log_dir = opts.log_dir or tempfile.mkdtemp(prefix="epmoe-run-")
    try:
        cmd = torchrun_command(
            opts.script, opts.args, nproc, opts.all_ranks, opts.module, log_dir, nodes
        )
        rc = _run(cmd, env)
        if rc != 0 and not opts.all_ranks and nproc > 1:
            sys.stdout.flush()
            print(failed_rank_logs(log_dir, nproc), file=sys.stderr, flush=True)
        return rc
    finally:
        if opts.log_dir is None:
            shutil.rmtree(log_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(prog="python -m epmoe.launch"))
