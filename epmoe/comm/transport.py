"""Transports shared by every layer of a model: one set of buffers per shape, not per layer.

A model with 61 MoE layers on one EP group needs one set of communication buffers, not 61:
the layers run one after another, so they can take turns on the same buffers. Backends
with large fixed buffers (symmetric memory, NVSHMEM, vendor buffers) acquire them here by
a key of what decides their size, e.g. ``(group ranks, H, K, dtype, wire dtype, M_max,
largest e)``, and release them in ``close``; the last release closes the transport.

Nothing is allocated at import; the registry is filled by the first backend that asks.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Protocol

import torch.distributed as dist


class Transport(Protocol):
    """What the registry needs of a shared transport: an explicit ``close``."""

    def close(self) -> None: ...


# key -> [transport, number of holders]
_SHARED: dict[Hashable, list[Any]] = {}


def group_key(group: dist.ProcessGroup | None) -> tuple[str, tuple[int, ...]]:
    """What identifies a process group in a transport key: its name and global ranks."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        if not (dist.is_available() and dist.is_initialized()):
            return ("", (0,))
        group = dist.group.WORLD
    return (group.group_name, tuple(dist.get_process_group_ranks(group)))


def acquire(key: Hashable, create: Callable[[], Transport]) -> Any:
    """The transport for ``key``, created by ``create()`` if no layer holds one yet.
    Collective when ``create`` is (every rank must ask for the same keys in the same order)."""
    entry = _SHARED.get(key)
    if entry is None:
        entry = _SHARED[key] = [create(), 0]
    entry[1] += 1
    return entry[0]


def release(key: Hashable) -> None:
    """Give back one hold on ``key``; the last one closes the transport."""
    entry = _SHARED.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] <= 0:
        del _SHARED[key]
        entry[0].close()


class Hold:
    """One backend's hold on the shared transport of ``key`` (acquired here): :meth:`get`
    it while held, :meth:`release` it in ``close``. A released hold, or one whose transport
    was closed under it (:func:`close_all`), raises that ``owner``'s backend is closed."""

    def __init__(self, owner: str, key: Hashable, create: Callable[[], Transport]) -> None:
        self.owner = owner
        self.key = key
        self._transport: Any = acquire(key, create)

    @property
    def held(self) -> bool:
        entry = _SHARED.get(self.key)
        return self._transport is not None and entry is not None and entry[0] is self._transport

    def get(self) -> Any:
        if not self.held:
            raise RuntimeError(f"{self.owner} backend is closed")
        return self._transport

    def release(self) -> None:
        """Give the hold back (once; later calls do nothing, as does a hold whose transport
        was closed under it: the key may name another transport by now)."""
        if self.held:
            release(self.key)
        self._transport = None


def holders(key: Hashable) -> int:
    """How many backends hold the transport of ``key`` (0: none is allocated)."""
    entry = _SHARED.get(key)
    return 0 if entry is None else entry[1]


# who initialised NVSHMEM in this process (one library may: a second would fail inside it)
_nvshmem_owner: str | None = None


def check_nvshmem_owner(owner: str) -> None:
    """Raise a clear error (instead of a crash inside NVSHMEM) if another backend family
    than ``owner`` initialised NVSHMEM in this process."""
    if _nvshmem_owner not in (None, owner):
        raise RuntimeError(
            f"NVSHMEM in this process belongs to {_nvshmem_owner!r}; {owner!r} cannot initialise "
            "it again: use backends of one family per process (e.g. deepep_ll or pplx)"
        )


def claim_nvshmem(owner: str) -> None:
    """Record that ``owner`` (a backend family) initialised NVSHMEM in this process (call
    it once that succeeded; :func:`check_nvshmem_owner` before trying)."""
    global _nvshmem_owner
    check_nvshmem_owner(owner)
    _nvshmem_owner = owner


def close_all() -> None:
    """Close every shared transport (e.g. before ``destroy_process_group``)."""
    entries = list(_SHARED.values())
    _SHARED.clear()
    for transport, _ in entries:
        transport.close()
