"""One DP step for the whole model: the ranks agree on the step once, every layer uses it.

In a data-parallel-attention / expert-parallel-MoE stack every rank runs its own batch
through the model, and each ``EPMoE`` layer needs the step's largest token count over the
EP group (the chunk count, the decode backend, the graph bucket) and the promise that every
rank is in the same call with valid inputs. Without a step each layer agrees on that by
itself (one host-synchronising all-gather per layer and forward: 61 for a 61-layer model).
``epmoe.step`` agrees once per step, as DP coordinators in serving engines do::

    with epmoe.step(group, num_tokens=T, decode=is_decode) as s:   # one all-gather
        logits = model(batch)          # every EPMoE layer reads s.max_tokens: no collective
                                       # of its own, no host synchronisation

    # or explicitly: layer(x, router_logits, step=s)

Idle ranks open the step with ``num_tokens=0`` and run the model on ``T = 0`` tokens.

What the one agreement decides (:class:`~epmoe.agreement.StepAgreement`, one all-gather of
the layers' agreement record, read by the host):

* ``max_tokens``: the largest ``num_tokens`` of the EP group (``tokens_per_rank``: all);
* validity: a rank whose ``num_tokens`` is not an int in [0, 2³¹) (or whose other
  arguments are bad) raises its own error, the others a ``RuntimeError`` naming it, in
  that same step;
* step: every rank is in the same step (the caller's ``step_id``, else a per-group step
  counter), not in another step or in a layer's own agreement: otherwise every rank raises
  naming the ranks and where each is;
* ``decode``: every rank asked for a decode step (``decode=True``) and, when
  ``graph_max_tokens`` is given, ``max_tokens`` fits it: the step may run a captured CUDA
  graph (``bucket(sizes)`` picks the graph's batch size, the same on every rank).

Inside the step, layers trust it as they trust ``max_tokens_across_ranks``: a layer's own
checks of its inputs (shapes, dtypes, ``T ≤ max_tokens``) raise on that rank only, routing
ids are not range checked, and a rank that skips a layer (or calls the layers in another
order) is refused where its call meets another layer's dispatch by the backends whose
counts reach the host (each dispatch carries its layer's index, ``AllToAll.call_tag``);
``symm_ll`` and ``symm_ht`` report it from the device at that rank's next call (the call
that met it returns NaN rows for the tokens with an expert across the divide). Each rank
also counts its layer calls in the step (``StepContext.calls``), and the next step's
agreement compares them: that is what names a rank that skipped the step's **last**
layer, where the graph-safe backends' bounded wait has left the others (the
host-synchronising backends leave them in the dispatch's collective instead, until the
group's timeout). The layers of one step must be on the step's EP group.

Shape legend: T tokens on this rank · W EP world size.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import weakref
from collections.abc import Iterator, Sequence

import torch.distributed as dist

from epmoe import custom_op
from epmoe.agreement import PreviousStepDiffers, StepAgreement, pending_digest
from epmoe.comm.collectives import world_of
from epmoe.distributed import as_int as _as_int
from epmoe.distributed import default_device

__all__ = ["StepContext", "current_step", "group_ranks", "step"]

_ACTIVE: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar(
    "epmoe_step", default=None
)
# Each group's last finished step on this rank: the layer indices of its calls and whether
# it ended in an exception here, for the next step's agreement (entries go with the group)
_PREVIOUS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def group_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """The global ranks of ``group`` (``()`` without torch.distributed): how a step and a
    layer compare their EP groups."""
    if not (dist.is_available() and dist.is_initialized()):
        return ()
    return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))


@dataclasses.dataclass(eq=False)
class StepContext:
    """One agreed DP step (see the module docstring). Read-only for its users.

    Fields: ``group`` (the EP group), ``rank``, ``world_size`` (W), ``index`` (the group's
    step number, the same on every rank), ``num_tokens`` (this rank's T),
    ``tokens_per_rank`` (every rank's T, rank order), ``max_tokens`` (their maximum: the
    ``max_tokens_across_ranks`` of every layer in the step), ``decode`` (agreed: the step
    may run a captured CUDA graph), ``active`` (inside its ``with`` block), ``calls``
    (the layer indices of the ``EPMoE`` forwards this rank ran in the step that reached
    their dispatch, in order, those of steps opened inside it included; a replayed CUDA
    graph runs none; compared across ranks by the next step)."""

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    index: int
    num_tokens: int
    tokens_per_rank: tuple[int, ...]
    max_tokens: int
    decode: bool
    ranks: tuple[int, ...]
    active: bool = True
    calls: list[int] = dataclasses.field(default_factory=list)

    @property
    def idle(self) -> bool:
        """This rank has no tokens (it still runs every layer, with ``T = 0``)."""
        return self.num_tokens == 0

    def bucket(self, sizes: Sequence[int]) -> int | None:
        """The smallest of ``sizes`` (CUDA-graph batch sizes) that holds ``max_tokens``, or
        ``None`` when none does; the same on every rank."""
        fits = [s for s in sizes if s >= self.max_tokens]
        return min(fits) if fits else None

    def max_tokens_for(self, layer, T: int) -> int:
        """The ``max_tokens_across_ranks`` of ``layer``'s forward on ``T`` tokens in this
        step. Raises (on this rank) when the step has ended, the layer is on another group,
        or ``T`` exceeds the step's ``max_tokens``."""
        if not self.active:
            raise RuntimeError(
                f"epmoe.step {self.index} has ended; call the layers inside its `with` block "
                "(or open a new step)"
            )
        if layer._group_ranks != self.ranks:
            raise ValueError(
                f"the layer's EP group (ranks {list(layer._group_ranks)}) is not the step's "
                f"(ranks {list(self.ranks)}); open the step on the layers' group"
            )
        if self.max_tokens < T:
            raise ValueError(
                f"this rank calls the layer with T={T} tokens, above the step's largest "
                f"token count {self.max_tokens} (this rank opened step {self.index} with "
                f"num_tokens={self.num_tokens}); pass the step's token count to epmoe.step"
            )
        return self.max_tokens


def record_call(layer, s: StepContext | None) -> None:
    """Count a forward of ``layer`` that reached its dispatch in step ``s`` (the one it
    ran in: given, else the active one), when ``s`` is active and on the layer's group."""
    if s is not None and s.active and s.ranks == layer._group_ranks:
        s.calls.append(layer._agreement.index)


def current_step() -> StepContext | None:
    """The step of the innermost active ``with epmoe.step(...)`` block, or ``None``.

    Not traceable by ``torch.compile`` (a context variable): in compiled code call the
    layers without ``step=``; the compiled layer reads the active step when it runs."""
    return _ACTIVE.get()


def _pending(ranks: tuple[int, ...]) -> int:
    """The digest of this rank's layers on ``ranks`` (those the step serves) with a
    conversion not yet agreed on. (A converted layer that is garbage but not yet collected
    still counts until the collector frees it.)"""
    return pending_digest(
        [layer for layer in custom_op.live_layers() if layer._group_ranks == ranks]
    )


def _int_in(value, low: int, high: int) -> bool:
    """Whether ``value`` is an int (not a bool; NumPy and torch integers too) in ``[low,
    high)``: what the step's all-gather of int64 carries, checked before it on this rank."""
    v = _as_int(value)
    return v is not None and low <= v < high


@contextlib.contextmanager
def step(
    group: dist.ProcessGroup | None = None,
    num_tokens: int = 0,
    *,
    decode: bool = False,
    graph_max_tokens: int | None = None,
    step_id: int | None = None,
) -> Iterator[StepContext]:
    """Agree on one DP step over the EP ``group`` (``None``: WORLD when initialised, else one
    process) and make it the active step of every ``EPMoE`` forward in the block.

    Collective: every rank of ``group`` opens every step, in the same order, also with
    ``num_tokens=0``; one all-gather of 8 int64 per rank, read by the host (nothing with one
    rank). ``num_tokens``: this rank's T for every layer of the step (an int in [0, 2³¹);
    anything else raises here on this rank, and on the others a ``RuntimeError`` naming it).
    ``decode``: this rank asks for a decode step; the step's ``decode`` is true when every
    rank asked and ``max_tokens ≤ graph_max_tokens`` (when given: the same on every rank,
    else every rank raises naming each rank's bound). ``step_id``: the caller's own step
    number (an int in [0, 2⁶²), e.g. its scheduler's; a bad one raises like a bad
    ``num_tokens``); ranks with different ids raise naming each other, which catches a rank
    that skipped a step. Without it the ranks compare their counts of agreed steps, which
    collectives matched in order keep equal: a skipped step then shows only where a rank
    meets another kind of call (a layer's own agreement), or as the others waiting (the
    collective's timeout names it).
    """
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    error = None
    if not _int_in(num_tokens, 0, 2**31):
        error = ValueError(
            f"epmoe.step: num_tokens must be an int in [0, 2**31) (this rank's token count; "
            f"0 when it is idle), got {num_tokens!r}"
        )
    if step_id is not None and not _int_in(step_id, 0, 2**62):
        step_id, bad_id = None, step_id
        error = error or ValueError(
            f"epmoe.step: step_id must be an int in [0, 2**62) or None, got {bad_id!r}"
        )
    if not isinstance(decode, bool):
        error = error or TypeError(f"epmoe.step: decode must be True or False, got {decode!r}")
    if graph_max_tokens is not None and not _int_in(graph_max_tokens, 1, 2**31):
        graph_max_tokens, bad_bound = None, graph_max_tokens
        error = error or ValueError(  # agreed like the others: raised on every rank
            f"epmoe.step: graph_max_tokens must be a positive int below 2**31 or None, got "
            f"{bad_bound!r}"
        )
    num_tokens = _as_int(num_tokens) if error is None else 0  # (a NumPy int: an int)
    if step_id is not None:
        step_id = _as_int(step_id)
    if graph_max_tokens is not None:
        graph_max_tokens = _as_int(graph_max_tokens)
    agreement = StepAgreement(group)
    T = num_tokens
    ranks = group_ranks(group)
    previous = _PREVIOUS.get(group) if group is not None else None
    try:
        tokens, decodes = agreement.step(
            T, decode is True, error, default_device(group), step_id, _pending(ranks),
            graph_max_tokens, previous,
        )  # fmt: skip
    except PreviousStepDiffers:
        _PREVIOUS.pop(group, None)  # told once, on every rank alike: the next step proceeds
        raise
    # this step's number: the caller's, else the group's count (counted once agreed)
    index = step_id if step_id is not None else agreement.calls - 1
    rank, world_size = world_of(group)
    max_tokens = max(tokens)
    ctx = StepContext(
        group=group,
        rank=rank,
        world_size=world_size,
        index=index,
        num_tokens=T,
        tokens_per_rank=tuple(tokens),
        max_tokens=max_tokens,
        decode=all(decodes) and (graph_max_tokens is None or max_tokens <= graph_max_tokens),
        ranks=ranks,
    )
    outer = _ACTIVE.get()
    token = _ACTIVE.set(ctx)
    raised = True
    try:
        yield ctx
        raised = False
    finally:
        ctx.active = False
        if group is not None and world_size > 1:
            _PREVIOUS[group] = (tuple(ctx.calls), raised)
            if outer is not None and outer.active and outer.ranks == ranks:
                # a step inside a step (a capture inside a served step): its calls are the
                # outer step's too, which the next step after the outer one compares
                outer.calls.extend(ctx.calls)
        _ACTIVE.reset(token)
