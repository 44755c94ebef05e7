"""The communication layer in one process: registry, specs, argument checks, and both
backends at W = 1 against a direct computation."""

from __future__ import annotations

import pytest
import torch

import epmoe
from epmoe.comm import available_backends, backend_class, create_backend, resolve_backend
from epmoe.comm.base import CommSpec, Layout, check_dispatch_args

CPU = torch.device("cpu")


def spec(**overrides) -> CommSpec:
    kwargs = dict(
        hidden_size=8,
        top_k=2,
        rank_offsets=(0, 5),
        max_num_tokens=4,
        dtype=torch.float32,
        device=CPU,
    )
    kwargs.update(overrides)
    return CommSpec(**kwargs)


def test_available_backends_on_cpu_names_every_backend():
    backends = available_backends("cpu")
    assert backends["naive"] is None and backends["all_to_all"] is None
    assert set(backends) == set(epmoe.available_backends("cpu"))


def test_unknown_backend_lists_the_choices():
    with pytest.raises(ValueError, match="choose one of"):
        backend_class("fast")


def test_auto_picks_a_backend_offering_the_layout():
    cls = resolve_backend("auto", CPU, None, Layout.EXPERT_BATCHED)
    assert Layout.EXPERT_BATCHED in cls.capabilities.layouts


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(rank_offsets=(1, 5)), "rank_offsets"),
        (dict(rank_offsets=(0, 5, 3)), "rank_offsets"),
        (dict(hidden_size=0), "positive"),
        (dict(max_num_tokens=0), "positive"),
    ],
    ids=["offsets not from 0", "offsets decrease", "H = 0", "M_max = 0"],
)
def test_comm_spec_rejects_bad_values(overrides, match):
    with pytest.raises(ValueError, match=match):
        spec(**overrides)


def test_spec_derived_sizes():
    s = spec(rank_offsets=(0, 3, 5, 5))
    assert (s.world_size, s.num_physical, s.max_local, s.num_local(2)) == (3, 5, 3, 0)


def test_backend_refuses_a_dtype_it_cannot_move():
    with pytest.raises(TypeError, match="params_dtype"):
        create_backend("all_to_all", spec(dtype=torch.int32), None)


def test_backend_refuses_a_world_size_mismatch():
    with pytest.raises(ValueError, match="ep_size=1"):
        create_backend("naive", spec(rank_offsets=(0, 2, 5)), None)


def test_dispatch_argument_checks():
    s = spec()
    x, ids, w = torch.randn(5, 8), torch.zeros(5, 2, dtype=torch.int64), torch.rand(5, 2)
    with pytest.raises(ValueError, match="max_num_tokens"):
        check_dispatch_args(s, x, ids, w, limit_tokens=True)
    check_dispatch_args(s, x, ids, w, limit_tokens=False)
    with pytest.raises(ValueError, match=r"\[T, 8\]"):
        check_dispatch_args(s, x[:, :7], ids, w, False)
    with pytest.raises(ValueError, match="K=2"):
        check_dispatch_args(s, x, ids[:, :1], w, False)
    with pytest.raises(TypeError, match="int32 or int64"):
        check_dispatch_args(s, x, ids.float(), w, False)
    with pytest.raises(TypeError, match="params_dtype"):
        check_dispatch_args(s, x.double(), ids, w, False)


@pytest.mark.parametrize(
    "name, layout",
    [
        ("naive", Layout.STANDARD),
        ("all_to_all", Layout.STANDARD),
        ("all_to_all", Layout.EXPERT_BATCHED),
    ],
    ids=["naive", "all_to_all standard", "all_to_all expert_batched"],
)
@pytest.mark.parametrize("T", [0, 1, 7], ids=["T=0", "T=1", "T=7"])
def test_single_rank_round_trip(name, layout, T):
    """W = 1: dispatch delivers every (token, expert) pair; combining the identity expert
    gives back Σ_k w · x."""
    g = torch.Generator().manual_seed(T)
    E, K, H = 5, 2, 8
    s = spec(max_num_tokens=8)
    comm = create_backend(name, s, None, layout)
    x = torch.randn(T, H, generator=g)
    ids = torch.rand(T, E, generator=g).argsort(1)[:, :K]
    w = torch.rand(T, K, generator=g)
    res = comm.dispatch(x, ids, w)
    if layout is Layout.STANDARD:
        assert res.hidden.shape == (T, H)
        torch.testing.assert_close(res.topk_ids, ids)
        y = res.hidden * res.topk_weights.sum(1, keepdim=True)
    else:
        counts = torch.bincount(ids.reshape(-1), minlength=E)
        assert res.counts.tolist() == counts.tolist()
        y = res.hidden.clone()
    torch.testing.assert_close(comm.combine(y, res), x * w.sum(1, keepdim=True))
