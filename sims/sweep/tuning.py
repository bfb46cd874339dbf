"""Tuning per cell: each cell's setting chosen among [tune]'s candidates on validation rows, before it runs.

A cell's arm is its grid values without `seed`: the cells of an arm differ only in their seed, so
they share one tuning. For every arm, candidate and tune seed there is one tuning run: the arm's
run config (that of its first cell) with the candidate's values, `seed` (and a set noise-seed) =
the tune seed, and `evaluate-on = "validation"`, so it trains on fit rows cut from the clients'
training rows and is scored on the rest; no test row is read. The sweep's `split-seed` is in
every run config, so these are the same training rows the arm's cells train on. The tuning costs
arms × candidates × tune seeds runs on the sweep's engine, and up to arms × candidates ×
tune-seeds-close more when candidates are close.

A candidate's score is the mean over the seeds it ran of the final validation accuracy (or of each
run's best round). When an arm's tune-seed runs are done, the candidate with the highest score is
the best so far; another candidate is close when the best's score minus its score is below
CLOSE_Z × the standard error of that difference, taken from the binomial error of one run's
validation accuracy, sqrt(p(1 − p)/m) with p the best's score and m the runs' validation rows
(summary.json's `evaluation_rows`), over the seeds each ran: sqrt(se²/n_best + se²/n_candidate).
If any is close, the best and every close candidate also run the tune-seeds-close seeds, and the
choice is made on each candidate's mean over all the seeds it ran (without a close candidate, or
with tune-seeds-close = [], on the tune seeds alone). A candidate with a failed run is never
close and cannot win; a run without `evaluation_rows` (federated evaluation) gives no s.e., so
nothing is close. Ties go to the first candidate in declared order.

A tuning run is written like a cell (`<out>/tuning/<arm>/<candidate>_seed=<s>/`, cell.json last),
the extra seeds' runs too, and resumes like one: a rerun skips the completed ones and redoes the
others; the closeness is decided again from the same tune-seed runs, so the same extra runs are
asked for and those done are not run again. choice.json records every candidate's scores, the
seeds it ran, its margin and s.e. and the extra seeds it got, and the choice; once it holds a
choice a rerun with the same inputs reads it rather than choosing again (a choice.json written
before tune-seeds-close existed is read the same way), so finished cells keep the setting they
ran with.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from fedprivacy.errors import InputError
from fedprivacy.recipe import partition_kwargs
from fedprivacy.runconfig import DEFAULTS, first_difference, parse_run_config
from fedprivacy.sweepfiles import (
    CELL_JSON,
    CHOICE_JSON,
    TUNING,
    TUNING_BASELINE,
    TUNING_PRIVACY_NOTE,
    cell_results,
    read_json,
    write_json,
)
from sims.sweep.grid import PLACEHOLDER_RESULTS_DIR, Cell, cell_name
from sims.sweep.private_tuning import TRIALS_JSON, other_draws, read_trials, tune_arm_private
from sims.sweep.spec import SweepSpec
from sims.sweep.tune_spec import TuneSpec
from sims.sweep.tuning_privacy import arm_costs

TRIALS_SEED = 0  # random search draws its candidates with this seed: the same scenario, the same draw
SCORES = {"final": "final_accuracy", "best-round": "best_accuracy"}
RULES = {
    "final": "the mean over tune seeds of the final validation accuracy",
    "best-round": "the mean over tune seeds of each run's best-round validation accuracy",
}
CLOSE_Z = 1.96  # a candidate within this many standard errors of the best gets the extra seeds
CLOSE_RULE = (
    "a candidate is close when the best's mean score minus its own is below 1.96 × the s.e. of that difference, "
    "sqrt(p(1 − p)/m) per run (p the best's mean, m the validation rows) over the seeds each ran; the best and the "
    "close candidates then also run the tune-seeds-close seeds and the choice is on the mean over all seeds each ran"
)


@dataclass(frozen=True)
class Candidate:
    """One setting of the search space: its values in [tune]'s order, and its name (as a cell's)."""

    name: str
    values: dict[str, Any]


def _candidate(space: dict[str, tuple[Any, ...]], index: int) -> Candidate:
    """The `index`-th combination of `space` in itertools.product's order (the last key fastest)."""
    picked: dict[str, Any] = {}
    for key in reversed(space):
        index, position = divmod(index, len(space[key]))
        picked[key] = space[key][position]
    values = {key: picked[key] for key in space}
    return Candidate(cell_name(values), values)


