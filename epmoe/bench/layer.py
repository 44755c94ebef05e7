"""One EPMoE forward end to end, and the same layer before and after a live EPLB re-plan.

Run on every rank (torchrun), e.g. on 2 GPUs or with 2 gloo ranks on a CPU:

    python launch/run.py -m epmoe.bench layer --out results/layer.json
    python launch/run.py --nproc 2 -m epmoe.bench layer --small

Shape legend: T tokens per rank · H hidden · I intermediate · E experts · K top-k · W ranks
· R redundant slots. Defaults are DeepSeek-V3-like (E=256, K=8, H=7168, I=2048, bf16, T = 128
and 4096 per rank); ``--small`` (automatic without CUDA) shrinks them for a CPU run.

Part ``layer``, per ``--backends`` entry (default ``all_to_all symm_ll``; unavailable ones
are recorded as skipped) and T, with DeepSeek-V3 routing (``--routing``: sigmoid scores,
top-4 of 8 expert groups, routed scaling 2.5) on random logits. The layer runs as a serving
loop calls it, with the step's token bound (``max_tokens_across_ranks=T``: no agreement
all-reduce), on a few input batches in turn; one record per mode:

* ``eager``: ``EPMoE.forward`` from Python;
* ``graph`` (graph-safe backends on CUDA): the forward captured once in a CUDA graph with
  static inputs (after eager warm-up on a side stream), replayed with each batch copied into
  the static inputs first (the copies are not timed); ``graph_vs_eager`` is the relative
  difference from the eager output of the same batch.

Each record: ``layer_us`` (the slowest rank's median step), ``kernels`` and ``memops``
(device kernels and memcpy/memset operations of one forward, counted by ``torch.profiler``;
in a graph, those of one replay), ``weights_read_us`` (the local experts' w13 + w2 bytes,
``weights_GB``, at the device copy bandwidth of a large ``copy_`` measured in the same run,
``copy_GBps``, read + write; once per chunk), ``dispatch_us`` and ``combine_us`` (the same
backend at the same T and mode, alone: ``epmoe.bench.comm``'s measurement on the layer's
own backend, the experts replaced by the identity; ``comm_us`` their sum), and
``ratio = layer_us / (weights_read_us + dispatch_us + combine_us)``: how far the step is
from reading the weights once plus moving the tokens. The issue's goal is ``ratio ≤ 1.15``
at EP2, T = 128, H = 7168, K = 8 (``goal``: met / missed; no verdict at other W). Eager
records also have ``experts_us``: the local experts alone on the first chunk's dispatched
rows, times the number of chunks (``chunks``; exact when it is 1).

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
before and after (the same weights, so only summation order differs). Part eplb scores
with softmax, ungrouped: the Zipf model of ``RoutingSimulator`` samples ungrouped top-k.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import epmoe
from epmoe.bench.comm import (
    at_goal_shape,
    backend_skip_reason,
    capture_agreed,
    graph_unavailable_reason,
    measure_dispatch_combine,
    table,
    time_phases,
    verdict,
    warm_up_on_side_stream,
)
from epmoe.bench.common import (
    EntrySyntax,
    copy_bandwidth,
    distributed_setup,
    format_table,
    median,
    over_ranks,
    parse_backend_choice,
    progress,
    time_fn,
)
from epmoe.comm.base import Layout
from epmoe.eplb.manager import EPLBManager, measured_balancedness
from epmoe.eplb.migration import MigrationStats
from epmoe.reference import relative_error
from epmoe.routing import RoutingSimulator

SMALL = dict(num_experts=16, top_k=4, hidden=128, intermediate=64, tokens=[16, 64])
FULL = dict(num_experts=256, top_k=8, hidden=7168, intermediate=2048, tokens=[128, 4096])
EXPERTS = ("auto", "torch", "triton")  # epmoe.experts.create_experts' names
# EPMoE routing options of part layer; DeepSeek-V3: sigmoid scores, top-4 of 8 groups
ROUTINGS: dict[str, dict[str, Any]] = {
    "deepseek_v3": dict(
        scoring_func="sigmoid", num_expert_group=8, topk_group=4, routed_scaling_factor=2.5
    ),
    "softmax": dict(scoring_func="softmax"),
}
LAYER_GOAL_RATIO = 1.15  # layer step / (weights read + dispatch + combine), at the goal shape
NUM_BATCHES = 4  # input batches a timed loop cycles through
# what --backends and --eplb-backend take (a backend, or auto: the layer's own choice)
BACKENDS_SYNTAX = EntrySyntax("--backends", "NAME or NAME:LAYOUT", auto=True)
EPLB_BACKEND_SYNTAX = EntrySyntax("--eplb-backend", "NAME (no layout)", auto=True, layout=False)
LAYER_COLUMNS = [
    "backend",
    "layout",
    "experts",
    "weights",
    "wire",
    "micro_batches",
    "mode",
    "W",
    "T",
    "chunks",
    "layer_us",
    "kernels",
    "weights_read_us",
    "dispatch_us",
    "combine_us",
    "ratio",
    "goal",
    "experts_us",
    "note",
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
    p.add_argument(
        "--experts", default="auto", choices=EXPERTS, help="expert implementation (default auto)"
    )
    p.add_argument(
        "--backends",
        nargs="+",
        default=["all_to_all", "symm_ll"],
        help="part layer: backend names, or name:layout pairs (a name alone: its default "
        "layout; auto: the layer's own choice)",
    )
    p.add_argument(
        "--routing",
        default="deepseek_v3",
        choices=sorted(ROUTINGS),
        help="part layer's scoring: deepseek_v3 (sigmoid, top-4 of 8 expert groups; E must "
        "be a multiple of 8) or plain softmax",
    )
    p.add_argument(
        "--max-num-tokens",
        type=int,
        default=None,
        help="part layer: EPMoE's max_num_tokens (M_max; default: the backend's limit or the "
        "layer's default chunk)",
    )
    p.add_argument(
        "--micro-batches",
        type=int,
        nargs="+",
        default=[1],
        choices=[1, 2],
        help="part layer: EPMoE's micro_batches, one layer per value (2: each half's "
        "communication overlaps the other's experts; '1 2' measures both in one run)",
    )
    p.add_argument(
        "--weight-dtype",
        default=None,
        choices=["float8_e4m3fn"],
        help="part layer: FP8 expert weights (quantized from the random bf16 ones)",
    )
    p.add_argument(
        "--weight-scale",
        default=None,
        choices=["block", "per_expert"],
        help="part layer, FP8 weights: 128x128 block scales (DeepSeek-V3's; I must be a "
        "multiple of 128) or one per expert; default block, per_expert when I is not a "
        "multiple of 128 (the CPU sizes)",
    )
    p.add_argument(
        "--dispatch-dtype",
        default=None,
        choices=["float8_e4m3fn"],
        help="part layer: FP8 rows on the wire",
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
            print(table(rows, LAYER_COLUMNS))
            for line in _goal_lines(rows):
                print(line)
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
    base = SMALL if small else FULL
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
    return cfg


_DTYPES = ("bfloat16", "float16", "float32")


def check_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the options that argparse does not check, or ``None``: before the
    process group starts, not as a traceback once part layer's work is done."""
    if args.dtype is not None and args.dtype not in _DTYPES:
        return f"--dtype must be one of {', '.join(_DTYPES)}, got {args.dtype!r}"
    try:
        _entries(args)  # (the parser the run uses)
        parse_backend_choice(args.eplb_backend, EPLB_BACKEND_SYNTAX)
    except ValueError as exc:
        return str(exc)
    for option, value in (("--tokens", args.tokens), ("--window", [args.window])):
        if value is not None and any(v < 1 for v in value):
            return f"{option} must be positive, got {value if option == '--tokens' else value[0]}"
    sizes = dict(num_experts=args.num_experts, top_k=args.top_k, hidden=args.hidden)
    sizes.update(intermediate=args.intermediate, max_num_tokens=args.max_num_tokens)
    sizes.update(iters=args.iters)
    for name, value in sizes.items():
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} must be positive, got {value}"
    if args.warmup is not None and args.warmup < 0:
        return f"--warmup must be 0 or more, got {args.warmup}"
    # the sizes _config will run: CPU runs are small without --small too (the device is
    # CUDA exactly where torch sees a GPU: epmoe.init_distributed picks NCCL there)
    base = SMALL if args.small or not torch.cuda.is_available() else FULL
    E, K = args.num_experts or base["num_experts"], args.top_k or base["top_k"]
    if K > E:
        return f"--top-k {K} is more than the {E} experts (--num-experts)"
    problem = _routing_problem(args.routing, E, K) if "layer" in args.parts else None
    if problem:
        return problem
    if args.weight_scale is not None and args.weight_dtype is None:
        return "--weight-scale is for FP8 weights: add --weight-dtype float8_e4m3fn"
    if getattr(args, "plot", None) and "layer" not in args.parts:
        return "--plot draws part layer's step times: add layer to --parts, or drop --plot"
    return None


