"""Run declarative scenarios through the real Flower apps, in process, and read their results.

A `Scenario` is a name, a run config (the app's run-config keys, overriding
`fedprivacy.runconfig.DEFAULTS`) and a number of simulated clients. `run_scenario` validates the
run config, drives `server.app:app` and `clients.app:app` on an `InProcessGrid`, and reads back
the results folder the ServerApp wrote (`summary.json`, `rounds.csv`, `clients.csv`).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedprivacy.data.partition import load_clients
from fedprivacy.recipe import partition_kwargs, require_data_file
from fedprivacy.runconfig import DEFAULTS, parse_run_config
from sims.inprocess import InProcessGrid, run_server


@dataclass(frozen=True)
class Scenario:
    """One federated run: `run_config` overrides the app defaults; `num_clients` None = one per
    natural partition (the data decides, e.g. 7 PUMAs)."""

    name: str
    run_config: dict[str, Any] = field(default_factory=dict)
    num_clients: int | None = None

    def config(self, results_dir: Path | None = None) -> dict[str, Any]:
        """The full run config (defaults + overrides), results under `results_dir/<name>` if given."""
        config = {**DEFAULTS, **self.run_config}
        if results_dir is not None:
            config["results-dir"] = str(Path(results_dir).resolve() / self.name)
        return config


@dataclass(frozen=True)
class RunResult:
    """What a run left behind: its folder and the parsed files, plus the headline numbers."""

    name: str
    folder: Path | None
    summary: dict[str, Any]
    rounds: list[dict[str, Any]]
    clients: list[dict[str, Any]]
    wall_s: float
    private: bool = True

    @property
    def final_accuracy(self) -> float:
        return float(self.rounds[-1]["accuracy"])

    @property
    def best(self) -> tuple[int, float]:
        """(round, accuracy) of the best central test accuracy (the earliest on ties)."""
        row = max(self.rounds, key=lambda r: (r["accuracy"], -r["round"]))
        return int(row["round"]), float(row["accuracy"])

    @property
    def epsilon_spent_max(self) -> float | None:
        return max((c["epsilon_spent"] for c in self.clients), default=0.0) if self.private else None

    def check_budgets(self) -> None:
        """Raise unless every client's ε spent ≤ its budget (read from clients.csv)."""
        if not self.private:
            return
        if not self.clients:
            raise AssertionError(f"{self.name}: no client reported its privacy spending")
        over = [c for c in self.clients if not c["epsilon_spent"] <= c["epsilon_budget"]]
        if over or not self.summary.get("all_within_budget", False):
            raise AssertionError(f"{self.name}: clients over budget: {over or self.summary}")

    def row(self) -> dict[str, Any]:
        best_round, best_accuracy = self.best
        return {
            "scenario": self.name,
            "private": self.private,
            "final_accuracy": self.final_accuracy,
            "best_round": best_round,
            "best_accuracy": best_accuracy,
            "epsilon_spent_max": self.epsilon_spent_max,
            "epsilon_budget_min": min((c["epsilon_budget"] for c in self.clients), default=None)
            if self.private
            else None,
            "wall_s": round(self.wall_s, 2),
            "results_folder": None if self.folder is None else str(self.folder),
        }


def _number(text: str) -> Any:
    if text == "":
        return None
    try:
        value = float(text)
    except ValueError:
        return text
    return int(value) if value.is_integer() and "." not in text and "e" not in text.lower() else value


def _read_csv(path: Path) -> list[dict[str, Any]]:
    with path.open(newline="", encoding="utf-8") as handle:
        return [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(handle)]


def read_results(folder: Path, name: str | None = None, wall_s: float = math.nan) -> RunResult:
    """Parse the results folder a ServerApp run wrote."""
    folder = Path(folder)
    for needed in ("summary.json", "rounds.csv", "clients.csv"):
        if not (folder / needed).is_file():
            raise FileNotFoundError(f"{folder} has no {needed}: the run did not finish")
    clients = _read_csv(folder / "clients.csv")
    for client in clients:
        client["client_id"] = str(client["client_id"])
    return RunResult(
        name=name or folder.name,
        folder=folder,
        summary=json.loads((folder / "summary.json").read_text(encoding="utf-8")),
        rounds=_read_csv(folder / "rounds.csv"),
        clients=clients,
        wall_s=wall_s,
    )


def natural_client_count(run_config: dict[str, Any]) -> int:
    """How many clients the run config's partitioning gives when the data decides (natural)."""
    settings = parse_run_config(run_config)
    return len(load_clients(**partition_kwargs(settings, None)))


def run_scenario(scenario: Scenario, results_dir: Path, *, run_id: int = 1, quiet: bool = False) -> RunResult:
    """Drive the real ServerApp and ClientApp on `scenario`; return its parsed results folder."""
    from clients.app import app as client_app
    from server.app import app as server_app

    config = scenario.config(results_dir)
    settings = parse_run_config(config)  # refuse a bad scenario before any client starts
    num_clients = natural_client_count(config) if scenario.num_clients is None else scenario.num_clients
    settings.check_clients(num_clients, field="num_clients")
    require_data_file(settings)
    base = Path(config["results-dir"])
    before = set(base.iterdir()) if base.is_dir() else set()
    grid = InProcessGrid.simulation(client_app, num_clients, config, run_id)
    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
        run_server(server_app, grid, config)
    wall = time.perf_counter() - started
    new = [p for p in base.iterdir() if p not in before and (p / "summary.json").is_file()]
    if len(new) != 1:
        raise RuntimeError(f"expected one new results folder under {base}, found {len(new)}")
    return read_results(new[0], scenario.name, wall)
