"""LoadRecorder: the sliding window of per-slot token counts (a device-side ring), and
replica folding."""

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


def test_the_ring_position_lives_on_the_device_over_several_windows() -> None:
    """Step i lands in row i % S, written at a device-side position; the window is right
    after every step, before it is full too, over three and a half windows."""
    S, P = 3, 5
    rec = LoadRecorder(P, S, "cpu")
    steps = _steps(3 * S + 2, T=4, K=2, P=P, seed=1)
    for i, ids in enumerate(steps):
        rec.record(ids)
        want = sum((_counts(x, P) for x in steps[max(0, i + 1 - S) : i + 1]), torch.zeros(P))
        assert torch.equal(rec.window_load(), want.long()), f"after step {i}"
        assert torch.equal(rec.counts_SP[i % S], _counts(ids, P)), f"row {i % S}, step {i}"
        assert rec.steps.dim() == 0 and rec.steps.device == rec.counts_SP.device
        assert int(rec.steps) == i + 1


def test_record_changes_only_device_tensors_in_place() -> None:
    """What a CUDA graph replays: record() may change its tensors in place, nothing else.
    Three identical steps must fill three rows (a Python step counter, frozen at capture,
    made every replay overwrite one row: the window read [1, 1, 1, 1], not [3, 3, 3, 3])."""
    rec = LoadRecorder(4, 4, "cpu")

    def state():
        return {k: ("tensor", id(v)) if torch.is_tensor(v) else v for k, v in vars(rec).items()}

    before = state()
    for _ in range(3):
        rec.record(torch.tensor([[0, 1], [2, 3]]))
    assert state() == before
    assert rec.window_load().tolist() == [3, 3, 3, 3]


def test_reset_zeroes_in_place_and_restarts_the_ring() -> None:
    """reset() keeps the tensors (a captured graph stays valid) and the next step goes to
    row 0; counting after it is right over several windows."""
    S, P = 2, 3
    rec = LoadRecorder(P, S, "cpu")
    counts, steps = rec.counts_SP, rec.steps
    for ids in _steps(5, T=3, K=2, P=P, seed=2):
        rec.record(ids)
    rec.reset()
    assert rec.counts_SP is counts and rec.steps is steps
    assert int(rec.steps) == 0 and rec.window_load().tolist() == [0] * P
    after = _steps(5, T=3, K=2, P=P, seed=3)
    for ids in after:
        rec.record(ids)
    want = _counts(after[-2], P) + _counts(after[-1], P)
    assert torch.equal(rec.window_load(), want)
    assert torch.equal(rec.counts_SP[0], _counts(after[-1], P))  # step 4 after the reset


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


def test_rejects_a_non_positive_window_or_slot_count() -> None:
    with pytest.raises(ValueError, match="window"):
        LoadRecorder(4, 0, "cpu")
    with pytest.raises(ValueError, match="num_physical"):
        LoadRecorder(0, 2, "cpu")
