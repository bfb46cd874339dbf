"""Each client's test accuracy (mean ± sd over seeds) from experiments/per_client_accuracy.py's CSV,
one line per grid setting: the per-client figure of docs/experiments.md.

Usage: python experiments/plot_per_client.py PER_CLIENT.csv --out FILE.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from fedprivacy.reports.sweep_figures import groups, label, save_png


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    table = pd.read_csv(args.csv)
    settings = [
        c
        for c in table.columns
        if c not in ("seed", "client", "epsilon_budget", "epsilon_spent", "test_rows", "accuracy")
    ]
    clients = table.groupby("client")["epsilon_budget"].first().sort_index()
    figure = Figure(figsize=(6.5, 3.8))
    axes = figure.subplots()
    for values, rows in groups(table, settings):
        stats = rows.groupby("client")["accuracy"].agg(["mean", "std"]).reindex(clients.index)
        axes.errorbar(
            range(len(clients)),
            stats["mean"],
            yerr=stats["std"],
            marker="o",
            capsize=3,
            label=label(settings, values),
        )
    axes.set_xticks(range(len(clients)), [f"{c}\nε={e:g}" for c, e in clients.items()])
    axes.set(
        xlabel="client (PUMA) and its budget",
        ylabel="test accuracy on its own rows",
        title="per-client accuracy of the final global model",
    )
    axes.legend(fontsize=7)
    axes.grid(True, alpha=0.3)
    save_png(figure, args.out)


if __name__ == "__main__":
    main()
