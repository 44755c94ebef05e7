"""Local experts on epmoe's own Triton kernels, for both layouts a backend delivers.

Shape legend: H hidden · I intermediate · e local experts · R received rows · K top-k ·
C rows of capacity per local expert.

Standard: the (row, k) pairs are grouped by expert on the GPU (no host sync), GEMM 1 runs
with ``act(gate)·up`` fused, GEMM 2 scales rows by their router weights, and a last kernel
sums each row's pairs. ExpertBatched: GEMM 1 and GEMM 2 over a fixed grid that skips the
tiles past ``counts`` (CUDA-graph capturable once the config is fixed). FP8 weights
(``float8_e4m3fn`` with 128×128 block or per-expert scales) run W8A8: activations are
quantized per token and group of 128 columns (or arrive so from an FP8 dispatch).
"""

from __future__ import annotations

from typing import Any

import torch

from epmoe.experts.base import Experts, ExpertWeights
from epmoe.kernels import ops
from epmoe.kernels.configs import MoEConfig


class TritonExperts(Experts):
    """Experts on the kernels of ``epmoe.kernels`` (CUDA; CPU only under the Triton
    interpreter, ``TRITON_INTERPRET=1``, which the CPU tests use).

    Args:
        activation: ``"silu"`` or ``"gelu"`` (exact), applied as ``act(gate) · up``.
        out_dtype: output dtype when the hidden states arrive in FP8 (otherwise the output
            has the hidden states' dtype).
        config: fixed tiling for every call (else per shape: tuned table, autotuning,
            heuristics; see ``epmoe.kernels.configs``). Fix it before CUDA-graph capture
            if no tuned table covers the shape.
        autotune: time candidate tilings on the first call of each shape; ``None`` follows
            the environment (``EPMOE_TRITON_AUTOTUNE=0`` disables it).
    """

    name = "triton"
    reads_row_index = True  # GEMM 1 gathers rows through DispatchResult.row_index

    def __init__(
        self,
        activation: str = "silu",
        *,
        out_dtype: torch.dtype = torch.bfloat16,
        config: MoEConfig | None = None,
        autotune: bool | None = None,
    ) -> None:
        super().__init__(activation)
        if out_dtype not in ops.COMPUTE_DTYPES:
            raise TypeError(f"out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
        self.out_dtype = out_dtype
        self.config = config
        self.autotune = autotune

    def _options(
        self, hidden: torch.Tensor, hidden_scale: torch.Tensor | None, weights: ExpertWeights
    ) -> dict[str, Any]:
        """The keyword arguments both layouts' kernels take: scales, activation, tiling;
        ``out_dtype`` only for FP8 input (otherwise the output keeps the input's dtype)."""
        return dict(
            activation=self.activation,
            hidden_scale=hidden_scale,
            w13_scale=weights.w13_scale,
            w2_scale=weights.w2_scale,
            out_dtype=self.out_dtype if hidden.dtype == ops.FP8_DTYPE else None,
            config=self.config,
            autotune=self.autotune,
        )

    def standard(
        self,
        hidden_RH: torch.Tensor,
        topk_ids_RK: torch.Tensor,
        topk_weights_RK: torch.Tensor,
        weights: ExpertWeights,
        hidden_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return ops.fused_moe_standard(
            hidden_RH,
            topk_ids_RK,
            topk_weights_RK,
            weights.w13,
            weights.w2,
            **self._options(hidden_RH, hidden_scale, weights),
        )

    def expert_batched(
        self,
        hidden_eCH: torch.Tensor,
        counts_e: torch.Tensor,
        weights: ExpertWeights,
        hidden_scale: torch.Tensor | None = None,
        row_index_eC: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``row_index_eC``: ``hidden_eCH`` is the received rows ``[R, H]``, read in place
        by GEMM 1 (see ``ops.fused_moe_batched``)."""
        return ops.fused_moe_batched(
            hidden_eCH,
            counts_e,
            weights.w13,
            weights.w2,
            row_index_eC=row_index_eC,
            **self._options(hidden_eCH, hidden_scale, weights),
        )
