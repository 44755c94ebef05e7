"""One rank misconfigured or out of step, on 3 gloo ranks: every rank raises in that same
call, naming the rank, within seconds (docs/reliability.md; rank bodies in
``reliability_cases.py``).

Each test prints its cases as a table (``pytest -s``): the slowest rank's seconds, and
the errors that the differing rank and the others raised.
"""

from __future__ import annotations

import pytest
import torch

import epmoe
from tests.distributed import reliability_cases as rc
from tests.harness import requires_world, run_on_ranks
from tests.harness import test_device as device_under_test

W = 3

pytestmark = pytest.mark.skipif(
    device_under_test() == "cuda", reason="gloo cases (CPU layers on a gloo group)"
)


def _table(results: list[list[dict]]) -> str:
    """Markdown rows: case | slowest rank's seconds | rank ODD's error | the others' error."""
    by_case: dict[str, dict[int, dict]] = {}
    for rows in results:
        for row in rows:
            by_case.setdefault(row["case"], {})[row["rank"]] = row
    lines = ["| case | seconds (slowest rank) | rank 1 raises | ranks 0 and 2 raise |"]
    lines.append("|---|---|---|---|")
    for case, ranks in by_case.items():
        seconds = max(r["seconds"] for r in ranks.values())
        odd = ranks.get(rc.ODD, {}).get("error", "")
        other = next((r["error"] for k, r in sorted(ranks.items()) if k != rc.ODD), "")
        lines.append(f"| {case} | {seconds:.3f} | {_short(odd)} | {_short(other)} |")
    return "\n".join(lines)


def _short(text: str, limit: int = 240) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _run(fn, *args, **kwargs) -> list[list[dict]]:
    requires_world(W)
    results = run_on_ranks(fn, W, *args, **kwargs)
    print("\n" + _table(results))
    return results


def test_one_rank_builds_another_layer():
    """placement, top_k, hidden_size, layout, params_dtype, backend, max_num_tokens,
    activation on one rank; a refused argument on one rank."""
    _run(rc.construction_mismatch)


def test_one_rank_with_bad_forward_inputs():
    """None or a list as input, router logits on the meta device, custom routing ids out of
    range (also with T = 0 on the others), on one rank."""
    _run(rc.bad_forward_inputs)


def test_one_rank_out_of_step():
    """A skipped forward met by a rebalance, a skipped rebalance, a skipped layer, an
    extra layer built."""
    _run(rc.out_of_step)


def test_one_rank_made_another_count_of_layer_calls_in_the_step_before():
    """Ranks whose previous step's layer calls differed are named at the next step."""
    _run(rc.previous_step_calls)


def test_a_late_rank_is_named_after_the_group_timeout():
    """Only a timeout can tell a rank that never arrives: on a group with a 3 s timeout the
    others raise after it naming the late rank. Isolated: the group is unusable after."""
    results = _run(rc.late_rank, 3.0, 6.0, isolated=True, timeout_s=60)
    first = min(rows[0]["seconds"] for r, rows in enumerate(results) if r != rc.ODD)
    assert first >= 3.0, f"raised after {first} s, before the group's 3 s timeout"


def test_float64_layers_compute_in_float64():
    _run(rc.float64_against_oracle)


def test_float64_on_one_process():
    """Without torch.distributed: float64 within 1e-12 of the oracle (it was 1.8e-7, the
    torch experts computed in float32 on CPU), and the Triton experts refuse float64 at
    construction instead of failing in the first forward."""
    E, K, H, I = rc.E, rc.K, rc.H, rc.I
    layer = epmoe.EPMoE(E, K, H, I, params_dtype=torch.float64, device="cpu")
    w13 = torch.randn(E, 2 * I, H, dtype=torch.float64) / H**0.5
    w2 = torch.randn(E, H, I, dtype=torch.float64) / I**0.5
    layer.load_experts(w13, w2)
    x, logits = torch.randn(9, H, dtype=torch.float64), torch.randn(9, E, dtype=torch.float64)
    ref = epmoe.reference.moe(x, w13, w2, *epmoe.select_experts(logits, K))
    assert epmoe.reference.relative_error(layer(x, logits), ref) <= 1e-12
    with pytest.raises(ValueError, match="experts='triton' computes in .* not torch.float64"):
        epmoe.EPMoE(E, K, H, I, params_dtype=torch.float64, device="cpu", experts="triton")


def test_routing_ids_out_of_range_on_one_process():
    """The layer's own range check (ids in [-1, E)) also guards one process."""
    layer = epmoe.EPMoE(rc.E, rc.K, rc.H, rc.I, params_dtype=torch.float32, device="cpu")
    layer.load_experts(torch.randn(rc.E, 2 * rc.I, rc.H), torch.randn(rc.E, rc.H, rc.I))
    select = layer._select

    def bad(logits):
        w, ids = select(logits)
        return w, ids + rc.E

    layer._select = bad
    with pytest.raises(ValueError, match="the routing returned expert ids"):
        layer(torch.randn(3, rc.H), torch.randn(3, rc.E))


def test_default_timeout_is_seconds():
    """init_distributed bounds every collective wait by a minute, not torch's 10 or 30
    (docs/reliability.md says why a minute)."""
    import inspect

    from epmoe.distributed import DEFAULT_TIMEOUT_S

    default = inspect.signature(epmoe.init_distributed).parameters["timeout_s"].default
    assert default == DEFAULT_TIMEOUT_S == 60.0
