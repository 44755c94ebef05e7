"""Expert-parallel drop-ins for the MoE blocks of Hugging Face ``transformers`` models.

``replace_moe_blocks(model, group=...)`` walks a model and swaps every supported MoE block
for an ``EPMoEBlock``: the block's router (``gate``) stays in the wrapper and runs
data-parallel (every rank scores its own tokens), the routed experts move into an
``epmoe.EPMoE`` that keeps only this rank's shard, and the shared experts (DeepSeek-V3,
GLM-4-MoE, Qwen2-MoE) run beside them on every rank. The wrapper takes and returns what the
Hugging Face block did, so the rest of the model (attention, norms, caches, ``generate``)
is untouched::

    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16).to(device)
    epmoe.init_distributed()
    replace_moe_blocks(model)  # collective: every rank of the group calls it
    out = model(input_ids)     # each rank its own requests; the MoE layers are collective

Supported blocks (``SUPPORTED_BLOCKS``), with transformers 5.x (fused 3-D expert weights,
router modules; targeted: 5.24) and 4.57 (one MLP module per expert, ``nn.Linear`` routers):

=========================  ============  ==============================================
block class                family        routing
=========================  ============  ==============================================
``MixtralSparseMoeBlock``  mixtral       softmax, top-k, renormalized
``Qwen2MoeSparseMoeBlock`` qwen2_moe     softmax, top-k, ``norm_topk_prob``; gated
                                         shared expert
``Qwen3MoeSparseMoeBlock`` qwen3_moe     softmax, top-k, ``norm_topk_prob``
``OlmoeSparseMoeBlock``    olmoe         softmax, top-k, ``norm_topk_prob``
``DeepseekV3MoE``          deepseek_v3   sigmoid, grouped top-k (``n_group``,
                                         ``topk_group``), ``e_score_correction_bias``,
                                         ``norm_topk_prob``, ``routed_scaling_factor``;
                                         shared experts
``Glm4MoeMoE``             glm4_moe      as deepseek_v3
=========================  ============  ==============================================

Loading by shard: ``from_pretrained_sharded(directory, group=...)`` builds the model with
its parameters on the meta device, converts it, and fills it from the safetensors files so
that each rank reads only its own experts' tensors (see :func:`load_sharded`).

Saving: ``save_pretrained(model, directory)`` (collective) writes a converted model in the
original Hugging Face layout, full experts under their original names, so that
``from_pretrained`` reads it like the unconverted model's own checkpoint (see its docstring).

Padded batches: a serving engine that captures the whole model's decode step in a CUDA
graph pads each batch to the graph's size. ``with padded_batch(n):`` around the model's
forward (or its capture) makes the rows from ``n`` on (a device tensor, filled before each
replay) padding in every ``EPMoEBlock``: routed to no expert, not recorded as expert load.

Only classes defined by ``transformers`` itself match (not ``trust_remote_code`` copies,
whose code differs). ``transformers`` is imported when a block is wrapped, never when this
module is imported.

Shape legend: B batch · S sequence · T = B·S tokens on this rank · H hidden · I expert
intermediate size · E routed experts · K top-k.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from epmoe.checkpoint import gather_full_experts
from epmoe.decode_graphs import DecodeGraphs
from epmoe.distributed import default_device, normalize_device
from epmoe.integrations.safetensors_loader import SCALE_SUFFIX, CheckpointReader
from epmoe.layer import EPMoE
from epmoe.placement import ExpertPlacement

__all__ = [
    "SUPPORTED_BLOCKS",
    "EPMoEBlock",
    "HFMoESpec",
    "ShardLoadReport",
    "from_pretrained_sharded",
    "load_sharded",
    "padded_batch",
    "replace_moe_blocks",
    "save_pretrained",
]

INSTALL_HINT = 'pip install "epmoe[hf]"'

_VALID_ROWS: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar(
    "epmoe_valid_rows", default=None
)


@contextlib.contextmanager
def padded_batch(num_valid_tokens: torch.Tensor) -> Iterator[None]:
    """Inside, every ``EPMoEBlock`` forward treats its flattened rows ``[B·S, H]`` from
    ``num_valid_tokens`` on as padding (or, given a bool tensor ``[B·S]``, the rows where it
    is False, e.g. finished requests that ride along in a static batch): routed to no
    expert, not recorded as expert load (the layers' ``num_valid_tokens``). For a model
    whose batch is padded to a fixed size,
    e.g. a whole decode step captured in a CUDA graph: pad the batch at its end, capture the
    forward inside this context with a one-element integer tensor on the layers' device, and
    fill that tensor with the step's real row count before each replay::

        n = torch.zeros(1, dtype=torch.int32, device="cuda")
        with epmoe.step(group, num_tokens=B, decode=True), padded_batch(n):
            with torch.cuda.graph(graph):
                logits = model(input_ids_B1, ...).logits
        n.fill_(real_rows); graph.replay()

    An ``EPMoEBlock`` called with its own ``num_valid_tokens`` uses that instead."""
    token = _VALID_ROWS.set(num_valid_tokens)
    try:
        yield
    finally:
        _VALID_ROWS.reset(token)


@dataclass(frozen=True)
class _Family:
    """How one Hugging Face MoE block class is built and routes."""

    name: str
    scoring: str  # "softmax" (softmax top-k) or "deepseek" (sigmoid, grouped, biased, scaled)
    renormalize_field: str | None  # config field saying whether to renormalize; None: always
    shared: str  # "none", "plain" (`shared_experts`, added) or "gated" (Qwen2-MoE)
    v4_returns_router_logits: bool  # transformers 4.x forward returns (hidden, logits)


_FAMILIES: dict[str, _Family] = {
    "MixtralSparseMoeBlock": _Family("mixtral", "softmax", None, "none", True),
    "Qwen2MoeSparseMoeBlock": _Family("qwen2_moe", "softmax", "norm_topk_prob", "gated", True),
    "Qwen3MoeSparseMoeBlock": _Family("qwen3_moe", "softmax", "norm_topk_prob", "none", True),
    "OlmoeSparseMoeBlock": _Family("olmoe", "softmax", "norm_topk_prob", "none", True),
    "DeepseekV3MoE": _Family("deepseek_v3", "deepseek", "norm_topk_prob", "plain", False),
    "Glm4MoeMoE": _Family("glm4_moe", "deepseek", "norm_topk_prob", "plain", False),
}

SUPPORTED_BLOCKS: tuple[str, ...] = tuple(_FAMILIES)
"""Class names of the Hugging Face MoE blocks ``EPMoEBlock`` can replace."""

# Hugging Face `hidden_act` → epmoe activation (`act(gate) * up`); gelu is the exact (erf) one.
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu"}

# EPMoE arguments that the wrapper reads from the Hugging Face block and config.
_FROM_BLOCK = frozenset(
    {
        "num_experts",
        "top_k",
        "hidden_size",
        "intermediate_size",
        "activation",
        "renormalize",
        "scoring_func",
        "num_expert_group",
        "topk_group",
        "e_score_correction_bias",
        "routed_scaling_factor",
        "apply_router_weight_on_input",
        "shared_experts",
    }
)

PlacementArg = str | ExpertPlacement | Callable[[str], "str | ExpertPlacement"]


@dataclass(frozen=True)
class HFMoESpec:
    """What ``EPMoEBlock`` read from a Hugging Face MoE block and its config.

    ``expert_layout`` is ``"fused"`` (transformers 5: ``experts.gate_up_proj [E, 2I, H]``,
    ``experts.down_proj [E, H, I]``) or ``"per_expert"`` (transformers 4: an
    ``nn.ModuleList`` of MLPs with ``w1``/``w3``/``w2`` or ``gate_proj``/``up_proj``/
    ``down_proj``). ``returns_router_logits``: the block's forward returns ``(hidden
    [B, S, H], router_logits [T, E])`` instead of the hidden states alone.
    """

    block_class: str
    family: str
    num_experts: int  # E
    top_k: int  # K
    hidden_size: int  # H
    intermediate_size: int  # I
    activation: str
    renormalize: bool
    scoring_func: str
    num_expert_group: int | None
    topk_group: int | None
    routed_scaling_factor: float
    shared_experts: str  # "none", "plain" or "gated"
    expert_layout: str  # "fused" or "per_expert"
    returns_router_logits: bool


def _require_transformers() -> int:
    """Import transformers (lazily) and return its major version."""
    try:
        transformers = importlib.import_module("transformers")
    except ImportError as exc:
        raise ImportError(
            f"epmoe.integrations.huggingface needs the transformers package: {INSTALL_HINT} "
            "(or pip install transformers)"
        ) from exc
    return int(str(transformers.__version__).split(".")[0])


def _family_of(module: nn.Module) -> _Family | None:
    cls = type(module)
    if not cls.__module__.startswith("transformers."):
        return None  # our own wrappers, user modules, trust_remote_code copies
    return _FAMILIES.get(cls.__name__)


def _unsupported(module: nn.Module, what: str) -> ValueError:
    return ValueError(
        f"cannot wrap {type(module).__name__}: {what}. EPMoEBlock supports the transformers "
        f"classes {', '.join(SUPPORTED_BLOCKS)} as defined by transformers 4.57 and 5.x"
    )


# ---------------------------------------------------------------------- expert weights
_PROJ_NAMES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))


def _mlp_projections(mlp: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear] | None:
    """(gate, up, down) Linear layers of a bias-free gated MLP, or None."""
    for names in _PROJ_NAMES:
        projs = [getattr(mlp, n, None) for n in names]
        if all(isinstance(p, nn.Linear) and p.bias is None for p in projs):
            return projs[0], projs[1], projs[2]
    return None


def _expert_tensors(block: nn.Module) -> tuple[str, torch.Tensor, int]:
    """(layout, a weight tensor for dtype/device, I) of the block's routed experts."""
    experts = getattr(block, "experts", None)
    if isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
        flags = {
            "is_transposed": False,
            "is_concatenated": True,
            "has_bias": False,
            "has_gate": True,
        }
        odd = [
            f"{k}={getattr(experts, k)}" for k, v in flags.items() if getattr(experts, k, v) != v
        ]
        if odd:
            raise _unsupported(
                block, f"its experts use a weight layout epmoe does not read ({odd})"
            )
        w13, w2 = experts.gate_up_proj, experts.down_proj
        if w13.dim() != 3 or w2.dim() != 3 or w13.shape[1] != 2 * w2.shape[2]:
            raise _unsupported(
                block,
                f"experts.gate_up_proj {tuple(w13.shape)} and down_proj {tuple(w2.shape)} are "
                "not [E, 2I, H] and [E, H, I]",
            )
        return "fused", w13, w2.shape[2]
    if isinstance(experts, nn.ModuleList) and len(experts) > 0:
        projs = [_mlp_projections(m) for m in experts]
        if any(p is None for p in projs):
            raise _unsupported(block, "an expert is not a bias-free gated MLP")
        return "per_expert", projs[0][0].weight, projs[0][0].weight.shape[0]
    raise _unsupported(block, f"its experts ({type(experts).__name__}) have no known layout")


