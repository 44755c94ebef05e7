"""EPMoE in one process (no torch.distributed): construction checks, moves, forward hints,
the graph-safe forward, FP8 dispatch errors, re-plans through the layer, device spelling."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import epmoe
import epmoe.comm
from epmoe.comm import backend_class, backend_names
from epmoe.comm.all_to_all import AllToAllBackend
from epmoe.comm.base import Layout
from epmoe.comm.naive import NaiveBackend
from epmoe.distributed import default_device, normalize_device
from epmoe.eplb import migration
from epmoe.reference import assert_close
from tests.distributed.layer_v2_cases import (
    LOOPBACK,
    HostReads,
    LoggedMLP,
    PausedExperts,
    physical_counts,
    python_state,
)


def layer_and_weights(**kwargs):
    E, K, H, I = 8, 2, 16, 8
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) / 4, torch.randn(E, H, I, generator=g) / 3
    layer = epmoe.EPMoE(E, K, H, I, params_dtype=torch.float32, device="cpu", **kwargs)
    layer.load_experts(w13, w2)
    return layer, w13, w2


def test_to_dtype_converts_the_layer_and_its_backend():
    layer, w13, w2 = layer_and_weights()
    layer.to("cpu").float()  # no change
    assert layer.comm.spec.dtype == torch.float32 and layer.generation == 0
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), layer).to(torch.float64)
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert layer.params_dtype == torch.float64 and layer.generation == 1
    x, logits = torch.randn(5, 16, dtype=torch.float64), torch.randn(5, 8)
    ref = epmoe.reference.moe(x, w13.double(), w2.double(), *epmoe.select_experts(logits, 2))
    out = layer(x, logits)
    assert out.dtype == torch.float64 and layer.comm.spec.dtype == torch.float64
    assert_close(out, ref, 1e-12)
    assert_close(layer.bfloat16()(x, logits).double(), ref, 2e-2)


def test_to_another_device_or_dtype_it_cannot_run_is_refused_before_the_layer_changes():
    layer, *_ = layer_and_weights()
    with pytest.raises(RuntimeError, match="cannot be moved to meta"):
        layer.to("meta")
    layer.experts = type("Named", (), {"name": "triton"})()  # as Triton experts would say
    with pytest.raises(ValueError, match="experts='triton' computes in bfloat16"):
        layer.double()
    assert layer.w13.dtype == torch.float32 and layer.params_dtype == torch.float32


def test_a_backward_through_the_eager_layer_raises_with_the_fix():
    """Not a partial gradient (the routing and the other ranks' part would be missing)."""
    layer, *_ = layer_and_weights()
    x = torch.randn(5, 16, requires_grad=True)
    logits = torch.randn(5, 8, requires_grad=True)
    out = layer(x, logits)
    assert out.requires_grad
    with torch.no_grad():
        assert_close(out, layer(x, logits), 0.0)
    with pytest.raises(RuntimeError, match=r"no backward.*torch\.no_grad\(\)"):
        out.sum().backward()


def test_a_deep_copy_shares_the_process_group_and_builds_its_own_backend(monkeypatch):
    import copy

    layer, *_ = layer_and_weights()
    group = object()  # a process group cannot be copied: the copy must keep it as is
    monkeypatch.setattr(layer, "group", group)
    twin = copy.deepcopy(layer)
    assert twin.group is group and twin.comm is layer.comm
    assert twin.w13 is not layer.w13 and torch.equal(twin.w13, layer.w13)
    assert twin._op_id != layer._op_id
    x, logits = torch.randn(5, 16), torch.randn(5, 8)
    monkeypatch.setattr(twin, "group", layer._agreement.group)
    assert_close(twin(x, logits), layer(x, logits), 0.0)
    assert twin.comm is not layer.comm  # its own, built at its first forward
    assert_close(layer(x, logits), twin(x, logits), 0.0)  # the original's still serves


def test_a_backward_with_shared_experts_that_require_grad_raises():
    """Inputs that need no grad, parameters that do: no partial gradient either."""
    layer, *_ = layer_and_weights(shared_experts=torch.nn.Linear(16, 16))
    out = layer(torch.randn(5, 16), torch.randn(5, 8))
    with pytest.raises(RuntimeError, match="no backward"):
        out.sum().backward()
    assert layer.shared_experts.weight.grad is None


def test_a_float32_shared_output_is_added_before_any_bf16_rounding():
    """bf16 experts in a float32 model: the float32 shared experts' output is added to the
    routed output in float32, so the layer's output is routed + shared exactly."""
    shared = torch.nn.Linear(16, 16)
    _, w13, w2 = layer_and_weights()
    layer, routed = (
        epmoe.EPMoE(8, 2, 16, 8, params_dtype=torch.bfloat16, device="cpu", **kwargs)
        for kwargs in (dict(shared_experts=shared), {})
    )
    layer.load_experts(w13, w2)
    routed.load_experts(w13, w2)
    x, logits = torch.randn(9, 16), torch.randn(9, 8)
    with torch.no_grad():
        out = layer(x, logits)
        assert out.dtype == torch.float32
        assert torch.equal(out, routed(x, logits) + shared(x))


def test_load_state_dict_converts_floating_weights_after_to():
    """A shard saved in float32 loads into a layer converted to float64, as any module."""
    layer, w13, w2 = layer_and_weights()
    state = layer.state_dict()
    other, *_ = layer_and_weights()
    other.double()
    other.load_state_dict(state)
    assert other.w13.dtype == torch.float64 and torch.equal(other.w13, w13.double())


def test_triton_experts_on_cpu_are_refused_at_construction(monkeypatch):
    from epmoe.kernels import ops

    monkeypatch.setattr(ops, "interpreted", lambda: False)  # as without TRITON_INTERPRET=1
    with pytest.raises(ValueError, match="experts='triton' runs on CUDA devices, not cpu"):
        epmoe.EPMoE(8, 2, 16, 8, experts="triton", params_dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("T", [0, 5, 13], ids=["T=0", "T=5", "T=13 (chunks)"])
def test_max_tokens_across_ranks_hint_gives_the_same_output(T):
    layer, w13, w2 = layer_and_weights(max_num_tokens=4)
    x, logits = torch.randn(T, 16), torch.randn(T, 8)
    ref = epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, 2))
    assert_close(layer(x, logits, max_tokens_across_ranks=max(T, 1)), ref, 1e-5)


