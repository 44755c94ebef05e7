"""Pure-Python parts of the experts benchmark: candidate files and the ratios it reports."""

from __future__ import annotations

import json

import pytest

from epmoe.bench import experts
from epmoe.kernels.configs import GemmConfig, MoEConfig

CFG = MoEConfig(128, GemmConfig(128, 64, 8, 8, 4), GemmConfig(256, 64, 8, 8, 3), half_tail=True)


def test_candidates_file_round_trips_and_rejects_bad_items(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps([{"scenario": "prefill", "dtype": "fp8", "config": CFG.to_dict()}]))
    assert experts._load_candidates(str(path)) == {("prefill", "fp8"): [CFG]}
    assert experts._load_candidates(None) == {}
    for bad, match in (
        ({"scenario": "prefil", "dtype": "fp8", "config": CFG.to_dict()}, "scenario 'prefil'"),
        ({"dtype": "fp8", "config": CFG.to_dict()}, "item 0 must be"),
        ({"scenario": "decode", "dtype": "fp8", "config": {"block_m": 48}}, "item 0 must be"),
    ):
        path.write_text(json.dumps([bad]))
        with pytest.raises(ValueError, match=match):
            experts._load_candidates(str(path))


def test_ratios_roofline_and_fp8_speedup():
    """Roofline = max(weight bytes / copy bandwidth, dense GEMM of the dtype); the FP8
    speedup is against the fastest bf16 layer whose output agrees with the default."""
    recs = [
        {"scenario": "prefill", "dtype": "bf16", "impl": "epmoe triton", "ms": 4.0,
         "weight_bytes": 8e9},
        {"scenario": "prefill", "dtype": "bf16", "impl": "epmoe triton candidate", "ms": 3.0,
         "weight_bytes": 8e9, "diff_vs_default": 0.5},  # disagrees: not a reference
        {"scenario": "prefill", "dtype": "bf16", "impl": "epmoe triton candidate", "ms": 3.6,
         "weight_bytes": 8e9, "diff_vs_default": 0.0},
        {"scenario": "prefill", "dtype": "fp8", "impl": "epmoe triton", "ms": 2.4,
         "weight_bytes": 4e9},
        {"scenario": "prefill", "dtype": "bf16", "impl": "dense bf16 mm", "ms": 1.5},
        {"scenario": "prefill", "dtype": "bf16", "impl": "dense fp8 scaled_mm", "ms": 1.2},
        {"scenario": "prefill", "dtype": "bf16", "impl": "torch._grouped_mm", "ms": 5.0},
    ]  # fmt: skip
    experts._add_ratios(recs, copy_bw=4e12)
    bf16, _, best, fp8 = recs[:4]
    assert bf16["roofline_ms"] == pytest.approx(2.0)  # 8 GB at 4 TB/s > 1.5 ms dense
    assert bf16["vs_roofline"] == pytest.approx(0.5)
    assert bf16["vs_dense"] == pytest.approx(1.5 / 4.0)
    assert bf16["vs_grouped_mm"] == pytest.approx(5.0 / 4.0)
    assert fp8["roofline_ms"] == pytest.approx(1.2)  # the FP8 dense rate bounds it here
    assert fp8["fp8_speedup"] == pytest.approx(best["ms"] / 2.4)


def experts_ops_interpreted() -> bool:
    from epmoe.kernels import ops

    return ops.interpreted()


def _tiny_decode(extra: str, baselines: bool = False) -> list[dict]:
    """``experts.main`` on a tiny decode problem under the interpreter, with ``extra``
    options (skips unless the kernels are interpreted)."""
    if not experts_ops_interpreted():
        pytest.skip("runs the kernels under TRITON_INTERPRET=1")
    import argparse
    import shlex

    p = argparse.ArgumentParser()
    experts.add_arguments(p)
    args = p.parse_args(
        shlex.split(
            "--device cpu --scenario decode --dtypes fp16 --hidden 64 --intermediate 32 "
            "--num-experts 8 --local-experts 4 --top-k 2 --decode-tokens 8 --decode-ranks 2 "
            "--iters 1 --warmup 0 " + ("" if baselines else "--no-baselines ") + extra
        )
    )
    return experts.main(args)


def test_decode_row_splits_are_timed_and_checked_against_the_default(capsys):
    """``--m-splits`` adds one decode record per S (row programs per expert), each with its
    output's difference from the default grid's; ``--decode-full-expert`` fills expert 0's
    slab (the serial worst case)."""
    records = _tiny_decode("--decode-full-expert --m-splits 1 3")
    runs = [r for r in records if r.get("impl", "").startswith("epmoe triton")]
    assert [r["m_splits"] for r in runs] == ["auto", 1, 3]
    assert all(r["max_count"] == 16 for r in runs)  # C = 8 tokens x 2 ranks, all in expert 0
    assert all(r["diff_vs_default"] < 1e-3 for r in runs[1:])
    assert "S=3" in capsys.readouterr().out


def test_baselines_run_whatever_the_dtypes():
    """``--dtypes fp16`` alone (no bf16) still times the baselines, in bf16 (they ran in
    the bf16 pass only, so such a run had no baseline, no vs_* ratio and no roofline)."""
    records = _tiny_decode("", baselines=True)
    bmm = [r for r in records if str(r.get("impl", "")).startswith("cuBLAS bmm")]
    assert len(bmm) == 1 and bmm[0]["dtype"] == "bf16" and bmm[0]["scenario"] == "decode"
    assert bmm[0]["weight_GBps"] > 0 and "error" not in bmm[0]
    assert [r["dtype"] for r in records if r.get("impl") == "epmoe triton"] == ["fp16"]


def test_configs_out_without_configs_is_refused(capsys):
    from epmoe.bench.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["experts", "--configs-out", "table.json"])
    assert exit_.value.code == 2
    assert "--configs-out writes the table --configs tunes" in capsys.readouterr().err


def test_the_tiling_sweep_times_its_candidates(tmp_path):
    """``--configs``: the sweep's records carry times (not only errors), and the best goes
    into the table written by ``--configs-out``."""
    out = tmp_path / "table.json"
    records = _tiny_decode(f"--configs --sweep-budget-s 4 --configs-out {out}")
    swept = [r for r in records if "sweep" in r]
    assert swept and all("error" not in r for r in swept), swept[:2]
    assert all(r["ms"] > 0 for r in swept)
    assert json.loads(out.read_text())["configs"]
