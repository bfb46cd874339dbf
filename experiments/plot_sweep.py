"""Final test accuracy (mean ± sd over seeds) of a sweep against one grid key, one line per value
of another: the figures of docs/experiments.md that `fedprivacy report` does not draw.

Usage: python experiments/plot_sweep.py SWEEP_DIR --x clip-norm --series epsilon [--logx] --out FILE.png [--title T]
       [--extra OTHER_SWEEP_DIR --extra-label LABEL]   (one more line: all of another sweep's cells)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure


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
        stats = rows.groupby(args.x)["final_accuracy"].agg(["mean", "std"]).reset_index()
        label = f"{args.series} = {value}" if args.series else None
        axes.errorbar(stats[args.x], stats["mean"], yerr=stats["std"].fillna(0.0), marker="o", capsize=3, label=label)
    if args.extra:
        extra = pd.read_csv(args.extra / "sweep.csv")
        stats = extra[extra["status"] == "completed"].groupby(args.x)["final_accuracy"].agg(["mean", "std"]).reset_index()
        axes.errorbar(stats[args.x], stats["mean"], yerr=stats["std"].fillna(0.0), marker="s", capsize=3, label=args.extra_label or args.extra.name)
    if args.logx:
        axes.set_xscale("log")
    axes.set(xlabel=args.x, ylabel="final test accuracy (mean ± sd over seeds)", title=args.title or args.sweep.name)
    if args.series or args.extra:
        axes.legend(fontsize=8)
    axes.grid(True, alpha=0.3)
    figure.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=100)


if __name__ == "__main__":
    main()
