"""The figures of one run: its progress round by round (accuracy and the largest ε spent), and each
client's accuracy on its own test rows. Accuracy axes run from 0 to 1, so a flat run looks flat."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator


def _figure(right_axis: bool = False, title: bool = False) -> Figure:
    """A 6 × 3.5 in figure with fixed margins, wide enough for its axis labels, a right-hand axis
    and a title where it has them: a layout engine ("tight") draws a figure twice, 40% of its cost."""
    fig = Figure(figsize=(6, 3.5))
    fig.subplots_adjust(left=0.11, right=0.88 if right_axis else 0.96, bottom=0.14, top=0.9 if title else 0.95)
    return fig


def draw_progress(rounds: Sequence[dict[str, Any]], path: Path) -> Path:
    """Accuracy (central, else federated) on the left axis, max ε spent on the right, per round;
    with client-level DP, the federation's ε spent on the right too."""
    numbers = [r["round"] for r in rounds]
    key = "accuracy" if any(r["accuracy"] is not None for r in rounds) else "federated_accuracy"
    fig = _figure(right_axis=True)
    left = fig.subplots()
    left.plot(numbers, [math.nan if r[key] is None else r[key] for r in rounds], "o-", color="C0")
    left.set_xlabel("round")
    left.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
    left.set_ylabel(key.replace("_", " "), color="C0")
    left.set_ylim(0.0, 1.0)
    right = left.twinx()
    right.plot(numbers, [r["epsilon_spent_max"] for r in rounds], "s--", color="C3", label="record level (max)")
    right.set_ylabel("max ε spent", color="C3")
    federation = [r.get("federation_epsilon_spent") for r in rounds]
    if any(spent is not None for spent in federation):
        right.plot(numbers, [math.nan if e is None else e for e in federation], "^:", color="C2", label="federation")
        right.set_ylabel("ε spent", color="C3")
        right.legend(loc="best", fontsize="small")
    right.set_ylim(bottom=0.0)
    fig.savefig(path, dpi=120)
    return path


LABELLED_CLIENTS = 20  # up to this many clients, clients.png names each point


def draw_client_accuracy(clients: Sequence[dict[str, Any]], central: float | None, path: Path) -> Path | None:
    """Each evaluated client's accuracy on its own test rows against its training rows, coloured by
    its ε budget and named when there are few, with the central accuracy as a line; None (and no
    file) when no client evaluated."""
    shown = [c for c in clients if not math.isnan(c["accuracy"])]
    if not shown:
        return None
    fig = _figure(title=True)
    axes = fig.subplots()
    budgets = sorted({c["epsilon_budget"] for c in shown}, key=lambda b: (math.isnan(b), b))
    for index, budget in enumerate(budgets):
        group = [
            c
            for c in shown
            if c["epsilon_budget"] == budget or (math.isnan(budget) and math.isnan(c["epsilon_budget"]))
        ]
        label = "ε budget unknown" if math.isnan(budget) else f"ε budget {budget:g}"
        axes.scatter(
            [c["num_examples"] for c in group], [c["accuracy"] for c in group], s=18, color=f"C{index}", label=label
        )
    if len(shown) <= LABELLED_CLIENTS:  # few enough to name each point by its client
        for c in shown:
            axes.annotate(
                str(c["client_id"]),
                (c["num_examples"], c["accuracy"]),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
    if central is not None:
        axes.axhline(central, color="black", linestyle=":", linewidth=1, label="central test accuracy")
    axes.set_ylim(0.0, 1.0)
    axes.set_xlabel("client's training rows")
    axes.set_ylabel("accuracy on its own test rows")
    axes.set_title(f"{len(shown)} clients, last federated evaluation", fontsize=10)
    if len(budgets) > 1 or central is not None:
        axes.legend(fontsize=8, loc="best")
    fig.savefig(path, dpi=120)
    return path
