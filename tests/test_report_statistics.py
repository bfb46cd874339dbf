"""The sweep report's statistics: t-intervals over seeds, paired differences, binomial standard errors.

Each number is checked against a computation that does not go through fedprivacy.reports: scipy's
own t-tests (`ttest_1samp`, `ttest_rel`) and their confidence intervals, hand formulas with the
t quantile written out, and, for the recorded evaluation rows, the data set's size minus the
clients' training rows. Sweep folders are written by hand for the unit tests (as the sweep writes
them: sweep.json, sweep.csv, cells/<cell>/cell.json and the run's rounds.csv, clients.csv,
summary.json); one real sweep on the fast engine checks the report end to end.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from fedprivacy import cli
from fedprivacy.reports.statistics import binomial_se, holm_adjusted, paired_difference, t_interval
from fedprivacy.reports.sweep_report import write_report
from fedprivacy.reports.sweep_tuning import tuning_markdown
from fedprivacy.sweepfiles import RESULT_COLUMNS

T_975_1 = 12.706204736174698  # t_{0.975, 1}, from tables: the hand formula's quantile for two values


def test_t_interval_is_scipys_one_sample_interval_and_the_hand_formula():
    values = [0.61, 0.58, 0.66, 0.63, 0.59]
    interval = t_interval(values)
    expected = stats.ttest_1samp(values, 0.0).confidence_interval(0.95)
    assert interval.n == 5 and interval.mean == pytest.approx(np.mean(values), abs=1e-15)
    assert interval.sd == pytest.approx(np.std(values, ddof=1), abs=1e-15)
    assert (interval.low, interval.high) == pytest.approx((expected.low, expected.high), abs=1e-12)
    two = t_interval([0.5, 0.6])  # s = 0.1/√2, half width = t · s / √2 = t · 0.05
    assert (two.low, two.high) == pytest.approx((0.55 - T_975_1 * 0.05, 0.55 + T_975_1 * 0.05), abs=1e-12)
    one = t_interval([0.7])
    assert (one.n, one.mean, one.sd, one.low, one.high) == (1, 0.7, None, None, None)
    assert not one.excludes_zero


def test_a_paired_difference_is_the_mean_of_per_seed_differences_over_the_shared_seeds():
    a = {0: 0.50, 1: 0.60, 2: 0.70, 3: 0.55}
    b = {1: 0.65, 2: 0.72, 3: 0.61, 4: 0.90}  # seeds 0 and 4 are not shared
    pair = paired_difference(a, b)
    assert pair is not None and pair.seeds == (1, 2, 3)
    expected = stats.ttest_rel([0.65, 0.72, 0.61], [0.60, 0.70, 0.55]).confidence_interval(0.95)
    assert pair.interval.mean == pytest.approx((0.05 + 0.02 + 0.06) / 3, abs=1e-12)
    assert (pair.interval.low, pair.interval.high) == pytest.approx((expected.low, expected.high), abs=1e-12)
    assert pair.resolved == (expected.low > 0 or expected.high < 0)
    assert paired_difference({0: 0.5}, {1: 0.6}) is None
    single = paired_difference({0: 0.5, 1: 0.4}, {1: 0.9})
    assert single is not None and single.interval.n == 1 and single.interval.low is None and not single.resolved


def test_binomial_standard_error():
    assert binomial_se(0.8, 400) == pytest.approx(0.02, abs=1e-15)  # sqrt(0.8 · 0.2 / 400)
    assert binomial_se(0.5, 100) == pytest.approx(0.05, abs=1e-15)
    assert binomial_se(0.8, None) is None and binomial_se(0.8, float("nan")) is None


def write_sweep(
    folder: Path,
    grid: dict[str, list],
    accuracy: Callable[[dict], float],
    evaluation_rows: Callable[[dict], int | None] = lambda _: 300,
    spent: Callable[[dict], float] = lambda params: float(params.get("epsilon", 1.0)),
    failed: Callable[[dict], bool] = lambda _: False,
    baselines: list[dict] = (),
    linked: dict[str, dict[str, list]] | None = None,
) -> Path:
    """A sweep folder as the sweep writes one, cells in grid order: [grid]'s keys, then each linked
    group as one axis whose i-th step sets each of its keys' i-th value, the last axis fastest."""
    linked = linked or {}
    axes = [[{key: value} for value in values] for key, values in grid.items()]
    axes += [[dict(zip(group, step)) for step in zip(*group.values())] for group in linked.values()]
    rows = []
    for steps in itertools.product(*axes):
        params = {key: value for step in steps for key, value in step.items()}
        name = "_".join(f"{k}={v}" for k, v in params.items())
        row = {
            **params,
            **dict.fromkeys(RESULT_COLUMNS),
            "status": "failed" if failed(params) else "completed",
            "cell": f"cells/{name}",
        }
        if row["status"] == "completed":
            final, used = accuracy(params), spent(params)
            budget = float(params.get("epsilon", 1.0))
            run = folder / "cells" / name / "run"
            run.mkdir(parents=True)
            pd.DataFrame(
                {"round": [1, 2], "accuracy": [final / 2, final], "epsilon_spent_max": [used / 2, used]}
            ).to_csv(run / "rounds.csv", index=False)
            pd.DataFrame(
                {"client_id": ["a", "b"], "epsilon_budget": [budget] * 2, "epsilon_spent": [used, used / 2]}
            ).assign(status="ok").to_csv(run / "clients.csv", index=False)
            summary = {"status": "completed", "final_accuracy": final, "evaluation_rows": evaluation_rows(params)}
            (run / "summary.json").write_text(json.dumps(summary))
            (folder / "cells" / name / "cell.json").write_text(json.dumps({"params": params, "run_folder": "run"}))
            row.update(
                final_accuracy=final,
                best_accuracy=final,
                epsilon_spent_max=used,
                epsilon_spent_mean=0.75 * used,
                all_within_budget=used <= budget,
            )
        else:
            row["error"] = "RuntimeError: injected"
        rows.append(row)
    pd.DataFrame(rows).to_csv(folder / "sweep.csv", index=False)
    (folder / "sweep.json").write_text(json.dumps({"name": "by hand", "grid": grid, "linked": linked}))
    for record in baselines:
        (folder / "baseline" / record["name"]).mkdir(parents=True)
        (folder / "baseline" / record["name"] / "baseline.json").write_text(json.dumps(record))
        pd.DataFrame({"round": [1, 2], "accuracy": [0.5, record["final_accuracy"]]}).to_csv(
            folder / "baseline" / record["name"] / "rounds.csv", index=False
        )
    return folder


