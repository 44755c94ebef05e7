"""``kernels.record.record_load`` (``LoadRecorder.record`` in one launch) against the torch
path it replaces, step by step through a wrapping ring: counts, the step count, ``-1``
ids, int32 and int64 ids, empty steps, more ids than one loop iteration and more slots
than one zeroing block; and the layer's recorder taking it on CUDA. On CPU under the Triton
interpreter (tests/conftest.py), on CUDA as compiled.

Shape legend: T tokens · K top-k · S steps in the window · P physical experts.
"""

from __future__ import annotations

import pytest
import torch

from epmoe.eplb.recorder import FUSED_RECORD_MAX_IDS, LoadRecorder

record = pytest.importorskip("epmoe.kernels.record", reason="needs triton")
ops = pytest.importorskip("epmoe.kernels.ops", reason="needs triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not ops.interpreted():
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)


def _torch_recorder(P: int, S: int) -> LoadRecorder:
    """The oracle: a CPU recorder, which counts with torch ops."""
    return LoadRecorder(P, S, "cpu")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize(
    "T, K, P, S",
    [(5, 2, 6, 3), (128, 8, 256, 4), (300, 8, 1500, 2), (1, 1, 1, 1)],
    ids=["tiny", "decode", "two_blocks", "one_slot"],
)
def test_record_load_matches_the_torch_recorder(T, K, P, S, dtype):
    g = torch.Generator().manual_seed(T + P)
    oracle = _torch_recorder(P, S)
    counts_SP = torch.zeros(S, P, dtype=torch.int64, device=DEVICE)
    steps = torch.zeros((), dtype=torch.int64, device=DEVICE)
    for step in range(2 * S + 1):  # wraps the ring twice
        n = 0 if step == 1 else T  # a rank with no tokens in one step
        ids_TK = torch.randint(-1, P, (n, K), generator=g, dtype=dtype)
        oracle.record(ids_TK)
        record.record_load(ids_TK.to(DEVICE), counts_SP, steps)
        assert torch.equal(counts_SP.cpu(), oracle.counts_SP), f"step {step}"
        assert int(steps) == step + 1


def test_each_step_overwrites_the_oldest_row_and_ignores_ids_outside_the_slots():
    P, S = 4, 2
    counts_SP = torch.full((S, P), 99, dtype=torch.int64, device=DEVICE)
    steps = torch.zeros((), dtype=torch.int64, device=DEVICE)
    record.record_load(torch.tensor([[3, 3], [-1, 0]], device=DEVICE), counts_SP, steps)
    assert counts_SP.cpu().tolist() == [[1, 0, 0, 2], [99, 99, 99, 99]]
    # a strided view (every other token), and ids outside [-1, P) that are dropped: P
    # itself (the first slot of the next row), past P, and below -1
    ids = torch.tensor([[1, 1], [9, 9], [2, 4], [9, 9], [-2, 3]], device=DEVICE)[::2]
    record.record_load(ids, counts_SP, steps)
    assert counts_SP.cpu().tolist() == [[1, 0, 0, 2], [0, 2, 1, 1]]
    record.record_load(torch.full((3, 2), -1, device=DEVICE), counts_SP, steps)
    assert counts_SP.cpu().tolist() == [[0, 0, 0, 0], [0, 2, 1, 1]] and int(steps) == 3


def test_record_load_refuses_what_it_cannot_count_into():
    ids = torch.zeros(2, 2, dtype=torch.int64, device=DEVICE)
    steps = torch.zeros((), dtype=torch.int64, device=DEVICE)
    with pytest.raises(TypeError, match="int64"):
        record.record_load(ids, torch.zeros(2, 3, dtype=torch.int32, device=DEVICE), steps)
    with pytest.raises(TypeError, match="int32 or int64 ids"):
        record.record_load(ids.float(), torch.zeros(2, 3, dtype=torch.int64, device=DEVICE), steps)
    with pytest.raises(ValueError, match="contiguous"):
        counts = torch.zeros(3, 2, dtype=torch.int64, device=DEVICE).t()
        record.record_load(ids, counts, steps)


