"""Triton kernels of the low-latency (``symm_ll``) transport on torch symmetric memory.

Only ``@triton.jit`` functions live here; ``ll.py`` allocates, checks and launches.

Shape legend: T tokens on this rank · H hidden · G = ceil(H / 128) FP8 scale groups ·
K top-k · W ranks · M = M_max tokens per rank · e local experts · C = W·M rows per local
expert · P physical experts.

Every rank owns one symmetric byte buffer; peers reach it through ``bases[r]`` (the
address of rank r's buffer, valid on every rank). Per parity (two buffers in flight) it
holds, at byte offsets the host passes:

* ``flags``: int32 ``expect[W]`` (source s wrote ``T_s + 1`` in its low 16 bits and its
  call tag, its layer's, in the 15 above: a receiver in another layer's dispatch reports
  it, see ``_announce``), ``started[W]`` (rank r began
  its combine), ``dflag[W, M]`` (token t of source s is written), ``cflag[W, M]`` (rank r's
  combine row for this rank's token t is written), and for ``symm_ht``'s counted mode
  ``done[W]`` (tokens of source s whose rows and routing are written), ``cdone[W]``
  (tokens of this rank that rank r has sent back, or had nothing to send back for) and,
  for its streamed combine, ``ccount[W, M]`` (the same per chunk of this rank's tokens:
  ``ccount[r, c]``);
* ``tok_x [W, M, H]`` wire rows, ``tok_s [W, M, G]`` float32 FP8 scales,
  ``tok_ids [W, M, K]`` int32 local expert slots (-1: not on this rank),
  ``tok_w [W, M, K]`` float32 router weights: what source s sent for its token t;
* ``comb_y [W, M, H]``: rank r's weighted partial sum for this rank's token t.

Design: one message per (token, destination rank). The sender writes each token once per
rank that holds one of its experts (halving NVLink bytes against one per (token, expert)
at top-8 over 2 ranks) plus its routing metadata to every rank; the receiver takes a row of
each local expert for it and writes the token's place in ``tok_x`` into the index ``[e, C]``
(the experts read the rows where they landed), or, with ``IN_PLACE`` off, copies the row
into ``[e, C, H]`` slabs. Combine reduces the top-k
outputs of a token on the expert's rank (router weights applied there) and sends one row
per (token, rank) back; the source adds the W partial sums in float32.

Synchronisation: one flag per token and direction, set after a system-scope fence over
the stores it covers (one fence for all of a token's flags, or for a batch of tokens) and
polled with acquire loads, so no two programs fight over one address; every wait is
bounded by ``timeout_ns`` of the GPU's global timer and writes an error code to host
memory instead of hanging. A dispatch announces its token count (``expect``) first (in
``symm_ll``'s fused dispatch from a program of its own, so that its fence delays no
token), so receivers of tokens that do not come leave early; a receiver polls its token's
flag and the count in one loop. A flag is reset by the program that consumed it, after
it is done with the token, ``expect`` by the combine of the same call, ``started`` by the
next dispatch on the same parity; the receive counters are zeroed by the combine (the experts
have read them) for the parity's next dispatch. The "started" flag each rank raises at the
start of its combine (after that reset) is what every source waits for before its next
dispatch can run: no peer writes a parity's buffers before their last reader is done.

``symm_ht``'s counted mode (``COUNTED``, ``tokens_per_flag=0``) has no row flags: each send
program fences once, after all its rows, and adds its number of tokens to ``done[src]``
at every rank (every rank gets every token's routing, so the adds sum to exactly
``T_src``), and each combine send program adds the number of tokens it went through, sent
back or not, to ``cdone[me]`` at their source (they sum to its T); a receiver waits once
for its count to reach the total. ``done[s]`` is cleared with ``expect[s]`` by the combine,
``cdone`` with ``started`` by the next dispatch's announcement, each before the release
that lets a peer count again. Its streamed combine (``STREAM``) sums while the rows
travel: the senders count per chunk of the source's tokens (``ccount``, cleared by the
announcement too), and reducer programs of the same launch sum each chunk once every
peer's count of it is complete (the send being bound by the link, the sum is then hidden
but for the last chunk's).

``symm_ll``'s programs handle one token (one row) each, whole-row steps of ``BLOCK_H``
columns, so that a decode-sized call is a single wave of short programs with no serial
latency chain. ``symm_ht``'s programs, capped by its SM budget, loop over tokens and take
several at a time (``ROWS``: their loads in flight together).

Each phase has its two halves as separate kernels (split phase: other work runs between
send and receive) and fused into one launch (``ll_dispatch_kernel``, ``ll_combine_kernel``:
the blocking calls, one launch less on the host and no gap between the halves on the GPU).
The bodies are shared ``@triton.jit`` functions, so both paths run the same code.
"""

import os

import triton
import triton.language as tl

# Under the Triton interpreter (CPU tests) there is no PTX: polls use atomics and the
# timer reads 0 (waits are then unbounded, which a single process never needs).
_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

POLL_PAUSE_NS = int(os.environ.get("EPMOE_POLL_PAUSE_NS", "100"))  # see _pause
_PAUSE_ASM = tl.constexpr(f"nanosleep.u32 {POLL_PAUSE_NS}; mov.u32 $0, 0;")

# error codes written to the host word: (kind << 24) | (op << 16) | peer
GIVE_UP_AFTER_NS = tl.constexpr(1_000_000)  # see _give_up
ERR_TIMEOUT = tl.constexpr(1)
ERR_CAPACITY = tl.constexpr(2)
ERR_EXPERT_ID = tl.constexpr(3)
ERR_LAYER = tl.constexpr(4)
OP_DISPATCH = tl.constexpr(1)
OP_COMBINE = tl.constexpr(2)


@triton.jit
def _after_prior(PDL: tl.constexpr):
    """With programmatic dependent launch (``PDL``, sm_90+) a kernel may start while the
    one before it on the stream is still finishing: every program waits here, before it
    touches memory, until that kernel's writes are visible. What it saves is the launch
    gap between the two kernels. Without ``PDL`` nothing is emitted."""
    if PDL:
        tl.inline_asm_elementwise(
            "griddepcontrol.wait; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
            pack=1,
        )  # fmt: skip


@triton.jit
def _now_ns():
    if _INTERPRET:
        return tl.full((), 0, tl.int64)
    else:
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )


@triton.jit
def _stamp(stamps_ptr, pid, i: tl.constexpr, STAMPS: tl.constexpr):
    """With ``STAMPS`` (``epmoe.bench.timeline``): the global timer into slot ``i`` of
    program ``pid``'s row of ``stamps_ptr [programs, 8]`` int64; nothing otherwise."""
    if STAMPS:
        tl.store(stamps_ptr + pid * 8 + i, _now_ns())


