"""A finished (or partly finished) sweep folder read into tables, for the report's figures and tables.

Only completed cells are read beyond sweep.csv. Each per-round and per-client table carries the
cell's grid values as columns, so that the report can group by any of them. The report plots
against `x_key`, the grid key on its horizontal axis: ε when the grid varies it, else the first
varied numeric key other than the seed, else none. Its lines (`series_keys`) are the other grid
keys but the seed and those linked with the x key, over which the report takes means and spreads.
`grid` holds every varied key: [grid]'s, then each [linked.<name>] group's (sweep.json's
"linked"), whose keys step together and so make one axis (`axes`).

The replicates of a setting (`replicate_keys`) are its seeds, and its splits too when [grid] varies
`split-seed` (2 or more values, outside any linked group): then a setting (`setting_keys`) is a
cell's grid values without both, and the report pools its runs over splits and seeds nested in them
(`statistics.two_stage_interval`). A split-seed with one value, or linked with other keys, stays a
setting's key like any other.

`cells` gains `evaluation_rows` from each completed cell's summary.json: how many central rows
(test, or validation under evaluate-on) its accuracy was measured on, for the binomial standard
error, and `largest_class_share`, what always predicting their largest class scores (sweep.csv's
`beats_largest_class` compares, `fedprivacy.results`); NaN for a results folder written before
summary.json recorded them, or for a run that evaluated through its clients.

With [tune] (sweep.json's `tune`), `tuned` maps each cell (sweep.csv's `cell`) to the values its
arm's tuning chose: `<sweep>/tuning/<arm>/choice.json` lists the arm's cells under `cells` and
the choice under `chosen`. An arm without a choice (every candidate failed) has no entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from fedprivacy.errors import InputError
from fedprivacy.sweepfiles import (
    BASELINE,
    BASELINE_JSON,
    CELL_JSON,
    CELLS,
    CHOICE_JSON,
    SWEEP_CSV,
    SWEEP_JSON,
    TUNING,
    read_json,
)

SEED = "seed"
SPLIT_SEED = "split-seed"
SUMMARY_JSON = "summary.json"


@dataclass(frozen=True)
class SweepData:
    name: str
    grid: dict[str, list]  # every varied key and its values: [grid]'s, then the linked groups'
    cells: pd.DataFrame  # sweep.csv, and evaluation_rows
    rounds: pd.DataFrame  # rounds.csv of every completed cell, with its grid values
    clients: pd.DataFrame  # clients.csv of every completed cell, with its grid values and spent/budget
    baselines: pd.DataFrame  # one row per completed baseline: its grid values, final and best accuracy
    baseline_rounds: pd.DataFrame  # the baselines' rounds.csv, with their grid values
    linked: dict[str, list[str]] = field(default_factory=dict)  # a linked group's name -> its keys
    tuned: dict[str, dict[str, Any]] = field(default_factory=dict)  # [tune]: a cell -> its arm's chosen values

    @property
    def completed(self) -> pd.DataFrame:
        return self.cells[self.cells["status"] == "completed"]

    @property
    def measured(self) -> pd.DataFrame:
        """The completed cells that have a final accuracy: those the statistics are taken over."""
        return self.completed[self.completed["final_accuracy"].notna()]

    @property
    def split_key(self) -> str | None:
        """SPLIT_SEED when the report pools over splits: a [grid] key (not linked) with 2 or more values."""
        linked = any(SPLIT_SEED in keys for keys in self.linked.values())
        return SPLIT_SEED if not linked and len(self.grid.get(SPLIT_SEED, [])) >= 2 else None

    @property
    def replicate_keys(self) -> tuple[str, ...]:
        """The keys whose values replicate a setting: the seed, and the split-seed when pooled over."""
        return (SEED, self.split_key) if self.split_key else (SEED,)

    @property
    def setting_keys(self) -> list[str]:
        """The grid keys that make a setting: all but `replicate_keys`, in grid order."""
        return [k for k in self.grid if k not in self.replicate_keys]

    @property
    def x_key(self) -> str | None:
        if "epsilon" in self.grid:
            return "epsilon"
        numeric = [k for k in self.setting_keys if all(isinstance(v, int | float) for v in self.grid[k])]
        return numeric[0] if numeric else None

    @property
    def series_keys(self) -> list[str]:
        return [k for k in self.setting_keys if k not in (self.x_key, *self.partners(self.x_key))]

    def partners(self, key: str | None) -> list[str]:
        """The keys linked with `key` (they take one value per value of it)."""
        return next(([k for k in keys if k != key] for keys in self.linked.values() if key in keys), [])

    @property
    def axes(self) -> dict[str, list[str]]:
        """The grid's axes but the replicates', named: a [grid] key alone, or a linked group's keys together."""
        grouped = {k for keys in self.linked.values() for k in keys}
        found = {k: [k] for k in self.setting_keys if k not in grouped}
        for name, keys in self.linked.items():
            found[f"{name} ({', '.join(keys)})"] = [k for k in keys if k != SEED]
        return found


