"""Weight migration for a live re-plan: move only the expert weights whose slots change.

Shape legend: E logical experts · P physical slots · W EP ranks · e local slots of a rank
(``e_old`` before, ``e_new`` after) · X the trailing dims of one slot's tensor (``w13``:
``[2I, H]``, ``w2``: ``[H, I]``, an FP8 block scale: ``[2I/128, H/128]``, ...).

Every rank holds the same old and new :class:`~epmoe.placement.ExpertPlacement` and derives
the same :class:`MigrationPlan` from them, so no metadata is exchanged: for each new local
slot of each rank the plan says where its weights come from:

* *keep*: the slot held the same expert before (same local index): nothing moves;
* *local*: another old slot of the same rank held the expert: a device copy;
* *recv*: no old slot of the rank held it: it arrives point-to-point from a rank that
  held it (among several holders, the one with the fewest sends so far, ties broken by
  ring distance, so that replicas share the sending); a rank that needs one expert in two
  new slots receives it once and copies it (*dup*).

Transfers run as one ``torch.distributed.batch_isend_irecv`` per call (gloo and NCCL), each
rank posting its sends and receives in the plan's global order so that the messages
between every pair of ranks match. With W = 1 nothing is communicated.

This module computes and moves weights; it never edits a layer's state. The layer owns the
swap: :func:`rebalance_layer` hands the moved tensors to ``EPMoE._swap_placement``, which
installs them with the placement and rebinds the backend.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from epmoe.comm.collectives import world_of
from epmoe.distributed import default_device
from epmoe.placement import ExpertPlacement

if TYPE_CHECKING:  # pragma: no cover
    from epmoe.layer import EPMoE

__all__ = [
    "MigrationPlan",
    "MigrationStats",
    "RankPlan",
    "Transfer",
    "migrate_slots",
    "rebalance_layer",
]


@dataclass(frozen=True)
class Transfer:
    """One expert's weights sent from ``src`` (old local slot ``src_slot``) to ``dst``
    (new local slot ``dst_slot``)."""

    src: int
    src_slot: int
    dst: int
    dst_slot: int
    expert: int


@dataclass(frozen=True)
class RankPlan:
    """What one rank does in a migration (local slot indices).

    ``keep``: new slots that held the same expert before (same index), untouched.
    ``local``: ``(new_slot, old_slot)`` copies within the rank.
    ``recv``: ``(new_slot, src_rank)`` in the plan's global order.
    ``send``: ``(old_slot, dst_rank)`` in the plan's global order.
    ``dup``: ``(new_slot, from_new_slot)`` copies of a received expert, after the receives.
    """

    num_old: int  # e_old
    num_new: int  # e_new
    keep: tuple[int, ...]
    local: tuple[tuple[int, int], ...]
    recv: tuple[tuple[int, int], ...]
    send: tuple[tuple[int, int], ...]
    dup: tuple[tuple[int, int], ...]

    @property
    def changed(self) -> tuple[int, ...]:
        """New slots whose weights change (everything but ``keep``), ascending."""
        slots = [s for s, _ in self.local] + [s for s, _ in self.recv] + [s for s, _ in self.dup]
        return tuple(sorted(slots))


@dataclass(frozen=True)
class MigrationPlan:
    """The transfers that turn ``old`` into ``new``; identical on every rank.

    Build it with :meth:`build`. ``transfers`` is in the global order every rank posts its
    point-to-point operations in; ``ranks[r]`` is rank r's :class:`RankPlan`.
    """

    old: ExpertPlacement
    new: ExpertPlacement
    transfers: tuple[Transfer, ...]
    ranks: tuple[RankPlan, ...]

    @classmethod
    def build(cls, old: ExpertPlacement, new: ExpertPlacement) -> MigrationPlan:
        _check_compatible(old, new)
        W = old.ep_size
        old_local = [old.local_experts(r) for r in range(W)]
        new_local = [new.local_experts(r) for r in range(W)]
        first_old: list[dict[int, int]] = []  # per rank: expert -> first old slot holding it
        holders: dict[int, list[int]] = {}  # expert -> ranks holding it (ascending)
        for r, experts in enumerate(old_local):
            first: dict[int, int] = {}
            for s, x in enumerate(experts):
                first.setdefault(x, s)
            first_old.append(first)
            for x in first:
                holders.setdefault(x, []).append(r)

        sends_per_rank = [0] * W
        transfers: list[Transfer] = []
        parts = []
        for d in range(W):
            keep, local, dup = [], [], []
            received: dict[int, int] = {}  # expert -> the new slot it is received into
            for s, x in enumerate(new_local[d]):
                if s < len(old_local[d]) and old_local[d][s] == x:
                    keep.append(s)
                elif x in first_old[d]:
                    local.append((s, first_old[d][x]))
                elif x in received:
                    dup.append((s, received[x]))
                else:
                    src = min(holders[x], key=lambda r: (sends_per_rank[r], (r - d) % W))
                    sends_per_rank[src] += 1
                    transfers.append(Transfer(src, first_old[src][x], d, s, x))
                    received[x] = s
            parts.append((keep, local, dup))
        ranks = []
        for r, (keep, local, dup) in enumerate(parts):
            ranks.append(
                RankPlan(
                    num_old=len(old_local[r]),
                    num_new=len(new_local[r]),
                    keep=tuple(keep),
                    local=tuple(local),
                    recv=tuple((t.dst_slot, t.src) for t in transfers if t.dst == r),
                    send=tuple((t.src_slot, t.dst) for t in transfers if t.src == r),
                    dup=tuple(dup),
                )
            )
        return cls(old, new, tuple(transfers), tuple(ranks))


@dataclass(frozen=True)
class MigrationStats:
    """What one rank did in one layer's migration.

    ``slots_moved``: new local slots whose weights changed (a slot whose index did not exist
    before counts); with unchanged ``rank_offsets`` it equals this rank's share of
    ``old.moved_slots(new)``. ``slots_received``: experts that arrived from other ranks
    (once per expert, however many new slots hold it). ``slots_copied``: changed slots
    filled by a copy on this rank (from an old slot or a just-received expert).
    ``slots_sent``: expert copies sent to other ranks. ``bytes_*``: payload of the
    point-to-point transfers. ``seconds``: wall time of the whole call on this rank (the
    device is synchronised before it is read).
    """

    slots_moved: int
    slots_received: int
    slots_copied: int
    slots_sent: int
    bytes_sent: int
    bytes_received: int
    seconds: float

    @classmethod
    def of(cls, plan: RankPlan, slot_bytes: int, seconds: float) -> MigrationStats:
        return cls(
            slots_moved=len(plan.changed),
            slots_received=len(plan.recv),
            slots_copied=len(plan.local) + len(plan.dup),
            slots_sent=len(plan.send),
            bytes_sent=len(plan.send) * slot_bytes,
            bytes_received=len(plan.recv) * slot_bytes,
            seconds=seconds,
        )


# ------------------------------------------------------------------------------ public API


@torch.no_grad()
def migrate_slots(
    old: ExpertPlacement,
    new: ExpertPlacement,
    rank: int,
    tensors_eX: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    *,
    in_place: bool = False,
    check: bool = True,
) -> list[torch.Tensor]:
    """Rearrange per-slot tensors from placement ``old`` to ``new`` (collective over ``group``).

    Args:
        old, new: the same placements on every rank (same E and W; P and ``rank_offsets``
            may differ).
        rank: this rank in ``group``.
        tensors_eX: this rank's per-slot tensors under ``old``, each ``[e_old, *X]``,
            contiguous, any dtype, on CUDA or the CPU (CUDA tensors on a group without
            NCCL travel as host copies); every rank passes the same number of tensors
            with the same trailing shapes and dtypes (e.g. ``[w13, w2]``, plus FP8 scales).
        group: the EP process group (``None``: WORLD, or a single process).
        in_place: write the changed slots into ``tensors_eX`` themselves and return them
            (needs ``e_new == e_old``); extra memory is then the changed slots only. Else
            new ``[e_new, *X]`` tensors are returned and the inputs are left unchanged.
        check: first verify with one small all-reduce that every rank passed the same
            placements and tensor shapes (a mismatch raises ``RuntimeError`` on every rank
            instead of hanging or corrupting weights; a rank whose own arguments do not fit
            raises its ``ValueError``, and the others a ``RuntimeError``, in the same call).

    Returns:
        One tensor per input, ``[e_new, *X]``, slot ``s`` holding the weights of logical
        expert ``new.local_experts(rank)[s]``.

    Every rank must call it, also ranks whose slots do not change.
    """
    tensors = list(tensors_eX)
    error = None
    try:  # (every check of this rank's arguments, before the agreement)
        _check_compatible(old, new)
        _check_tensors(tensors, old, rank)
        _check_group(group, old.ep_size, rank)
        e_old, e_new = old.num_local(rank), new.num_local(rank)
        if in_place and e_new != e_old:
            raise ValueError(
                f"in_place=True needs the same number of local slots before and after, rank "
                f"{rank} goes from {e_old} to {e_new}; pass in_place=False"
            )
    except (TypeError, ValueError) as exc:
        if not check:
            raise
        error = exc
    if check:  # (a rank whose arguments are wrong raises its error; the others name it)
        on_device = not error and tensors and isinstance(tensors[0], torch.Tensor)
        device = tensors[0].device if on_device else default_device(group)
        fingerprint = 0 if error else _fingerprint(old, new, tensors)
        _agree(group, device, fingerprint, error=error)
    plan = MigrationPlan.build(old, new)
    return _execute(plan, rank, tensors, group, in_place)


@torch.no_grad()
def rebalance_layer(
    layer: EPMoE, new_placement: ExpertPlacement, *, agreed: bool = False
) -> MigrationStats:
    """Switch ``layer`` to ``new_placement`` while serving (collective over ``layer.group``).

    This module moves the weights, the layer installs them: first every rank checks that
    the layer can take the placement (:meth:`EPMoE.check_placement`: E, W, the backend's
    limits) and that all ranks agree on it; then only the expert weights whose slots change
    move (see :class:`MigrationPlan`; in place when this rank's slot count is unchanged),
    and :meth:`EPMoE._swap_placement` installs the placement, its device maps, the weights,
    the backend binding (``rebind``) and a reset load recorder, with no forward in between.
    Extra memory while it runs: at most one layer's local weights.

    Every rank must pass the same placement. Without ``agreed`` this is
    :meth:`EPMoE.rebalance` (the layer's own agreement: the ranks must be in the same call
    of the same layer, hold the same placement and have their weights loaded; one rank's
    bad placement raises on every rank). A placement equal to the current one changes
    nothing (the recorder keeps counting). ``agreed``: the caller checked the placement
    and agreed on it already (what :meth:`EPMoE.rebalance` passes): no second check.
    """
    if not agreed:  # (its agreement names the layer and the call: see EPMoE.rebalance)
        return layer.rebalance(new_placement)
    start = time.perf_counter()
    old = layer.placement
    slot_tensors = layer.slot_tensors()  # name -> [e_old, *X]
    tensors = list(slot_tensors.values())
    rank, group = layer.rank, layer.group
    if new_placement == old:
        return MigrationStats(0, 0, 0, 0, 0, 0, time.perf_counter() - start)

    plan = MigrationPlan.build(old, new_placement)
    mine = plan.ranks[rank]
    moved = _execute(plan, rank, tensors, group, in_place=mine.num_new == mine.num_old)
    _synchronize(layer.device)
    layer._swap_placement(new_placement, dict(zip(slot_tensors, moved)))
    slot_bytes = sum(t[0].numel() * t.element_size() for t in tensors)
    return MigrationStats.of(mine, slot_bytes, time.perf_counter() - start)


# ------------------------------------------------------------------------------ internals


def _execute(
    plan: MigrationPlan,
    rank: int,
    tensors: list[torch.Tensor],
    group: dist.ProcessGroup | None,
    in_place: bool,
) -> list[torch.Tensor]:
    """Run ``plan``'s share of ``rank`` on ``tensors`` (``[e_old, *X]`` each); ``in_place``
    only where this rank's slot count stays (its callers check it)."""
    mine = plan.ranks[rank]
    changed = mine.changed
    if in_place:  # stage the changed slots: the old ones may still have to be sent
        row = {s: i for i, s in enumerate(changed)}
        stages = [t.new_empty((len(changed), *t.shape[1:])) for t in tensors]
        targets = [lambda s, st=st: st[row[s]] for st in stages]
    else:
        outs = [t.new_empty((mine.num_new, *t.shape[1:])) for t in tensors]
        targets = [lambda s, out=out: out[s] for out in outs]
        for a, b in _runs(mine.keep):
            for t, out in zip(tensors, outs):
                out[a:b].copy_(t[a:b])

    for new_slot, old_slot in mine.local:
        for t, target in zip(tensors, targets):
            target(new_slot).copy_(t[old_slot])

    # gloo sends CPU tensors only: CUDA tensors on a group without NCCL (ranks sharing a
    # GPU, "cpu:gloo,cuda:gloo", or plain gloo) travel as host copies
    host = (
        tensors[0].is_cuda and dist.is_initialized() and "nccl" not in str(dist.get_backend(group))
    )
    ops, landed = [], []
    for old_slot, dst in mine.send:
        peer = _global_rank(group, dst)
        for t in tensors:
            part = _wire(t[old_slot])
            ops.append(dist.P2POp(dist.isend, part.cpu() if host else part, peer, group))
    for new_slot, src in mine.recv:
        peer = _global_rank(group, src)
        for target in targets:
            part = _wire(target(new_slot))
            if host:
                landed.append((part, torch.empty_like(part, device="cpu")))
            ops.append(dist.P2POp(dist.irecv, landed[-1][1] if host else part, peer, group))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    for part, copy in landed:
        part.copy_(copy)

    for new_slot, from_slot in mine.dup:
        for target in targets:
            target(new_slot).copy_(target(from_slot))

    if not in_place:
        return outs
    if not changed:
        return tensors
    index = torch.tensor(changed, dtype=torch.int64, device=tensors[0].device)
    for t, stage in zip(tensors, stages):
        _wire(t).index_copy_(0, index, _wire(stage))  # (no float8 index_copy_ kernel)
    return tensors


def _runs(slots: Sequence[int]) -> list[tuple[int, int]]:
    """Ascending slot indices → maximal ``[a, b)`` runs of consecutive indices."""
    runs: list[tuple[int, int]] = []
    for s in slots:
        if runs and runs[-1][1] == s:
            runs[-1] = (runs[-1][0], s + 1)
        else:
            runs.append((s, s + 1))
    return runs


def _check_compatible(old: ExpertPlacement, new: ExpertPlacement) -> None:
    for name, p in (("old", old), ("new", new)):
        if not isinstance(p, ExpertPlacement):
            raise TypeError(f"{name} must be an ExpertPlacement, got {type(p).__name__}")
    if old.num_experts != new.num_experts or old.ep_size != new.ep_size:
        raise ValueError(
            f"old and new placements must have the same num_experts and ep_size, got "
            f"E={old.num_experts}, W={old.ep_size} and E={new.num_experts}, W={new.ep_size}"
        )


def _check_tensors(tensors: list[torch.Tensor], old: ExpertPlacement, rank: int) -> None:
    if not tensors:
        raise ValueError("tensors_eX must hold at least one per-slot tensor, got none")
    if not isinstance(rank, int) or not 0 <= rank < old.ep_size:
        raise ValueError(f"rank must be an int in [0, {old.ep_size}), got {rank!r}")
    e_old = old.num_local(rank)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] != e_old:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"tensors_eX[{i}] must be [e_old={e_old}, ...] (rank {rank}'s slots under the "
                f"old placement), got {shape}"
            )
        if not t.is_contiguous():
            raise ValueError(f"tensors_eX[{i}] must be contiguous; call .contiguous() first")
        if t.device != tensors[0].device:
            raise ValueError(
                f"tensors_eX must share one device, got {tensors[0].device} and {t.device}"
            )


