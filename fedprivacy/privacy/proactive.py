"""The proactive noise rule (van Dijk et al., ICML 2024) and its validity conditions.

σ_pro = sqrt(2(ε + ln(1/δ))/ε) does not depend on the number of steps T, which is what lets a
client fix its noise a priori and split its steps over as many rounds as it likes. The published
conditions are abstract-level (constants of the full theorem are not available), so every plan
is certified numerically as well; the conditions are reported by name, never silently ignored.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from fedprivacy.privacy.plan import Condition

# (2/e)^2 k^2 - 1/2 >= ln N: the epochs condition of the ICML 2024 version.
_EPOCH_FACTOR = (2.0 / math.e) ** 2


def proactive_sigma(epsilon: float, delta: float) -> float:
    """σ_pro(ε, δ) = sqrt(2 (ε + ln(1/δ)) / ε)."""
    return math.sqrt(2.0 * (epsilon + math.log(1.0 / delta)) / epsilon)


def smallest_epochs(n: int) -> int:
    """Smallest integer k with (2/e)²k² − 1/2 ≥ ln N."""
    return max(1, math.ceil(math.sqrt((math.log(n) + 0.5) / _EPOCH_FACTOR) - 1e-12))


def proactive_steps(epochs: float, epsilon: float) -> int:
    """Smallest T meeting T ≥ 2k²/ε (and T ≥ k, so that q = k/T ≤ 1)."""
    return max(math.ceil(2.0 * epochs**2 / epsilon - 1e-9), math.ceil(epochs - 1e-9), 1)


def proactive_conditions(n: int, epsilon: float, delta: float, epochs: float, steps: int) -> tuple[Condition, ...]:
    """The rule's conditions evaluated for a concrete (N, ε, δ, k, T)."""
    log_n = math.log(n)
    epoch_lhs = _EPOCH_FACTOR * epochs**2 - 0.5
    steps_needed = 2.0 * epochs**2 / epsilon
    return (
        Condition(
            "epsilon_regime",
            epsilon < 0.5,
            f"ε = {epsilon:g} < 0.5 (ICML 2024 main theorem)"
            if epsilon < 0.5
            else f"ε = {epsilon:g} ≥ 0.5 needs the enhanced version's two further conditions, which are "
            "not published in the abstract; the plan relies on its numerical certificate instead",
        ),
        Condition(
            "delta_vs_n",
            delta <= 1.0 / n,
            f"δ = {delta:.3g} {'≤' if delta <= 1.0 / n else '>'} 1/N = {1.0 / n:.3g} (theorem stated for δ = 1/N)",
        ),
        Condition(
            "steps_lower_bound",
            steps >= steps_needed - 1e-9,
            f"T = {steps} {'≥' if steps >= steps_needed - 1e-9 else '<'} 2k²/ε = {steps_needed:.1f}"
            + ("" if steps >= steps_needed / 4 else "; more than 4× below: the guarantee is known to fail"),
        ),
        Condition(
            "epochs_vs_log_n",
            epoch_lhs >= log_n,
            f"(2/e)²k² − 1/2 = {epoch_lhs:.2f} {'≥' if epoch_lhs >= log_n else '<'} ln N = {log_n:.2f} "
            f"(k = {epochs:g})",
        ),
        Condition(
            "earlier_epsilon_scale",
            epsilon >= steps / n**2,
            f"earlier version needs ε = Ω(T/N²); T/N² = {steps / n**2:.2g} (constant unknown, for information)",
            kind="information",
        ),
    )


def proactive_step_range(n: int, epsilon: float, delta: float, sampling_rate: float, max_steps: int) -> tuple[int, ...]:
    """(first, last) T ≤ max_steps at which the required conditions hold for T steps at rate q (k = qT
    epochs), or () where they hold for none. They hold on an interval: the ln N condition from some T
    on, T ≥ 2k²/ε up to some T, the others for every T or none."""

    def met(steps: int) -> dict[str, bool]:
        conditions = proactive_conditions(n, epsilon, delta, sampling_rate * steps, steps)
        return {c.name: c.met for c in conditions if c.kind == "required"}

    first = _first_true(lambda t: met(t)["epochs_vs_log_n"], 1, max_steps)
    last = _first_true(lambda t: not met(t)["steps_lower_bound"], 1, max_steps + 1) - 1
    if first > last or not all(met(first).values()):
        return ()
    return (first, last)


def _first_true(predicate: Callable[[int], bool], low: int, high: int) -> int:
    """Smallest t in [low, high] where a predicate that turns from false to true holds; high if none."""
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if predicate(middle) else (middle + 1, high)
    return low
