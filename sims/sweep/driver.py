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

Tuning. With [tune], the tuning runs come first (sims.sweep.tuning: written and resumed like
cells, under `<out>/tuning/`), then the baselines (with their own learning rate, when tuned: the
same tuning on sims.sweep.baseline_jobs' plan, its runs without the mechanism), then each cell with
its arm's chosen values, which its cell.json (`tuned`) and sweep.csv (`tuned.<key>` columns)
record. The tuned keys are left out of the check
above and checked instead against each finished cell's `tuned`, so a rerun never mixes choices.
The engine is set up when the first tuning run or cell needs it, and torn down once at the end.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console

from fedprivacy.errors import InputError, error_summary
from fedprivacy.runconfig import DEFAULTS, first_difference
from fedprivacy.sweepfiles import (
    BASELINE,
    BASELINE_JSON,
    CELL_JSON,
    CELLS,
    CHOICE_JSON,
    RESULT_COLUMNS,
    SWEEP_CSV,
    SWEEP_JSON,
    TUNED_EPSILON,
    TUNED_PREFIX,
    TUNING,
    TUNING_BASELINE,
    cell_results,
    read_json,
    write_json,
)
from sims.sweep.baseline_jobs import (
    KEY,
    BaselineJob,
    baseline_jobs,
    baseline_tuning,
    is_finished,
    run_baseline,
    tunes_baseline,
)
from sims.sweep.engines import CellRunner, create_runner
from sims.sweep.grid import Cell, schedule_note
from sims.sweep.machine import check_machine
from sims.sweep.progress import SweepProgress
from sims.sweep.spec import SweepSpec
from sims.sweep.tuning import TuningPlan, plan_tuning, read_choices, run_outcome, runs_done, tune_arm
from sims.sweep.tuning import check_resumable as check_tuning_resumable


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


def check_resumable(out: Path, cells: list[Cell], ignored: frozenset[str] = frozenset()) -> None:
    """Refuse an --out that holds another scenario's cells, or cells run with other settings than these
    cells' (but the `ignored` keys: the tuned ones, which `check_tuned` checks)."""
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
        if record is None:
            continue
        old = {k: v for k, v in record["run_config"].items() if k not in ignored}
        new = {k: v for k, v in cell.run_config.items() if k not in ignored}
        key = first_difference(old, new)
        if key is None:
            continue
        raise InputError(
            "out",
            str(out),
            f"its cell {cell.name} ran with {key}={old.get(key, DEFAULTS.get(key))!r}, this scenario has "
            f"{cell.run_config.get(key, DEFAULTS.get(key))!r}: resume with the same scenario"
            f"{' and the same --data-path' if key == 'data-path' else ''} or use another --out",
        )


def check_tuned(out: Path, cells: list[Cell], tuned: Mapping[str, dict[str, Any]]) -> None:
    """Refuse when a finished cell ran with other tuned values than its arm's choice (cell name -> values)."""
    for cell in cells:
        record = cell_record(out, cell.name)
        if record is None or record["status"] != "completed" or cell.name not in tuned:
            continue
        if record.get("tuned") != tuned[cell.name]:
            raise InputError(
                "out",
                str(out),
                f"its cell {cell.name} ran with the tuned values {record.get('tuned')}, this sweep's tuning chose "
                f"{tuned[cell.name]}: resume with the same scenario and tuning, or use another --out",
            )


def sweep_row(out: Path, cell: Cell, tuned: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The cell's grid values, its tuned values (if any: the keys of `tuned`), then its status and
    headline numbers (from its folder, when it has one)."""
    record = cell_record(out, cell.name)
    row: dict[str, Any] = {
        **cell.params,
        **{f"{TUNED_PREFIX}{key}": value for key, value in (tuned or {}).items()},
        **dict.fromkeys(RESULT_COLUMNS),
        "status": "pending",
        "cell": f"{CELLS}/{cell.name}",
    }
    if record is not None:
        if record["run_folder"] is not None:
            row.update(cell_results(out / CELLS / cell.name / record["run_folder"]))
        row.update(status=record["status"], error=record["error"], wall_s=record["wall_s"], engine=record["engine"])
    return row


def tuning_costs(root: Path) -> dict[str, float]:
    """Each cell's ε with its arm's private tuning, the largest over clients (choice.json)."""
    costs = {}
    for path in root.glob(f"*/{CHOICE_JSON}"):
        choice = read_json(path)
        if choice.get("private"):
            costs.update(dict.fromkeys(choice["cells"], choice["private"]["epsilon"]["tuned_max"]))
    return costs


def write_sweep_csv(
    out: Path, spec: SweepSpec, cells: list[Cell], tuned: Mapping[str, dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """sweep.csv from the cell folders; `tuned` (cell name -> values) fills the tuned.<key> columns;
    with private tuning, `epsilon_with_tuning_max` is each cell's arm's cost (`tuning_costs`)."""
    keys = list(spec.tune.space) if spec.tune else []
    blank = dict.fromkeys(keys)
    rows = [sweep_row(out, cell, {**blank, **(tuned or {}).get(cell.name, {})} if keys else None) for cell in cells]
    columns = [*spec.varied, *(f"{TUNED_PREFIX}{key}" for key in keys), *RESULT_COLUMNS]
    if spec.tune is not None and spec.tune.private is not None:
        costs = tuning_costs(out / TUNING)
        for cell, row in zip(cells, rows, strict=True):
            row[TUNED_EPSILON] = costs.get(cell.name)
        columns.append(TUNED_EPSILON)
    temporary = out / f"{SWEEP_CSV}.tmp"
    pd.DataFrame(rows, columns=columns).to_csv(temporary, index=False)
    os.replace(temporary, out / SWEEP_CSV)
    return rows


def run_cell(
    runner: CellRunner,
    engine_name: str,
    cell: Cell,
    folder: Path,
    progress: SweepProgress,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Run one cell (or tuning run) in its emptied `folder`; write cell.json last (a failure too, with
    its error), with `extra` fields (a tuned cell's values)."""
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
    run_folder = str(runs[0].relative_to(folder)) if len(runs) == 1 else None
    record = _cell_record(cell, engine_name, error, wall, run_folder, extra)
    write_json(folder / CELL_JSON, record)
    return record


def _cell_record(
    cell: Cell,
    engine_name: str,
    error: str | None,
    wall: float,
    run_folder: str | None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A cell's cell.json: what ran (its grid values, run config, clients, engine) and how it ended."""
    return {
        "name": cell.name,
        "params": cell.params,
        "run_config": cell.run_config,
        "num_clients": cell.num_clients,
        "engine": engine_name,
        "status": "completed" if error is None else "failed",
        "error": error,
        "wall_s": wall,
        "run_folder": run_folder,
        **(extra or {}),
    }


def _cell_line(record: dict[str, Any], row: dict[str, Any]) -> str:
    if record["status"] != "completed":
        return f"[red]{record['name']}: failed[/red] ({record['wall_s']:.0f} s): {record['error']}"
    flat = " [yellow]no better than the largest class[/yellow]" if row.get("beats_largest_class") is False else ""
    tuning = row.get(TUNED_EPSILON)
    counted = f", with its private tuning {tuning:.3g}" if tuning is not None else ""
    return (
        f"{record['name']}: final accuracy {row['final_accuracy']:.4f}{flat}, "
        f"max ε spent {row['epsilon_spent_max']:.4f}{counted} ({record['wall_s']:.0f} s)"
    )


class EngineUnavailable(RuntimeError):
    """The engine could not start (e.g. no SuperLink came up): no cell can run."""


class EngineSession:
    """The engine's cell runner, set up when the first tuning run or cell needs it; `close` tears it
    down (the sweep calls it on any exit, Ctrl-C too, also after a failed setup)."""

    def __init__(self, spec: SweepSpec) -> None:
        self.spec = spec
        self._runner: CellRunner | None = None

    def runner(self) -> CellRunner:
        if self._runner is None:
            self._runner = create_runner(self.spec.engine, self.spec.resources)
            try:
                self._runner.setup()
            except Exception as exc:
                raise EngineUnavailable(
                    f"engine {self.spec.engine} could not start: {error_summary(f'{type(exc).__name__}: {exc}')}"
                ) from exc
        return self._runner

    def close(self) -> None:
        if self._runner is not None:
            self._runner.teardown()


def _run_tuning(
    plan: TuningPlan,
    root: Path,
    runner: Callable[[], CellRunner],
    engine_name: str,
    progress: SweepProgress,
    what: str = "tuning",
) -> dict[str, dict[str, Any] | None]:
    """Every arm's chosen values (None: every candidate failed), running the tuning runs not yet
    done, each a cell run by `runner()` in `root/<arm>/<run>`: the cells' tuning (`root` is
    `<out>/tuning`) and the baselines' (`<out>/tuning/baseline`, their runs cells without the
    mechanism) are this one loop."""
    chosen: dict[str, dict[str, Any] | None] = dict(read_choices(root, plan))
    todo = [arm for arm in plan.arms if arm.name not in chosen]
    if not todo:
        return chosen
    count = {"done": runs_done(root, plan, chosen)}
    progress.log(f"{what}: {plan.summary}; {count['done']} already done")

    def run(cell: Cell, folder: Path) -> dict[str, Any]:
        label = f"{TUNING}/{folder.relative_to(root if root.name == TUNING else root.parent)}"
        progress.start(f"{what} {cell.name}", int(cell.run_config["num-server-rounds"]))
        record = run_cell(runner(), engine_name, cell, folder, progress)
        progress.end(counts_as_cell=False)
        score, error = run_outcome(folder, plan.tune.select)
        result = f"validation accuracy {score:.4f}" if error is None else f"[red]failed[/red]: {error}"
        if plan.tune.private is not None:
            count["done"] += 1
            which = f"{count['done']} (private trial; about {plan.runs} in all)"
        elif cell.params["seed"] in plan.tune.seeds:
            count["done"] += 1
            which = f"{count['done']}/{plan.runs}"
        else:  # a tune-seeds-close seed: the candidate is close to the best
            which = "(extra seed, close candidate)"
        progress.log(f"{what} run {which} {label}: {result} ({record['wall_s']:.0f} s)")
        return record

    for arm in todo:
        record = tune_arm(arm, plan, root, run)
        chosen[arm.name] = record["chosen"]["values"] if record["chosen"] else None
        extra = " over the extra seeds of close candidates" if record["extra_seeds"] else ""
        picked = (
            f"{record['chosen']['name']} ({'noisy ' if record.get('private') else ''}validation score "
            f"{record['chosen']['score']:.4f}{extra})"
            if record["chosen"]
            else "[red]nothing: every candidate failed[/red]"
        )
        if record.get("private") and record["chosen"]:
            cost = record["private"]["epsilon"]
            picked += (
                f" after {record['private']['count']} private trials; ε with the tuning, largest over clients: "
                f"{cost['tuned_max']:.3g} (one run alone, same accountant: {cost['one_run_max']:.3g})"
            )
        progress.log(f"{what} {arm.name}: chose {picked}")
    return chosen


def _tuned_jobs(
    spec: SweepSpec, jobs: list[BaselineJob], untuned: set[str], out: Path, progress: SweepProgress
) -> tuple[list[BaselineJob], dict[str, str]]:
    """The baselines with their own tuned learning rate (when [tune] has one), and why any cannot run."""
    refused = {
        job.name: f"its schedule_from cell {job.cell.name} has no tuned setting (every candidate failed)"
        for job in jobs
        if job.cell.name in untuned
    }
    if spec.tune is None or not tunes_baseline(spec.tune, spec.baseline_learning_rate):
        return jobs, refused
    from sims.sweep.engines.fast import FastCellRunner  # the fast engine's imports, only when a baseline tunes

    plan = baseline_tuning([job for job in jobs if job.name not in refused], spec.tune)
    nonprivate = FastCellRunner(spec.resources, private=False)
    chosen = _run_tuning(plan, out / TUNING / TUNING_BASELINE, lambda: nonprivate, "fast", progress, "baseline tuning")
    etas = {name: values[KEY] for arm in plan.arms if (values := chosen.get(arm.name)) for name in arm.cells}
    found = []
    for job in jobs:
        eta = etas.get(job.name)
        if eta is None:
            refused.setdefault(job.name, "its learning-rate tuning failed for every candidate")
            found.append(job)
        else:
            found.append(
                dataclasses.replace(
                    job, run_config={**job.run_config, "learning-rate": eta}, tuned={**job.tuned, "learning-rate": eta}
                )
            )
    return found, refused


def _run_baselines(
    jobs: list[BaselineJob], baseline_dir: Path, progress: SweepProgress, refused: Mapping[str, str] | None = None
) -> None:
    for job in [job for job in jobs if not is_finished(job, baseline_dir)]:
        progress.start(f"baseline {job.name}", int(job.cell.run_config["num-server-rounds"]))
        record = run_baseline(job, baseline_dir, (refused or {}).get(job.name))
        progress.end(counts_as_cell=False)
        outcome = (
            f"final accuracy {record['final_accuracy']:.4f}"
            if record["error"] is None
            else f"[red]failed[/red]: {record['error']}"
        )
        progress.log(f"baseline {job.name}: {outcome}")


def _not_tuned(cell: Cell, out: Path, engine_name: str) -> dict[str, Any]:
    """cell.json of a cell whose arm's tuning chose nothing: failed, so that a rerun tries again."""
    folder = out / CELLS / cell.name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    error = f"no tuned setting: every candidate's tuning run failed (see {TUNING}/)"
    record = _cell_record(cell, engine_name, error, 0.0, None, {"tuned": None})
    write_json(folder / CELL_JSON, record)
    return record


def _run_cells(
    spec: SweepSpec,
    cells: list[Cell],
    pending: list[Cell],
    out: Path,
    session: EngineSession,
    progress: SweepProgress,
    tuned: Mapping[str, dict[str, Any]],
) -> None:
    """The pending cells, each with its tuned values when the sweep tunes (`tuned`: cell name -> values)."""
    for cell in pending:
        progress.start(cell.name, int(cell.run_config["num-server-rounds"]))
        if spec.tune is not None and cell.name not in tuned:
            record = _not_tuned(cell, out, spec.engine)
        else:
            values = tuned.get(cell.name)
            runnable = cell if values is None else dataclasses.replace(cell, run_config={**cell.run_config, **values})
            extra = None if values is None else {"tuned": values}
            record = run_cell(session.runner(), spec.engine, runnable, out / CELLS / cell.name, progress, extra)
        rows = write_sweep_csv(out, spec, cells, tuned)
        progress.end(counts_as_cell=True)
        progress.log(_cell_line(record, rows[cells.index(cell)]))


def _by_cell(plan: TuningPlan | None, chosen: Mapping[str, dict[str, Any] | None]) -> dict[str, dict[str, Any]]:
    """Each cell's tuned values, from its arm's choice (cells of arms without one are left out)."""
    if plan is None:
        return {}
    return {name: values for arm in plan.arms if (values := chosen.get(arm.name)) is not None for name in arm.cells}


def run_sweep(
    spec: SweepSpec,
    cells: list[Cell],
    out: Path,
    *,
    console: Console | None = None,
) -> SweepOutcome:
    """Run the tuning (with [tune]), the baselines and every unfinished cell; return sweep.csv's rows
    and the baselines."""
    check_machine(spec)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise InputError("out", str(out), f"cannot write the sweep there: {error.strerror or error}") from None
    plan = plan_tuning(spec, cells)
    check_resumable(out, cells, frozenset(spec.tune.space) if spec.tune else frozenset())
    if plan is not None:
        check_tuning_resumable(out, plan)
        check_tuned(out, cells, _by_cell(plan, read_choices(out / TUNING, plan)))
    write_json(out / SWEEP_JSON, {**spec.to_dict(), "cells": [c.name for c in cells]})
    finished = {cell.name for cell in cells if (cell_record(out, cell.name) or {}).get("status") == "completed"}
    tuned = _by_cell(plan, read_choices(out / TUNING, plan)) if plan is not None else {}
    write_sweep_csv(out, spec, cells, tuned)
    session = EngineSession(spec)
    with SweepProgress(len(cells), len(finished), console) as progress:
        try:
            if spec.seeded_noise:
                progress.log(
                    "seeded noise: every cell's DP noise is reproducible from its seed (for experiments, never "
                    "production)"
                )
            if (note := schedule_note(spec)) is not None:
                progress.log(note)
            if finished:
                progress.log(f"resuming {out}: {len(finished)} of {len(cells)} cells already finished")
            if plan is not None:
                tuned = _by_cell(plan, _run_tuning(plan, out / TUNING, session.runner, spec.engine, progress))
                check_tuned(out, cells, tuned)
            jobs = baseline_jobs(cells, spec.baseline_learning_rate, tuned) if spec.baseline else []
            untuned = {cell.name for cell in cells} - set(tuned) if plan is not None else set()
            jobs, refused = _tuned_jobs(spec, jobs, untuned, out, progress)
            _run_baselines(jobs, out / BASELINE, progress, refused)
            pending = [cell for cell in cells if cell.name not in finished]
            _run_cells(spec, cells, pending, out, session, progress, tuned)
        finally:
            session.close()
    baselines = [read_json(out / BASELINE / job.name / BASELINE_JSON) for job in jobs]
    return SweepOutcome(write_sweep_csv(out, spec, cells, tuned), baselines)
