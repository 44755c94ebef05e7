"""Tests of the multi-process harness itself (tests/harness.py): gloo ranks on CPU, NCCL
ranks in the GPU tier (``EPMOE_TEST_DEVICE=cuda``).

The rank bodies below are module-level so the spawned ranks can import them. Timeouts are a
few seconds: these tests exercise the failure paths (raise, hang, skip, crash) and check the
pool recovers for the next call.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import time

import pytest
import torch
import torch.distributed as dist

from tests import harness
from tests.harness import RankFailure, RankTimeout, Sweep, free_port, run_on_ranks, test_device

SHORT_TIMEOUT_S = 2.0
BACKEND = "nccl" if test_device() == "cuda" else "gloo"


# ----------------------------------------------------------------------------- rank bodies


def _whoami(rank: int, world_size: int, tag: str, *, scale: float = 1.0) -> dict:
    return {
        "rank": rank,
        "world_size": world_size,
        "dist_rank": dist.get_rank(),
        "dist_world": dist.get_world_size(),
        "backend": dist.get_backend(),
        "tag": tag,
        "scale": scale,
        "pid": os.getpid(),
        "threads": torch.get_num_threads(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
    }


def _rank_data(rank: int, n: int) -> torch.Tensor:
    """Random, non-zero data that differs per rank (same on the parent for the oracle)."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.rand(n, generator=g, dtype=torch.float64) + 0.5


def _blocking_all_reduce() -> None:
    """An all_reduce that blocks the caller until every rank has joined it (NCCL is async)."""
    x = torch.ones(1, device=test_device())
    dist.all_reduce(x)
    x.item()


def _all_reduce_body(rank: int, world_size: int, n: int) -> torch.Tensor:
    x = _rank_data(rank, n).to(test_device())
    dist.all_reduce(x)
    return x.cpu()


def _raise_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError(f"boom from rank {rank} of {world_size}")
    return os.getpid()


def _raise_on_rank_1_before_collective(rank: int, world_size: int) -> None:
    if rank == 1:
        raise KeyError("rank 1 left before the all_reduce")
    _blocking_all_reduce()  # rank 0 waits here for rank 1, which never comes


def _hang_on_rank_1(rank: int, world_size: int, how: str) -> int:
    if rank == 1:
        if how == "sleep":
            time.sleep(3600)
        else:  # a collective that rank 0 never enters
            _blocking_all_reduce()
    return rank


def _skip_on(rank: int, world_size: int, ranks: tuple[int, ...]) -> int:
    if rank in ranks:
        pytest.skip(f"not supported here (rank {rank})" if len(ranks) < world_size else "no GPU")
    return rank


def _die_on_rank_1(rank: int, world_size: int, how: str) -> int:
    if rank == 1:
        if how == "exit":
            os._exit(3)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file in the repository
        os.kill(os.getpid(), signal.SIGSEGV)
    return rank


def _skip_on_0_raise_on_1(rank: int, world_size: int) -> None:
    if rank == 0:
        pytest.skip("rank 0 has nothing to do")
    raise RuntimeError("rank 1 broke")


def _unpicklable_result(rank: int, world_size: int):
    return lambda: rank


def _sweep_in_rank(rank: int, world_size: int) -> int:
    sweep = Sweep()
    for case in range(4):
        with sweep.case(f"case={case}"):
            total = torch.tensor([float(case)], device=test_device())
            dist.all_reduce(total)  # collectives first, assertions after them
            assert case % 2 == 0, f"odd case {case} on rank {rank} (sum {total.item()})"
    sweep.check()
    return sweep.passed


# ----------------------------------------------------------------------------- tests


def _pids(world_size: int) -> list[int]:
    return [r["pid"] for r in run_on_ranks(_whoami, world_size, "pid")]


