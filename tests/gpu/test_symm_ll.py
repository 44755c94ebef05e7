"""``symm_ll`` conformance on GPUs (NCCL ranks, one GPU each; W = 1 and 2).

Exact dispatch (tokens encode their source rank and index), combine against the oracle in
bf16 and FP8, zero-token ranks, all tokens to one expert, T = M_max, two results in
flight, CUDA-graph replays with changing routing, EPMoE end to end with Triton experts,
and a rank that skips a call (a bounded wait that names the missing rank).

Run in the GPU tier: ``EPMOE_TEST_DEVICE=cuda python -m pytest tests/gpu/test_symm_ll.py``.
"""

from __future__ import annotations

import itertools
import os
import re

import pytest
import torch

if not torch.cuda.is_available():  # collected on CPU too; conftest skips the gpu mark
    pytest.skip("needs CUDA", allow_module_level=True)

import epmoe  # noqa: E402
from epmoe.agreement import PreviousStepDiffers  # noqa: E402
from epmoe.bench.comm import wire_spec  # noqa: E402
from epmoe.comm import backend_class, create_backend  # noqa: E402
from epmoe.comm.base import FP8_DTYPE, Layout  # noqa: E402
from epmoe.reference import TOLERANCES, assert_close, quantize_groups  # noqa: E402
from tests.harness import Sweep, requires_world, run_on_ranks, world_ids, world_sizes  # noqa: E402

WORLDS = world_sizes([1, 2])  # EPMOE_TEST_WORLDS=4,8 on larger machines

pytestmark = pytest.mark.gpu

H, E, K, I, M = 384, 16, 4, 128, 32  # H: three FP8 groups, a partial copy step


def _spec(placement, dev, fp8=False, dtype=torch.bfloat16, M_max=M):
    return wire_spec(H, K, placement, M_max, dtype, dev, FP8_DTYPE if fp8 else dtype)


def _routing(rank, T, g, one_expert=None):
    if one_expert is not None:
        ids = torch.full((T, K), -1, dtype=torch.int64)
        ids[:, 0] = one_expert
        return ids
    return torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]


def exact_dispatch(rank, world):
    """Every (token, expert) pair lands once in its expert's rows; combine of the identity
    expert gives back the token (weights sum to 1). bf16 and FP8 on the wire; received
    rows read in place (the default) and copied into slabs."""
    dev = torch.device("cuda", torch.cuda.current_device())
    placement = epmoe.ExpertPlacement.linear(E, world)
    lo, hi = placement.rank_offsets[rank], placement.rank_offsets[rank + 1]
    sweep = Sweep()
    cases = {"T=11": 11, "T=0 on rank 1": 0 if rank == 1 else 7, "T=M_max": M}
    for fp8, in_place in itertools.product((False, True), (True, False)):
        spec = _spec(placement, dev, fp8)
        comm = backend_class("symm_ll")(spec, None, Layout.EXPERT_BATCHED, rows_in_place=in_place)
        for name, T in cases.items():
            for one in (None, E - 1):
                with sweep.case(f"{name} fp8={fp8} one_expert={one} in_place={in_place}"):
                    g = torch.Generator().manual_seed(100 * rank + T)
                    ids = _routing(rank, T, g, one)
                    w = torch.softmax(torch.randn(T, K, generator=g), -1)
                    w = torch.where(ids >= 0, w, 0.0)
                    w = w / w.sum(1, keepdim=True).clamp(min=1e-6)
                    x = _encode(rank, torch.randn(T, H, generator=g)).to(dev, torch.bfloat16)
                    everyone = [None] * world
                    torch.distributed.all_gather_object(everyone, (ids, x.cpu()))
                    res = comm.dispatch(x, ids.to(dev), w.to(dev))
                    # combine first (the identity expert), check afterwards: a failing
                    # check must not leave a dispatch uncombined on one rank only
                    assert (res.row_index is not None) == in_place
                    hidden, scale = res.expert_rows()  # (gathered: copies)
                    hidden, counts = hidden.clone(), res.counts.cpu().tolist()
                    scale = None if scale is None else scale.clone()
                    hid = hidden.float()
                    if fp8:
                        hid = hid * scale.repeat_interleave(128, -1)[..., :H]
                    out = comm.combine(hid.to(torch.bfloat16).contiguous(), res)
                    for slot in range(hi - lo):
                        rows = hid[slot, : counts[slot]].cpu()
                        got = sorted(_decode(r) for r in rows)
                        want = sorted(
                            (src, t)
                            for src, (sids, _) in enumerate(everyone)
                            for t in range(sids.shape[0])
                            if lo + slot in sids[t].tolist()
                        )
                        assert got == want, (slot, got, want)
                        if fp8:  # bit-exact against the torch quantizer of the source rows
                            for r in range(counts[slot]):
                                src, t = got_pair = _decode(rows[r])
                                q, s = quantize_groups(everyone[src][1][t : t + 1].float())
                                assert torch.equal(
                                    hidden[slot, r].cpu().view(torch.uint8), q[0].view(torch.uint8)
                                ), got_pair
                                assert torch.equal(scale[slot, r].cpu(), s[0]), got_pair
                    # what the identity expert returned: FP8 rows dequantized, in bf16 (a
                    # third rounding, beyond the two assert_rows_close allows, if not counted)
                    want_x = x.float() if not fp8 else _dequant(x).bfloat16().float()
                    assert out.shape == (T, H) and out.dtype == torch.bfloat16
                    assert_rows_close(out, want_x, f"rank {rank}")
        comm.check()
        comm.close()
    sweep.check()
    return sweep.passed


