"""EPMoE on comm contract v2, on W ranks (gloo on CPU; NCCL with EPMOE_TEST_DEVICE=cuda).

One sweep per world size (rank bodies in ``tests/distributed/layer_v2_cases.py``): the
graph-safe forward enters no agreement, the shared experts overlap the first dispatch,
FP8 dispatch from ``dispatch_dtype``, and a re-plan rebinds the backend instead of
rebuilding it. Every case also compares the output with the oracle.
"""

from __future__ import annotations

import pytest

from tests.distributed import layer_v2_cases
from tests.harness import requires_world, run_on_ranks
from tests.harness import test_device as device_under_test

WORLDS = [2, 3]


@pytest.mark.parametrize("world", WORLDS, ids=[f"W={w}" for w in WORLDS])
def test_layer_on_comm_contract_v2(world):
    requires_world(world)
    dtype = "bfloat16" if device_under_test() == "cuda" else "float32"
    run_on_ranks(layer_v2_cases.check_layer_v2, world, device_under_test(), dtype)
