"""Live EPLB over the MoE layers of a model: record load, re-plan, move weights.

Shape legend: L MoE layers · E logical experts · P physical slots (E + redundant) · W EP
ranks.

Cycle (vLLM and SGLang run the same one; vLLM records a window of 1000 steps and re-plans
every 3000, SGLang every 1000): every layer's
:class:`~epmoe.eplb.recorder.LoadRecorder` counts tokens per physical slot on the device
while serving; every ``rebalance_interval`` steps the manager sums each layer's window over
the EP ranks (one all-reduce for all layers), folds replicas into logical load ``[L, E]``,
plans every layer at once (:meth:`ExpertPlacement.balanced_layers`, migration-aware when
the slot layout is unchanged) and re-places the layers one at a time
(:meth:`EPMoE.rebalance <epmoe.layer.EPMoE.rebalance>`: the weights that move travel
point-to-point, the layer installs them and rebinds its backend), so extra memory is
bounded by one layer.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from epmoe.agreement import ReplanAgreement
from epmoe.comm.collectives import world_of
from epmoe.eplb.algorithm import check_tolerance, groups_on_nodes
from epmoe.eplb.migration import MigrationStats
from epmoe.eplb.recorder import logical_load
from epmoe.placement import ExpertPlacement

if TYPE_CHECKING:  # pragma: no cover
    from epmoe.layer import EPMoE

__all__ = [
    "EPLBManager",
    "LayerRebalance",
    "RebalanceReport",
    "measured_balancedness",
    "measured_rank_load",
]


@dataclass(frozen=True)
class LayerRebalance:
    """One layer's part of a re-plan (this rank's view; the balancedness figures are the
    same on every rank).

    ``measured_before``: balancedness of the tokens the ranks actually received in the
    window (per-slot counts summed by owner rank). ``expected_before`` / ``expected_after``:
    the old and new placement under the window's logical load, each expert's load split
    evenly over its replicas (what the planner optimises). ``planned``: the layer had load
    in the window (a layer without any keeps its placement). ``changed``: its placement
    changed. ``migration``: this rank's :class:`MigrationStats`.
    """

    layer: int
    tokens: int  # (token, expert) assignments recorded in the window: K per routed token
    measured_before: float
    expected_before: float
    expected_after: float
    planned: bool
    changed: bool
    migration: MigrationStats


@dataclass(frozen=True)
class RebalanceReport:
    """The outcome of :meth:`EPLBManager.rebalance` on this rank.

    ``step``: the manager's step count when it ran. ``reduce_seconds``: the load all-reduce;
    ``plan_seconds``: the re-plan of all layers; ``migrate_seconds``: moving the weights of
    all layers (device synchronised).
    """

    step: int
    layers: tuple[LayerRebalance, ...]
    reduce_seconds: float
    plan_seconds: float
    migrate_seconds: float

    @property
    def slots_moved(self) -> int:
        return sum(r.migration.slots_moved for r in self.layers)

    @property
    def bytes_sent(self) -> int:
        return sum(r.migration.bytes_sent for r in self.layers)

    @property
    def bytes_received(self) -> int:
        return sum(r.migration.bytes_received for r in self.layers)

    def summary(self) -> str:
        """One line for logs: the layers' mean balancedness as measured in the window,
        then as the planner expects it (replicas sharing their expert's load evenly) under
        the old and the new placement."""
        n = len(self.layers)
        mb = sum(r.measured_before for r in self.layers) / max(n, 1)
        eb = sum(r.expected_before for r in self.layers) / max(n, 1)
        ea = sum(r.expected_after for r in self.layers) / max(n, 1)
        changed = sum(r.changed for r in self.layers)
        return (
            f"EPLB step {self.step}: {changed}/{n} layers re-placed, balancedness "
            f"{mb:.3f} measured, expected {eb:.3f} -> {ea:.3f}, {self.slots_moved} slots moved "
            f"({self.bytes_received / 2**20:.1f} MiB in), plan {self.plan_seconds * 1e3:.1f} ms, "
            f"migration {self.migrate_seconds * 1e3:.1f} ms"
        )


class EPLBManager:
    """Periodic load-balancing of a list of :class:`~epmoe.layer.EPMoE` layers.

    Args:
        layers: the MoE layers, sharing one EP group and E; each built with
            ``EPMoE(..., load_window=N)`` so that it records its load.
        num_redundant: extra replica slots per layer (``E + num_redundant`` must be a
            multiple of W; E/8 is a common choice).
        num_groups: expert groups of the hierarchical policy of DeepSeek's EPLB (groups
            kept within one node); ``num_groups % num_nodes != 0`` falls back to global.
        num_nodes: nodes of that policy.
        rebalance_interval: :meth:`step` re-plans every this many steps.
        tolerance: balancedness margin within which a layer keeps its current placement
            (no migration): kept when its expected balancedness under the measured load is
            at least the new plan's minus ``tolerance`` (see
            :func:`epmoe.eplb.algorithm.rebalance`; also applied when the slot count
            changes). With 0.0 a layer moves whenever the new plan is strictly better.
        prefer_local_replica: if a bool, set on every layer (use a replica on the sending
            rank when it has one); ``None`` leaves each layer's setting.

    Cross-rank contract: every rank of the group calls :meth:`step` (or :meth:`rebalance`)
    at the same points, because a re-plan is collective. Each re-plan first agrees (one
    small all-gather, :mod:`epmoe.agreement`) that every rank is in it with the same
    settings, step count and layers: a rank built with another ``rebalance_interval``
    (which re-plans while the others run a forward with its own agreement, or a step)
    or over other layers raises on every rank, naming the difference. The plan is then
    computed on every rank from the same all-reduced counts, so it is identical (and
    checked).
    """

    def __init__(
        self,
        layers: Sequence[EPMoE],
        *,
        num_redundant: int = 0,
        num_groups: int = 1,
        num_nodes: int = 1,
        rebalance_interval: int = 3000,
        tolerance: float = 0.0,
        prefer_local_replica: bool | None = None,
    ) -> None:
        from epmoe.layer import EPMoE

        if isinstance(layers, torch.nn.Module) or not isinstance(layers, Iterable):
            raise TypeError(
                f"layers must be a list of EPMoE layers, got {type(layers).__name__}; pass "
                "[layer] for one"
            )
        layers = list(layers)
        if not layers:
            raise ValueError("layers must hold at least one EPMoE layer, got none")
        for i, layer in enumerate(layers):
            if not isinstance(layer, EPMoE):
                raise TypeError(f"layers[{i}] must be an EPMoE, got {type(layer).__name__}")
            if layer.load_recorder is None:
                raise ValueError(
                    f"layers[{i}] records no expert load; build it with "
                    "EPMoE(..., load_window=N) (N forwards per window, e.g. 1000)"
                )
        first = layers[0]
        for i, layer in enumerate(layers[1:], 1):
            if layer.group is not first.group or layer.ep_size != first.ep_size:
                raise ValueError(
                    f"layers[{i}] uses another process group than layers[0]; one manager "
                    "serves layers of one EP group"
                )
            if layer.num_experts != first.num_experts:
                raise ValueError(
                    f"layers[{i}] has E={layer.num_experts}, layers[0] E={first.num_experts}; "
                    "use one manager per expert count"
                )
        for name, value, minimum in [
            ("num_redundant", num_redundant, 0),
            ("num_groups", num_groups, 1),
            ("num_nodes", num_nodes, 1),
            ("rebalance_interval", rebalance_interval, 1),
        ]:
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        E, W = first.num_experts, first.ep_size
        if (E + num_redundant) % W:
            lo = (E + num_redundant) // W * W - E
            ok = " or ".join(f"num_redundant={r}" for r in (lo, lo + W) if r >= 0)
            raise ValueError(
                f"E + num_redundant = {E} + {num_redundant} must be a multiple of the EP size "
                f"{W} (every rank holds the same number of slots); use {ok}"
            )
        if W % num_nodes:
            raise ValueError(f"the EP size {W} must be a multiple of num_nodes={num_nodes}")
        if E % num_groups:
            raise ValueError(f"num_experts={E} must be a multiple of num_groups={num_groups}")
        tolerance = check_tolerance(tolerance)
        if prefer_local_replica is not None:
            for layer in layers:
                layer.prefer_local_replica = bool(prefer_local_replica)

        self.layers = layers
        self.group = first.group
        self.num_experts, self.ep_size = E, W
        self.num_redundant, self.num_groups, self.num_nodes = num_redundant, num_groups, num_nodes
        self.rebalance_interval = rebalance_interval
        self.tolerance = tolerance
        self.steps = 0
        self.last_report: RebalanceReport | None = None
        self._agreement = ReplanAgreement(self.group)

    def step(self) -> RebalanceReport | None:
        """Count one serving step (call it once per model forward, on every rank); every
        ``rebalance_interval`` steps run :meth:`rebalance` and return its report."""
        self.steps += 1
        if self.steps % self.rebalance_interval:
            return None
        return self.rebalance()

    @torch.no_grad()
    def rebalance(self) -> RebalanceReport:
        """Re-plan every layer from its recorded window and migrate (collective)."""
        E, W = self.num_experts, self.ep_size
        t0 = time.perf_counter()
        # every rank in this re-plan, with the same settings and layers: else a rank would
        # meet a layer's collective with the load all-reduce (or one of another size)
        self._agreement.replan(self._settings(), self.layers[0].device)
        physical = self._global_physical_load()  # per layer [P_l] int64, CPU
        t1 = time.perf_counter()

        olds = [layer.placement for layer in self.layers]
        load_LE = torch.stack(
            [logical_load(p, old.physical_to_logical, E) for p, old in zip(physical, olds)]
        ).to(torch.float64)
        planned = [i for i in range(len(self.layers)) if float(load_LE[i].sum()) > 0]
        news = list(olds)
        P = E + self.num_redundant
        even = tuple(range(0, P + 1, P // W))
        # layers whose slot layout stays are planned from their current placement (the
        # planner keeps experts in place and applies the tolerance), the others from scratch
        for same_slots in (True, False):
            part = [
                i
                for i in planned
                if (olds[i].num_physical == P and olds[i].rank_offsets == even) == same_slots
            ]
            if not part:
                continue
            plans = ExpertPlacement.balanced_layers(
                load_LE[part],
                W,
                num_redundant=self.num_redundant,
                num_groups=self.num_groups,
                num_nodes=self.num_nodes,
                current=[olds[i] for i in part] if same_slots else None,
                tolerance=self.tolerance,
            )
            for i, p in zip(part, plans):
                # when the slot layout changes (e.g. redundant slots are added) apply the
                # planner's rule here: keep a layer whose current placement is within
                # tolerance
                keep = (
                    not same_slots
                    and olds[i].balancedness(load_LE[i])
                    >= p.balancedness(load_LE[i]) - self.tolerance
                    and self._keeps_groups_on_nodes(olds[i])
                )
                news[i] = olds[i] if keep else p
        t2 = time.perf_counter()

        rows = []
        for i, (layer, old, new) in enumerate(zip(self.layers, olds, news)):
            stats = layer.rebalance(new)
            rows.append(
                LayerRebalance(
                    layer=i,
                    tokens=int(physical[i].sum()),
                    measured_before=measured_balancedness(old, physical[i]),
                    expected_before=old.balancedness(load_LE[i]),
                    expected_after=new.balancedness(load_LE[i]),
                    planned=i in planned,
                    changed=new != old,
                    migration=stats,
                )
            )
        t3 = time.perf_counter()
        report = RebalanceReport(
            step=self.steps,
            layers=tuple(rows),
            reduce_seconds=t1 - t0,
            plan_seconds=t2 - t1,
            migrate_seconds=t3 - t2,
        )
        self.last_report = report
        return report

    def _keeps_groups_on_nodes(self, placement: ExpertPlacement) -> bool:
        """Whether ``placement`` keeps each expert group on one node, as the hierarchical
        policy (``num_groups % num_nodes == 0``, more than one node) wants; True else."""
        G, N = self.num_groups, self.num_nodes
        if N <= 1 or G <= 1 or G % N:
            return True
        node_P = placement.owner_rank // (placement.ep_size // N)
        p2l = placement.physical_to_logical[None]
        return bool(groups_on_nodes(p2l, placement.num_experts, G, node_P)[0])

    def _settings(self) -> dict[str, str]:
        """What every rank's manager must hold equal at a re-plan (its agreement's fields):
        its settings, its step count and its layers (their agreement indices and slots)."""
        return {
            "layers": str([layer._agreement.index for layer in self.layers]),
            "slots per layer": str([layer.placement.num_physical for layer in self.layers]),
            "num_redundant": str(self.num_redundant),
            "num_groups": str(self.num_groups),
            "num_nodes": str(self.num_nodes),
            "rebalance_interval": str(self.rebalance_interval),
            "tolerance": repr(self.tolerance),
            "steps": str(self.steps),
        }

    def _global_physical_load(self) -> list[torch.Tensor]:
        """Every layer's window load summed over the EP ranks: one all-reduce of the
        concatenated ``[ΣP_l]`` counts. Returns one CPU int64 ``[P_l]`` tensor per layer."""
        local = [layer.load_recorder.window_load() for layer in self.layers]
        flat = torch.cat([t.to(local[0].device) for t in local])
        if world_of(self.group)[1] > 1:
            dist.all_reduce(flat, group=self.group)
        return list(flat.cpu().split([t.numel() for t in local]))


def measured_rank_load(placement: ExpertPlacement, physical_load_P: torch.Tensor) -> torch.Tensor:
    """Measured per-slot counts ``[P]`` summed per rank: ``[W]`` float64 on the CPU (each
    slot's count goes to the rank owning it)."""
    load = torch.as_tensor(physical_load_P, device="cpu").detach().to(torch.float64)
    if load.shape != (placement.num_physical,):
        raise ValueError(
            f"physical_load_P must be [P={placement.num_physical}], got {tuple(load.shape)}"
        )
    return torch.zeros(placement.ep_size, dtype=torch.float64, device="cpu").index_add_(
        0, placement.owner_rank, load
    )


def measured_balancedness(placement: ExpertPlacement, physical_load_P: torch.Tensor) -> float:
    """Mean rank load / max rank load of measured per-slot counts ``[P]``
    (``measured_rank_load``); 1.0 when there is no load."""
    per_rank = measured_rank_load(placement, physical_load_P)
    mx = float(per_rank.max())
    return 1.0 if mx <= 0 else float(per_rank.mean()) / mx
