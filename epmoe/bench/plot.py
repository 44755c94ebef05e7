"""Plots of benchmark JSON files (``--out`` of ``python -m epmoe.bench …``).

    python -m epmoe.bench.plot eplb results/eplb.json docs/eplb_balancedness.png
    python -m epmoe.bench.plot comm docs/comm_latency.png results/comm.json [more.json ...]
    python -m epmoe.bench.plot layer docs/layer_step.png results/layer.json

Needs matplotlib (``pip install "epmoe[bench]"``).
"""

from __future__ import annotations

import argparse
import json


def _eplb_label(r: dict) -> str:
    """A balance record's line: its placement, and for balanced ones its spare slots R."""
    if r["placement"] != "balanced":
        return r["placement"]
    R = r["redundant"]
    return f"balanced, {R} spare slots" if R else "balanced, no spare"


def plot_eplb(records: list[dict], path: str, title: str) -> None:
    """Balancedness (fresh window) per EP size, one panel per Zipf α, one line per
    placement (balanced: one per spare-slot count R, named by it: two R at one EP size
    are two points, not one line going back and forth)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if r.get("kind") == "balance"]
    alphas = sorted({r["alpha"] for r in rows})
    fig, axes = plt.subplots(1, len(alphas), figsize=(4 * len(alphas), 3.4), sharey=True)
    axes = axes if len(alphas) > 1 else [axes]
    for ax, alpha in zip(axes, alphas):
        lines: dict[str, list[tuple[int, float]]] = {}
        for r in rows:
            if r["alpha"] != alpha:
                continue
            lines.setdefault(_eplb_label(r), []).append((r["ep"], r["bal_eval"]))
        for name, points in sorted(lines.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["ep"] for r in rows}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_title(f"Zipf α = {alpha}")
        ax.set_xlabel("EP ranks")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("balancedness (mean / max rank load)")
    axes[-1].legend(fontsize=8, loc="lower left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# what each comm line shows: graph-safe backends as replayed back to back in a CUDA graph
# (the GPU's time), the others as called back to back from Python
_COMM_MODES = ("graph_b2b", "eager_b2b")


NCCL_LABEL = "NCCL all_to_all_single"


def nccl_label(layout: str) -> str:
    """The NCCL baseline's line for the rows of ``layout``."""
    return f"{NCCL_LABEL} ({layout} rows)"


def comm_series(records: list[dict]) -> dict[tuple[str, str, str], list[tuple[int, float]]]:
    """``(wire, phase, label) -> [(T, µs)]`` of comm and ceiling records: per backend (and
    SM budget) its ``graph_b2b`` time where it has one, else ``eager_b2b``; the peer-store
    ceiling (once per destination rank, ``graph_b2b``) under dispatch; NCCL's
    ``all_to_all_single`` of the same rows under each phase (``a2a_dispatch_us``,
    ``a2a_combine_us``: the bytes of that phase), one line per layout (the rows differ),
    from the eager records of the backends that send the layout's rows (not the gathering
    ones, whose baseline moves every token to every rank)."""
    out: dict[tuple[str, str, str], dict[int, float]] = {}
    from epmoe.bench.comm import GATHERING_BACKENDS, is_wrong

    # (a timing whose round trip came back wrong is not drawn)
    comm = [
        r for r in records if r.get("kind") == "comm" and "dispatch_us" in r and not is_wrong(r)
    ]
    graph_safe = {
        (r["backend"], r.get("sms"), r.get("per_flag")) for r in comm if r["mode"] == "graph_b2b"
    }
    for r in comm:
        key = (r["backend"], r.get("sms"), r.get("per_flag"))
        mode = "graph_b2b" if key in graph_safe else "eager_b2b"
        if r["mode"] != mode:
            continue
        sms = f", {r['sms']} SMs" if r.get("sms") else ""
        sms += f", {r['per_flag']} rows/flag" if r.get("per_flag") else ""
        label = f"{r['backend']} ({r['layout']}{sms}; {mode.replace('_b2b', '')})"
        for phase in ("dispatch", "combine"):
            out.setdefault((r["wire"], phase, label), {})[r["T"]] = r[f"{phase}_us"]
    for r in comm:
        if r["mode"] != "eager" or r["backend"].split("/")[0] in GATHERING_BACKENDS:
            continue
        for phase in ("dispatch", "combine"):
            us = _a2a_us(r, phase)
            if us:
                out.setdefault((r["wire"], phase, nccl_label(r["layout"])), {})[r["T"]] = us
    for r in records:
        ceiling = r.get("kind") == "ceiling" and r.get("mode") == "graph_b2b" and "us" in r
        if ceiling and r["pattern"] == "per_rank":
            out.setdefault((r["wire"], "dispatch", "peer-store ceiling"), {})[r["T"]] = r["us"]
    return {k: sorted(v.items()) for k, v in out.items()}


def _a2a_us(r: dict, phase: str) -> float | None:
    """The NCCL baseline of ``phase`` in an eager comm record. Records written before the
    per-phase fields have one ``a2a_us`` at the wire's row bytes: the dispatch's, and the
    combine's only where the wire is the hidden dtype (an FP8 wire row is half a combine's)."""
    if f"a2a_{phase}_us" in r:
        return r[f"a2a_{phase}_us"]
    if phase == "dispatch" or r.get("wire") == r.get("dtype"):
        return r.get("a2a_us")
    return None


