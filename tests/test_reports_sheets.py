"""Planning sheets: content of one sheet, one figure per distinct plan, and all-or-nothing writing."""

from __future__ import annotations

import csv
import json

import pytest

from fedprivacy.privacy.planner import plan_client
from fedprivacy.reports import sheets


@pytest.fixture(scope="module")
def two_plans():
    """Two clients with different budgets, hence different plans and figures."""
    return [
        plan_client(800, epsilon, 1e-5, client_id=f"c{i}", rule="calibrated") for i, epsilon in enumerate((1.0, 2.0))
    ]


def test_sheet_shows_plan_certificate_conditions_and_rules(tmp_path, two_plans):
    paths = sheets.write_sheet(two_plans[0], tmp_path)
    markdown = paths["md"].read_text()
    for text in (
        "certified ε, PLD",
        "budget unused",
        "σC/(qN)",
        "certified (required)",
        "pld_calibrated",
        paths["png"].name,
    ):
        assert text in markdown
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<table>" in paths["html"].read_text() and paths["png"].name in paths["html"].read_text()


def test_clients_with_the_same_plan_share_one_figure_and_others_get_their_own(tmp_path, two_plans):
    # N differs (800 vs 900) but ε, δ, rule, σ, q and T agree: the figure shows none of N, so it is shared
    same = [plan_client(n, 1.0, 1e-5, client_id=f"s{n}", rule="calibrated") for n in (800, 900)]
    assert sheets.PlanFigure.of(same[0]) == sheets.PlanFigure.of(same[1])
    written = sheets.write_sheets([*same, two_plans[1]], tmp_path / "out")
    figures = sorted(p.name for p in written if p.suffix == ".png")
    assert len(figures) == 2
    assert (
        sheets.PlanFigure.of(same[0]).file_name in figures and sheets.PlanFigure.of(two_plans[1]).file_name in figures
    )
    links = {
        p.stem: next(f for f in figures if f in p.read_text())
        for p in written
        if p.suffix == ".md" and p.stem != "index"
    }
    assert links["s800"] == links["s900"] != links["c1"]
    # the same inputs give the same figure file in another folder, another time
    assert sheets.write_sheet(same[1], tmp_path / "again")["png"].name == links["s800"]


def test_a_plan_made_without_the_rule_comparison_gets_it_on_its_sheet(tmp_path):
    """Clients of a run plan without the comparison (it is sheet content); the sheet adds it."""
    plan = plan_client(800, 1.0, 1e-5, client_id="p", rule="proactive", compare=False)
    assert plan.sigma_by_rule == {} and plan.moments_constant is None
    sheets.write_sheets([plan], tmp_path / "out")
    shown = json.loads((tmp_path / "out" / "p.json").read_text())
    calibrated = plan_client(800, 1.0, 1e-5, rule="calibrated", sampling_rate=plan.sampling_rate, steps=plan.steps)
    assert shown["sigma_by_rule"]["proactive"] == plan.sigma
    assert shown["sigma_by_rule"]["pld_calibrated"] == pytest.approx(calibrated.sigma)
    assert shown["moments_constant"] is not None
    assert "| rdp_calibrated |" in (tmp_path / "out" / "p.md").read_text()


def test_epsilon_curves_end_at_the_certificate(two_plans):
    plan = two_plans[0]
    curves = sheets.epsilon_curves(sheets.PlanFigure.of(plan))
    assert curves["steps"][-1] == plan.steps
    assert curves["PLD"][-1] == pytest.approx(plan.epsilon_pld, rel=0.01)
    assert curves["RDP"][-1] == pytest.approx(plan.epsilon_rdp, rel=1e-6)
    assert curves["naive"][-1] == pytest.approx(plan.epsilon_bounds["naive"], rel=1e-6)


def test_index_csv_has_one_row_per_client(tmp_path, two_plans):
    sheets.write_sheets(two_plans, tmp_path / "out")
    with (tmp_path / "out" / "index.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [r["client_id"] for r in rows] == ["c0", "c1"]
    assert float(rows[0]["sigma_pld_calibrated"]) == pytest.approx(two_plans[0].sigma)


def test_a_failure_while_writing_leaves_no_partial_output(tmp_path, two_plans, monkeypatch):
    real = sheets.draw_figure
    calls = []

    def fail_on_second(figure, curves, path):
        calls.append(figure)
        if len(calls) == 2:
            raise OSError("disk full (injected)")
        real(figure, curves, path)

    monkeypatch.setattr(sheets, "draw_figure", fail_on_second)
    with pytest.raises(OSError, match="injected"):
        sheets.write_sheets(two_plans, tmp_path / "out")
    assert len(calls) == 2
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []  # the staging folder is gone too


def test_importing_the_reports_selects_no_matplotlib_backend():
    import subprocess
    import sys

    code = (
        "import matplotlib, fedprivacy.reports.sheets, fedprivacy.reports.progress_figure, fedprivacy.results; "
        "import sys; print(matplotlib.rcParams._get_backend_or_none(), 'matplotlib.pyplot' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"MPLBACKEND": "svg", "PATH": ""},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["svg", "False"]


def test_two_clients_sharing_one_plan_get_one_sheet(tmp_path):
    """SuperNodes on one ledger account follow the plan the first of them saved, client id included."""
    plan = plan_client(800, 1.0, 1e-5, client_id="twin-a")
    written = sheets.write_sheets([plan, plan], tmp_path / "out")
    assert sorted(p.name for p in written if p.stem == "twin-a") == [
        "twin-a.html",
        "twin-a.json",
        "twin-a.md",
    ]
    assert len([p for p in written if p.suffix == ".png"]) == 1
