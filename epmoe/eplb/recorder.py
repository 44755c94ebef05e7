"""Expert-load recording for EPLB: tokens per physical expert over a sliding window.

Shape legend: S steps in the window · P physical experts · T tokens · K top-k.

Counting happens on the device inside the layer's routing step: a ``scatter_add`` into a
ring buffer whose write position is itself a device tensor, so ``record`` does no host
synchronisation and keeps no Python state that changes per step. A CUDA graph that captured
a forward therefore records every replay into the next ring row (a Python step counter
would be frozen at its capture-time value and every replay would overwrite one row). The
window is summed, and reduced across EP ranks, only when a re-plan asks for it. On CUDA, up
to ``FUSED_RECORD_MAX_IDS`` ids (decode steps), the whole ``record`` is one kernel
(``kernels.record``, unless ``EPMOE_FUSED_ROUTING=0``), where the torch ops below take seven.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from epmoe.routing import fused_routing_enabled

# ``record`` takes the one-program kernel up to this many ids (T·K). One H200, P = 256, in a
# CUDA graph: 3.0 µs at 1024 ids against 16-17 for the torch ops, but 34.7 at 32768 against
# 18.8 (one program's atomics take about 1 µs per 1024 ids): prefill chunks keep the torch
# ops (docs/benchmarks.md)
FUSED_RECORD_MAX_IDS = 8192


class LoadRecorder:
    """Ring buffer ``counts_SP [S, P]`` int64 of per-step token counts per physical expert.

    ``record(physical_ids_TK)`` stores one step's routing in row ``steps % S``, overwriting
    the oldest step; ``steps`` is a 0-d int64 device tensor (the number of steps recorded
    since the last ``reset``), advanced on the device. ``window_load()`` sums the last ``S``
    steps on this rank (rows not yet written are zero, so it is right before the window is
    full too); ``global_load(group)`` sums them over the EP ranks (collective).

    CUDA graphs: ``record`` is capturable and every replay advances the ring. ``enabled`` is
    read in Python when ``record`` runs, so a graph captured while it was ``True`` keeps
    recording on replay. ``reset()`` zeroes the buffers in place (captured graphs stay
    valid); ``reset(num_physical=...)`` with a new P allocates new ones (capture again).
    """

    def __init__(self, num_physical: int, window: int, device: torch.device | str) -> None:
        if not isinstance(window, int) or isinstance(window, bool):
            raise TypeError(
                f"window (EPMoE's load_window) must be an int number of forwards, got "
                f"{type(window).__name__} ({window!r})"
            )
        if window <= 0:
            raise ValueError(
                f"window (EPMoE's load_window) must be a positive number of forwards, got {window}"
            )
        if not isinstance(num_physical, int) or isinstance(num_physical, bool):
            raise TypeError(
                f"num_physical must be an int, got {type(num_physical).__name__} ({num_physical!r})"
            )
        if num_physical <= 0:
            raise ValueError(f"num_physical must be a positive int, got {num_physical!r}")
        self.num_physical = num_physical  # P
        self.window = window  # S
        self.counts_SP = torch.zeros(window, num_physical, dtype=torch.int64, device=device)
        self.steps = torch.zeros((), dtype=torch.int64, device=self.counts_SP.device)
        self.enabled = True

    @property
    def step(self) -> int:
        """Steps recorded since the last reset, read back to the host (a device
        synchronisation on CUDA: for logs and tests, not for the forward path)."""
        return int(self.steps)

    def record(self, physical_ids_TK: torch.Tensor) -> None:
        """Count one step's physical expert ids ``[T, K]`` int32/int64 (``-1`` ignored) into
        the next ring row. On the device, no host synchronisation, CUDA-graph capturable.
        Ids outside ``[-1, P)`` are the caller's error (the layer refuses them first): the
        one-kernel path does not count them, the torch ops fail on them."""
        if not self.enabled:
            return
        if (
            self.counts_SP.is_cuda
            and physical_ids_TK.device == self.counts_SP.device
            and physical_ids_TK.dtype in (torch.int32, torch.int64)  # (else cast below)
            and physical_ids_TK.numel() <= FUSED_RECORD_MAX_IDS
            and fused_routing_enabled()
        ):
            from epmoe.kernels.record import record_load

            record_load(physical_ids_TK, self.counts_SP, self.steps)  # one launch
            return
        # shift by one so that -1 (no expert) lands in bin 0, dropped; scatter_add, unlike
        # bincount on CUDA, never reads min/max back to the host
        shifted_N = physical_ids_TK.reshape(-1).to(torch.int64) + 1
        counts_1P = self.counts_SP.new_zeros(1, self.num_physical + 1)
        counts_1P.scatter_add_(1, shifted_N[None], torch.ones_like(shifted_N)[None])
        row_1 = torch.remainder(self.steps, self.window).reshape(1)  # device write position
        self.counts_SP.index_copy_(0, row_1, counts_1P[:, 1:])
        self.steps.add_(1)

    def window_load(self) -> torch.Tensor:
        """Tokens per physical expert ``[P]`` int64 over the last ``S`` steps, this rank."""
        return self.counts_SP.sum(0)

    def global_load(self, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """``window_load`` summed over the ranks of ``group`` (collective)."""
        load = self.window_load()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(load, group=group)
        return load

    def reset(self, num_physical: int | None = None) -> None:
        """Forget all counts (after a re-plan). With the same P the buffers are zeroed in
        place; a new ``num_physical`` allocates ``[S, P_new]`` (a graph that captured the old
        buffers must be captured again, as it must after any re-plan)."""
        if num_physical is not None and (
            isinstance(num_physical, bool) or not isinstance(num_physical, int) or num_physical <= 0
        ):
            raise ValueError(f"num_physical must be a positive int, got {num_physical!r}")
        if num_physical is not None and num_physical != self.num_physical:
            self.num_physical = num_physical
            self.counts_SP = self.counts_SP.new_zeros(self.window, num_physical)
        else:
            self.counts_SP.zero_()
        self.steps.zero_()


def logical_load(
    physical_load_P: torch.Tensor, physical_to_logical_P: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """Sum the load of every replica into its logical expert: ``[P]`` → ``[E]`` in the
    load's dtype and device (an expert without a replica in the map gets 0)."""
    out = torch.zeros(num_experts, dtype=physical_load_P.dtype, device=physical_load_P.device)
    return out.index_add_(0, physical_to_logical_P.to(physical_load_P.device), physical_load_P)
