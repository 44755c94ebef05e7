"""Tests of epmoe.routing: select_experts against a brute-force per-token router, the
validation errors, expert_counts and the RoutingSimulator's distributions.

Shape legend: T tokens · E experts · K top-k · G expert groups.
"""

from __future__ import annotations

import math

import pytest
import torch

from epmoe.routing import RoutingSimulator, expert_counts, select_experts

# --------------------------------------------------------------------------------------
# Brute-force reference: one token at a time, plain Python lists, float64.
# --------------------------------------------------------------------------------------


def brute_force_route(
    logits_TE: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
    scoring_func: str = "softmax",
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    bias_E: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[list[list[float]], list[list[int]]]:
    T, E = logits_TE.shape
    bias = [0.0] * E if bias_E is None else [float(b) for b in bias_E]
    all_w, all_ids = [], []
    for t in range(T):
        row = [float(v) for v in logits_TE[t].float()]
        if scoring_func == "softmax":
            m = max(row)
            ex = [math.exp(v - m) for v in row]
            scores = [v / sum(ex) for v in ex]
        else:
            scores = [1.0 / (1.0 + math.exp(-v)) for v in row]
        choice = [s + b for s, b in zip(scores, bias)]
        eligible = list(range(E))
        if num_expert_group is not None:
            n = E // num_expert_group
            group_score = []
            for g in range(num_expert_group):
                members = range(g * n, (g + 1) * n)
                if bias_E is None:
                    group_score.append(max(scores[e] for e in members))
                else:
                    best = sorted((choice[e] for e in members), reverse=True)[:2]
                    group_score.append(sum(best))
            kept = sorted(range(num_expert_group), key=lambda g: -group_score[g])[:topk_group]
            eligible = [e for e in range(E) if e // n in kept]
        ids = sorted(eligible, key=lambda e: -choice[e])[:top_k]
        w = [scores[e] for e in ids]
        if renormalize:
            w = [x / sum(w) for x in w]
        all_w.append([x * routed_scaling_factor for x in w])
        all_ids.append(ids)
    return all_w, all_ids


def _logits(T: int, E: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (2.0 * torch.randn(T, E, generator=g)).to(dtype)


def _bias(E: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 0.3 * torch.randn(E, generator=g)


# (id, E, K, kwargs for select_experts; "bias" is replaced by a random [E] bias)
ROUTING_CASES = [
    ("softmax-renorm", 16, 4, dict(renormalize=True)),
    ("softmax-no-renorm", 16, 4, dict(renormalize=False)),
    ("sigmoid-renorm", 16, 4, dict(scoring_func="sigmoid")),
    ("sigmoid-no-renorm", 16, 3, dict(scoring_func="sigmoid", renormalize=False)),
    ("K=1", 8, 1, dict(renormalize=False)),
    ("K=E", 8, 8, dict()),
    ("prime-E", 7, 3, dict()),
    ("scaling-2.5", 16, 4, dict(routed_scaling_factor=2.5)),
    ("bias-softmax", 16, 4, dict(e_score_correction_bias="bias")),
    ("bias-sigmoid-no-renorm", 16, 4, dict(
        scoring_func="sigmoid", renormalize=False, e_score_correction_bias="bias")),
    ("grouped-softmax", 16, 4, dict(num_expert_group=4, topk_group=2)),
    ("grouped-sigmoid", 16, 4, dict(scoring_func="sigmoid", num_expert_group=8, topk_group=3)),
    ("grouped-topk_group=1", 16, 2, dict(num_expert_group=4, topk_group=1)),
    ("grouped-all-groups-kept", 16, 4, dict(num_expert_group=4, topk_group=4)),
    ("grouped-bias-deepseek-v3", 32, 8, dict(
        scoring_func="sigmoid", num_expert_group=8, topk_group=4,
        e_score_correction_bias="bias", routed_scaling_factor=2.5)),
    ("grouped-bias-group-size-1", 8, 3, dict(
        scoring_func="sigmoid", num_expert_group=8, topk_group=4,
        e_score_correction_bias="bias")),
    ("grouped-K=eligible", 16, 8, dict(num_expert_group=4, topk_group=2)),
]  # fmt: skip


@pytest.mark.parametrize(
    "E, K, kwargs", [c[1:] for c in ROUTING_CASES], ids=[c[0] for c in ROUTING_CASES]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_select_experts_matches_brute_force(E, K, kwargs, dtype):
    T = 24
    logits = _logits(T, E, dtype)
    kwargs = dict(kwargs)
    if kwargs.get("e_score_correction_bias") == "bias":
        kwargs["e_score_correction_bias"] = _bias(E)
    w, ids = select_experts(logits, K, **kwargs)

    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    assert w.shape == (T, K) and ids.shape == (T, K)
    ref_kwargs = {k: v for k, v in kwargs.items() if k != "e_score_correction_bias"}
    ref_w, ref_ids = brute_force_route(
        logits, K, bias_E=kwargs.get("e_score_correction_bias"), **ref_kwargs
    )
    assert ids.tolist() == ref_ids
    torch.testing.assert_close(
        w.double(), torch.tensor(ref_w, dtype=torch.float64), rtol=1e-5, atol=1e-6
    )
    for row in ids.tolist():
        assert len(set(row)) == K, "an expert was chosen twice for one token"
    if kwargs.get("renormalize", True):
        scale = kwargs.get("routed_scaling_factor", 1.0)
        torch.testing.assert_close(w.sum(-1), torch.full((T,), scale), rtol=1e-5, atol=1e-5)


def test_scores_in_float32_whatever_the_logit_dtype():
    logits_bf16 = _logits(32, 16, torch.bfloat16)
    w16, ids16 = select_experts(logits_bf16, 4)
    w32, ids32 = select_experts(logits_bf16.float(), 4)
    assert torch.equal(ids16, ids32)
    assert torch.equal(w16, w32)


def test_bias_changes_the_choice_but_not_the_weights():
    # sigmoid scores ≈ [0.953, 0.881, 0.731, 0.5]; the bias lifts expert 3 to the top.
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0])
    _, ids_plain = select_experts(logits, 2, scoring_func="sigmoid")
    w, ids = select_experts(
        logits, 2, renormalize=False, scoring_func="sigmoid", e_score_correction_bias=bias
    )
    assert ids_plain.tolist() == [[0, 1]]
    assert ids.tolist() == [[3, 0]]
    expected = torch.sigmoid(torch.tensor([[0.0, 3.0]]))  # unbiased scores of 3 and 0
    torch.testing.assert_close(w, expected)


def test_group_selection_restricts_the_choice():
    # Group 0 = experts 0-3 holds the best expert; the 2nd best overall (5) is in group 1.
    logits = torch.tensor([[5.0, 1.0, 0.5, 0.2, 0.0, 4.0, 3.9, 0.1]])
    _, ids_flat = select_experts(logits, 2)
    _, ids_grouped = select_experts(logits, 2, num_expert_group=2, topk_group=1)
    assert ids_flat.tolist() == [[0, 5]]
    assert ids_grouped.tolist() == [[0, 1]]


def test_bias_switches_group_score_to_top2_sum():
    # Sigmoid scores: group 0 = [0.9, ~0, ...], group 1 = [0.8, 0.7, ...].
    # Max per group prefers group 0; sum of the top two (DeepSeek-V3 with a bias) group 1.
    def logit(p: float) -> float:
        return math.log(p / (1 - p))

    probs = [0.9, 0.01, 0.01, 0.01, 0.8, 0.7, 0.01, 0.01]
    logits = torch.tensor([[logit(p) for p in probs]])
    _, ids_max = select_experts(logits, 1, scoring_func="sigmoid", num_expert_group=2, topk_group=1)
    _, ids_sum = select_experts(
        logits,
        1,
        scoring_func="sigmoid",
        num_expert_group=2,
        topk_group=1,
        e_score_correction_bias=torch.zeros(8),
    )
    assert ids_max.tolist() == [[0]]
    assert ids_sum.tolist() == [[4]]


def test_negative_biased_scores_never_pick_an_expert_of_a_dropped_group():
    # Sigmoid scores lie in (0, 1); a bias of -1 makes every biased score negative. Experts
    # of the dropped groups must stay out of reach (masked below any score), not merely
    # below zero, which every eligible expert now is too.
    logits = _logits(16, 8, seed=3)
    bias = torch.full((8,), -1.0)
    kwargs = dict(scoring_func="sigmoid", num_expert_group=4, topk_group=1)
    w, ids = select_experts(logits, 2, e_score_correction_bias=bias, **kwargs)
    ref_w, ref_ids = brute_force_route(logits, 2, bias_E=bias, **kwargs)
    assert ids.tolist() == ref_ids
    assert all(row[0] // 2 == row[1] // 2 for row in ids.tolist()), "picks span two groups"
    torch.testing.assert_close(w.double(), torch.tensor(ref_w, dtype=torch.float64))


def test_renormalize_gives_zero_weights_not_nan_when_the_chosen_scores_underflow():
    # sigmoid(-200) is 0 in float32: the chosen weights sum to 0 and renormalizing must not
    # divide 0 by 0 (a padding row of very negative logits would put NaN into the combine)
    logits = torch.full((3, 8), -200.0)
    w, ids = select_experts(logits, 2, renormalize=True, scoring_func="sigmoid")
    assert torch.equal(w, torch.zeros(3, 2))
    assert ids.shape == (3, 2)


def test_scaling_factor_multiplies_final_weights():
    logits = _logits(16, 8)
    w1, ids1 = select_experts(logits, 3)
    w2, ids2 = select_experts(logits, 3, routed_scaling_factor=2.5)
    assert torch.equal(ids1, ids2)
    torch.testing.assert_close(w2, 2.5 * w1)


def test_custom_routing_function_overrides_and_is_cast():
    calls = []

    def route(logits, top_k, renormalize):
        calls.append((tuple(logits.shape), top_k, renormalize))
        ids = torch.arange(top_k, dtype=torch.int32).expand(logits.shape[0], top_k)
        return torch.full((logits.shape[0], top_k), 0.5, dtype=torch.float64), ids

    w, ids = select_experts(_logits(5, 8), 2, renormalize=False, custom_routing_function=route)
    assert calls == [((5, 8), 2, False)]
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    assert ids.tolist() == [[0, 1]] * 5
    assert torch.equal(w, torch.full((5, 2), 0.5))


@pytest.mark.parametrize(
    "bad_return, err, match",
    [
        pytest.param(lambda T, K: torch.zeros(T, K), TypeError, "pair", id="not-a-pair"),
        pytest.param(
            lambda T, K: (torch.zeros(T, K + 1), torch.zeros(T, K, dtype=torch.long)),
            ValueError, r"weights of shape", id="weights-shape",
        ),
        pytest.param(
            lambda T, K: (torch.zeros(T, K), torch.zeros(T, K)),
            TypeError, "expected integers", id="float-ids",
        ),
        pytest.param(
            lambda T, K: (torch.zeros(T, K), torch.full((T, K), 8, dtype=torch.long)),
            ValueError, r"\[-1, E\)", id="ids-out-of-range",
        ),
        pytest.param(
            lambda T, K: (torch.zeros(T, K), torch.full((T, K), -2, dtype=torch.long)),
            ValueError, r"in \[-2, -2\]; they must lie in \[-1, E\)", id="ids-below-minus-one",
        ),
        pytest.param(
            lambda T, K: (torch.zeros(T, K, device="meta"), torch.zeros(T, K, dtype=torch.long)),
            ValueError, r"returned weights on meta, the router logits are on cpu: return them "
            r"on the logits' device", id="another-device",
        ),
    ],
)  # fmt: skip
def test_custom_routing_function_output_is_validated(bad_return, err, match):
    fn = lambda logits, k, renorm: bad_return(logits.shape[0], k)
    with pytest.raises(err, match=match):
        select_experts(_logits(4, 8), 2, custom_routing_function=fn)


def test_custom_routing_ids_of_minus_one_mean_no_expert_in_the_layer_too():
    """``-1`` (no expert for that pick) is valid custom routing, on the CPU as on CUDA:
    the layer drops those picks, as the oracle does."""
    import epmoe
    from epmoe.reference import assert_close, moe

    E, K, H, I = 8, 2, 16, 8

    def route(logits, top_k, renormalize):
        w, ids = select_experts(logits, top_k, renormalize)
        return w, torch.where(torch.arange(top_k) == 1, -1, ids)  # every second pick: none

    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    layer = epmoe.EPMoE(E, K, H, I, device="cpu", experts="torch", params_dtype=torch.float32,
                        custom_routing_function=route)  # fmt: skip
    layer.load_experts(w13, w2)
    x, logits = torch.randn(4, H, generator=g), torch.randn(4, E, generator=g)
    w, ids = select_experts(logits, K, custom_routing_function=route)
    assert (ids[:, 1] == -1).all()
    assert_close(layer(x, logits), moe(x, w13, w2, w, ids), 1e-5)


def test_custom_routing_function_rejects_ignored_options():
    fn = lambda logits, k, renorm: select_experts(logits, k, renorm)
    with pytest.raises(ValueError, match="custom_routing_function"):
        select_experts(_logits(4, 8), 2, custom_routing_function=fn, routed_scaling_factor=2.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param(dict(), id="plain"),
        pytest.param(dict(scoring_func="sigmoid", renormalize=False), id="sigmoid"),
        pytest.param(
            dict(num_expert_group=4, topk_group=2, e_score_correction_bias=torch.zeros(16)),
            id="grouped-bias",
        ),
        pytest.param(dict(num_expert_group=4, topk_group=2), id="grouped"),
    ],
)
def test_zero_tokens(kwargs):
    w, ids = select_experts(torch.empty(0, 16, dtype=torch.bfloat16), 4, **kwargs)
    assert w.shape == (0, 4) and w.dtype == torch.float32
    assert ids.shape == (0, 4) and ids.dtype == torch.int64


def test_deterministic():
    logits = _logits(64, 32)
    a = select_experts(logits, 8, num_expert_group=4, topk_group=2)
    b = select_experts(logits.clone(), 8, num_expert_group=4, topk_group=2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize(
    "logits, top_k, kwargs, err, match",
    [
        pytest.param(torch.randn(4, 8, 2), 2, {}, ValueError, "2-D", id="3d-logits"),
        pytest.param(torch.randn(8), 2, {}, ValueError, "2-D", id="1d-logits"),
        pytest.param(torch.ones(4, 8, dtype=torch.long), 2, {}, TypeError, "floating",
                     id="int-logits"),
        pytest.param(torch.randn(4, 0), 1, {}, ValueError, "E = 0", id="no-experts"),
        pytest.param(torch.randn(4, 8), 9, {}, ValueError, "exceeds", id="top_k>E"),
        pytest.param(torch.randn(4, 8), 0, {}, ValueError, "positive", id="top_k=0"),
        pytest.param(torch.randn(4, 8), 2.0, {}, TypeError, "int", id="top_k-float"),
        pytest.param(torch.randn(4, 8), 2, dict(scoring_func="tanh"), ValueError,
                     "scoring_func", id="bad-scoring-func"),
        pytest.param(torch.randn(4, 12), 2, dict(num_expert_group=5, topk_group=2),
                     ValueError, "divisible", id="E-not-divisible-by-groups"),
        pytest.param(torch.randn(4, 8), 2, dict(num_expert_group=4, topk_group=5),
                     ValueError, "topk_group=5 exceeds", id="topk_group>num_expert_group"),
        pytest.param(torch.randn(4, 8), 2, dict(num_expert_group=4), ValueError,
                     "both", id="only-num_expert_group"),
        pytest.param(torch.randn(4, 8), 2, dict(topk_group=2), ValueError,
                     "both", id="only-topk_group"),
        pytest.param(torch.randn(4, 8), 2, dict(num_expert_group=0, topk_group=0),
                     ValueError, "positive", id="zero-groups"),
        pytest.param(torch.randn(4, 16), 5, dict(num_expert_group=4, topk_group=1),
                     ValueError, "kept groups", id="top_k>eligible-experts"),
        pytest.param(torch.randn(4, 8), 2, dict(e_score_correction_bias=torch.zeros(7)),
                     ValueError, r"\[E\]=\[8\]", id="bias-shape"),
        pytest.param(torch.randn(4, 8), 2, dict(e_score_correction_bias=torch.zeros(1, 8)),
                     ValueError, r"\[E\]", id="bias-2d"),
        pytest.param(torch.randn(4, 8), 2,
                     dict(e_score_correction_bias=torch.zeros(8, dtype=torch.long)),
                     TypeError, "floating", id="bias-int"),
        pytest.param(torch.randn(4, 8), 2, dict(routed_scaling_factor=math.inf),
                     ValueError, "finite", id="scaling-inf"),
    ],
)  # fmt: skip
def test_validation_errors(logits, top_k, kwargs, err, match):
    with pytest.raises(err, match=match):
        select_experts(logits, top_k, **kwargs)


# --------------------------------------------------------------------------------------
# expert_counts
# --------------------------------------------------------------------------------------


def test_expert_counts_matches_manual_count_and_ignores_minus_one():
    ids = torch.tensor([[0, 3], [3, -1], [-1, -1], [2, 0]], dtype=torch.int32)
    counts = expert_counts(ids, 5)
    assert counts.dtype == torch.int64
    assert counts.tolist() == [2, 0, 1, 2, 0]
    assert expert_counts(torch.empty(0, 4, dtype=torch.long), 3).tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    "ids, match",
    [
        pytest.param(torch.tensor([[0, 5]]), r"\[0, 5\)", id="id>=E"),
        pytest.param(torch.tensor([[0, -2]]), "-1", id="id<-1"),
        pytest.param(torch.tensor([[0.0, 1.0]]), "integer", id="float-ids"),
    ],
)
def test_expert_counts_validation(ids, match):
    with pytest.raises((ValueError, TypeError), match=match):
        expert_counts(ids, 5)


# --------------------------------------------------------------------------------------
# RoutingSimulator
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("distribution", ["uniform", "zipf", "hot"])
def test_simulator_is_deterministic_per_seed_and_step(distribution):
    sim = RoutingSimulator(32, 4, distribution, seed=7, shuffle=True)
    a = sim.router_logits(50, step=3)
    assert torch.equal(
        a, RoutingSimulator(32, 4, distribution, seed=7, shuffle=True).router_logits(50, step=3)
    )
    assert not torch.equal(a, sim.router_logits(50, step=4))
    assert not torch.equal(
        a, RoutingSimulator(32, 4, distribution, seed=8, shuffle=True).router_logits(50, step=3)
    )
    w, ids = sim.sample(50, step=3)
    w_ref, ids_ref = select_experts(a, 4)
    assert torch.equal(ids, ids_ref) and torch.equal(w, w_ref)
    pop = sim.popularity()
    assert pop.shape == (32,) and abs(float(pop.sum()) - 1.0) < 1e-12 and bool((pop > 0).all())


def test_simulator_logits_dtype_device_and_generator():
    sim = RoutingSimulator(16, 2, "zipf")
    x = sim.router_logits(10, dtype=torch.bfloat16)
    assert x.shape == (10, 16) and x.dtype == torch.bfloat16 and x.device.type == "cpu"
    assert sim.router_logits(0).shape == (0, 16)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(sim.router_logits(10, generator=g1), sim.router_logits(10, generator=g2))


def test_zipf_popularity_shape():
    alpha = 1.2
    sim = RoutingSimulator(64, 8, "zipf", alpha=alpha)
    pop = sim.popularity()
    assert bool((pop[:-1] >= pop[1:]).all()), "Zipf popularity must not increase before shuffle"
    ranks = torch.arange(1, 65, dtype=torch.float64)
    expected = ranks**-alpha / (ranks**-alpha).sum()
    torch.testing.assert_close(pop, expected, rtol=1e-12, atol=0)

    shuffled = RoutingSimulator(64, 8, "zipf", alpha=alpha, shuffle=True, seed=5)
    perm = shuffled.permutation()
    assert sorted(perm.tolist()) == list(range(64)) and perm.tolist() != list(range(64))
    torch.testing.assert_close(shuffled.popularity()[perm], expected, rtol=1e-12, atol=0)
    assert torch.equal(RoutingSimulator(64, 8, "zipf").permutation(), torch.arange(64))


def test_uniform_and_alpha_zero_are_flat():
    for sim in (RoutingSimulator(10, 2, "uniform"), RoutingSimulator(10, 2, "zipf", alpha=0.0)):
        torch.testing.assert_close(sim.popularity(), torch.full((10,), 0.1, dtype=torch.float64))


def _assert_frequencies_match(ids_N: torch.Tensor, probs_E: torch.Tensor) -> None:
    N = ids_N.numel()
    freq = expert_counts(ids_N, probs_E.numel()).double() / N
    sigma = (probs_E * (1 - probs_E) / N).sqrt()
    z = ((freq - probs_E).abs() / sigma).max()
    assert z < 4.5, f"pick frequencies {freq.tolist()} vs popularity {probs_E.tolist()}"


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
def test_gumbel_top1_frequencies_match_popularity(shuffle):
    sim = RoutingSimulator(12, 1, "zipf", alpha=1.0, seed=11, shuffle=shuffle)
    _, ids = sim.sample(20_000)
    _assert_frequencies_match(ids[:, 0], sim.popularity())


def test_gumbel_topk_first_pick_follows_popularity():
    # Top-k ids come sorted by logit, so column 0 is the Gumbel argmax = the first
    # Plackett-Luce draw, distributed as popularity for any K.
    sim = RoutingSimulator(12, 3, "zipf", alpha=1.0, seed=2)
    _, ids = sim.sample(20_000)
    _assert_frequencies_match(ids[:, 0], sim.popularity())


@pytest.mark.parametrize(
    "E, K, num_hot, hot_fraction",
    [
        pytest.param(64, 4, 2, 0.3, id="2-hot-of-64-top4"),
        pytest.param(32, 1, 1, 0.5, id="1-hot-top1"),
        pytest.param(16, 8, 4, 0.45, id="4-hot-of-16-top8"),
    ],
)
def test_hot_sends_hot_fraction_of_picks_to_hot_experts(E, K, num_hot, hot_fraction):
    sim = RoutingSimulator(
        E, K, "hot", num_hot=num_hot, hot_fraction=hot_fraction, seed=4, shuffle=True
    )
    hot_ids = sim.permutation()[:num_hot]
    pop = sim.popularity()
    assert bool((pop[hot_ids] > pop.max() * (1 - 1e-12)).all()), "hot experts must be top"
    _, ids = sim.sample(20_000)
    counts = expert_counts(ids, E)
    measured = float(counts[hot_ids].sum()) / ids.numel()
    assert abs(measured - hot_fraction) < 0.01, (measured, hot_fraction)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        pytest.param(dict(num_experts=8, top_k=9), "exceeds", id="top_k>E"),
        pytest.param(dict(num_experts=8, top_k=2, distribution="pareto"), "distribution",
                     id="bad-distribution"),
        pytest.param(dict(num_experts=8, top_k=2, distribution="zipf", alpha=-1.0), "alpha",
                     id="negative-alpha"),
        pytest.param(dict(num_experts=8, top_k=4, distribution="hot", num_hot=1,
                          hot_fraction=0.5), r"between 0 and 0.25", id="hot-fraction-too-high"),
        pytest.param(dict(num_experts=8, top_k=2, distribution="hot", num_hot=8),
                     "num_hot", id="all-hot"),
        pytest.param(dict(num_experts=8, top_k=2, seed=-1), "seed", id="negative-seed"),
    ],
)  # fmt: skip
def test_simulator_validation(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        RoutingSimulator(**kwargs)


def test_simulator_is_frozen_and_hashable():
    sim = RoutingSimulator(8, 2, "zipf")
    with pytest.raises(AttributeError):
        sim.top_k = 3  # type: ignore[misc]
    assert sim == RoutingSimulator(8, 2, "zipf") and hash(sim) == hash(
        RoutingSimulator(8, 2, "zipf")
    )


# --------------------------------------------------------------------------------------
# GPU tier
# --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    sim = RoutingSimulator(256, 8, "zipf", seed=3, shuffle=True)
    cpu = sim.router_logits(1024)
    gpu = sim.router_logits(1024, device="cuda")
    assert gpu.device.type == "cuda" and torch.equal(gpu.cpu(), cpu), "same draw on every device"
    kwargs = dict(
        scoring_func="sigmoid",
        num_expert_group=8,
        topk_group=4,
        e_score_correction_bias=_bias(256),
        routed_scaling_factor=2.5,
    )
    w_cpu, ids_cpu = select_experts(cpu, 8, **kwargs)
    w_gpu, ids_gpu = select_experts(gpu, 8, **kwargs)
    assert torch.equal(ids_gpu.cpu(), ids_cpu)
    torch.testing.assert_close(w_gpu.cpu(), w_cpu, rtol=1e-5, atol=1e-6)
    counts = expert_counts(ids_gpu, 256)
    assert counts.device.type == "cuda" and torch.equal(counts.cpu(), expert_counts(ids_cpu, 256))
