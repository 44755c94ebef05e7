"""The DeepEP and pplx-kernels adapters' plumbing on one CPU process, against stand-in
``deep_ep`` / ``pplx_kernels`` modules that implement the calls they make with the
libraries' documented semantics for one rank
(``Buffer.get_dispatch_layout`` / ``dispatch`` / ``combine``; ``low_latency_dispatch`` /
``low_latency_combine`` with receive hooks). What it checks: the arguments they pass
(int64 ids, float32 weights, FP8 rows as (e4m3, scales)), the layouts they hand to the
experts, the oracle's output through them, the two-buffer limit, one shared buffer per
group and its explicit destroy, a closed hold's error, the refusals of ``supports``, and
the ImportError that says how to install DeepEP. The real library runs in the GPU tier
(the conformance suite, ``tests/distributed/test_comm_v2.py``, parametrised over the
registry).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types

import pytest
import torch

import epmoe
from epmoe.comm import transport
from epmoe.comm.base import FP8_DTYPE, AllToAll, CommSpec, Layout
from epmoe.reference import assert_close, expert_mlp, quantize_groups

E, K, H, I, T = 8, 3, 2048, 32, 5  # H: one of DeepEP LL's hidden sizes


class _FakeBuffer:
    """DeepEP's Buffer for W = 1 (every expert local), in torch, on CPU tensors."""

    destroyed = 0
    created = 0

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                 num_qps_per_rank=24, explicitly_destroy=False):  # fmt: skip
        assert explicitly_destroy, "the adapters destroy their buffers explicitly"
        self.low_latency_mode = low_latency_mode
        self.calls: list[str] = []
        _FakeBuffer.created += 1

    num_sms = 20  # (DeepEP's class attribute, read by its recommended configs)

    class _Config:  # deep_ep.Config: (num_sms, NVLink chunk tokens, NVLink receive tokens)
        def __init__(self, num_sms=20, send=6, recv=256):
            self.fields = (num_sms, send, recv)

        def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
            return 1 << 20

    @staticmethod
    def get_dispatch_config(num_ranks):
        return _FakeBuffer._Config(_FakeBuffer.num_sms, 24, 256)

    @staticmethod
    def get_combine_config(num_ranks):
        return _FakeBuffer._Config(_FakeBuffer.num_sms, 10, 256)

    @staticmethod
    def get_low_latency_rdma_size_hint(M, hidden, num_ranks, num_experts):
        return 1 << 20

    def destroy(self):
        _FakeBuffer.destroyed += 1

    # normal mode
    def get_dispatch_layout(self, topk_idx, num_experts):
        assert topk_idx.dtype == torch.int64
        per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts).int()
        in_rank = (topk_idx >= 0).any(1, keepdim=True)
        return torch.tensor([int(in_rank.sum())]).int(), None, per_expert, in_rank, None

    def dispatch(self, x, topk_idx=None, topk_weights=None, num_tokens_per_rank=None,
                 num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                 num_tokens_per_expert=None, num_worst_tokens=0, config=None):  # fmt: skip
        assert topk_weights.dtype == torch.float32
        self.calls.append(("dispatch config", config and config.fields))
        keep = is_token_in_rank[:, 0]
        rows = (x[0][keep], x[1][keep]) if isinstance(x, tuple) else x[keep]
        ids, weights = topk_idx[keep], topk_weights[keep]
        if num_worst_tokens:  # rows past the received ones: ids -1, the rest left unset
            assert num_worst_tokens >= ids.shape[0]
            pad = num_worst_tokens - ids.shape[0]
            garbage = lambda t: torch.cat([t, torch.full((pad, *t.shape[1:]), float("nan"),  # noqa: E731
                                                         dtype=t.dtype)])  # fmt: skip
            rows = tuple(map(garbage, rows)) if isinstance(rows, tuple) else garbage(rows)
            ids = torch.cat([ids, torch.full((pad, ids.shape[1]), -1, dtype=ids.dtype)])
            weights = garbage(weights)
            return rows, ids, weights, [], keep, None
        return rows, ids, weights, [], keep, None

    def combine(self, x, handle, config=None):
        self.calls.append(("combine config", config and config.fields))
        out = torch.zeros(handle.shape[0], x.shape[1], dtype=x.dtype)
        out[handle] = x[: int(handle.sum())]  # unweighted, one row per token (worst case:
        # the rows past the received ones are never read)
        return out, None, None

    # low-latency mode
    def low_latency_dispatch(self, x, topk_idx, M, num_experts, use_fp8=True,
                             return_recv_hook=False):  # fmt: skip
        assert x.dtype == torch.bfloat16 and topk_idx.dtype == torch.int64
        self.calls.append("dispatch" if return_recv_hook else "dispatch, both phases")
        recv = torch.zeros(num_experts, M, x.shape[1], dtype=torch.bfloat16)
        counts = torch.zeros(num_experts, dtype=torch.int32)
        where = []
        for t in range(x.shape[0]):
            for k in range(topk_idx.shape[1]):
                e = int(topk_idx[t, k])
                if e >= 0:
                    recv[e, counts[e]] = x[t]
                    where.append((t, k, e, int(counts[e])))
                    counts[e] += 1
        if use_fp8:
            q, s = quantize_groups(recv.float())
            recv = (q, s.transpose(-1, -2).contiguous().transpose(-1, -2))  # column-major
        hook = (lambda: self.calls.append("recv hook")) if return_recv_hook else None
        return recv, counts, (where, x.shape[0]), None, hook

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, return_recv_hook=False):
        self.calls.append("combine" if return_recv_hook else "combine, both phases")
        where, T_ = handle
        out = torch.zeros(T_, x.shape[-1], dtype=torch.float32)
        for t, k, e, row in where:
            out[t] += topk_weights[t, k] * x[e, row].float()
        hook = (lambda: self.calls.append("combine hook")) if return_recv_hook else None
        return out.to(torch.bfloat16), None, hook


