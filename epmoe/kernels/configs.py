"""Block sizes of the MoE kernels: tuned tables per device, shape heuristics, autotuning.

A config is chosen per problem key (layout, weight dtype, H, I, e) and row bucket ``m``
(``R`` received rows for the Standard layout, ``C`` capacity for ExpertBatched), in order:

1. the tuned table shipped for this device, ``epmoe/kernels/configs/<device name>.json``
   (written by ``python -m epmoe.bench experts --configs``), at the nearest ``m``;
2. on CUDA, unless ``EPMOE_TRITON_AUTOTUNE=0``, a one-time timing of a few candidates on
   the first call of each key and power-of-two ``m`` bucket (never while a CUDA graph is
   being captured), cached for the process;
3. shape heuristics.

Nothing here compiles or touches a device at import; tables load on first use.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from importlib import resources
from typing import Any

import torch

from epmoe.distributed import normalize_device

AUTOTUNE_ENV = "EPMOE_TRITON_AUTOTUNE"
FP8_GROUP = 128
LAYOUTS = ("standard", "batched")
KERNELS = ("dot", "wgmma", "wgmma_ws")
WGMMA_KERNELS = ("wgmma", "wgmma_ws")  # the Hopper (sm_90) Gluon kernels
_SMEM_BYTES = 227 * 1024  # H100/H200 shared memory per block (opt-in maximum)


@dataclass(frozen=True)
class GemmConfig:
    """Tiling of one GEMM (the row block size ``block_m`` is shared, see ``MoEConfig``)."""

    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.group_m < 1:
            raise ValueError(f"group_m must be >= 1, got {self.group_m}")
        if self.num_warps not in (1, 2, 4, 8, 12, 16):
            raise ValueError(
                f"num_warps must be one of 1, 2, 4, 8, 16 (12: kernel='wgmma_ws' only), got "
                f"{self.num_warps}"
            )
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")


@dataclass(frozen=True)
class MoEConfig:
    """Tiling of one MoE forward: ``block_m`` rows per block (the alignment of the Standard
    layout, shared by both GEMMs), then each GEMM's own tiling.

    ``half_tail``: an expert's last block of at most ``block_m / 2`` rows runs a half-height
    tile (the Standard layout pads each group to ``pad_m``: ``block_m / 2``, or 64 rows on
    ``wgmma_ws``, whose warpgroups skip rows past a block's end). At about one block
    of rows per expert it cuts the rows the tiles compute from ≈ 1.5× to ≈ 1.25× the useful
    ones while the other blocks keep the full-height MMA.

    ``kernel``: ``"dot"``, the portable ``tl.dot`` kernels (``grouped_gemm``), or
    ``"wgmma"``, the Hopper (sm_90) Gluon kernels of the Standard layout (``wgmma``), with
    explicitly asynchronous warpgroup MMAs on two accumulator tiles, or ``"wgmma_ws"``, their
    warp-specialised, persistent form (a loader partition; each MMA warpgroup a partition
    that waits on mbarriers only; ``num_warps`` 8 or 12: two or three MMA warpgroups), which
    also runs the ExpertBatched layout. A ``wgmma`` config has
    ``block_m = 16 · num_warps`` in both GEMMs, ``block_k`` of 128 bytes, ``gate_up.block_n``
    128 and an even ``down.block_n`` (two accumulator tiles of ``down.block_n / 2``); with
    ``half_tail`` the two warpgroups of a half-height tile split its columns.
    ``wgmma_ws`` also runs ``block_m`` 192 (``num_warps`` 12: three MMA warpgroups), so that
    an expert of up to 192 rows reads each weight tile once, and its ``half_tail`` pads each
    group to one warpgroup's 64 rows only (``pad_m``).

    ``atomic_reduce`` (Standard layout): GEMM 2's epilogue adds each pair's router-weighted
    row into its token's output row with atomics, so the ``[P, H]`` rows by position are
    never written nor read back and the top-k sum needs no launch of its own. The adds run
    in the output dtype and in arrival order: the rounding of a row's sum (bf16: about
    ``sqrt(K)`` times one rounding) can differ from run to run. Off, the sum is a separate
    pass in fp32 and the layer is bitwise reproducible.
    """

    block_m: int
    gate_up: GemmConfig
    down: GemmConfig
    half_tail: bool = False
    kernel: str = "dot"
    atomic_reduce: bool = False

    def __post_init__(self) -> None:
        three_warpgroups = self.kernel == "wgmma_ws" and self.block_m == 192
        if (self.block_m < 16 or self.block_m & (self.block_m - 1)) and not three_warpgroups:
            raise ValueError(
                f"block_m must be a power of two >= 16 (or 192 with kernel='wgmma_ws'), got "
                f"{self.block_m}"
            )
        if self.kernel != "wgmma_ws" and 12 in (self.gate_up.num_warps, self.down.num_warps):
            raise ValueError(f"num_warps 12 needs kernel='wgmma_ws', got {self.kernel!r}")
        if self.half_tail and self.block_m < 32:
            raise ValueError(
                f"half_tail needs block_m >= 32 (tiles of at least 16 rows), got {self.block_m}"
            )
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        if self.kernel in WGMMA_KERNELS:
            self._check_wgmma()

    def _check_wgmma(self) -> None:
        gu, dn = self.gate_up, self.down
        ws = self.kernel == "wgmma_ws"
        problems = []
        for name, c in (("gate_up", gu), ("down", dn)):
            if ws and (c.num_warps not in (8, 12) or 16 * c.num_warps != self.block_m):
                problems.append(
                    f"{name}.num_warps 8 or 12 (two or three MMA warpgroups; the loader warps "
                    "come on top) with block_m = 16 · num_warps"
                )
            if not ws and (c.num_warps not in (4, 8) or self.block_m != 16 * c.num_warps):
                problems.append(f"{name}.num_warps 4 or 8 with block_m = 16 · num_warps")
            if c.num_stages < 3:
                problems.append(f"{name}.num_stages >= 3")
        if gu.block_n != 128:
            problems.append("gate_up.block_n = 128")
        if not 32 <= dn.block_n <= 256:
            problems.append(
                "down.block_n 32 to 256 (two tiles of at most 128 columns: one FP8 scale block)"
            )
        if self.half_tail and self.block_m < 128:
            problems.append("block_m 128 with half_tail (half-height tiles of 64 rows)")
        for name, c, tile_n in (("gate_up", gu, gu.block_n), ("down", dn, dn.block_n // 2)):
            # each stage: the activation tile and two weight tiles, rows of 128 bytes
            # (2 KiB for mbarriers, the tile queue and wgmma_ws's source rows of a tile)
            if c.num_stages * (self.block_m + 2 * tile_n) * 128 > _SMEM_BYTES - 2048:
                problems.append(
                    f"{name}.num_stages within {_SMEM_BYTES // 1024} KiB of shared memory"
                )
        if problems:
            raise ValueError(
                f"a kernel={self.kernel!r} config needs {'; '.join(problems)}; got {self}"
            )

    @property
    def pad_m(self) -> int:
        """Each expert's group of the Standard layout is padded to a multiple of this:
        ``block_m``; with ``half_tail`` ``block_m / 2``, or one warpgroup's 64 rows on
        ``wgmma_ws`` (whose warpgroups skip rows past a block's end by themselves)."""
        if not self.half_tail:
            return self.block_m
        return 64 if self.kernel == "wgmma_ws" else self.block_m // 2

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MoEConfig:
        return cls(
            block_m=int(d["block_m"]),
            gate_up=GemmConfig(**d["gate_up"]),
            down=GemmConfig(**d["down"]),
            half_tail=_bool_field(d, "half_tail"),
            kernel=str(d.get("kernel", "dot")),
            atomic_reduce=_bool_field(d, "atomic_reduce"),
        )

    def short(self) -> str:
        """A compact label, e.g. ``m128h gu128x64w8s4g8 dn256x64w8s3g8`` (``h``: half tails;
        ``+`` at the end: ``atomic_reduce``)."""

        def g(c: GemmConfig) -> str:
            return f"{c.block_n}x{c.block_k}w{c.num_warps}s{c.num_stages}g{c.group_m}"

        half = "h" if self.half_tail else ""
        kernel = "" if self.kernel == "dot" else f" {self.kernel}"
        summed = "+" if self.atomic_reduce else ""
        return f"m{self.block_m}{half} gu{g(self.gate_up)} dn{g(self.down)}{summed}{kernel}"


def _bool_field(d: dict[str, Any], key: str) -> bool:
    value = d.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"config field {key!r} must be true or false, got {value!r}")
    return value


