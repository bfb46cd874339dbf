"""Closed forms of the seeds, checked against values computed by hand from the seeds' formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedprivacy.privacy import adp, classical
from fedprivacy.privacy.proactive import (
    proactive_conditions,
    proactive_sigma,
    proactive_steps,
    smallest_epochs,
)


def test_proactive_sigma_matches_hand_values():
    # sqrt(2(1 + ln 1e5)/1) = sqrt(2 * 12.512925) = 5.0025845
    assert proactive_sigma(1.0, 1e-5) == pytest.approx(5.0025845, abs=1e-6)
    # sqrt(2(0.25 + ln 3000)/0.25) = sqrt(8 * (0.25 + 8.0063676)) = 8.1271729
    assert proactive_sigma(0.25, 1 / 3000) == pytest.approx(8.1271729, abs=1e-6)


@pytest.mark.parametrize("n, k", [(3000, 4), (5736, 5), (60000, 5), (2, 2), (10**9, 7)])
def test_smallest_epochs_meets_log_n_condition_and_is_smallest(n, k):
    factor = (2 / math.e) ** 2
    assert smallest_epochs(n) == k
    assert factor * k**2 - 0.5 >= math.log(n)
    assert factor * (k - 1) ** 2 - 0.5 < math.log(n)


@pytest.mark.parametrize("k, eps, steps", [(5, 2.0, 25), (4, 0.25, 128), (5, 0.49, 103), (5, 1.0, 50), (2, 8.0, 2)])
def test_proactive_steps_is_ceil_of_two_k_squared_over_epsilon(k, eps, steps):
    assert proactive_steps(k, eps) == steps


def test_proactive_conditions_are_named_and_evaluated():
    conditions = {c.name: c for c in proactive_conditions(5736, 0.49, 1 / 5736, 5, 103)}
    assert set(conditions) == {
        "epsilon_regime",
        "delta_vs_n",
        "steps_lower_bound",
        "epochs_vs_log_n",
        "earlier_epsilon_scale",
    }
    assert all(c.met for c in conditions.values())
    assert conditions["earlier_epsilon_scale"].kind == "information"
    failing = {c.name: c.met for c in proactive_conditions(5736, 1.0, 1e-3, 3, 10)}
    assert failing == {
        "epsilon_regime": False,
        "delta_vs_n": False,
        "steps_lower_bound": False,
        "epochs_vs_log_n": False,
        "earlier_epsilon_scale": True,
    }


def test_naive_sigma_is_seed_000_formula():
    q, steps, eps, delta = 0.01, 1000, 1.0, 1e-5
    # qT sqrt(2 ln(1.25 qT/δ))/ε = 10 sqrt(2 ln 1.25e6) = 10 * 5.29882 = 52.9882
    assert classical.naive_sigma(eps, delta, q, steps) == pytest.approx(52.9882, abs=1e-3)
    assert classical.naive_epsilon(52.9882, delta, q, steps) == pytest.approx(1.0, abs=1e-4)


def test_advanced_composition_hand_value():
    # 0.01 sqrt(200 ln 1e5) + 100 * 0.01 * (e^0.01 - 1)/(e^0.01 + 1) = 0.479850 + 0.0049999
    value = classical.advanced_composition_epsilon(0.01, 100, 1e-5)
    assert value == pytest.approx(
        0.01 * math.sqrt(200 * math.log(1e5)) + (math.exp(0.01) - 1) / (math.exp(0.01) + 1), rel=1e-12
    )
    assert value == pytest.approx(0.48485, abs=1e-5)


def test_strong_sigma_solves_the_exact_advanced_composition_formula():
    eps, delta, q, steps = 1.0, 1e-5, 0.01, 10_000
    sigma = classical.strong_sigma(eps, delta, q, steps)
    assert classical.strong_epsilon(sigma, delta, q, steps) == pytest.approx(eps, rel=1e-3)
    # any fixed δ split (here half/half, solved by hand with bisection) needs at least as much noise
    slack, per_step = delta / 2, delta / 2 / steps
    lo, hi = 1e-12, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        total = mid * math.sqrt(2 * steps * math.log(1 / slack)) + steps * mid * (math.exp(mid) - 1) / (
            math.exp(mid) + 1
        )
        lo, hi = (mid, hi) if total < eps else (lo, mid)
    half_split_sigma = q * math.sqrt(2 * math.log(1.25 * q / per_step)) / lo
    assert sigma <= half_split_sigma * (1 + 1e-6)
    assert sigma >= 0.8 * half_split_sigma  # the optimum is near: the split matters only logarithmically


def test_dpgd_basic_composition_hand_value():
    # Brown's DP-GD lecture notes: λ n / C = 2T sqrt(2 log(2T/δ))/ε;
    # T=10, δ=1e-5, ε=1: 20 sqrt(2 ln 2e6) = 20 * 5.386772 = 107.7354
    assert classical.dpgd_sigma(1.0, 1e-5, 10) == pytest.approx(107.7354, abs=1e-3)


def test_moments_constant_inverts_abadi_form():
    c = classical.moments_constant(2.0, 1.0, 1e-5, 0.01, 1000)
    assert c * 0.01 * math.sqrt(1000 * math.log(1e5)) / 1.0 == pytest.approx(2.0)


def test_extended_composition_reduces_to_classical_for_equal_steps():
    eps, delta = adp.extended_advanced_composition([0.05] * 50, [1e-7] * 50, 1e-6)
    assert eps == pytest.approx(classical.advanced_composition_epsilon(0.05, 50, 1e-6), rel=1e-12)
    assert delta == pytest.approx(1 - (1 - 1e-7) ** 50 + 1e-6, rel=1e-9)


def test_extended_composition_with_unequal_steps_hand_value():
    eps, delta = adp.extended_advanced_composition([0.1, 0.2], [1e-6, 2e-6], 1e-5)
    expected = math.sqrt(2 * (0.01 + 0.04) * math.log(1e5)) + 0.1 * math.tanh(0.05) + 0.2 * math.tanh(0.1)
    assert eps == pytest.approx(expected, rel=1e-12)
    assert delta == pytest.approx(1 - (1 - 1e-6) * (1 - 2e-6) + 1e-5, rel=1e-9)


def test_theorem41_with_constant_alpha_is_equation_13():
    q, steps, eps, delta = 256 / 50000, 1000, 1.0, 1e-5
    b_delta = math.log(16 * steps * q / delta) * math.log(1.25 / delta)
    expected = 16 * q * math.sqrt(steps * b_delta) / eps  # σ·m/C with σ² = (16C)² B_δ T/(n² ε²)
    assert adp.theorem41_scale(eps, delta, q, np.ones(steps)) == pytest.approx(expected, rel=1e-12)


def test_theorem41_condition_on_t_is_every_step_within_epsilon_one():
    """Constant α: min α²·Σ1/α² = T, so the condition is T ≥ ε² log(1.25/δ0)/(32q²B_δ); at the
    boundary each step's ε_t under Theorem 4.1's σ is exactly 1 (Step One of its proof)."""
    q, eps, delta = 0.05, 4.0, 1e-5

    def condition(steps: int) -> bool:
        (_, on_t) = adp.theorem41_conditions(eps, delta, q, np.ones(steps))
        return on_t.met

    def step_epsilon(steps: int) -> float:  # ε_t = 2·sqrt(2 log(1.25/δ0)) / σ_t, replace-one sensitivity 2C
        delta0 = (1 - (1 - 0.2 * delta) ** (1 / steps)) / q
        return 2 * math.sqrt(2 * math.log(1.25 / delta0)) / adp.theorem41_scale(eps, delta, q, np.ones(steps))

    short, long = 5, 5000
    assert step_epsilon(short) > 1 and not condition(short)
    assert step_epsilon(long) < 1 and condition(long)
    boundary = next(t for t in range(short, long) if condition(t))
    assert step_epsilon(boundary) <= 1 < step_epsilon(boundary - 1)


def test_theorem41_power_one_scales_with_harmonic_sum():
    steps = 500
    alphas = adp.alpha_values("power", steps, power=1.0)
    assert alphas**2 == pytest.approx(np.arange(1, steps + 1))
    ratio = adp.theorem41_scale(1.0, 1e-5, 0.01, alphas) / adp.theorem41_scale(1.0, 1e-5, 0.01, np.ones(steps))
    harmonic = sum(1 / t for t in range(1, steps + 1))
    assert ratio == pytest.approx(math.sqrt(harmonic / steps), rel=1e-12)


def test_inverse_sqrt_lr_alpha_follows_the_step_size():
    alphas = adp.alpha_values(
        "inverse_sqrt_lr", 4, learning_rate=1.0, lr_schedule="inverse_sqrt", lr_params={"a": 20, "c": 1}
    )
    assert alphas == pytest.approx([20**0.25, 21**0.25, 22**0.25, 23**0.25])


def test_alpha_segments_floor_to_the_grid_and_cover_every_step():
    alphas = adp.alpha_values("power", 1000, power=1.0)
    segments = adp.alpha_segments(alphas)
    assert sum(count for _, count in segments) == 1000
    relative = alphas / alphas[0]
    expanded = np.concatenate([np.full(count, value) for value, count in segments])
    assert np.all(expanded <= relative * (1 + 1e-12))
    assert np.all(expanded > relative / adp.ALPHA_GRID_RATIO)
