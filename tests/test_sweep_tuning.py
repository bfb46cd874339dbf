"""Tuning per cell ([tune]): the scenario's checks, validation rows only for the tuning runs and test
rows only for the cells, the choice as the argmax of the mean validation score, resuming, random
search, and the non-private baseline's own learning rate. Fast engine, digits, 2 clients, 1 round."""

from __future__ import annotations

import json
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from harness import CountingRunner

from fedprivacy import cli
from fedprivacy.errors import InputError
from fedprivacy.reports.sweep_report import write_report
from fedprivacy.sweepfiles import TUNING_PRIVACY_NOTE, cell_results
from sims.sweep.baseline_jobs import baseline_jobs, baseline_tuning, tunes_baseline
from sims.sweep.driver import run_sweep
from sims.sweep.grid import cells
from sims.sweep.spec import validate
from sims.sweep.tuning import candidates, plan_tuning

TINY_LR = 1e-6  # cannot move the model in one round: it must lose to a sensible step
GOOD_LR = 1.0
ARM = "epsilon=1"
BASELINE = "baseline-learning-rate"


def scenario(**sweep: Any) -> dict[str, Any]:
    """One arm (ε = 1) over two cell seeds; η tuned between a useless and a sensible step."""
    return {
        "sweep": {"clients": 2, "engine": "fast", "seeded-noise": True, **sweep},
        "run": {"dataset": "digits", "num-server-rounds": 1, "epochs": 1.0},
        "grid": {"epsilon": [1.0], "seed": [0, 1]},
        "tune": {"learning-rate": [TINY_LR, GOOD_LR]},
    }


def spec_of(raw: dict[str, Any], tmp_path: Path):
    return validate(raw, base_dir=tmp_path, default_name="tuned")


def with_tables(**tables: Any) -> dict[str, Any]:
    raw = scenario()
    for name, table in tables.items():
        if table is None:
            raw.pop(name, None)
        else:
            raw[name] = table
    return raw


