"""`plan_client`: a client's a-priori DP-SGD plan from its own N, ε, δ, certified before it runs.

The planner composes: the budget checked (δ < 1/N included), the schedule (q, T: by default the
smallest k meeting the proactive ln N condition and T = ⌈2k²/ε⌉), the rule's noise, conditions and
looser bounds (`fedprivacy.privacy.rules`, one object per rule, found by name), the certificate
(PLD, RDP as a cross-check), the refusal of a plan whose certified ε exceeds its target (it raises
`PlanRefused` and never reaches a trainer), and the σ every other rule would need (a classical
rule's only where its formula is a valid bound: `classical`, `comparison_conditions`).

That last part, the rule comparison, is what a planning sheet shows beside the plan; nothing
trains or certifies with it, and it costs more than the plan itself (two calibrations, about
0.25 s per distinct plan). Clients of a run plan without it (`compare=False`); the sheets add it
(`with_rule_comparison`) when they are written.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import NamedTuple

from fedprivacy import errors
from fedprivacy.errors import InputError, PlanRefused
from fedprivacy.privacy import accountants, adp, classical, limits
from fedprivacy.privacy.accountants import NoiseEvent
from fedprivacy.privacy.plan import LR_SCHEDULES, Condition, Plan
from fedprivacy.privacy.proactive import proactive_conditions, proactive_sigma, proactive_steps, smallest_epochs
from fedprivacy.privacy.rules import NoiseRule, PlanningTarget, Schedule, find_rule

ADP_DEFAULT_LR_PARAMS = {"a": 20.0, "c": 1.0}  # η_t = η/sqrt(20 + t), the paper's CIFAR-10 schedule


def below_one_over_n(delta: float, n: int) -> float:
    """δ in (0, 1/N): a δ ≥ 1/N is met by releasing one record in the clear (Dwork & Roth §2.3)."""
    allowed = (
        f"must be below 1/N = {1.0 / n:.3g} for N = {n} (a number in (0, {1.0 / n:.3g})): a δ ≥ 1/N allows "
        "releasing a record outright"
    )
    try:
        delta = errors.open_unit("delta", delta)
    except InputError:
        raise InputError("delta", delta, allowed) from None
    if delta * n >= 1.0:
        raise InputError("delta", delta, allowed)
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

    Every schedule is checked here, in constant time and before any accountant work: q ≥
    limits.SAMPLING_RATE_MIN, an expected batch q·N ≥ 1 record (with δ < 1/N this keeps q > δ,
    which keeps the σ calibration bounded: see `limits.sampling`) and T ≤ limits.STEPS_MAX. A
    refusal names the input that set the value it refuses.
    """
    if expected_batch_size is not None:
        if sampling_rate is not None:
            raise InputError(
                "batch-size",
                expected_batch_size,
                "give either a sampling rate or a batch size, not both",
            )
        batch = errors.positive("batch-size", expected_batch_size)
        if not limits.EXPECTED_BATCH_MIN <= batch <= n:
            raise InputError(
                "batch-size",
                expected_batch_size,
                f"must be in [{limits.EXPECTED_BATCH_MIN:g}, N] = [{limits.EXPECTED_BATCH_MIN:g}, {n}] "
                "(an expected batch q·N of less than one record per step mostly trains on nothing)",
            )
        sampling_rate = batch / n
    elif sampling_rate is not None:
        sampling_rate = errors.unit_rate("sampling-rate", sampling_rate)
        limits.sampling("sampling-rate", sampling_rate, sampling_rate, n, "choose a larger sampling rate")
    epochs_given, steps_given = epochs is not None, steps is not None
    if epochs is not None:
        epochs = limits.epochs("epochs", epochs)
    if steps is not None:
        steps = errors.integer_at_least("steps", steps, 1)
        limits.steps("steps", steps, steps)

    if sampling_rate is not None and steps is not None:
        if epochs is not None and not math.isclose(epochs, sampling_rate * steps, rel_tol=1e-3):
            raise InputError(
                "epochs",
                epochs,
                f"must equal sampling-rate × steps = {sampling_rate * steps:g} when all three are given",
            )
        return sampling_rate, steps
    if epochs is None:
        epochs = float(smallest_epochs(n))
    if sampling_rate is not None:
        limits.steps("sampling-rate", sampling_rate, limits.steps_for(epochs, sampling_rate))
        return sampling_rate, max(1, math.ceil(epochs / sampling_rate - 1e-9))
    if steps is None:
        steps = proactive_steps(epochs, epsilon)  # finite: k ≤ limits.EPOCHS_MAX
        limits.steps("epochs" if epochs_given else "epsilon", epochs if epochs_given else epsilon, steps)
    rate = epochs / steps
    if 1.0 < rate <= 1.0 + 1e-9:  # k a rounding above a whole number of steps (1.0000000000000002): q = 1
        rate = 1.0
    if rate > 1.0:
        raise InputError(
            "epochs",
            epochs,
            f"k = {epochs:g} epochs need at least {math.ceil(epochs)} steps; steps={steps} is too few",
        )
    # q = k/T: the refusal names the input that made it small. The default schedule (nothing
    # given: k ≥ 1, so qT ≥ 1 > δ and the calibration stays bounded) is left to the caller: a
    # run's client refuses q·N < 1 naming itself (fedprivacy/plans.py).
    if epochs_given:
        if steps_given or steps == 1:  # q = k/T grows with k
            hint = f"k = {epochs:g} epochs over T = {steps} steps; choose more epochs" + (
                " or fewer steps" if steps_given else ""
            )
        else:  # q = k/⌈2k²/ε⌉ ≈ ε/(2k) shrinks as k grows
            hint = (
                f"k = {epochs:g} epochs over the proactive T = ⌈2k²/ε⌉ = {steps} steps; "
                "choose fewer epochs or a sampling rate"
            )
        limits.sampling("epochs", epochs, rate, n, hint)
    elif steps_given:
        limits.sampling(
            "steps",
            steps,
            rate,
            n,
            f"the default k = {epochs:g} epochs over T = {steps} steps; choose fewer steps",
        )
    return rate, steps


