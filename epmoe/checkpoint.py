"""Checkpoints of ``EPMoE`` layers: per-rank shards that know their placement, and full
logical experts that load into any placement.

Shape legend: E logical experts · P physical slots · W EP world size · e local slots of a
rank · H hidden · I intermediate.

Two ways to save a layer, for two purposes:

* **Per-rank shards** (``layer.state_dict()`` on every rank, each rank its own file): fast,
  no communication, and each file holds only that rank's slots (``w13 [e, 2I, H]``,
  ``w2 [e, H, I]``). Each state dict also carries the placement it was saved under, as
  three int64 tensors (torch.save and safetensors store them)::

      <prefix>placement.physical_to_logical  [P]    logical expert of each physical slot
      <prefix>placement.rank_offsets         [W+1]  rank r owns slots [off[r], off[r+1])
      <prefix>placement.rank                 []     the rank that saved the shard

  ``layer.load_state_dict(sd)`` checks that record against the layer: the saved slots
  must hold the same logical experts, in the same order, as this rank's slots (same E).
  A shard saved by another rank or under another placement is refused with an error that
  names both (``RuntimeError`` from ``load_state_dict``, strict or not) and nothing of the
  layer is overwritten; a load that copies the expert weights marks them loaded, so the
  layer runs. Expert weights without a record (a state dict saved before epmoe recorded
  placements, or built by hand) are refused too, strict or not: nothing says which
  experts they hold. Whoever knows the placement and rank they were saved under adds the
  record, ``sd.update(placement_record(placement, rank, prefix))``, and loads again (then
  checked). A state dict with none of the layer's expert weights (a partial load with
  ``strict=False``) loads what it has and leaves the experts as they were.
* **Full logical experts** (:func:`gather_full_experts` then :func:`load_full_experts`):
  ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``, one copy of every expert whatever the placement
  (balanced ones with redundant replicas included), so they load into any placement, any
  W. Gathering is collective over the layer's EP group; loading is local.

A converted Hugging Face model saves in its original layout with
``epmoe.integrations.huggingface.save_pretrained`` (which uses :func:`gather_full_experts`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from epmoe.comm.collectives import all_gather_into
from epmoe.placement import ExpertPlacement

if TYPE_CHECKING:  # pragma: no cover
    from epmoe.layer import EPMoE

__all__ = [
    "RECORD_KEYS",
    "gather_full_experts",
    "load_full_experts",
    "placement_record",
]

# The placement record's keys, relative to the layer's state-dict prefix.
RECORD_KEYS = (
    "placement.physical_to_logical",
    "placement.rank_offsets",
    "placement.rank",
)

_FULL_KEYS = ("w13", "w2")
_SCALE_KEYS = ("w13_scale", "w2_scale")  # with FP8 weights
_BIAS = "e_score_correction_bias"


# ---------------------------------------------------------------------- per-rank shards
def placement_record(
    placement: ExpertPlacement, rank: int, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """The state-dict entries that record a shard saved by ``rank`` under ``placement``:
    ``<prefix>placement.physical_to_logical [P]``, ``<prefix>placement.rank_offsets
    [W+1]``, ``<prefix>placement.rank []``, CPU int64. ``EPMoE.state_dict`` adds them; add
    them yourself to a record-less shard whose placement you know (``prefix``: the layer's
    state-dict prefix, e.g. ``"model.layers.3.mlp.moe."``)."""
    if not isinstance(placement, ExpertPlacement):
        raise TypeError(f"placement must be an ExpertPlacement, got {type(placement).__name__}")
    placement.num_local(rank)  # checks the rank
    return {
        prefix + RECORD_KEYS[0]: placement.physical_to_logical.clone(),
        prefix + RECORD_KEYS[1]: torch.tensor(
            placement.rank_offsets, dtype=torch.int64, device="cpu"
        ),
        prefix + RECORD_KEYS[2]: torch.tensor(rank, dtype=torch.int64, device="cpu"),
    }


def save_record(layer: EPMoE, destination: dict[str, Any], prefix: str) -> None:
    """Add ``layer``'s placement record to a state dict being built (``EPMoE`` calls it
    from ``_save_to_state_dict``)."""
    destination.update(placement_record(layer.placement, layer.rank, prefix))


def load_shard(
    layer: EPMoE,
    load: Callable[..., None],
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> bool:
    """``EPMoE._load_from_state_dict``: check the placement record, then ``load`` (the
    ``nn.Module`` implementation) copies the tensors. A record that does not fit this
    rank's slots, or expert weights without a record, add one message to ``error_msgs``
    (``load_state_dict`` raises it, strict or not) and nothing is copied.

    Returns whether the expert weights were copied (every slot tensor was in the state
    dict and no error came up), so that the layer marks them loaded."""
    record = {key: state_dict.pop(prefix + key, None) for key in RECORD_KEYS}
    if all(value is None for value in record.values()):
        if any(prefix + name in state_dict for name in layer.slot_tensors()):
            error_msgs.append(
                f"EPMoE at {_where(prefix)}: the state dict holds expert weights but no "
                f"placement record ({', '.join(prefix + k for k in RECORD_KEYS)}), so "
                f"whether they are rank {layer.rank}'s experts {_short(layer.local_experts)} "
                "cannot be checked. Load the shard this rank saved with EPMoE.state_dict; "
                "or, if you know the placement and rank it was saved under, add the record "
                "(sd.update(epmoe.checkpoint.placement_record(placement, rank, "
                f"prefix={prefix!r}))) and load again; or load full experts with "
                "epmoe.checkpoint.load_full_experts"
            )
            return False
    else:
        error = _record_error(layer, record, prefix)
        if error is not None:
            error_msgs.append(error)
            return False
    assign = local_metadata.get("assign_to_params_buffers", False)
    if not assign and any(prefix + name in state_dict for name in layer.meta_slot_tensors()):
        error_msgs.append(f"EPMoE at {_where(prefix)}: {layer._meta_error('load_state_dict')}")
        return False
    cast = {}  # shards in another floating dtype, converted to the layer's
    for name, tensor in layer.slot_tensors().items():
        saved = state_dict.get(prefix + name)
        if not isinstance(saved, torch.Tensor) or saved.dtype == tensor.dtype:
            continue
        if torch.float8_e4m3fn in (saved.dtype, tensor.dtype):
            # copy_ would cast silently: FP8 codes read as values, or values as codes (other
            # floating dtypes convert, as for any module: a layer built in one and .to() another)
            error_msgs.append(
                f"EPMoE at {_where(prefix)}: {prefix + name} was saved as {saved.dtype}, this "
                f"layer holds {tensor.dtype} (weight_dtype={layer.weight_dtype}); build the "
                "layer with the weight_dtype it was saved with, or load full experts with "
                "epmoe.checkpoint.load_full_experts (which converts)"
            )
            return False
        cast[prefix + name] = saved.to(tensor.dtype)
    if cast:  # (in the layer's dtype, also for load_state_dict(..., assign=True))
        state_dict = {**state_dict, **cast}
    errors_before = len(error_msgs)
    load(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
    complete = all(prefix + name in state_dict for name in layer.slot_tensors())
    return complete and len(error_msgs) == errors_before


def placement_summary(placement: ExpertPlacement) -> str:
    """``"linear"``, ``"round_robin"`` or ``"custom"`` with its slot count, and E and W."""
    E, W, P = placement.num_experts, placement.ep_size, placement.num_physical
    kind = f"custom placement with {P} slots"
    if P == E:
        for name, build in (
            ("linear", ExpertPlacement.linear),
            ("round_robin", ExpertPlacement.round_robin),
        ):
            if E >= W and placement == build(E, W):
                kind = f"{name!r} placement"
                break
    return f"{kind} (E={E}, W={W})"


def _record_error(layer: EPMoE, record: dict[str, Any], prefix: str) -> str | None:
    """What is wrong with loading a shard saved under ``record`` into ``layer``, or None
    when its slots hold this rank's experts."""
    missing = [prefix + k for k, v in record.items() if v is None]
    try:
        if missing:
            raise ValueError(f"keys {missing} are missing")
        if not all(isinstance(v, torch.Tensor) for v in record.values()):
            raise TypeError("its entries must be tensors")
        rank = int(record[RECORD_KEYS[2]])
        offsets = record[RECORD_KEYS[1]].flatten().tolist()
        p2l = record[RECORD_KEYS[0]]
        saved = ExpertPlacement(int(p2l.max()) + 1, len(offsets) - 1, p2l, tuple(offsets))
        saved_local = saved.local_experts(rank)
    except (TypeError, ValueError, RuntimeError) as exc:
        return (
            f"EPMoE at {_where(prefix)}: the state dict's placement record is malformed "
            f"({exc}); it was not written by EPMoE.state_dict"
        )
    if saved.num_experts == layer.num_experts and saved_local == layer.local_experts:
        return None
    return (
        f"EPMoE at {_where(prefix)}: this shard was saved by rank {rank} of a "
        f"{placement_summary(saved)}, whose slots hold experts {_short(saved_local)}; this "
        f"layer is rank {layer.rank} of a {placement_summary(layer.placement)}, whose slots "
        f"hold experts {_short(layer.local_experts)}. Load each rank's own shard (the one "
        f"rank {layer.rank} saved under this placement), or, to change placement or world "
        "size, save full experts with epmoe.checkpoint.gather_full_experts and load them "
        "with epmoe.checkpoint.load_full_experts"
    )