def _with_params(table: pd.DataFrame, params: dict, cell: str) -> pd.DataFrame:
    return table.assign(cell=cell, **params)


SUMMARY_FIELDS = ("evaluation_rows", "largest_class_share")


def _summary_fields(run: Path) -> list[float]:
    """`SUMMARY_FIELDS` of a run's summary.json (NaN where it has none: older folders, federated evaluation)."""
    summary = read_json(run / SUMMARY_JSON) if (run / SUMMARY_JSON).is_file() else {}
    return [float("nan") if summary.get(key) is None else float(summary[key]) for key in SUMMARY_FIELDS]


def _tuned(folder: Path) -> dict[str, dict[str, Any]]:
    """sweep.csv's `cell` -> the values its arm's choice.json chose (the arms with a choice)."""
    found = {}
    for path in sorted((folder / TUNING).glob(f"*/{CHOICE_JSON}")):
        choice = read_json(path)
        if choice.get("chosen"):
            found.update({f"{CELLS}/{name}": choice["chosen"]["values"] for name in choice.get("cells", [])})
    return found


def load_sweep(folder: Path) -> SweepData:
    """Read `folder` (a sweep's --out); a folder without sweep.csv or sweep.json is refused in one line."""
    for needed in (SWEEP_CSV, SWEEP_JSON):
        if not (folder / needed).is_file():
            raise InputError("sweep_dir", str(folder), f"has no {needed}: not the --out folder of a fedprivacy sweep")
    spec = read_json(folder / SWEEP_JSON)
    cells = pd.read_csv(folder / SWEEP_CSV)
    rounds, clients = [], []
    for key in SUMMARY_FIELDS:
        cells[key] = float("nan")
    for index, name in cells.loc[cells["status"] == "completed", "cell"].items():
        record = read_json(folder / name / CELL_JSON)
        run = folder / name / record["run_folder"]
        cells.loc[index, list(SUMMARY_FIELDS)] = _summary_fields(run)
        rounds.append(_with_params(pd.read_csv(run / "rounds.csv"), record["params"], name))
        clients.append(_with_params(pd.read_csv(run / "clients.csv"), record["params"], name))
    baselines, baseline_rounds = [], []
    for path in sorted((folder / BASELINE).glob(f"*/{BASELINE_JSON}")):
        record = read_json(path)
        if record["status"] == "completed":
            baselines.append(
                {
                    **record["params"],
                    "final_accuracy": record["final_accuracy"],
                    "best_accuracy": record["best_accuracy"],
                    "schedule_from": record["schedule_from"],
                }
            )
            baseline_rounds.append(
                _with_params(pd.read_csv(path.parent / "rounds.csv"), record["params"], record["name"])
            )
    clients_table = pd.concat(clients, ignore_index=True) if clients else pd.DataFrame()
    if len(clients_table):
        clients_table["budget_used"] = clients_table["epsilon_spent"] / clients_table["epsilon_budget"]
    linked = spec.get("linked") or {}
    return SweepData(
        name=spec["name"],
        grid={**spec["grid"], **{key: values for group in linked.values() for key, values in group.items()}},
        cells=cells,
        rounds=pd.concat(rounds, ignore_index=True) if rounds else pd.DataFrame(),
        clients=clients_table,
        baselines=pd.DataFrame(baselines),
        baseline_rounds=pd.concat(baseline_rounds, ignore_index=True) if baseline_rounds else pd.DataFrame(),
        linked={name: list(group) for name, group in linked.items()},
        tuned=_tuned(folder) if spec.get("tune") else {},
    )
