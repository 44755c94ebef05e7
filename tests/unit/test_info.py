"""``python -m epmoe.info`` and the backends' answer for a device this torch cannot use."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import epmoe
from epmoe.comm import backend_names

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = {"epmoe", "host", "platform", "versions", "gpus", "peer_access", "topology",
        "backends", "expert_kernels", "settings"}  # fmt: skip
VERSION_KEYS = {"python", "torch", "triton", "cuda_runtime", "nccl", "nvshmem", "nvshmem4py",
                "deep_ep", "pplx_kernels"}  # fmt: skip
SETTINGS = {"NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
            "EPMOE_COMM_TIMEOUT_S", "EPMOE_SYMM_LL_ROWS", "EPMOE_SYMM_PDL", "EPMOE_FUSED_ROUTING",
            "EPMOE_TRITON_AUTOTUNE"}  # fmt: skip


def _info(*args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    full_env.update(env)
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, full_env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "epmoe.info", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=full_env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_info_json_is_one_object_with_every_section():
    info = json.loads(_info("--json", NCCL_NVLS_ENABLE="1").stdout)
    assert set(info) == KEYS, info.keys()
    assert set(info["versions"]) == VERSION_KEYS, info["versions"]
    assert info["versions"]["torch"] == torch.__version__
    assert set(info["settings"]) == SETTINGS, info["settings"]
    assert info["settings"]["NCCL_NVLS_ENABLE"]["value"] == "1"
    assert info["settings"]["NCCL_NVLS_ENABLE"]["ok"] is False  # NVLS on: flagged
    assert info["settings"]["NVSHMEM_DISABLE_NVLS"]["ok"] is True  # unset: the launcher sets it
    assert set(info["backends"]["cpu"]) == set(backend_names())
    assert info["backends"]["cpu"]["naive"] is None  # the portable backends run on CPU
    assert len(info["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert set(info["expert_kernels"]) == {"tl.dot", "wgmma"}
    if not torch.cuda.is_available():
        assert "cuda" not in info["backends"] and info["peer_access"] == []
        assert "sm_90" in info["expert_kernels"]["wgmma"]  # why not, not just "no"


def test_info_text_names_versions_backends_and_settings():
    out = _info(EPMOE_COMM_TIMEOUT_S="soon").stdout
    for word in ("Versions", "torch", "NCCL", "NVSHMEM", "deep_ep", "pplx_kernels",
                 "Backends on cpu", "naive", "usable", "Expert kernels", "wgmma", "Settings",
                 "NCCL_NVLS_ENABLE"):  # fmt: skip
        assert word in out, out
    assert "FIX EPMOE_COMM_TIMEOUT_S=soon" in out, out  # not a number of seconds
    assert "{" not in out.splitlines()[0], out  # text, not JSON


def test_info_says_not_installed_for_absent_packages():
    from epmoe.info import NOT_INSTALLED, _package_version

    assert _package_version({}, ("no-such-dist",), "no_such_module_epmoe") == NOT_INSTALLED
    assert _package_version({"nvidia-nvshmem-cu13": "3.3.9"}, ("nvidia-nvshmem",), None) == (
        "3.3.9 (nvidia-nvshmem-cu13)"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without usable CUDA")
def test_no_backend_is_usable_on_cuda_without_cuda():
    """A CPU-only torch asked about ``cuda``: every backend says why, none calls itself usable
    (the base class refuses it, so a new backend gets it too)."""
    reasons = epmoe.available_backends("cuda")
    assert set(reasons) == set(backend_names())
    for name, reason in reasons.items():
        assert reason is not None and "CUDA is not available" in reason, (name, reason)
    assert epmoe.available_backends("cpu")["all_to_all"] is None
    from epmoe.comm import resolve_backend

    with pytest.raises(RuntimeError, match="CUDA is not available"):
        resolve_backend("auto", "cuda", None)


def test_topology_drops_terminal_styling(monkeypatch, tmp_path):
    from epmoe import info

    fake = tmp_path / "nvidia-smi"  # what the image's nvidia-smi writes into a pipe
    fake.write_text("#!/bin/sh\nprintf '\\t\\033[4mGPU0\\tGPU1\\033[0m\\nGPU0\\t X \\tNV18\\n'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert info.topology() == "\tGPU0\tGPU1\nGPU0\t X \tNV18"


def test_info_flags_an_epmoe_fused_routing_that_is_neither_0_nor_1():
    settings = json.loads(_info("--json", EPMOE_FUSED_ROUTING="on").stdout)["settings"]
    assert settings["EPMOE_FUSED_ROUTING"]["ok"] is False
    assert "neither 0 nor 1" in settings["EPMOE_FUSED_ROUTING"]["note"]
    settings = json.loads(_info("--json", EPMOE_FUSED_ROUTING="0").stdout)["settings"]
    assert settings["EPMOE_FUSED_ROUTING"]["ok"] is True
