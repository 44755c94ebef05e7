"""The communication layer in one process: the contract v2 pieces (``Pending``,
``CommSpec.dispatch_dtype``, ``supports``), the registry and ``auto``'s choice by capability,
argument checks, and both backends at W = 1 against a direct computation."""

from __future__ import annotations

import pytest
import torch

import epmoe
import epmoe.comm as registry
from epmoe.comm import available_backends, backend_class, create_backend, resolve_backend
from epmoe.comm.base import (
    FP8_DTYPE,
    AllToAll,
    Capabilities,
    CommSpec,
    Layout,
    Pending,
    check_dispatch_args,
)
from epmoe.reference import quantize_groups

CPU = torch.device("cpu")


def spec(**overrides) -> CommSpec:
    kwargs = dict(
        hidden_size=8,
        top_k=2,
        rank_offsets=(0, 5),
        max_num_tokens=4,
        dtype=torch.float32,
        device=CPU,
    )
    kwargs.update(overrides)
    return CommSpec(**kwargs)


def test_available_backends_on_cpu_names_every_backend():
    backends = available_backends("cpu")
    assert backends["naive"] is None and backends["all_to_all"] is None
    assert set(backends) == set(epmoe.available_backends("cpu")) == set(registry.backend_names())
    # symm_ll needs CUDA (or is not importable yet): either way a reason, not a crash
    assert isinstance(backends["symm_ll"], str) and backends["symm_ll"]


def test_available_backends_with_a_spec_gives_the_supports_reason():
    fp8 = available_backends(spec=spec(dispatch_dtype=FP8_DTYPE))
    assert fp8["naive"] is None and fp8["all_to_all"] is None  # device from the spec: CPU
    ints = available_backends(spec=spec(dtype=torch.int32))
    assert "params_dtype" in ints["naive"] and "params_dtype" in ints["all_to_all"]


def test_unknown_backend_lists_the_choices():
    with pytest.raises(ValueError, match="choose one of"):
        backend_class("fast")


def test_auto_picks_a_backend_offering_the_layout():
    cls = resolve_backend("auto", CPU, None, Layout.EXPERT_BATCHED)
    assert Layout.EXPERT_BATCHED in cls.capabilities.layouts


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(rank_offsets=(1, 5)), "rank_offsets"),
        (dict(rank_offsets=(0, 5, 3)), "rank_offsets"),
        (dict(hidden_size=0), "positive"),
        (dict(max_num_tokens=0), "positive"),
    ],
    ids=["offsets not from 0", "offsets decrease", "H = 0", "M_max = 0"],
)
def test_comm_spec_rejects_bad_values(overrides, match):
    with pytest.raises(ValueError, match=match):
        spec(**overrides)


def test_dispatch_dtype_is_the_hidden_dtype_or_fp8():
    plain, same = spec(), spec(dispatch_dtype=torch.float32)
    fp8 = spec(dispatch_dtype=FP8_DTYPE)
    assert (plain.wire_dtype, plain.fp8_dispatch) == (torch.float32, False)
    assert (same.wire_dtype, same.fp8_dispatch) == (torch.float32, False)
    assert (fp8.wire_dtype, fp8.fp8_dispatch) == (FP8_DTYPE, True)
    with pytest.raises(ValueError, match="dispatch_dtype must be None, the hidden dtype"):
        spec(dispatch_dtype=torch.bfloat16)


def test_spec_derived_sizes():
    s = spec(rank_offsets=(0, 3, 5, 5))
    assert (s.world_size, s.num_physical, s.max_local, s.num_local(2)) == (3, 5, 3, 0)


def test_backend_refuses_a_dtype_it_cannot_move():
    with pytest.raises(TypeError, match="params_dtype"):
        create_backend("all_to_all", spec(dtype=torch.int32), None)


def test_backend_refuses_a_world_size_mismatch():
    with pytest.raises(ValueError, match="ep_size=1"):
        create_backend("naive", spec(rank_offsets=(0, 2, 5)), None)


