"""Sweep designs a referee would accept: linked axes (keys that move together), per-client epochs,
and adp compared with DP-SGD on the same step-size schedule."""

from __future__ import annotations

import itertools
import json
import sys
import tomllib
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from fedprivacy import cli
from fedprivacy.errors import InputError
from fedprivacy.runconfig import parse_run_config
from fedprivacy.sweepfiles import CELL_JSON, CELLS, RESULT_COLUMNS, write_json
from sims.fast.engine import run_fast
from sims.sweep.driver import check_resumable, write_sweep_csv
from sims.sweep.grid import cells, schedule_note
from sims.sweep.spec import SweepSpec, validate

# docs/simulator.md's "Linked axes" example, on 2 simulated digits clients.
DESIGN = """
[sweep]
clients = 2

[grid]
seed = [0, 1, 2]

[linked.budget]
epsilon = [0.25, 1, 4]
epochs  = [4, 8, 16]

[linked.step]
clip-norm     = [0.1, 1, 3]
learning-rate = [30, 3, 1]
"""


def spec_of(text: str, tmp_path: Path) -> SweepSpec:
    return validate(tomllib.loads(text), base_dir=tmp_path, default_name="design")


def refusal(text: str, tmp_path: Path) -> InputError:
    """The InputError validating `text` (and expanding its cells) raises."""
    with pytest.raises(InputError) as error:
        cells(spec_of(text, tmp_path))
    return error.value


# ---------------- linked axes ----------------


def test_linked_groups_are_one_axis_each_in_declared_order_the_last_fastest(tmp_path):
    spec = spec_of(DESIGN, tmp_path)
    found = cells(spec)
    assert len(found) == 3 * 3 * 3  # not 3**5: each group is one axis
    budget = [(0.25, 4.0), (1.0, 8.0), (4.0, 16.0)]
    step = [(0.1, 30.0), (1.0, 3.0), (3.0, 1.0)]
    expected = [
        {"seed": seed, "epsilon": eps, "epochs": k, "clip-norm": c, "learning-rate": lr}
        for seed, (eps, k), (c, lr) in itertools.product([0, 1, 2], budget, step)
    ]
    assert [cell.params for cell in found] == expected
    assert found[0].name == "seed=0_epsilon=0.25_epochs=4_clip-norm=0.1_learning-rate=30"
    assert found[1].name == "seed=0_epsilon=0.25_epochs=4_clip-norm=1_learning-rate=3"
    for cell in found:  # every key of every axis reaches the cell's run config
        assert all(cell.run_config[key] == value for key, value in cell.params.items())
    assert spec.varied == ["seed", "epsilon", "epochs", "clip-norm", "learning-rate"]


def test_a_linked_group_holds_eta_times_c_fixed_while_c_varies(tmp_path):
    found = cells(spec_of(DESIGN, tmp_path))
    assert sorted({cell.run_config["clip-norm"] for cell in found}) == [0.1, 1.0, 3.0]
    for cell in found:
        assert cell.run_config["learning-rate"] * cell.run_config["clip-norm"] == pytest.approx(3.0)


def test_sweep_json_and_sweep_csv_record_the_linked_keys(tmp_path):
    spec = spec_of(DESIGN, tmp_path)
    recorded = json.loads(json.dumps(spec.to_dict()))
    assert recorded["linked"] == {
        "budget": {"epsilon": [0.25, 1.0, 4.0], "epochs": [4.0, 8.0, 16.0]},
        "step": {"clip-norm": [0.1, 1.0, 3.0], "learning-rate": [30.0, 3.0, 1.0]},
    }
    found = cells(spec)
    write_sweep_csv(tmp_path, spec, found)
    table = pd.read_csv(tmp_path / "sweep.csv")
    assert list(table.columns) == [*spec.varied, *RESULT_COLUMNS]
    assert list(table["epochs"]) == [cell.params["epochs"] for cell in found]


def test_a_scenario_may_have_linked_groups_and_no_grid(tmp_path):
    found = cells(spec_of("[sweep]\nclients = 2\n[linked.b]\nepsilon = [1, 2]\nepochs = [2, 4]\n", tmp_path))
    assert [cell.name for cell in found] == ["epsilon=1_epochs=2", "epsilon=2_epochs=4"]


