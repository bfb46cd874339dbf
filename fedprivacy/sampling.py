"""Which clients a round asks: a seeded fraction of those still eligible.

One rule for every engine (the ServerApp's strategy and the fast engine), so that with the same
seed they ask the same clients in the same order.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


def sample_clients(rng: random.Random, eligible: Sequence[int], fraction: float) -> list[int]:
    """⌊fraction·len⌋ of `eligible` (at least one), sorted; none when there are none or fraction is 0."""
    if not eligible or fraction == 0.0:
        return []
    return sorted(rng.sample(list(eligible), max(1, int(len(eligible) * fraction))))
