"""``epmoe.launch`` (``epmoe-run``, ``launch/run.py``): the torchrun command it builds for one
node and for many, and the mistakes it refuses before starting anything."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from epmoe.launch import Nodes, main, torchrun_command

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _opt(cmd: list[str], name: str) -> str | None:
    """The value after ``name`` in ``cmd`` (``None`` when absent)."""
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_one_node_meets_on_a_free_local_port():
    cmd = torchrun_command("serve.py", ["--x", "1"], 4, all_ranks=False, log_dir="/tmp/logs")
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert _opt(cmd, "--nnodes") == "1" and _opt(cmd, "--nproc-per-node") == "4"
    assert _opt(cmd, "--master-addr") == "127.0.0.1" and int(_opt(cmd, "--master-port")) > 0
    assert _opt(cmd, "--local-ranks-filter") == "0" and _opt(cmd, "--log-dir") == "/tmp/logs"
    assert _opt(cmd, "--redirects") == "1:3,2:3,3:3"
    assert "--node-rank" not in cmd and "--rdzv-endpoint" not in cmd
    assert cmd[-3:] == ["serve.py", "--x", "1"]


def test_static_multi_node_passes_node_rank_and_master():
    nodes = Nodes(nnodes=2, node_rank=1, master_addr="10.0.0.1")
    cmd = torchrun_command("bench", ["comm"], 8, all_ranks=True, module=True, nodes=nodes)
    assert _opt(cmd, "--nnodes") == "2" and _opt(cmd, "--node-rank") == "1"
    assert _opt(cmd, "--master-addr") == "10.0.0.1"
    assert _opt(cmd, "--master-port") == "29500"  # the same on every node, not a free port
    assert "--local-ranks-filter" not in cmd  # --all-ranks
    assert cmd[-3:] == ["-m", "bench", "comm"]
    nodes = Nodes(nnodes="2", node_rank=0, master_addr="node0", master_port=23456)
    assert _opt(torchrun_command("s.py", [], 8, False, nodes=nodes), "--master-port") == "23456"


def test_rendezvous_multi_node_uses_c10d_and_no_master():
    nodes = Nodes(nnodes="2:4", rdzv_endpoint="node0:29400", rdzv_id="job7")
    cmd = torchrun_command("s.py", [], 8, False, nodes=nodes)
    assert _opt(cmd, "--nnodes") == "2:4" and _opt(cmd, "--rdzv-backend") == "c10d"
    assert _opt(cmd, "--rdzv-endpoint") == "node0:29400" and _opt(cmd, "--rdzv-id") == "job7"
    assert "--master-addr" not in cmd and "--node-rank" not in cmd


@pytest.mark.parametrize(
    "kwargs, message",
    [
        pytest.param({"nnodes": 2}, "--master-addr HOST", id="several nodes, nowhere to meet"),
        pytest.param({"nnodes": 2, "master_addr": "n0"}, "needs --node-rank", id="no node rank"),
        pytest.param(
            {"nnodes": 2, "master_addr": "n0", "node_rank": 2}, "0 … 1", id="node rank = nnodes"
        ),
        pytest.param(
            {"nnodes": "1:2", "master_addr": "n0", "node_rank": 0},
            "a range",
            id="range without rendezvous",
        ),
        pytest.param(
            {"nnodes": 2, "rdzv_endpoint": "n0:1", "master_addr": "n0"},
            "not both",
            id="rendezvous and master",
        ),
        pytest.param(
            {"nnodes": 2, "rdzv_endpoint": "n0:1", "node_rank": 0},
            "assigns",
            id="rendezvous with node rank",
        ),
        pytest.param({"nnodes": 2, "rdzv_endpoint": "n0"}, "HOST:PORT", id="endpoint no port"),
        pytest.param({"nnodes": "0"}, "M >= 1", id="zero nodes"),
        pytest.param({"nnodes": "3:2", "rdzv_endpoint": "n0:1"}, "MIN <= MAX", id="MIN > MAX"),
    ],
)
def test_nodes_refuses_inconsistent_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Nodes(**kwargs)


def test_main_reports_a_bad_option_as_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--nnodes", "2", "script.py"])
    assert exc.value.code == 2
    assert "--master-addr HOST" in capsys.readouterr().err


def test_more_than_ten_ranks_go_to_their_files_with_rank_0_teed():
    """torchrun's per-rank --redirects map takes one-digit local ranks (11 ranks failed at
    once with 'does not match'): above 10, every rank to its files, rank 0 also here."""
    cmd = torchrun_command("serve.py", [], 11, all_ranks=False, log_dir="/tmp/logs")
    assert _opt(cmd, "--redirects") == "3" and _opt(cmd, "--tee") == "0:3"
    assert _opt(cmd, "--local-ranks-filter") == "0"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["no_such_script.py"], "no script 'no_such_script.py' (a module? add -m)"),
        (["--all-ranks", "--log-dir", "/tmp/x", "-m", "m"], "--log-dir keeps the other ranks'"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:99999", "-m", "m"], "HOST:PORT"),
    ],
)
def test_main_refuses_what_torchrun_would_fail_on_late(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_no_rank_log_means_torchrun_stopped_before_the_ranks(tmp_path):
    from epmoe.launch import failed_rank_logs

    assert "torchrun stopped before it started the ranks" in failed_rank_logs(str(tmp_path), 2)


def test_python_m_epmoe_launch_runs_a_module_on_two_ranks(tmp_path):
    """The packaged launcher end to end: ``python -m epmoe.launch --all-ranks -m MODULE``."""
    (tmp_path / "hello_ranks.py").write_text(
        # one write per rank (a line below PIPE_BUF is atomic): the ranks share the pipe
        "import os, sys\n"
        "rank, world = os.environ['RANK'], os.environ['WORLD_SIZE']\n"
        "sys.stdout.write(f'hello from rank {rank} of {world}\\n')\n"
        "sys.stdout.flush()\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path), ROOT) if p)
    cmd = [sys.executable, "-m", "epmoe.launch", "--nproc", "2", "--all-ranks", "-m",
           "hello_ranks"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "hello from rank 0 of 2" in out and "hello from rank 1 of 2" in out, out


def test_sigterm_to_the_launcher_stops_the_ranks_and_cleans_up(tmp_path):
    """A scheduler's (or ``timeout``'s) SIGTERM reaches torchrun, which stops its ranks; the
    launcher then removes its temporary log folder. (It left torchrun and every rank running,
    and the folder behind.)"""
    import signal
    import time

    (tmp_path / "sleeper.py").write_text(
        "import os, time\n"
        "open(os.path.join(os.environ['PIDS'], os.environ['LOCAL_RANK']), 'w')"
        ".write(str(os.getpid()))\n"
        "time.sleep(120)\n"
    )
    env = dict(os.environ, PIDS=str(tmp_path), TMPDIR=str(tmp_path))
    cmd = [sys.executable, "-m", "epmoe.launch", "--nproc", "2", str(tmp_path / "sleeper.py")]
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, **quiet)
    deadline = time.monotonic() + 60
    while not all((tmp_path / r).exists() for r in "01"):
        assert time.monotonic() < deadline and proc.poll() is None, "the ranks never started"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) != 0
    pids = [int((tmp_path / r).read_text()) for r in "01"]
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}") for pid in pids):
        assert time.monotonic() < deadline, f"ranks {pids} still running"
        time.sleep(0.2)
    assert not list(tmp_path.glob("epmoe-run-*")), "the temporary log folder was left"
