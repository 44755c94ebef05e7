"""``epmoe.integrations.huggingface``: EPMoE as a drop-in for Hugging Face MoE blocks.

Every supported family is built tiny from a config (no downloads,
``tests/distributed/hf_cases.py``), run, converted with ``replace_moe_blocks`` and run
again: the logits must agree to 1e-5 in float32. The multi-rank test wraps one block on 2
gloo ranks and checks every rank's output against the original block on that rank's own
tokens. ``save_pretrained`` writes a converted model in the original layout:
``from_pretrained`` reloads it with the same logits (the 2- and 3-rank round trips are in
``tests/distributed/test_checkpoint.py``). Skipped without ``transformers``.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from epmoe.integrations import huggingface as hf
from epmoe.reference import TOLERANCES, assert_close
from tests.distributed import hf_cases
from tests.harness import REPO_ROOT, requires_world, run_on_ranks
from tests.harness import test_device as device_under_test

pytest.importorskip("transformers")

FAMILIES = list(hf_cases.FAMILIES)


def _input_ids(batch: int = 2, seq: int = 7, seed: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, hf_cases.COMMON["vocab_size"], (batch, seq), generator=g)


@pytest.mark.parametrize("family", FAMILIES)
def test_replaced_model_matches_hf_logits(family):
    model = hf_cases.tiny_model(family)
    reference = copy.deepcopy(model)
    names = hf_cases.moe_block_names(model)
    assert len(names) == 2, names  # both layers are MoE layers in the tiny configs

    replaced = hf.replace_moe_blocks(model)

    assert replaced == 2
    for name in names:
        wrapped = model.get_submodule(name)
        assert isinstance(wrapped, hf.EPMoEBlock)
        assert wrapped.spec.family == family
        assert wrapped.moe.ep_size == 1 and wrapped.moe.local_experts == list(
            range(wrapped.spec.num_experts)
        )
    assert not hf_cases.moe_block_names(model), "an original MoE block is still in the model"
    ids = _input_ids()
    with torch.no_grad():
        out, ref = model(ids).logits, reference(ids).logits
    assert ref.abs().max() > 0.5  # the tiny model computes something non-trivial
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_block_contract_matches_hf(family):
    """Same return type (tuple with router logits on transformers 4.x, tensor on 5.x), shape
    and dtype as the Hugging Face block; also for a [T, H] input and zero tokens."""
    model = hf_cases.tiny_model(family)
    block = model.get_submodule(hf_cases.moe_block_names(model)[0])
    wrapped = hf.EPMoEBlock(copy.deepcopy(block), model.config)
    g = torch.Generator().manual_seed(11)
    cases = {
        "B=2 S=5": torch.randn(2, 5, 32, generator=g),
        "S=0": torch.randn(1, 0, 32),
    }
    for what, x in cases.items():
        with torch.no_grad():
            out, ref = wrapped(x), block(x)
        assert type(out) is type(ref), what
        if isinstance(ref, tuple):
            assert wrapped.spec.returns_router_logits
            torch.testing.assert_close(out[1], ref[1], rtol=0, atol=0)
            out, ref = out[0], ref[0]
        assert out.shape == ref.shape and out.dtype == ref.dtype, what
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        if x.numel():  # the MoE output itself is checked, not a residual around it
            assert ref.abs().max() > 0.1, what


def test_padding_rows_of_a_block_go_to_no_expert():
    """EPMoEBlock passes num_valid_tokens (a decode graph's padded batch) to its EPMoE: the
    real rows equal the block's output on them alone, the padding rows get only what does
    not depend on routing (the shared experts, where the family has them)."""
    model = hf_cases.tiny_model("mixtral")
    block = model.get_submodule(hf_cases.moe_block_names(model)[0])
    wrapped = hf.EPMoEBlock(copy.deepcopy(block), model.config)
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = wrapped(x, num_valid_tokens=torch.tensor([4]))
        ref = wrapped(x[:4])
    out = out[0] if isinstance(out, tuple) else out
    ref = ref[0] if isinstance(ref, tuple) else ref
    torch.testing.assert_close(out[:4], ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[4:], torch.zeros(2, 32))  # Mixtral has no shared experts


def test_padded_batch_makes_every_blocks_trailing_rows_padding():
    """``padded_batch(n)`` around a whole model's forward (what a graph of the whole decode
    step captures): every EPMoEBlock treats the flattened rows from n on as padding, so
    the real sequences' logits equal the model's on them alone, and the padding rows are
    not recorded as expert load; a block's own num_valid_tokens still wins."""
    model = hf_cases.tiny_model("mixtral")
    hf.replace_moe_blocks(model, load_window=4)
    blocks = [m for m in model.modules() if isinstance(m, hf.EPMoEBlock)]
    ids = _input_ids(batch=3, seq=1)  # a decode step: one row per sequence
    with torch.no_grad():
        alone = model(input_ids=ids[:2]).logits
        with hf.padded_batch(torch.tensor([2])):
            padded = model(input_ids=ids).logits
    torch.testing.assert_close(padded[:2], alone, rtol=1e-5, atol=1e-5)
    K = model.config.num_experts_per_tok
    for block in blocks:  # two forwards of 2 real rows each, K experts per row
        assert int(block.moe.load_recorder.window_load().sum()) == 2 * 2 * K
    x = torch.randn(3, model.config.hidden_size)
    with torch.no_grad(), hf.padded_batch(torch.tensor([0])):
        out = blocks[0](x, num_valid_tokens=torch.tensor([3]))
    out = out[0] if isinstance(out, tuple) else out
    assert out.abs().sum() > 0  # all 3 rows routed: the explicit count


