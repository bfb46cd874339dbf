"""The Gaussian noise's tail: exact far below any δ the planner accepts.

A sampler whose |z| never exceeds r_max makes every output beyond g + σ·r_max impossible under a
dataset with gradient sum g and possible, with probability P(Z > r_max − 1/σ), under a neighbour
with g + C (the noise is σ·C, the shift C: 1/σ in units of the noise). No certificate covers that
probability. Reading u₁ from one 53-bit word cut the noise at 8.57; the radius's expansion goes on
past a zero 64-bit word, 16 words deep, through the release's exact path.
"""

from __future__ import annotations

import math
from decimal import Decimal, getcontext

import numpy as np
import pytest
import torch
from scipy import stats

from fedprivacy.privacy.limits import EPSILON_MAX
from fedprivacy.privacy.planner import plan_client
from fedprivacy.training.noise import MAX_RADIUS, RADIUS_WORDS, grid, rounded_gaussian

LN2 = math.log(2)
TOP = 2**64 - 1
ZERO_RADIUS = -(2**63)  # the radius word whose U starts with a zero word (U's first word = word + 2⁶³)
SIGMA_C = 3.0  # σ' = σC/γ = 384


def exact_radius(words: list[int]) -> float:
    """sqrt(−2 ln u₁) for u₁ = 2⁻⁶⁴ᵏ·(w_k + ½)·2⁻⁶⁴, with k the leading zero words of `words` and
    w_k the next (the last one if all are zero), in 50-digit decimal arithmetic from the integers:
    −ln u₁ = (64(k + 1) + 1)·ln 2 − ln(2w_k + 1)."""
    getcontext().prec = 50
    k = next((i for i, w in enumerate(words) if w), len(words) - 1)
    minus_log = (64 * (k + 1) + 1) * Decimal(2).ln() - Decimal(2 * words[k] + 1).ln()
    return float((2 * minus_log).sqrt())


def released_radius(continuation: list[int], pairs: int = 1) -> np.ndarray:
    """The release of a zero sum for `pairs` pairs whose U starts with a zero word and whose angle
    word is 0 (θ ∈ [0, 2π·2⁻⁶⁴): the cosine coordinate is the radius), U's expansion continued by
    `continuation` (per level, shared by the pairs) and V's by zeros: R/σ', the radius to 1/(2σ')."""
    words = torch.tensor([[ZERO_RADIUS] * pairs + [0] * pairs])
    std = torch.tensor([SIGMA_C], dtype=torch.float64)
    asked: list[tuple[int, int]] = []

    def refine(pair: int, level: int) -> tuple[int, int]:
        asked.append((pair, level))
        return continuation[level], 0

    released = rounded_gaussian(torch.zeros(1, 2 * pairs), words, std, [refine])
    scale = SIGMA_C / float(grid(std))
    return released[0, :pairs].double().numpy() / float(grid(std)) / scale


def padded(words: list[int]) -> list[int]:
    return words + [TOP] * (RADIUS_WORDS - 1 - len(words))


CASES = [
    ("a zero word, then 2⁶³", padded([2**63])),
    ("five zero words, then 12345", padded([0, 0, 0, 0, 12345])),
    ("fifteen zero words, then 1", padded([0] * 14 + [1])),
    ("sixteen zero words: the deepest", [0] * (RADIUS_WORDS - 1)),
    ("a zero word, then 2⁶⁴ − 1", padded([TOP])),
]


@pytest.mark.parametrize(("case", "continuation"), CASES, ids=[c[0] for c in CASES])
def test_a_zero_radius_word_takes_its_radius_from_the_expansion_far_past_one_word(case, continuation):
    """U's first word 0, then 2⁶³, is u₁ ≈ 2⁻⁶⁵: r = sqrt(2·65·ln 2) ≈ 9.49, past what any single
    64-bit word gives (9.42) and far past the 53-bit cut (8.57); five zero words reach r ≈ 22.7,
    sixteen `MAX_RADIUS`. The release is σ'·r rounded: r to within 1/(2σ')."""
    radius = released_radius(continuation)[0]
    assert radius == pytest.approx(exact_radius([0, *continuation]), abs=1 / (2 * 384) + 1e-12)
    assert radius <= MAX_RADIUS + 1 / 384


