"""A Hugging Face Mixtral served data-parallel / expert-parallel with epmoe.

Run it through the launcher (2 gloo ranks on CPU, every GPU with NCCL):

    python launch/run.py examples/hf_mixtral_ep.py
    python examples/hf_mixtral_ep.py            # one process works too (W = 1)

Every rank builds the same small Mixtral from a config (same seed, no download), keeps an
unconverted copy as the reference, and swaps the MoE blocks for ``EPMoEBlock``s with
``replace_moe_blocks``: attention, norms and routers stay on every rank, each rank keeps
only its shard of every layer's experts. Then each rank serves its own prompts (a different
length on each rank): one forward pass, compared with the reference's logits, and a greedy
``generate`` with ``synced_gpus=True``, which keeps ranks that finish early stepping the
model, so every rank enters every MoE layer the same number of times. Rank 0 prints, per
rank, the experts held, the largest logit difference and whether the generated tokens
match. Needs ``pip install "epmoe[hf]"``.
"""

from __future__ import annotations

import argparse
import copy
import gc

import torch
import torch.distributed as dist

import epmoe
from epmoe.distributed import default_device
from epmoe.integrations.huggingface import EPMoEBlock, replace_moe_blocks


def build_mixtral(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """A small Mixtral with random weights, identical on every rank (shared seed)."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(
        vocab_size=512,
        hidden_size=args.hidden_size,
        intermediate_size=2 * args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=args.num_experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=256,
        initializer_range=0.1,  # larger than a trained model's 0.02: decisive routing
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device, dtype).eval()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--num-layers", type=int, default=2, help="decoder layers of the tiny model")
    p.add_argument("--num-experts", type=int, default=8, help="experts per MoE block")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument(
        "--hidden-size", type=int, default=128, help="a multiple of 16 (8 heads, rotary halves)"
    )
    p.add_argument("--new-tokens", type=int, default=8, help="tokens generated per prompt")
    p.add_argument("--placement", default="linear", choices=["linear", "round_robin"])
    p.add_argument("--backend", default="auto", help="epmoe all-to-all backend")
    args = p.parse_args(argv)
    for name in ("num_layers", "num_experts", "top_k", "hidden_size", "new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.top_k > args.num_experts:
        p.error(f"--top-k {args.top_k} exceeds --num-experts {args.num_experts}")
    if args.hidden_size % 16:
        p.error(f"--hidden-size must be a multiple of 16 (8 heads), got {args.hidden_size}")

    group = epmoe.init_distributed()  # None without torchrun: a single process
    rank = dist.get_rank() if group is not None else 0
    world = dist.get_world_size() if group is not None else 1
    device = default_device(group)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    model = build_mixtral(args, device, dtype)
    reference = copy.deepcopy(model)  # the whole model on this rank, for the comparison
    replaced = replace_moe_blocks(
        model, group=group, placement=args.placement, backend=args.backend
    )
    first = next(m for m in model.modules() if isinstance(m, EPMoEBlock))

    # this rank's own requests: 2 prompts of a rank-dependent length
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(3, model.config.vocab_size, (2, 5 + 3 * rank), generator=g).to(device)
    with torch.no_grad():
        logits, ref_logits = model(ids).logits, reference(ids).logits
        max_diff = (logits.float() - ref_logits.float()).abs().max().item()
        scale = ref_logits.float().abs().max().item()
        greedy = dict(
            attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens, do_sample=False
        )
        generated = model.generate(ids, synced_gpus=group is not None, **greedy)
        expected = reference.generate(ids, **greedy)
    same_tokens = generated.shape == expected.shape and bool(torch.equal(generated, expected))

    local = first.moe.local_experts
    row = torch.tensor(
        [max_diff, scale, float(same_tokens), float(len(local)), float(local[0])],
        dtype=torch.float64,
        device=device,
    )
    rows = [row]
    if group is not None:
        rows = [torch.zeros_like(row) for _ in range(world)]
        dist.all_gather(rows, row)
    if rank == 0:
        print(
            f"Mixtral ({args.num_layers} layers, E={args.num_experts}, top-{args.top_k}, "
            f"H={args.hidden_size}, {dtype}) on {world} {device.type} rank(s): {replaced} MoE "
            f"blocks replaced, backend={first.moe.comm.name}, placement={args.placement}"
        )
        for r, (diff, ref_max, same, n_local, first_id) in enumerate(t.tolist() for t in rows):
            held = f"{int(n_local)} of {args.num_experts} experts per layer"
            if args.placement == "linear":
                held += f" ({int(first_id)}..{int(first_id + n_local - 1)})"
            print(
                f"  rank {r}: holds {held}; max |logit - reference| = {diff:.2e} "
                f"(logits up to {ref_max:.2f}); greedy tokens "
                f"{'match' if same else 'differ'}"
            )
    if group is not None:
        # the layers (and their process-group handles) go before the group: a group torn
        # down under live references can abort the process at exit
        del model, reference, first
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
