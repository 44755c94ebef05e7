"""Write a DeepSeek-V3-shaped checkpoint with random weights, in DeepSeek-V3's FP8 format.

    python examples/deepseek_v3_checkpoint.py /data/dsv3-4l                   # the real shape
    python examples/deepseek_v3_checkpoint.py /tmp/tiny --hidden-size 256 \\
        --num-experts 16 --moe-intermediate-size 128 --num-heads 4            # a small one

DeepSeek-V3's architecture and its checkpoint layout (``config.json`` with an FP8
``quantization_config`` of 128×128 blocks, ``model-0000k-of-0000n.safetensors`` shards and
their index; every linear ``*proj*.weight`` in ``float8_e4m3fn`` with a float32
``*proj*.weight_scale_inv`` per block, ``kv_a_proj_with_mqa`` included; router, norms,
embeddings and head in bf16, the routing correction bias in float32), with
``--num-layers`` MoE layers (all MoE:
``first_k_dense_replace=0``) and a small vocabulary. The model is never built: tensors are
made one at a time from the config's parameter list (random normal, DeepSeek-V3's
initializer range; norms one, correction bias zero), quantized, and written shard by shard,
so memory holds one shard. ``epmoe.integrations.huggingface.from_pretrained_sharded`` then
loads it by shard, keeping the experts in FP8 (``weight_dtype=torch.float8_e4m3fn``) or
dequantizing them (``dtype=torch.bfloat16``): ``examples/serving.py --checkpoint DIR``.

Each tensor's values come from its name and ``--seed`` only, so the same command writes
the same checkpoint. Needs ``pip install "epmoe[hf]"``.

Shape legend: H hidden · I expert intermediate · E routed experts · L layers.
"""

from __future__ import annotations

import argparse
import json
import os
import zlib

import torch

from epmoe.reference import quantize_block

BLOCK = 128  # DeepSeek-V3's weight_block_size


def config_for(args: argparse.Namespace):
    """The ``DeepseekV3Config`` of the checkpoint (DeepSeek-V3's values where not given)."""
    from transformers import DeepseekV3Config

    heads = args.num_heads
    return DeepseekV3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden_size,
        intermediate_size=args.moe_intermediate_size * 9,  # (no dense layer is built)
        moe_intermediate_size=args.moe_intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        n_routed_experts=args.num_experts,
        num_experts_per_tok=args.top_k,
        n_shared_experts=1,
        n_group=args.n_group,
        topk_group=args.topk_group,
        first_k_dense_replace=0,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank,
        qk_rope_head_dim=64 if args.hidden_size >= 1024 else 8,
        qk_nope_head_dim=128 if args.hidden_size >= 1024 else 16,
        v_head_dim=128 if args.hidden_size >= 1024 else 16,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="bfloat16",
        quantization_config={
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK],
        },
    )


