"""ADP-SGD (Wu et al., Adaptive Differentially Private Empirical Risk Minimization): noise adapted to the
step size, and its privacy analysis.

Step t adds noise α_t·c_t to the gradient; in this project's terms the noise multiplier of step t
is σ_t = s·α_t for a scale s. The paper's best choice is α_t = 1/sqrt(η_t). Theorem 4.1 gives s
from the extended advanced composition (Lemma 2.2); the tight alternative certifies the same
schedule step by step with PLD and calibrates s to the budget. Both are reported.

α changes every step; the accountant needs few distinct values, so α is floored to a geometric
grid (ratio `ALPHA_GRID_RATIO`) and run-length encoded into (α, count) segments. The trainer then
uses exactly those values, so what is certified is what runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fedprivacy.errors import InputError
from fedprivacy.privacy.plan import ALPHA_SCHEDULES, Condition

ALPHA_GRID_RATIO = 1.05


def alpha_values(
    schedule: str,
    steps: int,
    *,
    learning_rate: float = 1.0,
    lr_schedule: str = "constant",
    lr_params: dict[str, float] | None = None,
    power: float = 1.0,
) -> np.ndarray:
    """α_1..α_T for a schedule fixed in advance (Theorem 4.1 needs it known beforehand).

    - constant: α_t = 1 (plain DP-SGD);
    - inverse_sqrt_lr: α_t = 1/sqrt(η_t) for a deterministic step size η_t (the paper's optimum);
    - power: α_t² ∝ t^p, p ∈ [0, 1] (the paper's family; p = 1 gives σ² ∝ log T).
    """
    t = np.arange(1, steps + 1, dtype=float)
    if schedule == "constant":
        return np.ones(steps)
    if schedule == "inverse_sqrt_lr":
        if lr_schedule == "adagrad_norm":
            raise InputError(
                "alpha-schedule",
                schedule,
                "needs a step size fixed in advance; adagrad_norm adapts to the data, "
                "use alpha-schedule 'power' or 'constant' with it",
            )
        params = lr_params or {}
        if lr_schedule == "inverse_sqrt":
            eta = learning_rate / np.sqrt(params.get("a", 20.0) + params.get("c", 1.0) * (t - 1))
        else:
            eta = np.full(steps, learning_rate)
        return 1.0 / np.sqrt(eta)
    if schedule == "power":
        if not 0.0 <= power <= 1.0:
            raise InputError("alpha-power", power, "must be in [0, 1]")
        return t ** (power / 2.0)
    raise InputError("alpha-schedule", schedule, f"must be one of {', '.join(ALPHA_SCHEDULES)}")


def alpha_segments(alphas: Sequence[float], ratio: float = ALPHA_GRID_RATIO) -> tuple[tuple[float, int], ...]:
    """Floor α (relative to α_1) to a geometric grid and run-length encode it."""
    values = np.asarray(alphas, dtype=float) / float(alphas[0])
    grid = ratio ** np.floor(np.log(values) / math.log(ratio) + 1e-12)
    segments: list[list[float]] = []
    for value in grid:
        if segments and math.isclose(segments[-1][0], value):
            segments[-1][1] += 1
        else:
            segments.append([float(value), 1])
    return tuple((value, int(count)) for value, count in segments)


def extended_advanced_composition(
    step_epsilons: Sequence[float], step_deltas: Sequence[float], delta_slack: float
) -> tuple[float, float]:
    """Lemma 2.2: ε̃ = sqrt(Σ 2ε_i² log(1/δ')) + Σ ε_i(e^ε_i − 1)/(e^ε_i + 1), δ̃ = 1 − Π(1 − δ_i) + δ'."""
    eps = np.asarray(step_epsilons, dtype=float)
    deltas = np.asarray(step_deltas, dtype=float)
    epsilon = math.sqrt(float(np.sum(2.0 * eps**2 * math.log(1.0 / delta_slack)))) + float(
        np.sum(eps * np.tanh(eps / 2))
    )
    delta = -math.expm1(float(np.sum(np.log1p(-deltas)))) + delta_slack
    return epsilon, delta


def _b_delta(delta: float, sampling_rate: float, steps: int) -> float:
    """Theorem 4.1's B_δ = log(16Tm/(nδ))·log(1.25/δ), with m/n = q."""
    return math.log(16.0 * steps * sampling_rate / delta) * math.log(1.25 / delta)


def theorem41_scale(epsilon: float, delta: float, sampling_rate: float, alphas: Sequence[float]) -> float:
    """Theorem 4.1 (mini-batch form C.1) as a noise-multiplier scale s, σ_t = s·α_t.

    σ² = (16G)²B_δ/(n²ε²)·Σ 1/α_t² is the variance on the averaged gradient with G = C and
    m = qN, so σ_t = α_t·σ·m/C = 16q·α_t·sqrt(B_δ Σ 1/α_t²)/ε, B_δ = log(16Tq/δ)·log(1.25/δ).
    """
    alphas = np.asarray(alphas, dtype=float)
    b_delta = _b_delta(delta, sampling_rate, len(alphas))
    return 16.0 * sampling_rate * math.sqrt(b_delta * float(np.sum(1.0 / alphas**2))) / epsilon


def per_step_delta(delta: float, sampling_rate: float, steps: int, slack_share: float = 0.8) -> float:
    """δ0 of one unsampled step: the (1 − slack_share)·δ not kept as Lemma 2.2's slack δ', shared
    by the T sampled steps (each (·, qδ0)), so that 1 − Π(1 − qδ0) fills it exactly."""
    return -math.expm1(math.log1p(-(1.0 - slack_share) * delta) / steps) / sampling_rate


def lemma22_epsilon(
    scale: float,
    delta: float,
    sampling_rate: float,
    segments: Sequence[tuple[float, int]],
    slack_share: float = 0.8,
) -> float:
    """ε that Lemma 2.2 gives for a concrete schedule σ_t = scale·α_t (the paper's Steps 1–3).

    Step t is (ε_t, δ0) for the Gaussian with replace-one sensitivity, ε_t = 2·sqrt(2 log(1.25/δ0))/σ_t,
    amplified to (2qε_t, qδ0) by sampling; δ' = slack_share·δ and δ0 fills the rest of δ.
    Returns inf where the lemma's premise ε_t ≤ 1 fails.
    """
    steps = sum(count for _, count in segments)
    slack = slack_share * delta
    delta0 = per_step_delta(delta, sampling_rate, steps, slack_share)
    base = 2.0 * math.sqrt(2.0 * math.log(1.25 / delta0))
    step_eps = np.concatenate([np.full(count, base / (scale * alpha)) for alpha, count in segments])
    if np.any(step_eps > 1.0):
        return math.inf
    epsilon, _ = extended_advanced_composition(
        2.0 * sampling_rate * step_eps, np.full(steps, sampling_rate * delta0), slack
    )
    return epsilon


def theorem41_conditions(
    epsilon: float, delta: float, sampling_rate: float, alphas: Sequence[float]
) -> tuple[Condition, ...]:
    """Where Theorem 4.1's σ applies: mini-batch m ≤ n/2 for its amplification step, and T long
    enough that every step is (ε_t ≤ 1)-DP under that σ (Theorem C.1's condition on T). With
    m = qn and δ0 as in `lemma22_epsilon`, ε_t ≤ 1 for all t reads
    min_t α_t² · Σ 1/α_t² ≥ ε² log(1.25/δ0) / (32 q² B_δ)."""
    alphas = np.asarray(alphas, dtype=float)
    steps = len(alphas)
    b_delta = _b_delta(delta, sampling_rate, steps)
    delta0 = per_step_delta(delta, sampling_rate, steps)
    have = float(np.min(alphas**2) * np.sum(1.0 / alphas**2))
    need = epsilon**2 * math.log(1.25 / delta0) / (32.0 * sampling_rate**2 * b_delta)
    return (
        Condition(
            "adp_batch_fraction",
            sampling_rate <= 0.5,
            f"q = {sampling_rate:.3g} {'≤' if sampling_rate <= 0.5 else '>'} 1/2 "
            "(Theorem 4.1's amplification by sampling)",
        ),
        Condition(
            "adp_theorem41_steps",
            have >= need,
            f"min α_t²·Σ1/α_t² = {have:.4g} {'≥' if have >= need else '<'} ε²·log(1.25/δ0)/(32q²B_δ) = {need:.4g} "
            "(Theorem 4.1's condition on T: every step ε_t ≤ 1)",
        ),
    )
