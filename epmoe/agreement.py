"""One small all-gather per collective call of an ``EPMoE`` layer, so that one rank's
mistake raises on every rank in that same call.

A layer agrees with the other ranks of its EP group when it is built, at every
``forward`` without ``max_tokens_across_ranks`` (or an active step), and at every
``rebalance``; a DP step (:func:`epmoe.step`) agrees once for all layers of the step. Each rank
contributes one record of ``RECORD_LEN`` int64, the same length for every operation, so a
rank that is in another operation (or another layer) still meets the others in the same
collective and is named instead of crashing the transport:

    [MAGIC, operation, layer index, call count, T, status, digest, previous step]

* operation: ``construction``, ``forward``, ``rebalance``, ``backend rebuild``, ``step``
  or ``EPLB re-plan`` (an ``EPLBManager``'s: ``-2`` as layer index, its re-plan count as
  call count, a digest of its settings and layers; a step record
  holds ``-1`` as layer index, the caller's ``step_id`` or the group's step number as
  call count, and as digest its rank's ``decode`` wish in bit 0, its pending-conversion
  digest in bits 1–31 and its ``graph_max_tokens`` (0: none) in bits 32–62);
* layer index: the order in which this process built the layers of the group (agreed at
  construction), so a rank that skipped one layer's forward is caught at the next layer;
* call count: this layer's agreed calls so far (forwards and rebalances that passed their
  agreement). A forward with ``max_tokens_across_ranks`` does no collective and is not
  counted;
* T: this rank's tokens (forward); the step's largest T decides the chunk count;
* status: ``OK``, or why this rank refuses the call (``REJECTED``: its arguments, inputs
  or weights; else bits checked on the device and added without a host synchronisation:
  ``IDS_OUT_OF_RANGE``, its routing chose ids outside ``[-1, E)``; ``COUNT_OUT_OF_RANGE``,
  its ``num_valid_tokens`` count lies outside ``[0, T]``);
* digest: a 64-bit hash of the fields every rank must hold equal (construction: the
  layer's configuration, see ``EPMoE``; rebalance: the new placement);
* previous step (a step record; 0 in the others): a digest of the EPMoE layer calls this
  rank made inside the group's previous step (``NO_PREVIOUS`` when there was none,
  ``PREVIOUS_RAISED`` when that step ended in an exception on this rank, whose error was
  raised then). Ranks whose calls differed are told at the next step (a rank that
  skipped the step's last layer: see :meth:`StepAgreement.step`).

Every rank reads the same gathered records and so takes the same decision, in this order:
operation, layer index and call count (``RuntimeError`` naming the ranks and their values);
status (this rank's own error, or ``RuntimeError`` naming the refusing ranks); digest
(``ValueError`` naming each field that differs and which ranks hold which value, from a
second exchange of the fields' text that runs only then). With one rank (or without
torch.distributed) nothing is exchanged. A call that raises is not counted on any rank,
so after the error the ranks are in step again.

What a skipped call looks like: the ranks' k-th agreements meet, so a rank that skipped
a forward meets the others' forward with its next call. When that call is another layer's
(a model: layer index), a rebalance (operation) or a construction, every rank raises
naming the ranks and where each one is. Two forwards of one layer look alike, so a rank
that skipped a forward and then calls the same layer again goes on unnoticed (each rank's
output depends only on its own tokens, so the results stay right) until a call that
differs, or until the others wait for a call it never makes: the collective's timeout
then names it (see ``epmoe.comm.collectives.all_gather_rows``).

Shape legend: W ranks of the EP group · L = ``RECORD_LEN``.
"""

from __future__ import annotations

import copy
import hashlib
import weakref
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from epmoe.comm.base import COPY_INDEX, ranks_by_value, ranks_phrase
from epmoe.comm.collectives import all_gather_rows, world_of

__all__ = ["RECORD_LEN", "LayerAgreement", "StepAgreement", "describe_placement"]

