"""The neighbour relation a plan's ε holds for: stated on every plan, and certified as stated.

Add/remove one record (N public) is what every run plans; `--adjacency replace-one` certifies a
release whose N is the real size, where replacing one record moves the clipped sum by up to 2C.
The replace-one certificate is dp-accounting's REPLACE_ONE PLD; it is checked here against the
analytic Gaussian mechanism (Balle & Wang 2018) at twice the sensitivity for full-batch steps,
and bracketed for Poisson-sampled ones by the add/remove ε below and group privacy above.
"""

from __future__ import annotations

import json
import math

import pytest
from scipy.optimize import brentq
from scipy.stats import norm
from typer.testing import CliRunner

from fedprivacy.cli import app as cli_app
from fedprivacy.errors import InputError, PlanRefused
from fedprivacy.ledger import Ledger
from fedprivacy.privacy.calculator import feasible_plans
from fedprivacy.privacy.planner import plan_client
from fedprivacy.reports.sheets import write_sheet


def analytic_gaussian_epsilon(sigma: float, sensitivity: float, delta: float) -> float:
    """ε of the Gaussian mechanism N(0, σ²) at L2 sensitivity Δ: the root of
    δ(ε) = Φ(Δ/2σ − εσ/Δ) − e^ε Φ(−Δ/2σ − εσ/Δ) (Balle & Wang 2018, Theorem 8)."""

    def gap(eps: float) -> float:
        a, b = sensitivity / (2 * sigma), eps * sigma / sensitivity
        return norm.cdf(a - b) - math.exp(eps) * norm.cdf(-a - b) - delta

    return brentq(gap, 0.0, 500.0)


def test_a_full_batch_replace_one_plan_is_the_gaussian_at_twice_the_sensitivity():
    plan = plan_client(
        10, 2.0, 1e-5, rule="calibrated", sampling_rate=1.0, steps=1, compare=False, neighbours="replace-one"
    )
    assert plan.neighbours == "replace-one"
    exact = analytic_gaussian_epsilon(plan.sigma, 2.0, 1e-5)
    assert exact <= plan.epsilon_pld <= 2.0  # the certificate is pessimistic, and within the target
    assert plan.epsilon_pld == pytest.approx(exact, rel=2e-3)
    assert plan.epsilon_rdp >= plan.epsilon_pld  # RDP of the Gaussian at σ/2, a looser cross-check
    add_remove = plan_client(10, 2.0, 1e-5, rule="calibrated", sampling_rate=1.0, steps=1, compare=False)
    assert plan.sigma == pytest.approx(2 * add_remove.sigma, rel=1e-2)  # twice the noise for twice the sensitivity


def test_a_sampled_replace_one_certificate_lies_between_add_remove_and_group_privacy():
    """The default-like plan (N = 5,736, σ 2.93, q 0.1, T 50) certified at ε ≈ 1 add/remove is
    ε ≈ 1.9 replace-one: the figure that makes a declared public N necessary."""
    add_remove = plan_client(5736, 1.0, 1e-5, rule="calibrated", compare=False)
    events = dict(sigma=add_remove.sigma, sampling_rate=add_remove.sampling_rate, steps=add_remove.steps)
    replace_one = plan_client(
        5736,
        3.0,
        1e-5,
        rule="calibrated",
        compare=False,
        neighbours="replace-one",
        sampling_rate=events["sampling_rate"],
        steps=events["steps"],
    )
    assert replace_one.sigma < add_remove.sigma  # a larger target under the stricter relation
    from fedprivacy.privacy.accountants import NoiseEvent, pld_epsilon

    at_same_noise = pld_epsilon(
        [NoiseEvent(add_remove.sigma, add_remove.sampling_rate, add_remove.steps)],
        1e-5,
        neighbours="replace-one",
    )
    assert add_remove.epsilon_pld < at_same_noise < 2 * add_remove.epsilon_pld + 1e-9
    assert at_same_noise == pytest.approx(1.91, abs=0.03)  # docs/privacy.md's figure
    assert replace_one.epsilon_rdp is None  # dp-accounting's RDP has no replace-one Poisson analysis


def test_a_replace_one_plan_reports_what_it_spends_under_add_remove():
    """docs/privacy.md's table: calibrated replace-one at N = 5,736, ε = 1 is σ 5.28 and spends
    ε = 0.494 add/remove, by dp-accounting's PLD on the same steps."""
    from independent import CERTIFICATE_REL_TOL, pld_epsilon

    from fedprivacy.privacy.relations import epsilon_by_neighbours

    plan = plan_client(5736, 1.0, 1e-5, rule="calibrated", compare=False, neighbours="replace-one")
    assert plan.sigma == pytest.approx(5.28, abs=0.005)
    independent = pld_epsilon([(plan.sigma, plan.sampling_rate, plan.steps)], 1e-5)
    assert independent == pytest.approx(0.494, abs=0.0005)  # the table's figure
    assert epsilon_by_neighbours(plan)["add-remove"] == pytest.approx(independent, rel=CERTIFICATE_REL_TOL)


def test_the_proactive_sigma_is_refused_where_replace_one_needs_more_noise():
    assert plan_client(5736, 1.0, 1e-5, compare=False).epsilon_pld < 1.0
    with pytest.raises(PlanRefused, match="certifies ε=1.0"):
        plan_client(5736, 1.0, 1e-5, compare=False, neighbours="replace-one")


def test_the_relation_is_on_the_plan_json_the_sheet_and_the_calculator(tmp_path):
    plan = plan_client(5736, 1.0, 1e-5, rule="calibrated", neighbours="replace-one")
    assert json.loads(plan.to_json())["neighbours"] == "replace-one"
    files = write_sheet(plan, tmp_path)
    assert "replace one record; N may be the real size" in files["md"].read_text()
    rows = feasible_plans(5736, 1.0, 1e-5, epochs_grid=(1.0,), rate_grid=(0.05,), neighbours="replace-one")
    assert rows and rows[0].to_dict()["neighbours"] == "replace-one"
    assert rows[0].plan.sigma > feasible_plans(5736, 1.0, 1e-5, epochs_grid=(1.0,), rate_grid=(0.05,))[0].plan.sigma


def test_the_cli_takes_the_relation_by_name():
    runner = CliRunner()
    result = runner.invoke(
        cli_app,
        [
            "plan",
            "--n",
            "5736",
            "--epsilon",
            "1",
            "--rule",
            "calibrated",
            "--adjacency",
            "replace-one",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["neighbours"] == "replace-one"
    result = runner.invoke(cli_app, ["plan", "--n", "5736", "--epsilon", "1", "--adjacency", "swap"])
    assert result.exit_code == 2 and "swap" in result.output
    with pytest.raises(InputError, match="adjacency='swap': must be one of: add-remove, replace-one"):
        plan_client(5736, 1.0, 1e-5, neighbours="swap")


def test_the_ledger_composes_add_remove_plans_only(tmp_path):
    """A run's steps are composed as add/remove steps; a replace-one plan never enters a ledger."""
    plan = plan_client(5736, 1.0, 1e-5, rule="calibrated", compare=False, neighbours="replace-one")
    with Ledger(tmp_path / "l.sqlite") as ledger, pytest.raises(ValueError, match="replace-one"):
        ledger.save_plan("node:a", "run", plan)
