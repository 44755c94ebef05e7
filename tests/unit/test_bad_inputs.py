"""Inputs that used to be accepted silently, or refused with an unclear error, in one process.

Each public function checks its arguments at the boundary and names the argument: routing
(``select_experts``), placement (``ExpertPlacement``), the backends' dispatch and combine
(``check_dispatch_args``, ids out of range), the oracle (``reference.moe``) and the load
recorder (``load_window``). The cross-rank side of the ids check (every rank raises in the
same dispatch) is in ``tests/distributed/test_bad_ids.py``; docs/reliability.md lists
every bad input tried and what happens.
"""

from __future__ import annotations

import re

import pytest
import torch

import epmoe
from epmoe.comm import create_backend
from epmoe.comm.base import CommSpec, Layout, check_dispatch_args
from epmoe.eplb.recorder import LoadRecorder
from epmoe.placement import ExpertPlacement
from epmoe.reference import moe

E, K, H, I = 6, 2, 8, 4
NOT_TENSORS = [pytest.param([[0.5] * E], id="list"), pytest.param(None, id="None")]

# --------------------------------------------------------------------------- routing


@pytest.mark.parametrize("value", ["no", 1, None, 0.0], ids=["'no'", "1", "None", "0.0"])
def test_renormalize_must_be_a_bool(value):
    with pytest.raises(TypeError, match=r"renormalize must be a bool"):
        epmoe.select_experts(torch.randn(3, E), K, renormalize=value)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64])
def test_e_score_correction_bias_must_be_floating(dtype):
    bias = torch.zeros(E).to(dtype)
    with pytest.raises(TypeError, match="e_score_correction_bias must be floating point"):
        epmoe.select_experts(torch.randn(3, E), K, e_score_correction_bias=bias)


@pytest.mark.parametrize("nan_at", [list(range(E)), [3]], ids=["all NaN", "one NaN"])
def test_e_score_correction_bias_with_nan_is_refused(nan_at):
    bias = torch.zeros(E)
    bias[nan_at] = float("nan")
    with pytest.raises(ValueError, match=rf"holds NaN at experts \[{nan_at[0]}"):
        epmoe.select_experts(torch.randn(3, E), K, e_score_correction_bias=bias)


def test_e_score_correction_bias_with_infinities_still_chooses():
    """-inf is a way to switch experts off; only NaN is refused."""
    bias = torch.zeros(E)
    bias[0] = float("-inf")
    _, ids = epmoe.select_experts(torch.randn(5, E), K, e_score_correction_bias=bias)
    assert not (ids == 0).any()


def test_the_layer_keeps_its_own_copy_of_the_bias():
    """The ranks agree on the bias at construction: a later in-place change of the
    caller's tensor must not change this layer's routing behind the agreement."""
    bias = torch.zeros(8)
    layer = epmoe.EPMoE(8, 2, 16, 8, device="cpu", params_dtype=torch.float32,
                        scoring_func="sigmoid", e_score_correction_bias=bias)  # fmt: skip
    bias[0] = 5.0
    assert layer.e_score_correction_bias.tolist() == [0.0] * 8


def test_routing_arguments_that_are_not_tensors_name_the_argument():
    with pytest.raises(TypeError, match="router_logits must be a torch.Tensor, got list"):
        epmoe.select_experts([[0.0] * E], K)
    with pytest.raises(TypeError, match="router_logits must be a torch.Tensor, got NoneType"):
        epmoe.select_experts(None, K)
    with pytest.raises(TypeError, match="e_score_correction_bias must be a torch.Tensor.*list"):
        epmoe.select_experts(torch.randn(3, E), K, e_score_correction_bias=[0.0] * E)
    with pytest.raises(TypeError, match="custom_routing_function must be callable"):
        epmoe.select_experts(torch.randn(3, E), K, custom_routing_function="softmax")