def candidates(tune: TuneSpec) -> list[Candidate]:
    """Every combination, or (tune-trials = n) n drawn without replacement by a fixed seed (random
    search, Bergstra & Bengio 2012), kept in declared order so that ties go the same way."""
    total = tune.combinations
    if tune.trials == 0:
        indices: Iterable[int] = range(total)
    else:
        indices = sorted(random.Random(TRIALS_SEED).sample(range(total), tune.trials))
    return [_candidate(tune.space, index) for index in indices]


def tuning_config(base: dict[str, Any], values: dict[str, Any], seed: int) -> dict[str, Any]:
    """A tuning run's config: `base` with the candidate's values, the tune seed, validation rows."""
    config = {**base, **values, "seed": seed, "evaluate-on": "validation"}
    if base.get("noise-seed", -1) >= 0:  # seeded noise: the tune seed's own, never a cell's
        config["noise-seed"] = seed
    return config


@dataclass(frozen=True)
class Arm:
    """The cells that differ only in their seed: one tuning for all of them."""

    name: str
    params: dict[str, Any]  # the cells' grid values but the seed
    base: dict[str, Any]  # the run config the tuning runs start from: the arm's first cell's
    num_clients: int
    cells: tuple[str, ...]

    def run(self, candidate: Candidate, seed: int) -> Cell:
        """The tuning run of `candidate` with `seed`, as a cell the engines can run."""
        return Cell(
            f"{candidate.name}_seed={seed}",
            {**candidate.values, "seed": seed},
            tuning_config(self.base, candidate.values, seed),
            self.num_clients,
        )


@dataclass(frozen=True)
class TuningPlan:
    """The tuning a sweep runs: its spec, candidates and arms."""

    tune: TuneSpec
    candidates: tuple[Candidate, ...]
    arms: tuple[Arm, ...]
    cell_seeds: frozenset[int] = frozenset()  # the seeds private trials skip

    @property
    def runs(self) -> int:
        """The tune-seed runs; with private tuning, the expected number of trials over the arms."""
        if self.tune.private is not None:
            return round(len(self.arms) * self.tune.private.trials_mean)
        return len(self.arms) * len(self.candidates) * len(self.tune.seeds)

    @property
    def close_runs(self) -> int:
        """The most extra runs close candidates can add: every candidate of every arm, every extra seed."""
        return len(self.arms) * len(self.candidates) * len(self.tune.close_seeds)

    @property
    def summary(self) -> str:
        if self.tune.private is not None:
            search = self.tune.private
            return (
                f"{len(self.arms)} arms × a random number of trials (mean {search.trials_mean:g}, shape "
                f"{search.trials_shape:g}), each one of {len(self.candidates)} candidates drawn at random: about "
                f"{self.runs} private tuning runs on validation rows"
            )
        more = (
            f", and up to {self.close_runs} more ({len(self.tune.close_seeds)} extra seeds) for candidates close "
            "to the best"
            if self.close_runs
            else ""
        )
        return (
            f"{len(self.arms)} arms × {len(self.candidates)} candidates × {len(self.tune.seeds)} tune seeds "
            f"= {self.runs} tuning runs on validation rows{more}"
        )


def arm_params(params: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in params.items() if key != "seed"}


def _check(config: dict[str, Any], candidate: Candidate, arm: str) -> None:
    """`config` must be a valid run config; an error names the [tune] key when the candidate set it."""
    try:
        parse_run_config({**config, "results-dir": PLACEHOLDER_RESULTS_DIR})
    except InputError as error:
        field = f"tune.{error.field}" if error.field in candidate.values else error.field
        raise InputError(field, error.value, f"{error.allowed} (candidate {candidate.name}, cells {arm})") from None


