"""One process (no torch.distributed): ``epmoe.step`` and ``torch.compile`` of a model with
an ``EPMoE`` layer (``fullgraph=True``, no graph breaks, equal to eager). The same on gloo
ranks: ``tests/distributed/test_step.py``."""

from __future__ import annotations

import gc

import pytest
import torch
import torch._dynamo

import epmoe
from epmoe import custom_op
from epmoe.reference import assert_close
from tests.distributed.cases import loaded_layer

E, K, H, I = 8, 2, 16, 8


class Tiny(torch.nn.Module):
    """Linear → EPMoE (router from the hidden state) → Linear."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(H, H)
        self.router = torch.nn.Linear(H, E)
        self.moe = loaded_layer(E, K, H, I, torch.float32, "cpu", backend="all_to_all")[0]
        self.down = torch.nn.Linear(H, H)

    def forward(self, x):
        h = self.up(x)
        return self.down(self.moe(h, self.router(h)))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_explain_reports_no_graph_break():
    model = Tiny()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(torch.randn(5, H))
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fullgraph_compile_equals_eager(backend):
    model = Tiny()
    compiled = torch.compile(model, fullgraph=True, backend=backend, dynamic=True)
    with torch.no_grad():
        for T in (5, 1, 0, 9):
            x = torch.randn(T, H)
            assert_close(compiled(x), model(x), name=f"{backend} T={T}")
            with epmoe.step(num_tokens=T) as s:  # the op reads the active step
                assert_close(compiled(x), model(x), name=f"{backend} step T={T}")
            assert s.max_tokens == T and s.tokens_per_rank == (T,)
            hinted = model.moe(x, model.router(x), max_tokens_across_ranks=T + 3)
            assert_close(hinted, model.moe(x, model.router(x)), name="hint")


def test_compiled_outside_no_grad_runs_forward_and_refuses_backward():
    """Parameters that require grad (a model as loaded) compile with ``fullgraph=True`` and
    run forward like eager; a backward through the layer's op fails with the fix."""
    model = Tiny()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(5, H)
    out = compiled(x)
    with torch.no_grad():
        assert_close(out, model(x), name="outside no_grad")
    with pytest.raises(RuntimeError, match=r"no backward.*torch\.no_grad\(\)"):
        out.sum().backward()


