"""A DP/EP serving loop of a small MoE model: attention-side work data-parallel, MoE
layers expert-parallel through ``epmoe.EPMoE``.

Run it through the launcher (2 gloo ranks on CPU, every GPU with NCCL):

    python launch/demo.py                 # or: python launch/run.py examples/serve_demo.py

Every rank serves its own stream of batches (sizes differ per rank and step, some steps a
rank has no tokens at all) through a stack of blocks ``x + dense(norm(x))`` then
``x + moe(norm(x))``. At the end rank 0 prints tokens/s, the expert load per rank and the
largest relative error of any MoE layer's output against the single-process oracle (the
same routing and ``epmoe.reference.moe`` with the full expert weights, on the same input),
checked every few steps outside the timed passes. ``--placement eplb`` starts from the
linear placement with a spare replica slot per rank and re-plans every
``--rebalance-every`` steps from the measured load (weights move between ranks while
serving); each re-plan prints a line.

Shape legend: T tokens on this rank · H hidden · I intermediate · E experts · K top-k ·
W ranks.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import epmoe
from epmoe.comm import backend_names
from epmoe.distributed import default_device
from epmoe.reference import relative_error


@dataclass(frozen=True)
class DemoConfig:
    num_layers: int = 4
    num_experts: int = 16  # E
    top_k: int = 4  # K
    hidden_size: int = 256  # H
    intermediate_size: int = 128  # I
    steps: int = 30
    max_batch: int = 64  # most tokens a rank serves in one step
    placement: str = "linear"
    rebalance_every: int = 10  # steps between EPLB re-plans (--placement eplb)
    backend: str = "auto"
    experts: str = "auto"


class RMSNorm(nn.Module):
    def __init__(self, H: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(H))
        self.eps = eps

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        x = x_TH.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight.float()).to(x_TH.dtype)


class MoEBlock(nn.Module):
    """A transformer layer stripped to what matters here: a data-parallel dense part (the
    stand-in for attention) and an expert-parallel MoE part, each with a residual."""

    def __init__(self, cfg: DemoConfig, moe: nn.Module, oracle: nn.Module, dtype, device):
        super().__init__()
        self.oracle = oracle  # the same MoE computed in one process, for checking
        self.checking = False
        self.max_error, self.checked = 0.0, 0
        H, E = cfg.hidden_size, cfg.num_experts
        self.norm1, self.norm2 = RMSNorm(H).to(device), RMSNorm(H).to(device)
        self.dense = nn.Linear(H, H, bias=False, dtype=dtype, device=device)
        self.router = nn.Linear(H, E, bias=False, dtype=torch.float32, device=device)
        self.moe = moe

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        x_TH = x_TH + torch.tanh(self.dense(self.norm1(x_TH)))
        h_TH = self.norm2(x_TH)
        logits_TE = self.router(h_TH.float())
        moe_TH = self.moe(h_TH, logits_TE)
        if self.checking and h_TH.shape[0] > 0:
            error = relative_error(moe_TH, self.oracle(h_TH, logits_TE))
            self.max_error = max(self.max_error, error)
            self.checked += 1
        return x_TH + moe_TH


class OracleMoE(nn.Module):
    """The same MoE with every expert in this process: routing then ``reference.moe``."""

    def __init__(self, top_k: int, w13: torch.Tensor, w2: torch.Tensor):
        super().__init__()
        self.top_k, self.w13, self.w2 = top_k, w13, w2

    def forward(self, h_TH, logits_TE):
        w, ids = epmoe.select_experts(logits_TE, self.top_k)
        return epmoe.reference.moe(h_TH, self.w13, self.w2, w, ids)


def build_model(cfg: DemoConfig, moe_factory, oracle_factory, dtype, device) -> nn.Sequential:
    """Dense weights and router from a shared seed (identical on every rank)."""
    torch.manual_seed(1234)
    blocks = [
        MoEBlock(cfg, moe_factory(i), oracle_factory(i), dtype, device)
        for i in range(cfg.num_layers)
    ]
    for b in blocks:
        nn.init.normal_(b.dense.weight, std=cfg.hidden_size**-0.5)
        nn.init.normal_(b.router.weight, std=cfg.hidden_size**-0.5)
    return nn.Sequential(*blocks)


def expert_weights(cfg: DemoConfig, layer: int, dtype, device):
    """Full logical weights of one layer, the same on every rank."""
    g = torch.Generator().manual_seed(10_000 + layer)
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    w13 = torch.randn(E, 2 * I, H, generator=g) * H**-0.5
    w2 = torch.randn(E, H, I, generator=g) * I**-0.5
    return w13.to(device, dtype), w2.to(device, dtype)


def _set_checking(model: nn.Sequential, on: bool) -> None:
    """Check every MoE layer against the oracle (and keep the pass out of the load counts)."""
    for block in model:
        block.checking = on
        block.moe.load_recorder.enabled = not on


HELP = {
    "num_layers": "MoE blocks in the model",
    "num_experts": "experts per MoE layer (E)",
    "top_k": "experts per token (K)",
    "hidden_size": "hidden size (H)",
    "intermediate_size": "each expert's intermediate size (I)",
    "steps": "serving steps (one batch per rank each)",
    "max_batch": "most tokens a rank serves in one step",
    "placement": "expert placement: linear, round_robin, or eplb (re-planned from the load)",
    "rebalance_every": "steps between EPLB re-plans (with --placement eplb)",
    "backend": "all-to-all backend",
    "experts": "expert kernels",
}
MINIMUM = {  # the rest are ints >= 1
    name: 3 if name == "steps" else 1  # (the first 2 steps warm up, untimed)
    for name, value in vars(DemoConfig()).items()
    if isinstance(value, int)
}
CHOICES = {
    "placement": ["linear", "round_robin", "eplb"],
    "backend": ["auto", *backend_names()],
    "experts": ["auto", "torch", "triton"],
}


def batch_sizes(cfg: DemoConfig, rank: int) -> list[int]:
    """Tokens this rank serves at each step: uneven across ranks, sometimes none."""
    g = torch.Generator().manual_seed(rank)
    sizes = torch.randint(0, cfg.max_batch + 1, (cfg.steps,), generator=g)
    sizes[(torch.arange(cfg.steps) + rank) % 7 == 0] = 0  # idle steps, different per rank
    return sizes.tolist()


def main(argv: list[str] | None = None) -> None:
    defaults = DemoConfig()
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="launch/demo.py also takes --nproc N: the number of ranks (default: every "
        "GPU, or 2 on a CPU machine)",
    )
    for name, value in vars(defaults).items():
        p.add_argument(
            f"--{name.replace('_', '-')}",
            type=type(value),
            default=value,
            choices=CHOICES.get(name),
            help=f"{HELP[name]} (default: {value})",
        )
    cfg = DemoConfig(**vars(p.parse_args(argv)))
    for name, lo in MINIMUM.items():
        if getattr(cfg, name) < lo:
            p.error(f"--{name.replace('_', '-')} must be at least {lo}, got {getattr(cfg, name)}")
    if cfg.top_k > cfg.num_experts:
        p.error(f"--top-k {cfg.top_k} exceeds --num-experts {cfg.num_experts}")

    group = epmoe.init_distributed()
    rank = dist.get_rank() if group is not None else 0
    world = dist.get_world_size() if group is not None else 1
    device = default_device(group)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def make_moe(layer: int) -> epmoe.EPMoE:
        moe = epmoe.EPMoE(
            cfg.num_experts,
            cfg.top_k,
            cfg.hidden_size,
            cfg.intermediate_size,
            group=group,
            placement="linear" if cfg.placement == "eplb" else cfg.placement,
            backend=cfg.backend,
            experts=cfg.experts,
            params_dtype=dtype,
            device=device,
            load_window=cfg.rebalance_every if cfg.placement == "eplb" else cfg.steps,
        )
        moe.load_experts(*expert_weights(cfg, layer, dtype, device))
        return moe

    def make_oracle(layer: int) -> OracleMoE:
        return OracleMoE(cfg.top_k, *expert_weights(cfg, layer, dtype, device))

    model = build_model(cfg, make_moe, make_oracle, dtype, device)
    manager = None
    if cfg.placement == "eplb":
        E = cfg.num_experts
        manager = epmoe.EPLBManager(
            [b.moe for b in model],
            num_redundant=(-E) % world + world,  # a spare slot per rank for hot experts
            rebalance_interval=cfg.rebalance_every,
        )
    sizes = batch_sizes(cfg, rank)
    gen = torch.Generator().manual_seed(99 + rank)

    served, busy_s = 0, 0.0
    with torch.inference_mode():
        for step, T in enumerate(sizes):
            x = torch.randn(T, cfg.hidden_size, generator=gen).to(device, dtype)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step >= 2:  # the first steps warm up (allocations, kernel compilation)
                busy_s += time.perf_counter() - t0
                served += T
            if step % 5 == 0:  # the same step again, every layer checked (all ranks)
                _set_checking(model, True)
                model(x)
                _set_checking(model, False)
            if manager is not None and step + 1 < cfg.steps:  # (the last window is shown)
                report = manager.step()
                if report is not None and rank == 0:
                    print(f"  {report.summary()}")

    moes = [b.moe for b in model]
    load_per_rank = torch.zeros(world, dtype=torch.int64, device=device)
    for moe in moes:
        load_P = moe.load_recorder.global_load(group)
        owner = moe.placement.owner_rank.to(device)
        load_per_rank.index_add_(0, owner, load_P)
    worst_error = max(block.max_error for block in model)
    checked = sum(block.checked for block in model)
    stats = torch.tensor([served, busy_s, worst_error, checked], dtype=torch.float64, device=device)
    if group is not None:
        everyone = [torch.zeros_like(stats) for _ in range(world)]
        dist.all_gather(everyone, stats)
    else:
        everyone = [stats]
    if rank == 0:
        tokens = sum(int(s[0]) for s in everyone)
        seconds = max(float(s[1]) for s in everyone)
        error = max(float(s[2]) for s in everyone)
        checked = sum(int(s[3]) for s in everyone)
        load = load_per_rank.tolist()
        mean = sum(load) / len(load)
        print(
            f"epmoe demo: {world} rank(s) on {device.type}, {cfg.num_layers} MoE layers, "
            f"E={cfg.num_experts} top-{cfg.top_k}, H={cfg.hidden_size}, {dtype}, "
            f"backend={moes[0].comm.name} ({moes[0].comm.layout.value})"
            + (
                f" + {moes[0].decode_comm.name} for steps of <= {moes[0].decode_max_tokens} "
                "tokens/rank"
                if moes[0].decode_comm is not None
                else ""
            )
            + f", experts={moes[0].experts.name}, placement={cfg.placement}"
        )
        print(
            f"  served      {tokens} tokens in {cfg.steps - 2} timed steps: "
            f"{tokens / max(seconds, 1e-9):,.0f} tokens/s"
        )
        print(
            "  expert load (token-expert pairs per rank, all layers"
            + (", since the last re-plan): " if manager is not None else "): ")
            + ", ".join(f"rank {r}: {n}" for r, n in enumerate(load))
            + f"  (balancedness {mean / max(max(load), 1):.3f})"
        )
        print(
            f"  max relative error of an MoE layer vs the single-process oracle: {error:.2e} "
            f"({checked} layer outputs checked)"
            if checked
            else "  no MoE layer output was checked against the oracle (no tokens at the "
            "checked steps): run more --steps"
        )
    if group is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