def test_layer_construction_checks_the_routing_options():
    """EPMoE runs select_experts on 0 tokens at construction: the same errors, at once."""
    with pytest.raises(TypeError, match="renormalize must be a bool"):
        epmoe.EPMoE(E, K, H, I, renormalize="no", params_dtype=torch.float32, device="cpu")
    nan_bias = torch.full((E,), float("nan"))
    with pytest.raises(ValueError, match="NaN"):
        epmoe.EPMoE(
            E, K, H, I, e_score_correction_bias=nan_bias, params_dtype=torch.float32, device="cpu"
        )


# ------------------------------------------------------------------ backends' dispatch


def _spec(P: int = 5) -> CommSpec:
    return CommSpec(
        hidden_size=H,
        top_k=K,
        rank_offsets=(0, P),
        max_num_tokens=16,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


BACKENDS = [
    pytest.param("naive", Layout.STANDARD, id="naive"),
    pytest.param("all_to_all", Layout.STANDARD, id="all_to_all standard"),
    pytest.param("all_to_all", Layout.EXPERT_BATCHED, id="all_to_all expert_batched"),
]


def _args(T: int = 4):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(T, H, generator=g),
        torch.randint(0, 5, (T, K), generator=g),
        torch.rand(T, K, generator=g),
    )


@pytest.mark.parametrize("which", [0, 1, 2], ids=["hidden_states", "topk_ids", "topk_weights"])
@pytest.mark.parametrize("value", NOT_TENSORS)
def test_dispatch_arguments_that_are_not_tensors_name_the_argument(which, value):
    args = list(_args())
    args[which] = value
    name = ["hidden_states", "topk_ids", "topk_weights"][which]
    with pytest.raises(
        TypeError, match=f"{name} must be a torch.Tensor, got {type(value).__name__}"
    ):
        check_dispatch_args(_spec(), *args, limit_tokens=False)


def test_dispatch_refuses_integer_router_weights():
    x, ids, w = _args()
    with pytest.raises(TypeError, match="topk_weights must be floating point"):
        check_dispatch_args(_spec(), x, ids, (w * 4).long(), limit_tokens=False)


@pytest.mark.parametrize("name, layout", BACKENDS)
@pytest.mark.parametrize(
    "bad, lo, hi",
    [(-2, -2, 4), (5, -1, 5), (10**12, -1, 10**12)],
    ids=["id -2", "id == P", "id huge"],
)
def test_ids_out_of_range_raise_the_same_error_in_every_backend(name, layout, bad, lo, hi):
    """Ids below -1 are not "no expert" and ids >= P are not dropped: naive and all_to_all
    (both layouts) refuse them alike, naming the rank and the range, before any row moves."""
    comm = create_backend(name, _spec(P=5), None, layout)
    x, ids, w = _args()
    ids[1, 0] = bad
    ids[0, 1] = 4 if bad < 0 else 0  # the other end of the range, for the message
    ids[2:] = torch.tensor([-1, 3])
    want = (
        f"{name} dispatch: topk_ids on rank(s) [0] hold ids outside [-1, P=5) (this rank's "
        f"ids lie in [{lo}, {hi}]); pass physical expert ids in [0, 5)"
    )
    with pytest.raises(ValueError, match=re.escape(want)):
        comm.dispatch(x, ids, w)
    ids[1, 0] = -1  # -1 and ids in [0, P) go through
    assert comm.dispatch(x, ids, w).hidden.shape[-1] == H


@pytest.mark.parametrize("name, layout", BACKENDS)
def test_combine_arguments_that_are_not_tensors_name_the_argument(name, layout):
    comm = create_backend(name, _spec(), None, layout)
    result = comm.dispatch(*_args())
    with pytest.raises(TypeError, match="expert_out must be a torch.Tensor, got list"):
        comm.combine(result.hidden.tolist(), result)
    with pytest.raises(TypeError, match="result must be the DispatchResult.*NoneType"):
        comm.combine(result.hidden, None)


# --------------------------------------------------------------------------- placement


