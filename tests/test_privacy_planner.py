"""plan_client: schedules, rules, refusals, validation, serialisation; plus property tests."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from independent import CERTIFICATE_REL_TOL, pld_epsilon

from fedprivacy.errors import InputError, PlanRefused
from fedprivacy.privacy import classical
from fedprivacy.privacy.calculator import feasible_plans, usable_rates
from fedprivacy.privacy.plan import Plan
from fedprivacy.privacy.planner import plan_client, resolve_schedule
from fedprivacy.privacy.proactive import proactive_sigma


def test_default_proactive_plan_uses_smallest_k_and_t():
    delta = 0.5 / 5736
    plan = plan_client(5736, 2.0, delta)
    assert plan.rule == "proactive"
    assert plan.sigma == pytest.approx(math.sqrt(2 * (2 + math.log(1 / delta)) / 2))
    assert (plan.steps, plan.epochs) == (25, pytest.approx(5.0))
    assert plan.expected_batch_size == pytest.approx(5736 * 0.2)
    assert plan.epsilon_pld == pytest.approx(pld_epsilon([(plan.sigma, 0.2, 25)], delta), rel=CERTIFICATE_REL_TOL)
    assert {c.name for c in plan.conditions} >= {
        "epsilon_regime",
        "delta_vs_n",
        "steps_lower_bound",
        "epochs_vs_log_n",
        "certified",
    }


@pytest.mark.parametrize("rule", ["proactive", "calibrated", "adp"])
@pytest.mark.parametrize("n", [2, 5736, 10**6])
def test_every_rule_refuses_a_delta_of_one_over_n_or_more(rule, n):
    """δ ≥ 1/N is met by a mechanism that publishes one random record outright."""
    for delta in {1 / n, min(2 / n, 0.9), 0.5}:
        with pytest.raises(InputError, match=r"must be below 1/N = .* allows releasing a record outright") as info:
            plan_client(n, 1.0, delta, rule=rule)
        assert info.value.field == "delta"


def test_sigma_by_rule_holds_every_rule():
    plan = plan_client(5736, 1.0, 1e-5, rule="calibrated", epochs=8)
    assert set(plan.sigma_by_rule) == {
        "naive",
        "strong",
        "rdp_calibrated",
        "pld_calibrated",
        "proactive",
        "adp",
        "dpgd",
    }
    by_rule = plan.sigma_by_rule
    assert by_rule["pld_calibrated"] == pytest.approx(plan.sigma)
    assert by_rule["pld_calibrated"] < by_rule["rdp_calibrated"] < by_rule["strong"] < by_rule["naive"]
    assert by_rule["proactive"] == pytest.approx(proactive_sigma(1.0, 1e-5))
    assert plan.moments_constant == pytest.approx(
        by_rule["rdp_calibrated"] * 1.0 / (plan.sampling_rate * math.sqrt(plan.steps * math.log(1e5)))
    )


def test_proactive_plan_far_outside_its_conditions_is_refused():
    # full-batch steps, T far below 2k²/ε: the proactive σ no longer certifies ε = 0.3
    with pytest.raises(PlanRefused, match="steps_lower_bound"):
        plan_client(5736, 0.3, 1e-5, rule="proactive", epochs=20, steps=20)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n=1, epsilon=1, delta=1e-5), "n"),
        (dict(n=100, epsilon=0, delta=1e-5), "epsilon"),
        (dict(n=100, epsilon=float("inf"), delta=1e-5), "epsilon"),
        (dict(n=100, epsilon=1, delta=0), "delta"),
        (dict(n=100, epsilon=1, delta=1.0), "delta"),
        (dict(n=100, epsilon=1, delta=1e-5, clip_norm=-1), "clip-norm"),
        (dict(n=100, epsilon=1, delta=1e-5, sampling_rate=0), "sampling-rate"),
        (dict(n=100, epsilon=1, delta=1e-5, sampling_rate=1.01), "sampling-rate"),
        (dict(n=100, epsilon=1, delta=1e-5, epochs=-2), "epochs"),
        (dict(n=100, epsilon=1, delta=1e-5, rounds=0), "rounds"),
        (dict(n=100, epsilon=1, delta=1e-5, rule="magic"), "rule"),
        (dict(n=100, epsilon=1, delta=1e-5, expected_batch_size=500), "batch-size"),
        (dict(n=100, epsilon=1, delta=1e-5, rule="calibrated", alpha_schedule="power"), "alpha-schedule"),
    ],
)
def test_bad_inputs_name_the_field(kwargs, field):
    with pytest.raises(InputError) as error:
        plan_client(**kwargs, compare=False)
    assert error.value.field == field
    assert str(error.value).startswith(f"{field}=")


def test_schedule_resolution():
    assert resolve_schedule(1000, 1.0, sampling_rate=0.1, steps=30) == (0.1, 30)
    assert resolve_schedule(1000, 1.0, epochs=3, sampling_rate=0.1) == (0.1, 30)
    assert resolve_schedule(1000, 1.0, expected_batch_size=50, epochs=2) == (0.05, 40)
    q, steps = resolve_schedule(1000, 0.5, epochs=4)
    assert steps == 64 and q == pytest.approx(4 / 64)
    with pytest.raises(InputError):
        resolve_schedule(1000, 1.0, epochs=5, sampling_rate=0.1, steps=30)


def test_plan_round_trips_through_json():
    plan = plan_client(3000, 1.0, 1e-5, rule="adp", rounds=7)
    again = Plan.from_dict(__import__("json").loads(plan.to_json()))
    assert again == plan


@pytest.mark.parametrize("rounds", [1, 3, 7, 64])
def test_rounds_split_all_steps(rounds):
    plan = plan_client(3000, 1.0, 1e-5, rule="calibrated", rounds=rounds, compare=False)
    split = [plan.steps_in_round(r) for r in range(1, rounds + 1)]
    assert sum(split) == plan.steps and max(split) - min(split) <= 1
    assert plan.first_step_of_round(rounds) == plan.steps - split[-1]


def test_calculator_ranks_feasible_plans_at_equal_epochs():
    rows = feasible_plans(3000, 1.0, 1e-5, epochs_grid=(2.0, 4.0), rate_grid=(0.01, 0.05, 0.2))
    assert len(rows) == 6
    for k in (2.0, 4.0):
        same = [r for r in rows if r.plan.epochs == pytest.approx(k, rel=0.05)]
        assert [r.rank for r in same] == [1, 2, 3]
        proxies = [r.plan.noise_std_on_mean for r in same]
        assert proxies == sorted(proxies)
        assert all(r.plan.epsilon_pld <= 1.0 for r in same)
        assert same[0].to_dict()["noise_std_on_mean"] == pytest.approx(
            same[0].plan.sigma * 1.0 / (same[0].plan.sampling_rate * 3000)
        )


def test_the_calculator_refuses_a_grid_that_leaves_no_plan():
    """An empty table is never an answer: a grid whose rates all sample under one record names n,
    one whose every point the rule refuses says why."""
    with pytest.raises(InputError, match=r"n=4: .*below one record .*needs N >= 5"):
        feasible_plans(4, 1.0, 0.1)
    assert usable_rates(10) == [0.1, 0.2]
    # proactive at N = 10, 16 epochs of q = 0.2: over budget (the calculator's own table leaves it out)
    with pytest.raises(PlanRefused, match=r"no plan of the grid \(1 point of"):
        feasible_plans(10, 1.0, 0.01, rule="proactive", epochs_grid=(16.0,), rate_grid=(0.2,))
    for grid in ((), (0.0, 0.1), (0.5, 2.0)):
        with pytest.raises(InputError, match=r"rate_grid=.*must be in \(0, 1\]"):
            feasible_plans(100, 1.0, 1e-5, rate_grid=grid)


# ---------------- property tests ----------------


@settings(max_examples=12, deadline=None)
@given(
    n=st.integers(100, 200_000),
    eps=st.floats(0.1, 8.0),
    delta=st.floats(1e-8, 1e-3),
    rule=st.sampled_from(["proactive", "calibrated", "adp"]),
    epochs=st.one_of(st.none(), st.floats(1.0, 12.0)),
)
def test_every_accepted_plan_is_within_budget(n, eps, delta, rule, epochs):
    """Within budget by dp-accounting itself, not only by the planner's own certificate."""
    assume(delta * n < 1)  # δ ≥ 1/N is refused (tested above)
    try:
        plan = plan_client(n, eps, delta, rule=rule, epochs=epochs, compare=False)
    except PlanRefused:
        return
    runs = [(sigma, plan.sampling_rate, count) for sigma, count in plan.noise_segments]
    assert pld_epsilon(runs, delta) <= eps * (1 + CERTIFICATE_REL_TOL)
    assert plan.sampling_rate * plan.steps == pytest.approx(plan.epochs)


@given(st.floats(0.01, 50.0), st.floats(0.01, 50.0), st.floats(1e-12, 0.5))
def test_proactive_sigma_decreases_as_epsilon_grows(e1, e2, delta):
    low, high = sorted((e1, e2))
    if high - low > 1e-9:
        assert proactive_sigma(low, delta) > proactive_sigma(high, delta)


@settings(max_examples=30, deadline=None)
@given(
    eps=st.floats(0.1, 10.0),
    delta=st.floats(1e-10, 1e-3),
    q=st.floats(1e-4, 0.5),
    steps=st.integers(1_000, 1_000_000),
)
def test_naive_needs_more_noise_than_strong_for_large_t(eps, delta, q, steps):
    assert classical.naive_sigma(eps, delta, q, steps) >= classical.strong_sigma(eps, delta, q, steps)
