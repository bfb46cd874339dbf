"""The noise events one round of a plan releases: what a client records in its ledger per round.

The round's slice of the plan's steps comes from the plan's own rule (`round_steps`); the events
are cached per noise schedule, not per plan (plans carry their client's name, so every client has
its own plan, while a run's clients share a handful of schedules).
"""

from __future__ import annotations

from functools import lru_cache
from itertools import groupby

from fedprivacy.privacy.accountants import NoiseEvent
from fedprivacy.privacy.plan import Plan, round_steps

NoiseSchedule = tuple[tuple[tuple[float, int], ...], float, int, int]  # (σ segments, q, steps, rounds)


def round_events(plan: Plan, server_round: int) -> tuple[NoiseEvent, ...]:
    """The noise events of one round's slice of `plan`, consecutive equal σ merged (one tuple
    shared by every plan with the same schedule: the ledger checks equal spends once)."""
    return _round_events(*noise_schedule(plan), server_round)


def noise_schedule(plan: Plan) -> NoiseSchedule:
    """What `round_events` reads of a plan, as one tuple shared by every plan with an equal
    schedule: a simulator keys its clients' round events by its id, one look-up per schedule."""
    return _interned_schedule(plan.noise_segments, plan.sampling_rate, plan.steps, plan.rounds)


@lru_cache(maxsize=4096)
def _interned_schedule(segments: tuple[tuple[float, int], ...], q: float, steps: int, rounds: int) -> NoiseSchedule:
    return segments, q, steps, rounds  # built once per distinct schedule: the cache hands back this tuple


@lru_cache(maxsize=4096)
def _round_events(
    segments: tuple[tuple[float, int], ...], q: float, steps: int, rounds: int, server_round: int
) -> tuple[NoiseEvent, ...]:
    """Cached per schedule: clients with the same plan ask for the same rounds."""
    taken = round_steps(steps, rounds, server_round)
    sigmas = []
    position = 0
    for sigma, length in segments:  # σ of the round's steps, read from the segments
        overlap = min(position + length, taken.stop) - max(position, taken.start)
        sigmas += [sigma] * max(overlap, 0)
        position += length
    return tuple(NoiseEvent(sigma=sigma, sampling_rate=q, count=len(list(group))) for sigma, group in groupby(sigmas))