def check_config(config: MoEConfig, fp8: bool) -> None:
    """Raise ValueError if ``config`` cannot run the FP8 kernels (K steps inside one scale
    group). ``gate_up.block_n == 128`` quantizes GEMM 1's output in its epilogue; other
    widths store it in fp32 and quantize it in a separate pass (the same values)."""
    if not fp8:
        return
    for name, c in (("gate_up", config.gate_up), ("down", config.down)):
        if FP8_GROUP % c.block_k:
            raise ValueError(
                f"FP8 needs {name}.block_k to divide {FP8_GROUP} (one scale per step), got "
                f"{c.block_k}"
            )


@functools.cache
def wgmma_unavailable(device_index: int) -> str | None:
    """Why CUDA device ``device_index`` cannot run the Hopper kernels (``kernel="wgmma"`` /
    ``"wgmma_ws"``), or None: they need an sm_90 GPU and a Triton with Gluon's Hopper module
    (asked once per device; ``ops``, ``select_config`` and ``epmoe.info`` share the answer)."""
    major, minor = torch.cuda.get_device_capability(device_index)
    if (major, minor) != (9, 0):
        return f"they need an sm_90 GPU (H100/H200); cuda:{device_index} is sm_{major}{minor}"
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except ImportError:
        return "this Triton has no Gluon Hopper module (Triton >= 3.6 has it)"
    return None


