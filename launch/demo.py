#!/usr/bin/env python3
"""The main demo: a DP/EP serving loop of a small MoE model across ranks.

    python launch/demo.py [--nproc N] [demo options, see examples/serve_demo.py --help]

All GPUs with NCCL on a GPU machine, 2 gloo ranks on a CPU machine.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from run import main as run_main  # noqa: E402

DEMO = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "serve_demo.py"
)


def main(argv: list[str]) -> int:
    launch_args = []
    if argv[:1] == ["--nproc"]:
        launch_args, argv = argv[:2], argv[2:]
    return run_main([*launch_args, DEMO, *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
