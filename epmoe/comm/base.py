"""The all-to-all contract every communication backend implements.

Shape legend: T tokens on this rank · H hidden size · K top-k · P physical experts ·
e local experts (slots on this rank) · W EP world size · M_max max tokens per rank per
dispatch · R rows received by this rank · C rows of capacity per local expert (at most M_max·W).

A backend moves tokens from the rank that owns them to the ranks that hold their experts
(``dispatch``) and brings the expert outputs back (``combine``). It produces one of two
layouts:

* ``Layout.STANDARD``: received rows ``[R, H]``; a token appears once per destination rank
  with its top-k ids remapped to local slots (``-1`` for experts held elsewhere) and its
  router weights. The experts return one *weighted* partial sum per received row and
  ``combine`` adds the partial sums of all ranks (an unweighted sum).
* ``Layout.EXPERT_BATCHED``: ``[e, C, H]`` plus ``counts [e]``; a token appears once per
  selected local expert, rows ``[:counts[i]]`` of slot ``i`` are valid (their order is not
  fixed). ``C`` is the backend's capacity per expert: ``M_max · W`` for fixed buffers, or
  the largest count of the dispatch for backends that size buffers as they go. The
  experts return *unweighted* outputs in the same layout and ``combine`` applies the
  router weights and reduces.

Contract v2 (what the fast backends and the serving paths need):

* **Split phase.** ``dispatch_async`` / ``combine_async`` start the transfer and return a
  :class:`Pending`; its ``wait()`` finishes it. Between the two the caller runs other work
  (shared experts, the other micro-batch). ``dispatch`` / ``combine`` are the blocking
  path: ``dispatch_async(...).wait()``.
* **In flight.** ``Capabilities.max_in_flight`` says how many dispatch results a backend
  lets the caller hold before their combine (``None``: no limit; fixed double buffers: 2).
  A dispatch beyond it raises, naming the limit.
* **FP8 on the wire.** ``CommSpec.dispatch_dtype = torch.float8_e4m3fn`` asks for FP8
  dispatch: each row travels as e4m3 with one float32 scale per 128-column group
  (``amax / 448``), and the result carries ``hidden_scale``. Combine stays in ``dtype``.
* **Choice by capability.** ``supports(spec)`` says why a backend cannot serve a spec
  (``None`` when it can); ``unavailable_reason(device, group)`` why it cannot run here.
* **Binding.** A backend serves one placement (``spec.rank_offsets``); ``rebind`` moves it
  to another (an EPLB re-plan) without reallocating what it can keep.

Cross-rank contract: every rank of the group enters every dispatch and combine (started
and finished), also with ``T = 0``, in the same order on every rank.
"""

from __future__ import annotations

import enum
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

FP8_DTYPE = torch.float8_e4m3fn
FP8_GROUP = 128  # columns per FP8 scale on the wire


class Layout(enum.Enum):
    """How dispatched tokens are laid out for the experts."""

    STANDARD = "standard"
    EXPERT_BATCHED = "expert_batched"


