"""What private hyper-parameter tuning costs: random search with a random number of trials.

Papernot & Steinke 2022 ("Hyperparameter tuning with Renyi differential privacy", Theorem 2): run
a private base mechanism Q (here: one training run with a candidate drawn at random, and its
validation score released with noise) K times, K drawn from a truncated negative binomial
D_{η,γ}, and release only the best run. If Q is (λ, ε(λ))-RDP at every order λ, the selection is
(λ, ε'(λ))-RDP with

    ε'(λ) = ε(λ) + (1 + η)·min over λ̂ of [(1 − 1/λ̂)·ε(λ̂) + ln(1/γ)/λ̂] + ln(E[K])/(λ − 1),

and, RDP being monotone in λ, ε' at an order is at most ε' at any larger one. The shape η = 1
is the geometric distribution (γ = 1/E[K]), η = 0 the logarithmic one. dp-accounting's
`RepeatAndSelectDpEvent` computes this for one base event; here the base curve is the pointwise
maximum over the candidates (each candidate is its own plan, and a Rényi divergence of two
mixtures with the same weights is at most the largest of the components'), so the theorem is
applied to a curve (`repeat_and_select`, tested equal to dp-accounting's for one event).

Everything here is a function of public inputs (the candidates' plans, the trial count's
distribution, the score's noise), so the cost is known before any trial runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from dp_accounting import dp_event, rdp
from dp_accounting.rdp import rdp_privacy_accountant
from scipy.optimize import brentq

from fedprivacy.privacy.accountants import ADJACENCY, NoiseEvent, dp_event_of

ORDERS = tuple(float(order) for order in rdp_privacy_accountant.DEFAULT_RDP_ORDERS)
GEOMETRIC = 1.0  # the default shape η: K ~ geometric, the simplest of Papernot & Steinke's distributions


@dataclass(frozen=True)
class TrialCount:
    """K ~ D_{η,γ}, the truncated negative binomial of Papernot & Steinke 2022 (Definition 1), given
    by its mean E[K] ≥ 1 and shape η ≥ 0: P[K = k] ∝ (1 − γ)^k·Π_{ℓ<k} (ℓ + η)/(ℓ + 1) for k ≥ 1
    (η = 0: ∝ (1 − γ)^k/k)."""

    mean: float
    shape: float = GEOMETRIC

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mean) and self.mean >= 1):
            raise ValueError(f"mean number of trials {self.mean!r}: must be a finite number >= 1")
        if not (math.isfinite(self.shape) and self.shape >= 0):
            raise ValueError(f"shape {self.shape!r}: must be a finite number >= 0")

    @cached_property
    def gamma(self) -> float:
        """γ with E[K] = `mean` (E[K] falls as γ grows: 1 at γ = 1)."""
        if self.mean == 1:
            return 1.0
        if self.shape == 1:
            return 1.0 / self.mean
        gamma = brentq(lambda g: _mean(g, self.shape) - self.mean, 1e-300, 1.0 - 1e-15, xtol=1e-300, rtol=1e-15)
        while _mean(gamma, self.shape) < self.mean:  # never above the true γ: ln(1/γ) errs on the costly side
            gamma = math.nextafter(gamma, 0.0)
        return gamma

    def pmf(self, k: int) -> float:
        """P[K = k]."""
        if k < 1:
            return 0.0
        gamma, eta = self.gamma, self.shape
        if gamma == 1.0:
            return 1.0 if k == 1 else 0.0
        log_rest = k * math.log1p(-gamma)
        if eta == 0:
            return math.exp(log_rest - math.log(k) - math.log(-math.log(gamma)))
        log_binomial = math.lgamma(k + eta) - math.lgamma(eta) - math.lgamma(k + 1)
        return math.exp(log_binomial + log_rest - math.log(math.expm1(-eta * math.log(gamma))))

    def draw(self, uniform: float) -> int:
        """The smallest k whose CDF exceeds `uniform` in [0, 1) (inversion). From a 53-bit uniform,
        K's law is within about 2⁻⁵² of D_{η,γ} in total variation (the uniform's grid and the CDF's
        rounding), which adds at most that to δ; K has no cap."""
        if not 0.0 <= uniform < 1.0:
            raise ValueError(f"uniform {uniform!r}: must be in [0, 1)")
        total, k = 0.0, 0
        while True:
            k += 1
            mass = self.pmf(k)
            total += mass
            if total > uniform or (mass == 0.0 and k > self.mean):  # past the CDF's float resolution
                return k


def _mean(gamma: float, shape: float) -> float:
    """E[K] of D_{η,γ}: η(1/γ − 1)/(1 − γ^η), and (1/γ − 1)/ln(1/γ) at η = 0."""
    if shape == 0:
        return (1.0 / gamma - 1.0) / -math.log(gamma)
    return shape * (1.0 / gamma - 1.0) / -math.expm1(shape * math.log(gamma))


def run_curve(events: Sequence[NoiseEvent]) -> np.ndarray:
    """The RDP ε(λ) at `ORDERS` of one run's Poisson-subsampled Gaussian steps (dp-accounting)."""
    if not any(event.count > 0 for event in events):
        return np.zeros(len(ORDERS))
    accountant = rdp.RdpAccountant(list(ORDERS), ADJACENCY)
    accountant.compose(dp_event_of(events))
    return np.asarray(accountant.rdp, dtype=float)


