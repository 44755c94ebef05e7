"""``epmoe.checkpoint`` in one process: an EPMoE state dict records its placement and rank,
a load checks the record (strict or not) and marks the weights loaded, and full logical
experts move between placements. Records of other ranks and world sizes are built with
``placement_record``; the multi-rank cases are in ``tests/distributed/test_checkpoint.py``.
"""

from __future__ import annotations

import io

import pytest
import torch

import epmoe
from epmoe.checkpoint import (
    RECORD_KEYS,
    gather_full_experts,
    load_full_experts,
    placement_record,
    placement_summary,
)
from epmoe.reference import assert_close

E, K, H, I = 8, 2, 16, 8


def weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, H, generator=g) / 4, torch.randn(E, H, I, generator=g) / 3


def make_layer(placement="linear", load=True, **kwargs):
    layer = epmoe.EPMoE(E, K, H, I, placement=placement, params_dtype=torch.float32,
                        device="cpu", experts="torch", **kwargs)  # fmt: skip
    w13, w2 = weights()
    if load:
        layer.load_experts(w13, w2)
    return layer, w13, w2


def balanced(num_redundant: int = 2) -> epmoe.ExpertPlacement:
    load = torch.arange(1, E + 1, dtype=torch.float64) ** 2  # the last experts get replicas
    return epmoe.ExpertPlacement.balanced(load, ep_size=1, num_redundant=num_redundant)


def assert_matches_oracle(layer, w13, w2, T: int = 9):
    g = torch.Generator().manual_seed(3)
    x, logits = torch.randn(T, H, generator=g), torch.randn(T, E, generator=g)
    ref = epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, K))
    assert_close(layer(x, logits), ref, 1e-5)


def load_error(module, state, strict=True) -> str:
    with pytest.raises(RuntimeError) as info:
        module.load_state_dict(state, strict=strict)
    return str(info.value)


# ---------------------------------------------------------------------- the record
def test_state_dict_records_placement_and_rank():
    layer, *_ = make_layer(balanced())
    state = layer.state_dict()
    assert list(state) == ["w13", "w2", *RECORD_KEYS]
    p = layer.placement
    assert state["w13"].shape == (p.num_physical, 2 * I, H)  # the shard, replicas included
    assert torch.equal(state["placement.physical_to_logical"], p.physical_to_logical)
    assert state["placement.rank_offsets"].tolist() == list(p.rank_offsets)
    assert state["placement.rank"].dtype == torch.int64 and int(state["placement.rank"]) == 0


@pytest.mark.parametrize("fmt", ["torch.save", "safetensors"])
def test_round_trip_through_a_file_marks_loaded_and_matches_oracle(fmt, tmp_path):
    layer, w13, w2 = make_layer(balanced())
    if fmt == "torch.save":
        buffer = io.BytesIO()
        torch.save(layer.state_dict(), buffer)
        buffer.seek(0)
        state = torch.load(buffer, weights_only=True)
    else:
        safetensors = pytest.importorskip("safetensors.torch")
        path = str(tmp_path / "shard.safetensors")
        safetensors.save_file(layer.state_dict(), path)
        state = safetensors.load_file(path)
    fresh, *_ = make_layer(balanced(), load=False)
    assert not fresh.weights_loaded
    result = fresh.load_state_dict(state)
    assert not result.missing_keys and not result.unexpected_keys
    assert fresh.weights_loaded  # the forward runs: no "expert weights are not loaded"
    assert torch.equal(fresh.w13, layer.w13) and torch.equal(fresh.w2, layer.w2)
    assert_matches_oracle(fresh, w13, w2)


def test_a_nested_layer_saves_and_loads_under_its_prefix():
    model = torch.nn.Sequential(torch.nn.Linear(H, H), make_layer()[0])
    state = model.state_dict()
    assert {f"1.{k}" for k in RECORD_KEYS} <= set(state)
    fresh = torch.nn.Sequential(torch.nn.Linear(H, H), make_layer(load=False)[0])
    fresh.load_state_dict(state)
    assert fresh[1].weights_loaded


def test_the_record_follows_a_rebalance():
    layer, w13, w2 = make_layer()
    layer.rebalance(balanced())
    state = layer.state_dict()
    assert torch.equal(state["placement.physical_to_logical"], balanced().physical_to_logical)
    error = load_error(make_layer(load=False)[0], state)
    assert "custom placement with 10 slots" in error and "'linear' placement" in error
    fresh, *_ = make_layer(balanced(), load=False)
    fresh.load_state_dict(state)
    assert_matches_oracle(fresh, w13, w2)


