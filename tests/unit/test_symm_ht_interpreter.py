"""``symm_ht``'s Triton kernels on one CPU rank under the Triton interpreter.

With W = 1 the "peer" is this rank's own buffer, so the interpreter runs every code path of
the Standard-layout dispatch (rows stored once per destination rank, FP8 quantization in
the send kernel, ids and weights published with -1 / 0 on rows no token filled) and of the
combine (each row's partial sum sent back, the partial rows summed) against the oracle,
with the SM budget small enough that every kernel loops. Two ranks, graphs and the
benchmarks run on the GPU machine (``tests/gpu/test_symm_ht.py``).
"""

from __future__ import annotations

import os

import pytest
import torch

import epmoe
from epmoe.comm.base import FP8_DTYPE, Capabilities, CommSpec, Layout
from epmoe.reference import assert_close, moe, quantize_groups
from tests.unit.symm_sim import assert_interpreted_fp8

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs the kernels under TRITON_INTERPRET=1"
)


def _backend(spec, num_sms=None, tokens_per_flag=1, reducers=None, **options):
    from epmoe.comm.symm.ht import SymmHTBackend

    class OnCPU(SymmHTBackend):  # the same kernels, on CPU tensors through the interpreter
        capabilities = Capabilities(
            layouts=frozenset({Layout.STANDARD}),
            dtypes=frozenset({torch.float32, torch.bfloat16}),
            device_types=frozenset({"cpu"}),
            graph_safe=True,
            fp8_dispatch=True,
            max_in_flight=2,
        )

    if tokens_per_flag == "streamed":  # a streamed combine: 2 of the programs reduce
        tokens_per_flag, reducers = 0, 2
    return OnCPU(
        spec, None, Layout.STANDARD, num_sms=num_sms, tokens_per_flag=tokens_per_flag,
        reducers=reducers, **options,
    )  # fmt: skip


def _experts(result, w13, w2):
    """Standard-layout experts with the oracle's math: each received row's weighted sum
    of its local experts' outputs (rows whose ids are all -1 give zeros)."""
    x = result.hidden.float()
    if result.hidden_scale is not None:
        H = x.shape[1]
        x = x * result.hidden_scale.repeat_interleave(128, -1)[:, :H]
    out = torch.zeros_like(x)
    for r in range(x.shape[0]):
        for k in range(result.topk_ids.shape[1]):
            e = int(result.topk_ids[r, k])
            if e >= 0:
                gate, up = (w13[e] @ x[r]).chunk(2)
                out[r] += result.topk_weights[r, k] * (
                    w2[e] @ (torch.nn.functional.silu(gate) * up)
                )
    return out


@pytest.mark.parametrize(
    "per_flag",
    [1, 4, 8, 0, "streamed"],
    ids=[
        "1 row per flag", "4 rows per flag", "8 rows per flag", "one count per program",
        "streamed combine",
    ],
)  # fmt: skip
@pytest.mark.parametrize(
    "fp8", [False, "first", "in the send"],
    ids=["fp32 wire", "fp8 wire quantized first", "fp8 wire quantized in the send"],
)  # fmt: skip
@pytest.mark.parametrize(("T", "M", "sms"), [(5, 8, 2), (0, 4, 1), (8, 8, None)],
                         ids=["T=5 loops", "T=0", "T=M"])  # fmt: skip
