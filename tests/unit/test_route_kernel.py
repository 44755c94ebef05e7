"""``kernels.route.fused_route`` against ``select_experts`` + ``ExpertPlacement.to_physical``
(the torch path it replaces in the layer), option by option: scoring, bias, grouped top-k,
renormalization, scaling, replicated placements with and without ``prefer_local``, odd
expert counts, T = 0 and 1. On CPU under the Triton interpreter (tests/conftest.py).

Shape legend: T tokens · E experts · K top-k · G expert groups · W ranks.
"""

from __future__ import annotations

import pytest
import torch

from epmoe.placement import ExpertPlacement
from epmoe.routing import select_experts

route = pytest.importorskip("epmoe.kernels.route", reason="needs triton")
ops = pytest.importorskip("epmoe.kernels.ops", reason="needs triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not ops.interpreted():
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)


def _logits(T: int, E: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Distinct scores per row (exact ties would let either path pick either expert)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randperm(E, generator=g).float()[None].repeat(T, 1)
    noise = torch.rand(T, E, generator=g)
    return ((base + noise * 0.5) / E * 6 - 3).to(dtype).to(DEVICE)


def _placement(E: int, W: int, redundant: int) -> ExpertPlacement:
    if redundant == 0:
        return ExpertPlacement.linear(E, W)
    load = torch.arange(E, 0, -1, dtype=torch.float64) ** 2  # hot experts get replicas
    return ExpertPlacement.balanced(load, W, num_redundant=redundant)


def _check(logits, K, placement, rank=0, prefer_local=False, **routing):
    maps = placement.maps_on(logits.device)
    w, logical, phys = route.fused_route(
        logits, K, maps, rank=rank, prefer_local=prefer_local, **routing
    )
    w_ref, ids_ref = select_experts(logits, K, **routing)
    phys_ref = placement.to_physical(ids_ref, rank=rank, prefer_local=prefer_local)
    assert w.dtype == torch.float32 and logical.dtype == phys.dtype == torch.int64
    assert logical.shape == phys.shape == w.shape == (logits.shape[0], K)
    assert torch.equal(logical.cpu(), ids_ref.cpu())
    assert torch.equal(phys.cpu(), phys_ref.cpu())
    torch.testing.assert_close(w.cpu(), w_ref.cpu(), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("E, K", [(8, 2), (60, 4), (128, 8), (5, 5)])
def test_top_k_of_softmax_and_sigmoid_scores(scoring_func, renormalize, E, K):
    _check(
        _logits(37, E, seed=E + K), K, ExpertPlacement.linear(E, 1),
        renormalize=renormalize, scoring_func=scoring_func,
    )  # fmt: skip


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "E, G, topk_group, K",
    [(64, 8, 4, 8), (64, 8, 8, 8), (64, 4, 1, 2), (16, 16, 6, 5), (15, 3, 2, 4), (15, 5, 2, 3)],
)
def test_grouped_top_k_with_and_without_a_bias(bias, E, G, topk_group, K):
    """DeepSeek-V3's gate (sigmoid, bias, 8 groups of which 4 kept, scaled by 2.5) and
    variants: every group kept, one group, groups of one expert each, and group counts
    and sizes that are not powers of two (the kernel's padded lanes)."""
    gen = torch.Generator().manual_seed(G * 10 + topk_group)
    b = (torch.rand(E, generator=gen) * 0.2).to(DEVICE) if bias else None
    _check(
        _logits(29, E, seed=G + K), K, ExpertPlacement.linear(E, 2),
        scoring_func="sigmoid", num_expert_group=G, topk_group=topk_group,
        e_score_correction_bias=b, routed_scaling_factor=2.5,
    )  # fmt: skip


@pytest.mark.parametrize("prefer_local", [False, True])
@pytest.mark.parametrize("rank", [0, 3])
def test_replicated_experts_map_to_the_replica_the_placement_picks(prefer_local, rank):
    """EPLB placements with redundant replicas (up to several per hot expert): the replica
    of entry (t, k) on ``rank`` is the torch path's, with and without a local preference."""
    placement = _placement(32, 4, redundant=8)
    assert placement.maps_on(DEVICE).max_replicas > 1
    _check(_logits(45, 32, seed=rank), 6, placement, rank=rank, prefer_local=prefer_local)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_logits_of_any_float_dtype_and_strided_rows(dtype):
    logits = _logits(16, 40, seed=3, dtype=dtype)
    _check(logits, 3, ExpertPlacement.round_robin(40, 2), rank=1)
    wide = torch.zeros(16, 48, dtype=dtype, device=DEVICE)
    wide[:, :40] = logits  # rows 48 apart
    _check(wide[:, :40], 3, ExpertPlacement.round_robin(40, 2), rank=1)


@pytest.mark.parametrize("T", [0, 1])
def test_no_token_and_one_token(T):
    _check(_logits(T, 16, seed=T), 4, ExpertPlacement.linear(16, 2))


def test_a_nan_score_is_chosen_first_and_every_id_stays_in_range():
    """As ``torch.topk`` ranks NaN above every number; the ids of a row of NaN are still
    experts (the layer must never send a row to an id outside the placement)."""
    logits = _logits(4, 16, seed=1)
    logits[0, 5] = float("nan")
    logits[1] = float("nan")
    maps = ExpertPlacement.linear(16, 2).maps_on(DEVICE)
    w, logical, phys = route.fused_route(logits, 4, maps, scoring_func="sigmoid")
    assert int(logical[0, 0]) == 5 and torch.isnan(w[0]).all()  # renormalized by a NaN sum
    assert ((logical >= 0) & (logical < 16)).all() and ((phys >= 0) & (phys < 16)).all()
    assert len(set(logical[1].tolist())) == 4  # still K distinct experts
    _, ref = select_experts(logits[2:], 4, scoring_func="sigmoid")
    assert torch.equal(logical[2:].cpu(), ref.cpu())  # the other rows are untouched


@pytest.mark.parametrize("hint", [None, 12])
def test_the_layer_on_the_fused_kernel_equals_the_layer_on_torch_routing(monkeypatch, hint):
    """``EPMoE`` takes the kernel on CUDA (and here under the interpreter too), the torch
    path elsewhere: the output, the router weights and the physical ids equal the torch path's,
    with a bias, grouped top-k, scaling and an EPLB placement with replicas, with and
    without ``max_tokens_across_ranks`` (the graph-safe path and the agreeing one)."""
    import epmoe

    E, K, H, I, T = 16, 4, 32, 24, 12
    gen = torch.Generator().manual_seed(0)
    placement = ExpertPlacement.balanced(
        torch.arange(E, 0, -1, dtype=torch.float64) ** 2, 1, num_redundant=4
    )
    layer = epmoe.EPMoE(
        E, K, H, I, placement=placement, params_dtype=torch.float32, device=DEVICE,
        scoring_func="sigmoid", num_expert_group=4, topk_group=2, routed_scaling_factor=1.5,
        e_score_correction_bias=torch.rand(E, generator=gen) * 0.1, experts="torch",
    )  # fmt: skip
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen)
    layer.load_experts(w13.to(DEVICE), w2.to(DEVICE))
    x, logits = torch.randn(T, H, generator=gen).to(DEVICE), _logits(T, E, seed=7)
    kwargs = {} if hint is None else dict(max_tokens_across_ranks=hint)
    with torch.no_grad():
        monkeypatch.setattr(type(layer), "_fused_routing", lambda self, logits: False)
        ref_out, (ref_w, ref_ids) = layer(x, logits, **kwargs), layer.route(logits)
        monkeypatch.setattr(type(layer), "_fused_routing", lambda self, logits: True)
        out, (w, ids) = layer(x, logits, **kwargs), layer.route(logits)
    assert torch.equal(ids, ref_ids) and ids.dtype == torch.int64
    torch.testing.assert_close(w, ref_w, rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)


