"""``symm_ht``'s streamed combine with W ranks simulated on one GPU, their kernels running at
once on a stream each (``tests/unit/symm_sim.py``: a buffer per rank, one address table).

The streamed combine's reducers wait for the other ranks' senders inside the same kind of
launch, so the interpreter (one program after another) runs them in a launch of their own;
here the fused launches of all ranks run concurrently, with the real fences, acquire polls
and bounded waits, as they do across GPUs. Rounds alternate the parities, with T = 0 on a
rank, T = M, chunks that loop and a partial last chunk, and one rank's combine started 2 ms
late by the host (not by a ``torch.cuda._sleep`` on its stream: the first launch of that
kernel loads its module and waits for the device to be idle, which holds the host until
the waiting rank's bound has passed: a deadlock of this one-process simulation).

Run in the GPU tier: ``EPMOE_TEST_DEVICE=cuda python -m pytest tests/gpu/test_symm_ht_one_gpu.py``.
"""

from __future__ import annotations

import time

import pytest
import torch

if not torch.cuda.is_available():  # collected on CPU too; conftest skips the gpu mark
    pytest.skip("needs CUDA", allow_module_level=True)

pytestmark = pytest.mark.gpu

# The library's default (EPMOE_COMM_TIMEOUT_S)
TIMEOUT_NS = 10 * 10**9
CALLS = {  # tokens per rank, per round
    2: [(5, 0), (0, 3), (7, 8), (1, 1), (8, 2), (8, 8)],
    3: [(5, 0, 8), (0, 3, 1), (7, 8, 0), (1, 1, 6), (8, 2, 3), (8, 8, 8)],
}


@pytest.mark.parametrize("W", [2, 3], ids=["W=2", "W=3"])
def test_streamed_combine_of_ranks_running_at_once(W):
    """Each round: every rank's dispatch send, then receive (in stream order), then every
    rank's streamed combine (senders and reducers in one launch) on its own stream at once;
    the outputs are each token's weighted rows, no wait timed out, and the flags and counts
    are what the protocol says. Each call has its tag; in the third the last rank's is
    another layer's, which a receive reports (``ERR_LAYER``), and nothing else is; its
    tokens with an expert across that divide come back NaN."""
    from epmoe.comm.symm import kernels as k
    from tests.unit.symm_sim import Ranks

    sim = Ranks(W, H=300, device="cuda")
    M, H, K, dev = sim.M, sim.H, sim.K, sim.device
    chunk, senders, reducers = 3, 2, 2
    streams = [torch.cuda.Stream() for _ in range(W)]
    published = [
        [
            (
                torch.full((W * M, K), -1, dtype=torch.int64, device=dev),
                torch.zeros(W * M, K, device=dev),
                torch.zeros(W, dtype=torch.int32, device=dev),
            )
            for _ in range(2)
        ]
        for _ in range(W)
    ]
    for n, Ts in enumerate(CALLS[W]):
        parity = n % 2
        reg = sim.regions[parity]
        inputs = [sim.inputs(T) for T in Ts]
        # a tag per call (a layer's); in the third the last rank is in another layer's call
        tags = [n + 1] * (W - 1) + [99 if n == 2 else n + 1]
        for r in range(W):  # dispatch, send half
            sim.send(k, parity, r, inputs[r], 2, True, rows=4, chunk=chunk, tag=tags[r])
        for r in range(W):  # dispatch, receive half
            ids_out, w_out, recv_t = published[r][parity]
            k.ht_dispatch_recv_kernel[(W, 2)](
                sim.bases, ids_out, w_out, recv_t, sim.err_addr, M, W, r, 10**9,
                tags[r], reg.flags, reg.ids, reg.w, K=K, BLOCK_K=2, COUNTED=True, ROWS=4,
            )  # fmt: skip
        torch.cuda.synchronize()
        if n == 2:  # reported by a receiver of the odd rank's rows (it is named, or names)
            code = sim.err.item()
            assert code >> 16 == (k.ERR_LAYER << 8) | k.OP_DISPATCH, hex(code)
            sim.err.zero_()
        assert sim.err.item() == 0, f"round {n}: error word {sim.err.item():#x}"
        ys = [
            (sim.rows(r, parity) * published[r][parity][1].sum(1, keepdim=True)).contiguous()
            for r in range(W)
        ]
        outs = [torch.full((T, H), float("nan"), device=dev) for T in Ts]
        torch.cuda.synchronize()
        for r in range(W):  # combine: every rank's launch at once, rank 1 late every other round
            ids_out, _, recv_t = published[r][parity]
            streams[r].wait_stream(torch.cuda.current_stream())
            if r == 1 and n % 2:  # (on the host: see the module docstring)
                time.sleep(0.002)
            with torch.cuda.stream(streams[r]):
                k.ht_combine_send_kernel[(W, senders + reducers)](
                    ys[r], sim.bases, ids_out, recv_t, H, M, W, r, reg.flags, reg.y,
                    outs[r], sim.routes[r, parity], sim.err_addr, Ts[r], senders, TIMEOUT_NS,
                    K=K, BLOCK_K=2, BLOCK_H=128, BATCH=1, FENCE=False, COUNTED=True, ROWS=4,
                    STREAM=True, CHUNK=chunk, BLOCK_W=sim.BLOCK_W, RECV_BLOCK_H=128,
                    RECV_ROWS=4, RECV_RANKS=2,
                )  # fmt: skip
        torch.cuda.synchronize()
        assert sim.err.item() == 0, f"round {n}: error word {sim.err.item():#x}"
        for r in range(W):  # (NaN rows for tokens with an expert across the third's divide)
            want = sim.want(r, inputs[r], tags)
            torch.testing.assert_close(outs[r], want, msg=f"round {n}, rank {r}", equal_nan=True)
            sizes = [min(chunk, Ts[r] - c0) for c0 in range(0, Ts[r], chunk)]
            counts = torch.zeros(W, M, dtype=torch.int32, device=dev)
            counts[:, : len(sizes)] = torch.tensor(sizes, dtype=torch.int32, device=dev)
            counts[r] = 0  # (a rank sends nothing back to itself)
            assert torch.equal(sim.chunk_counts(r, parity), counts), (n, r)
        sim.assert_reset(parity, n)