def test_a_hint_below_this_ranks_tokens_is_refused():
    layer, *_ = layer_and_weights()
    with pytest.raises(ValueError, match="max_tokens_across_ranks=4 is below"):
        layer(torch.randn(5, 16), torch.randn(5, 8), max_tokens_across_ranks=4)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(max_num_tokens=4.5), ValueError, "max_num_tokens"),
        (dict(scoring_func="softplus"), ValueError, "scoring_func"),
        (dict(layout="batched"), ValueError, "layout"),
        (dict(activation="relu"), ValueError, "activation"),
        (dict(placement="random"), ValueError, "placement"),
        (dict(params_dtype=torch.int32), TypeError, "params_dtype"),
        (dict(micro_batches=3), ValueError, "micro_batches must be 1 or 2"),
        (dict(micro_batches=True), ValueError, "micro_batches must be 1 or 2"),
    ],
    ids=["fractional M_max", "unknown scoring", "unknown layout", "unknown activation",
         "unknown placement", "integer params_dtype", "three micro-batches",
         "bool micro-batches"],
)  # fmt: skip
def test_construction_rejects_bad_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        epmoe.EPMoE(8, 2, 16, 8, device="cpu", **{"params_dtype": torch.float32, **kwargs})


def test_inputs_on_another_dtype_are_cast_and_returned_in_it():
    layer, w13, w2 = layer_and_weights()
    x, logits = torch.randn(6, 16, dtype=torch.float64), torch.randn(6, 8)
    out = layer(x, logits)
    assert out.dtype == torch.float64
    ref = epmoe.reference.moe(x.float(), w13, w2, *epmoe.select_experts(logits, 2))
    assert_close(out.float(), ref, 1e-5)


# ------------------------------------------------------------------ graph-safe forward


