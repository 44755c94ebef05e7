"""``deepep_ll``: the ExpertBatched layout over DeepEP's low-latency mode.

``low_latency_dispatch`` writes each (token, expert) pair into fixed rows ``[e, W·M, H]``
of the expert's rank (FP8 with per-token 128-column scales made in the kernel when asked)
with per-expert counts; ``low_latency_combine`` sends the experts' unweighted outputs back
and reduces them with the router weights in the kernel. No host synchronisation: graph
safe. The split phase maps onto DeepEP's receive hook: ``dispatch_async`` / ``combine_async``
launch the send half only (``return_recv_hook=True``, no SMs held), ``wait()`` calls the
hook. DeepEP keeps two buffers, but each call clears the other's signals when it is
issued, so a call must be received before the next is issued: one result at a time
(``max_in_flight=1``; ``micro_batches=2`` is refused).

Limits (DeepEP's, refused by ``supports`` with the reason): H in {2048, 2560, 3072, 4096,
5120, 6144, 7168, 8192}, top-k ≤ 11, bf16, experts partitioned evenly, and every rank of
the group with the same ``max_num_tokens`` (a mismatch hangs inside DeepEP: the layer's
construction agreement checks it first). Needs NVSHMEM (DeepEP initialises it: one
low-latency buffer per process, shared by every layer of the group).

Shape legend: T tokens on this rank · H hidden · K top-k · W ranks · M = M_max · e local
experts · P physical experts.
"""

from __future__ import annotations

import os

import torch

from epmoe.comm import _deepep, transport
from epmoe.comm.base import (
    AllToAll,
    Capabilities,
    CommSpec,
    DispatchResult,
    Layout,
    Pending,
    check_combine_args,
    check_dispatch_args,
)

SUPPORTED_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
MAX_TOP_K = 11
NUM_BUFFERS = 2


def max_tokens() -> int:
    """DeepEP's largest ``max_num_tokens``: ``(M + 1) * 2 <= NVSHMEM_QP_DEPTH``, which it
    reads from the environment when its buffer is built (1024 unset: 511 tokens)."""
    raw = os.environ.get("NVSHMEM_QP_DEPTH", "1024")
    try:
        return int(raw) // 2 - 1
    except ValueError:
        raise ValueError(f"NVSHMEM_QP_DEPTH must be an integer, got {raw!r}") from None


