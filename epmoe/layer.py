"""``EPMoE``: one expert-parallel MoE layer, route → place → dispatch → experts → combine.

Shape legend: T tokens on this rank · H hidden · I intermediate · E logical experts ·
P physical experts · e local experts · K top-k · W EP world size · M_max tokens per chunk.

Graph-safe forward: with ``max_tokens_across_ranks`` given (the step's token bound, agreed
by the caller for every layer), the layer's own part of ``forward`` does no host
synchronisation and keeps no per-call Python state a graph would freeze, so a CUDA graph
can capture it with a graph-safe backend (``Capabilities.graph_safe``) and experts
(Triton, ExpertBatched). After replays, ``check_comm()`` raises what the device reported.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from epmoe import custom_op
from epmoe.agreement import (
    COUNT_OUT_OF_RANGE,
    IDS_OUT_OF_RANGE,
    LayerAgreement,
    describe_placement,
)
from epmoe.comm import (
    available_backends,
    backend_class,
    backend_names,
    check_backend_options,
    create_backend,
    graph_capturing,
    resolve_backend,
)
from epmoe.comm.base import (
    FP8_DTYPE,
    FP8_GROUP,
    AllToAll,
    CommSpec,
    DispatchResult,
    Layout,
    layer_call_tag,
)
from epmoe.comm.collectives import world_of
from epmoe.distributed import cpu_by_default, default_device, normalize_device
from epmoe.eplb.recorder import LoadRecorder
from epmoe.experts import ExpertWeights, create_experts
from epmoe.experts.base import check_activation
from epmoe.placement import ExpertPlacement
from epmoe.reference import FP8_EPS, FP8_MAX, dequantize_block, quantize_block
from epmoe.routing import (
    FUSED_ROUTING_MAX_EXPERTS,
    RoutingFunction,
    fused_routing_enabled,
    select_experts,
)
from epmoe.step_context import StepContext, current_step, group_ranks, record_call

# Tokens per dispatch when max_num_tokens is None and the backend sets no limit of its
# own: transports without fixed buffers still chunk so that a prefill of any length runs
# in bounded memory. ExpertBatched is the decode layout; its [e, C, H] buffer grows with
# the busiest expert, so it chunks sooner.
DEFAULT_CHUNK_TOKENS = {Layout.STANDARD: 8192, Layout.EXPERT_BATCHED: 1024}

# Per-slot tensors that follow the placement (``[e, ...]`` each, slot order), in migration
# order; the scales exist only for FP8 weights.
SLOT_TENSORS = ("w13", "w2", "w13_scale", "w2_scale")


@dataclasses.dataclass(frozen=True)
class _CommPlan:
    """A backend chosen and checked for a spec, not built yet (building can be collective:
    the layer builds it after every rank agreed on the configuration)."""

    cls: type[AllToAll]
    spec: CommSpec
    layout: Layout
    options: tuple[tuple[str, Any], ...] = ()  # the constructor's keyword options

    def check(self) -> None:
        """The checks of ``AllToAll.__init__`` (layout, ``supports``), run before the
        construction agreement so that a refusal is agreed, not met inside a collective."""
        caps = self.cls.capabilities
        if self.layout not in caps.layouts:
            raise ValueError(
                f"backend {self.cls.name!r} does not produce layout {self.layout.value!r}; it "
                f"offers {sorted(x.value for x in caps.layouts)}"
            )
        reason = self.cls.supports(self.spec)
        if reason is not None:
            err = TypeError if self.spec.dtype not in caps.dtypes else ValueError
            raise err(f"backend {self.cls.name!r} cannot serve this layer: {reason}")
        check_backend_options(self.cls, dict(self.options))

    def build(self, group: dist.ProcessGroup | None) -> AllToAll:
        return self.cls(self.spec, group, self.layout, **dict(self.options))


class EPMoE(nn.Module):
    """An expert-parallel MoE layer; a drop-in for the routed experts of an MoE block.

    Every rank of ``group`` holds the experts that ``placement`` gives it (``w13 [e, 2I, H]``,
    ``w2 [e, H, I]``) and calls ``forward`` with its own tokens; all ranks must call
    ``forward`` the same number of times (with ``T = 0`` when they have no tokens).
    ``forward(hidden_states [T, H], router_logits [T, E]) -> [T, H]`` returns
    ``Σ_k w[t, k] · expert_{ids[t, k]}(x[t])`` (plus ``shared_experts(x)`` if given).

    Weights start unset: call ``load_experts(w13, w2)`` with the full logical weights (each
    rank keeps its shard), or ``load_expert(expert_id, w13_e, w2_e)`` expert by expert.

    Collective checks (:mod:`epmoe.agreement`): construction is collective over ``group``.
    Each rank checks its arguments, then the ranks agree, with one small all-gather and
    before any backend is built, that they built the same layer (sizes, placement, backend
    and layout, dtypes, activation, routing options, chunk size, ...): a rank's bad argument
    raises its own error there and an error naming it on the others; a difference raises
    ``ValueError`` on every rank naming each field and which ranks hold which value.
    ``forward`` (without ``max_tokens_across_ranks``) and ``rebalance`` agree the same way,
    on the operation, the layer's index and its call count: a rank that meets the others'
    call with another one (it skipped a forward of this layer or a rebalance, or made an
    extra call) is named on every rank.

    ``params_dtype=torch.float64`` computes in float64 throughout (torch experts; the Triton
    experts refuse it); the router weights are float32 as ``select_experts`` returns them.

    PyTorch idioms: ``.to(dtype)`` / ``.half()`` / ``.bfloat16()`` (also through a model
    holding the layer) convert the weights and ``params_dtype``, and the communication
    backends are rebuilt for the new dtype at the next forward, after the ranks agree that
    each converted alike (FP8 weights and their scales keep their dtype). Another device is
    refused: build the layer where it runs (``device=``; a default-device context such as
    ``with torch.device("meta")`` does not move it, and its host tables stay on the CPU;
    ``accelerate.init_empty_weights()`` puts its weights on meta, to be loaded with
    ``load_state_dict(..., assign=True)`` or after ``to_empty``). ``copy.deepcopy`` gives another
    layer with its own weights on the same process group, which builds its own backends at
    its first collective call (copy on every rank alike). ``epmoe.step`` tells ranks whose
    layers differ in such a pending change apart before any forward. There is no backward
    (an inference layer): a backward through the output raises with the fix.

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
        custom_routing_function: ``fn(router_logits, top_k, renormalize) -> (weights [T, K],
            ids [T, K])`` replacing the built-in routing (see ``select_experts``). Its ids
            must lie in ``[-1, E)`` (``-1``: no expert); ids out of range raise on every
            rank in that forward (checked on the device, read with the agreement).
        micro_batches: ``1``, or ``2`` to split each chunk into two halves whose
            communication overlaps the other's experts: both dispatches are started, then
            each half's receive, experts and combine start in turn, and the combines are
            finished last (the shared experts run between the sends and the first
            receive). Outputs equal the plain forward's. Needs a backend that holds two
            dispatch results at once (``Capabilities.max_in_flight``). Steps on the decode
            backend (``backend="auto"``'s ``decode_comm``) run whole: at decode sizes the
            experts read every weight once per half, so halves cost more than they hide
            (2×H200, 128 tokens: 5.46 ms for two halves, 2.61 ms whole).
        weight_dtype: ``None`` (expert weights in ``params_dtype``) or
            ``torch.float8_e4m3fn``: the layer holds FP8 expert weights with float32
            scales (``w13_scale``, ``w2_scale``) and the experts run them (Triton: W8A8
            kernels; torch: dequantised per call). ``load_experts`` / ``load_expert`` take
            FP8 weights with their scales (a DeepSeek-V3 checkpoint's ``weight_scale_inv``)
            or full-precision ones, which they quantize.
        weight_scale: FP8 scales per ``"block"`` of 128×128 (DeepSeek-V3's format:
            ``w13_scale [e, ceil(2I/128), ceil(H/128)]``, ``w2_scale [e, ceil(H/128),
            ceil(I/128)]``) or ``"per_expert"`` (``[e]``).
        backend_options: keyword options for the constructor of a backend chosen by name
            (``epmoe.comm.backend_option_names``): ``symm_ht``'s ``num_sms`` (the most
            programs any launch of its kernels runs) and ``tokens_per_flag`` (0: one count
            per program), ``deepep_ht``'s ``worst_case_rows`` (no CPU sync, graph safe),
            ``symm_ll``'s ``rows_in_place``. Every rank passes the same (part of the agreement).
    """

    @cpu_by_default
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
        custom_routing_function: RoutingFunction | None = None,
        micro_batches: int = 1,
        weight_dtype: torch.dtype | None = None,
        weight_scale: str = "block",
        backend_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        self.group = group
        self.rank, self.ep_size = world_of(group)
        # Every argument is checked and the backend chosen first; then one small all-gather
        # agrees with the other ranks on the configuration (epmoe.agreement) before any
        # backend is built (building one can be collective): one rank's bad argument or
        # other configuration raises on every rank instead of hanging or crashing.
        self._agreement = LayerAgreement(group)
        try:
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
            for name, value in [
                ("apply_router_weight_on_input", apply_router_weight_on_input),
                ("prefer_local_replica", prefer_local_replica),
            ]:
                if not isinstance(value, bool):
                    raise TypeError(f"{name} must be True or False, got {value!r}")
            if apply_router_weight_on_input and top_k != 1:
                raise ValueError(
                    "apply_router_weight_on_input=True scales the input by the router weight, "
                    f"which is only defined for top_k=1 (got top_k={top_k}); set it to False"
                )
            if max_num_tokens is not None and (
                isinstance(max_num_tokens, bool)
                or not isinstance(max_num_tokens, int)
                or max_num_tokens <= 0
            ):
                raise ValueError(
                    f"max_num_tokens must be a positive int or None, got {max_num_tokens!r}"
                )
            if not isinstance(params_dtype, torch.dtype):
                raise TypeError(
                    f"params_dtype must be a torch.dtype (e.g. torch.bfloat16), got "
                    f"{params_dtype!r}"
                )
            if shared_experts is not None and not callable(shared_experts):
                raise TypeError(
                    "shared_experts must be a module (or callable) applied to the input, or "
                    f"None, got {type(shared_experts).__name__}"
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
                custom_routing_function=custom_routing_function,
            )
            self.apply_router_weight_on_input = apply_router_weight_on_input
            self.params_dtype = params_dtype
            self.prefer_local_replica = prefer_local_replica
            self.shared_experts = shared_experts
            if type(micro_batches) is not int or micro_batches not in (1, 2):
                raise ValueError(f"micro_batches must be 1 or 2, got {micro_batches!r}")
            self.micro_batches = micro_batches
            if weight_dtype not in (None, params_dtype, FP8_DTYPE):
                raise ValueError(
                    f"weight_dtype must be None (params_dtype) or torch.float8_e4m3fn, got "
                    f"{weight_dtype!r}"
                )
            self.weight_dtype = params_dtype if weight_dtype is None else weight_dtype
            if weight_scale not in ("block", "per_expert"):
                raise ValueError(
                    f"weight_scale must be 'block' (128×128) or 'per_expert', got {weight_scale!r}"
                )
            self.weight_scale = weight_scale if self.fp8_weights else None
            if self.weight_scale == "block" and intermediate_size % FP8_GROUP:
                raise ValueError(
                    f"weight_scale='block' needs intermediate_size % 128 == 0 (w13 stacks the "
                    f"gate and up rows: their 128-row blocks must not straddle), got "
                    f"{intermediate_size}; use weight_scale='per_expert'"
                )
            if device is not None:
                self.device = normalize_device(device)
            else:
                self.device = default_device(group)

            placement_name = placement if isinstance(placement, str) else None
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
            # backend="auto" with a graph-safe fixed-buffer backend at hand (symm_ll on one
            # NVLink node): steps whose largest T fits its buffers (decode) go there, larger
            # ones (prefill) to self.comm
            if backend_options is None:
                backend_options = {}
            if not isinstance(backend_options, Mapping):
                raise TypeError(
                    "backend_options must be a mapping of option names to values, got "
                    f"{type(backend_options).__name__}"
                )
            if backend_options and backend == "auto":
                raise ValueError(
                    f"backend_options={dict(backend_options)!r} need a backend chosen by "
                    "name (e.g. backend='symm_ht'), not 'auto'"
                )
            # (lists as tuples: ranks that pass [20, 8] and (20, 8) built the same layer)
            self.backend_options = {
                k: tuple(v) if isinstance(v, list) else v for k, v in backend_options.items()
            }
            auto = self._auto_classes(layout, dispatch_dtype) if backend == "auto" else None
            comm_plan = self._plan_comm(backend, layout, max_num_tokens, dispatch_dtype, auto)
            decode_plan = None
            if auto is not None:
                decode_plan = self._plan_decode_comm(auto[1], comm_plan, layout, max_num_tokens)
            # (the decode backend's steps run whole: see micro_batches)
            in_flight = comm_plan.cls.capabilities.max_in_flight
            if in_flight is not None and in_flight < micro_batches:
                raise ValueError(
                    f"micro_batches={micro_batches} needs {micro_batches} dispatch results "
                    f"in flight; backend {comm_plan.cls.name!r} holds {in_flight}: use "
                    "micro_batches=1 or another backend"
                )
            self.experts = create_experts(experts, activation, self.device, params_dtype)
            self._experts_choice = experts  # ("auto": chosen again after .to(dtype))

            if e_score_correction_bias is not None:
                bias = e_score_correction_bias
                if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
                    raise TypeError(
                        "e_score_correction_bias must be a floating-point tensor [E], got "
                        + (
                            f"{bias.dtype}"
                            if isinstance(bias, torch.Tensor)
                            else type(bias).__name__
                        )
                    )
                if bool(torch.isnan(bias).any()):  # once, at construction
                    raise ValueError(
                        "e_score_correction_bias holds NaN; experts can only be chosen with "
                        "finite biases (-inf switches an expert off)"
                    )
                if e_score_correction_bias.shape != (num_experts,):
                    raise ValueError(
                        f"e_score_correction_bias must be [E={num_experts}], got "
                        f"{tuple(e_score_correction_bias.shape)}"
                    )
                # (a copy: the layer's own, as the ranks agreed on it, not the caller's)
                e_score_correction_bias = e_score_correction_bias.to(
                    self.device, torch.float32, copy=True
                ).contiguous()
            self.register_buffer("e_score_correction_bias", e_score_correction_bias)
            # check the routing options now rather than at the first forward (T = 0 is cheap)
            select_experts(
                torch.empty(0, num_experts, device=self.device),
                top_k,
                e_score_correction_bias=e_score_correction_bias,
                **self.routing,
            )
            # EPLB: tokens per physical expert over the last `load_window` forwards
            # (device-side)
            self.load_recorder = (
                LoadRecorder(placement.num_physical, load_window, self.device)
                if load_window is not None
                else None
            )
            fields = self._fingerprint(placement_name, comm_plan, decode_plan, load_window)
        except Exception as exc:
            # the agreement raises it here, and on the other ranks an error naming this one
            self._agreement.construction(None, exc, default_device(group))
            raise
        self._agreement.construction(fields, None, default_device(group))

        self.comm = comm_plan.build(group)
        self.decode_comm: AllToAll | None = None
        self.decode_max_tokens = 0
        if decode_plan is not None:
            self.decode_comm = decode_plan.build(group)
            self.decode_max_tokens = decode_plan.spec.max_num_tokens
        e = placement.num_local(self.rank)
        factory = dict(dtype=self.weight_dtype, device=self.device)
        self.w13 = nn.Parameter(
            torch.empty(e, 2 * intermediate_size, hidden_size, **factory), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(e, hidden_size, intermediate_size, **factory), requires_grad=False
        )
        self.w13_scale: nn.Parameter | None = None
        self.w2_scale: nn.Parameter | None = None
        if self.fp8_weights:
            f32 = dict(dtype=torch.float32, device=self.device)
            for name, shape in self._scale_shapes().items():
                setattr(self, name, nn.Parameter(torch.ones(e, *shape, **f32), requires_grad=False))
        self._loaded = [False] * e  # per local slot; host bookkeeping, never on the device
        # bumped whenever a re-plan replaces the placement, weights or comm binding: what a
        # captured CUDA graph holds the addresses of (epmoe.DecodeGraphs compares it)
        self.generation = 0
        # backends to rebuild at the next collective call (after .to(dtype), in a copy), and
        # whether they are another layer's too (a copy's until then: never rebound or closed)
        self._comm_pending = False
        self._comm_shared = False
        self._group_ranks = group_ranks(group)  # compared with an epmoe.step's group
        # the key of this layer in epmoe::moe_forward's registry (torch.compile)
        self._op_id = custom_op.register(self)
        self._op_id_t = torch.tensor(self._op_id, device="cpu")  # (custom_op.moe_forward)

    def __deepcopy__(self, memo: dict) -> EPMoE:
        """Another layer with copies of this one's weights, maps and buffers, on the same
        process group (which cannot be copied). It builds backends of its own at its first
        collective call (collective there, like a construction: copy on every rank alike;
        its agreements use an index of its own, from this layer's and the number of copies
        made of it, see ``LayerAgreement.fork``); until then it refers to this layer's
        backends, without ever rebinding or closing them."""
        for shared in (self.group, self.comm, self.decode_comm):
            if shared is not None:
                memo.setdefault(id(shared), shared)
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        twin.__setstate__(copy.deepcopy(self.__dict__, memo))
        twin._agreement = self._agreement.fork()
        twin._comm_pending = twin._comm_shared = True
        return twin

    def __setstate__(self, state) -> None:
        """A copy (``copy.deepcopy``, ``pickle``) is another layer: its own id in the
        compiled op's registry, never the original's."""
        super().__setstate__(state)
        self.__dict__.setdefault("_comm_pending", False)  # (a layer saved before these)
        self.__dict__.setdefault("_comm_shared", False)
        self._op_id = custom_op.register(self)
        self._op_id_t = torch.tensor(self._op_id, device="cpu")  # (custom_op.moe_forward)

    def _fingerprint(
        self,
        placement_name: str | None,
        comm_plan: _CommPlan,
        decode_plan: _CommPlan | None,
        load_window: int | None,
    ) -> dict[str, str]:
        """What every rank of the group must build alike, as text by field (the
        construction agreement compares their digests and shows the texts that differ)."""
        bias = self.e_score_correction_bias
        routing = dict(self.routing)
        fn = routing.pop("custom_routing_function")
        if fn is not None:
            name = getattr(fn, "__qualname__", type(fn).__qualname__)
            routing["custom_routing_function"] = f"{getattr(fn, '__module__', '?')}.{name}"
        return {
            "num_experts": repr(self.num_experts),
            "top_k": repr(self.top_k),
            "hidden_size": repr(self.hidden_size),
            "intermediate_size": repr(self.intermediate_size),
            "placement": describe_placement(self.placement, placement_name),
            "backend": repr(comm_plan.cls.name),
            "backend_options": repr(comm_plan.options),
            "layout": repr(comm_plan.layout.value),
            "max_num_tokens": repr(self.max_num_tokens),
            "decode_backend": (
                "None"
                if decode_plan is None
                else f"{decode_plan.cls.name!r} (T <= {decode_plan.spec.max_num_tokens})"
            ),
            "params_dtype": str(self.params_dtype),
            "dispatch_dtype": str(comm_plan.spec.dispatch_dtype),
            "activation": repr(self.activation),
            "routing": repr(routing),
            "e_score_correction_bias": "None" if bias is None else repr(bias.tolist()),
            "apply_router_weight_on_input": repr(self.apply_router_weight_on_input),
            "load_window": repr(load_window),
            "micro_batches": repr(self.micro_batches),
            "weight_dtype": str(self.weight_dtype),
            "weight_scale": repr(self.weight_scale),
        }

    # ---------------------------------------------------------------- backend
    def _plan_comm(
        self,
        backend: str,
        layout: Layout | None,
        max_num_tokens: int | None,
        dispatch_dtype: torch.dtype | None,
        auto: tuple[type[AllToAll], type[AllToAll] | None] | None,
    ) -> _CommPlan:
        """Choose the backend (``auto``: :meth:`_auto_classes`'s choice, for
        ``backend="auto"``), size the chunks (``self.max_num_tokens``, M_max) and check
        that it can serve this layer's :class:`CommSpec`, building nothing (the layer builds
        it after the construction agreement: building can be collective). FP8 dispatch that
        the backend cannot serve raises ``ValueError`` naming ``dispatch_dtype`` and the
        backends that offer it."""
        if auto is not None:
            backend_cls = auto[0]
        else:
            backend_cls = resolve_backend(backend, self.device, self.group, layout)
        if layout is None:
            layouts = backend_cls.capabilities.layouts
            layout = Layout.STANDARD if Layout.STANDARD in layouts else next(iter(layouts))
        self.max_num_tokens = (
            max_num_tokens
            or backend_cls.capabilities.max_num_tokens
            or backend_cls.default_tokens(self.device)
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
            # none can, the first one's checks (or the FP8 check) say why, with the fix
            with contextlib.suppress(RuntimeError):
                backend_cls = resolve_backend("auto", self.device, self.group, layout, spec)
        if spec.fp8_dispatch and not backend_cls.capabilities.fp8_dispatch:
            raise _no_fp8_dispatch(backend_cls.name)
        options = tuple(sorted(self.backend_options.items()))
        plan = _CommPlan(backend_cls, spec, layout, options)
        plan.check()
        return plan

    def _auto_classes(
        self, layout: Layout | None, dispatch_dtype: torch.dtype | None
    ) -> tuple[type[AllToAll], type[AllToAll] | None]:
        """``auto``'s choice: the general backend and the decode backend (or ``None``).

        Decode: the first graph-safe ExpertBatched backend with fixed buffers (registry
        order) that runs here and offers ``layout`` (``symm_ll`` on one NVLink node).
        General: a graph-safe fixed-buffer Standard backend where one runs (``symm_ht``:
        prefill steps, chunked at its ``default_max_tokens``, and every step when the
        layer asks for the Standard layout; on 2×H200 it moves 4096 tokens 3.6× / 2.8×
        faster than ``all_to_all``), else the first that sizes its buffers per call
        (``all_to_all``: any batch, any node)."""
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
                if cls.capabilities.auto and (layout is None or layout in cls.capabilities.layouts):
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
        # graph-safe fixed-buffer backends: low-latency ones deliver ExpertBatched rows
        # (decode), high-throughput ones Standard rows (prefill, and decode where no
        # low-latency one serves the layer's layout)
        fixed = [
            c for c in usable if c.capabilities.graph_safe and c.capabilities.default_max_tokens
        ]
        decode = [c for c in fixed if Layout.EXPERT_BATCHED in c.capabilities.layouts]
        prefill = [
            c for c in fixed if Layout.STANDARD in c.capabilities.layouts and c not in decode[:1]
        ]
        if prefill:  # the largest buffers
            general = [max(prefill, key=lambda c: c.capabilities.default_max_tokens)]
        return general[0], (decode[0] if decode else None)

    def _plan_decode_comm(
        self,
        decode_cls: type[AllToAll] | None,
        comm_plan: _CommPlan,
        layout: Layout | None,
        max_num_tokens: int | None,
    ) -> _CommPlan | None:
        """The decode backend's plan when ``auto`` found a graph-safe fixed-buffer backend
        (``decode_cls``) other than ``comm_plan``'s (see ``__init__``); its M_max is
        ``max_num_tokens`` or the backend's default."""
        if decode_cls is None or decode_cls is comm_plan.cls:
            return None
        caps = decode_cls.capabilities
        # decode-sized: max_num_tokens bounds the prefill chunks; the fixed buffers stay at
        # most the backend's default (a larger M would send prefill steps here, in buffers
        # that grow with it)
        default = decode_cls.default_tokens(comm_plan.spec.device)
        M = min(max_num_tokens or default, default)
        M = min(M, caps.max_num_tokens or M)
        spec = dataclasses.replace(comm_plan.spec, max_num_tokens=M)
        if decode_cls.supports(spec) is not None:
            return None
        return _CommPlan(decode_cls, spec, layout or next(iter(caps.layouts)))

    def _comm_for(self, max_tokens: int) -> tuple[AllToAll, int]:
        """The backend of a step whose largest T over the group is ``max_tokens``, with its
        chunk size: the decode backend when the step fits its buffers, else ``self.comm``.
        Every rank passes the same ``max_tokens``, so every rank picks the same."""
        if self.decode_comm is not None and max_tokens <= self.decode_max_tokens:
            return self.decode_comm, self.decode_max_tokens
        if not self.comm.capabilities.graph_safe and graph_capturing(self.device):
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
        options = getattr(self, "backend_options", {})  # (a layer pickled before them)
        self.comm = _rebound(self.comm, rank_offsets, self.group, options)
        if self.decode_comm is not None:
            self.decode_comm = _rebound(self.decode_comm, rank_offsets, self.group)

    def check_comm(self, sync: bool = True) -> None:
        """Raise if a graph-safe backend of this layer reported an error from the device
        (a bounded wait that timed out, naming the rank that did not arrive; an expert id
        outside ``[0, P)``; a capacity overflow; a rank in another layer's dispatch, which
        a rank that skipped a layer causes). Eager calls check by themselves at the
        next call; a loop that only replays CUDA graphs calls this after its replays
        (``sync``: wait for the device first)."""
        for comm in (self.comm, self.decode_comm):
            check = getattr(comm, "check", None)
            if check is not None:
                check(sync=sync)

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
            reason = comm.rebind_reason(comm.spec.with_offsets(placement.rank_offsets))
            if reason is not None:
                raise ValueError(f"backend {comm.name!r} cannot serve the new placement: {reason}")

    @property
    def weights_loaded(self) -> bool:
        """Whether every local slot has its weights (``load_experts`` / ``load_expert`` / a
        shard). Never while they are on the meta device: every load refuses to copy into
        one (where a copy does nothing). Read by every forward: host flags only."""
        return all(self._loaded)

    def meta_slot_tensors(self) -> list[str]:
        """Names of the per-slot tensors (:meth:`slot_tensors`) on the meta device: a layer
        built under ``accelerate.init_empty_weights()`` or ``torch.device("meta")``."""
        return [name for name, t in self.slot_tensors().items() if t.is_meta]

    def _meta_error(self, what: str) -> ValueError:
        return ValueError(
            f"{what}: this EPMoE's expert weights {self.meta_slot_tensors()} are on the meta "
            "device (built under init_empty_weights() or torch.device('meta')), where a copy "
            "does nothing: give them storage first (layer.to_empty(device=layer.device)), or "
            "load a shard saved by EPMoE.state_dict with load_state_dict(sd, assign=True)"
        )

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
        ``rank_offsets``, else a fresh backend; the only collective step; when it fails
        after an in-place migration, the layer's weights count as not loaded), the weights (new
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
            try:
                self._rebind_comm(placement.rank_offsets)
            except BaseException:
                if any(new is current[name] for name, new in slot_tensors.items()):
                    # migrated in place: the slots hold the new placement's experts, the
                    # layer still the old placement; never serve them (every forward and
                    # rebalance refuses a layer whose weights are not loaded, naming it)
                    self._loaded = [False] * len(self._loaded)
                raise
        for name, new in slot_tensors.items():
            if new is not current[name]:
                if isinstance(current[name], nn.Parameter):
                    new = nn.Parameter(new, requires_grad=False)
                setattr(self, name, new)
        self.placement = placement
        self.generation += 1
        placement.maps_on(self.device)  # device maps built before the next forward
        self._loaded = [True] * e_new
        if self.load_recorder is not None:
            self.load_recorder.reset(placement.num_physical)

    @property
    def local_experts(self) -> list[int]:
        """Logical id of each local slot, in slot order."""
        return self.placement.local_experts(self.rank)

    @property
    def fp8_weights(self) -> bool:
        """Whether the layer holds FP8 expert weights (``weight_dtype``)."""
        return self.weight_dtype == FP8_DTYPE

    def _scale_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-slot shape of each FP8 scale tensor (``weight_scale``)."""
        if self.weight_scale == "per_expert":
            return {"w13_scale": (), "w2_scale": ()}
        I, H, b = self.intermediate_size, self.hidden_size, FP8_GROUP
        return {
            "w13_scale": (-(-2 * I // b), -(-H // b)),
            "w2_scale": (-(-H // b), -(-I // b)),
        }

    def _stored(self, where, w13, w2, w13_scale, w2_scale, lead):
        """``(w13, w2, w13_scale, w2_scale)`` as this layer stores them, from weights of
        leading shape ``lead`` (``(n,)`` experts, or ``()`` for one): FP8 weights come with
        their scales; full-precision ones are quantized for an FP8 layer; FP8 weights given
        to a full-precision layer are dequantized. Scales are ``None`` for such a layer."""
        _check_weights(where, w13=w13, w2=w2)
        if w13.dtype != w2.dtype:
            raise TypeError(
                f"{where}: w13 and w2 must have one dtype (FP8 with scales, or full "
                f"precision), got {w13.dtype} and {w2.dtype}"
            )
        given = {"w13_scale": w13_scale, "w2_scale": w2_scale}
        fp8_in = w13.dtype == FP8_DTYPE or w2.dtype == FP8_DTYPE
        if fp8_in and (w13_scale is None or w2_scale is None):
            raise ValueError(
                f"{where}: FP8 weights need their scales: pass w13_scale= and w2_scale= (a "
                "checkpoint's weight_scale_inv)"
            )
        if not fp8_in and (w13_scale is not None or w2_scale is not None):
            raise ValueError(f"{where}: scales belong to FP8 weights; {w13.dtype} weights got them")
        if fp8_in:
            for name, scale in given.items():
                if not isinstance(scale, torch.Tensor) or not scale.is_floating_point():
                    raise TypeError(f"{where}: {name} must be a float tensor, got {scale!r}")
                bad = int((~torch.isfinite(scale) | (scale < 0)).sum())
                if bad:
                    raise ValueError(
                        f"{where}: {name} holds {bad} negative, NaN or infinite values; FP8 "
                        "scales (a checkpoint's weight_scale_inv) are finite and >= 0"
                    )
        if not self.fp8_weights:
            if fp8_in:  # dequantize into the layer's dtype, whatever scale format came
                if w13_scale.dim() == len(lead) + 2 and self.intermediate_size % FP8_GROUP:
                    # (gate's and up's scales stacked like their rows would be read on one
                    # block grid over [2I, H]: silently wrong rows where I % 128 > 64)
                    raise ValueError(
                        f"{where}: FP8 w13 with block scales needs intermediate_size % 128 "
                        f"== 0 (w13 stacks the gate and up rows: their 128-row blocks must "
                        f"not straddle), got {self.intermediate_size}; dequantize gate_proj "
                        "and up_proj apart (epmoe.reference.dequantize_block) and load "
                        "full-precision weights"
                    )
                w13 = dequantize_block(_lead(w13, lead), _lead(w13_scale, lead))
                w2 = dequantize_block(_lead(w2, lead), _lead(w2_scale, lead))
                if not lead:
                    w13, w2 = w13[0], w2[0]
            return w13, w2, None, None
        want = {n: (*lead, *shape) for n, shape in self._scale_shapes().items()}
        if fp8_in:
            for name, scale in given.items():
                if tuple(scale.shape) != want[name]:
                    raise ValueError(
                        f"{where}: {name} must be {list(want[name])} for weight_scale="
                        f"{self.weight_scale!r}, got {list(scale.shape)}"
                    )
            # a zero scale (an all-zero block: DeepSeek-V3's weight_quant has no floor) is
            # raised to the kernels' floor (they rescale by ratios of scales), which keeps
            # its weights at zero to within 448 × the floor, 1e-10
            floor = FP8_EPS / FP8_MAX
            return w13, w2, w13_scale.clamp(min=floor), w2_scale.clamp(min=floor)
        per = self.weight_scale == "per_expert"
        q13, s13 = quantize_block(_lead(w13, lead), per_matrix=per)
        q2, s2 = quantize_block(_lead(w2, lead), per_matrix=per)
        if not lead:  # one expert: drop the leading 1
            q13, s13, q2, s2 = q13[0], s13[0], q2[0], s2[0]
        return q13, q2, s13, s2

    @torch.no_grad()
    def load_experts(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        *,
        w13_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
    ) -> None:
        """Take the full logical weights (``w13 [E, 2I, H]``, ``w2 [E, H, I]``, on any
        device) and keep this rank's shard, replicas included. FP8 weights come with their
        scales (``[E, ...]`` in the layer's ``weight_scale`` format; a full-precision layer
        dequantizes them); an FP8 layer quantizes full-precision ones. Not collective."""
        E, I, H = self.num_experts, self.intermediate_size, self.hidden_size
        _check_weights("load_experts", w13=w13, w2=w2)
        if self.meta_slot_tensors():
            raise self._meta_error("load_experts")
        if tuple(w13.shape) != (E, 2 * I, H) or tuple(w2.shape) != (E, H, I):
            raise ValueError(
                f"load_experts wants w13 [E, 2I, H] = {[E, 2 * I, H]} and w2 [E, H, I] = "
                f"{[E, H, I]}, got {list(w13.shape)} and {list(w2.shape)}"
            )
        for name, scale in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
            if scale is not None and (
                not isinstance(scale, torch.Tensor) or scale.dim() == 0 or scale.shape[0] != E
            ):
                got = list(scale.shape) if isinstance(scale, torch.Tensor) else repr(scale)
                raise ValueError(
                    f"load_experts: {name} must hold every expert's scales, [E = {E}, ...] "
                    f"(the weights' scale blocks per expert), got {got}"
                )
        local = torch.tensor(self.local_experts, dtype=torch.int64, device=w13.device)
        pick = [
            None if t is None else t[local.to(t.device)] for t in (w13, w2, w13_scale, w2_scale)
        ]
        stored = self._stored("load_experts", *pick, lead=(len(self.local_experts),))
        for name, t in zip(SLOT_TENSORS, stored):
            if t is not None:
                getattr(self, name).copy_(t)
        self._loaded = [True] * len(self._loaded)

    @torch.no_grad()
    def load_expert(
        self,
        expert_id: int,
        w13_e: torch.Tensor,
        w2_e: torch.Tensor,
        *,
        w13_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
    ) -> bool:
        """Load one logical expert (``w13_e [2I, H]``, ``w2_e [H, I]``; FP8 ones with their
        scales, as for :meth:`load_experts`) into every local slot that holds it; returns
        whether this rank holds it. For checkpoints stored per expert."""
        if isinstance(expert_id, bool) or not isinstance(expert_id, int):
            raise TypeError(f"expert_id must be an int, got {expert_id!r}")
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert_id must be in [0, {self.num_experts}), got {expert_id}")
        _check_weights("load_expert", w13_e=w13_e, w2_e=w2_e)
        if self.meta_slot_tensors():
            raise self._meta_error("load_expert")
        if tuple(w13_e.shape) != tuple(self.w13.shape[1:]) or tuple(w2_e.shape) != tuple(
            self.w2.shape[1:]
        ):
            raise ValueError(
                f"load_expert wants w13_e {list(self.w13.shape[1:])} and w2_e "
                f"{list(self.w2.shape[1:])}, got {list(w13_e.shape)} and {list(w2_e.shape)}"
            )
        slots = [s for s, x in enumerate(self.local_experts) if x == expert_id]
        if not slots:
            return False
        stored = self._stored("load_expert", w13_e, w2_e, w13_scale, w2_scale, lead=())
        for s in slots:
            for name, t in zip(SLOT_TENSORS, stored):
                if t is not None:
                    getattr(self, name)[s].copy_(t)
            self._loaded[s] = True
        return True

    @cpu_by_default
    def rebalance(self, placement: ExpertPlacement):
        """Switch to ``placement`` while serving (an EPLB re-plan): move only the expert
        weights whose slots change (point-to-point between ranks), then install the new
        placement, weights and backend binding (see :meth:`_swap_placement`). Collective
        over the EP group; outputs before and after are the same. Returns this rank's
        :class:`~epmoe.eplb.migration.MigrationStats`.

        Before any weight moves, the ranks agree (:mod:`epmoe.agreement`): a rank whose
        :meth:`check_placement` fails raises its error and names itself on the others, a
        rank that holds another placement raises ``ValueError`` on every rank naming the
        ranks and their placements, and a rank in another call (a skipped forward or
        rebalance) is named on every rank."""
        from epmoe.eplb.migration import rebalance_layer

        error = None
        try:
            self.check_placement(placement)
            if not self.weights_loaded:
                raise RuntimeError(
                    "expert weights are not loaded on this rank: call load_experts(w13, w2) "
                    "on every rank before rebalancing"
                )
        except (TypeError, ValueError, RuntimeError) as exc:
            error = exc
        if self._comm_pending:  # (agreed first: a rank that did not change is named)
            self._rebuild_comm()
        fields = (
            None
            if error
            else {
                "placement": describe_placement(placement),
                "params_dtype": str(self.params_dtype),
            }
        )
        self._agreement.rebalance(fields, error, self.device)
        # checked and agreed on every rank: the migration needs no second agreement
        return rebalance_layer(self, placement, agreed=True)

    def expert_weights(self) -> ExpertWeights:
        return ExpertWeights(self.w13, self.w2, self.w13_scale, self.w2_scale)

    # ------------------------------------------------------------------ checkpoints
    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        """This rank's shard plus the placement record (``<prefix>placement.*``) that
        ``load_state_dict`` checks; see :mod:`epmoe.checkpoint`."""
        from epmoe import checkpoint

        super()._save_to_state_dict(destination, prefix, keep_vars)
        checkpoint.save_record(self, destination, prefix)

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
        """Refuse a shard saved by another rank or under another placement (nothing is
        copied); a shard that fits marks the weights loaded. See :mod:`epmoe.checkpoint`."""
        from epmoe import checkpoint

        if checkpoint.load_shard(self, super()._load_from_state_dict, state_dict, prefix, *args):
            self._loaded = [True] * len(self._loaded)

    # ------------------------------------------------------------------ forward
    def route(self, router_logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router weights ``[T, K]`` float32 and *physical* expert ids ``[T, K]`` int64.
        On the device, no host synchronisation (the ids are not range checked here)."""
        weights_TK, logical_TK, physical_TK = self._route(router_logits_TE)
        return weights_TK, physical_TK if physical_TK is not None else self._to_physical(logical_TK)

    def _route(
        self, router_logits_TE: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Router weights ``[T, K]`` float32, *logical* expert ids ``[T, K]`` int64 and,
        where one kernel gives them too, the physical ids (else None: ``_to_physical``).

        On CUDA the built-in routing and the placement run as one Triton kernel
        (``kernels.route.fused_route``, unless ``EPMOE_FUSED_ROUTING=0``): about a dozen
        torch kernels fewer per forward, each of which an eager step waited for the host
        to launch. A custom routing function, logits on another device than the layer's,
        and the CPU take the torch path."""
        routing = self.routing
        if self._fused_routing(router_logits_TE):
            from epmoe.kernels.route import fused_route

            return fused_route(
                router_logits_TE,
                self.top_k,
                self.placement.maps_on(self.device),
                rank=self.rank,
                prefer_local=self.prefer_local_replica,
                renormalize=routing["renormalize"],
                scoring_func=routing["scoring_func"],
                num_expert_group=routing["num_expert_group"],
                topk_group=routing["topk_group"],
                e_score_correction_bias=self.e_score_correction_bias,
                routed_scaling_factor=routing["routed_scaling_factor"],
            )
        weights_TK, logical_TK = self._select(router_logits_TE)
        return weights_TK, logical_TK, None

    def _fused_routing(self, router_logits_TE: torch.Tensor) -> bool:
        """Whether ``_route`` takes the fused kernel for these logits."""
        return (
            router_logits_TE.is_cuda
            and router_logits_TE.device == self.device  # (its maps and bias live there)
            and self.routing["custom_routing_function"] is None
            and self.num_experts <= FUSED_ROUTING_MAX_EXPERTS
            and fused_routing_enabled()
        )

    def _select(self, router_logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router weights ``[T, K]`` float32 and *logical* expert ids ``[T, K]`` int64."""
        return select_experts(
            router_logits_TE,
            self.top_k,
            e_score_correction_bias=self.e_score_correction_bias,
            **self.routing,
        )

    def _to_physical(self, logical_TK: torch.Tensor) -> torch.Tensor:
        return self.placement.to_physical(
            logical_TK, rank=self.rank, prefer_local=self.prefer_local_replica
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        *,
        max_tokens_across_ranks: int | None = None,
        step: StepContext | None = None,
        num_valid_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``hidden_states [T, H]``, ``router_logits [T, E]`` → ``[T, H]`` in the input dtype.

        ``step``: an agreed DP step (:func:`epmoe.step`), by default the active one (the
        innermost ``with epmoe.step(...)`` block); its ``max_tokens`` is this forward's
        ``max_tokens_across_ranks`` (below), checked against this rank's ``T`` and the
        layer's group. An explicit ``max_tokens_across_ranks`` overrides the active step.

        Under ``torch.compile`` the whole forward is one opaque op,
        ``torch.ops.epmoe.moe_forward`` (:mod:`epmoe.custom_op`): a model with ``EPMoE``
        layers compiles with ``fullgraph=True`` and no graph breaks; the active step is read
        when the op runs, so one compiled model serves every step.

        Collective over the EP group: every rank calls it, also with ``T = 0``, and runs
        the same number of chunks of at most ``max_num_tokens`` tokens (one dispatch and
        combine each). Without ``max_tokens_across_ranks`` every check of this rank's
        inputs runs first (tensors, shapes, dtypes, devices, loaded weights, then the
        routing and the range of its ids, ``[-1, E)``), and then one small all-gather
        (:mod:`epmoe.agreement`), whose result the host reads, agrees on the chunk count
        (the step's largest T), on whether every rank's checks passed, and on the call
        (operation, layer index, call count): one rank's bad input, or a rank in another
        call, raises on every rank in that same call instead of leaving some inside a
        collective (see :mod:`epmoe.agreement` for what a skipped call looks like).

        ``max_tokens_across_ranks``: the largest ``T`` of any rank in the EP group this step
        (as a DP coordinator knows it; the same value on every rank). It replaces that
        all-gather, and the layer's own part of the forward then does no host
        synchronisation and changes no Python state (CUDA-graph capturable with a
        graph-safe backend and experts). The caller guarantees every rank's input is valid
        (ids in range included) and that every rank makes the same calls: these forwards
        are not counted, and a rank that skips one is not detected. ``router_logits`` must
        be on the layer's device.

        ``num_valid_tokens``: for padded batches (a CUDA graph captured for a bucket of
        ``T`` rows, fewer of them real), on the layer's device, either a one-element
        integer tensor ``n``: rows ``n..T-1`` are padding; or a bool tensor ``[T]``: rows
        where it is False are (e.g. a finished request's row in a static batch). Padding
        rows go to no expert: they are not sent, computed or recorded in the expert load,
        and their routed output is zero. Read on the device only, so each replay may hold
        other values. A count outside ``[0, T]`` raises on every rank in the layer's own
        agreement (checked on the device, read back with the agreement's all-gather); with
        ``max_tokens_across_ranks`` or a step it is not checked (that path never waits for
        the device): a count above ``T`` means every row, a negative one none.
        """
        if torch.compiler.is_compiling():
            if step is not None:
                if max_tokens_across_ranks is not None:
                    raise TypeError("pass either step= or max_tokens_across_ranks=, not both")
                # the step's own checks (ended, group) at trace time; then a graph constant
                max_tokens_across_ranks = step.max_tokens_for(self, 0)
            # (None: the step or the layer's agreement decides.) A hint's type is checked
            # here as eagerly (the op's schema would take a bool or a NumPy int as an int);
            # its value may be symbolic, and the op checks it when it runs
            if max_tokens_across_ranks is not None:
                error = _max_tokens_type_error(max_tokens_across_ranks)
                if error is not None:
                    raise error
            return torch.ops.epmoe.moe_forward(
                hidden_states, router_logits, self._op_id_t, max_tokens_across_ranks,
                num_valid_tokens, self._params_needing_grad(),
            )  # fmt: skip
        kwargs = dict(
            max_tokens_across_ranks=max_tokens_across_ranks,
            step=step,
            num_valid_tokens=num_valid_tokens,
        )
        if torch.is_grad_enabled():
            # as the compiled op: the output requires grad, and a backward raises (the
            # dispatch and combine are not differentiable; a partial gradient is wrong)
            inputs = (hidden_states, router_logits)
            grads = self._params_needing_grad()
            if grads or any(getattr(t, "requires_grad", False) for t in inputs):
                return _NoBackward.apply(self, hidden_states, router_logits, kwargs, *grads)
        return self._eager_forward(hidden_states, router_logits, **kwargs)

    def _params_needing_grad(self) -> list[torch.Tensor]:
        """The parameters a backward through the layer could reach (its shared experts'),
        with grad enabled: the eager and the compiled forward hand them to autograd so
        that such a backward raises instead of leaving zero gradients."""
        if not torch.is_grad_enabled():
            return []
        return [p for p in self.parameters() if p.requires_grad]

    def _eager_forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        *,
        max_tokens_across_ranks: int | None = None,
        step: StepContext | None = None,
        num_valid_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`forward` outside the compiler (and inside ``epmoe::moe_forward``)."""
        dev = self.device
        if dev.type == "cuda" and dev.index != torch.cuda.current_device():
            # one process driving several GPUs (a model split with device_map="auto"):
            # Triton launches on the current device and its stream, so run there
            with torch.cuda.device(dev):
                return self._eager_forward(
                    hidden_states,
                    router_logits,
                    max_tokens_across_ranks=max_tokens_across_ranks,
                    step=step,
                    num_valid_tokens=num_valid_tokens,
                )
        if self._comm_pending:
            self._rebuild_comm()
        if step is not None and max_tokens_across_ranks is not None:
            raise TypeError("pass either step= or max_tokens_across_ranks=, not both")
        if step is None and max_tokens_across_ranks is None:
            step = current_step()
        if step is not None:
            T = hidden_states.shape[0] if isinstance(hidden_states, torch.Tensor) else 0
            max_tokens_across_ranks = step.max_tokens_for(self, T)
        valid_error = self._valid_tokens_error(num_valid_tokens, hidden_states)
        if max_tokens_across_ranks is None:
            weights_TK, logical_TK, physical_TK, max_T = self._route_and_agree(
                hidden_states, router_logits, valid_error, num_valid_tokens
            )
        else:  # graph-safe path: no collective, no host sync; raises on this rank only
            error = (
                self._input_error(hidden_states, router_logits)
                or valid_error
                or self._hint_error(hidden_states, router_logits, max_tokens_across_ranks)
            )
            if error is not None:
                raise error
            max_T = max_tokens_across_ranks
            weights_TK, logical_TK, physical_TK = self._route(router_logits)
        comm, M = self._comm_for(max_T)
        num_chunks = max(math.ceil(max_T / M), 1)
        T = hidden_states.shape[0]

        # place (device only; the recorder counts into its device-side ring)
        x_TH = hidden_states.to(self.params_dtype)
        ids_TK = physical_TK if physical_TK is not None else self._to_physical(logical_TK)
        if num_valid_tokens is not None:  # padding rows: no expert (on the device)
            if num_valid_tokens.dtype == torch.bool:
                real_T = num_valid_tokens
            else:
                real_T = torch.arange(T, device=ids_TK.device) < num_valid_tokens.reshape(())
            ids_TK = torch.where(real_T[:, None], ids_TK, -1)
            # and no weight: a padding row's logits may be garbage (NaN weights), and an
            # ExpertBatched combine weights every slot, unused ones included (0 · NaN)
            weights_TK = torch.where(real_T[:, None], weights_TK, 0)
        if self.load_recorder is not None:
            self.load_recorder.record(ids_TK)
        if self.apply_router_weight_on_input:  # in float32, or float64 for float64 layers
            compute = torch.promote_types(self.params_dtype, torch.float32)
            x_TH = (x_TH.to(compute) * weights_TK).to(self.params_dtype)
            weights_TK = torch.ones_like(weights_TK)

        # dispatch → experts → combine, chunk by chunk (one dispatch held at a time, within
        # any backend's max_in_flight); the shared experts run while the first is in flight.
        # The tag lets a backend that reads its counts on the host refuse a dispatch that
        # meets another layer's (a rank that skipped a layer inside a step); the step counts
        # the calls that got this far (the next step's agreement compares the counts)
        comm.call_tag = layer_call_tag(self._agreement.index)
        record_call(self, step if step is not None else current_step())
        outs, shared_TH = [], None
        for c in range(num_chunks):
            lo, hi = min(c * M, T), min((c + 1) * M, T)
            chunk = (x_TH[lo:hi], ids_TK[lo:hi], weights_TK[lo:hi])
            shared = self.shared_experts if c == 0 else None
            if self.micro_batches == 2 and comm is not self.decode_comm:
                out_TH, shared_out = self._two_micro_batches(comm, chunk, shared, hidden_states)
                outs.append(out_TH)
                shared_TH = shared_out if shared is not None else shared_TH
                continue
            if shared is not None:  # split phase: overlap them
                pending = comm.dispatch_async(*chunk)
                shared_TH = shared(hidden_states)
                result = pending.wait()
            else:  # nothing to overlap: the blocking call (one launch where a backend fuses)
                result = comm.dispatch(*chunk)
            outs.append(self._experts_and_combine(comm, result))
        out_TH = outs[0] if len(outs) == 1 else torch.cat(outs)
        if shared_TH is not None:  # (added in the wider dtype, then rounded once: a
            # float32 shared output is not rounded to a bf16 params_dtype first)
            wide = torch.promote_types(out_TH.dtype, shared_TH.dtype)
            out_TH = out_TH.to(wide) + shared_TH.to(wide)
        return out_TH.to(hidden_states.dtype)

    def _two_micro_batches(
        self,
        comm: AllToAll,
        chunk: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        shared: nn.Module | None,
        hidden_states: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One chunk as two halves A and B (this rank's tokens split at ``ceil(T / 2)``):
        send A, send B, [shared experts], receive A, experts A, send A's combine, receive
        B, experts B, send B's combine, then finish both combines. Each half's transfer is
        in flight while the other half computes. ``[T_chunk, H]`` and the shared output."""
        x_TH, ids_TK, weights_TK = chunk
        half = -(-x_TH.shape[0] // 2)
        halves = [(x_TH[:half], ids_TK[:half], weights_TK[:half])]
        halves.append((x_TH[half:], ids_TK[half:], weights_TK[half:]))
        sends = [comm.dispatch_async(*h) for h in halves]
        shared_TH = shared(hidden_states) if shared is not None else None
        combines = []
        for pending in sends:
            result = pending.wait()
            combines.append(comm.combine_async(self._expert_out(result), result))
        outs = [p.wait() for p in combines]
        return torch.cat(outs), shared_TH

    def _expert_out(self, result: DispatchResult) -> torch.Tensor:
        """The local experts on one dispatch's rows, in ``params_dtype``."""
        expert_out = self.experts(result, self.expert_weights())
        if expert_out.dtype != self.params_dtype:  # FP8 rows come out in the experts' dtype
            expert_out = expert_out.to(self.params_dtype)
        return expert_out

    def _experts_and_combine(self, comm: AllToAll, result: DispatchResult) -> torch.Tensor:
        """The local experts on one dispatch's rows, then the combine: ``[T_chunk, H]`` in
        ``params_dtype``."""
        return comm.combine(self._expert_out(result), result)

    def _route_and_agree(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        extra_error: Exception | None = None,
        num_valid_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, int]:
        """Check this rank's inputs, route (router weights ``[T, K]``, logical ids
        ``[T, K]``, physical ids where ``_route`` gives them), flag ids outside ``[-1, E)``
        and a ``num_valid_tokens`` count outside ``[0, T]`` on the device, then agree with
        the other ranks (see :meth:`forward`). Returns the weights, the ids and the step's
        largest T; raises on every rank when any rank's checks failed or the ranks are out
        of step (``extra_error``: another argument's error, agreed the same way)."""
        error = self._input_error(hidden_states, router_logits) or extra_error
        weights_TK = logical_TK = physical_TK = flags = None
        if error is None:
            try:
                router_logits = router_logits.to(self.device)
            except Exception as exc:  # e.g. a meta tensor, a device that cannot copy
                error = ValueError(
                    f"router_logits on {router_logits.device} cannot be copied to the layer's "
                    f"{self.device} ({type(exc).__name__}: {exc}); compute the router logits "
                    "on the layer's device"
                )
        if error is None:
            try:  # the routing options, a custom routing function
                weights_TK, logical_TK, physical_TK = self._route(router_logits)
            except Exception as exc:
                error = exc
            else:
                bad_ids = ((logical_TK < -1) | (logical_TK >= self.num_experts)).any()
                flags = bad_ids.to(torch.int64) * IDS_OUT_OF_RANGE
        T = hidden_states.shape[0] if error is None else 0
        count = None
        if error is None and num_valid_tokens is not None and num_valid_tokens.dtype != torch.bool:
            count = num_valid_tokens.reshape(())
            flags = flags | ((count < 0) | (count > T)).to(torch.int64) * COUNT_OUT_OF_RANGE

        def device_error(bits: int) -> ValueError:  # this rank's device checks: read back
            if bits & IDS_OUT_OF_RANGE:
                lo, hi = int(logical_TK.min()), int(logical_TK.max())
                return ValueError(
                    f"the routing returned expert ids in [{lo}, {hi}] on this rank; they must "
                    f"lie in [0, E={self.num_experts}) or be -1 (no expert): check the "
                    "custom_routing_function. Nothing was sent: every rank raises in this call"
                )
            return ValueError(
                f"num_valid_tokens={int(count)} on this rank, whose batch has T={T} rows; "
                f"the count of real rows must lie in [0, {T}] (or pass a bool mask [T]). "
                "Nothing was sent: every rank raises in this call"
            )

        max_T = self._agreement.forward(T, error, flags, self.device, device_error)
        return weights_TK, logical_TK, physical_TK, max_T

    def _hint_error(
        self, hidden_states, router_logits, max_tokens_across_ranks
    ) -> Exception | None:
        """What is wrong with ``max_tokens_across_ranks`` (or the logits' device, which the
        graph-safe path does not copy over), as the exception to raise."""
        error = _max_tokens_error(max_tokens_across_ranks)
        if error is not None:
            return error
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

    def _valid_tokens_error(self, num_valid_tokens, hidden_states) -> Exception | None:
        """What is wrong with a ``num_valid_tokens`` argument (host-side checks only)."""
        if num_valid_tokens is None:
            return None
        what = "a one-element integer tensor or a bool tensor [T]"
        if not isinstance(num_valid_tokens, torch.Tensor):
            return TypeError(
                f"num_valid_tokens must be {what} on the layer's device (or None), got "
                f"{type(num_valid_tokens).__name__}"
            )
        T = hidden_states.shape[0] if isinstance(hidden_states, torch.Tensor) else None
        if num_valid_tokens.dtype == torch.bool:
            if T is not None and tuple(num_valid_tokens.shape) != (T,):
                return ValueError(
                    f"num_valid_tokens as a bool mask must have one value per row, shape "
                    f"({T},); got {tuple(num_valid_tokens.shape)}"
                )
        elif num_valid_tokens.numel() != 1 or num_valid_tokens.dtype not in _COUNT_DTYPES:
            return ValueError(
                f"num_valid_tokens must be {what} (int8/16/32/64 or uint8), got "
                f"{num_valid_tokens.dtype} of shape {tuple(num_valid_tokens.shape)}"
            )
        if num_valid_tokens.device != self.device:
            return ValueError(
                f"num_valid_tokens is on {num_valid_tokens.device} but the layer on "
                f"{self.device}; keep it on the layer's device (a graph replay reads it there)"
            )
        return None

    def _input_error(self, hidden_states, router_logits) -> Exception | None:
        """What is wrong with this rank's inputs (or weights), as the exception to raise.
        Host-side checks of types, shapes, dtypes and devices only (no device
        synchronisation)."""
        for name, value in (("hidden_states", hidden_states), ("router_logits", router_logits)):
            if not isinstance(value, torch.Tensor):
                return TypeError(
                    f"{name} must be a torch.Tensor, got {type(value).__name__}; pass "
                    "hidden_states [T, H] and router_logits [T, E] (T = 0 when this rank has "
                    "no tokens)"
                )
        if not self.weights_loaded:
            if self.meta_slot_tensors():
                return self._meta_error("EPMoE.forward")
            return RuntimeError(
                "expert weights are not loaded on this rank: call load_experts(w13, w2) or "
                f"load_expert(...) for local experts {self.local_experts}"
            )
        if hidden_states.dim() != 2 or hidden_states.shape[1] != self.hidden_size:
            H, shape = self.hidden_size, tuple(hidden_states.shape)
            fix = (
                f"; flatten the leading dims (hidden_states.reshape(-1, {H}), router_logits"
                f".reshape(-1, {self.num_experts})) and reshape the output back"
                if hidden_states.dim() > 2 and shape[-1] == H
                else ""
            )
            return ValueError(f"hidden_states must be [T, {H}], got {shape}{fix}")
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
        """``.to()``, ``.half()``, ``.bfloat16()`` … : a dtype change converts the weights
        and sets ``params_dtype``; the communication backends are rebuilt for it at the next
        forward (collective there: every rank converts alike, which the ranks agree on
        first). Another device is refused before this layer changes (its process group and
        communication buffers belong to its device): build the layer where it runs
        (``device=``). ``to_empty`` leaves full-precision expert weights uninitialised:
        the layer is then not loaded until its weights are loaded again (FP8 weights and
        scales on real storage keep their values, as for any dtype change)."""
        # (Module.to_empty passes a lambda of its own: the one conversion that drops values)
        emptied = "to_empty" in getattr(fn, "__qualname__", "")
        probe = fn(torch.empty(0, dtype=self.params_dtype, device=self.device))
        if probe.device != self.device:
            raise RuntimeError(
                f"EPMoE lives on {self.device} and cannot be moved to {probe.device} (its "
                "process group and communication buffers belong to its device): build it "
                "with device= where it runs"
            )
        dtype = probe.dtype
        if dtype != self.params_dtype:
            self._check_new_dtype(dtype)
        # FP8 weights, their float32 scales and the float32 router bias keep their dtype
        keep = {id(t) for t in (self.w13_scale, self.w2_scale) if t is not None}
        if self.fp8_weights:
            keep |= {id(self.w13), id(self.w2)}
        if self.e_score_correction_bias is not None:
            keep.add(id(self.e_score_correction_bias))

        def apply(t):  # (a kept tensor is not converted, not even into a temporary)
            if id(t) not in keep:
                return fn(t)
            if not t.is_meta:
                return t
            out = fn(t)  # (storage for a kept tensor on meta: to_empty; in its own dtype)
            return out if out.dtype == t.dtype else out.to(t.dtype)

        module = super()._apply(apply, recurse)
        if emptied and not self.fp8_weights:
            self._loaded = [False] * len(self._loaded)
        if dtype != self.params_dtype:
            self.params_dtype = dtype
            if not self.fp8_weights:
                self.weight_dtype = dtype
            if getattr(self, "_experts_choice", None) == "auto":  # (float64 → torch, …)
                self.experts = create_experts("auto", self.activation, self.device, dtype)
            self.generation += 1  # captured CUDA graphs hold the old buffers
            # (back to the backends' own dtype: nothing to rebuild, nothing to agree on)
            self._comm_pending = self._comm_shared or any(
                c is not None and c.spec.dtype != dtype for c in (self.comm, self.decode_comm)
            )
        return module

    def _check_new_dtype(self, dtype: torch.dtype) -> None:
        """What ``.to(dtype)`` needs of ``dtype``, before this layer changes."""
        if not dtype.is_floating_point or dtype == FP8_DTYPE:
            raise TypeError(
                f"EPMoE computes in a floating dtype (bfloat16, float16, float32, float64), "
                f"not {dtype}; FP8 expert weights are chosen at construction (weight_dtype=)"
            )
        if self.experts.name == "triton":  # (the torch experts compute in any dtype)
            create_experts("triton", self.activation, self.device, dtype)
        for comm in (self.comm, self.decode_comm):
            why = comm and type(comm).supports(dataclasses.replace(comm.spec, dtype=dtype))
            if why:
                raise ValueError(f"EPMoE in {dtype}: backend {comm.name!r} cannot serve it: {why}")

    @cpu_by_default
    def _rebuild_comm(self) -> None:
        """The first collective call after a dtype change or of a copy: the ranks agree
        that each changed alike, then build the backends for this layer's dtype and
        placement one at a time, agreeing on each build's outcome: if a rank's build
        failed, every rank raises and keeps its old backends (still pending: the next call
        tries again). The old ones are closed once every rank has all new ones, unless they
        are another layer's. (A backend whose constructor is itself collective, the
        symmetric-memory ones, and fails on one rank inside its rendezvous leaves the
        others there until the group's timeout names it.)"""
        fields = {"params_dtype": str(self.params_dtype)}
        self._agreement.rebuild(fields, None, self.device)
        options = getattr(self, "backend_options", {})  # (a layer pickled before them)
        old = [c for c in (self.comm, self.decode_comm) if c is not None]
        new: list[AllToAll] = []
        try:
            for i, comm in enumerate(old):
                error = None
                try:
                    new.append(self._rebuilt(comm, options if i == 0 else None))
                except Exception as exc:  # noqa: BLE001 (agreed on, then raised everywhere)
                    error = exc
                self._agreement.rebuild(fields, error, self.device)
        except BaseException:
            for fresh, comm in zip(new, old):
                if fresh is not comm:
                    fresh.close()
            raise
        for fresh, comm in zip(new, old):
            if fresh is not comm and not self._comm_shared:
                comm.close()
        self.comm = new[0]
        if self.decode_comm is not None:
            self.decode_comm = new[1]
        self._comm_pending = self._comm_shared = False
        self.generation += 1

    def _rebuilt(self, comm: AllToAll, options: Mapping[str, Any] | None) -> AllToAll:
        """A backend like ``comm`` (name, layout, ``options``) for this layer's dtype and
        placement (``comm`` itself when it fits and is this layer's own). Collective like a
        construction."""
        spec = dataclasses.replace(
            comm.spec, dtype=self.params_dtype, rank_offsets=self.placement.rank_offsets
        )
        if spec == comm.spec and not self._comm_shared:
            return comm
        return create_backend(comm.name, spec, self.group, comm.layout, **(options or {}))

    def extra_repr(self) -> str:
        return (
            f"E={self.num_experts}, K={self.top_k}, H={self.hidden_size}, "
            f"I={self.intermediate_size}, W={self.ep_size}, rank={self.rank}, "
            f"local={self.placement.num_local(self.rank)}, backend={self.comm.name}, "
            f"layout={self.comm.layout.value}, experts={self.experts.name}"
            + (f", dispatch_dtype={self.dispatch_dtype}" if self.dispatch_dtype else "")
            + (
                f", weight_dtype={self.weight_dtype} ({self.weight_scale} scales)"
                if self.fp8_weights
                else ""
            )
            + (f", micro_batches={self.micro_batches}" if self.micro_batches != 1 else "")
            + (
                f", decode_backend={self.decode_comm.name} (T <= {self.decode_max_tokens})"
                if self.decode_comm is not None
                else ""
            )
        )


def _lead(t: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
    """``t`` with a leading expert dimension (``lead == ()``: one expert, add it)."""
    return t if lead else t.unsqueeze(0)


# num_valid_tokens counts: the integer dtypes torch compares on every device (not uint16-64)
_COUNT_DTYPES = frozenset((torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64))


def _max_tokens_type_error(max_tokens_across_ranks: object) -> Exception | None:
    """A TypeError when a given ``max_tokens_across_ranks`` is no int (a bool is none)."""
    if isinstance(max_tokens_across_ranks, bool) or not isinstance(max_tokens_across_ranks, int):
        return TypeError(
            "max_tokens_across_ranks must be an int (the largest T of the EP group) or "
            f"None, got {type(max_tokens_across_ranks).__name__}"
        )
    return None


def _max_tokens_error(max_tokens_across_ranks: object) -> Exception | None:
    """What is wrong with a given ``max_tokens_across_ranks`` on its own (its type, its
    range), as the exception to raise."""
    error = _max_tokens_type_error(max_tokens_across_ranks)
    if error is not None:
        return error
    if not 0 <= max_tokens_across_ranks < 2**31:
        return ValueError(
            f"max_tokens_across_ranks={max_tokens_across_ranks} is outside [0, 2**31); pass "
            "the largest token count of any rank in the EP group (0 when none has tokens), "
            "or None"
        )
    return None


def _check_weights(where: str, **weights: object) -> None:
    """Expert weights are floating-point tensors (FP8 included): integer, bool or complex
    ones would be cast silently into the layer's dtype."""
    for name, w in weights.items():
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(w).__name__}")
        if not w.is_floating_point():
            raise TypeError(
                f"{where}: {name} must be floating point (bf16, fp16, fp32, fp64 or FP8), got "
                f"{w.dtype}; convert the checkpoint's tensors first"
            )


def _rebound(
    comm: AllToAll, rank_offsets: tuple[int, ...], group, options: Mapping[str, Any] | None = None
) -> AllToAll:
    """``comm`` moved to ``rank_offsets`` (``rebind``, keeping its buffers; a backend with
    fixed buffers grows them itself), or, when it refuses (a backend that cannot rebind), a
    fresh backend of the same name, layout and ``options``. The old one is closed only
    once the new one exists, so a refusal of the new spec leaves the layer with a working
    backend.
    Collective like a construction: every rank takes the same branch, since all hold the
    same placement."""
    try:
        comm.rebind(rank_offsets)
        return comm
    except (ValueError, NotImplementedError):
        spec = comm.spec.with_offsets(rank_offsets)
        fresh = create_backend(comm.name, spec, group, comm.layout, **(options or {}))
        comm.close()
        return fresh


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


class _NoBackward(torch.autograd.Function):
    """``EPMoE``'s eager forward when an input requires grad: the output requires grad too
    and a backward raises with the fix, as through the compiled op (``epmoe::moe_forward``)."""

    @staticmethod
    def forward(ctx, layer, hidden_states, router_logits, kwargs, *params):  # type: ignore[override]
        return layer._eager_forward(hidden_states, router_logits, **kwargs)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        raise RuntimeError(custom_op.NO_BACKWARD)