def test_dispatch_delivers_rows_in_place_and_combine_matches_the_oracle(
    fp8, T, M, sms, per_flag, monkeypatch
):
    """``fp8``: quantized by a kernel of its own before the send, or (counted mode, from
    ``FUSED_FP8_MIN_SMS``, lowered here: the CPU has 4 "SMs") in the send itself."""
    import epmoe.comm.symm.ht as ht

    monkeypatch.setattr(ht, "FUSED_FP8_MIN_SMS", 1 if fp8 == "in the send" else 10**6)
    E, K, H, I = 6, 3, 256, 32
    placement = epmoe.ExpertPlacement.linear(E, 1)
    spec = CommSpec(
        H, K, placement.rank_offsets, M, torch.float32, torch.device("cpu"),
        dispatch_dtype=FP8_DTYPE if fp8 else None,
    )  # fmt: skip
    comm = _backend(spec, num_sms=sms, tokens_per_flag=per_flag)
    g = torch.Generator().manual_seed(T + M)
    x = torch.randn(T, H, generator=g)
    ids = torch.rand(T, E, generator=g).argsort(1)[:, :K]
    if T:
        ids[0, 1] = -1  # a token with one slot unused
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5

    res = comm.dispatch(x, ids, w)
    assert res.layout is Layout.STANDARD and res.hidden.shape == (M, H)  # R = W·M rows
    assert res.topk_ids.dtype == torch.int64 and res.topk_ids.shape == (M, K)
    # rows [0, T) are this rank's tokens in order; the rest carry no expert
    assert (res.topk_ids[T:] == -1).all() and (res.topk_weights[T:] == 0).all()
    torch.testing.assert_close(res.topk_ids[:T], ids)
    torch.testing.assert_close(res.topk_weights[:T], torch.where(ids >= 0, w, 0.0))
    if fp8:
        q, s = quantize_groups(x)
        torch.testing.assert_close(res.hidden_scale[:T], s)
        assert_interpreted_fp8(res.hidden[:T], q, "fp8 rows")
    else:
        assert res.hidden_scale is None
        torch.testing.assert_close(res.hidden[:T], x, rtol=0, atol=0)

    out = comm.combine(_experts(res, w13, w2), res)
    x_sent = x
    if fp8:  # the rows as they arrived (see assert_interpreted_fp8)
        x_sent = res.hidden[:T].float() * res.hidden_scale[:T].repeat_interleave(128, -1)[:, :H]
    want = moe(x_sent, w13, w2, w, ids)
    assert out.shape == (T, H)
    assert_close(out, want, 1e-5, name="combine")
    comm.close()


def test_two_in_flight_a_third_refused_and_each_result_combines_once():
    E, K, H = 4, 2, 128
    spec = CommSpec(H, K, epmoe.ExpertPlacement.linear(E, 1).rank_offsets, 4, torch.float32, "cpu")
    comm = _backend(spec)
    x = torch.randn(3, H)
    ids = torch.tensor([[0, 1], [2, 3], [1, -1]])
    w = torch.full((3, K), 0.5)
    first = comm.dispatch_async(x, ids, w).wait()
    second = comm.dispatch_async(2 * x, ids, w).wait()
    with pytest.raises(RuntimeError, match="at most 2 dispatch results"):
        comm.dispatch_async(x, ids, w)

    def identity(res):  # Σ_k w_k · row
        return res.hidden * res.topk_weights.sum(1, keepdim=True)

    want = x * torch.tensor([[1.0], [1.0], [0.5]])
    torch.testing.assert_close(comm.combine(identity(first), first), want)
    torch.testing.assert_close(comm.combine_async(identity(second), second).wait(), 2 * want)
    with pytest.raises(RuntimeError, match="exactly once"):
        comm.combine(identity(first), first)
    with pytest.raises(ValueError, match="max_num_tokens"):
        comm.dispatch(torch.randn(5, H), torch.zeros(5, K, dtype=torch.int64), torch.ones(5, K))
    comm.close()


def test_bad_ids_are_reported_after_the_call_completes():
    E, K, H = 4, 3, 128
    spec = CommSpec(H, K, epmoe.ExpertPlacement.linear(E, 1).rank_offsets, 2, torch.float32, "cpu")
    comm = _backend(spec)
    w = torch.full((2, K), 1.0 / K)
    res = comm.dispatch(torch.randn(2, H), torch.tensor([[0, 1, E], [2, -1, 3]]), w)
    with pytest.raises(RuntimeError, match="symm_ht dispatch .* expert id outside"):
        comm.combine(res.hidden.clone(), res)
    comm.close()


def test_num_sms_tokens_per_flag_and_reducers_are_checked(monkeypatch):
    spec = CommSpec(128, 2, (0, 4), 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="num_sms must be a positive int"):
        _backend(spec, num_sms=0)
    with pytest.raises(
        ValueError, match=r"tokens_per_flag must be 0 \(one count per program\), 1, 2, 4 or 8"
    ):
        _backend(spec, tokens_per_flag=3)
    with pytest.raises(ValueError, match="reducers must be a non-negative int"):
        _backend(spec, tokens_per_flag=0, reducers=-1)
    with pytest.raises(ValueError, match="reducers=2 needs tokens_per_flag=0"):
        _backend(spec, tokens_per_flag=4, reducers=2)
    with pytest.raises(ValueError, match="combine_chunk must be a positive int"):
        _backend(spec, tokens_per_flag=0, combine_chunk=0)
    # the default streams from STREAM_MIN_SMS SMs (half of them reduce), not below (the
    # CPU counts as 4 SMs); never with row flags; at most all SMs but one
    import epmoe.comm.symm.ht as ht

    monkeypatch.setattr(ht, "STREAM_MIN_SMS", 4)
    assert _backend(spec, tokens_per_flag=0).reducers == 2
    assert _backend(spec, num_sms=3, tokens_per_flag=0).reducers == 0
    assert _backend(spec, tokens_per_flag=4).reducers == 0
    assert _backend(spec, num_sms=3, tokens_per_flag=0, reducers=5).reducers == 2