def test_the_same_experts_in_another_placement_load():
    """W = 1: linear and round-robin hold the same experts in the same slots."""
    state = make_layer("linear")[0].state_dict()
    fresh, w13, w2 = make_layer("round_robin", load=False)
    fresh.load_state_dict(state)
    assert_matches_oracle(fresh, w13, w2)


# ---------------------------------------------------------------------- refusals
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
def test_another_ranks_shard_is_refused_and_nothing_is_copied(strict):
    """Rank 1's file of a W=2 linear layer (experts 4..7) in this rank's layer."""
    layer, *_ = make_layer()
    state = {
        "w13": torch.zeros(E, 2 * I, H),  # the right shape, so only the record can tell
        "w2": torch.zeros(E, H, I),
        **placement_record(epmoe.ExpertPlacement.linear(E, 2), rank=1),
    }
    before = layer.w13.clone()
    error = load_error(layer, state, strict=strict)
    assert "saved by rank 1 of a 'linear' placement (E=8, W=2)" in error, error
    assert "slots hold experts [4, 5, 6, 7]" in error, error
    assert "this layer is rank 0 of a 'linear' placement (E=8, W=1)" in error, error
    assert "epmoe.checkpoint.load_full_experts" in error, error
    assert torch.equal(layer.w13, before), "a refused shard must not be copied"


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
def test_a_shard_of_another_placement_is_refused(strict):
    state = make_layer("linear")[0].state_dict()
    fresh, *_ = make_layer(balanced(), load=False)
    error = load_error(fresh, state, strict=strict)
    assert "'linear' placement (E=8, W=1)" in error and "custom placement" in error, error
    assert not fresh.weights_loaded


def test_another_number_of_experts_is_refused():
    state = make_layer()[0].state_dict()
    record = placement_record(epmoe.ExpertPlacement.linear(2 * E, 2), rank=0)  # 0..7 of 16
    error = load_error(make_layer(load=False)[0], {**state, **record})
    assert "E=16, W=2" in error, error


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
def test_expert_weights_without_a_record_are_refused(strict):
    state = {k: v for k, v in make_layer()[0].state_dict().items() if k not in RECORD_KEYS}
    layer, w13, w2 = make_layer(load=False)
    error = load_error(layer, state, strict=strict)
    assert "no placement record" in error and "placement_record(placement, rank" in error
    assert not layer.weights_loaded
    # who knows the placement it was saved under adds the record; the load is then checked
    state.update(placement_record(epmoe.ExpertPlacement.linear(E, 1), rank=0))
    layer.load_state_dict(state, strict=strict)
    assert_matches_oracle(layer, w13, w2)


def test_a_partial_load_without_expert_weights_leaves_the_layer_alone():
    model = torch.nn.Sequential(torch.nn.Linear(H, H), make_layer(load=False)[0])
    result = model.load_state_dict({"0.weight": torch.ones(H, H)}, strict=False)
    assert "1.w13" in result.missing_keys and not model[1].weights_loaded
    layer, *_ = make_layer()
    layer.load_state_dict({}, strict=False)
    assert layer.weights_loaded  # loaded before, untouched


def test_expert_weights_on_the_meta_device_are_never_taken_as_loaded():
    """A layer built with its parameters on meta (``init_empty_weights()``): a copy into
    them does nothing, so every load that copies says how to give them storage, the forward
    refuses the layer, and ``assign=True`` or ``to_empty`` then load it for real."""
    from epmoe.integrations.huggingface import _parameters_on_meta

    saved, w13, w2 = make_layer()
    state = saved.state_dict()

    def on_meta():
        with _parameters_on_meta():
            layer = make_layer(load=False)[0]
        assert layer.meta_slot_tensors() == ["w13", "w2"] and not layer.weights_loaded
        return layer

    layer = on_meta()
    for load in (
        lambda: layer.load_experts(w13, w2),
        lambda: layer.load_expert(0, w13[0], w2[0]),
    ):
        with pytest.raises(ValueError, match=r"on the meta device .*layer.to_empty"):
            load()
    assert "assign=True" in load_error(layer, state)
    with pytest.raises(ValueError, match=r"EPMoE.forward: .*\['w13', 'w2'\] are on the meta"):
        layer(torch.zeros(2, H), torch.zeros(2, E))
    assert not layer.weights_loaded

    layer.load_state_dict(state, assign=True)
    assert layer.weights_loaded and layer.w13.device.type == "cpu"
    assert_matches_oracle(layer, w13, w2)

    layer = on_meta().to_empty(device="cpu")
    assert not layer.weights_loaded  # storage, but not the weights yet
    layer.load_experts(w13, w2)
    assert_matches_oracle(layer, w13, w2)

    # to_empty of a loaded layer (from a parent module too) drops its weights' values: it
    # is no longer loaded (it said it was, and its forward returned whatever memory held)
    torch.nn.Sequential(layer).to_empty(device="cpu")
    assert not layer.weights_loaded
    with pytest.raises(RuntimeError, match="expert weights are not loaded"):
        layer(torch.zeros(2, H), torch.zeros(2, E))
    layer.load_experts(w13, w2)
    assert_matches_oracle(layer, w13, w2)


