"""Run a sweep: the baselines, then every cell not yet finished, through one engine; keep sweep.csv.

Resuming. A cell runs with `<out>/cells/<cell>/` as its results-dir, where the apps write their
usual `<time>-run<id>/` folder, and `cell.json` (grid values, run config, status, error, wall
time, the run folder's name) is written there last, atomically: it is what marks the cell done.
A rerun with the same `--out` skips the cells whose cell.json says completed, and empties any
other cell folder before running it again (what a killed sweep left, or a failed attempt), so a
broken run never survives beside its redo and no cell is run twice. A cell folder this scenario
does not have, or a cell.json (completed or failed) with other settings, make a rerun refuse to
start, so one folder never mixes two scenarios.

sweep.csv is rebuilt from the cell folders after every cell, so it always agrees with them:
one row per cell in grid order, `pending` until the cell has run.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console

from fedprivacy.errors import InputError, error_summary
from fedprivacy.sweepfiles import (
    BASELINE,
    BASELINE_JSON,
    CELL_JSON,
    CELLS,
    RESULT_COLUMNS,
    SWEEP_CSV,
    SWEEP_JSON,
    cell_results,
    read_json,
    write_json,
)
from sims.sweep.baselines import BaselineJob, baseline_jobs, is_finished, run_baseline
from sims.sweep.engines import CellRunner, create_runner
from sims.sweep.grid import Cell
from sims.sweep.progress import SweepProgress
from sims.sweep.spec import SweepSpec


@dataclass(frozen=True)
class SweepOutcome:
    """sweep.csv's rows and the baselines' records, as they stand at the end."""

    rows: list[dict[str, Any]]
    baselines: list[dict[str, Any]]

    @property
    def failures(self) -> list[str]:
        cells = [f"{r['cell']}: {r['error']}" for r in self.rows if r["status"] != "completed"]
        return cells + [f"baseline {b['name']}: {b['error']}" for b in self.baselines if b["status"] != "completed"]


def cell_record(out: Path, name: str) -> dict[str, Any] | None:
    path = out / CELLS / name / CELL_JSON
    return read_json(path) if path.is_file() else None


def check_resumable(out: Path, cells: list[Cell]) -> None:
    """Refuse an --out that holds another scenario's cells, or cells run with other settings than these cells'."""
    names = {cell.name for cell in cells}
    found = sorted(path.name for path in (out / CELLS).iterdir() if path.is_dir()) if (out / CELLS).is_dir() else []
    foreign = [name for name in found if name not in names]
    if foreign:
        raise InputError(
            "out",
            str(out),
            f"holds cell {foreign[0]}, which this scenario does not have (another scenario's "
            "results): resume with the same scenario or use another --out",
        )
    for cell in cells:
        record = cell_record(out, cell.name)
        if record is None or record["run_config"] == cell.run_config:
            continue
        old = record["run_config"]
        key = next(k for k in sorted({*old, *cell.run_config}) if old.get(k) != cell.run_config.get(k))
        raise InputError(
            "out",
            str(out),
            f"its cell {cell.name} ran with {key}={old.get(key)!r}, this scenario has "
            f"{cell.run_config.get(key)!r}: resume with the same scenario or use another --out",
        )


def sweep_row(out: Path, cell: Cell) -> dict[str, Any]:
    """The cell's grid values, then its status and headline numbers (from its folder, when it has one)."""
    record = cell_record(out, cell.name)
    row: dict[str, Any] = {
        **cell.params,
        **dict.fromkeys(RESULT_COLUMNS),
        "status": "pending",
        "cell": f"{CELLS}/{cell.name}",
    }
    if record is not None:
        if record["run_folder"] is not None:
            row.update(cell_results(out / CELLS / cell.name / record["run_folder"]))
        row.update(status=record["status"], error=record["error"], wall_s=record["wall_s"], engine=record["engine"])
    return row


def write_sweep_csv(out: Path, spec: SweepSpec, cells: list[Cell]) -> list[dict[str, Any]]:
    rows = [sweep_row(out, cell) for cell in cells]
    temporary = out / f"{SWEEP_CSV}.tmp"
    pd.DataFrame(rows, columns=[*spec.grid, *RESULT_COLUMNS]).to_csv(temporary, index=False)
    os.replace(temporary, out / SWEEP_CSV)
    return rows


