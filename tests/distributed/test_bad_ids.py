"""Expert ids out of range in one rank's dispatch raise on every rank, in that same call.

The portable backends (``naive``, ``all_to_all`` in both layouts) send an "ids out of
range" flag with their count exchange, so no rank is left waiting in the payload
collectives: every rank raises the same ``ValueError`` naming the rank whose ids are bad,
within seconds, and the group stays in step (the next dispatch works). 3 gloo ranks.
"""

from __future__ import annotations

import time

import pytest
import torch

from epmoe.comm import create_backend
from epmoe.comm.base import CommSpec, Layout
from tests.distributed.cases import device_for
from tests.harness import Sweep, requires_world, run_on_ranks
from tests.harness import test_device as device_under_test

WORLD = 3
CASES = [  # (name, bad rank, bad id given P, token counts per rank)
    ("id == P on rank 1", 1, lambda P: P, [4, 3, 5]),
    ("id -2 on rank 2, rank 0 has no tokens", 2, lambda P: -2, [0, 3, 5]),
    ("huge id on rank 0", 0, lambda P: 10**9, [1, 0, 2]),
]


def check_bad_ids_raise_everywhere(rank, world, device="cpu"):
    """Every backend × case: each rank's error and how long it took to raise."""
    dev = device_for(rank, device)
    H, K, offsets = 16, 2, (0, 2, 5, 7)  # P = 7, uneven slot counts
    P = offsets[-1]
    spec = CommSpec(H, K, offsets, 64, torch.float32, dev)
    sweep, seconds = Sweep(), {}
    backends = [("naive", Layout.STANDARD), ("all_to_all", Layout.STANDARD),
                ("all_to_all", Layout.EXPERT_BATCHED)]  # fmt: skip
    for name, layout in backends:
        comm = create_backend(name, spec, None, layout)
        for case, bad_rank, bad_id, tokens in CASES:
            T = tokens[rank]
            g = torch.Generator().manual_seed(rank)
            x, w = torch.randn(T, H, generator=g).to(dev), torch.rand(T, K).to(dev)
            ids = torch.randint(0, P, (T, K), generator=g).to(dev)
            if rank == bad_rank:
                ids[-1, 0] = bad_id(P)
            label = f"{name} {layout.value}: {case}"
            start = time.monotonic()
            with sweep.case(label), pytest.raises(ValueError) as info:
                comm.dispatch(x, ids, w)
            seconds[label] = time.monotonic() - start
            with sweep.case(label + ": the message"):
                msg = str(info.value)
                assert f"topk_ids on rank(s) [{bad_rank}] hold ids outside [-1, P={P})" in msg, msg
                assert ("this rank's ids lie in" in msg) == (rank == bad_rank), msg
            with sweep.case(label + ": the group is still in step"):
                ids.clamp_(-1, P - 1)
                result = comm.dispatch(x, ids, w)
                out = comm.combine(torch.zeros(result.hidden.shape, device=dev), result)
                assert out.shape == (T, H), out.shape
    sweep.check()
    return seconds


def test_ids_out_of_range_raise_on_every_rank_within_seconds():
    requires_world(WORLD)
    results = run_on_ranks(check_bad_ids_raise_everywhere, WORLD, device_under_test(), timeout_s=60)
    slowest = max(max(s.values()) for s in results)
    print(f"\nslowest raise: {slowest:.3f} s over {len(results[0])} cases x {WORLD} ranks")
    assert slowest < 5.0, results


def check_symm_allocation_agreement(rank, world, device="cpu"):
    """One rank's failed allocation of the symm buffers: every rank raises naming it,
    instead of the others waiting in the rendezvous until the group's timeout."""
    import torch.distributed as dist

    from epmoe.comm.symm.common import _agree_allocated

    dev = device_for(rank, device)
    group = dist.group.WORLD
    _agree_allocated(group, dev, None, "symm_ll: 1.00 GiB of symmetric memory")  # all fine
    failure = torch.OutOfMemoryError("CUDA out of memory") if rank == 1 else None
    with pytest.raises(RuntimeError) as info:
        _agree_allocated(group, dev, failure, "symm_ll: 1.00 GiB of symmetric memory")
    msg = str(info.value)
    assert "symm_ll: 1.00 GiB of symmetric memory failed on rank(s) [1]" in msg, msg
    assert ("here: OutOfMemoryError" in msg) == (rank == 1), msg
    assert "lower max_num_tokens" in msg, msg
    # opening peers' buffers by CUDA IPC (ranks sharing a GPU): the advice is about IPC
    from epmoe.comm.symm.common import IPC_ADVICE

    failure = RuntimeError("cudaIpcOpenMemHandle failed") if rank == 0 else None
    with pytest.raises(RuntimeError) as info:
        _agree_allocated(group, dev, failure, "opening symm_ll: the peers' buffers", IPC_ADVICE)
    msg = str(info.value)
    assert "opening symm_ll: the peers' buffers failed on rank(s) [0]" in msg, msg
    assert "one IPC namespace" in msg and "max_num_tokens" not in msg, msg
    return True


def test_a_failed_symm_allocation_raises_on_every_rank():
    requires_world(WORLD)
    assert all(
        run_on_ranks(check_symm_allocation_agreement, WORLD, device_under_test(), timeout_s=60)
    )
