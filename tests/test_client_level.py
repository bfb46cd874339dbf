"""Client-level DP enforced on the server (DP-FedAvg): the clipped sum's sensitivity, the noise's
distribution and scale, the members' Poisson sampling, the federation's ledger against
dp-accounting, the run config's refusals, and a two-level run of the fast engine."""

from __future__ import annotations

import json
import math
import statistics
import warnings
from fractions import Fraction
from pathlib import Path

import pandas as pd
import pytest
import torch
from dp_accounting import dp_event, pld
from flwr.supercore.differential_privacy import compute_stdv
from independent import pld_epsilon
from scipy import stats

from fedprivacy import client_level as client_level_module
from fedprivacy.client_level import GRID_BITS, ClientLevel, clipped_sum, federation_delta
from fedprivacy.errors import InputError
from fedprivacy.ledger import BudgetExceeded
from fedprivacy.participation import Participation
from fedprivacy.results import RunRecorder
from fedprivacy.runconfig import parse_run_config

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def client_level(tmp_path: Path, members: int = 1000, **config) -> ClientLevel:
    settings = parse_run_config({"federation-epsilon": 2.0, "federation-cohort": 50, "num-server-rounds": 10, **config})
    tmp_path.mkdir(parents=True, exist_ok=True)  # a run's folder
    level = ClientLevel.start(settings, range(members), tmp_path)
    assert level is not None
    return level


def test_one_member_moves_the_clipped_sum_by_at_most_the_clip():
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(5000, generator=generator, dtype=torch.float64)
    clip = 0.37
    for scale in (1e-9, 1e-3, 1.0, 1e6):  # far inside the clip, around it, far outside
        updates = base + scale * torch.randn(20, 5000, generator=generator, dtype=torch.float64)
        whole, count = clipped_sum(base, [updates.float()], clip)
        for member in range(20):
            others = torch.cat([updates[:member], updates[member + 1 :]]).float()
            without, count_without = clipped_sum(base, [others], clip)
            assert float(torch.linalg.vector_norm(whole - without)) <= clip
            assert abs(count - count_without) == 0.5  # adaptive clipping's count: sensitivity ½


def test_the_clipped_sum_is_the_same_whatever_the_chunk_of_members(monkeypatch):
    generator = torch.Generator().manual_seed(2)
    base = torch.randn(300, generator=generator, dtype=torch.float64)
    updates = [(base + 0.05 * torch.randn(23, 300, generator=generator, dtype=torch.float64)).float()]
    whole = clipped_sum(base, updates, 0.4)
    monkeypatch.setattr(client_level_module, "SUM_ELEMENTS", 300 * 4)  # four members at a time
    chunked = clipped_sum(base, updates, 0.4)
    assert torch.equal(whole[0], chunked[0]) and whole[1] == chunked[1]


def test_an_update_inside_the_clip_is_summed_as_it_is_and_a_non_finite_one_not_at_all():
    base = torch.zeros(100, dtype=torch.float64)
    small = torch.full((1, 100), 0.001)
    total, count = clipped_sum(base, [small], 1.0)
    assert torch.allclose(total, small[0].double(), rtol=1e-6, atol=0) and count == 0.5
    bad = torch.cat([small, torch.full((1, 100), math.nan)])
    assert torch.equal(clipped_sum(base, [bad], 1.0)[0], total) and clipped_sum(base, [bad], 1.0)[1] == 0.5
    large = torch.full((3, 100), 1.0)  # norm 10: above the clip
    assert clipped_sum(base, [torch.cat([small, large])], 1.0)[1] == 0.5 - 1.5
    empty, none = clipped_sum(base, [torch.zeros(0, 100)], 1.0)
    assert torch.equal(empty, base) and none == 0.0


