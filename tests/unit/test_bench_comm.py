"""The comm and layer benchmarks on one CPU process: their arithmetic (wire bytes, goals,
ratios), the peer-store ceiling's messages and kernel, and tiny end-to-end CLI runs that
must degrade to "n/a" records where CUDA is needed."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from epmoe.bench import comm, layer
from epmoe.comm.base import DispatchResult, Layout
from epmoe.reference import relative_error

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def test_wire_row_bytes_bf16_and_fp8_rows_with_scales():
    assert comm.wire_row_bytes(7168, BF16) == 14336
    assert comm.wire_row_bytes(7168, FP8) == 7168 + 56 * 4  # 7392: rows + 56 float32 scales
    assert comm.wire_row_bytes(7168, torch.float32) == 28672
    assert comm.wire_row_bytes(200, FP8) == 200 + 2 * 4  # a partial last group has a scale


def test_comm_goals_apply_at_the_issue_shape_only():
    shape = (2, 128, 7168, 8)  # (W, T, H, K)
    assert comm.comm_goal_us("dispatch", "graph", "float8_e4m3fn", *shape) == 10.0
    assert comm.comm_goal_us("dispatch", "graph", "bfloat16", *shape) == 13.0
    assert comm.comm_goal_us("combine", "graph", "float8_e4m3fn", *shape) == 15.0
    assert comm.comm_goal_us("combine", "graph", "bfloat16", *shape) == 15.0
    assert comm.comm_goal_us("dispatch", "eager", "float8_e4m3fn", *shape) == 31.0
    assert comm.comm_goal_us("combine", "eager", "bfloat16", *shape) == 41.0
    assert comm.comm_goal_us("dispatch", "graph", "bfloat16", 2, 512, 7168, 8) is None
    assert comm.comm_goal_us("dispatch", "graph", "bfloat16", 2, 128, 4096, 8) is None
    # the goals were set at EP2: an EP4 or EP8 record at T = 128 gets no verdict
    assert comm.comm_goal_us("dispatch", "graph", "bfloat16", 4, 128, 7168, 8) is None
    assert comm.comm_goal_us("combine", "eager", "bfloat16", 8, 128, 7168, 8) is None
    assert comm.verdict(13.0, 13.0) == "met"
    assert comm.verdict(13.01, 13.0) == "missed"


def test_goal_columns_and_summary():
    rec = dict(kind="comm", backend="symm_ll", layout="expert_batched", wire="bfloat16",
               mode="graph_b2b", W=2, T=128, H=7168, K=8, dispatch_us=12.0,
               combine_us=16.0)  # fmt: skip
    cold = dict(rec, mode="graph")
    comm._add_goals(cold, "graph", "bfloat16", 2, 128, 7168, 8)
    assert "goal" not in cold  # goals are judged on back-to-back streams only
    wide = dict(rec, W=4)
    comm._add_goals(wide, "graph_b2b", "bfloat16", 4, 128, 7168, 8)
    assert "goal" not in wide  # nor at EP4
    comm._add_goals(rec, "graph_b2b", "bfloat16", 2, 128, 7168, 8)
    assert (rec["dispatch_goal"], rec["combine_goal"], rec["goal"]) == (
        "met",
        "missed",
        "met/missed",
    )
    skipped = dict(kind="comm", backend="symm_ll", layout="expert_batched", wire="float8_e4m3fn",
                   mode="-", W=2, T=128, H=7168, K=8, note="skipped: why")  # fmt: skip
    lines = comm.goal_summary([rec, cold, skipped, dict(skipped, W=8)])
    assert len(lines) == 3
    assert "bfloat16 graph_b2b dispatch: 12.0 µs, goal ≤ 13 µs: met" in lines[0]
    assert "combine: 16.0 µs, goal ≤ 15 µs: missed" in lines[1]
    assert lines[2].endswith("skipped: why")
    assert "no record at W=2, T=128" in comm.goal_summary([dict(rec, T=1)])[0]
    assert "no record at W=2" in comm.goal_summary([dict(rec, W=8)])[0]
    wrong = dict(rec, wire="float8_e4m3fn", wrong=True, note="WRONG: round trip error 0.8 > 0.06")
    assert comm.goal_summary([wrong]) == [
        "symm_ll:expert_batched float8_e4m3fn graph_b2b: WRONG: round trip error 0.8 > 0.06"
    ]


def test_layer_ratio_and_its_goal():
    assert layer.layer_ratio(3450.0, 2700.0, 150.0, 150.0) == pytest.approx(1.15)
    rec = dict(W=2, T=128, H=7168, K=8, weights_read_us=2700.0)
    layer._fill(rec, 3.4, (0.15, 0.15), 1, (40, 3), torch.device("cpu"))
    assert rec["ratio"] == pytest.approx(3400 / 3000)
    assert (rec["goal"], rec["kernels"], rec["memops"]) == ("met", 40, 3)
    rec = dict(W=8, T=128, H=7168, K=8, weights_read_us=2700.0)  # the goal is EP2's
    layer._fill(rec, 3.4, (0.15, 0.15), 1, None, torch.device("cpu"))
    assert "goal" not in rec
    rec = dict(W=2, T=4096, H=7168, K=8, weights_read_us=2700.0)
    layer._fill(rec, 9.0, (0.5, 0.5), 2, None, torch.device("cpu"))
    assert rec["dispatch_us"] == pytest.approx(1000.0)  # per chunk × chunks
    assert "goal" not in rec and "kernels" not in rec


def test_eplb_moved_mb_is_in_1e6_bytes_like_every_mb_field():
    from epmoe.eplb.migration import MigrationStats

    stats = MigrationStats(slots_moved=5, slots_received=2, slots_copied=3, slots_sent=2,
                           bytes_sent=3_000_000, bytes_received=3_000_000, seconds=0.1)  # fmt: skip
    fields = layer.migration_fields(stats, torch.device("cpu"))
    assert fields == dict(moved_MB=3.0, experts_moved=2, slots_changed=5)  # not 2.86 (MiB)


def test_identity_expert_out_makes_combine_return_x_times_the_weight_sum():
    """Standard rows are weighted by their local router weights (the experts' partial
    sums); ExpertBatched rows go as they are; FP8 rows are scaled back."""
    rows_RH = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    standard = DispatchResult(
        layout=Layout.STANDARD,
        hidden=rows_RH,
        topk_ids=torch.tensor([[0, -1], [1, 2]]),
        topk_weights=torch.tensor([[0.5, 0.25], [0.125, 0.375]]),
    )
    out_RH = comm.identity_expert_out(standard, torch.float32)
    assert torch.equal(out_RH, torch.tensor([[0.5, 1.0], [1.5, 2.0]]))
    H = 256
    x_eCH = torch.randn(2, 3, H)
    scale_eCG = x_eCH.abs().reshape(2, 3, 2, 128).amax(-1) / 448
    q_eCH = (x_eCH / scale_eCG.repeat_interleave(128, -1)).to(FP8)
    batched = DispatchResult(Layout.EXPERT_BATCHED, q_eCH, counts=torch.tensor([3, 3]),
                             hidden_scale=scale_eCG)  # fmt: skip
    out_eCH = comm.identity_expert_out(batched, BF16)
    assert out_eCH.dtype == BF16 and out_eCH.shape == (2, 3, H)
    assert relative_error(out_eCH, x_eCH) < 0.06


def test_time_phases_times_every_phase_of_every_iteration():
    calls = []
    d_ms, c_ms = comm.time_phases(
        [lambda: calls.append("d"), lambda: calls.append("c")],
        warmup=1,
        iters=3,
        device=torch.device("cpu"),
        before=lambda: calls.append("|"),
    )
    assert len(d_ms) == len(c_ms) == 3 and min(d_ms + c_ms) >= 0
    assert "".join(calls) == "dc|dc|dc|dc"


def test_kernel_times_sum_each_phase_per_round_between_all_reduces():
    kernels = [  # (name, start µs, duration µs), out of order as a profile may list them
        ("ll_combine_kernel", 130.0, 15.0),
        ("ncclDevKernel_AllReduce", 100.0, 5.0),
        ("ll_dispatch_kernel", 110.0, 12.0),
        ("ll_dispatch_kernel", 50.0, 99.0),  # before the first all-reduce: left out
        ("spin_kernel", 60.0, 500.0),  # neither phase
        ("dispatch_send_kernel", 210.0, 7.0),
        ("ncclDevKernel_AllReduce", 200.0, 5.0),
        ("ll_dispatch_recv_kernel", 220.0, 4.0),  # split halves add up
        ("ll_combine_kernel", 240.0, 16.0),
        ("ncclDevKernel_AllReduce", 300.0, 5.0),
        ("ll_dispatch_kernel", 310.0, 13.0),  # a round without its combine: left out
    ]
    d_us, c_us = comm.phase_kernel_us(kernels, ("dispatch", "combine"), delimiter="nccl")
    assert d_us == [12.0, 11.0] and c_us == [15.0, 16.0]
    assert comm.phase_kernel_us(kernels[:1], ("dispatch", "combine"), "nccl") == [[], []]


def test_kernel_medians_are_per_round_sums_by_name():
    spin, align = "at::cuda::spin_kernel", "ncclDevKernel_AllReduce_Sum_f32"
    kernels = [  # (name, start µs, duration µs) as time_kernels profiles them
        ("send", -10.0, 9.0),  # before the first round: left out
        (spin, 0.0, 500.0),
        (align, 500.0, 1.0),  # the round's aligning all-reduce: left out
        ("send", 510.0, 4.0),
        ("recv", 520.0, 1.0),
        ("recv", 525.0, 1.0),  # twice in a round: their sum
        ("ncclDevKernel_SendRecv", 530.0, 2.0),  # a backend's own NCCL kernel: kept
        (align, 535.0, 7.0),  # a backend's own all-reduce after the first: kept
        (spin, 1000.0, 500.0),
        (align, 1500.0, 1.0),
        ("send", 1510.0, 6.0),
        ("recv", 1520.0, 3.0),
        (spin, 2000.0, 500.0),
        ("send", 2510.0, 5.0),  # W = 1: no all-reduce kernel in the round
    ]
    assert comm.kernel_medians(kernels, "spin_kernel", skip_first="AllReduce") == {
        "recv": 2.5, "send": 5.0, "ncclDevKernel_SendRecv": 2.0, align: 7.0,
    }  # fmt: skip
    assert comm.kernel_medians(kernels[:1], "spin_kernel") == {}  # no round started
    d_us, c_us = comm.phase_kernel_us(
        [(n.replace("send", "dispatch").replace("recv", "combine"), t, d) for n, t, d in kernels],
        ("dispatch", "combine"), delimiter="spin_kernel",
    )  # fmt: skip
    assert d_us == [4.0, 6.0] and c_us == [2.0, 3.0]  # (the third round has no combine)


def test_backend_entries_take_any_option_as_key_value():
    options = comm.entry_options("num_sms=24,nvl_chunks=20/8,worst_case_rows=true")
    assert options == dict(num_sms=24, nvl_chunks=(20, 8), worst_case_rows=True)
    assert comm.budget_label(options) == "num_sms=24,nvl_chunks=20/8,worst_case_rows=true"
    with pytest.raises(ValueError, match="expected key=value"):
        comm.entry_options("num_sms")


def test_each_phase_is_held_to_nccl_moving_its_own_bytes(monkeypatch):
    """With FP8 on the wire, dispatch moves FP8 rows and scales but combine moves rows in
    the hidden dtype: each phase's NCCL baseline moves that phase's bytes (one measurement
    per (layout, row bytes, gathers) and T, shared by the phases and wires that match)."""
    from epmoe.placement import ExpertPlacement
    from epmoe.routing import RoutingSimulator

    timed = []

    def fake_a2a(send_W, row_bytes, device, timing):  # 1 µs per row byte, 7 rows received
        timed.append(row_bytes)
        return row_bytes * 1e-3, 7

    monkeypatch.setattr(comm, "_a2a_reference", fake_a2a)
    cpu, H, T, E, K = torch.device("cpu"), 256, 4, 8, 2
    placement = ExpertPlacement.linear(E, 1)
    weights_TK, ids_TK = RoutingSimulator(E, K, seed=0).sample(T, device=cpu)
    x_TH = torch.randn(T, H).to(BF16)
    ctx = dict(group=None, rank=0, profile=False, a2a={},
               shape=dict(W=1, H=H, K=K, E=E, dtype="bfloat16"),
               timing=dict(warmup=0, iters=1, device=cpu, barrier=None))  # fmt: skip
    eager = {}
    for wire in (FP8, BF16):
        spec = comm.wire_spec(H, K, placement, T, BF16, cpu, wire)
        records = comm._backend_records("all_to_all:standard", spec, x_TH, ids_TK, weights_TK,
                                        placement, ctx)  # fmt: skip
        eager[wire] = next(r for r in records if r["mode"] == "eager")
    fp8, bf16 = eager[FP8], eager[BF16]
    assert fp8["a2a_dispatch_us"] == pytest.approx(H + 2 * 4)  # FP8 rows + 2 float32 scales
    assert fp8["a2a_combine_us"] == pytest.approx(H * 2)  # bf16 rows back
    assert fp8["combine_vs_a2a"] == pytest.approx(fp8["a2a_combine_us"] / fp8["combine_us"])
    assert fp8["dispatch_vs_a2a"] == pytest.approx(fp8["a2a_dispatch_us"] / fp8["dispatch_us"])
    assert bf16["a2a_dispatch_us"] == bf16["a2a_combine_us"] == pytest.approx(H * 2)
    assert timed == [H + 2 * 4, H * 2]  # the bf16 rows were timed once, for both records


def test_one_parser_checks_the_backends_each_benchmark_names(monkeypatch):
    """``epmoe.bench.common.parse_backend_choice``: the name and layout checks that bench
    comm and bench layer share, each option's syntax saying what it takes beyond them."""
    from epmoe.bench import common
    from epmoe.bench.common import EntrySyntax, parse_backend_choice

    plain = EntrySyntax("--backends", "NAME or NAME:LAYOUT", auto=True)
    naive = parse_backend_choice("naive", plain)
    assert (naive.name, naive.layout, naive.cls.name, naive.more) == ("naive", None, "naive", ())
    auto = parse_backend_choice("auto:expert_batched", plain)
    assert (auto.name, auto.layout, auto.cls) == ("auto", Layout.EXPERT_BATCHED, None)
    with pytest.raises(ValueError, match=r"^--backends 'naive:standard:24': expected NAME or "
                       r"NAME:LAYOUT$"):  # fmt: skip
        parse_backend_choice("naive:standard:24", plain)
    more = EntrySyntax("--backends", "NAME[:LAYOUT[:OPTIONS]]", more=True)
    assert parse_backend_choice("symm_ht:standard:24:4", more).more == ("24", "4")
    with pytest.raises(ValueError, match=r"^--backends 'auto': unknown backend 'auto' \('auto' "
                       "is the layer's choice"):  # fmt: skip
        parse_backend_choice("auto", more)
    name_only = EntrySyntax("--eplb-backend", "NAME", auto=True, layout=False)
    assert parse_backend_choice("auto", name_only).name == "auto"
    with pytest.raises(ValueError, match=r"^--eplb-backend 'naive:standard': expected NAME$"):
        parse_backend_choice("naive:standard", name_only)

    def no_module(name):
        raise ImportError(f"no module for {name}")

    monkeypatch.setattr(common, "backend_class", no_module)  # (the run records it as skipped)
    pplx = parse_backend_choice("pplx:standard", more)
    assert (pplx.name, pplx.layout, pplx.cls) == ("pplx", Layout.STANDARD, None)


