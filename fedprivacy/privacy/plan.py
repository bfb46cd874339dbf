"""The `Plan`: one client's DP-SGD parameters, decided before training and certified.

A plan is the single description of the mechanism: the trainer reads σ, q,
C and T from it and never recomputes them, and the accountant composes exactly the per-step
noise multipliers in `noise_segments`. Plans serialise to the JSON contract that
`fedprivacy plan --json`, the planning sheets and the Flower apps share.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

LR_SCHEDULES = ("constant", "inverse_sqrt", "adagrad_norm")
# The neighbour relation a plan's certificate holds for. Add/remove one record needs N public: the
# plan's q, T and the replies' `num-examples` are functions of N, so N must be a declared size (a
# deployed node's `public-size`, a simulation's partition size, the N given to `fedprivacy plan`).
# Every run plans add/remove; `fedprivacy plan --adjacency replace-one` certifies a release whose N
# is the real size (same N, one record replaced: the sensitivity is 2C).
NEIGHBOUR_RELATIONS = {
    "add-remove": "add/remove one record; N public (declared)",
    "replace-one": "replace one record; N may be the real size",
}
ALPHA_SCHEDULES = ("constant", "inverse_sqrt_lr", "power")
# What a step releases: the Gaussian mechanism's output, rounded exactly to a grid of the largest
# power of two ≤ σC/2^RELEASE_GRID_BITS (`fedprivacy.training.noise`). Rounding is post-processing:
# the certificate of the subsampled Gaussian holds for it as it is.
RELEASE_GRID_BITS = 8
RELEASED_MECHANISM = (
    "Poisson-subsampled Gaussian on the clipped sum, released exactly rounded to a power-of-two grid "
    f"≤ σC/{2**RELEASE_GRID_BITS} (Haney et al. 2022; the rounding is post-processing: no ε added)"
)


@dataclass(frozen=True)
class Condition:
    """One validity condition of a noise rule, evaluated for a concrete plan.

    `kind` is "required" for conditions of the theorem the rule relies on and "information"
    for statements that only help the reader (asymptotic forms without constants).
    """

    name: str
    met: bool
    detail: str
    kind: str = "required"


@functools.lru_cache(maxsize=4096)
def round_steps(steps: int, rounds: int, round_number: int) -> range:
    """The steps (0-based) of federated round `round_number` (1-based) when `steps` are split over
    `rounds` as evenly as possible, the first `steps % rounds` rounds one step longer; empty outside
    1..`rounds`. A function of the schedule alone: the ledger caches a round's events per schedule,
    and it is cached here (a fast-engine round asks it for every client, whose plans share a few)."""
    base, extra = divmod(steps, rounds)
    done = min(max(round_number - 1, 0), rounds)
    first = base * done + min(done, extra)
    count = base + (1 if round_number <= extra else 0) if 1 <= round_number <= rounds else 0
    return range(first, first + count)


@dataclass(frozen=True)
class Plan:
    """A client's certified DP-SGD plan (Poisson sampling; the neighbour relation in `neighbours`)."""

    client_id: str
    rule: str
    n: int
    epsilon: float
    delta: float
    clip_norm: float
    sigma: float
    sampling_rate: float
    steps: int
    rounds: int
    noise_segments: tuple[tuple[float, int], ...]
    epsilon_pld: float
    epsilon_rdp: float | None  # None: no RDP analysis of the relation (replace-one with Poisson sampling)
    conditions: tuple[Condition, ...] = ()
    sigma_by_rule: dict[str, float | None] = field(default_factory=dict)
    epsilon_bounds: dict[str, float | None] = field(default_factory=dict)
    moments_constant: float | None = None
    learning_rate: float = 0.1
    lr_schedule: str = "constant"
    lr_params: dict[str, float] = field(default_factory=dict)
    alpha_schedule: str = "constant"
    alpha_params: dict[str, float] = field(default_factory=dict)
    neighbours: str = "add-remove"  # a key of NEIGHBOUR_RELATIONS

    # ----- derived quantities (part of the JSON contract) -----
    @property
    def expected_batch_size(self) -> float:
        return self.sampling_rate * self.n

    @property
    def epochs(self) -> float:
        """k = q·T: expected passes over the local data."""
        return self.sampling_rate * self.steps

    @property
    def budget_unused(self) -> float:
        return self.epsilon - self.epsilon_pld

    @property
    def noise_std_on_mean(self) -> float:
        """Noise standard deviation on the averaged gradient, σC/(qN) (first step's σ)."""
        return self.noise_multiplier(0) * self.clip_norm / (self.sampling_rate * self.n)

    # ----- what the trainer asks -----
    def noise_multiplier(self, step: int) -> float:
        """σ used at local step `step` (0-based), read from the certified segments."""
        if not 0 <= step < self.steps:
            raise IndexError(f"step {step} outside the plan's {self.steps} steps")
        ends = list(itertools.accumulate(count for _, count in self.noise_segments))
        return self.noise_segments[bisect.bisect_right(ends, step)][0]

    def steps_in_round(self, round_number: int) -> int:
        """Steps of federated round `round_number` (1-based): T split as evenly as possible."""
        return len(round_steps(self.steps, self.rounds, round_number))

    def first_step_of_round(self, round_number: int) -> int:
        """Steps of the rounds before `round_number` (`round_steps`: the first T mod R rounds have one more)."""
        return round_steps(self.steps, self.rounds, round_number).start

    def noise_multipliers(self) -> np.ndarray:
        """σ_t of every step (float64), read from the certified segments: `noise_multiplier` for all t."""
        return np.repeat([sigma for sigma, _ in self.noise_segments], [count for _, count in self.noise_segments])

    def learning_rate_at(self, step: int) -> float:
        """η_t of the deterministic schedules (adagrad_norm adapts in the trainer instead)."""
        return float(self.learning_rates(np.asarray(step)))

    def learning_rates(self, steps: np.ndarray) -> np.ndarray:
        """η_t at each of `steps` (float64; `learning_rate_at` for many steps at once)."""
        if self.lr_schedule == "inverse_sqrt":
            a = self.lr_params.get("a", 20.0)
            c = self.lr_params.get("c", 1.0)
            return self.learning_rate / np.sqrt(a + c * steps.astype(np.float64))
        return np.full(steps.shape, float(self.learning_rate))

    # ----- serialisation -----
    def to_dict(self) -> dict[str, Any]:
        # Field by field, not dataclasses.asdict: its deep copies made saving 1,000 plans take 0.4 s.
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("sigma_by_rule", "epsilon_bounds", "lr_params", "alpha_params"):
            data[name] = dict(data[name])
        data["noise_segments"] = [list(seg) for seg in self.noise_segments]
        data["conditions"] = [dict(vars(c)) for c in self.conditions]  # flat: no deep copy needed
        data.update(
            expected_batch_size=self.expected_batch_size,
            epochs=self.epochs,
            budget_unused=self.budget_unused,
            noise_std_on_mean=self.noise_std_on_mean,
            released_mechanism=RELEASED_MECHANISM,
        )
        return data

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), allow_nan=False, **kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        known = set(cls.__dataclass_fields__)
        values = {k: v for k, v in data.items() if k in known}
        values["noise_segments"] = tuple((float(s), int(c)) for s, c in data["noise_segments"])
        values["conditions"] = tuple(Condition(**c) for c in data.get("conditions", ()))
        return cls(**values)