@dataclass(frozen=True)
class CommSpec:
    """What a backend needs to know about the layer it serves (identical on every rank).

    ``rank_offsets`` has ``W + 1`` entries: physical experts ``[rank_offsets[r],
    rank_offsets[r + 1])`` live on rank ``r``, so a physical id is owned by exactly one
    rank and its local slot is ``id - rank_offsets[owner]``.
    """

    hidden_size: int  # H
    top_k: int  # K
    rank_offsets: tuple[int, ...]  # [W + 1], non-decreasing, rank_offsets[0] == 0
    max_num_tokens: int  # M_max: most tokens one rank passes to one dispatch
    dtype: torch.dtype  # dtype of the hidden states given to dispatch and of combine's output
    device: torch.device
    # dtype of dispatched rows on the wire: None (= dtype) or torch.float8_e4m3fn (FP8 rows
    # with float32 scales per 128-column group; DispatchResult.hidden_scale carries them)
    dispatch_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        offs = self.rank_offsets
        if len(offs) < 2 or offs[0] != 0 or any(b < a for a, b in zip(offs, offs[1:])):
            raise ValueError(
                f"rank_offsets must start at 0 and not decrease, got {offs}; build it with "
                "ExpertPlacement.rank_offsets"
            )
        if self.hidden_size <= 0 or self.top_k <= 0 or self.max_num_tokens <= 0:
            raise ValueError(
                f"hidden_size, top_k and max_num_tokens must be positive, got "
                f"{self.hidden_size}, {self.top_k}, {self.max_num_tokens}"
            )
        if self.dispatch_dtype not in (None, self.dtype, FP8_DTYPE):
            raise ValueError(
                f"dispatch_dtype must be None, the hidden dtype {self.dtype} or "
                f"torch.float8_e4m3fn, got {self.dispatch_dtype}"
            )
        if not isinstance(self.device, torch.device):
            object.__setattr__(self, "device", torch.device(self.device))
        if self.dispatch_dtype == self.dtype:  # (rows in the hidden dtype: no conversion)
            object.__setattr__(self, "dispatch_dtype", None)

    @property
    def fp8_dispatch(self) -> bool:
        """Whether dispatched rows travel as FP8 e4m3 with per-128-column scales."""
        return self.dispatch_dtype == FP8_DTYPE

    @property
    def wire_dtype(self) -> torch.dtype:
        """The dtype of dispatched rows (``DispatchResult.hidden``)."""
        return self.dispatch_dtype or self.dtype

    def with_offsets(self, rank_offsets: tuple[int, ...]) -> CommSpec:
        """The same spec for another placement (EPLB re-plan)."""
        return replace(self, rank_offsets=tuple(rank_offsets))

    @property
    def world_size(self) -> int:  # W
        return len(self.rank_offsets) - 1

    @property
    def num_physical(self) -> int:  # P
        return self.rank_offsets[-1]

    def num_local(self, rank: int) -> int:  # e on `rank`
        return self.rank_offsets[rank + 1] - self.rank_offsets[rank]

    @property
    def max_local(self) -> int:  # largest e over ranks; ExpertBatched buffers use it
        return max(b - a for a, b in zip(self.rank_offsets, self.rank_offsets[1:]))


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; the layer and ``auto`` choose by these, never by name."""

    layouts: frozenset[Layout]
    dtypes: frozenset[torch.dtype]
    device_types: frozenset[str]  # "cpu", "cuda"
    max_num_tokens: int | None = None  # None: no limit beyond memory
    graph_safe: bool = False  # no host synchronisation, capturable in a CUDA graph
    multi_node: bool = False
    fp8_dispatch: bool = False  # CommSpec.dispatch_dtype = torch.float8_e4m3fn
    # FP8 rows and scales are epmoe.reference.quantize_groups of the hidden rows, bit for bit
    # (False: a library quantizes with its own arithmetic; values within one e4m3 step)
    fp8_reference_quantizer: bool = True
    # entries without an expert (-1) send their token with weight 0 to the lowest physical
    # experts it does not use (a library with no empty entry; no expert gets a token twice):
    # outputs are the same, those experts compute extra rows
    empty_entries_to_unused_expert: bool = False
    # dispatch results the caller may hold before their combine; None: no limit
    max_in_flight: int | None = None
    # fixed buffers sized for M_max tokens per rank: the M_max a layer picks when the user
    # sets none (None: the backend sizes its buffers per call and any chunk size goes)
    default_max_tokens: int | None = None
    # whether "auto" may pick it; False keeps a backend to users who name it (the adapters)
    auto: bool = True


@dataclass(frozen=True)
class DispatchResult:
    """What ``dispatch`` delivers to the experts on this rank.

    Standard: ``hidden [R, H]``, ``topk_ids [R, K]`` int64 local slots (-1: elsewhere),
    ``topk_weights [R, K]`` float32; ``counts`` is ``None`` or tokens per local slot.
    ExpertBatched: ``hidden [e, C, H]``, ``counts [e]`` int32 (rows ``[:counts[i]]``
    valid), ``topk_ids`` and ``topk_weights`` are ``None``. A backend that leaves the
    received rows where they landed (``symm_ll``) sets ``row_index [e, C]`` int32 instead:
    ``hidden`` is then the received rows ``[R, H]`` and row ``c < counts[i]`` of slot
    ``i`` is ``hidden[row_index[i, c]]``; ``expert_rows()`` gathers the ``[e, C, H]`` slabs
    for code that wants them, and the experts' output is ``[e, C, H]`` either way
    (``out_shape``).
    ``hidden_scale`` is set when the hidden states arrive quantized (FP8): float32
    ``[..., ceil(H / 128)]`` per-token-group scales matching ``hidden``'s leading dims.
    ``handle`` is backend state that ``combine`` needs; treat it as opaque.
    """

    layout: Layout
    hidden: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    hidden_scale: torch.Tensor | None = None
    handle: Any = field(default=None, repr=False)
    row_index: torch.Tensor | None = None  # ExpertBatched rows read in place: [e, C] int32

    @property
    def num_rows(self) -> int:
        """R for Standard, C (capacity per expert) for ExpertBatched."""
        if self.layout is Layout.STANDARD:
            return self.hidden.shape[0]
        return self.hidden.shape[1] if self.row_index is None else self.row_index.shape[1]

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The shape of the experts' output that ``combine`` takes: ``[R, H]`` (Standard)
        or ``[e, C, H]`` (ExpertBatched, also with ``row_index``)."""
        if self.row_index is None:
            return tuple(self.hidden.shape)
        return (*self.row_index.shape, self.hidden.shape[-1])

    def expert_rows(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ExpertBatched ``(hidden [e, C, H], hidden_scale [e, C, G] or None)``: the
        slabs themselves, or gathered through ``row_index`` (a copy; rows past
        ``counts[i]`` hold some received row)."""
        if self.layout is not Layout.EXPERT_BATCHED:
            raise ValueError("expert_rows() is for ExpertBatched results")
        if self.row_index is None:
            return self.hidden, self.hidden_scale
        idx = self.row_index.to(torch.int64).clamp(0, max(self.hidden.shape[0] - 1, 0))
        e, C = idx.shape
        flat = idx.reshape(-1)

        def gather(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, flat).view(e, C, t.shape[-1])

        scale = None if self.hidden_scale is None else gather(self.hidden_scale)
        return gather(self.hidden), scale


R = TypeVar("R")


class Pending(Generic[R]):
    """A started dispatch or combine. ``wait()`` finishes it and returns its result; later
    calls return the same result (or raise the same error). Until ``wait()`` the inputs
    given to the start must stay alive and unchanged. Every rank must finish what it
    started, in the same order."""

    __slots__ = ("_finish", "_result", "_error")

    def __init__(self, finish: Callable[[], R]) -> None:
        self._finish: Callable[[], R] | None = finish
        self._result: R | None = None
        self._error: BaseException | None = None

    @classmethod
    def done(cls, value: R) -> Pending[R]:
        """An already finished operation."""
        p = cls(lambda: value)
        p.wait()
        return p

    @property
    def finished(self) -> bool:
        return self._finish is None

    def wait(self) -> R:
        """The result; an error of the finish is raised again by later calls (the finish
        runs once: a second receive would wait for flags the first one consumed)."""
        finish = self._finish
        if finish is not None:
            self._finish = None
            try:
                self._result = finish()
            except BaseException as exc:
                self._error = exc
                raise
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]


class AllToAll(ABC):
    """Base of every communication backend (one file each under ``epmoe/comm``).

    Subclasses set ``name`` and ``capabilities`` and implement ``dispatch_async`` and
    ``combine_async``. ``unavailable_reason`` says, without side effects, why the backend
    cannot run for a device and group; ``supports`` why it cannot serve a spec (``None``
    when it can). Buffers are allocated in ``__init__`` (or shared through
    ``epmoe.comm.transport``) and released by ``close`` (never in ``__del__``).
    """

    name: str = ""
    capabilities: Capabilities
    # Who makes the next dispatch, as the same nonzero int on every rank (``EPMoE`` sets
    # :func:`layer_call_tag` of its layer index before each of its dispatches; 0:
    # untagged). The backends whose count exchange reaches the host carry it with the
    # counts and raise on every rank when the ranks' tags differ (see
    # :func:`call_tag_error`): ranks in different layers' dispatches, whose collectives
    # would otherwise pair up. symm_ll and symm_ht send it in their count word and report a
    # mismatch from the device (their error word, raised at the next call).
    call_tag: int = 0

    def __init__(
        self, spec: CommSpec, group: dist.ProcessGroup | None, layout: Layout | None = None
    ) -> None:
        self.spec = spec
        self.group = group
        self.rank = dist.get_rank(group) if _is_distributed(group) else 0
        self.world_size = dist.get_world_size(group) if _is_distributed(group) else 1
        if self.world_size != spec.world_size:
            raise ValueError(
                f"{self.name}: the placement is for {spec.world_size} ranks but the process "
                f"group has {self.world_size}; build the placement with ep_size={self.world_size}"
            )
        layouts = self.capabilities.layouts
        if layout is None:
            layout = Layout.STANDARD if Layout.STANDARD in layouts else next(iter(layouts))
        if layout not in layouts:
            raise ValueError(
                f"backend {self.name!r} does not produce layout {layout.value!r}; it offers "
                f"{sorted(x.value for x in layouts)}"
            )
        self.layout = layout
        reason = self.construction_reason(spec)
        if reason is not None:
            err = TypeError if spec.dtype not in self.capabilities.dtypes else ValueError
            raise err(f"backend {self.name!r} cannot serve this layer: {reason}")

    @classmethod
    def capabilities_with(cls, **options: Any) -> Capabilities:
        """The capabilities of an instance built with constructor ``options`` (the class's
        ``capabilities`` answer for the defaults; e.g. ``deepep_ht`` with
        ``worst_case_rows=True`` is graph safe). Pure."""
        return cls.capabilities

    @classmethod
    def supports(cls, spec: CommSpec) -> str | None:
        """Why this backend cannot serve ``spec`` (with the fix), or ``None``. Pure."""
        caps = cls.capabilities
        if spec.dtype not in caps.dtypes:
            return (
                f"it moves {sorted(str(d) for d in caps.dtypes)}, not {spec.dtype}; choose "
                "params_dtype among those"
            )
        if spec.device.type not in caps.device_types:
            return (
                f"it runs on {sorted(caps.device_types)}, not on {spec.device.type}; pick "
                "another backend or device"
            )
        if caps.max_num_tokens is not None and spec.max_num_tokens > caps.max_num_tokens:
            return (
                f"it takes at most {caps.max_num_tokens} tokens per rank per dispatch, "
                f"max_num_tokens={spec.max_num_tokens}; lower max_num_tokens (the layer "
                "chunks larger batches)"
            )
        if spec.fp8_dispatch and not caps.fp8_dispatch:
            return "it has no FP8 dispatch; leave dispatch_dtype unset"
        return None

    @classmethod
    def default_tokens(cls, device: torch.device) -> int | None:
        """The ``M_max`` a layer picks on ``device`` when the user sets none: the declared
        ``default_max_tokens`` (a backend whose limit depends on the GPU lowers it)."""
        return cls.capabilities.default_max_tokens

    @classmethod
    def unavailable_reason(
        cls, device: torch.device, group: dist.ProcessGroup | None = None
    ) -> str | None:
        """Why this backend cannot run here, or ``None``. Must not allocate or initialise.

        Subclasses that override it call this first: a device type the backend does not
        run on, or a CUDA device asked of a torch that has no usable CUDA, is refused here
        for every backend."""
        if device.type not in cls.capabilities.device_types:
            return f"needs a device of type {sorted(cls.capabilities.device_types)}"
        if device.type == "cuda" and not torch.cuda.is_available():
            built = "has no CUDA build" if torch.version.cuda is None else "sees no GPU"
            return f"CUDA is not available (torch {torch.__version__} {built})"
        return None

    @abstractmethod
    def dispatch_async(
        self,
        hidden_TH: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        topk_weights_TK: torch.Tensor,
    ) -> Pending[DispatchResult]:
        """Start sending each token to the ranks that hold its experts.

        ``hidden_TH`` ``[T, H]`` in ``spec.dtype``; ``topk_ids_TK`` int64 physical expert ids
        in ``[0, P)`` or ``-1`` (no expert); ``topk_weights_TK`` float32 router weights.
        ``T <= spec.max_num_tokens`` where the backend has fixed buffers. Collective: every
        rank starts it, and finishes it with ``wait()``.

        Ids outside ``[-1, P)`` are refused, never dropped: the portable backends raise
        the same ``ValueError`` on every rank of the group in that call (the check rides
        with their count exchange, see :func:`ids_out_of_range`); the graph-safe ones
        report them from the device at the next call or ``check()``.

        The inputs must stay unchanged until ``wait()``; after it the caller may refill
        them (the next micro-batch's): every backend keeps what its combine needs.
        """

    @abstractmethod
    def combine_async(
        self, expert_out: torch.Tensor, result: DispatchResult
    ) -> Pending[torch.Tensor]:
        """Start bringing expert outputs back; ``wait()`` returns ``[T, H]`` in
        ``spec.dtype`` on the rank that dispatched.

        ``expert_out`` has the layout of ``result`` (``[R, H]`` weighted partial sums for
        Standard, ``[e, C, H]`` unweighted for ExpertBatched). Collective. Leave
        ``expert_out`` unchanged until ``wait()``: a backend may read part of it only then.
        """

    def dispatch(
        self,
        hidden_TH: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        topk_weights_TK: torch.Tensor,
    ) -> DispatchResult:
        """``dispatch_async(...).wait()``: the blocking path."""
        return self.dispatch_async(hidden_TH, topk_ids_TK, topk_weights_TK).wait()

    def combine(self, expert_out: torch.Tensor, result: DispatchResult) -> torch.Tensor:
        """``combine_async(...).wait()``: the blocking path."""
        return self.combine_async(expert_out, result).wait()

    def rebind(self, rank_offsets: tuple[int, ...]) -> None:
        """Serve another placement with the same ranks (an EPLB re-plan): same spec but for
        ``rank_offsets``. Call between forwards, with no dispatch result held. Backends with
        derived state refresh it in ``_bind``; buffers are kept when they still fit."""
        spec = self.spec.with_offsets(rank_offsets)
        if spec.world_size != self.world_size:
            raise ValueError(
                f"rebind keeps the ranks: rank_offsets must have {self.world_size + 1} entries, "
                f"got {len(spec.rank_offsets)}"
            )
        reason = self.rebind_reason(spec)
        if reason is not None:
            raise ValueError(f"backend {self.name!r} cannot serve the new placement: {reason}")
        old, self.spec = self.spec, spec
        try:
            self._bind()
        except BaseException:
            self.spec = old
            raise

    def construction_reason(self, spec: CommSpec) -> str | None:
        """Why this backend, with the options it was built with (set before
        ``AllToAll.__init__``), cannot serve ``spec``, or ``None``. Default: ``supports``
        (which knows only the defaults)."""
        return self.supports(spec)

    def rebind_reason(self, spec: CommSpec) -> str | None:
        """Why this backend (its buffers as allocated) cannot be rebound to ``spec``, or
        ``None``; checked before a re-plan moves any weight. Default: ``supports``."""
        return self.supports(spec)

    def _bind(self) -> None:  # noqa: B027 (an optional hook, not abstract)
        """Derive per-placement state from ``self.spec`` (called by ``rebind``)."""

    def close(self) -> None:  # noqa: B027 (an optional hook, not abstract)
        """Release buffers. The backend must not be used afterwards."""


def wire_row_bytes(hidden_size: int, wire_dtype: torch.dtype) -> int:
    """Bytes of one dispatched row on the wire: ``H`` values, plus for FP8 one float32
    scale per 128 columns (7168 → 14336 B in bf16, 7392 B in FP8)."""
    if wire_dtype == FP8_DTYPE:
        return hidden_size + 4 * -(-hidden_size // FP8_GROUP)
    return hidden_size * wire_dtype.itemsize


def expert_batched_bytes(spec: CommSpec, copies: int = 1, outputs: int = 0) -> int:
    """Bytes of ``copies`` ExpertBatched receive buffers ``[e, C = W·M, H]`` (wire dtype, and
    FP8 scales ``[e, C, G]`` float32) and ``outputs`` buffers of the experts' outputs of that
    shape (in the hidden dtype): each local expert's slot holds every token of every
    rank, the worst case of routing, so they grow with ``e·W·M_max``."""
    row = wire_row_bytes(spec.hidden_size, spec.wire_dtype)
    out_row = spec.hidden_size * spec.dtype.itemsize
    slots = max(spec.max_local, 1) * spec.world_size * spec.max_num_tokens
    return slots * (copies * row + outputs * out_row)


def expert_batched_memory_reason(
    name: str, spec: CommSpec, copies: int = 1, outputs: int = 0, extra_bytes: int = 0
) -> str | None:
    """Why ``copies`` ExpertBatched buffers of received rows (wire dtype) and ``outputs``
    of the experts' outputs (hidden dtype) for ``spec``, plus ``extra_bytes`` (e.g. a
    symmetric buffer), do not fit on its GPU (more than a quarter of its memory, leaving
    the rest to weights), with the fix; ``None`` when they fit or the device is not a CUDA
    GPU."""
    what = (
        f"{name}'s ExpertBatched buffers [{copies + outputs}, e={spec.max_local}, "
        f"W·M={spec.world_size}·{spec.max_num_tokens}, H={spec.hidden_size}]"
    )
    nbytes = expert_batched_bytes(spec, copies, outputs) + extra_bytes
    return gpu_memory_reason(
        what, spec, nbytes, "or use a Standard-layout backend (symm_ht) for prefill"
    )


def gpu_memory_reason(what: str, spec: CommSpec, nbytes: int, hint: str = "") -> str | None:
    """Why ``nbytes`` of buffers (``what``) do not fit on ``spec``'s GPU (more than a
    quarter of its memory), with the fix; ``None`` when they fit or it is not a GPU. Every
    rank of a layer judges the same spec alike: a refusal, never one rank failing to
    allocate while the others wait for it."""
    if spec.device.type != "cuda" or not torch.cuda.is_available():
        return None
    gib = nbytes / 2**30
    have = torch.cuda.get_device_properties(spec.device).total_memory / 2**30
    if gib <= have / 4:
        return None
    return (
        f"{what} take {gib:.1f} GiB of the GPU's {have:.0f} GiB; lower max_num_tokens (the "
        f"layer chunks larger batches){' ' + hint if hint else ''}"
    )


def one_nvlink_node_reason(
    group: dist.ProcessGroup | None, ranks_may_share_gpus: bool = False
) -> str | None:
    """Why ``group`` cannot serve a backend that needs CUDA and its ranks on one node
    (NVLink peers), or ``None``: the group must be NCCL, or, for a backend that runs ranks
    sharing a GPU (``ranks_may_share_gpus``: the symm backends, which then exchange CUDA
    IPC handles), a group that moves CUDA tensors with gloo (``"cpu:gloo,cuda:gloo"``, as
    ``tests.harness`` makes). Without torch.distributed: only CUDA is checked."""
    if not torch.cuda.is_available():
        return "needs CUDA"
    if _is_distributed(group):
        backend = str(dist.get_backend(group))
        if "nccl" not in backend and not (ranks_may_share_gpus and "cuda:gloo" in backend):
            if "cuda:gloo" in backend:
                return (
                    "needs an NCCL process group (on a gloo group for CUDA tensors, ranks "
                    "that share a GPU, only symm_ll and symm_ht run)"
                )
            return "needs an NCCL process group"
        W = dist.get_world_size(group)
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local is not None and int(local) < W:
            return f"needs all {W} ranks on one node (NVLink peers); LOCAL_WORLD_SIZE={local}"
    return None


def _is_distributed(group: dist.ProcessGroup | None) -> bool:
    return dist.is_available() and dist.is_initialized()


def check_dispatch_args(
    spec: CommSpec,
    hidden_TH: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    limit_tokens: bool,
) -> None:
    """Validate dispatch inputs at the boundary, with the fix in the message.

    Host-side checks only (types, shapes, dtypes; no device synchronisation), so graph-safe
    backends call it too. The range of the ids is a device value: see :func:`ids_out_of_range`.
    """
    # (an eager decode step waits for this host time: each attribute is read once)
    Tensor = torch.Tensor
    if not (
        isinstance(hidden_TH, Tensor)
        and isinstance(topk_ids_TK, Tensor)
        and isinstance(topk_weights_TK, Tensor)
    ):
        check_tensor("hidden_states", hidden_TH)
        check_tensor("topk_ids", topk_ids_TK)
        check_tensor("topk_weights", topk_weights_TK)
    shape = hidden_TH.shape
    if len(shape) != 2 or shape[1] != spec.hidden_size:
        raise ValueError(f"hidden_states must be [T, {spec.hidden_size}], got {tuple(shape)}")
    T, K = shape[0], spec.top_k
    if topk_ids_TK.shape != (T, K) or topk_weights_TK.shape != (T, K):
        raise ValueError(
            f"topk_ids and topk_weights must be [T={T}, K={spec.top_k}], got "
            f"{tuple(topk_ids_TK.shape)} and {tuple(topk_weights_TK.shape)}"
        )
    if topk_ids_TK.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids_TK.dtype}")
    if not topk_weights_TK.is_floating_point():
        raise TypeError(
            f"topk_weights must be floating point (router weights), got {topk_weights_TK.dtype}"
        )
    if hidden_TH.dtype != spec.dtype:
        raise TypeError(
            f"hidden_states dtype {hidden_TH.dtype} differs from the layer's {spec.dtype}; "
            "cast the input or build the layer with params_dtype to match"
        )
    if limit_tokens and spec.max_num_tokens < T:
        raise ValueError(
            f"{T} tokens exceed max_num_tokens={spec.max_num_tokens} of this backend's fixed "
            "buffers; raise max_num_tokens or let EPMoE chunk the batch"
        )


def check_tensor(name: str, value: object) -> torch.Tensor:
    """``value`` if it is a ``torch.Tensor``, else a ``TypeError`` naming the argument (a
    list or ``None`` would otherwise fail later as ``'list' object has no attribute …``)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_combine_args(expert_out: torch.Tensor, result: DispatchResult) -> None:
    """Validate combine inputs: ``result`` is a :class:`DispatchResult` and ``expert_out`` a
    floating tensor of its dispatched shape."""
    if not isinstance(result, DispatchResult):
        raise TypeError(
            f"result must be the DispatchResult of this backend's dispatch, got "
            f"{type(result).__name__}"
        )
    check_tensor("expert_out", expert_out)
    if tuple(expert_out.shape) != result.out_shape or not expert_out.is_floating_point():
        raise ValueError(
            f"expert_out must be a floating tensor of the dispatched shape "
            f"{result.out_shape}, got {expert_out.dtype} {tuple(expert_out.shape)}"
        )