def plot_comm(records: list[dict], path: str, title: str) -> None:
    """Latency against tokens per rank: rows = wire dtypes, columns = dispatch / combine,
    one line per backend, the ceiling and NCCL baselines dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = comm_series(records)
    wires = sorted({w for w, _, _ in series})
    if not series:
        raise ValueError("no comm or ceiling records with timings to plot")
    fig, axes = plt.subplots(
        len(wires), 2, figsize=(11, 3.8 * len(wires)), squeeze=False, sharex=True
    )
    # one color per series in every panel (panels show different subsets); NCCL in greys
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    labels = sorted({label for _, _, label in series})
    nccl = [label for label in labels if label.startswith(NCCL_LABEL)]
    others = [label for label in labels if label not in nccl]
    colors = {label: palette[i % len(palette)] for i, label in enumerate(others)}
    greys = ("gray", "black", "silver")
    colors.update({label: greys[i % len(greys)] for i, label in enumerate(nccl)})
    for i, wire in enumerate(wires):
        for j, phase in enumerate(("dispatch", "combine")):
            ax = axes[i][j]
            for (w, ph, label), points in sorted(series.items()):
                if (w, ph) != (wire, phase):
                    continue
                baseline = label == "peer-store ceiling" or label in nccl
                ax.plot(
                    [p[0] for p in points],
                    [p[1] for p in points],
                    marker="o" if not baseline else None,
                    linestyle="--" if baseline else "-",
                    color=colors[label],
                    label=label,
                )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{phase}, {wire} on the wire", fontsize=10)
            ax.set_ylabel("µs per call (median)")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
        for ax in axes[-1]:
            ax.set_xlabel("tokens per rank")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_layer(records: list[dict], path: str, title: str) -> None:
    """One EPMoE step per backend and mode (bars, µs), one panel per T, with the floor it
    is held to drawn on each bar: reading the local expert weights at the copy bandwidth
    measured in the same run, plus that backend's dispatch and combine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if r.get("kind") == "layer" and r.get("layer_us")]
    if not rows:
        raise ValueError("no layer records with a step time to plot")
    tokens = sorted({r["T"] for r in rows})
    most = max(sum(r["T"] == T for r in rows) for T in tokens)
    width = max(7.5, len(tokens) * max(5.0, 0.8 * most + 1))
    fig, axes = plt.subplots(1, len(tokens), figsize=(width, 4.6), squeeze=False)
    for ax, T in zip(axes[0], tokens):
        mine = [r for r in rows if r["T"] == T]
        x = range(len(mine))
        ax.bar(x, [r["layer_us"] for r in mine], color="tab:blue", label="step")
        floor = [r["weights_read_us"] + r["dispatch_us"] + r["combine_us"] for r in mine]
        ax.scatter(x, floor, marker="_", s=700, color="black", zorder=3,
                   label="weights read + dispatch + combine")  # fmt: skip
        ax.scatter(x, [r["weights_read_us"] for r in mine], marker="_", s=700, color="gray",
                   zorder=3, label="weights read alone")  # fmt: skip
        ax.set_xticks(list(x), [_layer_label(r) for r in mine], fontsize=7)
        ax.set_ylabel("µs per step (median)")
        ax.set_title(f"T = {T} tokens per rank", fontsize=10)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _layer_label(r: dict) -> str:
    """A bar's variant: backend, mode, and what differs from the plain layer."""
    extra = []
    if r.get("micro_batches", 1) > 1:
        extra.append(f"micro_batches={r['micro_batches']}")
    if "float8" in str(r.get("weights", "")):
        extra.append("FP8 weights")
    if "float8" in str(r.get("wire", "")):
        extra.append("FP8 wire")
    if r.get("chunks", 1) > 1:
        extra.append(f"{r['chunks']} chunks")
    return "\n".join([r["backend"], r["mode"], *extra])


