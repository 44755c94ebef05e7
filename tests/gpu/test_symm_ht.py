"""``symm_ht`` conformance on GPUs (NCCL ranks, one GPU each; W = 1 and 2).

Exact dispatch into the fixed rows (tokens encode their source rank and index; FP8 bit for
bit), combine against the oracle in bf16 and FP8, zero-token ranks, all tokens to one
expert and to one rank, T = M_max, an SM budget small enough that every kernel loops,
CUDA-graph replays with changing routing, and EPMoE end to end with Triton and torch
experts.

Run in the GPU tier: ``EPMOE_TEST_DEVICE=cuda python -m pytest tests/gpu/test_symm_ht.py``.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():  # collected on CPU too; conftest skips the gpu mark
    pytest.skip("needs CUDA", allow_module_level=True)

import epmoe  # noqa: E402
from epmoe.comm.base import Layout  # noqa: E402
from epmoe.comm.symm.ht import STREAM_CHUNK, SymmHTBackend  # noqa: E402
from epmoe.reference import quantize_groups  # noqa: E402
from tests.gpu.test_symm_ll import (  # noqa: E402  (EPMoE and graph cases shared with symm_ll)
    E,
    H,
    K,
    M,
    _decode,
    _dequant,
    _encode,
    _spec,
    assert_rows_close,
    graph_replays,
    layer_against_oracle,
)
from tests.harness import Sweep, requires_world, run_on_ranks, world_ids, world_sizes  # noqa: E402

WORLDS = world_sizes([1, 2])  # EPMOE_TEST_WORLDS=4,8 on larger machines

pytestmark = pytest.mark.gpu


def _routing(rank, T, g, case):
    """[T, K] ids: uniform, all to one expert (the last), or all to rank 0's experts."""
    if case == "one expert":
        ids = torch.full((T, K), -1, dtype=torch.int64)
        ids[:, 0] = E - 1
        return ids
    if case == "one rank":  # rank 0 holds experts [0, E / W) under linear placement
        rows = [torch.randperm(E // 2, generator=g)[:K] for _ in range(T)]
        return torch.stack(rows) if rows else torch.empty(0, K, dtype=torch.int64)
    return torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]


def exact_dispatch(rank, world):
    """Every token lands once in row ``src·M + t`` of each rank holding one of its experts,
    with that rank's local slots and the router weights; rows no token filled carry -1.
    Combine of identity experts gives back the token (weights sum to 1)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    placement = epmoe.ExpertPlacement.linear(E, world)
    lo, hi = placement.rank_offsets[rank], placement.rank_offsets[rank + 1]
    sweep = Sweep()
    cases = {"T=11": 11, "T=0 on rank 1": 0 if rank == 1 else 7, "T=M_max": M}
    for fp8 in (False, True):
        # every SM one row per flag; few enough SMs that each kernel loops, 4 rows per
        # flag; one count per program (no flags), looping; the streamed combine on every
        # SM (the default: half of them reduce) and on 5 SMs, 2 reducing, in chunks of 8
        # tokens (M is more: chunks loop, the last one partial)
        for sms, per_flag, reducers, chunk in (
            (None, 1, None, None), (3, 4, None, None), (3, 0, None, None),
            (None, 0, None, None), (5, 0, 2, 8),
        ):  # fmt: skip
            spec = _spec(placement, dev, fp8)
            comm = SymmHTBackend(
                spec, None, Layout.STANDARD, num_sms=sms, tokens_per_flag=per_flag,
                reducers=reducers, combine_chunk=chunk or STREAM_CHUNK,
            )  # fmt: skip
            every = torch.cuda.get_device_properties(dev).multi_processor_count
            if reducers is None:  # half the SMs stream the sum on a full GPU
                want = every // 2 if per_flag == 0 and sms is None and every >= 64 else 0
            else:  # as asked, while each rank's column keeps one sender (5 SMs at W=4: 1)
                want = min(reducers, max(sms - world, 1))
            assert comm.reducers == want, (comm.reducers, want)
            for name, T in cases.items():
                for routing in ("uniform", "one expert", "one rank"):
                    label = f"sms={sms}/{per_flag}/{comm.reducers}"
                    with sweep.case(f"{name} fp8={fp8} {label} {routing}"):
                        g = torch.Generator().manual_seed(100 * rank + T)
                        ids = _routing(rank, T, g, routing)
                        w = torch.softmax(torch.randn(T, K, generator=g), -1)
                        w = torch.where(ids >= 0, w, 0.0)
                        w = w / w.sum(1, keepdim=True).clamp(min=1e-6)
                        x = _encode(rank, torch.randn(T, H, generator=g)).to(dev, torch.bfloat16)
                        everyone = [None] * world
                        torch.distributed.all_gather_object(everyone, (ids, w, x.cpu()))
                        res = comm.dispatch(x, ids.to(dev), w.to(dev))
                        # combine first (identity experts: Σ_k w_k · row), check afterwards
                        hid = res.hidden.float()
                        if fp8:
                            hid = hid * res.hidden_scale.repeat_interleave(128, -1)[..., :H]
                        got_ids, got_w = res.topk_ids.cpu(), res.topk_weights.cpu()
                        hidden, scale = (
                            res.hidden.clone(),
                            (res.hidden_scale.clone() if fp8 else None),
                        )
                        y = (hid * res.topk_weights.sum(1, keepdim=True)).to(torch.bfloat16)
                        out = comm.combine(y, res)
                        assert res.hidden.shape == (world * M, H)
                        for src, (sids, sw, sx) in enumerate(everyone):
                            for t in range(M):
                                r = src * M + t
                                mine = (sids[t] >= lo) & (sids[t] < hi) if t < len(sids) else None
                                if mine is None or not bool(mine.any()):
                                    assert (got_ids[r] == -1).all(), (src, t, got_ids[r])
                                    continue
                                want_ids = torch.where(mine, sids[t] - lo, -1)
                                assert torch.equal(got_ids[r], want_ids), (src, t)
                                torch.testing.assert_close(got_w[r], torch.where(mine, sw[t], 0.0))
                                assert _decode(hid[r].cpu()) == (src, t)
                                if fp8:  # bit-exact against the torch quantizer
                                    q, s = quantize_groups(sx[t : t + 1].float())
                                    row = hidden[r].cpu().view(torch.uint8)
                                    assert torch.equal(row, q[0].view(torch.uint8)), (src, t)
                                    assert torch.equal(scale[r].cpu(), s[0]), (src, t)
                        want_x = x.float() if not fp8 else _dequant(x)
                        assert out.shape == (T, H) and out.dtype == torch.bfloat16
                        assert_rows_close(out, want_x, f"rank {rank}")
            comm.check()
            comm.close()
    sweep.check()
    return sweep.passed


def two_in_flight(rank, world):
    """Two dispatch results held at once (both parities), combined in the order they were
    dispatched, over rounds of changing token counts (0 on some rank), with row flags and
    with one count per program: each combine gives back its own tokens (identity
    experts, weights summing to 1)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    placement = epmoe.ExpertPlacement.linear(E, world)
    sweep = Sweep()
    for per_flag, reducers in ((4, None), (0, None), (0, 1)):
        spec = _spec(placement, dev, False)
        comm = SymmHTBackend(
            spec, None, Layout.STANDARD, num_sms=3, tokens_per_flag=per_flag, reducers=reducers
        )
        for n, Ts in enumerate([(7, 0), (M, 3), (0, M), (5, 5)]):
            with sweep.case(f"{per_flag} rows per flag, {reducers} reducers, round {n}"):
                pair = []
                for j in range(2):
                    T = Ts[(rank + j) % 2]
                    g = torch.Generator().manual_seed(1000 * n + 10 * rank + j)
                    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
                    w = torch.softmax(torch.randn(T, K, generator=g), -1)
                    x = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)
                    pair.append((x, comm.dispatch(x, ids.to(dev), w.to(dev))))
                for x, res in pair:
                    y = res.hidden.float() * res.topk_weights.sum(1, keepdim=True)
                    out = comm.combine(y.to(torch.bfloat16), res)
                    assert_rows_close(out, x.float(), f"rank {rank}")
        comm.check()
        comm.close()
    # one compiled launch per mode, not one per call (a launch cache keyed on a call's
    # fresh tensor would hold every output it made: 24 combines ran)
    from epmoe.comm.symm.common import kernels, launch

    assert len(launch(kernels().ht_combine_send_kernel).compiled) <= 6
    sweep.check()
    return sweep.passed


