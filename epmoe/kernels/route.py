"""Routing and placement in one kernel: router logits to weights, logical and physical ids.

``select_experts`` followed by ``ExpertPlacement.to_physical`` is about a dozen small torch
kernels (softmax, a two-kernel top-k, gather, sum, divide, and the placement's compare,
clamp, index, fill and select). Each launch costs host time, which an eager decode step
waits for, and each kernel costs a few µs of GPU time, even in a CUDA graph. ``fused_route``
does both in one launch, with one program per token, and has the same semantics:

1. score the E experts in float32 (softmax over E, or sigmoid per expert);
2. add ``e_score_correction_bias`` to choose (the unbiased scores give the weights);
3. grouped top-k: keep the ``topk_group`` best of G contiguous groups (group score: the
   best score, or with a bias the sum of the two best biased scores);
4. the K best, in descending order, ties to the lower expert id (a NaN score, and a NaN
   group score, counts as the largest, as in ``torch.topk``);
5. renormalize the K weights and multiply by ``routed_scaling_factor``;
6. the physical replica: ``(t + k + rank) mod replica_count`` of the expert's replicas, or
   with ``prefer_local`` the first replica on ``rank`` when there is one.

``torch.topk`` does not promise an order for equal scores. Where two experts score exactly
alike, the two paths may pick different ones of them, or list them in another order
(which changes the replica of an expert with several): either is a top-k of the scores.
Ties are common with bf16 router logits (a few percent of rows at E = 128, K = 8).

Shape legend: T tokens · E logical experts · K top-k · G expert groups · N = E / G experts
per group · X the largest replica count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epmoe.kernels.launcher import check_cuda, launch
from epmoe.placement import PlacementMaps
from epmoe.routing import FUSED_ROUTING_MAX_EXPERTS

_TINY = float(torch.finfo(torch.float32).tiny)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@triton.jit(do_not_specialize=["rank"])
def route_kernel(
    logits_ptr,  # [T, E] floating, rows stride_t apart
    bias_ptr,  # [E] float32 (BIAS)
    first_ptr,  # [E] int64: each expert's first replica
    l2p_ptr,  # [E, X] int64: its replicas (REPLICATED)
    count_ptr,  # [E] int64: how many (REPLICATED)
    local_ptr,  # [W, E] int64: its replica on each rank, -1 where none (PREFER_LOCAL)
    weights_ptr,  # [T, K] float32, out
    logical_ptr,  # [T, K] int64, out
    physical_ptr,  # [T, K] int64, out
    stride_t,
    rank,
    scale,
    E: tl.constexpr,
    K: tl.constexpr,
    G: tl.constexpr,
    N: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    X: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SOFTMAX: tl.constexpr,
    BIAS: tl.constexpr,
    GROUPED: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    REPLICATED: tl.constexpr,
    PREFER_LOCAL: tl.constexpr,
    TINY: tl.constexpr,
):
    """One token per program: its row of E scores as ``[BLOCK_G, BLOCK_N]`` (G groups of
    N experts; ``G = 1`` without grouping)."""
    t = tl.program_id(0)
    g = tl.arange(0, BLOCK_G)[:, None]
    n = tl.arange(0, BLOCK_N)[None, :]
    valid = (g < G) & (n < N)
    col = g * N + n  # the logical expert id
    x = tl.load(logits_ptr + t.to(tl.int64) * stride_t + col, mask=valid, other=float("-inf"))
    x = x.to(tl.float32)
    if SOFTMAX:
        p = tl.where(valid, tl.exp(x - tl.max(tl.max(x, 1), 0)), 0.0)
        scores = p / tl.sum(tl.sum(p, 1), 0)
    else:
        scores = tl.sigmoid(x)
    choice = scores
    if BIAS:
        choice = scores + tl.load(bias_ptr + col, mask=valid, other=0.0)
    choice = tl.where(choice != choice, float("inf"), choice)  # NaN: the largest
    choice = tl.where(valid, choice, float("-inf"))
    if GROUPED:
        gi = tl.arange(0, BLOCK_G)
        best = tl.max(choice, 1)
        if BIAS and N > 1:  # the sum of the two best (a repeated best counts twice)
            first = tl.min(tl.where(choice == best[:, None], n, BLOCK_N), 1)
            second = tl.max(tl.where(n == first[:, None], float("-inf"), choice), 1)
            best = best + second
        # a NaN group score (inf + -inf) ranks first, as torch.topk ranks NaN
        score_g = tl.where(best != best, float("inf"), best)
        score_g = tl.where(gi < G, score_g, float("-inf"))
        keep = gi < 0
        for _ in tl.static_range(TOPK_GROUP):
            open_g = (gi < G) & ~keep
            top = tl.max(tl.where(open_g, score_g, float("-inf")), 0)
            pick = tl.min(tl.where(open_g & (score_g == top), gi, BLOCK_G), 0)
            keep = keep | (gi == pick)
        choice = tl.where(keep[:, None], choice, float("-inf"))
    kk = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    open_e = valid
    for k in tl.static_range(K):
        cur = tl.where(open_e, choice, float("-inf"))
        top = tl.max(tl.max(cur, 1), 0)
        # an open expert always matches: K <= E (fused_route checks it)
        i = tl.min(tl.min(tl.where(open_e & (cur == top), col, BLOCK_G * BLOCK_N), 1), 0)
        wi = tl.sum(tl.sum(tl.where(col == i, scores, 0.0), 1), 0)
        open_e = open_e & (col != i)
        ids = tl.where(kk == k, i, ids)
        w = tl.where(kk == k, wi, w)
    k_mask = kk < K
    if RENORMALIZE:
        total = tl.sum(tl.where(k_mask, w, 0.0), 0)
        w = w / tl.where(total < TINY, TINY, total)  # (a NaN sum stays NaN, as in torch)
    w = w * scale
    if REPLICATED:
        count = tl.load(count_ptr + ids, mask=k_mask, other=1)
        replica = (t + kk + rank) % count
        phys = tl.load(l2p_ptr + ids * X + replica, mask=k_mask, other=-1)
    else:
        phys = tl.load(first_ptr + ids, mask=k_mask, other=-1)
    if PREFER_LOCAL:
        local = tl.load(local_ptr + rank * E + ids, mask=k_mask, other=-1)
        phys = tl.where(local >= 0, local, phys)
    out = t.to(tl.int64) * K + kk
    tl.store(weights_ptr + out, w, mask=k_mask)
    tl.store(logical_ptr + out, ids, mask=k_mask)
    tl.store(physical_ptr + out, phys, mask=k_mask)


def fused_route(
    router_logits_TE: torch.Tensor,
    top_k: int,
    maps: PlacementMaps,
    *,
    rank: int = 0,
    prefer_local: bool = False,
    renormalize: bool = True,
    scoring_func: str = "softmax",
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``select_experts`` and ``to_physical`` in one launch: ``(weights [T, K] float32,
    logical ids [T, K] int64, physical ids [T, K] int64)``.

    The options are ``select_experts``' own, already checked there (``EPMoE`` checks them
    once, at construction); ``maps`` are the placement's tables on the logits' device
    (``ExpertPlacement.maps_on``). No host synchronisation: capturable in a CUDA graph.
    """
    T, E = router_logits_TE.shape
    K = top_k
    dev = router_logits_TE.device
    if E > FUSED_ROUTING_MAX_EXPERTS:
        raise ValueError(
            f"fused_route holds at most {FUSED_ROUTING_MAX_EXPERTS} experts per row, got E={E}"
        )
    if not 1 <= K <= E:  # (the kernel's picks rely on it: an id past E would be read)
        raise ValueError(f"top_k={K} must lie in [1, E={E}]")
    check_cuda("fused_route", dev, route_kernel)
    if maps.first_replica.device != dev:  # (the launch passes bare addresses)
        raise ValueError(
            f"maps are on {maps.first_replica.device} but router_logits_TE on {dev}: pass "
            f"placement.maps_on(router_logits_TE.device)"
        )
    bias = e_score_correction_bias
    if bias is not None and tuple(bias.shape) != (E,):
        raise ValueError(f"e_score_correction_bias must be [E={E}], got {tuple(bias.shape)}")
    weights = torch.empty(T, K, dtype=torch.float32, device=dev)
    logical = torch.empty(T, K, dtype=torch.int64, device=dev)
    physical = torch.empty(T, K, dtype=torch.int64, device=dev)
    if T == 0:
        return weights, logical, physical
    logits = router_logits_TE
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    grouped = num_expert_group is not None and topk_group < num_expert_group
    G = num_expert_group if grouped else 1
    if bias is not None:  # (read at stride 1)
        bias = bias.to(device=dev, dtype=torch.float32).contiguous()
    replicated = maps.max_replicas > 1
    BLOCK_G, BLOCK_N = _pow2(G), _pow2(E // G)
    launch(route_kernel)(
        (T,), logits, logits if bias is None else bias, maps.first_replica,
        maps.logical_to_physical, maps.replica_count, maps.local_physical,
        weights, logical, physical,
        logits.stride(0), rank, float(routed_scaling_factor),
        E=E, K=K, G=G, N=E // G, TOPK_GROUP=topk_group if grouped else 1,
        X=maps.max_replicas, BLOCK_G=BLOCK_G, BLOCK_N=BLOCK_N, BLOCK_K=_pow2(K),
        SOFTMAX=scoring_func == "softmax", BIAS=bias is not None, GROUPED=grouped,
        RENORMALIZE=renormalize, REPLICATED=replicated, PREFER_LOCAL=prefer_local,
        TINY=_TINY, num_warps=4 if BLOCK_G * BLOCK_N <= 1024 else 8,
    )  # fmt: skip
    return weights, logical, physical
