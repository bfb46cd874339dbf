"""The classical noise rules, for comparison on the planning sheet.

All of them are stated for T steps of DP-SGD with sampling rate q and a total target (ε, δ).
As in the usual presentation of DP-SGD (Abadi et al. 2016, Sec. 3.1, before the moments
accountant), one subsampled step that must be (ε_s, δ_s)-DP gets the Gaussian noise
multiplier σ = q·sqrt(2 ln(1.25 q/δ_s))/ε_s (the base Gaussian mechanism at (ε_s/q, δ_s/q),
amplified by sampling). Naive composition spends ε/T and δ/T per step; strong composition is
the exact Dwork–Roth advanced-composition formula, solved numerically (not its O(·) form).
"""

from __future__ import annotations

import math

from scipy.optimize import brentq, minimize_scalar


def step_sigma(step_epsilon: float, step_delta: float, sampling_rate: float) -> float:
    """σ that makes one subsampled Gaussian step (ε_s, δ_s)-DP, the classical per-step relation."""
    return sampling_rate * math.sqrt(2.0 * math.log(1.25 * sampling_rate / step_delta)) / step_epsilon


def step_epsilon(sigma: float, step_delta: float, sampling_rate: float) -> float:
    """Inverse of `step_sigma`: the per-step ε a noise multiplier buys."""
    return sampling_rate * math.sqrt(2.0 * math.log(1.25 * sampling_rate / step_delta)) / sigma


def naive_sigma(epsilon: float, delta: float, sampling_rate: float, steps: int) -> float:
    """Naive (basic) composition (Dwork & Roth 2014, Thm 3.16): σ = qT·sqrt(2 ln(1.25 qT/δ))/ε."""
    return step_sigma(epsilon / steps, delta / steps, sampling_rate)


def naive_epsilon(sigma: float, delta: float, sampling_rate: float, steps: int) -> float:
    """ε after `steps` steps of noise σ under naive composition."""
    return steps * step_epsilon(sigma, delta / steps, sampling_rate)


def advanced_composition_epsilon(step_eps: float, steps: int, delta_slack: float) -> float:
    """Dwork–Roth: ε̃ = ε'·sqrt(2T ln(1/δ'')) + T·ε'(e^ε' − 1)/(e^ε' + 1)."""
    return step_eps * math.sqrt(2.0 * steps * math.log(1.0 / delta_slack)) + steps * step_eps * math.tanh(step_eps / 2)


def _strong_sigma_for_split(epsilon: float, delta: float, q: float, steps: int, slack_share: float) -> float:
    slack = slack_share * delta
    per_step_delta = (1.0 - slack_share) * delta / steps
    upper = epsilon / math.sqrt(2.0 * steps * math.log(1.0 / slack))
    step_eps = brentq(lambda e: advanced_composition_epsilon(e, steps, slack) - epsilon, 1e-15, upper * (1 + 1e-12))
    return step_sigma(step_eps, per_step_delta, q)


def strong_sigma(epsilon: float, delta: float, sampling_rate: float, steps: int) -> float:
    """Smallest σ that strong composition certifies for (ε, δ) after T steps.

    Total δ = T·δ_s + δ''; the split between per-step δ_s and the slack δ'' is optimised.
    """
    result = minimize_scalar(
        lambda share: _strong_sigma_for_split(epsilon, delta, sampling_rate, steps, share),
        bounds=(1e-4, 1 - 1e-4),
        method="bounded",
        options={"xatol": 1e-5},
    )
    return float(result.fun)


def strong_epsilon(sigma: float, delta: float, sampling_rate: float, steps: int) -> float:
    """ε after `steps` steps of noise σ under strong composition (best δ split)."""

    def epsilon_for(share: float) -> float:
        per_step_delta = (1.0 - share) * delta / steps
        return advanced_composition_epsilon(step_epsilon(sigma, per_step_delta, sampling_rate), steps, share * delta)

    result = minimize_scalar(epsilon_for, bounds=(1e-4, 1 - 1e-4), method="bounded", options={"xatol": 1e-5})
    return float(result.fun)


def moments_constant(sigma: float, epsilon: float, delta: float, sampling_rate: float, steps: int) -> float:
    """The c of Abadi et al. Thm 1 (σ ≥ c·q·sqrt(T ln(1/δ))/ε) implied by an RDP-calibrated σ."""
    return sigma * epsilon / (sampling_rate * math.sqrt(steps * math.log(1.0 / delta)))


def dpgd_sigma(epsilon: float, delta: float, steps: int) -> float:
    """Full-batch DP-GD with basic composition (G. Brown's lecture notes on DP gradient
    descent, Lecture 4 §2.3), as a noise multiplier.

    λ = 2CT·sqrt(2 log(2T/δ))/(εn) is the noise std on the averaged gradient (replace-one
    sensitivity 2C/n); λ·n/C is the multiplier on the sum. Stated for ε ≤ 1, δ ≤ 1/2.
    """
    return 2.0 * steps * math.sqrt(2.0 * math.log(2.0 * steps / delta)) / epsilon
