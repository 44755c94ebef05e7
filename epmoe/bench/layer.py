"""One EPMoE forward end to end, and the same layer before and after a live EPLB re-plan.

Run on every rank (torchrun), e.g. on 2 GPUs or with 2 gloo ranks on a CPU:

    python launch/run.py -m epmoe.bench layer --out results/layer.json
    python launch/run.py --nproc 2 -m epmoe.bench layer --small

Shape legend: T tokens per rank · H hidden · I intermediate · E experts · K top-k · W ranks
· R redundant slots. Defaults are DeepSeek-V3-like (E=256, K=8, H=7168, I=2048, bf16, T = 128
and 4096 per rank); ``--small`` (automatic without CUDA) shrinks them for a CPU run.

Part ``layer``, per available (backend, layout) and T, on uniformly random routing:

* ``layer_us``: ``EPMoE.forward`` (route, place, dispatch, experts, combine; chunked as the
  layer chunks), the slowest rank's median;
* ``comm_us``: the same chunks' dispatch + combine alone (expert outputs replaced by the
  dispatched rows);
* ``experts_us``: the local experts alone on the first chunk's dispatched rows, times the
  number of chunks (``chunks``; exact when it is 1).

Part ``eplb`` (the issue's benchmark (b)), per T and ``--hot`` layout: a layer on the
linear placement under Zipf(α) routing (``--alpha``, default 1.2; the popular experts
either shuffled over the ids by a fixed seed, or contiguous from id 0, which linear
placement puts together on the first ranks: with few ranks a random spread is already
nearly balanced, so ``contiguous`` shows what a re-plan repairs) records
``--window`` steps, then ``EPLBManager`` re-plans with R = E/8 redundant slots (rounded so
that every rank holds as many) and migrates the weights. Reported: the layer step on one
fixed batch before and after (``step_before_us``, ``step_after_us``), the measured
balancedness (mean over ranks of the (token, expert) pairs each rank received / the
busiest rank's) of the window the plan was made from (``bal_before``) and of a fresh window
on the new placement (``bal_after``, out of sample), the planner's expectation, the
migration time (slowest rank), what moved over the network (``moved_MB``, ``experts_moved``:
expert copies received, all ranks) and the slots whose content changed (``slots_changed``,
local copies included), the re-plan time, and the relative difference of the outputs
before and after (the same weights, so only summation order differs).
"""

from __future__ import annotations

import argparse
import gc
import math
from typing import Any

import torch
import torch.distributed as dist

import epmoe
from epmoe.bench.common import (
    distributed_setup,
    format_table,
    median,
    over_ranks,
    progress,
    time_fn,
)
from epmoe.comm import available_backends, backend_class
from epmoe.comm.base import Layout
from epmoe.eplb.manager import EPLBManager, measured_balancedness
from epmoe.reference import relative_error
from epmoe.routing import RoutingSimulator

