"""Compile the MoE GEMM kernels for sm_90a without a GPU and print what limits them.

    python launch/kernel_resources.py                      # the shipped H200 prefill configs
    python launch/kernel_resources.py --config '{"block_m": 64, ...}' --dtype fp8

For each kernel, as ``epmoe.kernels.ops`` would launch it at the benchmark's shapes
(H = 7168, I = 2048, Standard layout): shared memory, registers, stack (spills), the
``pendings`` of every wgmma wait in the TTGIR (0: each MMA completes before the loop goes
on; 2: two MMA groups stay in flight), and from the SASS whether ptxas serialised the MMAs
anyway (``mma_serialized``: a wait for zero groups after every ``HGMMA``/``QGMMA``; ptxas
warns C7514/C7515, e.g. when registers of an MMA still in flight are read across a loop's
back edge). Uses Triton's bundled ptxas and cuobjdump and internals of triton 3.x
(``ASTSource``, ``GPUTarget``): a developer's tool, best effort. It mirrors Triton's
launch-time specialisation (integer arguments equal to 1 become constants, multiples of 16
get a divisibility hint, pointers are 16-byte aligned). ``--rows slab|index`` compiles
``wgmma_ws`` as the ExpertBatched layout runs it; ``EPMOE_RESOURCES_TRACE=1`` raises a
compile error with its traceback instead of printing its last line.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from unittest import mock

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

POINTER_TYPES = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.float8_e4m3fn: "*fp8e4nv",
}


class _Capture:
    """Stands in for a kernel: ``kernel[grid](*args, **meta)`` records the launch."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launches.append((args, meta))