def test_dispatch_argument_checks():
    s = spec()
    x, ids, w = torch.randn(5, 8), torch.zeros(5, 2, dtype=torch.int64), torch.rand(5, 2)
    with pytest.raises(ValueError, match="max_num_tokens"):
        check_dispatch_args(s, x, ids, w, limit_tokens=True)
    check_dispatch_args(s, x, ids, w, limit_tokens=False)
    with pytest.raises(ValueError, match=r"\[T, 8\]"):
        check_dispatch_args(s, x[:, :7], ids, w, False)
    with pytest.raises(ValueError, match="K=2"):
        check_dispatch_args(s, x, ids[:, :1], w, False)
    with pytest.raises(TypeError, match="int32 or int64"):
        check_dispatch_args(s, x, ids.float(), w, False)
    with pytest.raises(TypeError, match="params_dtype"):
        check_dispatch_args(s, x.double(), ids, w, False)


@pytest.mark.parametrize(
    "name, layout",
    [
        ("naive", Layout.STANDARD),
        ("all_to_all", Layout.STANDARD),
        ("all_to_all", Layout.EXPERT_BATCHED),
    ],
    ids=["naive", "all_to_all standard", "all_to_all expert_batched"],
)
@pytest.mark.parametrize("T", [0, 1, 7], ids=["T=0", "T=1", "T=7"])
def test_single_rank_round_trip(name, layout, T):
    """W = 1: dispatch delivers every (token, expert) pair; combining the identity expert
    gives back Σ_k w · x. The caller may reuse its input buffers once the dispatch has
    finished (the contract): the combine must not read them."""
    g = torch.Generator().manual_seed(T)
    E, K, H = 5, 2, 8
    s = spec(max_num_tokens=8)
    comm = create_backend(name, s, None, layout)
    x = torch.randn(T, H, generator=g)
    ids = torch.rand(T, E, generator=g).argsort(1)[:, :K]
    w = torch.rand(T, K, generator=g)
    want, ids_given = x * w.sum(1, keepdim=True), ids.clone()
    res = comm.dispatch(x, ids, w)
    for buffer in (x, ids, w):
        buffer.fill_(3)  # reused by the caller for the next batch
    if layout is Layout.STANDARD:
        assert res.hidden.shape == (T, H)
        torch.testing.assert_close(res.topk_ids, ids_given)
        y = res.hidden * res.topk_weights.sum(1, keepdim=True)
    else:
        counts = torch.bincount(ids_given.reshape(-1), minlength=E)
        assert res.counts.tolist() == counts.tolist()
        y = res.hidden.clone()
    torch.testing.assert_close(comm.combine(y, res), want)


def test_all_to_all_standard_sends_no_row_for_a_token_without_experts():
    """W = 1, Standard: a token goes once to each rank holding one of its experts, so a
    token whose ids are all -1 (padding) is not sent at all; its combined row is zero."""
    comm = create_backend("all_to_all", spec(), None, Layout.STANDARD)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[0, 3], [-1, -1], [2, -1], [-1, -1]])
    w = torch.full((4, 2), 0.5)
    res = comm.dispatch(x, ids, w)
    assert res.hidden.shape == (2, 8)
    torch.testing.assert_close(res.hidden, x[[0, 2]])
    assert res.topk_ids.tolist() == [[0, 3], [2, -1]]
    out = comm.combine(res.hidden, res)
    torch.testing.assert_close(out, torch.stack([x[0], torch.zeros(8), x[2], torch.zeros(8)]))