def markdown_table(markdown: str, heading: str) -> pd.DataFrame:
    """The first table after `heading`, its cells as strings."""
    lines = markdown.splitlines()
    start = next(i for i in range(lines.index(heading), len(lines)) if lines[i].startswith("|"))
    table = list(itertools.takewhile(lambda line: line.startswith("|"), lines[start:]))
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in table]
    return pd.DataFrame(cells[2:], columns=cells[0])


# Known accuracies, 2 rules × 2 ε × 4 seeds: proactive is higher by 0.04 ± 0.01 at ε = 1 (resolved),
# and within ±0.05 of calibrated at ε = 4 (not resolved); ε = 4 is higher than ε = 1 for both.
FINALS = {
    ("calibrated", 1.0): [0.60, 0.55, 0.65, 0.58],
    ("proactive", 1.0): [0.64, 0.60, 0.68, 0.62],
    ("calibrated", 4.0): [0.80, 0.76, 0.84, 0.79],
    ("proactive", 4.0): [0.85, 0.72, 0.86, 0.78],
}
ROWS = {0: 300, 1: 290, 2: 300, 3: 300}  # seed 1 splits off fewer evaluation rows


@pytest.fixture(scope="module")
def hand_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_sweep(
        tmp_path_factory.mktemp("hand"),
        {"rule": ["calibrated", "proactive"], "epsilon": [1.0, 4.0], "seed": [0, 1, 2, 3]},
        lambda p: FINALS[(p["rule"], p["epsilon"])][p["seed"]],
        evaluation_rows=lambda p: ROWS[p["seed"]],
        spent=lambda p: p["epsilon"] * (0.5 if p["rule"] == "proactive" else 1.0) * (1 - 0.01 * p["seed"]),
        baselines=[
            {
                "name": "default",
                "status": "completed",
                "params": {},
                "final_accuracy": 0.9,
                "best_accuracy": 0.9,
                "schedule_from": "rule=calibrated_epsilon=1.0_seed=1",
            }
        ],
    )
    write_report(folder)
    return folder


def test_the_accuracy_table_gives_intervals_over_seeds_and_the_binomial_se_of_the_recorded_rows(hand_sweep):
    markdown = (hand_sweep / "report" / "report.md").read_text()
    table = markdown_table(markdown, "## Accuracy")
    assert list(table.columns[:9]) == [
        "rule",
        "epsilon",
        "seeds",
        "final_accuracy_mean",
        "final_accuracy_sd",
        "ci95_low",
        "ci95_high",
        "binomial_se",
        "evaluation_rows",
    ]
    assert len(table) == len(FINALS)
    for row in table.itertuples():
        finals = FINALS[(row.rule, float(row.epsilon))]
        interval = stats.ttest_1samp(finals, 0.0).confidence_interval(0.95)
        mean = sum(finals) / len(finals)
        assert int(row.seeds) == 4 and float(row.final_accuracy_mean) == pytest.approx(mean, abs=5e-5)
        assert float(row.final_accuracy_sd) == pytest.approx(np.std(finals, ddof=1), abs=5e-5)
        assert float(row.ci95_low) == pytest.approx(interval.low, abs=5e-5)
        assert float(row.ci95_high) == pytest.approx(interval.high, abs=5e-5)
        assert int(row.evaluation_rows) == 290  # the fewest over the arm's seeds
        assert float(row.binomial_se) == pytest.approx(math.sqrt(mean * (1 - mean) / 290), abs=5e-5)
    baseline = markdown_table(markdown, "### Non-private baseline")  # the rows of the cell it took its schedule from
    assert baseline.loc[0, "evaluation_rows"] == "290"
    assert float(baseline.loc[0, "binomial_se"]) == pytest.approx(math.sqrt(0.9 * 0.1 / 290), abs=5e-5)
    assert "settings ran one seed" not in markdown


