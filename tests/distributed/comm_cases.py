"""Rank bodies of the comm conformance suite (``test_comm_v2.py``): one registered backend
per call, in every layout it declares, against the oracle; split phase with several
operations in flight; FP8 on the wire where it offers it; ``rebind``. Nothing here names a
backend: what each one must do follows from its layout and its declared capabilities.

Each body runs on every rank of an initialised process group (see ``tests/harness.py``)
and sweeps many cases in it. Every rank's inputs come from a seed of (case, rank), so each
rank can rebuild what every other rank sent and predict exactly which rows it receives.
End-to-end checks run the local experts in float64 on what the dispatch delivered (FP8
rows dequantized with their scales) and compare the combined output with
``epmoe.reference.moe`` on the rank's own tokens with the full weights.

Shape legend: T tokens · H hidden · I intermediate · E logical experts · P physical
experts · K top-k · W world · e local experts · R received rows · C capacity per expert ·
G = ceil(H / 128) FP8 scale groups.
"""

from __future__ import annotations

import ast
import functools
import itertools
import math
from contextlib import closing
from dataclasses import dataclass

import torch

import epmoe
from epmoe.comm import backend_class, create_backend
from epmoe.comm.base import FP8_DTYPE, FP8_GROUP, CommSpec, DispatchResult, Layout
from epmoe.experts.base import ExpertWeights
from epmoe.experts.torch_experts import TorchExperts
from epmoe.reference import TOLERANCES, assert_close, expert_mlp, quantize_groups
from tests.distributed.cases import device_for
from tests.harness import Sweep

E, K, I = 6, 2, 24  # E: logical experts up to W = 4 (num_experts(W) beyond)
H = 160  # two FP8 groups, the second one partial (128 + 32 columns)
H_TORCH_EXPERTS = 256  # whole FP8 groups (test_reference covers a partial last group)
DROP = 0.2  # share of (token, k) entries routed to no expert (-1)


# Option variants the suite runs besides each backend's defaults: the options that take
# another code path (symm_ll's rows copied into slabs; symm_ht's row flags and its combine
# summed at wait(); deepep_ht's worst-case rows, which make it graph safe). A variant is
# named "backend(key=value, ...)" wherever the suite takes a backend name.
OPTION_VARIANTS: dict[str, list[dict]] = {
    "symm_ll": [{"rows_in_place": False}],
    "symm_ht": [{"tokens_per_flag": 4}, {"reducers": 0}],
    "deepep_ht": [{"worst_case_rows": True}],
}


def variants(names: list[str]) -> list[str]:
    """The option variants of the backends in ``names``, as the suite names them."""
    out = []
    for name in names:
        for options in OPTION_VARIANTS.get(name, []):
            out.append(f"{name}({', '.join(f'{k}={v!r}' for k, v in options.items())})")
    return out


def split_variant(backend: str) -> tuple[str, dict]:
    """``"symm_ll(rows_in_place=False)"`` → ``("symm_ll", {"rows_in_place": False})``; a
    plain name → ``(name, {})``."""
    if "(" not in backend:
        return backend, {}
    call = ast.parse(backend, mode="eval").body  # name(key=literal, ...)
    return call.func.id, {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}


def caps_of(backend: str):
    """The capabilities of ``backend`` (a name or an option variant)."""
    name, options = split_variant(backend)
    return backend_class(name).capabilities_with(**options)


def supports(backend: str, spec: CommSpec) -> str | None:
    return backend_class(split_variant(backend)[0]).supports(spec)


def make(backend: str, spec: CommSpec, layout: Layout):
    """``backend`` (a name or an option variant) for ``spec`` on the default group."""
    name, options = split_variant(backend)
    return create_backend(name, spec, None, layout, **options)


def layouts_of(backend: str) -> list[Layout]:
    """Every layout ``backend`` offers (from its declared capabilities), in a fixed order."""
    caps = caps_of(backend)
    return [layout for layout in Layout if layout in caps.layouts]


def _label(backend: str, layout: Layout) -> str:
    return f"{backend} {layout.value}"


@dataclass(frozen=True)
class Physical:
    """A placement as the comm layer sees it: rank offsets and the logical expert of each
    physical slot (so the oracle can run on logical ids with the full weights)."""

    name: str
    rank_offsets: tuple[int, ...]  # [W + 1]
    physical_to_logical: torch.Tensor  # int64 [P]

    @property
    def num_physical(self) -> int:
        return self.rank_offsets[-1]


def num_experts(W: int) -> int:
    """Logical experts of the cases at ``W`` ranks: ``E``, or more where ``W`` ranks need
    at least one expert each (W = 8: 10, uneven over the ranks)."""
    return max(E, W + 2)


