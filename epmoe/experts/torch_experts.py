"""Local experts in plain torch: the readable reference and the CPU default.

Shape legend: H hidden · I intermediate · e local experts · R received rows · K top-k ·
C rows of capacity per local expert · N rows routed to one expert.
One Python iteration per local expert (never per token); each expert's rows run as one
matmul pair.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from epmoe.comm.base import FP8_GROUP
from epmoe.experts.base import Experts, ExpertWeights


def act_and_mul(gate_up_N2I: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` of ``[N, 2I]`` (gate columns first) → ``[N, I]``."""
    gate, up = gate_up_N2I.chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate)
    return act * up


def dequantized(weights: ExpertWeights, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w13, w2)`` in ``dtype``, applying FP8 scales when the weights carry them."""
    if weights.w13_scale is None:
        return weights.w13.to(dtype), weights.w2.to(dtype)
    from epmoe.reference import dequantize_block

    wide = torch.promote_types(dtype, torch.float32)  # (float64 layers: FP8 × scale exactly)
    return (
        dequantize_block(weights.w13, weights.w13_scale, dtype=wide).to(dtype),
        dequantize_block(weights.w2, weights.w2_scale, dtype=wide).to(dtype),
    )


def dequantized_hidden(hidden: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype):
    """Hidden states back to ``dtype``; ``scale [..., H/128]`` per 128-wide group if FP8."""
    if scale is None:
        return hidden.to(dtype)
    H = hidden.shape[-1]  # the last group may be partial: ceil(H / 128) scales
    full = scale.to(torch.float32).repeat_interleave(FP8_GROUP, dim=-1)[..., :H]
    return (hidden.to(torch.float32) * full).to(dtype)


def compute_dtype(out_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the matmuls run in: on CPU at least float32 (float64 stays float64), on
    GPU the layer's dtype (the GEMMs accumulate in float32 or wider themselves)."""
    return torch.promote_types(out_dtype, torch.float32) if device.type == "cpu" else out_dtype


class TorchExperts(Experts):
    """Experts as per-expert torch matmuls (float32 accumulation on CPU and GPU alike;
    float64 weights and rows compute and accumulate in float64)."""

    name = "torch"

    def _mlp(self, x_NH: torch.Tensor, w13_2IH: torch.Tensor, w2_HI: torch.Tensor):
        h = act_and_mul(x_NH @ w13_2IH.t(), self.activation)
        return h @ w2_HI.t()

    def standard(self, hidden_RH, topk_ids_RK, topk_weights_RK, weights, hidden_scale=None):
        R, H = hidden_RH.shape
        out_dtype = hidden_RH.dtype if hidden_scale is None else torch.bfloat16
        compute = compute_dtype(out_dtype, hidden_RH.device)
        acc = torch.promote_types(out_dtype, torch.float32)  # the weighted sum over k
        x = dequantized_hidden(hidden_RH, hidden_scale, compute)
        w13, w2 = dequantized(weights, compute)
        out = torch.zeros(R, H, dtype=acc, device=hidden_RH.device)
        ids = topk_ids_RK.reshape(-1)
        valid = (ids >= 0).nonzero().squeeze(1)  # flat (r, k) indices with a local expert
        if valid.numel() == 0:
            return out.to(out_dtype)
        order = torch.argsort(ids[valid], stable=True)
        pairs = valid[order]
        counts = torch.bincount(ids[pairs], minlength=weights.num_local).tolist()
        K = topk_ids_RK.shape[1]
        rows = pairs // K
        w = topk_weights_RK.reshape(-1)[pairs].to(acc)
        start = 0
        for slot, n in enumerate(counts):
            if n == 0:
                continue
            r = rows[start : start + n]
            y = self._mlp(x[r], w13[slot], w2[slot]).to(acc)
            out.index_add_(0, r, y * w[start : start + n, None])
            start += n
        return out.to(out_dtype)

    def expert_batched(self, hidden_eCH, counts_e, weights, hidden_scale=None):
        out_dtype = hidden_eCH.dtype if hidden_scale is None else torch.bfloat16
        compute = compute_dtype(out_dtype, hidden_eCH.device)
        w13, w2 = dequantized(weights, compute)
        out = torch.zeros(hidden_eCH.shape, dtype=out_dtype, device=hidden_eCH.device)
        for slot, n in enumerate(counts_e.tolist()):
            if n == 0:
                continue
            scale = None if hidden_scale is None else hidden_scale[slot, :n]
            x = dequantized_hidden(hidden_eCH[slot, :n], scale, compute)
            out[slot, :n] = self._mlp(x, w13[slot], w2[slot]).to(out_dtype)
        return out
