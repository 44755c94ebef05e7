"""All-to-all backends behind one registry.

Backends are named by the strings users pass (``EPMoE(backend=...)``). Each lives in its
own module, imported only when asked for, so a missing optional package (DeepEP,
pplx-kernels, NVSHMEM) costs nothing until that backend is chosen.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from epmoe.comm.base import AllToAll, Capabilities, CommSpec, DispatchResult, Layout

__all__ = [
    "AllToAll",
    "Capabilities",
    "CommSpec",
    "DispatchResult",
    "Layout",
    "available_backends",
    "backend_class",
    "create_backend",
    "resolve_backend",
]

# name -> "module:Class"; the order is the preference of "auto" among usable backends.
_BACKENDS: dict[str, str] = {
    "all_to_all": "epmoe.comm.all_to_all:AllToAllBackend",
    "naive": "epmoe.comm.naive:NaiveBackend",
}


def backend_names() -> list[str]:
    return list(_BACKENDS)


def backend_class(name: str) -> type[AllToAll]:
    """The backend class registered under ``name`` (imports its module)."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {backend_names()} or 'auto'")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def _unavailable(name: str, device: torch.device, group) -> str | None:
    try:
        cls = backend_class(name)
    except ImportError as exc:  # a backend module whose own imports fail
        return f"import failed: {exc}"
    return cls.unavailable_reason(device, group)


def available_backends(
    device: torch.device | str | None = None, group: dist.ProcessGroup | None = None
) -> dict[str, str | None]:
    """Every backend name → ``None`` if it can run here, else the reason it cannot.

    ``device`` defaults to the current CUDA device when there is one, else the CPU.
    """
    device = _default_device(device)
    return {name: _unavailable(name, device, group) for name in _BACKENDS}


def resolve_backend(
    name: str,
    device: torch.device,
    group: dist.ProcessGroup | None,
    layout: Layout | None = None,
) -> type[AllToAll]:
    """The class for ``name``; for ``"auto"`` the first usable backend offering ``layout``."""
    if name != "auto":
        cls = backend_class(name)
        reason = cls.unavailable_reason(device, group)
        if reason is not None:
            raise RuntimeError(f"backend {name!r} is unavailable: {reason}")
        return cls
    reasons = []
    for candidate in _BACKENDS:
        reason = _unavailable(candidate, device, group)
        if reason is None:
            cls = backend_class(candidate)
            if layout is None or layout in cls.capabilities.layouts:
                return cls
            reason = f"does not offer layout {layout.value}"
        reasons.append(f"{candidate}: {reason}")
    raise RuntimeError("no backend can run here: " + "; ".join(reasons))


def create_backend(
    name: str,
    spec: CommSpec,
    group: dist.ProcessGroup | None,
    layout: Layout | None = None,
) -> AllToAll:
    """Build backend ``name`` (or ``"auto"``) for ``spec`` on ``group``."""
    return resolve_backend(name, spec.device, group, layout)(spec, group, layout)


def _default_device(device) -> torch.device:
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