def assert_rows_close(out_TH: torch.Tensor, want_TH: torch.Tensor, name: str) -> None:
    """A combine's bf16 output against its tokens (the rows its experts returned), element
    by element: within two bf16 roundings (the partial rows and the sum), so one (token,
    expert) pair lost or added (its weight off the sum, above 1 % here) fails where a
    relative error over the whole output would not see it."""
    assert out_TH.shape == want_TH.shape and out_TH.dtype == torch.bfloat16, name
    out, want = out_TH.float(), want_TH.float().to(out_TH.device)
    bad = ((out - want).abs() > 1e-6 + 2**-7 * want.abs()).any(1).nonzero().flatten().tolist()

    def message(m: str) -> str:  # which rows, and how far off the first is
        ratio = (out[bad[0]].norm() / want[bad[0]].norm()).item() if bad else float("nan")
        where = f"rows {bad[:16]} of {out.shape[0]} off"
        return f"{name}: {where} (the first: |out| / |want| = {ratio:.4f})\n{m}"

    torch.testing.assert_close(out, want, rtol=2**-7, atol=1e-6, msg=message)


TOKEN_BITS, RANK_BITS = 12, 6  # up to 4096 tokens per rank and 64 ranks
MARK = TOKEN_BITS + RANK_BITS  # the column that says "an encoded row"


def _encode(rank, x_TH):
    """Write (rank, token index) as 0/1 bits into the first 128-column group, whose other
    columns are 0 and whose amax is 1: exact in bf16 and in FP8 (1 → 448 · scale)."""
    T = x_TH.shape[0]
    assert T <= 1 << TOKEN_BITS and rank < 1 << RANK_BITS, (T, rank)
    x_TH[:, :128] = 0
    t = torch.arange(T)
    for b in range(TOKEN_BITS):
        x_TH[:, b] = ((t >> b) & 1).float()
    for b in range(RANK_BITS):
        x_TH[:, TOKEN_BITS + b] = (rank >> b) & 1
    x_TH[:, MARK] = 1.0
    return x_TH


def _decode(row_H) -> tuple[int, int]:
    bits = row_H[: MARK + 1].round().int().tolist()
    assert bits[MARK] == 1, f"not an encoded row: {row_H[: MARK + 1]}"
    token = sum(bits[b] << b for b in range(TOKEN_BITS))
    return sum(bits[TOKEN_BITS + b] << b for b in range(RANK_BITS)), token


def _dequant(x):
    q, s = quantize_groups(x.float())
    return (q.float().unflatten(-1, (-1, 128)) * s.unsqueeze(-1)).flatten(-2)[..., : x.shape[1]]


