"""All-to-all backends behind one registry, chosen by name or by capability.

Backends are named by the strings users pass (``EPMoE(backend=...)``). Each lives in its
own module, imported only when asked for, so a missing optional package (DeepEP,
pplx-kernels, NVSHMEM) or a backend that cannot import costs nothing until that backend is
chosen by name; ``auto`` and ``available_backends`` report it with its reason.

``auto`` takes the first backend, in registry order, that can run here
(``unavailable_reason``), offers the requested layout, can serve the spec (``supports``),
while a CUDA graph is being captured is graph safe, and lets ``auto`` pick it
(``capabilities.auto``).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from epmoe.comm.base import AllToAll, Capabilities, CommSpec, DispatchResult, Layout, Pending
from epmoe.distributed import default_device

__all__ = [
    "AllToAll",
    "Capabilities",
    "CommSpec",
    "DispatchResult",
    "Layout",
    "Pending",
    "available_backends",
    "backend_class",
    "backend_names",
    "backend_option_names",
    "check_backend_options",
    "create_backend",
    "resolve_backend",
]

# name -> "module:Class"; the order is the preference of "auto" among usable backends:
# the fixed-buffer, graph-safe kernels first, the portable collectives after them.
_BACKENDS: dict[str, str] = {
    "symm_ll": "epmoe.comm.symm.ll:SymmLLBackend",
    "all_to_all": "epmoe.comm.all_to_all:AllToAllBackend",
    "symm_ht": "epmoe.comm.symm.ht:SymmHTBackend",
    "deepep_ht": "epmoe.comm.deepep_ht:DeepEPHTBackend",
    "deepep_ll": "epmoe.comm.deepep_ll:DeepEPLLBackend",
    "pplx": "epmoe.comm.pplx:PPLXBackend",
    "naive": "epmoe.comm.naive:NaiveBackend",
}


def backend_names() -> list[str]:
    """Registered backend names, in ``auto``'s order of preference."""
    return list(_BACKENDS)


def backend_class(name: str) -> type[AllToAll]:
    """The backend class registered under ``name`` (imports its module).

    Raises ``ValueError`` for an unknown name and ``ImportError`` when the module cannot be
    imported or lacks the class.
    """
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {backend_names()} or 'auto'")
    module_name, cls_name = _BACKENDS[name].split(":")
    module = importlib.import_module(module_name)
    cls = getattr(module, cls_name, None)
    if cls is None:
        raise ImportError(f"module {module_name} defines no {cls_name}")
    return cls


def graph_capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is capturing a graph (never on other devices)."""
    return (
        device.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.is_current_stream_capturing()
    )


def _why_not(
    name: str,
    device: torch.device,
    group: dist.ProcessGroup | None,
    layout: Layout | None = None,
    spec: CommSpec | None = None,
    capturing: bool = False,
) -> str | None:
    """Why backend ``name`` cannot serve this request (``None``: it can). Side-effect free
    beyond importing the backend's module."""
    try:
        cls = backend_class(name)
    except ImportError as exc:  # a backend module whose own imports fail, or not there yet
        return f"import failed ({exc})"
    try:
        reason = cls.unavailable_reason(device, group)
    except Exception as exc:  # a check that breaks must not break the others' report
        reason = f"its availability check failed ({type(exc).__name__}: {exc})"
    if reason is not None:
        return reason
    caps = cls.capabilities
    if layout is not None and layout not in caps.layouts:
        offered = sorted(x.value for x in caps.layouts)
        return f"does not produce layout {layout.value!r} (it offers {offered})"
    if spec is not None:
        reason = cls.supports(spec)
        if reason is not None:
            return reason
    if capturing and not caps.graph_safe:
        return "not graph safe, and a CUDA graph is being captured"
    return None


def available_backends(
    device: torch.device | str | None = None,
    group: dist.ProcessGroup | None = None,
    spec: CommSpec | None = None,
) -> dict[str, str | None]:
    """Every backend name → ``None`` if it can run here, else the reason it cannot.

    ``device`` defaults to ``spec.device`` when a spec is given, else to the device of
    ``group``'s collectives (``epmoe.distributed.default_device``: CPU for gloo, else the
    current CUDA device when there is one). With ``spec``, a backend that could run but
    cannot serve it (dtype, token limit, FP8 dispatch, …) gets ``supports(spec)``'s reason.
    """
    device = _device(device, group, spec)
    return {name: _why_not(name, device, group, spec=spec) for name in _BACKENDS}


