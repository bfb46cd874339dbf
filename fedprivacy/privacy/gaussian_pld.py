"""The PLD of a Poisson-subsampled Gaussian step, as dp-accounting builds it, with δ(ε) vectorised.

dp-accounting's `from_gaussian_mechanism` (connect-the-dots, pessimistic) evaluates the hockey-
stick divergence δ(ε) at every point of the loss grid, and inverts the privacy loss there one
point at a time in Python: 77k points × 2 adjacencies for a T = 10⁵ plan, two thirds of the time
of a certificate (benchmarks/planning_speed.py). The inverse has a closed form, so here it is one
numpy expression over the whole grid. Everything else (the truncation bounds, the mixture CDFs,
the connect-the-dots discretisation, the PLD object) is dp-accounting's own code; the result
equals `from_gaussian_mechanism` to rounding (tests/test_privacy_accountants.py).
"""

from __future__ import annotations

import math

import numpy as np
from dp_accounting.pld import pld_pmf, privacy_loss_distribution, privacy_loss_mechanism

Adjacency = privacy_loss_mechanism.AdjacencyType


class _GaussianLoss(privacy_loss_mechanism.GaussianPrivacyLoss):
    """dp-accounting's Gaussian privacy loss with `get_delta_for_epsilon` over arrays at once."""

    def get_delta_for_epsilon(self, epsilon):  # same contract as the parent's
        eps = np.atleast_1d(np.asarray(epsilon, dtype=float))
        q, sensitivity = self.sampling_prob, self.sensitivity
        deltas = np.zeros_like(eps)
        with np.errstate(divide="ignore"):  # the grid's end point may sit exactly on a bound
            if q == 1.0:
                inside, unsampled_loss = np.ones_like(eps, dtype=bool), eps
            elif self.adjacency_type == Adjacency.ADD:
                # loss = -ln(1 + (e^-ε' - 1)/q) inverted: ε' = ε - ln(1 - (1-q)e^ε) + ln q
                inside = eps < -math.log1p(-q)
                e = eps[inside]
                unsampled_loss = e - np.log1p(-(1 - q) * np.exp(e)) + math.log(q)
            else:
                # loss = ln(1 + (e^ε' - 1)/q) inverted: ε' = ε + ln(1 - (1-q)e^-ε) - ln q
                inside = eps > math.log1p(-q)
                deltas[~inside] = -np.expm1(eps[~inside])
                e = eps[inside]
                unsampled_loss = e + np.log1p(-(1 - q) * np.exp(-e)) - math.log(q)
        x = -0.5 * sensitivity - unsampled_loss * self.standard_deviation**2 / sensitivity
        if self.adjacency_type == Adjacency.ADD:
            x = x + sensitivity
        deltas[inside] = self.mu_upper_cdf(x) - np.exp(eps[inside] + self.mu_lower_log_cdf(x))
        deltas = np.clip(deltas, 0, 1)
        return float(deltas[0]) if np.ndim(epsilon) == 0 else deltas


def _connect_dots_pmf(loss: _GaussianLoss, discretization: float) -> pld_pmf.PLDPmf:
    """dp-accounting's pessimistic connect-the-dots PMF of a continuous privacy loss."""
    bounds = loss.connect_dots_bounds()
    upper = math.ceil(bounds.epsilon_upper / discretization)
    lower = math.floor(bounds.epsilon_lower / discretization)
    deltas = loss.get_delta_for_epsilon(np.arange(lower, upper + 1) * discretization)
    return pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(discretization, lower, upper, deltas)


def gaussian_pld(
    sigma: float, sampling_prob: float, discretization: float, log_truncation: float
) -> privacy_loss_distribution.PrivacyLossDistribution:
    """One step of N(0, σ²) noise on a sensitivity-1 sum of a Poisson sample (rate q), add/remove-one."""

    def pmf(adjacency: Adjacency) -> pld_pmf.PLDPmf:
        loss = _GaussianLoss(
            sigma,
            log_mass_truncation_bound=log_truncation,
            sampling_prob=sampling_prob,
            adjacency_type=adjacency,
        )
        return _connect_dots_pmf(loss, discretization)

    if sampling_prob == 1.0:  # symmetric: one PMF serves both adjacencies
        return privacy_loss_distribution.PrivacyLossDistribution(pmf(Adjacency.REMOVE))
    return privacy_loss_distribution.PrivacyLossDistribution(pmf(Adjacency.REMOVE), pmf(Adjacency.ADD))