def _graph_safe_layer(monkeypatch, log=None, **kwargs):
    """A W = 1 layer on the graph-safe loopback backend (ExpertBatched), M_max = 4, with a
    load window of 4 and shared experts; returns it, its full weights and the shared MLP."""
    monkeypatch.setitem(epmoe.comm._BACKENDS, "loopback", LOOPBACK)
    shared = LoggedMLP(16, 8, "cpu", [] if log is None else log)
    layer, w13, w2 = layer_and_weights(
        backend="loopback", max_num_tokens=4, load_window=4, shared_experts=shared, **kwargs
    )
    return layer, w13, w2, shared


def test_hinted_forward_reads_nothing_back_and_keeps_its_python_state(monkeypatch):
    """With max_tokens_across_ranks the layer's own part of the forward (routing, placement,
    load recording, chunking, shared experts, casts) runs no op that reads a device value
    back, and changes no Python state a CUDA graph would freeze: three forwards with fresh
    inputs (as three graph replays) are all recorded and all match the oracle."""
    layer, w13, w2, shared = _graph_safe_layer(monkeypatch)
    T = 9  # three chunks of M_max = 4
    g = torch.Generator().manual_seed(1)
    inputs = [(torch.randn(T, 16, generator=g), torch.randn(T, 8, generator=g)) for _ in range(3)]
    reads = HostReads()
    layer.experts = PausedExperts(layer.experts, reads)  # the experts' syncs are theirs
    state = python_state(layer)
    outs = []
    with reads, torch.no_grad():
        for x, logits in inputs:
            outs.append(layer(x, logits, max_tokens_across_ranks=T))
    assert reads.ops == [], f"host reads in the hinted forward: {reads.ops}"
    assert python_state(layer) == state, "the forward changed Python state"
    counts = torch.zeros(layer.placement.num_physical, dtype=torch.int64)
    for out, (x, logits) in zip(outs, inputs):
        w, ids = epmoe.select_experts(logits, 2)
        with torch.no_grad():
            ref = epmoe.reference.moe(x, w13, w2, w, ids) + shared(x)
        assert_close(out, ref, 1e-5)
        counts += physical_counts(layer, logits)
    assert torch.equal(layer.load_recorder.window_load(), counts)


def test_the_host_read_detector_sees_reads():
    """The control for the test above: each kind of read it looks for is caught."""
    x = torch.arange(6.0)
    with HostReads() as reads:
        x.sum().item()
        x.tolist()
        torch.where(x > 2)
        x[x > 2]
        x.repeat_interleave(torch.tensor([1, 2, 1, 1, 1, 1]))
        with reads.paused():
            x.max().item()
    assert len(reads.ops) == 5, reads.ops


def test_hint_is_checked_at_the_boundary(monkeypatch):
    layer, *_ = _graph_safe_layer(monkeypatch)
    x, logits = torch.randn(3, 16), torch.randn(3, 8)
    with pytest.raises(TypeError, match="max_tokens_across_ranks must be an int"):
        layer(x, logits, max_tokens_across_ranks=3.0)
    with pytest.raises(TypeError, match="max_tokens_across_ranks must be an int"):
        layer(x, logits, max_tokens_across_ranks=True)
    with pytest.raises(ValueError, match="router_logits is on meta"):
        layer(x, logits.to("meta"), max_tokens_across_ranks=3)


# ------------------------------------------------------------------ FP8 on the wire


class _NoFP8Backend(NaiveBackend):
    """naive without FP8 dispatch: the error path, whichever backends gain FP8."""

    name = "no_fp8"
    capabilities = dataclasses.replace(NaiveBackend.capabilities, fp8_dispatch=False)


def test_fp8_dispatch_needs_a_backend_that_offers_it(monkeypatch):
    monkeypatch.setitem(epmoe.comm._BACKENDS, "no_fp8", f"{__name__}:_NoFP8Backend")
    offering = [n for n in backend_names() if backend_class(n).capabilities.fp8_dispatch]
    with pytest.raises(ValueError, match="dispatch_dtype") as info:
        layer_and_weights(backend="no_fp8", dispatch_dtype=torch.float8_e4m3fn)
    assert "fp8_dispatch" in str(info.value) and str(offering) in str(info.value)
    with pytest.raises(ValueError, match="dispatch_dtype"):
        layer_and_weights(dispatch_dtype=torch.float16)


