"""The release on a finite computer: every output a record makes possible is possible without it.

A float32 sum plus float32 noise reaches a set of values that depends on the sum (Mironov 2012),
so outputs seen with a record can be impossible without it. The release is now γ·⌊s/γ + σ'Z⌉ with
Z a real Gaussian (`fedprivacy.training.noise`): these tests check (1) that the float64 path
decides a rounding only where interval arithmetic over the words' whole cell decides the same,
(2) that the released integers follow the rounded Gaussian, and (3) reachable sets over the
released float32 bit patterns, 10⁶ outputs per case in both directions, for the cases where the
float32 mechanism leaked: the reference below (float32 noise added to the float32 sum) fails them.
"""

from __future__ import annotations

import math
import warnings

import mpmath
import numpy as np
import pytest
import torch
from scipy import stats

from fedprivacy.training import noise, stack
from fedprivacy.training.noise import (
    CELL_BOUND,
    HIGH_RADIUS_WORD,
    LOW_RADIUS_WORD,
    MAX_RADIUS,
    box_muller,
    box_muller_bounds,
    exact_pair_rounding,
    grid,
    noise_ahead,
    rounded_gaussian,
)
from fedprivacy.training.rng import DrawRequest, StepRandomness, draw_batch

pytestmark = pytest.mark.filterwarnings("ignore::fedprivacy.training.SeededRunWarning")

EXTREME_RADIUS = [-(2**63) + k for k in (1, 2, 4095, 4096, 4097, 2**20, 2**40)] + [-1, 0, 1, 2**62, 2**63 - 1]
EXTREME_ANGLE = [0, 1, -1, 2**62, -(2**62), 2**62 + 1, -(2**63), 2**63 - 1, 2**61, 3 * 2**61]


def random_words(generator: np.random.Generator, pairs: int) -> torch.Tensor:
    """[1, 2·pairs] random words, the first ones' radius and angle words set to edge cases."""
    words = generator.integers(-(2**63), 2**63, size=(1, 2 * pairs), dtype=np.int64)
    for k, radius in enumerate(EXTREME_RADIUS):
        for j, angle in enumerate(EXTREME_ANGLE):
            words[0, k * len(EXTREME_ANGLE) + j] = radius
            words[0, pairs + k * len(EXTREME_ANGLE) + j] = angle
    return torch.from_numpy(words)


