"""GPU tier: a whole ``EPMoE`` forward (routing, placement, load recording, dispatch,
experts, combine) captured in one CUDA graph and replayed with fresh inputs.

For a fixed T the graph is captured once with ``max_tokens_across_ranks=T`` (the graph-safe
forward), then replayed ``REPLAYS`` times, each replay's inputs and router logits copied into
the static input tensors first. Each replay must equal an eager forward of the same inputs
and the float64 oracle, and the load recorder's window must hold the counts of exactly the
last ``WINDOW`` replays (a ring index kept in Python would be frozen at capture time: every
replay would overwrite one row).

Backends: ``symm_ll`` (fixed symmetric-memory buffers, graph safe) when
``epmoe.available_backends()`` says it can run, else that case is skipped with its reason;
and, on one GPU, the test-only ``loopback`` backend (``tests/distributed/layer_v2_cases``),
which checks the layer's own part without a multi-GPU transport. ``all_to_all`` reads
counts on the host and cannot be captured.

Run on one GPU with ``pytest tests/gpu/test_layer_graph.py`` (W = 1, no torch.distributed);
the NCCL case needs ``EPMOE_TEST_DEVICE=cuda`` and at least two GPUs.

Shape legend: T tokens per rank · H hidden · I intermediate · E logical experts · P physical
experts · K top-k · W world.
"""

from __future__ import annotations

import collections

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU too; conftest skips the gpu mark
    pytest.skip("needs CUDA", allow_module_level=True)

import epmoe  # noqa: E402
import epmoe.comm  # noqa: E402
from epmoe.reference import TOLERANCES, relative_error  # noqa: E402
from tests.distributed.cases import full_weights  # noqa: E402
from tests.distributed.layer_v2_cases import LOOPBACK, physical_counts  # noqa: E402
from tests.harness import requires_world, run_on_ranks, world_ids, world_sizes  # noqa: E402

WORLDS = world_sizes([2, 4], minimum=2)  # EPMOE_TEST_WORLDS=4,8 on larger machines
from tests.harness import test_device as device_under_test  # noqa: E402

T, E, K, H, I = 48, 16, 4, 256, 128
WINDOW = 4  # load_window: forwards the recorder keeps
REPLAYS = 100
BF16 = torch.bfloat16
# the graph replays the eager forward's kernels; only the order of cross-rank accumulation
# (atomics) may differ, so the two agree far inside the oracle's tolerance
GRAPH_VS_EAGER = 5e-3


