"""``symm_ll``: low-latency ExpertBatched dispatch/combine on torch symmetric memory.

Our own Triton kernels (``kernels.py``) store each token straight into the receive buffer
of every rank that holds one of its experts, over NVLink, and signal with release/acquire
flags: no host synchronisation, capturable in a CUDA graph, fixed buffers of ``M_max``
tokens per rank. Dispatch can quantize to FP8 inside the send kernel; combine applies the
router weights on the expert's rank and returns the input dtype. The blocking calls run
send and receive in one kernel launch; the split ones (``*_async``) a kernel per half.

The received rows stay where they landed: the receiver only writes each expert's row index
``[e, C]`` (``DispatchResult.row_index``) and the experts' first GEMM reads the rows
through it. ``rows_in_place=False`` copies them into ``[e, C, H]`` slabs instead (the
first design, kept for comparison: docs/benchmarks.md).

Shape legend: T tokens on this rank · H hidden · G = ceil(H/128) · K top-k · W ranks ·
M = M_max · e local experts (e_max the largest over ranks) · C = W·M rows per expert.

Buffers, parities and errors: ``common.py`` (shared with ``symm_ht``).
"""

from __future__ import annotations

import os

import torch

from epmoe.comm.base import (
    Capabilities,
    CommSpec,
    DispatchResult,
    Layout,
    Pending,
    expert_batched_memory_reason,
)
from epmoe.comm.symm.common import (
    BLOCK_E,
    NUM_PARITIES,
    SymmBackend,
    SymmTransport,
    kernels,
    launch,
    pow2,
    symm_buffer_bytes,
)


class LLTransport(SymmTransport):
    """``symm_ll``'s buffers for one shape, shared by layers: the symmetric regions
    (``common.SymmTransport``; the received rows stay there) and, per parity, the row index
    ``out [e_max, C]`` int32, ``counts [e_max]`` int32, ``pos [W, M, K]`` int32 and
    ``recv_t [W]`` int32 (each source's token count; ``-1 - T_s`` for a source in another
    layer's call, whose rows the combine then weights with NaN); ``routes`` as every
    symm transport."""

    name = "symm_ll"
    in_place = True

    def _allocate_local(self, spec: CommSpec) -> None:
        W, M, K = self.world_size, self.M, self.K
        self.C = W * M
        e, dev = max(self.e_max, 1), self.device
        i32 = dict(dtype=torch.int32, device=dev)
        # (the kernels' out_scale pointer is unused in place: any tensor)
        self.out = self.out_scale = [self._expert_rows(e) for _ in range(2)]
        self.counts = [torch.zeros(e, **i32) for _ in range(2)]
        self.pos = [torch.empty(W, M, K, **i32) for _ in range(2)]
        self.recv_t = [torch.zeros(W, **i32) for _ in range(2)]

    def _expert_rows(self, e: int) -> torch.Tensor:
        """One parity's per-expert rows: the index into the received rows."""
        return torch.zeros(e, self.C, dtype=torch.int32, device=self.device)

    def close(self) -> None:
        super().close()
        self.out = self.out_scale = self.counts = self.pos = []


class LLCopyTransport(LLTransport):
    """``rows_in_place=False``: ``out [e_max, C, H]`` holds copies of the received rows
    (wire dtype) and ``out_scale [e_max, C, G]`` float32 their FP8 scales."""

    in_place = False

    def _allocate_local(self, spec: CommSpec) -> None:
        super()._allocate_local(spec)
        e, C, dev = max(self.e_max, 1), self.C, self.device
        self.out_scale = [
            torch.empty(e, C, self.G, dtype=torch.float32, device=dev) if self.fp8 else x
            for x in self.out
        ]

    def _expert_rows(self, e: int) -> torch.Tensor:
        return torch.empty(e, self.C, self.H, dtype=self.wire, device=self.device)


def _memory_reason(spec: CommSpec, in_place: bool) -> str | None:
    """Rows in place: the experts' outputs ``[e, W·M, H]``; copied: also two parities of
    received slabs of that size; and the symmetric buffer either way."""
    copies = 0 if in_place else NUM_PARITIES  # (received rows, in the wire dtype)
    return expert_batched_memory_reason(
        "symm_ll", spec, copies, outputs=1, extra_bytes=symm_buffer_bytes(spec)
    )


def _rows_in_place_default() -> bool:
    raw = os.environ.get("EPMOE_SYMM_LL_ROWS", "in_place").strip() or "in_place"
    if raw not in ("in_place", "copy"):
        raise ValueError(f"EPMOE_SYMM_LL_ROWS must be in_place or copy, got {raw!r}")
    return raw == "in_place"