def wgmma_config(dtype: str, kernel: str = "wgmma", block_m: int = 128) -> MoEConfig | None:
    """The Hopper kernels' tiling for the Standard layout in ``dtype`` (None for fp32):
    128-row blocks over two warpgroups, half-height tails, four stages of 128-byte K steps,
    GEMM 2 tiles of 256 columns (two accumulators of 128); ``kernel`` ``"wgmma"`` or
    ``"wgmma_ws"`` (what the H200 table ships for prefill, and for decode slabs from
    C = 512); ``block_m`` 192 (``wgmma_ws`` only): three MMA warpgroups."""
    if dtype == "fp32":
        return None
    block_k = 128 if dtype == "fp8" else 64
    # bf16 GEMM 1: each row block sweeps all the columns (group_m 1), 7% faster on H200 than
    # 8 row blocks together; FP8 the other way round (launch/kernel_ab.py, docs/kernels.md)
    group_m = 8 if dtype == "fp8" else 1
    G = GemmConfig
    warps = block_m // 16
    gate_up, down = G(128, block_k, group_m, warps, 4), G(256, block_k, 8, warps, 4)
    return MoEConfig(block_m, gate_up, down, half_tail=True, kernel=kernel)


def _runnable(config: MoEConfig, device: torch.device) -> bool:
    """False for a Hopper-kernel config on a device or Triton that cannot run it."""
    if config.kernel not in WGMMA_KERNELS:
        return True
    if device.type != "cuda":
        return False
    return wgmma_unavailable(normalize_device(device).index) is None


def dtype_name(weight_dtype: torch.dtype) -> str:
    """The table's name of a weight dtype: ``fp8``, ``bf16``, ``fp16`` or ``fp32``."""
    names = {
        torch.float8_e4m3fn: "fp8",
        torch.bfloat16: "bf16",
        torch.float16: "fp16",
        torch.float32: "fp32",
    }
    if weight_dtype not in names:
        raise TypeError(f"no kernel config for weight dtype {weight_dtype}")
    return names[weight_dtype]