def resolve_backend(
    name: str,
    device: torch.device | str | None,
    group: dist.ProcessGroup | None,
    layout: Layout | None = None,
    spec: CommSpec | None = None,
    *,
    capturing: bool | None = None,
) -> type[AllToAll]:
    """The backend class for ``name``, checked against this request.

    ``name == "auto"``: the first backend in registry order that can run on ``device`` and
    ``group``, produces ``layout`` (any when ``None``), serves ``spec`` (when given) and,
    while a CUDA graph is being captured, is graph safe (a host-synchronising backend
    cannot run inside a capture); ``RuntimeError`` naming every candidate with its reason
    when none does. ``capturing`` ``None`` asks ``torch.cuda.is_current_stream_capturing()``.

    A named backend is checked for the environment and the capture (``RuntimeError`` with
    the reason and the usable alternatives); its constructor checks ``layout`` and ``spec``
    (``ValueError``, or ``TypeError`` for a dtype it cannot move).
    """
    device = _device(device, group, spec)
    if capturing is None:
        capturing = graph_capturing(device)
    if name != "auto":
        cls = backend_class(name)  # an unknown name or a broken module raises here
        reason = _why_not(name, device, group, capturing=capturing)
        if reason is not None:
            usable = [
                n for n in _BACKENDS if _why_not(n, device, group, layout, spec, capturing) is None
            ]
            hint = f"; usable here: {usable} or 'auto'" if usable else "; no backend is usable"
            raise RuntimeError(f"backend {name!r} cannot run here: {reason}{hint}")
        return cls
    reasons = {}
    for candidate in _BACKENDS:
        try:
            named_only = not backend_class(candidate).capabilities.auto
        except ImportError:
            named_only = False  # _why_not names the failed import
        if named_only:  # its library is not even imported: "auto" never picks it
            reason = "not chosen by 'auto' (name it to use it)"
        else:
            reason = _why_not(candidate, device, group, layout, spec, capturing)
        if reason is None:
            return backend_class(candidate)
        reasons[candidate] = reason
    wanted = [f"device {device}"]
    if layout is not None:
        wanted.append(f"layout {layout.value!r}")
    if spec is not None:
        wanted.append(f"dtype {spec.dtype}, wire dtype {spec.wire_dtype}")
    if capturing:
        wanted.append("CUDA graph capture")
    raise RuntimeError(
        f"no backend can serve {', '.join(wanted)}:\n"
        + "\n".join(f"  {candidate}: {reason}" for candidate, reason in reasons.items())
    )


def backend_option_names(cls: type[AllToAll]) -> list[str]:
    """The keyword options a backend's constructor takes beyond ``(spec, group, layout)``
    (e.g. ``symm_ht``'s ``num_sms`` and ``tokens_per_flag``, ``deepep_ht``'s
    ``worst_case_rows``), in signature order."""
    params = list(inspect.signature(cls.__init__).parameters.values())[4:]  # self, spec, ...
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds]


def check_backend_options(cls: type[AllToAll], options: Mapping[str, Any]) -> None:
    """Raise, naming the option and those the backend takes, unless every key of
    ``options`` is one of :func:`backend_option_names` (values are checked by the
    backend's constructor)."""
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise TypeError(
            f"backend_options must be a mapping of option names to values, got {options!r}"
        )
    known = backend_option_names(cls)
    unknown = sorted(set(options) - set(known))
    if unknown:
        takes = f"takes {known}" if known else "takes no options"
        raise ValueError(
            f"backend {cls.name!r} has no option {', '.join(map(repr, unknown))}: it {takes}"
        )


def create_backend(
    name: str,
    spec: CommSpec,
    group: dist.ProcessGroup | None,
    layout: Layout | None = None,
    **options: Any,
) -> AllToAll:
    """Build backend ``name`` (or ``"auto"``) for ``spec`` on ``group``; ``options`` go to
    the constructor of a backend chosen by name (see :func:`backend_option_names`)."""
    cls = resolve_backend(name, spec.device, group, layout, spec)
    if options:
        if name == "auto":
            raise ValueError("backend options need a backend chosen by name, not 'auto'")
        check_backend_options(cls, options)
    return cls(spec, group, layout, **options)


def _device(
    device: torch.device | str | None, group: dist.ProcessGroup | None, spec: CommSpec | None
) -> torch.device:
    if device is not None:
        return torch.device(device)
    if spec is not None:
        return spec.device
    return default_device(group)
