"""Certified ε and calibrated σ, checked against dp-accounting called directly in the test."""

from __future__ import annotations

import dp_accounting
import pytest
from dp_accounting import dp_event, pld, rdp

from fedprivacy.errors import PlanRefused
from fedprivacy.privacy import accountants
from fedprivacy.privacy.planner import plan_client

ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE


def independent_pld(segments, q, delta):
    """PLD ε of Poisson-subsampled Gaussian steps, straight from dp-accounting."""
    accountant = pld.PLDAccountant(ADD_REMOVE, value_discretization_interval=1e-4)
    for sigma, count in segments:
        step = dp_event.GaussianDpEvent(sigma) if q == 1 else dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma))
        accountant.compose(step, count)
    return accountant.get_epsilon(delta)


def independent_rdp(segments, q, delta):
    accountant = rdp.RdpAccountant(neighboring_relation=ADD_REMOVE)
    for sigma, count in segments:
        accountant.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), count)
    return accountant.get_epsilon(delta)


def test_reference_values_from_the_notes():
    events = accountants.constant_events(1.1, 256 / 60000, 14062)
    assert accountants.pld_epsilon(events, 1e-5) == pytest.approx(2.382, abs=2e-3)
    assert accountants.rdp_epsilon(events, 1e-5) == pytest.approx(2.597, abs=2e-3)
    events = accountants.constant_events(10.0, 4096 / 50000, 875)
    assert accountants.rdp_epsilon(events, 1e-5) == pytest.approx(0.988, abs=2e-3)
    assert accountants.pld_epsilon(events, 1e-5) == pytest.approx(0.903, abs=2e-3)


@pytest.mark.parametrize("rule", ["proactive", "calibrated", "adp"])
@pytest.mark.parametrize("n, eps, delta", [(5736, 1.0, 1e-5), (2983, 0.5, 1 / 2983), (1200, 4.0, 1e-6)])
def test_every_certified_epsilon_matches_independent_dp_accounting(rule, n, eps, delta):
    try:
        plan = plan_client(n, eps, delta, rule=rule, compare=False)
    except PlanRefused:
        pytest.skip("proactive rule refused here; refusal itself is tested elsewhere")
    assert sum(count for _, count in plan.noise_segments) == plan.steps
    assert plan.epsilon_pld == pytest.approx(independent_pld(plan.noise_segments, plan.sampling_rate, delta), rel=1e-9)
    assert plan.epsilon_rdp == pytest.approx(independent_rdp(plan.noise_segments, plan.sampling_rate, delta), rel=1e-9)
    assert plan.epsilon_pld <= eps
    assert plan.epsilon_rdp >= plan.epsilon_pld * 0.999  # RDP is the looser bound


@pytest.mark.parametrize(
    "eps, delta, q, steps",
    [(1.0, 1e-5, 0.1, 50), (0.25, 1e-5, 0.03, 128), (2.0, 1 / 5736, 0.2, 25), (1.0, 1e-5, 0.01, 10_000), (8.0, 1e-6, 1.0, 3)],
)
def test_pld_calibration_is_within_one_percent_below_target(eps, delta, q, steps):
    sigma = accountants.calibrate_pld(eps, delta, q, ((1.0, steps),))
    certified = independent_pld([(sigma, steps)], q, delta)
    assert 0.99 * eps <= certified <= eps


def test_rdp_calibration_is_within_one_percent_below_target():
    sigma = accountants.calibrate_rdp(1.0, 1e-5, 0.05, ((1.0, 200),))
    assert 0.99 <= independent_rdp([(sigma, 200)], 0.05, 1e-5) <= 1.0


def test_calibrated_plan_reclaims_the_budget_the_proactive_plan_leaves():
    proactive = plan_client(5736, 1.0, 1e-5, rule="proactive", compare=False)
    calibrated = plan_client(5736, 1.0, 1e-5, rule="calibrated", compare=False)
    assert (calibrated.sampling_rate, calibrated.steps) == (proactive.sampling_rate, proactive.steps)
    assert proactive.budget_unused > 0.3  # the rule spends about half (notes/privacy.md §2)
    assert calibrated.sigma < proactive.sigma
    assert 0 <= calibrated.budget_unused <= 0.01


def test_adp_plan_certifies_its_schedule_step_by_step():
    plan = plan_client(3000, 2.0, 1e-5, rule="adp", epochs=10, compare=False)
    sigmas = [s for s, _ in plan.noise_segments]
    assert len(plan.noise_segments) > 1 and sigmas == sorted(sigmas)  # α_t = 1/sqrt(η_t) grows as η_t decays
    assert plan.noise_multiplier(0) == pytest.approx(plan.sigma)
    assert 0.99 * 2.0 <= independent_pld(plan.noise_segments, plan.sampling_rate, 1e-5) <= 2.0


def test_split_events_compose_like_one_event():
    whole = accountants.pld_epsilon(accountants.constant_events(2.0, 0.05, 300), 1e-5)
    parts = [accountants.NoiseEvent(2.0, 0.05, 100), accountants.NoiseEvent(2.0, 0.05, 200)]
    assert accountants.pld_epsilon(parts, 1e-5) == pytest.approx(whole, rel=1e-3)
    assert accountants.prefix_events(parts, 150) == (accountants.NoiseEvent(2.0, 0.05, 100), accountants.NoiseEvent(2.0, 0.05, 50))


def test_epsilon_curve_grows_with_steps_and_ends_at_the_certificate():
    events = accountants.constant_events(3.0, 0.1, 64)
    curve = accountants.pld_epsilon_curve(events, 1e-5, [1, 8, 32, 64])
    assert curve == sorted(curve)
    assert curve[-1] == pytest.approx(accountants.pld_epsilon(events, 1e-5), rel=0.01)
