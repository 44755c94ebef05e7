#!/usr/bin/env python3
"""The main demo: a DP/EP serving loop of a small MoE model across ranks.

    python launch/demo.py [--nproc N] [demo options, see examples/serve_demo.py --help]

All GPUs with NCCL on a GPU machine, 2 gloo ranks on a CPU machine.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from run import main as run_main  # noqa: E402

DEMO = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "serve_demo.py"
)


def main(argv: list[str]) -> int:
    """``--nproc N`` (or ``--nproc=N``, anywhere) goes to the launcher, the rest to the demo."""
    launcher = argparse.ArgumentParser(add_help=False)
    launcher.add_argument("--nproc", type=int, default=None)
    opts, demo_args = launcher.parse_known_args(argv)
    launch_args = ["--nproc", str(opts.nproc)] if opts.nproc is not None else []
    return run_main([*launch_args, DEMO, *demo_args], prog="launch/demo.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
