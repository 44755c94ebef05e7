"""Expert-parallel load balancing: record load, re-plan placements, move weights.

``recorder`` counts tokens per physical expert on the device; ``algorithm`` turns measured
load into placements with redundant replicas (DeepSeek's hierarchical policy, global
fallback, migration-aware); ``migration`` moves only the expert weights whose slots change;
``manager`` runs the cycle over all MoE layers of a model while serving.
"""

from epmoe.eplb.algorithm import balancedness, gpu_loads, logical_to_physical, rebalance
from epmoe.eplb.recorder import LoadRecorder, logical_load

__all__ = [
    "LoadRecorder",
    "balancedness",
    "gpu_loads",
    "logical_load",
    "logical_to_physical",
    "rebalance",
]