def _projection_names(mlp: nn.Module) -> tuple[str, str, str]:
    """The (gate, up, down) attribute names of a per-expert MLP (see ``_mlp_projections``)."""
    for names in _PROJ_NAMES:
        if all(isinstance(getattr(mlp, n, None), nn.Linear) for n in names):
            return names
    raise AssertionError("checked by _mlp_projections")


def _expert_weights_e(block: nn.Module, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w13_e [2I, H], w2_e [H, I])`` of one expert of a per-expert (ModuleList) block."""
    gate, up, down = _mlp_projections(block.experts[expert])
    return torch.cat([gate.weight, up.weight], dim=0), down.weight


# ---------------------------------------------------------------------- spec
def _config_field(config, name: str, block: nn.Module):
    if not hasattr(config, name):
        raise ValueError(
            f"the config passed for {type(block).__name__} has no field {name!r}; pass the "
            "model's own config (model.config)"
        )
    return getattr(config, name)


def _read_spec(block: nn.Module, config, family: _Family, tf_major: int) -> HFMoESpec:
    gate = getattr(block, "gate", None)
    router_w = getattr(gate, "weight", None)
    if not isinstance(router_w, torch.Tensor) or router_w.dim() != 2:
        raise _unsupported(block, "its router (gate) has no [E, H] weight")
    E, H = router_w.shape
    layout, w, I = _expert_tensors(block)
    n_experts = w.shape[0] if layout == "fused" else len(block.experts)
    if n_experts != E or w.shape[-1] != H:
        raise _unsupported(
            block, f"the router scores {E} experts of hidden size {H} but the experts differ"
        )
    top_k = int(_config_field(config, "num_experts_per_tok", block))
    for owner in (block, gate):
        seen = getattr(owner, "top_k", None)
        if isinstance(seen, int) and seen != top_k:
            raise ValueError(
                f"config.num_experts_per_tok={top_k} but {type(block).__name__} was built with "
                f"top_k={seen}; pass the config the model was built from"
            )
    act = _config_field(config, "hidden_act", block)
    if act not in _ACTIVATIONS:
        raise ValueError(
            f"hidden_act={act!r} of {type(block).__name__} is not supported; epmoe experts "
            f"compute act(gate) * up with act in {sorted(_ACTIVATIONS)}"
        )
    renormalize = (
        True
        if family.renormalize_field is None
        else bool(_config_field(config, family.renormalize_field, block))
    )
    routing = dict(scoring_func="softmax", num_expert_group=None, topk_group=None, scale=1.0)
    if family.scoring == "deepseek":
        routing = dict(
            scoring_func="sigmoid",
            num_expert_group=int(_config_field(config, "n_group", block)),
            topk_group=int(_config_field(config, "topk_group", block)),
            scale=float(_config_field(config, "routed_scaling_factor", block)),
        )
    return HFMoESpec(
        block_class=type(block).__name__,
        family=family.name,
        num_experts=E,
        top_k=top_k,
        hidden_size=H,
        intermediate_size=I,
        activation=_ACTIVATIONS[act],
        renormalize=renormalize,
        scoring_func=routing["scoring_func"],
        num_expert_group=routing["num_expert_group"],
        topk_group=routing["topk_group"],
        routed_scaling_factor=routing["scale"],
        shared_experts=family.shared,
        expert_layout=layout,
        returns_router_logits=tf_major < 5 and family.v4_returns_router_logits,
    )


class _GatedSharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: ``sigmoid(gate(x)) · expert(x)``, ``[T, H] → [T, H]``."""

    def __init__(self, expert: nn.Module, gate: nn.Module) -> None:
        super().__init__()
        self.expert, self.gate = expert, gate

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(x_TH)) * self.expert(x_TH)