@pytest.mark.parametrize("layout", [Layout.STANDARD, Layout.EXPERT_BATCHED], ids=lambda x: x.value)
@pytest.mark.parametrize("H", [8, 160], ids=["H=8", "H=160 (partial FP8 group)"])
@pytest.mark.parametrize("T", [6, 0], ids=["T=6", "T=0"])
def test_single_rank_fp8_dispatch(layout, H, T):
    """W = 1, FP8 dispatch: the rows arrive as ``quantize_groups`` gives them (values and
    scales bit for bit, in the layout's shape); combine returns the layer's dtype. T = 0
    with one FP8 group (H = 8): the scales of no rows have stride 0, which packing them
    for the wire once refused."""
    g = torch.Generator().manual_seed(H)
    E, K = 5, 2
    comm = create_backend("all_to_all", spec(hidden_size=H, dispatch_dtype=FP8_DTYPE), None, layout)
    x = torch.randn(T, H, generator=g)
    ids = torch.rand(T, E, generator=g).argsort(1)[:, :K]
    w = torch.rand(T, K, generator=g)
    res = comm.dispatch(x, ids, w)
    q, scale = quantize_groups(x)
    G = scale.shape[1]
    assert res.hidden.dtype == FP8_DTYPE and res.hidden_scale.dtype == torch.float32
    deq = lambda h, s: h.float() * s.repeat_interleave(128, -1)[..., :H]  # noqa: E731
    if layout is Layout.STANDARD:
        assert res.hidden_scale.shape == (T, G)
        assert torch.equal(res.hidden.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(res.hidden_scale, scale)
        y = deq(res.hidden, res.hidden_scale) * res.topk_weights.sum(1, keepdim=True)
    else:
        assert res.hidden_scale.shape == (*res.hidden.shape[:2], G)
        for slot in range(E):  # one token at most once per expert, in token order
            tok = (ids == slot).any(1).nonzero().squeeze(1)
            n = int(res.counts[slot])
            assert torch.equal(res.hidden[slot, :n].view(torch.uint8), q[tok].view(torch.uint8))
            assert torch.equal(res.hidden_scale[slot, :n], scale[tok])
        y = deq(res.hidden, res.hidden_scale)
    out = comm.combine(y.bfloat16(), res)  # experts on FP8 input may answer in bf16
    assert out.dtype == torch.float32
    want = (deq(q, scale) * w.sum(1, keepdim=True)).bfloat16().float()
    torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)


# --------------------------------------------------------------------------- Pending


def test_pending_finishes_once_and_keeps_its_result():
    calls = []
    p = Pending(lambda: calls.append("finish") or torch.arange(3))
    assert not p.finished and calls == []  # starting does not finish
    first = p.wait()
    assert p.finished and p.wait() is first and calls == ["finish"]


def test_pending_done_is_finished():
    value = torch.ones(2)
    p = Pending.done(value)
    assert p.finished and p.wait() is value


def test_split_phase_at_w1_in_any_finish_order():
    """Two dispatches in flight, finished in reverse; combines likewise. Each micro-batch
    gets its own Σ_k w · x back (identity experts)."""
    comm = create_backend("all_to_all", spec(max_num_tokens=8), None, Layout.STANDARD)
    g = torch.Generator().manual_seed(0)
    mbs = [
        (torch.randn(T, 8, generator=g), torch.randint(0, 5, (T, 2), generator=g),
         torch.rand(T, 2, generator=g))
        for T in (3, 5)
    ]  # fmt: skip
    d0, d1 = (comm.dispatch_async(*mb) for mb in mbs)
    r1, r0 = d1.wait(), d0.wait()
    c0, c1 = (
        comm.combine_async(r.hidden * r.topk_weights.sum(1, keepdim=True), r) for r in (r0, r1)
    )
    for (x, _, w), out in zip(mbs, (c0.wait(), c1.wait())):
        torch.testing.assert_close(out, x * w.sum(1, keepdim=True))


# ------------------------------------------------------------- supports and choice by capability


class _Fake(AllToAll):
    """A backend for registry tests: it is chosen or refused, never run."""

    def dispatch_async(self, hidden_TH, topk_ids_TK, topk_weights_TK):
        raise AssertionError("a registry test ran a fake backend")

    def combine_async(self, expert_out, result):
        raise AssertionError("a registry test ran a fake backend")


class FakeLL(_Fake):
    """Like a low-latency kernel: ExpertBatched, bf16, at most 8 tokens, FP8, graph safe."""

    name = "fake_ll"
    capabilities = Capabilities(
        layouts=frozenset({Layout.EXPERT_BATCHED}),
        dtypes=frozenset({torch.bfloat16}),
        device_types=frozenset({"cpu"}),
        max_num_tokens=8,
        graph_safe=True,
        fp8_dispatch=True,
        max_in_flight=2,
    )


class FakeCudaOnly(_Fake):
    name = "fake_cuda"
    capabilities = Capabilities(
        layouts=frozenset({Layout.STANDARD}),
        dtypes=frozenset({torch.float32}),
        device_types=frozenset({"cuda"}),
    )


class FakeNoFP8(_Fake):
    name = "fake_no_fp8"
    capabilities = Capabilities(
        layouts=frozenset({Layout.STANDARD}),
        dtypes=frozenset({torch.float32}),
        device_types=frozenset({"cpu"}),
        max_num_tokens=4,
    )