MAGIC = 0x45504D6F45  # "EPMoE"
CONSTRUCTION, FORWARD, REBALANCE, STEP, REBUILD, REPLAN = 1, 2, 3, 4, 5, 6
OPERATIONS = {
    CONSTRUCTION: "construction",
    FORWARD: "forward",
    REBALANCE: "rebalance",
    STEP: "step",
    REBUILD: "backend rebuild",
    REPLAN: "EPLB re-plan",
}
STEP_INDEX = -1  # the layer index field of a step record (a step belongs to no layer)
REPLAN_INDEX = -2  # and of an EPLBManager's re-plan record (it spans the layers)
OK, REJECTED, IDS_OUT_OF_RANGE, COUNT_OUT_OF_RANGE = 0, 1, 2, 4
DEVICE_CHECKS = IDS_OUT_OF_RANGE | COUNT_OUT_OF_RANGE  # the status bits set on the device
_MAGIC, _OP, _INDEX, _COUNT, _T, _STATUS, _DIGEST, _PREVIOUS = range(8)
RECORD_LEN = 8
NO_PREVIOUS, PREVIOUS_RAISED = 0, -1  # the previous-step field's special values

# The next layer index of each process group, by group object (entries go with their
# group). Filled collectively: every rank of a group builds its layers in the same order,
# and the construction agreement realigns it when they do not.
_next_index: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# The next step number of each process group (epmoe.step), likewise; ``_one_process``:
# the steps of this process without torch.distributed (group None)
_next_step: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_one_process = {"steps": 0}

_SHOWN_CHARS = 160  # a field's value is cut to this many characters in messages


def digest(fields: Mapping[str, str]) -> int:
    """A signed 64-bit hash of ``fields`` (name → text)."""
    h = hashlib.blake2b(digest_size=8)
    for name in sorted(fields):
        h.update(f"{name}={fields[name]}\0".encode())
    return int.from_bytes(h.digest(), "little", signed=True)


def describe_placement(placement, name: str | None = None) -> str:
    """The placement as one line of text: its builder's name when known, ``rank_offsets``
    and ``physical_to_logical`` (all of it: the digest must see every slot)."""
    p2l = placement.physical_to_logical.tolist()
    head = repr(name) if name is not None else "ExpertPlacement"
    return f"{head} rank_offsets={list(placement.rank_offsets)} physical_to_logical={p2l}"


