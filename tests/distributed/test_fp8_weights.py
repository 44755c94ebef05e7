"""EPMoE with FP8 expert weights on 2 and 3 gloo ranks (NCCL with EPMOE_TEST_DEVICE=cuda):
every backend × layout × placement against the oracle on the dequantised weights, an
EPLB re-plan moving FP8 weights and scales, full experts with scales between placements.

One sweep per world size (rank bodies in ``tests/distributed/fp8_weights_cases.py``).
"""

from __future__ import annotations

import pytest

from tests.distributed import fp8_weights_cases
from tests.harness import requires_world, run_on_ranks
from tests.harness import test_device as device_under_test

WORLDS = [2, 3]


EXPERTS = ["torch", "triton"] if device_under_test() == "cuda" else ["torch"]


@pytest.mark.parametrize("experts", EXPERTS)
@pytest.mark.parametrize("world", WORLDS, ids=[f"W={w}" for w in WORLDS])
def test_fp8_weights(world, experts):
    requires_world(world)
    dtype = "bfloat16" if device_under_test() == "cuda" else "float32"
    passed = run_on_ranks(
        fp8_weights_cases.check_fp8_weights, world, device_under_test(), dtype, experts
    )
    cases_per_scale = 3 * 3 + 2  # backends × placements, the re-plan, the full experts
    assert passed == [2 * cases_per_scale] * world, passed
