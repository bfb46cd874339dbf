"""The noise rules, each a small object found by name (`RULES`), which the planner composes.

A rule decides three things for a client whose target (`PlanningTarget`: N, ε, δ) and schedule
(q, T, the α schedule) are known: the per-step noise multipliers, the validity conditions of the
analysis it relies on, and the ε that looser analyses give for the same plan. Certification,
refusal and the comparison with other rules are the planner's (`fedprivacy.privacy.planner`), the
same for every rule.

- `proactive` (van Dijk et al. 2024): σ = sqrt(2(ε + ln(1/δ))/ε), independent of T, with the
  published conditions on T, k and N reported by name;
- `calibrated`: the smallest σ the PLD accountant certifies for the target and schedule;
- `calibrated-rdp`: the smallest σ the RDP accountant (Mironov 2017) certifies, as DP-SGD
  libraries calibrate it: looser than PLD, so the plan (still certified by PLD) spends less than
  its budget; add/remove neighbours only (dp-accounting's RDP has no replace-one Poisson step);
- `adp` (Wu et al., ADP-SGD): σ_t = s·α_t for a schedule α fixed in advance (α_t = 1/sqrt(η_t) by
  default), s calibrated by PLD step by step; Theorem 4.1's condition on T, and Lemma 2.2's ε.

To add a rule, implement `NoiseRule` and add it to `RULES`: the run config, the CLI's choices and
the planner find it there. The rule comparison beside a plan is not: to show the new rule's σ
there, add it to `planner.compare_rules` (and to `planner.with_rule_comparison` for replace-one
plans), whose names the planning sheet's figure matches against the plan's rule. The tests that
run every rule list the rules by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fedprivacy.errors import InputError, did_you_mean
from fedprivacy.privacy import accountants, adp, classical
from fedprivacy.privacy.plan import Condition
from fedprivacy.privacy.proactive import proactive_conditions, proactive_sigma

Segments = tuple[tuple[float, int], ...]


@dataclass(frozen=True)
class PlanningTarget:
    """What a client plans for: its N records, its (ε, δ), and the neighbour relation ε holds for.
    A target, not a budget: the ledger's `Budget` is the (ε, δ) pinned for an account, and spent."""

    n: int
    epsilon: float
    delta: float
    neighbours: str = accountants.ADD_REMOVE


@dataclass(frozen=True)
class Schedule:
    """The steps a plan takes: Poisson rate q, T steps, and the noise schedule α (relative to α₁)."""

    rate: float
    steps: int
    alphas: np.ndarray  # α_1..α_T as fixed in advance
    relative: Segments  # α/α_1 floored to a grid and run-length encoded (adp.alpha_segments)


class NoiseRule(Protocol):
    name: str
    adapts_noise: bool  # whether an α schedule other than constant makes sense under the rule

    def default_schedules(self, lr_schedule: str | None) -> tuple[str, str]:
        """(learning-rate schedule, α schedule) when the caller names none."""

    def noise(self, target: PlanningTarget, schedule: Schedule) -> tuple[float, Segments]:
        """(σ, or the scale s of σ_t = s·α_t; the per-step noise multipliers as (σ, count) runs)."""

    def conditions(self, target: PlanningTarget, schedule: Schedule) -> tuple[Condition, ...]:
        """The validity conditions of the analysis behind the rule, evaluated for this plan."""

    def looser_bounds(self, sigma: float, target: PlanningTarget, schedule: Schedule) -> dict[str, float | None]:
        """The ε that classical analyses give for this same plan."""


class _ConstantNoise:
    """What the rules with one σ for every step share: a constant α schedule, and naive and strong
    composition (Dwork & Roth) of T steps as the looser analyses."""

    adapts_noise = False

    def default_schedules(self, lr_schedule: str | None) -> tuple[str, str]:
        return lr_schedule or "constant", "constant"

    def looser_bounds(self, sigma: float, target: PlanningTarget, schedule: Schedule) -> dict[str, float | None]:
        if target.neighbours != accountants.ADD_REMOVE:
            return {}  # the classical amplification bounds here are stated for add/remove
        return {
            "naive": classical.naive_epsilon(sigma, target.delta, schedule.rate, schedule.steps),
            "strong": classical.strong_epsilon(sigma, target.delta, schedule.rate, schedule.steps),
        }


class Proactive(_ConstantNoise):
    name = "proactive"

    def noise(self, target: PlanningTarget, schedule: Schedule) -> tuple[float, Segments]:
        sigma = proactive_sigma(target.epsilon, target.delta)
        return sigma, ((sigma, schedule.steps),)

    def conditions(self, target: PlanningTarget, schedule: Schedule) -> tuple[Condition, ...]:
        return proactive_conditions(
            target.n, target.epsilon, target.delta, schedule.rate * schedule.steps, schedule.steps
        )


class Calibrated(_ConstantNoise):
    name = "calibrated"

    def noise(self, target: PlanningTarget, schedule: Schedule) -> tuple[float, Segments]:
        sigma = accountants.calibrate_pld(
            target.epsilon, target.delta, schedule.rate, schedule.relative, target.neighbours
        )
        return sigma, tuple((sigma * alpha, count) for alpha, count in schedule.relative)

    def conditions(self, target: PlanningTarget, schedule: Schedule) -> tuple[Condition, ...]:
        return ()  # the PLD certificate is the whole argument


class CalibratedRdp(Calibrated):
    """σ calibrated by RDP instead of PLD: the comparison a referee asks for between accountants."""

    name = "calibrated-rdp"

    def noise(self, target: PlanningTarget, schedule: Schedule) -> tuple[float, Segments]:
        if target.neighbours != accountants.ADD_REMOVE:
            raise InputError(
                "rule",
                self.name,
                f"calibrates by RDP, which dp-accounting gives for add/remove neighbours only, not "
                f"{target.neighbours}; use rule 'calibrated'",
            )
        sigma = accountants.calibrate_rdp(target.epsilon, target.delta, schedule.rate, schedule.relative)
        return sigma, tuple((sigma * alpha, count) for alpha, count in schedule.relative)


class Adp(Calibrated):
    """ADP-SGD: the calibrated scale applied to the α schedule (Wu et al., Theorem 4.1)."""

    name = "adp"
    adapts_noise = True

    def default_schedules(self, lr_schedule: str | None) -> tuple[str, str]:
        lr_schedule = lr_schedule or "inverse_sqrt"
        return lr_schedule, ("power" if lr_schedule == "adagrad_norm" else "inverse_sqrt_lr")

    def conditions(self, target: PlanningTarget, schedule: Schedule) -> tuple[Condition, ...]:
        return adp.theorem41_conditions(target.epsilon, target.delta, schedule.rate, schedule.alphas)

    def looser_bounds(self, sigma: float, target: PlanningTarget, schedule: Schedule) -> dict[str, float | None]:
        if target.neighbours != accountants.ADD_REMOVE:
            return {}
        lemma = adp.lemma22_epsilon(sigma, target.delta, schedule.rate, schedule.relative)  # None where ε_t ≤ 1 fails
        return {"extended_advanced_composition": lemma if math.isfinite(lemma) else None}


RULES: dict[str, NoiseRule] = {rule.name: rule for rule in (Proactive(), Calibrated(), CalibratedRdp(), Adp())}
RULE_NAMES = tuple(RULES)


def find_rule(name: str) -> NoiseRule:
    """The rule called `name`, or an error that lists the rules there are."""
    if name not in RULES:
        raise InputError("rule", name, f"must be one of: {', '.join(RULES)}{did_you_mean(name, RULES)}")
    return RULES[name]