class SymmLLBackend(SymmBackend):
    """Low-latency ExpertBatched backend on torch symmetric memory (one NVLink node).

    ``DispatchResult.hidden [R, H]`` with ``R = W·M``: the received rows where they
    landed (FP8 with ``hidden_scale [R, G]`` when ``spec.dispatch_dtype`` is FP8),
    ``row_index [e, C]`` and ``counts [e]``: views into the shared transport, valid until
    the combine of that result; rows ``row_index[i, :counts[i]]`` are slot i's tokens in no
    fixed order (``expert_rows()`` gathers the ``[e, C, H]`` slabs). With
    ``rows_in_place=False``: ``hidden [e, C, H]`` copies (``hidden_scale [e, C, G]``) and no
    index. ``expert_out`` for combine is ``[e, C, H]`` either way.
    ``T <= spec.max_num_tokens`` on every call.
    """

    name = "symm_ll"
    transport_class = LLTransport
    # ``epmoe.bench.timeline`` sets these to int64 ``[programs, 8]`` tensors: the fused
    # kernels then record when each program reaches each of its steps (None: no records)
    stamps_dispatch: torch.Tensor | None = None
    stamps_combine: torch.Tensor | None = None
    capabilities = Capabilities(
        layouts=frozenset({Layout.EXPERT_BATCHED}),
        dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
        device_types=frozenset({"cuda"}),
        graph_safe=True,
        fp8_dispatch=True,
        max_in_flight=NUM_PARITIES,
        default_max_tokens=256,  # decode batches; larger ones go to a prefill backend
    )

    def __init__(self, spec, group, layout=None, *, rows_in_place: bool | None = None):
        """``rows_in_place``: the experts read the received rows through ``row_index``
        (the default); ``False`` copies them into ``[e, C, H]`` slabs (two parities of
        them). ``None`` reads ``EPMOE_SYMM_LL_ROWS`` (``in_place`` or ``copy``), so that a
        layer benchmark can compare the two without code."""
        if rows_in_place is None:
            rows_in_place = _rows_in_place_default()
        if type(rows_in_place) is not bool:
            raise TypeError(f"rows_in_place must be a bool, got {rows_in_place!r}")
        if not rows_in_place:  # (checked before the transport is taken)
            reason = _memory_reason(spec, False)
            if reason is not None:
                raise ValueError(f"backend {self.name!r} cannot serve this layer: {reason}")
        self.rows_in_place = rows_in_place
        self.transport_class = LLTransport if rows_in_place else LLCopyTransport
        super().__init__(spec, group, layout)

    @classmethod
    def supports(cls, spec: CommSpec) -> str | None:
        """Also refuses ExpertBatched buffers too large for the GPU: the experts' outputs
        ``[e, W·M, H]``, and with ``EPMOE_SYMM_LL_ROWS=copy`` two parities of received
        slabs too (see ``expert_batched_memory_reason``)."""
        try:
            in_place = _rows_in_place_default()
        except ValueError as exc:
            return str(exc)
        return super().supports(spec) or _memory_reason(spec, in_place)

    def construction_reason(self, spec: CommSpec) -> str | None:
        """As ``supports``, for this backend's own receive design (an explicit
        ``rows_in_place`` is not overridden by ``EPMOE_SYMM_LL_ROWS``)."""
        return super().supports(spec) or _memory_reason(spec, self.rows_in_place)

    rebind_reason = construction_reason

    @property
    def num_sms(self) -> int:
        """SMs the kernels may occupy: one short program per token, so a call is one wave
        over up to every SM of the device."""
        return self._live().num_sms

    # ------------------------------------------------------------------ dispatch
    def _dispatch_result(self, tr, b: int, ids: torch.Tensor, T: int) -> DispatchResult:
        views = self._views.get(b)
        if views is None:  # (made once per parity and binding: slicing costs host time)
            e = self._num_local
            if tr.in_place:
                rows, scale = tr.rows(b)
                index = tr.out[b][:e]
            else:
                rows, index = tr.out[b][:e], None
                scale = tr.out_scale[b][:e] if tr.fp8 else None
            views = self._views[b] = (rows, tr.counts[b][:e], scale, index)
        rows, counts, scale, index = views
        return DispatchResult(
            Layout.EXPERT_BATCHED, rows, None, None, counts, scale,
            self._handle(tr, b, ids, T), index,
        )  # fmt: skip

    def dispatch(self, hidden_TH, topk_ids_TK, topk_weights_TK) -> DispatchResult:
        """The blocking dispatch: send and receive in one kernel launch (bound once per
        parity: a call fills in its tensors, ``T`` and the tag; see
        ``kernels.launcher.BoundLaunch``)."""
        tr, x, ids, w, b, c = self._dispatch_prologue(hidden_TH, topk_ids_TK, topk_weights_TK)
        T, tag, stamps = x.shape[0], self.kernel_tag, self.stamps_dispatch
        try:
            bound = self._bound.get(("dispatch", b))
            if (
                bound is None
                or stamps is not None
                or not bound(1 + T + self.world_size * tr.M, x, ids, w, T, tag)
            ):
                self._launch_dispatch(tr, x, ids, w, b, c, T, tag, stamps)
        except BaseException:
            tr.give_back(b)
            raise
        return self._dispatch_result(tr, b, ids, T)

    def _launch_dispatch(self, tr, x, ids, w, b, c, T, tag, stamps) -> None:
        """The fused dispatch through ``launch`` (and bound for the parity's next calls,
        without timeline stamps)."""
        spec, W, reg = self.spec, self.world_size, tr.regions[b]
        args = (
            x, ids, w, self._owner_P, self._local_P, tr.bases, tr.err_addr,
            tr.out[b], tr.out_scale[b], tr.counts[b], tr.pos[b], tr.recv_t[b],
            tr.counts[b] if stamps is None else stamps,
            T, tr.H, spec.num_physical, tr.M, W, tr.G, tr.C, self.rank, tr.timeout_ns,
            tag, reg.flags, reg.x, reg.s, reg.ids, reg.w, tr.routes[b],
        )  # fmt: skip
        grid = (1 + T + W * tr.M,)
        meta = dict(IN_PLACE=tr.in_place, STAMPS=stamps is not None, num_warps=tr.num_warps)
        launcher = launch(kernels().ll_dispatch_kernel)
        launcher(grid, *args, **meta, **c)
        if stamps is None:  # (x, ids, w, T, tag vary; the rest is the parity's)
            self._bound[("dispatch", b)] = launcher.bind(
                grid, *args, variable=(0, 1, 2, 13, 22), **meta, **c
            )

    def dispatch_async(self, hidden_TH, topk_ids_TK, topk_weights_TK) -> Pending[DispatchResult]:
        """The split dispatch: the send kernel now, the receive kernel at ``wait()``."""
        k = kernels()
        tr, x, ids, w, b, c = self._dispatch_prologue(hidden_TH, topk_ids_TK, topk_weights_TK)
        W, T = self.world_size, x.shape[0]
        reg = tr.regions[b]
        tag = self.kernel_tag  # (the receive checks the tag this call was sent with)
        self._send(tr, x, ids, w, b, c, max(1, T))  # one program per token

        def receive() -> DispatchResult:
            launch(k.ll_dispatch_recv_kernel)(
                (W, tr.M),
                tr.bases, tr.out[b], tr.out_scale[b], tr.counts[b],
                tr.pos[b], tr.recv_t[b], tr.err_addr,
                tr.H, tr.M, W, tr.G, tr.C, self.rank, tr.timeout_ns, tag,
                reg.flags, reg.x, reg.s, reg.ids,
                K=c["K"], BLOCK_K=c["BLOCK_K"], BLOCK_H=c["BLOCK_H"], FP8=c["FP8"],
                WIRE=c["WIRE"], IN_PLACE=tr.in_place, num_warps=tr.num_warps,
            )  # fmt: skip
            return self._dispatch_result(tr, b, ids, T)

        return Pending(receive)

    # ------------------------------------------------------------------ combine
    def combine(self, expert_out, result) -> torch.Tensor:
        """The blocking combine: send and receive in one kernel launch (bound once per
        parity, as ``dispatch``)."""
        h, y, c = self._combine_prologue(expert_out, result)
        tr, T, b, stamps = h.transport, h.num_tokens, h.parity, self.stamps_combine
        out = torch.empty(T, tr.H, dtype=self.spec.dtype, device=tr.device)
        bound = self._bound.get(("combine", b))
        programs = self.world_size * tr.M + max(1, T)
        if bound is None or stamps is not None or not bound(programs, y, out, out, T):
            self._launch_combine(tr, h, y, out, c, stamps)
        self._combine_done(h)
        return out

    def _launch_combine(self, tr, h, y, out, c, stamps) -> None:
        """The fused combine through ``launch`` (and bound, as ``_launch_dispatch``)."""
        W, T, b = self.world_size, h.num_tokens, h.parity
        reg = tr.regions[b]
        args = (
            y, tr.bases, tr.pos[b], tr.recv_t[b], tr.counts[b], out, tr.err_addr,
            out if stamps is None else stamps,
            tr.e_max, T, tr.H, tr.M, W, self.rank, tr.timeout_ns,
            reg.flags, reg.w, reg.y, tr.routes[b],
        )  # fmt: skip
        grid = (W * tr.M + max(1, T),)
        meta = dict(BLOCK_W=pow2(W), BLOCK_E=BLOCK_E, STAMPS=stamps is not None)
        launcher = launch(kernels().ll_combine_kernel)
        launcher(grid, *args, num_warps=tr.num_warps, **meta, **c)
        if stamps is None:  # (y, out, T vary; the rest is the parity's)
            self._bound[("combine", b)] = launcher.bind(
                grid, *args, variable=(0, 5, 7, 9), num_warps=tr.num_warps, **meta, **c
            )

    def combine_async(self, expert_out, result) -> Pending[torch.Tensor]:
        """The split combine: the send kernel now, the receive kernel at ``wait()``."""
        k = kernels()
        h, y, c = self._combine_prologue(expert_out, result)
        tr, W, b = h.transport, self.world_size, h.parity
        reg = tr.regions[b]
        launch(k.ll_combine_send_kernel)(
            (W, tr.M),
            y, tr.bases, tr.pos[b], tr.recv_t[b], tr.counts[b], tr.e_max,
            tr.H, tr.M, W, self.rank,
            reg.flags, reg.w, reg.y,
            BLOCK_E=BLOCK_E, num_warps=tr.num_warps, **c,
        )  # fmt: skip

        # one program per token
        return Pending(lambda: self._combine_receive(h, c, max(1, h.num_tokens)))
