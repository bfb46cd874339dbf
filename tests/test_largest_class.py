"""A run that learned nothing says so: its summary, its console and a sweep's report compare the final
accuracy with always predicting the largest class of the evaluation rows."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from fedprivacy.results import beats_largest_class, largest_class_share
from fedprivacy.runconfig import parse_run_config
from server.evaluation import server_test_set
from sims.fast.engine import run_fast


def test_the_largest_class_share_and_the_margin_are_the_closed_form():
    assert largest_class_share(np.array([0, 0, 0, 1])) == 0.75
    assert largest_class_share(np.array([2, 2, 1, 0, 2])) == 0.6
    margin = 1.96 * math.sqrt(0.75 * 0.25 / 100)  # 0.0849: one run's accuracy of 0.75 on 100 rows moves this much
    assert beats_largest_class(0.75 + margin + 1e-9, 0.75, 100) is True
    assert beats_largest_class(0.75 + margin - 1e-9, 0.75, 100) is False
    assert beats_largest_class(None, 0.75, 100) is None and beats_largest_class(0.9, None, None) is None


@pytest.mark.parametrize(("learning_rate", "beats"), [(1e-9, False), (1.0, True)])
def test_a_run_says_whether_it_beats_the_largest_class(in_process, tmp_path, learning_rate, beats):
    """The fast engine on the project's defaults (PUMS, 3 rounds): with η = 10⁻⁹ the model cannot move
    from its initial weights and the run warns, naming the keys to turn; with η = 1 it learns and
    says nothing. summary.json holds the share and the verdict."""
    lines: list[str] = []
    config = {**in_process.defaults(), "learning-rate": learning_rate, "results-dir": str(tmp_path / "r")}
    folder, _ = run_fast(config, 2, say=lines.append)
    summary = json.loads((folder / "summary.json").read_text())
    test = server_test_set(parse_run_config(config), 2)
    assert summary["largest_class_share"] == largest_class_share(test.labels)  # digits: about 0.1
    assert summary["beats_largest_class"] is beats
    warned = [line for line in lines if line.startswith("warning: final accuracy")]
    assert bool(warned) is not beats
    if warned:
        assert (
            "learning-rate" in warned[0]
            and "epochs" in warned[0]
            and f"{summary['largest_class_share']:.4f}" in warned[0]
        )


def test_a_sweep_and_its_report_name_the_cells_that_learned_nothing(fedprivacy_cli, tmp_path):
    """`fedprivacy sweep` over learning-rate ∈ {10⁻⁹, 1} (fast engine, no baseline), then `fedprivacy
    report`: the console marks the first cell, sweep.csv's `beats_largest_class` is False for it and
    True for the other, and report.md lists it alone with the share it had to beat."""
    scenario = tmp_path / "flat.toml"
    scenario.write_text(
        '[sweep]\nclients = 2\nseeded-noise = true\n\n[run]\ndataset = "digits"\nnum-server-rounds = 2\n'
        "epochs = 2.0\n\n[grid]\nlearning-rate = [1e-9, 1.0]\n"
    )
    out = tmp_path / "out"

    def fedprivacy(*args: str) -> str:
        code, out, err = fedprivacy_cli(*args)
        assert code == 0, err
        return out + err

    console = fedprivacy("sweep", str(scenario), "--engine", "fast", "--no-baseline", "--out", str(out))
    flat = [line for line in console.splitlines() if "no better than the largest class" in line]
    assert len(flat) == 1 and "learning-rate=1e-09" in flat[0], console
    table = pd.read_csv(out / "sweep.csv")
    assert table["beats_largest_class"].tolist() == [False, True]
    fedprivacy("report", str(out))
    report = (out / "report" / "report.md").read_text()
    section = report.split("## Cells no better than the largest class")[1].split("\n## ")[0]
    assert "learning-rate=1e-09" in section and "learning-rate=1.0" not in section
    per_client = report.split("## Accuracy per client")[1].split("\n## ")[0]
    assert len([line for line in per_client.splitlines() if line.startswith("|")]) == 2 + 2  # a row per setting
