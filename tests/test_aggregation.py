"""Aggregation weights from public plans: by examples, or by the inverse of the update's noise variance."""

from __future__ import annotations

import pytest

from fedprivacy.aggregation import aggregation_weight, update_noise_variance
from fedprivacy.errors import InputError
from fedprivacy.privacy.planner import plan_client


def test_inverse_noise_weights_follow_the_closed_form_of_the_update_variance():
    plan = plan_client(1000, 1.0, 1e-5, rule="calibrated", epochs=4, rounds=3, learning_rate=0.5, compare=False)
    steps = plan.steps_in_round(2)
    per_step = (0.5 * plan.sigma * plan.clip_norm / (plan.sampling_rate * plan.n)) ** 2
    assert update_noise_variance(plan, 2) == pytest.approx(steps * per_step)
    assert aggregation_weight("inverse-noise", plan, 2, plan.n) == pytest.approx(1 / (steps * per_step))
    assert aggregation_weight("examples", plan, 2, 1000) == 1000.0


def test_a_larger_budget_weighs_more_under_inverse_noise():
    small, large = (plan_client(1000, eps, 1e-5, rule="calibrated", epochs=4, rounds=2, compare=False) for eps in (0.5, 8.0))
    assert aggregation_weight("inverse-noise", large, 1, 1000) > 10 * aggregation_weight("inverse-noise", small, 1, 1000)


def test_adp_schedules_sum_every_step_of_the_round():
    plan = plan_client(1000, 2.0, 1e-5, rule="adp", epochs=8, rounds=2, compare=False)
    first, count = plan.first_step_of_round(2), plan.steps_in_round(2)
    expected = sum((plan.learning_rate_at(t) * plan.noise_multiplier(t) * plan.clip_norm / (plan.sampling_rate * plan.n)) ** 2
                   for t in range(first, first + count))
    assert update_noise_variance(plan, 2) == pytest.approx(expected)
    assert len({plan.noise_multiplier(t) for t in range(first, first + count)}) > 1  # σ_t varies within the round


def test_an_unknown_scheme_is_refused_by_name():
    plan = plan_client(1000, 1.0, 1e-5, compare=False)
    with pytest.raises(InputError, match="aggregation='median': must be one of: examples, inverse-noise"):
        aggregation_weight("median", plan, 1, 1000)