def plan_tuning(spec: SweepSpec, cells: list[Cell]) -> TuningPlan | None:
    """The scenario's tuning (None without [tune]), every run config validated before anything runs."""
    if spec.tune is None:
        return None
    grouped: dict[str, list[Cell]] = {}
    for cell in cells:
        grouped.setdefault(cell_name(arm_params(cell.params)), []).append(cell)
    arms = tuple(
        Arm(
            name,
            arm_params(members[0].params),
            members[0].run_config,
            members[0].num_clients,
            tuple(c.name for c in members),
        )
        for name, members in grouped.items()
    )
    found = tuple(candidates(spec.tune))
    for arm in arms:
        for candidate in found:
            _check(arm.run(candidate, spec.tune.seeds[0]).run_config, candidate, arm.name)
            _check({**arm.base, **candidate.values}, candidate, arm.name)  # what the arm's cells would run
    if spec.tune.private is not None:
        for arm in arms:
            _same_rows_and_deltas(arm, found)
    seeds = frozenset(int(cell.run_config.get("seed", DEFAULTS["seed"])) for cell in cells)
    return TuningPlan(spec.tune, found, arms, seeds)


def _same_rows_and_deltas(arm: Arm, found: tuple[Candidate, ...]) -> None:
    """Private tuning bounds each client's records over the candidates' plans: every candidate must
    cut the same rows for each client and give it the same δ (a tuned key that changes either is refused)."""

    def signature(config: dict[str, Any]) -> str:
        settings = parse_run_config({**config, "results-dir": PLACEHOLDER_RESULTS_DIR})
        deltas = [settings.client_delta(index, arm.num_clients) for index in range(arm.num_clients)]
        return json.dumps([partition_kwargs(settings, arm.num_clients), deltas], sort_keys=True, default=str)

    first = found[0]
    base = arm.run(first, 0).run_config
    expected = signature(base)
    for candidate in found[1:]:
        if signature(arm.run(candidate, 0).run_config) != expected:
            differing = [k for k in candidate.values if candidate.values[k] != first.values[k]]
            key = next((k for k in differing if signature({**base, k: candidate.values[k]}) != expected), differing[0])
            raise InputError(
                f"tune.{key}",
                candidate.values[key],
                "changes which rows a client holds or its δ, which private tuning cannot bound over candidates: "
                "fix it in [run] or vary it in [grid]",
            )


def _refuse_foreign(out: Path, where: str, what: str) -> NoReturn:
    raise InputError(
        "out",
        str(out),
        f"holds {where}, which this scenario's tuning does not have ({what}): resume with the same "
        "scenario or use another --out",
    )


def check_resumable(out: Path, plan: TuningPlan) -> None:
    """Refuse an --out whose tuning/ holds another scenario's arms or runs, or runs with other settings."""
    root = out / TUNING
    if not root.is_dir():
        return
    arms = {arm.name: arm for arm in plan.arms}
    for folder in sorted(path for path in root.iterdir() if path.is_dir() and path.name != TUNING_BASELINE):
        if folder.name not in arms:
            _refuse_foreign(out, f"{TUNING}/{folder.name}", "another grid")
        runs = _allowed_runs(folder, arms[folder.name], plan)
        for path in sorted(p for p in folder.iterdir() if p.is_dir()):
            if path.name not in runs:
                _refuse_foreign(out, f"{TUNING}/{folder.name}/{path.name}", "other candidates or tune seeds")
            record = read_json(path / CELL_JSON) if (path / CELL_JSON).is_file() else None
            expected = runs[path.name].run_config
            old = record["run_config"] if record is not None else expected
            key = first_difference(old, expected)
            if key is not None:
                raise InputError(
                    "out",
                    str(out),
                    f"its tuning run {TUNING}/{folder.name}/{path.name} ran with "
                    f"{key}={old.get(key, DEFAULTS.get(key))!r}, this "
                    f"scenario has {expected.get(key, DEFAULTS.get(key))!r}: "
                    "resume with the same scenario or use another --out",
                )


def _allowed_runs(folder: Path, arm: Arm, plan: TuningPlan) -> dict[str, Cell]:
    """The tuning runs an arm's folder may hold: every candidate with every tune (and close) seed, or
    with private tuning the trials its trials.json drew."""
    if plan.tune.private is not None:
        drawn = read_trials(folder)
        by_name = {candidate.name: candidate for candidate in plan.candidates}
        difference = None if drawn is None else other_draws(drawn, plan.tune.private, list(by_name))
        if difference is not None:
            _refuse_foreign(folder.parent.parent, f"{TUNING}/{folder.name}/{TRIALS_JSON}", difference)
        trials = [] if drawn is None else drawn["trials"]
        found = (arm.run(by_name[trial["candidate"]], trial["seed"]) for trial in trials)
    else:
        seeds = (*plan.tune.seeds, *plan.tune.close_seeds)
        found = (arm.run(candidate, seed) for candidate in plan.candidates for seed in seeds)
    return {run.name: run for run in found}