def layer_against_oracle(rank, world, backend="symm_ll", backend_options=None):
    """EPMoE with ``backend`` (symm_ll, or symm_ht from its own test module; built with
    ``backend_options``) and Triton (and torch) experts against the oracle: bf16 and FP8
    on the wire, linear / round-robin / balanced placements, uneven and zero token counts,
    chunks above M_max, two micro-batches in flight."""
    options = dict(backend_options=backend_options or {})
    dev = torch.device("cuda", torch.cuda.current_device())
    from tests.distributed.cases import full_weights, placements, rank_tokens

    sweep = Sweep()
    w13, w2 = full_weights(E, H, I, torch.bfloat16, dev)
    for pname, placement in placements(E, world):
        for fp8 in (False, True):
            for experts in ("triton", "torch"):
                with sweep.case(f"{pname} fp8={fp8} {experts}"):
                    layer = epmoe.EPMoE(
                        E, K, H, I, placement=placement, backend=backend, experts=experts,
                        max_num_tokens=M, device=dev,
                        dispatch_dtype=FP8_DTYPE if fp8 else None, **options,
                    )  # fmt: skip
                    layer.load_experts(w13, w2)
                    for T in ([5, 0][rank % 2], M, 2 * M + 3):  # chunked above M_max
                        x, logits = rank_tokens(rank, T, H, E, torch.bfloat16, dev, seed=T)
                        out = layer(x, logits)
                        w, ids = epmoe.select_experts(logits, K)
                        ref = epmoe.reference.moe(x, w13, w2, w, ids)
                        tol = TOLERANCES[FP8_DTYPE] if fp8 else TOLERANCES[torch.bfloat16]
                        assert_close(out, ref, tol, name=f"rank {rank} T={T}")
                    layer.comm.check()
                    layer.comm.close()
    # EPMoE(micro_batches=2): each chunk's two halves overlap; equal to the plain forward
    with sweep.case("micro_batches=2"):
        layers = [
            epmoe.EPMoE(
                E,
                K,
                H,
                I,
                backend=backend,
                experts="triton",
                max_num_tokens=M,
                device=dev,
                micro_batches=mb,
                **options,
            )  # fmt: skip
            for mb in (1, 2)
        ]
        for layer in layers:
            layer.load_experts(w13, w2)
        for T in ([5, 0][rank % 2], M, 2 * M + 3):
            x, logits = rank_tokens(rank, T, H, E, torch.bfloat16, dev, seed=T)
            plain, overlapped = (layer(x, logits) for layer in layers)
            assert_close(overlapped, plain, 1e-2, name=f"rank {rank} T={T} vs plain")
            w, ids = epmoe.select_experts(logits, K)
            ref = epmoe.reference.moe(x, w13, w2, w, ids)
            assert_close(overlapped, ref, TOLERANCES[torch.bfloat16], name=f"rank {rank} T={T}")
        for layer in layers:
            layer.comm.check()
            layer.comm.close()
    # two dispatch results held at once (two micro-batches), combined in order
    with sweep.case("two in flight"):
        placement = epmoe.ExpertPlacement.linear(E, world)
        from epmoe.comm import backend_class

        layout = next(iter(backend_class(backend).capabilities.layouts))
        spec = _spec(placement, dev)
        comm = create_backend(backend, spec, None, layout, **options["backend_options"])
        from epmoe.experts.base import ExpertWeights
        from epmoe.experts.torch_experts import TorchExperts

        local = torch.tensor(placement.local_experts(rank), device=dev)
        ew = ExpertWeights(w13[local], w2[local])
        experts = TorchExperts("silu")
        batches = []
        for mb in range(2):
            x, logits = rank_tokens(rank, 9 + mb, H, E, torch.bfloat16, dev, seed=mb)
            w, ids = epmoe.select_experts(logits, K)
            batches.append((x, w, ids, comm.dispatch_async(x, ids, w)))
        with pytest.raises(RuntimeError, match="at most 2"):
            comm.dispatch_async(*[batches[0][i] for i in (0, 2, 1)])
        results = [p.wait() for *_, p in batches]
        pend = [comm.combine_async(experts(r, ew), r) for r in results]
        for (x, w, ids, _), p in zip(batches, pend):
            assert_close(p.wait(), epmoe.reference.moe(x, w13, w2, w, ids), 2e-2)
        comm.close()
    sweep.check()
    return sweep.passed


