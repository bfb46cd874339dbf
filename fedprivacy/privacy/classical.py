"""The classical noise rules, for comparison on the planning sheet, and where their formulas hold.

All of them are stated for T steps of DP-SGD with sampling rate q and a total target (ε, δ).
As in the usual presentation of DP-SGD (Abadi et al. 2016, Sec. 3.1, before the moments
accountant), one subsampled step that must be (ε_s, δ_s)-DP gets the Gaussian noise
multiplier σ = q·sqrt(2 ln(1.25 q/δ_s))/ε_s (the base Gaussian mechanism at (ε_s/q, δ_s/q),
amplified by sampling). Naive composition spends ε/T and δ/T per step; strong composition is
the exact advanced-composition formula (Dwork & Roth 2014 Thm 3.20; Wu et al. (ADP-SGD)
Lemma A.2), solved numerically (not its O(·) form).

A formula is a valid (ε, δ) bound only where the theorems it chains hold, so every σ (or ε, or
constant) comes as a `Bound` with its `Condition`s, and is shown only where they are met:

- `gaussian_range`: the lot-level ε₀ = ε_s/q ≤ 1. Dwork & Roth 2014, Thm 3.22 state the
  σ = sqrt(2 ln(1.25/δ₀))/ε₀ Gaussian for ε₀ ∈ (0, 1) (its bound reaches ε₀ = 1 by continuity);
  Abadi et al. 2016 §3.1 amplify it "for ε ≤ 1".
- `amplified_step`: the step really is (ε_s, δ_s)-DP. The formula amplifies with the factor q
  (Abadi et al. §3.1 write O(qε)); the lemma gives ln(1 + q(e^ε₀ − 1)) (Li, Qardaji & Su 2012,
  Thm 1; Wu et al.'s Lemma A.1's (e^ε₀ − 1)q is looser), which exceeds qε₀. By that lemma the step is
  (ε_s, δ_s)-DP where the lot Gaussian is (ln(1 + (e^ε_s − 1)/q), δ_s/q)-DP, which is checked on its
  exact privacy profile (Balle & Wang 2018, Thm 8). Without it the formula fails even inside ε₀ ≤ 1: one step at ε₀ = 1,
  q = 0.01, δ = 1e-10 spends 1.28 times its ε (PLD).

Composition itself adds nothing: basic composition (Dwork & Roth Thm 3.16) and the advanced form
used here (Wu et al. (ADP-SGD) Lemma A.2) hold for every ε₀, δ₀, δ'' > 0. DP-GD (Brown's DP-GD notes §2.3) is stated for
ε ≤ 1 and δ ≤ 1/2; the moments accountant's constant (Abadi et al. Thm 1) needs Lemma 3's σ ≥ 1
and q < 1/(16σ).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from scipy.optimize import brentq, minimize_scalar
from scipy.special import log_ndtr

from fedprivacy.privacy.plan import Condition


@dataclass(frozen=True)
class Bound:
    """A classical rule's value (a σ, an ε or a constant) and the conditions under which it is valid."""

    value: float
    conditions: tuple[Condition, ...]

    @property
    def holds(self) -> bool:
        return all(c.met for c in self.conditions if c.kind == "required")

    @property
    def failed(self) -> tuple[str, ...]:
        """Names of the required conditions not met."""
        return tuple(c.name for c in self.conditions if c.kind == "required" and not c.met)

    @property
    def shown(self) -> float | None:
        """The value where its formula holds, None elsewhere: what tables and figures show."""
        return self.value if self.holds else None


# ----- the formulas -----
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
    """ε̃ = ε'·sqrt(2T ln(1/δ'')) + T·ε'(e^ε' − 1)/(e^ε' + 1) (Wu et al. (ADP-SGD) Lemma A.2)."""
    return step_eps * math.sqrt(2.0 * steps * math.log(1.0 / delta_slack)) + steps * step_eps * math.tanh(step_eps / 2)


