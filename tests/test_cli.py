"""The `fedprivacy` command as a user runs it: JSON contract, sheets for PUMS, bad input exits 2."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from harness import pums_file

CONTRACT_FIELDS = {
    "rule",
    "n",
    "epsilon",
    "delta",
    "clip_norm",
    "sigma",
    "sampling_rate",
    "expected_batch_size",
    "steps",
    "epochs",
    "epsilon_pld",
    "epsilon_rdp",
    "budget_unused",
    "conditions",
    "sigma_by_rule",
}


def fedprivacy(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fedprivacy", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_plan_json_is_one_object_with_the_contract_fields(tmp_path):
    result = fedprivacy(
        "plan",
        "--n",
        "5736",
        "--epsilon",
        "1",
        "--delta",
        "1e-5",
        "--rule",
        "calibrated",
        "--epochs",
        "8",
        "--json",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)  # the whole stdout is one JSON object
    assert set(plan) >= CONTRACT_FIELDS
    assert plan["rule"] == "calibrated" and plan["n"] == 5736
    assert plan["epochs"] == pytest.approx(8.0)
    assert plan["epochs"] == pytest.approx(plan["sampling_rate"] * plan["steps"])
    assert plan["budget_unused"] == pytest.approx(plan["epsilon"] - plan["epsilon_pld"])
    assert 0.99 <= plan["epsilon_pld"] <= 1.0
    assert all({"name", "met", "detail"} <= set(c) for c in plan["conditions"])
    assert {"naive", "strong", "rdp_calibrated", "pld_calibrated", "proactive", "adp"} <= set(plan["sigma_by_rule"])
    assert list(tmp_path.iterdir()) == []  # no sheet unless asked for


def test_plan_prints_a_table_and_writes_a_sheet_only_when_asked(tmp_path):
    result = fedprivacy("plan", "--n", "5736", "--epsilon", "1", "--delta", "1e-5", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "certified ε: PLD / RDP" in result.stdout and "epochs_vs_log_n" in result.stdout
    assert list(tmp_path.iterdir()) == [] and "planning sheet" not in result.stdout
    result = fedprivacy("plan", "--n", "5736", "--epsilon", "1", "--delta", "1e-5", "--out", "mysheet", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert {p.suffix for p in (tmp_path / "mysheet").iterdir()} == {".md", ".html", ".png", ".json"}


def test_version_and_choices_in_help(tmp_path):
    version = fedprivacy("--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("fedprivacy ") and "unknown" not in version.stdout
    help_text = fedprivacy("plan", "--help", cwd=tmp_path, env={"COLUMNS": "200"}).stdout
    assert "[proactive|calibrated|calibrated-rdp|adp]" in help_text  # the rules, as choices
    wrong = fedprivacy("plan", "--n", "100", "--epsilon", "1", "--rule", "magic", cwd=tmp_path)
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1 and "'magic' is not one of" in wrong.stderr


@pytest.mark.parametrize(
    ("args", "hint"), [(["plna"], "'plan'"), (["shee"], "'sheets', 'sweep'"), (["ledger", "shw"], "'show'")]
)
def test_a_misspelled_command_is_suggested_once(tmp_path, args, hint):
    wrong = fedprivacy(*args, cwd=tmp_path)
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1
    assert wrong.stderr.count("Did you mean") == 1 and f"Did you mean {hint}?" in wrong.stderr


def test_sheets_for_fulton_pums_gives_seven_clients_of_the_puma_sizes(tmp_path):
    data = pums_file()
    with data.open() as handle:
        expected = Counter(row["puma"] for row in csv.DictReader(handle))
    result = fedprivacy(
        "sheets",
        "--data",
        str(data),
        "--partition-by",
        "puma",
        "--epsilon",
        "1",
        "--out",
        "sheets",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    out = tmp_path / "sheets"
    with (out / "index.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 7 == len(expected)
    assert {row["client_id"]: int(row["n"]) for row in rows} == {f"puma-{k}": v for k, v in expected.items()}
    assert all(float(row["epsilon_pld"]) <= 1.0 for row in rows)
    figures = {p.name for p in out.glob("plan-*.png")}
    for row in rows:
        for suffix in (".md", ".html", ".json"):
            assert (out / f"{row['client_id']}{suffix}").stat().st_size > 0
        assert len([f for f in figures if f in (out / f"{row['client_id']}.md").read_text()]) == 1
    assert 1 <= len(figures) <= 7  # one per distinct plan: PUMAs whose plans agree share one
    for name in ("index.md", "index.html"):
        assert "puma-1107" in (out / name).read_text()


def test_sheets_accepts_one_budget_per_client(tmp_path):
    result = fedprivacy(
        "sheets",
        "--data",
        str(pums_file()),
        "--partition-by",
        "puma",
        "--epsilons",
        "0.5,1,1,2,2,4,8",
        "--rule",
        "calibrated",
        "--out",
        "sheets",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    with (tmp_path / "sheets" / "index.csv").open() as handle:
        budgets = [float(row["epsilon"]) for row in csv.DictReader(handle)]
    assert budgets == [0.5, 1, 1, 2, 2, 4, 8]


@pytest.mark.parametrize(
    "args, field",
    [
        (["--n", "1", "--epsilon", "1"], "n"),
        (["--n", "100", "--epsilon", "0"], "epsilon"),
        (["--n", "100", "--epsilon", "-1"], "epsilon"),
        (["--n", "100", "--epsilon", "inf"], "epsilon"),
        (["--n", "100", "--epsilon", "nan"], "epsilon"),
        (["--n", "100", "--epsilon", "1", "--delta", "0"], "delta"),
        (["--n", "100", "--epsilon", "1", "--delta", "1.5"], "delta"),
        (["--n", "100", "--epsilon", "1", "--clip-norm", "0"], "clip-norm"),
        (["--n", "100", "--epsilon", "1", "--sampling-rate", "0"], "sampling-rate"),
        (["--n", "100", "--epsilon", "1", "--sampling-rate", "2"], "sampling-rate"),
        (["--n", "100", "--epsilon", "1", "--epochs", "0"], "epochs"),
    ],
)
def test_plan_bad_input_exits_2_with_one_line_and_no_files(tmp_path, args, field):
    result = fedprivacy("plan", *args, "--out", "out", cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {field}=")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["plan", "--n", "abc", "--epsilon", "1"], "'--n': 'abc' is not a valid integer"),
        (["plan", "--n", "100", "--epsilon", "1", "--frobnicate"], "--frobnicate"),
        (["plan", "--epsilon", "1"], "--n"),
    ],
)
def test_click_usage_errors_are_one_line_too(tmp_path, args, needle):
    result = fedprivacy(*args, cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr


def test_an_unwritable_out_is_one_line_and_leaves_it_alone(tmp_path):
    (tmp_path / "taken").write_text("not a folder")
    result = fedprivacy("plan", "--n", "100", "--epsilon", "1", "--out", "taken", cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: out=") and "cannot write the sheets there" in lines[0]
    assert (tmp_path / "taken").read_text() == "not a folder"


def test_sheets_bad_csv_inputs_exit_2_with_no_output(tmp_path):
    (tmp_path / "empty.csv").write_text("")
    (tmp_path / "header.csv").write_text("puma,age\n")
    (tmp_path / "tiny.csv").write_text("puma,age\n1,30\n1,40\n2,50\n")
    cases = [
        ("missing.csv", "puma", "data="),
        ("empty.csv", "puma", "data="),
        ("header.csv", "puma", "data="),
        ("tiny.csv", "region", "partition-by='region': not a column of"),
        ("tiny.csv", "puma", "partition-by puma"),
    ]
    for name, column, message in cases:
        result = fedprivacy(
            "sheets", "--data", str(tmp_path / name), "--partition-by", column, "--out", "out", cwd=tmp_path
        )
        assert result.returncode == 2, (name, result.stderr)
        assert result.stderr.strip().startswith(f"error: {message}"), result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "out").exists()


def test_sheets_take_one_of_epsilon_and_epsilons_and_refuse_in_one_line(tmp_path):
    base = ("sheets", "--data", str(pums_file()), "--partition-by", "puma", "--out", "out")
    both = fedprivacy(*base, "--epsilon", "1", "--epsilons", "1,2,3,4,5,6,7", cwd=tmp_path)
    assert both.returncode == 2 and both.stderr.startswith("error: epsilons='1,2,3,4,5,6,7': give either --epsilon")
    refused = fedprivacy(*base, "--epsilon", "0", cwd=tmp_path)
    assert (
        refused.returncode == 2 and refused.stderr.startswith("error: epsilon=0.0") and refused.stderr.count("\n") == 1
    )
    assert not (tmp_path / "out").exists()


def test_calculator_says_which_grid_points_it_left_out(tmp_path):
    result = fedprivacy(
        "calculator", "--n", "10", "--epsilon", "1", "--delta", "0.01", "--rule", "proactive", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    said = " ".join(result.stdout.split())
    assert "left out: q = 0.005, 0.01, 0.02, 0.05: an expected batch below one record" in said
    assert "1 grid point the rule does not certify" in said


def test_calculator_json_lists_ranked_certified_plans(tmp_path):
    result = fedprivacy("calculator", "--n", "2000", "--epsilon", "2", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert rows and all(r["epsilon_pld"] <= 2.0 for r in rows)
    assert sum(r["rank_at_equal_epochs"] == 1 for r in rows) == len({round(r["epochs"]) for r in rows})
