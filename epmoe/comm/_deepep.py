"""What the DeepEP adapters (``deepep_ht.py``, ``deepep_ll.py``) share: the lazy import,
the availability checks, and one ``deep_ep.Buffer`` per (EP group, mode) shared by every
layer, destroyed explicitly when the last layer lets go.

DeepEP (github.com/deepseek-ai/DeepEP) is not on the package index: build it from its
repository (``pip install .`` in a checkout, with CUDA and, for the low-latency mode,
NVSHMEM). epmoe imports it only when one of its backends is chosen. The adapters use the
classic ``deep_ep.Buffer`` API (DeepEP V1; V2 ships it as its legacy buffer), which vLLM,
SGLang and Megatron wrap.

DeepEP partitions the experts evenly and contiguously over the ranks (rank r holds
``[r·P/W, (r+1)·P/W)``): placements with another layout are refused by ``supports``.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch.distributed as dist

from epmoe.comm import transport
from epmoe.comm.base import CommSpec, one_nvlink_node_reason

INSTALL_HINT = (
    "DeepEP is not installed: build it from https://github.com/deepseek-ai/DeepEP "
    "(pip install . in its checkout; the low-latency mode needs NVSHMEM)"
)


def import_deep_ep() -> Any:
    """The ``deep_ep`` module, or an ``ImportError`` that says how to install it."""
    try:
        return importlib.import_module("deep_ep")
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} ({exc})") from exc
    except Exception as exc:  # e.g. a version check at its import (DeepEP V2: NCCL)
        raise ImportError(
            f"deep_ep is installed but importing it failed ({type(exc).__name__}: {exc}); "
            "epmoe adapts the classic deep_ep.Buffer (DeepEP V1): build that from "
            "https://github.com/deepseek-ai/DeepEP"
        ) from exc


def unavailable_reason(group: dist.ProcessGroup | None) -> str | None:
    """Why the DeepEP backends cannot run here (``None`` when they can)."""
    reason = one_nvlink_node_reason(group)
    if reason is not None:
        return reason
    try:  # the import, not only the package: a source checkout without its built
        import_deep_ep()  # extension (deep_ep_cpp) is found but cannot run
    except ImportError as exc:
        return str(exc)
    if not (dist.is_available() and dist.is_initialized()):
        return "DeepEP needs torch.distributed initialised with 2, 4 or 8 NCCL ranks (torchrun)"
    W = dist.get_world_size(group)
    if W not in (2, 4, 8):
        return f"DeepEP's intranode kernels take 2, 4 or 8 ranks, not {W}"
    return None


def process_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The group object DeepEP's ``Buffer`` needs: ours may be ``None`` (the default group)."""
    return group if group is not None else dist.group.WORLD


def even_partition_reason(spec: CommSpec) -> str | None:
    """DeepEP's expert layout: every rank holds P/W experts, in rank order."""
    W, P = spec.world_size, spec.num_physical
    if P % W or any(spec.num_local(r) != P // W for r in range(W)):
        sizes = [spec.num_local(r) for r in range(W)]
        return (
            f"DeepEP needs the same number of expert slots on every rank (P/W); this "
            f"placement has {sizes}: use linear placement, or EPLB with num_redundant making "
            "E + R a multiple of W"
        )
    return None


class SharedBuffer:
    """One ``deep_ep.Buffer`` of a group and mode, held by every layer that uses it (through
    ``epmoe.comm.transport``), destroyed when the last one closes. ``sizes``: what it was
    allocated for, checked against each new holder's needs."""

    def __init__(self, buffer: Any, sizes: dict[str, int]) -> None:
        self.buffer = buffer
        self.sizes = sizes
        self.held = 0  # results of the group's layers not yet combined (low-latency mode)

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.destroy()
            self.buffer = None


def acquire_buffer(
    owner: str,
    group: dist.ProcessGroup | None,
    mode: str,
    sizes: dict[str, int],
    *,
    create,
    exact: bool = False,
) -> transport.Hold:
    """A hold on the group's shared buffer of ``mode`` (``"ht"`` or ``"ll"``) for the backend
    ``owner``, the buffer created by ``create()`` for the first holder. A later holder that
    needs more than it was sized for gets a clear error (a second NVSHMEM-backed buffer in
    one process would fail inside NVSHMEM): build every layer of a group with the same
    sizes. ``exact``: the sizes must be equal, not only fit (a buffer whose layout depends
    on them)."""
    key = ("deep_ep", mode, transport.group_key(group))
    hold = transport.Hold(owner, key, lambda: SharedBuffer(create(), dict(sizes)))
    shared = hold.get()

    def off(want: int, have: int) -> bool:
        return want != have if exact else want > have

    small = {
        k: (v, shared.sizes.get(k, 0)) for k, v in sizes.items() if off(v, shared.sizes.get(k, 0))
    }
    if small:
        hold.release()
        raise ValueError(
            f"the {mode} DeepEP buffer of this group was allocated for "
            f"{ {k: have for k, (_, have) in small.items()} } and this layer needs "
            f"{ {k: want for k, (want, _) in small.items()} }: build every layer of the group "
            "with the same hidden size, top-k, max_num_tokens and backend options (one buffer "
            "serves them all)"
        )
    return hold
