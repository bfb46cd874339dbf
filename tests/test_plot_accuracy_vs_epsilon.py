"""experiments/plot_accuracy_vs_epsilon.py's per-client panel: each seed's lowest, median and highest
client accuracy, averaged over seeds, checked against sums written out by hand."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]


def plot_script() -> ModuleType:
    """The script as a module (experiments/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "experiments_plot_eps", ROOT / "experiments" / "plot_accuracy_vs_epsilon.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def per_client_table() -> pd.DataFrame:
    """Two rules × two budgets × two seeds × three clients, accuracies chosen so min, median and max differ."""
    rows = []
    accuracies = {
        ("proactive", 1.0, 0): [0.2, 0.5, 0.9],
        ("proactive", 1.0, 1): [0.4, 0.3, 0.7],
        ("proactive", 4.0, 0): [0.6, 0.8, 0.7],
        ("proactive", 4.0, 1): [0.5, 0.9, 0.6],
        ("calibrated", 1.0, 0): [0.1, 0.1, 0.4],
        ("calibrated", 1.0, 1): [0.3, 0.6, 0.2],
        ("calibrated", 4.0, 0): [0.9, 0.8, 1.0],
        ("calibrated", 4.0, 1): [0.7, 0.7, 0.8],
    }
    for (rule, epsilon, seed), values in accuracies.items():
        for client, accuracy in zip(("a", "b", "c"), values, strict=True):
            rows.append({"seed": seed, "rule": rule, "epsilon": epsilon, "client": client, "accuracy": accuracy})
    return pd.DataFrame(rows)


def test_client_spread_is_the_seed_mean_of_each_seeds_extremes_and_median() -> None:
    spread = plot_script().client_spread(per_client_table()).set_index(["rule", "epsilon"])
    # proactive, ε = 1: seed 0 → (0.2, 0.5, 0.9), seed 1 → (0.3, 0.4, 0.7)
    assert spread.loc[("proactive", 1.0)].to_dict() == pytest.approx({"low": 0.25, "median": 0.45, "high": 0.8})
    # calibrated, ε = 4: seed 0 → (0.8, 0.9, 1.0), seed 1 → (0.7, 0.7, 0.8)
    assert spread.loc[("calibrated", 4.0)].to_dict() == pytest.approx({"low": 0.75, "median": 0.8, "high": 0.9})
    # the min over clients of the seed means would be another number: the per-seed order matters
    table = per_client_table()
    pooled_min = table[(table.rule == "proactive") & (table.epsilon == 1.0)].groupby("client")["accuracy"].mean().min()
    assert pooled_min == pytest.approx(0.3) and spread.loc[("proactive", 1.0), "low"] != pytest.approx(pooled_min)
    assert len(spread) == 4


def test_per_client_option_draws_the_spread_beside_the_pooled_accuracy(tmp_path: Path) -> None:
    table = per_client_table()
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    cells = table.groupby(["seed", "rule", "epsilon"])["accuracy"].mean().rename("final_accuracy").reset_index()
    cells.sort_values("rule", ascending=False).assign(status="completed").to_csv(sweep / "sweep.csv", index=False)
    table.sort_values("rule").to_csv(tmp_path / "per_client.csv", index=False)
    module = plot_script()
    assert len(module.accuracy_figure([sweep], None, None, "t").axes) == 1
    figure = module.accuracy_figure([sweep], None, tmp_path / "per_client.csv", "t")
    assert len(figure.axes) == 2
    medians = {line.get_label(): list(line.get_ydata()) for line in figure.axes[1].get_lines()}
    # ε = 1 then 4: proactive (0.5 + 0.4) / 2 and (0.7 + 0.6) / 2; calibrated (0.1 + 0.3) / 2 and (0.9 + 0.7) / 2
    assert medians["proactive: median client"] == pytest.approx([0.45, 0.65])
    assert medians["calibrated: median client"] == pytest.approx([0.2, 0.8])
    # each rule keeps its colour across the panels (the per-client CSV lists its rules in another order)
    left = {c.get_label().split(" ")[0]: c.lines[0].get_color() for c in figure.axes[0].containers}
    right = {line.get_label().split(":")[0]: line.get_color() for line in figure.axes[1].get_lines()}
    assert left == right and len(set(left.values())) == 2
