"""The launch path users start with: the torchrun wrapper and the README's demo."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import epmoe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_init_distributed_without_torchrun_is_single_process(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    assert epmoe.init_distributed() is None
    with pytest.raises(ValueError, match="timeout_s"):
        epmoe.init_distributed(timeout_s=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU demo; the GPU tier runs its own")
def test_demo_serves_on_two_gloo_ranks_and_matches_the_oracle():
    """The README's first command, shortened: 2 ranks, 1 layer, a few steps."""
    cmd = [sys.executable, os.path.join(ROOT, "launch", "demo.py"), "--nproc", "2",
           "--num-layers", "1", "--steps", "6", "--max-batch", "16"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "2 rank(s) on cpu" in out, out
    assert re.search(r"[\d,]+ tokens/s", out), out
    error = float(re.search(r"oracle: ([0-9.e+-]+)", out).group(1))
    assert error < 1e-5, out
    loads = [int(n) for n in re.findall(r"rank \d+: (\d+)", out)]
    assert len(loads) == 2 and all(n > 0 for n in loads), out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU demo; the GPU tier runs its own")
def test_demo_with_eplb_replans_while_serving_and_still_matches_the_oracle():
    cmd = [sys.executable, os.path.join(ROOT, "launch", "demo.py"), "--nproc", "2",
           "--num-layers", "1", "--steps", "7", "--max-batch", "16", "--placement", "eplb",
           "--rebalance-every", "3"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert re.findall(r"EPLB step (\d+): 1/1 layers re-placed", out) == ["3", "6"], out
    assert "placement=eplb" in out and "since the last re-plan" in out, out
    assert float(re.search(r"oracle: ([0-9.e+-]+)", out).group(1)) < 1e-5, out


def _example(name: str):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


@pytest.mark.parametrize(
    ("args", "match"),
    [(["--placement", "balanced"], "invalid choice: 'balanced'"),
     (["--backend", "nccl"], "invalid choice: 'nccl'"),
     (["--placement", "eplb", "--rebalance-every", "0"], "--rebalance-every must be at least 1"),
     (["--steps", "2"], "--steps must be at least 3, got 2"),
     (["--max-batch", "0"], "--max-batch must be at least 1"),
     (["--num-layers", "0"], "--num-layers must be at least 1"),
     (["--top-k", "20"], "--top-k 20 exceeds --num-experts 16")],
)  # fmt: skip
def test_demo_refuses_bad_options_before_starting(args, match, capsys):
    """At argument parsing, naming the option: not inside the layer on every rank."""
    with pytest.raises(SystemExit):
        _example("serve_demo").main(args)
    assert match in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "match"),
    [(["--max-batch", "0"], "argument --max-batch: expected an int >= 1, got '0'"),
     (["--log-every", "0"], "argument --log-every: expected an int >= 1"),
     (["--max-new-tokens", "1"], "argument --max-new-tokens: expected an int >= 2"),
     (["--rebalance-every", "x"], "argument --rebalance-every: expected an int >= 1, got 'x'"),
     (["--fp8-experts"], "experts in FP8: add --checkpoint"),
     (["--top-k", "9"], "--top-k 9 exceeds --num-experts 8")],
)  # fmt: skip
def test_serving_refuses_bad_options_before_starting(args, match, capsys):
    pytest.importorskip("transformers")
    with pytest.raises(SystemExit):
        _example("serving").main(args)
    assert match in capsys.readouterr().err


def test_the_launcher_refuses_nproc_0(capsys):
    """(0 once fell through to the default count of ranks)"""
    from epmoe.launch import main

    with pytest.raises(SystemExit):
        main(["--nproc", "0", "script.py"])
    assert "--nproc must be positive, got 0" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run; the GPU tier runs its own")