@pytest.mark.parametrize(
    "value, kind",
    [(None, "NoneType"), ("hot", "str"), ({0: 1.0}, "dict")],
    ids=["None", "str", "dict"],
)
def test_expert_load_that_is_not_numbers_names_the_argument(value, kind):
    with pytest.raises(TypeError, match=f"expert_load must be a tensor or a sequence.*{kind}"):
        ExpertPlacement.balanced(value, ep_size=2)
    with pytest.raises(TypeError, match=f"expert_load_LE must be a tensor.*{kind}"):
        ExpertPlacement.balanced_layers(value, ep_size=2)
    with pytest.raises(TypeError, match=f"expert_load_E must be a tensor.*{kind}"):
        ExpertPlacement.linear(E, 2).rank_load(value)


def test_expert_load_as_a_list_is_still_accepted():
    p = ExpertPlacement.balanced([1.0, 2, 3, 4, 5, 6], ep_size=2)
    assert p.num_physical == E and p.rank_load([1] * E).tolist() == [3.0, 3.0]


@pytest.mark.parametrize(
    "load, error, match",
    [
        (torch.tensor([1.0, float("nan"), 1, 1, 1, 1]), ValueError, r"expert_load\[1\] = nan"),
        (torch.tensor([1.0, 1, -3, 1, 1, 1]), ValueError, r"expert_load\[2\] = -3.0"),
        (torch.tensor([1.0, 1, 1, float("inf"), 1, 1]), ValueError, r"expert_load\[3\] = inf"),
        (torch.ones(E, dtype=torch.complex64), TypeError, "real numbers"),
        (torch.ones(E, dtype=torch.bool), TypeError, "real numbers"),
    ],
    ids=["NaN", "negative", "inf", "complex", "bool"],
)
def test_expert_load_values_are_checked(load, error, match):
    with pytest.raises(error, match=match):
        ExpertPlacement.balanced(load, ep_size=2)


def test_placement_arguments_that_are_not_placements_or_ids():
    p = ExpertPlacement.linear(E, 2)
    with pytest.raises(TypeError, match="current must be an ExpertPlacement or None, got list"):
        ExpertPlacement.balanced(torch.ones(E), ep_size=2, current=[p])
    with pytest.raises(TypeError, match=r"current\[0\] must be an ExpertPlacement, got str"):
        ExpertPlacement.balanced_layers(torch.ones(1, E), ep_size=2, current=["linear"])
    with pytest.raises(TypeError, match="topk_ids must be a torch.Tensor, got list"):
        p.to_physical([[0, 1]])
    with pytest.raises(TypeError, match="other must be an ExpertPlacement, got NoneType"):
        p.moved_slots(None)
    with pytest.raises(TypeError, match="physical_to_logical must be a tensor.*NoneType"):
        ExpertPlacement(E, 2, None, (0, 3, 6))
    with pytest.raises(TypeError, match="physical_to_logical must be a tensor.*str"):
        ExpertPlacement.from_physical_to_logical("012345", 2)
    with pytest.raises(TypeError, match="physical_to_logical must hold integer ids"):
        ExpertPlacement.from_physical_to_logical(torch.arange(6.0), 2)


# -------------------------------------------------------------------------- the oracle


def _moe_args():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, H, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    w, ids = epmoe.select_experts(torch.randn(3, E, generator=g), K)
    return dict(hidden_states=x, w13=w13, w2=w2, topk_weights=w, topk_ids=ids)


@pytest.mark.parametrize("name", ["hidden_states", "w13", "w2", "topk_weights", "topk_ids"])
@pytest.mark.parametrize("value", NOT_TENSORS)
def test_oracle_arguments_that_are_not_tensors_name_the_argument(name, value):
    args = _moe_args()
    args[name] = value
    with pytest.raises(
        TypeError, match=f"{name} must be a torch.Tensor, got {type(value).__name__}"
    ):
        moe(**args)


