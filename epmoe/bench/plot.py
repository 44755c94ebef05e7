"""Plots of benchmark JSON files (``--out`` of ``python -m epmoe.bench …``).

    python -m epmoe.bench.plot eplb results/eplb.json docs/eplb_balancedness.png

Needs matplotlib (``pip install "epmoe[bench]"``).
"""

from __future__ import annotations

import argparse
import json


def plot_eplb(records: list[dict], path: str, title: str) -> None:
    """Balancedness (fresh window) per EP size, one panel per Zipf α, one line per
    placement (balanced split by spare slots)."""
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
            name = r["placement"]
            if name == "balanced":
                name = "balanced, spare slots" if r["redundant"] else "balanced, no spare"
            lines.setdefault(name, []).append((r["ep"], r["bal_eval"]))
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m epmoe.bench.plot", description=__doc__)
    p.add_argument("kind", choices=["eplb"])
    p.add_argument("json")
    p.add_argument("png")
    args = p.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    date = data.get("machine", {}).get("date", "")
    plot_eplb(data["records"], args.png, f"EPLB placements, 256 experts, top-8 ({date})")


if __name__ == "__main__":
    main()