class _OneInFlightBackend(NaiveBackend):
    name = "one_in_flight"
    capabilities = dataclasses.replace(NaiveBackend.capabilities, max_in_flight=1)


def test_two_micro_batches_need_two_results_in_flight(monkeypatch):
    monkeypatch.setitem(epmoe.comm._BACKENDS, "one_in_flight", f"{__name__}:_OneInFlightBackend")
    with pytest.raises(ValueError, match="micro_batches=2 needs 2 dispatch results in flight"):
        layer_and_weights(backend="one_in_flight", micro_batches=2)
    layer, *_ = layer_and_weights(backend="one_in_flight")  # one micro-batch: fine
    assert layer.micro_batches == 1


def test_fp8_dispatch_with_auto_picks_a_backend_that_offers_it():
    if not any(backend_class(n).capabilities.fp8_dispatch for n in backend_names()):
        pytest.skip("no registered backend offers FP8 dispatch yet")
    layer, *_ = layer_and_weights(dispatch_dtype=torch.float8_e4m3fn)
    assert layer.comm.capabilities.fp8_dispatch
    assert layer.dispatch_dtype == layer.comm.spec.dispatch_dtype == torch.float8_e4m3fn
    assert "dispatch_dtype=torch.float8_e4m3fn" in repr(layer)


# ------------------------------------------------------------------ re-plans and devices


def test_rebalance_installs_through_the_layer_and_rebinds_its_backend(monkeypatch):
    """W = 1, linear → balanced with two redundant slots (P 8 → 10, new rank_offsets): the
    layer keeps its backend object (rebind), takes new weight parameters for the new slot
    count, resets its recorder for the new P, and still matches the oracle."""
    layer, w13, w2 = layer_and_weights(backend="all_to_all", load_window=2)
    comm, param = layer.comm, layer.w13
    layer(torch.randn(4, 16), torch.randn(4, 8))
    new = epmoe.ExpertPlacement.balanced(torch.arange(1.0, 9.0), ep_size=1, num_redundant=2)
    stats = layer.rebalance(new)
    x, logits = torch.randn(6, 16), torch.randn(6, 8)
    assert layer.comm is comm and comm.spec.rank_offsets == new.rank_offsets == (0, 10)
    assert layer.placement == new and layer.w13 is not param and layer.w13.shape[0] == 10
    assert isinstance(layer.w13, torch.nn.Parameter) and not layer.w13.requires_grad
    assert layer.load_recorder.counts_SP.shape == (2, 10) and layer.load_recorder.step == 0
    before, after = epmoe.ExpertPlacement.linear(8, 1).local_experts(0), new.local_experts(0)
    changed = sum(s >= len(before) or before[s] != x for s, x in enumerate(after))
    assert stats.slots_moved == changed >= 2, (stats, changed)
    assert_close(
        layer(x, logits), epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, 2))
    )


def test_swap_placement_checks_what_it_installs():
    layer, *_ = layer_and_weights()
    new = epmoe.ExpertPlacement.balanced(torch.arange(1.0, 9.0), ep_size=1, num_redundant=2)
    with pytest.raises(ValueError, match=r"slot_tensors must hold \['w13', 'w2'\]"):
        layer._swap_placement(new, {"w13": layer.w13})
    with pytest.raises(ValueError, match=r"slot_tensors\['w13'\] must be \[10, 16, 16\]"):
        layer._swap_placement(new, {"w13": layer.w13, "w2": layer.w2})
    with pytest.raises(ValueError, match="ep_size"):
        layer.check_placement(epmoe.ExpertPlacement.linear(8, 2))
    assert layer.placement == epmoe.ExpertPlacement.linear(8, 1)  # nothing was installed


