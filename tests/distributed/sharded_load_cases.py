"""Rank bodies for loading a Hugging Face checkpoint by shard (``from_pretrained_sharded``).

Rank 0 writes a tiny model of each family with transformers' own ``save_pretrained`` (the
per-expert layout transformers writes); every rank then loads it by shard while
``safetensors.safe_open`` is wrapped to record every tensor read, and checks that it read
each non-expert tensor once, its own experts' tensors once and no other rank's, and that
its logits equal the unsharded model's. ``failing_rank`` gives one rank a bad checkpoint
(a missing directory, then one that lacks a tensor) and records what every rank raised.
Imports ``transformers`` inside functions only.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from tests.distributed.cases import device_for
from tests.harness import Sweep, test_device

EXPERT_KEY = re.compile(r"\.experts\.(\d+)\.")


class _CountingFile:
    """A ``safe_open`` handle that records the keys whose tensors are read."""

    def __init__(self, inner, opened: list[str]) -> None:
        self._inner, self._opened = inner, opened

    def keys(self):
        return self._inner.keys()

    def get_tensor(self, key: str) -> torch.Tensor:
        self._opened.append(key)
        return self._inner.get_tensor(key)

    def get_slice(self, key: str):
        self._opened.append(key)
        return self._inner.get_slice(key)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


@contextlib.contextmanager
def counting_safe_open(opened: list[str]) -> Iterator[None]:
    """Wrap ``safetensors.safe_open`` so that every tensor read appends its key to ``opened``."""
    import safetensors

    original = safetensors.safe_open

    def safe_open(*args, **kwargs):
        return _CountingFile(original(*args, **kwargs), opened)

    safetensors.safe_open = safe_open
    try:
        yield
    finally:
        safetensors.safe_open = original


def _write_checkpoint(rank: int, family: str, directory: str, dev) -> None:
    """Rank 0 saves the unsharded tiny model; every rank learns whether that worked."""
    from tests.distributed.hf_cases import tiny_model

    ok = 1
    if rank == 0:
        try:
            tiny_model(family, torch.float32, "cpu").save_pretrained(directory)
        except Exception:
            ok = 0
            raise
        finally:
            flag = torch.tensor([ok], dtype=torch.int64, device=dev)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    else:
        flag = torch.tensor([ok], dtype=torch.int64, device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if not flag.item():
            raise RuntimeError(f"rank 0 failed to write the {family} checkpoint")


def check_sharded_load(rank, world, tmpdir, families, placements=("linear", "round_robin")):
    """Each family × placement: load rank 0's checkpoint by shard on every rank; count the
    tensors read and compare the logits with the unsharded model (float32, 1e-5)."""
    import pytest

    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from safetensors import safe_open

    from epmoe.integrations.huggingface import EPMoEBlock, from_pretrained_sharded
    from tests.distributed.hf_cases import COMMON, tiny_model

    dev = device_for(rank, test_device())  # NCCL ranks load onto their own GPU
    tol = 1e-5 if dev.type == "cpu" else 1e-4  # (GPU matmuls sum in another order)
    sweep = Sweep()
    for family in families:
        directory = os.path.join(tmpdir, f"sharded-{family}")
        _write_checkpoint(rank, family, directory, dev)
        with safe_open(os.path.join(directory, "model.safetensors"), "pt") as f:
            keys = sorted(f.keys())
        reference = tiny_model(family, torch.float32, dev)
        g = torch.Generator().manual_seed(70 + rank)
        ids = torch.randint(3, COMMON["vocab_size"], (2, 4 + rank), generator=g).to(dev)
        for placement in placements:
            with sweep.case(f"W={world} {family} {placement}"):
                opened: list[str] = []
                with counting_safe_open(opened):
                    model = from_pretrained_sharded(
                        directory, placement=placement, experts="torch", device=dev
                    )
                with torch.no_grad():  # collective: every rank, before any assertion
                    logits = model(ids).logits
                    expected = reference(ids).logits
                blocks = [m for m in model.modules() if isinstance(m, EPMoEBlock)]
                local = set(blocks[0].moe.local_experts)
                want = [k for k in keys if not EXPERT_KEY.search(k)]
                want += [k for k in keys if (m := EXPERT_KEY.search(k)) and int(m[1]) in local]
                n_experts = len(local) * 3 * len(blocks)  # gate, up, down per local expert
                assert len(blocks) == COMMON["num_hidden_layers"], len(blocks)
                assert len(local) < blocks[0].spec.num_experts, f"rank {rank} holds {local}"
                assert sorted(opened) == sorted(want), (
                    f"rank {rank} read {sorted(set(opened) ^ set(want))[:6]} (un)expectedly"
                )
                assert len(opened) == len(want) and len(want) == (
                    len(keys) - blocks[0].spec.num_experts * 3 * len(blocks) + n_experts
                ), (len(opened), len(want), n_experts)
                report = model.shard_load_report
                assert report.tensors_read == len(opened), (report, len(opened))
                assert report.expert_tensors_read == n_experts, report
                assert logits.device == dev, logits.device
                torch.testing.assert_close(logits, expected, rtol=tol, atol=tol)
    sweep.check()
    return sweep.passed


def failing_rank(rank, world, tmpdir):
    """Rank 1 is given a bad checkpoint, the other ranks a good one: (1) a directory that
    does not exist (fails before the collective conversion), (2) a copy that lacks
    ``model.norm.weight`` (fails in load_sharded, after it). Returns per case what this rank
    raised (type name, message) and how long the call took."""
    import pytest

    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file, save_file

    from epmoe.integrations.huggingface import from_pretrained_sharded

    good = os.path.join(tmpdir, "failing-good")
    _write_checkpoint(rank, "mixtral", good, device_for(rank, test_device()))
    damaged = os.path.join(tmpdir, f"failing-damaged-{rank}")
    if rank == 1:  # local: only this rank reads it
        shutil.copytree(good, damaged)
        state = load_file(os.path.join(damaged, "model.safetensors"))
        del state["model.norm.weight"]
        save_file(state, os.path.join(damaged, "model.safetensors"))
    bad = {"missing": os.path.join(tmpdir, "nowhere"), "damaged": damaged}
    out = {}
    for case, path in bad.items():
        start = time.monotonic()
        try:
            from_pretrained_sharded(path if rank == 1 else good, experts="torch")
            raised = None
        except Exception as exc:
            raised = (type(exc).__name__, str(exc))
        out[case] = (raised, time.monotonic() - start)
    return out
