"""Rank bodies of the checkpoint tests: shards that know their placement, full experts
across placements, and a converted Hugging Face model's save and reload.

Each case saves through files in a directory every rank sees (``tmpdir``, the test's
``tmp_path``), as a user would, and ends with the oracle (``epmoe.reference``) or the
unconverted model's logits on the rank's own tokens. Expected refusals are checked after
the case's last collective, so a rank that raises cannot leave the others waiting.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

import epmoe
from epmoe.checkpoint import gather_full_experts, load_full_experts
from epmoe.reference import TOLERANCES, assert_close
from tests.distributed.cases import device_for, full_weights, rank_tokens, redundant_slots
from tests.harness import Sweep

E, K, H, I = 8, 2, 16, 8


def _layer(placement, dtype, dev, load: bool = True):
    layer = epmoe.EPMoE(E, K, H, I, placement=placement, experts="torch", params_dtype=dtype,
                        device=dev)  # fmt: skip
    w13, w2 = full_weights(E, H, I, dtype, dev, seed=7)
    if load:
        layer.load_experts(w13, w2)
    return layer, w13, w2


def _check_oracle(layer, w13, w2, rank, dtype, dev, T=5):
    """Collective (a forward): the layer's output on this rank's tokens is the oracle's."""
    x, logits = rank_tokens(rank, T + rank, H, E, dtype, dev, seed=2)
    out = layer(x, logits)
    ref = epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, K))
    assert_close(out, ref, TOLERANCES[dtype], name=f"rank {rank}")


def _load_error(layer, state, strict: bool = True) -> str | None:
    """The message ``load_state_dict`` raises, or None when it loads."""
    try:
        layer.load_state_dict(state, strict=strict)
    except RuntimeError as exc:
        return str(exc)
    return None


def _save_then_load(obj, path: str, rank: int, src: int = 0):
    """Rank ``src`` saves ``obj`` to ``path``; every rank loads it (a barrier between)."""
    if rank == src:
        torch.save(obj, path)
    dist.barrier()
    return torch.load(path, weights_only=True)


