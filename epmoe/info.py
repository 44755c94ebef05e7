"""What this machine offers epmoe: ``python -m epmoe.info [--json]``.

Versions (Python, torch, Triton, CUDA, NCCL, NVSHMEM, nvshmem4py, DeepEP, pplx-kernels),
the GPUs and the links between them, which communication backends can run here and why
the others cannot, and the environment settings that matter, each against its
recommended value. Plain text by default; ``--json`` prints one JSON object with the same
content (keys: ``epmoe``, ``host``, ``platform``, ``versions``, ``gpus``, ``peer_access``,
``topology``, ``backends``, ``expert_kernels``, ``settings``).

Optional packages are looked up by their installed metadata, never imported (importing
DeepEP or NVSHMEM initialises CUDA or reads the environment). Only the backends'
modules are imported, to ask them ``unavailable_reason``. Runs in a couple of seconds on
a CPU-only machine.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from typing import Any

import torch

from epmoe.distributed import SAFE_GPU_ENV

NOT_INSTALLED = "not installed"
TOPO_TIMEOUT_S = 10.0
# terminal styling (nvidia-smi underlines its header even when writing to a pipe)
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

# package shown -> (distribution names, by prefix after normalisation; module name or None)
_PACKAGES: dict[str, tuple[tuple[str, ...], str | None]] = {
    "triton": (("triton",), "triton"),
    "NVSHMEM": (("nvidia-nvshmem",), None),  # nvidia-nvshmem-cu12 / -cu13 (the library)
    "nvshmem4py": (("nvshmem4py",), "nvshmem"),  # nvshmem4py-cu12 / -cu13
    "deep_ep": (("deep-ep", "deepep"), "deep_ep"),
    "pplx_kernels": (("pplx-kernels",), "pplx_kernels"),
}


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed() -> dict[str, str]:
    """Normalised distribution name → version, for every installed distribution."""
    found = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata.get("Name")
        if name:
            found.setdefault(_normalise(name), dist.version)
    return found


def _package_version(installed: dict[str, str], dists: tuple[str, ...], module: str | None) -> str:
    for prefix in dists:
        for name in sorted(installed):
            if name == prefix or name.startswith(prefix + "-"):
                return installed[name] if name == prefix else f"{installed[name]} ({name})"
    # built from source without metadata (DeepEP, pplx-kernels): present, version unknown
    if module is not None and importlib.util.find_spec(module) is not None:
        return "installed (version unknown)"
    return NOT_INSTALLED


def versions() -> dict[str, str]:
    """Python, torch, CUDA, NCCL and the optional packages (``"not installed"`` if absent)."""
    installed = _installed()
    out = {"python": platform.python_version(), "torch": torch.__version__}
    out["triton"] = _package_version(installed, *_PACKAGES["triton"])
    out["cuda_runtime"] = torch.version.cuda or "none (CPU-only torch)"
    out["nccl"] = _nccl_version()
    for shown in ("NVSHMEM", "nvshmem4py", "deep_ep", "pplx_kernels"):
        out[shown.lower()] = _package_version(installed, *_PACKAGES[shown])
    return out


def _nccl_version() -> str:
    if torch.version.cuda is None or not torch.distributed.is_nccl_available():
        return "not available (torch without NCCL)"
    try:
        v = torch.cuda.nccl.version()
    except Exception as exc:  # a CUDA build without the library loaded
        return f"unknown ({type(exc).__name__}: {exc})"
    return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)


def gpus() -> list[dict[str, Any]]:
    """Every visible GPU: index, name, memory, SM count, compute capability."""
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(
            {
                "index": i,
                "name": p.name,
                "memory_gib": round(p.total_memory / 2**30, 1),
                "sm_count": p.multi_processor_count,
                "compute_capability": f"{p.major}.{p.minor}",
            }
        )
    return out


def peer_access() -> list[list[bool | None]]:
    """``[i][j]``: whether GPU ``i`` can access GPU ``j``'s memory (``None`` on the diagonal)."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [
        [None if i == j else bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)]
        for i in range(n)
    ]


