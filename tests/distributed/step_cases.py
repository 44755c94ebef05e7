"""Rank bodies for ``tests/distributed/test_step.py``: one DP step context for a model of
several ``EPMoE`` layers (``epmoe.step``), and the model compiled with ``fullgraph=True``.

A "model" here is ``L`` EPMoE layers with a residual between them, each with its own
weights (seed = layer index) and router; the oracle runs the same chain with
``epmoe.reference.moe`` on the full weights. Collectives are counted by wrapping the
``torch.distributed`` functions for the length of a step: the agreement collectives
(all-gather, all-reduce, broadcast, ...) separately from the payload ``all_to_all_single``
of the ``all_to_all`` backend (its count exchange and rows).
"""

from __future__ import annotations

import contextlib
import re

import torch
import torch.distributed as dist

import epmoe
from epmoe.reference import assert_close
from tests.distributed.cases import loaded_layer, rank_tokens
from tests.harness import Sweep

E, K, H, I = 8, 2, 16, 8
L = 3  # MoE layers in the model
BASE = dict(experts="torch", backend="all_to_all")

# the collectives a rank could use to agree on something (everything but the payload)
AGREEMENT_COLLECTIVES = (
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "reduce_scatter_tensor",
)
PAYLOAD_COLLECTIVES = ("all_to_all_single",)


