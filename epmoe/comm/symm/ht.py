"""``symm_ht``: high-throughput Standard-layout dispatch/combine on torch symmetric memory.

The prefill sibling of ``symm_ll``, on the same buffers and Triton kernels (``kernels.py``):
each token is written once per destination rank that holds one of its experts, straight
into fixed rows ``[W, M, H]`` of that rank's symmetric buffer, with its local expert ids
(-1 for experts elsewhere) and router weights. The experts read the received rows where
they landed (``DispatchResult.hidden`` is a view of the buffer, ``[W·M, H]``): nothing is
expanded or copied on the receiver, and the row count is the worst case ``W·M`` (rows no
token filled carry ids -1), so no count reaches the host and the calls are graph safe.
Combine sends each row's partial sum (the experts weight and reduce their top-k outputs
per row in the Standard layout) back to its source, which adds the W partial sums in
float32: on many SMs in the same launch as the send, chunk by chunk while the later rows
still travel (``reducers``), else in a receive kernel at ``wait()``.

``num_sms`` is the SM budget, as DeepEP's: no launch of the backend runs more than
``num_sms`` programs (persistent loops over tokens). The dispatch's send and the combine's
receive have one grid axis and take it whole; the dispatch's receive and the combine's
send have a grid ``(W, ·)``, one column per rank, and split it (``num_sms // W`` each, at
least one); a streamed combine's reducers come out of it first. Unset, nothing is capped:
every kernel runs up to one program per SM for each rank (``W`` × the SMs in the kernels
with a column per rank; what the records without a budget measured). The FP8 quantization
that runs before a send on few SMs (``_quantize_first``) is a kernel of its own, outside
the budget, as DeepEP's callers quantize before its dispatch. The throughput against the
budget is what the comm benchmark reports.

Shape legend: T tokens on this rank · H hidden · G = ceil(H/128) · K top-k · W ranks ·
M = M_max tokens per rank · R = W·M received rows.
"""

from __future__ import annotations

import torch

from epmoe.comm.base import (
    Capabilities,
    CommSpec,
    DispatchResult,
    Layout,
    Pending,
    gpu_memory_reason,
)
from epmoe.comm.symm.common import (
    NUM_PARITIES,
    SymmBackend,
    SymmTransport,
    kernels,
    launch,
    pow2,
    symm_buffer_bytes,
)

# Rows (tokens) a program loads and stores at once: with few SMs (DeepEP's 24) a program
# that takes one row at a time waits on a load latency per row; several in flight keep
# the link busy (24 SMs, 4096 tokens: combine 851 -> 460 µs). Combine send: copies of
# bf16 rows; combine receive: float32 sums of W partial rows; dispatch (counted mode):
# rows with their routing. The most that fit in registers without spills at 8 warps.
SEND_ROWS = 4
DISPATCH_ROWS = 4
FUSED_FP8_ROWS = 2  # the same, FP8 quantized in the send (float32 copies of the rows)
FUSED_FP8_MIN_SMS = 64  # FP8 quantized in the send from this many SMs (see _quantize_first)
# Combine receive (the sum of W partial rows per token, from this GPU's memory): its rows
# per step in column blocks of RECV_BLOCK_H, the ranks' rows loaded at once, its warps,
# and the steps ahead whose rows it asks of the L2 first. Measured alone on one H200
# (4096 tokens, W = 2, .device-style sweep, 2026-12-01): 2 rows x 8192 columns without
# prefetch 240 / 118 / 90 µs on 24 / 66 / 132 SMs, 4 x 4096 with one step prefetched
# 145 / 91 / 81 µs (registers bound the bytes a program holds in flight; the L2 does not).
RECV_ROWS = 4
RECV_BLOCK_H = 4096
RECV_RANKS = 2
RECV_WARPS = 8
RECV_PREFETCH = 1
# The streamed combine (counted mode): tokens per count, and the SMs from which it is the
# default (half of them reduce). Below that the send is bound by its SMs, not the link,
# and SMs taken for the sum slow it as much as they hide.
STREAM_CHUNK = 512
STREAM_MIN_SMS = 64
# Rows of routing a program of the counted dispatch's receive publishes at once (after its
# one wait nothing orders them): 64 rows of ids and weights, 4 KiB in flight per program.
PUBLISH_ROWS = 64