@pytest.mark.parametrize("world", WORLDS, ids=world_ids(WORLDS))
def test_two_results_in_flight_with_flags_counts_and_a_streamed_combine(world):
    requires_world(world)
    run_on_ranks(two_in_flight, world, timeout_s=300)


@pytest.mark.parametrize("world", WORLDS, ids=world_ids(WORLDS))
def test_exact_dispatch_and_identity_combine(world):
    requires_world(world)
    run_on_ranks(exact_dispatch, world, timeout_s=300)


@pytest.mark.parametrize("world", WORLDS, ids=world_ids(WORLDS))
def test_layer_against_oracle(world):
    requires_world(world)
    run_on_ranks(layer_against_oracle, world, "symm_ht", timeout_s=300)


@pytest.mark.parametrize("world", WORLDS, ids=world_ids(WORLDS))
def test_layer_with_few_sms_and_counts_against_oracle(world):
    """EPMoE(backend_options=...): 3 SMs, so every kernel loops, and one count per
    program, so the counted dispatch sends several tokens per step."""
    requires_world(world)
    options = {"num_sms": 3, "tokens_per_flag": 0}
    run_on_ranks(layer_against_oracle, world, "symm_ht", options, timeout_s=300)


@pytest.mark.parametrize("world", WORLDS, ids=world_ids(WORLDS))
def test_layer_with_a_streamed_combine_on_few_sms_against_oracle(world):
    """The streamed combine (the default on every SM: ``test_layer_against_oracle``) on 5
    SMs, 2 of them reducing: its senders and reducers loop."""
    requires_world(world)
    options = {"num_sms": 5, "tokens_per_flag": 0, "reducers": 2}
    run_on_ranks(layer_against_oracle, world, "symm_ht", options, timeout_s=300)


@pytest.mark.parametrize("world", WORLDS, ids=world_ids(WORLDS))
def test_graph_replays_with_changing_routing(world):
    requires_world(world)
    run_on_ranks(graph_replays, world, "symm_ht", timeout_s=300)
