"""Dispatch and combine of each all-to-all backend, against NCCL ``all_to_all_single``.

Run on every rank (torchrun), e.g. on 2 GPUs:

    python launch/run.py -m epmoe.bench comm --tokens 128 4096 --out results/comm.json

(or ``torchrun --nproc-per-node 2 -m epmoe.bench comm``). Per (backend, layout, tokens per
rank) it reports the median dispatch and combine times (the slowest rank's median), the
bytes they move, and two references measured in the same run:

* ``a2a_us``: NCCL/gloo ``all_to_all_single`` moving exactly the rows this dispatch moves
  (same split sizes, no metadata): the transport the portable backends stand on;
* ``link_GBps``: the bandwidth of a large ``all_to_all_single`` (the practical ceiling of
  the links between the ranks).

Bandwidth follows DeepEP's convention: received rows × H × bytes per element, self traffic
included (``recv_GBps``). Shape legend: T tokens per rank · H hidden · K top-k · E experts.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import epmoe
from epmoe.bench.common import distributed_setup, format_table, median, over_ranks, time_fn
from epmoe.comm import create_backend
from epmoe.comm.base import CommSpec, Layout
from epmoe.routing import RoutingSimulator


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 4096], help="T per rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--num-experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--backends",
        nargs="+",
        default=["all_to_all:standard", "all_to_all:expert_batched", "naive:standard"],
        help="name:layout pairs",
    )
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument(
        "--profile", action="store_true", help="print a torch.profiler table per backend (rank 0)"
    )


def _rows_per_rank(ids_TK, placement, layout: Layout) -> torch.Tensor:
    """Rows this rank sends to each rank ``[W]``: tokens with an expert there (Standard),
    or (token, expert) pairs (ExpertBatched)."""
    owner_TK = placement.owner_rank.to(ids_TK.device)[ids_TK]
    W = placement.ep_size
    if layout is Layout.EXPERT_BATCHED:
        return torch.bincount(owner_TK.reshape(-1), minlength=W)
    hit_TW = torch.zeros(ids_TK.shape[0], W, dtype=torch.bool, device=ids_TK.device)
    hit_TW.scatter_(1, owner_TK, True)
    return hit_TW.sum(0)


def _measure(comm, x_TH, ids_TK, weights_TK, placement, timing) -> dict:
    """Median dispatch and combine times of ``comm`` and of a bare all_to_all_single that
    moves the same rows (the slowest rank's medians)."""
    device, H = x_TH.device, x_TH.shape[1]
    result = comm.dispatch(x_TH, ids_TK, weights_TK)
    expert_out = result.hidden.clone()
    d_ms = median(time_fn(lambda: comm.dispatch(x_TH, ids_TK, weights_TK), **timing))
    c_ms = median(time_fn(lambda: comm.combine(expert_out, result), **timing))

    send = _rows_per_rank(ids_TK, placement, comm.layout)
    recv = send.clone()
    if dist.is_initialized():
        dist.all_to_all_single(recv, send)
    send_l, recv_l = send.tolist(), recv.tolist()
    a_in = torch.randn(sum(send_l), H, device=device).to(x_TH.dtype)
    a_out = torch.empty(sum(recv_l), H, device=device, dtype=x_TH.dtype)
    if dist.is_initialized():
        a_ms = median(
            time_fn(lambda: dist.all_to_all_single(a_out, a_in, recv_l, send_l), **timing)
        )
    else:
        a_ms = median(time_fn(lambda: a_out.copy_(a_in), **timing))
    d_ms, c_ms, a_ms = (over_ranks(v, device) for v in (d_ms, c_ms, a_ms))
    recv_rows = torch.tensor([sum(recv_l)], device=device)
    if dist.is_initialized():
        dist.all_reduce(recv_rows, op=dist.ReduceOp.MAX)
    recv_bytes = int(recv_rows.item()) * H * x_TH.dtype.itemsize
    return dict(
        dispatch_us=d_ms * 1e3,
        combine_us=c_ms * 1e3,
        a2a_us=a_ms * 1e3,
        dispatch_vs_a2a=a_ms / d_ms,
        combine_vs_a2a=a_ms / c_ms,
        recv_rows=int(recv_rows.item()),
        dispatch_recv_GBps=recv_bytes / (d_ms * 1e6),
        combine_recv_GBps=recv_bytes / (c_ms * 1e6),
    )


def _profile(comm, x_TH, ids_TK, weights_TK, rank: int, title: str) -> None:
    """Where dispatch + combine spend their time: a profiler table on rank 0."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if x_TH.is_cuda:
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(5):
            result = comm.dispatch(x_TH, ids_TK, weights_TK)
            comm.combine(result.hidden, result)
        if x_TH.is_cuda:
            torch.cuda.synchronize()
    if rank == 0:
        print(f"--- profile: {title} (5 iterations)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main(args) -> list[dict] | None:
    group, rank, W, device = distributed_setup()
    dtype = getattr(torch, args.dtype)
    H, E, K = args.hidden, args.num_experts, args.top_k
    placement = epmoe.ExpertPlacement.linear(E, W)
    barrier = (lambda: dist.barrier()) if group is not None else None
    timing = dict(warmup=args.warmup, iters=args.iters, device=device, barrier=barrier)

    # the links' ceiling: a large all_to_all_single (64 MiB to every peer)
    rows = (64 << 20) // (H * dtype.itemsize)
    big = torch.randn(rows * W, H, device=device).to(dtype)
    big_out = torch.empty_like(big)
    ms = median(time_fn(lambda: dist.all_to_all_single(big_out, big), **timing)) if W > 1 else 0
    ms = over_ranks(ms, device)
    link_GBps = rows * (W - 1) * H * dtype.itemsize / (ms * 1e6) if W > 1 else float("nan")

    records = []
    for T in args.tokens:
        sim = RoutingSimulator(num_experts=E, top_k=K, seed=rank)
        weights, ids = sim.sample(T, device=device)
        x = torch.randn(T, H, device=device).to(dtype)
        spec = CommSpec(
            hidden_size=H,
            top_k=K,
            rank_offsets=placement.rank_offsets,
            max_num_tokens=T,
            dtype=dtype,
            device=device,
        )
        for entry in args.backends:
            name, layout_name = entry.split(":")
            layout = Layout(layout_name)
            comm = create_backend(name, spec, group, layout)
            rec = _measure(comm, x, ids, weights, placement, timing)
            if args.profile:
                _profile(comm, x, ids, weights, rank, f"{entry} T={T}")
            comm.close()
            rec.update(backend=name, layout=layout.value, W=W, T=T, H=H, K=K, E=E)
            rec.update(dtype=args.dtype, link_GBps=link_GBps)
            records.append(rec)
    if rank == 0:
        print(
            format_table(
                records,
                [
                    "backend",
                    "layout",
                    "W",
                    "T",
                    "dispatch_us",
                    "combine_us",
                    "a2a_us",
                    "dispatch_vs_a2a",
                    "combine_vs_a2a",
                    "dispatch_recv_GBps",
                    "combine_recv_GBps",
                    "link_GBps",
                ],
            )
        )
    if group is not None:
        dist.destroy_process_group()
    return records if rank == 0 else None
