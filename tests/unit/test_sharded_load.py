"""Loading by shard in one process: every family of ``tests/distributed/hf_cases.py`` from
transformers' own ``save_pretrained`` output, a fused-expert checkpoint (read by slices), an
FP8 checkpoint with 128×128 block scales (dequantised while loading), a checkpoint split by
an index, the block size of an FP8 config, the float32 router of DeepSeek-V3 in bfloat16,
the manual flow (``replace_moe_blocks(defer_expert_loading=True)`` then ``load_sharded``)
and the errors for a checkpoint that lacks tensors or a model left on the meta device."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from epmoe.integrations.huggingface import (  # noqa: E402
    EPMoEBlock,
    _parameters_on_meta,
    from_pretrained_sharded,
    load_sharded,
    replace_moe_blocks,
)
from epmoe.integrations.safetensors_loader import dequantize_fp8  # noqa: E402
from epmoe.reference import assert_close  # noqa: E402
from tests.distributed.hf_cases import COMMON, FAMILIES, tiny_model  # noqa: E402

IDS = torch.randint(3, COMMON["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(5))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_loads_by_shard(family, tmp_path):
    model = tiny_model(family)
    model.save_pretrained(tmp_path)
    loaded = from_pretrained_sharded(tmp_path, experts="torch")
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=1e-5, atol=1e-5)
    report = loaded.shard_load_report
    assert report.expert_tensors_skipped == 0 and not report.unused_keys, report


def test_fused_experts_are_read_by_slice(tmp_path):
    model = tiny_model("qwen3_moe")
    model.save_pretrained(tmp_path)
    # rewrite the file in the transformers 5 in-memory layout: experts.gate_up_proj [E, 2I, H]
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    safetensors_torch.save_file(state, os.path.join(tmp_path, "model.safetensors"))
    loaded = from_pretrained_sharded(tmp_path, experts="torch")
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=1e-5, atol=1e-5)
    # (gate_up, down) × 2 layers: a fused tensor counts once, however many rows are sliced
    report = loaded.shard_load_report
    assert report.expert_tensors_read == 2 * 2, report
    assert report.tensors_read == len(state), report  # every tensor, each once
    assert report.tensors_read == report.expert_tensors_read + report.other_tensors_read


def test_index_and_several_files(tmp_path):
    model = tiny_model("mixtral")
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    loaded = from_pretrained_sharded(tmp_path, experts="torch")
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=1e-5, atol=1e-5)


def _quantize_fp8(w: torch.Tensor, block: int = 128):
    """Block-wise e4m3 (DeepSeek-V3): per 128×128 block, scale_inv = amax / 448."""
    N, K = w.shape
    s = torch.empty(-(-N // block), -(-K // block))
    q = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            tile = w[i * block : (i + 1) * block, j * block : (j + 1) * block]
            s[i, j] = tile.abs().amax().clamp(min=1e-12) / 448.0
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = (tile / s[i, j]).to(
                torch.float8_e4m3fn
            )
    return q, s


def _dequantize_fp8(q: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    """The oracle of ``dequantize_fp8``: block by block, each FP8 value times its block's
    scale_inv (what the loader's function must give exactly)."""
    w = torch.empty(q.shape)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            w[rows, cols] = q[rows, cols].float() * s[i, j]
    return w


def test_dequantize_fp8_blocks():
    w = torch.randn(200, 130, generator=torch.Generator().manual_seed(0))
    q, s = _quantize_fp8(w)
    assert s.shape == (2, 2)
    torch.testing.assert_close(dequantize_fp8(q, s), _dequantize_fp8(q, s), rtol=0, atol=0)
    torch.testing.assert_close(dequantize_fp8(q, s), w, rtol=7e-2, atol=1e-2)
    q, s = _quantize_fp8(w, 64)  # another block size
    torch.testing.assert_close(dequantize_fp8(q, s, (64, 64)), _dequantize_fp8(q, s, 64))


def test_fp8_checkpoint_is_dequantised(tmp_path):
    model = tiny_model("deepseek_v3")
    model.save_pretrained(tmp_path)
    path = os.path.join(tmp_path, "model.safetensors")
    state = safetensors_torch.load_file(path)
    out = {}
    for key, t in state.items():  # quantise every linear weight, experts included
        if key.endswith("proj.weight") and t.dim() == 2:
            out[key], out[key + "_scale_inv"] = _quantize_fp8(t)
            state[key] = _dequantize_fp8(out[key], out[key + "_scale_inv"])
        else:
            out[key] = t
    safetensors_torch.save_file(out, path)
    loaded = from_pretrained_sharded(tmp_path, experts="torch", dtype=torch.float32)
    reference = tiny_model("deepseek_v3")
    reference.save_pretrained(tmp_path / "dequantised")
    safetensors_torch.save_file(state, os.path.join(tmp_path / "dequantised", "model.safetensors"))
    expected = from_pretrained_sharded(tmp_path / "dequantised", experts="torch")
    torch.testing.assert_close(_logits(loaded), _logits(expected), rtol=1e-5, atol=1e-5)
    fp8_reads = loaded.shard_load_report.tensors_read
    assert fp8_reads == len(out), (fp8_reads, len(out))


def test_fp8_checkpoint_into_fp8_layers(tmp_path):
    """weight_dtype=FP8: the layers hold FP8 expert weights (re-quantized per 128×128 block
    from the checkpoint's; exact where the blocks align, here they do not: I < 128) and
    give the dequantised model's logits to FP8 accuracy."""
    model = tiny_model("deepseek_v3")
    model.save_pretrained(tmp_path)
    path = os.path.join(tmp_path, "model.safetensors")
    state = safetensors_torch.load_file(path)
    out = {}
    for key, t in state.items():
        if ".experts." in key and key.endswith("proj.weight"):
            out[key], out[key + "_scale_inv"] = _quantize_fp8(t)
        else:
            out[key] = t
    safetensors_torch.save_file(out, path)
    fp8 = from_pretrained_sharded(  # (the tiny model's I is no multiple of 128)
        tmp_path, experts="torch", dtype=torch.float32, weight_dtype=torch.float8_e4m3fn,
        weight_scale="per_expert",
    )  # fmt: skip
    plain = from_pretrained_sharded(tmp_path, experts="torch", dtype=torch.float32)
    blocks = [m for m in fp8.modules() if isinstance(m, EPMoEBlock)]
    assert blocks and all(b.moe.w13.dtype == torch.float8_e4m3fn for b in blocks)
    assert all(b.moe.w13_scale is not None for b in blocks)
    assert_close(_logits(fp8), _logits(plain), 6e-2, name="FP8 layers vs dequantised")
    # saved back in the Hugging Face layout: dequantized, the same model when reloaded
    from transformers import AutoModelForCausalLM

    from epmoe.integrations.huggingface import save_pretrained

    save_pretrained(fp8, tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    torch.testing.assert_close(_logits(reloaded), _logits(fp8), rtol=1e-4, atol=1e-4)


def _checkpoint_without(tmp_path, family: str, key: str) -> None:
    """A tiny ``family`` checkpoint in ``tmp_path`` with the tensor ``key`` removed."""
    tiny_model(family).save_pretrained(tmp_path)
    path = os.path.join(tmp_path, "model.safetensors")
    state = safetensors_torch.load_file(path)
    del state[key]
    safetensors_torch.save_file(state, path)


def test_missing_tensor_is_refused(tmp_path):
    _checkpoint_without(tmp_path, "mixtral", "model.norm.weight")
    with pytest.raises(ValueError, match="lacks 1 tensor"):
        from_pretrained_sharded(tmp_path, experts="torch")


def test_missing_expert_is_refused(tmp_path):
    _checkpoint_without(tmp_path, "qwen3_moe", "model.layers.1.mlp.experts.3.up_proj.weight")
    with pytest.raises(ValueError, match="lacks some of this rank's experts"):
        from_pretrained_sharded(tmp_path, experts="torch")


def test_missing_expert_is_refused_over_experts_loaded_before(tmp_path):
    """A model whose experts hold weights already (``load_sharded`` overwrites them): a
    checkpoint without one of them is refused naming it, not run with the old weights."""
    key = "model.layers.0.block_sparse_moe.experts.1.{}.weight"
    tiny_model("mixtral").save_pretrained(tmp_path)
    path = os.path.join(tmp_path, "model.safetensors")
    state = safetensors_torch.load_file(path)
    for w in ("w1", "w2", "w3"):
        del state[key.format(w)]
    safetensors_torch.save_file(state, path)
    model = tiny_model("mixtral", seed=7)
    replace_moe_blocks(model, experts="torch")  # (its own experts loaded)
    with pytest.raises(ValueError, match=r"lacks some of this rank's experts: \[1\] of"):
        load_sharded(model, tmp_path)


def test_fused_experts_of_another_count_are_refused_naming_the_key(tmp_path):
    model = tiny_model("qwen3_moe")
    model.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    safetensors_torch.save_file(state, os.path.join(tmp_path, "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    E = config.pop("num_experts", None) or config["num_local_experts"]
    config["num_local_experts"] = E + 4
    (tmp_path / "config.json").write_text(json.dumps(config))
    want = rf"experts\.\w+: the checkpoint holds {E} experts .* has {E + 4}; is the config"
    with pytest.raises(ValueError, match=want):
        from_pretrained_sharded(tmp_path, experts="torch")


def test_a_causal_lm_checkpoint_loads_into_the_base_model(tmp_path):
    """As transformers' AutoModel.from_pretrained does: the checkpoint's keys carry the
    base model's prefix (``model.``), the base model's do not, experts included."""
    import transformers

    model = tiny_model("qwen3_moe")
    model.save_pretrained(tmp_path)
    loaded = from_pretrained_sharded(tmp_path, model_class=transformers.AutoModel, experts="torch")
    with torch.no_grad():
        want = model.model(IDS).last_hidden_state
        torch.testing.assert_close(loaded(IDS).last_hidden_state, want, rtol=1e-5, atol=1e-5)


def test_an_expert_of_another_shape_is_refused_naming_it(tmp_path):
    key = "model.layers.1.mlp.experts.0.up_proj.weight"
    tiny_model("qwen3_moe").save_pretrained(tmp_path)
    path = os.path.join(tmp_path, "model.safetensors")
    state = safetensors_torch.load_file(path)
    state[key] = torch.cat([state[key], state[key]])  # [2I, H]
    safetensors_torch.save_file(state, path)
    with pytest.raises(ValueError, match=rf"{key}: the checkpoint holds expert 0's up_proj .*"
                                         r"is the config the checkpoint's\?"):  # fmt: skip
        from_pretrained_sharded(tmp_path, experts="torch")


def test_what_the_function_sets_is_refused_in_moe_kwargs(tmp_path):
    with pytest.raises(TypeError, match="sets params_dtype of the MoE blocks: pass dtype="):
        from_pretrained_sharded(tmp_path, params_dtype=torch.float32)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError):
        from_pretrained_sharded(tmp_path / "nowhere")


def _fp8_checkpoint(directory, block: int) -> dict:
    """Quantise every linear weight of the DeepSeek-V3 checkpoint in ``directory`` in
    ``block``×``block`` blocks; returns the dequantised state (what loading should give)."""
    path = os.path.join(directory, "model.safetensors")
    state = safetensors_torch.load_file(path)
    out = {}
    for key, t in state.items():
        if key.endswith("proj.weight") and t.dim() == 2:
            out[key], out[key + "_scale_inv"] = _quantize_fp8(t, block)
            state[key] = _dequantize_fp8(out[key], out[key + "_scale_inv"], block)
        else:
            out[key] = t
    safetensors_torch.save_file(out, path)
    return state


def test_fp8_block_size_comes_from_the_config(tmp_path):
    model = tiny_model("deepseek_v3")
    model.save_pretrained(tmp_path)
    state = _fp8_checkpoint(tmp_path, 8)  # 8×8 blocks: scales [N/8, K/8], not one per tensor
    with pytest.raises(ValueError, match="weight_block_size"):  # read as 128×128
        from_pretrained_sharded(tmp_path, experts="torch", dtype=torch.float32)
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [8, 8],
    }
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    loaded = from_pretrained_sharded(tmp_path, experts="torch", dtype=torch.float32)
    reference = tiny_model("deepseek_v3")
    reference.save_pretrained(tmp_path / "dequantised")
    safetensors_torch.save_file(state, os.path.join(tmp_path / "dequantised", "model.safetensors"))
    expected = from_pretrained_sharded(tmp_path / "dequantised", experts="torch")
    torch.testing.assert_close(_logits(loaded), _logits(expected), rtol=1e-5, atol=1e-5)
    # saved back dequantized: the written config no longer names FP8 (from_pretrained would
    # look for scales the files do not hold), the model's own config keeps it
    from transformers import AutoModelForCausalLM

    from epmoe.integrations.huggingface import save_pretrained

    save_pretrained(loaded, tmp_path / "saved")
    with open(tmp_path / "saved" / "config.json") as f:
        assert "quantization_config" not in json.load(f)
    assert loaded.config.quantization_config["weight_block_size"] == [8, 8]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    torch.testing.assert_close(_logits(reloaded), _logits(loaded), rtol=1e-4, atol=1e-4)


def _tolerance(dtype: torch.dtype) -> dict:
    return dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)


def test_router_stays_float32_in_bfloat16(tmp_path):
    """DeepSeek-V3's ``_keep_in_fp32_modules_strict``: the correction bias (and, from
    transformers 5.2x, ``gate.weight``) stay float32 as transformers keeps them; the rest
    runs in bfloat16."""
    model = tiny_model("deepseek_v3")
    model.save_pretrained(tmp_path)
    loaded = from_pretrained_sharded(tmp_path, experts="torch", dtype=torch.bfloat16)
    mlp = loaded.model.layers[0].mlp
    strict = getattr(type(model), "_keep_in_fp32_modules_strict", None) or []
    router_dtype = torch.float32 if "gate.weight" in strict else torch.bfloat16
    assert mlp.gate.weight.dtype == router_dtype, (mlp.gate.weight.dtype, strict)
    assert mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.lm_head.weight.dtype == torch.bfloat16
    torch.testing.assert_close(
        mlp.gate.weight.float(), model.model.layers[0].mlp.gate.weight, **_tolerance(router_dtype)
    )
    plain = tiny_model("mixtral")  # no keep-in-float32 modules: its router is bfloat16
    plain.save_pretrained(tmp_path / "mixtral")
    loaded = from_pretrained_sharded(tmp_path / "mixtral", experts="torch", dtype=torch.bfloat16)
    assert loaded.model.layers[0].mlp.gate.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_manual_flow_with_parameters_on_meta(family, tmp_path):
    """Parameters on meta, buffers real; convert with deferred experts; load_sharded with
    device= gives the parameters storage and fills them."""
    model = tiny_model(family)
    model.save_pretrained(tmp_path)
    with _parameters_on_meta():
        empty = type(model)(model.config)
    empty.eval()
    replace_moe_blocks(empty, experts="torch", defer_expert_loading=True, device="cpu")
    with pytest.raises(ValueError, match="meta device"):
        load_sharded(empty, tmp_path)  # copying into meta tensors would do nothing
    report = load_sharded(empty, tmp_path, device="cpu")
    assert report.tensors_read == report.expert_tensors_read + report.other_tensors_read
    assert not any(t.device.type == "meta" for t in empty.state_dict().values())
    torch.testing.assert_close(_logits(empty), _logits(model), rtol=1e-5, atol=1e-5)


def test_model_moved_to_meta_is_refused(tmp_path):
    """``model.to("meta")`` also puts the computed buffers (rotary inv_freq) on meta: no
    checkpoint holds them, so load_sharded refuses instead of "loading" nothing."""
    model = tiny_model("mixtral")
    model.save_pretrained(tmp_path)
    on_meta = tiny_model("mixtral").to("meta")
    replace_moe_blocks(on_meta, experts="torch", defer_expert_loading=True, device="cpu")
    for device in (None, "cpu"):
        with pytest.raises(ValueError, match="not saved in checkpoints"):
            load_sharded(on_meta, tmp_path, device=device)
    deepseek = tiny_model("deepseek_v3").to("meta")
    with pytest.raises(ValueError, match="e_score_correction_bias .* meta"):
        replace_moe_blocks(deepseek, experts="torch", defer_expert_loading=True, device="cpu")
