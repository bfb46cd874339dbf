"""The Gaussian noise's tail: exact far below any δ the planner accepts.

A sampler whose |z| never exceeds r_max makes every output beyond g + σ·r_max impossible under a
dataset with gradient sum g and possible, with probability P(Z > r_max − 1/σ), under a neighbour
with g + C (the noise is σ·C, the shift C: 1/σ in units of the noise). No certificate covers that
probability. Reading u₁ from one 53-bit word cut the noise at 8.57; the radius now continues its
binary expansion past a zero 64-bit word, 16 words deep.
"""

from __future__ import annotations

import math
from decimal import Decimal, getcontext

import numpy as np
import pytest
from scipy import stats

from fedprivacy.privacy.limits import EPSILON_MAX
from fedprivacy.privacy.planner import plan_client
from fedprivacy.training import rng as rng_module
from fedprivacy.training.rng import MAX_RADIUS, RADIUS_WORDS, box_muller, radius_from_words

pytestmark = pytest.mark.filterwarnings("ignore::fedprivacy.training.SeededRunWarning")

LN2 = math.log(2)
TOP = 2**64 - 1


def exact_radius(words: list[int]) -> float:
    """sqrt(−2 ln u₁) for u₁ = 2⁻⁶⁴ᵏ·(w_k + ½)·2⁻⁶⁴, with k the leading zero words of `words` and
    w_k the next (the last one if all are zero), in 50-digit decimal arithmetic from the integers:
    −ln u₁ = (64(k + 1) + 1)·ln 2 − ln(2w_k + 1)."""
    getcontext().prec = 50
    k = next((i for i, w in enumerate(words) if w), len(words) - 1)
    minus_log = (64 * (k + 1) + 1) * Decimal(2).ln() - Decimal(2 * words[k] + 1).ln()
    return float((2 * minus_log).sqrt())


def feeding(continuations: list[list[int]]):
    """An extension stream: each zero word's `RADIUS_WORDS` − 1 continuation words, in order."""
    flat = [w for row in continuations for w in row]

    def extension(count: int) -> np.ndarray:
        assert count == len(flat), "one request: RADIUS_WORDS − 1 words per zero word"
        return np.array(flat, dtype=np.uint64)

    return extension


def padded(words: list[int]) -> list[int]:
    return words + [TOP] * (RADIUS_WORDS - 1 - len(words))


CASES = [
    ("the smallest nonzero word", [1], None),
    ("a zero word, then 2⁶³", [0], padded([2**63])),
    ("five zero words, then 12345", [0], padded([0, 0, 0, 0, 12345])),
    ("fifteen zero words, then 1", [0], padded([0] * 14 + [1])),
    ("sixteen zero words: the deepest", [0], [0] * (RADIUS_WORDS - 1)),
    ("a zero word, then 2⁶⁴ − 1", [0], padded([TOP])),
    ("the largest word", [TOP], None),
]


@pytest.mark.parametrize(("case", "word", "continuation"), CASES, ids=[c[0] for c in CASES])
def test_injected_words_give_the_exact_radius_far_past_one_word(case, word, continuation):
    """Radius word 0 then 2⁶³ is u₁ ≈ 2⁻⁶⁵: r = sqrt(2·65·ln 2) ≈ 9.49, past what any single 64-bit
    word gives (9.42) and far past the 53-bit cut (8.57); five zero words reach r ≈ 22.7, sixteen
    `MAX_RADIUS`. The extension is asked for nothing when no word is 0."""

    def refuse(count: int) -> np.ndarray:
        raise AssertionError(f"asked for {count} continuation words without a zero word")

    extension = refuse if continuation is None else feeding([continuation])
    radius = radius_from_words(np.array(word, dtype=np.uint64), extension)
    expected = exact_radius(word + (continuation or []))
    assert radius.shape == (1,) and np.isfinite(radius).all()
    assert radius[0] == pytest.approx(
        expected, rel=1e-13, abs=1e-9
    )  # abs: the largest word's radius, 2⁻³², rounds to 0
    assert radius[0] <= MAX_RADIUS * (1 + 1e-15)


def test_the_deepest_radius_is_max_radius_and_the_closed_form():
    assert pytest.approx(math.sqrt(2 * 1025 * LN2), rel=1e-15) == MAX_RADIUS
    assert RADIUS_WORDS == 16
    deepest = radius_from_words(np.zeros(1, dtype=np.uint64), feeding([[0] * (RADIUS_WORDS - 1)]))
    assert deepest[0] == pytest.approx(MAX_RADIUS, rel=1e-15)
    assert exact_radius([0] * RADIUS_WORDS) == pytest.approx(MAX_RADIUS, rel=1e-15)


def test_zero_words_among_others_take_their_own_continuations_through_box_muller(monkeypatch):
    """Through `box_muller` (the draws' own path, its default extension replaced): zero radius words
    in a chunk take their continuations in order, the others keep their closed form, and the noise
    is r·(cos θ, sin θ) with θ = 0 for angle word 0."""
    words = np.array(
        [[0, 5, 0, 0, 0, 0], [7, 0, 2**63, 0, 0, 0]], dtype=np.uint64
    )  # rows: 3 radius words, 3 angle words
    continuations = [padded([2**63]), padded([0, 0, 0, 0, 12345]), padded([1])]
    monkeypatch.setattr(rng_module, "_fresh_words", feeding(continuations))
    noise = box_muller(words, np.float64)
    expected_radius = [
        [exact_radius([0, 2**63]), exact_radius([5]), exact_radius([0, 0, 0, 0, 0, 12345])],
        [exact_radius([7]), exact_radius([0, 1]), exact_radius([2**63])],
    ]
    np.testing.assert_allclose(noise[:, :3], expected_radius, rtol=1e-13)
    np.testing.assert_array_equal(noise[:, 3:], 0.0)
    assert noise[0, 0] > 9.49 and noise[0, 2] > 22.6


def test_a_zero_words_continuation_is_the_gaussian_tail_at_each_depth():
    """Given u₁ < 2⁻⁶⁴ᵏ (k zero words), −ln u₁ − 64k·ln 2 is again Exp(1): the tail beyond each word
    is the Rayleigh tail, not a cut or an atom. Checked at depths 1 and 2 with a seeded extension,
    and the default (the operating system's words) lands beyond one word's reach."""
    generator = np.random.default_rng(5)
    count = 20_000

    def random_words(n: int) -> np.ndarray:
        return generator.integers(0, 2**64, size=n, dtype=np.uint64, endpoint=False)

    def one_more_zero(n: int) -> np.ndarray:
        words = random_words(n).reshape(-1, RADIUS_WORDS - 1)
        words[:, 0] = 0
        return words.reshape(-1)

    for depth, extension in ((1, random_words), (2, one_more_zero)):
        radius = radius_from_words(np.zeros(count, dtype=np.uint64), extension)
        excess = radius**2 / 2 - 64 * depth * LN2
        assert excess.min() > 0
        assert stats.kstest(excess, "expon").pvalue > 1e-3, depth
    fresh = radius_from_words(np.zeros(1000, dtype=np.uint64))
    assert (fresh > math.sqrt(2 * 64 * LN2)).all() and (fresh <= MAX_RADIUS).all() and len(set(fresh.tolist())) > 990


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
