"""What a long wait in the symm kernels costs the host link: host-to-device copy bandwidth
while every SM waits in their bounded poll (``kernels._wait_at_least``) past its first
millisecond (where a poll may also read the host-mapped error word), against the same
copies with the GPU idle. For A/B of the poll's host reads: run it from each source tree
(``cd <tree> && python launch/host_poll.py``), alternating.

Usage (repository root, GPU): ``python launch/host_poll.py [--programs 132] [--warps 8]
[--copy-mib 256] [--copies 16] [--rounds 5]``
"""

import argparse
import statistics
import time

import torch
import triton

from epmoe.comm.symm.kernels import OP_DISPATCH, _wait_at_least


@triton.jit
def _waiter(flag_ptr, err_addr, timeout_ns):
    _wait_at_least(flag_ptr, 1, timeout_ns, err_addr, OP_DISPATCH, 0)


def _copies_gbps(src, dst, copies: int, stream) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        for _ in range(copies):
            dst.copy_(src, non_blocking=True)
        end.record()
    end.synchronize()
    return copies * src.numel() / (start.elapsed_time(end) * 1e-3) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", type=int, default=None, help="waiting programs (SMs)")
    parser.add_argument("--warps", type=int, default=8)
    parser.add_argument("--copy-mib", type=int, default=256)
    parser.add_argument("--copies", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    programs = args.programs or torch.cuda.get_device_properties(dev).multi_processor_count
    src = torch.empty(args.copy_mib << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device=dev)
    one = torch.ones(1, dtype=torch.int32, pin_memory=True)
    err = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    copy_stream, wait_stream = torch.cuda.Stream(), torch.cuda.Stream()
    idle, waiting, waited_ms = [], [], []
    _copies_gbps(src, dst, 2, copy_stream)  # warm-up (and the waiter's compile below)
    for r in range(args.rounds + 1):
        flag = torch.zeros(1, dtype=torch.int32, device=dev)
        torch.cuda.synchronize()
        idle_gbps = _copies_gbps(src, dst, args.copies, copy_stream)
        t0 = time.perf_counter()
        with torch.cuda.stream(wait_stream):
            _waiter[(programs,)](flag, err.data_ptr(), 5 * 10**9, num_warps=args.warps)
        time.sleep(0.002)  # past the poll's first millisecond
        waiting_gbps = _copies_gbps(src, dst, args.copies, copy_stream)
        with torch.cuda.stream(copy_stream):
            flag.copy_(one, non_blocking=True)  # by a copy engine: no SM needed
        torch.cuda.synchronize()
        if int(err[0]):
            raise RuntimeError(f"the waiter reported {int(err[0]):#x}")
        if r:  # (round 0 compiled the waiter)
            idle.append(idle_gbps)
            waiting.append(waiting_gbps)
            waited_ms.append((time.perf_counter() - t0) * 1e3)
    print(
        f"H2D copies of {args.copy_mib} MiB x {args.copies}, {args.rounds} rounds, "
        f"{programs} programs x {args.warps} warps waiting: GB/s idle "
        f"{statistics.median(idle):.1f} ({min(idle):.1f}-{max(idle):.1f}), while waiting "
        f"{statistics.median(waiting):.1f} ({min(waiting):.1f}-{max(waiting):.1f}); "
        f"ratio {statistics.median(waiting) / statistics.median(idle):.3f}; each wait "
        f"{statistics.median(waited_ms):.0f} ms"
    )


if __name__ == "__main__":
    main()
