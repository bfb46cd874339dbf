"""`plan_client`: a client's a-priori DP-SGD plan from its own N, ε, δ, certified before it runs.

Rules:
- `proactive`: σ from the proactive rule, T and q chosen to meet its conditions (by default the
  smallest k meeting the ln N condition and the smallest T ≈ 2k²/ε);
- `calibrated`: the same q and T, with the smallest σ that PLD certifies for the target: it
  hands back the budget the proactive rule leaves unused;
- `adp`: ADP-SGD's noise schedule σ_t = σ·α_t/α_1 (α_t = 1/sqrt(η_t) by default, with the paper's
  decaying step size η_t = η/sqrt(a + ct)), with the first step's σ calibrated by PLD step by step.

Every plan is certified with PLD (and RDP as a cross-check); one whose certified ε exceeds the
target raises `PlanRefused` and never reaches a trainer.
"""

from __future__ import annotations

import math

from fedprivacy import errors
from fedprivacy.errors import InputError, PlanRefused
from fedprivacy.privacy import accountants, adp, classical, limits
from fedprivacy.privacy.accountants import NoiseEvent
from fedprivacy.privacy.plan import LR_SCHEDULES, RULES, Condition, Plan
from fedprivacy.privacy.proactive import proactive_conditions, proactive_sigma, proactive_steps, smallest_epochs

ADP_DEFAULT_LR_PARAMS = {"a": 20.0, "c": 1.0}  # η_t = η/sqrt(20 + t), the paper's CIFAR-10 schedule


def below_one_over_n(delta: float, n: int) -> float:
    """δ in (0, 1/N): a δ ≥ 1/N is met by releasing one record in the clear (Dwork & Roth §2.3)."""
    delta = errors.open_unit("delta", delta)
    if delta * n >= 1.0:
        raise InputError(
            "delta", delta,
            f"must be below 1/N = {1.0 / n:.3g} for N = {n}: a δ ≥ 1/N allows releasing a record outright",
        )
    return delta


def resolve_schedule(
    n: int,
    epsilon: float,
    *,
    epochs: float | None = None,
    sampling_rate: float | None = None,
    expected_batch_size: float | None = None,
    steps: int | None = None,
) -> tuple[float, int]:
    """(q, T) from whichever of epochs k, sampling rate q (or batch qN) and steps T were given.

    Two of them fix the third (k = qT). With k alone, T is the proactive T = ⌈2k²/ε⌉; with
    nothing, k is the smallest epoch count meeting the proactive ln N condition.
    """
    if expected_batch_size is not None:
        if sampling_rate is not None:
            raise InputError("expected-batch-size", expected_batch_size, "give either a sampling rate or a batch size, not both")
        batch = errors.positive("expected-batch-size", expected_batch_size)
        if batch > n:
            raise InputError("expected-batch-size", expected_batch_size, f"must be in (0, N] = (0, {n}]")
        sampling_rate = batch / n
    if sampling_rate is not None:
        sampling_rate = errors.unit_rate("sampling-rate", sampling_rate)
    if epochs is not None:
        epochs = errors.positive("epochs", epochs)
    if steps is not None:
        steps = errors.integer_at_least("steps", steps, 1)
        limits.steps("steps", steps, steps)

    if sampling_rate is not None and steps is not None:
        if epochs is not None and not math.isclose(epochs, sampling_rate * steps, rel_tol=1e-3):
            raise InputError("epochs", epochs, f"must equal sampling-rate × steps = {sampling_rate * steps:g} when all three are given")
        return sampling_rate, steps
    if epochs is None:
        epochs = float(smallest_epochs(n))
    if sampling_rate is not None:
        limits.steps("sampling-rate", sampling_rate, limits.steps_for(epochs, sampling_rate))
        return sampling_rate, max(1, math.ceil(epochs / sampling_rate - 1e-9))
    if steps is None:
        steps = proactive_steps(epochs, epsilon)
        limits.steps("epsilon", epsilon, steps)
    rate = epochs / steps
    if rate > 1.0:
        raise InputError("epochs", epochs, f"k = {epochs:g} epochs need at least {math.ceil(epochs)} steps; steps={steps} is too few")
    return rate, steps


def _noise_segments(
    rule: str, n: int, epsilon: float, delta: float, rate: float, steps: int, alphas_relative
) -> tuple[float, tuple[tuple[float, int], ...]]:
    """(σ or ADP scale s, per-step noise segments) for the rule."""
    if rule == "proactive":
        sigma = proactive_sigma(epsilon, delta)
        return sigma, ((sigma, steps),)
    scale = accountants.calibrate_pld(epsilon, delta, rate, alphas_relative)
    return scale, tuple((scale * alpha, count) for alpha, count in alphas_relative)


def compare_rules(epsilon: float, delta: float, rate: float, steps: int, alphas) -> tuple[dict[str, float | None], float]:
    """σ each rule needs for the same target, q and T; and the moments-accountant constant c."""
    rdp_sigma = accountants.calibrate_rdp(epsilon, delta, rate, ((1.0, steps),))
    return (
        {
            "naive": classical.naive_sigma(epsilon, delta, rate, steps),
            "strong": classical.strong_sigma(epsilon, delta, rate, steps),
            "rdp_calibrated": rdp_sigma,
            "pld_calibrated": accountants.calibrate_pld(epsilon, delta, rate, ((1.0, steps),)),
            "proactive": proactive_sigma(epsilon, delta),
            "adp": adp.theorem41_scale(epsilon, delta, rate, alphas) * float(alphas[0]) if rate <= 0.5 else None,
            "dpgd": classical.dpgd_sigma(epsilon, delta, steps) if epsilon <= 1 and delta <= 0.5 else None,
        },
        classical.moments_constant(rdp_sigma, epsilon, delta, rate, steps),
    )