@pytest.mark.parametrize("cell_bound", [CELL_BOUND, 0.05], ids=["tiers as shipped", "most rows to tier 2"])
def test_the_float_bounds_hold_over_each_cell_and_decide_only_what_intervals_decide(cell_bound, monkeypatch):
    """For every pair of words (random, and U near 0 and 1, θ at the axes): the interval-arithmetic
    image of the words' cell under Box–Muller lies within z ± bound, and wherever the float64 path
    rounds a coordinate, the exact rounding over the whole cell (mpmath.iv) is the same integer;
    with tier 1's bound made coarse (so that nearly every row goes on to tier 2) as well."""
    monkeypatch.setattr(noise, "CELL_BOUND", cell_bound)
    generator = np.random.default_rng(3)
    pairs = 1500
    words = random_words(generator, pairs)
    cosine, sine, bound = box_muller_bounds(words[:, :pairs], words[:, pairs:])
    mpmath.iv.prec = 200
    unit = mpmath.iv.mpf(2) ** -64
    for pair in range(pairs):
        radius_word, angle_word = int(words[0, pair]) + 2**63, int(words[0, pairs + pair])
        if radius_word == 0 or not math.isfinite(float(bound[0, pair])):
            continue
        u = mpmath.iv.mpf([radius_word, radius_word + 1]) * unit
        radius = mpmath.iv.sqrt(-2 * mpmath.iv.log(u))
        angle = 2 * mpmath.iv.pi * mpmath.iv.mpf([angle_word, angle_word + 1]) * unit
        for value, image in ((cosine, radius * mpmath.iv.cos(angle)), (sine, radius * mpmath.iv.sin(angle))):
            z, b = float(value[0, pair]), float(bound[0, pair])
            assert z - b <= image.a and image.b <= z + b, (pair, z, b, image)
    mpmath.iv.prec = 53

    sums = torch.from_numpy(generator.normal(scale=50.0, size=(1, 2 * pairs)).astype(np.float32))
    noise_std = torch.tensor([2.7], dtype=torch.float64)
    refined: list[tuple[int, int]] = []

    def refine(pair: int, level: int) -> tuple[int, int]:
        refined.append((pair, level))
        return (pair * 7919 + level) % 2**64, (pair * 104729 + level) % 2**64

    released = rounded_gaussian(sums, words, noise_std, [refine])
    gamma, scale = float(grid(noise_std)), 2.7 / float(grid(noise_std))
    assert refined, "the edge cases (U within 2⁻⁵² of 0) take the exact path"
    refined_pairs = {pair for pair, _ in refined}
    for pair in range(pairs):
        if pair in refined_pairs:
            continue
        columns = (pair, pairs + pair)
        scaled = [float(sums[0, c]) / gamma for c in columns]
        whole = [round(v) for v in scaled]
        exact = exact_pair_rounding(
            int(words[0, pair]) + 2**63,
            int(words[0, pairs + pair]),
            [(trig, v - w) for trig, (v, w) in enumerate(zip(scaled, whole, strict=True))],
            scale,
            lambda level: pytest.fail("a cell the float path decided needs no refinement"),
        )
        for c, w, k in zip(columns, whole, exact, strict=True):
            assert float(released[0, c]) == (w + k) * gamma


def cell_words() -> tuple[torch.Tensor, torch.Tensor]:
    """Radius words across tier 1's range (its ends, u = ½, dense near both ends, random), and
    angle words (random, the axes)."""
    generator = np.random.default_rng(11)
    ends = [LOW_RADIUS_WORD + k for k in (0, 1, 2, 2**20, 2**40)] + [HIGH_RADIUS_WORD - k for k in (1, 2, 2**20, 2**40)]
    ends += [-1, 0, 1, -(2**62), 2**62]
    near = [LOW_RADIUS_WORD + int(k) for k in generator.integers(0, 2**46, 2000)]
    near += [HIGH_RADIUS_WORD - 1 - int(k) for k in generator.integers(0, 2**46, 2000)]
    middle = generator.integers(LOW_RADIUS_WORD, HIGH_RADIUS_WORD, 20_000).tolist()
    radius = torch.tensor(ends + near + middle, dtype=torch.int64)
    angle = torch.from_numpy(generator.integers(-(2**63), 2**63, len(radius), dtype=np.int64))
    angle[: len(EXTREME_ANGLE)] = torch.tensor(EXTREME_ANGLE)
    return radius, angle


def test_one_bound_covers_every_cell_in_tier_ones_range():
    """`CELL_BOUND` (tier 1's one bound) is at least the bound of each cell's own (`box_muller_bounds`,
    checked against intervals above) for radius words in [LOW_RADIUS_WORD, HIGH_RADIUS_WORD), and
    the interval image of such cells (ends and a sample) lies within `box_muller`'s value ± it."""
    radius, angle = cell_words()
    _, _, bound = box_muller_bounds(radius, angle)
    assert float(bound.max()) <= CELL_BOUND * 0.8, float(bound.max())  # the argument's 1.8·10⁻¹⁰
    values = box_muller(radius, angle)
    mpmath.iv.prec = 200
    unit = mpmath.iv.mpf(2) ** -64
    try:
        for k in [*range(14), *range(14, len(radius), 97)]:
            word = int(radius[k]) + 2**63
            u = mpmath.iv.mpf([word, word + 1]) * unit
            r = mpmath.iv.sqrt(-2 * mpmath.iv.log(u))
            theta = 2 * mpmath.iv.pi * mpmath.iv.mpf([int(angle[k]), int(angle[k]) + 1]) * unit
            for z, image in (
                (values[k], r * mpmath.iv.cos(theta)),
                (values[len(radius) + k], r * mpmath.iv.sin(theta)),
            ):
                assert float(z) - CELL_BOUND <= image.a and image.b <= float(z) + CELL_BOUND, (k, float(z), image)
    finally:
        mpmath.iv.prec = 53