class RuleComparison(NamedTuple):
    """σ each rule needs for one (ε, δ, q, T), None where a rule's formula does not hold there."""

    sigma_by_rule: dict[str, float | None]
    moments_constant: float  # c of Abadi et al.'s Thm 1 implied by the RDP σ (a ratio; Lemma 3 in `failed`)
    failed: dict[str, tuple[str, ...]]  # rule -> its required conditions not met (only rules that have some)


@functools.lru_cache(maxsize=1024)
def _classical_bounds(epsilon: float, delta: float, rate: float, steps: int) -> tuple[tuple[str, classical.Bound], ...]:
    return (
        ("naive", classical.naive(epsilon, delta, rate, steps)),
        ("strong", classical.strong(epsilon, delta, rate, steps)),
        ("dpgd", classical.dpgd(epsilon, delta, steps)),
    )


def classical_bounds(epsilon: float, delta: float, rate: float, steps: int) -> dict[str, classical.Bound]:
    """The classical rules' σ with their conditions (closed forms, milliseconds; cached)."""
    return dict(_classical_bounds(epsilon, delta, rate, steps))


def compare_rules(epsilon: float, delta: float, rate: float, steps: int, alphas) -> RuleComparison:
    """σ each rule needs for the same target, q and T; and the moments-accountant constant c.

    A classical σ is None where its formula is not a valid bound (`classical`); the accountants' σ
    (RDP, PLD) hold everywhere. The proactive σ is always given: the rule picks it before its
    conditions, which need N, are checked (`comparison_conditions`; the planning sheet shows them)."""
    rdp_sigma = accountants.calibrate_rdp(epsilon, delta, rate, ((1.0, steps),))
    bounds = classical_bounds(epsilon, delta, rate, steps)
    moments = classical.moments(rdp_sigma, epsilon, delta, rate, steps)
    return RuleComparison(
        {
            "naive": bounds["naive"].shown,
            "strong": bounds["strong"].shown,
            "rdp_calibrated": rdp_sigma,
            "pld_calibrated": accountants.calibrate_pld(epsilon, delta, rate, ((1.0, steps),)),
            "proactive": proactive_sigma(epsilon, delta),
            "adp": adp.theorem41_scale(epsilon, delta, rate, alphas) * float(alphas[0]) if rate <= 0.5 else None,
            "dpgd": bounds["dpgd"].shown,
        },
        moments.value,
        {name: bound.failed for name, bound in (*bounds.items(), ("moments_constant", moments))},
    )


