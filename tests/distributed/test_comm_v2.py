"""Comm contract v2 on the portable backends, W = 1, 2, 3 ranks (gloo on CPU; NCCL with
EPMOE_TEST_DEVICE=cuda): exact delivery and oracle results with and without FP8 dispatch,
split phase with two micro-batches in flight, and ``rebind``.

Each test is one task per world size in the harness's reused rank pool; the rank bodies
(``tests/distributed/comm_cases.py``) sweep their cases and list every failing one.
"""

from __future__ import annotations

import pytest

from tests.distributed import comm_cases
from tests.harness import requires_world, run_on_ranks
from tests.harness import test_device as device_under_test

WORLDS = [1, 2, 3]
IDS = [f"W={w}" for w in WORLDS]


def _dtype() -> str:
    return "bfloat16" if device_under_test() == "cuda" else "float32"


@pytest.mark.parametrize("world", WORLDS, ids=IDS)
def test_delivery_and_oracle_with_and_without_fp8(world):
    requires_world(world)
    passed = run_on_ranks(comm_cases.check_oracle_and_fp8, world, device_under_test(), _dtype())
    assert passed[0] > 0


@pytest.mark.parametrize("world", WORLDS, ids=IDS)
def test_fp8_dispatch_into_torch_experts(world):
    requires_world(world)
    run_on_ranks(comm_cases.check_fp8_with_torch_experts, world, device_under_test(), _dtype())


@pytest.mark.parametrize("world", WORLDS, ids=IDS)
def test_two_micro_batches_in_flight(world):
    requires_world(world)
    run_on_ranks(comm_cases.check_in_flight, world, device_under_test(), _dtype())


@pytest.mark.parametrize("world", WORLDS, ids=IDS)
def test_rebind_serves_the_new_placement(world):
    requires_world(world)
    run_on_ranks(comm_cases.check_rebind, world, device_under_test(), _dtype())
