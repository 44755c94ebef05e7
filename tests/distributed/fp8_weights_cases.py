"""Rank bodies for EPMoE with FP8 expert weights on W ranks (gloo; NCCL and CUDA tensors
with ``EPMOE_TEST_DEVICE=cuda``).

Each backend × layout × placement against the oracle on the dequantised weights, block
and per-expert scales; an EPLB re-plan that moves FP8 weights and their scales between
ranks (outputs unchanged, the moved slots bit-exact); full experts gathered with their
scales and loaded into another placement; a full-precision layer loaded from them.
"""

from __future__ import annotations

import torch

import epmoe
from epmoe.checkpoint import gather_full_experts, load_full_experts
from epmoe.reference import TOLERANCES, assert_close, quantize_block
from tests.distributed.cases import (
    backends_and_layouts,
    device_for,
    full_weights,
    placements,
    rank_tokens,
    redundant_slots,
)
from tests.harness import Sweep

FP8 = torch.float8_e4m3fn
E, K, H, I = 8, 2, 160, 256  # H: partial 128-blocks (I: whole ones, as block scales need)


def _layer(placement, backend, layout, scale, dev, dtype, experts="torch", **kwargs):
    return epmoe.EPMoE(
        E, K, H, I, placement=placement, backend=backend, layout=layout, experts=experts,
        params_dtype=dtype, device=dev, weight_dtype=FP8, weight_scale=scale, **kwargs,
    )  # fmt: skip


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def check_fp8_weights(rank, world, device="cpu", dtype_name="float32", experts="torch"):
    """``experts="triton"`` (GPU) runs W8A8: its activations are quantized too, so it is
    held to the FP8 tolerance; torch experts dequantize the weights and match closely."""
    dtype = getattr(torch, dtype_name)
    dev = device_for(rank, device)
    if experts == "triton":
        tol = TOLERANCES[FP8]
    else:
        tol = 1e-5 if dtype == torch.float32 else TOLERANCES[torch.bfloat16]
    T = [5, 0, 9, 3][rank]
    w13, w2 = full_weights(E, H, I, torch.float32, dev, seed=3)
    x, logits = rank_tokens(rank, T, H, E, dtype, dev, seed=3)
    w, ids = epmoe.select_experts(logits, K)
    sweep = Sweep()
    for scale in ("block", "per_expert"):
        per = scale == "per_expert"
        q13, s13 = quantize_block(w13, per_matrix=per)
        q2, s2 = quantize_block(w2, per_matrix=per)
        ref = epmoe.reference.moe(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2)
        for backend, layout in backends_and_layouts():
            for pname, placement in placements(E, world):
                with sweep.case(f"{scale} {backend} {layout.value} {pname}"):
                    layer = _layer(placement, backend, layout, scale, dev, dtype, experts)
                    layer.load_experts(q13, q2, w13_scale=s13, w2_scale=s2)
                    assert_close(layer(x, logits), ref, tol, name=f"rank {rank}")

        with sweep.case(f"{scale}: a re-plan moves FP8 weights and their scales"):
            layer = _layer("linear", "all_to_all", None, scale, dev, dtype, load_window=2)
            layer.load_experts(w13, w2)  # quantized on load, as the oracle's
            before = layer(x, logits)
            load = torch.arange(1, E + 1, dtype=torch.float64) ** 2
            balanced = epmoe.ExpertPlacement.balanced(
                load, ep_size=world, num_redundant=redundant_slots(E, world, at_least=world)
            )
            # round-robin keeps every rank's slot count (moved in place), balanced does not
            for new in (epmoe.ExpertPlacement.round_robin(E, world), balanced):
                layer.rebalance(new)
                assert layer.w13.dtype == FP8 and layer.w13_scale.dtype == torch.float32
                local = torch.tensor(layer.local_experts, device=dev)
                for name, full in (("w13", q13), ("w2", q2), ("w13_scale", s13), ("w2_scale", s2)):
                    got = getattr(layer, name)
                    assert torch.equal(_bits(got), _bits(full[local])), f"{name} after the move"
                # the same weights, summed over other ranks in another order: not bit-exact
                assert_close(layer(x, logits), before, tol, name="after the re-plan")

        with sweep.case(f"{scale}: full experts with scales load into another placement"):
            src = _layer(placements_of(world)[-1], "all_to_all", None, scale, dev, dtype)
            src.load_experts(w13, w2)
            full = gather_full_experts(src)
            assert set(full) == {"w13", "w2", "w13_scale", "w2_scale"}, sorted(full)
            assert torch.equal(_bits(full["w13"]), _bits(q13)) and torch.equal(full["w2_scale"], s2)
            dst = _layer("round_robin", "all_to_all", None, scale, dev, dtype)
            load_full_experts(dst, full)
            assert_close(dst(x, logits), ref, tol, name="reloaded FP8")
            plain = epmoe.EPMoE(
                E, K, H, I, backend="all_to_all", experts="torch", params_dtype=dtype, device=dev
            )
            load_full_experts(plain, full)  # a full-precision layer dequantizes them
            assert_close(plain(x, logits), ref, tol, name="dequantized on load")
    sweep.check()
    return sweep.passed


def placements_of(world):
    return [p for _, p in placements(E, world)]