@pytest.mark.parametrize("W", [2, 3, 8])
def test_num_sms_is_a_budget_for_every_launch(W, monkeypatch):
    """With ``num_sms`` given, no launch runs more programs than it: the kernels with a
    column per rank (dispatch receive, combine send) split it among the W columns, a
    streamed combine's reducers first; unset, each column may take every SM (the CPU
    counts as 4). The rank count is set by hand: one process, the host arithmetic only."""
    import epmoe.comm.symm.ht as ht

    monkeypatch.setattr(ht, "STREAM_MIN_SMS", 4)
    spec = CommSpec(128, 2, (0, 4), 64, torch.float32, "cpu")
    for sms in (1, 3, 4):
        comm = _backend(spec, num_sms=sms, tokens_per_flag=0)
        comm.world_size = W
        assert comm.num_sms == sms and comm._grid(64) == sms
        assert comm._grid_per_rank(64) == max(1, sms // W)  # (at least one per column)
        assert W * comm._grid_per_rank(64) <= max(sms, W)
        assert comm._grid_per_rank(1) == 1
        comm.close()
    budget = 4 * W
    comm = _backend(spec, num_sms=100, tokens_per_flag=0, reducers=W)
    comm.world_size = W
    assert comm.num_sms == 4  # (at most the device's)
    comm._sms = budget  # (a device with more SMs than the CPU's 4)
    monkeypatch.setattr(type(comm), "num_sms", property(lambda self: self._sms))
    reducers = comm.reducers
    senders = comm._grid_per_rank(64, taken=reducers)
    assert reducers == W and senders == 3  # the budget: W reducers and 3 senders per column
    assert reducers + W * senders == budget
    comm.close()
    uncapped = _backend(spec, tokens_per_flag=0)
    uncapped.world_size = W
    assert uncapped._grid_per_rank(64) == 4 and uncapped._grid_per_rank(64, taken=2) == 2
    assert uncapped.reducers == 2
    uncapped.close()


def test_a_result_is_combined_in_the_mode_it_was_dispatched_in():
    """Two symm_ht on one transport, one streaming its combine and one not: a result of
    the one combined by the other is refused (the streamed combine waits for chunk counts
    that only its own dispatch clears), and each combines its own."""
    E, K, H = 4, 2, 128
    spec = CommSpec(H, K, epmoe.ExpertPlacement.linear(E, 1).rank_offsets, 4, torch.float32, "cpu")
    streamed = _backend(spec, tokens_per_flag=0, reducers=1, combine_chunk=2)
    plain = _backend(spec, tokens_per_flag=0, reducers=0)
    assert streamed._live() is plain._live()  # (one transport for the shape)
    x = torch.randn(3, H)
    ids = torch.tensor([[0, 1], [2, 3], [1, -1]])
    w = torch.tensor([[0.5, 0.5], [0.25, 0.75], [1.0, 0.0]])
    for mine, other in ((streamed, plain), (plain, streamed)):
        res = mine.dispatch(x, ids, w)
        y = res.hidden * res.topk_weights.sum(1, keepdim=True)
        with pytest.raises(RuntimeError, match="combine each result with the backend that"):
            other.combine(y, res)
        torch.testing.assert_close(mine.combine(y, res), x)
    streamed.close()
    plain.close()


def test_more_ranks_than_the_routes_mask_holds_are_refused(monkeypatch):
    """Each token's destination ranks are an int32 mask: a group of 33 ranks is refused
    (``ranks_reason``, which ``unavailable_reason`` adds for ``available_backends`` and
    ``auto``) and by the constructor, naming the limit and the way out, before any buffer
    is taken; by ``symm_ll`` too, whose combine reads the same routes."""
    import epmoe.comm.symm.common as common
    from tests.unit.test_symm_ll_interpreter import _backend as ll_backend

    monkeypatch.setattr(common.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(common.dist, "get_world_size", lambda group=None: 33)
    reason = common.ranks_reason(None)
    assert reason is not None and "at most 32 ranks" in reason and "has 33" in reason
    spec = CommSpec(128, 2, (0, 4), 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"symm_ht: at most 32 ranks .* use all_to_all"):
        _backend(spec)
    with pytest.raises(ValueError, match=r"symm_ll: at most 32 ranks .* use all_to_all"):
        ll_backend(spec)


CALLS = {  # tokens per rank in five calls: T = 0 on some rank, T = M, tokens that loop
    2: [(5, 0), (0, 3), (7, 8), (1, 1), (8, 2)],
    3: [(5, 0, 8), (0, 3, 1), (7, 8, 0), (1, 1, 6), (8, 2, 3)],
    4: [(5, 0, 8, 2), (0, 3, 1, 0), (7, 8, 0, 8), (1, 1, 6, 3), (8, 2, 3, 5)],
}


MODES = {"counted": "one count per program", "streamed": "streamed combine", "flags": "row flags"}


# every mode at W = 2 and 3 (an odd count of peers); W = 4 adds peers to the same code
# paths, so it runs one mode (the cheapest: the interpreter takes 17-36 s per W = 4 case,
# and the CPU tier has a 15-minute budget)
@pytest.mark.parametrize(
    "mode, W",
    [pytest.param(m, W, id=f"{MODES[m]}-W={W}") for W in (2, 3) for m in MODES]
    + [pytest.param("counted", 4, id="one count per program-W=4")],
)
def test_ranks_back_to_back_leave_every_count_and_flag_as_the_protocol_says(mode, W):
    """W ranks simulated in one process (``symm_sim``): five calls alternate the
    parities, with T = 0 on some rank, grids of different sizes (programs loop) and a
    token routed nowhere. After each phase the counts (counted mode), chunk counts
    (streamed combine: chunks of 3 tokens, the last one partial) or flags (row flags)
    are what the protocol in ``kernels.py`` says, and combine returns each token's
    weighted rows. Rows of 300 columns: every kernel loops over column blocks of 128 (the
    combine receive's prefetch over its byte chunks too), the last one partial. The
    streamed combine's reducers run in a launch of their own after every rank's send
    (the interpreter runs one program after another). Each call has its own tag, and in
    the third the last rank is in another layer's call: rank 0's receive names it
    (``ERR_LAYER``), no other call reports anything, and every token with an expert across
    that divide comes back NaN (the published weights of rows from another call are)."""
    counted, streamed = mode != "flags", mode == "streamed"
    chunk = 3 if streamed else 0
    from epmoe.comm.symm import kernels as k
    from tests.unit.symm_sim import Ranks

    sim = Ranks(W, H=300)
    M, H, K = sim.M, sim.H, sim.K
    sms = [2, 3, 1, 2][:W]

    def grid(n, r):
        return max(1, min(n, sms[r]))

    from epmoe.comm.symm.ht import DISPATCH_ROWS, RECV_PREFETCH, RECV_RANKS, RECV_ROWS, SEND_ROWS

    publish = 2 if counted else 1  # (ht.py's PUBLISH_ROWS is more than M = 8: blocks loop)

    per_flag = dict(BATCH=1, FENCE=False, COUNTED=counted, ROWS=SEND_ROWS if counted else 1)
    published = [
        [(torch.full((W * M, K), -1), torch.zeros(W * M, K), torch.zeros(W, dtype=torch.int32))
         for _ in range(2)] for _ in range(W)
    ]  # fmt: skip
    for n, Ts in enumerate(CALLS[W]):
        parity = n % 2
        reg = sim.regions[parity]
        inputs = [sim.inputs(T) for T in Ts]
        tags = [n + 1] * (W - 1) + [99 if n == 2 else n + 1]
        for r in range(W):  # dispatch, send half
            sim.send(
                k, parity, r, inputs[r], grid(max(Ts[r], 1), r), counted,
                rows=DISPATCH_ROWS if counted else 1, chunk=chunk, tag=tags[r],
            )  # fmt: skip
        if counted:
            assert all(sim.counts(r, parity)[0] == list(Ts) for r in range(W))
        if streamed:  # the last combine's chunk counts cleared by the announcements
            assert not any(sim.chunk_counts(r, parity).any() for r in range(W)), n
        for r in range(W):  # dispatch, receive half
            ids_out, w_out, recv_t = published[r][parity]
            k.ht_dispatch_recv_kernel[(W, grid(-(-M // publish), r))](
                sim.bases, ids_out, w_out, recv_t, sim.err_addr, M, W, r, 10**9,
                tags[r], reg.flags, reg.ids, reg.w, K=K, BLOCK_K=2, COUNTED=counted,
                ROWS=publish,
            )  # fmt: skip
            assert recv_t.tolist() == list(Ts)
            if n == 2 and r == 0:
                assert sim.err.item() == (k.ERR_LAYER << 24) | (k.OP_DISPATCH << 16) | (W - 1)
            assert sim.err.item() == 0 or n == 2, (n, r, hex(sim.err.item()))
        sim.err.zero_()  # (one word here for every rank)
        ys = [None] * W
        for r in range(W):  # combine, send half: identity experts, weighted
            ids_out, w_out, recv_t = published[r][parity]
            ys[r] = y = (sim.rows(r, parity) * w_out.sum(1, keepdim=True)).contiguous()
            stream = {}  # (the reducers run in a launch of their own below)
            if streamed:
                stream = dict(STREAM=True, CHUNK=chunk, BLOCK_W=sim.BLOCK_W)
            k.ht_combine_send_kernel[(W, grid(M, r))](
                y, sim.bases, ids_out, recv_t, H, M, W, r, reg.flags, reg.y,
                y, sim.routes[r, parity], sim.err_addr, Ts[r], grid(M, r), 10**9,
                K=K, BLOCK_K=2, BLOCK_H=128, **per_flag, **stream,
            )  # fmt: skip
        if streamed:  # each peer went through each chunk of r's tokens; no cdone, no copy
            for r in range(W):
                sizes = [min(chunk, Ts[r] - c0) for c0 in range(0, Ts[r], chunk)]
                want = torch.zeros(W, M, dtype=torch.int32)
                want[:, : len(sizes)] = torch.tensor(sizes, dtype=torch.int32)
                want[r] = 0
                assert torch.equal(sim.chunk_counts(r, parity), want), (n, r)
                assert sim.counts(r, parity) == ([0] * W, [0] * W), (n, r)
            for r in range(W):
                sim.combine_reduce(
                    k, parity, r, inputs[r], ys[r], grid(max(Ts[r], 1), r), chunk, tags=tags
                )
            sim.assert_reset(parity, n)
            continue
        if counted:  # done cleared by the combine; each rank sent back all of r's T
            for r in range(W):
                assert sim.counts(r, parity) == ([0] * W, [Ts[r]] * W), (n, r)
        for r in range(W):  # combine, receive half
            sim.combine_receive(
                k, parity, r, inputs[r], grid(max(Ts[r], 1), r), counted, rows=RECV_ROWS,
                ranks=RECV_RANKS, prefetch=RECV_PREFETCH, tags=tags,
            )  # fmt: skip
        sim.assert_reset(parity, n)


@pytest.mark.parametrize(
    "per_flag", [4, 0, "streamed"],
    ids=["4 rows per flag", "one count per program", "streamed combine"],
)  # fmt: skip
def test_two_results_in_flight_combine_to_their_own_tokens(per_flag):
    """Two dispatch results held at once (both parities), combined in the order they were
    dispatched, over rounds of changing token counts: each combine gives back its own
    tokens (identity experts, weights summing to 1)."""
    E, K, H, M = 6, 3, 256, 8
    placement = epmoe.ExpertPlacement.linear(E, 1)
    spec = CommSpec(H, K, placement.rank_offsets, M, torch.float32, torch.device("cpu"))
    comm = _backend(spec, num_sms=3, tokens_per_flag=per_flag)
    for n, Ts in enumerate([(7, 0), (M, 3), (0, M), (5, 5)]):
        pair = []
        for j, T in enumerate(Ts):
            g = torch.Generator().manual_seed(1000 * n + j)
            ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
            w = torch.softmax(torch.randn(T, K, generator=g), -1)
            x = torch.randn(T, H, generator=g)
            pair.append((x, comm.dispatch(x, ids, w)))
        for x, res in pair:
            y = res.hidden * res.topk_weights.sum(1, keepdim=True)
            torch.testing.assert_close(comm.combine(y, res), x, msg=f"round {n}")
    comm.close()


@pytest.mark.parametrize("bad", [False, True], ids=["good ids", "an id out of range"])
@pytest.mark.parametrize(
    "fp8", [False, "first", "in the send"],
    ids=["fp32 rows", "fp8 rows quantized first", "fp8 rows quantized in the send"],
)  # fmt: skip
@pytest.mark.parametrize(
    ("W", "Ts", "sms"),
    [(2, (6, 5), 4), (3, (7, 0, 5), 2), (4, (6, 1, 6, 3), 1)],
    ids=["W=2", "W=3", "W=4"],
)
def test_counted_send_of_several_tokens_stores_what_one_at_a_time_stores(W, Ts, sms, fp8, bad):
    """``dispatch_send_kernel``'s counted mode with ``ROWS`` = DISPATCH_ROWS tokens per step
    (FUSED_FP8_ROWS when it quantizes FP8 rows itself) leaves every rank's buffer (rows, FP8
    scales, routing, counts), the routes it keeps for the combine and the error word byte
    for byte as one token per step does:
    W ranks, T = 0 on one, programs that loop, rows of 300 columns in two column steps (a
    partial last scale group), a token routed nowhere and, with ``bad``, an id out of range
    reported."""
    import triton.language as tl

    from epmoe.comm.symm import kernels as k
    from epmoe.comm.symm.ht import DISPATCH_ROWS, FUSED_FP8_ROWS
    from epmoe.reference import quantize_groups
    from tests.unit.symm_sim import Ranks

    def dispatch(rows: int):
        sim = Ranks(W, H=300, fp8=bool(fp8))
        g = torch.Generator().manual_seed(7)
        reg = sim.regions[0]
        for r in range(W):
            T = Ts[r]
            x = torch.randn(T, sim.H, generator=g)
            ids = torch.rand(T, sim.E, generator=g).argsort(1)[:, : sim.K].contiguous()
            if T > 1:
                ids[1] = -1
            if bad and T > 2:
                ids[2, 0] = sim.E + 3
            w = torch.rand(T, sim.K, generator=g)
            xs = x
            if fp8 == "first":
                x, xs = (t.contiguous() for t in quantize_groups(x))
            k.dispatch_send_kernel[(max(1, min(max(T, 1), sms)),)](
                x, xs, ids, w, sim.owner, sim.local, sim.bases, sim.err_addr,
                sim.routes[r, 0], T,
                sim.H, sim.E, sim.M, W, sim.G, r, 0, reg.flags, reg.x, reg.s, reg.ids, reg.w,
                K=sim.K, BLOCK_K=2, BLOCK_W=sim.BLOCK_W, BLOCK_H=256, FP8=fp8,
                WIRE=tl.float8e4nv if fp8 else tl.float32, FP8_MAX=448.0,
                INV_FP8_MAX=1 / 448, EPS=1e-10, BATCH=1, FENCE=False,
                PREQUANT=fp8 == "first", COUNTED=True, ROWS=rows, ROUTES=True,
            )  # fmt: skip
        return [b.clone() for b in sim.bufs] + [sim.routes.clone()], sim.err.item()

    one, err_one = dispatch(1)
    several, err_several = dispatch(FUSED_FP8_ROWS if fp8 == "in the send" else DISPATCH_ROWS)
    assert err_one == err_several and (err_one != 0) == bad
    for r in range(W):
        assert torch.equal(one[r], several[r]), f"rank {r}"
    assert torch.equal(one[W], several[W]), "routes"


def test_an_idle_rank_launches_the_kernel_variant_a_busy_one_does(monkeypatch):
    """FP8 quantized before the send: with T = 0 the send gets FP8 rows and scales too
    (empty), so a rank's first idle step compiles no new variant while its peers wait."""
    import epmoe.comm.symm.common as common

    seen, launch = [], common.launch

    def recording(kernel):
        run = launch(kernel)

        def call(grid, *args, **kwargs):
            if "PREQUANT" in kwargs:
                seen.append((kwargs["PREQUANT"], args[0].dtype, args[1].dtype))
            return run(grid, *args, **kwargs)

        return call

    monkeypatch.setattr(common, "launch", recording)
    E, K, H = 4, 2, 256
    spec = CommSpec(H, K, (0, E), 4, torch.float32, "cpu", dispatch_dtype=FP8_DTYPE)
    comm = _backend(spec, num_sms=1, tokens_per_flag=1)  # row flags: quantized first
    for T in (0, 3):
        ids = torch.zeros(T, K, dtype=torch.int64) + torch.arange(K)
        res = comm.dispatch(torch.randn(T, H), ids, torch.full((T, K), 0.5))
        comm.combine(torch.zeros(res.hidden.shape), res)
    assert seen == [(True, FP8_DTYPE, torch.float32)] * 2
    comm.close()
