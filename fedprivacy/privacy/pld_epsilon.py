"""ε for a target δ of a composed privacy-loss distribution, as one numpy pass over its grid.

dp-accounting's `get_epsilon_for_delta` walks the loss grid from the largest loss down in a Python
loop (two walks, one per adjacency), about 2.4 ms for a 20,000-point PMF: a ledger asks it once
per round and history, and every calibration step asks it once. The walk accumulates the mass
above each loss and that mass discounted by e^−loss, and stops at the first loss below
ln((upper − δ)/lower). Here the same sums are prefix sums (sequential, in the same order, from
the same starting values) and the stopping point is found by one comparison over the grid; the
result equals dp-accounting's to rounding (tests/test_privacy_accountants.py compares them).

It reads the PMFs' fields, which dp-accounting does not publish; `epsilon_for_delta` is the only
place that does, and falls back to dp-accounting's own method for any PMF it does not recognise.
"""

from __future__ import annotations

import math

import numpy as np
from dp_accounting.pld import pld_pmf, privacy_loss_distribution


def epsilon_for_delta(distribution: privacy_loss_distribution.PrivacyLossDistribution, delta: float) -> float:
    """The smallest ε ≥ 0 whose hockey-stick divergence is ≤ δ, over both adjacencies."""
    pmfs = [distribution._pmf_remove] if distribution._symmetric else [distribution._pmf_remove, distribution._pmf_add]
    return max(_dense_epsilon(pmf, delta) if isinstance(pmf, pld_pmf.DensePLDPmf) else pmf.get_epsilon_for_delta(delta)
               for pmf in pmfs)  # fmt: skip


def _dense_epsilon(pmf: pld_pmf.DensePLDPmf, delta: float) -> float:
    infinity_mass = float(pmf._infinity_mass)
    if infinity_mass > delta:
        return math.inf
    probs = np.flip(np.asarray(pmf._probs, dtype=np.float64))  # largest loss first
    # the losses as dp-accounting counts them: the top loss, then one discretisation step less each time
    steps = np.full(len(probs), -float(pmf._discretization))
    steps[0] = (pmf._lower_loss + len(probs) - 1) * pmf._discretization
    losses = np.cumsum(steps)
    # masses before each loss is added (index k) and after the last one (index n)
    # (past the stopping point the walk never goes, e^−loss may overflow: those entries are not read)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        upper = np.cumsum(np.concatenate(([infinity_mass], probs)))
        lower = np.cumsum(np.concatenate(([0.0], np.exp(-losses) * probs)))
        reached = (upper[:-1] > delta) & (lower[:-1] > 0) & (np.log((upper[:-1] - delta) / lower[:-1]) >= losses)
    # a loss so large that e^−loss is 0 leaves the lower mass 0 while the upper one passes δ
    only_upper = (upper[1:] >= delta) & (lower[1:] == 0)
    stops = np.flatnonzero(reached | only_upper)
    if stops.size:
        k = int(stops[0])
        if not reached[k]:
            return max(0.0, float(losses[k]))
        mass_upper, mass_lower = float(upper[k]), float(lower[k])
    else:
        mass_upper, mass_lower = float(upper[-1]), float(lower[-1])
    if mass_upper <= mass_lower + delta:
        return 0.0
    return math.log((mass_upper - delta) / mass_lower)