def ids_out_of_range(topk_ids_TK: torch.Tensor, num_physical: int) -> torch.Tensor:
    """0-d int64 on the ids' device: 1 if any id lies outside ``[-1, P)``, else 0.

    No host synchronisation: the portable backends send this flag with their count
    exchange (which the host reads anyway), so every rank learns that one rank's ids are
    bad in the same dispatch and all raise :func:`ids_error` before any row moves. The
    graph-safe backends check the ids inside their kernels instead (``symm_ll`` reports
    them through its error word).
    """
    if topk_ids_TK.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=topk_ids_TK.device)
    bad = (topk_ids_TK < -1) | (topk_ids_TK >= num_physical)
    return bad.any().to(torch.int64)


def ids_error(
    backend: str,
    topk_ids_TK: torch.Tensor,
    num_physical: int,
    bad_ranks: list[int],
    rank: int,
) -> ValueError:
    """The error every rank raises when the ids of ``bad_ranks`` lie outside ``[-1, P)``
    (found by :func:`ids_out_of_range`, agreed in the count exchange)."""
    P = num_physical
    mine = ""
    if rank in bad_ranks:  # this rank raises anyway: reading its ids back costs nothing
        lo, hi = int(topk_ids_TK.min()), int(topk_ids_TK.max())
        mine = f" (this rank's ids lie in [{lo}, {hi}])"
    return ValueError(
        f"{backend} dispatch: topk_ids on rank(s) {bad_ranks} hold ids outside [-1, P={P})"
        f"{mine}; pass physical expert ids in [0, {P}) (ExpertPlacement.to_physical maps "
        "logical ids) or -1 for no expert. Nothing was sent: every rank of the group raises "
        "this error in the same dispatch"
    )