class LayerAgreement:
    """The agreement state of one layer: its EP group, its index among the group's layers
    and its count of agreed calls. Host bookkeeping only."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        self.group = group
        self.rank, self.world_size = world_of(group)
        self.index = _next_index.get(group, 0) if self.world_size > 1 else 0
        self.calls = 0
        self.copies = 0  # deep copies made of this layer (see fork)

    # ------------------------------------------------------------------ operations
    def construction(
        self, fields: Mapping[str, str] | None, error: Exception | None, device: torch.device
    ) -> None:
        """Agree that every rank built this layer with the same ``fields`` (name → text;
        ``None`` when ``error``, this rank's own reason to refuse, is set). Raises
        ``error`` on its rank and an error naming the ranks on the others."""
        if self.world_size == 1:
            if error is not None:
                raise error
            return
        records = self._gather(CONSTRUCTION, 0, error, None, fields, device)
        if all(r[_OP] == CONSTRUCTION for r in records):
            # every rank is building a layer: the index is used up on each alike, whatever
            # the outcome (and realigned if the ranks' indices differed)
            _next_index[self.group] = max(r[_INDEX] for r in records) + 1
        self._check(records, CONSTRUCTION, error, fields, None)

    def forward(
        self,
        T: int,
        error: Exception | None,
        device_flags: torch.Tensor | None,
        device: torch.device,
        device_error: Callable[[int], Exception],
    ) -> int:
        """Agree on a forward: every rank's checks passed (``error`` is this rank's,
        ``device_flags`` a 0-d int64 device tensor of ``DEVICE_CHECKS`` bits: its routing
        chose ids out of range, its count of valid rows is out of range) and every rank is
        in the same call. ``device_error(flags)`` builds this rank's exception for its set
        bits. Returns the largest T of the group."""
        if self.world_size == 1:
            if error is not None:
                raise error
            if device_flags is not None and (flags := int(device_flags)):
                raise device_error(flags)
            return T
        records = self._gather(FORWARD, T, error, device_flags, None, device)
        self._check(records, FORWARD, error, None, device_error)
        self.calls += 1
        return max(r[_T] for r in records)

    def rebalance(
        self, fields: Mapping[str, str] | None, error: Exception | None, device: torch.device
    ) -> None:
        """Agree on a rebalance before any weight moves: every rank is in the same call,
        none refuses, and all hold the same new placement (``fields``)."""
        if self.world_size == 1:
            if error is not None:
                raise error
            return
        self._change(REBALANCE, fields, error, device)

    def rebuild(
        self, fields: Mapping[str, str] | None, error: Exception | None, device: torch.device
    ) -> None:
        """Agree, at the first collective call after ``.to(dtype)`` (or of a deep copy),
        that every rank changed its layer alike (``fields``: its dtype) and is in the same
        call, before the communication backends are rebuilt; then once more on the build's
        outcome (``error``: this rank's build failed; every rank raises and keeps its old
        backends)."""
        if self.world_size == 1:
            if error is not None:
                raise error
            return
        self._change(REBUILD, fields, error, device)

    def fork(self) -> LayerAgreement:
        """The agreement of a copy of this layer, no calls yet. Its index is derived from
        this layer's and the number of copies made of it before (the n-th copy of a layer
        has the same index on every rank that makes it), apart from the construction
        indices: a copy made on some ranks only changes no other layer's index, and copies
        called in different orders on different ranks are told apart."""
        twin = copy.copy(self)
        self.copies = getattr(self, "copies", 0) + 1
        twin.copies = 0
        twin.calls = 0
        if self.world_size > 1:
            tag = f"copy {self.copies} of layer {self.index}"
            twin.index = (digest({"copy": tag}) & (COPY_INDEX - 1)) | COPY_INDEX
        return twin

    def _change(self, op, fields, error, device) -> None:
        records = self._gather(op, 0, error, None, fields, device)
        self._check(records, op, error, fields, None)
        self.calls += 1

    # ------------------------------------------------------------------ internals
    def _gather(self, op, T, error, device_flags, fields, device) -> list[list[int]]:
        status = OK if error is None else REJECTED
        fields_digest = digest(fields) if fields is not None and error is None else 0
        count = self.calls if op != CONSTRUCTION else 0
        row = torch.tensor(
            [MAGIC, op, self.index, count, T, status, fields_digest, NO_PREVIOUS],
            dtype=torch.int64,
            device=device,
        )
        if device_flags is not None and error is None:  # on the device: no host sync
            row[_STATUS] = device_flags.to(device=device, dtype=torch.int64)
        what = (
            f"EPLBManager.rebalance agreement (re-plan {count})"
            if op == REPLAN
            else f"EPMoE.{OPERATIONS[op]} agreement (layer #{self.index}, call {count})"
        )
        return all_gather_rows(row, self.group, what)

    def _check(self, records, op, error, fields, device_error) -> None:
        W = self.world_size
        where = self._where(op)
        if any(r[_MAGIC] != MAGIC for r in records):
            others = [r for r in range(W) if records[r][_MAGIC] != MAGIC]
            raise RuntimeError(
                f"{where}: {ranks_phrase(others)} in a collective that is not an EPMoE agreement; "
                "the ranks are out of step"
            )
        # a step record that refused its arguments may hold no valid step number (a bad
        # step_id): its status names it below, its number takes no part here
        placed = [r for r in records if not (r[_OP] == STEP and r[_STATUS] == REJECTED)]
        places = [
            f"step {r[_COUNT]}"
            if r[_OP] == STEP
            else f"EPLB re-plan {r[_COUNT]}"
            if r[_OP] == REPLAN
            else f"{OPERATIONS.get(r[_OP], '?')} of layer #{r[_INDEX]} (call {r[_COUNT]})"
            for r in records
        ]
        if len({(r[_OP], r[_INDEX], r[_COUNT]) for r in placed}) > 1:
            if len({r[_OP] for r in records}) > 1:
                what = "different EPMoE calls"
            elif len({r[_INDEX] for r in records}) > 1:
                what = "different layers"
            else:
                what = "different steps" if op == STEP else "different calls of this layer"
                self.calls = max(r[_COUNT] for r in placed)  # realigned
            rule = (
                "every rank must open every step (also with num_tokens=0), in the same order"
                if op == STEP
                else "every rank must build its layers, call each (also with T = 0) and "
                "rebalance it in the same order"
            )
            if REPLAN in {r[_OP] for r in records}:
                rule = (
                    "every rank must call its EPLBManager's step() once per model step (or "
                    "rebalance() at the same point), built with the same rebalance_interval"
                )
            if REBUILD in {r[_OP] for r in records}:
                rule = (
                    "a rank changed this layer (model.to(dtype), or a copy.deepcopy) and "
                    "another did not: change every rank's model alike"
                )
            raise RuntimeError(
                f"{where}: the EP ranks are in {what}: {_listing(ranks_by_value(places), 'in')}. "
                f"A rank skipped a call or made an extra one: {rule}. "
                "This call is not counted on any rank, so the next one proceeds"
            )
        statuses = [r[_STATUS] for r in records]
        if error is not None:
            raise error
        if statuses[self.rank] & DEVICE_CHECKS:
            raise device_error(statuses[self.rank])
        if any(statuses):
            rejected = [r for r in range(W) if statuses[r] == REJECTED]
            bad_ids = [r for r in range(W) if statuses[r] & IDS_OUT_OF_RANGE]
            bad_counts = [r for r in range(W) if statuses[r] & COUNT_OUT_OF_RANGE]
            why = []
            if rejected:
                what = {FORWARD: "inputs, weights or routing", STEP: "epmoe.step arguments"}.get(
                    op, "arguments"
                )
                its = "its" if len(rejected) == 1 else "their"
                why.append(f"{ranks_phrase(rejected, 'rejected')} {its} {what}")
            if bad_ids:
                who = ranks_phrase(bad_ids).rsplit(" ", 1)[0]  # "rank 1" / "ranks [1, 2]"
                why.append(f"the routing of {who} chose expert ids outside [-1, E)")
            if bad_counts:
                who = ranks_phrase(bad_counts).rsplit(" ", 1)[0]
                why.append(f"the num_valid_tokens of {who} lay outside [0, T]")
            raise RuntimeError(
                f"{where}: another rank of the EP group refused this call: "
                f"{' and '.join(why)} (its own error says why); this rank stopped too, so "
                "that no rank is left waiting in a collective"
            )
        if op != STEP and len({r[_DIGEST] for r in records}) > 1:
            raise ValueError(self._differences(op, fields or {}))

    def _where(self, op) -> str:
        """This call in messages: ``EPMoE.forward (layer #3)``, ``epmoe.step (step 7)``."""
        if op == STEP:
            return f"epmoe.step (step {self.calls})"
        if op == REPLAN:
            return f"EPLBManager.rebalance (re-plan {self.calls})"
        return f"EPMoE.{OPERATIONS[op]} (layer #{self.index})"

    def _differences(self, op, fields: Mapping[str, str]) -> str:
        """The message for differing fields; collective (every rank calls it alike)."""
        texts: list = [None] * self.world_size
        dist.all_gather_object(texts, dict(fields), group=self.group)
        names = sorted({n for t in texts for n in t})
        lines = []
        for name in names:
            values = ranks_by_value([t.get(name, "<missing>") for t in texts])
            if len(values) > 1:
                start = _first_difference(list(values))
                shown = {_shorten(v, start): ranks for v, ranks in values.items()}
                lines.append(f"{name} differs: {_listing(shown, 'have')}")
        fix = {
            CONSTRUCTION: "build every rank's layer with the same arguments",
            REBUILD: "convert every rank's model to the same dtype",
            REPLAN: "build every rank's EPLBManager over the same layers with the same settings",
        }.get(
            op,
            "every rank must pass the same placement (plan it from the all-reduced load, "
            "as EPLBManager does)",
        )
        return (
            f"{self._where(op)}: the EP ranks disagree; "
            + "; ".join(lines or ["(the fields' digests differ)"])
            + f"; {fix}"
        )


class ReplanAgreement(LayerAgreement):
    """The agreement of an :class:`~epmoe.eplb.manager.EPLBManager`'s re-plans: the same
    record as a layer's, ``[MAGIC, REPLAN, -2, re-plan count, 0, status, settings, 0]``, so
    a rank that re-plans while another runs a layer's forward (or a step) meets it in the
    same collective and both are named, before the load all-reduce that would otherwise
    meet a layer's collective. The digest covers the manager's settings and its layers."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        super().__init__(group)
        self.index = REPLAN_INDEX

    def replan(self, fields: Mapping[str, str], device: torch.device) -> None:
        """Agree on a re-plan: every rank is in the same one, with the same ``fields``."""
        if self.world_size > 1:
            self._change(REPLAN, fields, None, device)


def pending_digest(layers) -> int:
    """A 31-bit digest of the converted layers among ``layers`` whose backends wait for
    their rebuild (``.to(dtype)`` before their next call: index and dtype), 0 when none.
    Copies waiting for their first call do not count: one made on some ranks only (a
    snapshot) is harmless until it is called."""
    entries = [
        f"{layer._agreement.index}:{layer.params_dtype}"
        for layer in layers
        if getattr(layer, "_comm_pending", False) and not getattr(layer, "_comm_shared", False)
    ]
    if not entries:
        return 0
    return (digest({str(i): e for i, e in enumerate(sorted(entries))}) & 0x7FFFFFFF) or 1


class PreviousStepDiffers(RuntimeError):
    """Raised by every rank of a step whose previous step's layer calls differed between
    the ranks (``StepAgreement.step``)."""


def previous_step_field(calls: tuple[int, ...] | None, raised: bool) -> int:
    """The previous-step field of a step record: ``NO_PREVIOUS`` (no step before on this
    group), ``PREVIOUS_RAISED``, or a positive 62-bit digest of ``calls`` (the layer
    indices of the EPMoE calls made in it, in order)."""
    if calls is None:
        return NO_PREVIOUS
    if raised:
        return PREVIOUS_RAISED
    return (digest({"calls": ",".join(map(str, calls))}) & ((1 << 62) - 1)) | (1 << 62)


class StepAgreement(LayerAgreement):
    """The agreement of one DP step (:func:`epmoe.step`): the same record as a layer's,
    ``[MAGIC, STEP, -1, step number, T, status, decode and bounds, previous step]``, so a
    rank in a step meets a rank in a layer's own agreement (or in another step) in the same
    collective and both are named. The step number counts the group's agreed steps (per
    group object, like the layer index); a step that raises is not counted on any rank."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        super().__init__(group)
        self.index = STEP_INDEX
        if self.group is not None:
            self.calls = _next_step.get(self.group, 0)
        else:
            self.calls = _one_process["steps"]

    def step(
        self,
        T: int,
        decode: bool,
        error: Exception | None,
        device: torch.device,
        step_id: int | None = None,
        pending: int = 0,
        graph_max_tokens: int | None = None,
        previous: tuple[tuple[int, ...], bool] | None = None,
    ) -> tuple[list[int], list[bool]]:
        """Agree on a step: every rank's ``T`` (``error``: this rank's reason to refuse,
        e.g. a bad ``num_tokens``) and its ``decode`` wish, and that every rank is in the
        same step: the same ``step_id`` (the caller's step number, e.g. its scheduler's),
        or, without one, the same count of agreed steps. One all-gather read by the host.
        Returns ``T`` and ``decode`` of every rank, in rank order; raises on every rank when
        a rank refused or the ranks are in different steps (or calls). ``pending``: a digest
        of this rank's layers whose backends wait for a rebuild (:func:`pending_digest`);
        ranks that differ in it (one converted its model's dtype and another did not) are
        told here, before a forward that would leave one rank in the rebuild's agreement
        and the other in a dispatch. ``graph_max_tokens``: this rank's bound for a CUDA-graph
        step (``None``: none); ranks that differ in it are told here too, since each would
        decide alone whether the step replays its graphs. ``previous``: the layer indices
        of the EPMoE calls this rank made in the group's previous step and whether that
        step raised here (``None``: no previous step). Ranks whose calls differed (and whose
        previous step raised on none of them) raise here, naming each rank's calls: a
        rank that skipped the step's last layer left the others in its dispatch, where
        nothing else names it."""
        if self.world_size == 1:
            if error is not None:
                raise error
            self._count()
            return [T], [decode]
        count = self.calls if step_id is None else step_id
        row = torch.tensor(
            [
                MAGIC,
                STEP,
                STEP_INDEX,
                count,
                T if error is None else 0,
                OK if error is None else REJECTED,
                int(bool(decode)) | (pending << 1) | ((graph_max_tokens or 0) << 32),
                previous_step_field(*previous) if previous is not None else NO_PREVIOUS,
            ],
            dtype=torch.int64,
            device=device,
        )
        records = all_gather_rows(row, self.group, f"epmoe.step agreement (step {count})")
        own = self.calls
        self.calls = count  # what _check names (and realigns, for the group's own count)
        try:
            self._check(records, STEP, error, None, None)
        finally:
            if step_id is not None:
                self.calls = own  # a caller's step id leaves the group's count alone
            elif self.group is not None:  # realigned when the ranks' counts differed
                _next_step[self.group] = self.calls
        pendings = [(r[_DIGEST] >> 1) & 0x7FFFFFFF for r in records]
        if len(set(pendings)) > 1:
            differ = ranks_by_value(["pending" if p else "none" for p in pendings])
            raise RuntimeError(
                f"epmoe.step (step {count}): the EP ranks' EPMoE layers differ in a change not "
                f"yet agreed on (model.to(dtype) or copy.deepcopy): "
                f"{_listing(differ, 'have')} (or different ones pending). Change every rank's "
                "model alike; this step is not counted on any rank"
            )
        bounds = [r[_DIGEST] >> 32 or None for r in records]
        if len(set(bounds)) > 1:
            raise RuntimeError(
                f"epmoe.step (step {count}): the EP ranks opened it with different "
                f"graph_max_tokens: {_listing(ranks_by_value(bounds), 'have')}. Pass the same "
                "bound on every rank (the largest graph bucket every rank captured, or None); this "
                "step is not counted on any rank"
            )
        previous_fields = [r[_PREVIOUS] for r in records]
        if PREVIOUS_RAISED not in previous_fields and len(set(previous_fields)) > 1:
            try:
                message = self._previous_differences(count, previous)
            except Exception as exc:  # (raised alike on every rank all the same)
                message = (
                    f"epmoe.step (step {count}): the EP ranks made different EPMoE layer calls "
                    f"in the step before it (naming them failed: {exc!r}); this step is not "
                    "counted on any rank"
                )
            raise PreviousStepDiffers(message)
        self._count()
        return [r[_T] for r in records], [bool(r[_DIGEST] & 1) for r in records]

    def _previous_differences(self, count, previous) -> str:
        """The message for ranks whose previous steps' layer calls differed; collective
        (every rank calls it alike: one exchange of the calls, only then)."""
        calls: list = [None] * self.world_size
        dist.all_gather_object(calls, list(previous[0]) if previous else None, group=self.group)
        ran = [tuple(c) if c is not None else None for c in calls]
        known = [c for c in ran if c is not None]
        at = _first_difference(known) if len(set(known)) > 1 else 0

        def what(c):
            if c is None:
                return "no step before this one"
            n = len(c)
            shown = ", ".join(_layer_name(i) for i in c[max(at - 2, 0) : at + 3])
            head = "…, " if at > 2 else ""
            tail = ", …" if at + 3 < n else ""
            return f"{n} call{'s' if n != 1 else ''} ({head}{shown}{tail})"

        return (
            f"epmoe.step (step {count}): the EP ranks made different EPMoE layer calls in "
            f"the step before it: {_listing(ranks_by_value([what(c) for c in ran]), 'made')}; "
            f"they first differ at call {at + 1}. A rank skipped a layer (or called one more) "
            "inside that step: every rank must call every layer of a step, also with T = 0, "
            "in the same order. Where it skipped the step's last layer, the others waited "
            "in that layer's dispatch: a graph-safe backend's bounded wait timed out there "
            "(its next call says so; rebuild the layers then). This step is not counted on "
            "any rank, so the next one proceeds"
        )

    def _count(self) -> None:
        self.calls += 1
        if self.group is not None:
            _next_step[self.group] = self.calls
        else:
            _one_process["steps"] = self.calls


