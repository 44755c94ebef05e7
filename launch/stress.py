#!/usr/bin/env python3
"""The randomized stress of EPMoE against the oracle, on every rank of a torchrun job.

    python3 launch/run.py --nproc 2 launch/stress.py [--steps 500] [--seed S]
        [--backends all_to_all,symm_ll] [--budget-s SECONDS] [--json PATH]

The loop of ``tests/distributed/stress_cases.py`` (the CPU tier runs it on 3 gloo ranks for
30 s): adversarial routing (all tokens to one expert, to one rank, Zipf-skewed, random,
all tied), uneven and zero token counts, chunking, redundant replicas, live rebalances
every 4 calls of a layer, every output against ``epmoe.reference.moe`` on the rank's own
tokens. On GPUs: NCCL, bf16, ``GPU_CONFIGS`` (``naive``, ``all_to_all`` Standard and
ExpertBatched, ``symm_ll`` and ``symm_ht``, FP8 dispatch in half of them), ``--steps`` calls
per configuration
(default 500). On a machine without GPUs: gloo, float32, the CPU configurations (a check of
the script itself).

Rank 0 prints the report (the seed, calls, rebalances, errors per configuration) and
writes it to ``--json``; the exit status is 1 when an output mismatched the oracle or a
requested backend cannot run here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import epmoe  # noqa: E402
from tests.distributed import stress_cases  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=500, help="layer calls per configuration")
    p.add_argument("--seed", type=int, default=int(os.environ.get("EPMOE_STRESS_SEED", "0") or 0))
    p.add_argument(
        "--backends",
        default=None,
        help="comma-separated backends to stress (default: every backend of the configs)",
    )
    p.add_argument("--budget-s", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--json", default=None, help="write the report here (rank 0)")
    opts = p.parse_args(argv)
    if opts.steps <= 0:
        p.error(f"--steps must be positive, got {opts.steps}")

    group = epmoe.init_distributed()
    rank = dist.get_rank() if group is not None else 0
    world = dist.get_world_size() if group is not None else 1
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    dtype = "bfloat16" if gpu else "float32"
    configs = stress_cases.GPU_CONFIGS if gpu else stress_cases.CPU_CONFIGS
    wanted = set(opts.backends.split(",")) if opts.backends else {c.backend for c in configs}
    dev = stress_cases.device_for(int(os.environ.get("LOCAL_RANK", rank)), device)
    usable = epmoe.available_backends(dev, group)
    reasons = {b: usable.get(b, "not a registered backend") for b in wanted}
    missing = {b: why for b, why in reasons.items() if why is not None}
    configs = tuple(c for c in configs if c.backend in wanted and c.backend not in missing)
    if rank == 0:
        print(
            f"stress: seed {opts.seed}, {world} rank(s) on {device} ({dtype}), {opts.steps} "
            f"steps per configuration, configurations: {[c.name for c in configs]}",
            flush=True,
        )
        for b, why in missing.items():
            print(f"stress: backend {b!r} cannot run here: {why}", flush=True)
    if not configs:
        return 1

    result = stress_cases.stress(
        rank, world, device, dtype,
        seed=opts.seed, budget_s=opts.budget_s, steps_per_config=opts.steps, configs=configs,
    )  # fmt: skip
    results = [None] * world
    if group is not None:
        dist.all_gather_object(results, result)
    else:
        results = [result]
    failed = sum(r["num_mismatches"] for r in results) > 0 or bool(missing)
    if rank == 0:
        print(stress_cases.summarize(results), flush=True)
        if opts.json:
            report = dict(
                device=torch.cuda.get_device_name() if gpu else "cpu",
                world=world,
                dtype=dtype,
                steps_per_config=opts.steps,
                missing_backends=missing,
                ranks=results,
            )
            with open(opts.json, "w") as f:
                json.dump(report, f, indent=1)
        print("stress: " + ("FAILED" if failed else "passed"), flush=True)
    if group is not None:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