LINKED = "[sweep]\nclients = 2\n"
BAD_DESIGNS = {
    "unequal lengths": (LINKED + "[linked.budget]\nepsilon = [1, 2]\nepochs = [4]\n", "linked.budget.epochs"),
    "also in [grid]": (
        LINKED + "[grid]\nepsilon = [1, 2]\n[linked.budget]\nepsilon = [1, 2]\nepochs = [4, 8]\n",
        "linked.budget.epsilon",
    ),
    "also in [run]": (
        LINKED + "[run]\nepochs = 4.0\n[linked.budget]\nepsilon = [1, 2]\nepochs = [4, 8]\n",
        "linked.budget.epochs",
    ),
    "in two groups": (
        LINKED + "[linked.a]\nepsilon = [1, 2]\n[linked.b]\nepsilon = [4, 8]\nepochs = [4, 8]\n",
        "linked.b.epsilon",
    ),
    "empty group": (LINKED + "[grid]\nseed = [0]\n[linked.budget]\n", "linked.budget"),
    "not a group": (LINKED + "[linked]\nepsilon = [1, 2]\n", "linked.epsilon"),
    "wrong type": (LINKED + '[linked.budget]\nepsilon = [1, "two"]\nepochs = [4, 8]\n', "linked.budget.epsilon"),
    "not an integer": (LINKED + "[linked.s]\nseed = [0, 1.5]\nepochs = [4, 8]\n", "linked.s.seed"),
    "not a list": (LINKED + "[linked.budget]\nepsilon = 1\nepochs = [4]\n", "linked.budget.epsilon"),
    "unknown key": (LINKED + "[linked.budget]\nepsilonn = [1, 2]\n", "linked.budget.epsilonn"),
    "a step twice": (LINKED + "[linked.budget]\nepsilon = [1, 1]\nepochs = [4, 4.0]\n", "linked.budget"),
    "out of range": (LINKED + "[linked.budget]\nepsilon = [1, -2]\nepochs = [4, 8]\n", "epsilon"),
    "seeded noise beside a linked noise-seed": (
        "[sweep]\nclients = 2\nseeded-noise = true\n[linked.n]\nnoise-seed = [0, 1]\nseed = [0, 1]\n",
        "sweep.seeded-noise",
    ),
    "matched-schedule not a flag": (
        LINKED + 'matched-schedule = "yes"\n[grid]\nseed = [0]\n',
        "sweep.matched-schedule",
    ),
    "neither grid nor linked": (LINKED, "grid"),
}


@pytest.mark.parametrize("case", list(BAD_DESIGNS))
def test_a_bad_linked_design_is_refused_naming_the_field(case, tmp_path):
    text, field = BAD_DESIGNS[case]
    assert refusal(text, tmp_path).field == field


def test_the_unequal_length_refusal_says_what_is_allowed(tmp_path):
    error = refusal(BAD_DESIGNS["unequal lengths"][0], tmp_path)
    assert "has 1 values, linked.budget.epsilon has 2" in str(error)


def _finish(out: Path, found: list[Any]) -> None:
    """cell.json of every cell as a completed run would leave it (check_resumable reads only these)."""
    for cell in found:
        record = {"name": cell.name, "params": cell.params, "run_config": cell.run_config, "status": "completed"}
        (out / CELLS / cell.name).mkdir(parents=True)
        write_json(out / CELLS / cell.name / CELL_JSON, record)


def test_a_sweep_resumes_with_its_linked_groups_and_refuses_changed_ones(tmp_path):
    out = tmp_path / "out"
    _finish(out, cells(spec_of(DESIGN, tmp_path)))
    check_resumable(out, cells(spec_of(DESIGN, tmp_path)))  # the same scenario resumes
    changed = DESIGN.replace("epochs  = [4, 8, 16]", "epochs  = [4, 8, 32]")
    with pytest.raises(InputError, match="holds cell seed=0_epsilon=4_epochs=16_clip-norm=0.1") as error:
        check_resumable(out, cells(spec_of(changed, tmp_path)))
    assert error.value.field == "out"


# ---------------- client-epochs ----------------


def test_client_epochs_reach_each_clients_plan_under_the_fast_engine(tmp_path):
    config = {
        "dataset": "digits",
        "num-server-rounds": 1,
        "client-epochs": "1,2,4",
        "noise-seed": 0,
        "results-dir": str(tmp_path),
    }
    folder, _ = run_fast(config, 3, say=lambda _: None)
    plans = [json.loads((folder / "plans" / f"{index}.json").read_text()) for index in range(3)]
    assert [plan["epochs"] for plan in plans] == [1.0, 2.0, 4.0]
    assert [plan["steps"] for plan in plans] == sorted({plan["steps"] for plan in plans})  # T grows with k
    clients = pd.read_csv(folder / "clients.csv")
    assert list(clients["steps_planned"]) == [plan["steps"] for plan in plans]


def test_client_epochs_for_falls_back_to_the_common_epochs():
    settings = parse_run_config({"epochs": 3.0, "results-dir": "/r"})
    assert [settings.client_epochs_for(i, 3) for i in range(3)] == [3.0, 3.0, 3.0]
    settings = parse_run_config({"client-epochs": "4,8,16", "results-dir": "/r"})
    assert [settings.client_epochs_for(i, 3) for i in range(3)] == [4.0, 8.0, 16.0]