def check_checkpoints(rank, world, tmpdir, device="cpu", dtype_name="float32", hf_families=()):
    dtype = getattr(torch, dtype_name)
    dev = device_for(rank, device)
    linear = epmoe.ExpertPlacement.linear(E, world)
    round_robin = epmoe.ExpertPlacement.round_robin(E, world)
    load = torch.arange(1, E + 1, dtype=torch.float64) ** 2
    balanced = epmoe.ExpertPlacement.balanced(
        load, ep_size=world, num_redundant=redundant_slots(E, world, at_least=2)
    )
    sweep = Sweep()

    with sweep.case(f"W={world} each rank's own shard round trip"):
        layer, w13, w2 = _layer(balanced, dtype, dev)
        path = os.path.join(tmpdir, f"own.rank{rank}.pt")
        torch.save(layer.state_dict(), path)
        fresh, *_ = _layer(balanced, dtype, dev, load=False)
        fresh.load_state_dict(torch.load(path, weights_only=True))
        assert fresh.weights_loaded, "a loaded shard must mark the weights loaded"
        _check_oracle(fresh, w13, w2, rank, dtype, dev)

    with sweep.case(f"W={world} rank 0's file on every rank"):
        layer, w13, w2 = _layer(linear, dtype, dev)
        state = _save_then_load(layer.state_dict(), os.path.join(tmpdir, "rank0.pt"), rank)
        fresh, *_ = _layer(linear, dtype, dev, load=False)
        error = _load_error(fresh, state)
        lenient = _load_error(fresh, state, strict=False)
        if rank == 0:
            assert error is None, error
        else:
            for message in (error, lenient):
                assert message and "saved by rank 0 of a 'linear' placement" in message, message
                assert f"this layer is rank {rank}" in message, message
            assert not fresh.weights_loaded, "a refused shard must leave the layer unloaded"

    with sweep.case(f"W={world} rank 0's file fits the ranks that hold the same experts"):
        # rank r < W-1 holds experts 0..E-1 in order, the last rank in reverse order
        p2l = [x for r in range(world) for x in (range(E) if r < world - 1 else range(E)[::-1])]
        same = epmoe.ExpertPlacement.from_physical_to_logical(p2l, world, E)
        layer, w13, w2 = _layer(same, dtype, dev)
        state = _save_then_load(layer.state_dict(), os.path.join(tmpdir, "same0.pt"), rank)
        fresh, *_ = _layer(same, dtype, dev, load=False)
        error = _load_error(fresh, state)
        if rank < world - 1:
            assert error is None, error
        else:
            assert error and f"slots hold experts {list(range(E))}" in error, error
            fresh.load_state_dict(layer.state_dict())  # its own shard fits
        _check_oracle(fresh, w13, w2, rank, dtype, dev)

    with sweep.case(f"W={world} linear shard into round_robin"):
        layer, *_ = _layer(linear, dtype, dev)
        path = os.path.join(tmpdir, f"linear.rank{rank}.pt")
        torch.save(layer.state_dict(), path)
        target, *_ = _layer(round_robin, dtype, dev, load=False)
        error = _load_error(target, torch.load(path, weights_only=True))
        assert error and "'linear' placement" in error and "'round_robin' placement" in error, error
        assert "load_full_experts" in error, error

    for dst in (None, 0, world - 1):
        with sweep.case(f"W={world} full experts from balanced (dst={dst}) into linear"):
            layer, w13, w2 = _layer(balanced, dtype, dev)
            full = gather_full_experts(layer, dst=dst)
            receives = dst is None or rank == dst
            src = 0 if dst is None else dst
            path = os.path.join(tmpdir, f"full.{dst}.pt")
            loaded = _save_then_load(full, path, rank, src=src)
            target, *_ = _layer(linear, dtype, dev, load=False)
            load_full_experts(target, loaded)
            _check_oracle(target, w13, w2, rank, dtype, dev)
            assert (full is not None) == receives, f"rank {rank} got {type(full)}"
            if receives:  # one copy of each expert, bit for bit, whatever the replicas
                assert torch.equal(full["w13"], w13) and torch.equal(full["w2"], w2)

    for family in hf_families:
        with sweep.case(f"W={world} Hugging Face {family} save and reload"):
            _hf_round_trip(rank, world, family, os.path.join(tmpdir, f"hf-{family}"), dev)
    sweep.check()
    return sweep.passed


def _hf_round_trip(rank, world, family, directory, dev):
    """Convert with a balanced placement (replicas), save in the Hugging Face layout,
    reload unconverted and reconverted with another placement: the same logits."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from epmoe.integrations.huggingface import replace_moe_blocks, save_pretrained
    from tests.distributed.hf_cases import COMMON, moe_block_names, tiny_model

    model = tiny_model(family, torch.float32, dev)
    reference = copy.deepcopy(model)
    E_model = model.get_submodule(moe_block_names(model)[0]).gate.weight.shape[0]
    load = torch.arange(1, E_model + 1, dtype=torch.float64)
    placement = epmoe.ExpertPlacement.balanced(
        load, ep_size=world, num_redundant=redundant_slots(E_model, world, at_least=1)
    )
    replace_moe_blocks(model, placement=placement, experts="torch")
    g = torch.Generator().manual_seed(40 + rank)
    ids = torch.randint(3, COMMON["vocab_size"], (2, 5 + rank), generator=g).to(dev)
    wrote = save_pretrained(model, directory)
    dist.barrier()  # save_pretrained returns on every rank once rank 0 wrote; belt and braces
    reloaded = AutoModelForCausalLM.from_pretrained(directory).to(dev).eval()
    with torch.no_grad():
        expected = reference(ids).logits
        unconverted = reloaded(ids).logits
        replace_moe_blocks(reloaded, placement="round_robin", experts="torch")
        reconverted = reloaded(ids).logits
    assert wrote == (rank == 0), f"rank {rank} wrote={wrote}"
    torch.testing.assert_close(unconverted, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(reconverted, expected, rtol=1e-5, atol=1e-5)