@pytest.mark.parametrize("trained", ["router", "shared experts"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_backward_to_the_router_or_shared_experts_refuses_too(trained, backend):
    """Only the router (or the shared experts) trains, the hidden states need no grad: the
    compiled op's backward reached none of them and gave zero gradients silently, where
    eager raises. Every input a gradient can reach now gets one that raises."""

    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(H, H)

        def forward(self, x):
            return self.proj(x)

    class RouterTuned(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.router = torch.nn.Linear(H, E)
            shared = Shared() if trained == "shared experts" else None
            self.moe = loaded_layer(
                E, K, H, I, torch.float32, "cpu", backend="all_to_all", shared_experts=shared
            )[0]
            self.router.requires_grad_(trained == "router")

        def forward(self, x):  # x: a frozen embedding's output (no grad)
            return self.moe(x, self.router(x))

    model = RouterTuned()
    x = torch.randn(5, H)
    for run in (model, torch.compile(model, fullgraph=True, backend=backend)):
        out = run(x)
        assert out.requires_grad
        with pytest.raises(RuntimeError, match=r"no backward"):
            out.sum().backward()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    ("hint", "match"),
    [
        (True, "must be an int .* got bool"),
        (8.0, "must be an int .* got float"),
        (2**40, r"outside \[0, 2\*\*31\)"),  # (eagerly: 10**8 empty chunks, a hang)
    ],
    ids=["bool", "float", "huge"],
)
def test_a_compiled_layer_refuses_the_hints_eager_refuses(hint, match):
    """The op's schema took ``True`` (and NumPy ints) as an int and named its own argument
    for a float: the hint's type is now checked at trace time, its value in the op."""
    layer = loaded_layer(E, K, H, I, torch.float32, "cpu", backend="all_to_all")[0]
    x, logits = torch.randn(5, H), torch.randn(5, E)
    with pytest.raises((TypeError, ValueError), match=match):
        layer(x, logits, max_tokens_across_ranks=hint)
    compiled = torch.compile(
        lambda x, logits: layer(x, logits, max_tokens_across_ranks=hint),
        fullgraph=True,
        backend="eager",
    )
    with torch.no_grad(), pytest.raises(Exception, match=match):  # (Dynamo wraps it)
        compiled(x, logits)


def test_layer_with_explicit_hint_compiles():
    model = Tiny()

    def f(x, n: int):
        h = model.up(x)
        return model.moe(h, model.router(h), max_tokens_across_ranks=n)

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    with torch.no_grad():
        x = torch.randn(4, H)
        assert_close(compiled(x, 4), f(x, 4), name="hinted")
        # a bad hint is refused as eagerly (a negative one once read as "no hint", and that
        # rank then waited in the agreement while the others dispatched)
        for n, match in ((-1, "is outside"), (-7, "is outside"), (2, "is below this rank's T=4")):
            with pytest.raises(ValueError, match=f"max_tokens_across_ranks={n} {match}"):
                compiled(x, n)


@pytest.mark.parametrize("form", ["count", "mask"])
def test_padded_rows_compile_with_their_rows_as_a_tensor(form):
    """Padding rows through the compiled op: a count (rows from it on) or a bool per row
    (finished requests of a static batch); one compiled graph, other values per call."""
    model = Tiny()

    def f(x, valid):
        h = model.up(x)
        return model.moe(h, model.router(h), max_tokens_across_ranks=8, num_valid_tokens=valid)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        x = torch.randn(8, H)
        for n in (3, 8):
            live = torch.arange(8) < n if form == "count" else torch.arange(8) % 3 != n % 3
            valid = torch.tensor([n]) if form == "count" else live
            got, want = compiled(x, valid), f(x, valid)
            assert_close(got, want, name=f"{form} {n}")
            assert torch.equal(got[~live], torch.zeros(int((~live).sum()), H))


def test_the_registry_lets_layers_go():
    layer = loaded_layer(E, K, H, I, torch.float32, "cpu")[0]
    layer_id = layer._op_id
    assert custom_op.lookup(layer_id) is layer
    del layer
    gc.collect()
    with pytest.raises(RuntimeError, match="no live EPMoE layer"):
        custom_op.lookup(layer_id)


def test_fake_op_keeps_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, H, dtype=torch.bfloat16)
        out = torch.ops.epmoe.moe_forward(x, torch.empty(3, E), torch.tensor(0), -1, None, [])
    assert out.shape == (3, H) and out.dtype == torch.bfloat16


def test_step_on_one_process():
    layer = loaded_layer(E, K, H, I, torch.float32, "cpu")[0]
    x, logits = torch.randn(3, H), torch.randn(3, E)
    want = layer(x, logits)
    assert epmoe.current_step() is None
    with epmoe.step(num_tokens=3, decode=True, graph_max_tokens=4) as s:
        assert epmoe.current_step() is s
        assert s.decode and not s.idle and s.bucket([1, 2, 4, 8]) == 4
        assert_close(layer(x, logits), want)
        assert_close(layer(x, logits, step=s), want)
        with pytest.raises(ValueError, match="above the step's largest token count 3"):
            layer(torch.randn(4, H), torch.randn(4, E))
        with pytest.raises(TypeError, match="not both"):
            layer(x, logits, step=s, max_tokens_across_ranks=3)
    assert epmoe.current_step() is None and not s.active
    with pytest.raises(RuntimeError, match="has ended"):
        layer(x, logits, step=s)
    with epmoe.step(num_tokens=5, decode=True, graph_max_tokens=4) as s:
        assert not s.decode and s.bucket([1, 2, 4]) is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_tokens=-1), r"num_tokens must be an int in \[0, 2\*\*31\)"),
        (dict(num_tokens=2.0), r"num_tokens must be an int in \[0, 2\*\*31\)"),
        (dict(num_tokens=True), r"num_tokens must be an int in \[0, 2\*\*31\)"),
        (dict(num_tokens=2**31), r"num_tokens must be an int in \[0, 2\*\*31\)"),
        (dict(num_tokens=2**63), r"num_tokens must be an int in \[0, 2\*\*31\)"),
        (dict(num_tokens=1, step_id=-2), r"step_id must be an int in \[0, 2\*\*62\)"),
        (dict(num_tokens=1, step_id=2**63), r"step_id must be an int in \[0, 2\*\*62\)"),
        (dict(num_tokens=1, graph_max_tokens=0), "graph_max_tokens must be a positive int"),
    ],
)
def test_step_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match), epmoe.step(**kwargs):
        pass
    assert epmoe.current_step() is None