SMALL = dict(num_experts=16, top_k=4, hidden=128, intermediate=64, tokens=[16, 64])
LAYER_COLUMNS = [
    "backend",
    "layout",
    "experts",
    "W",
    "T",
    "chunks",
    "layer_us",
    "comm_us",
    "experts_us",
]
EPLB_COLUMNS = [
    "backend",
    "hot",
    "W",
    "T",
    "R",
    "bal_before",
    "bal_after",
    "bal_expected",
    "step_before_us",
    "step_after_us",
    "speedup",
    "migration_ms",
    "moved_MB",
    "experts_moved",
    "slots_changed",
    "plan_ms",
    "out_rel_diff",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--small", action="store_true", help="CPU-sized shapes (default without CUDA)")
    p.add_argument("--tokens", type=int, nargs="+", default=None, help="T per rank")
    p.add_argument("--num-experts", type=int, default=None, help="E (default 256)")
    p.add_argument("--top-k", type=int, default=None, help="K (default 8)")
    p.add_argument("--hidden", type=int, default=None, help="H (default 7168)")
    p.add_argument("--intermediate", type=int, default=None, help="I (default 2048)")
    p.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--experts", default="auto", help="expert implementation: auto, torch, triton")
    p.add_argument(
        "--backends",
        nargs="+",
        default=None,
        help="name:layout pairs for part layer (default: every available backend and layout)",
    )
    p.add_argument("--eplb-backend", default="auto", help="backend of part eplb")
    p.add_argument("--alpha", type=float, default=1.2, help="Zipf exponent of part eplb")
    p.add_argument(
        "--hot",
        nargs="+",
        default=["shuffled", "contiguous"],
        choices=["shuffled", "contiguous"],
        help="where part eplb's popular experts sit: random ids, or ids 0, 1, ... (which "
        "the linear placement puts on the first rank: the worst case it meets)",
    )
    p.add_argument("--window", type=int, default=4, help="steps recorded before a re-plan")
    p.add_argument("--parts", nargs="+", default=["layer", "eplb"], choices=["layer", "eplb"])
    p.add_argument("--warmup", type=int, default=None, help="default 5 (2 with --small)")
    p.add_argument("--iters", type=int, default=None, help="default 20 (5 with --small)")
    p.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    group, rank, W, device = distributed_setup()
    cfg = _config(args, device)
    barrier = (lambda: dist.barrier()) if group is not None else None
    timing = dict(warmup=cfg["warmup"], iters=cfg["iters"], device=device, barrier=barrier)
    if rank == 0:
        print(
            f"EPMoE layer benchmark on {W} rank(s), {device.type}: E={cfg['E']}, K={cfg['K']}, "
            f"H={cfg['H']}, I={cfg['I']}, {cfg['dtype_name']}, T per rank {cfg['tokens']}"
        )

    records: list[dict[str, Any]] = []
    if "layer" in args.parts:
        rows = _layer_part(cfg, group, rank, W, device, timing, args)
        records += rows
        if rank == 0:
            print(format_table(rows, LAYER_COLUMNS))
    if "eplb" in args.parts:
        rows = _eplb_part(cfg, group, rank, W, device, timing, args)
        records += rows
        if rank == 0:
            print()
            print(format_table(rows, EPLB_COLUMNS))
    if group is not None:
        dist.destroy_process_group()
    return records if rank == 0 else None


# ------------------------------------------------------------------------------ set-up


def _config(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    small = args.small or device.type != "cuda"
    base = (
        SMALL
        if small
        else dict(num_experts=256, top_k=8, hidden=7168, intermediate=2048, tokens=[128, 4096])
    )
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    cfg = dict(
        E=args.num_experts or base["num_experts"],
        K=args.top_k or base["top_k"],
        H=args.hidden or base["hidden"],
        I=args.intermediate or base["intermediate"],
        tokens=args.tokens or base["tokens"],
        dtype_name=dtype_name,
        dtype=getattr(torch, dtype_name),
        warmup=args.warmup if args.warmup is not None else (2 if small else 5),
        iters=args.iters if args.iters is not None else (5 if small else 20),
    )
    if args.window < 1:
        raise ValueError(f"--window must be a positive number of steps, got {args.window}")
    return cfg


def _make_layer(cfg, group, device, args, **kwargs) -> epmoe.EPMoE:
    """An EPMoE whose expert weights depend only on the logical id (seeded per expert), so
    replicas agree and a rebalanced layer computes the same function."""
    E, H, I = cfg["E"], cfg["H"], cfg["I"]
    layer = epmoe.EPMoE(
        E,
        cfg["K"],
        H,
        I,
        group=group,
        experts=args.experts,
        params_dtype=cfg["dtype"],
        device=device,
        **kwargs,
    )
    gen = torch.Generator(device=device)
    for x in sorted(set(layer.local_experts)):
        gen.manual_seed(args.seed * 100003 + x)
        w13 = torch.randn(2 * I, H, generator=gen, device=device) / H**0.5
        w2 = torch.randn(H, I, generator=gen, device=device) / I**0.5
        layer.load_expert(x, w13.to(cfg["dtype"]), w2.to(cfg["dtype"]))
    return layer


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _pairs(args, device, group) -> list[tuple[str, Layout]]:
    if args.backends:
        return [(e.split(":")[0], Layout(e.split(":")[1])) for e in args.backends]
    out = []
    for name, reason in available_backends(device, group).items():
        if reason is None:
            layouts = backend_class(name).capabilities.layouts
            out += [(name, lay) for lay in sorted(layouts, key=lambda v: v.value, reverse=True)]
    return out


# ------------------------------------------------------------------------------ part layer


def _layer_part(cfg, group, rank, W, device, timing, args) -> list[dict[str, Any]]:
    records = []
    for name, layout in progress(_pairs(args, device, group), "layer"):
        layer = _make_layer(cfg, group, device, args, backend=name, layout=layout)
        for T in cfg["tokens"]:
            records.append(_time_layer(layer, T, cfg, rank, W, device, timing, args))
        layer.comm.close()
        del layer
        _free(device)
    return records


def _time_layer(layer, T, cfg, rank, W, device, timing, args) -> dict[str, Any]:
    E, K, H, dtype = cfg["E"], cfg["K"], cfg["H"], cfg["dtype"]
    sim = RoutingSimulator(E, K, seed=args.seed)
    gen = torch.Generator().manual_seed(args.seed + 7919 * rank + T)
    x = (torch.randn(T, H, generator=gen) * 0.5).to(device, dtype)
    logits = sim.router_logits(T, step=1000 * rank + T, device=device)
    layer_ms = median(time_fn(lambda: layer(x, logits), **timing))

    weights_TK, ids_TK = layer.route(logits)
    M = layer.max_num_tokens
    chunks = max(math.ceil(T / M), 1)  # T is the same on every rank here

    def comm_only() -> None:
        for c in range(chunks):
            s = slice(c * M, (c + 1) * M)
            result = layer.comm.dispatch(x[s], ids_TK[s], weights_TK[s])
            layer.comm.combine(result.hidden, result)

    comm_ms = median(time_fn(comm_only, **timing))
    result = layer.comm.dispatch(x[:M], ids_TK[:M], weights_TK[:M])
    experts_ms = median(
        time_fn(
            lambda: layer.experts(result, layer.expert_weights()),
            warmup=timing["warmup"],
            iters=timing["iters"],
            device=device,
        )
    )
    layer.comm.combine(layer.experts(result, layer.expert_weights()), result)
    return dict(
        kind="layer",
        backend=layer.comm.name,
        layout=layer.comm.layout.value,
        experts=layer.experts.name,
        W=W,
        T=T,
        E=E,
        K=K,
        H=H,
        I=cfg["I"],
        dtype=cfg["dtype_name"],
        chunks=chunks,
        layer_us=over_ranks(layer_ms, device) * 1e3,
        comm_us=over_ranks(comm_ms, device) * 1e3,
        experts_us=over_ranks(experts_ms * chunks, device) * 1e3,
    )


# ------------------------------------------------------------------------------ part eplb


def _window_balancedness(layer: epmoe.EPMoE, group) -> float:
    return measured_balancedness(layer.placement, layer.load_recorder.global_load(group))


def _eplb_part(cfg, group, rank, W, device, timing, args) -> list[dict[str, Any]]:
    records = []
    cases = [(hot, T) for hot in args.hot for T in cfg["tokens"]]
    for hot, T in progress(cases, "eplb"):
        records.append(_rebalance_once(T, hot, cfg, group, rank, W, device, timing, args))
        _free(device)  # the layer of this case is gone
    return records


def _rebalance_once(T, hot, cfg, group, rank, W, device, timing, args) -> dict[str, Any]:
    E, K, H, dtype = cfg["E"], cfg["K"], cfg["H"], cfg["dtype"]
    R = math.ceil((E + E // 8) / W) * W - E  # E/8 redundant slots, equal slots per rank
    shuffle = hot == "shuffled"
    sim = RoutingSimulator(E, K, "zipf", alpha=args.alpha, seed=args.seed, shuffle=shuffle)
    layer = _make_layer(
        cfg, group, device, args, backend=args.eplb_backend, load_window=args.window
    )
    manager = EPLBManager([layer], num_redundant=R, rebalance_interval=args.window)
    gen = torch.Generator().manual_seed(args.seed + 7919 * rank + T)
    x = (torch.randn(T, H, generator=gen) * 0.5).to(device, dtype)
    fixed = sim.router_logits(T, step=10**6 + rank, device=device)

    def fill_window(first: int) -> None:
        for s in range(first, first + args.window):
            layer(x, sim.router_logits(T, step=1000 * rank + s, device=device))

    before_ms = median(time_fn(lambda: layer(x, fixed), **timing))
    out_before = layer(x, fixed)
    fill_window(0)  # the window the re-plan uses (the timing's steps are overwritten)
    report = manager.rebalance()
    after_ms = median(time_fn(lambda: layer(x, fixed), **timing))
    out_after = layer(x, fixed)
    fill_window(args.window)  # a fresh window on the new placement
    bal_after = _window_balancedness(layer, group)
    row = report.layers[0]
    before_us = over_ranks(before_ms, device) * 1e3
    after_us = over_ranks(after_ms, device) * 1e3
    record = dict(
        kind="eplb",
        backend=layer.comm.name,
        layout=layer.comm.layout.value,
        W=W,
        T=T,
        E=E,
        K=K,
        H=H,
        I=cfg["I"],
        R=R,
        alpha=args.alpha,
        hot=hot,
        dtype=cfg["dtype_name"],
        bal_before=row.measured_before,
        bal_after=bal_after,
        bal_expected=row.expected_after,
        step_before_us=before_us,
        step_after_us=after_us,
        speedup=before_us / after_us,
        migration_ms=over_ranks(report.migrate_seconds, device) * 1e3,
        moved_MB=over_ranks(row.migration.bytes_received, device, "sum") / 2**20,
        experts_moved=int(over_ranks(row.migration.slots_received, device, "sum")),
        slots_changed=int(over_ranks(row.migration.slots_moved, device, "sum")),
        plan_ms=report.plan_seconds * 1e3,
        out_rel_diff=over_ranks(relative_error(out_after, out_before), device),
    )
    layer.comm.close()
    return record