def physical_layouts(W: int) -> list[Physical]:
    """linear, round-robin, balanced with redundant replicas, and (W > 1) one where rank 0
    holds no expert at all (the backends must still enter every collective)."""
    E = num_experts(W)
    load = torch.arange(1, E + 1, dtype=torch.float64) ** 2
    redundant = 1 + (-(E + 1)) % W
    out = [
        Physical(p_name, p.rank_offsets, p.physical_to_logical)
        for p_name, p in [
            ("linear", epmoe.ExpertPlacement.linear(E, W)),
            ("round_robin", epmoe.ExpertPlacement.round_robin(E, W)),
            (
                f"balanced+{redundant}",
                epmoe.ExpertPlacement.balanced(load, ep_size=W, num_redundant=redundant),
            ),
        ]
    ]
    if W > 1:
        rest = [E * r // (W - 1) for r in range(W)]  # ranks 1 … W-1 split E; rank 0 none
        out.append(Physical("rank 0 empty", (0, *rest), torch.arange(E)))
    return out


def full_weights(dtype, dev, hidden: int = H, seed: int = 0, experts: int = E):
    """The same logical weights ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` on every rank."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * I, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, I, generator=g) / I**0.5
    return w13.to(dev, dtype), w2.to(dev, dtype)


def rank_inputs(rank: int, T: int, P: int, dtype, dev, seed: int = 0, hidden: int = H):
    """Rank ``rank``'s tokens ``x [T, H]``, physical ids ``[T, K]`` (K distinct per token,
    ``DROP`` of them -1) and float32 router weights ``[T, K]``. Any rank can rebuild any
    other rank's inputs from (rank, seed)."""
    g = torch.Generator().manual_seed(7919 * seed + rank)
    x = torch.randn(T, hidden, generator=g) * (1 + torch.rand(T, 1, generator=g))
    ids = torch.rand(T, P, generator=g).argsort(1)[:, :K]
    ids[torch.rand(T, K, generator=g) < DROP] = -1
    w = torch.rand(T, K, generator=g) + 0.1
    return x.to(dev, dtype), ids.to(dev), w.to(dev)


def tokens_per_rank(W: int, micro_batch: int = 0) -> list[int]:
    """Uneven counts with a zero-token rank (rank 1) for W > 1."""
    if W == 1:
        return [7 - 3 * micro_batch]
    return [[5, 0, 9, 3][r % 4] + 2 * micro_batch * (r != 1) for r in range(W)]


def make_spec(phys: Physical, dtype, dev, fp8: bool, hidden: int = H) -> CommSpec:
    return CommSpec(
        hidden_size=hidden,
        top_k=K,
        rank_offsets=phys.rank_offsets,
        max_num_tokens=16,
        dtype=dtype,
        device=dev,
        dispatch_dtype=FP8_DTYPE if fp8 else None,
    )


def logical_ids(ids_TK: torch.Tensor, phys: Physical) -> torch.Tensor:
    p2l = phys.physical_to_logical.to(ids_TK.device)
    return torch.where(ids_TK >= 0, p2l[ids_TK.clamp(min=0)], -1)


def local_weights(phys: Physical, rank: int, w13, w2) -> tuple[torch.Tensor, torch.Tensor]:
    """``w13 [e, 2I, H]``, ``w2 [e, H, I]`` of ``rank``'s slots, in slot order."""
    lo, hi = phys.rank_offsets[rank], phys.rank_offsets[rank + 1]
    idx = phys.physical_to_logical[lo:hi].to(w13.device)
    return w13[idx], w2[idx]


def fake_quantized(x_TH: torch.Tensor) -> torch.Tensor:
    """``dequantize(quantize(x))`` in float64 (exact): what FP8 dispatch delivers."""
    return dequantize_rows(*quantize_groups(x_TH))


