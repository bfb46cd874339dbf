"""The ε an account has spent: the PLD composition of its recorded noise events, and its caches.

Pure of SQLite: the ledger hands in histories (tuples of `NoiseEvent`) and asks for their ε; the ε
spent is always the composition of the whole history at the account's δ, never a sum of per-round ε.
"""

from __future__ import annotations

from collections.abc import Sequence

from fedprivacy.privacy.accountants import NoiseEvent, pld_epsilon


def composed_epsilon(events: Sequence[NoiseEvent], delta: float) -> float:
    """PLD ε of `events` at `delta`; 0 when nothing was released."""
    events = [e for e in events if e.count > 0]
    return float(pld_epsilon(events, delta)) if events else 0.0


class SharedHistories:
    """Accounts with the same spends hold one history tuple, and each history's ε is computed once:
    a round of 1,000 clients under one plan asks for one ε, not 1,000 (each hashing a whole
    history for the accountant's cache). Forgotten wholesale past `LIMIT` entries."""

    LIMIT = 200_000

    def __init__(self) -> None:
        self._by_value: dict[tuple[NoiseEvent, ...], tuple[NoiseEvent, ...]] = {}
        self._extended: dict[
            tuple[int, tuple[NoiseEvent, ...]], tuple[tuple[NoiseEvent, ...], tuple[NoiseEvent, ...]]
        ] = {}
        self._epsilon: dict[tuple[int, float], tuple[tuple[NoiseEvent, ...], float]] = {}
        self._steps: dict[int, tuple[tuple[NoiseEvent, ...], int]] = {}

    def size(self) -> int:
        return len(self._by_value) + len(self._extended) + len(self._epsilon) + len(self._steps)

    def intern(self, events: Sequence[NoiseEvent]) -> tuple[NoiseEvent, ...]:
        if self.size() > self.LIMIT:
            self._by_value, self._extended, self._epsilon, self._steps = {}, {}, {}, {}
        events = tuple(events)
        return self._by_value.setdefault(events, events)

    def extend(self, history: tuple[NoiseEvent, ...], events: tuple[NoiseEvent, ...]) -> tuple[NoiseEvent, ...]:
        """`history` + `events`, shared with every account that had the same history and spends the same."""
        if not events:
            return history
        hit = self._extended.get((id(history), events))
        if hit is None or hit[0] is not history:  # ids are only trusted for the object they were taken from
            hit = (history, self.intern(history + events))
            self._extended[(id(history), events)] = hit
        return hit[1]

    def steps(self, history: tuple[NoiseEvent, ...]) -> int:
        hit = self._steps.get(id(history))
        if hit is None or hit[0] is not history:
            hit = (history, sum(e.count for e in history))
            self._steps[id(history)] = hit
        return hit[1]

    def epsilon(self, history: tuple[NoiseEvent, ...], delta: float) -> float:
        hit = self._epsilon.get((id(history), delta))
        if hit is None or hit[0] is not history:
            hit = (history, composed_epsilon(history, delta))
            self._epsilon[(id(history), delta)] = hit
        return hit[1]
