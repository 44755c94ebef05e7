#!/usr/bin/env python3
"""Launch a script on N ranks with torchrun: a free rendezvous port, safe GPU settings.

    python launch/run.py [--nproc N] [--all-ranks] SCRIPT [ARGS...]
    python launch/run.py [--nproc N] -m MODULE [ARGS...]      e.g. -m epmoe.bench comm

N defaults to the number of visible GPUs, or 2 (gloo) on a machine without one. Only rank
0's output is shown unless --all-ranks is given. The NVLink-multicast switches of
``epmoe.distributed.SAFE_GPU_ENV`` are set unless the environment already sets them.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

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


def torchrun_command(
    script: str, args: list[str], nproc: int, all_ranks: bool, module: bool = False
) -> list[str]:
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
    return cmd + (["-m"] if module else []) + [script, *args]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: GPUs, else 2)")
    parser.add_argument("--all-ranks", action="store_true", help="show every rank's output")
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
    return subprocess.call(
        torchrun_command(opts.script, opts.args, nproc, opts.all_ranks, opts.module), env=env
    )


if __name__ == "__main__":
    sys.exit(main())
