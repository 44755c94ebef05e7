"""examples/serving.py on GPUs with CUDA-graph decode: the whole decode step captured
(``--cuda-graphs step``: static KV cache, MoE blocks, greedy tokens) and the MoE blocks
alone (``--cuda-graphs blocks``), each serving greedy outputs equal to the unconverted
model's, with an EPLB re-plan (and its re-capture) while serving.

On every GPU of the machine (``--nproc`` = the GPU count, up to 2; W = 1 on one GPU),
backend ``symm_ll`` (graph safe), Triton experts.
"""

from __future__ import annotations

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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("scope", ["step", "blocks"])
def test_graph_decode_serves_the_unconverted_models_tokens(scope):
    W = min(torch.cuda.device_count(), 2)
    cmd = [sys.executable, os.path.join(ROOT, "launch", "run.py"), "--nproc", str(W),
           os.path.join(ROOT, "examples", "serving.py"), "--device", "cuda",
           "--backend", "symm_ll", "--requests", "10", "--max-batch", "4",
           "--max-new-tokens", "8", "--hidden-size", "256", "--num-experts", "8",
           "--rebalance-every", "6", "--log-every", "6", "--check", "4",
           "--aligned-moe-steps", "3", "--cuda-graphs", scope]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert re.search(r"EPLB step \d+:", out), out  # re-planned (and re-captured) mid-run
    if scope == "step":
        assert "captured the whole decode step of 4 rows in a CUDA graph" in out, out
        replays = re.search(
            r"decode steps replayed from the step's CUDA graph on rank 0: (\d+)", out
        )
    else:
        replays = re.search(r"MoE block forwards replayed from CUDA graphs on rank 0: (\d+)", out)
    assert replays and int(replays.group(1)) > 0, out
    m = re.search(r"decode steps: .* MoE blocks ([\d.]+) ms", out)
    assert m and float(m.group(1)) > 0, out  # timed inside the graphs too
    assert f"outputs of {4 * W} requests against the unconverted model" in out, out
    assert f"{4 * W} identical, 0 differ" in out, out
