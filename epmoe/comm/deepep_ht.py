"""``deepep_ht``: the Standard layout over DeepEP's high-throughput (normal) mode.

``get_dispatch_layout`` then ``Buffer.dispatch`` send each token once per destination rank
over NVLink; the receiver gets rows ``[R, H]`` (FP8 with ``[R, H/128]`` scales when asked)
with the top-k ids remapped to local slots (-1 elsewhere) and the router weights, which is
epmoe's Standard layout as it is. DeepEP's combine is an unweighted sum of the rows sent
back, which is what the Standard experts return (each row's weighted sum over its local
experts). The received counts reach the host (DeepEP's CPU sync), so the calls are not
graph safe, unless ``worst_case_rows=True``: DeepEP's ``num_worst_tokens`` path, with
``W·M`` received rows whatever came (ids -1 and weights 0 on rows no token filled, as
``symm_ht``), no CPU sync, and the calls graph safe. bf16 only (DeepEP's kernels); FP8
rows are quantized here, per token and 128-column group, before the send.

Shape legend: T tokens on this rank · H hidden · K top-k · W ranks · P physical experts ·
R received rows.
"""

from __future__ import annotations

import dataclasses

import torch

from epmoe.comm import _deepep
from epmoe.comm.base import (
    FP8_GROUP,
    AllToAll,
    Capabilities,
    CommSpec,
    DispatchResult,
    Layout,
    Pending,
    check_combine_args,
    check_dispatch_args,
)

NVL_BYTES_FLOOR = 1 << 28  # at least 256 MiB of NVLink buffer, as DeepEP's tests use more
NVL_RECV_TOKENS = 256  # DeepEP's NVLink receive buffer per channel, in tokens (its configs')


def _check_tuning(num_sms, nvl_chunks) -> None:
    """Refuse, naming the option, an SM count or chunk sizes DeepEP would assert on."""
    if num_sms is not None and (type(num_sms) is not int or num_sms < 2 or num_sms % 2):
        raise ValueError(
            f"num_sms must be an even int >= 2 (DeepEP runs a channel on two SMs), got {num_sms!r}"
        )
    if nvl_chunks is not None:
        ok = isinstance(nvl_chunks, (tuple, list)) and len(nvl_chunks) == 2
        if not ok or not all(type(c) is int and 0 < c < NVL_RECV_TOKENS for c in nvl_chunks):
            raise ValueError(
                "nvl_chunks must be (dispatch, combine) tokens per NVLink chunk, two ints in "
                f"[1, {NVL_RECV_TOKENS}), got {nvl_chunks!r}"
            )


# DeepEP's normal-mode limits (csrc/kernels/intranode.cu at 567632d): shared memory per
# warp for a staged half row (its TMA bytes), and threads of its layout notification
MAX_STAGED_BYTES = 8192
MAX_LOCAL_EXPERTS = 128