def test_the_released_noise_is_gaussian_with_sigma_times_the_clip_on_the_sum(tmp_path):
    """A round in which nobody trained releases the noise alone: σS on the sum, divided by pM, the
    standard deviation Flower's fixed-clipping wrapper adds for a cohort of pM members."""
    level = client_level(tmp_path, **{"federation-rule": "calibrated", "update-clip": 0.5})
    plan = level.plan
    current = {"w": torch.zeros(40_000)}
    new = level.release(1, current, {"w": torch.zeros(0, 40_000)})["w"].double()
    z = new * plan.expected_batch_size / (plan.sigma * plan.clip_norm)
    assert stats.kstest(z.numpy(), "norm").pvalue > 1e-3
    assert float(z.std()) == pytest.approx(1.0, abs=0.02)
    flowers = compute_stdv(plan.sigma, plan.clip_norm, round(plan.expected_batch_size))
    assert float(new.std()) == pytest.approx(flowers, rel=0.02)


def test_adaptive_clipping_splits_the_plans_sigma_between_the_sum_and_the_count(tmp_path):
    """Andrew et al. 2021, Theorem 1: the sum noised at σ_Δ·S and the count of (bᵢ − ½) noised at σ_b
    are together one Gaussian of multiplier σ: their composition's ε is dp-accounting's for σ."""
    level = client_level(tmp_path, **{"federation-rule": "calibrated", "update-clip-quantile": 0.5})
    adaptive, sigma = level.adaptive, level.plan.sigma
    assert adaptive is not None and adaptive.count_noise == pytest.approx(50 / 20)
    update = adaptive.update_multiplier(sigma)
    assert update > sigma
    pair = pld.PLDAccountant(value_discretization_interval=1e-4)
    pair.compose(dp_event.GaussianDpEvent(update))
    pair.compose(dp_event.GaussianDpEvent(2 * adaptive.count_noise))  # the count's sensitivity is ½
    one = pld.PLDAccountant(value_discretization_interval=1e-4)
    one.compose(dp_event.GaussianDpEvent(sigma))
    assert pair.get_epsilon(1e-5) == pytest.approx(one.get_epsilon(1e-5), rel=1e-3)
    current = {"w": torch.zeros(40_000)}
    new = level.release(1, current, {"w": torch.zeros(0, 40_000)})["w"].double()
    assert float(new.std()) * 50 / level.last_clip == pytest.approx(update, rel=0.02)


def test_the_count_is_released_with_noise_sigma_b_and_the_sum_at_sigma_delta_times_this_rounds_clip(tmp_path):
    """With nobody training the count is its noise alone, read back from the clip's moves:
    log(S'/S) = −η·(noisy/pM + ½ − γ)."""
    settings = {"federation-rule": "calibrated", "update-clip-quantile": 0.5, "num-server-rounds": 300}
    level = client_level(tmp_path, **settings)
    adaptive = level.adaptive
    counts, sums = [], []
    for server_round in range(1, 301):
        new = level.release(server_round, {"w": torch.zeros(2000)}, {"w": torch.zeros(0, 2000)})["w"].double()
        counts.append(-math.log(level.clip / level.last_clip) / adaptive.rate * 50)
        sums.append(float(new.std()) * 50 / level.last_clip)
    assert statistics.stdev(counts) == pytest.approx(adaptive.count_noise, rel=0.15)
    assert statistics.fmean(sums[-100:]) == pytest.approx(adaptive.update_multiplier(level.plan.sigma), rel=0.02)
    assert max(abs(c) for c in counts) < 6 * adaptive.count_noise


def test_sigma_delta_is_never_below_its_exact_value_even_with_sigma_b_near_sigma_over_two(tmp_path):
    adaptive = client_level(tmp_path, **{"update-clip-quantile": 0.5}).adaptive
    for sigma in (0.5, 1.0, 3.7):
        for excess in (1e-12, 1e-9, 1e-6, 1e-3, 1.0):
            adaptive.count_noise = sigma / 2 * (1 + excess)
            multiplier = adaptive.update_multiplier(sigma)
            exact = Fraction(sigma) ** -2 - Fraction(2 * adaptive.count_noise) ** -2
            assert Fraction(multiplier) ** -2 <= exact  # the pair's multiplier is at least σ
            assert Fraction(math.nextafter(multiplier, 0)) ** -2 > exact  # and the smallest such float


