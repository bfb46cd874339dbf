"""Private tuning ([sweep] tune-private = true): the trial count's distribution and the selection's
RDP bound against dp-accounting (Papernot & Steinke 2022), the noisy score, the scenario's checks,
and a sweep that draws its trials once, chooses the best noisy score, resumes with the same draws
and records each client's cost, recomputed here from the plans its runs wrote. Fast engine, digits,
2 clients, 1 round."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from dp_accounting import dp_event, rdp
from dp_accounting.rdp import rdp_privacy_accountant
from harness import CountingRunner

from fedprivacy.errors import InputError
from fedprivacy.privacy.accountants import NoiseEvent, dp_event_of
from fedprivacy.privacy.random_search import ORDERS, TrialCount, repeat_and_select, run_curve, tuning_cost
from fedprivacy.reports.sweep_report import write_report
from fedprivacy.sweepfiles import TUNING_PRIVATE_NOTE
from sims.sweep.driver import run_sweep
from sims.sweep.grid import cells
from sims.sweep.private_tuning import draw_trials, noisy_count, trial_seeds
from sims.sweep.spec import validate
from sims.sweep.tune_spec import PrivateSearch

ARM = "epsilon=1"
SHAPES = (0.0, 0.5, 1.0, 3.0)


def _accountant_epsilon(event: dp_event.DpEvent, delta: float) -> float:
    accountant = rdp.RdpAccountant(list(ORDERS))
    accountant.compose(event)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mean", [1.5, 10.0, 40.0])
def test_the_trial_count_has_the_truncated_negative_binomial_of_its_mean_and_shape(shape, mean):
    count = TrialCount(mean, shape)
    assert count.gamma == pytest.approx(rdp_privacy_accountant._gamma_truncated_negative_binomial(shape, mean), 1e-8)
    probabilities = np.array([count.pmf(k) for k in range(1, 40_000)])
    assert probabilities.sum() == pytest.approx(1.0, abs=1e-9)
    assert (np.arange(1, 40_000) * probabilities).sum() == pytest.approx(mean, rel=1e-8)
    # inversion at an even grid of uniforms gives every k its share of the grid, within one point
    points = 20_000
    drawn = np.bincount([count.draw((i + 0.5) / points) for i in range(points)], minlength=60)[1:60]
    assert np.all(np.abs(drawn - probabilities[:59] * points) <= 1.0)


def test_a_trial_count_outside_its_range_is_refused():
    for mean, shape in ((0.5, 1.0), (math.inf, 1.0), (10.0, -0.5), (10.0, math.nan)):
        with pytest.raises(ValueError, match="must be a finite number"):
            TrialCount(mean, shape)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("events", [(NoiseEvent(1.1, 0.01, 500),), (NoiseEvent(3.0, 0.2, 40), NoiseEvent(5.0, 0.2, 8))])
def test_the_selection_bound_is_dp_accountings_repeat_and_select(shape, events):
    selected = repeat_and_select(run_curve(events), TrialCount(10.0, shape))
    accountant = rdp.RdpAccountant(list(ORDERS))
    accountant.compose(dp_event.RepeatAndSelectDpEvent(dp_event_of(events), 10.0, shape))
    assert np.allclose(selected, accountant.rdp, rtol=1e-7, atol=0)


def test_a_clients_cost_is_dp_accountings_for_its_events_and_the_largest_candidate_decides():
    """One candidate: the selection of (run ∘ noisy score) composed with one run, and every trial that
    ran composed with one run, both through dp-accounting's own events. Two candidates: the costlier
    one's curve (here it dominates at every order) for the selection and for the run after it, which
    the data chose."""
    cheap, costly = (NoiseEvent(2.0, 0.05, 100),), (NoiseEvent(1.2, 0.05, 300),)
    score_noise, delta, count = 8.0, 1e-5, TrialCount(6.0, 1.0)

    def trial(events: tuple[NoiseEvent, ...]) -> dp_event.DpEvent:
        return dp_event.ComposedDpEvent([dp_event_of(events), dp_event.GaussianDpEvent(score_noise)])

    selection = dp_event.RepeatAndSelectDpEvent(trial(costly), count.mean, count.shape)
    expected = _accountant_epsilon(dp_event.ComposedDpEvent([selection, dp_event_of(costly)]), delta)
    seen = _accountant_epsilon(
        dp_event.ComposedDpEvent([trial(costly), trial(cheap), trial(costly), dp_event_of(costly)]), delta
    )
    one = tuning_cost([run_curve(costly)], [run_curve(costly)], score_noise, count, delta)
    assert one.tuned == pytest.approx(expected, rel=1e-9)
    assert one.one_run == pytest.approx(_accountant_epsilon(dp_event_of(costly), delta), rel=1e-9)
    both = tuning_cost(
        [run_curve(cheap), run_curve(costly)],
        [run_curve(cheap), run_curve(costly)],
        score_noise,
        count,
        delta,
        ran=[1, 0, 1],
    )
    assert both.tuned == pytest.approx(expected, rel=1e-9)
    assert both.all_trials == pytest.approx(seen, rel=1e-9)
    assert one.one_run < one.tuned


def test_the_noisy_count_is_gaussian_on_its_grid_and_the_same_for_the_same_key_and_trial():
    key, noise = bytes(range(32)), 10.0
    counts = np.array([noisy_count(250, noise, key, trial) for trial in range(3000)])
    grid = 2.0**-5  # the largest power of two <= 10/256
    assert np.all(np.round(counts / grid) == counts / grid)
    assert abs(counts.mean() - 250) < 4 * noise / math.sqrt(len(counts))
    assert abs(counts.std() / noise - 1) < 0.05  # sd of a sample sd: about 1/sqrt(2·3000) = 0.013
    assert noisy_count(250, noise, key, 7) == counts[7]
    assert noisy_count(250, noise, bytes(32), 7) != counts[7]


def test_trials_are_drawn_from_the_key_and_skip_the_cells_seeds():
    key = bytes(range(32))
    seeds = trial_seeds(key, 50, {0, 1})
    assert len(set(seeds)) == 50 and not {0, 1} & set(seeds) and seeds == trial_seeds(key, 50, {0, 1})
    assert trial_seeds(bytes(32), 50, set()) != seeds and all(0 <= seed < 2**31 for seed in seeds)
    search = PrivateSearch(trials_mean=4.0, seeded=True)
    names = ["a", "b", "c"]
    drawn = draw_trials(names, search, ARM, {1001})
    assert drawn == draw_trials(names, search, ARM, {1001})  # seeded: the same draws for the same arm
    assert draw_trials(names, PrivateSearch(trials_mean=4.0), ARM, set())["key"] != drawn["key"]
    assert drawn["count"] == len(drawn["trials"]) >= 1
    assert drawn["options"] == search.to_dict() and drawn["candidates"] == names
    assert [t["seed"] for t in drawn["trials"]] == trial_seeds(bytes.fromhex(drawn["key"]), drawn["count"], {1001})
    picked = [t["candidate"] for arm in range(300) for t in draw_trials(names, search, str(arm), set())["trials"]]
    shares = np.array([picked.count(name) for name in names]) / len(picked)
    assert np.all(np.abs(shares - 1 / 3) < 4 * math.sqrt(2 / 9 / len(picked)))


def test_gamma_never_exceeds_its_true_value_and_a_uniform_outside_0_1_is_refused():
    from fedprivacy.privacy.random_search import _mean

    for shape in SHAPES:
        for mean in (2.0, 7.3, 40.0):
            count = TrialCount(mean, shape)
            assert _mean(count.gamma, shape) >= mean  # E[K] falls as γ grows: γ is on the costly side
    with pytest.raises(ValueError, match="must be in"):
        TrialCount(4.0).draw(1.0)
    assert TrialCount(4.0).draw(1.0 - 2.0**-53) > 100  # the top of a 53-bit uniform: far in the tail, no cap


def scenario(**sweep: Any) -> dict[str, Any]:
    """One arm (ε = 1), two cell seeds; η among a useless and a sensible step, privately."""
    return {
        "sweep": {"clients": 2, "engine": "fast", "seeded-noise": True, "tune-private": True, **sweep},
        "run": {"dataset": "digits", "num-server-rounds": 1, "epochs": 1.0},
        "grid": {"epsilon": [1.0], "seed": [0, 1]},
        "tune": {"learning-rate": [1e-6, 1.0]},
    }


BAD = {
    "tune-private not a boolean": (scenario(**{"tune-private": "yes"}), "sweep.tune-private", "must be true"),
    "a mean below one trial": (scenario(**{"tune-trials-mean": 0.5}), "sweep.tune-trials-mean", "number in [1, 1000]"),
    "a mean of a billion trials": (
        scenario(**{"tune-trials-mean": 1e9}),
        "sweep.tune-trials-mean",
        "number in [1, 1000]",
    ),
    "a negative shape": (scenario(**{"tune-trials-shape": -1}), "sweep.tune-trials-shape", "number >= 0"),
    "no score noise": (scenario(**{"tune-score-noise": 0}), "sweep.tune-score-noise", "number > 0"),
    "an infinite score noise": (scenario(**{"tune-score-noise": math.inf}), "sweep.tune-score-noise", "number > 0"),
    "a best-round score": (scenario(**{"tune-select": "best-round"}), "sweep.tune-select", "use 'final'"),
    "a fixed number of trials": (scenario(**{"tune-trials": 1}), "sweep.tune-trials", "tune-trials-mean"),
    "private options without tune-private": (
        scenario(**{"tune-private": False, "tune-score-noise": 5}),
        "sweep.tune-score-noise",
        "needs tune-private = true",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_the_scenario_refuses_a_bad_private_tuning_naming_the_field(case, tmp_path):
    raw, field, words = BAD[case]
    with pytest.raises(InputError) as caught:
        validate(raw, base_dir=tmp_path, default_name="private")
    assert caught.value.field == field and words in str(caught.value)


def _sweep(out: Path, raw: dict[str, Any]) -> None:
    spec = validate(raw, base_dir=out.parent, default_name="private")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sims.sweep.driver.create_runner", lambda name, resources: CountingRunner(resources))
        assert run_sweep(spec, cells(spec), out).failures == []


@pytest.fixture(scope="module")
def private_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("private") / "sweep"
    CountingRunner.ran = []
    _sweep(out, scenario(**{"tune-trials-mean": 4, "baseline": False}))
    return out


def _plan(run_folder: Path, client: str) -> dict[str, Any]:
    return json.loads((run_folder / "plans" / f"{client}.json").read_text())


def _run_folder(folder: Path) -> Path:
    return folder / json.loads((folder / "cell.json").read_text())["run_folder"]


def test_each_drawn_trial_runs_once_and_the_best_noisy_score_wins(private_sweep):
    out = private_sweep
    drawn = json.loads((out / "tuning" / ARM / "trials.json").read_text())
    choice = json.loads((out / "tuning" / ARM / "choice.json").read_text())
    names = [f"{t['candidate']}_seed={t['seed']}" for t in drawn["trials"]]
    assert sorted(CountingRunner.ran) == sorted(
        [f"{ARM}/{name}" for name in names] + [f"cells/{ARM}_seed={s}" for s in (0, 1)]
    )
    trials = choice["private"]["trials"]
    assert [(t["candidate"], t["seed"]) for t in trials] == [(t["candidate"], t["seed"]) for t in drawn["trials"]]
    key = bytes.fromhex(drawn["key"])
    for j, trial in enumerate(trials):  # each score: the run's own correct count, with the arm's noise for trial j
        summary = json.loads((_run_folder(out / "tuning" / ARM / names[j]) / "summary.json").read_text())
        rows = summary["evaluation_rows"]
        correct = round(summary["final_accuracy"] * rows)
        assert trial["noisy_score"] == noisy_count(correct, 10.0, key, j) / rows
    best = max(range(len(trials)), key=lambda j: (trials[j]["noisy_score"], -j))
    assert choice["chosen"]["name"] == trials[best]["candidate"]
    for seed in (0, 1):
        cell = json.loads((out / "cells" / f"{ARM}_seed={seed}" / "cell.json").read_text())
        assert cell["tuned"] == choice["chosen"]["values"]


def test_each_clients_cost_is_recomputed_from_the_plans_its_runs_wrote(private_sweep):
    """Both candidates plan alike (η is not a planning input of the calibrated rule), so each client's
    cost is dp-accounting's repeat-and-select of its trial plan's events and the score's Gaussian,
    composed with its cell plan's events."""
    out = private_sweep
    choice = json.loads((out / "tuning" / ARM / "choice.json").read_text())
    first = next(p for p in (out / "tuning" / ARM).iterdir() if p.is_dir())
    cell = _run_folder(out / "cells" / f"{ARM}_seed=0")
    cost = choice["private"]["epsilon"]
    for client in ("0", "1"):
        trial, final = _plan(_run_folder(first), client), _plan(cell, client)

        def events(plan: dict[str, Any]) -> dp_event.DpEvent:
            return dp_event_of([NoiseEvent(s, plan["sampling_rate"], c) for s, c in plan["noise_segments"]])

        base = dp_event.ComposedDpEvent([events(trial), dp_event.GaussianDpEvent(10.0)])
        tuned = dp_event.ComposedDpEvent([dp_event.RepeatAndSelectDpEvent(base, 4.0, 1.0), events(final)])
        assert trial["n"] < final["n"]  # the tuning runs train on fit rows, the cells on all training rows
        assert cost["clients"][client]["tuned"] == pytest.approx(_accountant_epsilon(tuned, final["delta"]), rel=1e-9)
        assert cost["clients"][client]["one_run"] == pytest.approx(
            _accountant_epsilon(events(final), final["delta"]), rel=1e-9
        )
    assert cost["tuned_max"] == max(c["tuned"] for c in cost["clients"].values())
    table = pd.read_csv(out / "sweep.csv")
    assert list(table["epsilon_with_tuning_max"]) == pytest.approx([cost["tuned_max"]] * 2, rel=1e-12)


