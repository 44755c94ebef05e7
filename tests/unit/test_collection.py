"""The README's test command must collect every test module under ``tests/``.

pytest skips folders named ``dist``, ``build``, ``venv`` … by default (``norecursedirs``):
a test folder with such a name is never collected and CI never runs it, silently. This test
compares the modules collection reached with the files on disk.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import conftest

ROOT = Path(__file__).resolve().parents[2]


def _modules_on_disk() -> set[str]:
    found = set()
    for path in (ROOT / "tests").rglob("*.py"):
        name = path.name
        if name.startswith("test_") or name.endswith("_test.py"):
            found.add(path.relative_to(ROOT).as_posix())
    return found


def _collected_by_subprocess() -> set[str]:
    """What a plain ``python -m pytest`` collects (used when this test runs on its own)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    seen = set()
    for line in proc.stdout.splitlines():
        path = line.split("::")[0].strip()
        if path.endswith(".py"):
            seen.add(path)
    for line in proc.stdout.splitlines():  # modules skipped at import ("SKIPPED [1] path:33")
        if line.startswith("SKIPPED"):
            seen.add(line.split("]", 1)[1].strip().split(":")[0])
    return seen


def test_every_test_module_is_collected(request: pytest.FixtureRequest) -> None:
    on_disk = _modules_on_disk()
    collected = {m for m in conftest.COLLECTED_MODULES if m.startswith("tests/")}
    if not on_disk <= collected:  # a partial run (a path or -k on the command line)
        collected = _collected_by_subprocess()
    missing = sorted(on_disk - collected)
    assert not missing, (
        f"python -m pytest does not collect {missing}: a folder on their path is in pytest's "
        "norecursedirs (dist, build, venv, …) or they fail to import; rename the folder"
    )