def test_backend_entries_keep_their_markers_beside_key_value_options():
    """``:fixed`` / ``:copy`` with ``key=value`` options make series of their own (they
    were labelled by the options alone, so ``deepep_ht:standard:fixed:num_sms=24`` and
    ``deepep_ht:standard:num_sms=24`` were drawn and summarised as one backend)."""
    from epmoe.bench import plot

    fixed = comm.parse_backend_entry("deepep_ht:standard:fixed:num_sms=24")
    plain = comm.parse_backend_entry("deepep_ht:standard:num_sms=24")
    assert (fixed.label, plain.label) == ("deepep_ht/fixed/num_sms=24", "deepep_ht/num_sms=24")
    assert fixed.options == dict(worst_case_rows=True, num_sms=24)
    assert plain.options == dict(num_sms=24)
    copy = comm.parse_backend_entry("symm_ll:expert_batched:copy")
    assert (copy.label, copy.options) == ("symm_ll/copy", dict(rows_in_place=False))
    budget = comm.parse_backend_entry("symm_ht:standard:24:4")
    assert (budget.label, budget.options) == ("symm_ht", dict(num_sms=24, tokens_per_flag=4))
    assert comm.parse_backend_entry("naive").layout is Layout.STANDARD
    base = dict(kind="comm", wire="bfloat16", T=128, layout="standard", sms=24,
                mode="eager_b2b", dispatch_us=50.0, combine_us=40.0)  # fmt: skip
    series = plot.comm_series([dict(base, backend=fixed.label), dict(base, backend=plain.label)])
    assert len([k for k in series if k[1] == "dispatch"]) == 2


