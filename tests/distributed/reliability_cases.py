"""Rank bodies for ``tests/distributed/test_reliability.py``: one rank misconfigured or out
of step (see ``docs/reliability.md``).

Each case makes rank ``ODD`` differ from the others, times the call on every rank
(``time.monotonic``), and checks that every rank raised in that same call: the odd rank its
own error, the others an error that names it. A case's assertions run after its last
collective (``Sweep``), and each task ends with a correct call on every rank to show the
group is still in step. Every body returns rows ``{case, rank, seconds, error}`` for the
table the test prints.
"""

from __future__ import annotations

import contextlib
import datetime
import re
import time

import torch
import torch.distributed as dist

import epmoe
from epmoe.agreement import PreviousStepDiffers
from epmoe.comm.collectives import ARRIVAL_GRACE_S
from epmoe.reference import assert_close
from tests.distributed.cases import full_weights, rank_tokens
from tests.harness import Sweep

E, K, H, I = 8, 2, 16, 8
ODD = 1  # the rank that differs
FAST_S = 5.0  # every fault that an agreement catches raises within this, on every rank
BASE = dict(params_dtype=torch.float32, device="cpu", experts="torch", backend="all_to_all")


class Router:
    """A custom routing function (the same class on every rank, so the layers' fingerprints
    agree) that puts ``bad_id`` in its first token's first slot when set."""

    def __init__(self) -> None:
        self.bad_id: int | None = None

    def __call__(self, logits, top_k, renormalize):
        w, ids = epmoe.select_experts(logits, top_k, renormalize)
        if self.bad_id is not None and ids.numel():
            ids = ids.clone()
            ids[0, 0] = self.bad_id
        return w, ids


def _timed(fn) -> tuple[float, Exception | None, object]:
    """``(seconds, the exception or None, the result)`` of ``fn()``."""
    start = time.monotonic()
    try:
        out, error = fn(), None
    except Exception as exc:  # every case expects one on some ranks
        out, error = None, exc
    return time.monotonic() - start, error, out


def _row(case: str, rank: int, seconds: float, error: Exception | None) -> dict:
    text = "(no error)" if error is None else f"{type(error).__name__}: {error}"
    return dict(case=case, rank=rank, seconds=round(seconds, 4), error=text)


def _check(error, seconds, kind, pattern, limit_s=FAST_S) -> None:
    """``error`` is a ``kind`` whose message matches ``pattern`` (or None when ``kind`` is
    None), and it came within ``limit_s``."""
    if kind is None:
        assert error is None, f"expected no error, got {type(error).__name__}: {error}"
    else:
        assert isinstance(error, kind), f"expected {kind.__name__}, got {error!r}"
        assert re.search(pattern, str(error)), f"{pattern!r} not in: {error}"
    assert seconds < limit_s, f"took {seconds:.2f} s, limit {limit_s} s"


def _others(world: int) -> str:
    """``"ranks [0, 2]"`` for W = 3: the ranks other than ODD, as messages name them."""
    rest = [r for r in range(world) if r != ODD]
    return f"rank {rest[0]}" if len(rest) == 1 else f"ranks {rest}"


def _build(top_k: int = K, H: int = H, **kwargs):
    return epmoe.EPMoE(E, top_k, H, I, **kwargs)


def _layer(**kwargs):
    """A layer with the shared weights loaded."""
    kwargs = {**BASE, **kwargs}
    layer = epmoe.EPMoE(E, kwargs.pop("top_k", K), kwargs.pop("H", H), I, **kwargs)
    w13, w2 = full_weights(E, H, I, torch.float32, "cpu")
    layer.load_experts(w13, w2)
    return layer, w13, w2


def _in_step(layer, w13, w2, rank: int) -> None:
    """A correct forward on every rank: the group is still in step."""
    x, logits = rank_tokens(rank, 4 + rank, H, E, torch.float32, "cpu", seed=7)
    ref = epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, layer.top_k))
    assert_close(layer(x, logits), ref, 1e-5, name=f"rank {rank} after the errors")