def test_migration_never_assigns_layer_state():
    """Ownership: epmoe.eplb.migration computes and moves weights; the layer installs them
    (EPMoE._swap_placement). No assignment to a layer attribute, no setattr on a layer."""
    tree = ast.parse(Path(migration.__file__).read_text())
    offending = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr":
            targets = node.args[:1]
        for t in targets:
            base = t.value if isinstance(t, ast.Attribute) else t
            if isinstance(base, ast.Name) and base.id == "layer":
                offending.append(f"line {node.lineno}: {ast.unparse(node)[:60]}")
    assert not offending, offending


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16])
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "copied"])
def test_migrate_slots_moves_any_float_dtype(dtype, in_place):
    """``migrate_slots`` takes any dtype: 1-byte floats move as their bytes (no
    ``index_copy_`` kernel, no gloo type for them), in place and copied."""
    old = epmoe.ExpertPlacement.from_physical_to_logical([0, 1, 2, 3], 1)
    new = epmoe.ExpertPlacement.from_physical_to_logical([3, 1, 2, 0], 1)
    t = torch.arange(4.0)[:, None].expand(4, 3).contiguous().to(dtype)
    (out,) = migration.migrate_slots(old, new, 0, [t], in_place=in_place)
    assert out.dtype == dtype and (out is t) == in_place
    assert out[:, 0].float().tolist() == [3.0, 1.0, 2.0, 0.0]


def test_devices_have_one_spelling():
    assert normalize_device("cpu:0") == torch.device("cpu") == normalize_device("cpu")
    if torch.cuda.is_available():
        assert normalize_device("cuda").index == torch.cuda.current_device()
    else:
        with pytest.raises(ValueError, match="CUDA is not available"):
            normalize_device("cuda")
        assert default_device() == torch.device("cpu")
    layer = epmoe.EPMoE(8, 2, 16, 8, params_dtype=torch.float32, device="cpu:0")
    assert layer.device == torch.device("cpu")  # so CPU inputs (device "cpu") are accepted


class _FixedBufferBackend(AllToAllBackend):
    """Stands in for symm_ll in ``auto``'s choice: graph safe with fixed buffers of
    ``default_max_tokens`` (the transfers are all_to_all's; the test checks the routing)."""

    capabilities = dataclasses.replace(
        AllToAllBackend.capabilities,
        layouts=frozenset({Layout.EXPERT_BATCHED}),
        graph_safe=True,
        default_max_tokens=4,
    )
    calls: list[str] = []

    def dispatch_async(self, hidden_TH, topk_ids_TK, topk_weights_TK):
        _FixedBufferBackend.calls.append(f"fixed T={hidden_TH.shape[0]}")
        return super().dispatch_async(hidden_TH, topk_ids_TK, topk_weights_TK)


def _register(monkeypatch, *, prefill: bool = False) -> None:
    """Put the stand-ins in the backend registry: the fixed-buffer one first (``auto``'s
    decode choice) and, with ``prefill``, the prefill one last."""
    registry = {"fixed": f"{__name__}:_FixedBufferBackend", **epmoe.comm._BACKENDS}
    if prefill:
        registry["prefill"] = f"{__name__}:_PrefillBackend"
    monkeypatch.setattr(epmoe.comm, "_BACKENDS", registry)


def _assert_oracle(layer, w13, w2, tokens) -> None:
    """``layer`` (from ``layer_and_weights``) equals the oracle for each token count."""
    E, K, H = 8, 2, 16
    for T in tokens:
        x, logits = torch.randn(T, H), torch.randn(T, E)
        out = layer(x, logits)
        w, ids = epmoe.select_experts(logits, K)
        assert_close(out, epmoe.reference.moe(x, w13, w2, w, ids), 1e-5, name=f"T={T}")