# (--static-cache alone is the step run's path without its graph protocol: "step" covers it)
@pytest.mark.parametrize("cache", ["dynamic", "step"])
def test_serving_example_on_two_gloo_ranks_matches_the_unconverted_model(cache):
    """examples/serving.py, shortened: per-rank queues, chunked prefill, batched decode,
    one step context per forward, an EPLB re-plan while serving, and greedy outputs equal
    to the unconverted model's; with transformers' dynamic KV cache, and with the static
    one that ``--cuda-graphs step`` captures (batches padded to the smallest bucket of 1, 2, 4
    rows that holds them, the mask built by the example, the padding rows routed to no
    expert) in the step graphs' protocol, which on CPU replays eagerly: every rank
    replays the step's bucket (the last, partial batches take smaller ones), idle ranks
    with no real rows while the other decodes, and after each re-plan the ranks capture
    the bucket a step needs again in that step, some in the middle of a batch (every 5
    steps: a capture that moved the cache's write position would change the outputs)."""
    pytest.importorskip("transformers")
    every = 5 if cache == "step" else 8
    requests = "9" if cache == "step" else "6"  # (9: several batch sizes, an idle rank)
    cmd = [sys.executable, os.path.join(ROOT, "launch", "run.py"), "--nproc", "2",
           os.path.join(ROOT, "examples", "serving.py"), "--requests", requests, "--max-batch", "4",
           "--max-new-tokens", "6", "--rebalance-every", str(every), "--log-every", str(every),
           "--check", "12", "--aligned-moe-steps", "2"]  # fmt: skip
    cmd += {"dynamic": [], "step": ["--cuda-graphs", "step"]}[cache]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert re.search(r"served \d+ requests, \d+ tokens .* on 2 rank\(s\) \(cpu\)", out), out
    # the MoE blocks' own time, every rank starting together
    assert re.search(r"MoE blocks with the ranks aligned: [\d.]+ ms per decode pass of 4 rows", out)
    # ... against this run's floor: weights read at the measured copy rate, plus comm
    floor = r"floor in this run: .* [\d.]+ ms \(copy \d+ GB/s\) .* = ([\d.]+) ms; .* = ([\d.]+)"
    m = re.search(floor, out)
    assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0, out
    assert "time to first token (from the start, queueing included): p50" in out, out
    assert "inter-token latency: p50" in out, out
    assert f"EPLB step {every}:" in out, out  # re-planned while serving
    # live: each rank's expert load (layer 0's rows since the last re-plan) and its balance
    live = re.search(
        rf"\[step {every}\] .* expert load per rank \[(\d+), (\d+)\] .* balancedness ([\d.]+)",
        out,
    )
    assert live, out
    loads, balance = [int(live.group(i)) for i in (1, 2)], float(live.group(3))
    assert sum(loads) > 0 and balance == pytest.approx(sum(loads) / 2 / max(loads), abs=0.006)
    # every request of every rank (those left alone in a batch as others finished too)
    served = int(re.search(r"served (\d+) requests", out).group(1))
    assert f"outputs of {served} requests against the unconverted model" in out, out
    assert f"{served} identical, 0 differ" in out, out
    if cache == "step":
        replays = (
            r"on all ranks (\d+), by batch size \{([\d:, ]+)\}, (\d+) of them by idle ranks; "
            r"captures per rank \[(\d+), (\d+)\]"
        )
        m = re.search(replays, out)
        assert m, out
        assert int(m.group(1)) > 0 and int(m.group(3)) > 0, out  # an idle rank replayed
        # the last, partial batches: steps on smaller buckets than --max-batch
        used = dict(tuple(map(int, kv.split(":"))) for kv in m.group(2).split(","))
        assert len(used) >= 2 and sum(used.values()) == int(m.group(1)), out
        # the three buckets at the start; the re-plans re-placed experts: every rank captured
        # again (collective), in step
        assert m.group(4) == m.group(5) and int(m.group(4)) > 3, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run; the GPU tier runs its own")
