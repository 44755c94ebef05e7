"""What the backends on torch symmetric memory share: the symmetric buffer and its regions,
parities, the host-mapped error word, the backend base class and a low-overhead launcher.

Shape legend: T tokens on this rank · H hidden · G = ceil(H/128) · K top-k · W ranks ·
M = M_max tokens per rank · e local experts (e_max the largest over ranks).

A transport (:class:`SymmTransport` and its subclasses) is the set of buffers for one shape,
shared by every layer with the same (backend, group, H, K, dtype, wire dtype, M_max, e_max)
through ``epmoe.comm.transport``; each backend binds its placement and releases its hold in
``close``. Two parities of buffers let two dispatch results be held at once (two
micro-batches); a third dispatch before a combine raises.

Errors: every wait in the kernels is bounded (``EPMOE_COMM_TIMEOUT_S``, default 10 s); a
timeout, a capacity overflow or an expert id out of range writes a code to a host-mapped
word that the next call (or ``check()``) turns into an error naming the operation and
the peer; the kernels reach that word through a status block in device memory, whose stop
flag (set by a timeout) is what the rank's other waits poll, never host memory. After a
timeout the transport's flags are out of step: rebuild the layer.
"""

from __future__ import annotations

import importlib
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from epmoe.comm import transport
from epmoe.comm.base import (
    COPY_INDEX,
    FP8_DTYPE,
    FP8_GROUP,
    AllToAll,
    CommSpec,
    check_combine_args,
    check_dispatch_args,
    one_nvlink_node_reason,
)
from epmoe.distributed import normalize_device, num_sms
from epmoe.kernels.launcher import launch

ALIGN = 256  # bytes between regions (the kernels need 16)
NUM_PARITIES = 2
BLOCK_E = 256  # expert counters zeroed per step
_OPS = {1: "dispatch", 2: "combine"}
MAX_TOKENS_LIMIT = (1 << 16) - 1  # max_num_tokens below it: T + 1 fits 16 bits
_KINDS = {
    1: "timed out waiting for rank",
    2: "overflowed an expert's rows from rank",
    3: "got an expert id outside [0, P) or -1 on rank",
    4: "met another MoE layer's dispatch (a rank skipped or reordered the step's layers) on rank",
}


def comm_timeout_s() -> float:
    raw = os.environ.get("EPMOE_COMM_TIMEOUT_S", "").strip()
    try:
        value = float(raw) if raw else 10.0
    except ValueError:
        value = -1.0
    if not 0 < value < 9e9:  # (nanoseconds in an int64 on the device: a finite bound)
        raise ValueError(
            f"EPMOE_COMM_TIMEOUT_S must be a positive number of seconds below 9e9, got {raw!r}"
        )
    return value


_KERNELS = None


def kernels():
    """``epmoe.comm.symm.kernels`` (imports triton), imported on first use: kept out of
    import time, and looked up from a global after that (an import statement in every
    call costs host time that eager decode waits for)."""
    global _KERNELS
    if _KERNELS is None:
        from epmoe.comm.symm import kernels as module

        _KERNELS = module
    return _KERNELS


def pow2(n: int) -> int:
    """The next power of two ≥ ``n`` (1 for 0 and 1)."""
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class Regions:
    """Byte offsets of one parity's regions in the symmetric buffer (see kernels.py)."""

    # int32 expect [W], started [W], dflag [W, M], cflag [W, M], done [W], cdone [W],
    # ccount [W, M]
    flags: int
    x: int  # wire [W, M, H]
    s: int  # float32 [W, M, G] (FP8 only)
    ids: int  # int32 [W, M, K]
    w: int  # float32 [W, M, K]
    y: int  # combine dtype [W, M, H]