def _shared_experts(block: nn.Module, spec: HFMoESpec) -> nn.Module | None:
    if spec.shared_experts == "none":
        return None
    if spec.shared_experts == "plain":
        shared = getattr(block, "shared_experts", None)
        if not isinstance(shared, nn.Module):
            raise _unsupported(block, "it has no shared_experts module")
        return shared
    expert = getattr(block, "shared_expert", None)
    gate = getattr(block, "shared_expert_gate", None)
    if not isinstance(expert, nn.Module) or not isinstance(gate, nn.Module):
        raise _unsupported(block, "it has no shared_expert and shared_expert_gate modules")
    return _GatedSharedExpert(expert, gate)


# ---------------------------------------------------------------------- saving
@dataclass(frozen=True)
class _HFLayout:
    """Where a wrapped block's tensors lived in the Hugging Face block (its state-dict keys,
    relative to the block), recorded when the block is wrapped so that ``save_pretrained``
    can write them back under those names.

    ``renamed``: the wrapper's key → the block's key, for every tensor the wrapper kept
    (router, correction bias, shared experts; matched by identity). ``expert_keys``: the
    block's routed-expert keys. ``projections``: the per-expert (gate, up, down) names, or
    None for fused experts. ``lost``: block keys that are neither (none in the supported
    families); saving refuses a block that has some. ``dtype``: the experts' dtype.
    """

    renamed: dict[str, str]
    expert_keys: frozenset[str]
    projections: tuple[str, str, str] | None
    lost: tuple[str, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, block: nn.Module, wrapper: nn.Module, spec: HFMoESpec) -> _HFLayout:
        kept: dict[int, str] = {}
        for key, t in wrapper.state_dict(keep_vars=True).items():
            kept.setdefault(id(t), key)  # the router's own keys come first
        renamed, expert_keys, lost = {}, set(), []
        for key, t in block.state_dict(keep_vars=True).items():
            if key.startswith("experts."):
                expert_keys.add(key)
            elif id(t) in kept:
                renamed[kept[id(t)]] = key
            else:
                lost.append(key)
        projections = None
        if spec.expert_layout == "per_expert":
            projections = _projection_names(block.experts[0])
        _, weight, _ = _expert_tensors(block)
        return cls(renamed, frozenset(expert_keys), projections, tuple(lost), weight.dtype)

    def expert_state(
        self, w13: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """Full experts ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` under the block's keys, in
        ``dtype`` (default: the block's when it was wrapped; each tensor its own storage:
        safetensors refuses shared ones)."""
        dtype = dtype or self.dtype
        w13, w2 = w13.to(dtype), w2.to(dtype)
        if self.projections is None:
            return {"experts.gate_up_proj": w13, "experts.down_proj": w2}
        gate, up, down = self.projections
        I = w2.shape[2]
        out = {}
        for j in range(w13.shape[0]):
            out[f"experts.{j}.{gate}.weight"] = w13[j, :I].clone()
            out[f"experts.{j}.{up}.weight"] = w13[j, I:].clone()
            out[f"experts.{j}.{down}.weight"] = w2[j].clone()
        return out


# ---------------------------------------------------------------------- the wrapper
class EPMoEBlock(nn.Module):
    """A Hugging Face MoE block whose routed experts run expert-parallel in an ``EPMoE``.

    Built from one supported block (``SUPPORTED_BLOCKS``) and the model's config; the block
    itself is not modified (``replace_moe_blocks`` releases its experts afterwards).

    * ``gate``: the block's own router module, kept as is and run on this rank's tokens
      (data-parallel). On transformers 5 it is called like the block calls it, so
      ``output_router_logits=True`` still records its logits.
    * ``moe``: an ``EPMoE`` with the block's routing (top-k, scoring, renormalization,
      grouped top-k, correction bias, scaling read from the config and router) holding this
      rank's shard of the experts, loaded from the block; its ``shared_experts`` are the
      block's shared experts (Qwen2-MoE's with their sigmoid gate), run on every rank.
    * ``spec``: the ``HFMoESpec`` read from the block.

    ``forward(hidden_states [B, S, H])`` returns what the Hugging Face block returns: the
    output ``[B, S, H]`` in the input dtype, or with transformers 4.x for the softmax
    families ``(output [B, S, H], router_logits [B·S, E])``. Any leading shape works
    (``[T, H]`` too). Collective over the EP group like ``EPMoE.forward``: every rank calls
    it the same number of times, also with no tokens (``S = 0``).

    Inference only: the expert weights take no gradients and Mixtral's training-time router
    jitter is not applied.

    Args:
        block: the Hugging Face MoE block; its expert weights must be materialised (not on
            the meta device) on the device the layer should run on.
        config: the model's (text) config; defaults to ``block.config`` where blocks keep one.
        group: as for ``EPMoE``.
        placement: as for ``EPMoE``.
        backend: as for ``EPMoE``.
        experts: as for ``EPMoE``.
        **moe_kwargs: further ``EPMoE`` arguments (``max_num_tokens``, ``layout``,
            ``params_dtype`` (default: the expert weights' dtype), ``device`` (default:
            theirs), ``load_window``, ``prefer_local_replica``). Routing arguments come from
            the block and may not be passed.
        defer_expert_loading: leave the ``EPMoE``'s experts empty (unloaded) instead of
            copying them from the block, whose experts may then be on the meta device;
            ``device`` must be passed. The caller fills them with ``moe.load_expert`` (what
            ``from_pretrained_sharded`` does); the layer refuses to run until every local
            slot is loaded.
    """

    def __init__(
        self,
        block: nn.Module,
        config: Any = None,
        *,
        group: dist.ProcessGroup | None = None,
        placement: str | ExpertPlacement = "linear",
        backend: str = "auto",
        experts: str = "auto",
        defer_expert_loading: bool = False,
        **moe_kwargs: Any,
    ) -> None:
        super().__init__()
        tf_major = _require_transformers()
        family = _family_of(block)
        if family is None:
            raise TypeError(
                f"EPMoEBlock wraps a transformers MoE block ({', '.join(SUPPORTED_BLOCKS)}), "
                f"got {type(block).__module__}.{type(block).__name__}"
            )
        fixed = sorted(_FROM_BLOCK.intersection(moe_kwargs))
        if fixed:
            raise TypeError(
                f"EPMoEBlock reads {fixed} from the Hugging Face block and its config; do not "
                "pass them (change the model's config instead)"
            )
        if config is None:
            config = getattr(block, "config", None)
            if config is None:
                raise ValueError(
                    f"{type(block).__name__} keeps no config; pass config=model.config"
                )
        spec = _read_spec(block, config, family, tf_major)
        _, weight, _ = _expert_tensors(block)
        if weight.device.type == "meta" and not defer_expert_loading:
            raise ValueError(
                f"the expert weights of {spec.block_class} are on the meta device; load the "
                "checkpoint (and move the model to its device) before replacing the block, "
                "or load it by shard (from_pretrained_sharded)"
            )
        if defer_expert_loading and "device" not in moe_kwargs:
            raise TypeError("defer_expert_loading=True needs device= (where the layer runs)")
        moe_kwargs.setdefault("params_dtype", weight.dtype)
        moe_kwargs.setdefault("device", weight.device)

        self.spec = spec
        self.gate = block.gate
        # transformers 4.x DeepSeek-V3 / GLM-4-MoE routers return (ids, weights), not
        # logits: compute the logits as they do (a float32 linear) instead of calling them.
        self._logits_from_weight = family.scoring == "deepseek" and tf_major < 5
        bias = getattr(block.gate, "e_score_correction_bias", None)
        if family.scoring == "deepseek" and not isinstance(bias, torch.Tensor):
            raise _unsupported(block, "its router has no e_score_correction_bias")
        if family.scoring == "deepseek" and bias.device.type == "meta":
            raise ValueError(
                f"the router's e_score_correction_bias of {spec.block_class} is on the meta "
                "device; EPMoE checks it and keeps a float32 copy when it is built. Build the "
                "model with only its parameters on meta (the buffers real, as "
                "from_pretrained_sharded does), or give the buffer storage before converting"
            )
        self.moe = EPMoE(
            spec.num_experts,
            spec.top_k,
            spec.hidden_size,
            spec.intermediate_size,
            group=group,
            placement=placement,
            backend=backend,
            experts=experts,
            activation=spec.activation,
            renormalize=spec.renormalize,
            scoring_func=spec.scoring_func,
            num_expert_group=spec.num_expert_group,
            topk_group=spec.topk_group,
            e_score_correction_bias=bias.detach() if family.scoring == "deepseek" else None,
            routed_scaling_factor=spec.routed_scaling_factor,
            shared_experts=_shared_experts(block, spec),
            **moe_kwargs,
        )
        if not defer_expert_loading:
            self._load_experts(block)
        self._hf_layout = _HFLayout.of(block, self, spec)  # for save_pretrained
        self.decode_graphs: DecodeGraphs | None = None  # see capture_decode_graphs

    @torch.no_grad()
    def _load_experts(self, block: nn.Module) -> None:
        """Copy this rank's experts from ``block`` (only the local shard is materialised)."""
        if self.spec.expert_layout == "fused":
            self.moe.load_experts(block.experts.gate_up_proj, block.experts.down_proj)
            return
        for expert in sorted(set(self.moe.local_experts)):
            self.moe.load_expert(expert, *_expert_weights_e(block, expert))

    def router_logits(self, hidden_TH: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` → router logits ``[T, E]``, computed as the Hugging Face block does."""
        if self._logits_from_weight:
            return F.linear(hidden_TH.float(), self.gate.weight.float())
        out = self.gate(hidden_TH)
        return out if isinstance(out, torch.Tensor) else out[0]

    def forward(self, hidden_states: torch.Tensor, num_valid_tokens: torch.Tensor | None = None):
        """The Hugging Face block's forward. ``num_valid_tokens`` (default: the enclosing
        :func:`padded_batch`'s): rows of ``hidden_states`` flattened to ``[B·S, H]`` from it
        on (a one-element integer tensor), or where it is False (a bool tensor ``[B·S]``),
        are padding, routed to no expert."""
        shape = hidden_states.shape
        x_TH = hidden_states.reshape(-1, shape[-1])
        if num_valid_tokens is None:
            num_valid_tokens = _VALID_ROWS.get()
        graphs = self.decode_graphs if num_valid_tokens is None else None  # (caller pads)
        graphed = graphs(x_TH) if graphs is not None else None
        out = graphed if graphed is not None else self._rows(x_TH, num_valid_tokens)
        if self.spec.returns_router_logits:
            return out[0].view(shape), out[1]
        return out.view(shape)

    def _rows(self, x_TH: torch.Tensor, num_valid_tokens: torch.Tensor | None = None):
        """``[T, H]`` → the routed output ``[T, H]`` (and the router logits ``[T, E]`` where
        the block returns them): the eager forward, and what a decode graph captures."""
        logits_TE = self.router_logits(x_TH)
        out = self.moe(x_TH, logits_TE, num_valid_tokens=num_valid_tokens)
        return (out, logits_TE) if self.spec.returns_router_logits else out

    def capture_decode_graphs(self, sizes, **kwargs) -> DecodeGraphs:
        """Capture this block's decode forward for each bucket size (``epmoe.DecodeGraphs``;
        collective: every rank, same sizes, blocks in the same order). Afterwards a forward
        inside an agreed decode step whose largest token count fits a bucket replays its
        graph (open steps with ``graph_max_tokens=max(sizes)``); other steps run eagerly.
        Call it again after a re-plan (``rebalance``). ``kwargs``: ``DecodeGraphs``'s."""
        self.decode_graphs = None  # (a re-capture runs the eager path)
        kwargs.setdefault("dtype", self.moe.params_dtype)  # the hidden states' dtype
        self.decode_graphs = DecodeGraphs(
            self._rows, sizes, hidden_size=self.spec.hidden_size, device=self.moe.device,
            layers=[self.moe], group=self.moe.group, **kwargs,
        )  # fmt: skip
        return self.decode_graphs

    def extra_repr(self) -> str:
        return f"family={self.spec.family}, returns_router_logits={self.spec.returns_router_logits}"


# ---------------------------------------------------------------------- model surgery
def replace_moe_blocks(
    model: nn.Module,
    *,
    group: dist.ProcessGroup | None = None,
    placement: PlacementArg = "linear",
    backend: str = "auto",
    experts: str = "auto",
    config: Any = None,
    **moe_kwargs: Any,
) -> int:
    """Swap every supported MoE block of ``model`` for an ``EPMoEBlock``, in place.

    Collective: every rank of ``group`` calls it on the same model (same architecture and
    weights) and replaces the same blocks in the same order. Each replaced block's routed
    experts are released (``block.experts`` is set to ``None``), so after the call a rank
    holds only its shard of every MoE layer (plus the router and shared experts).

    Args:
        model: a transformers model (or any module containing supported blocks).
        group: the EP process group (``None``: WORLD when initialised).
        backend: the all-to-all backend of every layer, as for ``EPMoE``.
        experts: the expert kernels of every layer, as for ``EPMoE``.
        placement: ``"linear"``, ``"round_robin"``, an ``ExpertPlacement`` used for every
            layer, or a function ``qualified_block_name -> placement`` (per-layer EPLB
            placements, e.g. ``"model.layers.3.mlp"``).
        config: defaults to ``model.config`` (its text config for composite configs).
        **moe_kwargs: the other ``EPMoE`` options (``max_num_tokens``, ``dispatch_dtype``,
            ``weight_dtype``, ``micro_batches``, ...).

    Returns:
        How many blocks were replaced (at least 1).

    Raises:
        ValueError: no supported MoE block was found (the message lists the supported
            classes, and says so when the model was already converted). Blocks of other
            classes are left alone, so a model mixing supported and unsupported MoE blocks
            is converted only partly: check the returned count.
    """
    _require_transformers()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if config is None:
        config = getattr(model, "config", None)
        if config is not None and callable(getattr(config, "get_text_config", None)):
            config = config.get_text_config()
    found = [
        (name, module)
        for name, module in model.named_modules()
        if name and _family_of(module) is not None
    ]
    if not found:
        done = sum(isinstance(m, EPMoEBlock) for m in model.modules())
        note = f" (it already holds {done} EPMoEBlock(s))" if done else ""
        raise ValueError(
            f"no supported MoE block in {type(model).__name__}{note}; replace_moe_blocks "
            f"handles the transformers classes {', '.join(SUPPORTED_BLOCKS)}"
        )
    for name, block in found:
        per_layer = callable(placement) and not isinstance(placement, (str, ExpertPlacement))
        where = placement(name) if per_layer else placement
        wrapped = EPMoEBlock(
            block,
            config,
            group=group,
            placement=where,
            backend=backend,
            experts=experts,
            **moe_kwargs,
        )
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, wrapped)
        block.experts = None  # release the full expert weights now
    return len(found)


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, **kwargs) -> bool:
    """Save a model converted by ``replace_moe_blocks`` in its original Hugging Face layout.

    Every ``EPMoEBlock``'s experts are gathered in full (one copy of each logical expert,
    whatever the placement: :func:`epmoe.checkpoint.gather_full_experts`) and written,
    with the router and shared experts, under the names the unconverted block had; the
    rest of the model is saved as it is. Hugging Face's own ``model.save_pretrained(
    save_directory, state_dict=...)`` writes the files (config, generation config,
    safetensors shards; transformers 5 also writes the checkpoint's original per-expert
    names where the model defines that conversion), so ``AutoModelForCausalLM.
    from_pretrained(save_directory)`` loads the unconverted model, with the same logits,
    and ``replace_moe_blocks`` converts it again with any placement or world size. Layers
    holding FP8 experts (``weight_dtype``) are written dequantized, in the block's dtype;
    when nothing written is quantized (an FP8 checkpoint loaded by
    ``from_pretrained_sharded``), the written config leaves out ``quantization_config``.

    Collective over the blocks' EP group (all blocks must share one): every rank calls it.
    The files are written by global rank 0 (as ``transformers`` decides when
    ``torch.distributed`` is initialised); it holds the full model while writing (the
    experts gathered to it, moved to the CPU layer by layer). With several EP groups
    (data-parallel copies of the model) every rank calls it; the group that holds global
    rank 0 writes, and its ranks return once the files are written (or all raise if
    writing failed).
    ``kwargs`` go to ``model.save_pretrained`` (``max_shard_size``, ``variant``, ...;
    not ``state_dict`` or ``is_main_process``). Returns whether this rank wrote the files.

    ``model.save_pretrained(...)`` called directly on a converted model saves each rank's
    shard under epmoe's names, which ``from_pretrained`` does not read (the experts would
    be initialised at random): use this function. To reload on the same placement without
    gathering, save and load each rank's ``model.state_dict()`` (its shards are checked
    against the placement, see :mod:`epmoe.checkpoint`).
    """
    fixed = sorted({"state_dict", "is_main_process"}.intersection(kwargs))
    if fixed:
        raise TypeError(f"save_pretrained chooses {fixed} itself; do not pass them")
    if not callable(getattr(model, "save_pretrained", None)):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, EPMoEBlock)]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} holds no EPMoEBlock (it was not converted): call "
            "model.save_pretrained(save_directory) directly"
        )
    group, device = blocks[0][1].moe.group, blocks[0][1].moe.device
    if any(m.moe.group is not group for _, m in blocks):
        raise ValueError("save_pretrained needs every EPMoEBlock on the same EP group")
    lost = {n: m._hf_layout.lost for n, m in blocks if m._hf_layout.lost}
    if lost:
        raise ValueError(f"cannot save these blocks' tensors under their original names: {lost}")
    writer_rank = 0  # the EP-group rank of global rank 0 (transformers writes there)
    writes = True
    if dist.is_available() and dist.is_initialized():
        members = dist.get_process_group_ranks(group or dist.group.WORLD)
        writer_rank = members.index(0) if 0 in members else 0
        writes = dist.get_rank() == 0

    full = {}
    for name, block in blocks:  # collective: every rank, every block, in model order
        experts = gather_full_experts(block.moe, dst=writer_rank)
        if writes:
            full[name] = {k: v.cpu() for k, v in experts.items()}

    error = None
    if writes:
        try:
            state = _hf_state_dict(model, blocks, full)
            with _quantization_config_dropped(model, state):
                model.save_pretrained(save_directory, state_dict=state, **kwargs)
        except Exception as exc:  # reported on every rank below, raised here
            error = exc
    failed = error is not None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        flag = torch.tensor([int(failed)], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)  # rank 0 reports to all
        failed = bool(flag.item())
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(
            f"save_pretrained: writing {os.fspath(save_directory)!r} failed on global rank 0 "
            "(its own error says why); this rank stopped too"
        )
    return writes


@contextlib.contextmanager
def _quantization_config_dropped(
    model: nn.Module, state: dict[str, torch.Tensor]
) -> Iterator[None]:
    """Write the config without its ``quantization_config`` when no tensor of ``state`` is
    quantized: a model loaded from an FP8 checkpoint by ``from_pretrained_sharded`` runs
    (and is saved) dequantized, and a config still naming FP8 would make ``from_pretrained``
    look for scales that the files do not hold. Models whose Hugging Face layers stay
    quantized (loaded by ``from_pretrained`` with its quantizer) keep it."""
    config = getattr(model, "config", None)
    quant = getattr(config, "quantization_config", None)
    quantized = any(t.element_size() == 1 and t.is_floating_point() for t in state.values())
    if quant is None or quantized:
        yield
        return
    delattr(config, "quantization_config")
    try:
        yield
    finally:
        config.quantization_config = quant


def _hf_state_dict(
    model: nn.Module,
    blocks: list[tuple[str, EPMoEBlock]],
    full: dict[str, dict[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every ``EPMoEBlock``'s entries replaced by the Hugging
    Face block's (full experts from ``full``, the rest renamed)."""
    state = model.state_dict()
    out = {}
    wrapped = tuple(f"{name}." for name, _ in blocks)
    for key, value in state.items():
        if not key.startswith(wrapped):
            out[key] = value
    for name, block in blocks:
        layout, prefix = block._hf_layout, f"{name}."
        for key, original in layout.renamed.items():
            out[prefix + original] = state[prefix + key]
        # the correction bias the layer routes with: its own float32 copy, which
        # load_full_experts and load_state_dict update, not the router's buffer
        routing_bias = block.moe.e_score_correction_bias
        router_bias = layout.renamed.get("gate.e_score_correction_bias")
        if routing_bias is not None and router_bias is not None:
            kept = state[f"{prefix}gate.e_score_correction_bias"]
            out[prefix + router_bias] = routing_bias.detach().to(kept.dtype)
        w13, w2 = full[name]["w13"], full[name]["w2"]
        # in the layer's dtype now (the model's, also after model.to(dtype)); FP8 expert
        # weights are written dequantized (the unconverted model holds no FP8 experts)
        dtype = block.moe.params_dtype
        if "w13_scale" in full[name]:
            from epmoe.reference import dequantize_block

            w13 = dequantize_block(w13, full[name]["w13_scale"]).to(dtype)
            w2 = dequantize_block(w2, full[name]["w2_scale"]).to(dtype)
        experts = layout.expert_state(w13, w2, dtype)
        if set(experts) != layout.expert_keys:
            raise ValueError(
                f"{name}: the experts would be written as {sorted(experts)[:4]}... but the "
                f"block held {sorted(layout.expert_keys)[:4]}..."
            )
        out.update({prefix + k: v for k, v in experts.items()})
    return out


# ---------------------------------------------------------------------- loading by shard
# A routed expert's tensor in a checkpoint, after the model's renamings (per expert: the
# layout transformers 4.x models hold and transformers 5 writes back; fused: 5.x in memory).
_EXPERT_KEY = re.compile(r"^(?P<block>.+)\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
_FUSED_KEY = re.compile(r"^(?P<block>.+)\.experts\.(?P<proj>gate_up_proj|down_proj)$")
_ROLES = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": 2, "down_proj": 2}


@dataclass(frozen=True)
class ShardLoadReport:
    """What one rank read from a checkpoint in ``load_sharded``.

    Counted by the ``CheckpointReader``, once per tensor read: an FP8 weight and its
    ``weight_scale_inv`` count as two, and a fused expert tensor (``experts.gate_up_proj``
    / ``experts.down_proj``) counts once, however many local experts' rows are sliced from
    it. ``tensors_read`` = ``expert_tensors_read + other_tensors_read``. ``local_experts``:
    per converted block, the logical experts loaded on this rank (each once, replicas
    included). ``expert_tensors_skipped``: expert tensors never read (other ranks' experts).
    ``unused_keys``: checkpoint keys the model has no place for (not read either; e.g.
    DeepSeek-V3's multi-token-prediction layer).
    """

    path: str
    tensors_read: int
    expert_tensors_read: int
    other_tensors_read: int
    expert_tensors_skipped: int
    local_experts: dict[str, tuple[int, ...]]
    unused_keys: tuple[str, ...]


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside register their parameters on the meta device; buffers are
    built for real (rotary ``inv_freq`` and the like are computed, not read from files)."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(
                param.to("meta"), requires_grad=param.requires_grad
            )

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _fp32_names(model: nn.Module, dtype: torch.dtype) -> Callable[[str], bool]:
    """Whether a parameter stays in float32 when the model runs in ``dtype``, as transformers
    decides when loading: ``_keep_in_fp32_modules`` for float16, ``_keep_in_fp32_modules_strict``
    for float16 and bfloat16 (DeepSeek-V3 / GLM-4-MoE: the router's ``gate.weight``). Patterns
    match whole dotted components of the name, ``*`` matching anything."""
    patterns: set[str] = set()
    for module in model.modules():
        if dtype == torch.float16:
            patterns.update(getattr(module, "_keep_in_fp32_modules", None) or ())
        if dtype in (torch.float16, torch.bfloat16):
            patterns.update(getattr(module, "_keep_in_fp32_modules_strict", None) or ())
    if not patterns:
        return lambda name: False
    alternation = "|".join(re.escape(p).replace(r"\*", ".*") for p in sorted(patterns))
    regex = re.compile(rf"(?:^|\.)(?:{alternation})(?:\.|$)")
    return lambda name: regex.search(name) is not None


def _meta_tensors(model: nn.Module) -> tuple[list[str], list[str]]:
    """Names of the model's tensors on the meta device: (parameters and persistent buffers,
    which a checkpoint holds; non-persistent buffers, which it does not)."""
    held, computed = [], []
    for mname, module in model.named_modules():
        prefix = f"{mname}." if mname else ""
        for name, p in module._parameters.items():
            if p is not None and p.device.type == "meta":
                held.append(prefix + name)
        for name, b in module._buffers.items():
            if b is not None and b.device.type == "meta":
                lost = name in module._non_persistent_buffers_set
                (computed if lost else held).append(prefix + name)
    return held, computed


def _computed_on_meta(names: list[str]) -> ValueError:
    return ValueError(
        f"{len(names)} buffer(s) of the model are on the meta device and are not saved in "
        f"checkpoints ({names[:4]}{' ...' * (len(names) > 4)}; computed when the model is "
        "built, e.g. rotary inv_freq): build the model with only its parameters on meta, the "
        "buffers real (e.g. accelerate's init_empty_weights(); from_pretrained_sharded does)"
    )


def _materialise(model: nn.Module, device: torch.device, dtype: torch.dtype | None = None) -> None:
    """Give every meta parameter and persistent meta buffer empty storage on ``device`` (tied
    parameters stay tied) and move the other buffers there. Floating parameters take
    ``dtype`` (None: keep their own), except those transformers keeps in float32
    (``_keep_in_fp32_modules[_strict]``). Raises ``ValueError`` for a non-persistent buffer
    on meta (no checkpoint holds it)."""
    _, computed = _meta_tensors(model)
    if computed:
        raise _computed_on_meta(computed)
    keep_fp32 = _fp32_names(model, dtype) if dtype is not None else (lambda name: False)
    made: dict[int, nn.Parameter] = {}
    for mname, module in model.named_modules():
        prefix = f"{mname}." if mname else ""
        for name, p in list(module._parameters.items()):
            if p is None or p.device.type != "meta":
                continue
            if id(p) not in made:
                kind = p.dtype
                if dtype is not None and p.is_floating_point():
                    kind = torch.float32 if keep_fp32(prefix + name) else dtype
                empty = torch.empty(p.shape, dtype=kind, device=device)
                made[id(p)] = nn.Parameter(empty, requires_grad=p.requires_grad)
            module._parameters[name] = made[id(p)]
        for name, b in list(module._buffers.items()):
            if b is None:
                continue
            if b.device.type == "meta":
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
            else:
                module._buffers[name] = b.to(device)


def _weight_block_size(config) -> tuple[int, int] | None:
    """``config.quantization_config.weight_block_size`` (a dict or a transformers
    quantization config), or None where the config names none."""
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return None
    size = quant.get("weight_block_size") if isinstance(quant, dict) else None
    if size is None and not isinstance(quant, dict):
        size = getattr(quant, "weight_block_size", None)
    if size is None:
        return None
    if len(size) != 2 or not all(isinstance(v, int) and v > 0 for v in size):
        raise ValueError(f"quantization_config.weight_block_size must be [N, K], got {size!r}")
    return int(size[0]), int(size[1])


def _checkpoint_renamer(model: nn.Module) -> Callable[[str], str]:
    """Checkpoint key → the model's key, with the renamings transformers 5 applies when
    loading (Mixtral: ``block_sparse_moe`` → ``mlp``). Its converters (stacking experts)
    are not applied: epmoe reads experts one by one. transformers 4.x: keys as they are.

    Uses only what every transformers 5 release has (``get_model_conversion_mapping`` and
    ``WeightRenaming.rename_source_key``; 5.17 lacks the ``apply_renamings`` helper of
    later releases), so real Mixtral checkpoints (``block_sparse_moe.gate``) load on all."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:
        return lambda key: key
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]

    def rename(key: str) -> str:
        for renaming in renamings:
            key = renaming.rename_source_key(key)[0]
        return key

    return rename


def _shape_message(key, block, expert, proj, got, want) -> str:
    which = f"expert {expert}'s {proj}" if expert is not None else f"the experts' {proj}"
    return (
        f"{key}: the checkpoint holds {which} of {block} as {list(got)}, the layer wants "
        f"{list(want)} (H = hidden size, I = moe intermediate size); is the config the "
        "checkpoint's?"
    )


def _check_expert_part(key, block, expert, proj, got, moe) -> None:
    """Refuse a routed expert's projection whose shape is not the layer's, naming it."""
    H, I = moe.hidden_size, moe.intermediate_size
    want = [H, I] if _ROLES[proj] == 2 else [I, H]  # (down: [H, I]; gate, up: [I, H])
    if list(got) != want:
        raise ValueError(_shape_message(key, block, expert, proj, got, want))


def _resolve(name: str, targets: dict, prefix: str | None) -> str | None:
    """``name`` in ``targets``, allowing for a checkpoint saved with or without the base
    model's prefix (``model.``)."""
    if name in targets:
        return name
    if prefix:
        if f"{prefix}.{name}" in targets:
            return f"{prefix}.{name}"
        if name.startswith(prefix + ".") and name[len(prefix) + 1 :] in targets:
            return name[len(prefix) + 1 :]
    return None


@torch.no_grad()
def load_sharded(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    device: torch.device | str | None = None,
    weight_block_size: tuple[int, int] | None = None,
) -> ShardLoadReport:
    """Fill a model converted by ``replace_moe_blocks`` from a safetensors checkpoint in
    the Hugging Face layout, reading on this rank only its local experts' tensors.

    Every tensor outside the routed experts (embeddings, attention, norms, routers and
    their correction biases, shared experts) is read once and copied into the model
    (cast to its dtype); of each ``EPMoEBlock``'s routed experts, only those in
    ``moe.local_experts`` are read (per expert: ``gate_proj``/``w1``, ``up_proj``/``w3``,
    ``down_proj``/``w2``, each ``[I, H]`` or ``[H, I]``; fused ``experts.gate_up_proj``
    ``[E, 2I, H]`` / ``experts.down_proj [E, H, I]``: the local rows only) and loaded with
    ``moe.load_expert``. FP8 weights with a ``weight_scale_inv`` are dequantised while
    loading. Checkpoint keys are renamed as transformers 5 does when loading.

    Args:
        model: converted with ``replace_moe_blocks(..., defer_expert_loading=True,
            device=...)`` (or with its experts loaded already: they are overwritten).
        path: the checkpoint directory (or one ``.safetensors`` file).
        device: the one passed to ``replace_moe_blocks``: give the model's meta parameters
            and persistent meta buffers empty storage there first (each in its own dtype)
            and move the other buffers there. Without
            it, a tensor on the meta device raises ``ValueError``: copying into it would
            do nothing. Non-persistent buffers (rotary ``inv_freq``) cannot come from a
            checkpoint and must not be on meta either way.
        weight_block_size: ``(N, K)`` of the FP8 block scales; default the model config's
            ``quantization_config.weight_block_size``, else 128×128.

    Not collective: each rank reads its own tensors. Raises ``ValueError`` when a model
    tensor is on the meta device (see ``device``), a model tensor or a local expert is
    missing from the checkpoint or a shape differs (the model would otherwise run on
    uninitialised memory).
    """
    blocks = {n: m for n, m in model.named_modules() if isinstance(m, EPMoEBlock)}
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} holds no EPMoEBlock: convert it with replace_moe_blocks "
            "first (or use from_pretrained_sharded)"
        )
    if device is not None:
        _materialise(model, torch.device(device))
    held, computed = _meta_tensors(model)
    if computed:
        raise _computed_on_meta(computed)
    if held:
        raise ValueError(
            f"{len(held)} parameter(s)/buffer(s) of the model are on the meta device "
            f"({held[:4]}{' ...' * (len(held) > 4)}); copying into them would do nothing. "
            "Pass device= (load_sharded gives them storage there) or use "
            "from_pretrained_sharded"
        )
    if weight_block_size is None:
        weight_block_size = _weight_block_size(getattr(model, "config", None))
    block_size = tuple(weight_block_size) if weight_block_size is not None else (128, 128)
    state = model.state_dict(keep_vars=True)
    inside = tuple(f"{n}." for n in blocks)
    targets = {k: t for k, t in state.items() if not k.startswith(inside)}
    for n, block in blocks.items():
        for key, original in block._hf_layout.renamed.items():
            targets[f"{n}.{original}"] = state[f"{n}.{key}"]
    local = {n: sorted(set(b.moe.local_experts)) for n, b in blocks.items()}
    rename = _checkpoint_renamer(model)
    prefix = getattr(model, "base_model_prefix", None)
    # checkpoint block name → block name: the model's, or with / without the base model's
    # prefix (a causal LM's checkpoint into the base model, or the reverse; as _resolve)
    block_of = {}
    for n in blocks:
        block_of[n] = n
        if prefix and n.startswith(prefix + "."):
            block_of[n[len(prefix) + 1 :]] = n
        elif prefix:
            block_of[f"{prefix}.{n}"] = n

    filled: set[int] = set()
    pending: dict[tuple[str, int], list] = {}  # (block, expert) → [gate, up, down]
    expert_keys: set[str] = set()  # every routed-expert tensor of the checkpoint (+ scales)
    loaded: dict[str, set[int]] = {n: set() for n in blocks}  # local experts read this call
    unused = []
    with CheckpointReader(path) as reader:
        for key in reader.tensor_names():
            if key.endswith(SCALE_SUFFIX) and key[: -len(SCALE_SUFFIX)] in reader:
                continue  # read with its weight
            name = rename(key)
            scale = key + SCALE_SUFFIX
            m = _EXPERT_KEY.match(name)
            if m and m["block"] in block_of:
                n, j = block_of[m["block"]], int(m["expert"])
                expert_keys.update(k for k in (key, scale) if k in reader)
                if m["proj"] not in _ROLES:
                    raise ValueError(f"{key}: unknown expert projection {m['proj']!r}")
                if j not in local[n]:
                    continue
                parts = pending.setdefault((n, j), [None, None, None])
                dev = blocks[n].moe.device  # dequantised (and requantised) there
                part = reader.get_weight(key, block=block_size, device=dev)
                _check_expert_part(key, n, j, m["proj"], list(part.shape), blocks[n].moe)
                parts[_ROLES[m["proj"]]] = part
                if all(p is not None for p in parts):
                    gate, up, down = pending.pop((n, j))
                    blocks[n].moe.load_expert(j, torch.cat([gate, up], dim=0), down)
                    loaded[n].add(j)
                continue
            m = _FUSED_KEY.match(name)
            if m and m["block"] in block_of:
                n = block_of[m["block"]]
                expert_keys.add(key)
                if scale in reader:
                    raise ValueError(f"{key}: FP8 fused expert tensors are not supported")
                stacked = reader.slice(key)
                E_, *each = stacked.get_shape()
                E = blocks[n].moe.num_experts
                if E_ != E:
                    raise ValueError(
                        f"{key}: the checkpoint holds {E_} experts of {[E_, *each]}, the "
                        f"model's {n} has {E}; is the config the checkpoint's?"
                    )
                if m["proj"] == "down_proj":
                    _check_expert_part(key, n, None, "down_proj", each, blocks[n].moe)
                else:  # (gate and up stacked: [E, 2I, H])
                    moe = blocks[n].moe
                    want = [2 * moe.intermediate_size, moe.hidden_size]
                    if each != want:
                        raise ValueError(_shape_message(key, n, None, "gate_up_proj", each, want))
                for j in local[n]:
                    parts = pending.setdefault((n, j), [None, None, None])
                    if m["proj"] == "down_proj":
                        parts[2] = stacked[j]
                    else:
                        I2 = stacked.get_shape()[1]
                        parts[0], parts[1] = stacked[j, : I2 // 2], stacked[j, I2 // 2 :]
                    if all(p is not None for p in parts):
                        gate, up, down = pending.pop((n, j))
                        blocks[n].moe.load_expert(j, torch.cat([gate, up], dim=0), down)
                        loaded[n].add(j)
                continue
            target = _resolve(name, targets, prefix)
            if target is None:
                unused.append(key)
                continue
            t = targets[target]
            value = reader.get_weight(key, block=block_size, device=t.device)
            if tuple(value.shape) != tuple(t.shape):
                raise ValueError(
                    f"{key}: the checkpoint holds {list(value.shape)}, the model's {target} is "
                    f"{list(t.shape)}; is the config the checkpoint's?"
                )
            t.copy_(value)
            filled.add(id(t))
        reads = reader.reads  # the one read counter (see ShardLoadReport)
    missing = sorted(k for k, t in targets.items() if id(t) not in filled)
    if missing:
        raise ValueError(
            f"the checkpoint at {os.fspath(path)} lacks {len(missing)} tensor(s) of the model: "
            f"{missing[:6]}{' ...' * (len(missing) > 6)}"
        )
    for n, block in blocks.items():
        # (what this call read: experts loaded before it would hide a missing one)
        lacking = sorted(set(local[n]) - loaded[n])
        if lacking:
            partly = sorted({j for (b, j) in pending if b == n})
            partly_note = f" ({partly} only in part)" if partly else ""
            raise ValueError(
                f"{n}: the checkpoint at {os.fspath(path)} lacks some of this rank's experts: "
                f"{lacking} of {local[n]}{partly_note}; is it a checkpoint of this model?"
            )
        bias = getattr(block.gate, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor) and block.moe.e_score_correction_bias is not None:
            block.moe.e_score_correction_bias.copy_(bias)  # EPMoE holds its own float32 copy
    expert_reads = sum(reads[k] for k in expert_keys)
    return ShardLoadReport(
        path=os.fspath(path),
        tensors_read=sum(reads.values()),
        expert_tensors_read=expert_reads,
        other_tensors_read=sum(reads.values()) - expert_reads,
        expert_tensors_skipped=sum(reads[k] == 0 for k in expert_keys),
        local_experts={n: tuple(v) for n, v in local.items()},
        unused_keys=tuple(unused),
    )


def _config_dtype(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        return torch.float32
    if dtype.itemsize == 1:  # an FP8 checkpoint: run in bfloat16, dequantised while loading
        return torch.bfloat16
    return dtype


def from_pretrained_sharded(
    pretrained: str | os.PathLike,
    *,
    model_class: Any = None,
    config: Any = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    group: dist.ProcessGroup | None = None,
    placement: PlacementArg = "linear",
    backend: str = "auto",
    experts: str = "auto",
    **moe_kwargs: Any,
) -> nn.Module:
    """Build a Hugging Face model converted by ``replace_moe_blocks`` and load it from a
    local safetensors checkpoint by shard: each rank reads its own experts only.

    The model is built from ``config`` with its parameters on the meta device (nothing
    allocated), its MoE blocks are replaced by ``EPMoEBlock``s holding empty shards of this
    rank's experts, the other parameters get storage on ``device``, and
    :func:`load_sharded` fills everything from the files. Peak memory per rank: the
    non-expert weights plus its own experts; no rank ever holds another rank's experts.

    Collective over ``group`` (the conversion is): every rank calls it with the same
    arguments. Reading is local, so the files must be visible to every rank (a shared or
    copied directory). The ranks agree (a small all-reduce over ``group``) after building
    the model and after loading it, so a rank that fails (a missing directory, a config
    that does not load, a checkpoint that lacks a tensor) raises its own error while every
    other rank raises ``RuntimeError``, instead of some waiting in a collective.

    Args:
        pretrained: a directory with ``config.json`` and ``model.safetensors`` (or
            ``model.safetensors.index.json`` and its shards), as ``save_pretrained``
            writes it.
        model_class: a transformers class with ``from_config`` (default
            ``AutoModelForCausalLM``) or a model class taking the config.
        config: default ``AutoConfig.from_pretrained(pretrained)``.
        dtype: of the model's floating-point parameters and the experts; default the
            config's (bfloat16 for an FP8 checkpoint, which is dequantised while loading,
            in blocks of the config's ``quantization_config.weight_block_size``), else
            float32. Parameters transformers keeps in float32 (``_keep_in_fp32_modules``
            for float16, ``_keep_in_fp32_modules_strict`` for float16 and bfloat16: the
            DeepSeek-V3 / GLM-4-MoE router ``gate.weight``) stay in float32.
        device: where the model runs; default :func:`epmoe.distributed.default_device`
            of ``group`` (CPU with gloo, this rank's current GPU with NCCL).
        group: as for ``replace_moe_blocks``.
        placement: as for ``replace_moe_blocks``.
        backend: as for ``replace_moe_blocks``.
        experts: as for ``replace_moe_blocks``.
        **moe_kwargs: as for ``replace_moe_blocks``, except what this function sets
            itself: the experts' dtype is ``dtype``, their device ``device``.

    Returns:
        The model in eval mode; ``model.shard_load_report`` is this rank's
        :class:`ShardLoadReport`.
    """
    owned = {"params_dtype": "dtype=", "device": "device=", "defer_expert_loading": None}
    for name in owned.keys() & moe_kwargs.keys():  # (same arguments on every rank)
        fix = f"pass {owned[name]} instead" if owned[name] else "it loads the experts itself"
        raise TypeError(f"from_pretrained_sharded sets {name} of the MoE blocks: {fix}")
    _require_transformers()
    error: BaseException | None = None
    try:  # local steps: a rank that fails here must not leave the others in the conversion
        transformers = importlib.import_module("transformers")
        if not os.path.isdir(os.fspath(pretrained)):
            raise FileNotFoundError(
                f"from_pretrained_sharded reads a local checkpoint directory; {pretrained!r} "
                "is not one (download it first, e.g. huggingface_hub.snapshot_download)"
            )
        if config is None:
            config = transformers.AutoConfig.from_pretrained(pretrained)
        model_class = model_class or transformers.AutoModelForCausalLM
        dtype = dtype or _config_dtype(config)
        device = default_device(group) if device is None else normalize_device(device)
        block_size = _weight_block_size(config)
        with _parameters_on_meta():
            if hasattr(model_class, "from_config"):
                model = model_class.from_config(config)
            else:
                model = model_class(config)
        model.eval()
    except Exception as exc:
        error = exc
    _agree(error, group, "building the model")
    replace_moe_blocks(
        model,
        group=group,
        placement=placement,
        backend=backend,
        experts=experts,
        defer_expert_loading=True,
        device=device,
        params_dtype=dtype,
        **moe_kwargs,
    )
    try:  # not collective either: agree before returning
        _materialise(model, device, dtype)
        model.shard_load_report = load_sharded(model, pretrained, weight_block_size=block_size)
    except Exception as exc:
        error = exc
    _agree(error, group, "loading the checkpoint")
    return model


def _agree(error: BaseException | None, group: dist.ProcessGroup | None, step: str) -> None:
    """Every rank of ``group`` learns whether any failed ``step`` (an all-reduce of an ok
    flag), so that all raise together instead of some waiting in the next collective: the
    failing rank its own error, the others ``RuntimeError``. Nothing to agree on without an
    initialised process group."""
    if dist.is_available() and dist.is_initialized():
        flag = torch.tensor([int(error is None)], dtype=torch.int64, device=default_device(group))
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        ok = bool(flag.item())
    else:
        ok = error is None
    if error is not None:
        raise error
    if not ok:
        raise RuntimeError(
            f"from_pretrained_sharded: another rank of the group failed {step} (its own error "
            "is raised there); every rank stops here"
        )
