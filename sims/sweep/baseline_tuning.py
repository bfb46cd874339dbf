"""The non-private baseline's own learning rate, chosen on validation rows like the cells' settings.

A step size tuned for clipped, noisy updates can be far too large (or too small) for plain SGD,
which would put the baseline below the private cells it is meant to bound. So when [tune] has
baseline-learning-rate (its own candidates) or learning-rate (then the cells' candidates), and the
sweep sets no fixed [sweep] baseline-learning-rate, each baseline arm (its baselines but the seed)
tries every candidate with every tune seed, through
`sims.baseline.nonprivate_baseline` on validation rows (`evaluate-on = "validation"`), and its
baselines then run the winner on the test rows with their own seed. The rest of a baseline's run
config, the other tuned values included, is its schedule_from cell's.

Each run's outcome is one JSON file in `<out>/tuning/baseline/<arm>/`, so a rerun skips the runs
already done, and choice.json is written as for the cells (sims.sweep.tuning).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedprivacy.errors import error_summary
from fedprivacy.sweepfiles import CHOICE_JSON, TUNING, TUNING_BASELINE, read_json, write_json
from sims.baseline import nonprivate_baseline
from sims.sweep.baselines import BaselineJob
from sims.sweep.grid import cell_name
from sims.sweep.tune_spec import TuneSpec
from sims.sweep.tuning import Candidate, arm_params, choice_record, frozen_choice, tuning_config

KEY = "learning-rate"


def tunes_baseline(tune: TuneSpec | None, baseline_learning_rate: float | None) -> bool:
    return (
        tune is not None and bool(tune.baseline_learning_rates or KEY in tune.space) and baseline_learning_rate is None
    )


def baseline_rates(tune: TuneSpec) -> tuple[float, ...]:
    """The baseline's η candidates: [tune] baseline-learning-rate, else the cells' learning-rate list."""
    return tune.baseline_learning_rates or tune.space[KEY]


def baseline_candidates(tune: TuneSpec) -> tuple[Candidate, ...]:
    return tuple(Candidate(cell_name({KEY: value}), {KEY: value}) for value in baseline_rates(tune))


def baseline_arms(jobs: list[BaselineJob]) -> dict[str, list[BaselineJob]]:
    """The baselines that differ only in their seed, by arm name, in order."""
    arms: dict[str, list[BaselineJob]] = {}
    for job in jobs:
        arms.setdefault(cell_name(arm_params(job.params)), []).append(job)
    return arms


def tuning_runs(jobs: list[BaselineJob], tune: TuneSpec) -> int:
    return len(baseline_arms(jobs)) * len(baseline_rates(tune)) * len(tune.seeds)


def _is_done(path: Path, config: dict[str, Any]) -> bool:
    if not path.is_file():
        return False
    record = read_json(path)
    return record["status"] == "completed" and record["run_config"] == config


def _run(config: dict[str, Any], num_clients: int, path: Path) -> dict[str, Any]:
    """One baseline tuning run, its outcome written to `path` (a failure too)."""
    started = time.perf_counter()
    record: dict[str, Any] = {"run_config": config}
    try:
        result = nonprivate_baseline(config, num_clients, name=path.stem)
        record.update(
            status="completed", error=None, final_accuracy=result.final_accuracy, best_accuracy=result.best[1]
        )
    except Exception as exc:  # a failed candidate cannot be chosen; the sweep goes on
        record.update(status="failed", error=error_summary(f"{type(exc).__name__}: {exc}"))
    record["wall_s"] = round(time.perf_counter() - started, 2)
    write_json(path, record)
    return record


def _outcome(path: Path, select: str) -> tuple[float | None, str | None]:
    record = read_json(path) if path.is_file() else {"status": "failed", "error": "did not run"}
    if record["status"] != "completed":
        return None, record["error"]
    return record["best_accuracy" if select == "best-round" else "final_accuracy"], None


def _tune_arm(
    arm: str, members: list[BaselineJob], tune: TuneSpec, out: Path, log: Callable[[str], None]
) -> dict[str, Any] | None:
    """One baseline arm's chosen values (None: every candidate failed), from its choice.json when
    made from the same inputs, else by running its unfinished runs and choosing."""
    found = baseline_candidates(tune)
    base = members[0].run_config
    folder = out / TUNING / TUNING_BASELINE / arm
    inputs = {
        "arm": arm,
        "baselines": [job.name for job in members],
        "select": tune.select,
        "tune_seeds": list(tune.seeds),
        "candidate_names": [candidate.name for candidate in found],
        "base_run_config": base,
    }
    values = frozen_choice(folder / CHOICE_JSON, inputs)
    if values is not None:
        return values
    folder.mkdir(parents=True, exist_ok=True)
    for candidate in found:
        for seed in tune.seeds:
            path = folder / f"{candidate.name}_seed={seed}.json"
            config = tuning_config(base, candidate.values, seed)
            if not _is_done(path, config):
                record = _run(config, members[0].cell.num_clients, path)
                log(f"baseline tuning {arm}: {path.stem}: {_line(record, tune.select)}")
    record = choice_record(
        inputs,
        found,
        tune.seeds,
        tune.select,
        lambda candidate, seed: _outcome(folder / f"{candidate.name}_seed={seed}.json", tune.select),
    )
    write_json(folder / CHOICE_JSON, record)
    values = record["chosen"]["values"] if record["chosen"] else None
    log(f"baseline tuning {arm}: chose {values or 'nothing (every candidate failed)'}")
    return values


def tune_baselines(
    jobs: list[BaselineJob], tune: TuneSpec, out: Path, log: Callable[[str], None]
) -> dict[str, float | None]:
    """Each baseline's learning rate chosen on validation rows (job name -> η; None: no candidate ran)."""
    chosen: dict[str, float | None] = {}
    for arm, members in baseline_arms(jobs).items():
        values = _tune_arm(arm, members, tune, out, log)
        chosen.update({job.name: None if values is None else values[KEY] for job in members})
    return chosen


def _line(record: dict[str, Any], select: str) -> str:
    if record["status"] != "completed":
        return f"[red]failed[/red]: {record['error']}"
    return f"validation accuracy {record['best_accuracy' if select == 'best-round' else 'final_accuracy']:.4f}"
