"""Backend options: ``EPMoE(backend=..., backend_options={...})`` and
``create_backend(..., **options)`` pass keyword options to a backend's constructor, refuse
names it does not take (naming those it does), refuse them with ``auto``, and keep them
when a re-plan builds the backend again."""

from __future__ import annotations

import pytest
import torch

import epmoe
import epmoe.comm as registry
from epmoe.comm import backend_class, backend_option_names, check_backend_options, create_backend
from epmoe.comm.all_to_all import AllToAllBackend
from epmoe.comm.base import CommSpec
from epmoe.layer import _rebound
from epmoe.reference import assert_close
from tests.unit.test_layer import layer_and_weights


class TaggedBackend(AllToAllBackend):
    """``all_to_all`` with a keyword option, that builds itself again on a re-plan."""

    name = "tagged"

    def __init__(self, spec, group, layout=None, *, tag: str = "plain", rounds: int = 1):
        if not isinstance(tag, str):
            raise TypeError(f"tag must be a str, got {tag!r}")
        super().__init__(spec, group, layout)
        self.tag, self.rounds = tag, rounds

    def rebind(self, rank_offsets):
        raise NotImplementedError("built again on every re-plan")


@pytest.fixture
def tagged(monkeypatch):
    backends = {"tagged": f"{__name__}:TaggedBackend", **registry._BACKENDS}
    monkeypatch.setattr(registry, "_BACKENDS", backends)


def test_every_backend_names_its_options():
    options = {name: backend_option_names(backend_class(name)) for name in ("symm_ht", "naive")}
    options_ht = ["num_sms", "tokens_per_flag", "reducers", "combine_chunk"]
    assert options == {"symm_ht": options_ht, "naive": []}
    assert backend_option_names(TaggedBackend) == ["tag", "rounds"]


def test_unknown_options_are_refused_naming_those_the_backend_takes():
    with pytest.raises(ValueError, match=r"'tagged' has no option 'colour': it takes \['tag'"):
        check_backend_options(TaggedBackend, {"colour": 1, "tag": "x"})
    with pytest.raises(ValueError, match="'naive' has no option 'num_sms': it takes no options"):
        check_backend_options(backend_class("naive"), {"num_sms": 24})
    with pytest.raises(TypeError, match="backend_options must be a mapping"):
        check_backend_options(TaggedBackend, [("tag", "x")])


def test_create_backend_passes_options_and_refuses_them_with_auto(tagged):
    spec = CommSpec(16, 2, (0, 8), 8, torch.float32, torch.device("cpu"))
    comm = create_backend("tagged", spec, None, tag="red")
    assert (comm.tag, comm.rounds) == ("red", 1)
    with pytest.raises(ValueError, match="backend options need a backend chosen by name"):
        create_backend("auto", spec, None, tag="red")
    with pytest.raises(ValueError, match="has no option 'colour'"):
        create_backend("tagged", spec, None, colour="red")


def test_the_layer_builds_its_backend_with_the_options_and_keeps_them(tagged):
    options = {"tag": "red"}
    layer, w13, w2 = layer_and_weights(experts="torch", backend="tagged", backend_options=options)
    assert layer.comm.tag == "red" and layer.backend_options == {"tag": "red"}
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(2))
    want = epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, 2))
    assert_close(layer(x, logits), want, 1e-5)
    # a re-plan that builds the backend again builds it with the same options
    fresh = _rebound(layer.comm, layer.comm.spec.rank_offsets, None, layer.backend_options)
    assert fresh is not layer.comm and fresh.tag == "red"


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(backend="auto", backend_options={"tag": "x"}), ValueError, "not 'auto'"),
        (dict(backend="tagged", backend_options={"hue": 1}), ValueError, "has no option 'hue'"),
        (dict(backend="tagged", backend_options=["tag"]), TypeError, "must be a mapping"),
        (dict(backend="tagged", backend_options={"tag": 3}), TypeError, "tag must be a str"),
    ],
    ids=["with auto", "unknown name", "not a mapping", "a value its constructor refuses"],
)
def test_bad_options_raise_naming_the_argument(tagged, kwargs, error, match):
    with pytest.raises(error, match=match):
        layer_and_weights(experts="torch", **kwargs)