def layout(W: int, M: int, H: int, K: int, wire: torch.dtype, dtype: torch.dtype, fp8: bool):
    """Per-parity regions and the total bytes of the symmetric buffer."""
    G = -(-H // FP8_GROUP)
    sizes = [
        ("flags", (4 * W + 3 * W * M) * 4),
        ("x", W * M * H * wire.itemsize),
        ("s", W * M * G * 4 if fp8 else 0),
        ("ids", W * M * K * 4),
        ("w", W * M * K * 4),
        ("y", W * M * H * dtype.itemsize),
    ]
    regions, offset = [], 0
    for _ in range(NUM_PARITIES):
        fields = {}
        for name, nbytes in sizes:
            fields[name] = offset
            offset += -(-nbytes // ALIGN) * ALIGN
        regions.append(Regions(**fields))
    return regions, offset


def symm_buffer_bytes(spec: CommSpec) -> int:
    """Bytes of a rank's symmetric buffer for ``spec`` (both parities; see ``layout``)."""
    W, M, H, K = spec.world_size, spec.max_num_tokens, spec.hidden_size, spec.top_k
    return layout(W, M, H, K, spec.wire_dtype, spec.dtype, spec.fp8_dispatch)[1]


def kernel_tag(call_tag: int) -> int:
    """A call tag (``base.layer_call_tag``) in the 15 bits the kernels carry: layers'
    tags in ``[1, 2**14)`` (index + 1, wrapping past 16382 layers), copies'
    (``COPY_INDEX + i``) in ``[2**14, 2**15)``, so no copy looks like a layer; 0 stays
    untagged."""
    if call_tag >= COPY_INDEX:
        return 0x4000 | (call_tag & 0x3FFF)
    return (call_tag - 1) % 0x3FFF + 1 if call_tag else 0


MEMORY_ADVICE = "free GPU memory on those ranks, or lower max_num_tokens (the buffers grow with it)"
IPC_ADVICE = (
    "ranks that share a GPU open each other's buffers by CUDA IPC, which needs them in one "
    "container (one IPC namespace) on one host; or give each rank a GPU of its own and an "
    "NCCL group"
)


def _agree_allocated(
    group: dist.ProcessGroup,
    device: torch.device,
    failure: BaseException | None,
    what: str,
    advice: str = MEMORY_ADVICE,
) -> None:
    """Raise on every rank of ``group`` if ``what`` (allocating or opening buffers) failed on
    any (``failure``: this rank's error), naming the ranks and ``advice``; a collective, so
    also a barrier."""
    W = dist.get_world_size(group)
    ok = torch.tensor([0 if failure is not None else 1], dtype=torch.int32, device=device)
    every = torch.empty(W, dtype=torch.int32, device=device)
    dist.all_gather_into_tensor(every, ok, group=group)
    failed = [r for r, v in enumerate(every.tolist()) if v == 0]
    if failed:
        mine = f" (here: {type(failure).__name__}: {failure})" if failure is not None else ""
        raise RuntimeError(
            f"{what} failed on rank(s) {failed} of the group{mine}: {advice}; every rank "
            "raises this"
        ) from failure


def _ranks_share_a_gpu(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether two ranks of ``group`` run on one GPU, which torch's symmetric memory refuses
    ("allocations from overlapping devices"). Only a group that is not NCCL can hold such
    ranks (NCCL refuses them first), so an NCCL group is not asked: no collective."""
    if device.type != "cuda" or "nccl" in str(dist.get_backend(group)):
        return False
    me = (socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid))
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, me, group=group)
    return len(set(everyone)) < len(everyone)


def _open_peer_buffers(
    buffer: torch.Tensor, group: dist.ProcessGroup, rank: int, world_size: int
) -> list[torch.Tensor]:
    """Every rank's ``buffer`` as a tensor of this process, for ranks that share GPUs (a
    development setup: ``tests.harness``'s ``EPMOE_TEST_RANKS_PER_GPU``): CUDA IPC handles
    exchanged over ``group`` and opened here, in place of torch's symmetric memory. The
    kernels only need each peer's address; the views keep the peers' memory mapped.

    One share per peer: torch counts each share's consumers down from one, so a share
    opened by two peers would count below zero (the buffer leaked or freed early)."""
    from torch.multiprocessing.reductions import reduce_tensor

    shares = {r: reduce_tensor(buffer) for r in range(world_size) if r != rank}
    rebuild = next(iter(shares.values()))[0]  # (the same for every share: CUDA storage)
    mine = [shares[r][1] if r in shares else None for r in range(world_size)]
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)  # everyone[s][r]: s's share for r
    return [buffer if s == rank else rebuild(*everyone[s][rank]) for s in range(world_size)]


def status_block(err_host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The status block the kernels are given (``kernels._status``): int64 [2] on
    ``device``, the address of the host-mapped error word ``err_host`` (int32 [1], pinned),
    then the "a wait of this rank timed out" flag that the waits poll in device memory
    (zero until a timeout; never cleared)."""
    return torch.tensor([err_host.data_ptr(), 0], dtype=torch.int64, device=device)


class SymmTransport:
    """The symmetric buffer (``Regions`` per parity; peers write into it), the table of
    every rank's buffer address, one host-mapped int32 error word and the parities in use.
    Subclasses add their local buffers. ``name`` names the backend in messages."""

    name = "symm"

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
        spec: CommSpec,
        max_local: int,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        W, M, H, K = world_size, spec.max_num_tokens, spec.hidden_size, spec.top_k
        self.M, self.H, self.K, self.e_max = M, H, K, max_local
        self.G = -(-H // FP8_GROUP)
        self.fp8 = spec.fp8_dispatch
        self.dtype, self.wire = spec.dtype, spec.wire_dtype
        self.device = dev = normalize_device(spec.device)  # (what tensors report)
        self.regions, nbytes = layout(W, M, H, K, self.wire, self.dtype, self.fp8)
        if world_size > 1:
            group = group or dist.group.WORLD
            os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
            import torch.distributed._symmetric_memory as symm_mem

            shared = _ranks_share_a_gpu(group, dev)
            failure = None
            try:
                if shared:
                    self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=dev)
                else:
                    self._buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=dev)
            except RuntimeError as exc:  # (out of memory on this rank only, OutOfMemoryError)
                failure = exc
            # every rank learns of one rank's failure, instead of waiting in the rendezvous
            what = f"allocating {self.name}: {nbytes / 2**30:.2f} GiB of symmetric memory"
            _agree_allocated(group, dev, failure, what)
            if shared:
                opened = None
                try:
                    self._handle = _open_peer_buffers(self._buffer, group, rank, world_size)
                    ptrs = [b.data_ptr() for b in self._handle]
                except RuntimeError as exc:  # (cudaIpcOpenMemHandle, on this rank only)
                    opened = exc
                what = f"opening {self.name}: the peers' buffers (CUDA IPC)"
                _agree_allocated(group, dev, opened, what, IPC_ADVICE)
            else:
                self._handle = symm_mem.rendezvous(self._buffer, group.group_name)
                ptrs = list(self._handle.buffer_ptrs)
        else:  # one rank: the buffer needs no peers
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            self._handle = None
            ptrs = [self._buffer.data_ptr()]
        self._buffer.zero_()
        if any(p % 16 for p in ptrs):  # the kernels assume it (see kernels._at)
            raise RuntimeError(f"{self.name}: a symmetric buffer is not 16-byte aligned: {ptrs}")
        self.bases = torch.tensor(ptrs, dtype=torch.int64, device=dev)
        # the kernels write error codes straight into pinned host memory (mapped, UVA),
        # through the status block (device memory) that the kernels are given
        on_gpu = dev.type == "cuda"  # (the CPU runs these kernels only under the interpreter)
        self.err_host = torch.zeros(1, dtype=torch.int32, pin_memory=on_gpu)
        self._err_word = self.err_host.numpy()  # read without torch's indexing overhead
        self._status = status_block(self.err_host, dev)
        self.err_addr = self._status.data_ptr()
        self.timeout_ns = int(comm_timeout_s() * 1e9)
        self.num_sms = num_sms(dev) if on_gpu else 4
        # a whole row (up to 8192 columns) per step of a program
        self.block_h = min(max(pow2(H), FP8_GROUP), 8192)
        self.num_warps = 8 if self.block_h >= 4096 else 4
        self.held = [False] * NUM_PARITIES
        self.generation = [0] * NUM_PARITIES  # dispatches taken on each parity so far
        self.next_parity = 0
        self.broken: str | None = None
        self._row_views: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        # [M] int32 per parity: the ranks each of this rank's tokens went to, a bit each
        # (the dispatch send writes it, the combine receive reads it: one load per token,
        # not its ids and their owners, and not the caller's ids, refilled since maybe)
        failure = None
        try:
            self.routes = [torch.zeros(M, dtype=torch.int32, device=dev) for _ in range(2)]
            self._allocate_local(spec)
            if on_gpu:
                torch.cuda.synchronize(dev)
        except RuntimeError as exc:  # (OutOfMemoryError included)
            if world_size == 1:
                raise
            failure = exc
        if world_size > 1:
            # also the barrier after which peers may write: every buffer is zeroed by then
            _agree_allocated(group, dev, failure, f"allocating {self.name}: its local buffers")

    def _allocate_local(self, spec: CommSpec) -> None:
        """The subclass's local (not symmetric) buffers."""

    def region(self, parity: int, name: str, dtype: torch.dtype, shape: tuple[int, ...]):
        """A tensor view of region ``name`` of ``parity`` in this rank's symmetric buffer."""
        start = getattr(self.regions[parity], name)
        count = 1
        for n in shape:
            count *= n
        nbytes = count * dtype.itemsize
        return self._buffer[start : start + nbytes].view(dtype).view(shape)

    def rows(self, parity: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The received rows ``[R = W·M, H]`` (wire dtype) and FP8 scales ``[R, G]`` of
        ``parity``, where the peers wrote them: views of this rank's symmetric buffer (made
        once per parity: a dispatch's host time is what eager decode waits for)."""
        views = self._row_views.get(parity)
        if views is None:
            R = self.world_size * self.M
            x = self.region(parity, "x", self.wire, (R, self.H))
            scale = self.region(parity, "s", torch.float32, (R, self.G)) if self.fp8 else None
            views = self._row_views[parity] = (x, scale)
        return views

    # ------------------------------------------------------------------ parities
    def take_parity(self) -> int:
        for i in range(NUM_PARITIES):
            p = (self.next_parity + i) % NUM_PARITIES
            if not self.held[p]:
                self.held[p] = True
                self.generation[p] += 1
                self.next_parity = (p + 1) % NUM_PARITIES
                return p
        raise RuntimeError(
            f"{self.name} holds at most {NUM_PARITIES} dispatch results at once (shared by "
            "all layers of this shape): combine one before the next dispatch"
        )

    def give_back(self, parity: int) -> None:
        self.held[parity] = False

    # ------------------------------------------------------------------ errors
    def check(self, sync: bool = False) -> None:
        """Raise if a kernel reported an error. ``sync`` waits for the device first (else the
        error of a kernel still running shows at a later call)."""
        if sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.broken is None:
            code = int(self._err_word[0])
            if code == 0:
                return
            kind, op, peer = code >> 24, (code >> 16) & 0xFF, code & 0xFFFF
            what = _KINDS.get(kind, f"failed (code {code:#x}) with rank")
            message = f"{self.name} {_OPS.get(op, '?')} on rank {self.rank} {what} {peer}"
            if kind != 1:
                # bad ids or an overflow (those rows were dropped), or another layer's call
                # met: the call completed in step on every rank, so this rank reports it
                # once and the transport goes on (a timeout after it overwrites the word)
                self._err_word[0] = 0
                raise RuntimeError(message)
            self.broken = message + (
                f" for {self.timeout_ns / 1e9:g} s (EPMOE_COMM_TIMEOUT_S): that rank did not "
                "enter the same call; the transport is out of step: on every rank, close the "
                "shared transports (epmoe.comm.transport.close_all()) and rebuild the layers"
            )
        raise RuntimeError(self.broken)

    def close(self) -> None:
        self._handle = None
        self._buffer = None
        self._row_views = {}
        self.routes = []


class SymmHandle:
    """A dispatch result's state for its combine (opaque to callers). A plain class with
    slots, not a frozen dataclass: one is built per dispatch, and a frozen dataclass's
    ``__init__`` costs about 2 µs of an eager decode call's host time more.

    ``parity``; ``ids_TK``: physical ids of this rank's tokens (combine recomputes owners);
    ``num_tokens`` T; ``transport``: whose parity this result holds; ``generation``: the
    parity's dispatch count when this result took it; ``chunk``: ``symm_ht``'s tokens per
    count of the streamed combine its dispatch set up."""

    __slots__ = ("parity", "ids_TK", "num_tokens", "transport", "generation", "chunk")

    def __init__(
        self,
        parity: int,
        ids_TK: torch.Tensor,
        num_tokens: int,
        transport: SymmTransport,
        generation: int,
        chunk: int = 0,
    ) -> None:
        self.parity, self.ids_TK, self.num_tokens = parity, ids_TK, num_tokens
        self.transport, self.generation, self.chunk = transport, generation, chunk

    def __repr__(self) -> str:
        return f"SymmHandle(parity={self.parity}, num_tokens={self.num_tokens})"


class SymmBackend(AllToAll):
    """What the symmetric-memory backends share: availability, binding a placement to a
    shared transport (``transport_class``), input checks, parity bookkeeping."""

    transport_class: type[SymmTransport] = SymmTransport

    # whether the transport's buffers grow with the largest local expert count (symm_ll's
    # [e, C, H]; symm_ht's rows do not): part of the transport's key, re-acquired on growth
    sized_by_local_experts = True
    # rows a send program stores per barrier, and whether it then fences once for them
    # (kernels.batch_fence) instead of a release per flag: symm_ht's tokens_per_flag
    _batch = 1
    _fence = False
    # symm_ht's tokens_per_flag=0: no flag per row, one fence and one token count per
    # program at its end (kernels: COUNTED)
    _counted = False
    # FP8 dispatch: rows quantized by a kernel of their own (every SM) before the send,
    # instead of in the send programs (symm_ht decides by its mode and SM count)
    _quantize_first = False

    @property
    def kernel_tag(self) -> int:
        """``call_tag`` as the kernels carry it (:func:`kernel_tag`), in the upper half of
        each dispatch's count word (``expect``). Each receiver reports a source whose tag
        is not its own (``ERR_LAYER``)."""
        return kernel_tag(self.call_tag)

    @classmethod
    def supports(cls, spec: CommSpec) -> str | None:
        """Also refuses ``max_num_tokens`` that the count word cannot hold (``T + 1`` in its
        low 16 bits)."""
        if spec.max_num_tokens >= MAX_TOKENS_LIMIT:
            return (
                f"max_num_tokens={spec.max_num_tokens} is above the {MAX_TOKENS_LIMIT - 1} "
                "tokens per call its count word holds; pass a smaller max_num_tokens (the "
                "layer chunks larger steps)"
            )
        return super().supports(spec)

    @classmethod
    def unavailable_reason(cls, device, group=None) -> str | None:
        reason = super().unavailable_reason(device, group)
        if reason is not None:
            return reason
        reason = one_nvlink_node_reason(group, ranks_may_share_gpus=True) or ranks_reason(group)
        if reason is not None:
            return reason
        try:
            importlib.import_module("triton")
            importlib.import_module("torch.distributed._symmetric_memory")
        except ImportError as exc:
            return f"needs triton and torch symmetric memory ({exc})"
        return None

    def __init__(self, spec, group, layout=None):
        reason = ranks_reason(group)
        if reason is not None:
            raise ValueError(f"{self.name}: {reason}")
        super().__init__(spec, group, layout)
        self._hold: transport.Hold | None = None
        self._dispatch_consts: dict | None = None  # the dispatch kernels' meta-parameters
        self._combine_consts: dict | None = None  # ... and the combine kernels'
        self._views: dict = {}  # per parity: a result's views of the transport (see ll.py)
        self._bind()

    def _bind(self) -> None:
        if getattr(self, "_closed", False):  # (a rebind must not bring it back)
            raise RuntimeError(f"{self.name} backend is closed; build a new one")
        # what was derived from the old binding goes first (a failure below leaves none)
        self._dispatch_consts = self._combine_consts = None
        self._views = {}
        # bound launches (kernels.launcher.BoundLaunch), by call and parity
        self._bound: dict = {}
        spec = self.spec
        key = (
            self.name,
            self.transport_class.__name__,
            transport.group_key(self.group),
            spec.hidden_size,
            spec.top_k,
            spec.dtype,
            spec.wire_dtype,
            spec.max_num_tokens,
            spec.device,
        )
        e_max = spec.max_local if self.sized_by_local_experts else 0
        old = self._hold
        if old is None or old.key[:-1] != key or old.key[-1] < e_max:
            # (re)acquire buffers large enough for the largest local expert count
            make = self.transport_class
            self._hold = transport.Hold(
                self.name,
                (*key, e_max),
                lambda: make(self.group, self.rank, self.world_size, spec, e_max),
            )
            if old is not None:
                old.release()
        dev = spec.device
        sizes = [spec.num_local(r) for r in range(self.world_size)]
        self._owner_P = torch.repeat_interleave(
            torch.arange(self.world_size, dtype=torch.int32, device="cpu"),
            torch.tensor(sizes, device="cpu"),
        ).to(dev)
        # each physical expert's slot among its rank's experts (one lookup in the kernel)
        self._local_P = torch.cat(
            [torch.arange(n, dtype=torch.int32, device="cpu") for n in sizes]
        ).to(dev)
        self._num_local = spec.num_local(self.rank)

    @property
    def num_sms(self) -> int:
        """SMs the kernels may occupy (the device's, unless a backend caps it)."""
        return self._live().num_sms

    def _live(self) -> SymmTransport:
        """The shared transport; raises once this backend (or every transport) is closed."""
        if self._hold is None:
            raise RuntimeError(f"{self.name} backend is closed")
        return self._hold.get()

    def check(self, sync: bool = True) -> None:
        """Raise if a kernel of this transport reported a timeout or bad input."""
        self._live().check(sync=sync)

    def _dispatch_prologue(self, hidden_TH, topk_ids_TK, topk_weights_TK):
        """Checks and contiguous inputs; takes a parity: ``(tr, x, ids, w, b, consts)``,
        ``tr`` the live transport, the consts the send half's meta-parameters. (Host time
        is what an eager decode step waits for: the transport is looked up once per call.)"""
        spec, tr = self.spec, self._live()
        check_dispatch_args(spec, hidden_TH, topk_ids_TK, topk_weights_TK, True)
        dev = tr.device
        if hidden_TH.device != dev or topk_ids_TK.device != dev or topk_weights_TK.device != dev:
            _on_device(
                dev, hidden_states=hidden_TH, topk_ids=topk_ids_TK, topk_weights=topk_weights_TK
            )
        tr.check()
        x = hidden_TH.contiguous()
        ids = topk_ids_TK.contiguous()
        w = topk_weights_TK  # (a no-op .to() costs as much host time as all the checks)
        w = (w if w.dtype == torch.float32 else w.float()).contiguous()
        consts = self._dispatch_consts
        if consts is None:
            from epmoe.reference import FP8_EPS, FP8_MAX

            K = spec.top_k
            consts = self._dispatch_consts = dict(
                K=K, BLOCK_K=pow2(K), BLOCK_W=pow2(self.world_size), BLOCK_H=tr.block_h,
                FP8=tr.fp8, WIRE=TL_DTYPES[tr.wire], FP8_MAX=FP8_MAX,
                INV_FP8_MAX=INV_FP8_MAX, EPS=FP8_EPS,
            )  # fmt: skip
        return tr, x, ids, w, tr.take_parity(), consts

    def _send(self, tr, x, ids, w, b: int, consts: dict, programs: int, rows: int = 1) -> None:
        """The dispatch's send half (``_dispatch_prologue``'s outputs) on ``programs``
        programs (counted: each sending ``rows`` tokens at a time), FP8 rows quantized
        first with ``_quantize_first``; gives parity ``b`` back when that or the launch
        fails (nothing was sent)."""
        k = kernels()
        spec = self.spec
        reg = tr.regions[b]
        try:
            x_scale = None  # [T, G]: x is FP8 already, quantized with these scales
            if self._quantize_first and tr.fp8:
                if x.shape[0] > 0:
                    from epmoe.kernels.ops import per_token_group_quant_fp8

                    x, x_scale = per_token_group_quant_fp8(x)
                else:  # the same kernel variant as with tokens: a rank idle for the first
                    # time must not compile one while its peers wait in this call
                    x = torch.empty(0, tr.H, dtype=tr.wire, device=x.device)
                    x_scale = torch.empty(0, tr.G, dtype=torch.float32, device=x.device)
            launch(k.dispatch_send_kernel)(
                (programs,),
                x, x if x_scale is None else x_scale, ids, w, self._owner_P, self._local_P,
                tr.bases, tr.err_addr, tr.routes[b],
                x.shape[0], tr.H, spec.num_physical, tr.M, self.world_size, tr.G, self.rank,
                self.kernel_tag, reg.flags, reg.x, reg.s, reg.ids, reg.w,
                BATCH=self._batch, FENCE=self._fence, PREQUANT=x_scale is not None,
                COUNTED=self._counted, ROWS=rows, ROUTES=True,
                num_warps=tr.num_warps, **consts,
            )  # fmt: skip
        except BaseException:
            tr.give_back(b)
            raise

    def _combine_receive(
        self,
        h: SymmHandle,
        consts: dict,
        programs: int,
        rows: int = 1,
        ranks: int = 1,
        num_warps: int | None = None,
        prefetch: int = 0,
    ) -> torch.Tensor:
        """The combine's receive half on ``programs`` programs, each taking ``rows`` tokens
        at a time (``rows`` > 1: loading ``ranks`` ranks' partial rows at once, with the
        rows ``prefetch`` steps ahead asked of the L2 first): ``[T, H]``,
        the sum of the partial rows each rank sent back for this rank's tokens; ends the
        call (parity given back, errors reported)."""
        k = kernels()
        tr, spec, W, T = h.transport, self.spec, self.world_size, h.num_tokens
        reg = tr.regions[h.parity]
        out = torch.empty(T, tr.H, dtype=spec.dtype, device=tr.device)
        launch(k.combine_recv_kernel)(
            (programs,),
            out, h.ids_TK, self._owner_P, tr.bases, tr.err_addr, tr.routes[h.parity],
            T, tr.H, spec.num_physical, W, tr.M, self.rank, tr.timeout_ns,
            reg.flags, reg.y,
            BLOCK_W=pow2(W), COUNTED=self._counted, ROWS=rows, RANKS=min(ranks, W),
            PREFETCH=prefetch if rows > 1 else 0, ROUTES=True,
            num_warps=num_warps or tr.num_warps, **consts,
        )  # fmt: skip
        self._combine_done(h)
        return out

    def _handle(self, tr, parity: int, ids_TK: torch.Tensor, T: int, chunk: int = 0) -> SymmHandle:
        return SymmHandle(parity, ids_TK, T, tr, tr.generation[parity], chunk)

    def _combine_prologue(self, expert_out, result) -> tuple[SymmHandle, torch.Tensor, dict]:
        """Checks; ``(h, y, consts)``: the result's handle (``h.transport`` is the live
        transport once checked), contiguous expert outputs, the kernels' meta-parameters."""
        spec, tr = self.spec, self._live()
        check_combine_args(expert_out, result)
        if expert_out.device != tr.device:
            _on_device(tr.device, expert_out=expert_out)
        h: SymmHandle = result.handle
        if not isinstance(h, SymmHandle):
            raise TypeError("combine needs the DispatchResult of this backend's dispatch")
        current = tr.held[h.parity] and tr.generation[h.parity] == h.generation
        if h.transport is not tr or not current:
            # a second combine would raise the peers' flags twice and desynchronise them
            raise RuntimeError(
                "this dispatch result was already combined (or the backend was rebound to "
                "other buffers since): combine each dispatch result exactly once"
            )
        if expert_out.dtype != spec.dtype:  # (its shape: check_combine_args)
            raise TypeError(
                f"expert_out must be {spec.dtype} (the layer's dtype), got {expert_out.dtype}"
            )
        c = self._combine_consts
        if c is None:
            K = spec.top_k
            c = self._combine_consts = dict(K=K, BLOCK_K=pow2(K), BLOCK_H=tr.block_h)
        return h, expert_out.contiguous(), c

    def _combine_done(self, h: SymmHandle) -> None:
        tr = h.transport
        tr.give_back(h.parity)
        # the call is complete on every rank: now report what the kernels flagged (this
        # call's bad ids or overflow when they have finished, else at the next call)
        tr.check()

    def close(self) -> None:
        """Give back this backend's hold on the shared transport (the last holder frees
        its buffers) and drop every view of them; the backend cannot be used or rebound
        after it."""
        self._closed = True
        self._views, self._bound = {}, {}
        if self._hold is not None:
            self._hold.release()


# Each token's destination ranks are kept as an int32 mask (SymmTransport.routes)
MAX_RANKS = 32


def ranks_reason(group) -> str | None:
    """Why ``group`` has too many ranks for the symm backends, or ``None``."""
    W = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if W > MAX_RANKS:
        return (
            f"at most {MAX_RANKS} ranks (each token's destination ranks are kept as a 32-bit "
            f"mask), the group has {W}: use all_to_all"
        )
    return None


def _on_device(device: torch.device, **tensors: torch.Tensor) -> None:
    """Raise, naming the argument, unless every tensor is on ``device`` (the kernels get
    bare addresses, see ``kernels.launcher.Launcher``: a tensor elsewhere would be read as
    garbage)."""
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(
                f"{name} is on {t.device}, but this backend's buffers are on {device}: "
                f"move it there first ({name}.to({str(device)!r}))"
            )


INV_FP8_MAX = float(torch.tensor(1.0 / 448.0, dtype=torch.float32, device="cpu"))


def _tl_dtypes():
    import triton.language as tl

    return {
        torch.bfloat16: tl.bfloat16,
        torch.float16: tl.float16,
        torch.float32: tl.float32,
        FP8_DTYPE: tl.float8e4nv,
    }


class _LazyDtypes(dict):
    def __missing__(self, key):
        self.update(_tl_dtypes())
        return dict.__getitem__(self, key)


TL_DTYPES = _LazyDtypes()  # torch dtype -> triton dtype, filled on first use