def test_padded_batch_with_a_mask_makes_finished_rows_padding():
    """``padded_batch(mask)``, a bool per flattened row (a static batch whose first and
    third requests have finished): the live rows' logits equal the model's on them alone,
    and only they are recorded as expert load."""
    model = hf_cases.tiny_model("mixtral")
    hf.replace_moe_blocks(model, load_window=4)
    blocks = [m for m in model.modules() if isinstance(m, hf.EPMoEBlock)]
    ids = _input_ids(batch=4, seq=1)
    live = torch.tensor([False, True, False, True])
    with torch.no_grad():
        alone = model(input_ids=ids[live]).logits
        for block in blocks:
            block.moe.load_recorder.reset()
        with hf.padded_batch(live):
            masked = model(input_ids=ids).logits
    torch.testing.assert_close(masked[live], alone, rtol=1e-5, atol=1e-5)
    K = model.config.num_experts_per_tok
    assert all(int(b.moe.load_recorder.window_load().sum()) == 2 * K for b in blocks)


def test_greedy_generate_matches_hf():
    model = hf_cases.tiny_model("mixtral")
    reference = copy.deepcopy(model)
    hf.replace_moe_blocks(model)
    ids = _input_ids(batch=1, seq=6)
    with torch.no_grad():
        tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
        ref_tokens = reference.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(tokens, ref_tokens)