@pytest.fixture
def fake_registry(monkeypatch):
    """fake_cuda, broken, no_class, fake_ll, then the real portable backends."""
    here = __name__
    monkeypatch.setattr(
        registry,
        "_BACKENDS",
        {
            "fake_cuda": f"{here}:FakeCudaOnly",
            "broken": "epmoe.comm.no_such_module:Backend",
            "no_class": f"{here}:NoSuchClass",
            "fake_ll": f"{here}:FakeLL",
            "all_to_all": "epmoe.comm.all_to_all:AllToAllBackend",
            "naive": "epmoe.comm.naive:NaiveBackend",
        },
    )


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(dtype=torch.float32), "choose params_dtype among those"),
        (dict(device=torch.device("meta")), "pick another backend or device"),
        (dict(max_num_tokens=9), "lower max_num_tokens"),
    ],
    ids=["dtype", "device", "M_max above the limit"],
)
def test_supports_says_why_with_the_fix(overrides, match):
    s = spec(**{"dtype": torch.bfloat16, "max_num_tokens": 8, **overrides})
    assert FakeLL.supports(spec(dtype=torch.bfloat16, max_num_tokens=8)) is None
    assert match in FakeLL.supports(s)


def test_supports_refuses_fp8_dispatch_without_the_capability():
    assert FakeNoFP8.supports(spec()) is None
    assert "leave dispatch_dtype unset" in FakeNoFP8.supports(spec(dispatch_dtype=FP8_DTYPE))
    for cls in (backend_class("naive"), backend_class("all_to_all")):
        assert cls.capabilities.fp8_dispatch and cls.capabilities.max_in_flight is None
        assert cls.supports(spec(dispatch_dtype=FP8_DTYPE)) is None


def test_symm_ll_refuses_receive_buffers_too_large_for_the_gpu(monkeypatch):
    from types import SimpleNamespace

    from epmoe.comm.base import expert_batched_bytes

    ll = backend_class("symm_ll")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=140 * 2**30)
    )
    offsets = epmoe.ExpertPlacement.linear(256, 2).rank_offsets  # e = 128 on each rank

    def at(M: int, **kw) -> CommSpec:
        return CommSpec(7168, 8, offsets, M, torch.bfloat16, torch.device("cuda", 0), **kw)

    # [2, 128, 2·M, 7168] bf16: 7 GiB at M = 1024; 112 GiB at M = 16384
    assert expert_batched_bytes(at(1024), copies=2) == 2 * 128 * 2 * 1024 * 7168 * 2
    assert ll.supports(at(1024)) is None
    # rows read in place: only the experts' outputs [128, 2·M, 7168] grow with e·W·M (56.0
    # GiB), plus the symmetric buffer (two parities of rows each way, 1.75 GiB)
    reason = ll.supports(at(16384))
    assert "57.8 GiB of the GPU's 140 GiB" in reason and "lower max_num_tokens" in reason
    assert ll.supports(at(8192)) is None
    # rows copied into slabs: two parities of them too, refused before any buffer is taken
    with pytest.raises(ValueError, match="84.9 GiB of the GPU's 140 GiB"):  # 84.0 + 0.88
        ll(at(8192), None, Layout.EXPERT_BATCHED, rows_in_place=False)
    # FP8 rows are half as large, plus one float32 scale per 128 values
    fp8 = at(1024, dispatch_dtype=FP8_DTYPE)
    assert expert_batched_bytes(fp8, copies=2) == 2 * 128 * 2 * 1024 * (7168 + 224)
    # ... but the experts' outputs are in the hidden dtype: FP8 rows on the wire do not
    # make them fit (they were counted at the wire's size, half of theirs)
    assert "57.3 GiB" in ll.supports(at(16384, dispatch_dtype=FP8_DTYPE))  # 56.0 + 1.33
    assert expert_batched_bytes(fp8, 2, outputs=1) == 128 * 2 * 1024 * (2 * 7392 + 7168 * 2)


