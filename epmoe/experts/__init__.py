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


def create_experts(name: str, activation: str, device: torch.device) -> Experts:
    """``"torch"``, ``"triton"`` or ``"auto"`` (Triton on CUDA, torch on CPU)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_usable() else "torch"
    if name not in _EXPERTS:
        raise ValueError(f"unknown experts {name!r}; choose one of {sorted(_EXPERTS)} or 'auto'")
    module, cls = _EXPERTS[name].split(":")
    return getattr(importlib.import_module(module), cls)(activation)


def _triton_usable() -> bool:
    try:
        importlib.import_module("epmoe.experts.triton_experts")
    except ImportError:
        return False
    return True
