"""The comm conformance suite, generated from the backend registry: every registered
backend (``epmoe.comm.backend_names()``, no hand-kept list) in every layout it declares,
on W = 1 to 4 ranks (``EPMOE_TEST_WORLDS`` for others; gloo on CPU; NCCL and CUDA
tensors with EPMOE_TEST_DEVICE=cuda):
exact delivery for its layout (tokens rebuilt from every rank's seed; FP8 bit for bit),
the combined output against the oracle with and without FP8 dispatch (where the backend
offers it) on the blocking and the split path, zero-token ranks, skewed routing (all to
one expert, all to one rank), T = M_max, four two-micro-batch schedules (where it holds
two results), FP8 into the torch experts, ``rebind``, CUDA-graph replays (where it claims
graph safety, on GPUs) and EPMoE end to end (Triton experts on GPUs). A backend that
cannot run here is skipped with the reason ``epmoe.available_backends`` gives
(``symm_ll``, ``symm_ht``: CUDA; adapters: their package).

Each test is one task per (backend, world size) in the harness's reused rank pool; the
rank bodies (``tests/distributed/comm_cases.py``) sweep their cases and list every
failing one.
"""

from __future__ import annotations

import pytest

import epmoe
from epmoe.comm import backend_names
from epmoe.distributed import normalize_device
from tests.distributed import comm_cases
from tests.harness import requires_world, run_on_ranks, world_sizes
from tests.harness import test_device as device_under_test

# world sizes: 1-4 by default (gloo runs 4 ranks on 2 cores); EPMOE_TEST_WORLDS="8" on larger
# machines (the same cases; NCCL ranks beyond the GPUs skip)
WORLDS = world_sizes([1, 2, 3, 4])
# the registry (a new backend joins the suite by registering), then option variants
BACKENDS = backend_names() + comm_cases.variants(backend_names())


def _dtype() -> str:
    return "bfloat16" if device_under_test() == "cuda" else "float32"


def _usable(backend: str, world: int) -> None:
    """Skip (with its reason) a backend that cannot run on the device under test, for a
    reason that no process group changes (no CUDA, a package missing). The adapters also
    refuse a process without torch.distributed, which this parent is: the ranks decide
    that with their live group (``comm_cases.usable_here``), or the suite would skip them
    on every machine."""
    requires_world(world)
    device = "cuda:0" if device_under_test() == "cuda" else "cpu"
    why = epmoe.available_backends(normalize_device(device))[comm_cases.split_variant(backend)[0]]
    if why is not None and "needs torch.distributed" not in why:
        pytest.skip(f"{backend}: {why}")


def _run(body, backend, world):
    _usable(backend, world)
    return run_on_ranks(body, world, backend, device_under_test(), _dtype())


parametrize = pytest.mark.parametrize(
    ("backend", "world"),
    [(b, w) for b in BACKENDS for w in WORLDS],
    ids=[f"{b}-W={w}" for b in BACKENDS for w in WORLDS],
)


@parametrize
def test_delivery_and_oracle_with_and_without_fp8(backend, world):
    passed = _run(comm_cases.check_oracle_and_fp8, backend, world)
    assert passed[0] > 0


@parametrize
def test_fp8_dispatch_into_torch_experts(backend, world):
    if not comm_cases.caps_of(backend).fp8_dispatch:
        pytest.skip(f"{backend} offers no FP8 dispatch")
    _run(comm_cases.check_fp8_with_torch_experts, backend, world)


@parametrize
def test_two_micro_batches_in_flight(backend, world):
    in_flight = comm_cases.caps_of(backend).max_in_flight
    if in_flight is not None and in_flight < 2:
        pytest.skip(f"{backend} holds {in_flight} dispatch result at a time")
    _run(comm_cases.check_in_flight, backend, world)


@parametrize
def test_rebind_serves_the_new_placement(backend, world):
    _run(comm_cases.check_rebind, backend, world)


@parametrize
def test_skewed_routing_and_full_buffers(backend, world):
    _run(comm_cases.check_skewed_and_full, backend, world)


@parametrize
def test_graph_replay_where_claimed(backend, world):
    if not comm_cases.caps_of(backend).graph_safe:
        pytest.skip(f"{backend} does not claim graph safety")
    _run(comm_cases.check_graph_replay, backend, world)


@parametrize
def test_layer_end_to_end(backend, world):
    _run(comm_cases.check_layer_end_to_end, backend, world)


def test_our_backends_are_usable_where_the_suite_runs():
    """The suite skips a backend that cannot run here: on GPUs ours must not be skipped (a
    broken import would otherwise show as skips, not failures)."""
    if device_under_test() == "cuda":
        usable = epmoe.available_backends(normalize_device("cuda:0"))
        for name in ("symm_ll", "symm_ht", "all_to_all", "naive"):
            assert usable[name] is None, f"{name}: {usable[name]}"
    else:
        usable = epmoe.available_backends(normalize_device("cpu"))
        assert usable["all_to_all"] is None and usable["naive"] is None, usable


def test_the_parent_leaves_the_process_group_checks_to_the_ranks(monkeypatch):
    """An adapter refuses a process without torch.distributed (the parent); a missing
    package is refused in the parent already."""
    reasons = {
        "deepep_ht": "DeepEP needs torch.distributed initialised with 2, 4 or 8 NCCL ranks",
        "pplx": "pplx-kernels is not installed: pip install ...",
    }
    monkeypatch.setattr(epmoe, "available_backends", lambda device=None: reasons)
    _usable("deepep_ht(worst_case_rows=True)", 1)  # not skipped here
    with pytest.raises(pytest.skip.Exception, match="pplx: pplx-kernels is not installed"):
        _usable("pplx", 1)