def test_adaptive_clipping_moves_the_clip_to_the_quantile_of_update_norms(tmp_path):
    settings = {"federation-rule": "calibrated", "update-clip-quantile": 0.5, "update-clip": 0.05}
    level = client_level(tmp_path, **settings, **{"num-server-rounds": 110})
    norms = torch.linspace(0.5, 1.5, 50)  # the median norm is 1
    directions = torch.nn.functional.normalize(torch.randn(50, 20, generator=torch.Generator().manual_seed(1)))
    updates = {"w": directions * norms[:, None]}
    clips = []
    for server_round in range(1, 111):
        level.release(server_round, {"w": torch.zeros(20)}, updates)
        clips.append(level.last_clip)
    assert clips[0] == 0.05 and clips[:10] == sorted(clips[:10])  # every norm above S: S grows
    assert clips[10] == pytest.approx(0.05 * math.exp(0.1) ** 10, rel=0.1)  # by about exp(0.2·0.5) a round
    assert 0.8 < statistics.fmean(clips[-30:]) < 1.25  # then stays around the median


def test_members_are_poisson_sampled_at_the_plans_rate_and_a_seed_replays_them(tmp_path):
    level = client_level(tmp_path / "a", **{"noise-seed": 5})
    draws = [level.sampled(r) for r in range(1, 41)]
    rate = level.plan.sampling_rate
    assert rate == pytest.approx(0.05)
    share = sum(map(len, draws)) / (40 * 1000)
    assert abs(share - rate) < 4 * math.sqrt(rate * (1 - rate) / (40 * 1000))
    assert all(set(d) <= set(range(1000)) and d == sorted(d) for d in draws)
    again = client_level(tmp_path / "b", **{"noise-seed": 5})
    assert draws[0] == again.sampled(1)
    fresh = client_level(tmp_path / "c")  # OS entropy: another draw
    assert fresh.sampled(1) != draws[0]


def test_only_the_roster_is_sampled_whoever_is_connected(tmp_path):
    """The plan is for the clients of the first round: a later one is never asked; one of them that
    is gone is drawn all the same (its chance does not depend on who else is there)."""
    settings = parse_run_config({"federation-epsilon": 8.0, "federation-cohort": 2, "noise-seed": 1})
    level = ClientLevel.start(settings, [10, 20, 30, 40], tmp_path)
    participation = Participation(
        RunRecorder(tmp_path), seed=0, fraction_train=1.0, fraction_evaluate=1.0, client_level=level
    )
    asked = [participation.trainers(r, [20, 30, 40, 50]) for r in (1, 2, 3)]
    drawn = [level.sampled(r) for r in (1, 2, 3)]
    assert asked == [[c for c in d if c != 10] for d in drawn]
    assert participation.off_roster == {50}


def test_one_member_is_exactly_within_the_clip_at_the_boundary():
    """Exact arithmetic (Python integers): each clipped update on the grid has norm ≤ S, for
    updates whose float64 norm lies within a few ulps of S."""
    generator = torch.Generator().manual_seed(3)
    for size in (1, 3, 1000):
        for clip in (1e-6, 0.3, 1.0, 7.0):
            grid = Fraction(2) ** (math.floor(math.log2(clip)) - GRID_BITS)
            for trial in range(20):
                direction = torch.randn(size, generator=generator, dtype=torch.float64)
                update = direction / torch.linalg.vector_norm(direction) * clip * (1 + (trial - 10) * 2**-52)
                total, _ = clipped_sum(torch.zeros(size, dtype=torch.float64), [update[None]], clip)
                units = [Fraction(v) / grid for v in total.tolist()]
                assert all(u.denominator == 1 for u in units)
                assert sum(u * u for u in units) * grid * grid <= Fraction(clip) ** 2