def test_one_rank_has_no_link_bandwidth_and_writes_null():
    assert comm._link_bandwidth(BF16, 64, 1, torch.device("cpu"), {}) is None


def test_kernel_times_need_cuda_and_a_process_group():
    assert comm.time_kernels(lambda: None, lambda: None, torch.device("cpu")).startswith("n/a")


# ------------------------------------------------------------------------------ ceiling


@pytest.fixture(scope="module")
def ceiling():
    return pytest.importorskip("epmoe.bench.ceiling", reason="needs triton")


# rank holding each selected expert of 5 tokens, K = 3, W = 3 (-1: no expert)
OWNER_TK = torch.tensor([[0, 1, 2], [1, 1, -1], [0, 0, 0], [2, 1, 0], [-1, -1, -1]])


def test_peer_messages_per_rank_deduplicates_and_skips_self(ceiling):
    row, rank, slot, S = ceiling.peer_messages(OWNER_TK, 0, 3, "per_rank")
    assert S == 5  # T slots per source rank
    assert row.tolist() == [0, 0, 1, 3, 3]
    assert rank.tolist() == [1, 2, 1, 1, 2]
    assert slot.tolist() == [0, 0, 1, 2, 1]  # rank 0's region starts at 0
    row, rank, slot, _ = ceiling.peer_messages(OWNER_TK, 1, 3, "per_rank")
    assert row.tolist() == [0, 0, 2, 3, 3] and rank.tolist() == [0, 2, 0, 0, 2]
    assert slot.tolist() == [5, 5, 6, 7, 6]  # rank 1's region: slots [5, 10)