def test_auto_takes_the_first_backend_that_serves_the_spec(fake_registry):
    ll = spec(dtype=torch.bfloat16, max_num_tokens=8, dispatch_dtype=FP8_DTYPE)
    assert resolve_backend("auto", CPU, None, spec=ll) is FakeLL
    assert resolve_backend("auto", CPU, None, Layout.EXPERT_BATCHED, ll) is FakeLL
    a2a = backend_class("all_to_all")
    # the first usable backend without the fake's limits, for each limit in turn
    assert resolve_backend("auto", CPU, None, Layout.STANDARD, ll) is a2a  # layout
    assert resolve_backend("auto", CPU, None, spec=spec(dtype=torch.float32)) is a2a  # dtype
    assert resolve_backend("auto", CPU, None, spec=spec(max_num_tokens=64)) is a2a  # M_max
    assert resolve_backend("auto", CPU, None) is FakeLL  # no spec: any layout, no limits


def test_auto_under_capture_takes_only_graph_safe_backends(fake_registry):
    ll = spec(dtype=torch.bfloat16, max_num_tokens=8)
    assert resolve_backend("auto", CPU, None, spec=ll, capturing=True) is FakeLL
    with pytest.raises(RuntimeError, match="CUDA graph capture") as err:
        resolve_backend("auto", CPU, None, spec=spec(), capturing=True)
    msg = str(err.value)
    assert "fake_cuda: needs a device of type ['cuda']" in msg
    assert "broken: import failed (No module named 'epmoe.comm.no_such_module')" in msg
    assert "no_class: import failed (module " in msg and "defines no NoSuchClass)" in msg
    assert "fake_ll: it moves ['torch.bfloat16'], not torch.float32" in msg
    assert "all_to_all: not graph safe" in msg and "naive: not graph safe" in msg


def test_available_backends_reads_well_with_broken_entries(fake_registry):
    reasons = available_backends(CPU, spec=spec(dtype=torch.bfloat16, max_num_tokens=64))
    assert list(reasons) == registry.backend_names()
    assert reasons["fake_cuda"].startswith("needs a device of type")
    assert reasons["broken"].startswith("import failed (")
    assert "lower max_num_tokens" in reasons["fake_ll"]
    assert reasons["all_to_all"] is None and reasons["naive"] is None


def test_a_named_backend_that_cannot_run_names_the_usable_ones(fake_registry):
    with pytest.raises(RuntimeError, match=r"'fake_cuda' cannot run here: needs a device") as err:
        resolve_backend("fake_cuda", CPU, None)
    assert "usable here: ['fake_ll', 'all_to_all', 'naive'] or 'auto'" in str(err.value)
    with pytest.raises(RuntimeError, match="not graph safe"):
        resolve_backend("naive", CPU, None, capturing=True)
    with pytest.raises(ImportError, match="no_such_module"):
        resolve_backend("broken", CPU, None)


def test_rebind_refuses_another_world_size_and_keeps_the_spec():
    comm = create_backend("naive", spec(rank_offsets=(0, 5)), None)
    with pytest.raises(ValueError, match="rank_offsets must have 2 entries"):
        comm.rebind((0, 2, 5))
    assert comm.spec.rank_offsets == (0, 5)


def test_symm_ll_rows_design_from_the_environment(monkeypatch):
    """``EPMOE_SYMM_LL_ROWS`` picks symm_ll's receive design when the constructor is not
    told (in place by default, ``copy`` for comparison); anything else is refused by name,
    and ``epmoe.info`` flags it."""
    from epmoe.comm.symm.ll import _rows_in_place_default
    from epmoe.info import settings

    monkeypatch.delenv("EPMOE_SYMM_LL_ROWS", raising=False)
    assert _rows_in_place_default() is True and settings()["EPMOE_SYMM_LL_ROWS"]["ok"]
    monkeypatch.setenv("EPMOE_SYMM_LL_ROWS", "copy")
    assert _rows_in_place_default() is False and settings()["EPMOE_SYMM_LL_ROWS"]["ok"]
    monkeypatch.setenv("EPMOE_SYMM_LL_ROWS", "slabs")
    with pytest.raises(ValueError, match="EPMOE_SYMM_LL_ROWS must be in_place or copy"):
        _rows_in_place_default()
    assert not settings()["EPMOE_SYMM_LL_ROWS"]["ok"]
    with pytest.raises(TypeError, match="rows_in_place must be a bool"):
        backend_class("symm_ll")(None, None, rows_in_place="yes")


