"""W ranks of the symmetric-memory backends simulated in one process, for the protocol
tests under the Triton interpreter: a symmetric buffer per rank, reached by every
rank's kernels through one address table, and the kernels of each phase launched rank by
rank in the order the W streams would run them (every wait is then already met). With
``device="cuda"`` the buffers live on one GPU, where the ranks' kernels can also run
concurrently on streams of their own (``tests/gpu/test_symm_ht_one_gpu.py``).

Shape legend: W ranks (2 unless given) · M tokens per rank · H hidden · K top-k · E = 2W
experts (linear placement: 2 per rank).
"""

from __future__ import annotations

import torch

from epmoe.comm.symm.common import layout, status_block


def assert_interpreted_fp8(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """FP8 values a kernel made under the Triton interpreter against torch's e4m3 cast of
    the same inputs: equal, except where torch's rounding carried into the next binade (a
    power of two): the interpreter's cast drops that carry and gives half of it (about 2 %
    of random values). Anything else, a wrong scale or row included, fails; the GPU tests
    check bit equality."""
    a, b = actual.float(), expected.float()
    assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)}, want {tuple(b.shape)}"
    differ = a != b
    mantissa, _ = torch.frexp(b[differ].abs())
    carry_dropped = (mantissa == 0.5) & (a[differ] == b[differ] / 2)
    if not bool(carry_dropped.all()):
        bad = differ.nonzero()[~carry_dropped]
        first = tuple(bad[0].tolist())
        raise AssertionError(
            f"{name}: {len(bad)} of {a.numel()} FP8 values differ from torch's cast beyond the "
            f"interpreter's dropped carry, first at {first}: {float(a[first])} against "
            f"{float(b[first])}"
        )