def dequantize_rows(hidden: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Dispatched rows ``[..., H]`` to float64; ``scale [..., G]`` per 128-column group."""
    x = hidden.to(torch.float64)
    if scale is None:
        return x
    full = scale.to(torch.float64).repeat_interleave(FP8_GROUP, dim=-1)[..., : x.shape[-1]]
    return x * full


def float64_experts(res: DispatchResult, w13_e, w2_e, out_dtype) -> torch.Tensor:
    """The local experts in float64 on what the dispatch delivered, in its layout:
    Standard ``[R, H]`` weighted sums over local entries, ExpertBatched ``[e, C, H]``
    unweighted outputs (rows past counts zero). Returned in ``out_dtype``."""
    x = dequantize_rows(*_delivered(res))
    w13_e, w2_e = w13_e.double(), w2_e.double()
    out = torch.zeros_like(x)
    if res.layout is Layout.STANDARD:
        for slot in range(w13_e.shape[0]):
            rows, k = torch.nonzero(res.topk_ids == slot, as_tuple=True)
            y = expert_mlp(x[rows], w13_e[slot], w2_e[slot])
            out.index_add_(0, rows, y * res.topk_weights[rows, k, None].double())
    else:
        for slot, n in enumerate(res.counts.tolist()):
            out[slot, :n] = expert_mlp(x[slot, :n], w13_e[slot], w2_e[slot])
    return out.to(out_dtype)


def _stand_ins(ids_TK: torch.Tensor) -> torch.Tensor:
    """What a backend with no empty entry sends for ids of -1: the token to the lowest
    experts it does not use, one each (rows with no expert at all after the last row with
    one are not sent, so they keep their -1)."""
    out = ids_TK.clone()
    real = (ids_TK >= 0).any(1).nonzero()
    last = int(real.max()) if real.numel() else -1
    for t in range(last + 1):
        used = set(ids_TK[t].tolist())
        free = (p for p in itertools.count() if p not in used)
        for k in range(ids_TK.shape[1]):
            if ids_TK[t, k] < 0:
                out[t, k] = next(free)
    return out


def expected_delivery(phys: Physical, rank: int, backend: str, layout: Layout, inputs):
    """What ``rank`` must receive, from every rank's inputs ``[(x, ids, w), …]``.

    Standard: ``(rows [R, H], local ids [R, K], weights [R, K])`` of the tokens with an
    expert here (a backend may deliver more rows, whose ids are all -1: every token, or
    the unused rows of fixed buffers; and in any order).
    ExpertBatched: per local slot, the rows of the tokens that chose it, by source and
    token (the order of the rows inside a slot is the backend's choice: checked sorted).
    """
    lo, hi = phys.rank_offsets[rank], phys.rank_offsets[rank + 1]
    if layout is Layout.STANDARD:  # the tokens with an expert here (any order)
        rows, ids, weights = [], [], []
        for x, ids_TK, w in inputs:
            here_TK = (ids_TK >= lo) & (ids_TK < hi)
            keep = here_TK.any(1)
            rows.append(x[keep])
            ids.append(torch.where(here_TK, ids_TK - lo, -1)[keep])
            weights.append(w[keep])
        return torch.cat(rows), torch.cat(ids), torch.cat(weights)
    if caps_of(backend).empty_entries_to_unused_expert:
        inputs = [(x, _stand_ins(ids_TK), w) for x, ids_TK, w in inputs]

    def rows_of(p: int) -> torch.Tensor:
        return torch.cat([x[(ids_TK == p).any(1)] for x, ids_TK, _ in inputs])

    return [rows_of(p) for p in range(lo, hi)]


def _row_bytes(hidden: torch.Tensor, scale: torch.Tensor | None) -> list[bytes]:
    """Each row's bytes (values, then scales): rows compared bit for bit."""
    N = hidden.shape[0]
    b = hidden.contiguous().view(torch.uint8).reshape(N, hidden.shape[1] * hidden.itemsize)
    if scale is not None:
        b = torch.cat([b, scale.contiguous().view(torch.uint8).reshape(N, 4 * scale.shape[1])], 1)
    return [bytes(row) for row in b.cpu().tolist()]


def _delivered(res: DispatchResult) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(hidden, hidden_scale)`` in the result's layout: ExpertBatched ``[e, C, H]`` slabs,
    gathered through ``row_index`` where the backend left the rows in place."""
    if res.layout is Layout.STANDARD:
        return res.hidden, res.hidden_scale
    return res.expert_rows()


def snapshot(res: DispatchResult) -> DispatchResult:
    """A copy of what ``res`` delivered (its tensors cloned; ExpertBatched rows as slabs),
    to check after the combine."""

    def copy(t):
        return None if t is None else t.clone()

    hidden, scale = _delivered(res)
    return DispatchResult(
        layout=res.layout,
        hidden=hidden.clone(),
        topk_ids=copy(res.topk_ids),
        topk_weights=copy(res.topk_weights),
        counts=copy(res.counts),
        hidden_scale=copy(scale),
    )


def pooled_relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out − ref‖ / ‖ref‖`` over every rank's tokens (collective: every rank). FP8's
    error against the unquantized input is a statistical bound: a rank with a few tokens
    can exceed it alone (3 tokens at W = 8: 6.5e-2), as ``launch/stress.py`` pools too."""
    d = out.double() - ref.double()
    sums = torch.stack([d.pow(2).sum(), ref.double().pow(2).sum()])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(sums)
    return float((sums[0] / sums[1].clamp_min(1e-300)).sqrt())


def _within_one_fp8_step(hidden, scale, source: torch.Tensor, what: str) -> None:
    """FP8 rows from another quantizer: a permutation of the ``source`` rows, each value
    within one e4m3 step of it (2^-3 relative, or the scaled subnormal step 2^-9)."""
    got, want = dequantize_rows(hidden, scale), source.to(torch.float64)
    assert got.shape == want.shape, f"{what}: {tuple(got.shape)} rows, {tuple(want.shape)} due"
    if got.shape[0] == 0:
        return
    j = torch.cdist(got, want).argmin(1)  # each delivered row's nearest source row
    assert sorted(j.tolist()) == list(range(want.shape[0])), f"{what}: rows differ"
    step = dequantize_rows(torch.ones_like(got), scale) * 2.0**-9
    err = (got - want[j]).abs()
    bad = err > 2.0**-3 * want[j].abs() + step
    assert not bad.any(), f"{what}: {int(bad.sum())} values off by more than one FP8 step"


def check_delivery(res: DispatchResult, want, spec: CommSpec, exact_fp8: bool = True) -> None:
    """The dispatched rows are exactly the expected ones of ``expected_delivery`` (FP8:
    bit-exact values and scales of ``quantize_groups`` of the source rows, or with
    ``exact_fp8=False`` within one FP8 step of the source rows), with the wire dtype and
    the scale shape of the spec."""
    fp8, layout = spec.fp8_dispatch, res.layout
    if res.row_index is not None:  # rows read in place: check the slabs they stand for
        assert layout is Layout.EXPERT_BATCHED and res.row_index.dtype == torch.int32
        assert res.hidden.dim() == 2 and res.row_index.shape[0] == res.counts.shape[0]
        res = snapshot(res)
    assert res.hidden.dtype == spec.wire_dtype, (
        f"hidden is {res.hidden.dtype}, expected {spec.wire_dtype}"
    )
    if fp8:
        G = math.ceil(res.hidden.shape[-1] / FP8_GROUP)
        expected = (*res.hidden.shape[:-1], G)
        assert res.hidden_scale is not None and res.hidden_scale.dtype == torch.float32, (
            f"FP8 dispatch must carry float32 hidden_scale, got {res.hidden_scale}"
        )
        assert tuple(res.hidden_scale.shape) == expected, (
            f"hidden_scale {tuple(res.hidden_scale.shape)}, expected {expected}"
        )
    else:
        assert res.hidden_scale is None, "hidden_scale set without FP8 dispatch"

    def wire_rows(rows: torch.Tensor) -> list[bytes]:  # what the source rows look like sent
        return _row_bytes(*quantize_groups(rows)) if fp8 else _row_bytes(rows, None)

    if layout is Layout.STANDARD:  # rows with a local expert, as (row, ids, weights)
        rows, ids, weights = want
        keep = (res.topk_ids >= 0).any(1)
        scale = res.hidden_scale[keep] if fp8 else None

        def entries(row_bytes, ids_RK, w_RK):
            w_RK = torch.where(ids_RK >= 0, w_RK.float(), 0.0)  # weights of -1 entries: free
            return sorted(zip(row_bytes, map(tuple, ids_RK.tolist()), map(tuple, w_RK.tolist())))

        got = entries(_row_bytes(res.hidden[keep], scale), res.topk_ids[keep].cpu(),
                      res.topk_weights[keep].cpu())  # fmt: skip
        expect = entries(wire_rows(rows), ids.cpu(), weights.cpu())
        assert len(got) == len(expect), f"{len(got)} rows with a local expert, {len(expect)} due"
        assert got == expect, "rows, local top-k ids or router weights differ"
        return
    counts = res.counts.tolist()
    assert counts == [r.shape[0] for r in want], (
        f"counts {counts}, expected {[r.shape[0] for r in want]}"
    )
    for slot, n in enumerate(counts):  # the order of rows inside a slot is free
        scale = res.hidden_scale[slot, :n] if fp8 else None
        if fp8 and not exact_fp8:
            _within_one_fp8_step(res.hidden[slot, :n], scale, want[slot], f"slot {slot}")
            continue
        got = sorted(_row_bytes(res.hidden[slot, :n], scale))
        assert got == sorted(wire_rows(want[slot])), f"slot {slot}: rows differ"


# ----------------------------------------------------------------------- rank bodies


def hidden_for(backend: str, dtype, dev, world: int, sizes=(H, H_TORCH_EXPERTS, 2048)) -> int:
    """The first hidden size of ``sizes`` that ``backend`` serves (DeepEP's low-latency
    kernels take a few fixed ones): the suite runs every backend at a size it supports."""
    phys = physical_layouts(world)[0]
    for hidden in sizes:  # one that every wire the backend offers serves (pplx: FP8 scales)
        specs = [make_spec(phys, dtype, dev, fp8, hidden) for fp8 in _wires(backend)]
        if all(supports(backend, spec) is None for spec in specs):
            return hidden
    return sizes[0]  # none: the cases skip with the backend's reason


def skip_unless_supported(backend: str, spec: CommSpec) -> None:
    """Skip a case whose spec the backend refuses (placement, hidden, dtype), with why."""
    import pytest

    reason = supports(backend, spec)
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")


def _wires(backend: str) -> tuple[bool, ...]:
    """FP8 on the wire too where the backend offers it."""
    return (False, True) if caps_of(backend).fp8_dispatch else (False,)


def usable_here(fn):
    """A rank body that first skips, with the reason, when ``backend`` cannot run on this
    process group (e.g. DeepEP at W = 1 or 3): checks that need the live group, which the
    parent process's collection-time check cannot make."""

    @functools.wraps(fn)
    def body(rank, world, backend, device="cpu", dtype_name="float32"):
        import pytest

        reason = epmoe.available_backends(device_for(rank, device))[split_variant(backend)[0]]
        if reason is not None:
            pytest.skip(f"{backend} at W={world}: {reason}")
        return fn(rank, world, backend, device, dtype_name)

    return body


@usable_here
def check_oracle_and_fp8(rank, world, backend, device="cpu", dtype_name="float32"):
    """``backend`` in each layout × placement, with and without FP8 dispatch, on the
    blocking and the split path: exact delivery, then the combined output against the
    oracle (on the dequantized input exactly, and on the original input with the FP8
    tolerance)."""
    dtype, dev = getattr(torch, dtype_name), device_for(rank, device)
    hidden = hidden_for(backend, dtype, dev, world)
    w13, w2 = full_weights(dtype, dev, hidden=hidden, experts=num_experts(world))
    T_W = tokens_per_rank(world)
    sweep = Sweep()
    cases = itertools.product(layouts_of(backend), physical_layouts(world), _wires(backend))
    for seed, (layout, phys, fp8) in enumerate(cases):
        case = f"W={world} {_label(backend, layout)} {phys.name}{' fp8' if fp8 else ''}"
        with sweep.case(case):
            spec = make_spec(phys, dtype, dev, fp8, hidden)
            skip_unless_supported(backend, spec)
            comm = make(backend, spec, layout)
            P = phys.num_physical
            inputs = [
                rank_inputs(s, T_W[s], P, dtype, dev, seed, hidden=hidden) for s in range(world)
            ]
            x, ids, w = inputs[rank]
            # the split path for FP8, the blocking one otherwise (it calls the split path)
            with closing(comm):
                res = comm.dispatch_async(x, ids, w).wait() if fp8 else comm.dispatch(x, ids, w)
                y = float64_experts(res, *local_weights(phys, rank, w13, w2), dtype)
                # fixed-buffer backends own what they delivered until the combine: keep a
                # copy, combine on every rank, then check (a failing check must not leave
                # one rank's dispatch uncombined)
                delivered = snapshot(res)
                out = comm.combine_async(y, res).wait() if fp8 else comm.combine(y, res)
            lids = logical_ids(ids, phys)
            if fp8:  # (collective: before any check can raise on one rank only)
                ref = epmoe.reference.moe(x, w13, w2, w, lids)
                pooled = pooled_relative_error(out, ref)
            exact = caps_of(backend).fp8_reference_quantizer
            due = expected_delivery(phys, rank, backend, layout, inputs)
            check_delivery(delivered, due, spec, exact_fp8=exact)
            assert out.shape == x.shape and out.dtype == dtype, (out.shape, out.dtype)
            if exact or not fp8:  # (another quantizer's wire input is not ours)
                x_wire = fake_quantized(x) if fp8 else x
                ref_wire = epmoe.reference.moe(x_wire, w13, w2, w, lids)
                assert_close(out, ref_wire, TOLERANCES[dtype], name=f"rank {rank} vs wire input")
            if fp8:  # FP8's error against the unquantized input, over every rank's tokens
                assert pooled <= TOLERANCES[FP8_DTYPE], (
                    f"FP8 dispatch: relative error {pooled:.3e} against the unquantized "
                    f"input over all ranks > {TOLERANCES[FP8_DTYPE]}"
                )
    sweep.check()
    return sweep.passed


@usable_here
def check_fp8_with_torch_experts(rank, world, backend, device="cpu", dtype_name="float32"):
    """FP8 dispatch into ``TorchExperts`` (which consume ``hidden_scale`` and return
    bfloat16): the layer's dtype comes back, within the FP8 tolerance of the oracle."""
    dtype, dev = getattr(torch, dtype_name), device_for(rank, device)
    hidden = hidden_for(backend, dtype, dev, world, sizes=(H_TORCH_EXPERTS, 2048))
    w13, w2 = full_weights(dtype, dev, hidden=hidden, seed=1, experts=num_experts(world))
    T_W = tokens_per_rank(world)
    experts = TorchExperts("silu")
    sweep = Sweep()
    for layout, phys in itertools.product(layouts_of(backend), physical_layouts(world)[:2]):
        with sweep.case(f"W={world} {_label(backend, layout)} {phys.name} torch experts fp8"):
            spec = make_spec(phys, dtype, dev, fp8=True, hidden=hidden)
            skip_unless_supported(backend, spec)
            comm = make(backend, spec, layout)
            x, ids, w = rank_inputs(
                rank, T_W[rank], phys.num_physical, dtype, dev, seed=11, hidden=hidden
            )
            with closing(comm):
                res = comm.dispatch(x, ids, w)
                y = experts(res, ExpertWeights(*local_weights(phys, rank, w13, w2)))
                out = comm.combine(y, res)
            ref = epmoe.reference.moe(x, w13, w2, w, logical_ids(ids, phys))
            pooled = pooled_relative_error(out, ref)  # (collective: before any check)
            assert out.dtype == dtype, f"combine returned {out.dtype}, expected {dtype}"
            assert pooled <= TOLERANCES[FP8_DTYPE], (
                f"FP8 into torch experts: relative error {pooled:.3e} over all ranks > "
                f"{TOLERANCES[FP8_DTYPE]}"
            )
    sweep.check()
    return sweep.passed


# Schedules of two micro-batches: "D0" starts dispatch 0, "d0" waits for it and runs the
# experts, "C0" starts combine 0, "c0" waits for it. Every rank runs the same schedule.
SCHEDULES = {
    "both dispatches, then both combines": "D0 D1 d0 d1 C0 C1 c0 c1",
    "combine 0 in flight over dispatch 1": "D0 d0 C0 D1 d1 C1 c0 c1",
    "finished in reverse order": "D0 D1 d1 d0 C1 C0 c1 c0",
    "all four started before any combine wait": "D0 D1 d0 C0 d1 C1 c1 c0",
}


@usable_here
def check_in_flight(rank, world, backend, device="cpu", dtype_name="float32"):
    """Two micro-batches with several operations in flight, in the orders of
    ``SCHEDULES``, each output against the oracle (FP8 too, for one placement). Needs a
    backend that holds two dispatch results (``max_in_flight`` None or ≥ 2)."""
    dtype, dev = getattr(torch, dtype_name), device_for(rank, device)
    hidden = hidden_for(backend, dtype, dev, world)
    w13, w2 = full_weights(dtype, dev, hidden=hidden, seed=2, experts=num_experts(world))
    phys_all = physical_layouts(world)
    sweep = Sweep()
    for layout, (sname, schedule), fp8 in itertools.product(
        layouts_of(backend), SCHEDULES.items(), _wires(backend)
    ):
        phys = phys_all[-1] if fp8 else phys_all[0]
        with sweep.case(f"W={world} {_label(backend, layout)} {sname}{' fp8' if fp8 else ''}"):
            spec = make_spec(phys, dtype, dev, fp8, hidden)
            skip_unless_supported(backend, spec)
            comm = make(backend, spec, layout)
            in_flight = comm.capabilities.max_in_flight
            assert in_flight is None or in_flight >= 2, f"holds {in_flight}"
            w13_e, w2_e = local_weights(phys, rank, w13, w2)
            mb = [
                rank_inputs(rank, tokens_per_rank(world, m)[rank], phys.num_physical, dtype,
                            dev, seed=20 + m, hidden=hidden)
                for m in range(2)
            ]  # fmt: skip
            pending, results, outs = {}, {}, {}
            with closing(comm):
                for op in schedule.split():
                    m = int(op[1])
                    if op[0] == "D":
                        pending[m] = comm.dispatch_async(*mb[m])
                    elif op[0] == "d":
                        results[m] = pending.pop(m).wait()
                    elif op[0] == "C":
                        y = float64_experts(results[m], w13_e, w2_e, dtype)
                        pending[m] = comm.combine_async(y, results[m])
                    else:
                        outs[m] = pending.pop(m).wait()
            for m, (x, ids, w) in enumerate(mb):
                x_wire = fake_quantized(x) if fp8 else x
                ref = epmoe.reference.moe(x_wire, w13, w2, w, logical_ids(ids, phys))
                assert_close(outs[m], ref, TOLERANCES[dtype], name=f"rank {rank} micro-batch {m}")
    sweep.check()
    return sweep.passed


@usable_here
def check_rebind(rank, world, backend, device="cpu", dtype_name="float32"):
    """A backend built for one placement and rebound to each other one (same ranks, P may
    change) gives the oracle's results for the placement it is bound to."""
    import pytest

    dtype, dev = getattr(torch, dtype_name), device_for(rank, device)
    hidden = hidden_for(backend, dtype, dev, world)
    w13, w2 = full_weights(dtype, dev, hidden=hidden, seed=3, experts=num_experts(world))
    T_W = tokens_per_rank(world)
    phys_all = physical_layouts(world)
    sweep = Sweep()
    for layout in layouts_of(backend):
        with sweep.case(f"W={world} {_label(backend, layout)} rebind"):
            spec = make_spec(phys_all[0], dtype, dev, False, hidden)
            skip_unless_supported(backend, spec)
            comm = make(backend, spec, layout)
            for step, phys in enumerate([*phys_all[1:], phys_all[0]]):
                if supports(backend, spec.with_offsets(phys.rank_offsets)):
                    continue  # a placement this backend cannot serve (DeepEP: uneven)
                why = comm.rebind_reason(spec.with_offsets(phys.rank_offsets))
                if why is not None:  # declared (buffers sized for another P): refused as said
                    with pytest.raises(ValueError, match="cannot serve the new placement"):
                        comm.rebind(phys.rank_offsets)
                    assert comm.spec.rank_offsets != phys.rank_offsets  # still the old one
                    continue
                comm.rebind(phys.rank_offsets)
                assert comm.spec.rank_offsets == phys.rank_offsets
                x, ids, w = rank_inputs(
                    rank, T_W[rank], phys.num_physical, dtype, dev, 30 + step, hidden=hidden
                )
                res = comm.dispatch(x, ids, w)
                y = float64_experts(res, *local_weights(phys, rank, w13, w2), dtype)
                out = comm.combine(y, res)
                ref = epmoe.reference.moe(x, w13, w2, w, logical_ids(ids, phys))
                assert_close(out, ref, TOLERANCES[dtype], name=f"rank {rank} after {phys.name}")
            with pytest.raises(ValueError, match="rank_offsets must have"):
                comm.rebind((0, *phys_all[0].rank_offsets))  # one rank too many
            comm.close()
    sweep.check()
    return sweep.passed


def _skewed_ids(case: str, rank: int, T: int, phys: Physical, dev) -> torch.Tensor:
    """``[T, K]`` physical ids: every token to one expert (the last slot, K-1 entries -1),
    or every token only to rank 0's experts."""
    if case == "one expert":
        ids = torch.full((T, K), -1, dtype=torch.int64)
        ids[:, 0] = phys.num_physical - 1
    else:  # "one rank": K distinct slots of rank 0 (the others' slots when it has none)
        lo, hi = phys.rank_offsets[0], phys.rank_offsets[1]
        if hi - lo < K:
            lo, hi = 0, phys.num_physical
        g = torch.Generator().manual_seed(rank)
        rows = [lo + torch.randperm(hi - lo, generator=g)[:K] for _ in range(T)]
        ids = torch.stack(rows) if rows else torch.empty(0, K, dtype=torch.int64)
    return ids.to(dev)


@usable_here
def check_skewed_and_full(rank, world, backend, device="cpu", dtype_name="float32"):
    """Skewed routing (all tokens to one expert; all to one rank) and T = M_max on every
    rank, with and without FP8 where offered: the combined output against the oracle."""
    dtype, dev = getattr(torch, dtype_name), device_for(rank, device)
    hidden = hidden_for(backend, dtype, dev, world)
    w13, w2 = full_weights(dtype, dev, hidden=hidden, seed=5, experts=num_experts(world))
    phys = physical_layouts(world)[0]
    sweep = Sweep()
    for layout, fp8, case in itertools.product(
        layouts_of(backend), _wires(backend), ("one expert", "one rank", "T = M_max")
    ):
        with sweep.case(f"W={world} {_label(backend, layout)} {case}{' fp8' if fp8 else ''}"):
            spec = make_spec(phys, dtype, dev, fp8, hidden)
            skip_unless_supported(backend, spec)
            T = spec.max_num_tokens if case == "T = M_max" else [9, 0, 5, 3][rank % 4]
            x, ids, w = rank_inputs(rank, T, phys.num_physical, dtype, dev, seed=40, hidden=hidden)
            if case != "T = M_max":
                ids = _skewed_ids(case, rank, T, phys, dev)
            with closing(make(backend, spec, layout)) as comm:
                res = comm.dispatch(x, ids, w)
                y = float64_experts(res, *local_weights(phys, rank, w13, w2), dtype)
                out = comm.combine(y, res)
            x_wire = fake_quantized(x) if fp8 else x
            ref = epmoe.reference.moe(x_wire, w13, w2, w, logical_ids(ids, phys))
            assert_close(out, ref, TOLERANCES[dtype], name=f"rank {rank} {case}")
    sweep.check()
    return sweep.passed


def _identity_out(res: DispatchResult, dtype) -> torch.Tensor:
    """Experts that return their input, capturable (no host reads): Standard rows weighted
    by their local entries' weights, ExpertBatched rows as they are."""
    from epmoe.bench.comm import identity_expert_out

    return identity_expert_out(res, dtype)


@usable_here
def check_graph_replay(rank, world, backend, device="cpu", dtype_name="float32"):
    """Where the backend claims ``graph_safe`` (on CUDA): dispatch, identity experts and
    combine captured in one CUDA graph and replayed with new tokens and routing, each
    replay equal to ``x · Σ_k w`` (the identity experts' combine)."""
    import pytest

    dtype, dev = getattr(torch, dtype_name), device_for(rank, device)
    if dev.type != "cuda" or not caps_of(backend).graph_safe:
        pytest.skip(f"{backend}: graph replay needs a graph-safe backend on CUDA")
    hidden = hidden_for(backend, dtype, dev, world)
    phys = physical_layouts(world)[0]
    sweep = Sweep()
    for layout in layouts_of(backend):
        with sweep.case(f"W={world} {_label(backend, layout)} graph replays"):
            spec = make_spec(phys, dtype, dev, False, hidden)
            skip_unless_supported(backend, spec)
            T = [9, 0, 5, 3][rank % 4]
            x, ids, w = rank_inputs(rank, T, phys.num_physical, dtype, dev, seed=50, hidden=hidden)
            with closing(make(backend, spec, layout)) as comm:

                def step(comm=comm, x=x, ids=ids, w=w):
                    res = comm.dispatch(x, ids, w)
                    return comm.combine(_identity_out(res, dtype), res)

                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        step()
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = step()
                for i in range(5):
                    nx, nids, nw = rank_inputs(
                        rank, T, phys.num_physical, dtype, dev, seed=60 + i, hidden=hidden
                    )
                    x.copy_(nx), ids.copy_(nids), w.copy_(nw)
                    graph.replay()
                    torch.cuda.synchronize()
                    want = x.float() * torch.where(ids >= 0, w, 0.0).sum(-1, keepdim=True)
                    assert_close(out, want, TOLERANCES[dtype], name=f"replay {i}")
    sweep.check()
    return sweep.passed


@usable_here
def check_layer_end_to_end(rank, world, backend, device="cpu", dtype_name="float32"):
    """``EPMoE(backend=...)`` in each layout, with the Triton experts on CUDA (torch on
    CPU), against the oracle: uneven token counts, a zero-token rank, chunks above M."""
    dtype, dev = getattr(torch, dtype_name), device_for(rank, device)
    hidden = hidden_for(backend, dtype, dev, world)
    w13, w2 = full_weights(dtype, dev, hidden=hidden, seed=7, experts=num_experts(world))
    experts = "triton" if dev.type == "cuda" else "torch"
    sweep = Sweep()
    for layout in layouts_of(backend):
        with sweep.case(f"W={world} {_label(backend, layout)} EPMoE {experts} experts"):
            spec = make_spec(physical_layouts(world)[0], dtype, dev, False, hidden)
            skip_unless_supported(backend, spec)
            layer = epmoe.EPMoE(
                num_experts(world), K, hidden, I, backend=split_variant(backend)[0],
                backend_options=split_variant(backend)[1] or None, layout=layout,
                experts=experts, max_num_tokens=spec.max_num_tokens, params_dtype=dtype,
                device=dev,
            )  # fmt: skip
            layer.load_experts(w13, w2)
            T = [2 * spec.max_num_tokens + 3, 0, 9, 5][rank % 4]  # chunks above M_max
            g = torch.Generator().manual_seed(70 + rank)
            x = torch.randn(T, hidden, generator=g).to(dev, dtype)
            logits = torch.randn(T, num_experts(world), generator=g).to(dev)
            out = layer(x, logits)
            ref = epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, K))
            assert_close(out, ref, TOLERANCES[dtype], name=f"rank {rank}")
            layer.comm.close()
    sweep.check()
    return sweep.passed