def test_auto_sends_decode_steps_to_the_fixed_buffer_backend_and_prefill_elsewhere(monkeypatch):
    """``auto`` builds a graph-safe fixed-buffer backend beside the general one: steps whose
    largest T fits its buffers run there, larger ones on the general backend, unchunked."""
    _register(monkeypatch)
    _FixedBufferBackend.calls = []
    layer, w13, w2 = layer_and_weights()
    assert layer.comm.name == "all_to_all"
    assert isinstance(layer.decode_comm, _FixedBufferBackend) and layer.decode_max_tokens == 4
    assert "decode_backend" in repr(layer)
    _assert_oracle(layer, w13, w2, (0, 3, 4, 9))
    # T = 0, 3, 4 fit the fixed buffers; T = 9 goes to all_to_all in one chunk
    assert _FixedBufferBackend.calls == ["fixed T=0", "fixed T=3", "fixed T=4"]
    # a named backend gets no decode twin
    named, *_ = layer_and_weights(backend="all_to_all")
    assert named.decode_comm is None


class _PrefillBackend(AllToAllBackend):
    """Stands in for symm_ht in ``auto``'s choice: graph safe, Standard, fixed buffers
    larger than the decode backend's."""

    capabilities = dataclasses.replace(
        AllToAllBackend.capabilities,
        layouts=frozenset({Layout.STANDARD}),
        graph_safe=True,
        default_max_tokens=8,
    )

    def dispatch_async(self, hidden_TH, topk_ids_TK, topk_weights_TK):
        _FixedBufferBackend.calls.append(f"prefill T={hidden_TH.shape[0]}")
        return super().dispatch_async(hidden_TH, topk_ids_TK, topk_weights_TK)


def test_auto_sends_larger_steps_to_a_prefill_backend_with_larger_fixed_buffers(monkeypatch):
    """With a second graph-safe fixed-buffer backend sized for larger steps (symm_ht
    beside symm_ll), ``auto`` makes it the layer's main backend: decode steps go to the
    smaller one, larger steps to it in chunks of its buffers; all_to_all is not used."""
    _register(monkeypatch, prefill=True)
    _FixedBufferBackend.calls = []
    layer, w13, w2 = layer_and_weights()
    assert isinstance(layer.comm, _PrefillBackend) and layer.max_num_tokens == 8
    assert isinstance(layer.decode_comm, _FixedBufferBackend) and layer.decode_max_tokens == 4
    _assert_oracle(layer, w13, w2, (3, 9))
    # T = 3 fits the decode buffers; T = 9 runs on the prefill backend in chunks of 8
    assert _FixedBufferBackend.calls == ["fixed T=3", "prefill T=8", "prefill T=1"]
    # the Standard layout asked for: the prefill backend serves every step (no decode twin)
    standard, *_ = layer_and_weights(layout="standard")
    assert isinstance(standard.comm, _PrefillBackend) and standard.decode_comm is None
    # ExpertBatched asked for: the decode backend beside the per-call general one
    batched, *_ = layer_and_weights(layout="expert_batched")
    assert batched.comm.name == "all_to_all"
    assert isinstance(batched.decode_comm, _FixedBufferBackend)


def test_two_micro_batches_split_larger_steps_and_leave_decode_steps_whole(monkeypatch):
    """micro_batches=2 with auto's decode twin: a decode-sized step runs whole on the decode
    backend (halves would read every weight twice), a larger one in two halves; both equal
    the oracle."""
    _register(monkeypatch)
    calls: list[str] = []
    original = AllToAllBackend.dispatch_async  # (the fixed-buffer stand-in calls it too)

    def counted(self, x, ids, w):
        calls.append(f"{type(self).__name__} T={x.shape[0]}")
        return original(self, x, ids, w)

    monkeypatch.setattr(AllToAllBackend, "dispatch_async", counted)
    layer, w13, w2 = layer_and_weights(micro_batches=2)
    assert isinstance(layer.decode_comm, _FixedBufferBackend)
    _assert_oracle(layer, w13, w2, (3, 9))
    assert calls == [
        "_FixedBufferBackend T=3",  # decode: whole
        "AllToAllBackend T=5",  # larger: two halves
        "AllToAllBackend T=4",
    ], calls


def test_load_recording_paused_restores_each_recorders_own_setting():
    """The warm-ups before a graph capture record no load; afterwards every recorder is as
    it was, a disabled one included, also when a warm-up raises."""
    from epmoe.decode_graphs import load_recording_paused

    on, off = (layer_and_weights(load_window=2)[0] for _ in range(2))
    off.load_recorder.enabled = False
    x, logits = torch.randn(3, 16), torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="warm-up failed"), load_recording_paused([on, off]):
        on(x, logits)
        assert not on.load_recorder.enabled and not off.load_recorder.enabled
        raise RuntimeError("warm-up failed")
    assert int(on.load_recorder.window_load().sum()) == 0
    assert on.load_recorder.enabled and not off.load_recorder.enabled


