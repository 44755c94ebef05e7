#!/usr/bin/env python3
"""Launch a script on N ranks with torchrun: the launcher of the package, ``epmoe.launch``.

    python launch/run.py [--nproc N] [--all-ranks] SCRIPT [ARGS...]
    python launch/run.py [--nproc N] -m MODULE [ARGS...]      e.g. -m epmoe.bench comm

The same as ``python -m epmoe.launch`` and the ``epmoe-run`` console script (which also
take ``--nnodes``, ``--node-rank``, ``--master-addr``/``--master-port`` or
``--rdzv-endpoint`` for more than one node); kept so the commands in the docs keep working
from a checkout that is not installed. See ``epmoe/launch.py``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from epmoe.launch import (  # noqa: E402  (after the checkout is on the path)
    Nodes,
    failed_rank_logs,
    free_port,
    main,
    rank_stderr,
    torchrun_command,
)

__all__ = ["Nodes", "failed_rank_logs", "free_port", "main", "rank_stderr", "torchrun_command"]

if __name__ == "__main__":
    sys.exit(main(prog="launch/run.py"))