def test_output_router_logits_matches_hf():
    """transformers 5 records the router's logits (kept in the wrapper) and the aux loss."""
    if hf_cases.transformers_major() < 5:
        pytest.skip("transformers 4.x records router logits from the original block class")
    model = hf_cases.tiny_model("qwen3_moe")
    reference = copy.deepcopy(model)
    hf.replace_moe_blocks(model)
    ids = _input_ids(batch=1, seq=6)
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
        ref = reference(ids, output_router_logits=True)
    assert len(out.router_logits) == len(ref.router_logits) == 2
    for a, b in zip(out.router_logits, ref.router_logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(out.aux_loss, ref.aux_loss)


def test_bfloat16_model_within_bf16_tolerance():
    model = hf_cases.tiny_model("deepseek_v3", dtype=torch.bfloat16)
    reference = copy.deepcopy(model)
    hf.replace_moe_blocks(model)
    wrapped = model.get_submodule(hf_cases.moe_block_names(reference)[0])
    assert wrapped.moe.w13.dtype == torch.bfloat16  # params_dtype follows the checkpoint
    with torch.no_grad():
        out, ref = model(_input_ids()).logits, reference(_input_ids()).logits
    assert out.dtype == torch.bfloat16
    assert_close(out.float(), ref.float(), TOLERANCES[torch.bfloat16])


def test_a_converted_model_changes_dtype_with_to():
    """``model.to(torch.bfloat16)`` after the conversion, as after ``from_pretrained``: the
    EPMoE layers follow (weights, params_dtype, backend at the next forward)."""
    model = hf_cases.tiny_model("mixtral")
    reference = copy.deepcopy(model).to(torch.bfloat16)
    hf.replace_moe_blocks(model)
    model.to(torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        out, ref = model(_input_ids()).logits, reference(_input_ids()).logits
    assert out.dtype == torch.bfloat16
    assert_close(out.float(), ref.float(), TOLERANCES[torch.bfloat16])


def test_a_converted_model_saves_its_experts_in_its_dtype_now(tmp_path):
    from safetensors import safe_open

    model = hf_cases.tiny_model("mixtral")
    hf.replace_moe_blocks(model)
    model.half()
    assert hf.save_pretrained(model, tmp_path) is True
    dtypes = set()
    for path in tmp_path.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            dtypes |= {f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118 (not a dict)
    assert dtypes == {torch.float16}, dtypes


def test_per_layer_placement_and_moe_kwargs_pass_through():
    model = hf_cases.tiny_model("qwen3_moe")
    seen = []

    def placement(name: str) -> str:
        seen.append(name)
        return "round_robin"

    hf.replace_moe_blocks(model, placement=placement, experts="torch", max_num_tokens=4)
    assert seen == ["model.layers.0.mlp", "model.layers.1.mlp"]
    moe = model.get_submodule(seen[0]).moe
    assert moe.max_num_tokens == 4 and moe.experts.name == "torch"


def test_original_experts_are_released():
    model = hf_cases.tiny_model("mixtral")
    name = hf_cases.moe_block_names(model)[0]
    block = model.get_submodule(name)
    hf.replace_moe_blocks(model)
    assert block.experts is None
    assert model.get_submodule(name).gate is block.gate  # the router is kept, not copied


# ---------------------------------------------------------------------- saving
def _weight_keys(directory) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_writes_the_original_layout(family, tmp_path):
    """A converted model (round-robin, so the shards are not in logical order) saves what
    the unconverted model saves; from_pretrained then gives the same logits, unconverted
    and converted again."""
    from transformers import AutoModelForCausalLM

    model = hf_cases.tiny_model(family)
    reference = copy.deepcopy(model)
    reference.save_pretrained(tmp_path / "original")
    hf.replace_moe_blocks(model, placement="round_robin")

    assert hf.save_pretrained(model, tmp_path / "converted") is True

    assert _weight_keys(tmp_path / "converted") == _weight_keys(tmp_path / "original")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "converted").eval()
    ids = _input_ids()
    with torch.no_grad():
        expected = reference(ids).logits
        torch.testing.assert_close(reloaded(ids).logits, expected, rtol=1e-5, atol=1e-5)
        hf.replace_moe_blocks(reloaded)
        torch.testing.assert_close(reloaded(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_save_pretrained_writes_the_correction_bias_the_layer_routes_with(tmp_path):
    """DeepSeek-V3: the layer routes with its own float32 copy of the router's correction
    bias, which ``load_full_experts`` updates; the saved model routes as the running one."""
    from transformers import AutoModelForCausalLM

    from epmoe.checkpoint import gather_full_experts, load_full_experts

    model = hf_cases.tiny_model("deepseek_v3")
    hf.replace_moe_blocks(model)
    blocks = [m for m in model.modules() if isinstance(m, hf.EPMoEBlock)]
    for block in blocks:
        full = gather_full_experts(block.moe)
        E = full["e_score_correction_bias"].numel()
        full["e_score_correction_bias"] = torch.linspace(-1, 1, E)
        load_full_experts(block.moe, full)
    ids = _input_ids()
    hf.save_pretrained(model, tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_save_pretrained_refuses_what_it_cannot_save(tmp_path):
    model = hf_cases.tiny_model("mixtral")
    with pytest.raises(ValueError, match="holds no EPMoEBlock"):
        hf.save_pretrained(model, tmp_path)
    hf.replace_moe_blocks(model)
    with pytest.raises(TypeError, match="state_dict"):
        hf.save_pretrained(model, tmp_path, state_dict={})
    with pytest.raises(TypeError, match="PreTrainedModel"):
        hf.save_pretrained(torch.nn.Sequential(), tmp_path)


def test_per_expert_layout_is_written_per_expert():
    """transformers 4.x keeps one MLP per expert: w13 splits into gate and up rows."""
    layout = hf._HFLayout(
        renamed={}, expert_keys=frozenset(), projections=("w1", "w3", "w2"), lost=(),
        dtype=torch.float32,
    )  # fmt: skip
    w13, w2 = torch.randn(3, 8, 5), torch.randn(3, 5, 4)
    state = layout.expert_state(w13, w2)
    assert sorted(state) == sorted(
        f"experts.{j}.{n}.weight" for j in range(3) for n in ["w1", "w3", "w2"]
    )
    assert torch.equal(state["experts.2.w1.weight"], w13[2, :4])
    assert torch.equal(state["experts.2.w3.weight"], w13[2, 4:])
    assert torch.equal(state["experts.1.w2.weight"], w2[1])
    storages = {t.untyped_storage().data_ptr() for t in state.values()}
    assert len(storages) == len(state)  # safetensors refuses tensors that share storage


# ---------------------------------------------------------------------- errors
def test_no_supported_block_raises_listing_supported():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=8,
    )  # fmt: skip
    dense = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="no supported MoE block.*MixtralSparseMoeBlock"):
        hf.replace_moe_blocks(dense)


def test_converting_twice_says_already_converted():
    model = hf_cases.tiny_model("olmoe")
    hf.replace_moe_blocks(model)
    with pytest.raises(ValueError, match=r"already holds 2 EPMoEBlock"):
        hf.replace_moe_blocks(model)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(top_k=1), TypeError, "reads .*top_k"),
        (dict(shared_experts=torch.nn.Identity()), TypeError, "shared_experts"),
    ],
    ids=["routing kwarg", "shared_experts kwarg"],
)
def test_block_options_cannot_be_overridden(kwargs, error, match):
    model = hf_cases.tiny_model("mixtral")
    block = model.get_submodule(hf_cases.moe_block_names(model)[0])
    with pytest.raises(error, match=match):
        hf.EPMoEBlock(block, model.config, **kwargs)


