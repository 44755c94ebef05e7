#!/usr/bin/env python3
"""Launch a script on N ranks with torchrun: a free rendezvous port, safe GPU settings.

    python launch/run.py [--nproc N] [--all-ranks] SCRIPT [ARGS...]
    python launch/run.py [--nproc N] -m MODULE [ARGS...]      e.g. -m epmoe.bench comm

N defaults to the number of visible GPUs, or 2 (gloo) on a machine without one. Only rank
0's output is shown unless --all-ranks is given; the other ranks write theirs to files
(``--log-dir``, default a temporary folder), and when the job fails the end of the stderr of
every other rank that failed is printed, so the rank that raised first is never hidden
behind rank 0's "another rank ..." (torchrun stops the remaining ranks as soon as one
fails). The NVLink-multicast switches of ``epmoe.distributed.SAFE_GPU_ENV`` are set unless
the environment already sets them.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile

SAFE_GPU_ENV = {  # keep in step with epmoe.distributed.SAFE_GPU_ENV (no epmoe import here)
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_nproc() -> int:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    except ImportError:
        pass
    return 2


TAIL_LINES = 40  # lines of a failed rank's stderr printed at the end
_TRACEBACK = "Traceback (most recent call last)"


def torchrun_command(
    script: str,
    args: list[str],
    nproc: int,
    all_ranks: bool,
    module: bool = False,
    log_dir: str | None = None,
) -> list[str]:
    """The torchrun command line. Without ``all_ranks`` rank 0 writes to this console and
    ranks 1 … N-1 to ``log_dir`` (torchrun's ``--redirects``; see :func:`failed_rank_logs`)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
    ]
    if not all_ranks:
        cmd += ["--local-ranks-filter", "0"]
        if nproc > 1 and log_dir is not None:
            redirects = ",".join(f"{r}:3" for r in range(1, nproc))  # 3: stdout and stderr
            cmd += ["--log-dir", log_dir, "--redirects", redirects]
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
    """The end of the stderr of every rank 1 … N-1 that failed (its stderr holds a Python
    traceback), for printing after a failed job; when none holds one, the end of every
    non-empty stderr (a rank killed by a signal leaves no traceback)."""
    logs = {r: rank_stderr(log_dir, r) for r in range(1, nproc)}
    logs = {r: text for r, text in logs.items() if text and text.strip()}
    failed = {r: text for r, text in logs.items() if _TRACEBACK in text}
    chosen, what = (failed, "failed") if failed else (logs, "wrote to stderr")
    if not chosen:
        return (
            "launch/run.py: no rank other than rank 0 wrote to stderr; torchrun's summary "
            "above gives each rank's exit code"
        )
    out = []
    for rank, text in chosen.items():
        tail = text.rstrip().splitlines()[-lines:]
        out.append(
            f"===== rank {rank} {what}: the last {len(tail)} lines of its stderr "
            f"(launch/run.py; rank 0's output is above) ====="
        )
        out.extend(tail)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: GPUs, else 2)")
    parser.add_argument("--all-ranks", action="store_true", help="show every rank's output")
    parser.add_argument(
        "--log-dir",
        default=None,
        help="keep the other ranks' stdout/stderr here (default: a temporary folder, removed)",
    )
    parser.add_argument(
        "-m", "--module", action="store_true", help="SCRIPT is a module (python -m)"
    )
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    opts = parser.parse_args(argv)
    nproc = opts.nproc or default_nproc()
    if nproc <= 0:
        parser.error(f"--nproc must be positive, got {nproc}")
    env = dict(os.environ)
    for key, value in SAFE_GPU_ENV.items():
        env.setdefault(key, value)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    log_dir = opts.log_dir or tempfile.mkdtemp(prefix="epmoe-run-")
    try:
        cmd = torchrun_command(opts.script, opts.args, nproc, opts.all_ranks, opts.module, log_dir)
        rc = subprocess.call(cmd, env=env)
        if rc != 0 and not opts.all_ranks and nproc > 1:
            sys.stdout.flush()
            print(failed_rank_logs(log_dir, nproc), file=sys.stderr, flush=True)
        return rc
    finally:
        if opts.log_dir is None:
            shutil.rmtree(log_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
