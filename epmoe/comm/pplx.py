"""``pplx``: the ExpertBatched layout over pplx-kernels (``pplx_kernels.AllToAll``).

pplx-kernels dispatches each (token, expert) pair into fixed rows ``[e, W·M, H]`` of the
expert's rank with per-expert counts, and combines the experts' outputs back weighted by
the router, with no host synchronisation (``bound_m``, this rank's token count, stays on
the device): graph safe. Its ``do_send`` / ``do_recv`` split maps onto epmoe's split phase.
FP8 rows go as e4m3 with float32 scales per 128 columns (quantized here before the send).

Mapping of the configuration: epmoe gives every rank its own tokens (data-parallel
attention), so pplx's ``dp_size`` is 1 and its ``num_dp`` is W; ``max_num_tokens`` is
epmoe's M_max; experts are partitioned evenly and contiguously (``supports`` refuses other
placements). Indices are uint32 and pplx has no empty entry: an id of -1 (no expert) is
sent with weight 0 to the lowest expert its token does not already use, so it changes no
output (a little extra traffic) and no expert gets a token twice (pplx keeps M rows per
source rank and expert, and would write past them).

pplx-kernels and nvshmem4py are not imported until this backend is chosen (build
pplx-kernels from its repository); NVSHMEM is initialised once per process, here or by
another owner, and two different owners (e.g. DeepEP's low-latency buffer) are refused
with a clear error.

Shape legend: T tokens on this rank · H hidden · G = ceil(H/128) · K top-k · W ranks ·
M = M_max · e local experts · P physical experts.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch
import torch.distributed as dist

from epmoe.comm import _deepep, transport
from epmoe.comm.base import (
    FP8_GROUP,
    AllToAll,
    Capabilities,
    CommSpec,
    DispatchResult,
    Layout,
    Pending,
    check_combine_args,
    check_dispatch_args,
    expert_batched_memory_reason,
    one_nvlink_node_reason,
)
from epmoe.comm.collectives import world_of
from epmoe.distributed import num_sms

INSTALL_HINT = (
    "pplx-kernels is not installed: build it from https://github.com/perplexityai/pplx-kernels "
    "(python setup.py bdist_wheel; pip install dist/*.whl) with nvshmem4py"
)


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} ({exc})") from exc
    except Exception as exc:  # e.g. NVSHMEM's libraries failing to load at its import
        raise ImportError(
            f"{name} is installed but importing it failed ({type(exc).__name__}: {exc})"
        ) from exc


class _PPLXTransport:
    """One ``pplx_kernels.AllToAll`` per (group, shape) and its receive tensors, shared by
    the layers of that shape (they run one after another): ``counts [e]``, ``x [e, W·M, H]``
    (wire dtype), ``scale [e, W·M, G]`` (FP8 dispatch), ``out [M, H]``; ``held``: a dispatch
    result of some layer is not combined yet."""

    def __init__(self, ata, spec: CommSpec, world_size: int) -> None:
        self.ata = ata
        W, M, H, dev = world_size, spec.max_num_tokens, spec.hidden_size, spec.device
        e, G = spec.num_physical // W, -(-H // FP8_GROUP)
        self.counts = torch.empty(e, dtype=torch.int32, device=dev)
        self.x = torch.empty(e, M * W, H, dtype=spec.wire_dtype, device=dev)
        fp8 = spec.fp8_dispatch
        self.scale = torch.empty(e, M * W, G, dtype=torch.float32, device=dev) if fp8 else None
        self.out = torch.empty(M, H, dtype=spec.dtype, device=dev)
        self.held = False

    def close(self) -> None:
        if self.ata is not None:
            self.ata.destroy()
            self.ata = None


def stand_in_ids(topk_ids_TK: torch.Tensor) -> torch.Tensor:
    """``topk_ids_TK`` with each -1 replaced by an expert its token does not use: the
    lowest free ids of ``[0, K)``, in entry order (at most K - #real of them are taken, so
    enough are free; P >= K). On the device, no host synchronisation (graph safe)."""
    K = topk_ids_TK.shape[1]
    candidates_K = torch.arange(K, device=topk_ids_TK.device)
    free_TK = ~(topk_ids_TK[:, :, None] == candidates_K).any(1)  # [T, K] candidate c free
    free_rank_TK = free_TK.cumsum(1) - 1  # candidate c is the row's n-th free one
    none_TK = topk_ids_TK < 0
    nth_TK = none_TK.cumsum(1) - 1  # entry k is the row's n-th -1
    match = free_TK[:, None, :] & (free_rank_TK[:, None, :] == nth_TK[:, :, None])
    return torch.where(none_TK, match.int().argmax(2), topk_ids_TK)


def _ensure_nvshmem(group: dist.ProcessGroup | None, device: torch.device) -> None:
    """Initialise NVSHMEM (nvshmem4py) for this process once, over ``group``'s ranks."""
    transport.check_nvshmem_owner("pplx")
    nvshmem = _import("nvshmem.core")
    if getattr(_ensure_nvshmem, "done", False):
        return
    rank, world = world_of(group)
    uid = nvshmem.get_unique_id(empty=True)
    objects = [nvshmem.get_unique_id() if rank == 0 else None]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(objects, src=0)
    nvshmem.init(
        device=device, uid=objects[0] or uid, rank=rank, nranks=world, initializer_method="uid"
    )
    transport.claim_nvshmem("pplx")  # once it succeeded: a failed init locks no one out
    _ensure_nvshmem.done = True


