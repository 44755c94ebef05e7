"""One DP step context for a model of several ``EPMoE`` layers, on 2–4 gloo ranks (rank
bodies in ``tests/distributed/step_cases.py``): one agreement collective per step however
many layers, uneven and zero token counts, outputs equal to the oracle, one rank's bad
input or out-of-step call raising on every rank, and the model compiled with
``torch.compile(fullgraph=True)``."""

from __future__ import annotations

import pytest

from tests.distributed import step_cases
from tests.harness import requires_world, run_on_ranks
from tests.harness import test_device as device_under_test

pytestmark = pytest.mark.skipif(
    device_under_test() == "cuda", reason="gloo cases (CPU layers on a gloo group)"
)

# token counts per rank for each case (the first W entries are used)
TOKENS = {
    "uneven": (5, 1, 3, 2),
    "one rank idle": (0, 4, 2, 7),
    "all idle": (0, 0, 0, 0),
    "only the last rank busy": (0, 0, 0, 6),
    "many tokens": (40, 3, 0, 17),
}


@pytest.mark.parametrize("world", [2, 3, 4], ids=lambda w: f"W={w}")
def test_one_agreement_per_step_for_the_whole_model(world):
    requires_world(world)
    tokens = {
        case: (t[:world] if case != "only the last rank busy" else (0,) * (world - 1) + (6,))
        for case, t in TOKENS.items()
    }
    reports = run_on_ranks(step_cases.step_context, world, tokens)
    for case, counts, plain in reports[0]:
        print(f"{case}: with a step {counts}, without {plain}")


@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"W={w}")
def test_bad_input_or_another_step_raises_on_every_rank(world):
    requires_world(world)
    for rows in run_on_ranks(step_cases.step_faults, world):
        for row in rows:
            print(row)


def test_compiled_model_on_two_ranks():
    requires_world(2)
    run_on_ranks(step_cases.compiled_model, 2, timeout_s=300)