# ------------------------------------------------------------------ construction


def construction_mismatch(rank: int, world: int) -> list[dict]:
    """Rank ODD builds its layer with one other argument: every rank raises in the
    construction, before any backend is built, naming the field and the ranks."""
    others = _others(world)
    differs = {
        "placement='round_robin' on one rank (others 'linear')": (
            dict(placement="round_robin"),
            "placement",
        ),
        "top_k=3 on one rank (others 2)": (dict(top_k=3), "top_k"),
        "hidden_size=24 on one rank (others 16)": (dict(H=24), "hidden_size"),
        "layout='expert_batched' on one rank (others 'standard')": (
            dict(layout="expert_batched"),
            "layout",
        ),
        "params_dtype=bfloat16 on one rank (others float32)": (
            dict(params_dtype=torch.bfloat16),
            "params_dtype",
        ),
        "backend='naive' on one rank (others 'all_to_all')": (dict(backend="naive"), "backend"),
        "max_num_tokens=4 on one rank (others the default)": (
            dict(max_num_tokens=4),
            "max_num_tokens",
        ),
        "activation='gelu' on one rank (others 'silu')": (dict(activation="gelu"), "activation"),
    }
    sweep, rows = Sweep(), []
    for case, (kwargs, field) in differs.items():
        with sweep.case(case):
            mine = {**BASE, **(kwargs if rank == ODD else {})}
            seconds, error, _ = _timed(lambda mine=mine: _build(**mine))
            rows.append(_row(case, rank, seconds, error))
            theirs, mine = re.escape(f"{others} have "), re.escape(f"rank {ODD} has ")
            pattern = rf"{field} differs: ({theirs}.*, {mine}|{mine}.*, {theirs})"
            _check(error, seconds, ValueError, pattern)

    refused = {  # one rank's argument is refused by its own checks
        "top_k=0 on one rank": (dict(top_k=0), ValueError, "top_k must be a positive int"),
        "backend='nope' on one rank": (dict(backend="nope"), ValueError, "unknown backend"),
        "backend_options={'num_sms': 24} on one rank (all_to_all takes none)": (
            dict(backend_options={"num_sms": 24}),
            ValueError,
            "backend 'all_to_all' has no option 'num_sms': it takes no options",
        ),
    }
    for case, (kwargs, kind, own) in refused.items():
        with sweep.case(case):
            mine = {**BASE, **(kwargs if rank == ODD else {})}
            seconds, error, _ = _timed(lambda mine=mine: _build(**mine))
            rows.append(_row(case, rank, seconds, error))
            if rank == ODD:
                _check(error, seconds, kind, own)
            else:
                _check(error, seconds, RuntimeError, f"rank {ODD} rejected its arguments")
    with sweep.case("then the same layer on every rank"):
        _in_step(*_layer(), rank)
    sweep.check()
    return rows


# ------------------------------------------------------------------ forward inputs


