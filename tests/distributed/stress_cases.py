"""A seeded randomized stress of ``EPMoE`` against the oracle, on every rank.

One loop, two callers: ``tests/distributed/test_stress.py`` runs it on 3 gloo ranks for a
wall-clock budget (the CPU tier), ``launch/stress.py`` runs it under torchrun on GPUs (NCCL,
bf16, ``all_to_all`` and ``symm_ll``, FP8 dispatch) for a number of steps per configuration.

Every step, on every rank:

1. the ranks agree whether to go on (one tiny all-reduce: the budget is wall-clock, and a
   rank that stopped alone would leave the others inside a collective);
2. the next configuration in turn (backend, layout, placement, chunk size, FP8 dispatch)
   serves the step;
3. a generator seeded with ``(seed, step)``, identical on every rank, draws the routing
   mode (all tokens to one expert, all to one rank, Zipf-skewed, random, all tied) and
   every rank's token count (uneven, often 0, sometimes 0 on every rank, often more than
   one chunk);
4. each rank builds its own tokens and router logits (seeded with ``(seed, step, rank)``),
   runs the layer and compares the output with ``epmoe.reference.moe`` on its own tokens
   with the full weights: a relative error above the dtype's tolerance is a mismatch,
   recorded (never raised: a raise on one rank would leave the others waiting). With FP8
   dispatch each call is compared with the oracle on the FP8 rows the wire delivers
   (``quantize_groups`` round trip; tolerance: bf16's, the experts' output dtype), and the
   error against the unquantized oracle, pooled over all the calls of the configuration,
   must stay within ``TOLERANCES[float8_e4m3fn]`` (per call it does not: a few tokens all
   on one expert can reach 7.6e-2 from the FP8 rounding alone, see docs/reliability.md);
5. every few calls of a configuration, a live re-plan: a balanced placement from the
   recorded load (redundant replicas), a random map with uneven slot counts, or linear /
   round-robin, installed with ``layer.rebalance`` (weights migrate between ranks).

Reproduce a failure: the seed and the step are in the report; the same seed replays the
same steps (``EPMOE_STRESS_SEED``, ``EPMOE_STRESS_STEPS``).

Shape legend: T tokens on a rank · H hidden · I intermediate · E logical experts ·
P physical experts · K top-k · W world · M max tokens per chunk.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import epmoe
from epmoe.comm.base import FP8_GROUP
from epmoe.eplb.recorder import logical_load
from epmoe.reference import TOLERANCES, quantize_groups, relative_error
from tests.distributed.cases import device_for, full_weights

ROUTING_MODES = ("one_expert", "one_rank", "zipf", "random", "tied")
MAX_REPORTED = 20  # mismatches kept in full per rank


@dataclass(frozen=True)
class Shape:
    num_experts: int  # E
    top_k: int  # K
    hidden_size: int  # H
    intermediate_size: int  # I


@dataclass(frozen=True)
class StressConfig:
    """One layer of the stress: what serves the steps given to it."""

    name: str
    backend: str
    layout: str  # "standard" or "expert_batched"
    placement: str  # "linear", "round_robin" or "balanced" (redundant replicas)
    max_num_tokens: int | None = None  # M: small values chunk the batch
    fp8: bool = False  # dispatch_dtype=torch.float8_e4m3fn
    prefer_local: bool = False


CPU_SHAPE = Shape(num_experts=8, top_k=2, hidden_size=160, intermediate_size=32)
GPU_SHAPE = Shape(num_experts=16, top_k=4, hidden_size=384, intermediate_size=128)

# CPU tier (gloo): the portable backends, both layouts, chunking, replicas, FP8 dispatch
CPU_CONFIGS = (
    StressConfig("naive linear", "naive", "standard", "linear"),
    StressConfig("naive balanced M=4", "naive", "standard", "balanced", 4),
    StressConfig("a2a std round_robin M=5", "all_to_all", "standard", "round_robin", 5),
    StressConfig(
        "a2a std balanced fp8 local", "all_to_all", "standard", "balanced", None, True, True
    ),
    StressConfig("a2a batched linear M=6", "all_to_all", "expert_batched", "linear", 6),
    StressConfig("a2a batched balanced fp8", "all_to_all", "expert_batched", "balanced", 16, True),
)

# GPU tier (NCCL, bf16): every backend of ours, with and without FP8 dispatch
GPU_CONFIGS = (
    StressConfig("naive round_robin M=48", "naive", "standard", "round_robin", 48),
    StressConfig("naive balanced fp8", "naive", "standard", "balanced", None, True),
    StressConfig("a2a std balanced", "all_to_all", "standard", "balanced", 64),
    StressConfig("a2a std linear fp8", "all_to_all", "standard", "linear", None, True),
    StressConfig("a2a batched round_robin M=16", "all_to_all", "expert_batched", "round_robin", 16),
    StressConfig("a2a batched balanced fp8", "all_to_all", "expert_batched", "balanced", 64, True),
    StressConfig("symm_ll linear M=32", "symm_ll", "expert_batched", "linear", 32),
    StressConfig("symm_ll balanced fp8 M=64", "symm_ll", "expert_batched", "balanced", 64, True),
    StressConfig("symm_ht balanced M=64", "symm_ht", "standard", "balanced", 64),
    StressConfig("symm_ht round_robin fp8 M=32", "symm_ht", "standard", "round_robin", 32, True),
)


@dataclass
class ConfigStats:
    calls: int = 0
    rebalances: int = 0
    tokens: int = 0  # this rank's tokens served
    max_error: float = 0.0  # per call, against the oracle the calls are checked with
    tolerance: float = 0.0
    modes: dict[str, int] = dataclasses.field(default_factory=dict)
    # FP8 dispatch only: the error against the unquantized oracle, per call (largest) and
    # pooled over all calls (‖out − ref‖² and ‖ref‖² summed), with its tolerance
    fp8_max_error: float = 0.0
    fp8_sq_diff: float = 0.0
    fp8_sq_ref: float = 0.0
    fp8_tolerance: float = 0.0

    @property
    def fp8_pooled_error(self) -> float:
        return (self.fp8_sq_diff / self.fp8_sq_ref) ** 0.5 if self.fp8_sq_ref > 0 else 0.0


def fp8_wire_input(x_TH: torch.Tensor) -> torch.Tensor:
    """``x_TH`` as the experts see it after FP8 dispatch: e4m3 values times their float32
    scale per 128 columns (``epmoe.reference.quantize_groups``), in float32."""
    q_TH, scale_TG = quantize_groups(x_TH, FP8_GROUP)
    H = x_TH.shape[-1]
    return q_TH.float() * scale_TG.repeat_interleave(FP8_GROUP, dim=-1)[..., :H]


def _redundant(E: int, W: int, rng: random.Random) -> int:
    """A redundant-slot count that gives every rank as many slots (0 … W more)."""
    return (-E) % W + W * rng.randrange(0, 2)


def _initial_placement(cfg: StressConfig, shape: Shape, W: int, rng: random.Random):
    E = shape.num_experts
    if cfg.placement == "linear":
        return epmoe.ExpertPlacement.linear(E, W)
    if cfg.placement == "round_robin":
        return epmoe.ExpertPlacement.round_robin(E, W)
    load = torch.tensor([rng.random() ** 3 for _ in range(E)], dtype=torch.float64) + 0.01
    return epmoe.ExpertPlacement.balanced(load, ep_size=W, num_redundant=_redundant(E, W, rng))


def _random_placement(E: int, W: int, rng: random.Random) -> epmoe.ExpertPlacement:
    """Every logical expert once plus up to W + 1 extra replicas, shuffled over uneven
    slot counts (every rank at least one)."""
    P = max(E + rng.randrange(0, W + 2), W)
    p2l = list(range(E)) + [rng.randrange(E) for _ in range(P - E)]
    rng.shuffle(p2l)
    cuts = sorted(rng.sample(range(1, P), W - 1)) if W > 1 else []
    offsets = [0, *cuts, P]
    return epmoe.ExpertPlacement.from_physical_to_logical(
        torch.tensor(p2l), W, num_experts=E, rank_offsets=offsets
    )


def _replan(layer: epmoe.EPMoE, E: int, W: int, rng: random.Random) -> epmoe.ExpertPlacement:
    """The next placement, the same on every rank (shared generator; the recorded load is
    summed over the ranks). Collective: every rank calls it."""
    load_P = layer.load_recorder.global_load(layer.group)  # collective, every time
    kind = rng.choice(("balanced", "balanced", "random", "linear", "round_robin"))
    if kind == "balanced":
        load_E = logical_load(load_P, layer.placement.physical_to_logical, E).cpu().double()
        return epmoe.ExpertPlacement.balanced(
            load_E + 1.0, ep_size=W, num_redundant=_redundant(E, W, rng)
        )
    if kind == "random":
        return _random_placement(E, W, rng)
    if kind == "linear":
        return epmoe.ExpertPlacement.linear(E, W)
    return epmoe.ExpertPlacement.round_robin(E, W)


def _token_counts(W: int, M: int | None, rng: random.Random) -> list[int]:
    """Every rank's T this step: uneven, often 0 (sometimes on every rank), often more
    than one chunk of M."""
    if rng.random() < 0.08:
        return [0] * W
    top = 3 * M + 1 if M else 40
    return [0 if rng.random() < 0.2 else rng.randint(1, top) for _ in range(W)]


def _router_logits(mode, T, shape, layer, rng_args, gen, dev) -> torch.Tensor:
    """``[T, E]`` float32 logits of one routing mode (``rng_args``: the mode's shared
    parameters; ``gen``: this rank's generator)."""
    E, K = shape.num_experts, shape.top_k
    noise = torch.randn(T, E, generator=gen)
    if mode == "one_expert":  # every token picks the hot expert (and K - 1 others)
        noise[:, rng_args["expert"]] += 20.0
    elif mode == "one_rank":  # every token prefers the experts held by one rank
        held = sorted(set(layer.placement.local_experts(rng_args["rank"])))
        noise[:, held] += 20.0
    elif mode == "zipf":
        sim = epmoe.RoutingSimulator(
            E, K, "zipf", alpha=rng_args["alpha"], seed=rng_args["seed"], shuffle=True
        )
        noise = sim.router_logits(T, generator=gen)
    elif mode == "tied":  # every score equal: top-k breaks the ties
        noise = torch.zeros(T, E)
    return noise.to(dev)


def stress(
    rank: int,
    world: int,
    device: str = "cpu",
    dtype_name: str = "float32",
    *,
    seed: int = 0,
    budget_s: float | None = 30.0,
    steps_per_config: int = 1_000_000,
    configs: tuple[StressConfig, ...] | None = None,
    shape: Shape | None = None,
    rebalance_every: int = 4,
    experts: str | None = None,
) -> dict:
    """Run the stress loop on this rank (all ranks call it alike); return this rank's
    statistics (``summarize`` merges them). Stops when the budget is spent or every
    configuration served ``steps_per_config`` steps, whichever comes first."""
    dtype = getattr(torch, dtype_name)
    dev = device_for(rank, device)
    gpu = dev.type == "cuda"
    configs = configs or (GPU_CONFIGS if gpu else CPU_CONFIGS)
    shape = shape or (GPU_SHAPE if gpu else CPU_SHAPE)
    experts = experts or ("auto" if gpu else "torch")
    E, K, H, I = dataclasses.astuple(shape)
    W = world
    setup = random.Random(seed)
    layers, weights = [], []
    for i, cfg in enumerate(configs):
        layer = epmoe.EPMoE(
            E, K, H, I,
            placement=_initial_placement(cfg, shape, W, setup),
            backend=cfg.backend, layout=cfg.layout, experts=experts,
            max_num_tokens=cfg.max_num_tokens, params_dtype=dtype, device=dev,
            prefer_local_replica=cfg.prefer_local, load_window=rebalance_every,
            dispatch_dtype=torch.float8_e4m3fn if cfg.fp8 else None,
        )  # fmt: skip
        w13, w2 = full_weights(E, H, I, dtype, dev, seed=seed * 31 + i)
        layer.load_experts(w13, w2)
        layers.append(layer)
        weights.append((w13, w2))
    stats = {cfg.name: ConfigStats() for cfg in configs}
    for cfg in configs:
        st = stats[cfg.name]
        # FP8 rows come out of the experts in bf16: its tolerance, or the dtype's if larger
        st.tolerance = max(TOLERANCES[dtype], TOLERANCES[torch.bfloat16] if cfg.fp8 else 0.0)
        st.fp8_tolerance = TOLERANCES[torch.float8_e4m3fn] if cfg.fp8 else 0.0
    mismatches: list[dict] = []
    num_mismatches = 0
    total_steps = steps_per_config * len(configs)

    start = time.monotonic()
    step = 0
    with torch.inference_mode():
        while True:
            over = step >= total_steps or (
                budget_s is not None and time.monotonic() - start > budget_s
            )
            if _agree_any(over, dev):
                break
            c = step % len(configs)
            cfg, layer, (w13, w2) = configs[c], layers[c], weights[c]
            st = stats[cfg.name]
            rng = random.Random(f"{seed}/{step}")  # identical on every rank
            tokens = _token_counts(W, cfg.max_num_tokens, rng)
            mode = rng.choice(ROUTING_MODES)
            mode_args = dict(
                expert=rng.randrange(E),
                rank=rng.randrange(W),
                alpha=rng.choice((0.8, 1.2, 2.0)),
                seed=rng.randrange(1 << 30),
            )
            gen = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1024 + rank)
            T = tokens[rank]
            x = torch.randn(T, H, generator=gen).to(dev, dtype)
            logits = _router_logits(mode, T, shape, layer, mode_args, gen, dev)

            out = layer(x, logits)
            topk_w, topk_ids = epmoe.select_experts(logits, K)
            ref = epmoe.reference.moe(x, w13, w2, topk_w, topk_ids)
            if out.shape != ref.shape:
                err = float("inf")
            elif cfg.fp8:
                exact = out.double() - ref.double()
                st.fp8_sq_diff += float(exact.square().sum())
                st.fp8_sq_ref += float(ref.double().square().sum())
                st.fp8_max_error = max(st.fp8_max_error, relative_error(out, ref))
                wire = fp8_wire_input(x)
                err = relative_error(out, epmoe.reference.moe(wire, w13, w2, topk_w, topk_ids))
            else:
                err = relative_error(out, ref)
            st.calls += 1
            st.tokens += T
            st.modes[mode] = st.modes.get(mode, 0) + 1
            st.max_error = max(st.max_error, err)
            if not err <= st.tolerance:
                num_mismatches += 1
                if len(mismatches) < MAX_REPORTED:
                    mismatches.append(
                        dict(step=step, config=cfg.name, mode=mode, tokens=tokens,
                             error=err, tolerance=st.tolerance,
                             placement=repr(layer.placement))
                    )  # fmt: skip
            if st.calls % rebalance_every == 0:
                layer.rebalance(_replan(layer, E, W, rng))
                st.rebalances += 1
            step += 1
    seconds = time.monotonic() - start
    for name, st in stats.items():
        if st.fp8_tolerance and not st.fp8_pooled_error <= st.fp8_tolerance:
            num_mismatches += 1
            mismatches.append(
                dict(config=name, pooled_fp8_error=st.fp8_pooled_error,
                     tolerance=st.fp8_tolerance, calls=st.calls)
            )  # fmt: skip
    for layer in layers:  # fixed-buffer backends hold shared transports
        for comm in (layer.comm, layer.decode_comm):
            if comm is not None:
                comm.close()
    return dict(
        rank=rank,
        seed=seed,
        steps=step,
        seconds=seconds,
        calls=sum(s.calls for s in stats.values()),
        rebalances=sum(s.rebalances for s in stats.values()),
        num_mismatches=num_mismatches,
        mismatches=mismatches,
        configs={
            name: dict(dataclasses.asdict(s), fp8_pooled_error=s.fp8_pooled_error)
            for name, s in stats.items()
        },
    )


