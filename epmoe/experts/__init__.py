"""Local expert computation: ``torch`` (reference, CPU default) and ``triton`` kernels."""

from __future__ import annotations

import importlib

import torch

from epmoe.experts.base import Experts, ExpertWeights

__all__ = ["Experts", "ExpertWeights", "create_experts"]

_EXPERTS = {
    "torch": "epmoe.experts.torch_experts:TorchExperts",
    "triton": "epmoe.experts.triton_experts:TritonExperts",
}


# Compute dtypes of the Triton kernels (epmoe.kernels.ops.COMPUTE_DTYPES; FP8 weights come
# with a compute dtype among these). The torch experts take any floating dtype.
_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def create_experts(
    name: str, activation: str, device: torch.device, dtype: torch.dtype | None = None
) -> Experts:
    """``"torch"``, ``"triton"`` or ``"auto"`` (Triton on CUDA, torch on CPU, and torch for
    a compute ``dtype`` the Triton kernels lack, such as float64)."""
    if name == "auto":
        triton_fits = dtype is None or dtype in _TRITON_DTYPES
        name = "triton" if device.type == "cuda" and triton_fits and _triton_usable() else "torch"
    if name not in _EXPERTS:
        raise ValueError(f"unknown experts {name!r}; choose one of {sorted(_EXPERTS)} or 'auto'")
    if name == "triton" and dtype is not None and dtype not in _TRITON_DTYPES:
        raise ValueError(
            f"experts='triton' computes in bfloat16, float16 or float32, not {dtype}; use "
            "experts='torch' (or 'auto'), which computes in any floating dtype, float64 "
            "included"
        )
    if name == "triton" and device.type != "cuda":
        from epmoe.kernels import ops  # (imports Triton: only for experts="triton")

        if not ops.interpreted():
            raise ValueError(
                f"experts='triton' runs on CUDA devices, not {device}; use experts='torch' "
                "(or 'auto'), or set TRITON_INTERPRET=1 before epmoe is imported to run the "
                "Triton kernels in the interpreter"
            )
    module, cls = _EXPERTS[name].split(":")
    return getattr(importlib.import_module(module), cls)(activation)


def _triton_usable() -> bool:
    try:
        importlib.import_module("epmoe.experts.triton_experts")
    except ImportError:
        return False
    return True