def score_curve(noise_std: float) -> np.ndarray:
    """RDP of a count released with Gaussian noise of std `noise_std` (sensitivity one record)."""
    accountant = rdp.RdpAccountant(list(ORDERS), ADJACENCY)
    accountant.compose(dp_event.GaussianDpEvent(noise_std))
    return np.asarray(accountant.rdp, dtype=float)


def repeat_and_select(curve: np.ndarray, count: TrialCount) -> np.ndarray:
    """ε'(λ) of releasing the best of K runs of a mechanism with RDP `curve` (Theorem 2 above)."""
    orders = np.asarray(ORDERS)
    eta = count.shape
    constant = (1 + eta) * float(np.min((1 - 1 / orders) * curve - math.log(count.gamma) / orders))
    selected = curve + math.log(count.mean) / (orders - 1) + constant
    return np.minimum.accumulate(selected[::-1])[::-1]  # monotone in λ: the smallest at any larger order


def epsilon(curve: np.ndarray, delta: float) -> float:
    """(ε, δ) from an RDP curve at `ORDERS` (dp-accounting's conversion)."""
    value, _ = rdp_privacy_accountant.compute_epsilon(list(ORDERS), list(curve), delta)
    return float(value)


@dataclass(frozen=True)
class TuningCost:
    """One client's ε at its δ: one run alone, the tuned result (the selection, then one run of the
    choice), and every trial that ran with the choice's run (what a party seeing every trial sees)."""

    one_run: float
    tuned: float
    all_trials: float


def tuning_cost(
    trial_curves: Sequence[np.ndarray],
    final_curves: Sequence[np.ndarray],
    score_noise: float,
    count: TrialCount,
    delta: float,
    ran: Sequence[int] = (),
) -> TuningCost:
    """A client's cost of private random search: `trial_curves[c]` its RDP in a tuning run of
    candidate c, `final_curves[c]` in a cell run with c (a client a candidate leaves out: zeros).

    The base mechanism is a trial: any candidate's run (the maximum over them) composed with the
    noisy score (both counted, so a record on either side of the fit/validation split is covered).
    The tuned result adds one run with the choice, which depends on the selection: the maximum over
    candidates again. `ran` (candidate per trial) gives the cost of every trial's run and score,
    composed with that run: what the selection's theorem does not cover (NaN without trials)."""
    score = score_curve(score_noise)
    trial = np.max(np.stack(trial_curves), axis=0) + score
    final = np.max(np.stack(final_curves), axis=0)
    one_run = epsilon(final, delta)
    tuned = epsilon(repeat_and_select(trial, count) + final, delta)
    seen = sum((trial_curves[c] + score for c in ran), final)
    return TuningCost(one_run, tuned, epsilon(seen, delta) if ran else math.nan)
