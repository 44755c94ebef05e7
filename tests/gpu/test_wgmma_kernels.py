"""GPU tier of the Hopper (sm_90) Gluon kernels of the Standard layout (``kernel="wgmma"``
configs): bf16 and FP8 (block and per-expert scales) against the float64 oracle, rows on
both sides of every tile boundary, equal to the portable kernels, CUDA-graph capture, and
clear errors where they cannot run.

Tolerances (relative, ‖out − ref‖ / ‖ref‖): bf16 2e-2 and FP8 6e-2
(``epmoe.reference.TOLERANCES``). Shape legend: R rows · H hidden · I intermediate ·
e local experts · K top-k.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from epmoe.reference import (
    TOLERANCES,
    assert_close,
    dequantize_block,
    expert_mlp,
    moe,
    quantize_block,
    quantize_groups,
)

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU too; conftest skips the gpu mark
    pytest.skip("needs CUDA", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the wgmma kernels need an sm_90 GPU", allow_module_level=True)

from epmoe.kernels import configs, ops  # noqa: E402
from epmoe.kernels.configs import GemmConfig, MoEConfig  # noqa: E402

DEV = torch.device("cuda")
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
G = GemmConfig


# one partition; warp-specialised; warp-specialised with three MMA warpgroups (192 rows)
KERNELS = ["wgmma", "wgmma_ws", "wgmma_ws-192"]
WGMMA = {}
for _dtype in ("bf16", "fp8"):
    WGMMA[_dtype, "wgmma"] = configs.wgmma_config(_dtype, "wgmma")
    WGMMA[_dtype, "wgmma_ws"] = configs.wgmma_config(_dtype, "wgmma_ws")
    WGMMA[_dtype, "wgmma_ws-192"] = configs.wgmma_config(_dtype, "wgmma_ws", 192)
WS = ["wgmma_ws", "wgmma_ws-192"]
DOT = {
    "fp8": MoEConfig(128, G(128, 128, 8, 8, 3), G(128, 128, 8, 8, 4)),
    "bf16": MoEConfig(128, G(128, 64, 8, 8, 4), G(256, 64, 8, 8, 3)),
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _weights(dtype: str, e: int, H: int, I: int, seed: int, per_expert: bool = False):
    """Kernel weights ``(w13, w2, w13_scale, w2_scale)`` and the oracle's float64 ones."""
    g = _gen(seed)
    w13 = torch.randn(e, 2 * I, H, generator=g, device=DEV) * H**-0.5
    w2 = torch.randn(e, H, I, generator=g, device=DEV) * I**-0.5
    if dtype == "fp8":
        (q13, s13), (q2, s2) = (quantize_block(w, per_matrix=per_expert) for w in (w13, w2))
        ref = dequantize_block(q13, s13).double(), dequantize_block(q2, s2).double()
        return (q13, q2, s13, s2), ref
    return (w13.to(BF16), w2.to(BF16), None, None), (w13.to(BF16).double(), w2.to(BF16).double())


def _ids(R: int, K: int, e: int, E: int, seed: int) -> torch.Tensor:
    ids = torch.rand(R, E, generator=_gen(seed), device=DEV).argsort(dim=1)[:, :K]
    return torch.where(ids < e, ids, -1)


def _run(x, ids, w, weights, cfg, x_scale=None):
    q13, q2, s13, s2 = weights
    return ops.fused_moe_standard(
        x, ids, w, q13, q2, hidden_scale=x_scale, w13_scale=s13, w2_scale=s2, config=cfg
    )


