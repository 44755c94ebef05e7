"""Tiny Hugging Face MoE models and the rank bodies that check ``EPMoEBlock`` against them.

``tiny_model(family)`` builds a 2-layer model of one supported family from a config, in
process (no downloads), with every weight re-drawn from a fixed seed so that routing is
decisive and outputs are O(1): the same model on every rank. The rank bodies run inside the
process group of ``tests/harness.py``; this module imports ``transformers`` only inside
functions, so collecting tests without it costs nothing.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from epmoe.reference import TOLERANCES, assert_close
from tests.distributed.cases import device_for
from tests.harness import Sweep

# family -> config fields on top of COMMON: 2 layers, hidden 32, 4-8 experts, top-2.
# DeepSeek-V3 / GLM-4-MoE: both layers MoE, 4 groups of 2 experts with 2 kept, scaled.
COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    num_experts_per_tok=2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
FAMILIES = {
    "mixtral": dict(intermediate_size=16, num_local_experts=4),
    "qwen2_moe": dict(
        intermediate_size=48,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_experts=8,
        norm_topk_prob=False,
    ),
    "qwen3_moe": dict(
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=8,
        norm_topk_prob=True,
        head_dim=8,
    ),  # fmt: skip
    "olmoe": dict(intermediate_size=16, num_experts=6, norm_topk_prob=False),
    "deepseek_v3": dict(
        intermediate_size=48,
        moe_intermediate_size=16,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=0,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
    ),
    "glm4_moe": dict(
        intermediate_size=48,
        moe_intermediate_size=16,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=0,
        routed_scaling_factor=1.5,
        norm_topk_prob=True,
        head_dim=8,
    ),
}


def transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


@torch.no_grad()
def tiny_model(family: str, dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0):
    """A 2-layer causal LM of ``family`` in eval mode with random O(1) weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **{**COMMON, **FAMILIES[family]})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if p.dim() >= 2:  # fan-in is the last dim (nn.Linear, fused [E, out, in] experts)
            scale = p.shape[-1] ** -0.5 * (3.0 if name.endswith("gate.weight") else 1.0)
            p.copy_(torch.randn(p.shape, generator=g) * scale)
        else:  # norm weights and biases
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            # transformers 4.x masks dropped groups with 0 instead of -inf (v5 and DeepSeek's
            # reference use -inf), so keep biased scores positive there
            lo = -0.1 if transformers_major() >= 5 else 0.0
            b.copy_(lo + 0.2 * torch.rand(b.shape, generator=g))
    return model.to(device, dtype)


def moe_block_names(model) -> list[str]:
    from epmoe.integrations.huggingface import SUPPORTED_BLOCKS

    return [n for n, m in model.named_modules() if type(m).__name__ in SUPPORTED_BLOCKS]


def check_blocks_match_hf(rank, world, device="cpu", dtype_name="float32", families=None):
    """Each family × placement: one MoE block wrapped across the ``world`` ranks gives, on
    every rank's own tokens, what the original block gives on them. Token counts differ per
    rank and the last rank has none in the ``idle`` cases."""
    import pytest

    pytest.importorskip("transformers")
    from epmoe.integrations.huggingface import EPMoEBlock

    dtype = getattr(torch, dtype_name)
    dev = device_for(rank, device)
    group = dist.group.WORLD
    sweep = Sweep()
    for family in families or list(FAMILIES):
        for placement, idle in (("linear", False), ("round_robin", True)):
            with sweep.case(f"W={world} {family} {placement}{' idle' * idle}"):
                model = tiny_model(family, dtype, dev)
                name = moe_block_names(model)[-1]
                block = model.get_submodule(name)
                reference = copy.deepcopy(block)
                wrapped = EPMoEBlock(
                    block, model.config, group=group, placement=placement, experts="torch"
                )
                S = 0 if idle and rank == world - 1 else 3 + 2 * rank
                g = torch.Generator().manual_seed(100 + rank)
                x = torch.randn(2, S, 32, generator=g).to(dev, dtype)
                with torch.no_grad():
                    out, ref = wrapped(x), reference(x)
                local = wrapped.moe.local_experts
                if isinstance(ref, tuple):  # transformers 4.x: (hidden, router_logits)
                    assert isinstance(out, tuple) and len(out) == 2, type(out)
                    torch.testing.assert_close(out[1], ref[1], rtol=0, atol=0)
                    out, ref = out[0], ref[0]
                assert isinstance(out, torch.Tensor) and out.shape == x.shape, type(out)
                assert out.dtype == dtype, out.dtype
                assert_close(out, ref, TOLERANCES[dtype], name=f"rank {rank}")
                assert len(local) < wrapped.spec.num_experts or world == 1, local
    sweep.check()
    return sweep.passed