@pytest.mark.parametrize("word", [LOW_RADIUS_WORD - 1, HIGH_RADIUS_WORD, -(2**63), 2**63 - 1, LOW_RADIUS_WORD - 2**40])
def test_a_block_with_one_word_outside_tier_ones_range_is_looked_at(word):
    """A radius word outside [LOW_RADIUS_WORD, HIGH_RADIUS_WORD) anywhere in a block sets the
    block's flag (its pairs then go to tier 2 by their words), whatever the others are."""
    generator = np.random.default_rng(12)
    radius = torch.from_numpy(generator.integers(LOW_RADIUS_WORD, HIGH_RADIUS_WORD, (3, 500), dtype=np.int64))
    radius[1, 137] = word
    squared = torch.empty(radius.shape, dtype=torch.float64)
    assert noise._outside_possible(noise._squared_into(radius, squared))


def test_the_released_integers_follow_the_rounded_gaussian():
    """10⁶ releases of one sum s: R = released/γ − ⌊s/γ⌉ has P(R = k) = Φ((k + ½ − f)/σ') −
    Φ((k − ½ − f)/σ'), f = s/γ − ⌊s/γ⌉ (χ² over bins of eight integers)."""
    count, noise_std = 1_000_000, torch.tensor([1.9], dtype=torch.float64)
    gamma, scale = float(grid(noise_std)), 1.9 / float(grid(noise_std))
    total = 123.456
    words = StepRandomness("release-fit").draws(0, 1, 0, 0.5, count).noise
    sums = torch.full((1, count), total, dtype=torch.float32)
    released = rounded_gaussian(sums, words, noise_std, [StepRandomness("release-fit").refiner(0)])
    scaled = float(sums[0, 0]) / gamma
    fraction = scaled - round(scaled)
    offsets = (released[0].double().numpy() / gamma - round(scaled)).round().astype(np.int64)
    low, high = -int(5 * scale), int(5 * scale)
    edges = np.arange(low, high + 9, 8)
    observed, _ = np.histogram(offsets, bins=edges - 0.5)
    cdf = stats.norm.cdf((edges - 0.5 - fraction) / scale)
    expected = np.diff(cdf) * count
    outside = count - observed.sum()
    expected_outside = count * (cdf[0] + 1 - cdf[-1])
    chi2 = stats.chisquare(
        np.append(observed, outside),
        np.append(expected, expected_outside) * count / (expected.sum() + expected_outside),
    )
    assert chi2.pvalue > 1e-3, chi2
    assert abs(offsets.mean() - fraction) < 5 * scale / math.sqrt(count)  # E[⌊f + σ'Z⌉] = f, to 10⁻⁸ here


# ----- reachable sets over the released float32 bit patterns -----


def release_rows(sums: torch.Tensor, sigma_c: list[float], expected: list[float], seed: str) -> torch.Tensor:
    """The production release (`stack.release`) of clipped sums [K, P] for K clients drawn together
    from their own seeded streams, as the trainer (K = 1) and the fast engine (K = n) call it."""
    rows, width = sums.shape
    streams = [StepRandomness(f"{seed}:{k}") for k in range(rows)]
    _, words = draw_batch([DrawRequest(stream, 0, 1, 0, 0.5) for stream in streams], width)
    step = stack.StepInputs(
        None,
        None,
        None,
        words,
        stack.noise_scale(torch.tensor(sigma_c, dtype=torch.float64), 1.0),
        None,
        torch.tensor(expected, dtype=torch.float32),
        torch.ones(rows, dtype=torch.bool),
        [stream.refiner(0) for stream in streams],
    )
    return stack.release([sums], step)


