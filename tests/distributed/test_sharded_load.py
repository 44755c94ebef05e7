"""Loading a Hugging Face checkpoint by shard on 2 and 3 gloo ranks: each rank reads the
non-expert tensors and only its local experts' tensors (counted by wrapping
``safetensors.safe_open``), and its logits equal the unsharded model's. A rank given a bad
checkpoint makes every rank raise promptly instead of leaving the others waiting in a
collective.

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


def test_one_failing_rank_fails_every_rank(tmp_path):
    """Rank 1 fails before the conversion (missing directory) and after it (a checkpoint
    lacking a tensor): it raises its own error, rank 0 a RuntimeError, both within 5 s."""
    requires_world(2)
    outs = run_on_ranks(sharded_load_cases.failing_rank, 2, str(tmp_path), timeout_s=60)
    want = {"missing": "FileNotFoundError", "damaged": "ValueError"}
    for case, error in want.items():
        (raised0, s0), (raised1, s1) = outs[0][case], outs[1][case]
        assert raised1 is not None and raised1[0] == error, (case, raised1)
        assert raised0 is not None and raised0[0] == "RuntimeError", (case, raised0)
        assert "another rank" in raised0[1], raised0
        assert s0 < 5 and s1 < 5, (case, s0, s1)