@contextlib.contextmanager
def counting_collectives():
    """Count calls of the ``torch.distributed`` collectives: yields ``{name: calls}``."""
    counts: dict[str, int] = {}
    saved = {}
    for name in AGREEMENT_COLLECTIVES + PAYLOAD_COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        saved[name] = fn

        def wrapper(*args, _fn=fn, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _fn(*args, **kwargs)

        setattr(dist, name, wrapper)
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def agreements(counts: dict[str, int]) -> int:
    return sum(n for name, n in counts.items() if name in AGREEMENT_COLLECTIVES)


class Model(torch.nn.Module):
    """``L`` EPMoE layers, each ``x ← x + moe_l(x, router_l(x))``."""

    def __init__(self, dev, dtype=torch.float32, **kwargs):
        super().__init__()
        self.routers = torch.nn.ModuleList()
        self.moes = torch.nn.ModuleList()
        self.full = []
        g = torch.Generator().manual_seed(7)
        for layer in range(L):
            router = torch.nn.Linear(H, E, bias=False).to(dev, dtype)
            with torch.no_grad():
                router.weight.copy_(torch.randn(E, H, generator=g))
            moe, w13, w2 = loaded_layer(E, K, H, I, dtype, dev, seed=layer, **BASE, **kwargs)
            self.routers.append(router)
            self.moes.append(moe)
            self.full.append((w13, w2))

    def forward(self, x):
        for router, moe in zip(self.routers, self.moes):
            x = x + moe(x, router(x))
        return x

    def oracle(self, x):
        x = x.double()
        for router, (w13, w2) in zip(self.routers, self.full):
            logits = router(x.float()).double()
            w, ids = epmoe.select_experts(logits, K, renormalize=True)
            x = x + epmoe.reference.moe(x, w13.double(), w2.double(), w, ids)
        return x.float()


def step_context(rank, world, T_by_rank):
    """Uneven and zero token counts: every step does exactly one agreement collective for
    all ``L`` layers (``L`` without the step), and the outputs equal the oracle."""
    dev = torch.device("cpu")
    model = Model(dev)
    sweep = Sweep()
    report = []
    with torch.no_grad():
        for case, tokens in T_by_rank.items():
            T = tokens[rank]
            x, _ = rank_tokens(rank, T, H, E, torch.float32, dev, seed=len(report))
            with counting_collectives() as counts, epmoe.step(num_tokens=T) as s:
                out = model(x)
            with counting_collectives() as plain_counts:
                plain = model(x)  # each layer agrees on its own
            report.append((case, dict(counts), dict(plain_counts)))
            with sweep.case(f"{case}: {tokens}"):
                assert s.max_tokens == max(tokens), (s.max_tokens, tokens)
                assert s.tokens_per_rank == tuple(tokens), s.tokens_per_rank
                assert s.idle == (T == 0)
                assert not s.active and epmoe.current_step() is None
                assert agreements(counts) == 1, f"step: {counts}"
                assert agreements(plain_counts) == L, f"without a step: {plain_counts}"
                assert_close(out, model.oracle(x), name=f"{case} rank {rank}")
                assert_close(plain, out, name=f"{case} plain vs step")
    sweep.check()
    return report


def step_faults(rank, world):
    """One rank's bad ``num_tokens`` raises on every rank; a rank in a layer's own forward
    while the others open a step, a rank in another step, and ranks with different
    ``graph_max_tokens`` are named on every rank; a correct step follows each case (the
    group stays in step)."""
    dev = torch.device("cpu")
    model = Model(dev)
    odd = 1
    rows, sweep = [], Sweep()

    def good_step(seed):
        T = 2 + rank
        x, _ = rank_tokens(rank, T, H, E, torch.float32, dev, seed=seed)
        with epmoe.step(num_tokens=T):
            out = model(x)
        assert_close(out, model.oracle(x), name=f"good step after {seed}")

    cases = {
        "bad num_tokens": lambda: _open(-3 if rank == odd else 2),
        "num_tokens not an int": lambda: _open(2.0 if rank == odd else 2),
        # (beyond int64: once raised before the collective, leaving the others in it)
        "bad num_tokens, too large": lambda: _open(2**63 if rank == odd else 2),
        # (once sent the group's step number against the others' ids: named as another
        # step, and the bad rank's count left at theirs)
        "bad step_id": lambda: _open(2, step_id=-1 if rank == odd else 1000),
        "a layer's own forward against a step": lambda: (
            model.moes[0](*_inputs(rank, dev)) if rank == odd else _open(2)
        ),
    }
    for i, (case, fn) in enumerate(cases.items()):
        error = _error_of(fn)  # expected on every rank
        rows.append((case, rank, repr(error)))
        with sweep.case(case):
            assert error is not None, "no error"
            if case.startswith(("bad", "num_tokens")):
                if rank == odd:
                    assert isinstance(error, ValueError), repr(error)
                    what = "step_id" if "step_id" in case else "num_tokens"
                    assert f"{what} must be an int in [0, 2**" in str(error), str(error)
                else:
                    assert isinstance(error, RuntimeError), repr(error)
                    assert re.search(
                        rf"rank {odd} rejected its epmoe.step arguments", str(error)
                    ), error
            else:
                assert isinstance(error, RuntimeError), repr(error)
                assert "different EPMoE calls" in str(error), str(error)
                assert re.search(rf"rank {odd} is in forward of layer", str(error)), error
        with sweep.case(f"{case}: a good step follows"):
            good_step(i)

    # a rank that skipped a step of the caller's numbering is named on every rank
    with sweep.case("a rank in another step (step_id)"):
        error = _error_of(lambda: _open(1, step_id=8 if rank == odd else 7))
        rows.append(("a rank in another step", rank, repr(error)))
        assert isinstance(error, RuntimeError), repr(error)
        assert "different steps" in str(error), str(error)
        assert f"rank {odd} is in step 8" in str(error), str(error)
    with sweep.case("another step: a good step follows"):
        good_step(len(cases))

    # ranks whose graph bounds differ would each decide alone whether the step replays
    # its CUDA graphs: named on every rank
    with sweep.case("different graph_max_tokens"):
        error = _error_of(lambda: _open(1, decode=True, graph_max_tokens=4 if rank == odd else 8))
        rows.append(("different graph_max_tokens", rank, repr(error)))
        assert isinstance(error, RuntimeError), repr(error)
        assert "different graph_max_tokens" in str(error), str(error)
        assert f"rank {odd} has 4" in str(error), str(error)
    with sweep.case("graph bounds: a good step follows"):
        good_step(len(cases) + 1)
    with (
        sweep.case("the same graph_max_tokens everywhere"),
        epmoe.step(num_tokens=1, decode=True, graph_max_tokens=8) as s,
    ):
        assert s.decode, s

    # DecodeGraphs agrees on its arguments before any capture (refused without CUDA too)
    from epmoe.decode_graphs import DecodeGraphs

    def graphs(device="cuda", sizes=(1, 2)):
        DecodeGraphs(lambda x, num_valid_tokens=None: x, sizes, hidden_size=8,
                     dtype=torch.float32, device=device)  # fmt: skip

    graph_cases = {
        "DecodeGraphs: one rank's device": (
            lambda: graphs(device="cpu" if rank == odd else "cuda"),
            "device must be cuda",
        ),
        "DecodeGraphs: one rank's sizes": (
            lambda: graphs(sizes=(0, 2) if rank == odd else (1, 2)),
            "positive token counts",
        ),
        "DecodeGraphs: different buckets": (
            lambda: graphs(sizes=(1, 4) if rank == odd else (1, 2)),
            None,
        ),
    }
    for case, (fn, own) in graph_cases.items():
        error = _error_of(fn)
        rows.append((case, rank, repr(error)))
        with sweep.case(case):
            if own is None:  # every rank: the configurations, each rank's named
                assert isinstance(error, ValueError), repr(error)
                assert f"rank {odd}: sizes=[1, 4]" in str(error), str(error)
            elif rank == odd:
                assert isinstance(error, ValueError) and own in str(error), repr(error)
            else:
                assert isinstance(error, RuntimeError), repr(error)
                assert f"rank {odd} refused its arguments" in str(error), str(error)
    with sweep.case("DecodeGraphs: a good step follows"):
        good_step(len(cases) + 2)
    sweep.check()
    return rows


def _error_of(fn) -> Exception | None:
    """What ``fn()`` raised, or ``None``."""
    try:
        fn()
    except Exception as exc:
        return exc
    return None


def _open(T, **kwargs):
    """Open and close a step with no layer inside."""
    with epmoe.step(num_tokens=T, **kwargs):
        pass


def _inputs(rank, dev):
    return rank_tokens(rank, 2, H, E, torch.float32, dev, seed=99)


def compiled_model(rank, world):
    """The model compiled with ``fullgraph=True``: no graph breaks, equal to eager, inside a
    step (uneven and zero counts: one compiled graph serves them all) and without one."""
    import torch._dynamo

    dev = torch.device("cpu")
    model = Model(dev)
    sweep = Sweep()
    with torch.no_grad():
        x, _ = rank_tokens(rank, 3, H, E, torch.float32, dev, seed=5)
        explained = torch._dynamo.explain(model)(x)
        with sweep.case("explain: no graph breaks"):
            assert explained.graph_break_count == 0, explained.break_reasons
            assert explained.graph_count == 1, explained.graph_count
        for backend in ("eager", "aot_eager"):
            torch._dynamo.reset()
            compiled = torch.compile(model, fullgraph=True, backend=backend, dynamic=True)
            for i, tokens in enumerate([(3, 5, 1, 4), (0, 2, 0, 1), (4, 0, 6, 0)]):
                T = tokens[rank]
                x, _ = rank_tokens(rank, T, H, E, torch.float32, dev, seed=i)
                with counting_collectives() as counts, epmoe.step(num_tokens=T):
                    out = compiled(x)
                eager = model(x)  # no step: each layer's own agreement
                with sweep.case(f"{backend} step {tokens[:world]}"):
                    assert agreements(counts) == 1, counts
                    assert_close(out, eager, name=f"{backend} vs eager")
                    assert_close(out, model.oracle(x), name="vs oracle")
            out = compiled(x)  # no step: the op runs each layer's agreement
            with sweep.case(f"{backend} without a step"):
                assert_close(out, model(x), name=f"{backend} without a step")
    torch._dynamo.reset()
    sweep.check()
