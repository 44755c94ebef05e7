"""epmoe: an expert-parallel Mixture-of-Experts runtime for inference on torch.distributed.

Data flow of one MoE layer on every rank: route → place → dispatch → experts → combine.
The public names below are loaded on first use, so ``import epmoe`` touches no GPU,
network or environment variable and stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "select_experts": "epmoe.routing",
    "RoutingSimulator": "epmoe.routing",
    "ExpertPlacement": "epmoe.placement",
    "EPMoE": "epmoe.layer",
    "init_distributed": "epmoe.distributed",
    "available_backends": "epmoe.comm",
    "Layout": "epmoe.comm.base",
    "DispatchResult": "epmoe.comm.base",
    "reference": "epmoe.reference",
    "checkpoint": "epmoe.checkpoint",
    "EPLBManager": "epmoe.eplb.manager",
    "step": "epmoe.step_context",
    "StepContext": "epmoe.step_context",
    "current_step": "epmoe.step_context",
    "DecodeGraphs": "epmoe.decode_graphs",
}

__all__ = [
    "DecodeGraphs",
    "DispatchResult",
    "EPLBManager",
    "EPMoE",
    "ExpertPlacement",
    "Layout",
    "RoutingSimulator",
    "StepContext",
    "__version__",
    "available_backends",
    "checkpoint",
    "current_step",
    "init_distributed",
    "reference",
    "select_experts",
    "step",
]

if TYPE_CHECKING:  # pragma: no cover
    from epmoe import checkpoint, reference
    from epmoe.comm import available_backends
    from epmoe.comm.base import DispatchResult, Layout
    from epmoe.decode_graphs import DecodeGraphs
    from epmoe.distributed import init_distributed
    from epmoe.eplb.manager import EPLBManager
    from epmoe.layer import EPMoE
    from epmoe.placement import ExpertPlacement
    from epmoe.routing import RoutingSimulator, select_experts
    from epmoe.step_context import StepContext, current_step, step


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'epmoe' has no attribute {name!r}")
    mod = importlib.import_module(module)
    value = mod if module.endswith(name) else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
