"""The peer-store ceiling: the fastest a one-sided dispatch can move its payload to the peers.

A minimal Triton kernel on torch symmetric memory stores this rank's wire rows straight
into the receive buffers of the other ranks (``symm_mem.rendezvous(...).get_buffer(peer,
...)``): no counts, no flags, no quantization, no layout work, only the stores a dispatch
cannot avoid: what a dispatch built on the same links spends at least (one that beats it
has a better store loop than this one). ``epmoe.bench.comm`` runs it next to every backend,
for the same routing, T, H and wire dtype, eagerly and replayed from a CUDA graph.

Two patterns (``PATTERNS``), one message (one stored row) each:

* ``per_rank``: a token once per other rank that holds one of its experts (the de-duplicated
  dispatch of the Standard layout; DeepEP V2, TRT-LLM one-sided);
* ``per_expert``: a token once per selected expert on another rank (the ExpertBatched
  layout; DeepEP low-latency, pplx).

Rows for experts on this rank itself are not stored: they never cross a link (a real
dispatch copies them locally, through HBM). Each row is the wire row: ``H`` bf16 values, or
``H`` FP8 bytes followed by ``H / 128`` float32 scales; rows are padded to 16 bytes so that
the kernel stores 16-byte vectors (no padding at H = 7168). Receive buffers are rank-major:
the rows from source rank ``s`` fill slots ``[s·S, s·S + n)`` in message order, ``S`` being
the most messages one rank can send to one peer (``T`` per rank, ``T·K`` per expert).

Shape legend: T tokens on this rank · K top-k · W ranks · N messages (rows stored) ·
B bytes of one wire row · S receive slots per source rank · G programs (≤ SMs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from epmoe.comm.base import one_nvlink_node_reason

PATTERNS = ("per_rank", "per_expert")
ROW_ALIGN = 16  # bytes: rows start on 16-byte boundaries, so stores are 128-bit vectors
STEP_WORDS = 8192  # 4-byte words a program moves per step of its loop


@triton.jit
def peer_store_kernel(
    # pointers
    payload_ptr,  # [T, ROW_WORDS] int32: this rank's wire rows, 16-byte aligned
    msg_row_ptr,  # [N] int32: payload row of message n
    msg_rank_ptr,  # [N] int32: destination rank of message n
    msg_slot_ptr,  # [N] int32: row of the destination's receive buffer that message n fills
    recv_ptrs_ptr,  # [W] int64: address of each rank's receive buffer [W·S, ROW_WORDS] int32
    # sizes
    num_msgs,  # N
    # strides: payload and receive rows are contiguous, ROW_WORDS words apart (a constexpr,
    # so that the compiler sees every row start on a 16-byte boundary)
    # meta-parameters
    ROW_WORDS: tl.constexpr,  # 4-byte words per row (a multiple of 4)
    BLOCK: tl.constexpr,  # power of two >= ROW_WORDS
    MSGS: tl.constexpr,  # messages a program stores per step (power of two)
):
    """The G programs take MSGS messages at a time, round robin: program p stores messages
    ``[(p + i·G)·MSGS, (p + i·G + 1)·MSGS)`` for i = 0, 1, ... (whole rows)."""
    cols = tl.arange(0, BLOCK)
    col_mask = cols < ROW_WORDS
    first = tl.program_id(0) * MSGS
    stride = tl.num_programs(0) * MSGS
    for start in range(first, num_msgs, stride):
        n = start + tl.arange(0, MSGS)
        n_mask = n < num_msgs
        row = tl.load(msg_row_ptr + n, mask=n_mask, other=0).to(tl.int64)
        rank = tl.load(msg_rank_ptr + n, mask=n_mask, other=0)
        slot = tl.load(msg_slot_ptr + n, mask=n_mask, other=0).to(tl.int64)
        mask = n_mask[:, None] & col_mask[None, :]  # [MSGS, BLOCK]
        src = payload_ptr + row[:, None] * ROW_WORDS + cols[None, :]
        words = tl.load(src, mask=mask, other=0)
        # receive buffers are ROW_ALIGN (16)-byte aligned (checked on the host); without the
        # hint an address loaded from memory would allow only 4-byte stores
        recv_base = tl.load(recv_ptrs_ptr + rank, mask=n_mask, other=0)
        recv_base = tl.multiple_of(recv_base.to(tl.pointer_type(tl.int32)), 16)
        tl.store(recv_base[:, None] + slot[:, None] * ROW_WORDS + cols[None, :], words, mask=mask)


def unavailable_reason(
    device: torch.device, world_size: int, group: dist.ProcessGroup | None
) -> str | None:
    """Why the ceiling cannot be measured here (``None`` when it can). Torch symmetric
    memory maps the peers' buffers over NVLink: its rendezvous needs every rank of
    ``group`` on one node, as the backends built on it do (``one_nvlink_node_reason``)."""
    if device.type != "cuda":
        return "the peer-store ceiling needs CUDA GPUs (torch symmetric memory)"
    if world_size < 2:
        return "the peer-store ceiling needs at least 2 ranks"
    reason = one_nvlink_node_reason(group)
    if reason is not None:
        return f"the peer-store ceiling (torch symmetric memory) {reason}"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as exc:
        return f"torch symmetric memory is unavailable: {exc}"
    return None


def padded_row_words(row_bytes: int) -> int:
    """4-byte words of a wire row of ``row_bytes`` bytes, padded to ``ROW_ALIGN`` bytes."""
    return -(-row_bytes // ROW_ALIGN) * (ROW_ALIGN // 4)


def peer_messages(
    owner_TK: torch.Tensor, rank: int, world_size: int, pattern: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The rows this rank stores into its peers for one dispatch.

    ``owner_TK``: int64 ``[T, K]`` rank holding each selected expert (``-1``: no expert).
    Returns ``(row_N, rank_N, slot_N, S)``: int32 payload row, destination rank and
    receive slot of each message, in token order, and the receive slots per source rank.
    Messages to ``rank`` itself are left out (they do not cross a link).
    """
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")
    T, K = owner_TK.shape
    if pattern == "per_rank":  # [T, W + 1]: which ranks each token goes to (column W: none)
        hit_TX = torch.zeros(T, world_size + 1, dtype=torch.bool, device=owner_TK.device)
        hit_TX.scatter_(1, torch.where(owner_TK >= 0, owner_TK, world_size), True)
        token_N, rank_N = hit_TX[:, :world_size].nonzero(as_tuple=True)  # token order
        slots_per_source = T
    else:
        token_N, k_N = (owner_TK >= 0).nonzero(as_tuple=True)
        rank_N = owner_TK[token_N, k_N]
        slots_per_source = T * K
    keep_N = rank_N != rank
    token_N, rank_N = token_N[keep_N], rank_N[keep_N]
    # position of each message among those to the same destination, in token order
    onehot_NW = torch.nn.functional.one_hot(rank_N, world_size)
    position_N = (onehot_NW.cumsum(0) * onehot_NW).sum(1) - 1
    slot_N = rank * slots_per_source + position_N
    return _int32(token_N), _int32(rank_N), _int32(slot_N), slots_per_source


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


