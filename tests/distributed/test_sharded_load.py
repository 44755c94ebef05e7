"""Loading a Hugging Face checkpoint by shard on 2 and 3 gloo ranks: each rank reads the
non-expert tensors and only its local experts' tensors (counted by wrapping
``safetensors.safe_open``), and its logits equal the unsharded model's.

One sweep per world size (rank bodies in ``tests/distributed/sharded_load_cases.py``).
"""

from __future__ import annotations

import pytest

from tests.distributed import sharded_load_cases
from tests.harness import requires_world, run_on_ranks

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

WORLDS = [2, 3]
FAMILIES = ["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3"]
PLACEMENTS = ["linear", "round_robin"]


@pytest.mark.parametrize("world", WORLDS, ids=[f"W={w}" for w in WORLDS])
def test_sharded_load(world, tmp_path):
    requires_world(world)
    passed = run_on_ranks(
        sharded_load_cases.check_sharded_load,
        world,
        str(tmp_path),
        FAMILIES,
        PLACEMENTS,
    )
    assert passed == [len(FAMILIES) * len(PLACEMENTS)] * world, passed