def test_a_written_deepseek_v3_fp8_checkpoint_is_served_by_shard(tmp_path):
    """examples/deepseek_v3_checkpoint.py writes a (small) DeepSeek-V3-shaped FP8
    checkpoint in DeepSeek's per-expert layout; examples/serving.py --checkpoint loads it
    by shard on 2 gloo ranks with the experts kept in FP8 and serves it, greedy outputs
    equal to the same checkpoint loaded whole on one rank."""
    pytest.importorskip("transformers")
    ckpt = tmp_path / "dsv3"
    write = [sys.executable, os.path.join(ROOT, "examples", "deepseek_v3_checkpoint.py"),
             str(ckpt), "--num-layers", "2", "--hidden-size", "256", "--num-experts", "16",
             "--moe-intermediate-size", "128", "--n-group", "4", "--topk-group", "2",
             "--num-heads", "4", "--q-lora-rank", "64", "--kv-lora-rank", "32", "--vocab",
             "512", "--shard-gb", "0.002"]  # fmt: skip
    done = subprocess.run(write, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"wrote 239 tensors, .* in 2 shard\(s\)", done.stdout), done.stdout
    serve = [sys.executable, os.path.join(ROOT, "launch", "run.py"), "--nproc", "2",
             os.path.join(ROOT, "examples", "serving.py"), "--checkpoint", str(ckpt),
             "--fp8-experts", "--requests", "4", "--max-batch", "4", "--max-new-tokens", "4",
             "--rebalance-every", "8", "--check", "2"]  # fmt: skip
    done = subprocess.run(serve, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "decode steps:" in out and "MoE blocks" in out, out
    assert "outputs of 4 requests against the checkpoint on one rank" in out, out
    assert "4 identical, 0 differ" in out, out


def test_shipped_h200_prefill_configs_compile_for_sm90_within_limits():
    """``launch/kernel_resources.py`` compiles the shipped H200 prefill tilings for sm_90a
    offline (Triton's bundled ptxas; no GPU): shared memory within 227 KiB, wgmma groups in
    flight inside the K loops, and no spills in the ``tl.dot`` kernels; the warp-specialised
    Hopper kernels the table ships spill at most a few bytes (up to 16 with triton 3.6, the
    GPU image, and 40 with 3.9 for the 192-row tiles, three MMA warpgroups), and ptxas keeps
    their MMAs asynchronous in bf16 and in FP8 (read from the SASS)."""
    pytest.importorskip("triton.backends.compiler", reason="needs triton with its compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, os.path.join(ROOT, "launch", "kernel_resources.py")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    if done.returncode != 0 and "No such file" in done.stderr:
        pytest.skip(f"Triton's CUDA tools are missing: {done.stderr[-200:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert {(r["dtype"], r["kernel"]) for r in rows} == {
        (d, k) for d in ("bf16", "fp8") for k in ("gate_up", "down")
    }
    for r in rows:
        assert "error" not in r, r
        assert r["smem"] <= 227 * 1024, r
        assert r["regs"] is not None and r["stack"] is not None, r
        assert max(r["wgmma_wait_pendings"]) >= 1, r
        if "wgmma" in r["config"]:
            assert r["stack"] <= 96, r
        elif r["dtype"] == "bf16":  # (FP8 tl.dot GEMM 1: 0 with triton 3.6, 24 B with 3.9)
            assert r["stack"] == 0, r
        if r["dtype"] == "bf16" or "wgmma" in r["config"]:
            # ptxas keeps the MMAs asynchronous (SASS; the FP8 tl.dot loop waits for zero
            # MMAs before each rescale, which is why the Hopper kernels exist)
            assert not r["mma_serialized"], r


def test_192_row_hopper_tiles_compile_for_sm90_within_limits():
    """The warp-specialised Hopper kernel with three MMA warpgroups (``block_m`` 192, the
    activations by TMA) fits sm_90's 227 KiB of shared memory and 64K registers, in bf16
    and FP8: a few bytes of spills at most, and ptxas keeps the MMAs asynchronous."""
    pytest.importorskip("triton.backends.compiler", reason="needs triton with its compiler")
    from epmoe.kernels.configs import wgmma_config

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, os.path.join(ROOT, "launch", "kernel_resources.py")]
    for dtype in ("bf16", "fp8"):  # (compiled side by side, a process each)
        config = wgmma_config(dtype, "wgmma_ws", 192).to_dict()
        cmd += ["--dtype", dtype, "--config", json.dumps(config)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    if done.returncode != 0 and "No such file" in done.stderr:
        pytest.skip(f"Triton's CUDA tools are missing: {done.stderr[-200:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [(r["dtype"], r["kernel"]) for r in rows] == [
        (d, k) for d in ("bf16", "fp8") for k in ("gate_up", "down")
    ]
    for r in rows:
        assert "error" not in r, r
        assert r["smem"] <= 227 * 1024 and r["stack"] <= 96, r
        assert r["sass_mmas"] == 24 and not r["mma_serialized"], r


# Rank 1 raises at once; rank 0 raises something else once rank 1's traceback is out (its
# atexit handler runs after Python printed the traceback), as rank 0 does in EPMoE.forward
# when another rank rejected its inputs.
_FAILING_RANKS = """
import atexit, os, sys, time
rank, marker = int(os.environ["RANK"]), sys.argv[1]
print(f"rank {rank} starts", flush=True)
if rank == 1:
    atexit.register(lambda: open(marker, "w").close())
    raise ValueError("boom on rank 1")
deadline = time.monotonic() + 60
while not os.path.exists(marker) and time.monotonic() < deadline:
    time.sleep(0.05)
raise RuntimeError("another rank of the EP group rejected its inputs")
"""


def test_run_shows_the_error_of_a_failing_rank_other_than_rank_0(tmp_path):
    """``launch/run.py`` shows rank 0 only, but when the job fails it prints the end of the
    stderr of every other rank that failed: rank 1's own error is in the output."""
    script = tmp_path / "fail.py"
    script.write_text(_FAILING_RANKS)
    cmd = [sys.executable, os.path.join(ROOT, "launch", "run.py"), "--nproc", "2",
           str(script), str(tmp_path / "rank1.done")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "rank 0 starts" in out and "rank 1 starts" not in out, out  # rank 0 shown live
    assert "ValueError: boom on rank 1" in out, out
    assert "===== local rank 1 failed" in out, out


def test_run_failed_rank_logs_picks_the_ranks_with_a_traceback(tmp_path):
    """Only ranks whose stderr holds a traceback are printed; the tail is bounded."""
    run_py = _load_run_py()
    for rank, text in [(1, "warning only\n"), (2, "x\n" * 100 + "Traceback (most recent "
                       "call last):\nValueError: bad ids on rank 2\n"), (3, "")]:  # fmt: skip
        d = tmp_path / "run_abc" / "attempt_0" / str(rank)
        d.mkdir(parents=True)
        (d / "stderr.log").write_text(text)
    report = run_py.failed_rank_logs(str(tmp_path), 4, lines=5)
    assert "rank 2 failed" in report and "ValueError: bad ids on rank 2" in report, report
    assert "rank 1" not in report and "rank 3" not in report, report
    assert len(report.splitlines()) == 6, report
    # no traceback anywhere (a rank killed by a signal): every non-empty stderr
    (tmp_path / "run_abc" / "attempt_0" / "2" / "stderr.log").write_text("Killed\n")
    report = run_py.failed_rank_logs(str(tmp_path), 4)
    assert "rank 1 wrote to stderr" in report and "Killed" in report, report


def _load_run_py():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "launch_run", os.path.join(ROOT, "launch", "run.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