def _agree_any(flag: bool, dev: torch.device) -> bool:
    """Whether any rank raised ``flag`` (one tiny all-reduce)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def summarize(results: list[dict]) -> str:
    """A short report of every rank's statistics: totals, then one line per config."""
    r0 = results[0]
    lines = [
        f"stress: seed {r0['seed']}, {len(results)} ranks, {r0['steps']} steps in "
        f"{r0['seconds']:.1f} s: {r0['calls']} layer calls per rank "
        f"({r0['calls'] * len(results)} in all), {r0['rebalances']} live rebalances, "
        f"{sum(r['num_mismatches'] for r in results)} mismatches against the oracle"
    ]
    for name in r0["configs"]:
        per_rank = [r["configs"][name] for r in results]
        s0 = per_rank[0]
        modes = ", ".join(f"{m} {n}" for m, n in sorted(s0["modes"].items()))
        fp8 = ""
        if s0["fp8_tolerance"]:
            fp8 = (
                f"; against the unquantized oracle: pooled "
                f"{max(s['fp8_pooled_error'] for s in per_rank):.2e} (tolerance "
                f"{s0['fp8_tolerance']:.0e}), largest per call "
                f"{max(s['fp8_max_error'] for s in per_rank):.2e}"
            )
        lines.append(
            f"  {name}: {s0['calls']} calls, {s0['rebalances']} rebalances, "
            f"{sum(s['tokens'] for s in per_rank)} tokens, max error "
            f"{max(s['max_error'] for s in per_rank):.2e} (tolerance {s0['tolerance']:.0e})"
            f"{fp8}; {modes}"
        )
    for r in results:
        for m in r["mismatches"]:
            lines.append(f"  MISMATCH rank {r['rank']}: {m}")
    return "\n".join(lines)