@pytest.fixture
def fake_deep_ep(monkeypatch):
    module = types.ModuleType("deep_ep")
    module.Buffer, module.Config = _FakeBuffer, _FakeBuffer._Config
    monkeypatch.setitem(sys.modules, "deep_ep", module)
    monkeypatch.setattr(transport, "_nvshmem_owner", None)
    _FakeBuffer.created = _FakeBuffer.destroyed = 0
    yield module
    transport.close_all()


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.rand(T, E, generator=g).argsort(1)[:, :K]
    ids[0, 1] = -1
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    return x, ids, w, w13, w2


def _spec(fp8=False, M=8):
    return CommSpec(H, K, (0, E), M, torch.bfloat16, torch.device("cpu"),
                    dispatch_dtype=FP8_DTYPE if fp8 else None)  # fmt: skip


def _backend(cls_name, spec, layout, **options):
    from epmoe.comm import backend_class

    cls = backend_class(cls_name)

    class OnCPU(cls):  # the adapter's code, on CPU tensors
        capabilities = cls.capabilities.__class__(
            **{**cls.capabilities.__dict__, "device_types": frozenset({"cpu"})}
        )

    return OnCPU(spec, None, layout, **options)


def _rows(hidden, scale):
    x = hidden.float()
    if scale is not None:
        x = x * scale.repeat_interleave(128, -1)[..., : x.shape[-1]]
    return x


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_ht_delivers_the_standard_layout_and_combines_to_the_oracle(fake_deep_ep, fp8):
    x, ids, w, w13, w2 = _inputs()
    comm = _backend("deepep_ht", _spec(fp8), Layout.STANDARD)
    res = comm.dispatch(x, ids, w)
    assert res.layout is Layout.STANDARD and res.topk_ids.dtype == torch.int64
    assert (res.hidden_scale is not None) == fp8
    rows = _rows(res.hidden, res.hidden_scale)
    y = torch.zeros_like(rows)
    for r in range(rows.shape[0]):  # Standard experts: each row's weighted sum
        for k in range(K):
            e = int(res.topk_ids[r, k])
            if e >= 0:
                y[r] += res.topk_weights[r, k] * expert_mlp(rows[r : r + 1], w13[e], w2[e])[0]
    out = comm.combine(y.to(torch.bfloat16), res)
    # every token has an expert here (W = 1), delivered in order: the rows as sent (FP8:
    # quantized by the Triton kernel, whose interpreter rounds e4m3 a little apart from
    # torch; the GPU tests check the kernel bit for bit)
    assert rows.shape[0] == T
    assert_close(out, epmoe.reference.moe(rows, w13, w2, w, ids), 2e-2, name="deepep_ht")
    comm.close()
    assert _FakeBuffer.destroyed == 1