def _strong_step(epsilon: float, delta: float, q: float, steps: int, slack_share: float) -> tuple[float, float, float]:
    """(σ, ε_s, δ_s) of strong composition with a share `slack_share` of δ left as the slack δ''."""
    slack = slack_share * delta
    per_step_delta = (1.0 - slack_share) * delta / steps
    upper = epsilon / math.sqrt(2.0 * steps * math.log(1.0 / slack))
    step_eps = brentq(lambda e: advanced_composition_epsilon(e, steps, slack) - epsilon, 1e-15, upper * (1 + 1e-12))
    return step_sigma(step_eps, per_step_delta, q), step_eps, per_step_delta


def _best_share(objective: Callable[[float], float]) -> float:
    """The δ split (share of δ kept as slack) that minimises `objective`."""
    result = minimize_scalar(objective, bounds=(1e-4, 1 - 1e-4), method="bounded", options={"xatol": 1e-5})
    return float(result.x)


def strong_sigma(epsilon: float, delta: float, sampling_rate: float, steps: int) -> float:
    """Smallest σ that strong composition certifies for (ε, δ) after T steps.

    Total δ = T·δ_s + δ''; the split between per-step δ_s and the slack δ'' is optimised.
    """
    return strong(epsilon, delta, sampling_rate, steps).value


def _strong_epsilon_split(sigma: float, delta: float, q: float, steps: int, share: float) -> tuple[float, float]:
    """(ε after T steps, δ_s) under strong composition with a share `share` of δ as slack."""
    per_step_delta = (1.0 - share) * delta / steps
    return advanced_composition_epsilon(step_epsilon(sigma, per_step_delta, q), steps, share * delta), per_step_delta


def strong_epsilon(sigma: float, delta: float, sampling_rate: float, steps: int) -> float:
    """ε after `steps` steps of noise σ under strong composition (best δ split)."""
    return strong_epsilon_bound(sigma, delta, sampling_rate, steps).value


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


# ----- where they hold -----
def gaussian_delta(sigma: float, epsilon: float) -> float:
    """Exact δ(ε) of the Gaussian mechanism with sensitivity 1 and noise σ (Balle & Wang 2018, Thm 8):
    Φ(1/(2σ) − εσ) − e^ε·Φ(−1/(2σ) − εσ), in logs so that tiny tails keep their digits."""
    log_first = log_ndtr(1.0 / (2.0 * sigma) - epsilon * sigma)
    log_second = epsilon + log_ndtr(-1.0 / (2.0 * sigma) - epsilon * sigma)
    return float(-math.exp(log_first) * math.expm1(log_second - log_first))


def step_conditions(sigma: float, step_eps: float, step_delta: float, sampling_rate: float) -> tuple[Condition, ...]:
    """Whether one subsampled step with noise σ is (ε_s, δ_s)-DP by the argument the formulas use."""
    lot_eps = step_eps / sampling_rate
    in_range = lot_eps <= 1.0
    needed_eps = math.log1p(math.expm1(step_eps) / sampling_rate)  # amplified by q (Li et al.) to exactly ε_s
    lot_delta = step_delta / sampling_rate
    exact_delta = gaussian_delta(sigma, needed_eps)
    amplified = exact_delta <= lot_delta
    return (
        Condition(
            "gaussian_range",
            in_range,
            f"lot-level ε₀ = ε_step/q = {lot_eps:.3g} {'≤' if in_range else '>'} 1 (Dwork & Roth Thm 3.22: "
            "the classical Gaussian σ = sqrt(2 ln(1.25/δ₀))/ε₀ holds for ε₀ ≤ 1)",
        ),
        Condition(
            "amplified_step",
            amplified,
            f"step (ε, δ) = ({step_eps:.3g}, {step_delta:.3g}) needs the Gaussian σ = {sigma:.3g} to be "
            f"({needed_eps:.3g}, {lot_delta:.3g})-DP before sampling (Li et al. 2012 Thm 1); its exact δ there "
            f"is {exact_delta:.3g} {'≤' if amplified else '>'} {lot_delta:.3g} (Balle & Wang 2018 Thm 8)",
        ),
    )