def test_peer_messages_per_expert_one_row_per_pair(ceiling):
    row, rank, slot, S = ceiling.peer_messages(OWNER_TK, 0, 3, "per_expert")
    assert S == 15  # T·K slots per source rank
    assert row.tolist() == [0, 0, 1, 1, 3, 3]
    assert rank.tolist() == [1, 2, 1, 1, 2, 1]
    assert slot.tolist() == [0, 0, 1, 2, 1, 3]
    with pytest.raises(ValueError, match="pattern"):
        ceiling.peer_messages(OWNER_TK, 0, 3, "per_token")


def test_the_ceiling_needs_every_rank_on_one_nvlink_node(ceiling, monkeypatch):
    """Torch symmetric memory cannot rendezvous across nodes: a multi-node group gets the
    ceiling's "n/a" with the reason the symm backends give, not a failed set-up."""
    groups = []

    def two_nodes(group):
        groups.append(group)
        return "needs all 4 ranks on one node (NVLink peers); LOCAL_WORLD_SIZE=2"

    monkeypatch.setattr(ceiling, "one_nvlink_node_reason", two_nodes)
    group = object()  # (a stand-in: only passed through)
    reason = comm._ceiling_unavailable_reason(torch.device("cuda"), 4, group)
    assert reason == (
        "the peer-store ceiling (torch symmetric memory) needs all 4 ranks on one node "
        "(NVLink peers); LOCAL_WORLD_SIZE=2"
    )
    assert groups == [group]
    monkeypatch.setattr(ceiling, "one_nvlink_node_reason", lambda group: None)
    assert ceiling.unavailable_reason(torch.device("cuda"), 4, group) is None
    assert "needs CUDA GPUs" in ceiling.unavailable_reason(torch.device("cpu"), 4, group)


def test_a_failed_stream_capture_says_why_not_none(monkeypatch):
    """The ceiling's graph captured but its graph_b2b stream did not: that mode's note is
    the stream capture's failure (it read "n/a: None")."""
    results = iter([(_Replayable(), None), (None, "capture failed (boom)"), (None, "again")])
    monkeypatch.setattr(comm, "capture_agreed", lambda capture, device: next(results))
    loop = dict(warmup=0, iters=1, device=torch.device("cpu"), before=None)
    times, reasons = comm._ceiling_times(lambda: None, loop)
    assert set(times) == {"eager", "eager_b2b", "graph"}
    assert reasons == {"graph_b2b": "capture failed (boom)"}
    results = iter([(None, "capture failed (no CUDA)")])
    times, reasons = comm._ceiling_times(lambda: None, loop)
    assert set(times) == {"eager", "eager_b2b"}
    assert reasons == dict.fromkeys(("graph", "graph_b2b"), "capture failed (no CUDA)")


class _Replayable:
    def replay(self) -> None:
        pass


def test_padded_row_words_and_buffer_size(ceiling):
    assert ceiling.padded_row_words(14336) == 3584
    assert ceiling.padded_row_words(7392) == 1848  # 16-byte multiple already
    assert ceiling.padded_row_words(132) == 36  # 144 bytes
    assert comm._ceiling_words([1, 128, 512], 8, 2, [14336, 7392]) == 2 * 512 * 8 * 3584