def test_ht_worst_case_rows_fill_every_row_and_need_no_host_count(fake_deep_ep):
    """``worst_case_rows=True``: DeepEP's ``num_worst_tokens`` (W·M rows, no CPU sync)
    is asked for; rows no token filled come back with ids -1 and weight 0 (DeepEP leaves
    their weights unset), combine matches the oracle, this instance (not the class)
    claims graph safety, and more than M tokens is refused naming max_num_tokens."""
    x, ids, w, w13, w2 = _inputs()
    M = 8
    comm = _backend("deepep_ht", _spec(M=M), Layout.STANDARD, worst_case_rows=True)
    assert comm.capabilities.graph_safe and not type(comm).capabilities.graph_safe
    res = comm.dispatch(x, ids, w)
    assert res.hidden.shape[0] == M and (res.topk_ids[T:] == -1).all()
    assert not res.topk_weights.isnan().any() and (res.topk_weights[T:] == 0).all()
    rows = res.hidden.float()
    y = torch.zeros_like(rows)  # Standard experts: rows no token filled stay 0
    for r in range(T):
        for k in range(K):
            e = int(res.topk_ids[r, k])
            if e >= 0:
                y[r] += res.topk_weights[r, k] * expert_mlp(rows[r : r + 1], w13[e], w2[e])[0]
    out = comm.combine(y.to(torch.bfloat16), res)
    assert_close(out, epmoe.reference.moe(x.float(), w13, w2, w, ids), 2e-2, name="worst case")
    with pytest.raises(ValueError, match="max_num_tokens"):
        comm.dispatch(torch.zeros(M + 1, H, dtype=torch.bfloat16),
                      torch.zeros(M + 1, K, dtype=torch.int64), torch.ones(M + 1, K))  # fmt: skip
    with pytest.raises(TypeError, match="worst_case_rows must be a bool"):
        _backend("deepep_ht", _spec(M=M), Layout.STANDARD, worst_case_rows=1)
    comm.close()


def test_ht_sm_budget_and_chunks_reach_deepep_and_are_checked(fake_deep_ep):
    """``num_sms`` and ``nvl_chunks`` become DeepEP ``Config``s for dispatch and combine
    (only the SM count: DeepEP's recommended chunks for it, its class setting left as it
    was); without them DeepEP chooses per call; bad values are refused naming the option."""
    x, ids, w, w13, w2 = _inputs()

    def configs(**options):
        comm = _backend("deepep_ht", _spec(), Layout.STANDARD, **options)
        res = comm.dispatch(x, ids, w)
        y = res.hidden.float() * (res.topk_weights * (res.topk_ids >= 0)).sum(-1, keepdim=True)
        out = comm.combine(y.to(torch.bfloat16), res)
        want = x.float() * (w * (ids >= 0)).sum(-1, keepdim=True)
        assert_close(out, want, 2e-2, name=str(options))
        calls = dict(c for c in comm._buffer().calls if isinstance(c, tuple))
        comm.close()
        return calls["dispatch config"], calls["combine config"]

    assert configs() == (None, None)
    assert configs(num_sms=16, nvl_chunks=(20, 8)) == ((16, 20, 256), (16, 8, 256))
    assert configs(nvl_chunks=(20, 8)) == ((20, 20, 256), (20, 8, 256))
    assert configs(num_sms=16) == ((16, 24, 256), (16, 10, 256))
    assert fake_deep_ep.Buffer.num_sms == 20
    for bad in (dict(num_sms=23), dict(num_sms=0), dict(nvl_chunks=(20,)),
                dict(nvl_chunks=(0, 8)), dict(nvl_chunks=(20, 256))):  # fmt: skip
        with pytest.raises(ValueError, match=next(iter(bad))):
            _backend("deepep_ht", _spec(), Layout.STANDARD, **bad)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_ll_split_phase_maps_to_the_receive_hooks(fake_deep_ep, fp8):
    x, ids, w, w13, w2 = _inputs(1)
    comm = _backend("deepep_ll", _spec(fp8), Layout.EXPERT_BATCHED)
    first = comm.dispatch_async(x, ids, w)
    # DeepEP clears the other buffer's signals when it issues a call: one result at a time
    with pytest.raises(RuntimeError, match="one dispatch result at a time"):
        comm.dispatch_async(x, ids, w)
    buffer = comm._buffer()
    assert buffer.calls == ["dispatch"]  # the send half only
    res = first.wait()
    assert buffer.calls[-1] == "recv hook"
    assert res.hidden_scale is None or res.hidden_scale.is_contiguous()
    rows = _rows(res.hidden, res.hidden_scale)
    y = torch.zeros_like(rows)
    for e, n in enumerate(res.counts.tolist()):
        y[e, :n] = expert_mlp(rows[e, :n], w13[e], w2[e])
    pending = comm.combine_async(y.to(torch.bfloat16), res)
    assert buffer.calls[-1] == "combine"
    out = pending.wait()
    assert buffer.calls[-1] == "combine hook"
    sent = _rows(*quantize_groups(x.float())) if fp8 else x.float()
    tol = 6e-2 if fp8 else 2e-2
    assert_close(out, epmoe.reference.moe(sent, w13, w2, w, ids), tol, name="deepep_ll")
    second = comm.dispatch_async(x, ids, w).wait()  # free again after the combine
    comm.combine(torch.zeros_like(second.hidden, dtype=torch.bfloat16), second)
    # the blocking calls: one DeepEP kernel each (both phases, no hook), same results
    calls = len(buffer.calls)
    res = comm.dispatch(x, ids, w)
    rows = _rows(res.hidden, res.hidden_scale)
    y = torch.zeros_like(rows)
    for e, n in enumerate(res.counts.tolist()):
        y[e, :n] = expert_mlp(rows[e, :n], w13[e], w2[e])
    again = comm.combine(y.to(torch.bfloat16), res)
    assert buffer.calls[calls:] == ["dispatch, both phases", "combine, both phases"]
    torch.testing.assert_close(again, out)
    comm.close()


