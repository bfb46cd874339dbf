"""Sweeps: scenario files and flags, the in-process engine, resuming after a real kill, failed cells, the report."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from harness import load_scenario

from fedprivacy.runconfig import DEFAULTS
from fedprivacy.sweepfiles import RESULT_COLUMNS
from sims.runner import read_results
from sims.sweep.driver import run_sweep
from sims.sweep.engines.inprocess import InProcessCellRunner
from sims.sweep.flags import scenario_from_flags
from sims.sweep.grid import cell_name, cells
from sims.sweep.spec import validate

PROJECT = Path(__file__).resolve().parents[1]
TINY = PROJECT / "scenarios" / "tiny.toml"
TINY_CELLS = ["epsilon=1_rule=calibrated", "epsilon=2_rule=calibrated"]


def cell_folder(out: Path, name: str) -> Path:
    """The run's results folder inside a finished cell."""
    record = json.loads((out / "cells" / name / "cell.json").read_text())
    return out / "cells" / name / record["run_folder"]


def _markdown_rows(markdown: str, section: str) -> list[list[str]]:
    """The cells of the first markdown table after the heading `section`."""
    lines = markdown.splitlines()
    start = next(i for i in range(lines.index(section), len(lines)) if lines[i].startswith("|"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """scenarios/tiny.toml run once through the in-process engine, baseline included."""
    out = tmp_path_factory.mktemp("tiny") / "sweep"
    spec = load_scenario(TINY)
    outcome = run_sweep(spec, cells(spec), out)
    assert outcome.failures == []
    return out


def test_the_tiny_scenario_runs_every_cell_in_process_and_sweep_csv_agrees_with_the_cells(tiny_sweep):
    table = pd.read_csv(tiny_sweep / "sweep.csv")
    assert list(table.columns) == ["epsilon", "rule", *RESULT_COLUMNS]
    assert list(table["cell"]) == [f"cells/{name}" for name in TINY_CELLS]
    assert set(table["status"]) == {"completed"} and set(table["engine"]) == {"inprocess"}
    assert sorted(p.name for p in (tiny_sweep / "cells").iterdir()) == TINY_CELLS
    for row in table.itertuples():
        result = read_results(cell_folder(tiny_sweep, row.cell.split("/")[1]))
        result.check_budgets()
        assert result.summary["status"] == "completed" and len(result.clients) == 2
        assert row.final_accuracy == pytest.approx(result.final_accuracy, abs=1e-12)
        assert row.best_accuracy == pytest.approx(result.best[1], abs=1e-12)
        assert (
            row.epsilon_spent_max == pytest.approx(result.epsilon_spent_max, abs=1e-12)
            and row.epsilon_spent_max <= row.epsilon
        )
        assert row.epsilon_spent_mean == pytest.approx(sum(c["epsilon_spent"] for c in result.clients) / 2, abs=1e-12)
        assert row.all_within_budget and row.wall_s > 0
        config = json.loads((result.folder / "config.json").read_text())["run_config"]
        assert config["epsilon"] == row.epsilon and config["noise-seed"] == config["seed"] == 0  # seeded-noise
    baseline = json.loads((tiny_sweep / "baseline" / "default" / "baseline.json").read_text())
    assert baseline["status"] == "completed" and baseline["schedule_from"] == TINY_CELLS[0]
    assert baseline["final_accuracy"] > 0.5  # 10 digits: chance is 0.1


def test_the_fast_engine_gives_the_in_process_numbers_for_the_tiny_scenario(fedprivacy_cli, tiny_sweep, tmp_path):
    """`--engine fast` slots in as a module of sims/sweep/engines: same cells, same results to float tolerance."""
    code, _, err = fedprivacy_cli(
        "sweep",
        str(TINY),
        "--engine",
        "fast",
        "--no-baseline",
        "--out",
        str(tmp_path / "fast"),
    )
    assert code == 0, err
    fast, apps = pd.read_csv(tmp_path / "fast" / "sweep.csv"), pd.read_csv(tiny_sweep / "sweep.csv")
    assert set(fast["engine"]) == {"fast"} and list(fast["cell"]) == list(apps["cell"])
    for column in ("final_accuracy", "best_accuracy"):
        assert fast[column].to_list() == pytest.approx(apps[column].to_list(), abs=1e-4)
    assert fast["epsilon_spent_max"].to_list() == apps["epsilon_spent_max"].to_list()  # identical accounting
    summary = json.loads((cell_folder(tmp_path / "fast", TINY_CELLS[0]) / "summary.json").read_text())
    assert summary["engine"] == "fast"


def test_report_writes_figures_and_tables_from_a_finished_sweep(tiny_sweep):
    result = subprocess.run(
        [sys.executable, "-m", "fedprivacy", "report", str(tiny_sweep)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = tiny_sweep / "report"
    stems = ("accuracy_vs_epsilon", "accuracy_vs_round", "epsilon_vs_round", "budget_use", "accuracy_vs_epsilon_spent")
    for stem in stems:
        assert (report / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        svg = (report / f"{stem}.svg").read_text()
        assert svg.startswith("<?xml") and "<svg" in svg[:1000]
    markdown = (report / "report.md").read_text()
    assert "2 cells: 2 completed, 0 failed, 0 pending" in markdown
    for stem in stems:
        assert f"]({stem}.png)" in markdown
    accuracy = {float(r[1]): r for r in _markdown_rows(markdown, "## Accuracy")}
    for row in pd.read_csv(tiny_sweep / "sweep.csv").itertuples():  # one seed per setting: the mean is the cell's
        assert accuracy[row.epsilon][:3] == ["calibrated", f"{row.epsilon:.4f}", "1"]
        assert float(accuracy[row.epsilon][3]) == pytest.approx(row.final_accuracy, abs=5e-5)
        summary = json.loads((cell_folder(tiny_sweep, row.cell.split("/")[1]) / "summary.json").read_text())
        rows, p = summary["evaluation_rows"], row.final_accuracy  # the ServerApp records its central test rows
        assert rows > 0 and accuracy[row.epsilon][5:7] == ["—", "—"] and accuracy[row.epsilon][8] == str(rows)
        assert float(accuracy[row.epsilon][7]) == pytest.approx((p * (1 - p) / rows) ** 0.5, abs=5e-5)  # binomial s.e.
    baseline = json.loads((tiny_sweep / "baseline" / "default" / "baseline.json").read_text())
    assert f"{baseline['final_accuracy']:.4f}" in markdown


def test_report_tables_average_over_seeds(tmp_path):
    """A sweep folder written by hand (2 rules × 2 ε × 2 seeds): the report's means and spreads."""
    accuracies = {
        ("proactive", 1.0): (0.50, 0.60),
        ("proactive", 4.0): (0.70, 0.74),
        ("calibrated", 1.0): (0.62, 0.66),
        ("calibrated", 4.0): (0.80, 0.70),
    }
    rows = []
    for (rule, epsilon), finals in accuracies.items():
        for seed, final in enumerate(finals):
            name = cell_name({"rule": rule, "epsilon": epsilon, "seed": seed})
            run = tmp_path / "cells" / name / "run"
            run.mkdir(parents=True)
            pd.DataFrame(
                {
                    "round": [1, 2],
                    "accuracy": [final - 0.1, final],
                    "epsilon_spent_max": [epsilon / 2, epsilon],
                }
            ).to_csv(run / "rounds.csv", index=False)
            spent = [epsilon, epsilon / 2] if rule == "calibrated" else [epsilon / 2, epsilon / 4]
            pd.DataFrame(
                {
                    "client_id": ["a", "b"],
                    "epsilon_budget": [epsilon] * 2,
                    "epsilon_spent": spent,
                    "status": ["exhausted", "ok"] if rule == "calibrated" else ["ok", "ok"],
                }
            ).to_csv(run / "clients.csv", index=False)
            (tmp_path / "cells" / name / "cell.json").write_text(
                json.dumps({"params": {"rule": rule, "epsilon": epsilon, "seed": seed}, "run_folder": "run"})
            )
            rows.append(
                {
                    "rule": rule,
                    "epsilon": epsilon,
                    "seed": seed,
                    **dict.fromkeys(RESULT_COLUMNS),
                    "status": "completed",
                    "final_accuracy": final,
                    "best_accuracy": final,
                    "epsilon_spent_max": epsilon,
                    "all_within_budget": True,
                    "cell": f"cells/{name}",
                }
            )
    pd.DataFrame(rows).to_csv(tmp_path / "sweep.csv", index=False)
    (tmp_path / "sweep.json").write_text(
        json.dumps(
            {
                "name": "by hand",
                "grid": {"rule": ["proactive", "calibrated"], "epsilon": [1.0, 4.0], "seed": [0, 1]},
            }
        )
    )

    code = subprocess.run(
        [sys.executable, "-m", "fedprivacy", "report", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert code.returncode == 0, code.stderr
    markdown = (tmp_path / "report" / "report.md").read_text()
    accuracy = {(r[0], float(r[1])): r for r in _markdown_rows(markdown, "## Accuracy")}
    for key, finals in accuracies.items():
        row = accuracy[key]
        assert int(row[2]) == 2
        assert float(row[3]) == pytest.approx(sum(finals) / 2, abs=5e-5)
        assert float(row[4]) == pytest.approx(pd.Series(finals).std(), abs=5e-5)
    budget = {(r[0], float(r[1])): r for r in _markdown_rows(markdown, "## Budget use per client")}
    assert [float(v) for v in budget[("calibrated", 4.0)][3:6]] == [
        0.5,
        0.75,
        1.0,
    ]  # min, median, max of spent/budget
    assert (
        int(budget[("calibrated", 4.0)][6]) == 2 and int(budget[("proactive", 1.0)][6]) == 0
    )  # out of budget, over seeds
    assert (tmp_path / "report" / "accuracy_vs_epsilon.svg").is_file()


def test_flags_and_a_scenario_file_give_the_same_cells(fedprivacy_cli, tmp_path):
    from_file = load_scenario(TINY)
    raw = scenario_from_flags(
        {"dataset": "digits", "rounds": "2"},
        {"epsilons": "1,2", "rules": "calibrated"},
        ["epochs=2"],
        [],
        {"clients": 2, "seeded-noise": True},
        {},
    )
    from_flags = validate(raw, base_dir=tmp_path, default_name="tiny")
    assert [(c.name, c.run_config, c.num_clients) for c in cells(from_flags)] == [
        (c.name, c.run_config, c.num_clients) for c in cells(from_file)
    ]
    # and through the command, which lists the cells it would run
    _, listed_from_file, _ = fedprivacy_cli("sweep", str(TINY), "--out", str(tmp_path / "tiny"), "--dry-run")
    code, listed_from_flags, _ = fedprivacy_cli(
        "sweep",
        "--out",
        str(tmp_path / "tiny"),
        "--dry-run",
        "--dataset",
        "digits",
        "--clients",
        "2",
        "--rounds",
        "2",
        "--epsilons",
        "1,2",
        "--rules",
        "calibrated",
        "--set",
        "epochs=2",
        "--seeded-noise",
    )
    assert code == 0 and listed_from_flags == listed_from_file and all(name in listed_from_file for name in TINY_CELLS)
    assert not (tmp_path / "tiny").exists()  # a dry run writes nothing


def test_seed_ranges_and_readable_unique_cell_names():
    raw = scenario_from_flags(
        {"dataset": "digits"},
        {"seeds": "0-2,7"},
        [],
        ["clip-norm=0.1,1e-05", "model=mlp"],
        {"clients": 2},
        {},
    )
    spec = validate(raw, base_dir=Path.cwd(), default_name="x")
    assert spec.grid == {"seed": (0, 1, 2, 7), "clip-norm": (0.1, 1e-05), "model": ("mlp",)}
    assert cells(spec)[0].name == "seed=0_clip-norm=0.1_model=mlp"
    assert cell_name({"epsilon": 1.0, "rule": "proactive"}) == "epsilon=1_rule=proactive"
    unsafe = cell_name({"epsilons": "0.5,1/2"})
    assert unsafe.startswith("epsilons=0.5-1-2-") and unsafe != cell_name({"epsilons": "0.5-1-2"}) != cell_name(
        {"epsilons": "0.5,1,2"}
    )


def test_the_command_and_the_report_import_neither_flower_nor_sims():
    """fedprivacy never imports flwr at module level: `sweep` imports sims inside the command."""
    code = (
        "import sys, fedprivacy.cli, fedprivacy.reports.sweep_report, fedprivacy.results; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'flwr', 'sims', 'ray'}))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


BAD_SCENARIOS = {
    "unknown grid key": ("[grid]\nepsilonn = [1, 2]\n", "grid.epsilonn"),
    "unknown table": ("[grids]\nepsilon = [1]\n", "grids"),
    "unknown sweep key": ('[sweep]\nengin = "flower"\n[grid]\nepsilon = [1]\n', "sweep.engin"),
    "empty grid": ('[run]\ndataset = "digits"\n', "grid"),
    "empty value list": ("[grid]\nepsilon = []\n", "grid.epsilon"),
    "not a list": ("[grid]\nepsilon = 1\n", "grid.epsilon"),
    "wrong type in the grid": ('[grid]\nepsilon = [1, "two"]\n', "grid.epsilon"),
    "wrong type in run": ("[run]\nnum-server-rounds = 2.5\n[grid]\nepsilon = [1]\n", "run.num-server-rounds"),
    "duplicate cell": ('[grid]\nrule = ["proactive", "proactive"]\n', "grid.rule"),
    "duplicate after typing": ("[grid]\nepsilon = [1, 1.0]\n", "grid.epsilon"),
    "fixed and varied": ("[run]\nepsilon = 1.0\n[grid]\nepsilon = [1, 2]\n", "grid.epsilon"),
    "unknown engine": ('[sweep]\nengine = "fastest"\n[grid]\nepsilon = [1]\n', "sweep.engine"),
    "set by the sweep": ('[run]\nresults-dir = "/tmp/x"\n[grid]\nepsilon = [1]\n', "run.results-dir"),
    "out-of-range value": ("[sweep]\nclients = 2\n[grid]\nepsilon = [1, -2]\n", "epsilon"),
    "too few clients": ("[sweep]\nclients = 1\n[grid]\nepsilon = [1]\n", "sweep.clients"),
    "one budget per client, wrong count": (
        '[sweep]\nclients = 2\n[run]\nepsilons = "1,2,3"\n[grid]\nseed = [0]\n',
        "epsilons",
    ),
    "a common ε beside per-client ones": (
        '[sweep]\nclients = 3\n[run]\nepsilons = "1,2,3"\n[grid]\nepsilon = [1, 2]\n',
        "grid.epsilon",
    ),
    "a common δ beside per-client ones": (
        '[sweep]\nclients = 2\n[run]\ndelta = 1e-6\n[grid]\ndeltas = ["1e-5,1e-6"]\n',
        "run.delta",
    ),
    "a data file that is not there": (
        '[sweep]\nclients = 2\n[run]\ndataset = "pums"\ndata-path = "/nowhere/pums.csv"\n[grid]\nseed = [0]\n',
        "data-path",
    ),
    "baseline learning rate not positive": (
        "[sweep]\nbaseline-learning-rate = 0\n[grid]\nepsilon = [1]\n",
        "sweep.baseline-learning-rate",
    ),
    "fractional CPUs": ("[resources]\nclient-cpus = 0.5\n[grid]\nepsilon = [1]\n", "resources.client-cpus"),
    "not TOML": ("[grid\nepsilon = [1]\n", "scenario"),
}


@pytest.mark.parametrize("case", list(BAD_SCENARIOS))
def test_a_bad_scenario_is_refused_in_one_line_before_anything_runs(fedprivacy_cli, case, tmp_path):
    text, field = BAD_SCENARIOS[case]
    scenario = tmp_path / "bad.toml"
    scenario.write_text(text)
    code, out, err = fedprivacy_cli("sweep", str(scenario), "--out", str(tmp_path / "out"))
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {field}="), err
    assert not (tmp_path / "out").exists()


def test_flags_with_a_scenario_file_or_a_bad_flag_are_refused_in_one_line(fedprivacy_cli, tmp_path):
    for args, field in (
        (["--epsilons", "1,2"], "epsilons"),
        (["--seeds", "4-0"], "seeds"),
        (["--grid", "clip-norm=x"], "grid clip-norm"),
    ):
        scenario = [str(TINY)] if field == "epsilons" else ["--dataset", "digits", "--clients", "2"]
        code, _, err = fedprivacy_cli("sweep", *scenario, "--out", str(tmp_path / "out"), *args)
        assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith(f"error: {field}="), err
    assert not (tmp_path / "out").exists()


def test_data_path_relocates_a_scenario_files_data(fedprivacy_cli, tmp_path, monkeypatch):
    """A copy of a scenario whose data lives elsewhere: --data-path (relative to the working folder)
    replaces its [run] data-path, and nothing else; a scenario varying data-path is refused."""
    from fedprivacy.cli.sweeps import _sweep_scenario

    copied = tmp_path / "budgets.toml"  # its relative data-path names no file beside tmp_path
    copied.write_text((PROJECT / "scenarios" / "pums_budgets.toml").read_text())
    data = tmp_path / "elsewhere" / "pums.csv"
    data.parent.mkdir()
    data.write_text("puma,age\n1,30\n")
    monkeypatch.chdir(data.parent)
    none = dict.fromkeys(("dataset", "partition-by", "partitioning", "model", "rounds", "fraction-train"))
    sweep = {"engine": None, "baseline": None, "clients": None, "seeded-noise": None}
    resources = dict.fromkeys(("client-cpus", "client-gpus", "workers", "worker-gpus", "device"))
    grid = {"epsilons": None, "rules": None, "seeds": None}
    spec = _sweep_scenario(copied, {**none, "data-path": "pums.csv"}, grid, [], [], sweep, resources, Path("out"))
    original = _sweep_scenario(copied, {**none, "data-path": None}, grid, [], [], sweep, resources, Path("out"))
    assert spec.run == {**original.run, "data-path": str(data)} and original.run["data-path"] != str(data)
    assert spec.grid == original.grid
    in_grid = copied.read_text() + f'data-path = ["{data}", "{data}.2"]\n'  # [grid] is the file's last table
    in_linked = copied.read_text() + f'[linked.data]\ndata-path = ["{data}", "{data}.2"]\nclip-norm = [0.1, 0.2]\n'
    for table, text in (("[grid]", in_grid), ("[linked.data]", in_linked)):
        varied = tmp_path / "varied.toml"
        varied.write_text(text)
        code, _, err = fedprivacy_cli("sweep", str(varied), "--out", str(tmp_path / "out"), "--data-path", "pums.csv")
        assert code == 2 and err.startswith("error: data-path='pums.csv': the scenario file"), err
        assert f"varies data-path in its {table}" in err
    assert not (tmp_path / "out").exists()


def test_resource_flags_apply_to_a_scenario_file():
    """Where the cells run is not part of the scenario: --workers and the like replace the file's
    [resources] (grid flags with a file are refused, above)."""
    from fedprivacy.cli.sweeps import _sweep_scenario

    none = dict.fromkeys(("dataset", "data-path", "partition-by", "partitioning", "model", "rounds", "fraction-train"))
    sweep = {"engine": "fast", "baseline": None, "clients": None, "seeded-noise": None}
    resources = {"client-cpus": None, "client-gpus": None, "workers": 2, "worker-gpus": 0.5}
    spec = _sweep_scenario(
        TINY, none, {"epsilons": None, "rules": None, "seeds": None}, [], [], sweep, resources, Path("out")
    )
    assert (spec.engine, spec.resources.workers, spec.resources.worker_gpus) == ("fast", 2, 0.5)
    assert spec.grid == load_scenario(TINY).grid and spec.run == load_scenario(TINY).run


class FailingEngine(InProcessCellRunner):
    """The in-process engine with a fault injected into the named cells."""

    def __init__(self, *failing: str) -> None:
        super().__init__()
        self.failing = failing

    def run_cell(self, cell, results_dir, on_round):
        if cell.name in self.failing:
            raise RuntimeError("injected fault\nwith a second line")
        super().run_cell(cell, results_dir, on_round)


def test_a_sweep_whose_every_cell_failed_still_gets_a_report_of_why(fedprivacy_cli, tmp_path, monkeypatch):
    out = tmp_path / "sweep"
    monkeypatch.setattr("sims.sweep.driver.create_runner", lambda name, resources: FailingEngine(*TINY_CELLS))
    code, _, _ = fedprivacy_cli("sweep", str(TINY), "--out", str(out), "--no-baseline")
    assert code == 1 and list(pd.read_csv(out / "sweep.csv")["status"]) == ["failed", "failed"]
    code, printed, _ = fedprivacy_cli("report", str(out))
    assert code == 0 and printed.startswith("1 files, report:")
    markdown = (out / "report" / "report.md").read_text()
    assert "2 cells: 0 completed, 2 failed, 0 pending" in markdown and "No cell completed" in markdown
    assert [row[0] for row in _markdown_rows(markdown, "## Failed cells")] == [f"cells/{name}" for name in TINY_CELLS]
    assert markdown.count("RuntimeError: injected fault") == 2 and not list((out / "report").glob("*.png"))


def test_a_failed_cell_is_a_row_with_its_error_and_a_rerun_redoes_only_it(fedprivacy_cli, tmp_path, monkeypatch):
    out = tmp_path / "sweep"
    monkeypatch.setattr("sims.sweep.driver.create_runner", lambda name, resources: FailingEngine(TINY_CELLS[1]))
    code, _, err = fedprivacy_cli("sweep", str(TINY), "--out", str(out), "--no-baseline")
    assert code == 1 and f"failed: cells/{TINY_CELLS[1]}: RuntimeError: injected fault" in err
    table = pd.read_csv(out / "sweep.csv")
    assert list(table["status"]) == ["completed", "failed"]
    assert table["error"][1] == "RuntimeError: injected fault" and pd.isna(table["error"][0])  # one line
    first = (out / "cells" / TINY_CELLS[0] / "cell.json").stat().st_mtime_ns

    monkeypatch.setattr("sims.sweep.driver.create_runner", lambda name, resources: InProcessCellRunner())
    code, _, _ = fedprivacy_cli("sweep", str(TINY), "--out", str(out), "--no-baseline")
    assert code == 0
    assert list(pd.read_csv(out / "sweep.csv")["status"]) == ["completed", "completed"]
    assert (out / "cells" / TINY_CELLS[0] / "cell.json").stat().st_mtime_ns == first  # not run again
    assert not (out / "baseline").exists()


class EngineThatCannotStart(InProcessCellRunner):
    torn_down = False

    def setup(self):
        raise RuntimeError("no SuperLink came up (injected)")

    def teardown(self):
        EngineThatCannotStart.torn_down = True


def test_an_engine_that_cannot_start_is_one_line_and_is_torn_down(fedprivacy_cli, tmp_path, monkeypatch):
    monkeypatch.setattr("sims.sweep.driver.create_runner", lambda name, resources: EngineThatCannotStart())
    code, _, err = fedprivacy_cli("sweep", str(TINY), "--out", str(tmp_path / "out"), "--no-baseline")
    assert (
        code == 1
        and err.strip().splitlines()[-1]
        == "error: engine inprocess could not start: RuntimeError: no SuperLink came up (injected)"
    )
    assert EngineThatCannotStart.torn_down
    assert set(pd.read_csv(tmp_path / "out" / "sweep.csv")["status"]) == {"pending"}


def test_a_finished_sweep_refuses_to_resume_with_other_settings(fedprivacy_cli, tiny_sweep, tmp_path):
    changed = tmp_path / "tiny.toml"
    changed.write_text(TINY.read_text().replace("num-server-rounds = 2", "num-server-rounds = 3"))
    before = (tiny_sweep / "sweep.csv").read_text()
    code, _, err = fedprivacy_cli("sweep", str(changed), "--out", str(tiny_sweep))
    assert code == 2 and err.startswith(
        f"error: out='{tiny_sweep}': its cell {TINY_CELLS[0]} ran with num-server-rounds=2"
    )
    assert (tiny_sweep / "sweep.csv").read_text() == before


def test_a_sweep_finished_before_a_run_config_key_existed_resumes_with_that_key_at_its_default(
    fedprivacy_cli, tiny_sweep
):
    """Cells recorded without a key (added to the run config later) ran with its default: resuming
    the same scenario neither refuses nor reruns them; a non-default value for that key is refused."""
    for record_file in (tiny_sweep / "cells").glob("*/cell.json"):
        record = json.loads(record_file.read_text())
        assert record["run_config"].pop("data-split") == DEFAULTS["data-split"]
        record_file.write_text(json.dumps(record))
    before = (tiny_sweep / "sweep.csv").read_text()
    code, _, err = fedprivacy_cli("sweep", str(TINY), "--out", str(tiny_sweep))
    assert code == 0, err
    assert (tiny_sweep / "sweep.csv").read_text() == before
    changed = tiny_sweep.parent / "changed.toml"
    changed.write_text(TINY.read_text().replace("[run]\n", '[run]\ndata-split = "train"\n', 1))
    code, _, err = fedprivacy_cli("sweep", str(changed), "--out", str(tiny_sweep))
    assert code == 2 and "ran with data-split=''" in err


def test_a_sweep_refuses_a_folder_holding_another_scenarios_cells(fedprivacy_cli, tiny_sweep, tmp_path):
    """Another grid into the same --out: refused before anything is written, even where the
    cells it shares ran with the same settings (the report would mix the two scenarios)."""
    other = tmp_path / "other.toml"
    other.write_text(TINY.read_text().replace("epsilon = [1, 2]", "epsilon = [1, 4]"))
    assert other.read_text() != TINY.read_text()
    before = {path: path.read_bytes() for path in tiny_sweep.rglob("*") if path.is_file()}
    code, _, err = fedprivacy_cli("sweep", str(other), "--out", str(tiny_sweep), "--no-baseline")
    assert code == 2 and err.startswith(
        f"error: out='{tiny_sweep}': holds cell {TINY_CELLS[1]}, which this scenario does not have"
    )
    assert {path: path.read_bytes() for path in tiny_sweep.rglob("*") if path.is_file()} == before


def _sweep_process(out: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "fedprivacy", "sweep", str(TINY), "--out", str(out)],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def test_a_killed_sweep_resumes_with_no_cell_duplicated_or_lost(tmp_path):
    out = tmp_path / "sweep"
    process = _sweep_process(out, tmp_path / "first.log")
    first, second = (out / "cells" / name for name in TINY_CELLS)
    deadline = time.monotonic() + 240
    while not (second.is_dir() and (first / "cell.json").is_file()):  # the second cell has started
        assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    assert not (second / "cell.json").exists(), "the sweep finished its second cell before the kill"
    assert list(pd.read_csv(out / "sweep.csv")["status"]) == ["completed", "pending"]
    kept = {
        path: path.stat().st_mtime_ns for path in (first / "cell.json", out / "baseline" / "default" / "baseline.json")
    }

    resumed = _sweep_process(out, tmp_path / "second.log")
    assert resumed.wait(timeout=240) == 0, (tmp_path / "second.log").read_text()
    assert "resuming" in (tmp_path / "second.log").read_text()
    assert {path: path.stat().st_mtime_ns for path in kept} == kept  # the finished cell and baseline were not rerun
    table = pd.read_csv(out / "sweep.csv")
    assert list(table["cell"]) == [f"cells/{name}" for name in TINY_CELLS] and set(table["status"]) == {"completed"}
    assert sorted(p.name for p in (out / "cells").iterdir()) == TINY_CELLS
    for cell in (first, second):  # exactly one results folder each: the killed attempt left nothing behind
        assert [p.name for p in cell.iterdir() if p.is_dir()] == [
            json.loads((cell / "cell.json").read_text())["run_folder"]
        ]
        read_results(cell_folder(out, cell.name)).check_budgets()
    assert sorted(p.name for p in (out / "baseline").iterdir()) == ["default"]


def test_cells_that_differ_only_in_keys_the_baseline_ignores_share_one_baseline(tmp_path):
    from sims.sweep.baseline_jobs import baseline_jobs
    from sims.sweep.grid import cells
    from sims.sweep.spec import validate

    raw = {
        "sweep": {"clients": 2},
        "run": {"dataset": "digits", "num-server-rounds": 1},
        "grid": {
            "epsilon": [1, 2],
            "aggregation": ["examples", "inverse-noise"],
            "server-optimizer": ["none", "fedadam"],
            "seed": [0, 1],
        },
    }
    grid_cells = cells(validate(raw, base_dir=tmp_path, default_name="t"))
    jobs = baseline_jobs(grid_cells)
    assert len(grid_cells) == 16 and [job.params for job in jobs] == [{"seed": 0}, {"seed": 1}]


def test_a_sweep_can_give_its_baselines_their_own_learning_rate(tmp_path):
    """η chosen for clipped, noisy steps can be far too large for plain SGD: the baselines take
    `[sweep] baseline-learning-rate` when set, and the cells keep theirs."""
    from sims.baseline import nonprivate_baseline
    from sims.sweep.baseline_jobs import baseline_jobs
    from sims.sweep.grid import cells
    from sims.sweep.spec import validate

    raw = {
        "sweep": {"clients": 2, "baseline-learning-rate": 0.05},
        "run": {"dataset": "digits", "num-server-rounds": 1, "epochs": 1.0, "learning-rate": 3.0},
        "grid": {"epsilon": [1, 2]},
    }
    spec = validate(raw, base_dir=tmp_path, default_name="t")
    grid_cells = cells(spec)
    (job,) = baseline_jobs(grid_cells, spec.baseline_learning_rate)
    assert job.run_config["learning-rate"] == 0.05 and all(c.run_config["learning-rate"] == 3.0 for c in grid_cells)
    assert spec.to_dict()["baseline_learning_rate"] == 0.05
    chosen = nonprivate_baseline(job.run_config, 2, name="own")
    inherited = nonprivate_baseline(grid_cells[0].run_config, 2, name="inherited")
    assert chosen.final_accuracy != inherited.final_accuracy  # the baseline really trained with its own η


def test_a_model_the_trainer_refuses_fails_the_sweeps_validation_in_one_line(fedprivacy_cli, tmp_path, monkeypatch):
    """A registered model with BatchNorm is refused when the sweep validates its cells (built once
    on its data's shape), naming the model and the layer, before any folder is written."""
    from torch import nn

    from fedprivacy import model_registry

    monkeypatch.setattr(model_registry, "_decorated", {})

    @model_registry.register_model("bn-mlp")
    def bn_mlp(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.BatchNorm1d(16), nn.Linear(16, num_classes))

    scenario = tmp_path / "bn.toml"
    scenario.write_text('[run]\ndataset = "digits"\nmodel = "bn-mlp"\n[grid]\nepsilon = [1, 2]\n')
    code, out, err = fedprivacy_cli("sweep", str(scenario), "--out", str(tmp_path / "out"))
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("error: model='bn-mlp': (factory ") and "BatchNorm1d" in line and "GroupNorm" in line, line
    assert not (tmp_path / "out").exists()


def test_the_per_round_baseline_says_whose_schedule_it_runs(tiny_sweep):
    """The baseline takes its q and T from its schedule_from cell (ε = 1 here): the per-round figure's
    dashed curve says so, since it compares with that line only."""
    from fedprivacy.reports.sweep_data import load_sweep
    from fedprivacy.reports.sweep_figures import _schedule_of, groups

    data = load_sweep(tiny_sweep)
    ((values, _),) = groups(data.rounds, data.series_keys)
    assert _schedule_of(data, data.series_keys, values) == " (schedule of epsilon=1)"


def test_the_sweep_log_keeps_each_line_whole_on_a_narrow_console():
    """A log piped to a file gets rich's 80 columns: a cell's line must not break mid-phrase."""
    import io

    from rich.console import Console

    from sims.sweep.progress import SweepProgress

    out = io.StringIO()
    line = "tuning run 3/8 tuning/epsilon=1/learning-rate=0.3_seed=1000: validation accuracy 0.6823 (4 s)"
    with SweepProgress(1, 0, Console(file=out, width=40, force_terminal=False)) as progress:
        progress.log(line)
    assert line in out.getvalue().splitlines()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--engine", "fast", "--device", "cuda"], "resources.device='cuda': no CUDA GPU is visible here"),
        (["--engine", "fast", "--worker-gpus", "0.5"], "resources.worker-gpus=0.5: no CUDA GPU is visible here"),
        (["--engine", "flower", "--client-gpus", "0.5"], "resources.client-gpus=0.5: no CUDA GPU is visible here"),
        (["--engine", "flower", "--client-cpus", "{too_many}"], "resources.client-cpus={too_many}: this machine has"),
    ],
)
def test_resources_this_machine_cannot_give_are_refused_before_anything_is_written(
    tmp_path, monkeypatch, fedprivacy_cli, flags, message
):
    """Every cell would fail on them one by one (Flower's simulation places no client): refused by
    name, by --dry-run too, and the run writes no folder."""
    import torch

    from sims.sweep.machine import visible_cpus

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # a machine without a GPU, wherever this runs
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "no-cluster"))  # and no `ray start` cluster to join
    fill = {"too_many": str(visible_cpus() + 1)}
    flags = [flag.format(**fill) for flag in flags]
    out = tmp_path / "out"
    for dry in (["--dry-run"], []):
        code, _, err = fedprivacy_cli("sweep", str(TINY), "--out", str(out), *flags, *dry)
        assert code == 2 and err.startswith(f"error: {message.format(**fill)}"), err
        assert not out.exists()


@pytest.mark.parametrize("joined", ["RAY_ADDRESS", "ray start"])
@pytest.mark.parametrize(
    "flags",
    [
        ["--engine", "fast", "--device", "cuda", "--workers", "2"],
        ["--engine", "flower", "--client-gpus", "0.25"],
        ["--engine", "flower", "--client-cpus", "64"],
    ],
)
def test_a_ray_cluster_decides_its_own_resources(tmp_path, monkeypatch, fedprivacy_cli, joined, flags):
    """Ray workers and Flower's simulation join the cluster RAY_ADDRESS names or `ray start` left
    here: its machines may have GPUs and CPUs this one lacks, so they are not refused here."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    if joined == "RAY_ADDRESS":
        monkeypatch.setenv("RAY_ADDRESS", "ray://cluster:10001")
    else:
        (tmp_path / "ray").mkdir()
        (tmp_path / "ray" / "ray_current_cluster").write_text("10.0.0.1:6379")
    code, _, err = fedprivacy_cli("sweep", str(TINY), "--out", str(tmp_path / "out"), *flags, "--dry-run")
    assert code == 0, err
    # one fast worker runs in this process, cluster or not: refused
    code, _, err = fedprivacy_cli(
        "sweep", str(TINY), "--out", str(tmp_path / "out"), "--engine", "fast", "--device", "cuda", "--dry-run"
    )
    assert code == 2 and "resources.device='cuda'" in err
