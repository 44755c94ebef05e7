"""The contract of local expert computation, for both layouts a backend delivers.

Shape legend: H hidden size · I expert intermediate size · e local experts · R received
rows (Standard) · C rows of capacity per local expert (ExpertBatched) · K top-k.

Weights of the local experts, in slot order: ``w13 [e, 2I, H]`` (gate rows then up rows)
and ``w2 [e, H, I]``; the activation is ``act(gate) * up`` with ``act`` silu or gelu (exact,
erf form).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from epmoe.comm.base import DispatchResult, Layout

ACTIVATIONS = ("silu", "gelu")


def check_activation(activation: str) -> str:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return activation


@dataclass(frozen=True)
class ExpertWeights:
    """Local expert weights, optionally FP8 with block scales.

    ``w13 [e, 2I, H]``, ``w2 [e, H, I]`` in the compute dtype, or ``float8_e4m3fn`` with
    ``w13_scale [e, ceil(2I/128), ceil(H/128)]`` and ``w2_scale [e, ceil(H/128),
    ceil(I/128)]`` float32 (128×128 blocks, DeepSeek-V3's format) or ``[e]`` per-tensor.
    Scales are finite and at least ``1e-10 / 448``: the Triton kernels rescale their
    accumulators by ratios of scales, so a zero scale gives NaN (``EPMoE``'s loads raise
    a checkpoint's zero scales of all-zero blocks to that floor).
    """

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None

    @property
    def num_local(self) -> int:  # e
        return self.w13.shape[0]

    @property
    def intermediate_size(self) -> int:  # I
        return self.w2.shape[2]

    @property
    def hidden_size(self) -> int:  # H
        return self.w13.shape[2]


class Experts(ABC):
    """Runs the local experts on what a dispatch delivered; returns the same layout.

    ``standard`` returns, per received row, the *weighted* sum over its local top-k
    entries (rows with no local entry are zero). ``expert_batched`` returns *unweighted*
    outputs ``[e, C, H]``; rows past ``counts[i]`` may hold anything.
    """

    name: str = ""
    # whether expert_batched takes ``row_index_eC`` (rows read in place through an index,
    # ``DispatchResult.row_index``); others get the gathered ``[e, C, H]`` slabs
    reads_row_index: bool = False

    def __init__(self, activation: str = "silu") -> None:
        self.activation = check_activation(activation)

    def __call__(self, result: DispatchResult, weights: ExpertWeights) -> torch.Tensor:
        if result.layout is Layout.STANDARD:
            return self.standard(
                result.hidden, result.topk_ids, result.topk_weights, weights, result.hidden_scale
            )
        if result.row_index is None:
            return self.expert_batched(result.hidden, result.counts, weights, result.hidden_scale)
        if self.reads_row_index:
            return self.expert_batched(
                result.hidden, result.counts, weights, result.hidden_scale,
                row_index_eC=result.row_index,
            )  # fmt: skip
        hidden, scale = result.expert_rows()
        return self.expert_batched(hidden, result.counts, weights, scale)

    @abstractmethod
    def standard(
        self,
        hidden_RH: torch.Tensor,
        topk_ids_RK: torch.Tensor,
        topk_weights_RK: torch.Tensor,
        weights: ExpertWeights,
        hidden_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[R, H]`` → ``[R, H]``: Σ over k with ``topk_ids_RK[r, k] >= 0`` of
        ``topk_weights_RK[r, k] · expert_{topk_ids_RK[r, k]}(hidden_RH[r])``."""

    @abstractmethod
    def expert_batched(
        self,
        hidden_eCH: torch.Tensor,
        counts_e: torch.Tensor,
        weights: ExpertWeights,
        hidden_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[e, C, H]`` → ``[e, C, H]``: row ``c < counts_e[i]`` of slot ``i`` is
        ``expert_i(hidden_eCH[i, c])``."""