def bad_forward_inputs(rank: int, world: int) -> list[dict]:
    """Rank ODD calls forward with an input that its checks refuse (before the agreement):
    every rank raises in that same call."""
    router = Router()
    layer, w13, w2 = _layer(custom_routing_function=router)
    T = 3 + rank
    x, logits = rank_tokens(rank, T, H, E, torch.float32, "cpu")
    empty_x, empty_logits = x[:0], logits[:0]
    named = rf"another rank .*rank {ODD} "
    # case: (this rank's call, the odd rank's error (type, pattern), the others' pattern)
    cases = {
        "hidden_states=None on one rank": (
            lambda: layer(None if rank == ODD else x, logits),
            (TypeError, "hidden_states must be a torch.Tensor, got NoneType"),
            named + "rejected",
        ),
        "router_logits a list on one rank": (
            lambda: layer(x, logits.tolist() if rank == ODD else logits),
            (TypeError, "router_logits must be a torch.Tensor, got list"),
            named + "rejected",
        ),
        "router_logits on the meta device on one rank": (
            lambda: layer(x, logits.to("meta") if rank == ODD else logits),
            (ValueError, "router_logits on meta cannot be copied to the layer's cpu"),
            named + "rejected",
        ),
        "custom router returns id E on one rank": (
            lambda: _with_bad_id(router, rank, E, lambda: layer(x, logits)),
            (ValueError, "expert ids"),
            named,
        ),
        "custom router returns id E on one rank, T = 0 on the others": (
            lambda: _with_bad_id(
                router,
                rank,
                E,
                lambda: layer(x, logits) if rank == ODD else layer(empty_x, empty_logits),
            ),
            (ValueError, "expert ids"),
            named,
        ),
        "custom router returns id -5 on one rank": (
            lambda: _with_bad_id(router, rank, -5, lambda: layer(x, logits)),
            (ValueError, "expert ids"),
            named,
        ),
        "routing ids out of range past select_experts' own checks (device flag)": (
            lambda: _with_bad_select(layer, rank, lambda: layer(x, logits)),
            (ValueError, rf"the routing returned expert ids in \[0, {E}\] on this rank"),
            rf"the routing of rank {ODD} chose expert ids outside \[-1, E\)",
        ),
        "num_valid_tokens above T on one rank (device flag)": (
            lambda: layer(x, logits, num_valid_tokens=torch.tensor(T + 2 if rank == ODD else T)),
            (ValueError, rf"num_valid_tokens={T + 2} on this rank, whose batch has T={T}"),
            rf"the num_valid_tokens of rank {ODD} lay outside \[0, T\]",
        ),
        "num_valid_tokens a uint32 count on one rank": (
            lambda: layer(
                x,
                logits,
                num_valid_tokens=torch.tensor(
                    1, dtype=torch.uint32 if rank == ODD else torch.int64
                ),
            ),
            (ValueError, r"num_valid_tokens must be .*int8/16/32/64 or uint8\), got torch.uint32"),
            named + "rejected",
        ),
        "num_valid_tokens -1 on one rank (device flag)": (
            lambda: layer(x, logits, num_valid_tokens=torch.tensor(-1 if rank == ODD else 1)),
            (ValueError, rf"must lie in \[0, {T}\]"),
            rf"the num_valid_tokens of rank {ODD} lay outside \[0, T\]",
        ),
    }
    sweep, rows = Sweep(), []
    for case, (call, (kind, own), theirs) in cases.items():
        with sweep.case(case):
            seconds, error, _ = _timed(call)
            rows.append(_row(case, rank, seconds, error))
            if rank == ODD:
                _check(error, seconds, kind, own)
            else:
                _check(error, seconds, RuntimeError, theirs)
    with sweep.case("custom router returns id E on one rank that has T = 0: nothing routed"):
        mine = (empty_x, empty_logits) if rank == ODD else (x, logits)
        seconds, error, out = _timed(lambda: _with_bad_id(router, rank, E, lambda: layer(*mine)))
        rows.append(_row("custom router returns id E on a rank with T = 0", rank, seconds, error))
        _check(error, seconds, None, "")
        ref = epmoe.reference.moe(mine[0], w13, w2, *epmoe.select_experts(mine[1], K))
        assert_close(out, ref, 1e-5)
    with sweep.case("then a correct forward on every rank"):
        _in_step(layer, w13, w2, rank)
    sweep.check()
    return rows


def _with_bad_id(router: Router, rank: int, bad_id: int, call):
    router.bad_id = bad_id if rank == ODD else None
    try:
        return call()
    finally:
        router.bad_id = None


def _with_bad_select(layer, rank: int, call):
    """Rank ODD's routing yields id E after ``select_experts`` (which checks custom ids
    itself on CPU), so that only the layer's device flag can catch it."""
    if rank != ODD:
        return call()
    select = layer._select

    def bad(logits):
        w, ids = select(logits)
        ids = ids.clone()
        ids[0, 0] = E
        return w, ids

    layer._select = bad
    try:
        return call()
    finally:
        del layer._select