def topology(timeout_s: float = TOPO_TIMEOUT_S) -> str | None:
    """``nvidia-smi topo -m`` (the links between GPUs, NICs and CPUs), or ``None`` when
    nvidia-smi is not here; its error when it fails or outlasts ``timeout_s``."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run(
            [exe, "topo", "-m"], capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return f"nvidia-smi topo -m did not answer within {timeout_s:g} s"
    except OSError as exc:
        return f"nvidia-smi topo -m failed: {exc}"
    if done.returncode != 0:
        return f"nvidia-smi topo -m exited {done.returncode}: {done.stderr.strip()[-500:]}"
    return ANSI_ESCAPE.sub("", done.stdout).rstrip()


def backends() -> dict[str, dict[str, str | None]]:
    """Device → backend → ``None`` (usable here) or why not, for ``cpu`` and, when CUDA is
    available, ``cuda`` (``epmoe.available_backends``)."""
    from epmoe.comm import available_backends

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return {d: available_backends(d) for d in devices}


def expert_kernels() -> dict[str, str | None]:
    """Kernel family of ``experts="triton"`` → ``None`` (runs on GPU 0 here) or why not:
    the portable ``tl.dot`` kernels, and the Hopper Gluon kernels (``MoEConfig.kernel``
    ``"wgmma"`` / ``"wgmma_ws"``, shipped for H200 prefill)."""
    if importlib.util.find_spec("triton") is None:
        missing = "triton is not installed"
        return {"tl.dot": missing, "wgmma": missing}
    if not torch.cuda.is_available():
        cpu = "no CUDA GPU (on CPU only under TRITON_INTERPRET=1, for tests)"
        return {"tl.dot": cpu, "wgmma": "needs an sm_90 GPU (H100/H200)"}
    from epmoe.kernels.configs import wgmma_unavailable

    return {"tl.dot": None, "wgmma": wgmma_unavailable(0)}


def _switch(name: str, on: str, off: str, who: str) -> dict[str, Any]:
    """A 0/1 environment switch that is on by default: its value, whether it is valid, and
    what it does (``on`` / ``off``; ``who`` refuses any other value)."""
    raw = os.environ.get(name)
    ok = raw is None or raw.strip() in ("", "0", "1")
    enabled = raw is None or raw.strip() in ("", "1")
    note = on if enabled else off if ok else f"{raw!r} is neither 0 nor 1: {who} will refuse it"
    return {"value": raw, "recommended": "unset (1)", "ok": ok, "note": note}


def settings() -> dict[str, dict[str, Any]]:
    """The environment variables that matter, each with its value here (``None``: unset),
    the recommended value, whether it is fine as it is, and a note saying what it does."""
    out: dict[str, dict[str, Any]] = {}
    for key, good in SAFE_GPU_ENV.items():
        value = os.environ.get(key)
        if value is None:
            ok, note = True, f"unset; epmoe.launch and init_distributed set it to {good}"
        elif value == good:
            ok, note = True, "NVLink multicast off"
        else:
            ok = False
            note = (
                f"NVLink multicast (NVLS) may be used: on a shared host it can take every "
                f"GPU out of service; set {key}={good}"
            )
        out[key] = {"value": value, "recommended": good, "ok": ok, "note": note}
    raw = os.environ.get("EPMOE_COMM_TIMEOUT_S")
    from epmoe.comm.symm.common import comm_timeout_s  # (the backends' own check)

    try:
        comm_timeout_s()
        ok = True
    except ValueError:
        ok = False
    out["EPMOE_COMM_TIMEOUT_S"] = {
        "value": raw,
        "recommended": "unset (10 s) or a positive number of seconds below 9e9",
        "ok": ok,
        "note": "bound on every wait in the symm_ll and symm_ht kernels"
        + (
            ""
            if ok
            else f"; {raw!r} is not a positive number below 9e9: symm_ll and symm_ht will refuse it"
        ),
    }
    raw = os.environ.get("EPMOE_SYMM_LL_ROWS")
    ok = raw is None or raw.strip() in ("", "in_place", "copy")
    out["EPMOE_SYMM_LL_ROWS"] = {
        "value": raw,
        "recommended": "unset (in_place)",
        "ok": ok,
        "note": (
            "symm_ll's experts read the received rows where they landed"
            if raw is None or raw.strip() in ("", "in_place")
            else "symm_ll copies received rows into [e, C, H] slabs (slower; for comparison)"
            if ok
            else f"{raw!r} is neither in_place nor copy: symm_ll will refuse it"
        ),
    }
    out["EPMOE_SYMM_PDL"] = _switch(
        "EPMOE_SYMM_PDL",
        "symm kernels in CUDA graphs launch with programmatic dependent launch on sm_90+",
        "symm kernels never launch with programmatic dependent launch",
        "symm kernels",
    )
    out["EPMOE_FUSED_ROUTING"] = _switch(
        "EPMOE_FUSED_ROUTING",
        "EPMoE routes and places tokens with one Triton kernel on CUDA, and records the "
        "EPLB load of a decode step with another",
        "EPMoE routes and records the EPLB load with torch kernels (about a dozen launches "
        "per forward, seven more with EPLB)",
        "EPMoE on CUDA",
    )
    raw = os.environ.get("EPMOE_TRITON_AUTOTUNE")
    off = raw is not None and raw.strip().lower() in ("0", "false", "no", "off")
    out["EPMOE_TRITON_AUTOTUNE"] = {
        "value": raw,
        "recommended": "unset (on)",
        "ok": True,
        "note": "Triton experts use the shipped tilings only"
        if off
        else "Triton experts time a few tilings once per shape on CUDA",
    }
    return out


def collect() -> dict[str, Any]:
    """Everything ``python -m epmoe.info`` reports, as one JSON-serialisable dict."""
    import epmoe

    return {
        "epmoe": epmoe.__version__,
        "host": platform.node(),
        "platform": platform.platform(),
        "versions": versions(),
        "gpus": gpus(),
        "peer_access": peer_access(),
        "topology": topology(),
        "backends": backends(),
        "expert_kernels": expert_kernels(),
        "settings": settings(),
    }


def render(info: dict[str, Any]) -> str:
    """The plain-text report of :func:`collect`'s dict."""
    lines = [f"epmoe {info['epmoe']} on {info['host']} ({info['platform']})", "", "Versions"]
    names = {"cuda_runtime": "CUDA runtime", "nccl": "NCCL", "nvshmem": "NVSHMEM"}
    for key, value in info["versions"].items():
        lines.append(f"  {names.get(key, key):<14} {value}")
    lines.append("")
    if not info["gpus"]:
        lines.append("GPUs: none visible (torch.cuda.is_available() is False)")
    else:
        lines.append(f"GPUs ({len(info['gpus'])})")
        for g in info["gpus"]:
            lines.append(
                f"  {g['index']}: {g['name']}, {g['memory_gib']} GiB, {g['sm_count']} SMs, "
                f"sm_{g['compute_capability'].replace('.', '')}"
            )
        n = len(info["gpus"])
        if n > 1:
            lines.append("  peer access (row can read column):")
            lines.append("       " + " ".join(f"{j:>4}" for j in range(n)))
            for i, row in enumerate(info["peer_access"]):
                cells = ["   -" if c is None else ("  ok" if c else "  no") for c in row]
                lines.append(f"    {i:>2} " + " ".join(cells))
    if info["topology"] is not None:
        lines += ["", "nvidia-smi topo -m", *("  " + x for x in info["topology"].splitlines())]
    for device, table in info["backends"].items():
        lines += ["", f"Backends on {device}"]
        for name, reason in table.items():
            lines.append(f"  {name:<12} {'usable' if reason is None else 'no: ' + reason}")
    lines += ["", "Expert kernels (experts='triton')"]
    for name, reason in info["expert_kernels"].items():
        lines.append(f"  {name:<12} {'usable' if reason is None else 'no: ' + reason}")
    lines += ["", "Settings"]
    for key, s in info["settings"].items():
        value = "<unset>" if s["value"] is None else s["value"]
        mark = "ok " if s["ok"] else "FIX"
        lines.append(f"  {mark} {key}={value}  recommended: {s['recommended']}")
        lines.append(f"      {s['note']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m epmoe.info [--json]``: print the report; returns 0."""
    ap = argparse.ArgumentParser(
        prog="python -m epmoe.info",
        description="Versions, GPUs and their links, usable backends and the settings that "
        "matter on this machine.",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    opts = ap.parse_args(argv)
    info = collect()
    print(json.dumps(info, indent=2) if opts.json else render(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