def plot_experts(records: list[dict], path: str, title: str) -> None:
    """Expert kernels against the baselines of the same run, one panel per scenario:
    prefill in TFLOP/s (epmoe's kernels labelled with their fraction of the roofline
    measured in the same run), decode in expert-weight GB/s read with the device's copy
    bandwidth of the same run drawn as the ceiling. epmoe in blue, baselines in grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def value(r: dict) -> float | None:
        return r.get("tflops") if r.get("scenario") == "prefill" else r.get("weight_GBps")

    rows = [r for r in records if "sweep" not in r and r.get("scenario") and value(r)]
    if not rows:
        raise ValueError("no experts records with TFLOP/s or weight GB/s to plot")
    copy = next((r["copy_GBps"] for r in records if r.get("copy_GBps")), None)
    scenarios = sorted({r["scenario"] for r in rows}, key=["prefill", "decode"].index)
    fig, axes = plt.subplots(1, len(scenarios), figsize=(6 * len(scenarios), 4.2), squeeze=False)
    for ax, sc in zip(axes[0], scenarios):
        mine = [r for r in rows if r["scenario"] == sc]
        ours = [str(r.get("impl", "")).startswith("epmoe") for r in mine]
        labels = [
            f"{r['impl']}\n{r.get('dtype', '')}" if o else str(r["impl"])
            for r, o in zip(mine, ours)
        ]
        values = [value(r) for r in mine]
        x = range(len(mine))
        ax.bar(x, values, color=["tab:blue" if o else "lightgray" for o in ours])
        for i, (r, o) in enumerate(zip(mine, ours)):
            if not o:
                continue
            if sc == "prefill" and r.get("vs_roofline"):
                note = f"{r['vs_roofline']:.2f} of roofline"
            elif sc == "decode" and r.get("frac_of_copy"):
                note = f"{r['frac_of_copy']:.2f} of copy"
            else:
                continue
            ax.annotate(note, (i, values[i]), ha="center", va="bottom", fontsize=7)
        if sc == "decode" and copy:
            ax.axhline(copy, color="black", linestyle="--", linewidth=1,
                       label=f"device copy {copy:.0f} GB/s (same run)")  # fmt: skip
            ax.legend(fontsize=7, loc="lower right")
        ax.set_xticks(list(x), labels, fontsize=7, rotation=20)
        ax.set_ylabel("TFLOP/s" if sc == "prefill" else "expert weights read, GB/s")
        ax.set_title(sc, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _experts_title(records: list[dict], machine: dict) -> str:
    r = next((r for r in records if r.get("scenario") == "prefill" and r.get("pairs")), {})
    work = f", {r['R']} rows, {r['pairs']} (row, expert) pairs in prefill" if r else ""
    return f"expert kernels{work} — {machine.get('gpu', '?')}, {machine.get('date', '')[:16]}"


def draw(name: str, records: list[dict], path: str) -> None:
    """``--plot`` of ``python -m epmoe.bench NAME``: this run's records as a PNG."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise SystemExit(
            'plots need matplotlib: pip install "epmoe[bench]" (or pip install matplotlib)'
        ) from exc
    from epmoe.bench.common import machine_info

    machine = machine_info()
    if name == "eplb":
        plot_eplb(records, path, _eplb_title(records, machine))
    elif name == "layer":
        plot_layer(records, path, _layer_title(records, machine))
    elif name == "experts":
        plot_experts(records, path, _experts_title(records, machine))
    else:
        plot_comm(records, path, _comm_title(records, machine))


def _eplb_title(records: list[dict], machine: dict) -> str:
    r = next((r for r in records if r.get("kind") == "balance"), {})
    shape = (
        f", {r['E']} experts, top-{r['K']}, {r['T']} tokens per step"
        if "E" in r
        else ""  # (records written before the shape was recorded)
    )
    return f"EPLB placements{shape} — {machine.get('date', '')[:16]}"


def _layer_title(records: list[dict], machine: dict) -> str:
    r = next((r for r in records if r.get("kind") == "layer" and "E" in r), {})
    return (
        f"one EPMoE step, EP{r.get('W', '?')}, E={r.get('E', '?')}, top-{r.get('K', '?')}, "
        f"H={r.get('H', '?')}, I={r.get('I', '?')}, {r.get('experts', '?')} experts\n"
        f"{machine.get('num_gpus', '?')}× {machine.get('gpu', '?')}, "
        f"{machine.get('date', '')[:16]}"
    )


def _comm_title(records: list[dict], machine: dict) -> str:
    shape = next((r for r in records if r.get("kind") == "comm"), {})
    return (
        f"dispatch and combine, EP{shape.get('W', '?')}, H={shape.get('H', '?')}, "
        f"top-{shape.get('K', '?')} of {shape.get('E', '?')} — {machine.get('num_gpus', '?')}× "
        f"{machine.get('gpu', '?')}, {machine.get('date', '')[:16]}"
    )


def _load(paths: list[str]) -> tuple[list[dict], dict]:
    records, machine = [], {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        records += data["records"]
        machine = machine or data.get("machine", {})
    return records, machine


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m epmoe.bench.plot", description=__doc__)
    p.add_argument("kind", choices=["eplb", "comm", "layer", "experts"])
    p.add_argument(
        "paths", nargs="+", help="eplb: JSON PNG; comm, layer, experts: PNG JSON [JSON ...]"
    )
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        p.error('plots need matplotlib: pip install "epmoe[bench]" (or pip install matplotlib)')
    if args.kind == "eplb":
        if len(args.paths) != 2:
            p.error("eplb takes JSON PNG")
        records, machine = _load(args.paths[:1])
        plot_eplb(records, args.paths[1], _eplb_title(records, machine))
        return
    if len(args.paths) < 2:
        p.error(f"{args.kind} takes PNG JSON [JSON ...]")
    records, machine = _load(args.paths[1:])
    if args.kind == "layer":
        plot_layer(records, args.paths[0], _layer_title(records, machine))
    elif args.kind == "experts":
        plot_experts(records, args.paths[0], _experts_title(records, machine))
    else:
        plot_comm(records, args.paths[0], _comm_title(records, machine))


if __name__ == "__main__":
    main()
