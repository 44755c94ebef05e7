"""A long wait in the symm kernels leaves the host link alone.

Every wait is bounded and, past its first millisecond, checks whether another wait of the
rank has timed out. Until 2026-12-03 that check read the host-mapped error word, and
132 programs waiting for a late peer cut the process's host-to-device copies from 55 to
0.45 GB/s on an H200 (``launch/host_poll.py`` measures it, with a control). The check now
polls a stop flag in device memory; this keeps it so.

Run in the GPU tier: ``EPMOE_TEST_DEVICE=cuda python -m pytest tests/gpu/test_symm_host_link.py``.
"""

from __future__ import annotations

import time

import pytest
import torch

if not torch.cuda.is_available():  # collected on CPU too; conftest skips the gpu mark
    pytest.skip("needs CUDA", allow_module_level=True)

import triton

from epmoe.comm.symm.common import status_block
from epmoe.comm.symm.kernels import OP_DISPATCH, _wait_at_least

pytestmark = pytest.mark.gpu


@triton.jit
def _waiter(flag_ptr, err_addr, timeout_ns):
    _wait_at_least(flag_ptr, 1, timeout_ns, err_addr, OP_DISPATCH, 0)


def _h2d_gbps(src: torch.Tensor, dst: torch.Tensor, copies: int, stream) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        for _ in range(copies):
            dst.copy_(src, non_blocking=True)
        end.record()
    end.synchronize()
    return copies * src.numel() / (start.elapsed_time(end) * 1e-3) / 1e9


def test_host_to_device_copies_keep_their_speed_while_every_sm_waits():
    dev = torch.device("cuda", torch.cuda.current_device())
    programs = torch.cuda.get_device_properties(dev).multi_processor_count
    src = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device=dev)
    err = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    status = status_block(err, dev)
    one = torch.ones(1, dtype=torch.int32, pin_memory=True)
    copy_stream, wait_stream = torch.cuda.Stream(), torch.cuda.Stream()
    idle, waiting = [], []
    for r in range(3):  # (round 0 compiles the waiter and warms the copies)
        idle_gbps = _h2d_gbps(src, dst, 4, copy_stream)
        flag = torch.zeros(1, dtype=torch.int32, device=dev)
        torch.cuda.synchronize()
        with torch.cuda.stream(wait_stream):
            _waiter[(programs,)](flag, status.data_ptr(), 20 * 10**9, num_warps=8)
        time.sleep(0.003)  # past the wait's first millisecond
        waiting_gbps = _h2d_gbps(src, dst, 4, copy_stream)
        with torch.cuda.stream(copy_stream):
            flag.copy_(one, non_blocking=True)  # by a copy engine: no SM needed
        torch.cuda.synchronize()
        assert int(err[0]) == 0 and int(status[1]) == 0, hex(int(err[0]))
        if r:
            idle.append(idle_gbps)
            waiting.append(waiting_gbps)
    # 1.00 measured with the stop flag, 0.008 with the host word's reads
    assert min(waiting) > 0.7 * max(idle), (idle, waiting)