def test_a_rank_that_never_combines_is_named_within_the_bound():
    """Rank 1 dispatches but never combines: rank 0's reducers give up after the bound
    (0.2 s here) and name rank 1 in the error word, in about that time, not a hang."""
    from epmoe.comm.symm import kernels as k
    from tests.unit.symm_sim import Ranks

    W, Ts = 2, (5, 4)
    sim = Ranks(W, H=300, device="cuda")
    M, H, K, dev = sim.M, sim.H, sim.K, sim.device
    reg = sim.regions[0]
    inputs = [sim.inputs(T) for T in Ts]
    published = []
    for r in range(W):
        sim.send(k, 0, r, inputs[r], 2, True, rows=4, chunk=3)
    for r in range(W):
        ids_out = torch.full((W * M, K), -1, dtype=torch.int64, device=dev)
        w_out, recv_t = (
            torch.zeros(W * M, K, device=dev),
            torch.zeros(W, dtype=torch.int32, device=dev),
        )
        k.ht_dispatch_recv_kernel[(W, 2)](
            sim.bases, ids_out, w_out, recv_t, sim.err_addr, M, W, r, TIMEOUT_NS, 0,
            reg.flags, reg.ids, reg.w, K=K, BLOCK_K=2, COUNTED=True, ROWS=4,
        )  # fmt: skip
        published.append((ids_out, w_out, recv_t))
    torch.cuda.synchronize()
    ids_out, w_out, recv_t = published[0]
    y = (sim.rows(0, 0) * w_out.sum(1, keepdim=True)).contiguous()
    out = torch.empty(Ts[0], H, device=dev)
    t0 = time.monotonic()
    k.ht_combine_send_kernel[(W, 4)](
        y, sim.bases, ids_out, recv_t, H, M, W, 0, reg.flags, reg.y,
        out, sim.routes[0, 0], sim.err_addr, Ts[0], 2, 200_000_000,
        K=K, BLOCK_K=2, BLOCK_H=128, BATCH=1, FENCE=False, COUNTED=True, ROWS=4,
        STREAM=True, CHUNK=3, BLOCK_W=sim.BLOCK_W, RECV_BLOCK_H=128, RECV_ROWS=4, RECV_RANKS=2,
    )  # fmt: skip
    torch.cuda.synchronize()
    seconds = time.monotonic() - t0
    assert sim.err.item() == (1 << 24) | (2 << 16) | 1  # timeout, combine, rank 1
    assert 0.1 < seconds < 2.0, seconds
