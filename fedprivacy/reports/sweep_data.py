"""A finished (or partly finished) sweep folder read into tables, for the report's figures and tables.

Only completed cells are read beyond sweep.csv. Each per-round and per-client table carries the
cell's grid values as columns, so that the report can group by any of them. The report plots
against `x_key`, the grid key on its horizontal axis: ε when the grid varies it, else the first
varied numeric key other than the seed, else none. Its lines (`series_keys`) are the other grid
keys but the seed, over which the report takes means and spreads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from fedprivacy.errors import InputError
from fedprivacy.sweepfiles import BASELINE, BASELINE_JSON, CELL_JSON, SWEEP_CSV, SWEEP_JSON, read_json

SEED = "seed"


@dataclass(frozen=True)
class SweepData:
    name: str
    grid: dict[str, list]
    cells: pd.DataFrame  # sweep.csv
    rounds: pd.DataFrame  # rounds.csv of every completed cell, with its grid values
    clients: pd.DataFrame  # clients.csv of every completed cell, with its grid values and spent/budget
    baselines: pd.DataFrame  # one row per completed baseline: its grid values, final and best accuracy
    baseline_rounds: pd.DataFrame  # the baselines' rounds.csv, with their grid values

    @property
    def completed(self) -> pd.DataFrame:
        return self.cells[self.cells["status"] == "completed"]

    @property
    def x_key(self) -> str | None:
        if "epsilon" in self.grid:
            return "epsilon"
        numeric = [
            k for k, values in self.grid.items() if k != SEED and all(isinstance(v, int | float) for v in values)
        ]
        return numeric[0] if numeric else None

    @property
    def series_keys(self) -> list[str]:
        return [k for k in self.grid if k not in (SEED, self.x_key)]


def _with_params(table: pd.DataFrame, params: dict, cell: str) -> pd.DataFrame:
    return table.assign(cell=cell, **params)


def load_sweep(folder: Path) -> SweepData:
    """Read `folder` (a sweep's --out); a folder without sweep.csv or sweep.json is refused in one line."""
    for needed in (SWEEP_CSV, SWEEP_JSON):
        if not (folder / needed).is_file():
            raise InputError("sweep_dir", str(folder), f"has no {needed}: not the --out folder of a fedprivacy sweep")
    spec = read_json(folder / SWEEP_JSON)
    cells = pd.read_csv(folder / SWEEP_CSV)
    rounds, clients = [], []
    for name in cells.loc[cells["status"] == "completed", "cell"]:
        record = read_json(folder / name / CELL_JSON)
        run = folder / name / record["run_folder"]
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
    return SweepData(
        name=spec["name"],
        grid=spec["grid"],
        cells=cells,
        rounds=pd.concat(rounds, ignore_index=True) if rounds else pd.DataFrame(),
        clients=clients_table,
        baselines=pd.DataFrame(baselines),
        baseline_rounds=pd.concat(baseline_rounds, ignore_index=True) if baseline_rounds else pd.DataFrame(),
    )