def producible_rounded(
    outputs: torch.Tensor, sums: torch.Tensor, sigma_c: list[float], expected: list[float]
) -> torch.Tensor:
    """Whether each released float32 value could come from the clipped sums `sums` under the
    rounded Gaussian: some integer R within σ'·MAX_RADIUS (+½) of s/γ, the sampler's whole range,
    gives exactly that bit pattern through the release's own arithmetic (float32 γR, then / qN)."""
    noise_std = stack.noise_scale(torch.tensor(sigma_c, dtype=torch.float64), 1.0)
    gamma = grid(noise_std).unsqueeze(1)
    scale = noise_std.unsqueeze(1) / gamma
    divisor = torch.tensor(expected, dtype=torch.float32).unsqueeze(1)
    centre = torch.round(outputs.double() * divisor.double() / gamma)
    found = torch.zeros(outputs.shape, dtype=torch.bool)
    for shift in range(-3, 4):
        candidate = centre + shift
        value = (candidate * gamma).to(torch.float32) / divisor
        in_range = (candidate - sums.double() / gamma).abs() <= scale * MAX_RADIUS + 0.5
        found |= (value.view(torch.int32) == outputs.view(torch.int32)) & in_range
    return found


def release_float32(sums: torch.Tensor, sigma_c: float, expected: float, seed: int) -> torch.Tensor:
    """The reference the construction replaces: float32 Gaussian noise added to the float32 sum."""
    normals = torch.randn(sums.shape, generator=torch.Generator().manual_seed(seed))
    return (sums + torch.tensor(sigma_c, dtype=torch.float32) * normals) / torch.tensor(expected, dtype=torch.float32)


def producible_float32(outputs: torch.Tensor, sums: torch.Tensor, sigma_c: float, expected: float) -> torch.Tensor:
    """Whether some float32 normal z (|z| ≤ `MAX_RADIUS`) gives exactly each output from `sums`
    through the reference's arithmetic. The map z → output is monotone, so a bisection over the
    float32 values in their order finds the least z whose output is not below the target; the
    output is producible iff that z gives it exactly."""
    std, divisor = torch.tensor(sigma_c, dtype=torch.float32), torch.tensor(expected, dtype=torch.float32)

    def output(key: torch.Tensor) -> torch.Tensor:  # key: the float32 values in their order, as int64
        bits = torch.where(key >= 0, key, (-key) | 0x80000000).to(torch.int32)
        return (sums + std * bits.view(torch.float32)) / divisor

    def key_of(value: float) -> int:
        bits = int(torch.tensor(value, dtype=torch.float32).view(torch.int32))
        return bits if bits >= 0 else -(bits & 0x7FFFFFFF)

    low = torch.full(outputs.shape, key_of(-MAX_RADIUS), dtype=torch.int64)
    high = torch.full(outputs.shape, key_of(MAX_RADIUS), dtype=torch.int64)
    while bool((low < high).any()):  # invariant: the least z with output ≥ target lies in [low, high]
        middle = (low + high) // 2
        below = output(middle) < outputs
        low, high = torch.where(below, middle + 1, low), torch.where(below, high, middle)
    return output(low).view(torch.int32) == outputs.view(torch.int32)


# (σC, qN, the sum with the record, the sum without it): the cases where float32 noise leaked
CASES = {
    "trainer: sigma 3.738, qN 1, a coordinate only the record reaches": (3.738, 1.0, 0.83, 0.0),
    "trainer: sigma 2.497, qN 100, among the others' records": (2.497, 100.0, 37.31 + 0.91, 37.31),
}