def naive(epsilon: float, delta: float, sampling_rate: float, steps: int) -> Bound:
    """The naive σ for (ε, δ) after T steps, with its conditions."""
    sigma = naive_sigma(epsilon, delta, sampling_rate, steps)
    return Bound(sigma, step_conditions(sigma, epsilon / steps, delta / steps, sampling_rate))


def naive_epsilon_bound(sigma: float, delta: float, sampling_rate: float, steps: int) -> Bound:
    """The naive ε of T steps of noise σ, with its conditions."""
    step_eps = step_epsilon(sigma, delta / steps, sampling_rate)
    return Bound(steps * step_eps, step_conditions(sigma, step_eps, delta / steps, sampling_rate))


def strong(epsilon: float, delta: float, sampling_rate: float, steps: int) -> Bound:
    """The strong-composition σ for (ε, δ) after T steps (best δ split), with its conditions."""
    share = _best_share(lambda s: _strong_step(epsilon, delta, sampling_rate, steps, s)[0])
    sigma, step_eps, step_delta = _strong_step(epsilon, delta, sampling_rate, steps, share)
    return Bound(sigma, step_conditions(sigma, step_eps, step_delta, sampling_rate))


def strong_epsilon_bound(sigma: float, delta: float, sampling_rate: float, steps: int) -> Bound:
    """The strong-composition ε of T steps of noise σ (best δ split), with its conditions."""
    share = _best_share(lambda s: _strong_epsilon_split(sigma, delta, sampling_rate, steps, s)[0])
    epsilon, step_delta = _strong_epsilon_split(sigma, delta, sampling_rate, steps, share)
    step_eps = step_epsilon(sigma, step_delta, sampling_rate)
    return Bound(epsilon, step_conditions(sigma, step_eps, step_delta, sampling_rate))


def dpgd(epsilon: float, delta: float, steps: int) -> Bound:
    """The DP-GD σ with the stated range of G. Brown's DP-GD lecture notes (§2.3: 0 ≤ ε ≤ 1, 0 < δ ≤ 1/2)."""
    return Bound(
        dpgd_sigma(epsilon, delta, steps),
        (
            Condition(
                "dpgd_epsilon",
                epsilon <= 1.0,
                f"ε = {epsilon:g} {'≤' if epsilon <= 1 else '>'} 1 (Brown's DP-GD notes §2.3)",
            ),
            Condition(
                "dpgd_delta",
                delta <= 0.5,
                f"δ = {delta:.3g} {'≤' if delta <= 0.5 else '>'} 1/2 (Brown's DP-GD notes §2.3)",
            ),
            Condition(
                "dpgd_full_batch",
                True,
                "stated for full-batch steps and replace-one sensitivity 2C/N; Poisson sampling and "
                "add/remove (sensitivity C) only add privacy",
                kind="information",
            ),
        ),
    )


def moments(sigma: float, epsilon: float, delta: float, sampling_rate: float, steps: int) -> Bound:
    """The constant c that an RDP-calibrated σ implies in Abadi et al.'s Thm 1, with Lemma 3's range."""
    limit = 1.0 / (16.0 * sigma)
    return Bound(
        moments_constant(sigma, epsilon, delta, sampling_rate, steps),
        (
            Condition(
                "lemma3_sigma", sigma >= 1.0, f"σ = {sigma:.3g} {'≥' if sigma >= 1 else '<'} 1 (Abadi et al. Lemma 3)"
            ),
            Condition(
                "lemma3_sampling",
                sampling_rate < limit,
                f"q = {sampling_rate:.3g} {'<' if sampling_rate < limit else '≥'} 1/(16σ) = {limit:.3g} "
                "(Abadi et al. Lemma 3)",
            ),
            Condition(
                "theorem1_epsilon",
                True,
                f"Thm 1 also needs ε < c₁q²T = c₁·{sampling_rate**2 * steps:.3g} (c₁ not given)",
                kind="information",
            ),
        ),
    )
