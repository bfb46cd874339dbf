"""ε computed straight from dp-accounting's accountants, independently of fedprivacy's code.

The project's certificate builds the same PLD as `PLDAccountant` (same 1e-4 loss grid, pessimistic
connect-the-dots) but lets the noise-mass truncation follow δ instead of dp-accounting's
fixed e^-50 (`fedprivacy.privacy.accountants.log_truncation_bound`), and evaluates δ(ε) on the
grid in one numpy expression (`fedprivacy.privacy.gaussian_pld`, equal to dp-accounting's values to
1 ulp). Both results are valid upper bounds; they differ by where the truncated grid's points
fall and by float rounding amplified through the FFT composition. Over σ ∈ {0.5, 1, 3},
q ∈ {1, 0.3, 0.01}, T ∈ {1, 10, 1000}, δ ∈ {1e-3, 1e-5, 1e-10} the largest relative gap
measured was 5.9e-6, so the tests compare with CERTIFICATE_REL_TOL = 1e-5: loose enough for
that, tight enough that any real accounting error (a wrong q, σ, step count or δ moves ε by
≥1e-3) fails.

Below δ ≈ 1e-11 dp-accounting's own composition (it drops 1e-15 of tail mass per FFT) makes ε
move by up to ~0.5% with any change of the loss grid, in either direction (σ=0.8, q=0.02,
T=3000, δ=1e-12: 19.37 at e^-60, 19.45 at e^-50, 19.38 at e^-43). There the tests bracket the
certificate instead: above the optimistic estimate (a lower bound on the true ε), below the
reference plus 1%.
"""

from __future__ import annotations

from collections.abc import Iterable

import dp_accounting
from dp_accounting import dp_event, pld, rdp

ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE
CERTIFICATE_REL_TOL = 1e-5


def _step(sigma: float, q: float) -> dp_event.DpEvent:
    gaussian = dp_event.GaussianDpEvent(sigma)
    return gaussian if q >= 1 else dp_event.PoissonSampledDpEvent(q, gaussian)


def pld_epsilon(
    events: Iterable[tuple[float, float, int]],
    delta: float,
    relation: dp_accounting.NeighboringRelation = ADD_REMOVE,
) -> float:
    """PLD ε of (σ, q, count) runs of Poisson-subsampled Gaussian steps, add/remove-one by default."""
    accountant = pld.PLDAccountant(relation, value_discretization_interval=1e-4)
    for sigma, q, count in events:
        if count:
            accountant.compose(_step(sigma, q), count)
    return accountant.get_epsilon(delta)


def pld_epsilon_lower_bound(sigma: float, q: float, count: int, delta: float) -> float:
    """An optimistic PLD estimate: the true ε of these steps is at least this."""
    step = pld.privacy_loss_distribution.from_gaussian_mechanism(
        sigma,
        pessimistic_estimate=False,
        use_connect_dots=False,
        sampling_prob=q,
        value_discretization_interval=1e-4,
        neighboring_relation=ADD_REMOVE,
    )
    return step.self_compose(count).get_epsilon_for_delta(delta)


def rdp_epsilon(events: Iterable[tuple[float, float, int]], delta: float) -> float:
    """RDP ε of the same runs (dp-accounting's default orders)."""
    accountant = rdp.RdpAccountant(neighboring_relation=ADD_REMOVE)
    for sigma, q, count in events:
        if count:
            accountant.compose(_step(sigma, q), count)
    return accountant.get_epsilon(delta)


def plan_prefix_events(plan: dict, steps: int) -> list[tuple[float, float, int]]:
    """The (σ, q, count) runs of the first `steps` steps of a plan as written in JSON."""
    events, left = [], steps
    for sigma, count in plan["noise_segments"]:
        take = min(count, left)
        events.append((sigma, plan["sampling_rate"], take))
        left -= take
    assert left == 0, "more steps than the plan has"
    return events