# pplx-kernels' group name -> the gloo group registered under it (one per EP group)
_NAMED: dict[str, dist.ProcessGroup] = {}


def _named_group(group: dist.ProcessGroup | None) -> str:
    """The name under which pplx-kernels finds ``group``: it exchanges its buffers' IPC
    handles with CPU tensors, so it gets a gloo group of the same ranks (created once,
    collectively, and registered under that name; NCCL groups have no CPU backend)."""
    if not (dist.is_available() and dist.is_initialized()):
        return "epmoe"
    group = group if group is not None else dist.group.WORLD
    name = f"epmoe-{group.group_name}"
    if name in _NAMED and not _resolves(name):  # registered before a destroy_process_group
        del _NAMED[name]
    if name not in _NAMED:
        ranks = dist.get_process_group_ranks(group)
        # only the EP group's ranks take part (other EP groups build theirs in parallel)
        _NAMED[name] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        torch._C._distributed_c10d._register_process_group(name, _NAMED[name])
    return name


def _resolves(name: str) -> bool:
    """Whether c10d still finds a group under ``name`` (destroy_process_group forgets them)."""
    try:
        torch._C._distributed_c10d._resolve_process_group(name)
    except RuntimeError:
        return False
    return True


class PPLXBackend(AllToAll):
    """ExpertBatched dispatch/combine over pplx-kernels (intranode, graph safe)."""

    name = "pplx"
    capabilities = Capabilities(
        layouts=frozenset({Layout.EXPERT_BATCHED}),
        dtypes=frozenset({torch.bfloat16}),
        device_types=frozenset({"cuda"}),
        graph_safe=True,
        fp8_dispatch=True,
        empty_entries_to_unused_expert=True,  # pplx has no empty entry (see stand_in_ids)
        max_in_flight=1,  # one set of receive tensors per transport (shared by the layers)
        default_max_tokens=128,
        auto=False,  # named only
    )

    @classmethod
    def unavailable_reason(cls, device, group=None) -> str | None:
        reason = super().unavailable_reason(device, group)
        if reason is not None:
            return reason
        reason = one_nvlink_node_reason(group)
        if reason is not None:
            return reason
        try:  # the import, not only the package: an unbuilt checkout is found, not usable
            _import("pplx_kernels")
        except ImportError as exc:
            return str(exc)
        if importlib.util.find_spec("nvshmem") is None:
            return "pplx-kernels needs nvshmem4py (pip install nvshmem4py-cu13)"
        if not (dist.is_available() and dist.is_initialized()):
            return "pplx-kernels needs torch.distributed initialised with at least 2 ranks"
        if dist.get_world_size(group) < 2:
            return "pplx-kernels needs at least 2 ranks"
        if group is not None and group is not dist.group.WORLD:
            return "NVSHMEM is initialised over WORLD: the EP group must be WORLD"
        return None

    @classmethod
    def default_tokens(cls, device: torch.device) -> int | None:
        """128, or fewer on a GPU with fewer SMs (one token per SM: see ``supports``)."""
        sms = num_sms(device)
        default = cls.capabilities.default_max_tokens
        return default if sms is None else min(default, sms)

    @classmethod
    def supports(cls, spec: CommSpec) -> str | None:
        reason = super().supports(spec) or _deepep.even_partition_reason(spec)
        if reason is not None:
            return reason
        if spec.num_physical < spec.top_k:
            return f"pplx needs at least top_k={spec.top_k} expert slots, got {spec.num_physical}"
        H, wire = spec.hidden_size, spec.wire_dtype
        if H * wire.itemsize % 16:
            return (
                f"pplx-kernels moves rows of whole 16 bytes: H * {wire.itemsize} % 16 != 0 (H={H})"
            )
        sms = num_sms(spec.device)
        if sms is not None and spec.max_num_tokens > sms:
            # its dispatch send loop has no barrier between a block's tokens: a block that
            # sends a second token overwrites the first in shared memory while it is still
            # being sent (intranode_dispatch.cu at 2bd6e30; 0.79 relative error at 512)
            return (
                f"pplx-kernels' intranode dispatch corrupts rows when a block sends more than "
                f"one token (its grid is one block per SM): at most {sms} tokens per rank on "
                f"this GPU, max_num_tokens={spec.max_num_tokens}; lower max_num_tokens (the "
                "layer chunks larger batches)"
            )
        if spec.fp8_dispatch and 4 * -(-H // FP8_GROUP) % 16:
            return (
                f"pplx-kernels moves FP8 scale rows of whole 16 bytes (4 ceil(H/128) bytes): "
                f"H={H} needs a multiple of 512; leave dispatch_dtype unset"
            )
        # its receive rows (wire dtype), pplx's own buffers (float32 rows, W·M·e of them:
        # two bf16 outputs' worth) and the experts' outputs
        return expert_batched_memory_reason(cls.name, spec, copies=1, outputs=3)

    def rebind_reason(self, spec: CommSpec) -> str | None:
        """A re-plan keeps pplx's buffers only with the same slot count (they are built for
        P experts)."""
        if spec.num_physical != self.spec.num_physical:
            return (
                f"pplx's buffers serve P={self.spec.num_physical} expert slots, the new "
                f"placement has {spec.num_physical}: build the layers with the re-plans' slot "
                "count from the start (EPLBManager with a fixed num_redundant keeps it)"
            )
        return super().rebind_reason(spec)

    def __init__(self, spec, group, layout=None):
        super().__init__(spec, group, layout)
        pplx = _import("pplx_kernels")
        dev = spec.device
        _ensure_nvshmem(self.group, dev)
        name = _named_group(self.group)  # pplx finds its group by name
        W, M, H, K, P = (
            self.world_size,
            spec.max_num_tokens,
            spec.hidden_size,
            spec.top_k,
            spec.num_physical,
        )
        G = -(-H // FP8_GROUP)
        wire = spec.wire_dtype
        # what sizes the buffers: the key (pplx's and the receive tensors' shapes)
        key = ("pplx", transport.group_key(self.group), M, P, K, H, wire, spec.dtype, dev)
        self._hold = transport.Hold(
            self.name,
            key,
            lambda: _PPLXTransport(
                pplx.AllToAll.intranode(
                    max_num_tokens=M,
                    num_experts=P,
                    experts_per_token=K,
                    rank=self.rank,
                    world_size=W,
                    dp_size=1,
                    hidden_dim=H,
                    hidden_dim_bytes=H * wire.itemsize,
                    hidden_dim_scale_bytes=G * 4 if spec.fp8_dispatch else 0,
                    group_name=name,
                ),
                spec,
                W,
            ),
        )

    def dispatch_async(self, hidden_TH, topk_ids_TK, topk_weights_TK) -> Pending[DispatchResult]:
        """The send half now (``do_recv=False``); ``wait()`` receives."""
        spec, tr = self.spec, self._hold.get()
        check_dispatch_args(spec, hidden_TH, topk_ids_TK, topk_weights_TK, True)
        if tr.held:
            raise RuntimeError(
                "pplx holds one dispatch result at a time (its receive tensors, shared by "
                "every layer of this shape): combine it before the next dispatch"
            )
        T = hidden_TH.shape[0]
        none = topk_ids_TK < 0
        # pplx sends rows [0, bound_m): rows after the last one with an expert (a padded
        # batch's tail) are not sent at all; a -1 entry of a row that is sent goes with
        # weight 0 to an expert its token does not use (pplx has no empty entry)
        rows_T = torch.arange(1, T + 1, device=spec.device)
        sent = torch.where((~none).any(1), rows_T, 0).amax() if T else rows_T.sum()
        bound_m = sent.to(torch.uint32).reshape(1)
        indices = stand_in_ids(topk_ids_TK).to(torch.uint32).contiguous()
        weights = torch.where(none, 0.0, topk_weights_TK.to(torch.float32)).contiguous()
        x, x_scale = hidden_TH.contiguous(), None
        if spec.fp8_dispatch:
            from epmoe.kernels.ops import per_token_group_quant_fp8

            x, x_scale = per_token_group_quant_fp8(x)
        args = (tr.counts, tr.x, tr.scale, x, x_scale, indices, bound_m)
        tr.ata.dispatch(*args, do_send=True, do_recv=False)
        tr.held = True

        def receive() -> DispatchResult:
            tr.ata.dispatch(*args, do_send=False, do_recv=True)
            return DispatchResult(
                layout=Layout.EXPERT_BATCHED,
                hidden=tr.x,
                counts=tr.counts,
                hidden_scale=tr.scale,
                handle=(indices, weights, bound_m, T, none.all(1)),
            )

        return Pending(receive)

    def combine_async(self, expert_out, result) -> Pending[torch.Tensor]:
        """The send half of the weighted combine now; ``wait()`` receives."""
        check_combine_args(expert_out, result)
        if expert_out.dtype != torch.bfloat16:
            raise TypeError(f"pplx combines bf16 rows, got {expert_out.dtype}")
        indices, weights, bound_m, T, routed_nowhere_T = result.handle
        tr = self._hold.get()
        args = (tr.out, indices, weights, expert_out.contiguous(), bound_m)
        tr.ata.combine(*args, do_send=True, do_recv=False)

        def receive() -> torch.Tensor:
            tr.ata.combine(*args, do_send=False, do_recv=True)
            tr.held = False
            # rows routed nowhere are zero: those past bound_m were not sent (not a stale
            # row), those before it went to stand-ins with weight 0 (not 0 · NaN of a
            # padding row's garbage)
            rows_T = torch.arange(T, device=tr.out.device)
            zero = (rows_T >= bound_m.to(torch.int64)) | routed_nowhere_T
            return torch.where(zero[:, None], 0.0, tr.out[:T]).to(tr.out.dtype)

        return Pending(receive)

    def close(self) -> None:
        self._hold.release()
