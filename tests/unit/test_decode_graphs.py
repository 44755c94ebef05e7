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


class _Graph:
    def __init__(self, n):
        self.n, self.rows = n, []

    def replay(self):
        self.rows.append(int(self.n))


def _fake_graphs(ranks=()) -> DecodeGraphs:
    """Buckets (1, 2, 4) of H = 8 float32 rows with graphs that record the rows they ran."""
    graphs = object.__new__(DecodeGraphs)  # no capture: only the step logic is exercised
    graphs.sizes, graphs._ranks, graphs.dtype, graphs.hidden_size = (
        (1, 2, 4),
        ranks,
        torch.float32,
        8,
    )
    graphs.layers, graphs._state, graphs.replays = [], [], 0
    graphs._graphs = {}
    for b in graphs.sizes:
        n = torch.zeros(1, dtype=torch.int32)
        graphs._graphs[b] = (_Graph(n), torch.zeros(b, 8), n, torch.zeros(b, 8))
    return graphs


def test_a_graph_step_on_another_group_is_refused():
    graphs = _fake_graphs(ranks=(0, 1))
    with epmoe.step(num_tokens=3, decode=True) as s, pytest.raises(ValueError, match="ranks"):
        graphs(torch.randn(3, 8), s)  # this process's step has no ranks
    assert all(g.rows == [] for g, *_ in graphs._graphs.values())


@pytest.mark.parametrize(
    "rows, error, match",
    [
        (torch.randn(3, 8, dtype=torch.float64), TypeError, "float32 rows, got torch.float64"),
        (torch.randn(3, 6), ValueError, "H=8, got"),
        (torch.randn(24), ValueError, r"rows \[T, H=8\], got \(24,\)"),
        (torch.randn(5, 8), ValueError, "T=5 rows, above the step's bucket 4"),
    ],
    ids=["dtype", "hidden size", "one dimension", "above the bucket"],
)
def test_rows_the_step_cannot_take_raise_after_an_empty_replay(rows, error, match):
    """The other ranks replay the bucket too: this rank replays it with no rows (so their
    dispatches meet its own and they finish the step), then raises."""
    graphs = _fake_graphs()
    with epmoe.step(num_tokens=3, decode=True) as s, pytest.raises(error, match=match):
        graphs(rows, s)
    assert graphs._graphs[4][0].rows == [0] and graphs.replays == 0
    with epmoe.step(num_tokens=3, decode=True) as s:  # good rows: replayed with them
        out = graphs(torch.ones(3, 8), s)
    assert graphs._graphs[4][0].rows == [0, 3] and graphs.replays == 1 and out.shape == (3, 8)