@pytest.mark.skipif(DEVICE != "cuda", reason="the recorder takes the kernel on CUDA")
@pytest.mark.parametrize("fused", ["0", "1"])
def test_the_recorder_on_cuda_counts_like_on_cpu_and_in_a_graph(fused, monkeypatch):
    """``LoadRecorder.record`` on CUDA (the kernel, or the torch ops with
    ``EPMOE_FUSED_ROUTING=0`` and for steps of more than ``FUSED_RECORD_MAX_IDS`` ids, into
    the same ring) equals the CPU recorder, eagerly and over graph replays."""
    monkeypatch.setenv("EPMOE_FUSED_ROUTING", fused)
    P, S, T, K = 64, 3, 32, 4
    g = torch.Generator().manual_seed(1)
    big = FUSED_RECORD_MAX_IDS // K + 1  # a prefill-sized step: the torch ops
    steps_TK = [torch.randint(-1, P, (n, K), generator=g) for n in (T, big, T, T, T, T, T)]
    oracle, rec = _torch_recorder(P, S), LoadRecorder(P, S, DEVICE)
    for ids in steps_TK[:2]:
        oracle.record(ids)
        rec.record(ids.to(DEVICE))
    assert steps_TK[1].numel() > FUSED_RECORD_MAX_IDS >= steps_TK[0].numel()
    static = steps_TK[2].to(DEVICE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (warm-up outside the graph: compiles the kernel)
        rec_warm = LoadRecorder(P, S, DEVICE)
        rec_warm.record(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rec.record(static)
    for ids in steps_TK[2:]:
        static.copy_(ids)
        graph.replay()
        oracle.record(ids)
    assert torch.equal(rec.counts_SP.cpu(), oracle.counts_SP)
    assert rec.step == oracle.step == len(steps_TK)
    assert torch.equal(rec.window_load().cpu(), oracle.window_load())


def test_record_load_refuses_tensors_on_different_devices():
    """The launch passes bare addresses: a tensor on another device is refused, by name."""
    meta = torch.zeros(2, 3, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match=r"ids \(.*\), counts_SP \(meta\).*one device"):
        record.record_load(
            torch.zeros(2, 2, dtype=torch.int64, device=DEVICE),
            meta,
            torch.zeros((), dtype=torch.int64, device=DEVICE),
        )


@pytest.mark.skipif(DEVICE != "cuda", reason="the direct launch path runs on CUDA only")
def test_cpu_tensors_after_a_cuda_launch_are_refused_not_launched():
    """Once compiled for CUDA tensors of a dtype and alignment, the launch passes
    addresses as they are: CPU tensors of the same kind must be refused by name (they
    would fault the device). The wrappers refuse them first (``check_cuda``); the launch
    itself refuses them too, for any caller that goes around the wrappers."""
    from epmoe.kernels.launcher import launch
    from epmoe.placement import ExpertPlacement

    route = pytest.importorskip("epmoe.kernels.route")

    def args(dev):
        ids = torch.zeros(8, dtype=torch.int64, device=dev)
        counts = torch.zeros(3, 5, dtype=torch.int64, device=dev)
        steps = torch.zeros((), dtype=torch.int64, device=dev)
        return ids, counts, steps, torch.randn(4, 8, device=dev)

    ids, counts, steps, logits = args("cuda")
    record.record_load(ids, counts, steps)
    route.fused_route(logits, 2, ExpertPlacement.linear(8, 1).maps_on("cuda"))

    ids, counts, steps, logits = args("cpu")
    with pytest.raises(RuntimeError, match="record_load runs on CUDA tensors, got cpu"):
        record.record_load(ids, counts, steps)
    with pytest.raises(RuntimeError, match="fused_route runs on CUDA tensors, got cpu"):
        route.fused_route(logits, 2, ExpertPlacement.linear(8, 1).maps_on("cpu"))
    with pytest.raises(ValueError, match="ids_ptr is on cpu, but the kernel runs on the current"):
        launch(record.record_kernel)(
            (1,), ids, counts, steps, ids.numel(), P=5, S=3, BLOCK_N=record.BLOCK_N, BLOCK_P=8,
            num_warps=8,
        )  # fmt: skip
    torch.cuda.synchronize()  # the device is still fine
    assert int(steps) == 0 and int(counts.sum()) == 0  # (the CPU tensors: untouched)


def test_check_cuda_names_the_kernel_and_the_fix_off_cuda_unless_interpreted():
    """Without CUDA and without the interpreter, Triton's own error says only "0 active
    drivers": the wrappers say which kernel needs CUDA tensors, and what to do."""
    from epmoe.kernels.launcher import check_cuda

    class InterpretedFunction:  # what @triton.jit builds under TRITON_INTERPRET=1
        pass

    class JITFunction:
        pass

    check_cuda("record_load", torch.device("cpu"), InterpretedFunction())
    check_cuda("record_load", torch.device("cuda", 0), JITFunction())
    with pytest.raises(RuntimeError, match=r"record_load runs on CUDA tensors, got cpu: .*"):
        check_cuda("record_load", torch.device("cpu"), JITFunction())
