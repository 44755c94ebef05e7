"""EPLB benchmark (offline, CPU): placement balancedness and re-plan time.

``python -m epmoe.bench eplb [--alphas 0.8 1.0 1.2] [--ep 8 32 64] ...``

Protocol. Router choices are simulated: every token picks K distinct experts, sampled
without replacement by Zipf popularity ``p_i ∝ (i+1)^-α`` over a random permutation of the
expert ids (Gumbel top-k: the top K of ``log p + Gumbel noise``). A *plan window* of
``--window-steps`` steps of ``--tokens`` tokens gives the measured expert counts the
balanced placement is planned from; a *fresh* window from the same distribution is then
dispatched through each placement (tokens split evenly over the W ranks, each rank mapping
its ids with ``ExpertPlacement.to_physical``) and the (token, k) entries landing on every
rank are counted. Reported per placement:

* ``bal_plan``: expected balancedness on the plan window (what the planner optimised);
* ``bal_eval``: measured balancedness on the fresh window (summed over its steps) — the
  honest number;
* ``bal_step``: the mean over the fresh window's steps of each step's balancedness (what a
  single forward sees; sampling noise of one step's 8192 tokens caps it below 1);
* ``ceiling``: a balanced plan made *on* the fresh window and measured on it (in-sample);
* baseline: the linear placement's row.

Balancedness = mean rank load / max rank load. Re-plan time: one call of the vectorized
re-plan for ``--layers`` layers at EP ``--timing-ep`` on ``--threads`` CPU threads, with
E/8 spare slots and with none, each rounded up to a multiple of the EP size (every rank
holds as many slots: at EP24, 256 experts take 8 spare slots even with "none").
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

from epmoe.bench.common import format_table, median, progress, time_fn
from epmoe.eplb.algorithm import rebalance
from epmoe.placement import ExpertPlacement

GOAL_BALANCEDNESS = 0.97  # EP32, E/8 = 32 redundant slots, α = 1.0 (issue goal)
GOAL_MS_PER_LAYER = 10.0
GPUS_PER_NODE = 8  # the hierarchical re-plan timing's nodes: W / 8 where W is a multiple


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-experts", type=int, default=256, help="E logical experts")
    p.add_argument("--top-k", type=int, default=8, help="K experts per token")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per step (all ranks)")
    p.add_argument("--window-steps", type=int, default=16, help="steps per load window")
    p.add_argument("--alphas", type=float, nargs="+", default=[0.8, 1.0, 1.2], help="Zipf α")
    p.add_argument("--ep", type=int, nargs="+", default=[8, 32, 64], help="EP sizes W")
    p.add_argument(
        "--redundant",
        type=int,
        nargs="+",
        default=None,
        help="redundant slots (default: 0 and E/8, each rounded up to a multiple of W)",
    )
    p.add_argument("--layers", type=int, default=61, help="layers in the re-plan timing")
    p.add_argument("--timing-ep", type=int, default=64, help="EP size of the re-plan timing")
    p.add_argument("--threads", type=int, default=1, help="CPU threads for the re-plan timing")
    p.add_argument("--iters", type=int, default=5, help="timed re-plans (median reported)")
    p.add_argument("--seed", type=int, default=0)


def sample_topk(
    popularity_E: torch.Tensor, num_tokens: int, top_k: int, gen: torch.Generator
) -> torch.Tensor:
    """K distinct experts per token, sampled without replacement by ``popularity`` (Gumbel
    top-k). Returns ``[num_tokens, K]`` int64 logical ids."""
    logp = popularity_E.log()
    u = torch.rand(num_tokens, logp.numel(), generator=gen).clamp_(min=1e-20)
    return (logp - (-u.log()).log()).topk(top_k, dim=1).indices


def zipf_popularity(num_experts: int, alpha: float, gen: torch.Generator) -> torch.Tensor:
    """``[E]`` float64 Zipf(α) probabilities over a random permutation of expert ids."""
    p = torch.arange(1, num_experts + 1, dtype=torch.float64).pow(-alpha)
    return (p / p.sum())[torch.randperm(num_experts, generator=gen)]


def measured_rank_loads(placement: ExpertPlacement, ids_STK: torch.Tensor) -> torch.Tensor:
    """Dispatch every step's tokens through ``placement`` (T / W consecutive tokens per
    rank, each rank mapping with its own ``rank``) and count the entries each rank
    receives. Returns ``[S, W]`` float64."""
    S, T, K = ids_STK.shape
    W = placement.ep_size
    per_rank = T // W
    owner = placement.owner_rank
    loads = torch.zeros(S, W, dtype=torch.float64)
    for r in range(W):
        chunk = ids_STK[:, r * per_rank : (r + 1) * per_rank].reshape(-1, K)
        # to_physical's replica choice uses the token index within the rank's batch, so map
        # each step separately (the same as the layer does).
        phys = torch.cat(
            [placement.to_physical(c, rank=r) for c in chunk.view(S, per_rank, K).unbind(0)]
        ).view(S, -1)
        loads += torch.zeros(S, W, dtype=torch.float64).scatter_add_(
            1, owner[phys], torch.ones(phys.shape, dtype=torch.float64)
        )
    return loads


def _bal(loads: torch.Tensor) -> torch.Tensor:
    return loads.mean(-1) / loads.max(-1).values


def check_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the options that argparse does not check, or ``None``: before
    the balance part, not as a traceback once it is done."""
    sizes = ("num_experts", "top_k", "tokens", "window_steps", "layers", "timing_ep",
             "threads", "iters")  # fmt: skip
    for name in sizes:
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}"
    if min(args.ep) < 1:
        return f"--ep takes positive EP sizes, got {args.ep}"
    if args.redundant is not None and min(args.redundant) < 0:
        return f"--redundant takes spare slot counts of 0 or more, got {args.redundant}"
    if args.top_k > args.num_experts:
        return f"--top-k {args.top_k} is more than --num-experts {args.num_experts}"
    return _tokens_problem(args.tokens, args.ep)