def _capture(fn):
    """``fn()`` captured in a CUDA graph on a side stream: ``(graph, its output)``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = fn()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, out


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("half_tail", [False, True], ids=["one-height", "half-tails"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_every_tile_boundary(dtype, half_tail, kernel):
    """Experts with rows on both sides of every tile boundary (K = 1) at DeepSeek-V3's H
    and I, with and without half-height tail tiles: against the oracle, and equal to the
    portable kernels up to rounding."""
    counts = [0, 1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 300, 384, 385]
    e, H, I = len(counts), 7168, 2048
    weights, (w13d, w2d) = _weights(dtype, e, H, I, seed=1)
    ids = torch.repeat_interleave(torch.arange(e, device=DEV), torch.tensor(counts, device=DEV))
    R = ids.numel()
    ids = ids[torch.randperm(R, generator=_gen(2), device=DEV)][:, None]
    x = torch.randn(R, H, generator=_gen(3), device=DEV).to(BF16)
    w = torch.rand(R, 1, generator=_gen(4), device=DEV) + 0.1
    cfg = dataclasses.replace(WGMMA[dtype, kernel], half_tail=half_tail)
    out = _run(x, ids, w, weights, cfg)
    ref = moe(x.double(), w13d, w2d, w, ids)
    rtol = TOLERANCES[FP8 if dtype == "fp8" else BF16]
    # row by row as well: among R = 2733 rows one wrong row moves the whole by 1/√R
    assert_close(out, ref, rtol, name=f"wgmma {dtype}", row_rtol=rtol)
    portable = _run(x, ids, w, weights, DOT[dtype])
    assert_close(out, portable, rtol / 4, name=f"wgmma vs dot {dtype}", row_rtol=rtol / 2)


@pytest.mark.parametrize("kernel", WS)
@pytest.mark.parametrize("programs", [1, 3, 7])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_persistent_programs_walk_many_tiles(dtype, programs, kernel, monkeypatch):
    """``wgmma_ws`` is persistent: with a handful of programs each walks dozens of tiles
    (full and half-height blocks, stage phases carried across tiles) and the output
    is bit-identical to one program per tile."""
    counts = [0, 1, 63, 64, 65, 127, 128, 129, 192, 193, 255, 256, 300, 385]
    e, H, I = len(counts), 1024, 512
    weights, _ = _weights(dtype, e, H, I, seed=11)
    ids = torch.repeat_interleave(torch.arange(e, device=DEV), torch.tensor(counts, device=DEV))
    R = ids.numel()
    ids = ids[torch.randperm(R, generator=_gen(12), device=DEV)][:, None]
    x = torch.randn(R, H, generator=_gen(13), device=DEV).to(BF16)
    w = torch.rand(R, 1, generator=_gen(14), device=DEV) + 0.1
    cfg = WGMMA[dtype, kernel]
    monkeypatch.setattr(ops, "_ws_programs", lambda tiles, device: tiles)
    one_per_tile = _run(x, ids, w, weights, cfg)
    monkeypatch.setattr(ops, "_ws_programs", lambda tiles, device: min(tiles, programs))
    persistent = _run(x, ids, w, weights, cfg)
    torch.cuda.synchronize()
    assert torch.equal(persistent, one_per_tile)


@pytest.mark.parametrize("kernel", WS)
@pytest.mark.parametrize("programs", [3, None], ids=["3-programs", "per-SM"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_ws_leaves_its_tile_counter_at_zero(dtype, programs, kernel, monkeypatch):
    """``wgmma_ws`` claims tiles from a counter in the aligned pairs (zeroed by
    ``align_pairs``, no memset per launch); the launch's last claim leaves it at zero, so
    GEMMs run again on the same aligned pairs give the same output."""
    counts = [0, 1, 63, 64, 65, 127, 128, 129, 192, 255, 256, 300]
    e, H, I = len(counts), 1024, 512
    (q13, q2, s13, s2), _ = _weights(dtype, e, H, I, seed=71)
    ids = torch.repeat_interleave(torch.arange(e, device=DEV), torch.tensor(counts, device=DEV))
    R = ids.numel()
    ids = ids[torch.randperm(R, generator=_gen(72), device=DEV)][:, None]
    x = torch.randn(R, H, generator=_gen(73), device=DEV).to(BF16)
    xs = None
    if dtype == "fp8":
        x, xs = quantize_groups(x)
    w = torch.rand(R, 1, generator=_gen(74), device=DEV) + 0.1
    cfg = WGMMA[dtype, kernel]
    if programs is not None:
        monkeypatch.setattr(ops, "_ws_programs", lambda tiles, device: min(tiles, programs))
    aligned = ops.align_for(ids, e, cfg)
    outs = []
    for _ in range(3):
        y, ys = ops.gate_up(x, q13, aligned, cfg, "silu", xs, s13)
        outs.append(ops.down(y, q2, aligned, cfg, BF16, ys, s2, w))
        torch.cuda.synchronize()
        assert aligned.tile_counters.tolist() == [0, 0]
    keep = aligned.sorted_pairs[: int(aligned.num_padded)] < R  # positions holding a pair
    for out in outs[1:]:
        assert torch.equal(out[: keep.numel()][keep], outs[0][: keep.numel()][keep])


@pytest.mark.parametrize(
    "kernel,programs",
    [
        ("wgmma", None),
        ("wgmma_ws", 1),
        ("wgmma_ws", 3),
        ("wgmma_ws", None),
        ("wgmma_ws-192", 3),
        ("wgmma_ws-192", None),
    ],
    ids=["wgmma", "ws-1-program", "ws-3-programs", "ws-per-SM", "ws192-3", "ws192-per-SM"],
)
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_k_steps_not_a_multiple_of_the_stages(dtype, kernel, programs, monkeypatch):
    """H = 1280 and I = 384: GEMM 1 has 10 (FP8) or 20 (bf16) K steps, GEMM 2 3 or 6, so
    tiles start mid-ring and GEMM 2 has fewer steps than stages (4): against the oracle,
    with the persistent grid of a handful of programs and of one per SM."""
    if programs is not None:
        monkeypatch.setattr(ops, "_ws_programs", lambda tiles, device: min(tiles, programs))
    R, K, e, E, H, I = 300, 4, 6, 8, 1280, 384
    weights, (w13d, w2d) = _weights(dtype, e, H, I, seed=21)
    x = torch.randn(R, H, generator=_gen(22), device=DEV).to(BF16)
    ids, w = _ids(R, K, e, E, seed=23), torch.rand(R, K, generator=_gen(24), device=DEV)
    out = _run(x, ids, w, weights, WGMMA[dtype, kernel])
    rtol = TOLERANCES[FP8 if dtype == "fp8" else BF16]
    assert_close(out, moe(x.double(), w13d, w2d, w, ids), rtol, name=f"{dtype} short K")


def _batched(x, counts, weights, cfg, x_scale=None, row_index=None):
    q13, q2, s13, s2 = weights
    return ops.fused_moe_batched(
        x, counts, q13, q2, hidden_scale=x_scale, w13_scale=s13, w2_scale=s2, config=cfg,
        row_index_eC=row_index,
    )  # fmt: skip


@pytest.mark.parametrize("programs", [3, None], ids=["3-programs", "per-SM"])
@pytest.mark.parametrize(
    "rows,kernel",
    [
        ("slab", "wgmma_ws"),
        ("index", "wgmma_ws"),
        ("slab", "wgmma_ws-192"),
        ("index", "wgmma_ws-192"),
    ],
    ids=["slabs", "row-index", "slabs-192", "row-index-192"],
)
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_expert_batched_on_ws(dtype, rows, kernel, programs, monkeypatch):
    """ExpertBatched (decode) on ``wgmma_ws``: the block table built on the device from the
    counts (above C counts as C), slabs read in place or rows through a row index (what
    ``symm_ll`` delivers), counts across every tile boundary: against the oracle per valid
    row, and equal up to rounding to the portable kernels."""
    C, H, I = 320, 7168, 2048
    counts_l = [0, 1, 63, 64, 65, 127, 128, 129, 256, C, 7, 999]  # 999: clamped to C
    e = len(counts_l)
    weights, (w13d, w2d) = _weights(dtype, e, H, I, seed=31)
    counts = torch.tensor(counts_l, dtype=torch.int32, device=DEV)
    x = torch.randn(e, C, H, generator=_gen(32), device=DEV).to(BF16)
    x_scale, xin, xd = None, x, x.double()
    if dtype == "fp8":  # the oracle gets what the kernels see
        xin, x_scale = quantize_groups(x)
        xd = xin.double() * x_scale.double().repeat_interleave(128, dim=-1)
    cfg = WGMMA[dtype, kernel]
    if programs is not None:
        monkeypatch.setattr(ops, "_ws_programs", lambda tiles, device: min(tiles, programs))
    if rows == "index":  # the received rows in another order, found through the index
        perm = torch.randperm(e * C, generator=_gen(33), device=DEV)
        received = torch.empty_like(xin.view(e * C, H))
        received[perm] = xin.view(e * C, H)
        row_index = perm.view(e, C).to(torch.int32)
        rs = None
        if x_scale is not None:
            rs = torch.empty_like(x_scale.view(e * C, -1))
            rs[perm] = x_scale.view(e * C, -1)
        out = _batched(received, counts, weights, cfg, rs, row_index)
    else:
        out = _batched(xin, counts, weights, cfg, x_scale)
    portable = _batched(xin, counts, weights, DOT[dtype], x_scale)
    rtol = TOLERANCES[FP8 if dtype == "fp8" else BF16]
    for i, n in enumerate(min(c, C) for c in counts_l):
        if n:
            ref = expert_mlp(xd[i, :n], w13d[i], w2d[i])
            assert_close(out[i, :n], ref, rtol, name=f"{dtype} {rows} expert {i}")
            assert_close(out[i, :n], portable[i, :n], rtol / 4, name=f"vs dot, expert {i}")


@pytest.mark.parametrize("kernel", WS)
def test_expert_batched_ws_replays_in_a_graph_with_new_counts(kernel):
    """The decode layer on ``wgmma_ws`` in a CUDA graph: new counts and rows written in
    place are picked up at every replay (the block table is rebuilt on the device)."""
    e, C, H, I = 16, 256, 1024, 512
    weights, _ = _weights("fp8", e, H, I, seed=41)
    cfg = WGMMA["fp8", kernel]
    xq, xs = quantize_groups(torch.randn(e, C, H, generator=_gen(42), device=DEV).to(BF16))
    counts = torch.randint(0, C + 1, (e,), generator=_gen(43), device=DEV, dtype=torch.int32)
    _batched(xq, counts, weights, cfg, xs)  # compile outside the capture
    torch.cuda.synchronize()
    graph, out_graph = _capture(lambda: _batched(xq, counts, weights, cfg, xs))
    for step in range(3):
        q, s = quantize_groups(torch.randn(e, C, H, generator=_gen(50 + step), device=DEV).to(BF16))
        xq.copy_(q)
        xs.copy_(s)
        counts.copy_(torch.randint(0, C + 1, (e,), generator=_gen(60 + step), device=DEV))
        graph.replay()
        eager = _batched(xq, counts, weights, cfg, xs)
        torch.cuda.synchronize()
        for i, n in enumerate(counts.tolist()):
            assert torch.equal(out_graph[i, :n], eager[i, :n]), f"step {step} expert {i}"


@pytest.mark.parametrize("kernel", KERNELS)
def test_no_local_pairs_gives_zeros(kernel):
    """Every pair routed to another rank's experts: no row block is in use, the programs
    find no tile, and the output is zero (no hang, no stale rows)."""
    R, K, e, H, I = 64, 8, 4, 1024, 256
    weights, _ = _weights("bf16", e, H, I, seed=25)
    x = torch.randn(R, H, generator=_gen(26), device=DEV).to(BF16)
    ids = torch.full((R, K), -1, dtype=torch.int64, device=DEV)
    w = torch.rand(R, K, generator=_gen(27), device=DEV)
    out = _run(x, ids, w, weights, WGMMA["bf16", kernel])
    torch.cuda.synchronize()
    assert out.shape == (R, H) and not out.any()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("half_tail", [False, True], ids=["one-height", "half-tails"])
@pytest.mark.parametrize("fp8_input", [False, True], ids=["bf16-in", "fp8-in"])
@pytest.mark.parametrize("per_expert", [False, True], ids=["block-scales", "per-expert-scales"])
@pytest.mark.parametrize(
    "R,K,e,E,H,I",
    [
        pytest.param(300, 8, 16, 32, 1024, 512, id="EP-half-local"),
        pytest.param(512, 8, 8, 256, 7168, 2048, id="deepseek-shape"),
    ],
)
def test_fp8_top_k(R, K, e, E, H, I, per_expert, fp8_input, half_tail, kernel):
    """Top-K routing over E experts, e of them local (the Standard layout's gather)."""
    cfg = dataclasses.replace(WGMMA["fp8", kernel], half_tail=half_tail)
    weights, (w13d, w2d) = _weights("fp8", e, H, I, seed=R + e, per_expert=per_expert)
    x = torch.randn(R, H, generator=_gen(R), device=DEV).to(BF16)
    ids = _ids(R, K, e, E, seed=R + 1)
    w = torch.rand(R, K, generator=_gen(R + 2), device=DEV)
    if fp8_input:
        xq, xs = quantize_groups(x)
        out = _run(xq, ids, w, weights, cfg, xs)
    else:
        out = _run(x, ids, w, weights, cfg)
    ref = moe(x.double(), w13d, w2d, w, ids)
    assert out.dtype == BF16
    assert_close(out, ref, TOLERANCES[FP8], name="wgmma fp8 top-k")


@pytest.mark.parametrize("kernel", KERNELS)
def test_bf16_top_k_and_graph_replay(kernel):
    """bf16 with top-8 routing, then the same layer captured in a CUDA graph and replayed
    on new inputs and routes written in place (no host synchronisation)."""
    R, K, e, E, H, I = 256, 8, 8, 64, 2048, 768
    weights, (w13d, w2d) = _weights("bf16", e, H, I, seed=5)
    x = torch.randn(R, H, generator=_gen(6), device=DEV).to(BF16)
    ids, w = _ids(R, K, e, E, seed=7), torch.rand(R, K, generator=_gen(8), device=DEV)
    out = _run(x, ids, w, weights, WGMMA["bf16", kernel])
    assert_close(out, moe(x.double(), w13d, w2d, w, ids), TOLERANCES[BF16], name="bf16")

    graph, out_graph = _capture(lambda: _run(x, ids, w, weights, WGMMA["bf16", kernel]))
    for step in range(2):
        x.copy_(torch.randn(R, H, generator=_gen(10 + step), device=DEV).to(BF16))
        ids.copy_(_ids(R, K, e, E, seed=20 + step))
        graph.replay()
        eager = _run(x, ids, w, weights, WGMMA["bf16", kernel])
        torch.cuda.synchronize()
        assert torch.equal(out_graph, eager), f"replay {step}"


@pytest.mark.parametrize("kernel", KERNELS)
def test_unsupported_cases_name_the_fix(kernel):
    """Shapes the kernels cannot tile, the ExpertBatched layout on ``wgmma`` and slabs
    that are not one matrix on ``wgmma_ws`` are refused with the reason (never a wrong
    answer)."""
    e, H, I, R = 2, 1000, 256, 16
    weights, _ = _weights("bf16", e, H, I, seed=9)
    x = torch.randn(R, H, device=DEV).to(BF16)
    ids = torch.zeros(R, 1, dtype=torch.int64, device=DEV)
    w = torch.ones(R, 1, device=DEV)
    with pytest.raises(ValueError, match=f"kernel='{WGMMA['bf16', kernel].kernel}'.*multiple of"):
        _run(x, ids, w, weights, WGMMA["bf16", kernel])
    q13, q2, _, _ = _weights("bf16", e, 1024, I, seed=9)[0]
    counts = torch.tensor([3, 0], dtype=torch.int32, device=DEV)
    xb = torch.randn(e, 8, 1024, device=DEV).to(BF16)
    if kernel == "wgmma":
        with pytest.raises(ValueError, match="Standard layout only.*'wgmma_ws'"):
            ops.fused_moe_batched(xb, counts, q13, q2, config=WGMMA["bf16", kernel])
    else:
        gappy = torch.randn(e, 16, 1024, device=DEV).to(BF16)[:, :8]
        with pytest.raises(ValueError, match=r"one \[e·C, K\] matrix.*contiguous\(\)"):
            ops.fused_moe_batched(gappy, counts, q13, q2, config=WGMMA["bf16", kernel])


def test_ws_refuses_experts_that_are_not_stacked_and_wgmma_runs_them():
    """``wgmma_ws`` reads the weights through one TMA descriptor over ``[e·N_w, K]``:
    experts sliced out of a wider tensor are refused with the fix; ``wgmma`` runs them."""
    e, H, I, R = 4, 1024, 256, 64
    (q13, q2, _, _), (w13d, w2d) = _weights("bf16", e, H, I, seed=15)
    wide = torch.zeros(e, 2 * I + 64, H, dtype=BF16, device=DEV)
    wide[:, : 2 * I] = q13
    sliced = wide[:, : 2 * I]  # rows of expert i + 1 do not follow expert i's
    x = torch.randn(R, H, generator=_gen(16), device=DEV).to(BF16)
    ids = _ids(R, 2, e, e, seed=17)
    w = torch.rand(R, 2, generator=_gen(18), device=DEV)
    with pytest.raises(ValueError, match=r"kernel='wgmma_ws'.*TMA.*contiguous\(\)"):
        _run(x, ids, w, (sliced, q2, None, None), WGMMA["bf16", "wgmma_ws"])
    out = _run(x, ids, w, (sliced, q2, None, None), WGMMA["bf16", "wgmma"])
    assert_close(out, moe(x.double(), w13d, w2d, w, ids), TOLERANCES[BF16], name="sliced")
    # a config chosen by shape (table, autotuner) gives way instead of raising
    assert not ops._hopper_fits(WGMMA["bf16", "wgmma_ws"], x, sliced, q2)
    assert ops._hopper_fits(WGMMA["bf16", "wgmma"], x, sliced, q2)
    assert ops._hopper_fits(WGMMA["bf16", "wgmma_ws"], x, q13, q2)


@pytest.mark.parametrize("order", ["ws-then-dot", "dot-then-ws"])
def test_fp8_scales_cross_between_kernels(order):
    """GEMM 1's FP8 output scales are a group-major view on ``wgmma_ws`` and row-major on
    ``tl.dot``: either GEMM 2 reads either (both take strides), GEMM by GEMM through
    ``ops.gate_up`` / ``ops.down`` with configs that share the row alignment."""
    R, K, e, E, H, I = 300, 8, 16, 32, 1024, 512
    weights, (w13d, w2d) = _weights("fp8", e, H, I, seed=101)
    q13, q2, s13, s2 = weights
    x = torch.randn(R, H, generator=_gen(102), device=DEV).to(BF16)
    xq, xs = quantize_groups(x)
    ids, w = _ids(R, K, e, E, seed=103), torch.rand(R, K, generator=_gen(104), device=DEV)
    ws, dot = WGMMA["fp8", "wgmma_ws"], dataclasses.replace(DOT["fp8"], half_tail=True)
    assert (ws.block_m, ws.pad_m) == (dot.block_m, dot.pad_m)
    first, second = (ws, dot) if order == "ws-then-dot" else (dot, ws)
    aligned = ops.align_for(ids, e, ws)
    y, ys = ops.gate_up(xq, q13, aligned, first, "silu", xs, s13)
    z = ops.down(y, q2, aligned, second, BF16, ys, s2, w)
    out = ops.sum_topk(z, aligned, BF16)
    assert_close(out, moe(x.double(), w13d, w2d, w, ids), TOLERANCES[FP8], name=order)


@pytest.mark.parametrize("kernel", ["wgmma", "wgmma_ws", "wgmma_ws-192"])
def test_fp8_column_major_input_scales_give_the_same_output(kernel):
    """The Hopper kernels read the input's FP8 group scales through their strides: scales
    laid out column-major (as some producers write them) give bit-identical output."""
    R, K, e, E, H, I = 256, 8, 8, 16, 1024, 512
    weights, _ = _weights("fp8", e, H, I, seed=111)
    xq, xs = quantize_groups(torch.randn(R, H, generator=_gen(112), device=DEV).to(BF16))
    ids, w = _ids(R, K, e, E, seed=113), torch.rand(R, K, generator=_gen(114), device=DEV)
    column_major = xs.T.contiguous().T
    assert column_major.stride() == (1, R) and torch.equal(column_major, xs)
    cfg = WGMMA["fp8", kernel]
    out = _run(xq, ids, w, weights, cfg, xs)
    assert torch.equal(_run(xq, ids, w, weights, cfg, column_major), out)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_192_row_tiles_on_slabs_smaller_than_one_box(dtype):
    """ExpertBatched on 192-row tiles with ``e·C`` = 32 rows in all, fewer than one 64-row
    TMA box: the box reads past the slabs as zeros, the rows it computes there are never
    stored, and the valid rows match the oracle."""
    e, C, H, I = 2, 16, 1024, 512
    weights, (w13d, w2d) = _weights(dtype, e, H, I, seed=121)
    x = torch.randn(e, C, H, generator=_gen(122), device=DEV).to(BF16)
    counts = torch.tensor([16, 5], dtype=torch.int32, device=DEV)
    xin, xs, xd = x, None, x.double()
    if dtype == "fp8":
        xin, xs = quantize_groups(x)
        xd = xin.double() * xs.double().repeat_interleave(128, dim=-1)
    out = _batched(xin, counts, weights, WGMMA[dtype, "wgmma_ws-192"], xs)
    rtol = TOLERANCES[FP8 if dtype == "fp8" else BF16]
    for i, n in enumerate(counts.tolist()):
        ref = expert_mlp(xd[i, :n], w13d[i], w2d[i])
        assert_close(out[i, :n], ref, rtol, name=f"{dtype} expert {i}")


@pytest.mark.parametrize("kernel", ["dot", *KERNELS])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_atomic_reduce_sums_the_pairs_in_gemm2(dtype, kernel):
    """``atomic_reduce``: GEMM 2 adds each pair's weighted row into its token's row (bf16
    atomics, arrival order). Top-8 at DeepSeek-V3's H and I with a third of the rows
    without a local expert: against the oracle, within a few roundings of the separate fp32
    sum, rows without a local pair exactly zero, and in a CUDA graph replayed on new routes."""
    R, K, e, E, H, I = 384, 8, 16, 64, 7168, 2048
    weights, (w13d, w2d) = _weights(dtype, e, H, I, seed=131)
    x = torch.randn(R, H, generator=_gen(132), device=DEV).to(BF16)
    ids, w = _ids(R, K, e, E, seed=133), torch.rand(R, K, generator=_gen(134), device=DEV)
    ids[::3] = -1
    summed = DOT[dtype] if kernel == "dot" else WGMMA[dtype, kernel]
    cfg = dataclasses.replace(summed, atomic_reduce=True)
    out = _run(x, ids, w, weights, cfg)
    rtol = TOLERANCES[FP8 if dtype == "fp8" else BF16]
    assert out.shape == (R, H) and out.dtype == BF16
    assert_close(out, moe(x.double(), w13d, w2d, w, ids), rtol, name=f"{dtype} atomic sum")
    assert_close(out, _run(x, ids, w, weights, summed), 1e-2, name="atomic vs fp32 sum")
    assert not out[::3].any(), "rows without a local pair must be zero"

    graph, out_graph = _capture(lambda: _run(x, ids, w, weights, cfg))
    ids.copy_(_ids(R, K, e, E, seed=135))
    ids[1::3] = -1
    ref = moe(x.double(), w13d, w2d, w, ids)
    for replay in range(2):  # (the output is zeroed inside the graph: no sums carried over)
        graph.replay()
        name = f"{dtype} atomic sum, replay {replay} on new routes"
        assert_close(out_graph, ref, rtol, name=name)
        assert not out_graph[1::3].any(), name