def test_bad_blocks_and_configs_raise_clearly():
    model = hf_cases.tiny_model("mixtral")
    block = model.get_submodule(hf_cases.moe_block_names(model)[0])
    with pytest.raises(TypeError, match="wraps a transformers MoE block"):
        hf.EPMoEBlock(torch.nn.Linear(4, 4), model.config)
    if getattr(block, "config", None) is None:
        with pytest.raises(ValueError, match="pass config=model.config"):
            hf.EPMoEBlock(block)
    bad = copy.deepcopy(model.config)
    bad.hidden_act = "gelu_pytorch_tanh"
    with pytest.raises(ValueError, match="hidden_act='gelu_pytorch_tanh'"):
        hf.EPMoEBlock(block, bad)
    bad = copy.deepcopy(model.config)
    bad.num_experts_per_tok = 3
    with pytest.raises(ValueError, match="num_experts_per_tok=3"):
        hf.EPMoEBlock(block, bad)
    meta = copy.deepcopy(block).to("meta")
    with pytest.raises(ValueError, match="meta device"):
        hf.EPMoEBlock(meta, model.config)


def test_import_is_lazy_and_missing_transformers_is_explained():
    code = (
        "import sys, epmoe.integrations.huggingface as h\n"
        "assert 'transformers' not in sys.modules, 'imported transformers'\n"
        "sys.modules['transformers'] = None\n"
        "try:\n"
        "    h.replace_moe_blocks(None)\n"
        "except ImportError as e:\n"
        "    assert 'epmoe[hf]' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no ImportError')\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr


# ---------------------------------------------------------------------- 2 ranks
@pytest.mark.parametrize("world", [2], ids=["W=2"])
def test_block_across_ranks_matches_hf_on_each_ranks_tokens(world):
    requires_world(world)
    dtype = "bfloat16" if device_under_test() == "cuda" else "float32"
    passed = run_on_ranks(
        hf_cases.check_blocks_match_hf,
        world,
        device_under_test(),
        dtype,
        families=["mixtral", "qwen2_moe", "deepseek_v3"],
    )
    assert passed == [6] * world
