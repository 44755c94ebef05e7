"""Process-group set-up for torchrun launches.

``init_distributed`` reads the torchrun environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), binds the CUDA device, picks NCCL on GPUs
and gloo on CPU, and keeps a gloo group beside an NCCL world for CPU-side exchanges.

It is also the one home of the device rules: ``default_device(group)`` (where a group's
collectives put their tensors), ``normalize_device(device)`` (one spelling per device) and
``cpu_by_default`` (host tables stay on the host under a caller's default-device context).
"""

from __future__ import annotations

import datetime
import functools
import math
import operator
import os

import torch
import torch.distributed as dist

# Set on GPU machines whose hosts are shared: NVLink multicast (NVLS) can take every GPU
# of the host out of service. Applied by init_distributed unless the user set them.
SAFE_GPU_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

# gloo twins of NCCL groups, keyed by their ranks: a registry like torch's own group map,
# filled collectively by cpu_group() and emptied when the default group is destroyed.
_cpu_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}


# Default bound on any one collective wait (init_distributed's timeout_s). A serving step
# takes milliseconds to seconds; the longest legitimate wait at a collective is one rank
# still compiling its Triton kernels or capturing CUDA graphs at the first steps, or
# loading its checkpoint shard before the layers' construction agreement: tens of seconds.
# A minute covers those and still surfaces a rank that stopped within a minute instead of
# torch's 10 (NCCL) or 30 (gloo) minutes. Pass a larger timeout_s for slow checkpoint loads.
DEFAULT_TIMEOUT_S = 60.0


def init_distributed(
    backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> dist.ProcessGroup | None:
    """Initialise torch.distributed from the torchrun environment; returns the WORLD group.

    ``backend``: ``"nccl"``, ``"gloo"`` or ``None`` (NCCL when CUDA is available, else gloo).
    ``timeout_s``: how long any collective (and the rendezvous) may wait for the other
    ranks, 60 s by default (see ``DEFAULT_TIMEOUT_S``). On gloo a collective that runs out
    raises; the layer's agreement re-raises it naming the operation and the ranks that did
    not arrive. On NCCL the process group's watchdog aborts the process after it, naming
    the collective.
    Without torchrun's variables (a plain ``python script.py``) nothing is initialised and
    ``None`` is returned: every epmoe API then runs as a single process. Calling it again
    returns the existing group. On CUDA the device ``LOCAL_RANK`` is made current first.
    """
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not math.isfinite(timeout_s)
        or not 0 < timeout_s < 10**9
    ):
        raise ValueError(f"timeout_s must be a number of seconds in (0, 1e9), got {timeout_s!r}")
    if dist.is_initialized():
        return dist.group.WORLD
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl', 'gloo' or None, got {backend!r}")
    for key, value in SAFE_GPU_ENV.items():
        os.environ.setdefault(key, value)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device_id = None
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("backend='nccl' needs CUDA; use backend='gloo' on CPU")
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are "
                "visible; launch at most that many processes per node"
            )
        torch.cuda.set_device(local_rank)
        device_id = torch.device("cuda", local_rank)
    dist.init_process_group(
        backend=backend,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device_id,
    )
    if backend == "nccl":
        cpu_group(dist.group.WORLD)
    return dist.group.WORLD


def cpu_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """A gloo group with the ranks of ``group`` (itself if it is gloo already).

    Collective on first use for a group: every rank of ``group`` must call it.
    """
    if not dist.is_initialized():
        _cpu_groups.clear()  # a destroyed default group takes its subgroups with it
        return None
    group = group or dist.group.WORLD
    if dist.get_backend(group) == "gloo":
        return group
    key = tuple(dist.get_process_group_ranks(group))
    if key not in _cpu_groups:
        _cpu_groups[key] = dist.new_group(ranks=list(key), backend="gloo")
    return _cpu_groups[key]


def default_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device tensors of ``group``'s collectives live on, with its index: CPU for a gloo
    group, else the current CUDA device when there is one (NCCL, or a group whose backend is
    chosen per device), else CPU. ``group`` ``None`` is WORLD when torch.distributed is
    initialised. The one home of this rule: layers, backends and benchmarks call it."""
    if dist.is_available() and dist.is_initialized() and str(dist.get_backend(group)) == "gloo":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def num_sms(device: torch.device | str) -> int | None:
    """The streaming multiprocessors of CUDA ``device`` (what sizes persistent grids and SM
    budgets), or ``None`` off CUDA. The one home of this query: kernels, backends and
    benchmarks call it."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def normalize_device(device: torch.device | str) -> torch.device:
    """``device`` in the one spelling epmoe compares and keys caches by: ``"cuda"`` becomes
    the current CUDA device (``cuda:<index>``), ``"cpu:0"`` becomes ``cpu`` (CPU tensors
    report ``cpu``); other devices are returned as given.

    Raises ``ValueError`` for ``"cuda"`` without an index when CUDA is not available.
    """
    device = torch.device(device)
    if device.type == "cpu" and device.index is not None:
        return torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        if not torch.cuda.is_available():
            raise ValueError(
                "device='cuda' but CUDA is not available here; pass device='cpu' (gloo) or "
                "run on a machine with CUDA GPUs"
            )
        return torch.device("cuda", torch.cuda.current_device())
    return device


def cpu_by_default(fn):
    """Decorate ``fn`` to run with the CPU as the default device. epmoe passes ``device=``
    for every tensor meant for the layer's device; a factory call without one makes a host
    table (placements, plans, offsets). A caller's ``with torch.device("meta")`` or
    ``torch.set_default_device("cuda")`` must not move those: on meta they hold no data,
    on a GPU each later ``.item()`` / ``.tolist()`` would synchronise. For construction
    and planning, not per-forward paths (entering the context costs µs)."""

    @functools.wraps(fn)
    def on_cpu(*args, **kwargs):
        # (no torch function mode active: the default is the CPU; the fast path)
        if torch._C._len_torch_function_stack() == 0 or torch.get_default_device().type == "cpu":
            return fn(*args, **kwargs)
        with torch.device("cpu"):
            return fn(*args, **kwargs)

    return on_cpu


def as_int(value: object) -> int | None:
    """``value`` as an int: Python, NumPy and torch integers (one element), never a bool
    of any kind, a float or a string; ``None`` otherwise. What the argument checks that
    take "an int" accept."""
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", type(value).__name__)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None
