"""Final test accuracy against ε, one line per rule, from one or more sweeps drawn on one axis.

`fedprivacy report` draws one sweep; experiment 2 of docs/experiments.md tunes its low and high
budgets in two sweeps (different candidate epochs), so this script joins them. Each point is the
mean over the seeds with its 95% t-interval; `--earlier` adds another sweep's means dashed (e.g.
the fixed-k design the tuned one replaced). `--per-client` adds a second panel from
experiments/per_client_accuracy.py's CSV: under label skew the pooled accuracy hides how the worst
and best served clients fare, so it draws each seed's lowest, median and highest client accuracy,
averaged over the seeds.

Usage: python experiments/plot_accuracy_vs_epsilon.py SWEEP_DIR [SWEEP_DIR ...] --out FILE.png
       [--earlier SWEEP_DIR] [--per-client PER_CLIENT.csv] [--title T]
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


def client_spread(table: pd.DataFrame) -> pd.DataFrame:
    """Per rule and ε: each seed's lowest, median and highest client accuracy, then their means over seeds."""
    per_seed = table.groupby(["rule", "epsilon", "seed"])["accuracy"].agg(low="min", median="median", high="max")
    return per_seed.groupby(["rule", "epsilon"]).mean().reset_index()


def draw_spread(axes: Axes, spread: pd.DataFrame, rules: list[str]) -> None:
    """The median client per rule as a line, the lowest and highest as a band; `rules` in the colours' order."""
    for index, rule in enumerate(rules):
        rows = spread[spread["rule"] == rule].sort_values("epsilon")
        color = f"C{index}"
        axes.plot(rows["epsilon"], rows["median"], marker="o", color=color, label=f"{rule}: median client")
        axes.fill_between(rows["epsilon"], rows["low"], rows["high"], color=color, alpha=0.15, label=f"{rule}: min–max")


def label_epsilon_axis(axes: Axes, epsilons: list[float]) -> None:
    """A log₂ ε axis ticked at the budgets run."""
    axes.set_xscale("log", base=2)
    axes.set_xticks(epsilons, [f"{epsilon:g}" for epsilon in epsilons])
    axes.set_xlabel("ε per client")
    axes.grid(alpha=0.3)


def accuracy_figure(sweeps: list[Path], earlier: Path | None, per_client: Path | None, title: str) -> Figure:
    """Accuracy against ε per rule; beside it, with `per_client`, the spread over clients."""
    figure = Figure(figsize=(14, 5) if per_client is not None else (8, 5))
    axes = figure.add_subplot(1, 2 if per_client is not None else 1, 1)
    draw_rules(axes, completed_cells(sweeps), dashed=False)
    if earlier is not None:
        draw_rules(axes, completed_cells([earlier]), dashed=True)
    epsilons = sorted(completed_cells(sweeps)["epsilon"].unique())
    label_epsilon_axis(axes, epsilons)
    axes.set_ylabel("final test accuracy (mean, 95% interval over seeds)")
    axes.set_title(title, fontsize=10)
    axes.legend(fontsize=8, loc="lower right")
    if per_client is not None:
        spread_axes = figure.add_subplot(1, 2, 2, sharey=axes)
        draw_spread(spread_axes, client_spread(pd.read_csv(per_client)), list(completed_cells(sweeps)["rule"].unique()))
        label_epsilon_axis(spread_axes, epsilons)
        spread_axes.set_ylabel("client test accuracy (min, median, max over clients)")
        spread_axes.set_title("per client: the global model on each client's test rows", fontsize=10)
        spread_axes.legend(fontsize=8, loc="lower right")
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", type=Path, nargs="+", help="sweep folders (each with sweep.csv)")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--earlier", type=Path, help="a sweep whose means are drawn dashed for comparison")
    parser.add_argument("--per-client", type=Path, help="per_client_accuracy.py's CSV: adds the client spread panel")
    parser.add_argument("--title", default="accuracy against ε")
    args = parser.parse_args()
    save_png(accuracy_figure(args.sweeps, args.earlier, args.per_client, args.title), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