class DeepEPHTBackend(AllToAll):
    """Standard-layout dispatch/combine over ``deep_ep.Buffer`` (normal mode, one node).

    Experts must be partitioned evenly (P/W per rank, linear order): see ``supports``.
    """

    name = "deepep_ht"
    capabilities = Capabilities(
        layouts=frozenset({Layout.STANDARD}),
        dtypes=frozenset({torch.bfloat16}),
        device_types=frozenset({"cuda"}),
        graph_safe=False,  # the received counts reach the host
        fp8_dispatch=True,
        auto=False,  # named only
    )

    @classmethod
    def unavailable_reason(cls, device, group=None) -> str | None:
        return super().unavailable_reason(device, group) or _deepep.unavailable_reason(group)

    @classmethod
    def capabilities_with(cls, *, worst_case_rows: bool = False, **options) -> Capabilities:
        """``worst_case_rows=True``: graph safe (no count reaches the host)."""
        return (
            dataclasses.replace(cls.capabilities, graph_safe=True)
            if worst_case_rows
            else cls.capabilities
        )

    @classmethod
    def supports(cls, spec: CommSpec) -> str | None:
        reason = super().supports(spec)
        if reason is not None:
            return reason
        if spec.top_k > 32:
            return f"DeepEP's normal mode takes top-k <= 32, not {spec.top_k}"
        if spec.hidden_size % 8:
            return (
                f"DeepEP's kernels move rows in 16-byte vectors: H % 8 == 0, not {spec.hidden_size}"
            )
        if spec.fp8_dispatch and spec.hidden_size % FP8_GROUP:
            return f"DeepEP's FP8 rows need H divisible by 128, not {spec.hidden_size}"
        # its dispatch stages each half row in 8 KiB of shared memory per warp, behind an
        # mbarrier, and traps on other rows (intranode.cu, 567632d): whole 16-byte vectors
        # in each half, H * wire bytes / 2 + 8 <= 8192
        H, row_bytes = spec.hidden_size, spec.hidden_size * spec.wire_dtype.itemsize
        if row_bytes % 32 or row_bytes // 2 + 8 > MAX_STAGED_BYTES:
            largest = (MAX_STAGED_BYTES - 8) * 2 // 32 * 32 // spec.wire_dtype.itemsize
            hint = (
                ""
                if spec.fp8_dispatch
                else "; FP8 dispatch (dispatch_dtype=float8_e4m3fn) takes rows twice as wide"
            )
            return (
                f"DeepEP's normal-mode dispatch takes rows of H * {spec.wire_dtype.itemsize} "
                f"bytes with H a multiple of {32 // spec.wire_dtype.itemsize} and at most "
                f"{largest}, not H={H}{hint}; or use symm_ht / all_to_all"
            )
        if spec.num_physical // spec.world_size > MAX_LOCAL_EXPERTS:
            return (
                f"DeepEP's normal mode takes at most {MAX_LOCAL_EXPERTS} expert slots per rank, "
                f"this placement has {spec.num_physical // spec.world_size} (P={spec.num_physical}"
                f" over W={spec.world_size}): use more ranks, fewer redundant slots, or symm_ht"
            )
        return _deepep.even_partition_reason(spec)

    def __init__(
        self,
        spec,
        group,
        layout=None,
        *,
        worst_case_rows: bool = False,
        num_sms: int | None = None,
        nvl_chunks: tuple[int, int] | None = None,
    ):
        """``worst_case_rows``: receive ``W·M`` rows (``M = spec.max_num_tokens``) with no
        CPU sync (DeepEP's ``num_worst_tokens``, one node), which makes the calls graph
        safe and every call at most M tokens; else exactly the rows that came, counted on
        the host. ``num_sms`` (even) and ``nvl_chunks`` (dispatch, combine: tokens per
        NVLink chunk) tune DeepEP's kernels (its ``Config``); unset, DeepEP's recommended
        configuration for this rank count at its ``Buffer.num_sms`` (20 in 567632d; its
        README and tests set 24). DeepEP's ``tests/test_intranode.py`` prints the best
        chunks for a machine."""
        if type(worst_case_rows) is not bool:
            raise TypeError(f"worst_case_rows must be a bool, got {worst_case_rows!r}")
        _check_tuning(num_sms, nvl_chunks)
        if num_sms is not None and spec.device.type == "cuda":
            have = torch.cuda.get_device_properties(spec.device).multi_processor_count
            if num_sms > have:
                raise ValueError(f"num_sms={num_sms} exceeds the {have} SMs of {spec.device}")
        super().__init__(spec, group, layout)
        self._worst = self.world_size * spec.max_num_tokens if worst_case_rows else 0
        self.capabilities = type(self).capabilities_with(worst_case_rows=worst_case_rows)
        self._deep_ep = _deepep.import_deep_ep()
        # a buffer of its own: a host-counted dispatch polls a count in the buffer that a
        # worst-case dispatch queued before it may still write
        W, H = self.world_size, spec.hidden_size
        Buffer = self._deep_ep.Buffer
        self._configs = self._tuned_configs(num_sms, nvl_chunks)  # (dispatch, combine)
        dispatch_config, combine_config = (
            tuned or default
            for tuned, default in zip(
                self._configs, (Buffer.get_dispatch_config(W), Buffer.get_combine_config(W))
            )
        )
        hint = max(
            dispatch_config.get_nvl_buffer_size_hint(H * 2, W),
            combine_config.get_nvl_buffer_size_hint(H * 2, W),
        )
        nvl_bytes = max(hint, NVL_BYTES_FLOOR)
        self._hold = _deepep.acquire_buffer(
            self.name,
            self.group,
            "ht-worst-case" if worst_case_rows else "ht",
            {"nvl_bytes": nvl_bytes},
            create=lambda: Buffer(
                _deepep.process_group(self.group), nvl_bytes, 0, explicitly_destroy=True
            ),
        )

    def _tuned_configs(self, num_sms, nvl_chunks) -> tuple:
        """DeepEP ``Config``s for dispatch and combine from the options, or ``(None,
        None)``: DeepEP's own choice per call."""
        if num_sms is None and nvl_chunks is None:
            return None, None
        Buffer, Config = self._deep_ep.Buffer, self._deep_ep.Config
        sms = num_sms if num_sms is not None else Buffer.num_sms
        if nvl_chunks is not None:
            return tuple(Config(sms, chunk, NVL_RECV_TOKENS) for chunk in nvl_chunks)
        # DeepEP's recommended chunks with this SM count: its configs read Buffer.num_sms
        old = Buffer.num_sms
        try:
            Buffer.num_sms = sms
            W = self.world_size
            return Buffer.get_dispatch_config(W), Buffer.get_combine_config(W)
        finally:
            Buffer.num_sms = old

    def _buffer(self):
        return self._hold.get().buffer

    def dispatch_async(self, hidden_TH, topk_ids_TK, topk_weights_TK) -> Pending[DispatchResult]:
        """DeepEP dispatches on the current stream and returns when the rows are known on
        the host (or, with worst-case rows, once the kernels are queued): the result is
        ready (a finished ``Pending``)."""
        spec, buffer = self.spec, self._buffer()
        check_dispatch_args(spec, hidden_TH, topk_ids_TK, topk_weights_TK, self._worst > 0)
        ids = topk_ids_TK.to(getattr(self._deep_ep, "topk_idx_t", torch.int64)).contiguous()
        weights = topk_weights_TK.to(torch.float32).contiguous()
        x = hidden_TH.contiguous()
        if spec.fp8_dispatch:
            from epmoe.kernels.ops import per_token_group_quant_fp8

            x = per_token_group_quant_fp8(x)  # (e4m3 [T, H], float32 [T, H/128])
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(
            ids, spec.num_physical
        )
        extra = {"num_worst_tokens": self._worst} if self._worst else {}
        if self._configs[0] is not None:
            extra["config"] = self._configs[0]
        recv_x, recv_ids, recv_weights, _, handle, _ = buffer.dispatch(
            x,
            topk_idx=ids,
            topk_weights=weights,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            **extra,
        )
        hidden, scale = recv_x if spec.fp8_dispatch else (recv_x, None)
        recv_ids = recv_ids.to(torch.int64)
        if self._worst:  # rows no token filled: ids -1 (DeepEP's), weights unset until here
            recv_weights = torch.where(recv_ids >= 0, recv_weights, 0.0)
        return Pending.done(
            DispatchResult(
                layout=Layout.STANDARD,
                hidden=hidden,
                topk_ids=recv_ids,
                topk_weights=recv_weights,
                hidden_scale=scale,
                handle=handle,
            )
        )

    def combine_async(self, expert_out, result) -> Pending[torch.Tensor]:
        """The rows' partial sums back to their sources, summed there (DeepEP adds them)."""
        check_combine_args(expert_out, result)
        if expert_out.dtype != torch.bfloat16:
            raise TypeError(f"deepep_ht combines bf16 rows, got {expert_out.dtype}")
        tuned = {} if self._configs[1] is None else {"config": self._configs[1]}
        combined, _, _ = self._buffer().combine(expert_out.contiguous(), result.handle, **tuned)
        return Pending.done(combined)

    def close(self) -> None:
        self._hold.release()
