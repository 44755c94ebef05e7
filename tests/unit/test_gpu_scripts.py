"""The GPU scripts' commands, checked on CPU: every step of ``launch/gpu_comm.sh``,
``launch/gpu_tier.sh`` and ``launch/gpu_kernels.sh`` runs with ``python3``, ``python`` and
``timeout`` shimmed (they only record what they were asked to run), and every recorded
command is then checked as it would start: benchmark options through the benchmark's own
parser (``epmoe.bench.__main__.parse``), scripts' options through their parsers, test
paths and node ids against the tree. GPU time is scarce: a renamed option or a moved test
must fail here, not minutes into a device call."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SHIM = r"""#!{python}
import json, os, sys
with open(os.environ["SHIM_LOG"], "a") as f:
    f.write(json.dumps({{"tool": {tool!r}, "argv": sys.argv[1:]}}) + "\n")
if {tool!r} != "timeout" and sys.argv[1:2] == ["-c"] and "device_count" in sys.argv[2]:
    print(os.environ["FAKE_NGPU"])  # (gpu_env.sh's GPU count)
elif {tool!r} == "timeout":  # timeout [--opt ...] LIMIT CMD...: run CMD (shimmed too)
    args = sys.argv[1:]
    while args and args[0].startswith("-"):
        args = args[1:]
    os.execvp(args[1], args[1:])
"""


def _case_steps(script: str) -> list[str]:
    """The step names of a script's ``case $s in`` (every label but ``*``)."""
    text = (ROOT / script).read_text()
    body = text[text.index("case $s in") :]
    return re.findall(r"^\s{4}([a-z_0-9]+)\)", body, re.M)


def _run_script(tmp_path: Path, script: str, steps: list[str], ngpu: int, env: dict) -> list:
    shims = tmp_path / "shims"
    shims.mkdir(parents=True, exist_ok=True)
    for tool in ("python3", "python", "timeout"):
        path = shims / tool
        path.write_text(SHIM.format(python=sys.executable, tool=tool))
        path.chmod(0o755)
    log = tmp_path / f"{Path(script).stem}_{ngpu}.jsonl"
    out = tmp_path / f"out_{Path(script).stem}_{ngpu}"
    full_env = dict(
        os.environ,
        PATH=f"{shims}{os.pathsep}{os.environ['PATH']}",
        SHIM_LOG=str(log),
        FAKE_NGPU=str(ngpu),
        OUT=str(out),
        DSV3_DIR=str(tmp_path / "dsv3"),
        **env,
    )
    subprocess.run(
        ["bash", str(ROOT / script), *steps],
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=120,
    )
    return [json.loads(line) for line in log.read_text().splitlines()]


class _Parsed(BaseException):
    """Raised right after a script's ``parse_args`` succeeded: nothing more of it runs."""