def plan_client(
    n: int,
    epsilon: float,
    delta: float,
    *,
    rule: str = "proactive",
    clip_norm: float = 1.0,
    epochs: float | None = None,
    sampling_rate: float | None = None,
    expected_batch_size: float | None = None,
    steps: int | None = None,
    rounds: int = 1,
    client_id: str = "client",
    learning_rate: float = 0.1,
    lr_schedule: str | None = None,
    lr_params: dict[str, float] | None = None,
    alpha_schedule: str | None = None,
    alpha_power: float = 0.5,  # seed 004 §5.2: α_t² = sqrt(b0² + tC) grows as t^(1/2) under adagrad_norm
    compare: bool = True,
) -> Plan:
    """Plan, certify and return one client's DP-SGD parameters (see the module docstring)."""
    n = limits.records("n", n)
    epsilon = limits.epsilon("epsilon", epsilon)
    delta = below_one_over_n(delta, n)
    clip_norm = errors.positive("clip-norm", clip_norm)
    rounds = limits.rounds("rounds", rounds)
    learning_rate = errors.positive("learning-rate", learning_rate)
    if rule not in RULES:
        raise InputError("rule", rule, f"must be one of {', '.join(RULES)}")
    lr_schedule = lr_schedule or ("inverse_sqrt" if rule == "adp" else "constant")
    if lr_schedule not in LR_SCHEDULES:
        raise InputError("lr-schedule", lr_schedule, f"must be one of {', '.join(LR_SCHEDULES)}")
    lr_params = dict(lr_params or (ADP_DEFAULT_LR_PARAMS if lr_schedule == "inverse_sqrt" else {}))
    if alpha_schedule is None:
        alpha_schedule = "constant" if rule != "adp" else ("power" if lr_schedule == "adagrad_norm" else "inverse_sqrt_lr")
    if rule != "adp" and alpha_schedule != "constant":
        raise InputError("alpha-schedule", alpha_schedule, "adapts the noise only under rule 'adp'")

    rate, steps = resolve_schedule(
        n, epsilon, epochs=epochs, sampling_rate=sampling_rate, expected_batch_size=expected_batch_size, steps=steps
    )
    alphas = adp.alpha_values(
        alpha_schedule, steps, learning_rate=learning_rate, lr_schedule=lr_schedule, lr_params=lr_params, power=alpha_power
    )
    relative = adp.alpha_segments(alphas)
    sigma, segments = _noise_segments(rule, n, epsilon, delta, rate, steps, relative)
    events = [NoiseEvent(s, rate, count) for s, count in segments]
    epsilon_pld = accountants.pld_epsilon(events, delta)
    epsilon_rdp = accountants.rdp_epsilon(events, delta)

    conditions: list[Condition] = []
    if rule == "proactive":
        conditions.extend(proactive_conditions(n, epsilon, delta, rate * steps, steps))
    if rule == "adp":
        conditions.extend(adp.theorem41_conditions(epsilon, delta, rate, alphas))
    conditions.append(
        Condition("certified", epsilon_pld <= epsilon, f"PLD ε = {epsilon_pld:.4f} {'≤' if epsilon_pld <= epsilon else '>'} target {epsilon:g}")
    )
    if epsilon_pld > epsilon:
        failed = [c.name for c in conditions if not c.met and c.kind == "required" and c.name != "certified"]
        raise PlanRefused(
            f"client {client_id}: rule {rule} with σ={sigma:.4g}, q={rate:.4g}, T={steps} certifies ε={epsilon_pld:.4f} "
            f"> target ε={epsilon:g}" + (f" (conditions not met: {', '.join(failed)})" if failed else "")
            + "; use rule 'calibrated' or change the epochs"
        )

    if rule == "adp":
        lemma = adp.lemma22_epsilon(sigma, delta, rate, relative)  # None where its premise ε_t ≤ 1 fails
        bounds = {"extended_advanced_composition": lemma if math.isfinite(lemma) else None}
    else:
        bounds = {
            "naive": classical.naive_epsilon(sigma, delta, rate, steps),
            "strong": classical.strong_epsilon(sigma, delta, rate, steps),
        }
    by_rule, moments_c = compare_rules(epsilon, delta, rate, steps, alphas) if compare else ({}, None)
    return Plan(
        client_id=str(client_id),
        rule=rule,
        n=n,
        epsilon=epsilon,
        delta=delta,
        clip_norm=clip_norm,
        sigma=sigma,
        sampling_rate=rate,
        steps=steps,
        rounds=rounds,
        noise_segments=segments,
        epsilon_pld=epsilon_pld,
        epsilon_rdp=epsilon_rdp,
        conditions=tuple(conditions),
        sigma_by_rule=by_rule,
        epsilon_bounds=bounds,
        moments_constant=moments_c,
        learning_rate=learning_rate,
        lr_schedule=lr_schedule,
        lr_params=lr_params,
        alpha_schedule=alpha_schedule,
        alpha_params={"power": alpha_power} if alpha_schedule == "power" else {},
    )