class HTTransport(SymmTransport):
    """``symm_ht``'s buffers for one shape, shared by layers: the symmetric regions
    (``common.SymmTransport``; the received rows stay there) and, per parity, the
    published ``ids_out [R, K]`` int64 and ``w_out [R, K]`` float32 and ``recv_t [W]``
    (``routes`` as every symm transport)."""

    name = "symm_ht"

    def _allocate_local(self, spec: CommSpec) -> None:
        R, K, dev = self.world_size * self.M, self.K, self.device
        self.ids_out = [torch.full((R, K), -1, dtype=torch.int64, device=dev) for _ in range(2)]
        self.w_out = [torch.zeros(R, K, dtype=torch.float32, device=dev) for _ in range(2)]
        self.recv_t = [
            torch.zeros(self.world_size, dtype=torch.int32, device=dev) for _ in range(2)
        ]

    def close(self) -> None:
        super().close()
        self.ids_out = self.w_out = self.recv_t = []


class SymmHTBackend(SymmBackend):
    """High-throughput Standard-layout backend on torch symmetric memory (one NVLink node).

    ``DispatchResult.hidden [R, H]`` with ``R = W·M`` (FP8 with ``hidden_scale [R, G]``),
    ``topk_ids [R, K]`` int64 local slots (-1: elsewhere, and on rows no token filled) and
    ``topk_weights [R, K]``: views into the shared transport, valid until the combine of
    that result. ``expert_out`` for combine is ``[R, H]``, each row the weighted sum of its
    local experts' outputs. ``T <= spec.max_num_tokens`` on every call.
    """

    name = "symm_ht"
    transport_class = HTTransport
    sized_by_local_experts = False  # rows stay where they land: no [e, C, H] buffer
    capabilities = Capabilities(
        layouts=frozenset({Layout.STANDARD}),
        dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
        device_types=frozenset({"cuda"}),
        graph_safe=True,
        fp8_dispatch=True,
        max_in_flight=NUM_PARITIES,
        default_max_tokens=4096,  # prefill chunks; the buffers grow with W·M·H
        # auto: an EPMoE's prefill steps (above the decode backend's 256 tokens per rank) on
        # one NVLink node; measured on 2×H200 (docs/backends.md): at 128 tokens the layer
        # step is 12 % faster on symm_ll, at 4096 symm_ht moves tokens 3.6× / 2.8× faster
        # than all_to_all
    )

    @classmethod
    def supports(cls, spec: CommSpec) -> str | None:
        """Also refuses buffers too large for the GPU: the symmetric buffer (two parities
        of ``[W·M, H]`` rows each way) and the received ids and weights."""
        reason = super().supports(spec)
        if reason is not None:
            return reason
        R = spec.world_size * spec.max_num_tokens
        nbytes = symm_buffer_bytes(spec) + NUM_PARITIES * R * spec.top_k * (8 + 4)
        what = (
            f"symm_ht's buffers (two parities of W·M={spec.world_size}·{spec.max_num_tokens} "
            f"rows of H={spec.hidden_size}, each way)"
        )
        return gpu_memory_reason(what, spec, nbytes)

    def __init__(
        self,
        spec,
        group,
        layout=None,
        *,
        num_sms: int | None = None,
        tokens_per_flag: int = 0,
        reducers: int | None = None,
        combine_chunk: int = STREAM_CHUNK,
    ):
        """``num_sms``: the SM budget, the most programs any one launch runs (default
        none: up to every SM per rank; see the module docstring). ``tokens_per_flag``: 0 (the
        default), no flag per row: each program streams all its rows, then fences once and
        adds the number of its tokens to a count per source that the receivers wait for
        (they need every row before the experts run anyway), so no program ever waits for
        its own stores mid-way. 1, 2, 4 or 8: rows a program stores before it raises their
        flags (one system fence per batch, then relaxed flag writes). Measured on 2×H200 at
        4096 tokens (docs/benchmarks.md, 2026-12-01, graph, dispatch / combine µs): 0 gives
        187 / 237 bf16 and 130 / 237 FP8 on 132 SMs, 271 / 450 and 196 / 449 on 24; 4 rows
        per flag 208 / 247, 160 / 248, 491 / 573 and 469 / 574. ``reducers`` (counted mode
        only): of the ``num_sms`` programs, how many sum the partial rows in the combine's
        send kernel while the other rows still travel (a streamed combine; the experts'
        own rows are read where they are, not copied); 0: the sum runs at ``wait()`` on
        every SM, after all rows arrived. Default: half the SMs from ``STREAM_MIN_SMS``,
        else 0. ``combine_chunk``: tokens per count of a streamed combine (each sender
        fences once per chunk; the last chunk's sum is not hidden). Every rank must pass
        the same values (the modes signal differently: a mismatch reads as a timeout)."""
        # checked before the transport is taken (nothing to release on a refusal)
        if num_sms is not None and (type(num_sms) is not int or num_sms < 1):
            raise ValueError(
                f"num_sms must be a positive int (the SMs the kernels may occupy), got {num_sms!r}"
            )
        if tokens_per_flag not in (0, 1, 2, 4, 8) or type(tokens_per_flag) is not int:
            raise ValueError(
                f"tokens_per_flag must be 0 (one count per program), 1, 2, 4 or 8, got "
                f"{tokens_per_flag!r}"
            )
        if reducers is not None and (type(reducers) is not int or reducers < 0):
            raise ValueError(
                f"reducers must be a non-negative int (programs that sum the combine's rows "
                f"while they arrive; 0: at wait()), got {reducers!r}"
            )
        if type(combine_chunk) is not int or combine_chunk < 1:
            raise ValueError(
                f"combine_chunk must be a positive int (tokens per count of a streamed "
                f"combine), got {combine_chunk!r}"
            )
        if reducers and tokens_per_flag:
            raise ValueError(
                f"reducers={reducers} needs tokens_per_flag=0 (the streamed combine counts "
                f"tokens per chunk), got tokens_per_flag={tokens_per_flag}"
            )
        from epmoe.comm.symm.kernels import batch_fence

        self._sms = num_sms
        self._reducers = reducers
        self._chunk = combine_chunk
        self._counted = tokens_per_flag == 0
        self._batch = max(tokens_per_flag, 1)
        self._fence = batch_fence(self._batch)
        super().__init__(spec, group, layout)

    @property
    def _quantize_first(self) -> bool:
        """FP8: quantize in a kernel of its own before the send (on every SM) when the send
        has few SMs, in the send itself otherwise. Measured at 4096 tokens on 2×H200
        (docs/benchmarks.md): on 132 SMs 103 µs in the send against 121 first; on 24 SMs
        the send's quantization is the bottleneck, 274 against 152. With row flags
        (``tokens_per_flag`` > 0) always first (232 -> 181 µs)."""
        return not self._counted or self.num_sms < FUSED_FP8_MIN_SMS

    @property
    def num_sms(self) -> int:
        """The SM budget: ``num_sms`` if given (at most the device's), else every SM of the
        device (then per rank in the kernels with a column per rank: nothing is capped)."""
        return min(self._sms or self._live().num_sms, self._live().num_sms)

    def _grid(self, n: int) -> int:
        """Programs of a kernel with one grid axis, for ``n`` units of work."""
        return max(1, min(n, self.num_sms))

    def _grid_per_rank(self, n: int, taken: int = 0) -> int:
        """Programs in each rank's column of a kernel whose grid is ``(W, ·)``, for ``n``
        units of work per rank, once ``taken`` programs went elsewhere (a streamed
        combine's reducers): the budget shared among the W columns when ``num_sms`` was
        given (at least one each), else up to every SM in each."""
        per_rank = self.num_sms - taken
        if self._sms is not None:
            per_rank //= self.world_size
        return max(1, min(n, per_rank))

    @property
    def reducers(self) -> int:
        """Programs of the combine's send kernel that sum the rows while they arrive (0:
        the sum runs at ``wait()``); see ``__init__``."""
        if not self._counted:
            return 0
        if self._reducers is not None:  # (one sender left per column: see _grid_per_rank)
            senders = self.world_size if self._sms is not None else 1
            return min(self._reducers, max(self.num_sms - senders, 1))
        sms = self.num_sms
        return sms // 2 if sms >= STREAM_MIN_SMS else 0

    # ------------------------------------------------------------------ dispatch
    def dispatch_async(self, hidden_TH, topk_ids_TK, topk_weights_TK) -> Pending[DispatchResult]:
        """The send kernel now, the receive kernel (publishing ids and weights) at ``wait()``."""
        k = kernels()
        tr, x, ids, w, b, c = self._dispatch_prologue(hidden_TH, topk_ids_TK, topk_weights_TK)
        W, T = self.world_size, x.shape[0]
        reg = tr.regions[b]
        rows = 1
        if self._counted:  # (FP8 quantized in the send holds fewer rows in registers)
            rows = FUSED_FP8_ROWS if tr.fp8 and not self._quantize_first else DISPATCH_ROWS
        chunk = self._chunk if self.reducers else 0  # (the chunk counts it clears)
        tag = self.kernel_tag  # (the receive checks the tag this call was sent with)
        self._send(tr, x, ids, w, b, dict(c, CHUNK=chunk), self._grid(max(T, 1)), rows)

        publish = PUBLISH_ROWS if self._counted else 1

        def receive() -> DispatchResult:
            launch(k.ht_dispatch_recv_kernel)(
                (W, self._grid_per_rank(-(-tr.M // publish))),
                tr.bases, tr.ids_out[b], tr.w_out[b], tr.recv_t[b], tr.err_addr,
                tr.M, W, self.rank, tr.timeout_ns, tag, reg.flags, reg.ids, reg.w,
                K=c["K"], BLOCK_K=c["BLOCK_K"], COUNTED=self._counted, ROWS=publish,
                num_warps=4 if publish > 1 else 1,
            )  # fmt: skip
            rows, scale = tr.rows(b)
            return DispatchResult(
                layout=Layout.STANDARD,
                hidden=rows,
                topk_ids=tr.ids_out[b],
                topk_weights=tr.w_out[b],
                hidden_scale=scale,
                handle=self._handle(tr, b, ids, T, chunk),
            )

        return Pending(receive)

    # ------------------------------------------------------------------ combine
    def combine_async(self, expert_out, result) -> Pending[torch.Tensor]:
        """The send kernel (one row back per (token, rank)) now, the sum at ``wait()``."""
        k = kernels()
        h, y, c = self._combine_prologue(expert_out, result)
        tr, W, b = h.transport, self.world_size, h.parity
        reg = tr.regions[b]
        reducers = self.reducers
        if bool(h.chunk) != bool(reducers):
            # (the chunk counts a streamed combine waits for are cleared by its dispatch)
            raise RuntimeError(
                f"this dispatch result was made by a symm_ht with reducers="
                f"{'>0' if h.chunk else '0'}, this backend has reducers={reducers}: "
                "combine each result with the backend that dispatched it"
            )
        if reducers:
            return self._combine_streamed(h, y, c, reducers)
        launch(k.ht_combine_send_kernel)(
            (W, self._grid_per_rank(tr.M)),
            y, tr.bases, tr.ids_out[b], tr.recv_t[b],
            tr.H, tr.M, W, self.rank, reg.flags, reg.y,
            y, tr.recv_t[b], tr.err_addr, 0, 1, 0,  # (a streamed combine's only)
            BATCH=self._batch, FENCE=self._fence, COUNTED=self._counted,
            ROWS=SEND_ROWS if self._counted else min(self._batch, SEND_ROWS),
            num_warps=tr.num_warps, **c,
        )  # fmt: skip
        programs = self._grid(max(h.num_tokens, 1))
        recv = dict(rows=RECV_ROWS, ranks=RECV_RANKS, num_warps=RECV_WARPS, prefetch=RECV_PREFETCH)
        c = dict(c, BLOCK_H=min(RECV_BLOCK_H, c["BLOCK_H"]))
        return Pending(lambda: self._combine_receive(h, c, programs, **recv))

    def _combine_streamed(self, h, y, c, reducers: int) -> Pending[torch.Tensor]:
        """One launch: senders (the SM budget less the ``reducers``, per rank column) send
        the rows back chunk by chunk, the reducers sum each chunk of this rank's tokens as
        it completes."""
        tr, W, b, T = h.transport, self.world_size, h.parity, h.num_tokens
        reg = tr.regions[b]
        senders = self._grid_per_rank(tr.M, taken=reducers)
        out = torch.empty(T, tr.H, dtype=self.spec.dtype, device=tr.device)
        launch(kernels().ht_combine_send_kernel)(
            (W, senders + reducers),
            y, tr.bases, tr.ids_out[b], tr.recv_t[b],
            tr.H, tr.M, W, self.rank, reg.flags, reg.y,
            out, tr.routes[b], tr.err_addr, T, senders, tr.timeout_ns,
            BATCH=1, FENCE=False, COUNTED=True, ROWS=SEND_ROWS,
            STREAM=True, CHUNK=h.chunk, BLOCK_W=pow2(W),
            RECV_BLOCK_H=min(RECV_BLOCK_H, c["BLOCK_H"]), RECV_ROWS=RECV_ROWS,
            RECV_RANKS=min(RECV_RANKS, W),
            num_warps=tr.num_warps, **c,
        )  # fmt: skip

        def receive() -> torch.Tensor:
            self._combine_done(h)
            return out

        return Pending(receive)
