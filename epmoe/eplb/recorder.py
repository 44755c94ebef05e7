"""Expert-load recording for EPLB: tokens per physical expert over a sliding window.

Counting happens on the device inside the layer's routing step (a ``bincount`` into a ring
buffer, no host synchronisation); the window is summed and reduced across EP ranks only
when a re-plan asks for it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class LoadRecorder:
    """Ring buffer ``[window, P]`` of per-step token counts per physical expert.

    ``record(physical_ids_TK)`` stores one step's routing, overwriting the oldest step.
    ``window_load()`` sums the last ``window`` steps on this rank; ``global_load(group)``
    sums them over the EP ranks (collective).
    """

    def __init__(self, num_physical: int, window: int, device: torch.device | str) -> None:
        if window <= 0:
            raise ValueError(f"window must be a positive number of steps, got {window}")
        self.num_physical = num_physical
        self.window = window
        self.counts_SP = torch.zeros(window, num_physical, dtype=torch.int64, device=device)
        self.step = 0  # steps recorded so far (host counter, no device sync)
        self.enabled = True

    def record(self, physical_ids_TK: torch.Tensor) -> None:
        """Count one step's physical expert ids ``[T, K]`` (``-1`` ignored), on the device."""
        if not self.enabled:
            return
        # shift by one so that -1 (no expert) lands in bin 0, dropped; scatter_add, unlike
        # bincount on CUDA, never reads min/max back to the host
        shifted = physical_ids_TK.reshape(-1).to(torch.int64) + 1
        counts = torch.zeros(self.num_physical + 1, dtype=torch.int64, device=shifted.device)
        counts.scatter_add_(0, shifted, torch.ones_like(shifted))
        counts = counts[1:]
        self.counts_SP[self.step % self.window] = counts
        self.step += 1

    def window_load(self) -> torch.Tensor:
        """Tokens per physical expert ``[P]`` over the last ``window`` steps, this rank."""
        return self.counts_SP.sum(0)

    def global_load(self, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """``window_load`` summed over the ranks of ``group`` (collective)."""
        load = self.window_load()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(load, group=group)
        return load

    def reset(self, num_physical: int | None = None) -> None:
        """Forget all counts (after a re-plan that changes the physical slots)."""
        if num_physical is not None and num_physical != self.num_physical:
            self.num_physical = num_physical
            self.counts_SP = self.counts_SP.new_zeros(self.window, num_physical)
        else:
            self.counts_SP.zero_()
        self.step = 0


def logical_load(
    physical_load_P: torch.Tensor, physical_to_logical_P: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """Sum the load of every replica into its logical expert: ``[P]`` → ``[E]`` in the
    load's dtype and device (an expert without a replica in the map gets 0)."""
    out = torch.zeros(num_experts, dtype=physical_load_P.dtype, device=physical_load_P.device)
    return out.index_add_(0, physical_to_logical_P.to(physical_load_P.device), physical_load_P)