@pytest.mark.parametrize("B", [40, 8200], ids=["16 rows a step", "2 rows a step"])
def test_peer_store_kernel_puts_each_row_in_its_slot(ceiling, B):
    """The kernel (Triton interpreter on CPU) with ordinary tensors standing in for the
    ranks' symmetric receive buffers: one program storing 16 rows a step, or two storing
    2 rows a step over several steps."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    T, W = OWNER_TK.shape[0], 3
    payload_TB = torch.randint(0, 256, (T, B), dtype=torch.uint8, device=device)
    for pattern in ceiling.PATTERNS:
        messages = ceiling.peer_messages(OWNER_TK.to(device), 0, W, pattern)
        S, words = messages[3], ceiling.padded_row_words(B)
        recv = [torch.zeros(W * S, words, dtype=torch.int32, device=device) for _ in range(W)]

        class Buffers:  # what PeerStore reads of ReceiveBuffers
            num_words = W * S * words
            ptrs_W = torch.tensor([t.data_ptr() for t in recv], device=device)

        store = ceiling.PeerStore(Buffers, payload_TB, messages, num_sms=2)
        N = messages[0].numel()
        assert store.num_programs == min(-(-N // store.msgs), 2) and store.bytes_stored == N * B
        store.launch()
        filled = set()
        for t, r, s in zip(*(m.tolist() for m in messages[:3])):
            got_B = recv[r][s].view(torch.uint8)[:B]
            assert torch.equal(got_B, payload_TB[t]), (pattern, t, r, s)
            filled.add((r, s))
        for r in range(W):  # nothing else written
            rows = [s for s in range(W * S) if (r, s) not in filled]
            assert not recv[r][rows].any(), (pattern, r)


def test_peer_store_kernel_stores_16_byte_vectors_on_sm90():
    """Compiled offline for sm_90 (no GPU needed), the stores into the peer are 128-bit:
    the alignment hint on the address loaded from the pointer table works."""
    pytest.importorskip("triton.backends.compiler", reason="needs triton with its compiler")
    script = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from epmoe.bench.ceiling import peer_store_kernel
sig = {"payload_ptr": "*i32", "msg_row_ptr": "*i32", "msg_rank_ptr": "*i32",
       "msg_slot_ptr": "*i32", "recv_ptrs_ptr": "*i64", "num_msgs": "i32",
       "ROW_WORDS": "constexpr", "BLOCK": "constexpr", "MSGS": "constexpr"}
src = ASTSource(peer_store_kernel, sig, constexprs={"ROW_WORDS": 1848, "BLOCK": 2048, "MSGS": 4},
                attrs={(i,): [["tt.divisibility", 16]] for i in range(5)})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
print("v4-stores" if "st.global.v4.b32" in ptx else "no-v4-stores")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=env)  # fmt: skip
    if done.returncode != 0 and ("No such file" in done.stderr or "ptxas" in done.stderr):
        pytest.skip(f"Triton's CUDA tools are missing: {done.stderr[-200:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("v4-stores") and "no-v4" not in done.stdout


# ------------------------------------------------------------------------------ CLI runs


def _run_bench(tmp_path, *args: str, nproc: int | None = None) -> list[dict]:
    out = tmp_path / "records.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = ROOT
    if nproc is None:
        cmd = [sys.executable, "-m", "epmoe.bench", *args, "--out", str(out)]
    else:
        cmd = [sys.executable, os.path.join(ROOT, "launch", "run.py"), "--nproc", str(nproc),
               "-m", "epmoe.bench", *args, "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["machine"]["torch"] == torch.__version__
    return data["records"]


TINY_COMM = ["comm", "--tokens", "4", "--hidden", "256", "--num-experts", "8", "--top-k", "2",
             "--iters", "2", "--warmup", "1"]  # fmt: skip


def _check_tiny_comm(records: list[dict], W: int, hidden: torch.dtype) -> None:
    rows = [r for r in records if r["kind"] == "comm"]
    measured = [r for r in rows if r["mode"] == "eager"]
    H, size = 256, hidden.itemsize
    for wire, row_bytes in ((comm.dtype_name(hidden), H * size), ("float8_e4m3fn", H + 2 * 4)):
        got = [r for r in measured if r["wire"] == wire]
        assert {(r["backend"], r["layout"]) for r in got} >= {("all_to_all", "standard")}
        for r in got:
            assert r["W"] == W and r["T"] == 4 and r["dispatch_us"] > 0 and r["combine_us"] > 0
            assert r["a2a_dispatch_us"] > 0 and r["a2a_combine_us"] > 0 and r["sms"] is None
            assert r["roundtrip_error"] < (6e-2 if wire == "float8_e4m3fn" else 1e-2)
            assert r["dispatch_MB"] == pytest.approx(r["recv_rows"] * row_bytes / 1e6)
            assert r["combine_MB"] == pytest.approx(r["recv_rows"] * H * size / 1e6)
    assert {r["mode"] for r in measured} == {"eager"}
    assert {r["mode"] for r in rows if r["mode"] not in ("-", "eager")} >= {
        "eager_b2b", "graph", "graph_b2b"}  # fmt: skip
    graphs = [r for r in rows if r["mode"].startswith("graph")]
    assert graphs and all(r["note"] == "n/a: CUDA graphs need CUDA" for r in graphs)
    symm = [r for r in rows if r["backend"] == "symm_ll"]
    assert len(symm) == 2 and all(r["note"].startswith("skipped: ") for r in symm)
    ceilings = [r for r in records if r["kind"] == "ceiling"]
    assert len(ceilings) == 2 and all(r["note"].startswith("n/a: ") for r in ceilings)
    links = {r["link_GBps"] for r in records}
    assert links == {None} if W == 1 else min(links) > 0  # (JSON null, not NaN, on one rank)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU degradation path")
def test_comm_cli_tiny_on_one_cpu_process(tmp_path):
    _check_tiny_comm(_run_bench(tmp_path, *TINY_COMM), W=1, hidden=BF16)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU degradation path")
def test_comm_cli_tiny_on_two_gloo_ranks(tmp_path):
    _check_tiny_comm(_run_bench(tmp_path, *TINY_COMM, "--dtype", "float32",
                                "--dispatch-dtypes", "float32", "float8_e4m3fn",
                                nproc=2), W=2, hidden=torch.float32)  # fmt: skip


def test_wire_dtypes_are_the_hidden_dtype_or_fp8():
    args = argparse.Namespace(dispatch_dtypes=["float16"])
    with pytest.raises(ValueError, match="hidden dtype"):
        comm.wire_dtypes(args, BF16)
    args.dispatch_dtypes = None
    assert comm.wire_dtypes(args, BF16) == [BF16, FP8]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU degradation path")
def test_layer_cli_tiny_on_one_cpu_process(tmp_path):
    records = _run_bench(tmp_path, "layer", "--tokens", "4", "--num-experts", "8", "--top-k",
                         "2", "--hidden", "64", "--intermediate", "32", "--iters", "2",
                         "--warmup", "1", "--parts", "layer")  # fmt: skip
    eager, graph, symm = records
    assert (eager["backend"], eager["layout"], eager["mode"]) == ("all_to_all", "standard", "eager")
    assert eager["routing"] == "deepseek_v3" and eager["experts"] == "torch"
    weight_bytes = 8 * 4 * (2 * 32 * 64 + 64 * 32)  # all 8 experts local, float32 w13 + w2
    assert eager["weights_GB"] == pytest.approx(weight_bytes / 1e9)
    assert eager["weights_read_us"] == pytest.approx(weight_bytes / (eager["copy_GBps"] * 1e3))
    floor = eager["weights_read_us"] + eager["dispatch_us"] + eager["combine_us"]
    assert eager["ratio"] == pytest.approx(eager["layer_us"] / floor)
    assert eager["experts_us"] > 0 and "kernels" not in eager and "goal" not in eager
    assert graph["mode"] == "graph" and graph["note"] == "n/a: CUDA graphs need CUDA"
    assert symm["backend"] == "symm_ll" and symm["note"].startswith("skipped: ")


def test_layer_top_k_is_checked_against_the_small_shape_a_cpu_run_takes(monkeypatch, capsys):
    """Without CUDA the layer benchmark runs SMALL's 16 experts whether or not --small is
    given: --top-k 20 is refused before the run, not by the layer after part layer."""
    from epmoe.bench.__main__ import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        main(["layer", "--top-k", "20"])
    assert "--top-k 20 is more than the 16 experts" in capsys.readouterr().err


def test_layer_cli_runs_backend_auto(tmp_path):
    """``--backends auto`` is the layer's default backend: measured, not recorded as an
    unregistered backend skipped."""
    records = _run_bench(tmp_path, "layer", "--tokens", "4", "--num-experts", "8", "--top-k",
                         "2", "--hidden", "64", "--intermediate", "32", "--iters", "2",
                         "--warmup", "1", "--parts", "layer", "--backends", "auto")  # fmt: skip
    eager = [r for r in records if r.get("mode") == "eager"]
    assert len(eager) == 1 and eager[0]["layer_us"] > 0, records
    assert eager[0]["backend"] != "auto"  # (the backend it chose)


def test_layer_cli_measures_each_micro_batch_count_in_one_run(tmp_path):
    """... with FP8 weights at an I that is no multiple of 128 (scales per expert, as at
    the CPU sizes: block scales were refused there)."""
    records = _run_bench(tmp_path, "layer", "--tokens", "4", "--num-experts", "8", "--top-k",
                         "2", "--hidden", "64", "--intermediate", "32", "--iters", "2",
                         "--warmup", "1", "--parts", "layer", "--backends", "all_to_all",
                         "--micro-batches", "1", "2",
                         "--weight-dtype", "float8_e4m3fn")  # fmt: skip
    eager = [r for r in records if r.get("mode") == "eager"]
    assert [r["micro_batches"] for r in eager] == [1, 2]
    assert all(r["layer_us"] > 0 and r["weights"] == "float8_e4m3fn" for r in eager)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["experts", "--dtypes", "fp32"], "--dtypes takes a comma list of bf16, fp16, fp8"),
        (["experts", "--dtypes", ","], "--dtypes takes a comma list"),
        (["experts", "--top-k", "5", "--num-experts", "4"], "--top-k 5 is more than"),
        (["experts", "--num-experts", "4", "--top-k", "2"], "--local-experts 128 is more than"),
        (["experts", "--m-splits", "0"], "--m-splits must be positive"),
        (["layer", "--dtype", "float16x"], "--dtype must be one of bfloat16, float16, float32"),
        (["layer", "--backends", "all_to_all:bogus"], "--backends 'all_to_all:bogus': layout"),
        (["layer", "--backends", "all_to_all:standard:24"], "expected NAME or NAME:LAYOUT"),
        (["layer", "--window", "0"], "--window must be positive, got 0"),
        (["layer", "--tokens", "4", "0"], "--tokens must be positive, got [4, 0]"),
        (["layer", "--weight-scale", "block"], "--weight-scale is for FP8 weights"),
        (["comm", "--dtype", "foo"], "--dtype must be one of bfloat16, float16, float32"),
        (["comm", "--dispatch-dtypes", "float16"], "--dispatch-dtypes float16: a wire dtype"),
        (["comm", "--backends", "foo"], "--backends 'foo': unknown backend 'foo'"),
        (["comm", "--backends", "auto"], "'auto' is the layer's choice"),
        (["comm", "--backends", "all_to_all:bogus"], "layout 'bogus' is not one of standard"),
        (["comm", "--backends", "naive:expert_batched"], "naive has no expert_batched layout"),
        (["comm", "--backends", "all_to_all:standard:abc"], "'abc' is not a count"),
        (["comm", "--backends", "symm_ht:standard:num_sms=x"], "'num_sms=x': the value must"),
        (["comm", "--backends", "symm_ht:standard:24:num_sms=8"], "num_sms given twice"),
        (["comm", "--backends", "all_to_all:standard:copy"], "has no option 'rows_in_place'"),
        (["comm", "--iters", "0"], "--iters must be positive, got 0"),
        (["comm", "--small", "--top-k", "20"], "--top-k 20 is more than the 16 experts"),
        (["comm", "--tokens", "0"], "--tokens must be positive"),
        (["layer", "--eplb-backend", "foo"], "--eplb-backend 'foo': unknown backend"),
        (
            ["layer", "--eplb-backend", "naive:standard"],
            "--eplb-backend 'naive:standard': expected NAME (no layout)",
        ),
        (["layer", "--experts", "foo"], "argument --experts: invalid choice: 'foo'"),
        (["layer", "--iters", "0"], "--iters must be positive, got 0"),
        (["layer", "--max-num-tokens", "0"], "--max-num-tokens must be positive, got 0"),
        (["layer", "--num-experts", "12"], "--num-experts must be a multiple of 8, got 12"),
        (["layer", "--num-experts", "16", "--top-k", "9"], "--top-k 9 is more than the 8"),
        (["layer", "--backends", "foo"], "--backends 'foo': unknown backend"),
        (["layer", "--backends", "naive:expert_batched"], "naive has no expert_batched layout"),
        (
            ["layer", "--tokens", "8", "--parts", "eplb", "--hot", "shuffled", "--plot", "le.png"],
            "--plot draws part layer's step times: add layer to --parts",
        ),
        (["eplb", "--timing-ep", "0"], "--timing-ep must be positive, got 0"),
        (["eplb", "--ep", "8", "0"], "--ep takes positive EP sizes"),
        (["eplb", "--tokens", "100", "--ep", "8"], "--tokens=100 must be a multiple of every"),
        (["eplb", "--top-k", "9", "--num-experts", "8"], "--top-k 9 is more than"),
    ],
)
def test_bench_options_are_checked_before_the_run(argv, match, capsys):
    from epmoe.bench.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("bench", ["comm", "layer"])
@pytest.mark.parametrize(
    "entry, match",
    [
        ("foo", "--backends 'foo': unknown backend 'foo'; the backends are "),
        ("all_to_all:bogus", "--backends 'all_to_all:bogus': layout 'bogus' is not one of "
         "standard, expert_batched"),
        ("naive:expert_batched", "--backends 'naive:expert_batched': naive has no "
         "expert_batched layout (it offers standard)"),
        # (bench layer took a name and an empty layout for the name alone)
        ("all_to_all:", "--backends 'all_to_all:': layout '' is not one of standard"),
    ],
)  # fmt: skip
def test_both_benchmarks_refuse_a_bad_backend_entry_in_the_same_words(bench, entry, match,
                                                                       capsys):  # fmt: skip
    """One parser (``epmoe.bench.common``) checks the backend and layout of a --backends
    entry for bench comm and bench layer alike."""
    from epmoe.bench.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main([bench, "--backends", entry])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert match in err
    if entry == "foo":  # (auto: the layer's own choice, a backend to the layer benchmark)
        assert err.rstrip().endswith(" or auto") == (bench == "layer")


def test_layer_runs_the_backends_its_check_accepted():
    """Bench layer's run reads --backends with the parser of its check: a name alone is
    the backend's default layout (``None``), ``auto`` may name a layout."""
    args = argparse.Namespace(
        backends=["all_to_all", "auto", "auto:expert_batched", "naive:standard"]
    )
    assert layer._entries(args) == [
        ("all_to_all", None), ("auto", None), ("auto", Layout.EXPERT_BATCHED),
        ("naive", Layout.STANDARD),
    ]  # fmt: skip