# ------------------------------------------------------------------------ determinism

DETERMINISM_CONFIGS = (
    StressConfig("naive standard", "naive", "standard", "balanced", 5),
    StressConfig("all_to_all standard", "all_to_all", "standard", "balanced", 5),
    StressConfig("all_to_all expert_batched", "all_to_all", "expert_batched", "balanced", 5),
    StressConfig("all_to_all standard fp8", "all_to_all", "standard", "linear", 5, True),
    StressConfig(
        "all_to_all expert_batched fp8", "all_to_all", "expert_batched", "linear", 5, True
    ),
)
# on GPUs also the symmetric-memory backends (their slot order varies from call to call:
# whether the outputs do is what this measures), with the Triton experts
GPU_DETERMINISM_CONFIGS = (
    StressConfig("symm_ll expert_batched", "symm_ll", "expert_batched", "balanced", 16),
    StressConfig("symm_ll expert_batched fp8", "symm_ll", "expert_batched", "linear", 16, True),
    StressConfig("symm_ht standard", "symm_ht", "standard", "balanced", 16),
)


def check_determinism(rank: int, world: int, device: str = "cpu", dtype_name: str = "float32"):
    """Run the same inputs through each backend and layout several times and compare the
    outputs bitwise: the same layer twice, a freshly built layer with the same weights,
    and the layer after a re-plan away and back. Returns, per config, which of these were
    bitwise equal to the first run, and the largest relative difference between backends
    (bitwise equality across backends is not promised: they add partial sums in different
    orders)."""
    dtype = getattr(torch, dtype_name)
    dev = device_for(rank, device)
    shape = CPU_SHAPE
    E, K, H, I = dataclasses.astuple(shape)
    setup = random.Random(7)
    placements = {c.name: _initial_placement(c, shape, world, setup) for c in DETERMINISM_CONFIGS}
    w13, w2 = full_weights(E, H, I, dtype, dev, seed=11)
    gen = torch.Generator().manual_seed(100 + rank)
    steps = []
    for T in ([13, 0, 7, 1] * 2)[rank : rank + 3]:  # uneven, a zero, several chunks
        x = torch.randn(T, H, generator=gen).to(dev, dtype)
        steps.append((x, torch.randn(T, E, generator=gen).to(dev)))

    configs = DETERMINISM_CONFIGS + (GPU_DETERMINISM_CONFIGS if dev.type == "cuda" else ())
    placements |= {
        c.name: _initial_placement(c, shape, world, setup) for c in GPU_DETERMINISM_CONFIGS
    }
    experts = "triton" if dev.type == "cuda" else "torch"

    def build(cfg: StressConfig) -> epmoe.EPMoE:
        layer = epmoe.EPMoE(
            E, K, H, I, placement=placements[cfg.name], backend=cfg.backend,
            layout=cfg.layout, experts=experts, max_num_tokens=cfg.max_num_tokens,
            params_dtype=dtype, device=dev,
            dispatch_dtype=torch.float8_e4m3fn if cfg.fp8 else None,
        )  # fmt: skip
        layer.load_experts(w13, w2)
        return layer

    def run(layer: epmoe.EPMoE) -> list[torch.Tensor]:
        return [layer(x, logits) for x, logits in steps]

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return all(torch.equal(p, q) for p, q in zip(a, b))

    report, first = {}, {}
    with torch.inference_mode():
        for cfg in configs:
            layer = build(cfg)
            a, b = run(layer), run(layer)
            fresh = run(build(cfg))
            away = _random_placement(E, world, random.Random(3))
            layer.rebalance(away)
            layer.rebalance(placements[cfg.name])
            back = run(layer)
            first[cfg.name] = a
            report[cfg.name] = dict(
                repeat=same(a, b), fresh_layer=same(a, fresh), after_replan=same(a, back)
            )
    base = first["naive standard"]
    others = ["all_to_all standard", "all_to_all expert_batched"]
    others += [c.name for c in configs if c.name.startswith("symm") and not c.fp8]
    for name in others:
        report[name]["bitwise_equal_to_naive"] = same(first[name], base)
        report[name]["max_error_to_naive"] = max(
            (relative_error(p, q) for p, q in zip(first[name], base)), default=0.0
        )
    return report
