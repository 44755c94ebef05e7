"""Rank bodies and helpers of the layer tests of comm contract v2 (``test_layer_v2.py``).

What they check on every rank, against ``epmoe.reference`` on the rank's own tokens with the
full weights:

* the graph-safe forward (``max_tokens_across_ranks`` given) enters no agreement (the
  agreed forward's all-gather, :mod:`epmoe.agreement`) and no all-reduce;
* split phase: the shared experts run between ``dispatch_async`` and its ``wait``, once;
* FP8 on the wire from one argument (``dispatch_dtype``): the experts receive e4m3 rows with
  their scales;
* a re-plan keeps the backend object (``rebind``) and builds a fresh one only when the
  backend refuses to rebind.

Also here, for the single-process and GPU tests: :class:`LoopbackBackend`, a graph-safe
ExpertBatched backend for one rank in plain torch; :class:`HostReads`, which records every
op that reads a device value back to the host; :func:`python_state`, what a CUDA graph would
freeze.

Shape legend: T tokens · H hidden · I intermediate · E logical experts · P physical experts ·
K top-k · W world · e local experts · C capacity per expert · N = T·K (token, k) entries ·
G = H / 128 FP8 scale groups.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import epmoe
import epmoe.layer
from epmoe.comm import backend_class
from epmoe.comm.base import (
    FP8_DTYPE,
    FP8_GROUP,
    AllToAll,
    Capabilities,
    DispatchResult,
    Layout,
    Pending,
    check_dispatch_args,
)
from epmoe.comm.collectives import world_of
from epmoe.reference import TOLERANCES, assert_close, quantize_groups
from tests.distributed.cases import (
    backends_and_layouts,
    device_for,
    full_weights,
    rank_tokens,
    redundant_slots,
)
from tests.harness import Sweep

aten = torch.ops.aten

# ------------------------------------------------------------------------ graph-safe helpers


class LoopbackBackend(AllToAll):
    """A graph-safe ExpertBatched backend for one rank (W = 1) in plain torch: the rows of
    each local expert are packed into fixed ``[e, C, H]`` buffers, ``C = M_max``, with
    device-side positions (a one-hot cumsum), and combine gathers them back weighted. No
    host synchronisation and no Python state per call, so a CUDA graph can capture it.

    Test-only: it checks the layer's graph-safe path (no host-reading op on CPU; CUDA-graph
    capture on one GPU) independently of the multi-GPU transports. Register it for a test
    with ``monkeypatch.setitem(epmoe.comm._BACKENDS, "loopback", LOOPBACK)``.
    """

    name = "loopback"
    capabilities = Capabilities(
        layouts=frozenset({Layout.EXPERT_BATCHED}),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        device_types=frozenset({"cpu", "cuda"}),
        graph_safe=True,
        max_in_flight=1,
    )

    @classmethod
    def unavailable_reason(cls, device, group=None) -> str | None:
        reason = super().unavailable_reason(device, group)
        if reason is None and world_of(group)[1] != 1:
            return "a loopback serves one rank only (W = 1)"
        return reason

    def dispatch_async(self, hidden_TH, topk_ids_TK, topk_weights_TK) -> Pending[DispatchResult]:
        check_dispatch_args(self.spec, hidden_TH, topk_ids_TK, topk_weights_TK, True)
        T, K = topk_ids_TK.shape
        e, C, H = self.spec.num_local(0), self.spec.max_num_tokens, self.spec.hidden_size
        ids_N = topk_ids_TK.reshape(-1).to(torch.int64)
        valid_N = ids_N >= 0  # -1 matches no column below
        # one-hot by comparison: F.one_hot range-checks its input on the host
        onehot_Ne = (ids_N[:, None] == torch.arange(e, device=ids_N.device)).long()
        row_N = (onehot_Ne.cumsum(0) * onehot_Ne).sum(1) - 1  # row within its expert
        # flat row of the [e·C + 1, H] buffer; entries without an expert go to the spare
        # last row (distinct experts per token: an expert gets at most T <= C rows)
        flat_N = torch.where(valid_N, ids_N.clamp(min=0) * C + row_N, e * C)
        buf_RH = hidden_TH.new_zeros(e * C + 1, H)
        buf_RH.index_copy_(0, flat_N, hidden_TH.repeat_interleave(K, dim=0, output_size=T * K))
        counts_e = onehot_Ne.sum(0).to(torch.int32)
        handle = (flat_N, topk_weights_TK.to(torch.float32), T)
        return Pending(
            lambda: DispatchResult(
                layout=Layout.EXPERT_BATCHED,
                hidden=buf_RH[: e * C].view(e, C, H),
                counts=counts_e,
                handle=handle,
            )
        )

    def combine_async(self, expert_out, result) -> Pending[torch.Tensor]:
        flat_N, weights_TK, T = result.handle
        e, C, H = expert_out.shape
        K = self.spec.top_k
        rows_RH = torch.cat([expert_out.reshape(e * C, H), expert_out.new_zeros(1, H)])
        y_TKH = rows_RH[flat_N].to(torch.float32).view(T, K, H)
        out_TH = (y_TKH * weights_TK[..., None]).sum(1).to(self.spec.dtype)
        return Pending.done(out_TH)


LOOPBACK = f"{__name__}:LoopbackBackend"  # its entry in epmoe.comm's registry


class HostReads(TorchDispatchMode):
    """Records every op that reads a device value back to the host or depends on one:
    ``.item()`` / ``bool()`` / ``int()`` (``_local_scalar_dense``), ``nonzero`` (also
    one-argument ``torch.where``), boolean-mask indexing, ``masked_select``, ``unique``,
    ``bincount``, ``repeat_interleave`` without ``output_size``, ``equal``, copies between
    devices, and the Python-side ``Tensor.tolist`` / ``numpy``. CPU tensors count too: an
    op that would synchronise on CUDA is caught on a CPU-only machine.

    ``with HostReads() as reads: ...`` then ``reads.ops``; ``with reads.paused(): ...``
    excludes a region (the experts or the backend, whose syncs are theirs).
    """

    _ALWAYS = {
        aten._local_scalar_dense.default,
        aten.nonzero.default,
        aten.masked_select.default,
        aten.bincount.default,
        aten._unique2.default,
        aten.unique_dim.default,
        aten.unique_consecutive.default,
        aten.equal.default,
        aten.is_nonzero.default,
    }

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self._paused = 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _reads(self, func, args, kwargs) -> bool:
        if func in self._ALWAYS:
            return True
        if func is aten.repeat_interleave.Tensor:
            return kwargs.get("output_size") is None
        if func is aten.index.Tensor:
            return any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                for i in args[1]
            )
        if func is aten._to_copy.default and "device" in kwargs:
            return torch.device(kwargs["device"]).type != args[0].device.type
        if func is aten.copy_.default:
            return args[0].device.type != args[1].device.type
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._paused and self._reads(func, args, kwargs):
            self.ops.append(str(func))
        return func(*args, **kwargs)

    def __enter__(self):
        self._patched = {}
        for name in ("tolist", "numpy"):
            original = getattr(torch.Tensor, name)
            self._patched[name] = original

            def wrapper(t, *a, _name=name, _original=original, **kw):
                if not self._paused:
                    self.ops.append(f"Tensor.{_name}")
                return _original(t, *a, **kw)

            setattr(torch.Tensor, name, wrapper)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._patched.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)


class PausedExperts:
    """``layer.experts`` with ``reads`` paused while it runs (its syncs are not the
    layer's), optionally logging each call."""

    def __init__(self, experts, reads: HostReads | None = None, log: list | None = None):
        self.inner, self.reads, self.log = experts, reads, log
        self.name = experts.name
        self.seen: list[DispatchResult] = []

    def __call__(self, result: DispatchResult, weights):
        self.seen.append(result)
        if self.log is not None:
            self.log.append("experts")
        with self.reads.paused() if self.reads is not None else contextlib.nullcontext():
            return self.inner(result, weights)


def python_state(layer: epmoe.EPMoE) -> dict[str, Any]:
    """What a CUDA graph would freeze of the layer and its recorder: every attribute, plain
    values by value, tensors and other objects by identity, dicts entry by entry. Two
    snapshots around a forward must be equal (device tensors may change in place)."""

    def freeze(value: Any) -> Any:
        if value is None or isinstance(
            value, (bool, int, float, str, torch.dtype, torch.device, Layout)
        ):
            return value
        if isinstance(value, tuple):
            return tuple(freeze(v) for v in value)
        if isinstance(value, dict):
            return {k: freeze(v) for k, v in value.items()}
        return ("object", id(value))

    state = {f"layer.{k}": freeze(v) for k, v in vars(layer).items()}
    if layer.load_recorder is not None:
        state |= {f"recorder.{k}": freeze(v) for k, v in vars(layer.load_recorder).items()}
    return state


def physical_counts(layer: epmoe.EPMoE, logits_TE: torch.Tensor) -> torch.Tensor:
    """Tokens per physical expert ``[P]`` int64 (CPU) of one forward's routing, counted on
    the host from the layer's own ``route`` (the recorder's oracle)."""
    ids = layer.route(logits_TE)[1].flatten().cpu()
    return torch.bincount(ids[ids >= 0], minlength=layer.placement.num_physical)


def fp8_round_trip(x_TH: torch.Tensor) -> torch.Tensor:
    """``x`` as the experts see it after FP8 dispatch: e4m3 per 128-column group with a
    float32 scale, dequantized to float32 (``H`` a multiple of 128)."""
    q_TH, scale_TG = quantize_groups(x_TH, FP8_GROUP)
    x_TGn = q_TH.to(torch.float32).unflatten(-1, (scale_TG.shape[-1], FP8_GROUP))
    return (x_TGn * scale_TG[..., None]).flatten(-2)


class LoggedMLP(nn.Module):
    """A shared-expert MLP (``w_down · silu(w_up · x)``, float32) that logs each call."""

    def __init__(self, H: int, I: int, device, log: list, seed: int = 7) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w_up = nn.Parameter((torch.randn(I, H, generator=g) / H**0.5).to(device))
        self.w_down = nn.Parameter((torch.randn(H, I, generator=g) / I**0.5).to(device))
        self.log = log

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        self.log.append("shared")
        return F.silu(x_TH.float() @ self.w_up.t()) @ self.w_down.t()


def log_comm_calls(comm: AllToAll, log: list) -> None:
    """Make ``comm`` log ``dispatch_async``, the dispatch's ``wait`` and ``combine`` (instance
    attributes shadowing the methods; the blocking ``combine`` calls ``combine_async``)."""
    dispatch_async, combine_async = comm.dispatch_async, comm.combine_async

    def logged_dispatch(*args):
        log.append("dispatch_async")
        pending = dispatch_async(*args)
        return Pending(lambda: (log.append("wait"), pending.wait())[1])

    def logged_combine(*args):
        log.append("combine")
        return combine_async(*args)

    comm.dispatch_async, comm.combine_async = logged_dispatch, logged_combine


@contextlib.contextmanager
def counting_agreements() -> Iterator[list]:
    """Count ``torch.distributed.all_reduce`` calls and the layer's agreement all-gathers
    (``epmoe.agreement.all_gather_rows``; both are looked up at call time); yields a list
    that gets one entry per call."""
    import epmoe.agreement as agreement

    calls: list = []
    originals = dist.all_reduce, agreement.all_gather_rows

    def counted(original):
        def call(*args, **kwargs):
            calls.append(args[0].shape if args else None)
            return original(*args, **kwargs)

        return call

    dist.all_reduce, agreement.all_gather_rows = map(counted, originals)
    try:
        yield calls
    finally:
        dist.all_reduce, agreement.all_gather_rows = originals


# ------------------------------------------------------------------------------ rank body


def _layer(E, K, H, I, dtype, dev, backend, layout, seed, **kwargs):
    layer = epmoe.EPMoE(
        E, K, H, I, backend=backend, layout=layout, experts="torch", params_dtype=dtype,
        device=dev, **kwargs,
    )  # fmt: skip
    w13, w2 = full_weights(E, H, I, dtype, dev, seed=seed)
    layer.load_experts(w13, w2)
    return layer, w13, w2


def check_layer_v2(rank, world, device="cpu", dtype_name="float32"):
    """Every case × backend × layout in one sweep (see the module docstring)."""
    dtype = getattr(torch, dtype_name)
    dev = device_for(rank, device)
    E, K, H, I, M = 6, 2, 32, 16, 4  # M = max_num_tokens: T = 9 runs as 3 chunks
    tokens = [5, 0, 9, 3][:world] if world > 1 else [9]
    T = tokens[rank]
    sweep = Sweep()
    for backend, layout in backends_and_layouts():
        label = f"W={world} {backend} {layout.value}"

        with sweep.case(f"{label}: max_tokens_across_ranks enters no agreement"):
            layer, w13, w2 = _layer(
                E, K, H, I, dtype, dev, backend, layout, 1, max_num_tokens=M, load_window=2
            )
            x, logits = rank_tokens(rank, T, H, E, dtype, dev, seed=1)
            with counting_agreements() as hinted:
                out = layer(x, logits, max_tokens_across_ranks=max(tokens))
            with counting_agreements() as agreed:
                again = layer(x, logits)
            ref = epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, K))
            assert hinted == [], f"the hinted forward agreed or all-reduced on {hinted}"
            assert world == 1 or agreed, "the counter missed the forward's agreement"
            assert_close(out, ref, TOLERANCES[dtype], name="hinted vs oracle")
            assert torch.equal(out, again), "hinted and agreed forwards differ"
            want = 2 * physical_counts(layer, logits)
            got = layer.load_recorder.window_load().cpu()
            assert torch.equal(got, want), f"recorder window {got.tolist()}, want {want.tolist()}"

        with sweep.case(f"{label}: shared experts run while the first dispatch is in flight"):
            log: list[str] = []
            shared = LoggedMLP(H, I, dev, log)
            layer, w13, w2 = _layer(
                E, K, H, I, dtype, dev, backend, layout, 2, max_num_tokens=M,
                shared_experts=shared,
            )  # fmt: skip
            log_comm_calls(layer.comm, log)
            layer.experts = PausedExperts(layer.experts, log=log)
            x, logits = rank_tokens(rank, T, H, E, dtype, dev, seed=2)
            out = layer(x, logits)
            calls = list(log)  # before the oracle calls the shared MLP again
            chunks = max(math.ceil(t / M) for t in tokens)
            with torch.no_grad():
                ref = epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, K))
                ref = ref + shared(x).to(ref.dtype)
            step = ["dispatch_async", "wait", "experts", "combine"]
            want = ["dispatch_async", "shared", *step[1:]] + step * (chunks - 1)
            assert calls == want, f"calls {calls}, want {want}"
            assert_close(out, ref, TOLERANCES[dtype], name="with shared experts vs oracle")

        with sweep.case(f"{label}: two micro-batches overlap, equal to the plain forward"):
            log = []
            shared = LoggedMLP(H, I, dev, log)
            kwargs = dict(max_num_tokens=M, shared_experts=shared)
            plain, w13, w2 = _layer(E, K, H, I, dtype, dev, backend, layout, 5, **kwargs)
            layer, _, _ = _layer(
                E, K, H, I, dtype, dev, backend, layout, 5, micro_batches=2, **kwargs
            )
            log_comm_calls(layer.comm, log)
            layer.experts = PausedExperts(layer.experts, log=log)
            x, logits = rank_tokens(rank, T, H, E, dtype, dev, seed=5)
            out = layer(x, logits)
            calls = list(log)
            want_out = plain(x, logits)
            chunks = max(math.ceil(t / M) for t in tokens)
            half = ["wait", "experts", "combine"]
            want = ["dispatch_async", "dispatch_async", "shared", *half, *half]
            want += ["dispatch_async", "dispatch_async", *half, *half] * (chunks - 1)
            assert calls == want, f"calls {calls}, want {want}"
            torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)
            with torch.no_grad():
                ref = epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, K))
                ref = ref + shared(x).to(ref.dtype)
            assert_close(out, ref, TOLERANCES[dtype], name="two micro-batches vs oracle")

        with sweep.case(f"{label}: dispatch_dtype=float8_e4m3fn"):
            if not backend_class(backend).capabilities.fp8_dispatch:
                pytest.skip(f"backend {backend!r} has no FP8 dispatch yet (fp8_dispatch=False)")
            H8 = 2 * FP8_GROUP  # whole groups: TorchExperts' dequantization assumes them
            layer, w13, w2 = _layer(
                E, K, H8, I, dtype, dev, backend, layout, 3, max_num_tokens=M,
                dispatch_dtype=FP8_DTYPE,
            )  # fmt: skip
            layer.experts = seen = PausedExperts(layer.experts)
            x, logits = rank_tokens(rank, T, H8, E, dtype, dev, seed=3)
            out = layer(x, logits, max_tokens_across_ranks=max(tokens))
            ref = epmoe.reference.moe(
                fp8_round_trip(x).to(dtype), w13, w2, *epmoe.select_experts(logits, K)
            )
            assert layer.dispatch_dtype == FP8_DTYPE == layer.comm.spec.dispatch_dtype
            for result in seen.seen:
                G = H8 // FP8_GROUP
                assert result.hidden.dtype == FP8_DTYPE, result.hidden.dtype
                assert result.hidden_scale is not None, "FP8 rows arrived without scales"
                assert result.hidden_scale.shape == (*result.hidden.shape[:-1], G)
            assert out.dtype == dtype
            assert_close(out, ref, TOLERANCES[FP8_DTYPE], name="FP8 dispatch vs oracle")

        # E = 6 on W ranks, then balanced with redundant slots: rank_offsets change
        new = epmoe.ExpertPlacement.balanced(
            torch.arange(1, E + 1, dtype=torch.float64) ** 2,
            ep_size=world,
            num_redundant=redundant_slots(E, world, at_least=world),
        )
        # .to(dtype): float64 on CPU, float16 on CUDA (what the backends there move)
        new_dtype = torch.float64 if dev.type == "cpu" else torch.float16
        with sweep.case(f"{label}: .to(dtype) rebuilds the backend at the next forward"):
            layer, w13, w2 = _layer(E, K, H, I, dtype, dev, backend, layout, 6, max_num_tokens=M)
            before = layer.comm
            layer.to(new_dtype)
            assert layer.params_dtype == new_dtype == layer.w13.dtype == layer.w2.dtype
            assert layer.comm is before, "the backend is rebuilt at the forward, not in .to()"
            x, logits = rank_tokens(rank, T, H, E, new_dtype, dev, seed=6)
            with counting_agreements() as agreed:
                out = layer(x, logits, max_tokens_across_ranks=max(tokens))
            # two agreements: on the change, then on the build's outcome
            assert world == 1 or len(agreed) == 2, f"two agreements on the rebuild, got {agreed}"
            assert layer.comm is not before and layer.comm.spec.dtype == new_dtype
            assert type(layer.comm) is type(before) and layer.comm.layout is layout
            ref = epmoe.reference.moe(
                x, w13.to(new_dtype), w2.to(new_dtype), *epmoe.select_experts(logits, K)
            )
            assert out.dtype == new_dtype
            assert_close(out, ref, TOLERANCES[new_dtype], name="after .to(dtype) vs oracle")

        with sweep.case(f"{label}: a rank that did not convert is named, then both convert"):
            if world == 1:
                pytest.skip("needs two ranks")
            layer, w13, w2 = _layer(E, K, H, I, dtype, dev, backend, layout, 7, max_num_tokens=M)
            if rank == 0:
                layer.to(new_dtype)
            x, logits = rank_tokens(rank, T, H, E, layer.params_dtype, dev, seed=7)
            change = "changed this layer .*model.to.dtype.* and another did not"
            with pytest.raises(RuntimeError, match=change):
                layer(x, logits)
            with pytest.raises(RuntimeError, match=change):  # before any weight moves
                layer.rebalance(new)
            pending = "differ in a change not yet agreed"  # (told at the step, on every rank)
            with pytest.raises(RuntimeError, match=pending), epmoe.step(layer.group, num_tokens=T):
                pass
            layer.to(new_dtype)  # now every rank: the next call agrees and rebuilds
            x = x.to(new_dtype)
            with epmoe.step(layer.group, num_tokens=T):
                out = layer(x, logits)
            ref = epmoe.reference.moe(
                x, w13.to(new_dtype), w2.to(new_dtype), *epmoe.select_experts(logits, K)
            )
            assert_close(out, ref, TOLERANCES[new_dtype], name="converted on every rank")

        with sweep.case(f"{label}: a rebuild that fails on one rank fails on all, then retries"):
            layer, w13, w2 = _layer(E, K, H, I, dtype, dev, backend, layout, 10, max_num_tokens=M)
            before = layer.comm
            layer.to(new_dtype)
            x, logits = rank_tokens(rank, T, H, E, new_dtype, dev, seed=10)
            real = epmoe.layer.create_backend

            def refuse(*args, **kwargs):
                raise RuntimeError("no buffers today")

            epmoe.layer.create_backend = refuse if rank == 0 else real
            try:
                with pytest.raises(RuntimeError, match="no buffers today|refused this call"):
                    layer(x, logits)
            finally:
                epmoe.layer.create_backend = real
            assert layer.comm is before and layer._comm_pending  # old backends kept, pending
            out = layer(x, logits)  # every rank retries the rebuild, in step
            ref = epmoe.reference.moe(
                x, w13.to(new_dtype), w2.to(new_dtype), *epmoe.select_experts(logits, K)
            )
            assert layer.comm is not before and not layer._comm_pending
            assert_close(out, ref, TOLERANCES[new_dtype], name="after the retried rebuild")

        with sweep.case(f"{label}: a copy on one rank only takes no layer index"):
            layer, w13, w2 = _layer(E, K, H, I, dtype, dev, backend, layout, 11, max_num_tokens=M)
            if rank == 0:
                snapshot = copy.deepcopy(layer)  # never called
            later, w13b, w2b = _layer(E, K, H, I, dtype, dev, backend, layout, 12)
            x, logits = rank_tokens(rank, T, H, E, dtype, dev, seed=11)
            with epmoe.step(layer.group, num_tokens=T):
                out = later(x, logits)
            ref = epmoe.reference.moe(x, w13b, w2b, *epmoe.select_experts(logits, K))
            assert_close(out, ref, TOLERANCES[dtype], name="a layer built after the copy")
            if rank == 0:
                del snapshot

        with sweep.case(f"{label}: copies called in another order on one rank are told apart"):
            if world == 1:
                pytest.skip("needs two ranks")
            layer, w13, w2 = _layer(E, K, H, I, dtype, dev, backend, layout, 13, max_num_tokens=M)
            first, second = copy.deepcopy(layer), copy.deepcopy(layer)
            x, logits = rank_tokens(rank, T, H, E, dtype, dev, seed=13)
            with pytest.raises(RuntimeError, match="different layers"):
                (first if rank == 0 else second)(x, logits)
            ref = epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, K))
            for twin in (first, second):  # in order on every rank: served
                assert_close(twin(x, logits), ref, TOLERANCES[dtype], name="a copy in order")

        with sweep.case(f"{label}: .to() and back on one rank changes nothing to agree on"):
            layer, w13, w2 = _layer(E, K, H, I, dtype, dev, backend, layout, 8, max_num_tokens=M)
            before = layer.comm
            if rank == 0:
                layer.to(new_dtype).to(dtype)
            x, logits = rank_tokens(rank, T, H, E, dtype, dev, seed=8)
            out = layer(x, logits, max_tokens_across_ranks=max(tokens))
            assert layer.comm is before
            ref = epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, K))
            assert_close(out, ref, TOLERANCES[dtype], name="after a round trip")

        with sweep.case(f"{label}: a deep copy builds its own backend; both serve"):
            layer, w13, w2 = _layer(E, K, H, I, dtype, dev, backend, layout, 9, max_num_tokens=M)
            twin = copy.deepcopy(layer)
            assert twin.group is layer.group and twin.comm is layer.comm
            x, logits = rank_tokens(rank, T, H, E, dtype, dev, seed=9)
            twin.rebalance(new)  # the twin's own backend first: the original's stays bound
            out_twin = twin(x, logits)
            assert twin.comm is not layer.comm
            assert layer.comm.spec.rank_offsets == layer.placement.rank_offsets
            out = layer(x, logits)
            ref = epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, K))
            assert_close(out_twin, ref, TOLERANCES[dtype], name="the copy, re-planned")
            assert_close(out, ref, TOLERANCES[dtype], name="the original after its copy's")

        for refuse in (False, True):
            what = "a refused rebind builds a fresh backend" if refuse else "rebind keeps it"
            with sweep.case(f"{label}: re-plan, {what}"):
                layer, w13, w2 = _layer(E, K, H, I, dtype, dev, backend, layout, 4)
                before, closed = layer.comm, []
                if refuse:  # as a backend whose fixed buffers cannot hold the new largest e

                    def too_small(rank_offsets):
                        raise ValueError("buffers too small for the new placement")

                    before.rebind, before.close = too_small, functools.partial(closed.append, True)
                layer.rebalance(new)
                x, logits = rank_tokens(rank, T, H, E, dtype, dev, seed=4)
                out = layer(x, logits, max_tokens_across_ranks=max(tokens))
                ref = epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, K))
                assert (layer.comm is before) != refuse, "backend object kept iff it rebinds"
                assert closed == ([True] if refuse else []), f"old backend closed: {closed}"
                assert type(layer.comm) is type(before) and layer.comm.layout is layout
                offsets = (layer.comm.spec.rank_offsets, layer.placement.rank_offsets)
                assert offsets == (new.rank_offsets,) * 2, offsets
                assert_close(out, ref, TOLERANCES[dtype], name="after the re-plan vs oracle")
    sweep.check()
    return sweep.passed