def graph_replays(rank, world, backend="symm_ll"):
    """A whole EPMoE forward (routing, dispatch, experts, combine) with ``backend`` captured
    once and replayed 100 times with fresh tokens and routing, each equal to the eager
    forward and to the oracle."""
    dev = torch.device("cuda", torch.cuda.current_device())
    from tests.distributed.cases import full_weights

    T = 24
    w13, w2 = full_weights(E, H, I, torch.bfloat16, dev)
    layer = epmoe.EPMoE(
        E, K, H, I, backend=backend, experts="triton", max_num_tokens=M, device=dev,
        load_window=4,
    )  # fmt: skip
    layer.load_experts(w13, w2)
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    logits = torch.randn(T, E, device=dev)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            layer(x, logits, max_tokens_across_ranks=T)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x, logits, max_tokens_across_ranks=T)
    worst = 0.0
    g = torch.Generator().manual_seed(rank)
    for i in range(100):
        x.copy_(torch.randn(T, H, generator=g).to(dev, torch.bfloat16))
        logits.copy_(torch.randn(T, E, generator=g) * (1 + i % 3))
        graph.replay()
        got = out.clone()
        want = layer(x, logits, max_tokens_across_ranks=T)
        err = (got.float() - want.float()).norm() / want.float().norm()
        worst = max(worst, float(err))
        w, ids = epmoe.select_experts(logits, K)
        assert_close(got, epmoe.reference.moe(x, w13, w2, w, ids), 2e-2, name=f"replay {i}")
    layer.comm.check()
    assert worst < 1e-2, f"graph replay differs from eager by {worst:.3g}"
    return worst


def skipped_call_times_out(rank, world):
    """Rank 1 skips a dispatch: rank 0's bounded wait fails within the timeout and names
    rank 1, instead of hanging."""
    import time

    os.environ["EPMOE_COMM_TIMEOUT_S"] = "2"
    dev = torch.device("cuda", torch.cuda.current_device())
    placement = epmoe.ExpertPlacement.linear(E, world)
    comm = create_backend("symm_ll", _spec(placement, dev, M_max=8), None, Layout.EXPERT_BATCHED)
    x = torch.randn(4, H, device=dev, dtype=torch.bfloat16)
    ids = torch.arange(K, device=dev).repeat(4, 1)
    w = torch.full((4, K), 1.0 / K, device=dev)
    t0 = time.monotonic()
    if rank == 0:
        comm.dispatch(x, ids, w)
        with pytest.raises(RuntimeError, match="dispatch on rank 0 timed out waiting for rank 1"):
            comm.check(sync=True)
    torch.distributed.barrier()
    return time.monotonic() - t0


def _two_layers(name, dev):
    """Two bf16 layers of backend ``name`` (one transport) with the same weights, and
    the weights."""
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.05, torch.randn(E, H, I, generator=g) * 0.05
    layers = []
    for _ in range(2):
        layer = epmoe.EPMoE(E, K, H, I, backend=name, device=dev, params_dtype=torch.bfloat16)
        layer.load_experts(w13.to(dev, torch.bfloat16), w2.to(dev, torch.bfloat16))
        layers.append(layer)
    return layers, w13.to(dev), w2.to(dev)