def test_the_deepest_radius_is_max_radius_and_the_closed_form():
    assert pytest.approx(math.sqrt(2 * 1025 * LN2), rel=1e-15) == MAX_RADIUS
    assert RADIUS_WORDS == 16
    assert exact_radius([0] * RADIUS_WORDS) == pytest.approx(MAX_RADIUS, rel=1e-15)


def test_a_zero_words_continuation_is_the_gaussian_tail_at_each_depth():
    """Given u₁ < 2⁻⁶⁴ᵏ (k zero words), −ln u₁ − 64k·ln 2 is again Exp(1): the tail beyond each word
    is the Rayleigh tail, not a cut or an atom. Checked at depths 1 and 2 from the released values
    (each r to 1/(2σ'), so r²/2 to about 0.05), and the operating system's words of an unseeded run
    land beyond one word's reach."""
    generator = np.random.default_rng(5)
    for depth in (1, 2):
        excess = []
        for _ in range(300):
            continuation = [int(w) for w in generator.integers(0, 2**64, size=RADIUS_WORDS - 1, dtype=np.uint64)]
            continuation[: depth - 1] = [0] * (depth - 1)
            radius = released_radius(continuation)[0]
            excess.append(radius**2 / 2 - 64 * depth * LN2)
        assert min(excess) > -0.1
        assert stats.kstest(np.array(excess) + 0.0, "expon").pvalue > 1e-3, depth


def shortfall(max_radius: float, sigma: float, rate: float, steps: int, epsilon: float) -> tuple[float, float]:
    """ln of what a noise cut at `max_radius` (in units of σ) adds to δ, for a neighbour shift of 1/σ:

    - at least q·P(Z > r_max − 1/σ) (one step's outputs past the cut: impossible under one dataset);
    - at most T·(1 + e^ε)·P(R > r_max − 1/σ), R the Rayleigh radius: P(R > t) bounds P(|Z| > t),
      and, for 1/σ > 0.02, the 2⁻¹⁰²⁴ of radius mass the sampler lumps at r_max (its total variation
      from the true Gaussian's tail, which costs at most (1 + e^ε) of δ per step).
    """
    t = max_radius - 1.0 / sigma
    lower = math.log(rate) + float(stats.norm.logsf(t))
    upper = math.log(steps) + epsilon + math.log1p(math.exp(-epsilon)) - max(t, 0.0) ** 2 / 2
    return lower, upper


@pytest.mark.parametrize(
    ("schedule", "delta"),
    [({"sampling_rate": 1.0, "steps": 1}, 1e-5), ({}, 1e-5), ({"sampling_rate": 1.0, "steps": 1}, 1e-12)],
    ids=["one step q=1", "default schedule", "one step q=1, delta 1e-12"],
)
def test_the_cut_is_far_below_delta_at_the_largest_budget(schedule, delta):
    """ε = 100 (the largest accepted), calibrated: the smallest σ any plan gets (≈ 0.095 for one
    step at q = 1, a shift of 1/σ ≈ 10.6 noise units). The sampler's cut at `MAX_RADIUS` adds at
    most 10⁻¹² of δ there; the 53-bit sampler's cut (8.57) added close to 1."""
    plan = plan_client(5736, EPSILON_MAX, delta, rule="calibrated", compare=False, **schedule)
    assert plan.sigma < 0.25
    lower, upper = shortfall(MAX_RADIUS, plan.sigma, plan.sampling_rate, plan.steps, plan.epsilon)
    assert lower <= upper < math.log(1e-12 * delta), (plan.sigma, lower, upper)