def best(scores: list[float | None]) -> int | None:
    """The index of the highest score (the first on a tie), None when no score is there."""
    found = [(score, -index) for index, score in enumerate(scores) if score is not None]
    return -max(found)[1] if found else None


Outcome = Callable[[Candidate, int], tuple[float | None, str | None]]


def _entry(candidate: Candidate, seeds: tuple[int, ...], outcome: Outcome) -> dict[str, Any]:
    runs = {seed: outcome(candidate, seed) for seed in seeds}
    scores = [score for score, _ in runs.values()]
    return {
        "name": candidate.name,
        "values": candidate.values,
        "seeds": list(seeds),
        "scores": {str(seed): score for seed, (score, _) in runs.items()},
        "errors": {str(seed): error for seed, (_, error) in runs.items() if error is not None},
        "score": statistics.fmean(scores) if None not in scores else None,
    }


def closeness(entries: list[dict[str, Any]], rows: Callable[[str, int], int | None]) -> list[dict[str, Any]]:
    """Per entry (on the seeds each ran): `margin`, the best's score minus its own; `se`, the s.e. of
    that difference, sqrt(p(1 − p)/m) per run combined as sqrt(se²/n_best + se²/n); `close`, whether
    margin < CLOSE_Z × se. The best itself, a failed candidate, or one without `rows(name, seed)`
    (a run's validation rows) is never close (its se, or margin, is None)."""
    winner = best([entry["score"] for entry in entries])
    if winner is None:
        return [{"margin": None, "se": None, "close": False} for _ in entries]
    top = entries[winner]
    p = top["score"]
    found = []
    for index, entry in enumerate(entries):
        if index == winner or entry["score"] is None:
            margin = 0.0 if index == winner else None
            found.append({"margin": margin, "se": None, "close": False})
            continue
        counted = [rows(e["name"], seed) for e in (top, entry) for seed in e["seeds"]]
        known = [m for m in counted if m is not None and m > 0]
        se = None
        if known and len(known) == len(counted):
            per_run = math.sqrt(p * (1 - p) / min(known))
            se = math.sqrt(per_run**2 / len(top["seeds"]) + per_run**2 / len(entry["seeds"]))
        margin = p - entry["score"]
        found.append({"margin": margin, "se": se, "close": se is not None and margin < CLOSE_Z * se})
    return found


def _stage(
    found: tuple[Candidate, ...],
    seeds: tuple[int, ...],
    close_seeds: tuple[int, ...],
    outcome: Outcome,
    rows: Callable[[str, int], int | None],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[bool]]:
    """The entries on `seeds`, their closeness, and which candidates get `close_seeds` (the best and
    the close ones, when any is close)."""
    entries = [_entry(candidate, seeds, outcome) for candidate in found]
    if not close_seeds:
        return entries, [{"margin": None, "se": None, "close": False} for _ in entries], [False] * len(entries)
    near = closeness(entries, rows)
    winner = best([entry["score"] for entry in entries])
    any_close = any(item["close"] for item in near)
    return entries, near, [any_close and (item["close"] or i == winner) for i, item in enumerate(near)]


def close_runs(
    found: tuple[Candidate, ...],
    seeds: tuple[int, ...],
    close_seeds: tuple[int, ...],
    outcome: Outcome,
    rows: Callable[[str, int], int | None],
) -> list[tuple[Candidate, int]]:
    """The extra runs the tune-seed runs ask for: each close seed of the best and of every close candidate."""
    _, _, extended = _stage(found, seeds, close_seeds, outcome, rows)
    return [(candidate, seed) for candidate, extra in zip(found, extended) if extra for seed in close_seeds]