def comparison_conditions(plan: Plan) -> dict[str, tuple[Condition, ...]]:
    """The conditions of each rule in `plan.sigma_by_rule`, for this plan's N, ε, δ, q and T.

    The rule comparison shows a rule's σ only where they are met; the accountants' σ (RDP, PLD)
    need none. `moments_constant` is Abadi et al.'s Thm 1 read off the RDP σ (Lemma 3's range)."""
    found: dict[str, tuple[Condition, ...]] = {}
    if {"naive", "strong", "dpgd"} & set(plan.sigma_by_rule):
        for name, bound in classical_bounds(plan.epsilon, plan.delta, plan.sampling_rate, plan.steps).items():
            if name in plan.sigma_by_rule:
                found[name] = bound.conditions
    if "proactive" in plan.sigma_by_rule:
        found["proactive"] = proactive_conditions(plan.n, plan.epsilon, plan.delta, plan.epochs, plan.steps)
    if "adp" in plan.sigma_by_rule:
        within = plan.sampling_rate <= 0.5
        found["adp"] = (
            Condition(
                "theorem41_sampling",
                within,
                f"q = {plan.sampling_rate:.3g} {'≤' if within else '>'} 1/2 (Wu et al. Thm 4.1 amplifies with q < 1/2)",
            ),
        )
    rdp_sigma = plan.sigma_by_rule.get("rdp_calibrated")
    if plan.moments_constant is not None and rdp_sigma is not None:
        found["moments_constant"] = classical.moments(
            rdp_sigma, plan.epsilon, plan.delta, plan.sampling_rate, plan.steps
        ).conditions
    return found


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
    alpha_power: float = 0.5,  # Wu et al. §5.2: α_t² = sqrt(b0² + tC) grows as t^(1/2) under adagrad_norm
    compare: bool = True,
    neighbours: str = accountants.ADD_REMOVE,
) -> Plan:
    """Plan, certify and return one client's DP-SGD parameters (see the module docstring).

    `neighbours`: the relation the certificate holds for, add-remove (N public: what every run
    plans) or replace-one (N may be the real size; dp-accounting's replace-one PLD certifies it)."""
    if neighbours not in accountants.NEIGHBOURS:
        raise InputError("adjacency", neighbours, f"must be one of: {', '.join(accountants.NEIGHBOURS)}")
    budget = PlanningTarget(limits.records("n", n), limits.epsilon("epsilon", epsilon), 0.0)
    budget = PlanningTarget(budget.n, budget.epsilon, below_one_over_n(delta, budget.n), neighbours)
    clip_norm = limits.clip_norm("clip-norm", clip_norm)
    rounds = limits.rounds("rounds", rounds)
    learning_rate = errors.positive("learning-rate", learning_rate)
    noise_rule = find_rule(rule)
    lr_schedule, lr_params, alpha_schedule = _step_sizes(noise_rule, lr_schedule, lr_params, alpha_schedule)
    rate, steps = resolve_schedule(
        budget.n,
        budget.epsilon,
        epochs=epochs,
        sampling_rate=sampling_rate,
        expected_batch_size=expected_batch_size,
        steps=steps,
    )
    alphas = adp.alpha_values(
        alpha_schedule,
        steps,
        learning_rate=learning_rate,
        lr_schedule=lr_schedule,
        lr_params=lr_params,
        power=alpha_power,
    )
    schedule = Schedule(rate, steps, alphas, adp.alpha_segments(alphas))
    sigma, segments = noise_rule.noise(budget, schedule)
    events = [NoiseEvent(s, rate, count) for s, count in segments]
    epsilon_pld = accountants.pld_epsilon(events, budget.delta, neighbours=neighbours)
    conditions = (*noise_rule.conditions(budget, schedule), _certified(epsilon_pld, budget.epsilon))
    _refuse_if_over(client_id, noise_rule.name, sigma, schedule, epsilon_pld, budget.epsilon, conditions)
    plan = Plan(
        client_id=str(client_id),
        rule=noise_rule.name,
        n=budget.n,
        epsilon=budget.epsilon,
        delta=budget.delta,
        clip_norm=clip_norm,
        sigma=sigma,
        sampling_rate=rate,
        steps=steps,
        rounds=rounds,
        noise_segments=segments,
        epsilon_pld=epsilon_pld,
        epsilon_rdp=_known(accountants.rdp_epsilon(events, budget.delta, neighbours)),
        conditions=conditions,
        epsilon_bounds=noise_rule.looser_bounds(sigma, budget, schedule),
        learning_rate=learning_rate,
        lr_schedule=lr_schedule,
        lr_params=lr_params,
        alpha_schedule=alpha_schedule,
        alpha_params={"power": alpha_power} if alpha_schedule == "power" else {},
        neighbours=neighbours,
    )
    return with_rule_comparison(plan) if compare else plan


