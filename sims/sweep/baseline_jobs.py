"""The non-private baseline of a sweep: `sims.baseline.nonprivate_baseline` once per distinct
non-privacy setting, stored under `<out>/baseline/<name>/` (baseline.json, rounds.csv).

Cells that differ only in keys the baseline does not read (fedprivacy.sweepfiles.BASELINE_IGNORED_KEYS:
ε, δ, rule, clip norm, noise seed, aggregation, the server optimiser) share one baseline. The
baseline takes its local schedule (each client's q and T, and their split over rounds) from a
private plan, which depends on ε; it takes it from the
first cell of its group in grid order, and baseline.json names that cell (`schedule_from`).
Like the cells, a baseline is written to a hidden folder and renamed into place when done, and a
rerun skips the baselines already there with the same run config.

With [tune], a baseline takes its schedule_from cell's tuned values, and, when [tune] has
learning-rate or baseline-learning-rate and [sweep] sets no baseline-learning-rate, its own η chosen
on validation rows: baseline.json's `tuned` holds them. A step size tuned for clipped, noisy updates
can be far too large (or too small) for plain SGD, which would put the baseline below the private
cells it bounds. That tuning is the cells' (sims.sweep.tuning), on `baseline_tuning`'s plan: one
arm per group of baselines that differ only in their seed, the candidates [tune]
baseline-learning-rate (else the cells' learning-rate list), its runs cells run with clipping and
noise off (`FastCellRunner(private=False)`) under `<out>/tuning/baseline/<arm>/`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd

from fedprivacy.errors import error_summary
from fedprivacy.sweepfiles import BASELINE_IGNORED_KEYS, BASELINE_JSON, STAGING_PREFIX, read_json, write_json
from sims.baseline import nonprivate_baseline
from sims.sweep.grid import Cell, cell_name
from sims.sweep.tune_spec import TuneSpec
from sims.sweep.tuning import Arm, Candidate, TuningPlan, arm_params

KEY = "learning-rate"  # what a baseline's tuning chooses


@dataclass(frozen=True)
class BaselineJob:
    """One baseline: its grid values outside the keys it ignores, and the cell whose run config it takes."""

    name: str
    params: dict[str, Any]
    cell: Cell
    run_config: dict[str, Any]  # the cell's, with the sweep's baseline-learning-rate if it sets one
    tuned: dict[str, Any] = field(default_factory=dict)  # values chosen on validation rows (with [tune])


def baseline_jobs(
    cells: list[Cell], learning_rate: float | None = None, tuned: Mapping[str, dict[str, Any]] | None = None
) -> list[BaselineJob]:
    """One job per distinct non-privacy setting, in the order its first cell appears; with
    `learning_rate`, every baseline takes that η instead of its cells' (one chosen for clipped, noisy
    steps can be far too large without them). `tuned` (cell name -> its tuned values) gives each
    baseline its schedule_from cell's; the grouping is by the cells' untuned settings."""
    jobs: dict[str, BaselineJob] = {}
    for cell in cells:
        setting = {key: value for key, value in cell.run_config.items() if key not in BASELINE_IGNORED_KEYS}
        key = json.dumps({**setting, "clients": cell.num_clients}, sort_keys=True)
        if key not in jobs:
            params = {k: v for k, v in cell.params.items() if k not in BASELINE_IGNORED_KEYS}
            chosen = dict((tuned or {}).get(cell.name, {}))
            run_config = {**cell.run_config, **chosen}
            if learning_rate is not None:
                run_config["learning-rate"] = learning_rate
                chosen.pop("learning-rate", None)
            jobs[key] = BaselineJob(cell_name(params), params, cell, run_config, chosen)
    return list(jobs.values())


def is_finished(job: BaselineJob, baseline_dir: Path) -> bool:
    path = baseline_dir / job.name / BASELINE_JSON
    if not path.is_file():
        return False
    record = read_json(path)
    return record.get("status") == "completed" and record.get("run_config") == job.run_config


def run_baseline(job: BaselineJob, baseline_dir: Path, refused: str | None = None) -> dict[str, Any]:
    """Run one baseline and rename its folder into place; a failure is recorded, not raised.
    With `refused` (why it cannot run, e.g. its tuning chose nothing), that is its recorded error."""
    staging = baseline_dir / f"{STAGING_PREFIX}{job.name}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    started = time.perf_counter()
    record: dict[str, Any] = {
        "name": job.name,
        "params": job.params,
        "schedule_from": job.cell.name,
        "run_config": job.run_config,
        "tuned": job.tuned,
    }
    failed = {"status": "failed", "final_accuracy": None, "best_accuracy": None}
    try:
        if refused is not None:
            record.update(failed, error=refused)
        else:
            result = nonprivate_baseline(job.run_config, job.cell.num_clients, name=job.name)
            pd.DataFrame(result.rounds).to_csv(staging / "rounds.csv", index=False)
            record.update(
                status="completed", error=None, final_accuracy=result.final_accuracy, best_accuracy=result.best[1]
            )
    except Exception as exc:  # a failed baseline is reported beside the cells, not a crashed sweep
        record.update(failed, error=error_summary(f"{type(exc).__name__}: {exc}"))
    record["wall_s"] = round(time.perf_counter() - started, 2)
    write_json(staging / BASELINE_JSON, record)
    target = baseline_dir / job.name
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    return record


def tunes_baseline(tune: TuneSpec | None, baseline_learning_rate: float | None) -> bool:
    """Whether the baselines choose their own η: [tune] has candidates for it and [sweep] fixes none."""
    return (
        tune is not None and bool(tune.baseline_learning_rates or KEY in tune.space) and baseline_learning_rate is None
    )


def baseline_tuning(jobs: list[BaselineJob], tune: TuneSpec) -> TuningPlan:
    """The baselines' tuning: an arm per group of baselines that differ only in their seed (its
    run config the group's first), η among [tune] baseline-learning-rate or the cells' list."""
    rates = tune.baseline_learning_rates or tune.space[KEY]
    arms: dict[str, list[BaselineJob]] = {}
    for job in jobs:
        arms.setdefault(cell_name(arm_params(job.params)), []).append(job)
    return TuningPlan(
        replace(tune, private=None),  # the baseline is not private: its η is tuned as without tune-private
        tuple(Candidate(cell_name({KEY: rate}), {KEY: rate}) for rate in rates),
        tuple(
            Arm(
                name,
                arm_params(members[0].params),
                members[0].run_config,
                members[0].cell.num_clients,
                tuple(job.name for job in members),
            )
            for name, members in arms.items()
        ),
    )