def test_epmoe_fused_routing_must_be_0_or_1(monkeypatch):
    from epmoe.routing import fused_routing_enabled

    monkeypatch.setenv("EPMOE_FUSED_ROUTING", "0")
    assert not fused_routing_enabled()
    monkeypatch.setenv("EPMOE_FUSED_ROUTING", "yes")
    with pytest.raises(ValueError, match="EPMOE_FUSED_ROUTING must be 0 or 1"):
        fused_routing_enabled()


def test_a_strided_bias_and_minus_infinity_scores():
    """A bias that is a strided view (read as its values, not its storage), a bias of -inf
    that switches experts and a whole group off, and -inf logits under softmax."""
    E, K = 32, 4
    placement = ExpertPlacement.linear(E, 2)
    strided = torch.rand(E, 2, generator=torch.Generator().manual_seed(5)).to(DEVICE)[:, 0]
    assert not strided.is_contiguous()
    logits = _logits(24, E, seed=5)
    _check(logits, K, placement, scoring_func="sigmoid", e_score_correction_bias=strided)
    off = strided.clone()
    off[[3, 9, 17]] = float("-inf")
    off[8:16] = float("-inf")  # group 1 of 4
    _check(
        logits, K, placement, scoring_func="sigmoid", e_score_correction_bias=off,
        num_expert_group=4, topk_group=2,
    )  # fmt: skip
    masked = logits.clone()
    masked[:, ::3] = float("-inf")
    _check(masked, K, placement)