def _where(prefix: str) -> str:
    return repr(prefix[:-1]) if prefix else "the root"


def _short(experts: list[int]) -> str:
    if len(experts) <= 16:
        return str(experts)
    return f"[{experts[0]}, {experts[1]}, ..., {experts[-1]}] ({len(experts)} slots)"


# ---------------------------------------------------------------------- full experts
@torch.no_grad()
def gather_full_experts(layer: EPMoE, dst: int | None = None) -> dict[str, torch.Tensor] | None:
    """The layer's full logical experts, gathered from every rank's shard.

    Returns ``{"w13": [E, 2I, H], "w2": [E, H, I]}`` in the layer's weight dtype on its
    device (with FP8 weights also ``"w13_scale"``, ``"w2_scale"`` ``[E, ...]``), plus
    ``"e_score_correction_bias": [E]`` float32 when the layer has one (it routes with it;
    every rank holds the same). Each logical expert comes from its first
    replica (the lowest physical slot holding it), so placements with redundant replicas
    give one copy per expert. The result loads into any placement of the same E, I, H
    with :func:`load_full_experts`.

    Collective over ``layer.group``: every rank calls it, with the same ``dst``.
    ``dst=None`` gives the result on every rank (all-gather); ``dst=r`` (a rank of the EP
    group) only on rank r, the others get ``None`` (gather: only r holds the full
    weights). Before any weight moves, one small all-reduce checks on every rank that all
    ranks hold loaded weights under the same placement, so a bad call raises everywhere
    instead of leaving ranks in a collective. Extra memory: the full experts on the
    receiving ranks (with ``dst=None``, up to W·max_e slots while gathering).
    """
    rank, W = layer.rank, layer.ep_size
    bad_dst = dst is not None and (
        isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < W
    )
    dst_error = (
        f"dst must be None or a rank of the EP group in [0, {W}), got {dst!r}" if bad_dst else None
    )
    tensors = layer.slot_tensors()  # name -> [e, *X]
    _agree(layer, tensors, None if bad_dst else dst, dst_error)
    p = layer.placement
    first = p.logical_to_physical[:, 0]  # [E] physical id of each expert's first replica
    owner = p.owner_rank[first]  # [E] the rank that sends it
    counts = torch.bincount(owner, minlength=W)
    n_max = int(counts.max())
    # rank r sends the experts it owns (first replicas) in ascending id; expert x lands at
    # row owner[x] * n_max + (its position among rank owner[x]'s experts)
    position = torch.empty_like(owner)
    for r in range(W):
        mine = (owner == r).nonzero().flatten()
        position[mine] = torch.arange(mine.numel(), device="cpu")
    rows = (owner * n_max + position).to(layer.device)
    send_slots = (first[owner == rank] - p.rank_offsets[rank]).to(layer.device)

    receives = dst is None or dst == rank
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        send = t.new_zeros((n_max, *t.shape[1:]))
        send[: send_slots.numel()] = t[send_slots]
        gathered = t.new_empty((W * n_max, *t.shape[1:])) if receives else None
        _gather(send, gathered, layer.group, W, dst)
        if receives:
            out[name] = gathered[rows]
    if not receives:
        return None
    bias = getattr(layer, _BIAS, None)
    if bias is not None:
        out[_BIAS] = bias.detach().clone()
    return out