def test_step_takes_numpy_and_torch_ints_as_the_placements_do():
    import numpy as np

    with epmoe.step(num_tokens=np.int64(3), step_id=np.int32(7)) as s:
        assert s.max_tokens == 3 and s.index == 7 and type(s.max_tokens) is int
    with (
        pytest.raises(ValueError, match="num_tokens must be an int"),
        epmoe.step(num_tokens=np.bool_(True)),
    ):
        pass


def test_init_distributed_refuses_timeouts_that_are_no_seconds():
    for bad in (float("nan"), float("inf"), "60", True, 0, -1, 1e12):
        with pytest.raises(ValueError, match="timeout_s must be a number of seconds"):
            epmoe.init_distributed(timeout_s=bad)


def test_steps_of_one_process_are_numbered():
    with epmoe.step(num_tokens=1) as first:
        pass
    with epmoe.step(num_tokens=1) as second:
        pass
    assert second.index == first.index + 1


def test_a_copied_layer_is_its_own_op():
    """deepcopy / pickle give another layer: compiled code must run the copy's weights."""
    import copy

    model = Tiny()
    twin = copy.deepcopy(model.moe)
    assert twin._op_id != model.moe._op_id
    with torch.no_grad():
        twin.w2.mul_(2)
        x = torch.randn(5, H)
        logits = model.router(x)
        compiled = torch.compile(twin, fullgraph=True, backend="eager")
        assert_close(compiled(x, logits, max_tokens_across_ranks=5), twin(x, logits), 1e-6)
        assert (twin(x, logits) - model.moe(x, logits)).abs().max() > 1e-3


def test_inductor_takes_a_permuted_input():
    """The fake op promises a contiguous output, as the real one returns."""
    model = Tiny()
    f = torch.compile(lambda x, lg: model.moe(x, lg, max_tokens_across_ranks=5), backend="inductor")
    with torch.no_grad():
        x_t = torch.randn(H, 5).t()  # [5, H], column-major
        logits = model.router(x_t.contiguous())
        assert_close(f(x_t, logits), model.moe(x_t.contiguous(), logits), 1e-5)


def test_a_compiled_explicit_step_is_still_checked():
    model = Tiny()
    with epmoe.step(num_tokens=5) as s:
        pass  # ended
    f = torch.compile(lambda x: model.moe(x, model.router(x), step=s), backend="eager")
    with pytest.raises(Exception, match="ended|not active|closed"), torch.no_grad():
        f(torch.randn(5, H))


def test_layers_compiled_one_by_one_share_one_graph():
    """The layer id is an input of the graph: twelve layers (past Dynamo's recompile limit
    of 8) compiled one by one with fullgraph=True run on one graph, each its own weights."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    layers = [loaded_layer(E, K, H, I, torch.float32, "cpu", seed=s)[0] for s in range(12)]
    x, logits = torch.randn(5, H), torch.randn(5, E)
    with torch.no_grad():
        for layer in layers:
            compiled = torch.compile(layer, fullgraph=True, backend="eager")
            assert_close(compiled(x, logits), layer(x, logits), 0.0)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