def test_a_malformed_record_is_refused():
    state = make_layer()[0].state_dict()
    state["placement.rank"] = torch.tensor(3)  # W = 1 has no rank 3
    assert "placement record is malformed" in load_error(make_layer(load=False)[0], state)
    state = make_layer()[0].state_dict()
    del state["placement.rank_offsets"]
    assert "placement.rank_offsets" in load_error(make_layer(load=False)[0], state)


def test_placement_summary():
    assert placement_summary(epmoe.ExpertPlacement.linear(8, 2)) == "'linear' placement (E=8, W=2)"
    assert "round_robin" in placement_summary(epmoe.ExpertPlacement.round_robin(8, 3))
    assert "custom placement with 10 slots" in placement_summary(balanced())


def test_placement_record_checks_its_arguments():
    with pytest.raises(TypeError, match="ExpertPlacement"):
        placement_record("linear", 0)
    with pytest.raises(ValueError, match="rank"):
        placement_record(epmoe.ExpertPlacement.linear(E, 2), rank=2)
    record = placement_record(epmoe.ExpertPlacement.linear(E, 2), 1, prefix="mlp.moe.")
    assert sorted(record) == sorted(f"mlp.moe.{k}" for k in RECORD_KEYS)


# ---------------------------------------------------------------------- full experts
@pytest.mark.parametrize("dst", [None, 0], ids=["dst=None", "dst=0"])
def test_full_experts_from_replicas_load_into_another_placement(dst):
    source, w13, w2 = make_layer(balanced(num_redundant=3))
    full = gather_full_experts(source, dst=dst)
    assert sorted(full) == ["w13", "w2"]
    assert torch.equal(full["w13"], w13) and torch.equal(full["w2"], w2)  # one copy each
    target, *_ = make_layer("round_robin", load=False)
    load_full_experts(target, full)
    assert target.weights_loaded
    assert_matches_oracle(target, w13, w2)


def test_full_experts_carry_the_correction_bias():
    bias = torch.linspace(-0.1, 0.1, E)
    options = dict(scoring_func="sigmoid", e_score_correction_bias=bias)
    source, *_ = make_layer(**options)
    full = gather_full_experts(source)
    assert torch.equal(full["e_score_correction_bias"], bias)
    target, *_ = make_layer(balanced(), load=False, **options)
    target.e_score_correction_bias.zero_()
    load_full_experts(target, full)
    assert torch.equal(target.e_score_correction_bias, bias)
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        load_full_experts(make_layer(load=False)[0], full)  # a layer without one


def test_full_experts_errors():
    layer, w13, w2 = make_layer(load=False)
    with pytest.raises(RuntimeError, match="not loaded on this rank"):
        gather_full_experts(layer)
    with pytest.raises(ValueError, match="dst must be None or a rank"):
        gather_full_experts(layer, dst=1)
    with pytest.raises(ValueError, match="wants keys"):
        load_full_experts(layer, {"w13": w13})
    with pytest.raises(ValueError, match="wants keys"):
        load_full_experts(layer, {"w13": w13, "w2": w2, "gate_up_proj": w13})
    with pytest.raises(TypeError, match="mapping"):
        load_full_experts(layer, (w13, w2))
    with pytest.raises(ValueError, match="load_experts wants"):
        load_full_experts(layer, {"w13": w13[:4], "w2": w2[:4]})
