"""``python -m epmoe.bench NAME [options]``: run one benchmark, print a table, write JSON."""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

from epmoe.bench.common import write_json

PLOTS = ("comm", "eplb", "layer", "experts")  # benchmarks that --plot draws (epmoe.bench.plot)
BENCHMARKS = {
    "comm": "dispatch and combine of each all-to-all backend against NCCL all_to_all_single",
    "experts": "batched-expert kernels against dense matmul, torch._grouped_mm and cuBLAS",
    "layer": "one EPMoE forward end to end, and before/after an EPLB rebalance",
    "eplb": "placement balancedness and re-plan time (offline, CPU)",
    "timeline": "when each program of symm_ll's kernels reaches each step (GPU timer)",
}


def parse(argv: list[str]) -> tuple[str, ModuleType, argparse.Namespace]:
    """``argv`` (without ``python -m epmoe.bench``) checked as a run would check it, before
    anything runs: ``(name, module, args)``; argparse's exit (status 2) on bad input."""
    top = argparse.ArgumentParser(
        prog="python -m epmoe.bench",
        description=__doc__,
        epilog="benchmarks: " + "; ".join(f"{k}: {v}" for k, v in BENCHMARKS.items()),
    )
    top.add_argument("name", choices=sorted(BENCHMARKS))
    name = top.parse_args(argv[:1]).name
    module = importlib.import_module(f"epmoe.bench.{name}")  # only the chosen one
    parser = argparse.ArgumentParser(
        prog=f"python -m epmoe.bench {name}", description=module.__doc__
    )
    parser.add_argument("--out", default=None, help="write the records as JSON to this path")
    if name in PLOTS:
        parser.add_argument(
            "--plot", default=None, help='draw the records as PNG here (pip install "epmoe[bench]")'
        )
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    check = getattr(module, "check_arguments", None)  # what argparse alone cannot check
    problem = check(args) if check is not None else None
    if problem:
        parser.error(problem)
    if getattr(args, "plot", None):  # refuse before the run, not after it
        try:
            importlib.import_module("matplotlib")
        except ImportError:
            parser.error('--plot needs matplotlib: pip install "epmoe[bench]"')
    return name, module, args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    name, module, args = parse(argv)
    records = module.main(args)
    if args.out and records is not None:
        write_json(records, args.out, benchmark=name, argv=argv)
    if getattr(args, "plot", None) and records is not None:  # (rank 0 only gets records)
        from epmoe.bench import plot

        plot.draw(name, records, args.plot)


if __name__ == "__main__":
    main()