def test_the_federations_ledger_spends_dp_accountings_epsilon_and_refuses_a_round_more(tmp_path):
    level = client_level(tmp_path, **{"federation-rule": "calibrated"})
    plan = level.plan
    current = {"w": torch.zeros(10)}
    for server_round in range(1, plan.rounds + 1):
        level.release(server_round, current, {"w": torch.zeros(0, 10)})
    reference = pld_epsilon([(plan.sigma, plan.sampling_rate, plan.rounds)], plan.delta)
    assert level.epsilon_spent() == pytest.approx(reference, rel=1e-3)
    assert reference <= plan.epsilon * (1 + 1e-3)
    with pytest.raises(BudgetExceeded):  # the calibrated plan leaves no room for an eleventh round
        level.ledger.record("federation", "2", 1, level.ledger.events("federation")[:1])


def test_a_federation_ledger_kept_across_runs_refuses_the_rounds_its_budget_cannot_afford(tmp_path):
    config = {
        "federation-epsilon": 2.0,
        "federation-cohort": 50,
        "num-server-rounds": 4,
        "federation-rule": "calibrated",
        "federation-ledger": str(tmp_path / "federation.sqlite"),
    }
    current, nobody = {"w": torch.zeros(10)}, {"w": torch.zeros(0, 10)}
    folders = [tmp_path / f"run{n}" for n in (1, 2, 3)]  # a run's key in the ledger is its folder's name
    for folder in folders:
        folder.mkdir()
    with ClientLevel.start(parse_run_config(config), range(1000), folders[0]) as first:
        for server_round in range(1, 5):
            first.release(server_round, current, nobody)
        with pytest.raises(BudgetExceeded, match="outside the federation's plan of 4 rounds"):
            first.release(5, current, nobody)
        with pytest.raises(BudgetExceeded, match="already released"):
            first.release(4, current, nobody)
    with pytest.raises(InputError, match="would bring it to") as refused:  # before any member trains
        ClientLevel.start(parse_run_config(config), range(1000), folders[1])
    assert refused.value.field == "num-server-rounds"
    with pytest.raises(InputError, match="another run") as refused:  # a seed would repeat its noise
        ClientLevel.start(parse_run_config({**config, "noise-seed": 1}), range(1000), folders[2])
    assert refused.value.field == "noise-seed"
    with pytest.raises(InputError, match="holds a budget of") as refused:
        ClientLevel.start(parse_run_config({**config, "federation-epsilon": 3.0}), range(1000), folders[2])
    assert refused.value.field == "federation-epsilon"
    assert not (folders[1] / "federation-plan.json").exists()  # a refused run leaves no plan behind


def test_the_federations_default_delta_is_small_for_small_federations_too():
    settings = parse_run_config({"federation-epsilon": 1.0})
    assert federation_delta(settings, 10**7) == pytest.approx(10**-7.7)  # McMahan et al.'s 1/M^1.1
    assert federation_delta(settings, 20) == 1e-5  # not 20^-1.1 = 0.037 for a small federation


@pytest.mark.parametrize(
    ("config", "key", "message"),
    [
        ({"update-clip": 0.5}, "update-clip", "federation-epsilon > 0"),
        ({"federation-cohort": 20}, "federation-cohort", "federation-epsilon > 0"),
        ({"federation-epsilon": -1}, "federation-epsilon", "must be 0 (no client-level DP) or a finite number"),
        ({"federation-epsilon": 2, "fraction-train": 0.5}, "fraction-train", "federation plan's rate"),
        ({"federation-epsilon": 2, "aggregation": "inverse-noise"}, "aggregation", "sensitivity"),
        ({"federation-epsilon": 2, "federation-rule": "adp"}, "federation-rule", "proactive, calibrated"),
        ({"federation-epsilon": 2, "federation-cohort": 0.5}, "federation-cohort", "at least 1 member"),
        ({"federation-epsilon": 2, "clip-count-noise": 3.0}, "clip-count-noise", "update-clip-quantile"),
        ({"federation-epsilon": 2, "update-clip-quantile": 1.0}, "update-clip-quantile", "quantile in (0, 1)"),
    ],
)
def test_the_run_config_refuses_federation_keys_that_would_be_ignored_or_break_the_plan(config, key, message):
    with pytest.raises(InputError) as refused:
        parse_run_config(config)
    assert refused.value.field == key and message in str(refused.value)