def problem_key(
    layout: str, dtype: str, hidden_size: int, intermediate_size: int, num_experts: int
) -> str:
    """Key of a tuned-table entry, e.g. ``standard:bf16:H7168:I2048:e128``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return f"{layout}:{dtype}:H{hidden_size}:I{intermediate_size}:e{num_experts}"


def table_filename(device_name: str) -> str:
    """``"NVIDIA H200"`` → ``"NVIDIA_H200.json"``."""
    return re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json"


@functools.cache
def _device_name(index: int) -> str:
    """The name of CUDA device ``index``, asked once (every forward picks a config)."""
    return torch.cuda.get_device_name(index)


@functools.cache
def load_table(device_name: str) -> dict[str, dict[int, MoEConfig]]:
    """The tuned table shipped for ``device_name`` (empty when there is none)."""
    path = resources.files("epmoe.kernels").joinpath("configs", table_filename(device_name))
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    return {
        key: {int(m): MoEConfig.from_dict(c) for m, c in by_m.items()}
        for key, by_m in raw.get("configs", {}).items()
    }


def lookup(table: dict[str, dict[int, MoEConfig]], key: str, m: int) -> MoEConfig | None:
    """The entry of ``key`` whose row bucket is nearest ``m`` (on a log scale)."""
    by_m = table.get(key)
    if not by_m:
        return None
    target = math.log2(max(m, 1))
    best = min(by_m, key=lambda k: (abs(math.log2(max(k, 1)) - target), k))
    return by_m[best]


def autotune_enabled() -> bool:
    """False when the environment sets ``EPMOE_TRITON_AUTOTUNE=0``."""
    return os.environ.get(AUTOTUNE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def rows_per_expert(layout: str, m: int, num_experts: int, top_k: int) -> int:
    """Estimated rows per expert: ``R·K / e`` (an upper bound under EP), or ``C``."""
    if layout == "batched":
        return m
    return max(1, (m * top_k) // max(num_experts, 1))


@functools.lru_cache(maxsize=4096)  # (each forward asks: 21 µs of host time to build)
def heuristic_config(
    layout: str,
    dtype: str,
    m: int,
    hidden_size: int,
    intermediate_size: int,
    num_experts: int,
    top_k: int,
    device_type: str,
) -> MoEConfig:
    """Block sizes from the shape alone (no timing), chosen for H100/H200 (sm_90)."""
    fp8 = dtype == "fp8"
    if device_type != "cuda":  # the interpreter: small tiles, few programs
        gu = GemmConfig(FP8_GROUP if fp8 else 32, 32, 1, 4, 1)
        return MoEConfig(16, gu, GemmConfig(32, 32, 1, 4, 1))
    rows = rows_per_expert(layout, m, num_experts, top_k)
    if rows <= 16:
        block_m = 16
    elif rows <= 32:
        block_m = 32
    elif dtype == "fp32" or rows <= (128 if layout == "standard" else 1024):
        # 64-row tiles pad each expert's group less (R·K / e overestimates the rows under
        # EP: at R·K / e ≈ 256 with half of the pairs local, an expert holds ≈ 128 rows).
        block_m = 64
    else:
        # Measured on H200 (2026-11-29, ≈128 rows per expert): 128-row tiles beat 64-row ones
        # (4.27 vs 4.88 ms bf16) despite padding 1.47× vs 1.24× of the rows. FP8 tiles fit
        # without spills since the rescaled accumulation (one register tile per accumulator).
        block_m = 128
    return MoEConfig(block_m, *gemm_configs(dtype, block_m)[0])


def gemm_configs(dtype: str, block_m: int) -> list[tuple[GemmConfig, GemmConfig]]:
    """(gate_up, down) tilings for ``block_m``, best guess first (sm_90: no register
    spills per the compiler's resource report; shared memory within 227 KiB)."""
    G = GemmConfig
    if dtype == "fp32":
        return [(G(64, 32, 8, 4, 2), G(64, 32, 8, 4, 2)), (G(32, 32, 8, 4, 3), G(64, 32, 8, 4, 3))]
    if dtype == "fp8":  # gate_up.block_n == 128 fuses the quantization of its output
        if block_m <= 32:
            warps = 4 if block_m == 16 else 8  # 32-row tiles spill with 4 warps
            return [
                (G(128, 128, 8, warps, 4), G(128, 128, 8, 4, 4)),
                (G(128, 64, 8, warps, 5), G(64, 128, 8, 4, 4)),
                (G(128, 128, 8, 8, 3), G(256, 128, 8, 8, 3)),
            ]
        if block_m == 64:
            return [
                (G(128, 128, 8, 8, 4), G(128, 128, 8, 4, 4)),  # measured best (H200)
                (G(128, 128, 8, 8, 3), G(128, 128, 8, 8, 3)),
                (G(128, 64, 8, 8, 5), G(256, 128, 8, 8, 3)),
            ]
        # 128-row tiles (ptxas sm_90a, triton 3.6: 251 / 244 / 190 / 243 registers, no spills)
        return [
            (G(128, 128, 8, 8, 3), G(128, 128, 8, 8, 4)),
            (G(128, 128, 8, 8, 4), G(128, 128, 8, 4, 4)),
            (G(128, 64, 8, 8, 5), G(128, 128, 8, 8, 5)),
        ]
    if block_m <= 32:
        return [
            (G(64, 128, 8, 4, 4), G(64, 128, 8, 4, 4)),
            (G(128, 64, 8, 4, 4), G(128, 64, 8, 4, 4)),
            (G(64, 64, 8, 4, 5), G(128, 128, 8, 8, 3)),
        ]
    if block_m == 64:
        return [
            (G(128, 64, 8, 8, 4), G(128, 64, 8, 4, 4)),
            (G(128, 64, 8, 4, 4), G(256, 64, 8, 8, 3)),
            (G(64, 64, 8, 4, 5), G(128, 128, 8, 4, 3)),
        ]
    return [
        (G(128, 64, 8, 8, 4), G(256, 64, 8, 8, 3)),  # measured best (H200, 2026-11-29)
        (G(128, 64, 8, 8, 3), G(128, 64, 8, 8, 4)),
        (G(64, 64, 8, 4, 4), G(128, 128, 8, 8, 3)),
    ]


def smem_bytes(config: MoEConfig, act_bytes: int, w_bytes: int) -> int:
    """Shared memory the pipelined loads need (the larger of the two GEMMs)."""
    m = config.block_m
    gu, dn = config.gate_up, config.down
    a = (m * gu.block_k * act_bytes + 2 * gu.block_k * gu.block_n * w_bytes) * gu.num_stages
    b = (m * dn.block_k * act_bytes + dn.block_k * dn.block_n * w_bytes) * dn.num_stages
    return max(a, b)


def candidate_configs(
    layout: str,
    dtype: str,
    m: int,
    hidden_size: int,
    intermediate_size: int,
    num_experts: int,
    top_k: int,
) -> list[MoEConfig]:
    """Configs worth timing on CUDA, the heuristic choice first: its ``block_m`` and half
    of it, each with the tilings of ``gemm_configs`` (the first one also with half-height
    tails, Standard layout)."""
    base = heuristic_config(
        layout, dtype, m, hidden_size, intermediate_size, num_experts, top_k, "cuda"
    )
    nbytes = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}[dtype]
    out = [base]
    for block_m in (base.block_m, max(16, base.block_m // 2)):
        for i, (gu, dn) in enumerate(gemm_configs(dtype, block_m)):
            variants = [MoEConfig(block_m, gu, dn)]
            if i == 0 and layout == "standard" and block_m >= 64:
                variants.append(MoEConfig(block_m, gu, dn, half_tail=True))
            for cfg in variants:
                if cfg not in out and smem_bytes(cfg, nbytes, nbytes) <= _SMEM_BYTES:
                    out.append(cfg)
    tiles = intermediate_size % 128 == 0 and hidden_size % 256 == 0  # (gate_up, down) tiles
    if dtype != "fp32" and tiles:  # sm_90 only: select_config drops them elsewhere
        if layout == "standard" and base.block_m >= 64:
            out.extend(wgmma_config(dtype, kernel) for kernel in WGMMA_KERNELS)
            ws192 = wgmma_config(dtype, "wgmma_ws", 192)  # (three MMA warpgroups)
            out += [ws192, replace(ws192, atomic_reduce=True)]
        elif layout == "batched":  # slabs walked by the persistent kernel (C >= 512 on H200)
            out.append(wgmma_config(dtype, "wgmma_ws"))
    return out


_TUNED: dict[tuple[Any, ...], MoEConfig] = {}  # process-wide autotuning results


def autotune(
    key: tuple[Any, ...], candidates: list[MoEConfig], run: Callable[[MoEConfig], Any]
) -> MoEConfig:
    """Time ``run(config)`` for each candidate (CUDA events, median of 3 after a warm-up
    that also compiles), cache and return the fastest. ``run`` must be idempotent."""
    if key in _TUNED:
        return _TUNED[key]
    best, best_ms = candidates[0], math.inf
    for cfg in candidates:
        try:
            run(cfg)
            torch.cuda.synchronize()
            times = []
            for _ in range(3):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                run(cfg)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
        except Exception:  # a candidate that does not fit this device: skip it
            torch.cuda.synchronize()
            continue
        ms = sorted(times)[1]
        if ms < best_ms:
            best, best_ms = cfg, ms
    _TUNED[key] = best
    return best


def select_config(
    layout: str,
    weight_dtype: torch.dtype,
    m: int,
    hidden_size: int,
    intermediate_size: int,
    num_experts: int,
    top_k: int,
    device: torch.device,
    run: Callable[[MoEConfig], Any] | None = None,
    allow_autotune: bool | None = None,
) -> MoEConfig:
    """The config for one forward (see the module docstring for the order of sources).

    ``run(config)`` runs the forward with a config; it is needed for autotuning, which
    happens only on CUDA, with ``allow_autotune`` (default: the environment switch) and
    outside CUDA-graph capture.
    """
    dtype = dtype_name(weight_dtype)
    if device.type == "cuda":
        table = load_table(_device_name(normalize_device(device).index))
        key = problem_key(layout, dtype, hidden_size, intermediate_size, num_experts)
        hit = lookup(table, key, m)
        if hit is not None and _runnable(hit, device):
            return hit
        tune = autotune_enabled() if allow_autotune is None else allow_autotune
        if tune and run is not None and not torch.cuda.is_current_stream_capturing():
            bucket = 1 << max(0, math.ceil(math.log2(max(m, 1))))
            cands = candidate_configs(
                layout, dtype, bucket, hidden_size, intermediate_size, num_experts, top_k
            )
            cands = [c for c in cands if _runnable(c, device)]
            return autotune((key, bucket, top_k, device.index), cands, run)
    return heuristic_config(
        layout, dtype, m, hidden_size, intermediate_size, num_experts, top_k, device.type
    )
