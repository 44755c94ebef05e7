"""Shared pytest setup: the Triton interpreter on CPU, the ``gpu`` marker, rank pools.

``EPMOE_TEST_DEVICE=cuda`` runs the GPU tier (NCCL ranks, CUDA tensors); without it every
test runs on CPU, multi-process tests with gloo. See ``tests/harness.py`` for how to write a
distributed test.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from tests.harness import shutdown_pools, test_device

# Test modules pytest's collection reached in this session (collected or skipped at module
# level), relative to the repository root: tests/unit/test_collection.py compares them with
# the files on disk, so a folder pytest silently skips (``dist``, ``build``, …) fails CI.
COLLECTED_MODULES: set[str] = set()


def pytest_configure(config: pytest.Config) -> None:
    if not torch.cuda.is_available():  # before any test module imports triton
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if test_device() == "cuda":
            raise pytest.UsageError(
                "EPMOE_TEST_DEVICE=cuda but torch.cuda.is_available() is False: unset it to "
                "run the CPU tier, or run on a machine with CUDA GPUs"
            )


def pytest_collectreport(report: pytest.CollectReport) -> None:
    path = report.nodeid.split("::")[0]
    if path.endswith(".py") and "::" not in report.nodeid:
        COLLECTED_MODULES.add(path)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu test: CUDA is not available")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _rank_pools() -> Iterator[None]:
    """Stop the harness's rank pools when the session ends."""
    yield
    shutdown_pools()


@pytest.fixture
def dist_device() -> str:
    """The device string tests put tensors on: ``"cuda"`` in the GPU tier, else ``"cpu"``."""
    return test_device()