def _tokens_problem(T: int, eps: list[int]) -> str | None:
    bad = [W for W in eps if T % W]
    if bad:
        return f"--tokens={T} must be a multiple of every --ep size, not of {bad}"
    return None


def _redundant_options(E: int, W: int, requested: list[int] | None) -> list[int]:
    wanted = requested if requested is not None else [0, E // 8]
    out = []
    for r in wanted:
        r = math.ceil((E + r) / W) * W - E  # equal slots per rank
        if r not in out:
            out.append(r)
    return out


def _balance_records(args: argparse.Namespace) -> list[dict[str, Any]]:
    E, K, T, S = args.num_experts, args.top_k, args.tokens, args.window_steps
    problem = _tokens_problem(T, args.ep)
    if problem:
        raise ValueError(problem)
    gen = torch.Generator().manual_seed(args.seed)
    records: list[dict[str, Any]] = []
    for alpha in progress(args.alphas, "eplb balancedness"):
        pop = zipf_popularity(E, alpha, gen)
        plan_ids = torch.stack([sample_topk(pop, T, K, gen) for _ in range(S)])  # [S, T, K]
        eval_ids = torch.stack([sample_topk(pop, T, K, gen) for _ in range(S)])
        plan_load = torch.bincount(plan_ids.flatten(), minlength=E).double()
        eval_load = torch.bincount(eval_ids.flatten(), minlength=E).double()
        for W in args.ep:
            cases: list[tuple[str, int, ExpertPlacement, ExpertPlacement | None]] = [
                ("linear", 0, ExpertPlacement.linear(E, W), None),
                ("round_robin", 0, ExpertPlacement.round_robin(E, W), None),
            ]
            for R in _redundant_options(E, W, args.redundant):
                cases.append(
                    (
                        "balanced",
                        R,
                        ExpertPlacement.balanced(plan_load, W, num_redundant=R),
                        ExpertPlacement.balanced(eval_load, W, num_redundant=R),
                    )
                )
            for name, R, placement, oracle in cases:
                step_loads = measured_rank_loads(placement, eval_ids)  # [S, W]
                rec = {
                    "alpha": alpha,
                    "ep": W,
                    "placement": name,
                    "redundant": R,
                    "slots_per_rank": placement.max_local,
                    "max_replicas": placement.max_replicas,
                    "bal_plan": placement.balancedness(plan_load),
                    "bal_eval": float(_bal(step_loads.sum(0))),
                    "bal_step": float(_bal(step_loads).mean()),
                }
                if oracle is not None:
                    rec["ceiling"] = float(_bal(measured_rank_loads(oracle, eval_ids).sum(0)))
                records.append(rec)
    return records


def _timing_records(args: argparse.Namespace) -> list[dict[str, Any]]:
    E, K, T, L, W = args.num_experts, args.top_k, args.tokens, args.layers, args.timing_ep
    gen = torch.Generator().manual_seed(args.seed + 1)
    alpha = 1.0
    # Per-layer measured counts (one step each), each layer with its own hot experts.
    load = torch.stack(
        [
            torch.bincount(
                sample_topk(zipf_popularity(E, alpha, gen), T, K, gen).flatten(), minlength=E
            ).double()
            for _ in range(L)
        ]
    )
    # The next window: same popularity up to ±10 % drift per expert.
    drift = load * (0.9 + 0.2 * torch.rand(L, E, generator=gen, dtype=torch.float64))
    # E/8 spare slots and none, each rounded up so that every rank holds as many slots
    # (E + R must be a multiple of W: "none" is R > 0 where W does not divide E)
    (R,) = _redundant_options(E, W, [E // 8])
    (R0,) = _redundant_options(E, W, [0])
    groups = 8 if E % 8 == 0 else 1
    nodes = W // GPUS_PER_NODE if W % GPUS_PER_NODE == 0 else 1  # (equal GPUs per node)
    configs = [
        ("global", R, 1, 1, None, 0.0),
        ("global", R0, 1, 1, None, 0.0),
        ("hierarchical", R, groups, nodes, None, 0.0),
        ("global+migration", R, 1, 1, "current", 0.01),
    ]
    records: list[dict[str, Any]] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        for policy, R_, G, N, cur, tol in progress(configs, "eplb re-plan timing"):
            current = None
            if cur is not None:
                current = rebalance(load, E + R_, G, N, W)[0]

            def fn(R_=R_, G=G, N=N, current=current, tol=tol) -> Any:
                return rebalance(drift, E + R_, G, N, W, current_phy2log=current, tolerance=tol)

            ms = median(time_fn(fn, warmup=1, iters=args.iters, device="cpu"))
            record = {
                "policy": policy,
                "layers": L,
                "experts": E,
                "ep": W,
                "redundant": R_,
                "groups": G,
                "nodes": N,
                "threads": args.threads,
                "ms_total": ms,
                "ms_per_layer": ms / L,
            }
            if G % N:  # (rebalance falls back to the global policy then)
                record["note"] = f"{G} groups do not split over {N} nodes: planned globally"
            records.append(record)
    finally:
        torch.set_num_threads(threads)
    return records


def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    balance = _balance_records(args)
    print(
        format_table(
            balance,
            [
                "alpha",
                "ep",
                "placement",
                "redundant",
                "slots_per_rank",
                "max_replicas",
                "bal_plan",
                "bal_eval",
                "bal_step",
                "ceiling",
            ],
        )
    )
    timing = _timing_records(args)
    print()
    print(
        format_table(
            timing,
            ["policy", "layers", "experts", "ep", "redundant", "groups", "nodes", "threads"]
            + ["ms_total", "ms_per_layer", "note"],
        )
    )
    goal = [
        r
        for r in balance
        if r["placement"] == "balanced"
        and r["ep"] == 32
        and r["redundant"] == 32
        and math.isclose(r["alpha"], 1.0)
    ]
    print()
    for r in goal:
        ok = "met" if r["bal_eval"] >= GOAL_BALANCEDNESS else "NOT met"
        print(
            f"goal balancedness >= {GOAL_BALANCEDNESS} (EP32, 32 redundant, alpha 1.0): "
            f"{r['bal_eval']:.3f} on a fresh window ({ok}); per step {r['bal_step']:.3f}"
        )
    worst = max(r["ms_per_layer"] for r in timing)
    ok = "met" if worst <= GOAL_MS_PER_LAYER else "NOT met"
    print(f"goal re-plan <= {GOAL_MS_PER_LAYER} ms per layer: worst {worst:.3f} ms ({ok})")
    shape = dict(E=args.num_experts, K=args.top_k, T=args.tokens)  # what the plot titles say
    return [{"kind": "balance", **shape, **r} for r in balance] + [
        {"kind": "replan", **r} for r in timing
    ]