# ------------------------------------------------------------------ out of step


def out_of_step(rank: int, world: int) -> list[dict]:
    """Rank ODD skips a call (or makes an extra one) and meets the others' call with a
    different one: every rank raises in that call naming where each rank is, and the call
    is counted nowhere, so the next calls proceed."""
    layer, w13, w2 = _layer()
    other, _, _ = _layer()  # layer #1 of a two-layer model
    x, logits = rank_tokens(rank, 5, H, E, torch.float32, "cpu")
    new = epmoe.ExpertPlacement.round_robin(E, world)
    everyone = re.escape(f"{_others(world)} are in forward of layer #{layer._agreement.index}")
    cases = {
        "one rank skipped a forward; the next rebalance": (
            lambda: layer.rebalance(new) if rank == ODD else layer(x, logits),
            rf"different EPMoE calls: ({everyone}.*, rank {ODD} is in rebalance)",
        ),
        "one rank skipped a rebalance": (
            lambda: layer(x, logits) if rank == ODD else layer.rebalance(new),
            rf"different EPMoE calls: .*rank {ODD} is in forward",
        ),
        "one rank skipped layer #0's forward (two-layer model)": (
            lambda: other(x, logits) if rank == ODD else layer(x, logits),
            rf"different layers: {everyone} .*, rank {ODD} is in forward of layer "
            rf"#{other._agreement.index}",
        ),
        "one rank builds a layer the others do not": (
            lambda: _layer() if rank == ODD else layer(x, logits),
            rf"different EPMoE calls: .*rank {ODD} is in construction",
        ),
    }
    sweep, rows = Sweep(), []
    for case, (call, pattern) in cases.items():
        with sweep.case(case):
            seconds, error, _ = _timed(call)
            rows.append(_row(case, rank, seconds, error))
            _check(error, seconds, RuntimeError, pattern)
    with sweep.case("then both layers on every rank, and a rebalance"):
        _in_step(layer, w13, w2, rank)
        _in_step(other, w13, w2, rank)
        layer.rebalance(new)
        _in_step(layer, w13, w2, rank)

    # Inside a step the layers do not agree (no collective of their own): the backends
    # whose counts reach the host carry each layer's tag with them, so a rank in another
    # layer's dispatch is refused there, on every rank, before any row moves
    # (ExpertBatched's per-expert counts are as long as the layer's slots per rank: a
    # second layer whose slots differ, [2, 4, 2] or [4, 2, 2] against [3, 3, 2] at W = 3,
    # so that a rank sends fewer or more counts than a peer in the other layer expects
    # (more once aborted gloo), is named by the fixed-size header before them)
    def slots(offsets):
        placement = epmoe.ExpertPlacement.from_physical_to_logical(
            range(E), 3, rank_offsets=offsets
        )
        return dict(placement=placement, _slots=offsets)

    uneven = [slots([0, 2, 6, 8]), slots([0, 4, 6, 8])] if world == 3 else []
    for backend, layout, more in (("all_to_all", "standard", {}),
                                  ("all_to_all", "expert_batched", {}),
                                  *(("all_to_all", "expert_batched", u) for u in uneven),
                                  ("naive", "standard", {})):  # fmt: skip
        more = dict(more)
        offsets = more.pop("_slots", None)
        first, _, _ = _layer(backend=backend, layout=layout)
        second, _, _ = _layer(backend=backend, layout=layout, **more)
        if offsets:
            sizes = [b - a for a, b in zip(offsets, offsets[1:])]
            layout += f", the second layer's slots per rank {sizes}"
        where = rf"rank {ODD} in layer #{second._agreement.index}'s dispatch"
        orders = {  # what rank ODD calls in the step; the others call [first, second]
            "skipped layer #0 inside a step": [second],
            "called the step's layers in the other order": [second, first],
        }
        for what, odd_order in orders.items():
            case = f"{backend} ({layout}): one rank {what}"
            order = odd_order if rank == ODD else [first, second]
            with sweep.case(case):
                seconds, error, _ = _timed(lambda order=order: _step_of(order, x, logits))
                rows.append(_row(case, rank, seconds, error))
                _check(error, seconds, RuntimeError, rf"different MoE layers' dispatches .*{where}")
        with sweep.case(f"{backend} ({layout}): then a step of both layers on every rank"):
            ref = epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, K))
            for out in _step_of([first, second], x, logits):
                assert_close(out, ref, 1e-5, name=f"rank {rank} in a step")
    sweep.check()
    return rows