def _check_script(path: Path, args: list[str]) -> None:
    """Run ``path``'s ``__main__`` up to its first ``parse_args``, which must accept
    ``args``."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, argv=None, namespace=None):
        original(self, argv, namespace)
        raise _Parsed

    sys_argv = sys.argv
    sys.argv = [str(path), *args]
    argparse.ArgumentParser.parse_args = parse_then_stop
    try:
        runpy.run_path(str(path), run_name="__main__")
    except _Parsed:
        return
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv = sys_argv
    raise AssertionError(f"{path.name} did not parse its arguments before doing anything else")


def _check_pytest(args: list[str]) -> None:
    for arg in args:
        arg = arg.removeprefix("--ignore=")  # (an ignored path must exist too)
        if not arg.startswith("tests"):
            continue
        file, _, node = arg.partition("::")
        assert (ROOT / file).exists(), f"no such test path: {file}"
        if node:
            name = node.split("[")[0]
            assert re.search(rf"^def {name}\(", (ROOT / file).read_text(), re.M), (
                f"no test {name} in {file}"
            )


def _check(call: dict) -> str | None:
    """What is wrong with one recorded command (None: it starts as asked)."""
    from epmoe.bench.__main__ import parse
    from epmoe.launch import parser as launch_parser

    argv = list(call["argv"])
    if call["tool"] == "timeout" or not argv or argv[0] in ("-c", "-"):
        return None  # (the command under timeout is recorded on its own; inline code)
    if argv[0] == "launch/run.py":  # the launcher: what it starts
        opts = launch_parser().parse_args(argv[1:])
        argv = (["-m"] if opts.module else []) + [opts.script, *opts.args]
    if argv[0] == "launch/demo.py":  # the demo's launcher: the demo's own options
        launcher = argparse.ArgumentParser(add_help=False)
        launcher.add_argument("--nproc", type=int)
        argv = ["examples/serve_demo.py", *launcher.parse_known_args(argv[1:])[1]]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if argv[0] == "-m" and argv[1] == "epmoe.bench":
                parse(argv[2:])
            elif argv[0] == "-m" and argv[1] == "pytest":
                _check_pytest(argv[2:])
            elif argv[0] == "-m":
                import importlib.util

                assert importlib.util.find_spec(argv[1]) is not None, f"no module {argv[1]}"
            else:
                path = ROOT / argv[0]
                assert path.exists(), f"no such script: {argv[0]}"
                _check_script(path, argv[1:])
    except SystemExit as exc:
        if exc.code:
            return f"{shlex.join(call['argv'])}: {err.getvalue().strip().splitlines()[-1:]}"
    except AssertionError as exc:
        return f"{shlex.join(call['argv'])}: {exc}"
    return None


def _problems(calls: list) -> str:
    """Every recorded command that would not start as written, a line each."""
    return "\n".join(p for p in map(_check, calls) if p)


def _bench_lines(script: str) -> int:
    return len(re.findall(r"-m epmoe\.bench ", (ROOT / script).read_text()))


@pytest.mark.parametrize(
    "script, ngpu",
    [("launch/gpu_comm.sh", 2), ("launch/gpu_comm.sh", 8), ("launch/gpu_tier.sh", 2)],
)
def test_every_step_of_the_gpu_scripts_starts_as_written(tmp_path, script, ngpu):
    steps = _case_steps(script) if script.endswith("gpu_comm.sh") else []
    if script.endswith("gpu_comm.sh"):
        assert {"comm", "ht", "conformance", "dsv3", "timeline"} <= set(steps), steps
    env = {
        "DSV3_RUNS": "fp8 graphs blocks one onegraphs bf16",
        "TIMELINE_VARIANTS": "default EPMOE_POLL_PAUSE_NS=50",
    }
    calls = _run_script(tmp_path, script, steps, ngpu, env)
    assert not _problems(calls), _problems(calls)
    run = sum("epmoe.bench" in c["argv"] for c in calls if c["tool"] != "timeout")
    assert run >= _bench_lines(script), (run, _bench_lines(script))  # every line ran


CALL_LIMIT_S = 600  # the device tool's limit on one call
SELF_CAPPED = {"prefill"}  # steps that cap their own total (PREFILL_LIMIT_S)


def _limits(calls: list) -> list[int]:
    """The time limits of the recorded ``timeout LIMIT CMD`` calls."""
    out = []
    for call in calls:
        if call["tool"] == "timeout":
            out.append(int(next(a for a in call["argv"] if not a.startswith("-"))))
    return out


@pytest.mark.parametrize("ngpu", [2, 8])
def test_each_step_of_gpu_comm_fits_in_one_device_call(tmp_path, ngpu):
    """The sum of a step's time limits (its worst case) within one call's 600 s, so that
    a step that runs long is cut by its own limits, with its logs, not by the device tool."""
    over = {}
    for step in _case_steps("launch/gpu_comm.sh"):
        if step in SELF_CAPPED:
            continue
        worst = sum(_limits(_run_script(tmp_path / step, "launch/gpu_comm.sh", [step], ngpu, {})))
        if worst > CALL_LIMIT_S - 10:
            over[step] = worst
    default = sum(_limits(_run_script(tmp_path / "default", "launch/gpu_comm.sh", [], ngpu, {})))
    assert not over and default <= CALL_LIMIT_S - 10, (over, default)


def test_the_gpu_tiers_default_steps_fit_in_one_device_call(tmp_path):
    worst = sum(_limits(_run_script(tmp_path, "launch/gpu_tier.sh", [], 2, {})))
    assert 0 < worst <= CALL_LIMIT_S - 10, worst
    for step in ("tests", "dist", "experts"):  # (one call each)
        calls = _run_script(tmp_path / step, "launch/gpu_tier.sh", [step], 2, {})
        assert _limits(calls)[0] <= CALL_LIMIT_S - 10, (step, _limits(calls))


def test_the_kernels_script_starts_as_written(tmp_path):
    calls = _run_script(tmp_path, "launch/gpu_kernels.sh", [], 1, {})
    assert not _problems(calls), _problems(calls)
    mine = [c for c in calls if c["tool"] != "timeout"]
    assert sum("epmoe.bench" in c["argv"] for c in mine) == 1
    assert sum("pytest" in c["argv"] for c in mine) >= 1


def test_a_stale_option_is_caught():
    """The check itself: an option the benchmark lost, a test file that moved."""
    argv = ["launch/run.py", "--nproc", "2", "-m", "epmoe.bench", "comm", "--no-such-option", "1"]
    bad = {"tool": "python3", "argv": argv}
    assert "--no-such-option" in (_check(bad) or "")
    moved = {"tool": "python3", "argv": ["-m", "pytest", "tests/gpu/test_gone.py"]}
    assert "no such test path" in (_check(moved) or "")
    ignored = {"tool": "python3", "argv": ["-m", "pytest", "tests", "--ignore=tests/gpu/x.py"]}
    assert "no such test path: tests/gpu/x.py" in (_check(ignored) or "")
    node = {"tool": "python3", "argv": ["-m", "pytest", "tests/unit/test_gpu_scripts.py::x"]}
    assert "no test x" in (_check(node) or "")
    script = {"tool": "python3", "argv": ["examples/serving.py", "--no-such-flag"]}
    assert "--no-such-flag" in (_check(script) or "")
