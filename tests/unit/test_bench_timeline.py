"""``epmoe.bench.timeline``'s bookkeeping (the stamps themselves need a GPU: see
docs/benchmarks.md): which program plays which role, and the times read from stamps."""

from __future__ import annotations

import pytest
import torch

from epmoe.bench import timeline


@pytest.mark.parametrize("T, W, M, rank", [(4, 2, 4, 0), (3, 3, 5, 2), (0, 2, 2, 1)])
def test_roles_cover_each_grid_once(T, W, M, rank):
    """Every program of the fused kernels' grids has exactly one role; a dispatch
    receiver is "self" exactly when its source slot is this rank's."""
    roles = timeline._roles(T, W, M, rank)
    for phase, size in (("dispatch", 1 + T + W * M), ("combine", W * M + max(T, 1))):
        pids = sorted(p for (ph, _), ps in roles.items() if ph == phase for p in ps)
        assert pids == list(range(size))
    assert all((p - 1 - T) // M == rank for p in roles[("dispatch", "recv self")])
    assert len(roles[("dispatch", "recv self")]) == M


def test_summaries_read_steps_relative_to_each_kernel_start():
    """Steps in µs after the phase's first program start (unwritten stamps, 0, left out),
    the phase's span, and the gap from the dispatch's last stamp to the combine."""
    T, W, M, rank = 2, 2, 2, 0
    roles = timeline._roles(T, W, M, rank)
    d = torch.zeros(1 + T + W * M, 8, dtype=torch.int64)
    d[:, 0] = 10_000  # every program starts at 10 µs on the GPU timer
    d[0, 2] = 11_000  # the count sent
    d[1:3, 1:4] = torch.tensor([[12_000, 15_000, 15_500], [13_000, 16_000, 16_500]])
    d[3:, 1:4] = 18_000  # receivers: token seen, rows taken, done
    d[5, 1:4] = 0  # steps a program never stamped
    c = torch.zeros(W * M + T, 8, dtype=torch.int64)
    c[:, 0] = 20_000
    c[:, 1:3] = 21_000
    out = timeline._summaries({"dispatch": d, "combine": c}, roles)
    assert out[("dispatch", "announce", "count sent")] == (1.0, 1.0, 1.0)
    assert out[("dispatch", "send", "fenced")] == (5.0, 5.0, 6.0)
    assert out[("dispatch", "recv self", "token seen")] == (8.0, 8.0, 8.0)
    assert out[("dispatch", "", "span")] == (8.0, 8.0, 8.0)
    assert out[("combine", "", "after dispatch")] == (2.0, 2.0, 2.0)
    row = timeline._record("dispatch", "send", "fenced", *out[("dispatch", "send", "fenced")])
    assert row == dict(
        phase="dispatch", role="send", step="fenced", first_us=5.0, median_us=5.0, last_us=6.0
    )
