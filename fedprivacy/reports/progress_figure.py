"""The figure of one run's progress: accuracy and the largest ε spent, round by round."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator


def draw_progress(rounds: Sequence[dict[str, Any]], path: Path) -> Path:
    """Accuracy (central, else federated) on the left axis, max ε spent on the right, per round."""
    numbers = [r["round"] for r in rounds]
    key = "accuracy" if any(r["accuracy"] is not None for r in rounds) else "federated_accuracy"
    fig = Figure(figsize=(6, 3.5), layout="tight")
    left = fig.subplots()
    left.plot(numbers, [math.nan if r[key] is None else r[key] for r in rounds], "o-", color="C0")
    left.set_xlabel("round")
    left.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
    left.set_ylabel(key.replace("_", " "), color="C0")
    right = left.twinx()
    right.plot(numbers, [r["epsilon_spent_max"] for r in rounds], "s--", color="C3")
    right.set_ylabel("max ε spent", color="C3")
    fig.savefig(path, dpi=120)
    return path
