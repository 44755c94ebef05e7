"""examples/serving.py on GPUs with CUDA-graph decode: the whole decode step captured
(``--cuda-graphs step``: static KV cache, MoE blocks, greedy tokens) and the MoE blocks
alone (``--cuda-graphs blocks``), each serving greedy outputs equal to the unconverted
model's, with EPLB re-planning while serving (re-placing experts, and re-capturing, from
W = 2); and the step graph captured again in the middle of a batch, as after a re-plan,
keeping the eager engine's tokens and expert load.

On every GPU of the machine (``--nproc`` = the GPU count, up to 2; W = 1 on one GPU),
backend ``symm_ll`` (graph safe), Triton experts.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU too; conftest skips the gpu mark
    pytest.skip("needs CUDA", allow_module_level=True)

pytest.importorskip("transformers")

import epmoe  # noqa: E402
from epmoe.integrations.huggingface import EPMoEBlock, replace_moe_blocks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("scope", ["step", "blocks"])
def test_graph_decode_serves_the_unconverted_models_tokens(scope):
    W = min(torch.cuda.device_count(), 2)
    cmd = [sys.executable, os.path.join(ROOT, "launch", "run.py"), "--nproc", str(W),
           os.path.join(ROOT, "examples", "serving.py"), "--device", "cuda",
           "--backend", "symm_ll", "--requests", "10", "--max-batch", "4",
           "--max-new-tokens", "8", "--hidden-size", "256", "--num-experts", "8",
           "--rebalance-every", "6", "--log-every", "6", "--check", "12",
           "--aligned-moe-steps", "3", "--cuda-graphs", scope]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert re.search(r"EPLB step \d+:", out), out  # (at W = 1 nothing is re-placed)
    if scope == "step":
        assert "captured the whole decode step in a CUDA graph for batch sizes [1, 2, 4]" in out
        replays = re.search(
            r"decode steps replayed from the step's CUDA graphs on rank 0: (\d+)", out
        )
    else:
        replays = re.search(r"MoE block forwards replayed from CUDA graphs on rank 0: (\d+)", out)
    assert replays and int(replays.group(1)) > 0, out
    m = re.search(r"decode steps: .* MoE blocks ([\d.]+) ms", out)
    assert m and float(m.group(1)) > 0, out  # timed inside the graphs too
    # every request of every rank: the partial last batches ran on smaller sizes
    served = int(re.search(r"served (\d+) requests", out).group(1))
    assert f"outputs of {served} requests against the unconverted model" in out, out
    assert f"{served} identical, 0 differ" in out, out


def _example():
    """examples/serving.py as a module (its engines and the step graph)."""
    spec = importlib.util.spec_from_file_location(
        "serving_example", os.path.join(ROOT, "examples", "serving.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    module._CACHE_ARG = module._cache_argument()
    return module


def _serve(sv, engine, R: int, recapture_at: tuple[int, ...] = ()) -> list[list[int]]:
    """One process (W = 1): every request of ``engine`` served, each forward in its step;
    the step graph is captured again after each count of decode steps in ``recapture_at``
    (as after a re-plan)."""
    requests, decodes = list(engine.queue), 0
    while (inputs := engine.next_forward()) is not None:
        decode = inputs["kind"] == "decode"
        T = inputs["input_ids"].numel()
        with epmoe.step(None, num_tokens=T, decode=decode, graph_max_tokens=R):
            engine.run(inputs)
        decodes += decode
        if decode and decodes in recapture_at and engine.graphs is not None:
            for b in engine.sizes:
                engine.graphs.capture(b)
    return [r.output for r in requests]


def test_step_graph_recaptured_mid_batch_keeps_the_eager_tokens_and_records_load():
    """The whole-step graph against the same engine run eagerly, on one GPU: equal greedy
    tokens, also after a capture in the middle of a batch (its warm-ups write the cache
    where the next step writes, and at its last position when the batch fills it), and the
    same expert load recorded (the replays record it; the warm-ups and padding rows do
    not)."""
    sv = _example()
    R = 4
    args = argparse.Namespace(
        requests=6, max_batch=R, prefill_chunk=8, max_prompt=12, max_new_tokens=6,
        num_layers=2, num_experts=8, top_k=2, hidden_size=256, vocab=512,
    )  # fmt: skip
    device = torch.device("cuda", torch.cuda.current_device())
    model = sv.build_model(args, device)
    replace_moe_blocks(model, backend="symm_ll", experts="auto", load_window=10_000)
    blocks = [m for m in model.modules() if isinstance(m, EPMoEBlock)]
    g = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(3, args.vocab, (n,), generator=g).tolist() for n in (12, 5, 9, 7, 4, 11)
    ]
    # the first batch fills the cache (12 + 6 positions); the second has 2 of 4 rows
    queue = [sv.Request(f"r{i}", p, n) for i, (p, n) in enumerate(zip(prompts, (6, 3, 2, 5, 4, 6)))]
    recorders = [b.moe.load_recorder for b in blocks]
    outputs, loads = [], []
    for graphed in (False, True):
        for r in recorders:
            r.reset()
        engine = sv.StaticEngine(model, copy.deepcopy(queue), args, device, torch.float32)
        if graphed:
            timer = sv.StepTimer(blocks, device)
            engine.graphs = sv.StepGraphs(engine, blocks, None, timer)
        # mid-batch, and after the first batch's last decode step (the cache then full)
        outputs.append(_serve(sv, engine, R, recapture_at=(2, 5)))
        loads.append([int(r.window_load().sum()) for r in recorders])
        if graphed:  # the full batches' bucket and the last batch's (2 of 4 rows)
            assert engine.graphs.replays[R] > 0 and engine.graphs.replays[2] > 0
    assert outputs[1] == outputs[0]
    assert loads[1] == loads[0] and min(loads[0]) > 0