def test_one_buffer_per_group_and_sizes_checked(fake_deep_ep):
    a = _backend("deepep_ll", _spec(M=8), Layout.EXPERT_BATCHED)
    b = _backend("deepep_ll", _spec(M=8), Layout.EXPERT_BATCHED)
    assert a._buffer() is b._buffer() and _FakeBuffer.created == 1
    with pytest.raises(ValueError, match="build every layer of the group with the same"):
        _backend("deepep_ll", _spec(M=16), Layout.EXPERT_BATCHED)
    a.close()
    assert _FakeBuffer.destroyed == 0  # b still holds it
    b.close()
    assert _FakeBuffer.destroyed == 1


def test_a_closed_or_orphaned_hold_says_closed(fake_deep_ep):
    a = _backend("deepep_ht", _spec(), Layout.STANDARD)
    b = _backend("deepep_ht", _spec(), Layout.STANDARD)
    key = a._hold.key
    a.close()
    a.close()  # a second close gives nothing back twice
    assert transport.holders(key) == 1 and b._buffer() is not None
    with pytest.raises(RuntimeError, match="deepep_ht backend is closed"):
        a._buffer()
    transport.close_all()  # the buffer is destroyed under b
    with pytest.raises(RuntimeError, match="deepep_ht backend is closed"):
        b._buffer()
    c = _backend("deepep_ht", _spec(), Layout.STANDARD)  # a new buffer under the same key
    b.close()  # b's hold is gone with its buffer: c's stays
    assert transport.holders(key) == 1 and c._buffer() is not None
    c.close()
    assert transport.holders(key) == 0 and _FakeBuffer.destroyed == 2


def test_supports_refuses_what_deepep_cannot_do():
    from epmoe.comm.deepep_ht import DeepEPHTBackend
    from epmoe.comm.deepep_ll import DeepEPLLBackend

    cuda = torch.device("cuda")
    spec = CommSpec(7168, 8, (0, 128, 256), 128, torch.bfloat16, cuda)
    assert DeepEPLLBackend.supports(spec) is None and DeepEPHTBackend.supports(spec) is None
    assert "H in" in DeepEPLLBackend.supports(CommSpec(7000, 8, (0, 8), 128, torch.bfloat16, cuda))
    assert "top-k <= 11" in DeepEPLLBackend.supports(
        CommSpec(7168, 12, (0, 16), 64, torch.bfloat16, cuda)
    )
    uneven = CommSpec(7168, 8, (0, 100, 256), 128, torch.bfloat16, cuda)
    assert "same number of expert slots" in DeepEPHTBackend.supports(uneven)
    assert "moves" in DeepEPHTBackend.supports(CommSpec(7168, 8, (0, 8), 8, torch.float32, cuda))

    # its dispatch traps on rows whose half does not fit 8 KiB of shared memory, or of odd
    # 16-byte vectors (bf16: H % 16, H <= 8176; FP8: H % 32, H <= 16352)
    def ht(H, fp8=False, offsets=(0, 128, 256)):
        dispatch = FP8_DTYPE if fp8 else None
        return DeepEPHTBackend.supports(
            CommSpec(H, 8, offsets, 128, torch.bfloat16, cuda, dispatch_dtype=dispatch)
        )

    assert ht(8176) is None and ht(8192, fp8=True) is None and ht(16256, fp8=True) is None
    assert "at most 8176, not H=8192; FP8 dispatch" in ht(8192)
    assert "a multiple of 16" in ht(2056)
    assert "at most 16352, not H=16384" in ht(16384, fp8=True)
    # and at most 128 expert slots per rank (its layout notification's threads)
    assert ht(7168, offsets=(0, 128, 256)) is None
    assert "at most 128 expert slots per rank, this placement has 136" in ht(
        7168, offsets=(0, 136, 272)
    )


