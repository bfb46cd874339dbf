"""Final test accuracy (mean ± sd over seeds) of a sweep against one grid key, one line per value
of another: the figures of docs/experiments.md that `fedprivacy report` does not draw.

Usage: python experiments/plot_sweep.py SWEEP_DIR --x clip-norm --series epsilon [--logx] --out FILE.png [--title T]
       [--extra OTHER_SWEEP_DIR --extra-label LABEL]   (one more line: all of another sweep's cells)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from fedprivacy.reports.sweep_figures import save_png


def accuracy_line(axes: Axes, rows: pd.DataFrame, x: str, label: str | None, marker: str) -> None:
    """Final accuracy against `x`: mean ± sd over the rows (seeds) at each value."""
    stats = rows.groupby(x)["final_accuracy"].agg(["mean", "std"]).reset_index()
    axes.errorbar(stats[x], stats["mean"], yerr=stats["std"].fillna(0.0), marker=marker, capsize=3, label=label)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--x", required=True, help="grid key on the x axis")
    parser.add_argument("--series", default="", help="grid key drawn as one line per value")
    parser.add_argument("--logx", action="store_true")
    parser.add_argument("--title", default="")
    parser.add_argument("--extra", type=Path, help="another sweep drawn as one more line")
    parser.add_argument("--extra-label", default="")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    table = pd.read_csv(args.sweep / "sweep.csv")
    table = table[table["status"] == "completed"]
    groups = table.groupby(args.series) if args.series else [("", table)]
    figure = Figure(figsize=(6.0, 3.8))
    axes = figure.subplots()
    for value, rows in groups:
        accuracy_line(axes, rows, args.x, f"{args.series} = {value}" if args.series else None, "o")
    if args.extra:
        extra = pd.read_csv(args.extra / "sweep.csv")
        accuracy_line(axes, extra[extra["status"] == "completed"], args.x, args.extra_label or args.extra.name, "s")
    if args.logx:
        axes.set_xscale("log")
    axes.set(
        xlabel=args.x,
        ylabel="final test accuracy (mean ± sd over seeds)",
        title=args.title or args.sweep.name,
    )
    if args.series or args.extra:
        axes.legend(fontsize=8)
    axes.grid(True, alpha=0.3)
    save_png(figure, args.out)


if __name__ == "__main__":
    main()
