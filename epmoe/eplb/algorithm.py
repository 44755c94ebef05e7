"""Expert-parallel load balancing (EPLB): decide which GPU holds which expert replica.

Shape legend: L MoE layers · E logical experts · P physical slots (E + redundant) · W GPUs
(EP ranks) · N nodes · G expert groups · c = P / W slots per GPU · X max replicas of one
expert · B a batch of independent packing problems (layers, or layers × nodes).

The policy follows DeepSeek's EPLB (``deepseek-ai/EPLB``), reimplemented and vectorized over
layers:

1. *Groups → nodes* (hierarchical policy only): the G expert groups are packed onto the N
   nodes, G / N groups per node, balancing the summed group load. Experts of one group stay
   on one node, which keeps group-limited routing (``topk_group``) inside a node.
2. *Replicate within each node*: starting from one replica per expert, every extra slot goes
   to the expert with the largest load per replica (this minimises the largest per-replica
   load).
3. *Replicas → GPUs*: the node's replicas (each carrying ``load / replica_count``) are packed
   onto the node's GPUs, c per GPU, by greedy balanced packing (heaviest first, onto the
   lightest GPU that still has a free slot), then refined by pairwise swaps that lower the
   heaviest GPU (our addition; it keeps every invariant and never makes a plan worse).

When ``num_groups % num_nodes != 0`` the global policy runs instead: one group, one node.
Two replicas of one expert may land on the same GPU.

Output conventions (identical to ``ExpertPlacement``): physical ids are GPU-major, GPU ``g``
owns slots ``[g·c, (g+1)·c)``; within a GPU the slots are sorted by logical id (or, with a
``current_phy2log``, arranged to keep already-present experts in their old slot).
"""

from __future__ import annotations

import numpy as np
import torch

from epmoe.distributed import cpu_by_default

__all__ = [
    "balanced_packing",
    "balancedness",
    "gpu_loads",
    "logical_to_physical",
    "rebalance",
    "replicate_experts",
]


# --------------------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------------------


@cpu_by_default
def rebalance(
    weight_LE: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    current_phy2log: torch.Tensor | None = None,
    tolerance: float = 0.0,
    refine: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plan expert replicas and their GPUs for every layer from measured expert load.

    Args:
        weight_LE: ``[L, E]`` load per logical expert (token count or any non-negative
            measure), any real dtype and device. A layer with zero total load is planned
            as if the load were uniform.
        num_replicas: P, physical slots per layer; a multiple of ``num_gpus`` and ``>= E``.
        num_groups: G, expert groups (``E % G == 0``); with ``G % N == 0`` the hierarchical
            policy keeps each group on one node, otherwise the global policy runs.
        num_nodes: N, nodes; ``num_gpus % N == 0``.
        num_gpus: W, GPUs (EP ranks), each receiving ``c = P / W`` slots.
        current_phy2log: optional ``[L, P]`` int current plan (same P), for migration-aware
            re-planning. Per layer: when the current plan's balancedness under the new load
            is within ``tolerance`` of the new plan's, the current plan is kept unchanged;
            otherwise the new plan's nodes, GPUs and slots are relabelled (which changes no
            load) so that experts already on a GPU keep their old slot where possible, which
            minimises the slots whose weights must move.
        tolerance: absolute balancedness margin for keeping the current plan (0.0 keeps it
            only when it is at least as balanced as the new plan).
        refine: run the swap refinement after greedy packing (on by default).

    Returns:
        ``phy2log [L, P]`` int64 logical id of each physical slot; ``log2phy [L, E, X]``
        int64 physical ids of each expert's replicas in increasing order, ``-1`` padded;
        ``logcnt [L, E]`` int64 replica count (``>= 1``). All on the CPU.
    """
    weight = _check_weight(weight_LE)
    L, E = weight.shape
    _check_config(E, num_replicas, num_groups, num_nodes, num_gpus)
    tolerance = check_tolerance(tolerance)
    current = None
    if current_phy2log is not None:
        current = _check_phy2log(current_phy2log, L, num_replicas, E, "current_phy2log")

    # The global policy is the hierarchical one with a single group on a single node.
    G, N = (num_groups, num_nodes) if num_groups % num_nodes == 0 else (1, 1)
    phy2log = _plan(weight, num_replicas, G, N, num_gpus, refine)
    if current is not None:
        phy2log = _choose_with_current(
            weight,
            phy2log,
            current,
            num_gpus,
            N,
            tolerance,
            refine,
            groups_on_nodes(current, E, G, torch.arange(num_replicas) // (num_replicas // N)),
        )

    log2phy, logcnt = logical_to_physical(phy2log, E)
    return phy2log, log2phy, logcnt


# --------------------------------------------------------------------------------------
# metrics and maps
# --------------------------------------------------------------------------------------


@cpu_by_default
def gpu_loads(weight_LE: torch.Tensor, phy2log_LP: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Expected load of each GPU, ``[L, W]`` float64, when each expert's load is split
    evenly over its replicas. Slots are GPU-major, ``P / W`` per GPU."""
    weight = torch.as_tensor(weight_LE).to("cpu", torch.float64)
    phy2log = torch.as_tensor(phy2log_LP).to("cpu", torch.int64)
    if weight.dim() == 1:
        weight, phy2log = weight[None], phy2log.reshape(1, -1)
    L, P = phy2log.shape
    if P % num_gpus:
        raise ValueError(f"P={P} physical slots do not split evenly over num_gpus={num_gpus}")
    cnt = torch.zeros_like(weight).scatter_add_(
        1, phy2log, torch.ones_like(phy2log, dtype=weight.dtype)
    )
    per_replica = weight / cnt.clamp(min=1)
    return per_replica.gather(1, phy2log).view(L, num_gpus, -1).sum(-1)