@pytest.mark.parametrize("world_size", [1, 2, 3], ids=lambda w: f"W={w}")
def test_results_come_back_in_rank_order(world_size: int) -> None:
    out = run_on_ranks(_whoami, world_size, "hello", scale=2.5)
    assert [r["rank"] for r in out] == list(range(world_size))
    assert [r["dist_rank"] for r in out] == list(range(world_size))
    for r in out:
        assert (r["world_size"], r["dist_world"], r["backend"]) == (world_size, world_size, BACKEND)
        assert (r["tag"], r["scale"]) == ("hello", 2.5)
        assert r["threads"] == 1 or BACKEND == "nccl"
        if not torch.cuda.is_available():
            assert r["triton_interpret"] == "1"
    assert len({r["pid"] for r in out}) == world_size


def test_pool_is_reused_between_calls() -> None:
    assert _pids(2) == _pids(2)


@pytest.mark.parametrize("world_size", [2, 3], ids=lambda w: f"W={w}")
def test_all_reduce_inside_a_task(world_size: int) -> None:
    n = 17
    expected = sum(_rank_data(r, n) for r in range(world_size))
    for out in run_on_ranks(_all_reduce_body, world_size, n):
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=0)


def test_raise_on_one_rank_shows_its_traceback_and_keeps_the_pool() -> None:
    before = _pids(2)
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_raise_on_rank_1, 2, timeout_s=30)
    msg = str(info.value)
    assert "tests.unit.test_harness._raise_on_rank_1 failed on rank(s) [1]" in msg
    assert "===== rank 1 raised =====" in msg
    assert "Traceback (most recent call last)" in msg
    assert 'in _raise_on_rank_1\n    raise ValueError(f"boom from rank' in msg
    assert "ValueError: boom from rank 1 of 2" in msg
    assert "===== rank 0" not in msg
    assert _pids(2) == before  # rank 0 replied and the group passed a barrier: same processes


def test_raise_while_another_rank_waits_in_a_collective_restarts_the_pool(monkeypatch) -> None:
    monkeypatch.setattr(harness, "_GRACE_S", 1.0)
    before = _pids(2)
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_raise_on_rank_1_before_collective, 2, timeout_s=60)
    assert time.monotonic() - start < harness._GRACE_S + 10  # the grace period, not the timeout
    msg = str(info.value)
    assert "failed on rank(s) [1]" in msg
    assert "KeyError: 'rank 1 left before the all_reduce'" in msg
    assert "rank(s) [0] gave no reply" in msg
    assert "===== rank 0 gave no reply; its stack =====" in msg
    assert "_raise_on_rank_1_before_collective" in msg.split("===== rank 0")[1]  # where it waits
    after = _pids(2)
    assert set(after).isdisjoint(before)


@pytest.mark.parametrize("how", ["sleep", "collective"])
def test_hang_on_one_rank_times_out_naming_it(how: str) -> None:
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_on_ranks(_hang_on_rank_1, 2, how, timeout_s=SHORT_TIMEOUT_S)
    elapsed = time.monotonic() - start
    assert SHORT_TIMEOUT_S <= elapsed < SHORT_TIMEOUT_S + 10
    msg = str(info.value)
    assert f"_hang_on_rank_1 timed out after {SHORT_TIMEOUT_S} s on 2 {BACKEND} ranks" in msg
    assert "rank(s) [1] did not finish, rank(s) [0] did" in msg
    stack = msg.split("===== rank 1 gave no reply; its stack =====")[1]
    assert "_hang_on_rank_1" in stack
    assert run_on_ranks(_whoami, 2, "after")[1]["rank"] == 1  # a fresh pool serves the next call


def test_skip_on_all_ranks_skips_with_the_reason() -> None:
    with pytest.raises(pytest.skip.Exception, match="^no GPU$"):
        run_on_ranks(_skip_on, 2, (0, 1))


def test_skip_on_some_ranks_names_them() -> None:
    with pytest.raises(pytest.skip.Exception, match=r"^rank 0: not supported here \(rank 0\)$"):
        run_on_ranks(_skip_on, 2, (0,))
    assert run_on_ranks(_skip_on, 2, ()) == [0, 1]