def _inputs(rank: int, step: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's hidden states ``[T, H]`` bf16 and router logits ``[T, E]`` float32 of one
    step (a per-(rank, step) seed)."""
    g = torch.Generator(device=dev).manual_seed(1_000_003 * rank + step)
    x = torch.randn(T, H, generator=g, device=dev).to(BF16)
    logits = torch.randn(T, E, generator=g, device=dev)
    return x, logits


def _skip_unless_usable(backend: str, dev: torch.device) -> None:
    reason = epmoe.available_backends(dev).get(backend, f"{backend!r} is not registered")
    if reason is not None:
        pytest.skip(f"backend {backend!r} cannot run here: {reason}")


def graph_replays(rank: int, world: int, backend: str, replays: int = REPLAYS) -> dict:
    """Rank body: capture one forward, replay it ``replays`` times, compare every replay.

    Runs with W = 1 without torch.distributed (called directly) and on NCCL ranks (through
    ``run_on_ranks``); every rank runs the same collectives in the same order and asserts
    only at the end. Returns the worst errors seen, for the report.
    """
    dev = torch.device("cuda", torch.cuda.current_device())
    _skip_unless_usable(backend, dev)  # the same answer on every rank
    layer = epmoe.EPMoE(
        E, K, H, I, backend=backend, layout="expert_batched", experts="triton",
        params_dtype=BF16, device=dev, max_num_tokens=T, load_window=WINDOW,
    )  # fmt: skip
    w13, w2 = full_weights(E, H, I, BF16, dev, seed=0)
    layer.load_experts(w13, w2)
    recorder = layer.load_recorder

    # static inputs; warm up on a side stream (Triton compiles and picks its tiling here,
    # not inside the capture), then capture
    static_x, static_logits = _inputs(rank, -1, dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            layer(static_x, static_logits, max_tokens_across_ranks=T)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        static_out = layer(static_x, static_logits, max_tokens_across_ranks=T)
    torch.cuda.synchronize()

    errors: list[str] = []
    # the reported bug: three replays of one input must fill three rows of the window
    recorder.reset()  # in place: the graph keeps its buffers
    for _ in range(3):
        graph.replay()
    want = 3 * physical_counts(layer, static_logits)
    if not torch.equal(recorder.window_load().cpu(), want):
        errors.append(
            f"3 replays of one input: window {recorder.window_load().tolist()}, want "
            f"{want.tolist()}"
        )

    # an eager hinted forward synchronises nothing either (backend and experts included)
    recorder.enabled = False  # eager checks do not count; the captured graph still does
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            layer(static_x, static_logits, max_tokens_across_ranks=T)
    except RuntimeError as exc:
        errors.append(f"the eager hinted forward synchronised: {exc}")
    finally:
        torch.cuda.set_sync_debug_mode(0)

    recorder.reset()
    last = collections.deque(maxlen=WINDOW)  # counts of the last WINDOW replays
    worst_eager = worst_oracle = 0.0
    for step in range(replays):
        x, logits = _inputs(rank, step, dev)
        static_x.copy_(x)
        static_logits.copy_(logits)
        graph.replay()
        got = static_out.clone()
        with torch.no_grad():
            eager = layer(x, logits, max_tokens_across_ranks=T)
        ref = epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, K))
        last.append(physical_counts(layer, logits))
        err_eager, err_oracle = relative_error(got, eager), relative_error(got, ref)
        worst_eager, worst_oracle = max(worst_eager, err_eager), max(worst_oracle, err_oracle)
        if err_eager > GRAPH_VS_EAGER or err_oracle > TOLERANCES[BF16]:
            errors.append(
                f"replay {step}: relative error {err_eager:.2e} vs eager (limit "
                f"{GRAPH_VS_EAGER:.0e}), {err_oracle:.2e} vs oracle (limit "
                f"{TOLERANCES[BF16]:.0e})"
            )
        window, want = recorder.window_load().cpu(), sum(last)
        if not torch.equal(window, want):
            errors.append(
                f"after replay {step}: window {window.tolist()}, want the last "
                f"{len(last)} replays' {want.tolist()}"
            )
    recorder.enabled = True
    steps = recorder.step
    graph.reset()
    layer.comm.close()

    assert steps == replays, f"the recorder counted {steps} replays, want {replays}"
    assert not errors, f"rank {rank} of {world}, {backend}: {len(errors)} failures:\n" + "\n".join(
        errors[:10]
    )
    return {"worst_vs_eager": worst_eager, "worst_vs_oracle": worst_oracle}


@pytest.mark.parametrize("backend", ["symm_ll", "loopback"])
def test_graph_replays_match_eager_and_oracle_on_one_gpu(backend, monkeypatch):
    """W = 1 without torch.distributed: capture, 100 replays, recorder window."""
    if backend == "loopback":
        monkeypatch.setitem(epmoe.comm._BACKENDS, "loopback", LOOPBACK)
    graph_replays(0, 1, backend)


@pytest.mark.parametrize("world", WORLDS, ids=world_ids(WORLDS))
def test_graph_replays_on_nccl_ranks(world):
    """The same on W NCCL ranks with symm_ll (one replay is one collective step)."""
    if device_under_test() != "cuda":
        pytest.skip("NCCL ranks need EPMOE_TEST_DEVICE=cuda")
    requires_world(world)
    run_on_ranks(graph_replays, world, "symm_ll", isolated=True)