def test_epochs_beside_client_epochs_is_refused():
    with pytest.raises(InputError, match="client-epochs is also given") as error:
        parse_run_config({"epochs": 4.0, "client-epochs": "4,8", "results-dir": "/r"})
    assert error.value.field == "epochs"
    parse_run_config({"epochs": 0.0, "client-epochs": "4,8", "results-dir": "/r"})  # 0: unset


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (LINKED + '[run]\nepochs = 4.0\n[grid]\nclient-epochs = ["4,8"]\n', "run.epochs"),
        (LINKED + '[run]\nclient-epochs = "4,8"\n[linked.b]\nepsilon = [1, 2]\nepochs = [4, 8]\n', "linked.b.epochs"),
    ],
)
def test_a_scenario_with_epochs_beside_client_epochs_is_refused(text, field, tmp_path):
    assert refusal(text, tmp_path).field == field


def test_client_epochs_of_the_wrong_length_are_refused_naming_the_key(tmp_path):
    settings = parse_run_config({"client-epochs": "4,8", "results-dir": "/r"})
    with pytest.raises(InputError, match="3 clients, 2 values") as error:
        settings.check_clients(3)
    assert error.value.field == "client-epochs"
    text = '[sweep]\nclients = 3\n[grid]\nclient-epochs = ["4,8,8", "4,8"]\n'
    assert refusal(text, tmp_path).field == "client-epochs"


# ---------------- matched schedules ----------------


def _schedules(text: str, tmp_path: Path) -> set[str]:
    return {cell.run_config["lr-schedule"] for cell in cells(spec_of(text, tmp_path))}


RULES = LINKED + '[grid]\nrule = ["calibrated", "adp"]\nseed = [0, 1]\n'


def test_a_grid_of_rules_with_adp_gives_every_cell_adps_schedule(tmp_path):
    spec = spec_of(RULES, tmp_path)
    assert {cell.run_config["lr-schedule"] for cell in cells(spec)} == {"inverse_sqrt"}
    assert spec.to_dict()["matched_schedule"] is True and spec.to_dict()["shared_lr_schedule"] == "inverse_sqrt"
    assert "lr-schedule='inverse_sqrt'" in (schedule_note(spec) or "")
    linked = LINKED + '[linked.r]\nrule = ["calibrated", "adp"]\nlearning-rate = [1, 2]\n'
    assert _schedules(linked, tmp_path) == {"inverse_sqrt"}


def test_matched_schedule_false_keeps_each_rules_own(tmp_path):
    spec = spec_of(RULES.replace("clients = 2\n", "clients = 2\nmatched-schedule = false\n"), tmp_path)
    assert {cell.run_config["lr-schedule"] for cell in cells(spec)} == {""}
    assert spec.to_dict()["shared_lr_schedule"] is None and schedule_note(spec) is None


@pytest.mark.parametrize(
    "text",
    [
        LINKED + '[grid]\nrule = ["proactive", "calibrated"]\n',  # no adp cell
        LINKED + '[run]\nrule = "adp"\n[grid]\nseed = [0, 1]\n',  # rule not varied
        LINKED + '[run]\nlr-schedule = "constant"\n[grid]\nrule = ["calibrated", "adp"]\n',
        LINKED + '[grid]\nrule = ["calibrated", "adp"]\nlr-schedule = ["constant", "adagrad_norm"]\n',
    ],
    ids=["no adp", "rule fixed", "lr-schedule in run", "lr-schedule in grid"],
)
def test_the_schedule_is_left_alone_without_adp_beside_dpsgd_or_when_the_scenario_sets_it(text, tmp_path):
    spec = spec_of(text, tmp_path)
    given = spec.run.get("lr-schedule")
    assert _schedules(text, tmp_path) == ({given} if given else set(spec.grid.get("lr-schedule", ("",))))
    assert spec.shared_lr_schedule is None


def test_the_dry_run_says_the_schedules_are_matched(tmp_path, capsys, monkeypatch):
    scenario = tmp_path / "rules.toml"
    scenario.write_text(RULES)
    monkeypatch.setattr(sys, "argv", ["fedprivacy", "sweep", str(scenario), "--out", str(tmp_path / "o"), "--dry-run"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 0
    assert "matched schedule: every cell steps with lr-schedule='inverse_sqrt'" in " ".join(
        capsys.readouterr().err.split()
    )


def test_a_sweep_run_with_its_own_schedules_refuses_to_resume_matched(tmp_path):
    out = tmp_path / "out"
    _finish(out, cells(spec_of(RULES.replace("clients = 2\n", "clients = 2\nmatched-schedule = false\n"), tmp_path)))
    with pytest.raises(InputError, match="ran with lr-schedule=''"):
        check_resumable(out, cells(spec_of(RULES, tmp_path)))