COPY_INDEX = 1 << 62  # layer indices from here on are copies' (LayerAgreement.fork)


def layer_call_tag(layer_index: int) -> int:
    """The ``call_tag`` of a layer's dispatches: its index + 1 (0 stays "untagged"), a
    copy's index as it is (nonzero already, and + 1 could overflow int64)."""
    return layer_index + 1 if layer_index < COPY_INDEX else layer_index


def _layer_index(call_tag: int) -> int:
    """The layer index of a nonzero :func:`layer_call_tag`."""
    return call_tag - 1 if call_tag < COPY_INDEX else call_tag


def ranks_by_value(values: list) -> dict:
    """value → the ranks holding it, in order of first appearance."""
    out: dict = {}
    for rank, value in enumerate(values):
        out.setdefault(value, []).append(rank)
    return out


def ranks_phrase(ranks: list[int], verb: str = "are") -> str:
    """``"ranks [0, 2] are"`` / ``"rank 1 is"`` (verb given in its plural form)."""
    singular = {"are": "is", "have": "has"}.get(verb, verb)
    if len(ranks) == 1:
        return f"rank {ranks[0]} {singular}"
    return f"ranks {ranks} {verb}"


def call_tag_error(backend: str, tags_W: list[int]) -> RuntimeError | None:
    """The error every rank raises when the ranks' ``call_tag`` differ in one dispatch
    (gathered with the counts), else ``None``."""
    if len(set(tags_W)) <= 1:
        return None
    where = "; ".join(
        f"{ranks_phrase(ranks, 'in')} "
        + (f"layer #{_layer_index(tag)}'s" if tag > 0 else "an untagged")
        + " dispatch"
        for tag, ranks in ranks_by_value(tags_W).items()
    )
    return RuntimeError(
        f"{backend} dispatch: the EP ranks are in different MoE layers' dispatches ({where}): "
        "a rank skipped a layer or called an extra one inside the step. Every rank must call "
        "the step's layers (also with T = 0) in the same order. Nothing was sent: every rank "
        "raises in this dispatch"
    )