@triton.jit
def _pause():
    """Back off ``POLL_PAUSE_NS`` between polls: every thread of hundreds of waiting
    programs polls, and without a pause their loads crowd the L2 that the peers' stores
    and this GPU's own senders need."""
    if not _INTERPRET:
        tl.inline_asm_elementwise(
            _PAUSE_ASM,
            "=r",
            [],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def _prefetch_l2(ptrs, mask):
    """Ask the L2 for the 128-byte lines at ``ptrs`` (where ``mask``), without waiting
    and without registers to hold them: a later load of them waits on the L2, not on
    HBM."""
    if not _INTERPRET:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l,r",
            [ptrs, mask.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def _prefetch_rows(comb_y, tR, T, W, M, H, out_ptr, ROW_BYTES: tl.constexpr):
    """``_prefetch_l2`` of every rank's partial rows (in ``comb_y``, a byte pointer) of the
    tokens ``tR`` below ``T``: their 128-byte lines, ``ROW_BYTES`` of a row at a time."""
    esize: tl.constexpr = out_ptr.dtype.element_ty.primitive_bitwidth // 8
    lines = tl.arange(0, ROW_BYTES // 128) * 128
    for r in range(W):
        row = (r * M + tR).to(tl.int64) * H * esize
        for l0 in range(0, H * esize, ROW_BYTES):
            ok = (tR < T)[:, None] & (l0 + lines < H * esize)[None, :]
            _prefetch_l2(comb_y + row[:, None] + l0 + lines[None, :], ok)


def batch_fence(batch: int) -> bool:
    """Whether a kernel storing ``batch`` rows per barrier fences once for them and writes
    their flags relaxed (``FENCE``): for batches of more than one row on a GPU; one row
    per flag, and the interpreter, keep a release per flag."""
    return batch > 1 and os.environ.get("TRITON_INTERPRET", "0") != "1"


@triton.jit
def _fence_sys():
    """``fence.acq_rel.sys``: every store this thread made before it (and, after a CTA
    barrier, every store of the program) is ordered before every store after it, so the
    relaxed flag writes that follow form release patterns. One fence for a batch of rows'
    flags, where a release per flag fences once per row."""
    if not _INTERPRET:
        tl.inline_asm_elementwise(
            "fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def _load_sys(ptr, SEM: tl.constexpr):
    """``*ptr`` (int32) at system scope with ``SEM`` ("acquire" or "relaxed"): a plain
    load, so that many programs polling one flag do not serialise the peers' atomics on
    it. A relaxed load orders nothing after it, so no L1 invalidation waits for it (an
    acquire's does: one round trip each)."""
    tl.static_assert((SEM == "acquire") or (SEM == "relaxed"), "SEM: acquire or relaxed")
    if _INTERPRET:
        return tl.atomic_add(ptr, 0, sem=SEM, scope="sys")
    elif SEM == "acquire":
        return tl.inline_asm_elementwise(
            "ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
            is_pure=False, pack=1,
        )  # fmt: skip
    else:
        return tl.inline_asm_elementwise(
            "ld.relaxed.sys.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
            is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def _load_acquire(ptr):
    return _load_sys(ptr, "acquire")


@triton.jit
def _load_relaxed(ptr):
    return _load_sys(ptr, "relaxed")


@triton.jit
def _status(err_addr):
    """``err_addr`` is the device address of the transport's status block, int64 [2]
    (``common.status_block``): word 0 holds the address of the host-mapped error word
    (what the host reads, without a synchronisation), bytes 8-11 the rank's "a wait timed
    out" flag, in device memory (what the other waits poll: see ``_give_up``). Returns
    (error word, stop flag) pointers."""
    block = tl.cast(err_addr, tl.int64).to(tl.pointer_type(tl.int64))
    word = tl.load(block).to(tl.pointer_type(tl.int32))
    return word, _stop_flag(err_addr)


@triton.jit
def _stop_flag(err_addr):
    """The status block's stop flag alone (see ``_status``): what a long wait polls, with
    no load of the host word's address on the way."""
    block = tl.cast(err_addr, tl.int64).to(tl.pointer_type(tl.int64))
    return (block + 1).to(tl.pointer_type(tl.int32))


@triton.jit
def _report(err_addr, kind, op, peer):
    """Write an error code to the host-mapped error word unless one is there already, or
    a timeout over a report that the host lets the transport go on after (bad ids, an
    overflow, another layer's call): a timeout is what stops the call's other waits early
    (``_give_up``, through the status block's stop flag) and what the host must not
    clear."""
    err_ptr, stop_ptr = _status(err_addr)
    current = tl.load(err_ptr, volatile=True)
    # keep the first error (a race only between errors), but let a timeout through
    kind_ = tl.full((), kind, tl.int32)
    if (current == 0) | ((kind_ == ERR_TIMEOUT) & ((current >> 24) != ERR_TIMEOUT)):
        code = (kind_ << 24) | (tl.full((), op, tl.int32) << 16) | peer
        tl.store(err_ptr, code)
    if kind_ == ERR_TIMEOUT:
        tl.store(stop_ptr, 1)  # (never cleared: a timed-out transport stays broken)


@triton.jit
def _give_up(start, timeout_ns, err_addr, op, peer):
    """1 if a wait begun at ``start`` stops now: past ``timeout_ns`` (it reports
    ``ERR_TIMEOUT`` naming ``peer``), or past ``GIVE_UP_AFTER_NS`` once any wait of this
    rank has timed out; else 0 after a pause before the next poll.

    The second test reads the status block's stop flag, in device memory: the waits of
    a late peer are normal and long, and every waiting warp reading host memory instead
    (as this did until 2026-12-03) took the host link's reads: H2D copies fell from 55 to
    0.44 GB/s while 132 programs waited (``launch/host_poll.py``, one H200)."""
    waited = _now_ns() - start
    stop = tl.full((), 0, tl.int32)
    if waited > timeout_ns:
        stop = tl.full((), 1, tl.int32)
        _report(err_addr, ERR_TIMEOUT, op, peer)
    else:
        # another wait of this rank has timed out already: the call is lost, and a program
        # that waits for many flags must not pay the timeout for each
        if waited > GIVE_UP_AFTER_NS:
            stop = tl.load(_stop_flag(err_addr), volatile=True)
            if stop != 0:
                # and says so again: the host word may have lost the first timeout (to a
                # report that raced it, or to the host clearing a report it had read)
                _report(err_addr, ERR_TIMEOUT, op, peer)
        _pause()
    return stop


@triton.jit
def _wait_at_least(flag_ptr, target, timeout_ns, err_addr, op, peer):
    """Spin until ``*flag_ptr >= target`` (acquire, system scope); returns the value seen
    (bounded: see ``_give_up``)."""
    value = _load_acquire(flag_ptr)
    start = _now_ns()
    timed_out = tl.full((), 0, tl.int32)
    while (value < target) & (timed_out == 0):
        timed_out = _give_up(start, timeout_ns, err_addr, op, peer)
        value = _load_acquire(flag_ptr)
    # Every thread polls on its own and may leave the loop at another moment: none goes on
    # (e.g. to reset the flag it waited for) until all have left, and the value returned
    # is one read that the whole program shares (an atomic reads once and broadcasts).
    tl.debug_barrier()
    return tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")


@triton.jit
def _wait_token(flag_ptr, expect_ptr, t, timeout_ns, err_addr, peer):
    """Whether token ``t`` of a source came: spin until its flag (``flag_ptr``) is raised
    or the source's ``expect`` (``T_s + 1``) says it sent no token ``t``, polling both at
    once (one wait, not ``expect``'s and then the flag's). Bounded as ``_wait_at_least``;
    a timeout reads as "did not come".

    The flag is read with acquire (the token's rows are read after it), the count
    relaxed: it only ever says that a token does not come, after which nothing it
    covers is read; the two loads of a poll are then in flight together.

    Each thread answers from its own last poll: a token is either sent (every thread
    leaves on its flag) or not (every thread leaves on the count), so the answers agree,
    except after a timeout, where a thread that gave up may miss a flag another saw.
    Callers therefore mask by the answer and never branch around a barrier on it, and
    whatever decides where data goes is decided once and shared through memory (see
    ``_dispatch_recv``'s positions); a shared re-read of the flag would agree always, at
    the price of an atomic round trip, 0.7 µs on every token's path."""
    expect = _load_relaxed(expect_ptr)
    flag = _load_acquire(flag_ptr)
    start = _now_ns()
    timed_out = tl.full((), 0, tl.int32)
    while (flag < 1) & ((expect < 1) | (t < _count_of(expect) - 1)) & (timed_out == 0):
        timed_out = _give_up(start, timeout_ns, err_addr, OP_DISPATCH, peer)
        expect = _load_relaxed(expect_ptr)
        flag = _load_acquire(flag_ptr)
    tl.debug_barrier()  # (threads leave the loop at their own moments)
    return flag >= 1


@triton.jit
def _wait_all(ptrs, need, lanes, timeout_ns, err_addr, op, target=1):
    """Spin until ``*ptrs >= target`` in every lane where ``need`` (acquire, system scope;
    ``ptrs`` valid in every lane), one poll for all of them; a timeout names the first
    lane (rank) still missing. The loop's test is a reduction over the program with each
    thread's own timeout folded in, so every thread leaves it together (also on a
    timeout: a thread that gave up waits for the others to give up too)."""
    missing = need & (_load_acquire(ptrs) < target)
    start = _now_ns()
    timed_out = tl.full((), 0, tl.int32)
    while tl.max((missing & (timed_out == 0)).to(tl.int32)) > 0:
        peer = tl.min(tl.where(missing, lanes, 1 << 16))
        timed_out = _give_up(start, timeout_ns, err_addr, op, peer)
        missing = need & (_load_acquire(ptrs) < target)
    tl.debug_barrier()


@triton.jit
def _at(base, byte_offset, dtype: tl.constexpr):
    """Pointer to ``dtype`` elements at ``byte_offset`` of the symmetric buffer at ``base``.

    Buffers and region offsets are 16-byte aligned (checked on the host). Said here, it lets
    the compiler move whole rows in 16-byte vectors: an address loaded from memory would
    otherwise allow one element per load or store, which over NVLink is several times
    slower."""
    return tl.multiple_of((base + byte_offset).to(tl.pointer_type(dtype)), 16)


@triton.jit
def _counts(flags, W, M):
    """``done[W]`` in a rank's ``flags`` (``cdone[W]`` follows it): see the module
    docstring."""
    return flags + 2 * W + 2 * W * M


@triton.jit
def _count_of(expect):
    """``T_s + 1`` of an ``expect`` word (0: not written yet)."""
    return expect & 0xFFFF


@triton.jit
def _report_other_call(other, err_addr, s):
    """Report ``ERR_LAYER`` when source ``s`` is in another layer's call (``other``: its
    ``expect`` word was written and ``_other_call``)."""
    if other:
        _report(err_addr, ERR_LAYER, OP_DISPATCH, s)


@triton.jit
def _other_call(expect, tag):
    """Whether the source of a written ``expect`` word is in another layer's call than this
    rank (its call tag differs). Its rows then go through this rank's layer, whose experts
    are not the ones they were sent to: the receive poisons their router weights with NaN,
    so the rows the combine sends back, and every output row they reach, are NaN instead
    of quietly wrong (the host raises ``ERR_LAYER`` at the rank's next call)."""
    return (expect >> 16) != tag


@triton.jit
def _chunk_counts(flags, W, M):
    """``ccount[W, M]`` in a rank's ``flags`` (after ``cdone``): ``ccount[r, c]`` counts
    the tokens of this rank's chunk ``c`` that rank ``r`` went through in a streamed
    combine (see the module docstring)."""
    return flags + 4 * W + 2 * W * M


@triton.jit
def _add_counts(bases, rr, W, M, off_flags, lane, n):
    """Add ``n`` (this program's tokens, its stores fenced by the caller) to count
    ``lane`` of ``done`` at every rank (a lane of ``bases [BLOCK_W]`` per rank)."""
    ptrs = _counts(_at(bases, off_flags, tl.int32), W, M) + lane
    tl.atomic_add(ptrs, tl.full(rr.shape, 0, tl.int32) + n, mask=rr < W, sem="relaxed",
                  scope="sys")  # fmt: skip


@triton.jit
def _strided_count(first, total, stride):
    """How many of ``first, first + stride, ...`` lie below ``total``."""
    return tl.where(first < total, (total - 1 - first) // stride + 1, 0)


@triton.jit
def _pick(values, lanes, i):
    """``values[i]`` of a small vector indexed by ``lanes`` (a scalar every thread holds)."""
    return tl.sum(tl.where(lanes == i, values, 0))


@triton.jit
def _route_token(ids_ptr, owner_ptr, t64, P, K: tl.constexpr, kk, k_mask, rr):
    """Token ``t64``'s routing, read the same way by the dispatch (which ranks get it) and
    the combine (which ranks send a row back): ``ids [BLOCK_K]`` int32 (-1 where not
    valid), ``valid`` (an expert in ``[0, P)``), ``bad`` (an id outside ``[-1, P)``, judged
    before any narrowing), ``owner`` (its rank, -1 when not valid) and ``has_W [BLOCK_W]``
    (1 where rank r holds one of the token's experts)."""
    raw = tl.load(ids_ptr + t64 * K + kk, mask=k_mask, other=-1)
    valid = k_mask & (raw >= 0) & (raw < P)
    bad = k_mask & ((raw < -1) | (raw >= P))
    ids = tl.where(valid, raw, -1).to(tl.int32)
    owner = tl.where(valid, tl.load(owner_ptr + tl.where(valid, ids, 0), mask=valid, other=0), -1)
    has_W = tl.max((owner[None, :] == rr[:, None]).to(tl.int32), 1)
    return ids, valid, bad, owner, has_W


@triton.jit
def _route_rows(ids_ptr, owner_ptr, t64, live, P, K: tl.constexpr, kk, rr):
    """``_route_token`` for the tokens ``t64 [R]`` at once (``live [R]``: those that exist;
    the others read as routed nowhere): ``ids``, ``valid``, ``bad``, ``owner`` ``[R,
    BLOCK_K]`` and ``has [R, BLOCK_W]``."""
    km = live[:, None] & (kk < K)[None, :]
    raw = tl.load(ids_ptr + t64[:, None] * K + kk[None, :], mask=km, other=-1)
    valid = km & (raw >= 0) & (raw < P)
    bad = km & ((raw < -1) | (raw >= P))
    ids = tl.where(valid, raw, -1).to(tl.int32)
    owner = tl.where(valid, tl.load(owner_ptr + tl.where(valid, ids, 0), mask=valid, other=0), -1)
    has = tl.max((owner[:, :, None] == rr[None, None, :]).to(tl.int32), 1)
    return ids, valid, bad, owner, has


@triton.jit
def _row_cols(h0, BLOCK_H: tl.constexpr, GROUPED: tl.constexpr):
    """Columns ``[h0, h0 + BLOCK_H)`` of a row: ``[BLOCK_H]``, or with ``GROUPED`` (FP8)
    ``[BLOCK_H // 128, 128]``, a scale group per tile row, so that the rows are loaded in
    the layout the groups' amax reduces in (a reshape of a loaded row converts its layout
    through shared memory: microseconds on a decode dispatch's path)."""
    if GROUPED:
        gg = tl.arange(0, BLOCK_H // 128)
        return h0 + gg[:, None] * 128 + tl.arange(0, 128)[None, :]
    else:
        return h0 + tl.arange(0, BLOCK_H)


@triton.jit
def _quantize_fp8(x, FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr, EPS: tl.constexpr):
    """``x [groups, 128]`` float32 → (e4m3 ``[groups, 128]``, float32 scales ``[groups]``),
    one scale per 128 columns, exactly as ``epmoe.reference.quantize_groups``."""
    scale = tl.maximum(tl.max(tl.abs(x), 1), EPS) * INV_FP8_MAX
    # one correctly rounded reciprocal per group, then products: a division per value
    # costs 2.7 µs of a 128-token dispatch (docs/benchmarks.md, 2026-11-30 timeline)
    q = tl.minimum(tl.maximum(x * tl.div_rn(1.0, scale)[:, None], -FP8_MAX), FP8_MAX)
    return q.to(tl.float8e4nv), scale


# ------------------------------------------------------------------------------ dispatch
@triton.jit
def _send_step(
    x, sv, h0, row, bases, rr, has_W, H, G, W, off_x, off_s,
    BLOCK_H: tl.constexpr, FP8: tl.constexpr, PREQUANT: tl.constexpr, WIRE: tl.constexpr,
    FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr, EPS: tl.constexpr,
):  # fmt: skip
    """Columns ``[h0, h0 + BLOCK_H)`` of one token's row ``x`` (``_row_cols``' shape),
    quantized if FP8 (unless ``PREQUANT``: ``x`` is FP8 already, ``sv`` its scales), stored
    into every rank that holds one of its experts (read once, stored up to W times)."""
    cols = _row_cols(h0, BLOCK_H, FP8)
    c_mask = cols < H
    if PREQUANT:
        q, scale = x, sv
        gg = h0 // 128 + tl.arange(0, BLOCK_H // 128)
    elif FP8:
        q, scale = _quantize_fp8(x.to(tl.float32), FP8_MAX, INV_FP8_MAX, EPS)
        gg = h0 // 128 + tl.arange(0, BLOCK_H // 128)
    else:
        q = x.to(WIRE)
    for r in range(W):
        on = _pick(has_W, rr, r)  # (a scalar mask, broadcast)
        base = _pick(bases, rr, r)
        c_on = c_mask & (tl.broadcast_to(on, cols.shape) > 0)
        tl.store(_at(base, off_x, WIRE) + row * H + cols, q, mask=c_on)
        if FP8:
            g_on = (gg < G) & (tl.broadcast_to(on, gg.shape) > 0)
            tl.store(_at(base, off_s, tl.float32) + row * G + gg, scale, mask=g_on)


@triton.jit
def _announce(bases_ptr, T, W, M, src, tag, off_flags, BLOCK_W: tl.constexpr,
              CHUNK: tl.constexpr = 0):  # fmt: skip
    """Program 0 of a dispatch, first: clear this parity's ``started`` flags, ``cdone``
    counts and (``CHUNK`` > 0: a streamed combine's, see ``ht_combine_send_kernel``) the
    counts of every rank for each chunk of ``CHUNK`` tokens,
    then tell every rank how many tokens come and from which layer's call
    (``expect[src] = tag << 16 | T + 1``; ``tag`` below 2**15, ``T`` below 2**16 - 1: the
    host checks both). Rows may arrive
    before it (each has a flag or a count of its own): the count only has to reach the
    receivers of tokens that do not come, and the combine's bookkeeping."""
    rr = tl.arange(0, BLOCK_W)
    base = tl.load(bases_ptr + src)
    bases = tl.load(bases_ptr + rr, mask=rr < W, other=0)
    own = _at(base, off_flags, tl.int32)
    zeros = tl.zeros((BLOCK_W,), tl.int32)
    tl.atomic_xchg(own + W + rr, zeros, mask=rr < W, sem="relaxed", scope="sys")
    tl.atomic_xchg(_counts(own, W, M) + W + rr, zeros, mask=rr < W, sem="relaxed", scope="sys")
    if CHUNK > 0:  # (own memory; ordered before `expect` by the fence below)
        n = tl.cdiv(M, CHUNK)
        for r in range(W):
            for c0 in range(0, n, 128):
                cc = c0 + tl.arange(0, 128)
                tl.store(_chunk_counts(own, W, M) + r * M + cc, tl.zeros((128,), tl.int32),
                         mask=cc < n)  # fmt: skip
    # the clears before any rank sees `expect` (a peer that sees it may raise `started`
    # and count what it sends back), one fence for the writes
    tl.debug_barrier()
    _fence_sys()
    expect = _at(bases, off_flags, tl.int32) + src  # expect[src] at every rank, at once
    word = (tl.cast(tag, tl.int32) << 16) | (T + 1)
    tl.atomic_xchg(expect, zeros + word, mask=rr < W, sem="relaxed", scope="sys")


@triton.jit
def _send_token(
    t, x_ptr, xs_ptr, ids_ptr, w_ptr, owner_ptr, local_ptr, bases, err_addr,
    T, H, P, M, W, G, src, off_x, off_s, off_ids, off_w,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_H: tl.constexpr,
    FP8: tl.constexpr, PREQUANT: tl.constexpr, WIRE: tl.constexpr, FP8_MAX: tl.constexpr,
    INV_FP8_MAX: tl.constexpr, EPS: tl.constexpr, routes_ptr, ROUTES: tl.constexpr,
):  # fmt: skip
    """Token ``t``'s row to every rank holding one of its experts and its routing to every
    rank (stores only: its flag follows a barrier, see ``_flag_token``); ``bases
    [BLOCK_W]``: each rank's buffer address, loaded once by the caller. ``ROUTES``: the
    ranks it went to, a bit each, into ``routes_ptr[t]`` (``symm_ht``'s combine receive
    reads them).

    Latency is the cost at decode sizes, so every load that does not depend on another is
    issued up front: the token's ids and weights and the first columns of its row; only
    the expert → (rank, local slot) lookups wait for the ids."""
    if t < T:
        kk = tl.arange(0, BLOCK_K)
        k_mask = kk < K
        rr = tl.arange(0, BLOCK_W)
        t64 = tl.cast(t, tl.int64)
        # masked lanes read 0: a partial last FP8 group takes its amax over real columns
        first = _row_cols(0, BLOCK_H, FP8)
        x_first = tl.load(x_ptr + t64 * H + first, mask=first < H, other=0.0)
        wts = tl.load(w_ptr + t64 * K + kk, mask=k_mask, other=0.0)
        ids, valid, bad, owner, has_W = _route_token(ids_ptr, owner_ptr, t64, P, K, kk, k_mask, rr)
        local = tl.load(local_ptr + tl.where(valid, ids, 0), mask=valid, other=-1)
        if tl.max(bad.to(tl.int32)) > 0:
            _report(err_addr, ERR_EXPERT_ID, OP_DISPATCH, src)
        if ROUTES:
            tl.store(routes_ptr + t64, tl.sum(has_W << rr))
        row = tl.cast(src, tl.int64) * M + t64  # this token's row in every receiver's tok_*
        # the row, then its routing metadata to every rank (-1 where it holds none of them)
        _send_step(
            x_first, _load_scales(xs_ptr, t64, 0, G, BLOCK_H, PREQUANT), 0, row, bases, rr,
            has_W, H, G, W, off_x, off_s,
            BLOCK_H, FP8, PREQUANT, WIRE, FP8_MAX, INV_FP8_MAX, EPS,
        )  # fmt: skip
        for h0 in range(BLOCK_H, H, BLOCK_H):  # (rows wider than one step)
            x = tl.load(x_ptr + t64 * H + h0 + first, mask=h0 + first < H, other=0.0)
            _send_step(
                x, _load_scales(xs_ptr, t64, h0, G, BLOCK_H, PREQUANT), h0, row, bases, rr,
                has_W, H, G, W, off_x, off_s,
                BLOCK_H, FP8, PREQUANT, WIRE, FP8_MAX, INV_FP8_MAX, EPS,
            )  # fmt: skip
        for r in range(W):
            base = _pick(bases, rr, r)
            tl.store(
                _at(base, off_ids, tl.int32) + row * K + kk,
                tl.where(owner == r, local, -1),
                mask=k_mask,
            )
            tl.store(_at(base, off_w, tl.float32) + row * K + kk, wts, mask=k_mask)


@triton.jit
def _send_rows(
    tR, x_ptr, xs_ptr, ids_ptr, w_ptr, owner_ptr, local_ptr, bases, err_addr,
    T, H, P, M, W, G, src, off_x, off_s, off_ids, off_w,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_H: tl.constexpr,
    FP8: tl.constexpr, PREQUANT: tl.constexpr, WIRE: tl.constexpr, FP8_MAX: tl.constexpr,
    INV_FP8_MAX: tl.constexpr, EPS: tl.constexpr, ROWS: tl.constexpr, routes_ptr,
    ROUTES: tl.constexpr,
):  # fmt: skip
    """``_send_token`` for the tokens ``tR [ROWS]`` (those below ``T``) at once: their
    routing, rows and stores issued together, so that a program keeps ROWS tokens in flight
    instead of waiting on one token's load latencies after another (``symm_ht``'s counted
    send on few SMs). FP8 rows are quantized here (``[ROWS, BLOCK_H // 128, 128]``, a
    scale group per tile row), or beforehand with ``PREQUANT`` (``xs_ptr``: their scales)."""
    kk = tl.arange(0, BLOCK_K)
    rr = tl.arange(0, BLOCK_W)
    live = tR < T
    t64 = tl.where(live, tR, 0).to(tl.int64)  # (tokens that exist)
    km = live[:, None] & (kk < K)[None, :]
    wts = tl.load(w_ptr + t64[:, None] * K + kk[None, :], mask=km, other=0.0)
    ids, valid, bad, owner, has = _route_rows(ids_ptr, owner_ptr, t64, live, P, K, kk, rr)
    local = tl.load(local_ptr + tl.where(valid, ids, 0), mask=valid, other=-1)
    if tl.max(tl.max(bad.to(tl.int32), 1), 0) > 0:
        _report(err_addr, ERR_EXPERT_ID, OP_DISPATCH, src)
    if ROUTES:
        tl.store(routes_ptr + t64, tl.sum(has << rr[None, :], 1), mask=live)
    row = tl.cast(src, tl.int64) * M + t64  # their rows in every receiver's tok_*
    for h0 in range(0, H, BLOCK_H):
        if FP8:
            gg = h0 // 128 + tl.arange(0, BLOCK_H // 128)
            cols = (gg[:, None] * 128 + tl.arange(0, 128)[None, :])[None, :, :]
            at = t64[:, None, None] * H + cols
            c_ok = cols < H
            x = tl.load(x_ptr + at, mask=live[:, None, None] & c_ok, other=0.0)
            g_ok = (gg < G)[None, :]
            if PREQUANT:
                q = x
                sv = tl.load(xs_ptr + t64[:, None] * G + gg[None, :], mask=live[:, None] & g_ok)
            else:  # masked columns read 0: a partial last group's amax is over real ones
                xf = x.to(tl.float32)
                sv = tl.maximum(tl.max(tl.abs(xf), 2), EPS) * INV_FP8_MAX
                q = xf * tl.div_rn(1.0, sv)[:, :, None]
                q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX).to(tl.float8e4nv)
            dst = row[:, None, None] * H + cols
        else:
            cols = (h0 + tl.arange(0, BLOCK_H))[None, :]
            c_ok = cols < H
            q = tl.load(x_ptr + t64[:, None] * H + cols, mask=live[:, None] & c_ok, other=0.0)
            dst = row[:, None] * H + cols
        for r in range(W):
            on = tl.sum(tl.where(rr[None, :] == r, has, 0), 1) > 0
            base = _pick(bases, rr, r)
            if FP8:
                tl.store(_at(base, off_x, WIRE) + dst, q.to(WIRE), mask=on[:, None, None] & c_ok)
                tl.store(_at(base, off_s, tl.float32) + row[:, None] * G + gg[None, :], sv,
                         mask=on[:, None] & g_ok)  # fmt: skip
            else:
                tl.store(_at(base, off_x, WIRE) + dst, q.to(WIRE), mask=on[:, None] & c_ok)
    for r in range(W):
        base = _pick(bases, rr, r)
        at = row[:, None] * K + kk[None, :]
        tl.store(_at(base, off_ids, tl.int32) + at, tl.where(owner == r, local, -1), mask=km)
        tl.store(_at(base, off_w, tl.float32) + at, wts, mask=km)


@triton.jit
def _flag_token(t, bases, rr, T, M, W, src, off_flags, FENCED: tl.constexpr):
    """Token ``t``'s flag at every rank, all at once (a lane of ``bases [BLOCK_W]`` per rank;
    the caller loaded them before its stores, so nothing but the writes follows its fence):
    release, after its stores, which a barrier in the caller has ordered before it;
    ``FENCED``: the caller has fenced them, a relaxed write."""
    if t < T:
        row = tl.cast(src, tl.int64) * M + t
        flags = _at(bases, off_flags, tl.int32) + 2 * W + row
        ones = tl.full(rr.shape, 1, tl.int32)
        if FENCED:
            tl.atomic_xchg(flags, ones, mask=rr < W, sem="relaxed", scope="sys")
        else:
            tl.atomic_xchg(flags, ones, mask=rr < W, sem="release", scope="sys")


@triton.jit
def _dispatch_send(
    t, x_ptr, ids_ptr, w_ptr, owner_ptr, local_ptr, bases_ptr, err_addr,
    T, H, P, M, W, G, src, off_flags, off_x, off_s, off_ids, off_w,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_H: tl.constexpr,
    FP8: tl.constexpr, WIRE: tl.constexpr, FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr,
    EPS: tl.constexpr, stamps_ptr, pid, STAMPS: tl.constexpr, routes_ptr,
):  # fmt: skip
    """Program ``t`` of a one-token-per-program send half (``symm_ll``'s fused dispatch):
    each sends its token (its ranks into ``routes_ptr[t]``) and raises its flag."""
    _stamp(stamps_ptr, pid, 0, STAMPS)
    rr = tl.arange(0, BLOCK_W)
    bases = tl.load(bases_ptr + rr, mask=rr < W, other=0)
    _send_token(
        t, x_ptr, x_ptr, ids_ptr, w_ptr, owner_ptr, local_ptr, bases, err_addr,
        T, H, P, M, W, G, src, off_x, off_s, off_ids, off_w,
        K, BLOCK_K, BLOCK_W, BLOCK_H, FP8, False, WIRE, FP8_MAX, INV_FP8_MAX, EPS,
        routes_ptr, True,
    )  # fmt: skip
    _stamp(stamps_ptr, pid, 1, STAMPS)
    tl.debug_barrier()  # every store of this program is issued before the fence
    _fence_sys()  # one fence for the token's flags at every rank (not a release per rank)
    _stamp(stamps_ptr, pid, 2, STAMPS)
    _flag_token(t, bases, rr, T, M, W, src, off_flags, True)
    _stamp(stamps_ptr, pid, 3, STAMPS)


@triton.jit
def _recv_step(
    v, sv, h0, dst, kk, xo_ptr, so_ptr, H, G,
    BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """Columns ``[h0, h0 + BLOCK_H)`` of one received row (and its scales) copied into each
    of its local expert rows ``dst`` (-1: not here)."""
    cols = h0 + tl.arange(0, BLOCK_H)
    c_mask = cols < H
    gg = h0 // 128 + tl.arange(0, BLOCK_H // 128)
    for k in tl.static_range(BLOCK_K):
        d = _pick(dst, kk, k)  # this k's row, -1: elsewhere
        tl.store(xo_ptr + d * H + cols, v, mask=c_mask & (tl.broadcast_to(d, cols.shape) >= 0))
        if FP8:
            tl.store(so_ptr + d * G + gg, sv, mask=(gg < G) & (tl.broadcast_to(d, gg.shape) >= 0))


@triton.jit
def _load_scales(tok_s, row, h0, G, BLOCK_H: tl.constexpr, FP8: tl.constexpr):
    """The FP8 scales of columns ``[h0, h0 + BLOCK_H)`` of row ``row`` of ``tok_s [rows, G]``
    (a received row, or a pre-quantized one being sent; zeros, unused, without FP8)."""
    gg = h0 // 128 + tl.arange(0, BLOCK_H // 128)
    if FP8:
        sv = tl.load(tok_s + row * G + gg, mask=gg < G)
    else:
        sv = tl.zeros((BLOCK_H // 128,), tl.float32)
    return sv


@triton.jit
def _dispatch_recv(
    s, t, bases_ptr, xo_ptr, so_ptr, cnt_ptr, pos_ptr, recv_t_ptr, err_addr,
    H, M, W, G, C, me, timeout_ns, tag, off_flags, off_x, off_s, off_ids,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, FP8: tl.constexpr,
    WIRE: tl.constexpr, IN_PLACE: tl.constexpr, stamps_ptr, pid, STAMPS: tl.constexpr,
):  # fmt: skip
    """Program (source ``s``, token ``t``) of the dispatch's receive half: waits for the
    token and takes a row of each of its local experts. ``IN_PLACE``: that row's entry of
    the index ``xo_ptr [e_max, C]`` int32 gets the token's row in ``tok_x`` (the experts
    read it there); else the row is copied into ``xo_ptr [e_max, C, H]`` (its first
    columns read while the expert rows are being taken)."""
    _stamp(stamps_ptr, pid, 0, STAMPS)
    kk = tl.arange(0, BLOCK_K)
    k_mask = kk < K
    base = tl.load(bases_ptr + me)
    flags = _at(base, off_flags, tl.int32)
    if t == 0:  # the count, for the combine, and the source's call tag against this one's
        expect = _wait_at_least(flags + s, 1, timeout_ns, err_addr, OP_DISPATCH, s)
        T_s = tl.maximum(_count_of(expect) - 1, 0)
        # a source in another layer's call is marked (-1 - T_s): its rows combine as NaN
        other = (expect >= 1) & _other_call(expect, tag)
        tl.store(recv_t_ptr + s, tl.where(other, -1 - T_s, T_s))
        _report_other_call(other, err_addr, s)
    row = tl.cast(s, tl.int64) * M + t
    # masked by whether the token came, not branched on it (see _wait_token): a program
    # whose token does not come does the same steps with nothing to write
    came = _wait_token(flags + 2 * W + row, flags + s, t, timeout_ns, err_addr, s)
    _stamp(stamps_ptr, pid, 1, STAMPS)
    k_came = k_mask & (tl.broadcast_to(came.to(tl.int32), kk.shape) > 0)
    slot_ids = tl.load(_at(base, off_ids, tl.int32) + row * K + kk, mask=k_came, other=-1)
    tok_x = _at(base, off_x, WIRE)
    tok_s = _at(base, off_s, tl.float32)
    if not IN_PLACE:
        h_first = tl.arange(0, BLOCK_H)
        v_first = tl.load(tok_x + row * H + h_first, mask=h_first < H)
        s_first = _load_scales(tok_s, row, 0, G, BLOCK_H, FP8)
    valid = k_came & (slot_ids >= 0)
    slot = tl.atomic_add(
        cnt_ptr + tl.maximum(slot_ids, 0), 1, mask=valid, sem="relaxed", scope="gpu"
    )
    # The K lanes' slots are taken, and their positions stored, by the threads that own
    # the lanes (in one warp); every thread then reads the positions back and follows
    # them, so that the program agrees on where the rows go even where its threads'
    # `came` differ (after a timeout). Every lane is written: -1 where the token did not
    # come or has no expert here, -2 where it was dropped (capacity: the combine still
    # sends the token a row), and the combine never reads another call's positions.
    ok = valid & (slot < C)
    pos = tl.where(ok, slot_ids * C + slot, tl.where(valid, -2, -1))
    tl.store(pos_ptr + row * K + kk, pos, mask=k_mask)
    tl.debug_barrier()
    dst = tl.load(pos_ptr + row * K + kk, mask=k_mask, other=-1).to(tl.int64)
    if tl.max((dst == -2).to(tl.int32)) > 0:
        _report(err_addr, ERR_CAPACITY, OP_DISPATCH, s)
    _stamp(stamps_ptr, pid, 2, STAMPS)
    if IN_PLACE:
        here = tl.zeros((BLOCK_K,), tl.int32) + row.to(tl.int32)
        tl.store(xo_ptr + tl.maximum(dst, 0), here, mask=k_mask & (dst >= 0))
    else:
        _recv_step(v_first, s_first, 0, dst, kk, xo_ptr, so_ptr, H, G, BLOCK_K, BLOCK_H, FP8)
        for h0 in range(BLOCK_H, H, BLOCK_H):  # (rows wider than one step)
            cols = h0 + tl.arange(0, BLOCK_H)
            v = tl.load(tok_x + row * H + cols, mask=cols < H)
            sv = _load_scales(tok_s, row, h0, G, BLOCK_H, FP8)
            _recv_step(v, sv, h0, dst, kk, xo_ptr, so_ptr, H, G, BLOCK_K, BLOCK_H, FP8)
    # consumed: reset last, off the path to the index, whether or not the token came
    # (one thread writes it, whose `came` may differ from the others' after a timeout;
    # nothing raises the flag again before this call's combine: see the module docstring)
    tl.atomic_xchg(flags + 2 * W + row, 0, sem="relaxed", scope="sys")
    _stamp(stamps_ptr, pid, 3, STAMPS)


@triton.jit(
    do_not_specialize=["T", "src", "tag", "off_flags", "off_x", "off_s", "off_ids", "off_w"]
)
def dispatch_send_kernel(
    # pointers
    x_ptr,  # [T, H] hidden states (bf16/fp16/fp32; FP8 with PREQUANT)
    xs_ptr,  # PREQUANT: [T, G] float32 scales of x (else unused)
    ids_ptr,  # [T, K] int32/int64 physical expert ids, -1: none
    w_ptr,  # [T, K] float32 router weights
    owner_ptr,  # [P] int32 rank holding each physical expert
    local_ptr,  # [P] int32 each physical expert's slot on its rank
    bases_ptr,  # [W] int64 address of each rank's symmetric buffer
    err_addr,  # int64 device address of the status block (see _status)
    routes_ptr,  # ROUTES: [T] int32 the ranks each token went to, a bit each (out)
    # sizes
    T,
    H,
    P,
    M,
    W,
    G,
    src,  # this rank
    tag,  # this call's tag (the caller's layer, below 2**15), sent with the count
    # byte offsets of this parity's regions in every rank's symmetric buffer
    off_flags,
    off_x,
    off_s,
    off_ids,
    off_w,
    # meta-parameters
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FP8: tl.constexpr,
    WIRE: tl.constexpr,  # tl dtype of rows on the wire
    FP8_MAX: tl.constexpr,
    INV_FP8_MAX: tl.constexpr,
    EPS: tl.constexpr,
    BATCH: tl.constexpr,  # tokens a program stores before it raises their flags
    FENCE: tl.constexpr,  # one system fence per batch, relaxed flags (batch_fence(BATCH))
    PREQUANT: tl.constexpr,  # x is FP8 already (quantized by a kernel of its own)
    COUNTED: tl.constexpr,  # no flags: one fence and one count per program, at its end
    ROWS: tl.constexpr = 1,  # COUNTED: tokens a program sends at once
    ROUTES: tl.constexpr = False,  # write routes_ptr (symm_ht's combine reads it)
    CHUNK: tl.constexpr = 0,  # > 0: the combine streams (chunk counts to clear, _announce)
    PDL: tl.constexpr = False,
):
    """The send half alone (split phase; ``symm_ht``'s dispatch). Program p sends tokens
    p, p + N, ... of T (N programs: one per token for ``symm_ll``, the SM budget for
    ``symm_ht``), ``BATCH`` tokens per step: their stores all in flight, then one barrier,
    then their flags (a release waits for the stores before it: one wait per step, not
    per token). ``COUNTED``: the stores of all its tokens stream with no wait between
    them, then one fence and the program's token count added to ``done[src]`` at every
    rank (the receivers wait for the sum to reach T)."""
    _after_prior(PDL)
    pid = tl.program_id(0)
    N = tl.num_programs(0)
    if pid == 0:
        _announce(bases_ptr, T, W, M, src, tag, off_flags, BLOCK_W, CHUNK)
    rr = tl.arange(0, BLOCK_W)
    bases = tl.load(bases_ptr + rr, mask=rr < W, other=0)
    if COUNTED:
        if ROWS == 1:
            for t in range(pid, T, N):
                _send_token(
                    t, x_ptr, xs_ptr, ids_ptr, w_ptr, owner_ptr, local_ptr, bases,
                    err_addr, T, H, P, M, W, G, src, off_x, off_s, off_ids, off_w,
                    K, BLOCK_K, BLOCK_W, BLOCK_H, FP8, PREQUANT, WIRE, FP8_MAX, INV_FP8_MAX,
                    EPS, routes_ptr, ROUTES,
                )  # fmt: skip
        else:
            for t0 in range(pid, T, N * ROWS):
                _send_rows(
                    t0 + N * tl.arange(0, ROWS), x_ptr, xs_ptr, ids_ptr, w_ptr, owner_ptr,
                    local_ptr, bases, err_addr, T, H, P, M, W, G, src, off_x, off_s, off_ids,
                    off_w, K, BLOCK_K, BLOCK_W, BLOCK_H, FP8, PREQUANT, WIRE, FP8_MAX,
                    INV_FP8_MAX, EPS, ROWS, routes_ptr, ROUTES,
                )  # fmt: skip
        n = _strided_count(pid, T, N)
        if n > 0:
            tl.debug_barrier()  # every store of the program is issued before the fence
            _fence_sys()
            _add_counts(bases, rr, W, M, off_flags, src, n)
    else:
        for t0 in range(pid, T, N * BATCH):
            for j in tl.static_range(BATCH):
                _send_token(
                    t0 + j * N, x_ptr, xs_ptr, ids_ptr, w_ptr, owner_ptr, local_ptr, bases,
                    err_addr, T, H, P, M, W, G, src, off_x, off_s, off_ids, off_w,
                    K, BLOCK_K, BLOCK_W, BLOCK_H, FP8, PREQUANT, WIRE, FP8_MAX, INV_FP8_MAX, EPS,
                    routes_ptr, ROUTES,
                )  # fmt: skip
            tl.debug_barrier()
            if FENCE:  # a batch: one fence for its rows, then relaxed flags
                _fence_sys()
            for j in tl.static_range(BATCH):
                _flag_token(t0 + j * N, bases, rr, T, M, W, src, off_flags, FENCE)


@triton.jit(do_not_specialize=["me", "tag", "off_flags", "off_x", "off_s", "off_ids"])
def ll_dispatch_recv_kernel(
    # pointers
    bases_ptr,  # [W] int64
    xo_ptr,  # IN_PLACE: [e_max, C] int32 row index (out); else [e_max, C, H] wire rows (out)
    so_ptr,  # FP8 and not IN_PLACE: [e_max, C, G] float32 scales (out)
    cnt_ptr,  # [e_max] int32 rows per local expert (out; zero on entry)
    pos_ptr,  # [W, M, K] int32 row of [e·C] each (source, token, k) went to, -1 (out)
    recv_t_ptr,  # [W] int32 tokens each source dispatched (out; -1 - T_s: in another call)
    err_addr,
    # sizes
    H,
    M,
    W,
    G,
    C,
    me,
    timeout_ns,
    tag,  # this call's tag, against each source's
    # byte offsets of this parity's regions
    off_flags,
    off_x,
    off_s,
    off_ids,
    # meta-parameters
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FP8: tl.constexpr,
    WIRE: tl.constexpr,
    IN_PLACE: tl.constexpr,  # received rows stay in tok_x; xo_ptr is their index
    PDL: tl.constexpr = False,
):
    """The receive half alone (split phase): a program per (source rank, token slot)."""
    _after_prior(PDL)
    _dispatch_recv(
        tl.program_id(0), tl.program_id(1), bases_ptr, xo_ptr, so_ptr, cnt_ptr, pos_ptr,
        recv_t_ptr, err_addr, H, M, W, G, C, me, timeout_ns, tag, off_flags, off_x, off_s,
        off_ids, K, BLOCK_K, BLOCK_H, FP8, WIRE, IN_PLACE, cnt_ptr, 0, False,
    )  # fmt: skip


@triton.jit(
    do_not_specialize=["T", "src", "tag", "off_flags", "off_x", "off_s", "off_ids", "off_w"]
)
def ll_dispatch_kernel(
    x_ptr, ids_ptr, w_ptr, owner_ptr, local_ptr, bases_ptr, err_addr,
    xo_ptr, so_ptr, cnt_ptr, pos_ptr, recv_t_ptr, stamps_ptr,
    T, H, P, M, W, G, C, src, timeout_ns, tag,
    off_flags, off_x, off_s, off_ids, off_w,
    routes_ptr,  # [M] int32 (out): the ranks each token went to, for this call's combine
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_H: tl.constexpr,
    FP8: tl.constexpr, WIRE: tl.constexpr, FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr,
    EPS: tl.constexpr, IN_PLACE: tl.constexpr, STAMPS: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Send and receive in one launch (the blocking dispatch; arguments as in the two
    halves): program 0 announces the count, programs ``[1, 1 + T)`` send a token each,
    the next ``W·M`` receive. The count goes first and on a program of its own (its fence
    delays no token); the senders come before the receivers in launch order, so the
    receivers' spinning never keeps them off the SMs, and rows are expanded as they arrive,
    while this rank's own stores are still in flight. ``stamps_ptr [programs, 8]``: see
    ``_stamp``."""
    _after_prior(PDL)
    pid = tl.program_id(0)
    if pid == 0:
        _stamp(stamps_ptr, pid, 0, STAMPS)
        _announce(bases_ptr, T, W, M, src, tag, off_flags, BLOCK_W)
        _stamp(stamps_ptr, pid, 2, STAMPS)
    elif pid <= T:
        _dispatch_send(
            pid - 1, x_ptr, ids_ptr, w_ptr, owner_ptr, local_ptr, bases_ptr, err_addr,
            T, H, P, M, W, G, src, off_flags, off_x, off_s, off_ids, off_w,
            K, BLOCK_K, BLOCK_W, BLOCK_H, FP8, WIRE, FP8_MAX, INV_FP8_MAX, EPS,
            stamps_ptr, pid, STAMPS, routes_ptr,
        )  # fmt: skip
    else:
        q = pid - 1 - T
        _dispatch_recv(
            q // M, q % M, bases_ptr, xo_ptr, so_ptr, cnt_ptr, pos_ptr, recv_t_ptr, err_addr,
            H, M, W, G, C, src, timeout_ns, tag, off_flags, off_x, off_s, off_ids,
            K, BLOCK_K, BLOCK_H, FP8, WIRE, IN_PLACE, stamps_ptr, pid, STAMPS,
        )  # fmt: skip


# ------------------------------------------------------------------------------ combine
@triton.jit
def _combine_send(
    s, t, y_ptr, bases_ptr, pos_ptr, recv_t_ptr, cnt_ptr, e_max,
    H, M, W, me, off_flags, off_w, off_y,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr,
    stamps_ptr, pid, STAMPS: tl.constexpr,
):  # fmt: skip
    """Program (source ``s``, token ``t``) of the combine's send half: the weighted sum of
    the token's rows on this rank, written into the source's ``comb_y``, then its flag.
    Program (0, 0) also zeroes this parity's expert row counters for its next dispatch
    (the experts have read them: they ran before this combine). The token's positions and
    weights are read before its count is known (they are used only below it)."""
    _stamp(stamps_ptr, pid, 0, STAMPS)
    kk = tl.arange(0, BLOCK_K)
    k_mask = kk < K
    base_s = tl.load(bases_ptr + s)
    base_me = tl.load(bases_ptr + me)
    row = tl.cast(s, tl.int64) * M + t
    pos = tl.load(pos_ptr + row * K + kk, mask=k_mask, other=-1).to(tl.int64)
    w = tl.load(_at(base_me, off_w, tl.float32) + row * K + kk, mask=k_mask, other=0.0)
    T_s = tl.load(recv_t_ptr + s)
    if T_s < 0:  # the source was in another layer's call (_dispatch_recv): NaN rows back
        T_s = -1 - T_s
        w = tl.full((BLOCK_K,), float("nan"), tl.float32)
    src_flags = _at(base_s, off_flags, tl.int32)
    if t == 0:
        if s == 0:
            for e0 in range(0, e_max, BLOCK_E):
                ee = e0 + tl.arange(0, BLOCK_E)
                tl.store(cnt_ptr + ee, tl.zeros((BLOCK_E,), tl.int32), mask=ee < e_max)
        # the dispatch of this call is fully received: clear its `expect`, then tell s
        # that this rank started combining (s's next dispatch on this parity waits for it)
        tl.atomic_xchg(_at(base_me, off_flags, tl.int32) + s, 0, sem="relaxed", scope="sys")
        tl.atomic_xchg(src_flags + W + me, 1, sem="release", scope="sys")  # started[me]
    # one row back for every token the source sent here (its combine waits for it), even
    # if a capacity error dropped all of its rows (pos -2). Decided from this rank's own
    # `pos`, never from the staging metadata: a source that needs no row from here may
    # already be writing its next dispatch into that staging
    if (t < T_s) & (tl.max((pos != -1).to(tl.int32)) > 0):
        out = _at(base_s, off_y, y_ptr.dtype.element_ty)
        src_row = tl.cast(me, tl.int64) * M + t  # slot in s's comb_y [W, M, H]
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            c_mask = cols < H
            acc = tl.zeros((BLOCK_H,), tl.float32)
            for k in tl.static_range(BLOCK_K):  # unrolled: the K row loads overlap
                p = _pick(pos, kk, k)
                on = c_mask & (tl.broadcast_to(p, cols.shape) >= 0)
                y = tl.load(y_ptr + p * H + cols, mask=on, other=0.0)
                acc += y.to(tl.float32) * _pick(w, kk, k)
            tl.store(out + src_row * H + cols, acc.to(y_ptr.dtype.element_ty), mask=c_mask)
        _stamp(stamps_ptr, pid, 1, STAMPS)
        tl.debug_barrier()
        tl.atomic_xchg(src_flags + 2 * W + W * M + src_row, 1, sem="release", scope="sys")
        _stamp(stamps_ptr, pid, 2, STAMPS)


@triton.jit
def _combine_recv(
    t, out_ptr, ids_ptr, owner_ptr, bases_ptr, err_addr,
    T, H, P, W, M, me, timeout_ns, off_flags, off_y,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_H: tl.constexpr,
    stamps_ptr, pid, STAMPS: tl.constexpr, COUNTED: tl.constexpr,
    routes_ptr, ROUTES: tl.constexpr,
):  # fmt: skip
    """Program ``t`` of the combine's receive half: waits for token ``t``'s partial sums
    from the ranks holding its experts and adds them in float32. ``COUNTED``: the caller
    has waited, once for all its tokens (``_combine_waits``). ``ROUTES``: which ranks hold
    them is read from ``routes_ptr[t]`` (the dispatch's own record, a bit per rank), not
    from the caller's ids, which it may have refilled since."""
    _stamp(stamps_ptr, pid, 0, STAMPS)
    kk = tl.arange(0, BLOCK_K)
    k_mask = kk < K
    rr = tl.arange(0, BLOCK_W)
    base = tl.load(bases_ptr + me)
    flags = _at(base, off_flags, tl.int32)
    t64 = tl.cast(t, tl.int64)
    if t < T and ROUTES:  # (its routing does not depend on the waits below)
        has_W = (tl.load(routes_ptr + t64) >> rr) & 1
    elif t < T:
        _, _, _, _, has_W = _route_token(ids_ptr, owner_ptr, t64, P, K, kk, k_mask, rr)
    else:
        has_W = tl.zeros((BLOCK_W,), tl.int32)
    r_ok = rr < W
    r_any = tl.minimum(rr, W - 1)  # (a valid address in every lane)
    if not COUNTED:
        # every rank started its combine, then the partial rows of this token's ranks:
        # one poll loop each over all ranks
        _wait_started(flags, rr, W, timeout_ns, err_addr, rr < W)
    _stamp(stamps_ptr, pid, 1, STAMPS)
    if t < T:
        cflags = flags + 2 * W + W * M
        comb_y = _at(base, off_y, out_ptr.dtype.element_ty)
        mine = r_ok & (has_W > 0)
        if not COUNTED:
            _wait_all(cflags + r_any * M + t, mine, rr, timeout_ns, err_addr, OP_COMBINE)
        _stamp(stamps_ptr, pid, 2, STAMPS)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            c_mask = cols < H
            acc = tl.zeros((BLOCK_H,), tl.float32)
            for r in range(W):
                on = c_mask & (tl.broadcast_to(_pick(has_W, rr, r), cols.shape) > 0)
                part = tl.load(comb_y + (r * M + t64) * H + cols, mask=on, other=0.0)
                acc += part.to(tl.float32)
            tl.store(out_ptr + t64 * H + cols, acc.to(out_ptr.dtype.element_ty), mask=c_mask)
        if not COUNTED:  # consumed (raised again only in this parity's next combine)
            tl.atomic_xchg(cflags + r_any * M + t, tl.zeros((BLOCK_W,), tl.int32), mask=mine,
                           sem="relaxed", scope="sys")  # fmt: skip
    _stamp(stamps_ptr, pid, 3, STAMPS)


@triton.jit
def _combine_recv_rows(
    tR, bits, out_ptr, bases_ptr, err_addr,
    T, H, W, M, me, timeout_ns, off_flags, off_y,
    BLOCK_W: tl.constexpr, BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr, COUNTED: tl.constexpr, RANKS: tl.constexpr,
    y_ptr, OWN_Y: tl.constexpr,
):  # fmt: skip
    """``_combine_recv`` for the tokens ``tR [ROWS]`` (those below ``T``) at once, with
    ``bits [ROWS]`` the ranks each went to (the dispatch's ``routes``): their flags awaited
    in one poll loop, their partial rows loaded together (``RANKS`` ranks' at a time), so
    that a program keeps ROWS·RANKS rows in flight (``symm_ht`` on few SMs, where one row at
    a time leaves the program waiting on one load latency after another). ``OWN_Y``: this
    rank's own partial rows are read where its experts wrote them (``y_ptr [W·M, H]``,
    rows ``me·M + t``; a streamed combine does not copy them into ``comb_y``)."""
    rr = tl.arange(0, BLOCK_W)
    live = tR < T
    t64 = tl.where(live, tR, 0).to(tl.int64)  # (tokens that exist)
    has = (bits[:, None] >> rr[None, :]) & 1
    r_any = tl.minimum(rr, W - 1)[None, :]  # (a valid address in every lane)
    mine = (has > 0) & (rr < W)[None, :]
    base = tl.load(bases_ptr + me)
    flags = _at(base, off_flags, tl.int32)
    cflag = flags + 2 * W + W * M + r_any * M + t64[:, None]
    if not COUNTED:
        _wait_started(flags, rr, W, timeout_ns, err_addr, rr < W)
        lanes = rr[None, :] + tl.zeros((ROWS, BLOCK_W), tl.int32)
        _wait_all(cflag, mine, lanes, timeout_ns, err_addr, OP_COMBINE)
    comb_y = _at(base, off_y, out_ptr.dtype.element_ty)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        c_mask = (cols < H)[None, :]
        acc = tl.zeros((ROWS, BLOCK_H), tl.float32)
        for r0 in range(0, W, RANKS):  # RANKS ranks' rows loaded together, then summed
            for j in tl.static_range(RANKS):
                on = tl.sum(tl.where(rr[None, :] == r0 + j, has, 0), 1) > 0  # (none >= W)
                at = ((r0 + j) * M + t64)[:, None] * H + cols[None, :]
                if OWN_Y:
                    src = tl.where(r0 + j == me, y_ptr + at, comb_y + at)
                else:
                    src = comb_y + at
                part = tl.load(src, mask=on[:, None] & c_mask, other=0.0)
                acc += part.to(tl.float32)
        tl.store(out_ptr + t64[:, None] * H + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=live[:, None] & c_mask)  # fmt: skip
    if not COUNTED:  # consumed (raised again only in this parity's next combine)
        tl.atomic_xchg(cflag, tl.zeros((ROWS, BLOCK_W), tl.int32), mask=mine, sem="relaxed",
                       scope="sys")  # fmt: skip


@triton.jit
def _combine_waits(bases_ptr, err_addr, T, W, M, me, timeout_ns, off_flags,
                   BLOCK_W: tl.constexpr):  # fmt: skip
    """A counted combine's receive, once per program: every rank started its combine,
    then every rank's count of this rank's tokens it went through reached T."""
    rr = tl.arange(0, BLOCK_W)
    flags = _at(tl.load(bases_ptr + me), off_flags, tl.int32)
    _wait_started(flags, rr, W, timeout_ns, err_addr, rr < W)
    cdone = _counts(flags, W, M) + W + tl.minimum(rr, W - 1)
    _wait_all(cdone, rr < W, rr, timeout_ns, err_addr, OP_COMBINE, T)


@triton.jit
def _wait_started(flags, rr, W, timeout_ns, err_addr, need):
    """Wait until every rank of ``need`` raised ``started`` in this rank's ``flags`` (it
    began its combine: see the module docstring); ``rr [BLOCK_W]`` a lane per rank,
    ``need [BLOCK_W]`` the lanes to wait for (``rr < W``: every rank)."""
    _wait_all(flags + W + tl.minimum(rr, W - 1), need, rr, timeout_ns, err_addr, OP_COMBINE)


@triton.jit(do_not_specialize=["me", "off_flags", "off_w", "off_y"])
def ll_combine_send_kernel(
    # pointers
    y_ptr,  # [e_max·C, H] expert outputs (unweighted), in the combine dtype
    bases_ptr,  # [W] int64
    pos_ptr,  # [W, M, K] int32 from the dispatch
    recv_t_ptr,  # [W] int32 from the dispatch
    cnt_ptr,  # [e_max] int32 the dispatch's expert row counters (zeroed here)
    e_max,
    # sizes
    H,
    M,
    W,
    me,
    # byte offsets of this parity's regions
    off_flags,
    off_w,
    off_y,
    # meta-parameters
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_E: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """The send half alone (split phase): a program per (source rank, token slot)."""
    _after_prior(PDL)
    _combine_send(
        tl.program_id(0), tl.program_id(1), y_ptr, bases_ptr, pos_ptr, recv_t_ptr, cnt_ptr,
        e_max, H, M, W, me, off_flags, off_w, off_y, K, BLOCK_K, BLOCK_H, BLOCK_E,
        cnt_ptr, 0, False,
    )  # fmt: skip


@triton.jit(do_not_specialize=["T", "me", "off_flags", "off_y"])
def combine_recv_kernel(
    # pointers
    out_ptr,  # [T, H] combined output in the combine dtype
    ids_ptr,  # [T, K] physical expert ids of this rank's tokens
    owner_ptr,  # [P] int32
    bases_ptr,  # [W] int64
    err_addr,
    routes_ptr,  # ROWS > 1: [T] int32 from the dispatch (the ranks each token went to)
    # sizes
    T,
    H,
    P,
    W,
    M,
    me,
    timeout_ns,
    # byte offsets of this parity's regions
    off_flags,
    off_y,
    # meta-parameters
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_H: tl.constexpr,
    COUNTED: tl.constexpr,  # the senders count tokens per program instead of flagging rows
    ROWS: tl.constexpr = 1,  # tokens a program takes at once (symm_ht: more than one)
    RANKS: tl.constexpr = 1,  # ROWS > 1: ranks whose partial rows it loads at once
    PREFETCH: tl.constexpr = 0,  # ROWS > 1: steps ahead whose rows it asks of the L2
    PDL: tl.constexpr = False,
    ROUTES: tl.constexpr = False,  # ROWS = 1: each token's ranks from routes_ptr, not ids
):
    """The receive half alone (split phase; ``symm_ht``'s combine receive): program p
    takes tokens p, p + G, ... of ``max(T, 1)`` (``COUNTED``: after one wait for all),
    ``ROWS`` of them at a time."""
    _after_prior(PDL)
    if COUNTED:
        _combine_waits(bases_ptr, err_addr, T, W, M, me, timeout_ns, off_flags, BLOCK_W)
    G = tl.num_programs(0)
    if ROWS == 1:
        for t in range(tl.program_id(0), tl.maximum(T, 1), G):
            _combine_recv(
                t, out_ptr, ids_ptr, owner_ptr, bases_ptr, err_addr,
                T, H, P, W, M, me, timeout_ns, off_flags, off_y, K, BLOCK_K, BLOCK_W, BLOCK_H,
                out_ptr, 0, False, COUNTED, routes_ptr, ROUTES,
            )  # fmt: skip
    else:  # each step's routes loaded a step ahead: its rows' loads wait on nothing
        tR = tl.program_id(0) + G * tl.arange(0, ROWS)
        bits = tl.load(routes_ptr + tR, mask=tR < T, other=0)
        comb_y = _at(tl.load(bases_ptr + me), off_y, tl.int8)
        ROW_BYTES: tl.constexpr = BLOCK_H * out_ptr.dtype.element_ty.primitive_bitwidth // 8
        for d in tl.static_range(PREFETCH):  # the first PREFETCH steps' rows
            _prefetch_rows(comb_y, tR + d * G * ROWS, T, W, M, H, out_ptr, ROW_BYTES)
        for t0 in range(tl.program_id(0), tl.maximum(T, 1), G * ROWS):
            tR = t0 + G * tl.arange(0, ROWS)
            ahead = tR + G * ROWS
            bits_ahead = tl.load(routes_ptr + ahead, mask=ahead < T, other=0)
            if PREFETCH > 0:  # the rows PREFETCH steps ahead, every rank's, into the L2
                _prefetch_rows(comb_y, tR + PREFETCH * G * ROWS, T, W, M, H, out_ptr, ROW_BYTES)
            _combine_recv_rows(
                tR, bits, out_ptr, bases_ptr, err_addr, T, H, W, M, me, timeout_ns,
                off_flags, off_y, BLOCK_W, BLOCK_H, ROWS, COUNTED, RANKS, out_ptr, False,
            )  # fmt: skip
            bits = bits_ahead


@triton.jit(do_not_specialize=["T", "me", "off_flags", "off_w", "off_y"])
def ll_combine_kernel(
    y_ptr, bases_ptr, pos_ptr, recv_t_ptr, cnt_ptr, out_ptr, err_addr, stamps_ptr,
    e_max, T, H, M, W, me, timeout_ns, off_flags, off_w, off_y,
    routes_ptr,  # [M] int32 the ranks each token went to (ll_dispatch_kernel's routes)
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_E: tl.constexpr, STAMPS: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Send and receive in one launch (the blocking combine): programs ``[0, W·M)`` send,
    the next ``max(T, 1)`` receive (senders first in launch order, as in
    ``ll_dispatch_kernel``)."""
    _after_prior(PDL)
    pid = tl.program_id(0)
    n_send = W * M
    if pid < n_send:
        _combine_send(
            pid // M, pid % M, y_ptr, bases_ptr, pos_ptr, recv_t_ptr, cnt_ptr, e_max,
            H, M, W, me, off_flags, off_w, off_y, K, BLOCK_K, BLOCK_H, BLOCK_E,
            stamps_ptr, pid, STAMPS,
        )  # fmt: skip
    else:
        _combine_recv(  # (its routing from routes_ptr: no ids, owners or P to read)
            pid - n_send, out_ptr, out_ptr, out_ptr, bases_ptr, err_addr,
            T, H, 0, W, M, me, timeout_ns, off_flags, off_y, K, BLOCK_K, BLOCK_W, BLOCK_H,
            stamps_ptr, pid, STAMPS, False, routes_ptr, True,
        )  # fmt: skip


# ------------------------------------------------------------------------------ symm_ht
# The Standard layout reuses the send half of the dispatch and the receive half of the
# combine above: each token once per destination rank into fixed rows [W, M] of the
# peer's buffer. The experts read those rows in place (no expansion); the receive half of
# the dispatch only publishes each row's local expert ids and weights (-1 / 0 on rows no
# token filled), and the send half of the combine copies each row's partial sum back.
@triton.jit
def _ht_dispatch_recv(
    s, t, T_s, other, bases_ptr, ids_out_ptr, w_out_ptr, recv_t_ptr, err_addr,
    M, W, me, timeout_ns, off_flags, off_ids, off_w,
    K: tl.constexpr, BLOCK_K: tl.constexpr, COUNTED: tl.constexpr,
):  # fmt: skip
    """Row ``t`` of source ``s`` (which sent ``T_s`` tokens): its routing published, after
    its flag (with ``COUNTED`` the caller waited once for the source's count instead);
    ``other``: the source is in another layer's call (NaN weights, see ``_other_call``)."""
    kk = tl.arange(0, BLOCK_K)
    k_mask = kk < K
    base = tl.load(bases_ptr + me)
    flags = _at(base, off_flags, tl.int32)
    if t == 0:
        tl.store(recv_t_ptr + s, T_s)
    row = tl.cast(s, tl.int64) * M + t
    ids = tl.full((BLOCK_K,), -1, tl.int32)
    w = tl.zeros((BLOCK_K,), tl.float32)
    if t < T_s:
        if not COUNTED:
            _wait_at_least(flags + 2 * W + row, 1, timeout_ns, err_addr, OP_DISPATCH, s)
            tl.atomic_xchg(flags + 2 * W + row, 0, sem="relaxed", scope="sys")  # consumed
        ids = tl.load(_at(base, off_ids, tl.int32) + row * K + kk, mask=k_mask, other=-1)
        w = tl.load(_at(base, off_w, tl.float32) + row * K + kk, mask=k_mask, other=0.0)
        if other:
            w = tl.full((BLOCK_K,), float("nan"), tl.float32)
    tl.store(ids_out_ptr + row * K + kk, ids.to(tl.int64), mask=k_mask)
    tl.store(w_out_ptr + row * K + kk, tl.where(ids >= 0, w, 0.0), mask=k_mask)


@triton.jit(do_not_specialize=["me", "tag", "off_flags", "off_ids", "off_w"])
def ht_dispatch_recv_kernel(
    bases_ptr,  # [W] int64
    ids_out_ptr,  # [W·M, K] int64 local expert slot of each received row, -1 (out)
    w_out_ptr,  # [W·M, K] float32 its router weights, 0 where -1 (out)
    recv_t_ptr,  # [W] int32 tokens each source dispatched (out)
    err_addr,
    M,
    W,
    me,
    timeout_ns,
    tag,  # this call's tag, against each source's
    off_flags,
    off_ids,
    off_w,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COUNTED: tl.constexpr,  # the sender counts tokens per program instead of flagging rows
    ROWS: tl.constexpr = 1,  # COUNTED: rows a program publishes at once (contiguous)
    PDL: tl.constexpr = False,
):
    """Program (s, p) publishes rows p, p + G, ... of source s's M rows, once the source's
    count says they came (``expect``, then with ``COUNTED`` ``done[s]`` reaching it);
    ``COUNTED`` with ``ROWS`` > 1: blocks p, p + G, ... of ROWS contiguous rows (block b is
    rows ``[b·ROWS, (b + 1)·ROWS)``; after the one wait
    no row waits for anything, so a block's loads all go out together: one row at a time
    cost 15 µs at 4096 tokens on 132 SMs, 74 µs on 24)."""
    _after_prior(PDL)
    s = tl.program_id(0)
    flags = _at(tl.load(bases_ptr + me), off_flags, tl.int32)
    expect = _wait_at_least(flags + s, 1, timeout_ns, err_addr, OP_DISPATCH, s)
    T_s = tl.maximum(_count_of(expect) - 1, 0)
    other = (expect >= 1) & _other_call(expect, tag)
    if COUNTED:
        _wait_at_least(_counts(flags, W, M) + s, T_s, timeout_ns, err_addr, OP_DISPATCH, s)
    if COUNTED and ROWS > 1:
        if tl.program_id(1) == 0:
            tl.store(recv_t_ptr + s, T_s)
        for t0 in range(tl.program_id(1) * ROWS, M, tl.num_programs(1) * ROWS):
            _ht_publish_rows(
                s, t0 + tl.arange(0, ROWS), T_s, other, bases_ptr, ids_out_ptr, w_out_ptr, M,
                me, off_ids, off_w, K, BLOCK_K,
            )  # fmt: skip
    else:
        for t in range(tl.program_id(1), M, tl.num_programs(1)):
            _ht_dispatch_recv(
                s, t, T_s, other, bases_ptr, ids_out_ptr, w_out_ptr, recv_t_ptr, err_addr,
                M, W, me, timeout_ns, off_flags, off_ids, off_w, K, BLOCK_K, COUNTED,
            )  # fmt: skip
    if tl.program_id(1) == 0:
        _report_other_call(other, err_addr, s)


@triton.jit
def _ht_publish_rows(
    s, tR, T_s, other, bases_ptr, ids_out_ptr, w_out_ptr, M, me, off_ids, off_w,
    K: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``_ht_dispatch_recv`` of a counted dispatch for rows ``tR [R]`` of source ``s`` at
    once (all of them arrived): their routing published, -1 / 0 on rows ``>= T_s``; NaN
    weights where ``other`` (the source is in another layer's call)."""
    kk = tl.arange(0, BLOCK_K)
    base = tl.load(bases_ptr + me)
    row = tl.cast(s, tl.int64) * M + tR.to(tl.int64)
    at = row[:, None] * K + kk[None, :]
    m = (tR < M)[:, None] & (kk < K)[None, :]
    got = m & (tR < T_s)[:, None]
    ids = tl.load(_at(base, off_ids, tl.int32) + at, mask=got, other=-1)
    w = tl.load(_at(base, off_w, tl.float32) + at, mask=got, other=0.0)
    if other:
        w = tl.full(w.shape, float("nan"), tl.float32)
    tl.store(ids_out_ptr + at, ids.to(tl.int64), mask=m)
    tl.store(w_out_ptr + at, tl.where(ids >= 0, w, 0.0), mask=m)


@triton.jit
def _ht_combine_rows(
    s, tR, T_s, y_ptr, bases_ptr, ids_out_ptr, H, M, me, off_y,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Rows ``tR [R]`` from source ``s`` (those below ``T_s``) back into s's ``comb_y``
    where one of their experts is here, all loaded and stored together: a program keeps R
    rows in flight, not one at a time behind its ids' and its row's load latencies (what
    bounds a small SM budget). Returns ``sent [R]`` (their flags follow a barrier, see
    ``_ht_combine_flag``)."""
    kk = tl.arange(0, BLOCK_K)
    live = tR < T_s
    t64 = tl.where(live, tR, 0).to(tl.int64)  # (rows that exist)
    row = tl.cast(s, tl.int64) * M + t64
    ids = tl.load(ids_out_ptr + row[:, None] * K + kk[None, :],
                  mask=live[:, None] & (kk < K)[None, :], other=-1)  # fmt: skip
    sent = live & (tl.max((ids >= 0).to(tl.int32), 1) > 0)
    out = _at(tl.load(bases_ptr + s), off_y, y_ptr.dtype.element_ty)
    src_row = tl.cast(me, tl.int64) * M + t64  # slots in s's comb_y [W, M, H]
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        m = sent[:, None] & (cols < H)[None, :]
        y = tl.load(y_ptr + row[:, None] * H + cols[None, :], mask=m)
        tl.store(out + src_row[:, None] * H + cols[None, :], y, mask=m)
    return sent


@triton.jit
def _ht_combine_flag(s, t, sent, bases_ptr, M, W, me, off_flags, FENCED: tl.constexpr):
    if sent:
        flags = _at(tl.load(bases_ptr + s), off_flags, tl.int32)
        src_row = tl.cast(me, tl.int64) * M + t
        if FENCED:  # (the caller fenced the batch's rows)
            tl.atomic_xchg(flags + 2 * W + W * M + src_row, 1, sem="relaxed", scope="sys")
        else:
            tl.atomic_xchg(flags + 2 * W + W * M + src_row, 1, sem="release", scope="sys")


@triton.jit
def _ht_combine_reduce(
    q, NQ, y_ptr, out_ptr, routes_ptr, bases_ptr, err_addr, T, H, W, M, me, timeout_ns,
    off_flags, off_y, CHUNK: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr, RANKS: tl.constexpr,
):  # fmt: skip
    """Reducer ``q`` of ``NQ`` in a streamed combine: once every rank started its combine,
    chunk by chunk of this rank's T tokens, wait until every peer went through the chunk
    (``ccount``), then sum the W partial rows of its tokens ``c0 + q, c0 + q + NQ, ...``,
    ``ROWS`` at a time, this rank's own rows read from ``y_ptr`` where its experts wrote
    them. This rank's own ``started`` and counts are not awaited: its senders are in the
    same launch, and its rows are not sent."""
    rr = tl.arange(0, BLOCK_W)
    flags = _at(tl.load(bases_ptr + me), off_flags, tl.int32)
    peers = (rr < W) & (rr != me)
    r_any = tl.minimum(rr, W - 1)  # (a valid address in every lane)
    _wait_started(flags, rr, W, timeout_ns, err_addr, peers)
    ccount = _chunk_counts(flags, W, M) + r_any * M
    for c0 in range(0, T, CHUNK):
        c_end = tl.minimum(c0 + CHUNK, T)
        _wait_all(ccount + c0 // CHUNK, peers, rr, timeout_ns, err_addr, OP_COMBINE, c_end - c0)
        for t0 in range(c0 + q, c_end, NQ * ROWS):
            tR = t0 + NQ * tl.arange(0, ROWS)
            bits = tl.load(routes_ptr + tR, mask=tR < c_end, other=0)
            _combine_recv_rows(
                tR, bits, out_ptr, bases_ptr, err_addr, c_end, H, W, M, me, timeout_ns,
                off_flags, off_y, BLOCK_W, BLOCK_H, ROWS, True, RANKS, y_ptr, True,
            )  # fmt: skip


@triton.jit(do_not_specialize=["T", "me", "off_flags", "off_y"])
def ht_combine_reduce_kernel(
    y_ptr, out_ptr, routes_ptr, bases_ptr, err_addr, T, H, W, M, me, timeout_ns,
    off_flags, off_y, CHUNK: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr, RANKS: tl.constexpr,
):  # fmt: skip
    """A streamed combine's reducers (``_ht_combine_reduce``) in a launch of their own,
    after the send kernel (``REDUCERS`` = 0): the protocol simulation under the
    interpreter runs each rank's reducers once every rank has sent, as it must run
    programs one after another."""
    _ht_combine_reduce(
        tl.program_id(0), tl.num_programs(0), y_ptr, out_ptr, routes_ptr, bases_ptr, err_addr,
        T, H, W, M, me, timeout_ns, off_flags, off_y, CHUNK, BLOCK_W, BLOCK_H, ROWS, RANKS,
    )  # fmt: skip


@triton.jit(do_not_specialize=["me", "off_flags", "off_y", "T"])
def ht_combine_send_kernel(
    y_ptr,  # [W·M, H] the experts' partial sums per received row, in the combine dtype
    bases_ptr,  # [W] int64
    ids_out_ptr,  # [W·M, K] int64 from the dispatch
    recv_t_ptr,  # [W] int32 from the dispatch
    H,
    M,
    W,
    me,
    off_flags,
    off_y,
    # a streamed combine (STREAM) only, the sum of the partial rows while they arrive
    # (other launches pass placeholders)
    out_ptr,  # [T, H] the combined output, in the combine dtype
    routes_ptr,  # [M] int32 the ranks each of this rank's tokens went to
    err_addr,
    T,  # this rank's tokens
    senders,  # sending programs per source (on axis 1, after the reducers)
    timeout_ns,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BATCH: tl.constexpr,  # rows a program stores before it raises their flags
    FENCE: tl.constexpr,  # one system fence per batch, relaxed flags (batch_fence(BATCH))
    COUNTED: tl.constexpr,  # no flags: one fence and one count per program, at its end
    ROWS: tl.constexpr = 4,  # rows a program loads and stores at once (flags: ROWS | BATCH)
    STREAM: tl.constexpr = False,  # (COUNTED only)
    CHUNK: tl.constexpr = 512,  # STREAM: tokens per count
    BLOCK_W: tl.constexpr = 1,  # STREAM: a power of two >= W
    RECV_BLOCK_H: tl.constexpr = 4096,  # STREAM: the reducers' column block, rows, ranks
    RECV_ROWS: tl.constexpr = 4,
    RECV_RANKS: tl.constexpr = 2,
    PDL: tl.constexpr = False,
):
    """Program (s, p) sends back rows p, p + G, ... of the T_s that source s sent; program
    (s, 0) first clears ``expect[s]`` (and ``done[s]``) and raises ``started`` at s (as
    ``_combine_send``). ``COUNTED``: no flags; after its rows, one fence and the number of
    tokens it went through (sent or not) added to ``cdone[me]`` at s, whose receivers wait
    for the sum to reach their T.

    ``STREAM``: the receive runs in this launch, while the rows travel. Programs
    ``(0, q)`` below the ``reducers = num_programs(1) - senders`` are reducers
    (``_ht_combine_reduce``; ``(s > 0, q)`` do nothing): first in the launch order, so
    that the block scheduler makes them resident beside the senders rather than after
    them. Senders ``(s, reducers + p)`` go through the T_s tokens of s in chunks of
    ``CHUNK``, after each a fence and its count added to ``ccount[me, c]`` at s, and send
    nothing to this rank itself (its reducers read its own partial rows in ``y``). Senders
    never wait, so reducers (fewer than the SMs) cannot hold back the rows they wait for.
    Every rank must stream or not alike (a mismatch times out)."""
    _after_prior(PDL)
    s = tl.program_id(0)
    if STREAM:
        reducers = tl.num_programs(1) - senders
        if tl.program_id(1) < reducers:
            if s == 0:
                _ht_combine_reduce(
                    tl.program_id(1), reducers, y_ptr, out_ptr, routes_ptr, bases_ptr,
                    err_addr, T, H, W, M, me, timeout_ns, off_flags, off_y, CHUNK, BLOCK_W,
                    RECV_BLOCK_H, RECV_ROWS, RECV_RANKS,
                )  # fmt: skip
        else:
            _ht_combine_send(
                s, tl.program_id(1) - reducers, senders, y_ptr, bases_ptr, ids_out_ptr,
                recv_t_ptr, H, M, W, me, off_flags, off_y, K, BLOCK_K, BLOCK_H, BATCH, FENCE,
                COUNTED, ROWS, STREAM, CHUNK,
            )  # fmt: skip
    else:
        _ht_combine_send(
            s, tl.program_id(1), tl.num_programs(1), y_ptr, bases_ptr, ids_out_ptr,
            recv_t_ptr, H, M, W, me, off_flags, off_y, K, BLOCK_K, BLOCK_H, BATCH, FENCE,
            COUNTED, ROWS, STREAM, CHUNK,
        )  # fmt: skip


@triton.jit
def _ht_combine_send(
    s, p, N, y_ptr, bases_ptr, ids_out_ptr, recv_t_ptr, H, M, W, me, off_flags, off_y,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, BATCH: tl.constexpr,
    FENCE: tl.constexpr, COUNTED: tl.constexpr, ROWS: tl.constexpr,
    STREAM: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Sender ``p`` of ``N`` for source ``s`` in ``ht_combine_send_kernel``."""
    T_s = tl.load(recv_t_ptr + s)
    if p == 0:
        own = _at(tl.load(bases_ptr + me), off_flags, tl.int32)
        tl.atomic_xchg(own + s, 0, sem="relaxed", scope="sys")
        if COUNTED:
            tl.atomic_xchg(_counts(own, W, M) + s, 0, sem="relaxed", scope="sys")
        src_flags = _at(tl.load(bases_ptr + s), off_flags, tl.int32)
        tl.atomic_xchg(src_flags + W + me, 1, sem="release", scope="sys")  # started[me]
    if STREAM:
        ccount = _chunk_counts(_at(tl.load(bases_ptr + s), off_flags, tl.int32), W, M) + me * M
        if s != me:  # (this rank's own rows: its reducers read them where they are)
            for c0 in range(0, T_s, CHUNK):
                c_end = tl.minimum(c0 + CHUNK, T_s)
                for t0 in range(c0 + p, c_end, N * ROWS):
                    _ht_combine_rows(
                        s, t0 + N * tl.arange(0, ROWS), c_end, y_ptr, bases_ptr, ids_out_ptr,
                        H, M, me, off_y, K, BLOCK_K, BLOCK_H,
                    )  # fmt: skip
                n = _strided_count(p, c_end - c0, N)
                if n > 0:
                    tl.debug_barrier()  # every store of the chunk is issued before the fence
                    _fence_sys()
                    tl.atomic_add(ccount + c0 // CHUNK, n, sem="relaxed", scope="sys")
    elif COUNTED:
        cdone = _counts(_at(tl.load(bases_ptr + s), off_flags, tl.int32), W, M) + W + me
        for t0 in range(p, T_s, N * ROWS):  # ROWS rows in flight at once
            _ht_combine_rows(
                s, t0 + N * tl.arange(0, ROWS), T_s, y_ptr, bases_ptr, ids_out_ptr, H, M, me,
                off_y, K, BLOCK_K, BLOCK_H,
            )  # fmt: skip
        n = _strided_count(p, T_s, N)
        if n > 0:
            tl.debug_barrier()  # every store of the program is issued before the fence
            _fence_sys()
            tl.atomic_add(cdone, n, sem="relaxed", scope="sys")
    else:
        tl.static_assert(BATCH % ROWS == 0, "ROWS must divide BATCH")
        lanes = tl.arange(0, BATCH)
        for t0 in range(p, T_s, N * BATCH):  # BATCH rows per barrier
            sent = tl.zeros((BATCH,), tl.int32)
            for j0 in tl.static_range(0, BATCH, ROWS):  # ROWS of them in flight at once
                ok = _ht_combine_rows(
                    s, t0 + N * (j0 + tl.arange(0, ROWS)), T_s, y_ptr, bases_ptr, ids_out_ptr,
                    H, M, me, off_y, K, BLOCK_K, BLOCK_H,
                ).to(tl.int32)  # fmt: skip
                for jj in tl.static_range(ROWS):
                    sent = tl.where(lanes == j0 + jj, _pick(ok, tl.arange(0, ROWS), jj), sent)
            tl.debug_barrier()
            if FENCE:  # (see dispatch_send_kernel)
                _fence_sys()
            for j in tl.static_range(BATCH):
                ok = _pick(sent, tl.arange(0, BATCH), j) > 0
                _ht_combine_flag(s, t0 + j * N, ok, bases_ptr, M, W, me, off_flags, FENCE)