def with_rule_comparison(plan: Plan) -> Plan:
    """`plan` with the σ each rule needs for its ε, δ, q and T and the moments-accountant constant
    (unchanged if it has them); computed once per distinct comparison."""
    if plan.sigma_by_rule:
        return plan
    if plan.neighbours != accountants.ADD_REMOVE:  # the other rules' analyses are stated for add/remove
        pld_sigma = accountants.calibrate_pld(
            plan.epsilon, plan.delta, plan.sampling_rate, ((1.0, plan.steps),), plan.neighbours
        )
        return replace(
            plan,
            sigma_by_rule={
                "pld_calibrated": pld_sigma,
                "proactive": proactive_sigma(plan.epsilon, plan.delta),
            },
        )
    by_rule, moments_c = _comparison(
        plan.epsilon,
        plan.delta,
        plan.sampling_rate,
        plan.steps,
        plan.alpha_schedule,
        plan.learning_rate,
        plan.lr_schedule,
        tuple(sorted(plan.lr_params.items())),
        plan.alpha_params.get("power", 0.5),
    )
    return replace(plan, sigma_by_rule=dict(by_rule), moments_constant=moments_c)


@functools.lru_cache(maxsize=1024)
def _comparison(
    epsilon: float,
    delta: float,
    rate: float,
    steps: int,
    alpha_schedule: str,
    learning_rate: float,
    lr_schedule: str,
    lr_params: tuple[tuple[str, float], ...],
    power: float,
) -> tuple[tuple[tuple[str, float | None], ...], float]:
    alphas = adp.alpha_values(
        alpha_schedule,
        steps,
        learning_rate=learning_rate,
        lr_schedule=lr_schedule,
        lr_params=dict(lr_params),
        power=power,
    )
    comparison = compare_rules(epsilon, delta, rate, steps, alphas)
    return tuple(comparison.sigma_by_rule.items()), comparison.moments_constant


def _step_sizes(
    noise_rule: NoiseRule,
    lr_schedule: str | None,
    lr_params: dict[str, float] | None,
    alpha_schedule: str | None,
) -> tuple[str, dict[str, float], str]:
    """(learning-rate schedule, its parameters, α schedule): the caller's, or the rule's defaults."""
    lr_schedule, default_alpha = noise_rule.default_schedules(lr_schedule)
    if lr_schedule not in LR_SCHEDULES:
        raise InputError("lr-schedule", lr_schedule, f"must be one of {', '.join(LR_SCHEDULES)}")
    lr_params = dict(lr_params or (ADP_DEFAULT_LR_PARAMS if lr_schedule == "inverse_sqrt" else {}))
    alpha_schedule = alpha_schedule or default_alpha
    if not noise_rule.adapts_noise and alpha_schedule != "constant":
        raise InputError("alpha-schedule", alpha_schedule, "adapts the noise only under rule 'adp'")
    return lr_schedule, lr_params, alpha_schedule


def _known(value: float) -> float | None:
    """None where an accountant has no analysis (NaN): a plan's JSON holds no NaN."""
    return None if math.isnan(value) else value


def _certified(epsilon_pld: float, target: float) -> Condition:
    within = epsilon_pld <= target
    return Condition("certified", within, f"PLD ε = {epsilon_pld:.4f} {'≤' if within else '>'} target {target:g}")


def _refuse_if_over(
    client_id: str,
    rule: str,
    sigma: float,
    schedule: Schedule,
    epsilon_pld: float,
    target: float,
    conditions: tuple[Condition, ...],
) -> None:
    """A plan whose certificate exceeds its target never runs: `PlanRefused`, naming what failed."""
    if epsilon_pld <= target:
        return
    failed = [c.name for c in conditions if not c.met and c.kind == "required" and c.name != "certified"]
    raise PlanRefused(
        f"client {client_id}: rule {rule} with σ={sigma:.4g}, q={schedule.rate:.4g}, T={schedule.steps} certifies "
        f"ε={epsilon_pld:.4f} > target ε={target:g}"
        + (f" (conditions not met: {', '.join(failed)})" if failed else "")
        + "; use rule 'calibrated' or change the schedule (epochs, sampling rate, steps)"
    )