@pytest.mark.parametrize("hinted", [True, False], ids=["graph-safe path", "agreed path"])
def test_padding_rows_past_num_valid_tokens_go_to_no_expert(hinted):
    layer, w13, w2 = layer_and_weights(max_num_tokens=4, load_window=2)
    T, n = 7, 3  # a bucket of 7 rows, 3 of them real
    x, logits = torch.randn(T, 16), torch.randn(T, 8)
    hint = dict(max_tokens_across_ranks=T) if hinted else {}
    out = layer(x, logits, num_valid_tokens=torch.tensor([n]), **hint)
    w, ids = epmoe.select_experts(logits[:n], 2)
    assert_close(out[:n], epmoe.reference.moe(x[:n], w13, w2, w, ids), 1e-5)
    assert torch.equal(out[n:], torch.zeros(T - n, 16))  # routed nowhere
    # only the real rows are recorded as expert load
    assert int(layer.load_recorder.window_load().sum()) == n * 2
    # a replay with another count: the same call, another tensor value
    out = layer(x, logits, num_valid_tokens=torch.tensor(T), **hint)
    assert_close(out, epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, 2)), 1e-5)


@pytest.mark.parametrize("hinted", [True, False], ids=["graph-safe path", "agreed path"])
def test_rows_masked_out_by_num_valid_tokens_go_to_no_expert(hinted):
    """A bool mask [T]: the rows where it is False (finished requests of a static batch,
    anywhere in it) go to no expert and are not recorded; the others as without it."""
    layer, w13, w2 = layer_and_weights(max_num_tokens=4, load_window=2)
    T = 7
    x, logits = torch.randn(T, 16), torch.randn(T, 8)
    real = torch.tensor([True, False, True, True, False, True, False])
    hint = dict(max_tokens_across_ranks=T) if hinted else {}
    out = layer(x, logits, num_valid_tokens=real, **hint)
    w, ids = epmoe.select_experts(logits[real], 2)
    assert_close(out[real], epmoe.reference.moe(x[real], w13, w2, w, ids), 1e-5)
    assert torch.equal(out[~real], torch.zeros(int((~real).sum()), 16))
    assert int(layer.load_recorder.window_load().sum()) == int(real.sum()) * 2


@pytest.mark.parametrize("layout", ["standard", "expert_batched"])
@pytest.mark.parametrize("mask", [False, True], ids=["a count", "a mask"])
def test_padding_rows_with_garbage_logits_give_zero_rows(layout, mask):
    """A padding row's router logits may be garbage (NaN, or all -inf where the caller
    masked it: softmax gives NaN weights): its routed output is still zero. The
    ExpertBatched combine weights every slot, so the weights are zeroed with the ids."""
    layer, w13, w2 = layer_and_weights(layout=layout)
    T, n = 5, 3
    x, logits = torch.randn(T, 16), torch.randn(T, 8)
    logits[3], logits[4] = float("nan"), float("-inf")
    valid = torch.arange(T) < n if mask else torch.tensor(n)
    out = layer(x, logits, num_valid_tokens=valid)
    w, ids = epmoe.select_experts(logits[:n], 2)
    assert_close(out[:n], epmoe.reference.moe(x[:n], w13, w2, w, ids), 1e-5)
    assert torch.equal(out[n:], torch.zeros(T - n, 16))


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [(3, TypeError, "one-element integer tensor"), (torch.tensor([1.0]), ValueError, "integer"),
     (torch.tensor([1, 2]), ValueError, "one-element"),
     (torch.tensor([1 + 0j]), ValueError, "integer"),
     (torch.ones(3, dtype=torch.bool), ValueError, r"one value per row, shape \(4,\)")],
    ids=["an int", "a float tensor", "two elements", "complex", "a mask of another length"],
)  # fmt: skip
def test_num_valid_tokens_is_checked(value, error, match):
    layer, *_ = layer_and_weights()
    with pytest.raises(error, match=match):
        layer(torch.randn(4, 16), torch.randn(4, 8), num_valid_tokens=value)


