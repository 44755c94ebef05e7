"""LoadRecorder: the sliding window of per-slot token counts, and replica folding."""

from __future__ import annotations

import pytest
import torch

from epmoe.eplb.recorder import LoadRecorder, logical_load


def _counts(ids_TK: torch.Tensor, P: int) -> torch.Tensor:
    """Tokens per physical slot, counted one entry at a time (the independent oracle)."""
    out = torch.zeros(P, dtype=torch.int64)
    for i in ids_TK.flatten().tolist():
        if i >= 0:
            out[i] += 1
    return out


def _steps(n: int, T: int, K: int, P: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-1, P, (T, K), generator=g) for _ in range(n)]


@pytest.mark.parametrize(
    "window,num_steps",
    [(1, 3), (3, 2), (3, 3), (3, 7), (4, 8)],
    ids=["window=1", "fewer_steps_than_window", "exactly_full", "wrapped", "wrapped_twice"],
)
def test_window_sums_the_last_steps(window: int, num_steps: int) -> None:
    P = 6
    rec = LoadRecorder(P, window, "cpu")
    steps = _steps(num_steps, T=5, K=2, P=P)
    for ids in steps:
        rec.record(ids)
    want = sum((_counts(ids, P) for ids in steps[-window:]), torch.zeros(P, dtype=torch.int64))
    assert torch.equal(rec.window_load(), want)
    assert rec.step == num_steps
    assert rec.window_load().dtype == torch.int64


def test_minus_one_entries_are_not_counted() -> None:
    rec = LoadRecorder(4, 2, "cpu")
    rec.record(torch.tensor([[-1, 3], [-1, -1], [0, 3]]))
    assert rec.window_load().tolist() == [1, 0, 0, 2]
    rec.record(torch.full((3, 2), -1))
    assert rec.window_load().tolist() == [1, 0, 0, 2]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_id_dtypes_and_empty_step(dtype: torch.dtype) -> None:
    rec = LoadRecorder(5, 3, "cpu")
    rec.record(torch.tensor([[4, 1], [1, 0]], dtype=dtype))
    rec.record(torch.empty(0, 2, dtype=dtype))  # a rank with no tokens this step
    assert rec.window_load().tolist() == [1, 2, 0, 0, 1]
    assert rec.step == 2


def test_disabled_recorder_ignores_steps() -> None:
    rec = LoadRecorder(3, 2, "cpu")
    rec.enabled = False
    rec.record(torch.tensor([[0, 1]]))
    assert rec.window_load().tolist() == [0, 0, 0] and rec.step == 0


def test_reset_forgets_and_can_resize() -> None:
    rec = LoadRecorder(4, 2, "cpu")
    for ids in _steps(3, T=4, K=2, P=4):
        rec.record(ids)
    rec.reset()
    assert rec.step == 0 and rec.window_load().tolist() == [0, 0, 0, 0]
    rec.reset(num_physical=6)
    assert rec.num_physical == 6 and tuple(rec.counts_SP.shape) == (2, 6)
    rec.record(torch.tensor([[5, 5]]))
    assert rec.window_load().tolist() == [0, 0, 0, 0, 0, 2]


def test_global_load_without_process_group_is_the_window() -> None:
    rec = LoadRecorder(3, 2, "cpu")
    rec.record(torch.tensor([[2, 0], [2, 1]]))
    assert torch.equal(rec.global_load(), rec.window_load())


def test_logical_load_folds_replicas() -> None:
    # slots 0 and 3 replicate expert 0, slots 1 and 4 expert 1
    p2l = torch.tensor([0, 1, 2, 0, 1])
    load = torch.tensor([5, 7, 1, 3, 2])
    assert logical_load(load, p2l, 3).tolist() == [8, 9, 1]
    # an expert without any count keeps 0; dtype follows the load
    out = logical_load(torch.tensor([1.5, 0.0, 2.0]), torch.tensor([0, 0, 2]), 4)
    assert out.dtype == torch.float32 and out.tolist() == [1.5, 0.0, 2.0, 0.0]


def test_rejects_a_non_positive_window() -> None:
    with pytest.raises(ValueError, match="window"):
        LoadRecorder(4, 0, "cpu")