def skipped_layer_in_a_step(rank, world, name):
    """Two layers of backend ``name`` (one transport); inside a step, the last rank skips
    layer A and meets the others' A with its B. In that call every token with an expert on
    a rank in the other layer's call comes back NaN and the others match the oracle (the
    layers hold the same weights); every rank's next call raises naming a rank in another
    layer's dispatch (the receivers' ERR_LAYER): on the others their B, inside the step,
    on the last rank the next step's first call, or already the crossed call's combine
    when the host reads the error word after the kernel wrote it (the host reads it
    without a synchronisation: which call sees it is timing, e.g. ranks sharing a GPU).
    The layers then serve a step of both on every rank, equal to the oracle (the step
    that raised is not compared with the others' by the next step's agreement)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    (a, b), w13, w2 = _two_layers(name, dev)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, H, generator=g).to(dev, torch.bfloat16)
    logits = torch.randn(6, E, generator=g)
    odd, per_rank = world - 1, E // world
    logits[0, :per_rank] += 10  # token 0's experts all on rank 0, token 1's on the odd rank
    logits[1, odd * per_rank : (odd + 1) * per_rank] += 10
    logits = logits.to(dev)
    ref = epmoe.reference.moe(x.float(), w13, w2, *epmoe.select_experts(logits, K))

    def crossed_step():
        with epmoe.step(None, num_tokens=6):
            for layer in [b] if rank == odd else [a, b]:
                if layer is b and rank != odd:
                    torch.cuda.synchronize()  # (the error word is written by then)
                out = layer(x, logits).float()  # the others' B raises
                # the call across layers: NaN for every token with an expert across the divide
                owners = epmoe.select_experts(logits, K)[1] // per_rank
                crossed = ((owners == odd) != (rank == odd)).any(1)
                assert bool(crossed.any()) and not bool(crossed.all()), crossed  # (both kinds)
                assert torch.equal(out.isnan().any(1), crossed), (out.isnan().any(1), crossed)
                assert not out[crossed].isfinite().any()
                assert_close(out[~crossed], ref[~crossed], TOLERANCES[torch.bfloat16])

    seen_in_step = rank != odd
    if rank == odd:
        try:
            crossed_step()
        except RuntimeError as e:  # (seen by the combine already: reported once)
            assert "met another MoE layer's dispatch" in str(e), e
            seen_in_step = True
        torch.cuda.synchronize()
    else:
        with pytest.raises(RuntimeError, match="met another MoE layer's dispatch"):
            crossed_step()
    if not seen_in_step:  # its first call raises (out of the step: not compared by the next)
        with pytest.raises(RuntimeError, match="another MoE layer's"), epmoe.step(None, 6):
            a(x, logits)
    else:
        with epmoe.step(None, num_tokens=6):
            pass
    torch.distributed.barrier()
    with epmoe.step(None, num_tokens=6):
        for layer in (a, b):
            assert_close(layer(x, logits).float(), ref, TOLERANCES[torch.bfloat16])
    return True


def skipped_last_layer_in_a_step(rank, world, name):
    """Inside a step the last rank skips the step's last layer B: the others' dispatch of B
    waits for it until the bounded wait gives up (1 s here), and the next step's agreement
    raises on every rank, naming each rank's calls in the step before it. The others' next
    call of the transport then names the last rank (the timeout: rebuild the layers)."""
    os.environ["EPMOE_COMM_TIMEOUT_S"] = "1"  # (read when the transport is built)
    dev = torch.device("cuda", torch.cuda.current_device())
    (a, b), _, _ = _two_layers(name, dev)
    ia, ib = a._agreement.index, b._agreement.index
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, H, generator=g).to(dev, torch.bfloat16)
    logits = torch.randn(6, E, generator=g).to(dev)
    odd = world - 1
    with epmoe.step(None, num_tokens=6):
        for layer in [a] if rank == odd else [a, b]:
            layer(x, logits)
    others = "rank 0" if world == 2 else f"ranks {list(range(odd))}"
    calls = (
        rf"{re.escape(others)} made 2 calls \(#{ia}, #{ib}\), rank {odd} made 1 call "
        rf"\(#{ia}\); they first differ at call 2"
    )
    with pytest.raises(PreviousStepDiffers, match=calls), epmoe.step(None, num_tokens=6):
        pass
    if rank != odd:
        with pytest.raises(RuntimeError, match=rf"timed out waiting for rank {odd}"):
            b.comm.check(sync=True)
    torch.distributed.barrier()
    return True


@pytest.mark.parametrize("world", WORLDS, ids=world_ids(WORLDS))
def test_exact_dispatch_and_identity_combine(world):
    requires_world(world)
    run_on_ranks(exact_dispatch, world)


@pytest.mark.parametrize("world", WORLDS, ids=world_ids(WORLDS))
def test_layer_against_oracle(world):
    requires_world(world)
    run_on_ranks(layer_against_oracle, world, timeout_s=300)


@pytest.mark.parametrize("world", WORLDS, ids=world_ids(WORLDS))
def test_graph_replays_with_changing_routing(world):
    requires_world(world)
    run_on_ranks(graph_replays, world, timeout_s=300)


def test_a_rank_that_skips_a_call_is_named_within_the_timeout():
    requires_world(2)
    seconds = run_on_ranks(skipped_call_times_out, 2, isolated=True, timeout_s=60)
    assert seconds[0] < 5, seconds


@pytest.mark.parametrize("name", ["symm_ll", "symm_ht"])
def test_a_rank_that_skips_a_layer_in_a_step_is_named_at_the_next_call(name):
    requires_world(2)
    run_on_ranks(skipped_layer_in_a_step, 2, name, isolated=True, timeout_s=120)


@pytest.mark.parametrize("name", ["symm_ll", "symm_ht"])
def test_a_rank_that_skips_the_last_layer_of_a_step_is_named_at_the_next_step(name):
    requires_world(2)
    run_on_ranks(skipped_last_layer_in_a_step, 2, name, isolated=True, timeout_s=120)