def test_paired_differences_are_per_seed_means_and_not_resolved_exactly_when_the_interval_holds_zero(hand_sweep):
    pairs = pd.read_csv(hand_sweep / "report" / "paired_differences.csv")
    assert sorted(zip(pairs["differs_in"], pairs["a"].astype(str), pairs["b"].astype(str))) == [
        ("epsilon", "1.0", "4.0"),
        ("epsilon", "1.0", "4.0"),
        ("rule", "calibrated", "proactive"),
        ("rule", "calibrated", "proactive"),
    ]
    for row in pairs.itertuples():
        if row.differs_in == "rule":
            a, b = FINALS[("calibrated", row.epsilon)], FINALS[("proactive", row.epsilon)]
        else:
            a, b = FINALS[(row.rule, 1.0)], FINALS[(row.rule, 4.0)]
        expected = stats.ttest_rel(b, a).confidence_interval(0.95)
        assert row.shared_seeds == 4
        assert row.difference_mean == pytest.approx(np.mean(np.subtract(b, a)), abs=1e-12)
        assert (row.ci95_low, row.ci95_high) == pytest.approx((expected.low, expected.high), abs=1e-12)
        holds_zero = expected.low <= 0 <= expected.high
        assert (row.verdict == "not resolved") == holds_zero
        if not holds_zero:
            assert row.verdict == ("b higher" if expected.low > 0 else "b lower")
    assert set(pairs["verdict"]) == {"not resolved", "b higher"}  # the fixture has both kinds
    markdown = (hand_sweep / "report" / "report.md").read_text()
    rule = markdown_table(markdown, "### rule: b − a")
    assert list(rule.columns) == [
        "epsilon",
        "a",
        "b",
        "shared_seeds",
        "difference_mean",
        "ci95_low",
        "ci95_high",
        "verdict",
    ]
    shown = {float(r.epsilon): r.verdict for r in rule.itertuples()}
    assert shown == {1.0: "b higher", 4.0: "not resolved"}
    assert markdown.index("## Paired differences") < markdown.index("## Accuracy per round")