def test_a_cohort_larger_than_the_members_is_refused_before_any_round(tmp_path):
    settings = parse_run_config({"federation-epsilon": 2.0, "federation-cohort": 50})
    with pytest.raises(InputError, match="expected cohort") as refused:
        ClientLevel.start(settings, range(20), tmp_path)
    assert refused.value.field == "federation-cohort"  # the run-config key, not the planner's name


def test_a_count_noise_below_half_sigma_is_refused_before_any_round(tmp_path):
    settings = parse_run_config(
        {"federation-epsilon": 2.0, "federation-cohort": 20, "update-clip-quantile": 0.5, "clip-count-noise": 0.1}
    )
    with pytest.raises(InputError, match="must exceed σ/2"):
        ClientLevel.start(settings, range(1000), tmp_path)


def test_a_two_level_run_reports_both_levels(tmp_path):
    from sims.fast.engine import run_fast

    config = {
        "dataset": "synthetic",
        "num-server-rounds": 4,
        "federation-epsilon": 4.0,
        "federation-cohort": 10,
        "federation-rule": "calibrated",
        "fraction-evaluate": 0.0,
        "results-dir": str(tmp_path),
    }
    lines: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        folder, _ = run_fast(config, 100, say=lines.append)
    rounds = pd.read_csv(folder / "rounds.csv")
    spent = rounds["federation_epsilon_spent"].tolist()
    assert spent == sorted(spent) and spent[0] > 0 and spent[-1] <= 4.0
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["federation_epsilon_spent"] == spent[-1]
    assert summary["federation"]["members"] == 100 and summary["federation"]["expected_cohort"] == 10
    plan = json.loads((folder / "federation-plan.json").read_text())
    assert (plan["client_id"], plan["n"], plan["epsilon"], plan["rounds"]) == ("federation", 100, 4.0, 4)
    assert summary["federation"]["sigma"] == plan["sigma"] == summary["federation"]["sum_noise_multiplier"]
    assert summary["epsilon_spent_max"] >= summary["epsilon_spent_mean"] > 0
    assert any(line.startswith("client-level DP: 100 members") for line in lines)
    assert any(line.startswith("done:") and "federation ε spent" in line for line in lines)
    # the members sampled each round: Poisson, so not always the same count
    assert rounds["clients_sampled"].nunique() > 1


SWEEP = """
[sweep]
engine = "fast"
clients = 20
seeded-noise = true
baseline = false

[run]
dataset = "synthetic"
synthetic-examples = 2000
num-server-rounds = 2
fraction-evaluate = 0.0

[grid]
seed = [0]

[linked.federation]      # client-level DP off, then at ε_fed = 4
federation-epsilon = [0, 4]
federation-cohort = [0, 5]
federation-rule = ["proactive", "calibrated"]
"""


def test_a_sweep_grids_over_the_federations_epsilon_and_reports_it(fedprivacy_cli, tmp_path):
    scenario = tmp_path / "two_levels.toml"
    scenario.write_text(SWEEP)
    code, out, err = fedprivacy_cli("sweep", str(scenario), "--out", str(tmp_path / "sweep"))
    assert code == 0, out + err
    table = pd.read_csv(tmp_path / "sweep" / "sweep.csv")
    assert list(table["federation-epsilon"]) == [0, 4] and set(table["status"]) == {"completed"}
    off, on = table["federation_epsilon_spent"]
    assert math.isnan(off) and 0 < on <= 4
    assert (table["epsilon_spent_max"] > 0).all()  # the record level, in both cells
    code, _, err = fedprivacy_cli("report", str(tmp_path / "sweep"))
    assert code == 0, err
    report = (tmp_path / "sweep" / "report" / "report.md").read_text()
    assert "federation_epsilon_spent" in report and f"{on:.4f}" in report
    assert "epsilon_spent_mean" in report  # both levels: the record level's mean beside its largest
