"""What a long wait in the symm kernels costs the host link: host-to-device copy bandwidth
while every SM waits in their bounded poll (``kernels._wait_at_least``) past its first
millisecond (where it also checks whether another wait has timed out: by reading the
host-mapped error word until 2026-12-03, a flag in device memory since), against the same
copies with the GPU idle. For an A/B of two trees, run this script against each
(``PYTHONPATH=<tree> python launch/host_poll.py``), alternating.

Usage (repository root, GPU): ``python launch/host_poll.py [--programs 132] [--warps 8]
[--copy-mib 64] [--copies 8] [--rounds 5] [--timeout-s 30]``

Besides idle, the control is the same poll and pause on device memory only
(``_device_waiter``), so one tree's run separates the host reads from the waiting itself.
"""

import argparse
import statistics
import time

import torch
import triton

from epmoe.comm.symm.kernels import OP_DISPATCH, _load_acquire, _pause, _wait_at_least

try:
    from epmoe.comm.symm.common import status_block
except ImportError:  # a tree before 2026-12-03: the kernels took the host word's address

    def status_block(err_host, device):
        return err_host


@triton.jit
def _waiter(flag_ptr, err_addr, timeout_ns):
    _wait_at_least(flag_ptr, 1, timeout_ns, err_addr, OP_DISPATCH, 0)


@triton.jit
def _device_waiter(flag_ptr):
    """The control: the same poll and pause on device memory only, never the host's."""
    while _load_acquire(flag_ptr) < 1:
        _pause()


def _copies_gbps(src, dst, copies: int, stream) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        for _ in range(copies):
            dst.copy_(src, non_blocking=True)
        end.record()
    end.synchronize()
    return copies * src.numel() / (start.elapsed_time(end) * 1e-3) / 1e9


def _gbps_while(launch, src, dst, copies: int, copy_stream, one, err, status) -> tuple[float, bool]:
    """H2D GB/s while the kernel that ``launch`` starts waits (past its first 2 ms), and
    whether that wait hit its own timeout (the copies took longer than it)."""
    dev = dst.device
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    err.zero_()
    if status is not err:  # the stop flag too (a timeout raised it)
        status[1] = 0
    torch.cuda.synchronize()
    launch(flag)
    time.sleep(0.002)  # past the poll's first millisecond
    gbps = _copies_gbps(src, dst, copies, copy_stream)
    with torch.cuda.stream(copy_stream):
        flag.copy_(one, non_blocking=True)  # by a copy engine: no SM needed
    torch.cuda.synchronize()
    return gbps, bool(int(err[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", type=int, default=None, help="waiting programs (SMs)")
    parser.add_argument("--warps", type=int, default=8)
    parser.add_argument("--copy-mib", type=int, default=64)
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeout-s", type=float, default=30.0, help="the waiter's bound")
    args = parser.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    programs = args.programs or torch.cuda.get_device_properties(dev).multi_processor_count
    src = torch.empty(args.copy_mib << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device=dev)
    one = torch.ones(1, dtype=torch.int32, pin_memory=True)
    err = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    status = status_block(err, dev)
    copy_stream, wait_stream = torch.cuda.Stream(), torch.cuda.Stream()
    timeout_ns = int(args.timeout_s * 1e9)

    def ours(flag):
        with torch.cuda.stream(wait_stream):
            _waiter[(programs,)](flag, status.data_ptr(), timeout_ns, num_warps=args.warps)

    def control(flag):
        with torch.cuda.stream(wait_stream):
            _device_waiter[(programs,)](flag, num_warps=args.warps)

    rates: dict[str, list[float]] = {"idle": [], "device-only poll": [], "symm poll": []}
    timeouts = 0
    _copies_gbps(src, dst, 2, copy_stream)  # warm-up
    for r in range(args.rounds + 1):  # round 0 compiles the waiters
        idle = _copies_gbps(src, dst, args.copies, copy_stream)
        dev_only, _ = _gbps_while(control, src, dst, args.copies, copy_stream, one, err, status)
        symm, timed_out = _gbps_while(ours, src, dst, args.copies, copy_stream, one, err, status)
        timeouts += timed_out and r > 0
        if r:
            rates["idle"].append(idle)
            rates["device-only poll"].append(dev_only)
            rates["symm poll"].append(symm)
    idle_med = statistics.median(rates["idle"])
    print(
        f"H2D copies of {args.copy_mib} MiB x {args.copies}, {args.rounds} rounds, "
        f"{programs} programs x {args.warps} warps waiting (median GB/s, min-max, / idle):"
    )
    for name, xs in rates.items():
        med = statistics.median(xs)
        print(f"  {name:>16}: {med:8.2f} ({min(xs):.2f}-{max(xs):.2f})  {med / idle_med:.3f}")
    if timeouts:
        print(f"  the symm poll hit its {args.timeout_s:g} s bound in {timeouts} rounds")


if __name__ == "__main__":
    main()
