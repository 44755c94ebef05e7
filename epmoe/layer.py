"""``EPMoE``: one expert-parallel MoE layer, route → place → dispatch → experts → combine.

Shape legend: T tokens on this rank · H hidden · I intermediate · E logical experts ·
P physical experts · e local experts · K top-k · W EP world size · M_max tokens per chunk.

Graph-safe forward: with ``max_tokens_across_ranks`` given (the step's token bound, agreed
by the caller for every layer), the layer's own part of ``forward`` does no host
synchronisation and changes no Python state per call, so a CUDA graph can capture it with a
graph-safe backend (``Capabilities.graph_safe``) and experts (Triton, ExpertBatched).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from epmoe.comm import (
    available_backends,
    backend_class,
    backend_names,
    create_backend,
    resolve_backend,
)
from epmoe.comm._collectives import agree_max, world_of
from epmoe.comm.base import FP8_DTYPE, AllToAll, CommSpec, DispatchResult, Layout
from epmoe.distributed import default_device, normalize_device
from epmoe.eplb.recorder import LoadRecorder
from epmoe.experts import ExpertWeights, create_experts
from epmoe.experts.base import check_activation
from epmoe.placement import ExpertPlacement
from epmoe.routing import select_experts

# Tokens per dispatch when max_num_tokens is None and the backend sets no limit of its
# own: transports without fixed buffers still chunk so that a prefill of any length runs
# in bounded memory. ExpertBatched is the decode layout; its [e, C, H] buffer grows with
# the busiest expert, so it chunks sooner.
DEFAULT_CHUNK_TOKENS = {Layout.STANDARD: 8192, Layout.EXPERT_BATCHED: 1024}

# Per-slot tensors that follow the placement (``[e, ...]`` each, slot order), in migration
# order; the scales exist only for FP8 weights.
SLOT_TENSORS = ("w13", "w2", "w13_scale", "w2_scale")


class EPMoE(nn.Module):
    """An expert-parallel MoE layer; a drop-in for the routed experts of an MoE block.

    Every rank of ``group`` holds the experts that ``placement`` gives it (``w13 [e, 2I, H]``,
    ``w2 [e, H, I]``) and calls ``forward`` with its own tokens; all ranks must call
    ``forward`` the same number of times (with ``T = 0`` when they have no tokens).
    ``forward(hidden_states [T, H], router_logits [T, E]) -> [T, H]`` returns
    ``Σ_k w[t, k] · expert_{ids[t, k]}(x[t])`` (plus ``shared_experts(x)`` if given).

    Weights start unset: call ``load_experts(w13, w2)`` with the full logical weights (each
    rank keeps its shard), or ``load_expert(expert_id, w13_e, w2_e)`` expert by expert.

    Keyword-only options:
        layout: ``"standard"`` or ``"expert_batched"`` (``None``: the backend's first).
        shared_experts: a module applied to the input and added to the output; it runs
            while the first dispatch is in flight.
        prefer_local_replica: use a replica on this rank when it holds one.
        load_window: record tokens per physical expert over this many forwards (EPLB).
        dispatch_dtype: ``None`` (rows travel in ``params_dtype``) or
            ``torch.float8_e4m3fn``: rows travel as FP8 with float32 scales per 128
            columns, the experts consume the scales, combine stays in ``params_dtype``.
            Needs a backend with ``Capabilities.fp8_dispatch``.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        group: dist.ProcessGroup | None = None,
        placement: str | ExpertPlacement = "linear",
        backend: str = "auto",
        experts: str = "auto",
        activation: str = "silu",
        renormalize: bool = True,
        scoring_func: str = "softmax",
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        e_score_correction_bias: torch.Tensor | None = None,
        routed_scaling_factor: float = 1.0,
        apply_router_weight_on_input: bool = False,
        max_num_tokens: int | None = None,
        params_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        *,
        layout: Layout | str | None = None,
        shared_experts: nn.Module | None = None,
        prefer_local_replica: bool = False,
        load_window: int | None = None,
        dispatch_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in [
            ("num_experts", num_experts),
            ("top_k", top_k),
            ("hidden_size", hidden_size),
            ("intermediate_size", intermediate_size),
        ]:
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if top_k > num_experts:
            raise ValueError(f"top_k={top_k} exceeds num_experts={num_experts}")
        if apply_router_weight_on_input and top_k != 1:
            raise ValueError(
                "apply_router_weight_on_input=True scales the input by the router weight, "
                f"which is only defined for top_k=1 (got top_k={top_k}); set it to False"
            )
        if max_num_tokens is not None and (
            not isinstance(max_num_tokens, int) or max_num_tokens <= 0
        ):
            raise ValueError(
                f"max_num_tokens must be a positive int or None, got {max_num_tokens!r}"
            )
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.activation = check_activation(activation)
        self.routing = dict(
            renormalize=renormalize,
            scoring_func=scoring_func,
            num_expert_group=num_expert_group,
            topk_group=topk_group,
            routed_scaling_factor=routed_scaling_factor,
        )
        self.apply_router_weight_on_input = apply_router_weight_on_input
        self.params_dtype = params_dtype
        self.prefer_local_replica = prefer_local_replica
        self.shared_experts = shared_experts

        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        self.group = group
        self.rank, self.ep_size = world_of(group)
        self.device = normalize_device(device) if device is not None else default_device(group)

        if isinstance(placement, str):
            builders = {
                "linear": ExpertPlacement.linear,
                "round_robin": ExpertPlacement.round_robin,
            }
            if placement not in builders:
                raise ValueError(
                    f"placement must be 'linear', 'round_robin' or an ExpertPlacement, got "
                    f"{placement!r} (build balanced ones with ExpertPlacement.balanced)"
                )
            placement = builders[placement](num_experts, self.ep_size)
        self._check_placement_shape(placement)
        self.placement = placement
        # build the device maps now, so no forward (or graph capture) copies them over
        placement.maps_on(self.device)

        if isinstance(layout, str):
            choices = [x.value for x in Layout]
            if layout not in choices:
                raise ValueError(f"layout must be one of {choices} or None, got {layout!r}")
            layout = Layout(layout)
        _check_group_device(group, self.device)
        self.comm = self._create_comm(backend, layout, max_num_tokens, dispatch_dtype)
        # backend="auto" with a graph-safe fixed-buffer backend at hand (symm_ll on one
        # NVLink node): steps whose largest T fits its buffers (decode) go there, larger
        # ones (prefill) to self.comm
        self.decode_comm: AllToAll | None = None
        self.decode_max_tokens = 0
        if backend == "auto":
            self._create_decode_comm(layout, max_num_tokens, dispatch_dtype)
        self.experts = create_experts(experts, activation, self.device)

        e = placement.num_local(self.rank)
        factory = dict(dtype=params_dtype, device=self.device)
        self.w13 = nn.Parameter(
            torch.empty(e, 2 * intermediate_size, hidden_size, **factory), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(e, hidden_size, intermediate_size, **factory), requires_grad=False
        )
        if e_score_correction_bias is not None:
            if e_score_correction_bias.shape != (num_experts,):
                raise ValueError(
                    f"e_score_correction_bias must be [E={num_experts}], got "
                    f"{tuple(e_score_correction_bias.shape)}"
                )
            e_score_correction_bias = e_score_correction_bias.to(self.device, torch.float32)
        self.register_buffer("e_score_correction_bias", e_score_correction_bias)
        # check the routing options now rather than at the first forward (T = 0 is cheap)
        select_experts(
            torch.empty(0, num_experts, device=self.device),
            top_k,
            e_score_correction_bias=e_score_correction_bias,
            **self.routing,
        )
        self._loaded = [False] * e  # per local slot; host bookkeeping, never on the device
        # EPLB: tokens per physical expert over the last `load_window` forwards (device-side)
        self.load_recorder = (
            LoadRecorder(placement.num_physical, load_window, self.device)
            if load_window is not None
            else None
        )

    # ---------------------------------------------------------------- backend
    def _create_comm(
        self,
        backend: str,
        layout: Layout | None,
        max_num_tokens: int | None,
        dispatch_dtype: torch.dtype | None,
    ) -> AllToAll:
        """Choose the backend, size the chunks (``self.max_num_tokens``, M_max) and build the
        backend for this layer's :class:`CommSpec` (collective when the backend allocates
        shared buffers). FP8 dispatch that the backend cannot serve raises ``ValueError``
        naming ``dispatch_dtype`` and the backends that offer it."""
        if backend == "auto":
            backend_cls = self._auto_classes(layout, dispatch_dtype)[0]
        else:
            backend_cls = resolve_backend(backend, self.device, self.group, layout)
        if layout is None:
            layouts = backend_cls.capabilities.layouts
            layout = Layout.STANDARD if Layout.STANDARD in layouts else next(iter(layouts))
        self.max_num_tokens = (
            max_num_tokens
            or backend_cls.capabilities.max_num_tokens
            or DEFAULT_CHUNK_TOKENS[layout]
        )
        spec = CommSpec(
            hidden_size=self.hidden_size,
            top_k=self.top_k,
            rank_offsets=self.placement.rank_offsets,
            max_num_tokens=self.max_num_tokens,
            dtype=self.params_dtype,
            device=self.device,
            dispatch_dtype=dispatch_dtype,
        )
        if backend == "auto" and backend_cls.supports(spec) is not None:
            # the first backend that runs here cannot serve this spec: choose with it; when
            # none can, the first one's constructor (or the FP8 check) says why, with the fix
            with contextlib.suppress(RuntimeError):
                backend_cls = resolve_backend("auto", self.device, self.group, layout, spec)
        if spec.fp8_dispatch and not backend_cls.capabilities.fp8_dispatch:
            raise _no_fp8_dispatch(backend_cls.name)
        return backend_cls(spec, self.group, layout)

    def _auto_classes(
        self, layout: Layout | None, dispatch_dtype: torch.dtype | None
    ) -> tuple[type[AllToAll], type[AllToAll] | None]:
        """``auto``'s choice: the first backend (registry order) that runs here, offers
        ``layout`` and sizes its buffers per call (any batch), and the first graph-safe one
        with fixed buffers (decode), or ``None``. Their preference order is the registry's."""
        probe = CommSpec(
            hidden_size=self.hidden_size,
            top_k=self.top_k,
            rank_offsets=self.placement.rank_offsets,
            max_num_tokens=1,
            dtype=self.params_dtype,
            device=self.device,
            dispatch_dtype=dispatch_dtype,
        )
        usable = []
        for name, why in available_backends(self.device, self.group, probe).items():
            if why is None:
                cls = backend_class(name)
                if layout is None or layout in cls.capabilities.layouts:
                    usable.append(cls)
        general = [c for c in usable if c.capabilities.default_max_tokens is None]
        if not general:
            # none can serve this layer: the first that runs here builds it, and its
            # constructor (or the FP8 check) raises the specific error, with the fix
            runs = [
                backend_class(n)
                for n, why in available_backends(self.device, self.group).items()
                if why is None
            ]
            if not runs:  # nothing runs here at all: the error lists every reason
                return resolve_backend("auto", self.device, self.group, layout), None
            unbounded = [c for c in runs if c.capabilities.default_max_tokens is None]
            return (unbounded or runs)[0], None
        decode = [
            c for c in usable if c.capabilities.graph_safe and c.capabilities.default_max_tokens
        ]
        return general[0], (decode[0] if decode else None)

    def _create_decode_comm(
        self,
        layout: Layout | None,
        max_num_tokens: int | None,
        dispatch_dtype: torch.dtype | None,
    ) -> None:
        """Build ``self.decode_comm`` when ``auto`` found a graph-safe fixed-buffer backend
        (see ``__init__``); its M_max is ``max_num_tokens`` or the backend's default."""
        decode_cls = self._auto_classes(layout, dispatch_dtype)[1]
        if decode_cls is None or decode_cls is type(self.comm):
            return
        caps = decode_cls.capabilities
        M = min(max_num_tokens or caps.default_max_tokens, caps.max_num_tokens or 1 << 62)
        spec = self.comm.spec.with_offsets(self.placement.rank_offsets)
        spec = dataclasses.replace(spec, max_num_tokens=M)
        if decode_cls.supports(spec) is not None:
            return
        dlayout = layout or next(iter(caps.layouts))
        self.decode_comm = decode_cls(spec, self.group, dlayout)
        self.decode_max_tokens = M

    def _comm_for(self, max_tokens: int) -> tuple[AllToAll, int]:
        """The backend of a step whose largest T over the group is ``max_tokens``, with its
        chunk size: the decode backend when the step fits its buffers, else ``self.comm``.
        Every rank passes the same ``max_tokens``, so every rank picks the same."""
        if self.decode_comm is not None and max_tokens <= self.decode_max_tokens:
            return self.decode_comm, self.decode_max_tokens
        if not self.comm.capabilities.graph_safe and _capturing(self.device):
            fits = (
                f"; steps of at most {self.decode_max_tokens} tokens per rank use the "
                f"graph-safe {self.decode_comm.name!r}"
                if self.decode_comm is not None
                else "; build the layer with a graph-safe backend (e.g. backend='symm_ll')"
            )
            raise RuntimeError(
                f"a CUDA graph is being captured but backend {self.comm.name!r} is not graph "
                f"safe (max_tokens_across_ranks={max_tokens}){fits}"
            )
        return self.comm, self.max_num_tokens

    def _rebind_comm(self, rank_offsets: tuple[int, ...]) -> None:
        """Move the backend to a placement with other ``rank_offsets``, keeping it (and its
        buffers) when it can: ``rebind``; a backend that refuses (its fixed buffers are too
        small for the new largest e, or it cannot rebind) is closed and replaced by a fresh
        one of the same name and layout (collective, like its first construction: every
        rank takes the same branch, since all hold the same placement)."""
        self.comm = _rebound(self.comm, rank_offsets, self.group)
        if self.decode_comm is not None:
            self.decode_comm = _rebound(self.decode_comm, rank_offsets, self.group)

    @property
    def dispatch_dtype(self) -> torch.dtype | None:
        """The dtype rows travel in (``None``: ``params_dtype``; or ``torch.float8_e4m3fn``)."""
        return self.comm.spec.dispatch_dtype

    # ---------------------------------------------------------------- placement and weights
    def _check_placement_shape(self, placement: ExpertPlacement) -> None:
        if not isinstance(placement, ExpertPlacement):
            raise TypeError(
                f"placement must be an ExpertPlacement, got {type(placement).__name__}; build "
                "one with ExpertPlacement.linear / round_robin / balanced"
            )
        if placement.num_experts != self.num_experts:
            raise ValueError(
                f"placement has {placement.num_experts} experts, the layer {self.num_experts}; "
                f"build it with num_experts={self.num_experts}"
            )
        if placement.ep_size != self.ep_size:
            raise ValueError(
                f"placement is for ep_size={placement.ep_size} but the group has "
                f"{self.ep_size} ranks; build it with ep_size={self.ep_size}"
            )

    def check_placement(self, placement: ExpertPlacement) -> None:
        """Raise (``TypeError`` / ``ValueError``, with the fix) if this layer cannot switch to
        ``placement``: another E or W, or a slot layout its backend cannot serve. Pure: a
        re-plan calls it on every rank before any weight moves."""
        self._check_placement_shape(placement)
        for comm in (self.comm, self.decode_comm):
            if comm is None:
                continue
            reason = comm.supports(comm.spec.with_offsets(placement.rank_offsets))
            if reason is not None:
                raise ValueError(f"backend {comm.name!r} cannot serve the new placement: {reason}")

    @property
    def weights_loaded(self) -> bool:
        """Whether every local slot has its weights (``load_experts`` / ``load_expert``)."""
        return all(self._loaded)

    def slot_tensors(self) -> dict[str, torch.Tensor]:
        """The per-slot tensors that follow the placement, by attribute name, each
        ``[e, *X]`` in slot order: ``w13``, ``w2`` and, for FP8 weights, their scales. An
        EPLB re-plan migrates exactly these."""
        out = {}
        for name in SLOT_TENSORS:
            t = getattr(self, name, None)
            if t is not None:
                out[name] = t
        return out

    @torch.no_grad()
    def _swap_placement(
        self, placement: ExpertPlacement, slot_tensors: Mapping[str, torch.Tensor]
    ) -> None:
        """Install ``placement`` with its already migrated per-slot tensors. Called by
        :func:`epmoe.eplb.migration.rebalance_layer` on every rank, between forwards, with
        no dispatch result held (use :meth:`rebalance`, which moves the weights first).

        ``slot_tensors``: every name of :meth:`slot_tensors` → ``[e_new, *X]`` tensor of the
        same dtype and device; passing the current tensor keeps it (in-place migration).
        Installed in this order: the backend (:meth:`AllToAll.rebind` to the new
        ``rank_offsets``, else a fresh backend; the only collective step), the weights (new
        ``nn.Parameter(requires_grad=False)`` where the tensor changed, the old ones freed),
        the placement and its device maps, the loaded mask, and the load recorder (reset
        for the new P). A CUDA graph captured before must be captured again.
        """
        self._check_placement_shape(placement)
        e_new = placement.num_local(self.rank)
        current = self.slot_tensors()
        if set(slot_tensors) != set(current):
            raise ValueError(
                f"slot_tensors must hold {sorted(current)} (the layer's slot_tensors()), got "
                f"{sorted(slot_tensors)}"
            )
        for name, new in slot_tensors.items():
            old = current[name]
            want = (e_new, *old.shape[1:])
            if tuple(new.shape) != want or new.dtype != old.dtype or new.device != old.device:
                raise ValueError(
                    f"slot_tensors[{name!r}] must be {list(want)} {old.dtype} on {old.device} "
                    f"(e_new={e_new} slots of the new placement), got {list(new.shape)} "
                    f"{new.dtype} on {new.device}"
                )
        if placement.rank_offsets != self.placement.rank_offsets:
            self._rebind_comm(placement.rank_offsets)
        for name, new in slot_tensors.items():
            if new is not current[name]:
                if isinstance(current[name], nn.Parameter):
                    new = nn.Parameter(new, requires_grad=False)
                setattr(self, name, new)
        self.placement = placement
        placement.maps_on(self.device)  # device maps built before the next forward
        self._loaded = [True] * e_new
        if self.load_recorder is not None:
            self.load_recorder.reset(placement.num_physical)

    @property
    def local_experts(self) -> list[int]:
        """Logical id of each local slot, in slot order."""
        return self.placement.local_experts(self.rank)

    @torch.no_grad()
    def load_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Take the full logical weights (``w13 [E, 2I, H]``, ``w2 [E, H, I]``, on any
        device) and keep this rank's shard, replicas included. Not collective."""
        E, I, H = self.num_experts, self.intermediate_size, self.hidden_size
        if tuple(w13.shape) != (E, 2 * I, H) or tuple(w2.shape) != (E, H, I):
            raise ValueError(
                f"load_experts wants w13 [E, 2I, H] = {[E, 2 * I, H]} and w2 [E, H, I] = "
                f"{[E, H, I]}, got {list(w13.shape)} and {list(w2.shape)}"
            )
        local = torch.tensor(self.local_experts, dtype=torch.int64, device=w13.device)
        self.w13.copy_(w13[local])
        self.w2.copy_(w2[local])
        self._loaded = [True] * len(self._loaded)

    @torch.no_grad()
    def load_expert(self, expert_id: int, w13_e: torch.Tensor, w2_e: torch.Tensor) -> bool:
        """Load one logical expert (``w13_e [2I, H]``, ``w2_e [H, I]``) into every local slot
        that holds it; returns whether this rank holds it. For checkpoints stored per expert."""
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert_id must be in [0, {self.num_experts}), got {expert_id}")
        if tuple(w13_e.shape) != tuple(self.w13.shape[1:]) or tuple(w2_e.shape) != tuple(
            self.w2.shape[1:]
        ):
            raise ValueError(
                f"load_expert wants w13_e {list(self.w13.shape[1:])} and w2_e "
                f"{list(self.w2.shape[1:])}, got {list(w13_e.shape)} and {list(w2_e.shape)}"
            )
        slots = [s for s, x in enumerate(self.local_experts) if x == expert_id]
        for s in slots:
            self.w13[s].copy_(w13_e)
            self.w2[s].copy_(w2_e)
            self._loaded[s] = True
        return bool(slots)

    def rebalance(self, placement: ExpertPlacement):
        """Switch to ``placement`` while serving (an EPLB re-plan): move only the expert
        weights whose slots change (point-to-point between ranks), then install the new
        placement, weights and backend binding (see :meth:`_swap_placement`). Collective
        over the EP group; outputs before and after are the same. Returns this rank's
        :class:`~epmoe.eplb.migration.MigrationStats`."""
        from epmoe.eplb.migration import rebalance_layer

        return rebalance_layer(self, placement)

    def expert_weights(self) -> ExpertWeights:
        return ExpertWeights(self.w13, self.w2)

    # ------------------------------------------------------------------ forward
    def route(self, router_logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router weights ``[T, K]`` float32 and *physical* expert ids ``[T, K]`` int64.
        On the device, no host synchronisation."""
        weights_TK, logical_TK = select_experts(
            router_logits_TE,
            self.top_k,
            e_score_correction_bias=self.e_score_correction_bias,
            **self.routing,
        )
        physical_TK = self.placement.to_physical(
            logical_TK, rank=self.rank, prefer_local=self.prefer_local_replica
        )
        return weights_TK, physical_TK

    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        *,
        max_tokens_across_ranks: int | None = None,
    ) -> torch.Tensor:
        """``hidden_states [T, H]``, ``router_logits [T, E]`` → ``[T, H]`` in the input dtype.

        Collective over the EP group: every rank calls it, also with ``T = 0``, and runs
        the same number of chunks of at most ``max_num_tokens`` tokens (one dispatch and
        combine each). Without ``max_tokens_across_ranks`` the ranks agree on that number
        (and on whether every rank's inputs are valid, so that bad input raises on all
        ranks instead of leaving some inside a collective) with one small all-reduce, whose
        result the host reads.

        ``max_tokens_across_ranks``: the largest ``T`` of any rank in the EP group this step
        (as a DP coordinator knows it; the same value on every rank). It replaces that
        all-reduce, and the layer's own part of the forward then does no host
        synchronisation and changes no Python state (CUDA-graph capturable with a
        graph-safe backend and experts). The caller guarantees every rank's input is valid,
        and ``router_logits`` must be on the layer's device.
        """
        max_T = self._step_tokens(hidden_states, router_logits, max_tokens_across_ranks)
        comm, M = self._comm_for(max_T)
        num_chunks = max(math.ceil(max_T / M), 1)
        T = hidden_states.shape[0]

        # route → place (device only; the recorder counts into its device-side ring)
        x_TH = hidden_states.to(self.params_dtype)
        weights_TK, ids_TK = self.route(router_logits.to(self.device))
        if self.load_recorder is not None:
            self.load_recorder.record(ids_TK)
        if self.apply_router_weight_on_input:
            x_TH = (x_TH.float() * weights_TK).to(self.params_dtype)
            weights_TK = torch.ones_like(weights_TK)

        # dispatch → experts → combine, chunk by chunk (one dispatch held at a time, within
        # any backend's max_in_flight); the shared experts run while the first is in flight
        outs, shared_TH = [], None
        for c in range(num_chunks):
            lo, hi = min(c * M, T), min((c + 1) * M, T)
            pending = comm.dispatch_async(x_TH[lo:hi], ids_TK[lo:hi], weights_TK[lo:hi])
            if c == 0 and self.shared_experts is not None:
                shared_TH = self.shared_experts(hidden_states)
            outs.append(self._experts_and_combine(comm, pending.wait()))
        out_TH = outs[0] if len(outs) == 1 else torch.cat(outs)
        if shared_TH is not None:
            out_TH = out_TH + shared_TH.to(out_TH.dtype)
        return out_TH.to(hidden_states.dtype)

    def _experts_and_combine(self, comm: AllToAll, result: DispatchResult) -> torch.Tensor:
        """The local experts on one dispatch's rows, then the combine: ``[T_chunk, H]`` in
        ``params_dtype``."""
        expert_out = self.experts(result, self.expert_weights())
        if expert_out.dtype != self.params_dtype:  # FP8 rows come out in the experts' dtype
            expert_out = expert_out.to(self.params_dtype)
        return comm.combine(expert_out, result)

    def _step_tokens(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        max_tokens_across_ranks: int | None,
    ) -> int:
        """The largest T of any rank of the group this step, after checking this rank's
        inputs; it decides the backend and the number of chunks (see :meth:`forward`)."""
        error = self._input_error(hidden_states, router_logits)
        if max_tokens_across_ranks is not None:  # graph-safe path: no collective, no sync
            if error is None:
                error = self._hint_error(hidden_states, router_logits, max_tokens_across_ranks)
            if error is not None:
                raise error
            return max_tokens_across_ranks
        T = hidden_states.shape[0] if error is None else 0
        max_T, failed = agree_max((T, int(error is not None)), self.group, self.device)
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(
                "another rank of the EP group rejected its inputs to EPMoE.forward (its "
                "own error says why); this rank stopped too so that no rank is left "
                "waiting in a collective"
            )
        return max_T

    def _hint_error(
        self, hidden_states, router_logits, max_tokens_across_ranks
    ) -> Exception | None:
        """What is wrong with ``max_tokens_across_ranks`` (or the logits' device, which the
        graph-safe path does not copy over), as the exception to raise."""
        if isinstance(max_tokens_across_ranks, bool) or not isinstance(
            max_tokens_across_ranks, int
        ):
            return TypeError(
                "max_tokens_across_ranks must be an int (the largest T of the EP group) or "
                f"None, got {type(max_tokens_across_ranks).__name__}"
            )
        T = hidden_states.shape[0]
        if max_tokens_across_ranks < T:
            return ValueError(
                f"max_tokens_across_ranks={max_tokens_across_ranks} is below this rank's "
                f"T={T}; pass the largest token count of any rank in the EP group"
            )
        if router_logits.device != self.device:
            return ValueError(
                f"router_logits is on {router_logits.device} but the layer on {self.device}; "
                "with max_tokens_across_ranks the forward copies nothing across devices: "
                "compute the router logits on the layer's device"
            )
        return None

    def _input_error(self, hidden_states, router_logits) -> Exception | None:
        """What is wrong with this rank's inputs (or weights), as the exception to raise.
        Host-side checks of shapes, dtypes and devices only (no device synchronisation)."""
        if not self.weights_loaded:
            return RuntimeError(
                "expert weights are not loaded on this rank: call load_experts(w13, w2) or "
                f"load_expert(...) for local experts {self.local_experts}"
            )
        if hidden_states.dim() != 2 or hidden_states.shape[1] != self.hidden_size:
            return ValueError(
                f"hidden_states must be [T, {self.hidden_size}], got {tuple(hidden_states.shape)}"
            )
        if not hidden_states.is_floating_point():
            return TypeError(f"hidden_states must be floating point, got {hidden_states.dtype}")
        if hidden_states.device != self.device:
            return ValueError(
                f"hidden_states is on {hidden_states.device} but the layer on {self.device}; "
                "move the input (or build the layer with device=...)"
            )
        T = hidden_states.shape[0]
        if tuple(router_logits.shape) != (T, self.num_experts):
            return ValueError(
                f"router_logits must be [T={T}, E={self.num_experts}], got "
                f"{tuple(router_logits.shape)}"
            )
        if not router_logits.is_floating_point():
            return TypeError(f"router_logits must be floating point, got {router_logits.dtype}")
        return None

    def _apply(self, fn, recurse=True):
        """``.to()``, ``.cuda()``, ``.half()`` … : the backend, maps and buffers were built
        for one device and dtype, so moving only the weights would break them silently.
        A conversion that would change either is refused before anything moves; build the
        layer where it runs (``device=``, ``params_dtype=``)."""
        probe = fn(torch.empty(0, dtype=self.params_dtype, device=self.device))
        if probe.device != self.device or probe.dtype != self.params_dtype:
            raise RuntimeError(
                f"EPMoE lives on {self.device} in {self.params_dtype} and cannot be moved to "
                f"{probe.device} / {probe.dtype}: build it with device= and params_dtype="
            )
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return (
            f"E={self.num_experts}, K={self.top_k}, H={self.hidden_size}, "
            f"I={self.intermediate_size}, W={self.ep_size}, rank={self.rank}, "
            f"local={self.placement.num_local(self.rank)}, backend={self.comm.name}, "
            f"layout={self.comm.layout.value}, experts={self.experts.name}"
            + (f", dispatch_dtype={self.dispatch_dtype}" if self.dispatch_dtype else "")
            + (
                f", decode_backend={self.decode_comm.name} (T <= {self.decode_max_tokens})"
                if self.decode_comm is not None
                else ""
            )
        )


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _rebound(comm: AllToAll, rank_offsets: tuple[int, ...], group) -> AllToAll:
    """``comm`` moved to ``rank_offsets`` (``rebind``, keeping its buffers), or, when it
    refuses (fixed buffers too small for the new largest e, or no rebind), a fresh backend
    of the same name and layout with the old one closed. Collective like a construction:
    every rank takes the same branch, since all hold the same placement."""
    try:
        comm.rebind(rank_offsets)
        return comm
    except (ValueError, NotImplementedError):
        spec = comm.spec.with_offsets(rank_offsets)
        comm.close()
        return create_backend(comm.name, spec, group, comm.layout)


def _check_group_device(group: dist.ProcessGroup | None, device: torch.device) -> None:
    """NCCL groups move CUDA tensors and gloo groups CPU tensors: refuse a mismatch now
    rather than at the first collective."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    backend = str(dist.get_backend(group))
    if device.type == "cpu" and "nccl" in backend and "gloo" not in backend:
        raise ValueError(
            f"the EP group uses {backend}, which cannot move CPU tensors; build the layer "
            "with a CUDA device or pass a gloo group"
        )
    if device.type == "cuda" and backend == "gloo":
        raise ValueError(
            "the EP group uses gloo, which moves CPU tensors; build the layer with "
            "device='cpu' or pass an NCCL group (epmoe.init_distributed picks NCCL on GPUs)"
        )


def _no_fp8_dispatch(backend: str) -> ValueError:
    """The error for ``dispatch_dtype=torch.float8_e4m3fn`` with a backend that lacks it."""
    offering = []
    for name in backend_names():
        try:
            if backend_class(name).capabilities.fp8_dispatch:
                offering.append(name)
        except ImportError:  # a backend whose module cannot load here offers nothing here
            continue
    return ValueError(
        f"dispatch_dtype={FP8_DTYPE} needs a backend with FP8 dispatch (capability "
        f"fp8_dispatch), and backend={backend!r} "
        + ("has none here" if backend == "auto" else "has none")
        + f"; backends that offer it: {offering or 'none registered'}. Pass one of them as "
        "backend=, or leave dispatch_dtype=None"
    )