@pytest.mark.parametrize("case", list(CASES))
def test_no_output_seen_with_the_record_is_impossible_without_it(case):
    """10⁶ released coordinates drawn under s (with the record), each producible under s' (without
    it), and the same the other way. The float32 reference fails the same check at qN = 1 (any
    float32 normal allowed: at qN = 100 its holes came from the old sampler's own sparse values)."""
    sigma_c, expected, with_record, without = CASES[case]
    count = 1_000_000
    for drawn, other, seed in ((with_record, without, "a"), (without, with_record, "b")):
        sums = torch.full((1, count), drawn, dtype=torch.float32)
        outputs = release_rows(sums, [sigma_c], [expected], f"{case}:{seed}")
        assert bool(producible_rounded(outputs, sums, [sigma_c], [expected]).all())  # the check's own sanity
        assert bool(producible_rounded(outputs, torch.full_like(sums, other), [sigma_c], [expected]).all())
    if expected == 1.0:  # the float32 reference, each direction: what the construction closes
        impossible = []
        for drawn, other in ((with_record, without), (without, with_record)):
            reference = release_float32(torch.full((count,), drawn), sigma_c, expected, seed=1)
            producible = producible_float32(reference, torch.full((count,), other), sigma_c, expected)
            impossible.append(float((~producible).double().mean()))
        assert min(impossible) > 0.03 and max(impossible) > 0.15, impossible  # measured: 0.046 and 0.205


def test_a_record_spread_over_a_hundred_coordinates_by_a_crafted_model_is_never_told_apart():
    """The server crafts the model so that a record's clipped gradient spreads over 100 coordinates
    (C/10 each) that no other record reaches: 10⁴ releases of 100 coordinates under each sum, every
    vector producible under the other (each coordinate is: the pair (U, V) maps onto the plane, so
    coordinates jointly producible one by one are producible together). With float32 noise nearly
    every vector holds an impossible coordinate."""
    sigma_c, expected, count = 3.738, 1.0, 10_000
    record = torch.full((count, 100), 0.1)
    for drawn, other, seed in ((record, torch.zeros_like(record), "a"), (torch.zeros_like(record), record, "b")):
        outputs = release_rows(drawn.reshape(1, -1), [sigma_c], [expected], f"crafted:{seed}").reshape(count, 100)
        assert bool(producible_rounded(outputs.reshape(1, -1), other.reshape(1, -1), [sigma_c], [expected]).all())
    reference = release_float32(record, sigma_c, expected, seed=2)
    told_apart = ~producible_float32(reference, torch.zeros_like(record), sigma_c, expected).all(dim=1)
    assert float(told_apart.double().mean()) > 0.9


def test_the_fast_engines_clients_released_together_are_never_told_apart():
    """64 clients released in one call as the fast engine does (each its own σC, qN and stream):
    15,625 coordinates each, 10⁶ in all, every one producible without the record and back."""
    generator = np.random.default_rng(9)
    clients, width = 64, 15_625
    sigma_c = generator.uniform(0.5, 6.0, clients).tolist()
    expected = generator.uniform(1.0, 200.0, clients).round().tolist()
    others = torch.from_numpy(generator.normal(scale=20.0, size=(clients, 1)).astype(np.float32)).expand(clients, width)
    record = torch.from_numpy(generator.uniform(-1.0, 1.0, size=(clients, 1)).astype(np.float32))
    with_record = (others + record).contiguous()
    for drawn, other, seed in ((with_record, others, "a"), (others.contiguous(), with_record, "b")):
        outputs = release_rows(drawn, sigma_c, expected, f"engine:{seed}")
        assert bool(producible_rounded(outputs, other, sigma_c, expected).all())