class ReceiveBuffers:
    """One symmetric receive buffer per rank, large enough for every case of a run, and
    the table of every rank's buffer address. Collective to build and to ``close``."""

    def __init__(self, num_words: int, group: dist.ProcessGroup, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        W = dist.get_world_size(group)
        self.num_words = num_words
        self.group = group
        self.local = symm_mem.empty(num_words, dtype=torch.int32, device=device)
        self.handle = symm_mem.rendezvous(self.local, group.group_name)
        # the views keep the peers' mappings in use while their addresses are
        self.views = [self.handle.get_buffer(r, (num_words,), torch.int32) for r in range(W)]
        if any(v.data_ptr() % ROW_ALIGN for v in self.views):
            raise RuntimeError(f"a symmetric receive buffer is not {ROW_ALIGN}-byte aligned")
        self.ptrs_W = torch.tensor(
            [v.data_ptr() for v in self.views], dtype=torch.int64, device=device
        )

    def close(self) -> None:
        """Wait until no rank stores into the buffers any more, then drop them."""
        torch.cuda.synchronize()
        dist.barrier(self.group)
        self.views = []
        del self.local, self.handle


class PeerStore:
    """One dispatch's peer stores of ``payload_TB [T, B]`` uint8 for ``messages`` (from
    :func:`peer_messages`), ready to launch on the current stream (capturable in a CUDA
    graph). ``G = min(ceil(N / MSGS), num_sms)`` programs: never more than the SMs."""

    def __init__(
        self,
        buffers: ReceiveBuffers,
        payload_TB: torch.Tensor,
        messages: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int],
        num_sms: int,
    ) -> None:
        row_N, rank_N, slot_N, slots_per_source = messages
        T, B = payload_TB.shape
        W = buffers.ptrs_W.numel()
        self.row_bytes = B
        self.num_msgs = row_N.numel()
        self.row_words = padded_row_words(B)
        if W * slots_per_source * self.row_words > buffers.num_words:
            raise ValueError(
                f"the receive buffers hold {buffers.num_words} words, this case needs "
                f"{W * slots_per_source * self.row_words}; size them for the largest case"
            )
        padded_TB = torch.zeros(T, self.row_words * 4, dtype=torch.uint8, device=payload_TB.device)
        padded_TB[:, :B] = payload_TB
        self.payload = padded_TB.view(torch.int32)  # [T, ROW_WORDS]
        self.row_N, self.rank_N, self.slot_N = row_N, rank_N, slot_N
        self.recv_ptrs_W = buffers.ptrs_W
        self.block = triton.next_power_of_2(self.row_words)
        # about 32 KiB in flight per program and step (2 bf16 / 4 FP8 rows at H = 7168)
        self.msgs = min(16, max(1, STEP_WORDS // self.block))
        self.num_programs = max(1, min(-(-self.num_msgs // self.msgs), num_sms))  # G

    @property
    def bytes_stored(self) -> int:
        """Payload bytes one launch stores into peers (padding excluded)."""
        return self.num_msgs * self.row_bytes

    def launch(self) -> None:
        """One dispatch's stores (a launch even without messages, as a dispatch would)."""
        peer_store_kernel[(self.num_programs,)](
            self.payload,
            self.row_N,
            self.rank_N,
            self.slot_N,
            self.recv_ptrs_W,
            self.num_msgs,
            ROW_WORDS=self.row_words,
            BLOCK=self.block,
            MSGS=self.msgs,
            num_warps=16,
        )
