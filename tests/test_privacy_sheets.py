"""Planning sheets: content of one sheet, and all-or-nothing writing when something fails."""

from __future__ import annotations

import csv

import pytest

from fedprivacy.privacy import sheets
from fedprivacy.privacy.planner import plan_client


@pytest.fixture(scope="module")
def two_plans():
    return [plan_client(800 + i, 1.0, 1e-5, client_id=f"c{i}", rule="calibrated") for i in range(2)]  # two distinct figures


def test_sheet_shows_plan_certificate_conditions_and_rules(tmp_path, two_plans):
    paths = sheets.write_sheet(two_plans[0], tmp_path)
    markdown = paths["md"].read_text()
    for text in ("certified ε, PLD", "budget unused", "σC/(qN)", "certified (required)", "pld_calibrated", "c0.png"):
        assert text in markdown
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<table>" in paths["html"].read_text()


def test_epsilon_curves_end_at_the_certificate(two_plans):
    plan = two_plans[0]
    curves = sheets.epsilon_curves(plan)
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

    def fail_on_second(plan, curves, path):
        calls.append(plan.client_id)
        if len(calls) == 2:
            raise OSError("disk full (injected)")
        real(plan, curves, path)

    monkeypatch.setattr(sheets, "draw_figure", fail_on_second)
    with pytest.raises(OSError, match="injected"):
        sheets.write_sheets(two_plans, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []  # the staging folder is gone too


def test_clients_with_the_same_plan_share_one_drawing(tmp_path, monkeypatch):
    """An IID split gives many clients one plan: its figure is drawn once and copied."""
    plans = [plan_client(800, 1.0, 1e-5, client_id=f"c{i}") for i in range(3)]
    drawn = []
    real = sheets.draw_figure
    monkeypatch.setattr(sheets, "draw_figure", lambda plan, curves, path: (drawn.append(plan.client_id), real(plan, curves, path)))
    sheets.write_sheets(plans, tmp_path / "out")
    assert drawn == ["c0"]
    pngs = [(tmp_path / "out" / f"c{i}.png").read_bytes() for i in range(3)]
    assert pngs[0] == pngs[1] == pngs[2] and pngs[0][:4] == b"\x89PNG"


def test_two_clients_sharing_one_plan_get_one_sheet(tmp_path):
    """SuperNodes on one ledger account follow the plan the first of them saved, client id included."""
    plan = plan_client(800, 1.0, 1e-5, client_id="twin-a")
    written = sheets.write_sheets([plan, plan], tmp_path / "out")
    assert sorted(p.name for p in written if p.stem == "twin-a") == ["twin-a.html", "twin-a.json", "twin-a.md", "twin-a.png"]
