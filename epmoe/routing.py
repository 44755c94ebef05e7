"""Top-k expert selection (the router) and a routing simulator for benchmarks.

Shape legend: T tokens · E logical experts · K top-k · G expert groups.

``select_experts`` turns router logits ``[T, E]`` into float32 weights ``[T, K]`` and int64
logical expert ids ``[T, K]`` with the semantics of vLLM's ``FusedMoE.select_experts``,
DeepSeek-V3's ``Gate`` and SGLang's ``select_experts``:

1. score every expert in float32: ``softmax`` over E, or element-wise ``sigmoid``;
2. optionally add ``e_score_correction_bias`` (aux-loss-free balancing, DeepSeek-V3): the
   biased scores *choose* the experts, the unbiased scores become the weights;
3. optionally restrict the choice to the ``topk_group`` best of ``num_expert_group``
   contiguous groups (group score: max unbiased score, or with a bias the sum of the two
   best biased scores of the group);
4. take the top K (ties broken deterministically by ``torch.topk``); the ids come in
   descending order of the choosing score;
5. optionally renormalize the K weights to sum to 1, then multiply by
   ``routed_scaling_factor``.

``RoutingSimulator`` produces synthetic router logits whose top-k is an exact sample of K
distinct experts from a popularity distribution (uniform, Zipf or hot-expert) via the
Gumbel-top-k trick, so benchmarks can reproduce skewed expert loads deterministically.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = [
    "SCORING_FUNCS",
    "DISTRIBUTIONS",
    "RoutingFunction",
    "select_experts",
    "expert_counts",
    "RoutingSimulator",
]

SCORING_FUNCS = ("softmax", "sigmoid")
DISTRIBUTIONS = ("uniform", "zipf", "hot")

# (router_logits [T, E], top_k, renormalize) -> (weights [T, K], ids [T, K])
RoutingFunction = Callable[[torch.Tensor, int, bool], tuple[torch.Tensor, torch.Tensor]]

# the fused routing kernel (kernels.route) holds a row of scores in registers: up to this E
FUSED_ROUTING_MAX_EXPERTS = 4096


def fused_routing_enabled() -> bool:
    """Whether ``EPMoE`` routes on CUDA with one fused kernel (``kernels.route``; the same
    choice as ``select_experts`` then ``to_physical``, up to ties): unless
    ``EPMOE_FUSED_ROUTING=0``."""
    raw = os.environ.get("EPMOE_FUSED_ROUTING", "1").strip() or "1"
    if raw not in ("0", "1"):
        raise ValueError(f"EPMOE_FUSED_ROUTING must be 0 or 1, got {raw!r}")
    return raw == "1"


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
    scoring_func: str = "softmax",
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    custom_routing_function: RoutingFunction | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose ``top_k`` experts per token and their router weights.

    Args:
        router_logits: ``[T, E]`` floating (any float dtype; scored in float32). ``T`` may
            be 0.
        top_k: K, ``1 <= K <= E`` (with grouping, ``K <= topk_group * E / num_expert_group``).
        renormalize: divide the K chosen weights by their sum (a ``bool``).
        scoring_func: ``"softmax"`` (over E) or ``"sigmoid"`` (per expert).
        num_expert_group: grouped top-k (DeepSeek-V2/V3): the E experts form
            ``num_expert_group`` contiguous groups of ``E / num_expert_group``; only
            experts of the ``topk_group`` best groups are eligible. Give both or neither.
        topk_group: how many groups are eligible (with ``num_expert_group``).
        e_score_correction_bias: ``[E]`` floating, added to the scores to choose experts
            (and rank groups) but not to the weights. A NaN in it is refused when the bias
            is on the CPU (on GPU that check would need a host synchronisation; ``EPMoE``
            checks its bias once, at construction).
        routed_scaling_factor: multiplies the final weights (after renormalization).
        custom_routing_function: ``fn(router_logits, top_k, renormalize) -> (weights,
            ids)``, replaces all of the above (then grouping, bias and scaling must be left
            at their defaults). Its outputs are checked for shape ``[T, K]`` and cast to
            float32 / int64; its ids lie in ``[-1, E)`` (``-1``: no expert for that pick).
            On CPU the ids are also range checked (on GPU that check would need a host
            synchronisation, so it is skipped; the layer checks them on the device).

    Returns:
        ``(topk_weights [T, K] float32, topk_ids [T, K] int64)``: logical expert ids in
        ``[0, E)`` (a custom function's may also be ``-1``), in descending order of the
        (biased) choosing score, on the device of ``router_logits``. No host
        synchronisation (CUDA-graph safe) unless a custom function adds one.
    """
    if not isinstance(router_logits, torch.Tensor):
        raise TypeError(f"router_logits must be a torch.Tensor, got {type(router_logits).__name__}")
    if router_logits.dim() != 2:
        raise ValueError(
            f"router_logits must be 2-D [T, E], got shape {tuple(router_logits.shape)}; "
            "flatten leading dims with router_logits.reshape(-1, E)"
        )
    if not router_logits.is_floating_point():
        raise TypeError(f"router_logits must be floating point, got {router_logits.dtype}")
    T, E = router_logits.shape
    if E == 0:
        raise ValueError("router_logits has E = 0 experts; it must be [T, E] with E >= 1")
    top_k = _check_positive_int("top_k", top_k)
    if top_k > E:
        raise ValueError(f"top_k={top_k} exceeds the number of experts E={E}; use top_k <= E")
    if not isinstance(renormalize, bool):
        raise TypeError(
            f"renormalize must be a bool, got {type(renormalize).__name__} ({renormalize!r}); "
            "pass True or False"
        )
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {scoring_func!r}")
    if (num_expert_group is None) != (topk_group is None):
        raise ValueError(
            "grouped top-k needs both num_expert_group and topk_group, got "
            f"num_expert_group={num_expert_group}, topk_group={topk_group}; give both or neither"
        )
    if not isinstance(routed_scaling_factor, numbers.Real) or isinstance(
        routed_scaling_factor, bool
    ):
        raise TypeError(
            f"routed_scaling_factor must be a float, got {type(routed_scaling_factor).__name__}"
        )
    routed_scaling_factor = float(routed_scaling_factor)
    if not math.isfinite(routed_scaling_factor):
        raise ValueError(f"routed_scaling_factor must be finite, got {routed_scaling_factor}")

    if custom_routing_function is not None:
        if not callable(custom_routing_function):
            raise TypeError(
                "custom_routing_function must be callable as fn(router_logits, top_k, "
                f"renormalize) -> (weights, ids), got {type(custom_routing_function).__name__}"
            )
        if (
            num_expert_group is not None
            or e_score_correction_bias is not None
            or routed_scaling_factor != 1.0
        ):
            raise ValueError(
                "custom_routing_function replaces the built-in routing; do not combine it "
                "with num_expert_group/topk_group, e_score_correction_bias or "
                "routed_scaling_factor (apply those inside the custom function)"
            )
        return _run_custom(custom_routing_function, router_logits, top_k, renormalize)

    if num_expert_group is not None:
        num_expert_group = _check_positive_int("num_expert_group", num_expert_group)
        topk_group = _check_positive_int("topk_group", topk_group)
        if E % num_expert_group != 0:
            raise ValueError(
                f"E={E} experts are not divisible by num_expert_group={num_expert_group}; "
                "pick num_expert_group dividing E"
            )
        if topk_group > num_expert_group:
            raise ValueError(
                f"topk_group={topk_group} exceeds num_expert_group={num_expert_group}; "
                "use topk_group <= num_expert_group"
            )
        eligible = topk_group * (E // num_expert_group)
        if top_k > eligible:
            raise ValueError(
                f"top_k={top_k} exceeds the {eligible} experts in the topk_group={topk_group} "
                f"kept groups of {E // num_expert_group}; raise topk_group or lower top_k"
            )

    bias_E = None
    if e_score_correction_bias is not None:
        if not isinstance(e_score_correction_bias, torch.Tensor):
            raise TypeError(
                "e_score_correction_bias must be a torch.Tensor of shape [E], got "
                f"{type(e_score_correction_bias).__name__}"
            )
        if tuple(e_score_correction_bias.shape) != (E,):
            raise ValueError(
                f"e_score_correction_bias must have shape [E]=[{E}], got "
                f"{tuple(e_score_correction_bias.shape)}"
            )
        if not e_score_correction_bias.is_floating_point():
            raise TypeError(
                f"e_score_correction_bias must be floating point, got "
                f"{e_score_correction_bias.dtype}"
            )
        if e_score_correction_bias.device.type == "cpu" and bool(
            torch.isnan(e_score_correction_bias).any()
        ):
            nan = torch.isnan(e_score_correction_bias).nonzero().flatten().tolist()
            raise ValueError(
                f"e_score_correction_bias holds NaN at experts {nan[:8]}"
                f"{' ...' if len(nan) > 8 else ''} (of E={E}); a NaN score wins every top-k, "
                "so those experts would be chosen for every token. Load the bias from the "
                "checkpoint (or pass None)"
            )
        bias_E = e_score_correction_bias.to(device=router_logits.device, dtype=torch.float32)

    logits_TE = router_logits.float()
    if scoring_func == "softmax":
        scores_TE = torch.softmax(logits_TE, dim=-1)
    else:
        scores_TE = torch.sigmoid(logits_TE)

    # Scores that choose; the unbiased `scores_TE` give the weights.
    choice_TE = scores_TE if bias_E is None else scores_TE + bias_E

    if num_expert_group is not None and topk_group < num_expert_group:
        G = num_expert_group
        choice_TGn = choice_TE.reshape(T, G, E // G)
        if bias_E is None:
            group_score_TG = choice_TGn.amax(dim=-1)
        else:
            # DeepSeek-V3: a group is as good as the sum of its two best biased scores
            # (its single best when groups have one expert).
            n_best = min(2, E // G)
            group_score_TG = choice_TGn.topk(n_best, dim=-1).values.sum(dim=-1)
        kept_groups = torch.topk(group_score_TG, topk_group, dim=-1).indices
        keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool)
        keep_TG.scatter_(1, kept_groups, True)
        choice_TE = choice_TGn.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).reshape(T, E)

    topk_ids_TK = torch.topk(choice_TE, top_k, dim=-1, sorted=True).indices
    topk_weights_TK = scores_TE.gather(1, topk_ids_TK)
    if renormalize:
        denom_T1 = topk_weights_TK.sum(dim=-1, keepdim=True)
        topk_weights_TK = topk_weights_TK / denom_T1.clamp_min(torch.finfo(torch.float32).tiny)
    if routed_scaling_factor != 1.0:
        topk_weights_TK = topk_weights_TK * routed_scaling_factor
    return topk_weights_TK, topk_ids_TK.to(torch.int64)


def _run_custom(
    fn: RoutingFunction, router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    T, E = router_logits.shape
    out = fn(router_logits, top_k, renormalize)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(
            "custom_routing_function must return a (weights [T, K], ids [T, K]) pair, got "
            f"{type(out).__name__}"
        )
    weights, ids = out
    if not isinstance(weights, torch.Tensor) or not isinstance(ids, torch.Tensor):
        raise TypeError("custom_routing_function must return two tensors (weights, ids)")
    for name, t in (("weights", weights), ("ids", ids)):
        if tuple(t.shape) != (T, top_k):
            raise ValueError(
                f"custom_routing_function returned {name} of shape {tuple(t.shape)}; "
                f"expected [T, K] = [{T}, {top_k}]"
            )
        if t.device != router_logits.device:
            raise ValueError(
                f"custom_routing_function returned {name} on {t.device}, the router logits "
                f"are on {router_logits.device}: return them on the logits' device"
            )
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(
            f"custom_routing_function returned ids of dtype {ids.dtype}; expected integers"
        )
    if not weights.is_floating_point():
        raise TypeError(
            f"custom_routing_function returned weights of dtype {weights.dtype}; "
            "expected floating point"
        )
    ids = ids.to(torch.int64)
    if ids.device.type == "cpu" and ids.numel() > 0:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < -1 or hi >= E:
            raise ValueError(
                f"custom_routing_function returned expert ids in [{lo}, {hi}]; they must "
                f"lie in [-1, E) = [-1, {E}) (-1: no expert)"
            )
    return weights.to(torch.float32), ids


def expert_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many (token, k) picks each expert received.

    Args:
        topk_ids: integer ids of any shape (typically ``[T, K]``); ``-1`` (no expert) is
            ignored, every other id must lie in ``[0, num_experts)``.
        num_experts: E.

    Returns:
        ``[E]`` int64 on the device of ``topk_ids``. Uses ``scatter_add`` with no host
        synchronisation; on CPU the ids are range checked (ValueError), on GPU an
        out-of-range id trips a device-side assert.
    """
    E = _check_positive_int("num_experts", num_experts)
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}")
    if topk_ids.is_floating_point() or topk_ids.is_complex() or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    flat = topk_ids.reshape(-1).to(torch.int64)
    if flat.device.type == "cpu" and flat.numel() > 0:
        lo, hi = int(flat.min()), int(flat.max())
        if lo < -1 or hi >= E:
            raise ValueError(
                f"topk_ids hold values in [{lo}, {hi}]; expected -1 or ids in [0, {E})"
            )
    # Route -1 to an overflow bin E that is dropped.
    idx = torch.where(flat < 0, torch.full_like(flat, E), flat)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, idx, torch.ones_like(idx))
    return counts[:E]


# --------------------------------------------------------------------------------------
# Routing simulator
# --------------------------------------------------------------------------------------


_STREAM_NOISE = 0
_STREAM_PERMUTATION = 1


def _mix_seed(seed: int, stream: int, step: int) -> int:
    """SplitMix64 over (seed, stream, step): independent-looking generator seeds."""
    mask = (1 << 64) - 1
    z = 0
    for word in (seed, stream, step):
        z = (z + (word & mask) * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E5B1) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
    return z & ((1 << 63) - 1)


def _expected_hot_picks(ratio: float, num_hot: int, num_cold: int, top_k: int) -> float:
    """Expected number of hot experts among K drawn without replacement (Plackett-Luce).

    Each hot expert has weight ``ratio``, each cold one weight 1. Dynamic programme over
    the K sequential draws; state = hot experts drawn so far.
    """
    prob = [1.0]  # prob[h]: P(h hot drawn after j draws)
    expected = 0.0
    for j in range(top_k):
        nxt = [0.0] * (j + 2)
        for h, p in enumerate(prob):
            if p == 0.0:
                continue
            hot_left, cold_left = num_hot - h, num_cold - (j - h)
            mass_hot = hot_left * ratio
            total = mass_hot + cold_left
            p_hot = mass_hot / total if total > 0 else 0.0
            expected += p * p_hot
            nxt[h + 1] += p * p_hot
            nxt[h] += p * (1.0 - p_hot)
        prob = nxt
    return expected


def _hot_weight_ratio(num_experts: int, top_k: int, num_hot: int, hot_fraction: float) -> float:
    """Weight ratio hot/cold such that E[hot picks] / K == hot_fraction (bisection)."""
    num_cold = num_experts - num_hot
    lo, hi = -60.0, 60.0  # log ratio; the map ratio -> expected picks is increasing
    target = hot_fraction * top_k
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _expected_hot_picks(math.exp(mid), num_hot, num_cold, top_k) < target:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return math.exp(0.5 * (lo + hi))


@dataclass(frozen=True)
class RoutingSimulator:
    """Synthetic router logits with a controlled expert popularity, for benchmarks.

    ``router_logits`` returns ``log(popularity) + Gumbel(0, 1)`` noise, i.i.d. per (token,
    expert). By the Gumbel-top-k trick (Vieira 2014; Kool et al. 2019, "Stochastic Beams
    and Where to Find Them") the K largest entries of each row are an exact sample of K
    *distinct* experts drawn one after another with probability proportional to
    popularity among those not yet drawn (Plackett-Luce). Softmax and sigmoid are monotone,
    so ``select_experts`` on these logits (without grouping or bias) picks exactly that
    sample. With ``top_k = 1`` the pick frequencies converge to ``popularity()``; with
    ``top_k > 1`` they are flatter, because an expert is picked at most once per token —
    plan load balancing from measured counts (``expert_counts``), not from popularity.

    Distributions (``popularity()`` for expert ranks r = 0..E-1, most popular first):

    * ``"uniform"``: ``1 / E``.
    * ``"zipf"``: ``∝ (r + 1) ** -alpha`` (alpha ≈ 1.0 for DeepSeek-V3/R1, ≈ 1.2 for
      Qwen3-235B; alpha = 0 is uniform).
    * ``"hot"``: ``num_hot`` hot experts share one weight, the others another, calibrated
      so that in expectation ``hot_fraction`` of all ``T·K`` picks go to the hot experts
      (exact for Plackett-Luce sampling). Feasible when
      ``max(0, K - (E - num_hot)) / K < hot_fraction < min(num_hot, K) / K``.

    ``shuffle=True`` maps ranks to expert ids through a fixed random permutation drawn
    from ``seed`` (``permutation()``), so popular experts are not always ids ``0..n``.

    Determinism: the same (fields, ``num_tokens``, ``step``) give bitwise the same logits on
    every device, because the noise is drawn on the CPU from a generator seeded with a hash
    of ``(seed, step)`` and then moved; pass ``generator`` to draw on its device instead.
    """

    num_experts: int
    top_k: int
    distribution: str = "uniform"
    alpha: float = 1.0
    num_hot: int = 1
    hot_fraction: float = 0.1
    seed: int = 0
    shuffle: bool = False
    # Derived in __post_init__: popularity per expert id and the rank -> id permutation.
    _popularity: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _permutation: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        E = _check_positive_int("num_experts", self.num_experts)
        K = _check_positive_int("top_k", self.top_k)
        if K > E:
            raise ValueError(f"top_k={K} exceeds num_experts={E}; use top_k <= num_experts")
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(
                f"distribution must be one of {DISTRIBUTIONS}, got {self.distribution!r}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")

        if self.distribution == "uniform":
            weights = [1.0] * E
        elif self.distribution == "zipf":
            alpha = float(self.alpha)
            if not math.isfinite(alpha) or alpha < 0:
                raise ValueError(f"alpha must be finite and >= 0 for zipf, got {self.alpha}")
            weights = [(r + 1) ** -alpha for r in range(E)]
            if weights[-1] == 0.0:
                raise ValueError(
                    f"alpha={self.alpha} is so large that the least popular of {E} experts "
                    "gets probability 0 in float64; use a smaller alpha"
                )
        else:
            n_hot = self.num_hot
            if isinstance(n_hot, bool) or not isinstance(n_hot, int) or not 0 < n_hot < E:
                raise ValueError(
                    f"num_hot must be an int in [1, num_experts - 1] = [1, {E - 1}], got {n_hot!r}"
                )
            f = float(self.hot_fraction)
            lo, hi = max(0, K - (E - n_hot)) / K, min(n_hot, K) / K
            if not lo < f < hi:
                raise ValueError(
                    f"hot_fraction={self.hot_fraction} is not reachable with num_hot={n_hot}, "
                    f"top_k={K}, num_experts={E}: each token picks K distinct experts, so the "
                    f"hot share of picks lies strictly between {lo:g} and {hi:g}; choose "
                    "hot_fraction in that range or change num_hot"
                )
            ratio = _hot_weight_ratio(E, K, n_hot, f)
            weights = [ratio] * n_hot + [1.0] * (E - n_hot)

        if self.shuffle:
            g = torch.Generator().manual_seed(_mix_seed(self.seed, _STREAM_PERMUTATION, 0))
            perm = tuple(int(i) for i in torch.randperm(E, generator=g))
        else:
            perm = tuple(range(E))
        total = math.fsum(weights)
        popularity = [0.0] * E
        for r, w in enumerate(weights):
            popularity[perm[r]] = w / total
        object.__setattr__(self, "_popularity", tuple(popularity))
        object.__setattr__(self, "_permutation", perm)

    def popularity(self) -> torch.Tensor:
        """``[E]`` float64 probabilities (sum 1) indexed by expert id: the Plackett-Luce
        weights of the draw (for K = 1, the probability of each expert)."""
        return torch.tensor(self._popularity, dtype=torch.float64)

    def permutation(self) -> torch.Tensor:
        """``[E]`` int64: ``permutation()[r]`` is the expert id of popularity rank ``r``
        (identity unless ``shuffle``)."""
        return torch.tensor(self._permutation, dtype=torch.int64)

    def router_logits(
        self,
        num_tokens: int,
        *,
        step: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """``[T, E]`` logits ``log(popularity) + Gumbel noise`` in ``dtype`` on ``device``
        (default: the CPU, or the generator's device when one is given).

        ``step`` selects a reproducible, independent draw (e.g. the decode step). With a
        ``generator`` the noise is drawn from it on its device (``step`` is then unused).
        In low precision (bf16/fp16) rounding can create ties, so the top-k is then only
        approximately the Plackett-Luce sample.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating dtype, got {dtype}")
        E = self.num_experts
        if device is None:
            device = generator.device if generator is not None else torch.device("cpu")
        if generator is None:
            generator = torch.Generator().manual_seed(_mix_seed(self.seed, _STREAM_NOISE, step))
        # Exp(1) samples; Gumbel = -log(Exp(1)). Clamp away an exact 0 (-> +inf logit).
        noise_TE = torch.empty(num_tokens, E, dtype=torch.float32, device=generator.device)
        noise_TE.exponential_(generator=generator)
        gumbel_TE = -torch.log(noise_TE.clamp_min_(torch.finfo(torch.float32).tiny))
        log_pop_E = self.popularity().log().to(torch.float32).to(gumbel_TE.device)
        return (gumbel_TE + log_pop_E).to(device=device, dtype=dtype)

    def sample(
        self,
        num_tokens: int,
        *,
        step: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        generator: torch.Generator | None = None,
        renormalize: bool = True,
        scoring_func: str = "softmax",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``select_experts`` on ``router_logits(...)``: ``(weights [T, K] float32, ids
        [T, K] int64)``."""
        logits_TE = self.router_logits(
            num_tokens, step=step, device=device, dtype=dtype, generator=generator
        )
        return select_experts(
            logits_TE, self.top_k, renormalize=renormalize, scoring_func=scoring_func
        )