@pytest.mark.parametrize("count", [5, -1])
def test_a_count_outside_the_batch_raises_where_the_layer_agrees(count):
    """Checked on the device and read back with the agreement (one rank here); the
    graph-safe path never waits for the device: above T means every row, below 0 none."""
    layer, w13, w2 = layer_and_weights()
    x, logits = torch.randn(4, 16), torch.randn(4, 8)
    with pytest.raises(ValueError, match=rf"num_valid_tokens={count} on this rank, whose batch"):
        layer(x, logits, num_valid_tokens=torch.tensor(count))
    out = layer(x, logits, num_valid_tokens=torch.tensor(count), max_tokens_across_ranks=4)
    expected = layer(x, logits) if count > 0 else torch.zeros(4, 16)
    assert_close(out, expected, 0.0)


def test_a_layer_saved_before_the_rebuild_state_still_runs():
    """``torch.save(layer)`` from before ``_comm_pending`` existed: defaults on load."""
    layer, w13, w2 = layer_and_weights()
    state = dict(layer.__dict__)
    for name in ("_comm_pending", "_comm_shared", "backend_options"):
        state.pop(name)
    old = epmoe.EPMoE.__new__(epmoe.EPMoE)
    old.__setstate__(state)
    assert old._comm_pending is False and old._comm_shared is False
    x, logits = torch.randn(5, 16), torch.randn(5, 8)
    assert_close(old(x, logits), layer(x, logits), 0.0)
    old.double()
    assert old(x.double(), logits).dtype == torch.float64  # the rebuild reads no options


def test_load_state_dict_with_assign_takes_the_layers_dtype():
    layer, w13, w2 = layer_and_weights()
    other, *_ = layer_and_weights()
    other.double()
    other.load_state_dict(layer.state_dict(), assign=True)
    assert other.w13.dtype == other.w2.dtype == torch.float64
    x, logits = torch.randn(5, 16, dtype=torch.float64), torch.randn(5, 8)
    ref = epmoe.reference.moe(x, w13.double(), w2.double(), *epmoe.select_experts(logits, 2))
    assert_close(other(x, logits), ref, 1e-12)


def test_fp8_weights_are_never_converted_by_to():
    """Not into bf16 on a no-op .to(), and not into a temporary on a real change."""
    layer = epmoe.EPMoE(
        8, 2, 256, 128, params_dtype=torch.float32, device="cpu",
        weight_dtype=torch.float8_e4m3fn,
    )  # fmt: skip
    seen = []
    w13 = layer.w13
    layer.to(torch.float32)
    layer._apply(lambda t: seen.append(t.dtype) or t)
    layer.half()
    assert layer.w13 is w13 and layer.w13.dtype == torch.float8_e4m3fn
    assert layer.w13_scale.dtype == torch.float32
    assert torch.float8_e4m3fn not in seen, "an FP8 weight went through the conversion"


def test_a_layer_built_under_a_meta_device_context_is_where_its_device_says():
    """``with torch.device("meta")`` around construction (as model builders do) does not
    move a layer given ``device=``, nor its host tables: it loads and matches the oracle."""
    E, K, H, I = 8, 2, 16, 8
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    load = torch.arange(1, E + 1, dtype=torch.float64)
    with torch.device("meta"):
        placement = epmoe.ExpertPlacement.balanced(load, ep_size=1, num_redundant=2)
        layer = epmoe.EPMoE(E, K, H, I, placement=placement, device="cpu", experts="torch",
                            params_dtype=torch.float32)  # fmt: skip
    assert layer.w13.device.type == "cpu" and not layer.meta_slot_tensors()
    layer.load_experts(w13, w2)
    x, logits = torch.randn(5, H, generator=g), torch.randn(5, E, generator=g)
    ref = epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, K))
    assert_close(layer(x, logits), ref, 1e-5)