@pytest.mark.parametrize("cell_bound", [CELL_BOUND, 0.05], ids=["tiers as shipped", "most rows to tier 2"])
def test_the_trainers_path_and_the_engines_release_the_same_bits(cell_bound, monkeypatch):
    """The trainer makes a round's Box–Muller ahead (`noise_ahead`) and rounds in NumPy on a CPU; the
    engine makes it block by block in torch: the same release, bit for bit, edge-case words (the
    exact path) included, and a row with σC = 0 left as its sums."""
    monkeypatch.setattr(noise, "CELL_BOUND", cell_bound)
    generator = np.random.default_rng(4)
    pairs, rows = 700, 3
    words = torch.cat([random_words(generator, pairs) for _ in range(rows)])
    sums = torch.from_numpy(generator.normal(scale=30.0, size=(rows, 2 * pairs - 1)).astype(np.float32))
    noise_std = torch.tensor([2.7, 0.0, 0.4], dtype=torch.float64)
    refiners = [StepRandomness(f"paths:{k}").refiner(3) for k in range(rows)]
    ahead = rounded_gaussian(sums, words, noise_std, refiners, noise_ahead(words, noise_std))
    blockwise = rounded_gaussian(sums, words, noise_std, refiners)
    assert torch.equal(ahead, blockwise)
    assert torch.equal(ahead[1], sums[1]) and not torch.equal(ahead[0], sums[0])
    assert torch.equal(
        ahead[0],
        rounded_gaussian(sums[:1], words[:1], noise_std[:1], refiners, noise_ahead(words, noise_std).row(0))[0],
    )


@pytest.mark.parametrize("bad", [math.nan, -1.0, math.inf, 2.0**-70])
def test_a_noise_scale_that_is_not_zero_or_a_usable_positive_value_is_refused(bad):
    """σC = NaN or negative would read as "no noise" and release the sums as they are; a σC too small
    for its grid (γ would underflow) is refused too, by both paths, naming the field."""
    words = torch.zeros((2, 8), dtype=torch.int64)
    noise_std = torch.tensor([1.0, bad], dtype=torch.float64)
    with pytest.raises(ValueError, match="noise_std"):
        rounded_gaussian(torch.ones(2, 8), words, noise_std, [None, None])
    with pytest.raises(ValueError, match="noise_std"):
        noise_ahead(words, noise_std)


def test_a_non_finite_sum_stays_so_without_a_warning():
    """An infinite or NaN clipped sum is released as it is (the update is dropped downstream), on
    both paths and without NumPy's invalid-value warnings."""
    sums = torch.tensor([[math.inf, -math.inf, math.nan, 1.0]])
    words = torch.from_numpy(np.random.default_rng(5).integers(-(2**63), 2**63, (1, 4), dtype=np.int64))
    noise_std = torch.tensor([2.0], dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for ahead in (None, noise_ahead(words, noise_std)):
            released = rounded_gaussian(sums, words, noise_std, [None], ahead)
            assert torch.equal(released[0, :2], sums[0, :2]) and bool(torch.isnan(released[0, 2]))
            assert bool(torch.isfinite(released[0, 3]))


def test_the_release_is_the_same_bits_on_every_device(compute_device):
    """Given the same sums and words, the release on the device (its own log, cos and sin) is the
    CPU's bit for bit: every rounding is exact, so the device's float64 errors cannot show."""
    generator = np.random.default_rng(6)
    pairs = 4000
    words = torch.cat([random_words(generator, pairs) for _ in range(2)])
    sums = torch.from_numpy(generator.normal(scale=30.0, size=(2, 2 * pairs)).astype(np.float32))
    noise_std = torch.tensor([2.7, 0.9], dtype=torch.float64)
    refiners = [StepRandomness(f"devices:{k}").refiner(0) for k in range(2)]
    on_cpu = rounded_gaussian(sums, words, noise_std, refiners)
    moved = [t.to(compute_device) for t in (sums, words, noise_std)]
    on_device = rounded_gaussian(*moved, refiners)
    ahead = rounded_gaussian(*moved, refiners, noise_ahead(moved[1], moved[2]))
    assert on_device.device.type == compute_device.type
    assert torch.equal(on_device.cpu(), on_cpu) and torch.equal(ahead.cpu(), on_cpu)