def _compile(fn, args: tuple, meta: dict):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    meta = dict(meta)
    options = {"num_warps": meta.pop("num_warps")}
    if "num_stages" in meta:  # (the Gluon kernels pipeline by hand: STAGES)
        options["num_stages"] = meta.pop("num_stages")
    if "num_warps" in fn.arg_names:  # a Gluon kernel reads it as a constexpr argument
        meta["num_warps"] = options["num_warps"]
    names = fn.arg_names
    keep = {names[i] if isinstance(i, int) else i for i in (fn.do_not_specialize or ())}
    values = dict(zip(names, args, strict=False))
    for name in [k for k, v in meta.items() if isinstance(v, torch.Tensor)]:
        values[name] = meta.pop(name)  # a pointer passed by keyword
    signature, constants, attrs = {}, dict(meta), {}
    for i, name in enumerate(names):
        if name not in values:
            continue
        value = values[name]
        if isinstance(value, torch.Tensor):
            signature[name] = POINTER_TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif hasattr(value, "block_shape"):  # a TMA descriptor (its type names the box)
            from triton.runtime.jit import mangle_type

            signature[name] = mangle_type(value)
        elif isinstance(value, int) and not isinstance(value, bool):
            if value == 1 and name not in keep:
                constants[name] = 1
            else:
                signature[name] = "i64" if abs(value) >= 2**31 else "i32"
                if value % 16 == 0 and name not in keep:
                    attrs[(i,)] = [["tt.divisibility", 16]]
    for name in constants:
        signature[name] = "constexpr"
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    src = ASTSource(
        fn,
        {n: signature[n] for n in names if n in signature},
        constexprs={(names.index(k),): v for k, v in constants.items()},
        attrs=attrs,
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _resources(kernel) -> dict:
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    usage = subprocess.run(
        [os.path.join(tools, "cuobjdump"), "--dump-resource-usage", f.name],
        capture_output=True,
        text=True,
    ).stdout
    sass = subprocess.run(
        [os.path.join(tools, "cuobjdump"), "-sass", f.name], capture_output=True, text=True
    ).stdout
    os.unlink(f.name)
    # What the hardware does: ptxas may serialise the wgmmas whatever the TTGIR's pendings
    # say (warnings C7514 / C7515), waiting for each MMA before the next is issued. In SASS
    # every [HQ]GMMA is then followed by a wait for zero groups in flight.
    mmas = len(re.findall(r"\b[HQ]GMMA\.", sass))
    full_waits = len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0\b", sass))

    def field(key: str):
        m = re.search(rf"{key}:(\d+)", usage)
        return int(m.group(1)) if m else None

    waits = re.findall(r"warp_group_dot_wait.*?pendings = (\d+)", kernel.asm["ttgir"])
    return {
        "smem": kernel.metadata.shared,
        "regs": field("REG"),
        "stack": field("STACK"),
        "wgmma_wait_pendings": sorted({int(w) for w in waits}),
        "sass_mmas": mmas,
        "sass_waits_for_zero": full_waits,
        "mma_serialized": mmas > 0 and full_waits >= mmas,
    }


def _sorted_scales(x_scale, sorted_pairs, num_padded, num_pairs, top_k):
    """``ops._sort_scales``'s output, unwritten (its kernel does not run here)."""
    return torch.empty(x_scale.shape[1], sorted_pairs.shape[0])


def report(
    dtype: str, config, e: int = 4, H: int = 7168, I: int = 2048, row_mode: str = "pairs"
) -> list[dict]:
    """Compile ``gate_up`` and ``down`` of ``config`` for the Standard layout (``row_mode``
    ``"slab"`` / ``"index"``: the ``wgmma_ws`` kernel as ExpertBatched runs it)."""
    from epmoe.kernels import grouped_gemm, ops

    fp8 = dtype == "fp8"
    wdt = torch.float8_e4m3fn if fp8 else torch.bfloat16
    R, K, B = 64, 8, 64
    pad_m = config.pad_m
    i32 = torch.int32
    aligned = ops.AlignedPairs(
        torch.empty(B * config.block_m, dtype=i32),
        *torch.empty(3, B, dtype=i32),
        torch.empty(R * K, dtype=i32),
        torch.empty(e, dtype=i32),
        torch.empty(1, dtype=i32),
        torch.empty(1, dtype=i32),
        config.block_m,
        pad_m,
        R,
        K,
    )

    def scales(*shape):
        return torch.empty(*shape) if fp8 else None

    gate_up, down, pair = _Capture(), _Capture(), _Capture()
    hopper = None
    if config.kernel != "dot":
        from epmoe.kernels import wgmma as hopper
    with (
        mock.patch.object(grouped_gemm, "gate_up_kernel", gate_up),
        mock.patch.object(grouped_gemm, "down_kernel", down),
        # the Hopper kernels: both GEMMs launch one kernel (GATE_UP tells them apart)
        mock.patch.object(
            ops,
            "_wgmma_module",
            lambda: mock.Mock(
                pair_gemm_kernel=pair,
                pair_gemm_ws_kernel=pair,
                weight_descriptor=hopper.weight_descriptor if hopper else None,
                rows_descriptor=hopper.rows_descriptor if hopper else None,
            ),
        ),
        mock.patch.object(ops, "wgmma_unsupported", lambda *a, **k: None),
        # FP8 GEMM 1 on wgmma_ws lays its rows' scales out by position first: not reported
        mock.patch.object(ops, "_sort_scales", _sorted_scales),
        mock.patch.object(ops, "_check_device", lambda *t: torch.device("cpu")),
        # FP8 GEMM 1 tiles narrower than a group quantize in a separate kernel: not reported
        mock.patch.object(ops, "per_token_group_quant_fp8", lambda y, counts=None: (y, None)),
    ):
        ops.gate_up(
            torch.empty(R, H, dtype=wdt),
            torch.empty(e, 2 * I, H, dtype=wdt),
            aligned,
            config,
            "silu",
            scales(R, H // 128),
            scales(e, 2 * I // 128, H // 128),
        )
        ops.down(
            torch.empty(B * config.block_m, I, dtype=wdt),
            torch.empty(e, H, I, dtype=wdt),
            aligned,
            config,
            torch.bfloat16,
            scales(B * config.block_m, I // 128),
            scales(e, H // 128, I // 128),
            torch.empty(R, K),
        )
    if hopper is not None:
        launches = {meta["GATE_UP"]: (args, meta) for args, meta in pair.launches}
        if row_mode != "pairs" and config.kernel != "wgmma_ws":
            raise SystemExit(f"--rows {row_mode} needs a wgmma_ws config, got {config.short()}")
        if row_mode != "pairs":  # (the same arguments; the kernel reads them per layout)
            for _, meta in launches.values():
                # ExpertBatched has no router weights nor top-k sum (the table's Standard
                # config may sum in GEMM 2)
                meta.update(ROWS=row_mode, SUM_ROWS=False)
                meta["TOP_K"] = meta["TOP_K"] if meta["GATE_UP"] else 1
        fn = hopper.pair_gemm_ws_kernel if config.kernel == "wgmma_ws" else hopper.pair_gemm_kernel
        kernels = [("gate_up", launches[True], fn), ("down", launches[False], fn)]
    else:
        kernels = [
            ("gate_up", gate_up.launches[0], grouped_gemm.gate_up_kernel),
            ("down", down.launches[0], grouped_gemm.down_kernel),
        ]
    rows = []
    for name, launch, fn in kernels:
        row = {"dtype": dtype, "config": config.short(), "kernel": name, "rows": row_mode}
        try:
            row.update(_resources(_compile(fn, *launch)))
        except Exception as exc:  # e.g. out of shared memory
            row["error"] = " ".join(str(exc).splitlines())[-400:]
            if os.environ.get("EPMOE_RESOURCES_TRACE"):
                raise
        rows.append(row)
    return rows


def main() -> None:
    from epmoe.kernels.configs import MoEConfig, load_table, lookup, problem_key

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", choices=("bf16", "fp8"), action="append")
    p.add_argument(
        "--config",
        action="append",
        help="a MoEConfig as JSON (MoEConfig.to_dict): one for every dtype, or one per --dtype "
        "in their order; default: the shipped H200 table's",
    )
    p.add_argument(
        "--rows",
        choices=("pairs", "slab", "index"),
        default="pairs",
        help="wgmma_ws only: the Standard layout's pairs, or ExpertBatched slabs / row index",
    )
    args = p.parse_args()
    dtypes = args.dtype or ["bf16", "fp8"]
    configs = args.config or []
    if len(configs) == 1:  # one for every dtype
        configs = configs * len(dtypes)
    if configs and len(configs) != len(dtypes):
        p.error(f"give one --config, or one per --dtype ({len(dtypes)}), got {len(configs)}")
    jobs = []
    for i, dtype in enumerate(dtypes):
        if configs:
            config = MoEConfig.from_dict(json.loads(configs[i]))
        else:
            key = problem_key("standard", dtype, 7168, 2048, 128)
            config = lookup(load_table("NVIDIA H200"), key, 4096)
        jobs.append((dtype, config))
    # one forked process per dtype (each compile takes seconds; nothing ran in torch yet)
    work = functools.partial(report, row_mode=args.rows)
    with multiprocessing.get_context("fork").Pool(min(len(jobs), os.cpu_count() or 1)) as pool:
        for rows in pool.starmap(work, jobs):
            for row in rows:
                print(json.dumps(row))


if __name__ == "__main__":
    main()