def run_cell(runner: CellRunner, engine_name: str, cell: Cell, out: Path, progress: SweepProgress) -> dict[str, Any]:
    """Run one cell in its emptied folder; write cell.json last (a failure too, with its error)."""
    folder = out / CELLS / cell.name
    shutil.rmtree(folder, ignore_errors=True)  # a killed or failed attempt: never a second result
    folder.mkdir(parents=True)
    started = time.perf_counter()
    error = None
    try:
        runner.run_cell(cell, folder, progress.round)
    except Exception as exc:  # one failed cell is a row with its error, not a crashed sweep
        error = error_summary(f"{type(exc).__name__}: {exc}")
    wall = round(time.perf_counter() - started, 2)
    runs = [path.parent for path in folder.rglob("summary.json")]
    if error is None and len(runs) != 1:
        error = f"the run left {len(runs)} results folders, expected one"
    elif error is None and read_json(runs[0] / "summary.json").get("status") != "completed":
        error = read_json(runs[0] / "summary.json").get("error") or "the run did not complete"
    record = {
        "name": cell.name,
        "params": cell.params,
        "run_config": cell.run_config,
        "num_clients": cell.num_clients,
        "engine": engine_name,
        "status": "completed" if error is None else "failed",
        "error": error,
        "wall_s": wall,
        "run_folder": str(runs[0].relative_to(folder)) if len(runs) == 1 else None,
    }
    write_json(folder / CELL_JSON, record)
    return record


def _cell_line(record: dict[str, Any], row: dict[str, Any]) -> str:
    if record["status"] != "completed":
        return f"[red]{record['name']}: failed[/red] ({record['wall_s']:.0f} s): {record['error']}"
    return (
        f"{record['name']}: final accuracy {row['final_accuracy']:.4f}, max ε spent {row['epsilon_spent_max']:.4f} "
        f"({record['wall_s']:.0f} s)"
    )


class EngineUnavailable(RuntimeError):
    """The engine could not start (e.g. no SuperLink came up): no cell can run."""


def _run_baselines(jobs: list[BaselineJob], baseline_dir: Path, progress: SweepProgress) -> None:
    for job in [job for job in jobs if not is_finished(job, baseline_dir)]:
        progress.start(f"baseline {job.name}", int(job.cell.run_config["num-server-rounds"]))
        record = run_baseline(job, baseline_dir)
        progress.end(counts_as_cell=False)
        outcome = (
            f"final accuracy {record['final_accuracy']:.4f}"
            if record["error"] is None
            else f"[red]failed[/red]: {record['error']}"
        )
        progress.log(f"baseline {job.name}: {outcome}")


def _run_cells(
    spec: SweepSpec,
    cells: list[Cell],
    pending: list[Cell],
    out: Path,
    runner: CellRunner,
    progress: SweepProgress,
) -> None:
    """The pending cells between the runner's setup and teardown (which runs on any exit, Ctrl-C too)."""
    try:
        try:
            runner.setup()
        except Exception as exc:
            raise EngineUnavailable(
                f"engine {spec.engine} could not start: {error_summary(f'{type(exc).__name__}: {exc}')}"
            ) from exc
        for cell in pending:
            progress.start(cell.name, int(cell.run_config["num-server-rounds"]))
            record = run_cell(runner, spec.engine, cell, out, progress)
            rows = write_sweep_csv(out, spec, cells)
            progress.end(counts_as_cell=True)
            progress.log(_cell_line(record, rows[cells.index(cell)]))
    finally:
        runner.teardown()


def run_sweep(
    spec: SweepSpec,
    cells: list[Cell],
    out: Path,
    *,
    console: Console | None = None,
) -> SweepOutcome:
    """Run the baselines and every unfinished cell; return sweep.csv's rows and the baselines."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise InputError("out", str(out), f"cannot write the sweep there: {error.strerror or error}") from None
    check_resumable(out, cells)
    write_json(out / SWEEP_JSON, {**spec.to_dict(), "cells": [c.name for c in cells]})
    jobs = baseline_jobs(cells, spec.baseline_learning_rate) if spec.baseline else []
    pending = [cell for cell in cells if (cell_record(out, cell.name) or {}).get("status") != "completed"]
    write_sweep_csv(out, spec, cells)
    with SweepProgress(len(cells), len(cells) - len(pending), console) as progress:
        if spec.seeded_noise:
            progress.log(
                "seeded noise: every cell's DP noise is reproducible from its seed (for experiments, never production)"
            )
        if len(pending) < len(cells):
            progress.log(f"resuming {out}: {len(cells) - len(pending)} of {len(cells)} cells already finished")
        _run_baselines(jobs, out / BASELINE, progress)
        if pending:
            _run_cells(spec, cells, pending, out, create_runner(spec.engine, spec.resources), progress)
    baselines = [read_json(out / BASELINE / job.name / BASELINE_JSON) for job in jobs]
    return SweepOutcome(write_sweep_csv(out, spec, cells), baselines)