@torch.no_grad()
def load_full_experts(layer: EPMoE, state: Mapping[str, torch.Tensor]) -> None:
    """Load full logical experts (as :func:`gather_full_experts` returns them) into
    ``layer``, whatever its placement: ``state["w13"] [E, 2I, H]``, ``state["w2"]
    [E, H, I]`` with ``"w13_scale"`` / ``"w2_scale"`` for FP8 weights (=
    ``layer.load_experts``; each rank keeps its own slots; an FP8 layer quantizes
    full-precision weights, a full-precision layer dequantizes FP8 ones) and, when the
    layer routes with one, ``state["e_score_correction_bias"] [E]``. Not collective."""
    if not isinstance(state, Mapping):
        raise TypeError(
            f"state must be a mapping of tensors (as gather_full_experts returns), got "
            f"{type(state).__name__}"
        )
    bias = getattr(layer, _BIAS, None)
    allowed = set(_FULL_KEYS) | set(_SCALE_KEYS) | ({_BIAS} if bias is not None else set())
    missing = [k for k in _FULL_KEYS if k not in state]
    unknown = sorted(set(state) - allowed)
    if missing or unknown:
        hint = (
            f"; {_BIAS!r} belongs to a layer built with e_score_correction_bias"
            if _BIAS in unknown
            else ""
        )
        raise ValueError(
            f"load_full_experts wants keys {sorted(allowed)} (w13 [E, 2I, H], w2 [E, H, I]"
            f"{', bias [E]' if bias is not None else ''}), got {sorted(state)}{hint}"
        )
    if _BIAS in state:
        new_bias = state[_BIAS]
        if not isinstance(new_bias, torch.Tensor) or tuple(new_bias.shape) != tuple(bias.shape):
            shape = tuple(new_bias.shape) if isinstance(new_bias, torch.Tensor) else new_bias
            raise ValueError(f"{_BIAS} must be [E={layer.num_experts}], got {shape}")
    scales = {k: state[k] for k in _SCALE_KEYS if k in state}  # FP8 weights' scales
    layer.load_experts(state["w13"], state["w2"], **scales)
    if _BIAS in state:
        bias.copy_(state[_BIAS])