def test_a_wrong_round_trip_marks_the_record():
    from epmoe.bench.comm import check_roundtrip

    ok, fp8, bad, nan = ({"wire": w} for w in ("bfloat16", "float8_e4m3fn", "bfloat16", "bfloat16"))
    check_roundtrip(ok, 1.2e-3)
    check_roundtrip(fp8, 2.6e-2)
    check_roundtrip(bad, 0.79)
    check_roundtrip(nan, float("nan"))
    assert not ok.get("wrong") and not fp8.get("wrong") and ok["roundtrip_error"] == 1.2e-3
    assert bad["wrong"] and bad["note"] == "WRONG: round trip error 0.79 > 0.01"
    assert nan["wrong"]


def test_comm_plot_series_pick_graph_times_and_baselines(tmp_path):
    """Graph-safe backends are drawn from their graph_b2b records, the others from
    eager_b2b; the ceiling (per rank) goes under dispatch, NCCL under both phases: one
    line per layout, whatever the order of the backends, without naive's gathered rows."""
    from epmoe.bench import plot

    base = dict(kind="comm", wire="bfloat16", T=128, W=2, H=7168, K=8, E=256)
    records = [
        dict(base, backend="symm_ll", layout="expert_batched", sms=132, mode="graph_b2b",
             dispatch_us=25.0, combine_us=19.7),
        dict(base, backend="symm_ll", layout="expert_batched", sms=132, mode="eager",
             dispatch_us=160.0, combine_us=126.0, a2a_dispatch_us=90.0, a2a_combine_us=95.0),
        dict(base, backend="all_to_all", layout="standard", sms=None, mode="eager_b2b",
             dispatch_us=1800.0, combine_us=380.0),
        dict(kind="ceiling", wire="bfloat16", T=128, pattern="per_rank", mode="graph_b2b",
             us=10.9),
        dict(kind="ceiling", wire="bfloat16", T=128, pattern="per_expert", mode="graph_b2b",
             us=26.1),
        dict(base, backend="pplx", layout="expert_batched", mode="graph_b2b", dispatch_us=60.0,
             combine_us=59.0, wrong=True),  # a wrong round trip is not drawn
        dict(base, backend="all_to_all", layout="standard", sms=None, mode="eager",
             dispatch_us=1900.0, combine_us=400.0, a2a_dispatch_us=50.0, a2a_combine_us=55.0),
        dict(base, backend="naive", layout="standard", sms=None, mode="eager",
             dispatch_us=700.0, combine_us=130.0, a2a_dispatch_us=75.0, a2a_combine_us=78.0),
    ]  # fmt: skip
    series = plot.comm_series(records)
    assert series == plot.comm_series(records[::-1])  # (the order of --backends)
    batched, standard = (plot.nccl_label(x) for x in ("expert_batched", "standard"))
    assert series[("bfloat16", "dispatch", standard)] == [(128, 50.0)]  # not naive's 75
    assert series[("bfloat16", "combine", standard)] == [(128, 55.0)]
    assert not any("pplx" in label for _, _, label in series)
    assert series[("bfloat16", "dispatch", "symm_ll (expert_batched, 132 SMs; graph)")] == [
        (128, 25.0)
    ]
    assert series[("bfloat16", "combine", "all_to_all (standard; eager)")] == [(128, 380.0)]
    assert series[("bfloat16", "dispatch", "peer-store ceiling")] == [(128, 10.9)]
    assert series[("bfloat16", "dispatch", batched)] == [(128, 90.0)]
    assert series[("bfloat16", "combine", batched)] == [(128, 95.0)]
    old = dict(records[1], wire="float8_e4m3fn", dtype="bfloat16", a2a_us=40.0)
    del old["a2a_dispatch_us"], old["a2a_combine_us"]  # a record from before the split
    old_series = plot.comm_series([old])
    assert old_series == {("float8_e4m3fn", "dispatch", batched): [(128, 40.0)]}
    assert not any("ceiling" in label for _, phase, label in series if phase == "combine")
    pytest.importorskip("matplotlib")
    png = tmp_path / "comm.png"
    plot.plot_comm(records, str(png), "test")
    assert png.stat().st_size > 10_000