def previous_step_calls(rank: int, world: int) -> list[dict]:
    """Each rank counts the layer calls of a step that reached their dispatch, and the next
    step compares the counts. A rank with a call more (what a forward whose dispatch met no
    one leaves behind: a rank that skipped the step's last layer, on the graph-safe
    backends, whose dispatch does not hold the host; on gloo every dispatch is a collective,
    so the extra call is added to the step's count here) is named at the next step on every
    rank, also from a step opened inside the step, and the step after it proceeds. A call
    refused on one rank before its dispatch (and retried) is not counted, and a step that
    ended in an exception on one rank is not compared: its error was raised then."""
    first, w13, w2 = _layer()
    second, _, _ = _layer()
    x, logits = rank_tokens(rank, 5, H, E, torch.float32, "cpu")
    big_x, big_logits = rank_tokens(rank, 6, H, E, torch.float32, "cpu")
    ref = epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, K))
    a, b = first._agreement.index, second._agreement.index
    too_many = "above the step's largest token count"

    def refused_on_odd() -> None:  # T = 6 in a step of 5 tokens: raises on this rank only
        if rank == ODD:
            try:
                second(big_x, big_logits)
            except ValueError as exc:
                assert too_many in str(exc), exc
            else:
                raise AssertionError("T = 6 in a step of 5 tokens was accepted")

    def both_layers() -> None:
        for out in _step_of([first, second], x, logits):
            assert_close(out, ref, 1e-5, name=f"rank {rank} in a step")

    others = re.escape(_others(world))
    named = (
        rf"different EPMoE layer calls in the step before it: {others} made 1 call \(#{a}\), "
        rf"rank {ODD} made 2 calls \(#{a}, #{b}\); they first differ at call 2\. A rank "
        r"skipped a layer .* not counted on any rank"
    )
    sweep, rows = Sweep(), []
    with sweep.case("a call refused on one rank before its dispatch, then retried"):
        with epmoe.step(None, num_tokens=5):
            refused_on_odd()
            for out in (first(x, logits), second(x, logits)):
                assert_close(out, ref, 1e-5, name=f"rank {rank}")
        both_layers()  # (the refused call is not counted: the next step proceeds)
    for nested in (False, True):
        case = "one rank's step counted a call more" + (" (in a step inside it)" if nested else "")
        with sweep.case(case):
            with epmoe.step(None, num_tokens=5) as s:
                first(x, logits)
                with epmoe.step(None, num_tokens=5) if nested else contextlib.nullcontext(s) as t:
                    if rank == ODD:
                        t.calls.append(b)  # a forward of `second` whose dispatch met no one
            seconds, error, _ = _timed(lambda: _step_of([first, second], x, logits))
            rows.append(_row(case, rank, seconds, error))
            _check(error, seconds, PreviousStepDiffers, named)
        with sweep.case("then a step of both layers on every rank" + (" (2)" if nested else "")):
            both_layers()
    case = "the step raised on that rank: not compared"
    with sweep.case(case):

        def raising_step() -> None:
            with epmoe.step(None, num_tokens=5) as s:
                first(x, logits)
                if rank == ODD:
                    s.calls.append(b)
                    second(big_x, big_logits)  # raises on this rank, out of the step

        seconds, error, _ = _timed(raising_step)
        rows.append(_row(case, rank, seconds, error))
        _check(error, seconds, ValueError if rank == ODD else None, too_many)
        both_layers()
    sweep.check()
    return rows