@pytest.mark.parametrize(
    "how, head",
    [("exit", "died with exit code 3"), ("segfault", "died from signal SIGSEGV")],
    ids=["os._exit(3)", "SIGSEGV"],
)
def test_dead_rank_is_reported_promptly(how: str, head: str) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_die_on_rank_1, 2, how, timeout_s=60)
    assert time.monotonic() - start < harness._GRACE_S + 10  # found by liveness, not timeout
    msg = str(info.value)
    assert f"===== rank 1 {head} =====" in msg
    if how == "segfault":  # faulthandler left the Python stack of the crash
        assert "Fatal Python error: Segmentation fault" in msg
        assert "in _die_on_rank_1" in msg
    assert [r["rank"] for r in run_on_ranks(_whoami, 2, "after")] == [0, 1]  # a fresh pool


def test_rank_killed_between_tasks_is_replaced() -> None:
    before = _pids(2)
    os.kill(before[1], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while harness._POOLS[(2, BACKEND)].alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(_pids(2)).isdisjoint(before)


def test_isolated_pool_is_fresh_and_leaves_the_shared_pool_alone() -> None:
    shared = _pids(2)
    isolated = [r["pid"] for r in run_on_ranks(_whoami, 2, "iso", isolated=True)]
    assert set(isolated).isdisjoint(shared)
    assert _pids(2) == shared


def test_failure_wins_over_skip() -> None:
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_skip_on_0_raise_on_1, 2)
    msg = str(info.value)
    assert "failed on rank(s) [1]" in msg
    assert "===== rank 0 skipped: rank 0 has nothing to do =====" in msg
    assert "RuntimeError: rank 1 broke" in msg


def test_unpicklable_return_value_is_a_failure() -> None:
    with pytest.raises(RankFailure, match="the return value is not picklable"):
        run_on_ranks(_unpicklable_result, 1)


def test_sweep_inside_ranks_reports_every_failing_case() -> None:
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_sweep_in_rank, 2)
    msg = str(info.value)
    for rank in (0, 1):
        section = msg.split(f"===== rank {rank} raised =====")[1].split("=====")[0]
        assert "2 of 4 sweep cases failed (2 passed, 0 skipped): case=1, case=3" in section
        assert f"odd case 1 on rank {rank} (sum {2.0})" in section
        assert f"odd case 3 on rank {rank} (sum {6.0})" in section


def test_sweep_collects_failures_and_skips() -> None:
    sweep = Sweep()
    with sweep.case("ok"):
        pass
    with sweep.case("W=2 naive linear"):
        raise ValueError("bad layout")
    with sweep.case("skipped"):
        pytest.skip("not here")
    with sweep.case("W=3 all_to_all"):
        torch.testing.assert_close(torch.ones(2), torch.zeros(2))
    assert sweep.passed == 1
    assert sweep.skipped == [("skipped", "not here")]
    with pytest.raises(AssertionError) as info:
        sweep.check()
    msg = str(info.value)
    assert msg.startswith(
        "2 of 4 sweep cases failed (1 passed, 1 skipped): W=2 naive linear, W=3 all_to_all\n"
    )
    assert re.search(r"--- W=2 naive linear\n    ValueError: bad layout\n", msg)
    assert 'raise ValueError("bad layout")' in msg
    assert "--- W=3 all_to_all\n    AssertionError: Tensor-likes are not close!" in msg
    assert harness.__file__ not in msg  # the Sweep frames are left out


def test_sweep_without_failures_passes() -> None:
    sweep = Sweep()
    for i in range(3):
        with sweep.case(f"i={i}"):
            assert i < 3
    sweep.check()
    assert sweep.passed == 3


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: run_on_ranks(_whoami, 0, "x"), ValueError, "world_size must be a positive int"),
        (lambda: run_on_ranks(_whoami, 2, "x", backend="mpi"), ValueError, "backend must be"),
        (lambda: run_on_ranks(_whoami, 1, "x", timeout_s=0), ValueError, "timeout_s must be"),
        (lambda: run_on_ranks(lambda r, w: r, 1), TypeError, "define the rank function at module"),
        (lambda: run_on_ranks(_whoami, 1, lambda: 0), TypeError, "pass picklable arguments"),
    ],
    ids=["W=0", "unknown backend", "zero timeout", "lambda body", "unpicklable argument"],
)
def test_bad_arguments_are_rejected_before_any_rank_runs(call, error, match) -> None:
    with pytest.raises(error, match=match):
        call()