def test_table_numbers_have_one_format_per_magnitude():
    from epmoe.bench.common import format_table

    table = format_table(
        [dict(a=5022.4), dict(a=25.04), dict(a=0.919), dict(a=float("nan"))], ["a"]
    )
    assert [line.strip() for line in table.split("\n")[1:]] == ["5022", "25", "0.919", "nan"]
    assert "e+" not in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_experts_bench_without_a_gpu_exits_with_an_error_and_the_cpu_command():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "epmoe.bench", "experts"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "TRITON_INTERPRET=1 python -m epmoe.bench experts --device cpu" in done.stderr


def test_layer_plot_draws_each_backend_and_mode(tmp_path):
    pytest.importorskip("matplotlib")
    from epmoe.bench import plot

    base = dict(kind="layer", T=128, W=2, E=256, K=8, H=7168, I=2048, experts="triton",
                weights_read_us=2792.0, dispatch_us=85.0, combine_us=32.0)  # fmt: skip
    records = [dict(base, backend="symm_ll", mode="graph", layer_us=2674.0),
               dict(base, backend="all_to_all", mode="eager", layer_us=5022.0),
               dict(base, backend="all_to_all", mode="graph", note="n/a")]  # fmt: skip
    png = tmp_path / "layer.png"
    plot.plot_layer(records, str(png), "test")
    assert png.stat().st_size > 10_000
    with pytest.raises(ValueError, match="no layer records"):
        plot.plot_layer(records[2:], str(png), "test")


