"""Client-level DP on the server: DP-FedAvg (McMahan et al. 2018, "Learning differentially private
recurrent language models"), one for the ServerApp's strategy and the fast engine.

With `federation-epsilon` > 0 the server, before the first round, fixes the roster (the M clients
the run starts with), plans the federation's noise (`fedprivacy.privacy.federation.plan_federation`:
M, rounds R, the expected cohort pM and the update clip S, certified by the same accountant as a
client's plan) and opens the federation's ledger account for (ε_fed, δ_fed) (`federation-ledger`,
kept across runs, or one in the run's folder). Then every round:

1. each member of the roster is sampled with probability p (`sampled`: a Poisson draw per member
   from ChaCha20, as a client samples its records); the sampled members that are connected and
   can still train are asked;
2. the round's spend is recorded in the federation's ledger before anything is released: a round
   the federation's budget cannot afford (earlier runs on the ledger included), or one beyond the
   plan's R, is refused and the run stops;
3. each trained member's update Δᵢ (its released parameters less the round's global model) is
   clipped to S, the clipped updates are summed exactly, Gaussian noise of standard deviation σS is
   added and the result divided by pM (`release`). A sampled member that did not train contributes
   nothing, and a round without any trained member still releases noise.

With `update-clip-quantile` γ > 0 the clip adapts (Andrew et al. 2021, "Differentially private
learning with adaptive clipping"): each round also releases Σᵢ(bᵢ − ½) + N(0, σ_b²), bᵢ = 1 when
member i's update norm is at most this round's S, and S moves by exp(−η·(share − γ)) towards the
γ-quantile. Released together with the update sum noised at σ_Δ·S, σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2),
the pair is one Gaussian mechanism of noise multiplier σ (their Theorem 1), so the plan's σ and
certificate hold unchanged; σ_b must exceed σ/2.

What the sum holds is exact: each clipped Δᵢ is cut towards zero onto a grid of g = 2⁻³⁰·2^⌊log₂S⌋
(a coordinate's magnitude never grows, so neither does the norm) and summed as integers, so the sum
moves by at most S when one member's contribution is there or not (neighbouring federations:
zero-out on the public roster, whose accounting is add/remove's for the Poisson-sampled Gaussian);
the noise is the project's exactly rounded Gaussian (`fedprivacy.training.noise.rounded_gaussian`,
Haney et al. 2022). The norm is taken in float64 and the clip aims at S·(1 − 2⁻³⁰ − P·2⁻⁵²), which
covers its rounding for P parameters.

The guarantee is central DP: it holds against whoever sees the sequence of aggregated models (other
members, the public), not against the server, which sees the updates and who replied; what the
results folder says of participation (counts of sampled and trained clients, clients.csv, the log)
is the server operator's and is not covered. A member's records stay protected from the server by
the member's own record-level plan.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from fedprivacy.errors import InputError, PlanRefused
from fedprivacy.ledger import BudgetExceeded, BudgetMismatch, Ledger, RoundRepeated, round_events
from fedprivacy.privacy.federation import FEDERATION_ID, plan_federation
from fedprivacy.privacy.limits import CLIP_NORM_MAX, CLIP_NORM_MIN
from fedprivacy.privacy.plan import Plan
from fedprivacy.runconfig import RunSettings
from fedprivacy.training.noise import rounded_gaussian
from fedprivacy.training.rng import StepRandomness
from fedprivacy.training.stack import noise_scale

LEDGER_NAME = "federation-ledger.sqlite"
PLAN_NAME = "federation-plan.json"  # the whole certified plan, in the run's folder
GRID_BITS = 30  # the clipped updates' grid g = 2^(⌊log₂S⌋ − GRID_BITS)
MAX_COHORT = 1 << 22  # integer sums stay exact in float64: K·2^(GRID_BITS+1) ≤ 2⁵³
SUM_ELEMENTS = 1 << 24  # float64 elements of a chunk of members' updates in `clipped_sum` (128 MiB)
NEIGHBOURS = "zero-out on the public roster (one member's contribution there or not; accounted as add/remove)"
PLAN_FIELDS = {  # plan_federation's field names → the run-config keys that set them
    "n": "members (the clients the run starts with)",
    "rounds": "num-server-rounds",
    "epsilon": "federation-epsilon",
    "delta": "federation-delta",
    "batch-size": "federation-cohort",
    "rule": "federation-rule",
    "clip-norm": "update-clip",
}


def federation_delta(settings: RunSettings, members: int) -> float:
    """The federation's δ: `federation-delta`, or, when it is 0, min(10⁻⁵, 1/M^1.1) (McMahan et
    al. 2018 take 1/M^1.1, which is weak for the small federations of a simulation)."""
    return settings.federation_delta or min(1e-5, members**-1.1)


@dataclass
class AdaptiveClip:
    """Adaptive clipping's settings and its count's noise stream (see the module docstring)."""

    quantile: float
    rate: float
    count_noise: float  # σ_b
    stream: StepRandomness

    def update_multiplier(self, sigma: float) -> float:
        """σ_Δ: the update sum's noise multiplier that leaves the pair's at σ, rounded up: the
        smallest float whose σ_Δ⁻² + (2σ_b)⁻² is at most σ⁻², checked in rational arithmetic (the
        float difference loses digits when σ_b is near σ/2)."""
        left = Fraction(sigma) ** -2 - Fraction(2 * self.count_noise) ** -2  # > 0: σ_b > σ/2
        multiplier = float(left) ** -0.5
        while Fraction(multiplier) ** -2 > left:
            multiplier = math.nextafter(multiplier, math.inf)
        return multiplier

    def next_clip(self, clip: float, centred_count: float, expected_cohort: float, step: int) -> float:
        """The next round's S from this round's Σ(bᵢ − ½), released with noise σ_b; kept within
        `update-clip`'s range, where the sum's grid stays exact."""
        noise_std = noise_scale(self.count_noise, 1.0).reshape(1)
        draws = self.stream.draws(step, 1, 0, 0.0, 1)
        count = torch.tensor([[centred_count]], dtype=torch.float64)
        noisy = float(rounded_gaussian(count, draws.noise, noise_std, [self.stream.refiner(step)])[0, 0])
        share = noisy / expected_cohort + 0.5
        log_clip = math.log(clip) - self.rate * (share - self.quantile)  # in logs: no overflow at any rate
        return math.exp(min(max(log_clip, math.log(CLIP_NORM_MIN)), math.log(CLIP_NORM_MAX)))


@dataclass
class ClientLevel:
    """A run's client-level DP: its roster, plan, ledger account, randomness and current clip.

    The roster is the members the plan was made for, fixed at the start: neighbouring federations
    differ in one member's contribution being there or not (zero-out on a public roster, whose
    accounting is add/remove's for the Poisson-sampled Gaussian), and a client that joins later is
    never sampled."""

    plan: Plan
    roster: tuple[int, ...]
    ledger: Ledger
    run_id: str
    sampling: StepRandomness
    noise: StepRandomness
    adaptive: AdaptiveClip | None = None
    clip: float = 0.0  # this round's S: the plan's, or where adaptive clipping has moved it
    last_clip: float | None = None  # the S of the last round released

    @classmethod
    def start(cls, settings: RunSettings, roster: Sequence[int], folder: Path) -> ClientLevel | None:
        """Plan the federation for the members of `roster` before the first round and open its
        ledger account (`federation-ledger`, or `folder`'s); None when the run has no client-level
        DP. A plan the budget cannot certify, or a ledger that refuses the account, stops the run
        here, before any member trains."""
        if not settings.client_level:
            return None
        members = len(roster)
        plan = _plan(settings, members)
        seeded = settings.noise_seed >= 0

        def stream(name: str) -> StepRandomness:
            return StepRandomness(f"{settings.noise_seed}:federation-{name}" if seeded else None)

        adaptive = None
        if settings.update_clip_quantile:
            count_noise = settings.clip_count_noise or plan.expected_batch_size / 20
            largest = max(sigma for sigma, _ in plan.noise_segments)
            if not count_noise > largest / 2:
                given = "" if settings.clip_count_noise else f" (0: pM/20 = {count_noise:.4g})"
                raise InputError(
                    "clip-count-noise",
                    f"{settings.clip_count_noise:g}{given}",
                    f"the count's noise σ_b must exceed σ/2 = {largest / 2:.4g}: it is part of the plan's σ "
                    "(Andrew et al. 2021); set clip-count-noise above that, or a larger federation-cohort",
                )
            adaptive = AdaptiveClip(
                settings.update_clip_quantile, settings.update_clip_rate, count_noise, stream("count")
            )
        run = folder.name  # the run's key in the ledger: a run id repeats across simulations, a folder does not
        ledger = _open_ledger(settings, plan, folder / LEDGER_NAME, run)
        (folder / PLAN_NAME).write_text(plan.to_json(indent=2) + "\n")
        return cls(plan, tuple(roster), ledger, run, stream("sampling"), stream("noise"), adaptive, plan.clip_norm)

    @property
    def members(self) -> int:
        return len(self.roster)

    def sampled(self, server_round: int) -> list[int]:
        """Round `server_round`'s Poisson draw over the roster: each member kept with probability
        p, from the round's own stream, whoever is connected or can still train."""
        draws = self.sampling.draws(server_round - 1, 1, self.members, self.plan.sampling_rate, 0)
        kept = draws.keep[0, : self.members].tolist()
        return [member for member, keep in zip(self.roster, kept, strict=True) if keep]

    def release(
        self, server_round: int, current: Mapping[str, Tensor], updates: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        """The new values of the released entries: the current ones plus the noisy mean of the
        members' clipped updates (`updates`: entry → [K, *shape], K members, possibly 0), after the
        round's spend is recorded (`BudgetExceeded` when the budget cannot afford it)."""
        if not 1 <= server_round <= self.plan.rounds:
            raise BudgetExceeded(
                f"round {server_round} is outside the federation's plan of {self.plan.rounds} rounds: "
                "its noise was planned for those rounds only"
            )
        try:
            self.ledger.record(FEDERATION_ID, self.run_id, server_round, round_events(self.plan, server_round))
        except RoundRepeated:
            raise BudgetExceeded(f"round {server_round} of this run was already released by the federation") from None
        except BudgetExceeded:
            raise BudgetExceeded(
                f"the federation's budget ε_fed = {self.plan.epsilon:g} cannot afford round {server_round}: "
                f"{self.epsilon_spent():.4f} spent in {self.ledger.path} (earlier runs included)"
            ) from None
        keys = list(updates)
        base = torch.cat([current[k].detach().to(torch.float64).flatten() for k in keys])
        clip = self.clip
        total, centred_count = clipped_sum(base, [updates[k] for k in keys], clip)
        step = self.plan.first_step_of_round(server_round)
        multiplier = self.plan.noise_multiplier(step)
        if self.adaptive is not None:
            multiplier = self.adaptive.update_multiplier(multiplier)
        noise_std = noise_scale(multiplier, clip).reshape(1)
        draws = self.noise.draws(step, 1, 0, 0.0, base.numel())
        noisy = rounded_gaussian(total[None], draws.noise, noise_std, [self.noise.refiner(step)])[0]
        flat = base + noisy / self.plan.expected_batch_size
        self.last_clip = clip
        if self.adaptive is not None:
            self.clip = self.adaptive.next_clip(clip, centred_count, self.plan.expected_batch_size, step)
        pieces = flat.split([current[k].numel() for k in keys])
        return {k: piece.reshape(current[k].shape).to(current[k].dtype) for k, piece in zip(keys, pieces, strict=True)}

    def epsilon_spent(self) -> float:
        """The federation's ε spent so far (its ledger, PLD at δ_fed)."""
        return self.ledger.epsilon_spent(FEDERATION_ID)

    def describe(self) -> dict[str, Any]:
        """What config.json and summary.json say of the federation's plan."""
        plan = self.plan
        return {
            "members": self.members,
            "epsilon": plan.epsilon,
            "delta": plan.delta,
            "rule": plan.rule,
            "sigma": plan.sigma,
            "update_clip": plan.clip_norm,
            "update_clip_quantile": None if self.adaptive is None else self.adaptive.quantile,
            "clip_count_noise": None if self.adaptive is None else self.adaptive.count_noise,
            "sum_noise_multiplier": self.update_multiplier(),
            "sampling_rate": plan.sampling_rate,
            "expected_cohort": plan.expected_batch_size,
            "rounds": plan.rounds,
            "neighbours": NEIGHBOURS,
            "epsilon_certified": plan.epsilon_pld,
            "ledger": str(self.ledger.path),
        }

    def headline(self) -> str:
        """The plan in one line, for the run's console."""
        plan, adaptive = self.plan, self.adaptive
        clip = f"S = {plan.clip_norm:g}" + (
            "" if adaptive is None else f" first, then its {adaptive.quantile:g}-quantile"
        )
        split = (
            ""
            if adaptive is None
            else f"; σ_Δ = {self.update_multiplier():.4g} on the sum, σ_b = {adaptive.count_noise:.4g} on the count"
        )
        return (
            f"client-level DP: {self.members} members, each sampled with p = {plan.sampling_rate:.4g} "
            f"(expected cohort {plan.expected_batch_size:.4g}), updates clipped to {clip}, "
            f"noise σ = {plan.sigma:.4g} ({plan.rule}{split}); certified ε_fed = {plan.epsilon_pld:.3f} ≤ "
            f"{plan.epsilon:g} at δ_fed = {plan.delta:.3g} over {plan.rounds} rounds{self._spent_before()}"
        )

    def update_multiplier(self) -> float:
        """σ_Δ of the update sum's noise at the plan's σ (the plan's σ itself with a fixed clip)."""
        sigma = max(sigma for sigma, _ in self.plan.noise_segments)
        return sigma if self.adaptive is None else self.adaptive.update_multiplier(sigma)

    def _spent_before(self) -> str:
        """What the federation's ledger holds from earlier runs, if anything."""
        spent = self.epsilon_spent()
        return "" if spent == 0 else f"; its ledger holds ε_fed = {spent:.4f} spent by earlier runs"

    def close(self) -> None:
        """Close the federation's ledger (its spends are already durable)."""
        self.ledger.close()

    def __enter__(self) -> ClientLevel:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def clipped_sum(base: Tensor, updates: Sequence[Tensor], clip: float) -> tuple[Tensor, float]:
    """Σᵢ clip_S(uᵢ − base), exact, in float64 (see the module docstring), and Σᵢ(bᵢ − ½) with bᵢ = 1
    when update i's norm is at most S (adaptive clipping's count): `updates` per entry [K, *shape],
    `base` the current values flattened in the same order. An update that is not finite counts as
    a member that did not train (in neither sum). Members are taken a chunk at a time (`SUM_ELEMENTS`
    float64 entries), so the temporaries stay near 128 MiB whatever the cohort."""
    members = updates[0].shape[0] if updates else 0
    if members > MAX_COHORT:
        raise ValueError(f"{members} members' updates in one round: at most {MAX_COHORT} sum exactly")
    margin = 2.0**-30 + base.numel() * 2.0**-52
    grid = 2.0 ** (math.floor(math.log2(clip)) - GRID_BITS)
    units = torch.zeros(base.numel(), dtype=torch.int64, device=base.device)
    centred_count = 0.0
    rows = max(1, SUM_ELEMENTS // max(base.numel(), 1))
    for first in range(0, members, rows):
        part = [u[first : first + rows].detach().to(torch.float64) for u in updates]
        deltas = torch.cat([u.reshape(u.shape[0], -1) for u in part], dim=1) - base
        finite = torch.isfinite(deltas).all(dim=1)
        deltas = torch.where(finite[:, None], deltas, 0.0)
        norms = torch.linalg.vector_norm(deltas, dim=1)
        factors = torch.clamp(clip * (1.0 - margin) / norms, max=1.0)  # a zero norm gives inf: factor 1
        units += torch.trunc(deltas * factors[:, None] / grid).to(torch.int64).sum(dim=0)  # towards zero
        centred_count += float(((norms <= clip).double() - 0.5)[finite].sum())
    return units.to(torch.float64) * grid, centred_count


def _plan(settings: RunSettings, members: int) -> Plan:
    """The federation's certified plan, its refusals naming the run-config keys."""
    try:
        return plan_federation(
            members,
            settings.federation_epsilon,
            federation_delta(settings, members),
            settings.num_server_rounds,
            rule=settings.federation_rule,
            update_clip=settings.update_clip,
            expected_cohort=settings.federation_cohort,
            compare=False,
        )
    except InputError as refused:
        raise InputError(PLAN_FIELDS.get(refused.field, refused.field), refused.value, refused.allowed) from None
    except PlanRefused as refused:
        words = (
            ("use rule ", "use federation-rule="),
            ("a smaller cohort", "a smaller federation-cohort"),
            ("fewer rounds", "fewer num-server-rounds"),
            ("target ε=", "federation-epsilon="),
        )
        message = str(refused)
        for old, new in words:
            message = message.replace(old, new)
        raise PlanRefused(message) from None


def _open_ledger(settings: RunSettings, plan: Plan, default: Path, run_id: str) -> Ledger:
    """The federation's ledger with its account open at (ε_fed, δ_fed). Refused: a seeded run on an
    account another run spent from (it would repeat that run's noise), and a run whose planned rounds
    the account cannot afford after earlier runs (before any member trains)."""
    ledger = Ledger(settings.federation_ledger or default)
    try:
        try:
            ledger.open_account(FEDERATION_ID, plan.epsilon, plan.delta)
        except BudgetMismatch:
            pinned = ledger.budget(FEDERATION_ID)
            key, value = ("federation-epsilon", plan.epsilon)
            if pinned.epsilon == plan.epsilon:
                key, value = ("federation-delta", plan.delta)
            raise InputError(
                key,
                value,
                f"the federation's ledger {ledger.path} holds a budget of ε_fed = {pinned.epsilon:g}, "
                f"δ_fed = {pinned.delta:.3g}: run with that budget, or name another federation-ledger",
            ) from None
        if settings.noise_seed >= 0 and ledger.runs(FEDERATION_ID) - {run_id}:
            raise InputError(
                "noise-seed",
                settings.noise_seed,
                f"the federation's ledger {ledger.path} was already spent from by another run: a fixed seed "
                "would repeat its noise; use a fresh federation-ledger or noise-seed=-1",
            )
        planned = [event for r in range(1, plan.rounds + 1) for event in round_events(plan, r)]
        total = ledger.epsilon_if(FEDERATION_ID, planned)
        if total > plan.epsilon:
            raise InputError(
                "num-server-rounds",
                plan.rounds,
                f"the federation's ledger {ledger.path} has spent ε_fed = {ledger.epsilon_spent(FEDERATION_ID):.4f} "
                f"in earlier runs; this run's rounds would bring it to {total:.4f} > {plan.epsilon:g}: plan fewer "
                "rounds or a smaller federation-cohort, or name another federation-ledger",
            )
    except Exception:
        ledger.close()
        raise
    return ledger