def test_a_nan_in_a_group_ranks_that_group_and_expert_first():
    """torch ranks a NaN group score (here inf + -inf: a NaN expert beside experts a -inf
    bias switched off) above every group, and the NaN expert first."""
    E, K = 16, 2
    bias = torch.zeros(E, device=DEVICE)
    bias[4:8] = float("-inf")
    logits = _logits(3, E, seed=2)
    logits[0, 5] = float("nan")
    maps = ExpertPlacement.linear(E, 1).maps_on(DEVICE)
    options = dict(scoring_func="sigmoid", num_expert_group=4, topk_group=1)
    _, logical, _ = route.fused_route(logits, K, maps, e_score_correction_bias=bias, **options)
    _, ref = select_experts(logits, K, e_score_correction_bias=bias, **options)
    assert int(logical[0, 0]) == int(ref[0, 0]) == 5
    assert torch.equal(logical[1:].cpu(), ref[1:].cpu())


def test_with_bf16_logits_and_their_ties_the_choice_is_a_top_k_of_the_scores():
    """bf16 logits tie often; the kernel breaks ties toward the lower id, torch.topk in no
    promised order. Either way the chosen experts must be a top-k: no expert left out
    scores above one chosen, and each weight is its expert's renormalized score."""
    E, K, T = 128, 8, 64
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(T, E, generator=gen) * 0.5).to(torch.bfloat16).to(DEVICE)
    ranked = logits.float().sort(1, descending=True).values
    assert int((ranked[:, K - 1] == ranked[:, K]).sum()) >= 3  # ties across the cut (4 here)
    maps = ExpertPlacement.linear(E, 1).maps_on(DEVICE)
    w, logical, _ = route.fused_route(logits, K, maps)
    scores = torch.softmax(logits.float(), -1).cpu()
    logical, w = logical.cpu(), w.cpu()
    chosen = scores.gather(1, logical)
    left = scores.scatter(1, logical, float("-inf"))
    assert (chosen.min(1).values >= left.max(1).values).all()
    assert (logical.sort(1).values.diff(1) > 0).all()  # K distinct experts
    torch.testing.assert_close(w, chosen / chosen.sum(1, keepdim=True), rtol=2e-6, atol=1e-7)


def test_top_k_outside_one_to_e_a_bias_of_the_wrong_shape_and_maps_elsewhere_are_refused():
    maps = ExpertPlacement.linear(4, 1).maps_on(DEVICE)
    logits = _logits(2, 4, seed=0)
    with pytest.raises(ValueError, match=r"top_k=5 must lie in \[1, E=4\]"):
        route.fused_route(logits, 5, maps)
    with pytest.raises(ValueError, match=r"e_score_correction_bias must be \[E=4\]"):
        route.fused_route(logits, 2, maps, e_score_correction_bias=torch.zeros(3))
    # the launch passes bare addresses: maps on another device than the logits are refused
    with pytest.raises(ValueError, match=r"maps are on meta but router_logits_TE on .*maps_on"):
        route.fused_route(logits, 2, ExpertPlacement.linear(4, 1).maps_on("meta"))


def test_the_layer_takes_the_kernel_only_for_built_in_routing_on_its_own_cuda_device(
    monkeypatch,
):
    """The CPU, a custom routing function, ``EPMOE_FUSED_ROUTING=0``, and logits on
    another device than the layer's (its maps and bias are there) take the torch path."""
    import epmoe

    layer = epmoe.EPMoE(8, 2, 16, 8, params_dtype=torch.float32, device=DEVICE)
    logits = _logits(3, 8, seed=0)
    assert layer._fused_routing(logits) == (DEVICE == "cuda")
    assert not layer._fused_routing(logits.cpu()) or DEVICE == "cpu"
    monkeypatch.setenv("EPMOE_FUSED_ROUTING", "0")
    assert not layer._fused_routing(logits)
    monkeypatch.delenv("EPMOE_FUSED_ROUTING")
    custom = epmoe.EPMoE(
        8, 2, 16, 8, params_dtype=torch.float32, device=DEVICE,
        custom_routing_function=lambda x, k, r: select_experts(x, k, r),
    )  # fmt: skip
    assert not custom._fused_routing(logits)
    if DEVICE == "cuda":  # another device's logits: routed by torch, as before
        w, ids = layer.route(logits.cpu())
        ref_w, ref_ids = layer.route(logits)
        assert torch.equal(ids.cpu(), ref_ids.cpu())