def test_experts_plot_marks_ours_against_the_baselines(tmp_path):
    pytest.importorskip("matplotlib")
    from epmoe.bench import plot

    records = [
        dict(scenario="prefill", dtype="bf16", impl="epmoe standard", ms=4.3, tflops=420.0,
             vs_roofline=0.62),
        dict(scenario="prefill", impl="torch._grouped_mm", ms=5.2, tflops=350.0),
        dict(scenario="decode", dtype="fp8", impl="epmoe batched", ms=0.9, weight_GBps=3600.0,
             frac_of_copy=0.86),
        dict(scenario="decode", impl="device copy", copy_GBps=4200.0),
    ]  # fmt: skip
    png = tmp_path / "experts.png"
    plot.plot_experts(records, str(png), "test")
    assert png.stat().st_size > 10_000
    with pytest.raises(ValueError, match="no experts records"):
        plot.plot_experts(records[-1:], str(png), "test")  # the copy bandwidth alone


def _nan_on_rank_1(rank, world):
    from epmoe.bench.common import over_ranks

    value = float("nan") if rank == 1 else 0.1
    return over_ranks(value, torch.device("cpu")), over_ranks(1.0, torch.device("cpu"), "sum")


def test_a_nan_on_one_rank_is_a_nan_on_every_rank():
    from tests.harness import run_on_ranks

    for worst, total in run_on_ranks(_nan_on_rank_1, 2, backend="gloo"):
        assert worst != worst and total == 2.0  # NaN, not the other rank's 0.1


def test_eplb_plot_title_comes_from_the_records(tmp_path):
    pytest.importorskip("matplotlib")
    from epmoe.bench import plot

    base = dict(kind="balance", E=256, K=8, T=8192, alpha=1.0, redundant=0)
    records = [
        dict(base, ep=ep, placement=name, bal_eval=v)
        for ep in (8, 32)
        for name, v in (("linear", 0.6), ("round_robin", 0.5), ("balanced", 0.99))
    ]
    spare = [dict(base, ep=8, placement="balanced", bal_eval=v, redundant=R)
             for R, v in ((32, 0.97), (64, 0.99))]  # fmt: skip
    assert [plot._eplb_label(r) for r in spare] == [
        "balanced, 32 spare slots", "balanced, 64 spare slots"]  # fmt: skip
    assert plot._eplb_label(records[2]) == "balanced, no spare"
    records += spare
    title = plot._eplb_title(records, {"date": "2026-11-30T14:45:59+00:00"})
    assert title == "EPLB placements, 256 experts, top-8, 8192 tokens per step — 2026-11-30T14:45"
    png = tmp_path / "eplb.png"
    plot.plot_eplb(records, str(png), title)
    assert png.stat().st_size > 10_000


def test_eplb_replan_timing_at_an_ep_size_that_does_not_divide_e(tmp_path):
    """EP24 with 256 experts: "no spare slots" is the 8 that give every rank 11 slots, not
    0 (which crashed the re-plan timing after the balance part, and no JSON was written);
    24 ranks make 3 nodes, over which 8 expert groups do not split: said in a note."""
    from epmoe.bench.__main__ import main

    out = tmp_path / "e24.json"
    main(["eplb", "--tokens", "96", "--window-steps", "1", "--ep", "24", "--alphas", "1.0",
          "--layers", "1", "--timing-ep", "24", "--iters", "1", "--out", str(out)])  # fmt: skip
    records = json.loads(out.read_text())["records"]
    replan = [r for r in records if r["kind"] == "replan"]
    assert [(r["policy"], r["redundant"]) for r in replan] == [
        ("global", 32), ("global", 8), ("hierarchical", 32), ("global+migration", 32)]  # fmt: skip
    hierarchical = replan[2]
    assert (hierarchical["groups"], hierarchical["nodes"]) == (8, 3)
    assert "planned globally" in hierarchical["note"]
    assert all(r["ms_per_layer"] > 0 for r in replan)


def test_comm_cli_options_given_win_over_small_and_bad_ones_are_named(monkeypatch):
    """``--small`` fills only what was not given; a backend named without a layout takes
    its first (Standard where offered); T = 0 is refused by name (nothing to time)."""
    parser = argparse.ArgumentParser()
    comm.add_arguments(parser)
    seen = {}

    def stop(*_):  # the shapes main settled on, before any process group
        seen.update(tokens=args.tokens, hidden=args.hidden, iters=args.iters)
        raise SystemExit("stop")

    monkeypatch.setattr(comm, "distributed_setup", stop)
    args = parser.parse_args(["--small", "--tokens", "3", "--hidden", "64"])
    with pytest.raises(SystemExit, match="stop"):
        comm.main(args)
    assert seen == dict(tokens=[3], hidden=64, iters=5)
    args = parser.parse_args([])
    with pytest.raises(SystemExit, match="stop"):
        comm.main(args)
    assert seen == dict(tokens=[1, 128, 512], hidden=7168, iters=30)
    with pytest.raises(SystemExit, match=r"--tokens must be positive .*\[0, 4\]"):
        comm.main(parser.parse_args(["--tokens", "0", "4"]))
    assert comm._first_layout("naive") == "standard"
    assert comm._first_layout("all_to_all") == "standard"
