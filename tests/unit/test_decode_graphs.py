"""``epmoe.DecodeGraphs`` on one process without a GPU: what it refuses, and when it
steps aside for the eager forward. Capture and replay: ``tests/gpu/test_decode_graphs.py``."""

from __future__ import annotations

import pytest
import torch

import epmoe
from epmoe.decode_graphs import DecodeGraphs


def _forward(x_TH, num_valid_tokens=None):
    return x_TH


def test_it_captures_cuda_graphs_only():
    with pytest.raises(ValueError, match="device must be cuda"):
        DecodeGraphs(_forward, (1, 2), hidden_size=8, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("sizes", [(), (0, 4), (True,)], ids=["none", "zero", "a bool"])
def test_sizes_are_positive_token_counts(sizes, monkeypatch):
    with pytest.raises(ValueError, match="sizes must be positive token counts"):
        DecodeGraphs(_forward, sizes, hidden_size=8, dtype=torch.float32, device="cuda")


def test_steps_that_are_not_graph_steps_run_eagerly(monkeypatch):
    graphs = object.__new__(DecodeGraphs)  # no capture: only the step logic is exercised
    graphs.sizes, graphs._ranks, graphs.dtype = (1, 2, 4), (), torch.float32
    x = torch.randn(3, 8)
    assert graphs(x) is None  # no active step
    with epmoe.step(num_tokens=3) as s:  # a prefill step
        assert not s.decode and graphs(x) is None
    with epmoe.step(num_tokens=3, decode=True, graph_max_tokens=2) as s:  # above the buckets
        assert not s.decode and graphs(x) is None
    with epmoe.step(num_tokens=5, decode=True) as s:  # decode, but no bucket holds 5
        assert s.decode and s.bucket(graphs.sizes) is None and graphs(x) is None


def test_a_graph_step_on_another_group_or_dtype_is_refused():
    graphs = object.__new__(DecodeGraphs)
    graphs.sizes, graphs._ranks, graphs.dtype = (1, 2, 4), (0, 1), torch.float32
    with epmoe.step(num_tokens=3, decode=True) as s, pytest.raises(ValueError, match="ranks"):
        graphs(torch.randn(3, 8), s)  # this process's step has no ranks
    graphs._ranks = ()
    with epmoe.step(num_tokens=3, decode=True) as s, pytest.raises(TypeError, match="float32"):
        graphs(torch.randn(3, 8, dtype=torch.float64), s)