def _routing_problem(routing: str, E: int, top_k: int) -> str | None:
    """Why part layer's ``routing`` cannot route ``top_k`` of ``E`` experts (the rule of
    ``epmoe.routing.select_experts``), or ``None``."""
    groups, kept = ROUTINGS[routing].get("num_expert_group"), ROUTINGS[routing].get("topk_group")
    if groups is None:
        return None
    if E % groups:
        return (
            f"--routing {routing} splits the experts into {groups} groups: --num-experts must "
            f"be a multiple of {groups}, got {E} (or pass --routing softmax)"
        )
    eligible = kept * (E // groups)
    if top_k > eligible:
        return (
            f"--top-k {top_k} is more than the {eligible} experts --routing {routing} can pick "
            f"(the best {kept} of {groups} groups of {E // groups}); lower --top-k or pass "
            "--routing softmax"
        )
    return None


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


def _weight_scale(args, I: int) -> dict[str, str]:
    """``weight_scale=`` for FP8 weights (``--weight-scale``, else block scales when ``I``
    is a multiple of 128, else per expert), nothing otherwise."""
    if not args.weight_dtype:
        return {}
    return dict(weight_scale=args.weight_scale or ("block" if I % 128 == 0 else "per_expert"))


def _entries(args) -> list[tuple[str, Layout | None]]:
    """``--backends`` as (name, layout or None: the backend's default), by the parser that
    checks bench comm's names and layouts too (``ValueError`` saying what is wrong)."""
    out = []
    for entry in args.backends:
        choice = parse_backend_choice(entry, BACKENDS_SYNTAX)
        out.append((choice.name, choice.layout))
    return out


def count_device_ops(fn: Callable[[], Any], device: torch.device) -> tuple[int, int] | None:
    """``(kernels, memops)``: device kernels and memcpy/memset operations that one call of
    ``fn`` runs, as ``torch.profiler`` (CUPTI) records them; ``None`` without CUDA or when
    it records none (as a profiler that does not trace inside CUDA graphs would)."""
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    names = [
        e.name
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]
    if not names:
        return None
    memops = sum(n.startswith(("Memcpy", "Memset")) for n in names)
    return len(names) - memops, memops


def layer_ratio(
    layer_us: float, weights_read_us: float, dispatch_us: float, combine_us: float
) -> float:
    """``layer_us / (weights_read_us + dispatch_us + combine_us)``: the step against reading
    the local weights once and moving the tokens (1.0 = nothing else costs time)."""
    return layer_us / (weights_read_us + dispatch_us + combine_us)


# ------------------------------------------------------------------------------ part layer


def _layer_part(cfg, group, rank, W, device, timing, args) -> list[dict[str, Any]]:
    copy_bw = copy_bandwidth(device, timing)
    records = []
    variants = [(e, mb) for e in _entries(args) for mb in args.micro_batches]
    for (name, layout), micro_batches in progress(variants, "layer"):
        # ("auto": the layer picks a usable backend itself, as by default)
        reason = None if name == "auto" else backend_skip_reason(name, layout, None, device, group)
        if reason is not None:
            layout_name = layout.value if layout is not None else "-"
            records.append(
                dict(kind="layer", backend=name, layout=layout_name, W=W, note=f"skipped: {reason}")
            )
            continue
        layer = _make_layer(
            cfg,
            group,
            device,
            args,
            backend=name,
            layout=layout,
            max_num_tokens=args.max_num_tokens,
            micro_batches=micro_batches,
            weight_dtype=getattr(torch, args.weight_dtype) if args.weight_dtype else None,
            **_weight_scale(args, cfg["I"]),
            dispatch_dtype=getattr(torch, args.dispatch_dtype) if args.dispatch_dtype else None,
            **ROUTINGS[args.routing],
        )
        for T in cfg["tokens"]:
            records += _time_layer(layer, T, cfg, rank, W, device, timing, args, copy_bw)
        layer.comm.close()
        del layer
        _free(device)
    return records


def _time_layer(layer, T, cfg, rank, W, device, timing, args, copy_bw) -> list[dict[str, Any]]:
    """The eager and graph records of ``layer`` at T tokens per rank."""
    E, K, H, dtype = cfg["E"], cfg["K"], cfg["H"], cfg["dtype"]
    sim = RoutingSimulator(E, K, seed=args.seed)
    gen = torch.Generator().manual_seed(args.seed + 7919 * rank + T)
    batches = [
        (
            (torch.randn(T, H, generator=gen) * 0.5).to(device, dtype),
            sim.router_logits(T, step=1000 * rank + 100 * T + i, device=device),
        )
        for i in range(NUM_BATCHES)
    ]
    batch_cycle = itertools.cycle(batches)

    def step(x_TH: torch.Tensor, logits_TE: torch.Tensor) -> torch.Tensor:
        return layer(x_TH, logits_TE, max_tokens_across_ranks=T)

    M = layer.max_num_tokens
    chunks = max(math.ceil(T / M), 1)  # T is the same on every rank here
    loop = dict(warmup=timing["warmup"], iters=timing["iters"], device=device)
    (eager_ms,) = time_phases([lambda: step(*next(batch_cycle))], before=timing["barrier"], **loop)

    # the backend alone on the first chunk of batch 0 (times the number of chunks)
    x0_TH, logits0_TE = batches[0]
    weights_TK, ids_TK = layer.route(logits0_TE)
    comm = measure_dispatch_combine(layer.comm, x0_TH[:M], ids_TK[:M], weights_TK[:M], timing)
    result = layer.comm.dispatch(x0_TH[:M], ids_TK[:M], weights_TK[:M])
    experts_ms = median(time_fn(lambda: layer.experts(result, layer.expert_weights()), **loop))
    layer.comm.combine(layer.experts(result, layer.expert_weights()).to(dtype), result)
    eager_ops = count_device_ops(lambda: step(x0_TH, logits0_TE), device)

    weight_bytes = sum(t.numel() * t.element_size() for t in layer.slot_tensors().values())
    weights_read_us = chunks * weight_bytes / copy_bw * 1e6
    base = dict(
        kind="layer",
        backend=layer.comm.name,
        layout=layer.comm.layout.value,
        experts=layer.experts.name,
        routing=args.routing,
        W=W,
        T=T,
        E=E,
        K=K,
        H=H,
        I=cfg["I"],
        dtype=cfg["dtype_name"],
        weights=str(layer.weight_dtype).removeprefix("torch."),
        wire=str(layer.dispatch_dtype or layer.params_dtype).removeprefix("torch."),
        micro_batches=layer.micro_batches,
        chunks=chunks,
        max_num_tokens=M,
        sms=getattr(layer.comm, "num_sms", None),
        weights_GB=weight_bytes / 1e9,
        copy_GBps=copy_bw / 1e9,
        weights_read_us=weights_read_us,
    )
    eager = dict(base, mode="eager", experts_us=over_ranks(experts_ms * chunks, device) * 1e3)
    _fill(eager, over_ranks(median(eager_ms), device), comm["eager"], chunks, eager_ops, device)

    graph = dict(base, mode="graph")
    reason = graph_unavailable_reason(layer.comm) or _graph_comm_reason(comm["graph"])
    if reason is None:
        reason = _time_layer_graph(graph, step, batches, comm, chunks, timing, device)
    if reason is not None:
        graph["note"] = f"n/a: {reason}"
    return [eager, graph]


def _graph_comm_reason(comm_graph: tuple[float, float] | str) -> str | None:
    """Why the layer is not captured when its backend's own capture failed."""
    if isinstance(comm_graph, str):
        return f"the backend alone: {comm_graph.removeprefix('n/a: ')}"
    return None


def _time_layer_graph(rec, step, batches, comm, chunks, timing, device) -> str | None:
    """Capture ``step`` on static inputs, replay it with each batch copied in, and fill
    ``rec``; returns why it could not (the same answer on every rank) or ``None``."""
    x_TH, logits_TE = (t.clone() for t in batches[0])

    def capture() -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        warm_up_on_side_stream(lambda: step(x_TH, logits_TE), timing["warmup"])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_TH = step(x_TH, logits_TE)
        return graph, out_TH

    captured, reason = capture_agreed(capture, device)
    if captured is None:
        return reason
    graph, out_TH = captured
    batch_cycle = itertools.cycle(batches)

    def load_next() -> None:
        x_new, logits_new = next(batch_cycle)
        x_TH.copy_(x_new)
        logits_TE.copy_(logits_new)
        if timing["barrier"] is not None:
            timing["barrier"]()

    loop = dict(warmup=timing["warmup"], iters=timing["iters"], device=device)
    (graph_ms,) = time_phases([graph.replay], before=load_next, **loop)
    for t, src in zip((x_TH, logits_TE), batches[0]):
        t.copy_(src)
    graph.replay()
    replayed_TH = out_TH.clone()
    ops = count_device_ops(graph.replay, device)
    rec["graph_vs_eager"] = over_ranks(relative_error(replayed_TH, step(*batches[0])), device)
    _fill(rec, over_ranks(median(graph_ms), device), comm["graph"], chunks, ops, device)
    return None


def _fill(rec, layer_ms, comm_ms, chunks, ops, device) -> None:
    """Add the step, comm, ratio, goal and op-count fields of one mode to ``rec``."""
    d_us, c_us = (over_ranks(v, device) * 1e3 * chunks for v in comm_ms)
    rec.update(layer_us=layer_ms * 1e3, dispatch_us=d_us, combine_us=c_us, comm_us=d_us + c_us)
    rec["ratio"] = layer_ratio(rec["layer_us"], rec["weights_read_us"], d_us, c_us)
    if at_goal_shape(rec["W"], rec["T"], rec["H"], rec["K"]):
        rec["goal"] = verdict(rec["ratio"], LAYER_GOAL_RATIO)
    if ops is not None:
        rec["kernels"], rec["memops"] = ops


def _goal_lines(records: list[dict[str, Any]]) -> list[str]:
    """One line per record the issue's layer goal applies to."""
    lines = []
    for r in records:
        if "goal" in r:
            lines.append(
                f"goal {r['backend']}:{r['layout']} {r['mode']} T={r['T']}: step "
                f"{r['layer_us']:.0f} µs / (weights {r['weights_read_us']:.0f} + dispatch "
                f"{r['dispatch_us']:.1f} + combine {r['combine_us']:.1f} µs) = "
                f"{r['ratio']:.3f}, goal ≤ {LAYER_GOAL_RATIO}: {r['goal']}"
            )
    return lines


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


def migration_fields(stats: MigrationStats, device: torch.device) -> dict[str, Any]:
    """What one layer's migration moved, summed over the ranks: ``moved_MB`` (received over
    the network, in 1e6 bytes as every ``_MB`` field of the benchmarks), ``experts_moved``,
    ``slots_changed``. Collective."""
    return dict(
        moved_MB=over_ranks(stats.bytes_received, device, "sum") / 1e6,
        experts_moved=int(over_ranks(stats.slots_received, device, "sum")),
        slots_changed=int(over_ranks(stats.slots_moved, device, "sum")),
    )


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
        **migration_fields(row.migration, device),
        plan_ms=report.plan_seconds * 1e3,
        out_rel_diff=over_ranks(relative_error(out_after, out_before), device),
    )
    layer.comm.close()
    return record
