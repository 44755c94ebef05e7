"""``EPMoE``: one expert-parallel MoE layer, route → place → dispatch → experts → combine.

Shape legend: T tokens on this rank · H hidden · I intermediate · E logical experts ·
P physical experts · e local experts · K top-k · W EP world size · M_max tokens per chunk.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from epmoe.comm import resolve_backend
from epmoe.comm._collectives import agree_max, world_of
from epmoe.comm.base import CommSpec, Layout
from epmoe.distributed import default_device
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


class EPMoE(nn.Module):
    """An expert-parallel MoE layer; a drop-in for the routed experts of an MoE block.

    Every rank of ``group`` holds the experts that ``placement`` gives it (``w13 [e, 2I, H]``,
    ``w2 [e, H, I]``) and calls ``forward`` with its own tokens; all ranks must call
    ``forward`` the same number of times (with ``T = 0`` when they have no tokens).
    ``forward(hidden_states [T, H], router_logits [T, E]) -> [T, H]`` returns
    ``Σ_k w[t, k] · expert_{ids[t, k]}(x[t])`` (plus ``shared_experts(x)`` if given).

    Weights start unset: call ``load_experts(w13, w2)`` with the full logical weights (each
    rank keeps its shard), or ``load_expert(expert_id, w13_e, w2_e)`` expert by expert.
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
        self.device = torch.device(device) if device is not None else default_device(group)

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
        self._check_placement(placement)
        self.placement = placement
        # build the device maps now, so no forward (or graph capture) copies them over
        placement.maps_on(self.device)

        if isinstance(layout, str):
            choices = [x.value for x in Layout]
            if layout not in choices:
                raise ValueError(f"layout must be one of {choices} or None, got {layout!r}")
            layout = Layout(layout)
        _check_group_device(group, self.device)
        backend_cls = resolve_backend(backend, self.device, group, layout)
        if layout is None:
            layouts = backend_cls.capabilities.layouts
            layout = Layout.STANDARD if Layout.STANDARD in layouts else next(iter(layouts))
        self.max_num_tokens = (
            max_num_tokens
            or backend_cls.capabilities.max_num_tokens
            or DEFAULT_CHUNK_TOKENS[layout]
        )
        spec = CommSpec(
            hidden_size=hidden_size,
            top_k=top_k,
            rank_offsets=placement.rank_offsets,
            max_num_tokens=self.max_num_tokens,
            dtype=params_dtype,
            device=self.device,
        )
        self.comm = backend_cls(spec, group, layout)
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
        self._loaded = torch.zeros(e, dtype=torch.bool)
        # EPLB: tokens per physical expert over the last `load_window` forwards (device-side)
        self.load_recorder = (
            LoadRecorder(placement.num_physical, load_window, self.device)
            if load_window is not None
            else None
        )

    # ------------------------------------------------------------------ weights
    def _check_placement(self, placement: ExpertPlacement) -> None:
        if placement.num_experts != self.num_experts:
            raise ValueError(
                f"placement has {placement.num_experts} experts, the layer {self.num_experts}"
            )
        if placement.ep_size != self.ep_size:
            raise ValueError(
                f"placement is for ep_size={placement.ep_size} but the group has "
                f"{self.ep_size} ranks; build it with ep_size={self.ep_size}"
            )

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
        self._loaded[:] = True

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
        """Switch to ``placement`` while serving: move only the expert weights whose slots
        change (point-to-point between ranks), then swap the maps. Collective over the EP
        group; outputs before and after are the same. Returns the migration statistics."""
        from epmoe.eplb.migration import rebalance_layer

        return rebalance_layer(self, placement)

    def expert_weights(self) -> ExpertWeights:
        return ExpertWeights(self.w13, self.w2)

    # ------------------------------------------------------------------ forward
    def route(self, router_logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router weights ``[T, K]`` float32 and *physical* expert ids ``[T, K]`` int64."""
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

        Collective over the EP group: every rank calls it, also with ``T = 0``. The ranks
        agree on the number of chunks (and on whether every rank's inputs are valid, so
        that bad input raises on all ranks instead of leaving some inside a collective)
        with one small all-reduce. A serving loop that knows the largest ``T`` of the group
        (as a DP coordinator does) passes it as ``max_tokens_across_ranks`` to skip that
        all-reduce; it then guarantees every rank's input is valid.
        """
        error = self._input_error(hidden_states, router_logits)
        T = hidden_states.shape[0] if error is None else 0
        M = self.max_num_tokens
        if max_tokens_across_ranks is not None:
            if error is not None:
                raise error
            if max_tokens_across_ranks < T:
                raise ValueError(
                    f"max_tokens_across_ranks={max_tokens_across_ranks} is below this rank's "
                    f"T={T}; pass the largest token count of any rank in the EP group"
                )
            num_chunks = math.ceil(max_tokens_across_ranks / M)
        else:
            num_chunks, failed = agree_max(
                (math.ceil(T / M), int(error is not None)), self.group, self.device
            )
            if error is not None:
                raise error
            if failed:
                raise RuntimeError(
                    "another rank of the EP group rejected its inputs to EPMoE.forward (its "
                    "own error says why); this rank stopped too so that no rank is left "
                    "waiting in a collective"
                )

        x_TH = hidden_states.to(self.params_dtype)
        weights_TK, ids_TK = self.route(router_logits.to(self.device))
        if self.load_recorder is not None:
            self.load_recorder.record(ids_TK)
        if self.apply_router_weight_on_input:
            x_TH = (x_TH.float() * weights_TK).to(self.params_dtype)
            weights_TK = torch.ones_like(weights_TK)
        outs = []
        for c in range(max(num_chunks, 1)):
            lo, hi = min(c * M, T), min((c + 1) * M, T)
            outs.append(self._moe_chunk(x_TH[lo:hi], ids_TK[lo:hi], weights_TK[lo:hi]))
        out_TH = outs[0] if len(outs) == 1 else torch.cat(outs)
        if self.shared_experts is not None:
            out_TH = out_TH + self.shared_experts(hidden_states).to(out_TH.dtype)
        return out_TH.to(hidden_states.dtype)

    def _input_error(self, hidden_states, router_logits) -> Exception | None:
        """What is wrong with this rank's inputs (or weights), as the exception to raise."""
        if not bool(self._loaded.all()):
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

    def _moe_chunk(self, x_TH, ids_TK, weights_TK) -> torch.Tensor:
        result = self.comm.dispatch(x_TH, ids_TK, weights_TK)
        expert_out = self.experts(result, self.expert_weights())
        return self.comm.combine(expert_out, result)

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
        )


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