def _step_of(layers, x, logits) -> list[torch.Tensor]:
    """One ``epmoe.step`` calling ``layers`` in order on the same input."""
    with epmoe.step(None, num_tokens=x.shape[0]):
        return [layer(x, logits) for layer in layers]


def late_rank(rank: int, world: int, timeout_s: float, sleep_s: float) -> list[dict]:
    """On a gloo group whose timeout is ``timeout_s``, rank ODD sleeps ``sleep_s`` before a
    forward: the others' agreement fails after the timeout naming the operation and rank
    ODD; the late rank, alone, fails after it too. Run isolated: the group is unusable."""
    group = dist.new_group(
        list(range(world)), timeout=datetime.timedelta(seconds=timeout_s), backend="gloo"
    )
    layer, _, _ = _layer(group=group)
    x, logits = rank_tokens(rank, 4, H, E, torch.float32, "cpu")
    if rank == ODD:
        time.sleep(sleep_s)
    seconds, error, _ = _timed(lambda: layer(x, logits))
    case = f"one rank arrives {sleep_s:g} s late (group timeout {timeout_s:g} s)"
    row = _row(case, rank, seconds, error)
    limit = timeout_s + ARRIVAL_GRACE_S + 2.0
    if rank == ODD:
        pattern = r"EPMoE.forward agreement \(layer #0, call 0\) failed"
        _check(error, seconds, RuntimeError, pattern, limit)
    else:
        pattern = (
            rf"EPMoE.forward agreement \(layer #0, call 0\) failed on rank {rank} .*: "
            rf"rank {ODD} never arrived"
        )
        _check(error, seconds, RuntimeError, pattern, limit)
    return [row]


# ------------------------------------------------------------------ float64


def float64_against_oracle(rank: int, world: int) -> list[dict]:
    """float64 layers compute in float64: every backend × layout × placement (and weight on
    input) against ``epmoe.reference.moe`` in float64, relative error ≤ 1e-12."""
    dt = torch.float64
    w13, w2 = full_weights(E, H, I, dt, "cpu", seed=11)
    combos = [
        ("naive", "standard"),
        ("all_to_all", "standard"),
        ("all_to_all", "expert_batched"),
    ]
    sweep, rows = Sweep(), []
    for (backend, layout), placement, k, on_input in [
        (c, p, 2, False) for c in combos for p in ("linear", "round_robin")
    ] + [(c, "linear", 1, True) for c in combos]:
        case = f"float64 {backend} {layout} {placement} K={k}" + (" weight on input" * on_input)
        with sweep.case(case):
            layer = epmoe.EPMoE(
                E, k, H, I, params_dtype=dt, device="cpu", backend=backend, layout=layout,
                placement=placement, apply_router_weight_on_input=on_input, max_num_tokens=4,
            )  # fmt: skip
            layer.load_experts(w13, w2)
            x, logits = rank_tokens(rank, [7, 0, 5, 2][rank % 4], H, E, dt, "cpu", seed=11)
            seconds, error, out = _timed(lambda layer=layer, x=x, logits=logits: layer(x, logits))
            if error is not None:
                raise error
            w, ids = epmoe.select_experts(logits, k)
            ref = epmoe.reference.moe(x, w13, w2, w, ids, apply_router_weight_on_input=on_input)
            assert out.dtype == dt
            err = epmoe.reference.relative_error(out, ref) if x.shape[0] else 0.0
            rows.append(dict(case=case, rank=rank, seconds=round(seconds, 4), error=f"{err:.1e}"))
            assert err <= 1e-12, f"relative error {err:.2e} against the float64 oracle"
    sweep.check()
    return rows