class DeepEPLLBackend(AllToAll):
    """ExpertBatched dispatch/combine over DeepEP's low-latency kernels (graph safe)."""

    name = "deepep_ll"
    capabilities = Capabilities(
        layouts=frozenset({Layout.EXPERT_BATCHED}),
        dtypes=frozenset({torch.bfloat16}),
        device_types=frozenset({"cuda"}),
        graph_safe=True,
        fp8_dispatch=True,
        fp8_reference_quantizer=False,  # DeepEP's kernels quantize with their own arithmetic
        # DeepEP clears the other buffer's signals when it issues a call: call N must be
        # received before call N + 1 is issued, so one result at a time
        max_in_flight=1,
        default_max_tokens=128,
        auto=False,  # named only
    )

    @classmethod
    def unavailable_reason(cls, device, group=None) -> str | None:
        return super().unavailable_reason(device, group) or _deepep.unavailable_reason(group)

    @classmethod
    def supports(cls, spec: CommSpec) -> str | None:
        reason = super().supports(spec)
        if reason is not None:
            return reason
        if spec.hidden_size not in SUPPORTED_HIDDEN:
            return (
                f"DeepEP's low-latency kernels take H in {SUPPORTED_HIDDEN}, not {spec.hidden_size}"
            )
        if spec.top_k > MAX_TOP_K:
            return f"DeepEP's low-latency kernels take top-k <= {MAX_TOP_K}, not {spec.top_k}"
        W, M = spec.world_size, spec.max_num_tokens
        if (W * M) % 4:
            return f"DeepEP's low-latency kernels need W * max_num_tokens % 4 == 0, got {W} * {M}"
        limit = max_tokens()
        if spec.max_num_tokens > limit:
            return (
                f"DeepEP's low-latency mode takes max_num_tokens <= {limit} (its NVSHMEM "
                f"queue depth, (M + 1) * 2 <= NVSHMEM_QP_DEPTH), got {M}: lower max_num_tokens "
                "or raise NVSHMEM_QP_DEPTH on every rank"
            )
        return _deepep.even_partition_reason(spec)

    def __init__(self, spec, group, layout=None):
        super().__init__(spec, group, layout)
        self._deep_ep = _deepep.import_deep_ep()
        W, P, M, H = self.world_size, spec.num_physical, spec.max_num_tokens, spec.hidden_size
        Buffer = self._deep_ep.Buffer
        rdma_bytes = Buffer.get_low_latency_rdma_size_hint(M, H, W, P)
        transport.check_nvshmem_owner("deep_ep")  # its low-latency buffer initialises NVSHMEM
        self._hold = _deepep.acquire_buffer(
            self.name,
            self.group,
            "ll",
            {"rdma_bytes": rdma_bytes, "max_num_tokens": M, "num_experts": P, "hidden": H},
            exact=True,  # its layout (signal counters included) depends on M, P and H
            create=lambda: Buffer(
                _deepep.process_group(self.group),
                num_rdma_bytes=rdma_bytes,
                low_latency_mode=True,
                num_qps_per_rank=P // W,
                explicitly_destroy=True,
            ),
        )
        transport.claim_nvshmem("deep_ep")  # once its buffer exists: a failure locks no one out

    def _buffer(self):
        return self._hold.get().buffer

    def rebind_reason(self, spec: CommSpec) -> str | None:
        """A re-plan keeps the buffer only with the same slot count: DeepEP's low-latency
        buffer is built for P experts (P/W queue pairs per rank)."""
        allocated = self._hold.get().sizes["num_experts"] if self._hold.held else None
        if allocated is not None and spec.num_physical != allocated:
            return (
                f"deepep_ll's buffer serves P={allocated} expert slots, the new placement has "
                f"{spec.num_physical}: build the layers with the re-plans' slot count from "
                "the start (EPLBManager with a fixed num_redundant keeps it)"
            )
        return super().rebind_reason(spec)

    def dispatch(self, hidden_TH, topk_ids_TK, topk_weights_TK) -> DispatchResult:
        """The blocking dispatch: DeepEP's send and receive phases in one kernel (no
        receive hook), the way DeepEP's own tests time it."""
        return self._dispatch(hidden_TH, topk_ids_TK, topk_weights_TK, hook=False).wait()

    def dispatch_async(self, hidden_TH, topk_ids_TK, topk_weights_TK) -> Pending[DispatchResult]:
        """The send half now; ``wait()`` calls DeepEP's receive hook."""
        return self._dispatch(hidden_TH, topk_ids_TK, topk_weights_TK, hook=True)

    def _dispatch(self, hidden_TH, topk_ids_TK, topk_weights_TK, hook: bool):
        spec = self.spec
        check_dispatch_args(spec, hidden_TH, topk_ids_TK, topk_weights_TK, True)
        shared = self._hold.get()
        if shared.held >= 1:  # any layer's: the buffer is the group's
            raise RuntimeError(
                "deepep_ll holds one dispatch result at a time, for every layer of the group "
                "(DeepEP's next call clears the other buffer's signals): combine it before the "
                "next dispatch"
            )
        # copies, kept for the combine: the caller may reuse its buffers once the dispatch
        # has finished (the contract), and .to() of a matching tensor would return it
        idx_dtype = getattr(self._deep_ep, "topk_idx_t", torch.int64)
        ids = topk_ids_TK.to(idx_dtype, copy=True).contiguous()
        weights = topk_weights_TK.to(torch.float32, copy=True).contiguous()
        recv, counts, handle, _, recv_hook = shared.buffer.low_latency_dispatch(
            hidden_TH.contiguous(),
            ids,
            spec.max_num_tokens,
            spec.num_physical,
            use_fp8=spec.fp8_dispatch,
            return_recv_hook=hook,
        )
        shared.held += 1

        def receive() -> DispatchResult:
            if recv_hook is not None:  # (None without a hook: one kernel did both phases)
                recv_hook()
            if spec.fp8_dispatch:
                hidden, scale = recv
                scale = scale.contiguous()  # DeepEP keeps its last two dims column-major
            else:
                hidden, scale = recv, None
            return DispatchResult(
                layout=Layout.EXPERT_BATCHED,
                hidden=hidden,
                counts=counts,
                hidden_scale=scale,
                handle=(handle, ids, weights),
            )

        return Pending(receive)

    def combine(self, expert_out, result) -> torch.Tensor:
        """The blocking combine: DeepEP's two phases in one kernel (no receive hook)."""
        return self._combine(expert_out, result, hook=False).wait()

    def combine_async(self, expert_out, result) -> Pending[torch.Tensor]:
        """The send half of the weighted combine now; ``wait()`` calls the receive hook."""
        return self._combine(expert_out, result, hook=True)

    def _combine(self, expert_out, result, hook: bool) -> Pending[torch.Tensor]:
        check_combine_args(expert_out, result)
        if expert_out.dtype != torch.bfloat16:
            raise TypeError(f"deepep_ll combines bf16 rows, got {expert_out.dtype}")
        handle, ids, weights = result.handle
        shared = self._hold.get()
        combined, _, recv_hook = shared.buffer.low_latency_combine(
            expert_out.contiguous(), ids, weights, handle, return_recv_hook=hook
        )

        def receive() -> torch.Tensor:
            if recv_hook is not None:
                recv_hook()
            shared.held = max(shared.held - 1, 0)
            return combined

        return Pending(receive)

    def close(self) -> None:
        self._hold.release()
