"""Checkpoints on W gloo ranks (NCCL with EPMOE_TEST_DEVICE=cuda): each rank's shard knows
its placement (rank 0's file on every rank and a linear shard in a round-robin layer are
refused where they do not fit), full experts gathered from a balanced placement with
replicas load into a linear one, and a converted Hugging Face model saved with
``epmoe.integrations.huggingface.save_pretrained`` reloads with the same logits.

One sweep per world size (rank bodies in ``tests/distributed/checkpoint_cases.py``).
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.distributed import checkpoint_cases
from tests.harness import requires_world, run_on_ranks
from tests.harness import test_device as device_under_test

WORLDS = [2, 3]
HF_FAMILIES = ["mixtral", "qwen2_moe", "deepseek_v3"]  # fused, gated shared, biased + shared


@pytest.mark.parametrize("world", WORLDS, ids=[f"W={w}" for w in WORLDS])
def test_checkpoints(world, tmp_path):
    requires_world(world)
    dtype = "bfloat16" if device_under_test() == "cuda" else "float32"
    has_hf = importlib.util.find_spec("transformers") is not None
    families = HF_FAMILIES if world == 2 and has_hf else []
    passed = run_on_ranks(
        checkpoint_cases.check_checkpoints,
        world,
        str(tmp_path),
        device_under_test(),
        dtype,
        hf_families=families,
    )
    assert passed == [7 + len(families)] * world, passed