def parameter_shapes(config) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name → (shape, dtype) of every tensor of the checkpoint, from the model's state dict
    built on the meta device (no storage). Experts are written as DeepSeek-V3 publishes
    them, per expert (``mlp.experts.{j}.gate_proj.weight [I, H]``, ``up_proj``,
    ``down_proj [H, I]``), also where transformers fuses them in memory
    (``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    out = {}
    for key, t in model.state_dict().items():
        shape = tuple(t.shape)
        if key.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]
            prefix, (E, two_i, H) = key.removesuffix("gate_up_proj"), shape
            for j in range(E):
                out[f"{prefix}{j}.gate_proj.weight"] = ((two_i // 2, H), t.dtype)
                out[f"{prefix}{j}.up_proj.weight"] = ((two_i // 2, H), t.dtype)
        elif key.endswith("mlp.experts.down_proj"):  # [E, H, I]
            prefix, (E, H, I) = key.removesuffix("down_proj"), shape
            for j in range(E):
                out[f"{prefix}{j}.down_proj.weight"] = ((H, I), t.dtype)
        else:
            out[key] = (shape, t.dtype)
    return out


def make_tensor(name, shape, dtype, std: float, seed: int, device) -> dict[str, torch.Tensor]:
    """The tensors written for parameter ``name``: FP8 and its block scales for a linear
    ``*proj.weight``, else the parameter itself."""
    if name.endswith("norm.weight"):
        return {name: torch.ones(shape, dtype=torch.bfloat16)}
    if name.endswith("e_score_correction_bias"):
        return {name: torch.zeros(shape, dtype=torch.float32)}
    g = torch.Generator(device=device).manual_seed(seed ^ zlib.crc32(name.encode()))
    w = torch.randn(shape, generator=g, device=device, dtype=torch.float32) * std
    if name.endswith(".weight") and "proj" in name.split(".")[-2] and len(shape) == 2:
        # every linear projection, kv_a_proj_with_mqa (576 rows: a partial block) included
        q, scale = quantize_block(w[None], BLOCK)
        return {name: q[0].cpu(), name + "_scale_inv": scale[0].cpu()}
    return {name: w.to(torch.bfloat16 if dtype.is_floating_point else dtype).cpu()}


def write(directory: str, args: argparse.Namespace) -> dict:
    """Write the checkpoint; returns its index (``weight_map``, ``total_size``)."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    config = config_for(args)
    shapes = parameter_shapes(config)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shard: dict[str, torch.Tensor] = {}
    names: list[list[str]] = []
    limit = args.shard_gb * 2**30
    total = 0

    def flush() -> None:
        if shard:
            path = os.path.join(directory, f"part-{len(names):05d}.safetensors")
            save_file(dict(shard), path, metadata={"format": "pt"})
            names.append(list(shard))
            shard.clear()

    size = 0
    for name, (shape, dtype) in shapes.items():
        for key, t in make_tensor(
            name, shape, dtype, config.initializer_range, args.seed, device
        ).items():
            shard[key] = t
            nbytes = t.numel() * t.element_size()
            size += nbytes
            total += nbytes
        if size >= limit:
            flush()
            size = 0
    flush()
    n = len(names)
    weight_map = {}
    for i, keys in enumerate(names):  # the names transformers' loaders expect
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        part = os.path.join(directory, f"part-{i:05d}.safetensors")
        os.replace(part, os.path.join(directory, final))
        weight_map.update({k: final for k in keys})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=1)
    config.save_pretrained(directory)
    return index


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("directory", help="where to write config.json and the safetensors shards")
    p.add_argument("--num-layers", type=int, default=4, help="MoE layers (L)")
    p.add_argument("--hidden-size", type=int, default=7168, help="H")
    p.add_argument("--num-experts", type=int, default=256, help="routed experts (E)")
    p.add_argument("--top-k", type=int, default=8, help="experts per token")
    p.add_argument("--moe-intermediate-size", type=int, default=2048, help="I")
    p.add_argument("--n-group", type=int, default=8, help="expert groups of grouped top-k")
    p.add_argument("--topk-group", type=int, default=4, help="groups each token picks from")
    p.add_argument("--num-heads", type=int, default=128, help="attention heads")
    p.add_argument("--q-lora-rank", type=int, default=1536)
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary (DeepSeek-V3: 129280)")
    p.add_argument("--seed", type=int, default=0, help="the values' seed")
    p.add_argument("--shard-gb", type=float, default=4.0, help="GiB per safetensors shard")
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    E, groups = args.num_experts, args.n_group
    if groups < 1 or E % groups:  # (what the routing of the written model needs)
        p.error(f"--num-experts {E} must be a multiple of --n-group {groups}")
    if not 1 <= args.topk_group <= groups:
        p.error(f"--topk-group must be in 1 … --n-group ({groups}), got {args.topk_group}")
    if not 1 <= args.top_k <= args.topk_group * E // groups:
        p.error(
            f"--top-k {args.top_k} must be at most the experts of the --topk-group "
            f"{args.topk_group} groups chosen ({args.topk_group * E // groups})"
        )
    index = write(args.directory, args)
    n = len(set(index["weight_map"].values()))
    gib = index["metadata"]["total_size"] / 2**30
    tensors = len(index["weight_map"])
    print(f"wrote {tensors} tensors, {gib:.2f} GiB in {n} shard(s) to {args.directory}")


if __name__ == "__main__":
    main()