def choice_record(
    inputs: dict[str, Any],
    found: tuple[Candidate, ...],
    seeds: tuple[int, ...],
    select: str,
    outcome: Outcome,
    close_seeds: tuple[int, ...] = (),
    rows: Callable[[str, int], int | None] = lambda name, seed: None,
) -> dict[str, Any]:
    """choice.json: each candidate's score per seed and mean, the choice and the rule that made it.
    `outcome(candidate, seed)` is a run's (score, error); a candidate with any missing score cannot win.
    With `close_seeds`, the best on `seeds` and the candidates close to it (`closeness`; `rows(name,
    seed)` is a run's validation rows) are scored over `seeds` + `close_seeds` (`close_runs` lists
    those runs, which must have run): each entry's `close` says its margin, s.e. and extra seeds."""
    entries, near, extended = _stage(found, seeds, close_seeds, outcome, rows)
    for candidate, entry, item, extra in zip(found, entries, near, extended):
        entry["tune_seeds_score"] = entry["score"]
        if extra:
            entry.update(_entry(candidate, (*seeds, *close_seeds), outcome))
        entry["close"] = {**item, "extra_seeds": list(close_seeds) if extra else []}
    winner = best([entry["score"] for entry in entries])
    chosen = None if winner is None else {key: entries[winner][key] for key in ("name", "values", "score")}
    return {
        **inputs,
        "rule": RULES[select] + (", and of the extra seeds for the close candidates" if any(extended) else ""),
        "close_rule": CLOSE_RULE if close_seeds else "off (tune-seeds-close = [])",
        "extra_seeds": any(extended),
        "candidates": entries,
        "chosen": chosen,
        "privacy": TUNING_PRIVACY_NOTE,
    }


def choice_inputs(arm: Arm, plan: TuningPlan) -> dict[str, Any]:
    """What a choice depends on: a choice.json with other inputs is made again."""
    inputs = {
        "arm": arm.name,
        "params": arm.params,
        "cells": list(arm.cells),
        "select": plan.tune.select,
        "candidate_names": [candidate.name for candidate in plan.candidates],
        "base_run_config": arm.base,
    }
    if plan.tune.private is not None:  # its trials draw their own seeds (trials.json)
        return {"private": plan.tune.private.to_dict(), **inputs}
    return {**inputs, "tune_seeds": list(plan.tune.seeds), "tune_seeds_close": list(plan.tune.close_seeds)}


LATER_INPUTS = ("tune_seeds_close",)


def frozen_choice(path: Path, inputs: dict[str, Any]) -> dict[str, Any] | None:
    """The chosen values of a choice.json made from these inputs (None: none there yet, or none chosen)."""
    if not path.is_file():
        return None
    record = read_json(path)
    # a choice.json written before a key was an input lacks it, and is read back as it was then
    same = all(record.get(key, value if key in LATER_INPUTS else None) == value for key, value in inputs.items())
    return record["chosen"]["values"] if same and record.get("chosen") else None


def read_choices(root: Path, plan: TuningPlan) -> dict[str, dict[str, Any]]:
    """The arms already tuned (arm name -> chosen values); `root` holds a folder per arm (the
    cells' `<out>/tuning`, the baselines' `<out>/tuning/baseline`)."""
    found = {arm.name: frozen_choice(root / arm.name / CHOICE_JSON, choice_inputs(arm, plan)) for arm in plan.arms}
    return {name: values for name, values in found.items() if values is not None}


def run_outcome(folder: Path, select: str) -> tuple[float | None, str | None]:
    record = read_json(folder / CELL_JSON) if (folder / CELL_JSON).is_file() else None
    if record is None:
        return None, "did not run"
    if record["status"] != "completed":
        return None, record["error"]
    score = cell_results(folder / record["run_folder"])[SCORES[select]]
    return (score, None) if score is not None else (None, "no validation accuracy recorded")


def run_rows(folder: Path) -> int | None:
    """A completed tuning run's validation rows (summary.json's `evaluation_rows`; None: not recorded)."""
    if not is_done(folder):
        return None
    summary = folder / read_json(folder / CELL_JSON)["run_folder"] / "summary.json"
    rows = read_json(summary).get("evaluation_rows") if summary.is_file() else None
    return int(rows) if rows is not None else None


def is_done(folder: Path) -> bool:
    return (folder / CELL_JSON).is_file() and read_json(folder / CELL_JSON)["status"] == "completed"