def _layer_name(index: int) -> str:
    """``"#3"`` for a layer index, ``"a copy"`` for a copy's (see ``fork``)."""
    return f"#{index}" if index < COPY_INDEX else "a copy"


def _listing(groups: Mapping, verb: str) -> str:
    """``"ranks [0, 2] have X, rank 1 has Y"`` from value → ranks; ``verb`` ``"have"``
    or ``"in"`` (``"ranks [0, 2] are in X"``)."""
    if verb == "in":
        return ", ".join(f"{ranks_phrase(r)} in {value}" for value, r in groups.items())
    return ", ".join(f"{ranks_phrase(r, verb)} {value}" for value, r in groups.items())


def _first_difference(texts: list[str]) -> int:
    """The first character position at which ``texts`` are not all equal."""
    for i, chars in enumerate(zip(*texts)):
        if len(set(chars)) > 1:
            return i
    return min(len(t) for t in texts)


def _shorten(text: str, start: int) -> str:
    """``text`` cut to about ``_SHOWN_CHARS`` characters, keeping its head and the part
    from its first difference with the other ranks' values (``start``) on."""
    if len(text) <= _SHOWN_CHARS:
        return text
    head = _SHOWN_CHARS // 3
    if start <= head + 20:
        return text[: _SHOWN_CHARS - 1] + "…"
    tail = text[start - 20 : start - 20 + _SHOWN_CHARS - head]
    return text[:head] + "…" + tail + ("…" if start - 20 + len(tail) < len(text) else "")