@cpu_by_default
def balancedness(weight_LE: torch.Tensor, phy2log_LP: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Mean GPU load / max GPU load per layer, ``[L]`` float64 (1.0 is perfect; a layer
    without load counts as 1.0)."""
    loads = gpu_loads(weight_LE, phy2log_LP, num_gpus)
    mx = loads.max(-1).values
    return torch.where(mx > 0, loads.mean(-1) / mx.clamp(min=1e-300), torch.ones_like(mx))


@cpu_by_default
def logical_to_physical(
    phy2log_LP: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Invert ``phy2log [L, P]``: returns ``log2phy [L, E, X]`` int64 (each expert's
    physical ids in increasing order, ``-1`` padded, X = the largest replica count) and
    ``logcnt [L, E]`` int64. Experts without a replica get count 0 and a row of ``-1``."""
    phy2log = torch.as_tensor(phy2log_LP).to("cpu", torch.int64)
    L, P = phy2log.shape
    E = num_experts
    logcnt = torch.zeros(L, E, dtype=torch.int64).scatter_add_(1, phy2log, torch.ones_like(phy2log))
    X = max(int(logcnt.max()) if logcnt.numel() else 1, 1)
    # Stable order of the slots by logical id keeps each expert's replicas in increasing
    # physical id; a replica's index is its position minus the expert's first position.
    order = torch.argsort(phy2log * P + torch.arange(P), dim=1)
    log_sorted = phy2log.gather(1, order)
    start = torch.cumsum(logcnt, 1) - logcnt
    rep = torch.arange(P).expand(L, P) - start.gather(1, log_sorted)
    log2phy = torch.full((L, E * X), -1, dtype=torch.int64)
    log2phy.scatter_(1, log_sorted * X + rep, order)
    return log2phy.view(L, E, X), logcnt


# --------------------------------------------------------------------------------------
# the three steps
# --------------------------------------------------------------------------------------


@cpu_by_default
def replicate_experts(
    weight_BE: torch.Tensor, num_physical: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Give ``num_physical - E`` extra replicas, one at a time, to the expert with the
    largest load per replica (ties: lowest expert id).

    Returns ``phy2log [B, num_physical]`` (experts ``0..E-1`` first, then the extra
    replicas in the order they were granted) and ``logcnt [B, E]`` int64.
    """
    weight = weight_BE.to(torch.float64)
    B, E = weight.shape
    extra = num_physical - E
    assert extra >= 0
    cnt = torch.ones(B, E, dtype=torch.int64)
    phy2log = torch.empty(B, num_physical, dtype=torch.int64)
    phy2log[:, :E] = torch.arange(E)
    rows = torch.arange(B)
    per_replica = weight.clone()
    for i in range(extra):
        hot = per_replica.argmax(-1)  # first index among ties
        phy2log[:, E + i] = hot
        cnt[rows, hot] += 1
        per_replica[rows, hot] = weight[rows, hot] / cnt[rows, hot]
    return phy2log, cnt


@cpu_by_default
def balanced_packing(
    weight_BN: torch.Tensor, num_packs: int, refine: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack N weighted items into ``num_packs`` packs of exactly ``N / num_packs`` items each,
    balancing the pack weights, independently for each of B rows.

    Greedy (longest-processing-time): items in decreasing weight, each onto the lightest
    pack with a free place. Then, with ``refine``, repeatedly swap one item of the heaviest
    pack with one item of another pack when that lowers the larger of the two; this never
    raises the heaviest pack and stops when no swap helps.

    Returns ``pack_BN`` (pack of each item) and ``rank_BN`` (its place within the pack),
    both int64 on the CPU.
    """
    w = weight_BN.detach().to("cpu", torch.float64).numpy()
    B, N = w.shape
    assert N % num_packs == 0, (N, num_packs)
    cap = N // num_packs
    if cap == 1 or num_packs == 1:
        pack = np.broadcast_to(np.arange(N) // cap, (B, N))
        rank = np.broadcast_to(np.arange(N) % cap, (B, N))
        return torch.from_numpy(pack.copy()), torch.from_numpy(rank.copy())

    order = np.argsort(-w, axis=1, kind="stable")  # heaviest first, ties by item id
    members = np.full((B, num_packs, cap), -1, dtype=np.int64)  # item id at each place
    wm = np.zeros((B, num_packs, cap))  # weight at each place
    _greedy_fill(np.take_along_axis(w, order, 1), order, members, wm)
    if refine:
        _refine_by_swaps(wm, members)

    pack = np.empty((B, N), dtype=np.int64)
    rank = np.empty((B, N), dtype=np.int64)
    flat = members.reshape(B, -1)
    np.put_along_axis(pack, flat, np.repeat(np.arange(num_packs), cap)[None].repeat(B, 0), 1)
    np.put_along_axis(rank, flat, np.tile(np.arange(cap), num_packs)[None].repeat(B, 0), 1)
    return torch.from_numpy(pack), torch.from_numpy(rank)


def _greedy_fill(
    item_w_BN: np.ndarray, item_id_BN: np.ndarray, members_BMC: np.ndarray, wm_BMC: np.ndarray
) -> None:
    """Greedy packing into the free places (``members == -1``) of partly filled packs, in
    place. Items must come in decreasing weight per row; ``item_id == -1`` marks padding,
    which must come last. Each item goes to the lightest pack that still has a free place
    (ties: lowest pack index), at its first free place. Vectorized over rows."""
    B, M, C = members_BMC.shape
    free = (members_BMC == -1).sum(-1)  # [B, M]
    load = wm_BMC.sum(-1)
    load[free == 0] = np.inf
    rows = np.arange(B)
    for j in range(item_w_BN.shape[1]):
        ids = item_id_BN[:, j]
        r = rows if (ids >= 0).all() else rows[ids >= 0]
        if r.size == 0:
            break
        p = load[r].argmin(1)
        pos = (members_BMC[r, p] == -1).argmax(1)
        members_BMC[r, p, pos] = ids[r]
        wm_BMC[r, p, pos] = item_w_BN[r, j]
        load[r, p] += item_w_BN[r, j]
        free[r, p] -= 1
        full = free[r, p] == 0
        if full.any():
            load[r[full], p[full]] = np.inf


def _refine_by_swaps(
    wm_BMC: np.ndarray, members_BMC: np.ndarray, max_iters: int | None = None
) -> None:
    """Lower the heaviest pack by pairwise swaps, in place on ``wm`` (weight of each place)
    and ``members`` (payload of each place), both ``[B, M, C]``.

    Each iteration, for every row still improving, takes the heaviest pack h and the swap
    (place i of h, place j of any other pack p) that minimises ``max(load_h - d, load_p + d)``
    with ``d = w_i - w_j``; it is applied only if that is below ``load_h`` by a relative
    margin (so float noise cannot loop). The heaviest pack never gets heavier, and the
    sorted load vector strictly improves, so it terminates; ``max_iters`` (default 4·M)
    bounds the work.
    """
    B, M, C = members_BMC.shape
    max_iters = 4 * M if max_iters is None else max_iters
    active = np.arange(B)
    for _ in range(max_iters):
        if active.size == 0:
            break
        wa = wm_BMC[active]  # [A, M, C]
        load = wa.sum(-1)  # [A, M]
        A = active.size
        ar = np.arange(A)
        h = load.argmax(1)
        lh = load[ar, h]
        wh = wa[ar, h]  # [A, C]
        d = wh[:, None, :, None] - wa[:, :, None, :]  # [A, M, C (i in h), C (j in p)]
        new_max = np.maximum(lh[:, None, None, None] - d, load[:, :, None, None] + d)
        new_max[ar, h] = np.inf
        flat = new_max.reshape(A, -1)
        best = flat.argmin(1)
        gain = flat[ar, best] < lh * (1.0 - 1e-9)
        if not gain.any():
            break
        active, h, best = active[gain], h[gain], best[gain]
        p, rem = np.divmod(best, C * C)
        i, j = np.divmod(rem, C)
        for arr in (wm_BMC, members_BMC):
            tmp = arr[active, h, i].copy()
            arr[active, h, i] = arr[active, p, j]
            arr[active, p, j] = tmp


def _plan(
    weight: torch.Tensor,
    num_physical: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    refine: bool,
) -> torch.Tensor:
    """Steps 1–3 for all layers; returns ``phy2log [L, P]`` with the slots of each GPU
    sorted by logical id."""
    L, E = weight.shape
    G, N, W, P = num_groups, num_nodes, num_gpus, num_physical
    group_size = E // G
    E_node, P_node, W_node = E // N, P // N, W // N
    c = P // W

    # 1. groups → nodes. `mlog` numbers the experts node-major: node n holds mlog ids
    #    [n·E/N, (n+1)·E/N), group by group.
    group_load = weight.view(L, G, group_size).sum(-1)
    g_node, g_rank = balanced_packing(group_load, N, refine)
    g_slot = g_node * (G // N) + g_rank  # [L, G], group's position in node-major order
    log2mlog = (g_slot[:, :, None] * group_size + torch.arange(group_size)).view(L, E)
    mlog2log = _inverse_perm(log2mlog)

    # 2. replicate within each node.
    w_mlog = weight.gather(1, mlog2log).view(L * N, E_node)
    phy2mlog, mlogcnt = replicate_experts(w_mlog, P_node)  # [L·N, P/N], [L·N, E/N]

    # 3. replicas → the node's GPUs.
    w_phy = (w_mlog / mlogcnt).gather(1, phy2mlog)
    gpu, rank = balanced_packing(w_phy, W_node, refine)
    slot = gpu * c + rank  # [L·N, P/N] position of each replica within the node
    pphy2mlog = phy2mlog.gather(1, _inverse_perm(slot))
    pphy2mlog = (pphy2mlog.view(L, N, P_node) + (torch.arange(N) * E_node)[:, None]).view(L, P)
    phy2log = mlog2log.gather(1, pphy2mlog)

    return phy2log.view(L, W, c).sort(-1).values.view(L, P)


# --------------------------------------------------------------------------------------
# migration-aware relabelling
# --------------------------------------------------------------------------------------


def groups_on_nodes(phy2log_LP: torch.Tensor, E: int, G: int, node_P: torch.Tensor) -> torch.Tensor:
    """``[L]`` bool: whether each layer's plan keeps every expert group (``E / G``
    contiguous experts) on one node, ``node_P [P]`` the node of each slot (the
    hierarchical policy's ``P / N`` contiguous slots; a placement's ranks' nodes); all
    True with one group."""
    phy2log = torch.as_tensor(phy2log_LP).to("cpu", torch.int64).reshape(-1, phy2log_LP.shape[-1])
    L, P = phy2log.shape
    if G <= 1:
        return torch.ones(L, dtype=torch.bool)
    group_LP = phy2log // (E // G)
    node_LP = node_P.to(torch.int64).expand(L, P)
    N = int(node_P.max()) + 1
    lo = torch.full((L, G), N, dtype=torch.int64).scatter_reduce(1, group_LP, node_LP, "amin")
    hi = torch.full((L, G), -1, dtype=torch.int64).scatter_reduce(1, group_LP, node_LP, "amax")
    return (lo == hi).all(1)


def _choose_with_current(
    weight: torch.Tensor,
    fresh_LP: torch.Tensor,
    cur_LP: torch.Tensor,
    W: int,
    N: int,
    tolerance: float,
    refine: bool,
    current_ok_L: torch.Tensor,
) -> torch.Tensor:
    """Per layer, pick among three plans the one that moves the fewest slots while its
    balancedness is within ``tolerance`` of the best of them:

    * the current plan (moves nothing), where it keeps the policy's groups on their nodes
      (``current_ok_L``: a plan made by another policy does not compete);
    * a warm-started plan: the fresh plan's replica counts and node composition, but every
      current slot whose expert is still wanted on that node stays where it is, the rest are
      packed greedily around them (then refined);
    * the fresh plan, relabelled to overlap the current one as much as possible.
    """
    E = weight.shape[1]
    fresh = _align_to_current(fresh_LP, cur_LP, E, W, N)
    warm = _warm_start(weight, fresh, cur_LP, W, N, refine)
    plans = torch.stack([cur_LP, warm, fresh])  # [3, L, P]
    bal = torch.stack([balancedness(weight, p, W) for p in plans])  # [3, L]
    moved = (plans != cur_LP).sum(-1).to(torch.float64)  # [3, L]
    bal[0] = torch.where(current_ok_L, bal[0], -torch.inf)
    ok = bal >= bal.max(0).values - tolerance - 1e-12
    pick = torch.where(ok, moved, torch.inf).argmin(0)  # ties: the earlier (fewer moves)
    return plans.gather(0, pick[None, :, None].expand(1, *fresh.shape))[0]


def _warm_start(
    weight: torch.Tensor, fresh_LP: torch.Tensor, cur_LP: torch.Tensor, W: int, N: int, refine: bool
) -> torch.Tensor:
    """Keep every current slot whose expert the fresh plan still places (as many times) on
    the same node, pack the missing replicas into the freed slots, refine, and put experts
    that stayed on a GPU back into their old slot. ``fresh`` must already be node-aligned."""
    L, P = fresh_LP.shape
    E = weight.shape[1]
    Wn, c = W // N, P // W
    B, S = L * N, P // N
    fr, cu = fresh_LP.reshape(B, S), cur_LP.reshape(B, S)
    cnt_new = torch.zeros(B, E, dtype=torch.int64).scatter_add_(1, fr, torch.ones_like(fr))
    per_replica = weight.repeat_interleave(N, 0) / cnt_new.clamp(min=1)  # [B, E]
    kept = _occurrence(cu, E) < cnt_new.gather(1, cu)  # [B, S]
    kept_cnt = torch.zeros_like(cnt_new).scatter_add_(1, cu, kept.long())
    need = cnt_new - kept_cnt  # replicas still to place, >= 0
    X = max(int(need.max()), 1)
    valid = torch.arange(X) < need[:, :, None]  # [B, E, X]
    item_w = torch.where(valid, per_replica[:, :, None], -torch.inf).view(B, E * X)
    item_w, order = item_w.sort(dim=1, descending=True, stable=True)
    n_items = max(int((~kept).sum(1).max()), 1)
    item_w, order = item_w[:, :n_items], order[:, :n_items]
    item_id = torch.where(torch.isfinite(item_w), order // X, -1)
    members = torch.where(kept, cu, -1).view(B, Wn, c).numpy().copy()
    wm = torch.where(kept, per_replica.gather(1, cu), 0.0).view(B, Wn, c).numpy().copy()
    _greedy_fill(item_w.numpy(), item_id.numpy(), members, wm)
    if refine:
        _refine_by_swaps(wm, members)
    members_t = torch.from_numpy(members).view(B * Wn, c)
    return _keep_slots(members_t, cu.reshape(B * Wn, c)).view(L, P)


def _occurrence(ids_BS: torch.Tensor, E: int) -> torch.Tensor:
    """For each element, how many equal elements precede it in its row, ``[B, S]``."""
    B, S = ids_BS.shape
    order = torch.argsort(ids_BS * S + torch.arange(S), dim=1)
    sorted_ids = ids_BS.gather(1, order)
    cnt = torch.zeros(B, E, dtype=torch.int64).scatter_add_(1, ids_BS, torch.ones_like(ids_BS))
    start = torch.cumsum(cnt, 1) - cnt
    occ_sorted = torch.arange(S).expand(B, S) - start.gather(1, sorted_ids)
    return torch.empty_like(ids_BS).scatter_(1, order, occ_sorted)


def _align_to_current(
    new_LP: torch.Tensor, cur_LP: torch.Tensor, E: int, W: int, N: int
) -> torch.Tensor:
    """Relabel the new plan so it moves as few slots as possible from ``cur``, without
    changing any GPU's set of experts (so its balancedness is unchanged).

    Nodes are permuted as blocks (keeping groups within nodes), then GPUs within a node,
    each by greedy maximum overlap of expert counts; then the slots within each GPU are
    permuted so that an expert already on that GPU keeps its old slot.
    """
    L, P = new_LP.shape
    c = P // W
    Wn = W // N
    if N > 1:
        cnt_new = _counts(new_LP.view(L, N, Wn * c), E)  # [L, N, E]
        cnt_cur = _counts(cur_LP.view(L, N, Wn * c), E)
        perm = _greedy_matching(cnt_new @ cnt_cur.transpose(1, 2))  # new node → cur node
        blocks = new_LP.view(L, N, Wn * c)
        out = torch.empty_like(blocks)
        out.scatter_(1, perm[:, :, None].expand_as(blocks), blocks)
        new_LP = out.view(L, P)
    # GPUs within each node.
    new_g = new_LP.view(L * N, Wn, c)
    cur_g = cur_LP.view(L * N, Wn, c)
    if Wn > 1:
        overlap = _counts(new_g, E) @ _counts(cur_g, E).transpose(1, 2)
        perm = _greedy_matching(overlap)
        out = torch.empty_like(new_g)
        out.scatter_(1, perm[:, :, None].expand_as(new_g), new_g)
        new_g = out
    # Slots within each GPU.
    new_s = new_g.reshape(-1, c)
    cur_s = cur_g.reshape(-1, c)
    return _keep_slots(new_s, cur_s).view(L, P)


def _counts(ids_BMS: torch.Tensor, E: int) -> torch.Tensor:
    """How often each expert appears in each pack: ``[B, M, E]`` float32."""
    B, M, S = ids_BMS.shape
    out = torch.zeros(B, M, E)
    return out.scatter_add_(2, ids_BMS, torch.ones(B, M, S))


def _greedy_matching(overlap_BMM: torch.Tensor) -> torch.Tensor:
    """Assign each row i (new pack) a distinct column (current pack), taking the largest
    remaining overlap first. Returns ``perm [B, M]``: new pack i goes to position perm[i]."""
    B, M, _ = overlap_BMM.shape
    ov = overlap_BMM.clone()
    perm = torch.empty(B, M, dtype=torch.int64)
    rows = torch.arange(B)
    for _ in range(M):
        flat = ov.view(B, -1).argmax(1)
        i, j = flat // M, flat % M
        perm[rows, i] = j
        ov[rows, i, :] = -1.0
        ov[rows, :, j] = -1.0
    return perm


def _keep_slots(new_BC: torch.Tensor, cur_BC: torch.Tensor) -> torch.Tensor:
    """Permute each row of ``new`` so that experts also present in the same row of ``cur``
    stay at their ``cur`` slot (respecting multiplicity); the rest fill the free slots in
    order."""
    B, C = new_BC.shape
    earlier = torch.ones(C, C, dtype=torch.bool).tril(-1)  # [s, s'] : s' < s
    # occurrence index of each element among equal earlier elements of its row
    occ_cur = ((cur_BC[:, :, None] == cur_BC[:, None, :]) & earlier).sum(-1)
    occ_new = ((new_BC[:, :, None] == new_BC[:, None, :]) & earlier).sum(-1)
    n_in_new = (cur_BC[:, :, None] == new_BC[:, None, :]).sum(-1)  # count of cur[s] in new
    n_in_cur = (new_BC[:, :, None] == cur_BC[:, None, :]).sum(-1)  # count of new[i] in cur
    n_in_new_self = (new_BC[:, :, None] == new_BC[:, None, :]).sum(-1)
    keep = occ_cur < n_in_new  # slot s keeps its expert
    used = occ_new < torch.minimum(n_in_cur, n_in_new_self)  # new item i is a kept one
    free_slots = torch.argsort(keep.to(torch.int8), dim=1, stable=True)
    unused = torch.argsort(used.to(torch.int8), dim=1, stable=True)
    out = torch.empty_like(new_BC)
    out.scatter_(1, free_slots, new_BC.gather(1, unused))
    return torch.where(keep, cur_BC, out)


# --------------------------------------------------------------------------------------
# validation and small helpers
# --------------------------------------------------------------------------------------


def _inverse_perm(perm_BN: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm_BN)
    return inv.scatter_(1, perm_BN, torch.arange(perm_BN.shape[1]).expand_as(perm_BN).contiguous())


def check_tolerance(tolerance) -> float:
    """``tolerance`` as a float, refused (naming it) unless a real number in [0, 1]."""
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)):
        raise TypeError(
            f"tolerance must be a float in [0, 1] (a balancedness margin), got {tolerance!r}"
        )
    if not 0.0 <= tolerance <= 1.0:
        raise ValueError(f"tolerance must be in [0, 1] (a balancedness margin), got {tolerance}")
    return float(tolerance)


def _check_weight(weight_LE: torch.Tensor) -> torch.Tensor:
    weight = torch.as_tensor(weight_LE)
    if weight.dim() != 2 or weight.shape[1] == 0:
        raise ValueError(
            f"weight must be [L, E] (one row of expert load per layer), got shape "
            f"{tuple(weight.shape)}; pass weight[None] for a single layer"
        )
    if weight.is_complex() or weight.dtype == torch.bool:
        raise TypeError(f"weight must be a real tensor, got {weight.dtype}")
    weight = weight.detach().to("cpu", torch.float64)
    if not torch.isfinite(weight).all() or (weight < 0).any():
        raise ValueError("weight must be finite and non-negative (expert token counts)")
    empty = weight.sum(1) == 0
    if empty.any():
        weight = torch.where(empty[:, None], torch.ones_like(weight), weight)
    return weight.contiguous()


def _check_config(E: int, P: int, G: int, N: int, W: int) -> None:
    for name, v in (("num_replicas", P), ("num_groups", G), ("num_nodes", N), ("num_gpus", W)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if P < E:
        raise ValueError(f"num_replicas={P} must be at least the number of experts E={E}")
    if P % W:
        lo, hi = (P // W) * W, (P // W + 1) * W
        ok = ", ".join(str(x) for x in (lo, hi) if x >= E)
        raise ValueError(
            f"num_replicas={P} must be a multiple of num_gpus={W} (equal slots per GPU); use {ok}"
        )
    if W % N:
        raise ValueError(f"num_gpus={W} must be a multiple of num_nodes={N}")
    if E % G:
        raise ValueError(f"num_groups={G} must divide the number of experts E={E}")


def _check_phy2log(phy2log: torch.Tensor, L: int, P: int, E: int, name: str) -> torch.Tensor:
    t = torch.as_tensor(phy2log)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    t = t.detach().to("cpu", torch.int64)
    if t.shape != (L, P):
        raise ValueError(f"{name} must be [L={L}, P={P}], got {tuple(t.shape)}")
    if ((t < 0) | (t >= E)).any():
        raise ValueError(f"{name} holds ids outside [0, {E})")
    cnt = torch.zeros(L, E, dtype=torch.int64).scatter_add_(1, t, torch.ones_like(t))
    if (cnt == 0).any():
        layer, expert = (cnt == 0).nonzero()[0].tolist()
        raise ValueError(f"{name}: expert {expert} has no replica in layer {layer}")
    return t.contiguous()