def test_environment_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPMOE_TEST_TIMEOUT", "7.5")
    assert harness._default_timeout_s() == 7.5
    monkeypatch.setenv("EPMOE_TEST_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="EPMOE_TEST_TIMEOUT must be a positive number"):
        harness._default_timeout_s()
    monkeypatch.delenv("EPMOE_TEST_TIMEOUT")
    assert harness._default_timeout_s() == 120.0
    monkeypatch.setenv("EPMOE_TEST_DEVICE", "CUDA")
    assert harness.test_device() == "cuda"
    monkeypatch.setenv("EPMOE_TEST_DEVICE", "tpu")
    with pytest.raises(ValueError, match="EPMOE_TEST_DEVICE must be 'cpu' or 'cuda'"):
        harness.test_device()
    monkeypatch.delenv("EPMOE_TEST_DEVICE")
    assert harness.test_device() == "cpu"


def test_free_port_can_be_bound() -> None:
    import socket

    port = free_port()
    assert 1024 <= port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_dist_device_fixture_follows_the_environment(dist_device: str) -> None:
    assert dist_device == harness.test_device()


def test_requires_world_skips_only_a_cuda_run_short_of_gpus(monkeypatch) -> None:
    monkeypatch.delenv("EPMOE_TEST_DEVICE", raising=False)
    harness.requires_world(64)  # CPU ranks: any world size runs
    monkeypatch.setenv("EPMOE_TEST_DEVICE", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    harness.requires_world(2)
    with pytest.raises(pytest.skip.Exception, match="^needs 4 GPUs for 4 ranks, found 2$"):
        harness.requires_world(4)
    with pytest.raises(pytest.skip.Exception, match="^needs 3 GPUs"):
        run_on_ranks(_whoami, 3, "x")  # NCCL is the default backend now
    # ranks sharing GPUs: twice the ranks, on a group NCCL does not refuse
    monkeypatch.setenv("EPMOE_TEST_RANKS_PER_GPU", "2")
    harness.requires_world(4)
    with pytest.raises(pytest.skip.Exception, match="^needs 3 GPUs for 5 ranks at EPMOE_TEST_R"):
        harness.requires_world(5)
    with pytest.raises(pytest.skip.Exception, match="^needs 3 GPUs for 6 ranks"):
        run_on_ranks(_whoami, 6, "x")  # the shared-GPU backend checks the world too
    with pytest.raises(pytest.skip.Exception, match="^needs 3 GPUs for 3 ranks, found 2$"):
        run_on_ranks(_whoami, 3, "x", backend="nccl")  # NCCL: a GPU per rank regardless
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(pytest.skip.Exception, match="^needs 1 GPUs for 2 ranks .* found 0$"):
        run_on_ranks(_whoami, 2, "x", backend=harness.SHARED_GPU_BACKEND)


def test_ranks_per_gpu_comes_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("EPMOE_TEST_RANKS_PER_GPU", raising=False)
    assert harness.ranks_per_gpu() == 1
    monkeypatch.setenv("EPMOE_TEST_RANKS_PER_GPU", " 4 ")
    assert harness.ranks_per_gpu() == 4
    for bad in ("0", "two", "1.5"):
        monkeypatch.setenv("EPMOE_TEST_RANKS_PER_GPU", bad)
        with pytest.raises(ValueError, match="EPMOE_TEST_RANKS_PER_GPU must be an integer >= 1"):
            harness.ranks_per_gpu()


@pytest.mark.gpu
def test_gpu_marker_runs_only_with_cuda() -> None:
    assert torch.cuda.is_available()