def _gather(
    send: torch.Tensor,
    out: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    W: int,
    dst: int | None,
) -> None:
    """``out [W·n, *X]`` ← every rank's ``send [n, *X]`` in rank order, on every rank
    (``dst=None``) or on ``dst`` only (``out`` is None elsewhere). One-byte floats (FP8)
    travel as uint8 (gloo moves no float8)."""
    if send.element_size() == 1 and send.is_floating_point():
        send = send.view(torch.uint8)
        out = None if out is None else out.view(torch.uint8)
    if W == 1:
        out.copy_(send)
    elif dst is None:
        all_gather_into(out, send, group)
    else:
        chunks = list(out.chunk(W)) if out is not None else None
        dist.gather(send, chunks, group=group, group_dst=dst)


def _agree(
    layer: EPMoE, tensors: Mapping[str, torch.Tensor], dst: int | None, dst_error: str | None
) -> None:
    """Raise on every rank if some rank passed an invalid ``dst`` (``dst_error``), the
    ranks' placements, tensor shapes or ``dst`` differ, or some rank's weights are not
    loaded. One all-reduce of four int64."""
    h = hashlib.blake2b(digest_size=8)
    p = layer.placement
    h.update(repr((p.num_experts, p.ep_size, p.rank_offsets, dst)).encode())
    h.update(p.physical_to_logical.numpy().tobytes())
    h.update(repr([(n, tuple(t.shape[1:]), str(t.dtype)) for n, t in tensors.items()]).encode())
    fingerprint = int.from_bytes(h.digest(), "little") >> 2
    flags = [fingerprint, -fingerprint, int(not layer.weights_loaded), int(dst_error is not None)]
    if layer.ep_size > 1:
        t = torch.tensor(flags, dtype=torch.int64, device=layer.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=layer.group)
        flags = t.tolist()
    if flags[3]:
        raise ValueError(
            dst_error
            or "gather_full_experts: another rank of the EP group passed an invalid dst (its "
            "own error says which); every rank must pass the same dst, None or a group rank"
        )
    if flags[0] != -flags[1]:
        raise RuntimeError(
            "gather_full_experts: the EP ranks disagree on the placement, the expert shapes "
            "and dtypes, or dst; every rank must call it on the same layer with the same dst"
        )
    if flags[2]:
        where = "this rank" if not layer.weights_loaded else "another rank of the EP group"
        raise RuntimeError(
            f"gather_full_experts: expert weights are not loaded on {where}; load them "
            "(load_experts, load_full_experts or load_state_dict) on every rank first"
        )
