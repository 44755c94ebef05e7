"""Expert-parallel load balancing: record load, re-plan placements, move weights.

``recorder`` counts tokens per physical expert on the device; ``algorithm`` turns measured
load into placements with redundant replicas (DeepSeek's hierarchical policy, global
fallback, migration-aware); ``migration`` moves only the expert weights whose slots change;
``manager`` runs the cycle over all MoE layers of a model while serving.
"""

from __future__ import annotations

import importlib
from typing import Any

from epmoe.eplb.algorithm import balancedness, gpu_loads, logical_to_physical, rebalance
from epmoe.eplb.recorder import LoadRecorder, logical_load

# migration and manager import the layer's collaborators; load them on first use so that
# importing epmoe.eplb (which the layer does) stays free of cycles.
_LAZY = {
    "EPLBManager": "epmoe.eplb.manager",
    "RebalanceReport": "epmoe.eplb.manager",
    "MigrationStats": "epmoe.eplb.migration",
    "migrate_slots": "epmoe.eplb.migration",
    "rebalance_layer": "epmoe.eplb.migration",
}

__all__ = [
    "EPLBManager",
    "LoadRecorder",
    "MigrationStats",
    "RebalanceReport",
    "balancedness",
    "gpu_loads",
    "logical_load",
    "logical_to_physical",
    "migrate_slots",
    "rebalance",
    "rebalance_layer",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'epmoe.eplb' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
