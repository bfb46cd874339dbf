"""Final test accuracy against ε, one line per rule, from one or more sweeps drawn on one axis.

`fedprivacy report` draws one sweep; experiment 2 of docs/experiments.md tunes its low and high
budgets in two sweeps (different candidate epochs), so this script joins them. Each point is the
mean over the seeds with its 95% t-interval; `--earlier` adds another sweep's means dashed (e.g.
the fixed-k design the tuned one replaced).

Usage: python experiments/plot_accuracy_vs_epsilon.py SWEEP_DIR [SWEEP_DIR ...] --out FILE.png
       [--earlier SWEEP_DIR] [--title T]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from fedprivacy.reports.statistics import t_interval
from fedprivacy.reports.sweep_figures import save_png


def completed_cells(folders: list[Path]) -> pd.DataFrame:
    """The completed rows of every folder's sweep.csv."""
    rows = pd.concat([pd.read_csv(folder / "sweep.csv") for folder in folders], ignore_index=True)
    return rows[rows["status"] == "completed"]


def draw_rules(axes: Axes, rows: pd.DataFrame, dashed: bool) -> None:
    """Mean accuracy per (rule, ε); solid lines carry 95% intervals, dashed ones means only."""
    for index, (rule, cells) in enumerate(rows.groupby("rule", sort=False)):
        by_epsilon = sorted(cells.groupby("epsilon")["final_accuracy"])
        epsilons = [epsilon for epsilon, _ in by_epsilon]
        intervals = [t_interval(list(values)) for _, values in by_epsilon]
        means = [interval.mean for interval in intervals]
        color = f"C{index}"
        if dashed:
            axes.plot(epsilons, means, ls="--", marker="x", alpha=0.45, color=color, label=f"{rule}: earlier")
            continue
        errors = [
            [m - (i.low if i.low is not None else m) for m, i in zip(means, intervals, strict=True)],
            [(i.high if i.high is not None else m) - m for m, i in zip(means, intervals, strict=True)],
        ]
        seeds = max(len(values) for _, values in by_epsilon)
        shifted = [e * 1.03 ** (index - 1) for e in epsilons]  # rules side by side, not on top
        axes.errorbar(shifted, means, yerr=errors, marker="o", capsize=4, color=color, label=f"{rule} ({seeds} seeds)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", type=Path, nargs="+", help="sweep folders (each with sweep.csv)")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--earlier", type=Path, help="a sweep whose means are drawn dashed for comparison")
    parser.add_argument("--title", default="accuracy against ε")
    args = parser.parse_args()
    figure = Figure(figsize=(8, 5))
    axes = figure.add_subplot()
    draw_rules(axes, completed_cells(args.sweeps), dashed=False)
    if args.earlier is not None:
        draw_rules(axes, completed_cells([args.earlier]), dashed=True)
    axes.set_xscale("log", base=2)
    epsilons = sorted(completed_cells(args.sweeps)["epsilon"].unique())
    axes.set_xticks(epsilons, [f"{epsilon:g}" for epsilon in epsilons])
    axes.set_xlabel("ε per client")
    axes.set_ylabel("final test accuracy (mean, 95% interval over seeds)")
    axes.set_title(args.title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="lower right")
    save_png(figure, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