@pytest.mark.parametrize("name", ["w13", "w2"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
def test_oracle_refuses_weights_that_are_not_floating(name, dtype):
    args = _moe_args()
    args[name] = args[name].to(dtype)
    with pytest.raises(TypeError, match=f"{name} must be floating point"):
        moe(**args)


def test_oracle_checks_compute_dtype_and_scales():
    with pytest.raises(TypeError, match="compute_dtype must be a floating torch.dtype"):
        moe(**_moe_args(), compute_dtype="float64")
    with pytest.raises(TypeError, match="w13_scale must be a tensor of scales"):
        moe(**_moe_args(), w13_scale=[1.0])


# ------------------------------------------------------------------------ load recorder


@pytest.mark.parametrize("window", [2.5, True, "4", None], ids=["2.5", "True", "'4'", "None"])
def test_load_window_must_be_an_int(window):
    with pytest.raises(TypeError, match="load_window"):
        LoadRecorder(E, window, "cpu")
    if window is not None:  # None means "no recorder" to the layer
        with pytest.raises(TypeError, match="load_window"):
            epmoe.EPMoE(E, K, H, I, load_window=window, params_dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("window", [0, -3])
def test_load_window_must_be_positive(window):
    with pytest.raises(ValueError, match="load_window.*positive"):
        LoadRecorder(E, window, "cpu")


# ---------------------------------------------------------------- EPMoE's own arguments


def _layer(**kwargs):
    kwargs.setdefault("params_dtype", torch.float32)
    return epmoe.EPMoE(8, 2, 16, 8, device="cpu", **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(max_num_tokens=True), ValueError, "max_num_tokens"),
        (dict(prefer_local_replica="no"), TypeError, "prefer_local_replica"),
        (dict(apply_router_weight_on_input="yes"), TypeError, "apply_router_weight_on_input"),
        (dict(params_dtype="bf16"), TypeError, "params_dtype"),
        (dict(shared_experts=3), TypeError, "shared_experts"),
        (dict(e_score_correction_bias=torch.arange(8)), TypeError, "e_score_correction_bias"),
        (dict(e_score_correction_bias=[0.0] * 8), TypeError, "e_score_correction_bias"),
        (
            dict(e_score_correction_bias=torch.full((8,), float("nan"))),
            ValueError,
            "e_score_correction_bias holds NaN",
        ),
    ],
    ids=["max_num_tokens=True", "prefer_local 'no'", "weight_on_input 'yes'", "dtype str",
         "shared_experts=3", "int bias", "list bias", "NaN bias"],
)  # fmt: skip
def test_epmoe_refuses_unclear_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        _layer(**kwargs)


@pytest.mark.parametrize(
    "w13",
    [torch.ones(8, 16, 16, dtype=torch.int64), torch.ones(8, 16, 16, dtype=torch.bool),
     torch.ones(8, 16, 16, dtype=torch.complex64), [[0.0]]],
    ids=["int", "bool", "complex", "list"],
)  # fmt: skip
def test_load_experts_refuses_weights_it_would_cast_silently(w13):
    layer = _layer()
    with pytest.raises(TypeError, match="load_experts: w13"):
        layer.load_experts(w13, torch.ones(8, 16, 8))


@pytest.mark.parametrize("expert_id", [1.0, True, torch.tensor(1)], ids=["float", "bool", "tensor"])
def test_load_expert_wants_an_int_id_and_floating_weights(expert_id):
    layer = _layer()
    with pytest.raises(TypeError, match="expert_id must be an int"):
        layer.load_expert(expert_id, torch.ones(16, 16), torch.ones(16, 8))
    with pytest.raises(TypeError, match="load_expert: w2_e must be floating point"):
        layer.load_expert(1, torch.ones(16, 16), torch.ones(16, 8, dtype=torch.int32))


def test_batched_hidden_states_are_refused_with_the_flattening_fix():
    layer = _layer()
    layer.load_experts(torch.ones(8, 16, 16) / 16, torch.ones(8, 16, 8) / 8)
    with pytest.raises(ValueError, match=re.escape(
        "got (2, 3, 16); flatten the leading dims (hidden_states.reshape(-1, 16), "
        "router_logits.reshape(-1, 8)) and reshape the output back"
    )):  # fmt: skip
        layer(torch.ones(2, 3, 16), torch.ones(2, 3, 8))
    with pytest.raises(ValueError, match=r"must be \[T, 16\], got \(3, 12\)$"):
        layer(torch.ones(3, 12), torch.ones(3, 8))