def test_the_figures_have_interval_bars_and_accuracy_against_epsilon_spent(hand_sweep):
    report = hand_sweep / "report"
    for stem in ("accuracy_vs_epsilon", "accuracy_vs_epsilon_spent"):
        assert (report / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "<svg" in (report / f"{stem}.svg").read_text()[:1000]
    markdown = (report / "report.md").read_text()
    assert "](accuracy_vs_epsilon_spent.png)" in markdown


def test_one_seed_gives_no_interval_and_an_unresolved_pair_and_missing_rows_no_binomial_se(tmp_path):
    """proactive's seed 1 failed: its arm has one seed (no interval) and shares one seed with calibrated;
    a results folder from before summary.json held evaluation_rows leaves the binomial s.e. blank."""
    folder = write_sweep(
        tmp_path,
        {"rule": ["calibrated", "proactive"], "seed": [0, 1]},
        lambda p: 0.6 + 0.1 * (p["rule"] == "proactive") + 0.01 * p["seed"],
        evaluation_rows=lambda _: None,
        failed=lambda p: p["rule"] == "proactive" and p["seed"] == 1,
    )
    write_report(folder)
    markdown = (folder / "report" / "report.md").read_text()
    table = markdown_table(markdown, "## Accuracy").set_index("rule")
    assert table.loc["proactive", "seeds"] == "1" and table.loc["proactive", "ci95_low"] == "—"
    assert table.loc["calibrated", "ci95_low"] != "—" and table.loc["calibrated", "binomial_se"] == "—"
    assert "1 of 2 settings ran one seed: no sd and no interval (—) for them." in markdown
    pairs = markdown_table(markdown, "### rule: b − a")
    assert pairs.loc[0, "shared_seeds"] == "1" and pairs.loc[0, "verdict"] == "not resolved"
    assert pairs.loc[0, "ci95_low"] == "—" and float(pairs.loc[0, "difference_mean"]) == pytest.approx(0.1, abs=5e-5)


def test_a_key_with_many_values_shows_neighbouring_pairs_and_keeps_all_in_the_csv(tmp_path):
    epsilons = [0.5, 1.0, 2.0, 4.0, 8.0]
    folder = write_sweep(
        tmp_path,
        {"epsilon": epsilons, "seed": [0, 1, 2]},
        lambda p: 0.5 + 0.04 * epsilons.index(p["epsilon"]) + 0.01 * p["seed"] ** 2,
    )
    write_report(folder)
    assert len(pd.read_csv(folder / "report" / "paired_differences.csv")) == 10  # 5 choose 2
    markdown = (folder / "report" / "report.md").read_text()
    heading = "### epsilon: b − a (6 more, of values further apart, in paired_differences.csv)"
    shown = markdown_table(markdown, heading)
    assert [(float(a), float(b)) for a, b in zip(shown["a"], shown["b"])] == list(zip(epsilons, epsilons[1:]))
    assert set(shown["verdict"]) == {"b higher"}  # the same +0.04 on every seed: an interval of width 0


def test_a_linked_group_is_one_axis_of_the_paired_differences(tmp_path):
    """[linked.budget] steps ε and epochs together: arms keep both keys, and pairs along the budget
    change both at once (no pair of arms differs in ε alone)."""
    finals = {(1.0, 2): [0.50, 0.55, 0.52], (4.0, 8): [0.70, 0.71, 0.69]}
    folder = write_sweep(
        tmp_path,
        {"rule": ["calibrated", "proactive"], "seed": [0, 1, 2]},
        lambda p: finals[(p["epsilon"], p["epochs"])][p["seed"]] + 0.02 * (p["rule"] == "proactive"),
        linked={"budget": {"epsilon": [1.0, 4.0], "epochs": [2, 8]}},
    )
    write_report(folder)
    markdown = (folder / "report" / "report.md").read_text()
    arms = markdown_table(markdown, "## Accuracy")
    assert list(arms.columns[:4]) == ["rule", "epsilon", "epochs", "seeds"] and set(arms["seeds"]) == {"3"}
    pairs = pd.read_csv(folder / "report" / "paired_differences.csv")
    assert set(pairs["differs_in"]) == {"rule", "budget (epsilon, epochs)"} and len(pairs) == 4
    budget = markdown_table(markdown, "### budget (epsilon, epochs): b − a")
    assert list(budget["a"]) == ["epsilon=1.0, epochs=2"] * 2 and list(budget["b"]) == ["epsilon=4.0, epochs=8"] * 2
    for row in budget.itertuples():
        expected = np.subtract(finals[(4.0, 8)], finals[(1.0, 2)]).mean()
        assert float(row.difference_mean) == pytest.approx(expected, abs=5e-5) and row.verdict == "b higher"
    rule = markdown_table(markdown, "### rule: b − a")
    assert list(rule.columns[:2]) == ["epsilon", "epochs"] and set(rule["verdict"]) == {"b higher"}


def test_a_real_sweep_records_its_evaluation_rows_and_the_report_renders(tmp_path, capsys, monkeypatch):
    """digits, 2 clients, 2 rounds, ε ∈ {1, 2} × 2 seeds on the fast engine (tests/test_sweep.py's report
    test runs the ServerApp's cells and their baseline)."""
    scenario = tmp_path / "seeds.toml"
    scenario.write_text(
        "[sweep]\nclients = 2\nseeded-noise = true\n\n"
        '[run]\ndataset = "digits"\nnum-server-rounds = 2\nepochs = 2.0\n\n'
        '[grid]\nepsilon = [1, 2]\nrule = ["calibrated"]\nseed = [0, 1]\n'
    )
    out = tmp_path / "sweep"
    for args in (
        ["sweep", str(scenario), "--engine", "fast", "--no-baseline", "--out", str(out)],
        ["report", str(out)],
    ):
        monkeypatch.setattr(sys, "argv", ["fedprivacy", *args])
        with pytest.raises(SystemExit) as exit_info:
            cli.main()
        assert exit_info.value.code == 0, capsys.readouterr().err
    from sklearn.datasets import load_digits

    digits = len(load_digits().target)
    cells = pd.read_csv(out / "sweep.csv")
    rows = {}
    for cell in cells["cell"]:
        record = json.loads((out / cell / "cell.json").read_text())
        run = out / cell / record["run_folder"]
        summary = json.loads((run / "summary.json").read_text())
        trained = pd.read_csv(run / "clients.csv")["num_examples"].sum()
        assert summary["evaluation_rows"] == digits - trained  # every row not trained on is evaluated on
        rows[cell] = summary["evaluation_rows"]
    markdown = (out / "report" / "report.md").read_text()
    table = markdown_table(markdown, "## Accuracy")
    for row in table.itertuples():
        finals = cells.loc[cells["epsilon"] == float(row.epsilon), "final_accuracy"].to_numpy()
        interval = stats.ttest_1samp(finals, 0.0).confidence_interval(0.95)
        m = min(rows[c] for c in cells.loc[cells["epsilon"] == float(row.epsilon), "cell"])
        assert float(row.ci95_low) == pytest.approx(interval.low, abs=5e-5)
        assert float(row.ci95_high) == pytest.approx(interval.high, abs=5e-5)
        assert float(row.binomial_se) == pytest.approx(math.sqrt(finals.mean() * (1 - finals.mean()) / m), abs=5e-5)
    pairs = markdown_table(markdown, "### epsilon: b − a")
    assert len(pairs) == 1 and pairs.loc[0, "shared_seeds"] == "2"
    assert (out / "report" / "accuracy_vs_epsilon_spent.png").is_file()


def test_figures_cut_accuracy_bars_at_0_and_1_and_name_paths_by_their_file():
    """Two seeds give t₀.₉₇₅,₁ = 12.7: a 95% interval around 0.9 or 0.1 runs far past 1 or 0; the
    bars stop there (a mean accuracy lies in [0, 1]). A data path in a legend is its file name."""
    from fedprivacy.reports.sweep_figures import _accuracy_bars, label

    bars = _accuracy_bars([0.9, 0.1, 0.5], [0.5, 0.5, 0.2])
    np.testing.assert_allclose(bars, [[0.5, 0.1, 0.2], [0.1, 0.5, 0.2]], atol=1e-12)
    half = t_interval([0.2, 0.9]).high - 0.55  # the interval two seeds give: half width 4.4
    assert half > 4 and _accuracy_bars([0.55], [half]).tolist() == [[0.55], [pytest.approx(0.45)]]
    assert (
        label(["data-path", "epsilon"], ["/home/me/data/digits_8x8.npz", 0.5])
        == "data-path=digits_8x8.npz, epsilon=0.5"
    )


def test_no_two_baselines_look_alike():
    """A baseline of one series takes its series' colour, dashed; the others are black in a style each."""
    from fedprivacy.reports.sweep_figures import _baseline_style

    colours = {"learning-rate=0.3": "C0", "learning-rate=1": "C1"}
    own = [_baseline_style(["learning-rate"], [v], ["learning-rate"], colours, i) for i, v in enumerate((0.3, 1.0))]
    assert own == [("C0", "--"), ("C1", "--")]
    shared = [_baseline_style(["epochs"], [k], ["rule"], colours, i) for i, k in enumerate((1, 2, 4))]
    assert len(set(shared)) == 3 and {colour for colour, _ in shared} == {"black"}


# ---------------- p-values, Holm's correction and what a tuned sweep's pairs compare ----------------


def test_a_paired_p_value_is_scipys_one_sample_t_test_on_the_per_seed_differences(hand_sweep):
    """Every pair of the hand sweep against ttest_1samp on its differences; the edge cases by hand."""
    pairs = pd.read_csv(hand_sweep / "report" / "paired_differences.csv")
    assert len(pairs) == 4 and "p_holm" not in pairs and "tuned_a" not in pairs
    for row in pairs.itertuples():
        if row.differs_in == "rule":
            a, b = FINALS[("calibrated", row.epsilon)], FINALS[("proactive", row.epsilon)]
        else:
            a, b = FINALS[(row.rule, 1.0)], FINALS[(row.rule, 4.0)]
        expected = stats.ttest_1samp(np.subtract(b, a), 0.0).pvalue
        assert row.p_value == pytest.approx(expected, rel=1e-9)
    one = paired_difference({0: 0.5, 1: 0.4}, {1: 0.9})
    assert one is not None and one.p_value is None  # one shared seed: no test
    same = paired_difference({0: 0.5, 1: 0.25}, {0: 0.75, 1: 0.5})  # +0.25 exactly on both seeds: sd 0
    assert same is not None and same.interval.sd == 0 and same.p_value == 0.0
    none = paired_difference({0: 0.5, 1: 0.25}, {0: 0.5, 1: 0.25})
    assert none is not None and none.p_value == 1.0


def test_holm_adjusts_a_family_as_the_closed_form_gives():
    """Sorted 0.005, 0.01, 0.03, 0.04 (m = 4) times 4, 3, 2, 1: 0.02, 0.03, 0.06, 0.04; running max
    0.02, 0.03, 0.06, 0.06. A None stays out of the family (m stays 4) and comes back None."""
    adjusted = holm_adjusted([0.01, 0.04, None, 0.03, 0.005])
    assert adjusted[2] is None
    assert [adjusted[i] for i in (0, 1, 3, 4)] == pytest.approx([0.03, 0.06, 0.06, 0.02], abs=1e-15)
    assert holm_adjusted([0.5, 0.6]) == [1.0, 1.0]  # 2 · 0.5 capped at 1, and no lower after it
    assert holm_adjusted([]) == [] and holm_adjusted([None]) == [None]


# rule at ε = 1 is higher by +0.03, +0.05, +0.01, +0.04 (p 0.032: resolved alone, not among 2 tests);
# ε = 4 against ε = 1 for calibrated by +0.05, −0.03, +0.02, −0.01 (p 0.70); proactive at ε = 4 ran seed 0 only.
CALIBRATED = [0.60, 0.55, 0.65, 0.58]
RULE_GAIN = [0.03, 0.05, 0.01, 0.04]
EPSILON_GAIN = [0.05, -0.03, 0.02, -0.01]


def _holm_accuracy(p: dict) -> float:
    seed = p["seed"]
    return CALIBRATED[seed] + RULE_GAIN[seed] * (p["rule"] == "proactive") + EPSILON_GAIN[seed] * (p["epsilon"] == 4)


def test_report_holm_adds_adjusted_p_values_over_every_pair_with_one(tmp_path, capsys, monkeypatch):
    folder = write_sweep(
        tmp_path / "sweep",
        {"rule": ["calibrated", "proactive"], "epsilon": [1.0, 4.0], "seed": [0, 1, 2, 3]},
        _holm_accuracy,
        failed=lambda p: p["rule"] == "proactive" and p["epsilon"] == 4.0 and p["seed"] > 0,
    )
    for args, out in (([], "plain"), (["--holm"], "holm")):
        monkeypatch.setattr(sys, "argv", ["fedprivacy", "report", str(folder), "--out", str(tmp_path / out), *args])
        with pytest.raises(SystemExit) as exit_info:
            cli.main()
        assert exit_info.value.code == 0, capsys.readouterr().err
    plain = pd.read_csv(tmp_path / "plain" / "paired_differences.csv")
    assert "p_holm" not in plain and "verdict_holm" not in plain
    assert "p_holm" not in (tmp_path / "plain" / "report.md").read_text()
    pairs = pd.read_csv(tmp_path / "holm" / "paired_differences.csv").set_index(["differs_in", "rule", "epsilon"])
    p_rule = stats.ttest_1samp(np.array(RULE_GAIN), 0.0).pvalue
    p_epsilon = stats.ttest_1samp(np.array(EPSILON_GAIN), 0.0).pvalue
    assert p_rule < 0.05 < 2 * p_rule < p_epsilon  # so Holm takes back the rule's verdict
    rule = pairs.loc[("rule", np.nan, 1.0)]
    epsilon = pairs.loc[("epsilon", "calibrated", np.nan)]
    assert rule.p_holm == pytest.approx(2 * p_rule, rel=1e-9)  # the smaller of m = 2: 2 · p
    assert epsilon.p_holm == pytest.approx(max(2 * p_rule, p_epsilon), rel=1e-9)
    assert (rule.verdict, rule.verdict_holm) == ("b higher", "not resolved")
    assert epsilon.verdict_holm == "not resolved"
    single = [pairs.loc[("rule", np.nan, 4.0)], pairs.loc[("epsilon", "proactive", np.nan)]]
    assert all(row.shared_seeds == 1 and pd.isna(row.p_value) for row in single)
    assert all(pd.isna(row.p_holm) and pd.isna(row.verdict_holm) for row in single)  # outside the family
    markdown = (tmp_path / "holm" / "report.md").read_text()
    assert "Holm 1979" in markdown and "(2 in all: every axis" in markdown
    shown = markdown_table(markdown, "### rule: b − a")
    assert list(shown.columns[-3:]) == ["p_value", "p_holm", "verdict_holm"]
    assert shown["verdict_holm"].tolist() == ["not resolved", "—"] and shown.loc[1, "p_holm"] == "—"
    assert float(shown.loc[0, "p_holm"]) == pytest.approx(2 * p_rule, abs=5e-5)


TUNED = {  # each arm's choice: the rule's pair at ε = 1 chose different values, at ε = 4 the same
    ("calibrated", 1.0): {"learning-rate": 0.3, "epochs": 4},
    ("proactive", 1.0): {"learning-rate": 1.0, "epochs": 4},
    ("calibrated", 4.0): {"learning-rate": 1.0, "epochs": 8},
    ("proactive", 4.0): {"learning-rate": 1.0, "epochs": 8},
}


def _tune(folder: Path, seeds: list[int]) -> None:
    """Make write_sweep's folder a tuned sweep's: sweep.json's tune, each arm's choice.json listing its
    cells (as sims.sweep.tuning writes it), and sweep.csv's tuned.<key> columns."""
    spec = json.loads((folder / "sweep.json").read_text())
    spec["tune"] = {
        "space": {"learning-rate": [0.3, 1.0], "epochs": [4, 8]},
        "seeds": [1000],
        "select": "final",
        "trials": 0,
        "split_seed": 0,
        "baseline_learning_rate": [],
    }
    (folder / "sweep.json").write_text(json.dumps(spec))
    cells = pd.read_csv(folder / "sweep.csv")
    for (rule, epsilon), values in TUNED.items():
        arm = f"rule={rule}_epsilon={epsilon}"
        chosen = {"name": "_".join(f"{k}={v}" for k, v in values.items()), "values": values, "score": 0.5}
        choice = {
            "arm": arm,
            "params": {"rule": rule, "epsilon": epsilon},
            "cells": [f"{arm}_seed={seed}" for seed in seeds],
            "rule": "the mean over tune seeds of the final validation accuracy",
            "candidates": [{**chosen, "scores": {"1000": 0.5}, "errors": {}}],
            "chosen": chosen,
        }
        (folder / "tuning" / arm).mkdir(parents=True)
        (folder / "tuning" / arm / "choice.json").write_text(json.dumps(choice))
        mine = (cells["rule"] == rule) & (cells["epsilon"] == epsilon)
        for key, value in values.items():
            cells.loc[mine, f"tuned.{key}"] = value
    cells.to_csv(folder / "sweep.csv", index=False)


def test_a_tuned_sweeps_pairs_show_each_sides_tuned_values_and_what_they_compare(tmp_path):
    """The same folder reported before and after it becomes a tuned sweep's: untuned, the pairs have
    no tuned columns (and report.md says nothing of them); tuned, both sides' values and the label."""
    seeds = [0, 1, 2, 3]
    folder = write_sweep(
        tmp_path / "sweep",
        {"rule": ["calibrated", "proactive"], "epsilon": [1.0, 4.0], "seed": seeds},
        lambda p: FINALS[(p["rule"], p["epsilon"])][p["seed"]],
    )
    write_report(folder, tmp_path / "untuned")
    untuned = pd.read_csv(tmp_path / "untuned" / "paired_differences.csv")
    assert list(untuned.columns) == [
        "differs_in",
        "rule",
        "epsilon",
        "a",
        "b",
        "neighbours",
        "shared_seeds",
        "difference_mean",
        "ci95_low",
        "ci95_high",
        "verdict",
        "p_value",
    ]
    text = (tmp_path / "untuned" / "report.md").read_text()
    assert "tuned_a" not in text and "own tuned optimum" not in text
    _tune(folder, seeds)
    write_report(folder)
    pairs = pd.read_csv(folder / "report" / "paired_differences.csv")
    assert list(pairs.columns[:8]) == ["differs_in", "rule", "epsilon", "a", "b", "tuned_a", "tuned_b", "compared"]
    rule = pairs[pairs["differs_in"] == "rule"].set_index("epsilon")
    assert rule.loc[1.0, ["tuned_a", "tuned_b", "compared"]].tolist() == [
        "learning-rate=0.3, epochs=4",
        "learning-rate=1, epochs=4",
        "each arm at its own tuned optimum",
    ]
    assert rule.loc[4.0, ["tuned_a", "tuned_b", "compared"]].tolist() == [
        "learning-rate=1, epochs=8",
        "learning-rate=1, epochs=8",
        "tuned values equal",
    ]
    epsilon = pairs[pairs["differs_in"] == "epsilon"].set_index("rule")
    assert set(epsilon["compared"]) == {"each arm at its own tuned optimum"}  # both chose 8 epochs at ε = 4
    assert epsilon.loc["calibrated", "tuned_b"] == "learning-rate=1, epochs=8"
    markdown = (folder / "report" / "report.md").read_text()
    assert "`each arm at its own tuned optimum`: they differ" in markdown
    shown = markdown_table(markdown, "### rule: b − a")
    assert list(shown.columns[:6]) == ["epsilon", "a", "b", "tuned_a", "tuned_b", "compared"]
    assert shown["compared"].tolist() == ["each arm at its own tuned optimum", "tuned values equal"]
    assert shown["tuned_a"].tolist() == ["learning-rate=0.3, epochs=4", "learning-rate=1, epochs=8"]


# ---------------- splits as a replicate level: seeds nested in split-seeds ----------------


def test_the_two_stage_interval_is_the_t_interval_over_split_means():
    """Seeds nested in splits: each split's mean over its seeds, then mean ± t_{0.975, k−1} · s/√k over
    the k split means; one split (or none given) is the interval over the values themselves."""
    from fedprivacy.reports.statistics import two_stage_interval

    values = [0.60, 0.64, 0.55, 0.57, 0.70, 0.66, 0.62]
    splits = [0, 0, 1, 1, 2, 2, 2]  # split 2 ran three seeds: its mean counts once, as the others'
    means = [0.62, 0.56, np.mean([0.70, 0.66, 0.62])]
    mean, sd = np.mean(means), np.std(means, ddof=1)
    half = stats.t.ppf(0.975, 2) * sd / math.sqrt(3)
    interval = two_stage_interval(values, splits)
    assert (interval.n, interval.mean, interval.sd) == (3, pytest.approx(mean, abs=1e-15), pytest.approx(sd, abs=1e-15))
    assert (interval.low, interval.high) == pytest.approx((mean - half, mean + half), abs=1e-12)
    assert two_stage_interval(values, [4] * len(values)) == t_interval(values) == two_stage_interval(values)


# split-seed ∈ {0, 1, 2} × seed ∈ {0, 1}: calibrated's accuracy per (split, seed); proactive adds a gain per
# (split, seed), so the per-split mean differences are 0.03, 0.01 and 0.05.
SPLIT_FINALS = {0: [0.60, 0.62], 1: [0.52, 0.58], 2: [0.66, 0.70]}
SPLIT_GAIN = {0: [0.02, 0.04], 1: [0.00, 0.02], 2: [0.06, 0.04]}


def _split_accuracy(p: dict) -> float:
    split, seed = p["split-seed"], p["seed"]
    return SPLIT_FINALS[split][seed] + SPLIT_GAIN[split][seed] * (p["rule"] == "proactive")


def test_a_sweep_over_split_seeds_pools_splits_and_seeds_nested_in_them(tmp_path):
    splits, seeds = [0, 1, 2], [0, 1]
    baselines = [
        {
            "name": f"split-seed={split}_seed={seed}",
            "status": "completed",
            "params": {"split-seed": split, "seed": seed},
            "final_accuracy": 0.8 + 0.01 * split + 0.002 * seed,
            "best_accuracy": 0.85,
            "schedule_from": f"rule=calibrated_split-seed={split}_seed={seed}",
        }
        for split in splits
        for seed in seeds
    ]
    folder = write_sweep(
        tmp_path,
        {"rule": ["calibrated", "proactive"], "split-seed": splits, "seed": seeds},
        _split_accuracy,
        baselines=baselines,
    )
    write_report(folder)
    markdown = (folder / "report" / "report.md").read_text()
    arms = markdown_table(markdown, "## Accuracy").set_index("rule")
    assert list(arms.columns[:3]) == ["splits", "seeds", "final_accuracy_mean"] and len(arms) == 2
    for rule in ("calibrated", "proactive"):
        per_split = [
            np.mean([_split_accuracy({"rule": rule, "split-seed": s, "seed": d}) for d in seeds]) for s in splits
        ]
        expected = stats.ttest_1samp(per_split, 0.0).confidence_interval(0.95)  # 2 degrees of freedom
        row = arms.loc[rule]
        assert (row["splits"], row["seeds"]) == ("3", "2")
        assert float(row["final_accuracy_mean"]) == pytest.approx(np.mean(per_split), abs=5e-5)
        assert float(row["final_accuracy_sd"]) == pytest.approx(np.std(per_split, ddof=1), abs=5e-5)
        assert (float(row["ci95_low"]), float(row["ci95_high"])) == pytest.approx(
            (expected.low, expected.high), abs=5e-5
        )
    pairs = pd.read_csv(folder / "report" / "paired_differences.csv")
    assert len(pairs) == 1 and "split-seed" not in pairs and "split-seed" not in arms
    (pair,) = pairs.itertuples()
    differences = [np.mean(SPLIT_GAIN[s]) for s in splits]  # 0.03, 0.01, 0.05
    expected = stats.ttest_1samp(differences, 0.0)
    assert (pair.shared_seeds, pair.shared_splits) == (6, 3)
    assert pair.difference_mean == pytest.approx(0.03, abs=1e-12)
    interval = expected.confidence_interval(0.95)
    assert (pair.ci95_low, pair.ci95_high) == pytest.approx((interval.low, interval.high), abs=1e-12)
    assert pair.p_value == pytest.approx(expected.pvalue, rel=1e-9)
    shown = markdown_table(markdown, "### rule: b − a")
    assert list(shown.columns[2:5]) == ["shared_seeds", "shared_splits", "difference_mean"]
    assert "An interval covers the variation between splits" in markdown and "and between seeds" in markdown
    baseline = markdown_table(markdown, "### Non-private baseline")  # one row for the one setting it reads
    finals = [np.mean([0.8 + 0.01 * s + 0.002 * d for d in seeds]) for s in splits]
    assert len(baseline) == 1 and (baseline.loc[0, "splits"], baseline.loc[0, "seeds"]) == ("3", "2")
    assert float(baseline.loc[0, "final_accuracy"]) == pytest.approx(np.mean(finals), abs=5e-5)
    assert (folder / "report" / "accuracy_by_setting.png").is_file()  # not against split-seed, a replicate


@pytest.mark.parametrize("case", ["one value", "linked"])
def test_a_split_seed_with_one_value_or_in_a_linked_group_stays_a_settings_key(case, tmp_path):
    """Its tables are those the same sweep gives with split-seed as any other key: intervals over seeds,
    no `splits` or `shared_splits`, and report.md says the interval covers seeds within one split."""
    seeds = [0, 1, 2]
    grid: dict[str, list] = {"rule": ["calibrated", "proactive"], "seed": seeds}
    linked = None
    if case == "one value":
        grid = {"rule": grid["rule"], "split-seed": [5], "seed": seeds}
    else:
        linked = {"data": {"split-seed": [0, 1], "epochs": [2, 4]}}
    folder = write_sweep(
        tmp_path,
        grid,
        lambda p: 0.5 + 0.05 * (p["rule"] == "proactive") + 0.02 * p["seed"] ** 2 + 0.01 * p.get("epochs", 0),
        linked=linked,
    )
    write_report(folder)
    markdown = (folder / "report" / "report.md").read_text()
    arms = markdown_table(markdown, "## Accuracy")
    assert "splits" not in arms and "split-seed" in arms and set(arms["seeds"]) == {"3"}
    for row in arms.itertuples():
        finals = [
            0.5 + 0.05 * (row.rule == "proactive") + 0.02 * s**2 + (0.01 * int(row.epochs) if linked else 0)
            for s in seeds
        ]
        interval = stats.ttest_1samp(finals, 0.0).confidence_interval(0.95)
        assert (float(row.ci95_low), float(row.ci95_high)) == pytest.approx((interval.low, interval.high), abs=5e-5)
    pairs = pd.read_csv(folder / "report" / "paired_differences.csv")
    assert "shared_splits" not in pairs and set(pairs["shared_seeds"]) == {3}
    assert len(pairs) == (2 + 2 if linked else 1)  # linked: rule at each step, and the step at each rule
    assert "An interval covers the variation between seeds within one split" in markdown


@pytest.mark.parametrize(
    ("tables", "says"),
    [
        ({"run": {"split-seed": 3}, "grid": {"rule": ["proactive"]}}, "split-seed = 3, the split every cell used"),
        ({"run": {}, "grid": {"split-seed": [0, 1]}}, "each arm's own split-seed, the split its cells used"),
        (
            {"run": {}, "grid": {}, "linked": {"g": {"split-seed": [0, 1], "epochs": [1, 2]}}},
            "each arm's own split-seed",
        ),
    ],
)
def test_the_tuning_section_names_the_split_its_runs_validated_on(tmp_path, tables, says):
    """The tuning runs start from their arm's first cell's config: one split-seed of [run], or each
    arm's own where [grid] or [linked] varies it (never the [sweep] default the spec keeps then)."""
    tune = {"space": {"learning-rate": [0.3, 1.0]}, "seeds": [1000], "select": "final", "trials": 0, "split_seed": 0}
    (tmp_path / "sweep.json").write_text(json.dumps({"name": "s", **tables, "tune": tune, "cells": []}))
    assert says in tuning_markdown(tmp_path)