def test_symm_ll_refuses_copies_too_large_when_the_environment_asks_for_them(monkeypatch):
    """With ``EPMOE_SYMM_LL_ROWS=copy``, ``supports`` (what ``auto`` and the layer ask)
    counts the two parities of received slabs as well, so the refusal comes before any
    constructor; a bad value is a reason, not a crash."""
    from types import SimpleNamespace

    ll = backend_class("symm_ll")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=140 * 2**30)
    )
    offsets = epmoe.ExpertPlacement.linear(256, 2).rank_offsets
    spec = CommSpec(7168, 8, offsets, 8192, torch.bfloat16, torch.device("cuda", 0))
    monkeypatch.delenv("EPMOE_SYMM_LL_ROWS", raising=False)
    assert ll.supports(spec) is None
    monkeypatch.setenv("EPMOE_SYMM_LL_ROWS", "copy")
    assert "84.9 GiB of the GPU's 140 GiB" in ll.supports(spec)
    monkeypatch.setenv("EPMOE_SYMM_LL_ROWS", "bogus")
    assert "EPMOE_SYMM_LL_ROWS must be in_place or copy" in ll.supports(spec)


def test_capabilities_with_options():
    """An instance's capabilities can depend on its options (deepep_ht's worst-case rows make
    it graph safe); the class answers for the defaults, and so do backends without such."""
    deepep_ht = backend_class("deepep_ht")
    assert not deepep_ht.capabilities.graph_safe
    assert deepep_ht.capabilities_with(worst_case_rows=True).graph_safe
    assert deepep_ht.capabilities_with(worst_case_rows=False) == deepep_ht.capabilities
    symm_ll = backend_class("symm_ll")
    assert symm_ll.capabilities_with(rows_in_place=False) == symm_ll.capabilities


def test_conformance_suite_names_option_variants():
    from tests.distributed.comm_cases import OPTION_VARIANTS, caps_of, split_variant, variants

    names = variants(registry.backend_names())
    assert len(names) == sum(len(v) for v in OPTION_VARIANTS.values())
    assert "deepep_ht(worst_case_rows=True)" in names
    for name in names:
        base, options = split_variant(name)
        assert options in OPTION_VARIANTS[base]
        registry.check_backend_options(backend_class(base), options)  # real options only
    assert caps_of("deepep_ht(worst_case_rows=True)").graph_safe
    assert split_variant("all_to_all") == ("all_to_all", {})


def test_a_dispatch_dtype_equal_to_the_hidden_dtype_is_no_conversion():
    """``dispatch_dtype=dtype`` is kept as ``None``: a layer built so converts to another
    dtype later (it was refused, the message naming a dtype the user never passed)."""
    offsets = epmoe.ExpertPlacement.linear(4, 1).rank_offsets
    s = CommSpec(16, 2, offsets, 8, torch.float32, CPU, dispatch_dtype=torch.float32)
    assert s.dispatch_dtype is None and s.wire_dtype == torch.float32
    layer = epmoe.EPMoE(4, 2, 16, 8, params_dtype=torch.float32, device="cpu",
                        dispatch_dtype=torch.float32)  # fmt: skip
    layer.load_experts(torch.randn(4, 16, 16), torch.randn(4, 16, 8))
    layer.to(torch.bfloat16)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    assert layer(x, torch.randn(3, 4)).dtype == torch.bfloat16


def test_a_failed_wait_raises_again_and_never_runs_its_finish_twice():
    """A receive that raised (a timeout, an overflow) is not run again by a second
    ``wait()``: it would wait for flags the first run consumed."""
    from epmoe.comm.base import Pending

    runs = []

    def finish():
        runs.append(1)
        raise RuntimeError("overflowed an expert's rows")

    pending = Pending(finish)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="overflowed"):
            pending.wait()
    assert runs == [1] and pending.finished
    assert Pending.done(3).wait() == 3


def test_kernel_tags_keep_layers_and_their_copies_apart():
    from epmoe.comm.base import COPY_INDEX, layer_call_tag
    from epmoe.comm.symm.common import kernel_tag

    layers = [kernel_tag(layer_call_tag(i)) for i in range(200)]
    copies = [kernel_tag(layer_call_tag(COPY_INDEX + i)) for i in range(200)]
    assert layers == list(range(1, 201))  # a layer's own index + 1, as before
    assert len(set(layers + copies)) == 400 and all(0 < t < 2**15 for t in layers + copies)
    assert kernel_tag(0) == 0 and kernel_tag(layer_call_tag(16382)) == 16383
    assert kernel_tag(layer_call_tag(16383)) != 0  # wraps, never "untagged"