def test_a_rerun_runs_the_same_trials_and_makes_the_same_choice(private_sweep, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(private_sweep, copy)
    folder = copy / "tuning" / ARM
    before = json.loads((folder / "choice.json").read_text())
    drawn = (folder / "trials.json").read_bytes()
    CountingRunner.ran = []
    _sweep(copy, scenario(**{"tune-trials-mean": 4, "baseline": False}))
    assert CountingRunner.ran == []
    # killed during the tuning: no choice yet, the last trial unfinished, a cell to redo
    last = json.loads(drawn)["trials"][-1]
    (folder / "choice.json").unlink()
    (folder / f"{last['candidate']}_seed={last['seed']}" / "cell.json").unlink()
    shutil.rmtree(copy / "cells" / f"{ARM}_seed=1")
    _sweep(copy, scenario(**{"tune-trials-mean": 4, "baseline": False}))
    assert CountingRunner.ran == [f"{ARM}/{last['candidate']}_seed={last['seed']}", f"cells/{ARM}_seed=1"]
    assert (folder / "trials.json").read_bytes() == drawn
    after = json.loads((folder / "choice.json").read_text())
    assert after["chosen"] == before["chosen"] and after["private"]["epsilon"] == before["private"]["epsilon"]


def test_the_report_gives_each_arms_cost_and_the_dry_run_plans_it(private_sweep, tmp_path, fedprivacy_cli, monkeypatch):
    markdown = write_report(private_sweep, tmp_path / "report")[-1].read_text()
    section = markdown[markdown.index("## Tuning") :]
    choice = json.loads((private_sweep / "tuning" / ARM / "choice.json").read_text())
    assert TUNING_PRIVATE_NOTE in section and "not in the reported ε" not in section
    assert "### Validation scores" not in section  # the other trials' scores are not released
    row = next(line for line in section.splitlines() if line.startswith(f"| {ARM}") and "|" in line[2:])
    cells_of_row = [cell.strip() for cell in row.strip("|").split("|")]
    cost = choice["private"]["epsilon"]
    assert cells_of_row[1:4] == [
        str(choice["private"]["count"]),
        f"{cost['one_run_max']:.3f}",
        f"{cost['tuned_max']:.3f}",
    ]

    path = tmp_path / "private.toml"
    path.write_text(
        '[sweep]\nclients = 2\nengine = "fast"\ntune-private = true\ntune-trials-mean = 4\nbaseline = false\n'
        '[run]\ndataset = "digits"\nnum-server-rounds = 1\nepochs = 1.0\n'
        "[grid]\nepsilon = [1.0]\nseed = [0, 1]\n[tune]\nlearning-rate = [1e-6, 1.0]\n"
    )
    monkeypatch.setenv("COLUMNS", "240")
    code, out, _ = fedprivacy_cli("sweep", str(path), "--out", str(tmp_path / "o"), "--dry-run")
    printed = " ".join(out.split())
    assert code == 0 and not (tmp_path / "o").exists()
    assert "a random number of trials (mean 4, shape 1), each one of 2 candidates drawn at random" in printed
    assert "2 cells after about 4 tuning runs" in printed  # the count is random: never stated as fixed
    assert f"largest over clients: {cost['tuned_max']:.3g}" in printed  # planned before any trial: the same cost


def test_each_clients_curve_is_that_of_the_plan_its_engine_would_make(tmp_path):
    """Clients of their own size, ε and δ (the run config's `epsilons`, `deltas`), on a size-skewed
    partition: each curve is dp-accounting's for the plan `simulation_client` and the planner give."""
    from fedprivacy.identity import simulation_client
    from fedprivacy.plans import plan_from_settings
    from fedprivacy.runconfig import parse_run_config
    from sims.sweep.tuning_privacy import client_curves

    config = {
        "dataset": "digits",
        "partitioning": "size",
        "epsilons": "0.5,1,2",
        "deltas": "1e-5,1e-6,1e-5",
        "num-server-rounds": 2,
        "epochs": 2.0,
        "evaluate-on": "validation",
    }
    curves = client_curves(config, 3)
    settings = parse_run_config({**config, "results-dir": str(tmp_path)})
    assert len(curves) == 3
    sizes = set()
    for index in range(3):
        client = simulation_client(settings, index, 3, tmp_path / "ledger.db")
        plan = plan_from_settings(
            settings, client.planning_size, client.epsilon, client.delta, client.client_id, epochs=client.epochs
        )
        events = [NoiseEvent(s, plan.sampling_rate, c) for s, c in plan.noise_segments]
        delta, curve = curves[client.client_id]
        accountant = rdp.RdpAccountant(list(ORDERS))
        accountant.compose(dp_event_of(events))
        assert delta == client.delta and np.allclose(curve, accountant.rdp, rtol=1e-12)
        sizes.add(client.planning_size)
    assert len(sizes) == 3  # the partition is size-skewed: the clients really differ


def test_a_rerun_with_other_private_options_is_refused_and_a_failed_trial_is_never_run_again(private_sweep, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(private_sweep, copy)
    with pytest.raises(InputError) as caught:
        _sweep(copy, scenario(**{"tune-trials-mean": 5, "baseline": False}))
    assert caught.value.field == "out" and "tune-trials-mean 4.0 there, 5.0 now" in str(caught.value)
    folder = copy / "tuning" / ARM
    first = json.loads((folder / "trials.json").read_text())["trials"][0]
    record_path = folder / f"{first['candidate']}_seed={first['seed']}" / "cell.json"
    record = json.loads(record_path.read_text())
    record.update(status="failed", error="diverged")  # as a trial that failed would have left it
    record_path.write_text(json.dumps(record))
    (folder / "choice.json").unlink()
    for seed in (0, 1):
        shutil.rmtree(copy / "cells" / f"{ARM}_seed={seed}")
    CountingRunner.ran = []
    _sweep(copy, scenario(**{"tune-trials-mean": 4, "baseline": False}))
    assert [run for run in CountingRunner.ran if run.startswith(f"{ARM}/")] == []  # the failed trial stays failed
    trials = json.loads((folder / "choice.json").read_text())["private"]["trials"]
    assert (trials[0]["error"], trials[0]["noisy_score"]) == ("diverged", None)


@pytest.mark.parametrize(
    ("tuned", "field"),
    [({"delta": [1e-5, 1e-6]}, "tune.delta"), ({"partitioning": ["iid", "size"]}, "tune.partitioning")],
)
def test_a_tuned_key_that_changes_a_clients_rows_or_delta_is_refused(tuned, field, tmp_path):
    from sims.sweep.tuning import plan_tuning

    raw = scenario()
    raw["tune"] = {"learning-rate": [1.0, 0.5], **tuned}
    spec = validate(raw, base_dir=tmp_path, default_name="private")
    with pytest.raises(InputError) as caught:
        plan_tuning(spec, cells(spec))
    assert caught.value.field == field and "private tuning cannot bound" in str(caught.value)


def test_a_dry_run_refuses_an_out_folder_whose_trials_were_drawn_for_other_options(
    private_sweep, tmp_path, fedprivacy_cli, monkeypatch
):
    copy = tmp_path / "copy"
    shutil.copytree(private_sweep, copy)
    path = tmp_path / "private.toml"
    path.write_text(
        '[sweep]\nclients = 2\nengine = "fast"\nseeded-noise = true\ntune-private = true\ntune-trials-mean = 5\n'
        'baseline = false\n[run]\ndataset = "digits"\nnum-server-rounds = 1\nepochs = 1.0\n'
        "[grid]\nepsilon = [1.0]\nseed = [0, 1]\n[tune]\nlearning-rate = [1e-6, 1.0]\n"
    )
    monkeypatch.setenv("COLUMNS", "240")
    code, _, err = fedprivacy_cli("sweep", str(path), "--out", str(copy), "--dry-run")
    assert code == 2 and "tune-trials-mean 4.0 there, 5.0 now" in " ".join(err.split())