class Ranks:
    """Buffers, routing tables and checks shared by the ``symm_ll`` and ``symm_ht``
    protocol tests. ``W, M, H, K, E`` as in the legend; float32 rows on the wire, or FP8
    rows with float32 scales per 128 columns (``fp8``)."""

    M, K = 8, 2

    def __init__(self, W: int = 2, H: int = 128, fp8: bool = False, device: str = "cpu") -> None:
        self.W, self.E, self.H, self.G = W, 2 * W, H, -(-H // 128)
        self.BLOCK_W = 1 << max(W - 1, 0).bit_length()  # (a power of two >= W)
        W, M, H, K = self.W, self.M, self.H, self.K
        wire = torch.float8_e4m3fn if fp8 else torch.float32
        self.regions, nbytes = layout(W, M, H, K, wire, torch.float32, fp8)
        self.bufs = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(W)]
        self.bases = torch.tensor(
            [b.data_ptr() for b in self.bufs], dtype=torch.int64, device=device
        )
        self.err = torch.zeros(1, dtype=torch.int32, device=device)
        # what the kernels are given: the status block around the error word
        self.status = status_block(self.err, device)
        self.err_addr = self.status.data_ptr()
        per_rank = self.E // W
        self.owner = (torch.arange(self.E, dtype=torch.int32) // per_rank).to(device)
        self.local = (torch.arange(self.E, dtype=torch.int32) % per_rank).to(device)
        self.gen = torch.Generator().manual_seed(0)
        # [W, parity, M] the ranks each token went to (the dispatch send's routes)
        self.routes = torch.zeros(W, 2, M, dtype=torch.int32, device=device)
        self.device = torch.device(device)

    def inputs(self, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x [T, H], ids [T, K], w [T, K])``: distinct experts per token, token 1 (when
        there is one) routed nowhere."""
        x = torch.randn(T, self.H, generator=self.gen)
        ids = torch.rand(T, self.E, generator=self.gen).argsort(1)[:, : self.K].contiguous()
        if T > 1:
            ids[1] = -1
        w = torch.rand(T, self.K, generator=self.gen)
        return x.to(self.device), ids.to(self.device), w.to(self.device)

    def flags(self, r: int, parity: int) -> torch.Tensor:
        """Rank r's int32 flags: expect[W], started[W], dflag[W, M], cflag[W, M], done[W],
        cdone[W], ccount[W, M] (see ``kernels.py``)."""
        W, M = self.W, self.M
        start = self.regions[parity].flags
        return self.bufs[r][start : start + (4 * W + 3 * W * M) * 4].view(torch.int32)

    def chunk_counts(self, r: int, parity: int) -> torch.Tensor:
        """Rank r's ``ccount [W, M]`` (a streamed combine's count per rank and chunk)."""
        W, M = self.W, self.M
        return self.flags(r, parity)[4 * W + 2 * W * M :].view(W, M)

    def counts(self, r: int, parity: int) -> tuple[list[int], list[int]]:
        """Rank r's ``(done, cdone)``."""
        f = self.flags(r, parity)[2 * self.W + 2 * self.W * self.M :]
        return f[: self.W].tolist(), f[self.W : 2 * self.W].tolist()

    def rows(self, r: int, parity: int) -> torch.Tensor:
        """The rows rank r received, ``[W·M, H]``, where the senders stored them."""
        n = self.W * self.M
        start = self.regions[parity].x
        return self.bufs[r][start : start + n * self.H * 4].view(torch.float32).view(n, -1)

    def send(
        self, kernels, parity, r, inputs, grid: int, counted: bool, rows: int = 1, chunk: int = 0,
        tag: int = 0,
    ) -> None:  # fmt: skip
        """Rank r's dispatch send half (``dispatch_send_kernel``, float32 rows, a flag per
        token or, ``counted``, one count per program, ``rows`` tokens at a time) on
        ``grid`` programs; ``chunk``: a streamed combine's chunk counts cleared first;
        ``tag``: the call's tag."""
        import triton.language as tl

        x, ids, w = inputs
        reg = self.regions[parity]
        kernels.dispatch_send_kernel[(grid,)](
            x, x, ids, w, self.owner, self.local, self.bases, self.err_addr,
            self.routes[r, parity], x.shape[0],
            self.H, self.E, self.M, self.W, 1, r, tag, reg.flags, reg.x, reg.s, reg.ids, reg.w,
            K=self.K, BLOCK_K=2, BLOCK_W=self.BLOCK_W, BLOCK_H=128, FP8=False, WIRE=tl.float32,
            FP8_MAX=448.0, INV_FP8_MAX=1 / 448, EPS=1e-10, BATCH=1, FENCE=False,
            PREQUANT=False, COUNTED=counted, ROWS=rows, ROUTES=True, CHUNK=chunk,
        )  # fmt: skip

    def want(self, r: int, inputs, tags: list[int] | None) -> torch.Tensor:
        """What rank r's combine returns: each token's row times the sum of its router
        weights; NaN for a token with an expert on a rank whose call ``tags`` differ from
        r's (the receive poisons the weights of rows from another layer's call)."""
        x, ids, w = inputs
        want = x * torch.where(ids >= 0, w, 0.0).sum(1, keepdim=True)
        if tags is not None:
            other = torch.tensor([tag != tags[r] for tag in tags], device=ids.device)
            hit = ((ids >= 0) & other[self.owner[ids.clamp(min=0)].long()]).any(1)
            want[hit] = float("nan")
        return want

    def combine_receive(
        self, kernels, parity, r, inputs, grid: int, counted: bool, rows: int = 1, ranks: int = 1,
        prefetch: int = 0, tags: list[int] | None = None,
    ) -> None:  # fmt: skip
        """Rank r's combine receive (``rows`` tokens per program at a time, ``ranks`` ranks'
        partial rows loaded at once, ``prefetch`` steps ahead asked of the L2: the loop and
        its masks run, the PTX prefetch does not under the interpreter), checked against
        ``want`` (``tags``: every rank's call tag)."""
        x, ids, w = inputs
        T, reg = x.shape[0], self.regions[parity]
        out = torch.empty(T, self.H)
        kernels.combine_recv_kernel[(grid,)](
            out, ids, self.owner, self.bases, self.err_addr, self.routes[r, parity],
            T, self.H, self.E, self.W,
            self.M, r, 10**9, reg.flags, reg.y, K=self.K, BLOCK_K=2, BLOCK_W=self.BLOCK_W,
            BLOCK_H=128,
            COUNTED=counted, ROWS=rows, RANKS=ranks, PREFETCH=prefetch,
        )  # fmt: skip
        want = self.want(r, inputs, tags)
        torch.testing.assert_close(out, want, msg=f"rank {r}", equal_nan=True)

    def combine_reduce(
        self, kernels, parity, r, inputs, y, grid: int, chunk: int, tags: list[int] | None = None
    ) -> None:
        """Rank r's streamed-combine reducers in a launch of their own
        (``ht_combine_reduce_kernel``, after every rank's send), ``y`` its experts' rows
        (its own partial rows are read there), checked as ``combine_receive``."""
        x, ids, w = inputs
        T, reg = x.shape[0], self.regions[parity]
        out = torch.empty(T, self.H, device=self.device)
        kernels.ht_combine_reduce_kernel[(grid,)](
            y, out, self.routes[r, parity], self.bases, self.err_addr, T, self.H,
            self.W, self.M, r, 10**9, reg.flags, reg.y, CHUNK=chunk, BLOCK_W=self.BLOCK_W,
            BLOCK_H=128, ROWS=4, RANKS=2 if self.W > 1 else 1,
        )  # fmt: skip
        want = self.want(r, inputs, tags)
        torch.testing.assert_close(out, want, msg=f"rank {r}", equal_nan=True)

    def assert_reset(self, parity: int, call: int) -> None:
        """No error; every rank's ``expect`` and row flags back to 0 for the parity's next
        call."""
        assert self.err.item() == 0
        W, M = self.W, self.M
        for r in range(W):
            f = self.flags(r, parity)
            assert not f[:W].any() and not f[2 * W : 2 * W + 2 * W * M].any(), (call, r)


TwoRanks = Ranks  # (W = 2, the default)
