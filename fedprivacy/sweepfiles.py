"""The folder a sweep writes: its layout, the columns of sweep.csv, and a cell's row.

The sweep (`sims.sweep`, which may import flwr) writes this folder and the report
(`fedprivacy.reports.sweep_report`, which never does) reads it, so both take the layout from here:

    <out>/sweep.json            the scenario as run: fixed run config, grid, engine, resources
    <out>/sweep.csv             one row per cell: the grid keys, then RESULT_COLUMNS
    <out>/cells/<cell>/         the cell's results-dir: the run's `<time>-run<id>/` results folder
                                (fedprivacy.results) and cell.json, written last: the cell is done
    <out>/baseline/<name>/      one non-private baseline: baseline.json and rounds.csv
    <out>/tuning/<arm>/         with [tune]: the tuning runs of the cells that differ only in seed
                                (`<candidate>_seed=<s>/`, each like a cell folder) and choice.json
    <out>/tuning/baseline/<arm>/  the non-private baseline's own learning-rate tuning: one JSON per
                                run and choice.json
    <out>/report/               figures and report.md (`fedprivacy report`)

A hidden folder (`.<name>`) under baseline/ is a baseline being written: it is renamed into place
when done, so a sweep killed midway never leaves half a baseline.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pandas as pd

from fedprivacy.runconfig_keys import FEDERATION_KEYS

SWEEP_JSON = "sweep.json"
SWEEP_CSV = "sweep.csv"
CELLS = "cells"
CELL_JSON = "cell.json"
BASELINE = "baseline"
BASELINE_JSON = "baseline.json"
REPORT = "report"
TUNING = "tuning"
TUNING_BASELINE = "baseline"  # under TUNING; a cell arm is never named so (its name holds "=" or is "default")
CHOICE_JSON = "choice.json"
TUNED_EPSILON = "epsilon_with_tuning_max"  # sweep.csv with private tuning: the arm's ε with it, largest over clients
TUNED_PREFIX = "tuned."  # sweep.csv's column of a tuned key: tuned.learning-rate
TUNING_PRIVACY_NOTE = (
    "The tuning ran on validation rows cut from the clients' own training rows, so its privacy cost is "
    "NOT in the reported ε: a tuned result is private only if the tuning is accounted separately "
    "(e.g. Papernot & Steinke 2022, 'Hyperparameter tuning with Renyi differential privacy', for random search)."
)
TUNING_PRIVATE_NOTE = (
    "The tuning is private random search (Papernot & Steinke 2022, 'Hyperparameter tuning with Renyi "
    "differential privacy'): a random number of trials, each a candidate drawn at random and scored with "
    "Gaussian noise on validation rows. Each client's ε for the tuned result (the choice and one cell run with "
    "it), against whoever sees only those, is in choice.json (private.epsilon), beside what every trial's "
    "updates reveal together to a party that sees them all (the server)."
)
STAGING_PREFIX = "."

RESULT_COLUMNS = (
    "status",
    "final_accuracy",
    "best_accuracy",
    "epsilon_spent_max",
    "epsilon_spent_mean",
    "federation_epsilon_spent",
    "all_within_budget",
    "beats_largest_class",
    "wall_s",
    "engine",
    "cell",
    "error",
)

# The run-config keys the non-private baseline does not read (sims.baseline: plain FedAvg weighted
# by examples, no clipping, no noise, no server optimiser): a cell's baseline is the same for every
# value of these, so cells that differ only in them share one (its local schedule is taken from
# one cell, see sims.sweep).
BASELINE_IGNORED_KEYS = frozenset(
    {
        "epsilon",
        "epsilons",
        "delta",
        "deltas",
        "rule",
        "noise-seed",
        "clip-norm",
        "aggregation",
        "server-optimizer",
        "server-learning-rate",
        "server-momentum",
        "server-tau",
        "federation-epsilon",
        *FEDERATION_KEYS,
    }
)


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Written whole or not at all (a temporary file renamed into place)."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(temporary, path)


def _accuracy_column(rounds: pd.DataFrame) -> pd.Series:
    """Central test accuracy, or federated accuracy where the server had no test set."""
    if "accuracy" in rounds and rounds["accuracy"].notna().any():
        return rounds["accuracy"]
    return rounds.get("federated_accuracy", pd.Series(dtype=float))


def _number(value: Any) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def cell_results(folder: Path) -> dict[str, Any]:
    """The headline numbers of one cell's results folder (what it has: a failed run may have none)."""
    rounds = pd.read_csv(folder / "rounds.csv") if (folder / "rounds.csv").is_file() else pd.DataFrame()
    clients = pd.read_csv(folder / "clients.csv") if (folder / "clients.csv").is_file() else pd.DataFrame()
    summary = read_json(folder / "summary.json") if (folder / "summary.json").is_file() else {}
    accuracy = _accuracy_column(rounds).dropna()
    spent = clients["epsilon_spent"] if "epsilon_spent" in clients else pd.Series(dtype=float)
    return {
        "final_accuracy": _number(accuracy.iloc[-1]) if len(accuracy) else None,
        "best_accuracy": _number(accuracy.max()) if len(accuracy) else None,
        "epsilon_spent_max": _number(spent.max()) if len(spent) else None,
        "epsilon_spent_mean": _number(spent.mean()) if len(spent) else None,
        "federation_epsilon_spent": _number(summary.get("federation_epsilon_spent")),
        "all_within_budget": summary.get("all_within_budget"),
        "beats_largest_class": summary.get("beats_largest_class"),  # fedprivacy.results.beats_largest_class
    }
