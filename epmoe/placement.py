"""Expert placement: which rank holds which expert, and which replica serves each token.

Shape legend: T tokens on this rank · K top-k · E logical experts · P physical slots
(E + redundant replicas) · W EP world size (ranks) · X max replicas of one expert · L layers.

Data model (shared with DeepSeek EPLB, vLLM and SGLang): the P physical slots are
rank-major. Rank ``r`` owns physical ids ``[rank_offsets[r], rank_offsets[r + 1])`` and the
local slot of physical id ``p`` is ``p - rank_offsets[r]``; ``physical_to_logical[p]`` is
the logical expert whose weights that slot holds. A logical expert may have several
replicas (redundant experts); the router's logical ids are mapped to one replica per
(token, k) by :meth:`ExpertPlacement.to_physical`. ``rank_offsets`` is what
``epmoe.comm.base.CommSpec.rank_offsets`` expects.

Cross-rank contract: every rank must build the same placement (same tensors), otherwise
tokens are sent to slots that hold other experts. Placements are cheap, immutable values;
re-planning builds a new one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from epmoe.distributed import as_int as _as_int
from epmoe.distributed import normalize_device

__all__ = ["ExpertPlacement", "PlacementMaps"]


@dataclass(frozen=True, eq=False)
class PlacementMaps:
    """The device-side tables :meth:`ExpertPlacement.to_physical` reads every step.

    ``logical_to_physical [E, X]`` int64 (-1 padded), ``replica_count [E]`` int64,
    ``first_replica [E]`` int64 (= ``logical_to_physical[:, 0]``), ``local_physical [W, E]``
    int64: the physical id of the first replica of each expert on each rank, -1 where the
    rank holds none. All on ``device``.
    """

    device: torch.device
    logical_to_physical: torch.Tensor
    replica_count: torch.Tensor
    first_replica: torch.Tensor
    local_physical: torch.Tensor
    max_replicas: int


@dataclass(frozen=True, eq=False)
class ExpertPlacement:
    """Where the physical expert slots live and which logical expert each one holds.

    Fields (inputs):
        num_experts: E logical experts.
        ep_size: W ranks.
        physical_to_logical: ``[P]`` int64 on the CPU, logical id held by each physical slot.
            Every logical expert has at least one replica.
        rank_offsets: ``W + 1`` ints, ``0 = rank_offsets[0] < ... < rank_offsets[W] = P``;
            every rank holds at least one slot.

    Derived (computed once): ``logical_to_physical [E, X]`` int64 (each expert's replicas in
    increasing physical id, -1 padded), ``replica_count [E]`` int64, ``owner_rank [P]``
    int64. Treat all tensors as read-only.

    Equality and hashing compare contents (E, W, offsets and the map).
    """

    num_experts: int
    ep_size: int
    physical_to_logical: torch.Tensor
    rank_offsets: tuple[int, ...]
    logical_to_physical: torch.Tensor = field(init=False, repr=False)
    replica_count: torch.Tensor = field(init=False, repr=False)
    owner_rank: torch.Tensor = field(init=False, repr=False)
    _maps: dict[torch.device, PlacementMaps] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        E = _check_positive_int("num_experts", self.num_experts)
        W = _check_positive_int("ep_size", self.ep_size)
        p2l = _tensor_arg("physical_to_logical", self.physical_to_logical)
        if p2l.is_floating_point() or p2l.is_complex() or p2l.dtype == torch.bool:
            raise TypeError(f"physical_to_logical must hold integer ids, got dtype {p2l.dtype}")
        if p2l.dim() != 1:
            raise ValueError(f"physical_to_logical must be 1-D [P], got shape {tuple(p2l.shape)}")
        p2l = p2l.detach().to("cpu", torch.int64).clone().contiguous()
        P = p2l.numel()
        bad = ((p2l < 0) | (p2l >= E)).nonzero()
        if bad.numel():
            slot = int(bad[0])
            raise ValueError(
                f"physical_to_logical[{slot}] = {int(p2l[slot])} is not a logical expert id in "
                f"[0, num_experts={E})"
            )
        count = torch.bincount(p2l, minlength=E)
        missing = (count == 0).nonzero().flatten().tolist()
        if missing:
            raise ValueError(
                f"every logical expert needs at least one replica; experts {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''} have none in physical_to_logical"
            )
        offsets = _int_sequence("rank_offsets", self.rank_offsets)
        if len(offsets) != W + 1 or offsets[0] != 0 or offsets[-1] != P:
            raise ValueError(
                f"rank_offsets must have ep_size + 1 = {W + 1} entries from 0 to P = {P}, got "
                f"{offsets}"
            )
        if any(b <= a for a, b in zip(offsets, offsets[1:])):
            raise ValueError(
                f"rank_offsets must be strictly increasing (every rank holds at least one "
                f"slot), got {offsets}"
            )
        log2phy, logcnt = _algorithm().logical_to_physical(p2l[None], E)
        owner = torch.repeat_interleave(
            torch.arange(W, device="cpu"),
            torch.tensor([b - a for a, b in zip(offsets, offsets[1:])], device="cpu"),
        )
        object.__setattr__(self, "num_experts", E)
        object.__setattr__(self, "ep_size", W)
        object.__setattr__(self, "physical_to_logical", p2l)
        object.__setattr__(self, "rank_offsets", offsets)
        object.__setattr__(self, "logical_to_physical", log2phy[0])
        object.__setattr__(self, "replica_count", logcnt[0])
        object.__setattr__(self, "owner_rank", owner)
        object.__setattr__(self, "_maps", {})

    # ---------------------------------------------------------------- constructors

    @classmethod
    def linear(cls, num_experts: int, ep_size: int) -> ExpertPlacement:
        """Contiguous blocks: rank r holds experts ``[start_r, start_r + n_r)`` with
        ``n_r = E // W + (1 if r < E % W else 0)`` (the remainder goes to the first ranks).
        """
        num_experts = _check_positive_int("num_experts", num_experts)
        ep_size = _check_positive_int("ep_size", ep_size)
        _check_enough_experts(num_experts, ep_size, "linear")
        base, rem = divmod(num_experts, ep_size)
        counts = [base + (1 if r < rem else 0) for r in range(ep_size)]
        return cls(num_experts, ep_size, torch.arange(num_experts, device="cpu"), _offsets(counts))

    @classmethod
    def round_robin(cls, num_experts: int, ep_size: int) -> ExpertPlacement:
        """Strided: rank r holds experts ``r, r + W, r + 2W, ...`` in that slot order
        (physical ids stay rank-major, so ranks ``r < E % W`` hold one more)."""
        num_experts = _check_positive_int("num_experts", num_experts)
        ep_size = _check_positive_int("ep_size", ep_size)
        _check_enough_experts(num_experts, ep_size, "round_robin")
        per_rank = [torch.arange(r, num_experts, ep_size, device="cpu") for r in range(ep_size)]
        return cls(
            num_experts, ep_size, torch.cat(per_rank), _offsets([t.numel() for t in per_rank])
        )

    @classmethod
    def balanced(
        cls,
        expert_load: torch.Tensor | Sequence[float],
        ep_size: int,
        num_redundant: int = 0,
        num_groups: int = 1,
        num_nodes: int = 1,
        current: ExpertPlacement | None = None,
        tolerance: float = 0.0,
    ) -> ExpertPlacement:
        """EPLB placement from measured load ``[E]`` (tokens routed to each expert).

        ``E + num_redundant`` slots, the same number on every rank (so it must be a
        multiple of ``ep_size``); the ``num_redundant`` extra replicas go to the experts
        with the most load per replica, and replicas are packed so that rank loads are
        even. With ``num_groups % num_nodes == 0`` (and ``num_nodes > 1``) each expert
        group stays within one node of ``ep_size / num_nodes`` ranks (hierarchical
        policy); otherwise the global policy runs. ``current`` and ``tolerance`` make the
        re-plan migration-aware (see :func:`epmoe.eplb.algorithm.rebalance`).
        """
        load = _tensor_arg("expert_load", expert_load)
        _check_load("expert_load", load)
        if load.dim() != 1:
            raise ValueError(
                f"expert_load must be [E] (one layer), got shape {tuple(load.shape)}; use "
                "ExpertPlacement.balanced_layers for [L, E]"
            )
        if current is not None and not isinstance(current, ExpertPlacement):
            raise TypeError(
                f"current must be an ExpertPlacement or None, got {type(current).__name__}"
            )
        currents = None if current is None else [current]
        return cls.balanced_layers(
            load[None], ep_size, num_redundant, num_groups, num_nodes, currents, tolerance
        )[0]

    @classmethod
    def balanced_layers(
        cls,
        expert_load_LE: torch.Tensor,
        ep_size: int,
        num_redundant: int = 0,
        num_groups: int = 1,
        num_nodes: int = 1,
        current: Sequence[ExpertPlacement] | None = None,
        tolerance: float = 0.0,
    ) -> list[ExpertPlacement]:
        """:meth:`balanced` for L layers at once (one vectorized re-plan); ``current`` is
        one placement per layer or ``None``. Returns L placements."""
        load = _tensor_arg("expert_load_LE", expert_load_LE)
        if load.dim() != 2:
            raise ValueError(f"expert_load_LE must be [L, E], got shape {tuple(load.shape)}")
        L, E = load.shape
        if E == 0 or L == 0:
            raise ValueError(
                "expert_load_LE must hold one row per layer (L >= 1) of one value per expert "
                f"(E >= 1), got shape {tuple(load.shape)}"
            )
        _check_load("expert_load_LE", load)
        ep_size = _check_positive_int("ep_size", ep_size)
        num_redundant = _check_int("num_redundant", num_redundant, minimum=0)
        P = E + num_redundant
        if P % ep_size:
            lo = (P // ep_size) * ep_size - E
            hi = lo + ep_size
            ok = " or ".join(f"num_redundant={r}" for r in (lo, hi) if r >= 0)
            raise ValueError(
                f"E + num_redundant = {E} + {num_redundant} = {P} must be a multiple of "
                f"ep_size={ep_size} (every rank holds the same number of slots); use {ok}"
            )
        num_groups = _check_positive_int("num_groups", num_groups)
        num_nodes = _check_positive_int("num_nodes", num_nodes)
        if ep_size % num_nodes:
            raise ValueError(f"ep_size={ep_size} must be a multiple of num_nodes={num_nodes}")
        cur_p2l = None
        if current is not None:
            if isinstance(current, ExpertPlacement) or not isinstance(current, Sequence):
                raise TypeError(
                    f"current must be a sequence of one ExpertPlacement per layer or None, got "
                    f"{type(current).__name__}"
                )
            for i, c in enumerate(current):
                if not isinstance(c, ExpertPlacement):
                    raise TypeError(
                        f"current[{i}] must be an ExpertPlacement, got {type(c).__name__}"
                    )
            if len(current) != L:
                raise ValueError(
                    f"current must hold one placement per layer ({L}), got {len(current)}"
                )
            even = tuple(range(0, P + 1, P // ep_size))
            for i, c in enumerate(current):
                if c.num_experts != E or c.ep_size != ep_size or c.num_physical != P:
                    raise ValueError(
                        f"current[{i}] has E={c.num_experts}, W={c.ep_size}, P={c.num_physical}; "
                        f"the new plan has E={E}, W={ep_size}, P={P}; pass current=None to plan "
                        "from scratch"
                    )
                if c.rank_offsets != even:  # (the planner reads slots as P / W per rank)
                    raise ValueError(
                        f"current[{i}] has rank_offsets {c.rank_offsets}; the new plan gives "
                        f"every rank {P // ep_size} slots {even}, and keeps experts in place "
                        "only from such a layout; pass current=None to plan from scratch"
                    )
            cur_p2l = torch.stack([c.physical_to_logical for c in current])
        phy2log, _, _ = _algorithm().rebalance(
            load,
            P,
            num_groups,
            num_nodes,
            ep_size,
            current_phy2log=cur_p2l,
            tolerance=tolerance,
        )
        offsets = tuple(range(0, P + 1, P // ep_size))
        return [cls(E, ep_size, row, offsets) for row in phy2log]

    @classmethod
    def from_physical_to_logical(
        cls,
        physical_to_logical: torch.Tensor | Sequence[int],
        ep_size: int,
        num_experts: int | None = None,
        rank_offsets: Sequence[int] | None = None,
    ) -> ExpertPlacement:
        """Wrap an existing map ``[P]`` (e.g. a row of ``rebalance``'s ``phy2log``).

        ``num_experts`` defaults to ``max + 1``; ``rank_offsets`` defaults to an equal
        split (then P must be a multiple of ``ep_size``).
        """
        p2l = _tensor_arg("physical_to_logical", physical_to_logical)
        if p2l.numel() == 0:
            raise ValueError(
                "physical_to_logical must hold the logical expert id of each slot, got none"
            )
        if p2l.is_floating_point() or p2l.is_complex() or p2l.dtype == torch.bool:
            raise TypeError(f"physical_to_logical must hold integer ids, got dtype {p2l.dtype}")
        ep_size = _check_positive_int("ep_size", ep_size)
        if num_experts is None:
            num_experts = int(p2l.max()) + 1 if p2l.numel() else 0
        if rank_offsets is None:
            P = p2l.numel()
            if P % ep_size:
                raise ValueError(
                    f"P={P} slots do not split evenly over ep_size={ep_size}; pass "
                    "rank_offsets to give ranks different slot counts"
                )
            rank_offsets = range(0, P + 1, P // ep_size)
        return cls(num_experts, ep_size, p2l, tuple(rank_offsets))

    # ---------------------------------------------------------------- structure

    @property
    def num_physical(self) -> int:  # P
        return self.physical_to_logical.numel()

    @property
    def max_replicas(self) -> int:  # X
        return self.logical_to_physical.shape[1]

    @property
    def max_local(self) -> int:  # largest e over ranks
        offs = self.rank_offsets
        return max(b - a for a, b in zip(offs, offs[1:]))

    def num_local(self, rank: int) -> int:
        """Slots on ``rank`` (e)."""
        rank = self._check_rank(rank)
        return self.rank_offsets[rank + 1] - self.rank_offsets[rank]

    def local_experts(self, rank: int) -> list[int]:
        """Logical id held by each local slot of ``rank``, in slot order (length e)."""
        rank = self._check_rank(rank)
        a, b = self.rank_offsets[rank], self.rank_offsets[rank + 1]
        return self.physical_to_logical[a:b].tolist()

    def expert_map(self, rank: int) -> torch.Tensor:
        """``[E]`` int64 on the CPU: logical id → local slot on ``rank`` (the first one when
        the rank holds several replicas of that expert), ``-1`` if the rank holds none."""
        rank = self._check_rank(rank)
        a, b = self.rank_offsets[rank], self.rank_offsets[rank + 1]
        local = self.physical_to_logical[a:b]
        big = b - a
        out = torch.full((self.num_experts,), big, dtype=torch.int64, device="cpu")
        out.scatter_reduce_(0, local, torch.arange(b - a, device="cpu"), reduce="amin")
        return out.masked_fill_(out == big, -1)

    # ---------------------------------------------------------------- per-step mapping

    def maps_on(self, device: torch.device | str) -> PlacementMaps:
        """The device copies of the maps ``to_physical`` uses, built once per device.

        Call it once before capturing a CUDA graph so that capture does no host→device copy.
        """
        device = normalize_device(device)
        maps = self._maps.get(device)
        if maps is None:
            W, E, P = self.ep_size, self.num_experts, self.num_physical
            local = torch.full((W * E,), P, dtype=torch.int64, device="cpu")  # P: "none yet"
            key = self.owner_rank * E + self.physical_to_logical
            local.scatter_reduce_(0, key, torch.arange(P, device="cpu"), reduce="amin")
            local = local.masked_fill_(local == P, -1).view(W, E)
            maps = PlacementMaps(
                device=device,
                logical_to_physical=self.logical_to_physical.to(device),
                replica_count=self.replica_count.to(device),
                first_replica=self.logical_to_physical[:, 0].contiguous().to(device),
                local_physical=local.to(device),
                max_replicas=self.max_replicas,
            )
            self._maps[device] = maps
        return maps

    def to_physical(
        self, topk_ids_TK: torch.Tensor, rank: int = 0, prefer_local: bool = False
    ) -> torch.Tensor:
        """Map logical expert ids ``[T, K]`` to physical ids, one replica per (token, k).

        ``topk_ids_TK`` int32/int64 logical ids in ``[0, E)`` or ``-1`` (no expert; stays
        ``-1``); ids are not range-checked (that would need a host sync). Returns the same
        shape, dtype and device.

        Replica choice: the replica of expert x used by entry ``(t, k)`` on ``rank`` is
        ``(t + k + rank) mod replica_count[x]``: deterministic, and an expert picked by
        consecutive tokens cycles through its replicas, so its load splits evenly. (The
        flat index ``t·K + k`` would not: when the replica count divides K it reduces to
        ``k mod count``, so an expert usually ranked first would always get replica 0.)
        With ``prefer_local`` a replica on ``rank`` itself is used when one exists (it
        saves the transfer but lets local traffic skew replica loads).

        Fully on the device, no host synchronisation: the layer calls it every step and it
        can be captured in a CUDA graph once :meth:`maps_on` has run for the device.
        """
        if not isinstance(topk_ids_TK, torch.Tensor):
            raise TypeError(f"topk_ids must be a torch.Tensor, got {type(topk_ids_TK).__name__}")
        if topk_ids_TK.dim() != 2:
            raise ValueError(f"topk_ids must be [T, K], got shape {tuple(topk_ids_TK.shape)}")
        if topk_ids_TK.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids_TK.dtype}")
        rank = self._check_rank(rank)
        maps = self.maps_on(topk_ids_TK.device)
        ids = topk_ids_TK.long()
        valid = ids >= 0
        ids_c = ids.clamp(min=0)
        if maps.max_replicas == 1:
            phys = maps.first_replica[ids_c]
        else:
            T, K = ids.shape
            dev = ids.device
            pick = torch.arange(T, device=dev)[:, None] + torch.arange(K, device=dev)[None, :]
            pick = (pick + rank) % maps.replica_count[ids_c]
            phys = maps.logical_to_physical[ids_c, pick]
        if prefer_local:
            local = maps.local_physical[rank][ids_c]
            phys = torch.where(local >= 0, local, phys)
        phys = torch.where(valid, phys, torch.full_like(phys, -1))
        return phys.to(topk_ids_TK.dtype)

    # ---------------------------------------------------------------- load metrics

    def rank_load(self, expert_load_E: torch.Tensor | Sequence[float]) -> torch.Tensor:
        """Expected load per rank ``[W]`` float64 when each expert's load ``[E]`` is split
        evenly over its replicas."""
        load = _tensor_arg("expert_load_E", expert_load_E)
        _check_load("expert_load_E", load)
        load = load.detach().to("cpu", torch.float64)
        if load.shape != (self.num_experts,):
            raise ValueError(
                f"expert_load must be [E={self.num_experts}], got shape {tuple(load.shape)}"
            )
        per_slot = (load / self.replica_count)[self.physical_to_logical]
        return torch.zeros(self.ep_size, dtype=torch.float64, device="cpu").index_add_(
            0, self.owner_rank, per_slot
        )

    def balancedness(self, expert_load_E: torch.Tensor | Sequence[float]) -> float:
        """Mean rank load / max rank load (1.0 is perfect; no load at all counts as 1.0)."""
        loads = self.rank_load(expert_load_E)
        mx = float(loads.max())
        return 1.0 if mx <= 0 else float(loads.mean()) / mx

    def moved_slots(self, other: ExpertPlacement) -> torch.Tensor:
        """``[P]`` bool: physical slots whose logical expert differs in ``other`` (the
        slots whose weights must be fetched when switching between the two)."""
        if not isinstance(other, ExpertPlacement):
            raise TypeError(f"other must be an ExpertPlacement, got {type(other).__name__}")
        if other.num_physical != self.num_physical or other.rank_offsets != self.rank_offsets:
            raise ValueError(
                "moved_slots needs placements with the same slots: got P="
                f"{self.num_physical}, offsets {self.rank_offsets} and P={other.num_physical}, "
                f"offsets {other.rank_offsets}"
            )
        return self.physical_to_logical != other.physical_to_logical

    # ---------------------------------------------------------------- value semantics

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ExpertPlacement):
            return NotImplemented
        return (
            self.num_experts == other.num_experts
            and self.ep_size == other.ep_size
            and self.rank_offsets == other.rank_offsets
            and torch.equal(self.physical_to_logical, other.physical_to_logical)
        )

    def __hash__(self) -> int:
        return hash(
            (
                self.num_experts,
                self.ep_size,
                self.rank_offsets,
                tuple(self.physical_to_logical.tolist()),
            )
        )

    def __repr__(self) -> str:
        return (
            f"ExpertPlacement(num_experts={self.num_experts}, ep_size={self.ep_size}, "
            f"num_physical={self.num_physical}, max_replicas={self.max_replicas}, "
            f"rank_offsets={_short(self.rank_offsets)})"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickle only the inputs: device caches stay behind.
        return (
            type(self),
            (self.num_experts, self.ep_size, self.physical_to_logical, self.rank_offsets),
        )

    def _check_rank(self, rank: int) -> int:
        """``rank`` as an int in ``[0, ep_size)`` (NumPy and torch integers too), or a
        ValueError naming it (a bool is no rank)."""
        r = _as_int(rank)
        if r is None or not 0 <= r < self.ep_size:
            raise ValueError(f"rank must be an int in [0, ep_size={self.ep_size}), got {rank!r}")
        return r


# -------------------------------------------------------------------- helpers


def _algorithm() -> Any:
    # Imported on use so that epmoe.eplb (recorder, migration) may import this module.
    from epmoe.eplb import algorithm

    return algorithm


def _tensor_arg(name: str, value: Any) -> torch.Tensor:
    """``value`` as a tensor: a tensor as is, a sequence of numbers (or a NumPy array)
    converted; anything else (``None``, a string, a dict) a ``TypeError`` naming ``name``."""
    if isinstance(value, torch.Tensor):
        return value
    if value is None or isinstance(value, (str, bytes)):
        raise TypeError(
            f"{name} must be a tensor or a sequence of numbers, got {type(value).__name__}"
        )
    try:
        return torch.as_tensor(value, device="cpu")
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(
            f"{name} must be a tensor or a sequence of numbers, got {type(value).__name__} ({e})"
        ) from None


def _check_load(name: str, load: torch.Tensor) -> None:
    """Expert load (token counts): real, finite and non-negative. Reads the values on the
    host (placements are built on the host)."""
    if load.is_complex() or load.dtype == torch.bool:
        raise TypeError(f"{name} must hold real numbers (token counts), got dtype {load.dtype}")
    values = load.detach().to("cpu", torch.float64)
    bad = ~torch.isfinite(values) | (values < 0)
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        where = first[0] if len(first) == 1 else list(first)
        raise ValueError(
            f"{name} must be finite and non-negative (tokens routed to each expert), got "
            f"{name}[{where}] = {float(values[first])}"
        )


def _offsets(counts: Sequence[int]) -> tuple[int, ...]:
    out = [0]
    for n in counts:
        out.append(out[-1] + n)
    return tuple(out)


def _int_sequence(name: str, values: Any) -> tuple[int, ...]:
    """``values`` as a tuple of ints (each as :func:`_as_int` takes it), or a TypeError
    naming ``name`` (floats are not truncated, strings not read digit by digit)."""
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of ints, got {values!r}")
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype == torch.bool or values.is_complex():
            raise TypeError(f"{name} must hold integers, got a tensor of {values.dtype}")
        values = values.tolist()
    try:
        items = list(values)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of ints, got {values!r}") from None
    ints = [_as_int(v) for v in items]
    if any(v is None for v in ints):
        raise TypeError(f"{name} must be a sequence of ints, got {tuple(items)!r}")
    return tuple(ints)


def _check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int (numpy and torch integers accepted), or a ValueError naming it."""
    v = _as_int(value)
    if v is None or v < minimum:
        kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    return v


def _check_positive_int(name: str, value: Any) -> int:
    return _check_int(name, value, minimum=1)


def _check_enough_experts(E: int, W: int, kind: str) -> None:
    if E < W:
        raise ValueError(
            f"{kind} placement of num_experts={E} over ep_size={W} ranks leaves ranks "
            f"without an expert; every rank needs at least one. Use ep_size <= {E}, or "
            f"ExpertPlacement.balanced(..., num_redundant={math.ceil(E / W) * W - E}) to "
            "replicate experts onto every rank"
        )


def _short(t: tuple[int, ...]) -> str:
    return str(t) if len(t) <= 9 else f"({t[0]}, {t[1]}, ..., {t[-1]})"