def _check_group(group: dist.ProcessGroup | None, W: int, rank: int) -> None:
    g_rank, g_size = world_of(group)
    if g_size != W or g_rank != rank:
        raise ValueError(
            f"the placements are for ep_size={W} and rank={rank}, but the process group has "
            f"{g_size} ranks and this is rank {g_rank}; pass the EP group and its rank"
        )


def _global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def _fingerprint(
    old: ExpertPlacement, new: ExpertPlacement, tensors: Sequence[torch.Tensor]
) -> int:
    """A 62-bit digest of what every rank must agree on: both placements and the trailing
    shapes and dtypes of the migrated tensors."""
    h = hashlib.blake2b(digest_size=8)
    for p in (old, new):
        h.update(repr((p.num_experts, p.ep_size, p.rank_offsets)).encode())
        h.update(p.physical_to_logical.numpy().tobytes())
    h.update(repr([(tuple(t.shape[1:]), str(t.dtype)) for t in tensors]).encode())
    return int.from_bytes(h.digest(), "little") >> 2


def _agree(
    group: dist.ProcessGroup | None,
    device: torch.device,
    fingerprint: int,
    error: BaseException | None = None,
) -> None:
    """Raise on every rank if some rank failed its own checks (``error``: raised there, the
    others name it) or the ranks' fingerprints differ. One all-reduce of three int64,
    before anything moves."""
    mine = (fingerprint, -fingerprint, int(error is not None))
    if world_of(group)[1] == 1:
        flags = mine
    else:
        t = torch.tensor(mine, dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        flags = tuple(t.tolist())
    if error is not None:
        raise error
    if flags[2]:
        raise RuntimeError(
            "another EP rank refused this migration (its own error says why: placements, "
            "tensors or a group that do not fit it); nothing was moved"
        )
    if flags[0] != -flags[1]:
        raise RuntimeError(
            "EP ranks disagree on the migration: their old or new placements (or the shapes "
            "and dtypes of the expert tensors) differ. Every rank must plan from the same "
            "all-reduced load with the same settings (EPLBManager does this)"
        )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the collectives and ``index_copy_`` can move it: 1-byte floats (the FP8
    dtypes) as their bytes (gloo has no float8 type, index_copy_ no float8 kernel); a
    view, so writes land in ``t``."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t
