"""The noise and sampling stream: cryptographically keyed, sensitive to all of its seed material,
Gaussian, and a Poisson rate that never exceeds q."""

from __future__ import annotations

import math
import warnings
from itertools import combinations

import numpy as np
import pytest
from scipy import stats

from fedprivacy.training.rng import UNIFORM_BITS, SeededRunWarning, StepRandomness, sampling_threshold

pytestmark = pytest.mark.filterwarnings("ignore::fedprivacy.training.SeededRunWarning")


def noise(seed, step: int = 0, count: int = 64) -> np.ndarray:
    return StepRandomness(seed).for_step(step).gaussians(count)


def test_any_change_of_the_seed_material_changes_the_noise():
    """torch's CPU generator keeps 32 bits of a 64-bit seed; here every bit and byte counts."""
    seeds = [1, 1 + 2**32, 1 + 2**63, 1 + 2**64, 2**200 + 1, "1:a", "1:b", b"1:a\x00", b"\x01" * 32, b"\x01" * 31 + b"\x03"]
    draws = [noise(s) for s in seeds]
    for (a, da), (b, db) in combinations(zip(seeds, draws), 2):
        assert not np.any(da == db), (a, b)  # unrelated streams: not even one coordinate equal


def test_steps_have_their_own_noise_and_seeded_steps_replay_in_any_order():
    r = StepRandomness(7)
    later_first = r.for_step(5).gaussians(100)
    assert np.array_equal(StepRandomness(7).for_step(5).gaussians(100), later_first)
    assert not np.any(StepRandomness(7).for_step(4).gaussians(100) == later_first)


def test_unseeded_streams_come_from_the_os_and_never_repeat():
    with warnings.catch_warnings():
        warnings.simplefilter("error", SeededRunWarning)  # no warning without a seed
        r = StepRandomness()
    assert not r.seeded
    assert not np.any(r.for_step(0).gaussians(1000) == r.for_step(0).gaussians(1000))


def test_the_noise_is_standard_normal():
    draws = StepRandomness(11).for_step(0).gaussians(200_001)  # odd: the last Box–Muller pair is cut
    assert draws.shape == (200_001,)
    assert stats.kstest(draws, "norm").pvalue > 1e-3
    assert abs(draws.mean()) < 5 / math.sqrt(len(draws))
    assert abs(draws.std() - 1) < 5 / math.sqrt(2 * len(draws))


@pytest.mark.parametrize("q", [3e-7, 1e-3, 0.1, 1 / 3, 0.5, 1 - 1e-9, 1.0])
def test_the_sampling_rate_never_exceeds_q(q):
    rate = sampling_threshold(q) / 2**UNIFORM_BITS
    assert rate <= q and q - rate < 2**-UNIFORM_BITS


def test_a_float32_comparison_would_have_sampled_above_q():
    """The regression this rules out: float32 uniforms compared with q sample at ⌈q·2²⁴⌉/2²⁴."""
    q = 3e-7
    float32_rate = math.ceil(q * 2**24) / 2**24
    assert float32_rate / q > 1.19
    assert sampling_threshold(q) / 2**UNIFORM_BITS <= q


def test_poisson_sample_sizes_are_binomial():
    n, q, reps = 20_000, 0.02, 30
    r = StepRandomness(3)
    sizes = np.array([len(r.for_step(step).poisson_sample(n, q)) for step in range(reps)])
    trials = n * reps
    assert abs(sizes.sum() - q * trials) < 5 * math.sqrt(trials * q * (1 - q))
    assert len(set(sizes.tolist())) > 1
