"""The DP calculator: every feasible plan for (N, ε, δ) over a grid of epochs k and rates q.

Utility proxy (stated so users can judge it): the standard deviation of the noise on the
averaged gradient, σC/(qN). At equal epochs k every plan takes the same expected number of
gradient computations, and the smaller this noise, the closer each step is to the clean
gradient; so plans are ranked by it *within* each epoch count (rank 1 = least noise). Across
epoch counts the proxy is not comparable (more epochs = more steps of smaller signal), which is
why the table keeps k as its first key and lets the user pick k.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fedprivacy.errors import InputError, PlanRefused
from fedprivacy.privacy.plan import Plan
from fedprivacy.privacy.planner import plan_client

DEFAULT_EPOCHS = (1.0, 2.0, 4.0, 8.0, 16.0)
DEFAULT_RATES = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2)
UTILITY_PROXY = "noise std on the averaged gradient σC/(qN), lower is better, ranked at equal epochs"


@dataclass(frozen=True)
class CalculatorRow:
    """One feasible plan of the grid and its rank among plans with the same epochs."""

    plan: Plan
    rank: int

    def to_dict(self) -> dict[str, float | int | str]:
        p = self.plan
        return {
            "epochs": p.epochs,
            "sampling_rate": p.sampling_rate,
            "expected_batch_size": p.expected_batch_size,
            "steps": p.steps,
            "sigma": p.sigma,
            "noise_std_on_mean": p.noise_std_on_mean,
            "epsilon_pld": p.epsilon_pld,
            "rule": p.rule,
            "neighbours": p.neighbours,
            "rank_at_equal_epochs": self.rank,
        }


def usable_rates(n: int, rate_grid: Sequence[float] = DEFAULT_RATES) -> list[float]:
    """The grid's sampling rates whose expected batch q·N holds at least one record."""
    return [q for q in rate_grid if q * n >= 1.0 and q <= 1.0]


def feasible_plans(
    n: int,
    epsilon: float,
    delta: float,
    *,
    rule: str = "calibrated",
    clip_norm: float = 1.0,
    epochs_grid: Sequence[float] = DEFAULT_EPOCHS,
    rate_grid: Sequence[float] = DEFAULT_RATES,
    on_progress: Callable[[int, int], None] | None = None,
    neighbours: str = "add-remove",
) -> list[CalculatorRow]:
    """All certified plans of the grid, sorted by epochs, then by the utility proxy.

    Grid points with an expected batch below one record, or that the rule cannot certify
    (proactive outside its conditions), are left out; a grid that leaves no point of the first
    kind is refused (InputError naming n), and one whose every point is refused raises the first
    refusal (PlanRefused), so an empty table never stands for an answer.
    """
    if not rate_grid or not all(0.0 < q <= 1.0 for q in rate_grid):
        raise InputError("rate_grid", tuple(rate_grid), "every sampling rate of the grid must be in (0, 1]")
    if not epochs_grid or not all(k > 0 for k in epochs_grid):
        raise InputError("epochs_grid", tuple(epochs_grid), "every epoch count of the grid must be > 0")
    rates = usable_rates(n, rate_grid)
    if not rates:
        needed = math.ceil(1.0 / max(rate_grid))
        raise InputError(
            "n",
            n,
            f"the grid's sampling rates (at most {max(rate_grid):g}) leave an expected batch below one "
            f"record (q·N < 1): the calculator needs N >= {needed}",
        )
    grid = [(k, q) for k in epochs_grid for q in rates]
    plans: list[tuple[float, Plan]] = []
    refusals: list[PlanRefused] = []
    for done, (k, q) in enumerate(grid, start=1):
        try:
            plans.append(
                (
                    k,
                    plan_client(
                        n,
                        epsilon,
                        delta,
                        rule=rule,
                        clip_norm=clip_norm,
                        epochs=k,
                        sampling_rate=q,
                        compare=False,
                        neighbours=neighbours,
                    ),
                )
            )
        except PlanRefused as refusal:
            refusals.append(refusal)
        if on_progress:
            on_progress(done, len(grid))
    if not plans:
        points = f"{len(grid)} point{'s' if len(grid) > 1 else ''}"
        raise PlanRefused(f"no plan of the grid ({points} of epochs × rate) is certified: {refusals[0]}")
    rows: list[CalculatorRow] = []
    for k in sorted({k for k, _ in plans}):
        same_epochs = sorted((p for pk, p in plans if pk == k), key=lambda p: p.noise_std_on_mean)
        rows.extend(CalculatorRow(p, rank) for rank, p in enumerate(same_epochs, start=1))
    return rows