def runs_done(root: Path, plan: TuningPlan, chosen: Iterable[str]) -> int:
    """Tune-seed runs that need no running: every one of the arms in `chosen`, the completed ones of the
    rest (the extra seeds of close candidates are not counted: whether they run is known only later)."""
    settled = set(chosen)
    if plan.tune.private is not None:
        by_name = {candidate.name: candidate for candidate in plan.candidates}
        return sum(
            (root / arm.name / arm.run(by_name[trial["candidate"]], trial["seed"]).name / CELL_JSON).is_file()
            for arm in plan.arms
            if arm.name not in settled
            for trial in (read_trials(root / arm.name) or {"trials": []})["trials"]
        )
    return sum(
        arm.name in settled or is_done(root / arm.name / arm.run(candidate, seed).name)
        for arm in plan.arms
        for candidate in plan.candidates
        for seed in plan.tune.seeds
    )


def tune_arm(
    arm: Arm,
    plan: TuningPlan,
    root: Path,
    run: Callable[[Cell, Path], dict[str, Any]],
) -> dict[str, Any]:
    """Run the arm's unfinished tuning runs in `root/<arm>` (`run(cell, folder)` writes a cell
    folder), then the extra seeds' runs of close candidates not yet done, and write its
    choice.json; returns the record (its `chosen` is None when every candidate failed)."""
    folder = root / arm.name

    def ensure(candidate: Candidate, seed: int) -> None:
        cell = arm.run(candidate, seed)
        if not is_done(folder / cell.name):
            run(cell, folder / cell.name)

    def outcome(candidate: Candidate, seed: int) -> tuple[float | None, str | None]:
        return run_outcome(folder / arm.run(candidate, seed).name, plan.tune.select)

    by_name = {candidate.name: candidate for candidate in plan.candidates}

    def rows(name: str, seed: int) -> int | None:
        return run_rows(folder / arm.run(by_name[name], seed).name)

    if plan.tune.private is not None:
        return _tune_privately(arm, plan, folder, run, rows)

    for candidate in plan.candidates:
        for seed in plan.tune.seeds:
            ensure(candidate, seed)
    for candidate, seed in close_runs(plan.candidates, plan.tune.seeds, plan.tune.close_seeds, outcome, rows):
        ensure(candidate, seed)
    record = choice_record(
        choice_inputs(arm, plan),
        plan.candidates,
        plan.tune.seeds,
        plan.tune.select,
        outcome,
        plan.tune.close_seeds,
        rows,
    )
    write_json(folder / CHOICE_JSON, record)
    return record


def private_cost(arm: Arm, plan: TuningPlan, ran: Sequence[int] = ()) -> dict[str, Any]:
    """Each client's cost of the arm's private tuning (`arm_costs`): known before any trial runs,
    and with the trials that ran (`ran`, candidate indices), what they all reveal."""
    assert plan.tune.private is not None
    return arm_costs(
        [arm.run(candidate, plan.tune.seeds[0]).run_config for candidate in plan.candidates],
        [{**arm.base, **candidate.values} for candidate in plan.candidates],
        arm.num_clients,
        plan.tune.private,
        ran,
    )


def _tune_privately(
    arm: Arm,
    plan: TuningPlan,
    folder: Path,
    run: Callable[[Cell, Path], dict[str, Any]],
    rows: Callable[[str, int], int | None],
) -> dict[str, Any]:
    """`tune_arm` for private random search (sims.sweep.private_tuning): a trial with a cell.json,
    failed or not, is never run again."""
    search = plan.tune.private
    assert search is not None
    by_name = {candidate.name: candidate for candidate in plan.candidates}

    def ensure(name: str, seed: int) -> None:
        cell = arm.run(by_name[name], seed)
        if not (folder / cell.name / CELL_JSON).is_file():
            run(cell, folder / cell.name)

    def outcome(name: str, seed: int) -> tuple[float | None, int | None, str | None]:
        score, error = run_outcome(folder / arm.run(by_name[name], seed).name, "final")
        return score, rows(name, seed) if error is None else None, error

    return tune_arm_private(
        folder,
        choice_inputs(arm, plan),
        [(candidate.name, candidate.values) for candidate in plan.candidates],
        search,
        ensure,
        outcome,
        lambda ran: private_cost(arm, plan, ran),
        set(plan.cell_seeds),
    )