BAD = {
    "a tuned key also in [grid]": (
        with_tables(grid={"epsilon": [1.0], "learning-rate": [0.5]}),
        "tune.learning-rate",
        "also in grid.learning-rate",
    ),
    "a tuned key also in [run]": (
        with_tables(run={"dataset": "digits", "learning-rate": 0.5}),
        "tune.learning-rate",
        "also in run.learning-rate",
    ),
    "a tuned key also in [linked]": (
        with_tables(grid={"seed": [0]}, linked={"budget": {"epsilon": [1.0, 2.0], "learning-rate": [0.5, 1.0]}}),
        "tune.learning-rate",
        "also in linked.budget.learning-rate",
    ),
    "a tune seed that is a cell's seed": (
        {**scenario(), "grid": {"epsilon": [1.0], "seed": [0, 1001]}},
        "sweep.tune-seeds",
        "1001 is also a cell's seed (grid.seed",
    ),
    "a tune seed that is the default cell seed": (
        {**scenario(**{"tune-seeds": [0, 5]}), "grid": {"epsilon": [1.0]}},
        "sweep.tune-seeds",
        "0 is also a cell's seed (the default seed",
    ),
    "an empty candidate list": (with_tables(tune={"learning-rate": []}), "tune.learning-rate", "non-empty list"),
    "an unknown key in [tune]": (with_tables(tune={"learning-rat": [1.0]}), "tune.learning-rat", "not a run-config"),
    "an empty [tune]": (with_tables(tune={}), "tune", "must be a table"),
    "a candidate of the wrong type": (
        with_tables(tune={"clip-norm": [4, "eight"]}),
        "tune.clip-norm",
        "must be a number",
    ),
    "a candidate listed twice": (with_tables(tune={"clip-norm": [4, 4.0]}), "tune.clip-norm", "lists 4.0 twice"),
    "a key the tuning sets itself": (with_tables(tune={"seed": [3, 4]}), "tune.seed", "decides which rows"),
    "more trials than combinations": (scenario(**{"tune-trials": 3}), "sweep.tune-trials", "in [0, 2]"),
    "an unknown selection rule": (scenario(**{"tune-select": "best"}), "sweep.tune-select", "final, best-round"),
    "tune options without [tune]": (
        {**with_tables(tune=None), "sweep": {"tune-seeds": [7]}},
        "sweep.tune-seeds",
        "needs a [tune] table",
    ),
    "a run split-seed of -1 beside [tune]": (
        with_tables(run={"dataset": "digits", "split-seed": -1}),
        "run.split-seed",
        "-1 cuts each run's data by its own seed",
    ),
    "split-seed in [sweep] and [run]": (
        {**with_tables(run={"dataset": "digits", "split-seed": 3}), "sweep": {"split-seed": 4}},
        "sweep.split-seed",
        "also in run.split-seed",
    ),
    "baseline candidates beside a fixed baseline η": (
        {**scenario(**{"baseline-learning-rate": 0.5}), "tune": {"learning-rate": [1.0], BASELINE: [0.1, 1.0]}},
        f"tune.{BASELINE}",
        "sweep.baseline-learning-rate = 0.5 also sets the baseline's η",
    ),
    "baseline candidates without a baseline": (
        {**scenario(baseline=False), "tune": {"learning-rate": [1.0], BASELINE: [0.1, 1.0]}},
        f"tune.{BASELINE}",
        "sweep.baseline = false runs none",
    ),
    "an empty baseline candidate list": (
        with_tables(tune={"learning-rate": [1.0], BASELINE: []}),
        f"tune.{BASELINE}",
        "non-empty list of learning rates > 0",
    ),
    "a baseline candidate that is not a number": (
        with_tables(tune={"learning-rate": [1.0], BASELINE: [0.1, "1"]}),
        f"tune.{BASELINE}",
        "'1' is not a number",
    ),
    "a baseline candidate of zero": (
        with_tables(tune={"learning-rate": [1.0], BASELINE: [0.1, 0]}),
        f"tune.{BASELINE}",
        "0: every candidate must be a finite number > 0",
    ),
    "a baseline candidate listed twice": (
        with_tables(tune={"learning-rate": [1.0], BASELINE: [0.1, 0.1]}),
        f"tune.{BASELINE}",
        "lists 0.1 twice",
    ),
    "baseline candidates alone in [tune]": (
        with_tables(tune={BASELINE: [0.1, 1.0]}),
        "tune",
        "tunes only the baseline",
    ),
    "tune-seeds-close not a list": (
        scenario(**{"tune-seeds-close": 1002}),
        "sweep.tune-seeds-close",
        "must be a list of integers >= 0, e.g. [1002, 1003, 1004]",
    ),
    "a negative close seed": (
        scenario(**{"tune-seeds-close": [1002, -1]}),
        "sweep.tune-seeds-close",
        "must be a list of integers >= 0",
    ),
    "a close seed listed twice": (
        scenario(**{"tune-seeds-close": [1002, 1002]}),
        "sweep.tune-seeds-close",
        "lists a seed twice",
    ),
    "a close seed that is a cell's seed": (
        scenario(**{"tune-seeds-close": [1002, 1]}),
        "sweep.tune-seeds-close",
        "1 is also a cell's seed (grid.seed",
    ),
    "a close seed that is a tune seed": (
        scenario(**{"tune-seeds-close": [1001, 1002]}),
        "sweep.tune-seeds-close",
        "1001 is also in sweep.tune-seeds = [1000, 1001]",
    ),
    "tune-seeds-close without [tune]": (
        {**with_tables(tune=None), "sweep": {"tune-seeds-close": [7]}},
        "sweep.tune-seeds-close",
        "needs a [tune] table",
    ),
    "evaluate-on beside [tune]": (
        with_tables(run={"dataset": "digits", "evaluate-on": "validation"}),
        "run.evaluate-on",
        "is set by the tuning",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_the_scenario_refuses_a_bad_tuning_naming_the_field(case, tmp_path):
    raw, field, allowed = BAD[case]
    with pytest.raises(InputError) as refused:
        spec_of(raw, tmp_path)
    assert refused.value.field == field and allowed in str(refused.value), str(refused.value)


def test_tune_seeds_close_takes_a_list_or_none_and_defaults_to_the_seeds_after_the_tune_seeds(tmp_path):
    assert spec_of(scenario(), tmp_path).tune.close_seeds == (1002, 1003, 1004)
    assert spec_of(scenario(**{"tune-seeds-close": []}), tmp_path).tune.close_seeds == ()
    assert spec_of(scenario(**{"tune-seeds-close": [7, 9]}), tmp_path).tune.close_seeds == (7, 9)
    # not given: the seeds after the largest tune seed that no cell uses
    raw = {**scenario(**{"tune-seeds": [5, 6]}), "grid": {"epsilon": [1.0], "seed": [0, 8]}}
    assert spec_of(raw, tmp_path).tune.close_seeds == (7, 9, 10)


def test_a_candidate_that_makes_a_bad_run_config_is_refused_before_anything_runs(tmp_path):
    raw = with_tables(tune={"lr-schedule": ["constant", "cosine"]})
    spec = spec_of(raw, tmp_path)
    with pytest.raises(InputError) as refused:
        plan_tuning(spec, cells(spec))
    assert refused.value.field == "tune.lr-schedule" and "candidate lr-schedule=cosine" in str(refused.value)


def test_every_cell_and_tuning_run_shares_the_sweeps_split_seed(tmp_path):
    spec = spec_of(scenario(), tmp_path)
    plan = plan_tuning(spec, cells(spec))
    assert spec.run["split-seed"] == 0 and all(cell.run_config["split-seed"] == 0 for cell in cells(spec))
    (arm,) = plan.arms
    assert arm.name == ARM and arm.cells == ("epsilon=1_seed=0", "epsilon=1_seed=1")
    runs = [arm.run(c, s) for c in plan.candidates for s in plan.tune.seeds]
    assert {run.run_config["split-seed"] for run in runs} == {0}
    assert {run.run_config["evaluate-on"] for run in runs} == {"validation"}
    assert [run.run_config["seed"] for run in runs] == [1000, 1001, 1000, 1001]
    assert all(run.run_config["noise-seed"] == run.run_config["seed"] for run in runs)  # seeded-noise
    assert plan.runs == 4


def test_a_grid_of_split_seeds_tunes_each_split_from_its_own_first_cell(tmp_path):
    """split-seed in [grid]: each split is an arm of its own, whose tuning runs start from its first
    cell's run config and so cut their training and validation rows with that split's seed."""
    raw = with_tables(grid={"epsilon": [1.0], "split-seed": [3, 7], "seed": [0, 1]})
    spec = spec_of(raw, tmp_path)
    plan = plan_tuning(spec, cells(spec))
    assert [arm.name for arm in plan.arms] == ["epsilon=1_split-seed=3", "epsilon=1_split-seed=7"]
    for arm, split in zip(plan.arms, (3, 7)):
        assert arm.params["split-seed"] == split and arm.base["split-seed"] == split
        assert arm.cells == (f"epsilon=1_split-seed={split}_seed=0", f"epsilon=1_split-seed={split}_seed=1")
        runs = [arm.run(c, s) for c in plan.candidates for s in plan.tune.seeds]
        assert {run.run_config["split-seed"] for run in runs} == {split}
        assert {run.run_config["seed"] for run in runs} == set(plan.tune.seeds)  # never a cell's seed
    assert plan.runs == 2 * 2 * 2


def test_random_search_draws_the_same_combinations_for_the_same_scenario(tmp_path):
    space = {"learning-rate": [0.1, 0.3, 1, 3], "clip-norm": [0.1, 1, 10], "lr-schedule": ["constant", "inverse_sqrt"]}
    raw = {**scenario(**{"tune-trials": 5}), "tune": space}
    first = candidates(spec_of(raw, tmp_path).tune)
    again = candidates(spec_of(json.loads(json.dumps(raw)), tmp_path).tune)
    every = candidates(spec_of({**raw, "sweep": {**raw["sweep"], "tune-trials": 0}}, tmp_path).tune)
    assert first == again and len(first) == 5 and len({c.name for c in first}) == 5
    assert len(every) == 24 and [c for c in every if c in first] == first  # a subset, in declared order
    assert every[0].values == {"learning-rate": 0.1, "clip-norm": 0.1, "lr-schedule": "constant"}
    assert every[1].values == {"learning-rate": 0.1, "clip-norm": 0.1, "lr-schedule": "inverse_sqrt"}


class Spy:
    """Every central evaluation set a run builds: its run's seed, evaluate-on and feature rows."""

    def __init__(self) -> None:
        from sims.fast import engine

        self.real = engine.server_test_set
        self.seen: list[tuple[int, str, set[bytes]]] = []

    def __call__(self, settings, num_clients):
        dataset = self.real(settings, num_clients)
        rows = {np.ascontiguousarray(row).tobytes() for row in np.asarray(dataset.features)}
        self.seen.append((settings.seed, settings.evaluate_on, rows))
        return dataset


@pytest.fixture(scope="module")
def tuned_sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Spy]:
    """scenario() run once with its baseline, every evaluation set recorded."""
    out = tmp_path_factory.mktemp("tuned") / "sweep"
    spy = Spy()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sims.fast.engine.server_test_set", spy)
        patch.setattr("sims.sweep.driver.create_runner", lambda name, resources: CountingRunner(resources))
        CountingRunner.ran = []
        spec = spec_of(scenario(), out.parent)
        outcome = run_sweep(spec, cells(spec), out)
    assert outcome.failures == []
    return out, spy


def test_tuning_runs_evaluate_only_on_validation_rows_and_cells_only_on_test_rows(tuned_sweep):
    out, spy = tuned_sweep
    tuning = [(seed, on, rows) for seed, on, rows in spy.seen if seed in (1000, 1001)]
    final = [(seed, on, rows) for seed, on, rows in spy.seen if seed in (0, 1)]
    assert len(tuning) == 4 + 4 and len(final) == 2 + 2  # cells' and baseline's tuning runs; cells and baselines
    assert {on for _, on, _ in tuning} == {"validation"} and {on for _, on, _ in final} == {"test"}
    test_rows, validation_rows = final[0][2], tuning[0][2]
    assert all(rows == test_rows for _, _, rows in final)  # split-seed: every cell has the same test rows
    assert all(rows == validation_rows for _, _, rows in tuning)
    assert not validation_rows & test_rows  # the tuning never saw a test row
    for folder in (out / "tuning" / ARM).iterdir():
        if folder.is_dir():
            (config,) = folder.glob("*/config.json")
            assert json.loads(config.read_text())["run_config"]["evaluate-on"] == "validation"
    for folder in (out / "cells").iterdir():
        (config,) = folder.glob("*/config.json")
        assert json.loads(config.read_text())["run_config"]["evaluate-on"] == "test"


def _scores(out: Path) -> dict[str, list[float]]:
    """Each candidate's final validation accuracy per tune seed, read from its runs' own folders."""
    scores: dict[str, list[float]] = {}
    for folder in sorted((out / "tuning" / ARM).iterdir()):
        if folder.is_dir():
            record = json.loads((folder / "cell.json").read_text())
            candidate = folder.name.rsplit("_seed=", 1)[0]
            scores.setdefault(candidate, []).append(cell_results(folder / record["run_folder"])["final_accuracy"])
    return scores


def test_the_choice_is_the_argmax_of_the_mean_validation_score_and_the_cells_run_it(tuned_sweep):
    out, _ = tuned_sweep
    means = {name: statistics.fmean(values) for name, values in _scores(out).items()}
    assert set(means) == {"learning-rate=1e-06", "learning-rate=1"}
    assert means["learning-rate=1"] > means["learning-rate=1e-06"]  # the tiny step cannot win
    choice = json.loads((out / "tuning" / ARM / "choice.json").read_text())
    assert choice["chosen"]["name"] == max(means, key=means.get)
    assert choice["chosen"]["values"] == {"learning-rate": GOOD_LR}
    assert choice["chosen"]["score"] == pytest.approx(means["learning-rate=1"], abs=1e-12)
    assert [c["score"] for c in choice["candidates"]] == pytest.approx([means[c["name"]] for c in choice["candidates"]])
    assert choice["privacy"] == TUNING_PRIVACY_NOTE and "NOT in the reported ε" in TUNING_PRIVACY_NOTE
    table = pd.read_csv(out / "sweep.csv")
    assert list(table["tuned.learning-rate"]) == [GOOD_LR, GOOD_LR] and set(table["status"]) == {"completed"}
    for name in ("epsilon=1_seed=0", "epsilon=1_seed=1"):
        record = json.loads((out / "cells" / name / "cell.json").read_text())
        assert record["tuned"] == {"learning-rate": GOOD_LR} and record["run_config"]["learning-rate"] == GOOD_LR
        assert record["run_config"]["seed"] in (0, 1)  # its own seed, never a tune seed


def test_the_baseline_tunes_its_own_learning_rate(tuned_sweep, tmp_path):
    out, _ = tuned_sweep
    choice = json.loads((out / "tuning" / "baseline" / "default" / "choice.json").read_text())
    assert [c["name"] for c in choice["candidates"]] == ["learning-rate=1e-06", "learning-rate=1"]
    best = max(choice["candidates"], key=lambda c: c["score"])
    assert choice["chosen"]["name"] == best["name"] == "learning-rate=1"
    for seed in (0, 1):
        baseline = json.loads((out / "baseline" / f"seed={seed}" / "baseline.json").read_text())
        assert baseline["tuned"] == {"learning-rate": GOOD_LR} and baseline["run_config"]["learning-rate"] == GOOD_LR
        assert baseline["run_config"]["evaluate-on"] == "test" and baseline["status"] == "completed"
    # a sweep that sets baseline-learning-rate keeps it, and tunes no baseline
    spec = spec_of(scenario(**{"baseline-learning-rate": 0.05}), tmp_path)
    grid = cells(spec)
    jobs = baseline_jobs(grid, spec.baseline_learning_rate, {cell.name: {"learning-rate": GOOD_LR} for cell in grid})
    assert not tunes_baseline(spec.tune, spec.baseline_learning_rate)
    assert [(job.run_config["learning-rate"], job.tuned) for job in jobs] == [(0.05, {}), (0.05, {})]


def test_the_baseline_tunes_over_its_own_candidates_when_tune_lists_them(tmp_path):
    # the cells' only η candidate is GOOD_LR; the baseline's own list holds neither it nor anything the
    # cells' list holds, so it can only have run these candidates if it read baseline-learning-rate
    own = [TINY_LR, 0.5]
    raw = {**scenario(), "grid": {"epsilon": [1.0], "seed": [0]}, "tune": {"learning-rate": [GOOD_LR], BASELINE: own}}
    spec = spec_of(raw, tmp_path)
    assert spec.tune.space == {"learning-rate": (GOOD_LR,)} and spec.tune.baseline_learning_rates == (TINY_LR, 0.5)
    assert spec.to_dict()["tune"]["baseline_learning_rate"] == own
    out = tmp_path / "out"
    assert run_sweep(spec, cells(spec), out).failures == []
    choice = json.loads((out / "tuning" / "baseline" / "default" / "choice.json").read_text())
    assert [c["name"] for c in choice["candidates"]] == ["learning-rate=1e-06", "learning-rate=0.5"]
    assert choice["chosen"]["values"] == {"learning-rate": 0.5}  # the tiny step cannot win
    baseline = json.loads((out / "baseline" / "seed=0" / "baseline.json").read_text())
    assert baseline["run_config"]["learning-rate"] == 0.5 and baseline["tuned"] == {"learning-rate": 0.5}
    cell = json.loads((out / "cells" / "epsilon=1_seed=0" / "cell.json").read_text())
    assert cell["run_config"]["learning-rate"] == GOOD_LR  # the cells keep their own
    section = write_report(out, tmp_path / "report")[-1].read_text()
    baseline_part = section[section.index("### The non-private baseline's learning rate") :]
    assert "among its own candidates ([tune] baseline-learning-rate): learning-rate ∈ {1e-06, 0.5}" in baseline_part
    assert "- default: learning-rate = 0.5, the largest candidate" in baseline_part
    assert _table_rows(baseline_part, "### The non-private baseline's learning rate")[0][:2] == ["default", "0.5"]


def test_baseline_candidates_tune_the_baseline_even_when_the_cells_tune_no_learning_rate(tmp_path):
    spec = spec_of(with_tables(tune={"clip-norm": [0.5, 1.0], BASELINE: [0.3, 3]}), tmp_path)
    assert tunes_baseline(spec.tune, spec.baseline_learning_rate)
    plan = baseline_tuning(baseline_jobs(cells(spec)), spec.tune)
    assert [c.values for c in plan.candidates] == [{"learning-rate": 0.3}, {"learning-rate": 3.0}]
    assert plan.runs == 4  # 1 baseline arm (seeds 0 and 1) × 2 candidates × 2 tune seeds
    without = spec_of(with_tables(tune={"clip-norm": [0.5, 1.0]}), tmp_path)
    assert not tunes_baseline(without.tune, without.baseline_learning_rate)  # nothing to tune it over: as before


def test_a_rerun_resumes_without_rerunning_finished_tuning_runs(tuned_sweep, tmp_path):
    out, _ = tuned_sweep
    assert sorted(CountingRunner.ran) == sorted(
        [f"{ARM}/learning-rate={lr}_seed={s}" for lr in ("1e-06", "1") for s in (1000, 1001)]
        + ["cells/epsilon=1_seed=0", "cells/epsilon=1_seed=1"]
    )
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    spec = spec_of(scenario(), tmp_path)
    CountingRunner.ran = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sims.sweep.driver.create_runner", lambda name, resources: CountingRunner(resources))
        baseline_tuning = _files(copy / "tuning" / "baseline")
        assert run_sweep(spec, cells(spec), copy).failures == []  # everything done: nothing runs
        assert CountingRunner.ran == [] and _files(copy / "tuning" / "baseline") == baseline_tuning
        # a sweep killed during the tuning: no choice yet, one run unfinished
        (copy / "tuning" / ARM / "choice.json").unlink()
        (copy / "tuning" / ARM / "learning-rate=1_seed=1001" / "cell.json").unlink()
        shutil.rmtree(copy / "cells" / "epsilon=1_seed=1")
        assert run_sweep(spec, cells(spec), copy).failures == []
    assert CountingRunner.ran == [f"{ARM}/learning-rate=1_seed=1001", "cells/epsilon=1_seed=1"]
    assert json.loads((copy / "tuning" / ARM / "choice.json").read_text())["chosen"]["values"] == {
        "learning-rate": GOOD_LR
    }


def _files(folder: Path) -> dict[Path, bytes]:
    return {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def test_a_rerun_with_other_candidates_or_another_choice_is_refused(tuned_sweep, tmp_path):
    out, _ = tuned_sweep
    before = _files(out)
    spec = spec_of(with_tables(tune={"learning-rate": [TINY_LR, 0.5]}), tmp_path)
    with pytest.raises(InputError) as refused:
        run_sweep(spec, cells(spec), out)
    assert f"holds tuning/{ARM}/learning-rate=1_seed=1000, which this scenario's tuning does not have" in str(
        refused.value
    )
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    choice = json.loads((copy / "tuning" / ARM / "choice.json").read_text())
    choice["chosen"]["values"] = {"learning-rate": TINY_LR}  # finished cells ran η = 1
    (copy / "tuning" / ARM / "choice.json").write_text(json.dumps(choice))
    spec = spec_of(scenario(), tmp_path)
    with pytest.raises(InputError, match="ran with the tuned values {'learning-rate': 1.0}"):
        run_sweep(spec, cells(spec), copy)
    assert _files(out) == before


def test_an_arm_whose_every_candidate_failed_fails_its_cells_and_baselines_and_the_sweep_goes_on(tmp_path):
    class FailingTuning(CountingRunner):
        def run_cell(self, cell, results_dir, on_round):
            if results_dir.parent.name == ARM:
                CountingRunner.ran.append(f"{ARM}/{results_dir.name}")
                raise RuntimeError("injected tuning failure")
            super().run_cell(cell, results_dir, on_round)

    spec = spec_of(scenario(), tmp_path)
    CountingRunner.ran = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sims.sweep.driver.create_runner", lambda name, resources: FailingTuning(resources))
        outcome = run_sweep(spec, cells(spec), tmp_path / "out")
    choice = json.loads((tmp_path / "out" / "tuning" / ARM / "choice.json").read_text())
    assert choice["chosen"] is None and all(c["score"] is None for c in choice["candidates"])
    assert choice["candidates"][0]["errors"]["1000"] == "RuntimeError: injected tuning failure"
    assert len(CountingRunner.ran) == 4 and not any(name.startswith("cells/") for name in CountingRunner.ran)
    assert [row["status"] for row in outcome.rows] == ["failed", "failed"]
    assert all("no tuned setting" in row["error"] for row in outcome.rows)
    assert [b["status"] for b in outcome.baselines] == ["failed", "failed"]
    assert "has no tuned setting" in outcome.baselines[0]["error"]


def test_the_best_score_wins_ties_go_first_and_a_candidate_with_a_failed_run_cannot_win():
    from sims.sweep.tuning import Candidate, best, choice_record

    assert best([0.5, None, 0.5, 0.7]) == 3 and best([0.5, 0.5]) == 0 and best([None, None]) is None
    found = (Candidate("a", {"learning-rate": 0.1}), Candidate("b", {"learning-rate": 1.0}))
    scores = {("a", 1): 0.6, ("a", 2): 0.6, ("b", 1): 0.9, ("b", 2): None}
    record = choice_record(
        {"arm": "x"},
        found,
        (1, 2),
        "final",
        lambda c, s: (scores[c.name, s], None if scores[c.name, s] is not None else "diverged"),
    )
    assert record["chosen"] == {"name": "a", "values": {"learning-rate": 0.1}, "score": 0.6}
    assert record["candidates"][1]["score"] is None and record["candidates"][1]["errors"] == {"2": "diverged"}


def _table_rows(markdown: str, heading: str) -> list[list[str]]:
    lines = markdown[markdown.index(heading) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_the_report_shows_the_choices_and_says_the_tuning_is_not_in_epsilon(tuned_sweep, tmp_path):
    out, _ = tuned_sweep
    written = write_report(out, tmp_path / "report")
    markdown = written[-1].read_text()
    section = markdown[markdown.index("## Tuning") :]
    assert TUNING_PRIVACY_NOTE in section and "Papernot & Steinke 2022" in section
    choice = json.loads((out / "tuning" / ARM / "choice.json").read_text())
    ((arm, eta, score, tried, failed),) = _table_rows(section, "### Chosen per arm")
    assert (arm, eta, tried, failed) == (ARM, "1", "2", "0") and float(score) == pytest.approx(
        choice["chosen"]["score"], abs=1e-4
    )
    scores = _table_rows(section, "### Validation scores")
    assert [row[0] for row in scores] == ["learning-rate=1e-06", "learning-rate=1"]
    assert scores[1][1] == f"**{choice['chosen']['score']:.4f}**" and not scores[0][1].startswith("**")
    assert "### The non-private baseline's learning rate" in section


def test_the_dry_run_counts_the_tuning_runs(tmp_path, capsys, monkeypatch):
    path = tmp_path / "tuned.toml"
    path.write_text(
        '[sweep]\nclients = 2\nengine = "fast"\n[run]\ndataset = "digits"\nnum-server-rounds = 1\n'
        "[grid]\nepsilon = [1, 2]\nseed = [0, 1, 2]\n[tune]\nlearning-rate = [0.3, 1, 3]\nepochs = [4, 8]\n"
    )
    monkeypatch.setattr(sys, "argv", ["fedprivacy", "sweep", str(path), "--out", str(tmp_path / "o"), "--dry-run"])
    monkeypatch.setenv("COLUMNS", "240")
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    printed = " ".join(capsys.readouterr().out.split())
    assert exit_info.value.code == 0
    assert "tuned: 6 cells after 24 tuning runs" in printed
    assert "2 arms × 6 candidates × 2 tune seeds = 24 tuning runs" in printed
    assert "and up to 36 more (3 extra seeds) for candidates close to the best" in printed  # 2 × 6 × 3
    assert "non-private baseline: 6 more tuning runs" in printed  # 1 baseline arm × 3 η × 2 tune seeds
    assert "(up to 9 more for close candidates)" in printed
    assert not (tmp_path / "o").exists()


def test_a_choice_at_either_end_of_a_numeric_space_is_flagged_even_with_two_candidates():
    from fedprivacy.reports.sweep_tuning import edge_notes

    space = {"learning-rate": [10.0, 30.0], "epochs": [4.0, 8.0, 16.0], "lr-schedule": ["constant", "inverse_sqrt"]}
    choices = [
        {"arm": "a", "chosen": {"values": {"learning-rate": 10.0, "epochs": 8.0, "lr-schedule": "constant"}}},
        {"arm": "b", "chosen": {"values": {"learning-rate": 30.0, "epochs": 16.0, "lr-schedule": "inverse_sqrt"}}},
        {"arm": "c", "chosen": None},
    ]
    notes = edge_notes(choices, space)
    assert notes == [
        "- a: learning-rate = 10, the smallest candidate",
        "- b: learning-rate = 30, the largest candidate",
        "- b: epochs = 16, the largest candidate",
    ]


CLOSE_LR = 1.0001  # a step no different from GOOD_LR in effect: the two are close on any seeds


def close_scenario(**sweep: Any) -> dict[str, Any]:
    """One cell; η between two steps that train alike, so the tune seeds cannot tell them apart."""
    return {
        **scenario(**sweep),
        "grid": {"epsilon": [1.0], "seed": [0]},
        "tune": {"learning-rate": [GOOD_LR, CLOSE_LR]},
    }


def _run_counted(spec, out: Path) -> list[str]:
    CountingRunner.ran = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sims.sweep.driver.create_runner", lambda name, resources: CountingRunner(resources))
        assert run_sweep(spec, cells(spec), out).failures == []
    return sorted(CountingRunner.ran)


def test_close_candidates_run_the_extra_seeds_the_choice_uses_them_and_a_rerun_does_not_repeat_them(tmp_path):
    spec = spec_of(close_scenario(), tmp_path)
    out = tmp_path / "out"
    names = ("learning-rate=1", "learning-rate=1.0001")
    every = (1000, 1001, 1002, 1003, 1004)
    assert _run_counted(spec, out) == sorted(
        [f"{ARM}/{n}_seed={s}" for n in names for s in every] + ["cells/" + ARM + "_seed=0"]
    )
    choice = json.loads((out / "tuning" / ARM / "choice.json").read_text())
    assert choice["extra_seeds"] is True and choice["tune_seeds_close"] == [1002, 1003, 1004]
    scores = _scores(out)
    for candidate in choice["candidates"]:
        assert candidate["seeds"] == list(every) and candidate["close"]["extra_seeds"] == [1002, 1003, 1004]
        assert candidate["score"] == pytest.approx(statistics.fmean(scores[candidate["name"]]), abs=1e-12)
        assert len(scores[candidate["name"]]) == 5
    best, runner_up = sorted(choice["candidates"], key=lambda c: -c["tune_seeds_score"])
    assert best["close"]["close"] is False and runner_up["close"]["close"] is True
    assert runner_up["close"]["margin"] < 1.96 * runner_up["close"]["se"]
    means = {name: statistics.fmean(values) for name, values in scores.items()}
    assert choice["chosen"]["name"] == max(names, key=lambda n: (means[n], -names.index(n)))
    # the baseline's η tuning runs the same rule: its two candidates are as close
    baseline = json.loads((out / "tuning" / "baseline" / "default" / "choice.json").read_text())
    assert baseline["extra_seeds"] is True and all(c["seeds"] == list(every) for c in baseline["candidates"])
    section = write_report(out, tmp_path / "report")[-1].read_text()
    assert "Extra seeds for close candidates" in section
    assert f"- {ARM}: {best['name']} and the close {runner_up['name']} (margin" in section
    assert "also ran seeds 1002, 1003, 1004" in section
    # a rerun: nothing runs; a sweep killed among the extra runs redoes only the unfinished one
    assert _run_counted(spec, out) == []
    (out / "tuning" / ARM / "choice.json").unlink()
    (out / "tuning" / ARM / "learning-rate=1.0001_seed=1003" / "cell.json").unlink()
    shutil.rmtree(out / "cells" / f"{ARM}_seed=0")
    assert _run_counted(spec, out) == sorted([f"{ARM}/learning-rate=1.0001_seed=1003", f"cells/{ARM}_seed=0"])
    assert json.loads((out / "tuning" / ARM / "choice.json").read_text())["chosen"] == choice["chosen"]


def test_tune_seeds_close_empty_decides_on_the_tune_seeds_alone(tmp_path):
    spec = spec_of(close_scenario(**{"tune-seeds-close": []}), tmp_path)
    out = tmp_path / "out"
    ran = _run_counted(spec, out)
    assert [r for r in ran if r.startswith(ARM)] == sorted(
        f"{ARM}/learning-rate={lr}_seed={s}" for lr in ("1", "1.0001") for s in (1000, 1001)
    )
    choice = json.loads((out / "tuning" / ARM / "choice.json").read_text())
    assert choice["extra_seeds"] is False and choice["tune_seeds_close"] == []
    assert all(c["seeds"] == [1000, 1001] and c["close"]["extra_seeds"] == [] for c in choice["candidates"])
    assert len(list((out / "tuning" / "baseline" / "default").glob("*_seed=*"))) == 4
    assert "Extra seeds for close candidates" not in write_report(out, tmp_path / "report")[-1].read_text()


def test_a_clear_winner_gets_no_extra_seeds_and_an_older_choice_is_read_back(tuned_sweep, tmp_path):
    out, _ = tuned_sweep
    choice = json.loads((out / "tuning" / ARM / "choice.json").read_text())
    assert choice["extra_seeds"] is False and choice["tune_seeds_close"] == [1002, 1003, 1004]
    assert all(c["seeds"] == [1000, 1001] and c["close"]["extra_seeds"] == [] for c in choice["candidates"])
    loser = next(c for c in choice["candidates"] if c["name"] != choice["chosen"]["name"])
    assert loser["close"]["se"] > 0 and loser["close"]["margin"] >= 1.96 * loser["close"]["se"]
    assert not list((out / "tuning" / ARM).glob("*_seed=1002"))
    section = write_report(out, tmp_path / "report")[-1].read_text()
    assert "No arm had a candidate close to the best, so none ran the extra seeds" in section
    # a choice.json written before tune-seeds-close (no such input, no closeness) is read back as it was
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    for path in (copy / "tuning").rglob("choice.json"):
        old = json.loads(path.read_text())
        for key in ("tune_seeds_close", "extra_seeds", "close_rule"):
            old.pop(key)
        for candidate in old["candidates"]:
            for key in ("seeds", "close", "tune_seeds_score"):
                candidate.pop(key)
        path.write_text(json.dumps(old))
    assert _run_counted(spec_of(scenario(), tmp_path), copy) == []
    assert "## Tuning" in write_report(copy, tmp_path / "old")[-1].read_text()


def test_closeness_is_the_margin_against_1_96_standard_errors_of_the_binomial_accuracy():
    from sims.sweep.tuning import Candidate, choice_record, close_runs

    # p = 0.8 on m = 100 rows: s.e. per run 0.04, of a difference of two-seed means 0.04; 1.96 × 0.04 = 0.0784
    found = tuple(Candidate(name, {"learning-rate": lr}) for name, lr in (("a", 0.1), ("b", 0.3), ("c", 1.0)))
    scores = {"a": [0.8, 0.8, 0.6, 0.6, 0.6], "b": [0.73, 0.73, 0.9, 0.9, 0.9], "c": [0.7, 0.7, 1.0, 1.0, 1.0]}
    seeds, extra = (1, 2), (3, 4, 5)
    asked: list[tuple[str, int]] = []

    def outcome(candidate, seed):
        asked.append((candidate.name, seed))
        return scores[candidate.name][seed - 1], None

    def rows(name, seed):
        return 100

    needed = close_runs(found, seeds, extra, outcome, rows)
    assert [(c.name, s) for c, s in needed] == [("a", 3), ("a", 4), ("a", 5), ("b", 3), ("b", 4), ("b", 5)]
    record = choice_record({"arm": "x"}, found, seeds, "final", outcome, extra, rows)
    a, b, c = record["candidates"]
    assert b["close"]["se"] == pytest.approx(0.04) and b["close"]["margin"] == pytest.approx(0.07)
    assert b["close"]["close"] and not c["close"]["close"] and c["close"]["margin"] == pytest.approx(0.1)
    assert a["seeds"] == b["seeds"] == [1, 2, 3, 4, 5] and c["seeds"] == [1, 2] and c["close"]["extra_seeds"] == []
    # b wins on its five seeds; c, better on seeds it never ran, keeps its two-seed mean
    assert record["chosen"]["name"] == "b" and record["chosen"]["score"] == pytest.approx(0.832)
    assert ("c", 3) not in asked
    # without extra seeds the choice is today's: a, on the tune seeds alone
    assert choice_record({"arm": "x"}, found, seeds, "final", outcome, (), rows)["chosen"]["name"] == "a"
    # a failed run's candidate is never close, and no rows recorded means no s.e.: nothing is close
    assert close_runs(found, seeds, extra, outcome, lambda name, seed: None) == []
