"""EPMoE on W ranks (gloo on CPU; NCCL with EPMOE_TEST_DEVICE=cuda) against the oracle.

Each test runs one sweep per world size inside one process group and lists every failing
case at the end (see ``tests/distributed/cases.py`` for the rank bodies).
"""

from __future__ import annotations

import pytest

from tests.distributed import cases
from tests.harness import requires_world, run_on_ranks, world_ids, world_sizes
from tests.harness import test_device as device_under_test

WORLDS = world_sizes([1, 2, 3, 4])  # EPMOE_TEST_WORLDS=8 on an 8-GPU machine


def _dtype() -> str:
    return "bfloat16" if device_under_test() == "cuda" else "float32"


@pytest.mark.parametrize("world", WORLDS, ids=world_ids(WORLDS))
def test_layer_matches_oracle(world):
    requires_world(world)
    run_on_ranks(cases.check_layer_against_oracle, world, device_under_test(), _dtype())


@pytest.mark.parametrize("world", [1, 3], ids=["W=1", "W=3"])
def test_chunking_with_uneven_chunk_counts(world):
    requires_world(world)
    run_on_ranks(cases.check_chunking, world, device_under_test(), _dtype())


@pytest.mark.parametrize("world", [2], ids=["W=2"])
def test_routing_and_activation_variants(world):
    requires_world(world)
    run_on_ranks(cases.check_variants, world, device_under_test(), _dtype())


@pytest.mark.parametrize("world", world_sizes([1, 2, 4]), ids=world_ids(world_sizes([1, 2, 4])))
def test_dispatch_delivers_exactly(world):
    requires_world(world)
    run_on_ranks(cases.check_exact_dispatch, world, device_under_test())


@pytest.mark.parametrize("world", [2], ids=["W=2"])
def test_bad_inputs_raise_clearly(world):
    requires_world(world)
    run_on_ranks(cases.check_bad_inputs, world, device_under_test())


@pytest.mark.parametrize("world", [1, 2], ids=["W=1", "W=2"])
def test_layer_with_triton_experts(world):
    """The same sweep with the Triton batched-expert kernels (the interpreter on CPU)."""
    requires_world(world)
    run_on_ranks(
        cases.check_layer_against_oracle, world, device_under_test(), _dtype(), experts="triton"
    )