def test_symm_buffers_too_large_for_the_gpu_are_refused_alike_on_every_rank(monkeypatch):
    """symm_ht had no memory check: a buffer too large failed on some rank's allocation
    while the others waited in the rendezvous. Both symm backends now count their
    symmetric buffer in supports()."""
    from types import SimpleNamespace

    from epmoe.comm import backend_class
    from epmoe.comm.base import CommSpec
    from epmoe.comm.symm.common import symm_buffer_bytes

    gpu = SimpleNamespace(multi_processor_count=132, total_memory=140 * 2**30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: gpu)
    cuda = torch.device("cuda", 0)
    offsets = tuple(range(0, 257, 32))  # W = 8
    fits = CommSpec(16384, 8, offsets, 4096, torch.bfloat16, cuda)
    huge = CommSpec(16384, 8, offsets, 40000, torch.bfloat16, cuda)  # 39 GiB
    assert symm_buffer_bytes(huge) > 35 * 2**30 > symm_buffer_bytes(fits)
    ht, ll = backend_class("symm_ht"), backend_class("symm_ll")
    assert ht.supports(fits) is None
    assert "symm_ht's buffers" in ht.supports(huge) and "lower max_num_tokens" in ht.supports(huge)
    # symm_ll: its symmetric buffer counts with the experts' outputs; with one expert per
    # rank it is the larger part (4x the outputs), here what no longer fits 10 GiB
    gpu.total_memory = 40 * 2**30
    one_each = CommSpec(16384, 8, tuple(range(9)), 16000, torch.bfloat16, cuda)  # e = 1
    outputs = 8 * 16000 * 16384 * 2
    assert outputs < 10 * 2**30 < outputs + symm_buffer_bytes(one_each)
    assert "take 19.5 GiB of the GPU's 40 GiB" in ll.supports(one_each)
    assert ll.supports(CommSpec(16384, 8, tuple(range(9)), 4000, torch.bfloat16, cuda)) is None


SHARED_GPUS = (
    "needs an NCCL process group (on a gloo group for CUDA tensors, ranks that share a GPU, "
    "only symm_ll and symm_ht run)"
)


@pytest.mark.parametrize(
    "backend, symm, vendors",
    [
        ("nccl", None, None),
        ("cpu:gloo,cuda:nccl", None, None),
        ("cpu:gloo,cuda:gloo", None, SHARED_GPUS),  # ranks sharing a GPU (tests.harness)
        ("gloo", "needs an NCCL process group", "needs an NCCL process group"),
    ],
)
def test_backends_on_nvlink_peers_need_nccl_and_the_symm_ones_take_ranks_sharing_a_gpu(
    monkeypatch, backend, symm, vendors
):
    """The symm backends open peers' buffers by CUDA IPC where ranks share a GPU; DeepEP,
    pplx and the peer-store ceiling (torch's symmetric memory) cannot."""
    import torch.distributed as dist

    from epmoe.comm import base

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert base.one_nvlink_node_reason(None, ranks_may_share_gpus=True) == symm
    assert base.one_nvlink_node_reason(None) == vendors


def test_ranks_sharing_a_gpu_open_one_ipc_share_per_peer(monkeypatch):
    """Rank 1 of 3 shares its buffer once per peer (torch counts each share's consumers
    down from one) and opens, from each peer, the share that peer made for rank 1."""
    import torch.distributed as dist
    import torch.multiprocessing.reductions as reductions

    from epmoe.comm.symm import common

    made = []

    def reduce_tensor(tensor):
        made.append(tensor)
        return (lambda tag: ("view of", tag)), (f"r1->share{len(made)}",)

    def all_gather_object(out, obj, group=None):
        for s in range(3):
            out[s] = obj if s == 1 else [None if r == s else (f"r{s}->r{r}",) for r in range(3)]

    monkeypatch.setattr(reductions, "reduce_tensor", reduce_tensor)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    buffer = torch.zeros(4)
    views = common._open_peer_buffers(buffer, None, rank=1, world_size=3)
    assert len(made) == 2 and all(t is buffer for t in made)
    assert views[1] is buffer
    assert views[0] == ("view of", "r0->r1") and views[2] == ("view of", "r2->r1")