def test_without_deep_ep_the_error_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # import fails
    from epmoe.comm import _deepep

    with pytest.raises(ImportError, match="github.com/deepseek-ai/DeepEP"):
        _deepep.import_deep_ep()
    monkeypatch.setattr(_deepep, "one_nvlink_node_reason", lambda group: None)  # as on a GPU
    assert "github.com/deepseek-ai/DeepEP" in _deepep.unavailable_reason(None)


def test_an_unbuilt_deep_ep_checkout_is_unavailable_not_a_failure(tmp_path, monkeypatch):
    # a source checkout on the path: the package is found, its extension deep_ep_cpp is not
    (tmp_path / "deep_ep").mkdir()
    (tmp_path / "deep_ep" / "__init__.py").write_text("from deep_ep_cpp import Buffer\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    from epmoe.comm import _deepep

    monkeypatch.setattr(_deepep, "one_nvlink_node_reason", lambda group: None)  # as on a GPU
    reason = _deepep.unavailable_reason(None)
    assert "deep_ep_cpp" in reason and "build it from" in reason


class _FakeATA:
    """pplx_kernels.AllToAll for one rank: the documented dispatch/combine semantics."""

    created = destroyed = 0

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list[tuple[str, bool, bool]] = []
        _FakeATA.created += 1

    @classmethod
    def intranode(cls, **kwargs):
        assert kwargs["dp_size"] == 1 and kwargs["world_size"] == 1
        return cls(**kwargs)

    def destroy(self):
        _FakeATA.destroyed += 1

    def dispatch(self, out_counts, out_x, out_scale, x, x_scale, indices, bound_m,
                 do_send=True, do_recv=True):  # fmt: skip
        assert indices.dtype == torch.uint32 and bound_m.dtype == torch.uint32
        self.calls.append(("dispatch", do_send, do_recv))
        if not do_recv:
            return
        out_counts.zero_()
        for t in range(int(bound_m[0])):
            for k in range(indices.shape[1]):
                e = int(indices[t, k])
                row = int(out_counts[e])
                # pplx's slot per (source rank, expert): M rows, written past unchecked
                assert row < self.kwargs["max_num_tokens"], f"expert {e}'s slot overflows"
                out_x[e, row] = x[t]
                if x_scale is not None:
                    out_scale[e, row] = x_scale[t]
                out_counts[e] += 1

    def combine(self, out, indices, weights, expert_y, bound_m, do_send=True, do_recv=True):
        self.calls.append(("combine", do_send, do_recv))
        if not do_recv:
            return
        seen = torch.zeros(expert_y.shape[0], dtype=torch.int64)
        b = int(bound_m[0])
        acc = torch.zeros(out.shape, dtype=torch.float32)
        for t in range(b):
            for k in range(indices.shape[1]):
                e = int(indices[t, k])
                acc[t] += weights[t, k] * expert_y[e, seen[e]].float()
                seen[e] += 1
        out[:b] = acc[:b].to(out.dtype)  # rows past bound_m: not written


@pytest.fixture
def fake_pplx(monkeypatch):
    pplx = types.ModuleType("pplx_kernels")
    pplx.AllToAll = _FakeATA
    nvshmem = types.ModuleType("nvshmem")
    core = types.ModuleType("nvshmem.core")
    core.get_unique_id = lambda empty=False: "uid"
    core.init = lambda **kwargs: None
    nvshmem.core = core
    nvshmem.__spec__ = importlib.machinery.ModuleSpec("nvshmem", None)  # found, as installed
    for name, module in (("pplx_kernels", pplx), ("nvshmem", nvshmem), ("nvshmem.core", core)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(transport, "_nvshmem_owner", None)
    from epmoe.comm.pplx import _ensure_nvshmem

    monkeypatch.setattr(_ensure_nvshmem, "done", False, raising=False)  # a fresh process
    _FakeATA.created = _FakeATA.destroyed = 0
    yield
    transport.close_all()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_pplx_split_phase_uint32_ids_and_no_expert_entries(fake_pplx, fp8):
    x, ids, w, w13, w2 = _inputs(2)  # token 0 has an entry without expert (-1)
    comm = _backend("pplx", _spec(fp8), Layout.EXPERT_BATCHED)
    pending = comm.dispatch_async(x, ids, w)
    ata = comm._hold.get().ata
    assert ata.calls == [("dispatch", True, False)]  # the send half only
    with pytest.raises(RuntimeError, match="one dispatch result at a time"):
        comm.dispatch_async(x, ids, w)
    res = pending.wait()
    assert ata.calls[-1] == ("dispatch", False, True)
    rows = _rows(res.hidden, res.hidden_scale)
    y = torch.zeros_like(rows)
    for e, n in enumerate(res.counts.tolist()):
        y[e, :n] = expert_mlp(rows[e, :n], w13[e], w2[e])
    out = comm.combine(y.to(torch.bfloat16), res)
    assert [c[0] for c in ata.calls[-2:]] == ["combine", "combine"]
    sent = x.float()
    if fp8:  # the rows as the adapter's quantizer sent them (the interpreter's e4m3 cast
        # rounds a little apart from torch's; the GPU tests check the kernel bit for bit)
        from epmoe.kernels.ops import per_token_group_quant_fp8

        sent = _rows(*per_token_group_quant_fp8(x))
    assert_close(out, epmoe.reference.moe(sent, w13, w2, w, ids), 2e-2, name="pplx")
    comm.close()
    assert _FakeATA.destroyed == 1


def test_nvshmem_has_one_owner_per_process(fake_pplx, fake_deep_ep):
    _backend("deepep_ll", _spec(), Layout.EXPERT_BATCHED)
    with pytest.raises(RuntimeError, match="NVSHMEM in this process belongs to 'deep_ep'"):
        _backend("pplx", _spec(), Layout.EXPERT_BATCHED)


def test_pplx_refuses_rows_and_scales_of_partial_16_bytes_and_a_new_slot_count(fake_pplx):
    from epmoe.comm import backend_class

    cls, cuda = backend_class("pplx"), torch.device("cuda", 0)

    def at(hidden, fp8):
        dispatch = FP8_DTYPE if fp8 else None
        return CommSpec(hidden, 8, (0, 8), 8, torch.bfloat16, cuda, dispatch_dtype=dispatch)

    assert cls.supports(at(7168, True)) is None and cls.supports(at(160, False)) is None
    assert "H=160 needs a multiple of 512" in cls.supports(at(160, True))  # 2 scales: 8 bytes
    assert "whole 16 bytes" in cls.supports(at(2044, False))
    from types import SimpleNamespace

    from epmoe.distributed import num_sms

    gpu = SimpleNamespace(multi_processor_count=132, total_memory=140 * 2**30)  # an H200
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "get_device_properties", lambda device: gpu)
        assert num_sms(cuda) == 132
        assert cls.supports(CommSpec(7168, 8, (0, 8), 132, torch.bfloat16, cuda)) is None
        big = CommSpec(7168, 8, (0, 8), 512, torch.bfloat16, cuda)  # wrong results at 512
        assert "at most 132 tokens per rank" in cls.supports(big)
        assert cls.default_tokens(cuda) == 128  # the default fits an H200
        gpu.multi_processor_count = 108  # an A100: the layer's default M_max follows
        assert cls.default_tokens(cuda) == 108
    assert cls.default_tokens(torch.device("cpu")) == 128
    comm = _backend("pplx", _spec(), Layout.EXPERT_BATCHED)
    with pytest.raises(ValueError, match=f"pplx's buffers serve P={E} expert slots"):
        comm.rebind((0, E + 2))  # a re-plan with two redundant slots
    comm.close()


def test_pplx_does_not_send_a_padded_tail(fake_pplx):
    """Rows after the last one with an expert (a decode graph's padding) are not sent:
    bound_m stops before them, and their output is zero, not what the buffer held."""
    x, ids, w, w13, w2 = _inputs(2)
    T = x.shape[0]
    ids = torch.cat([ids, torch.full((3, ids.shape[1]), -1)])  # 3 padding rows
    x = torch.cat([x, torch.randn(3, x.shape[1]).to(x.dtype)])
    w = torch.cat([w, torch.ones(3, w.shape[1])])
    comm = _backend("pplx", _spec(M=T + 3), Layout.EXPERT_BATCHED)
    comm._hold.get().out.fill_(float("nan"))  # what an earlier call may have left there
    res = comm.dispatch(x, ids, w)
    real = ids[:T]
    assert int(res.counts.sum()) == real.numel()  # -1 entries of real rows: stand-ins
    rows = _rows(res.hidden, res.hidden_scale)
    y = torch.zeros_like(rows)
    for e, n in enumerate(res.counts.tolist()):
        y[e, :n] = expert_mlp(rows[e, :n], w13[e], w2[e])
    out = comm.combine(y.to(torch.bfloat16), res)
    assert torch.equal(out[T:], torch.zeros(3, x.shape[1], dtype=out.dtype))
    assert_close(out[:T], epmoe.reference.moe(x[:T].float(), w13, w2, w[:T], real), 2e-2)
    comm.close()


def test_pplx_sends_no_expert_a_token_twice(fake_pplx):
    """Rows without an expert in the middle of a batch (a mask of valid tokens) are sent
    with stand-in experts, weight 0: each to experts the token does not use, so no expert
    gets more than one copy per token (pplx's slot per source and expert holds M rows;
    one fixed stand-in would overflow it)."""
    from epmoe.comm.pplx import stand_in_ids

    ids = torch.tensor([[2, -1, 0], [-1, -1, -1], [-1, 1, -1], [4, 5, 6]])
    assert stand_in_ids(ids).tolist() == [[2, 1, 0], [0, 1, 2], [0, 1, 2], [4, 5, 6]]
    x, _, w, w13, w2 = _inputs(2)
    T = 6
    x = torch.randn(T, H).to(torch.bfloat16)
    x[1] = float("nan")  # a padding row's garbage (a CUDA graph bucket's unused row)
    w = torch.rand(T, K)
    ids = torch.full((T, K), -1)
    ids[-1] = torch.tensor([1, 2, 3])  # only the last row has experts: every row is sent
    comm = _backend("pplx", _spec(M=T), Layout.EXPERT_BATCHED)
    res = comm.dispatch(x, ids, w)
    assert res.counts.tolist()[:K] == [T - 1, T, T]  # the masked rows' stand-ins; no overflow
    rows = _rows(res.hidden, res.hidden_scale)
    y = torch.zeros_like(rows)
    for e, n in enumerate(res.counts.tolist()):
        y[e, :n] = expert_mlp(rows[e, :n], w13[e], w2[e])
    assert y.isnan().any()  # the stand-ins computed the garbage row
    out = comm.combine(y.to(torch.bfloat16), res)
    assert torch.equal(out[:-1], torch.zeros(T - 1, H, dtype=out.dtype))  # zero, not NaN
    expected = epmoe.reference.moe(x[-1:].float(), w13, w2, w[-1:], ids[-1:])
    assert_close(out[-1:], expected, 2e-2, name="pplx")
    comm.close()


def test_pplx_layers_share_the_receive_tensors(fake_pplx):
    """Layers of one shape share pplx's AllToAll and its receive tensors (one set per
    model, not per layer), and one layer's held result blocks every layer's dispatch."""
    a = _backend("pplx", _spec(), Layout.EXPERT_BATCHED)
    b = _backend("pplx", _spec(), Layout.EXPERT_BATCHED)
    assert _FakeATA.created == 1 and a._hold.get() is b._hold.get()
    x, ids, w, _, _ = _inputs(2)
    pending = a.dispatch_async(x, ids, w)
    with pytest.raises(RuntimeError, match="one dispatch result at a time"):
        b.dispatch_async(x, ids, w)
    res = pending.wait()
    a.combine(torch.zeros(res.hidden.shape, dtype=torch.bfloat16), res)
    b.combine(torch.zeros(res.hidden.shape, dtype=torch.bfloat16), b.dispatch(x, ids, w))
    a.close()
    b.close()
    assert _FakeATA.destroyed == 1


@pytest.mark.parametrize("package", ["deep_ep", "pplx_kernels"])
def test_a_library_whose_import_fails_otherwise_is_reported_not_raised(
    package, tmp_path, monkeypatch
):
    """DeepEP V2 checks NCCL's version when imported (an AssertionError here), pplx-kernels
    loads NVSHMEM: ``available_backends()`` and ``auto`` report it as the reason, the
    adapter's construction raises an ImportError saying what failed."""
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text(
        "raise AssertionError('Invalid NCCL versions: 2.28 < 2.30.4')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, package, raising=False)
    monkeypatch.setitem(sys.modules, "nvshmem", types.ModuleType("nvshmem"))
    from epmoe.comm import _deepep, available_backends, pplx, resolve_backend

    # as on a GPU node (the import is what is tested): no device or node check
    monkeypatch.setattr(_deepep, "one_nvlink_node_reason", lambda group: None)
    monkeypatch.setattr(pplx, "one_nvlink_node_reason", lambda group: None)
    monkeypatch.setattr(AllToAll, "unavailable_reason", classmethod(lambda cls, d, g: None))
    reasons = available_backends("cpu")
    names = ["deepep_ht", "deepep_ll"] if package == "deep_ep" else ["pplx"]
    for name in names:
        assert "importing it failed (AssertionError: Invalid NCCL versions" in reasons[name]
    imported = []

    def recording(name, *args):
        imported.append(name)
        return importlib.import_module(name, *args)

    for module in (_deepep, pplx):
        monkeypatch.setattr(module, "importlib", types.SimpleNamespace(import_module=recording))
    resolve_backend("auto", "cpu", None)  # picks a portable backend
    assert imported == []  # and never tried the adapters' libraries
    assert "importing it failed" in available_backends("cpu")[names[0]]  # (the recorder works)
    assert imported
    with pytest.raises(ImportError, match="importing it failed"):
        (_deepep.import_deep_ep if package == "deep_ep" else lambda: pplx._import(package))()


def test_deepep_ll_results_in_flight_are_counted_for_the_group(fake_deep_ep):
    """DeepEP's low-latency buffer is the group's, shared by every layer: one layer's
    result not yet combined blocks another layer's dispatch (its next call would clear the
    first one's signals), with an error, not a hang."""
    a = _backend("deepep_ll", _spec(), Layout.EXPERT_BATCHED)
    b = _backend("deepep_ll", _spec(), Layout.EXPERT_BATCHED)
    x, ids, w, _, _ = _inputs(2)
    res = a.dispatch(x, ids, w)
    with pytest.raises(RuntimeError, match="for every layer of the group"):
        b.dispatch(x, ids, w)
    a.combine(torch.zeros(res.hidden.shape, dtype=torch.bfloat16), res)
    res = b.dispatch(x, ids, w)  # free again once combined
    b.combine(torch.zeros(res.hidden.shape, dtype=torch.bfloat16), res)
    a.close()
    b.close()


def test_deepep_ll_token_limit_follows_the_queue_depth(monkeypatch):
    from epmoe.comm.deepep_ll import DeepEPLLBackend

    def at(M):
        return DeepEPLLBackend.supports(
            CommSpec(7168, 8, (0, 128, 256), M, torch.bfloat16, torch.device("cuda"))
        )

    monkeypatch.delenv("NVSHMEM_QP_DEPTH", raising=False)
    assert at(508) is None and "max_num_tokens <= 511" in at(512)  # DeepEP's default 1024
    monkeypatch.setenv("NVSHMEM_QP_DEPTH", "4096")
    assert at(1024) is None
    monkeypatch.setenv("NVSHMEM_QP_DEPTH", "256")
    assert "max_num_tokens <= 127" in at(128)
    monkeypatch.setenv("NVSHMEM_QP_DEPTH", "deep")
    with pytest.raises(ValueError, match="NVSHMEM_QP_DEPTH must be an integer"):
        at(128)


def test_adapters_without_torch_distributed_say_what_they_need(monkeypatch, fake_pplx):
    """One process without a process group: not usable, and the reason says to launch
    ranks, instead of failing inside the library at construction."""
    from epmoe.comm import _deepep, pplx

    assert not torch.distributed.is_initialized()
    monkeypatch.setattr(_deepep, "one_nvlink_node_reason", lambda group: None)  # as on a GPU
    monkeypatch.setattr(pplx, "one_nvlink_node_reason", lambda group: None)
    monkeypatch.setitem(sys.modules, "deep_ep", types.ModuleType("deep_ep"))
    assert "initialised with 2, 4 or 8 NCCL ranks" in _deepep.unavailable_reason(None)
    monkeypatch.setattr(AllToAll, "unavailable_reason", classmethod(lambda cls, d, g: None))
    reason = pplx.PPLXBackend.unavailable_reason(torch.device("cuda"), None)
    assert "initialised with at least 2 ranks" in reason


def test_a_failed_nvshmem_start_locks_no_other_library_out(fake_pplx, fake_deep_ep):
    def broken(*args, **kwargs):
        raise RuntimeError("no NVSHMEM heap")

    fake_deep_ep.Buffer = type("Broken", (_FakeBuffer,), {"__init__": broken})
    with pytest.raises(RuntimeError, match="no NVSHMEM heap"):
        _backend("deepep_ll", _spec(), Layout.EXPERT_BATCHED)
    assert transport._nvshmem_owner is None
    _backend("pplx", _spec(), Layout.EXPERT_BATCHED).close()  # not refused
    assert transport._nvshmem_owner == "pplx"


def test_pplx_names_its_gloo_group_again_after_a_new_process_group(monkeypatch):
    import torch.distributed as dist

    from epmoe.comm import pplx

    monkeypatch.setattr(pplx, "_NAMED", {})
    for attempt in range(2):  # a group re-created under the same name after a destroy
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            assert pplx._resolves(pplx._named_group(None)), attempt
        finally:
            dist.destroy_process_group()
