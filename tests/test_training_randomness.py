"""The noise and sampling stream: cryptographically keyed, sensitive to all of its seed material,
Gaussian, and a Poisson rate that never exceeds q."""

from __future__ import annotations

import math
import warnings
from itertools import combinations

import numpy as np
import pytest
import torch
from scipy import stats

from fedprivacy.training import rng as rng_module
from fedprivacy.training.rng import (
    UNIFORM_BITS,
    DrawRequest,
    SeededRunWarning,
    StepRandomness,
    draw_batch,
    sampling_threshold,
)

pytestmark = pytest.mark.filterwarnings("ignore::fedprivacy.training.SeededRunWarning")


def noise(seed, step: int = 0, count: int = 64) -> np.ndarray:
    return StepRandomness(seed).draws(step, 1, 0, 0.5, count, dtype=torch.float64).noise[0].numpy()


def test_any_change_of_the_seed_material_changes_the_noise():
    """torch's CPU generator keeps 32 bits of a 64-bit seed; here every bit and byte counts."""
    seeds = [
        1,
        1 + 2**32,
        1 + 2**63,
        1 + 2**64,
        2**200 + 1,
        "1:a",
        "1:b",
        b"1:a\x00",
        b"\x01" * 32,
        b"\x01" * 31 + b"\x03",
    ]
    draws = [noise(s) for s in seeds]
    for (a, da), (b, db) in combinations(zip(seeds, draws), 2):
        assert not np.any(da == db), (a, b)  # unrelated streams: not even one coordinate equal


def test_steps_have_their_own_draws_and_seeded_steps_replay_in_any_split():
    together = StepRandomness(7).draws(3, 4, 50, 0.3, 100)  # steps 3, 4, 5, 6 in one pass
    for step in range(3, 7):
        alone = StepRandomness(7).draws(step, 1, 50, 0.3, 100)
        assert torch.equal(alone.noise[0], together.normals(step))
        assert torch.equal(alone.sample(step), together.sample(step))
    assert not torch.any(together.normals(3) == together.normals(4))


def test_unseeded_streams_come_from_the_os_and_never_repeat():
    with warnings.catch_warnings():
        warnings.simplefilter("error", SeededRunWarning)  # no warning without a seed
        r = StepRandomness()
    assert not r.seeded
    first, second = (r.draws(0, 1, 0, 0.5, 1000).noise[0] for _ in range(2))
    assert not torch.any(first == second)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_noise_is_standard_normal(dtype):
    draws = StepRandomness(11).draws(0, 1, 0, 0.5, 200_001, dtype=dtype).noise[0].double().numpy()  # odd: a pair is cut
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
    draws = StepRandomness(3).draws(0, reps, n, q, 10)
    sizes = np.array([len(draws.sample(step)) for step in range(reps)])
    trials = n * reps
    assert abs(sizes.sum() - q * trials) < 5 * math.sqrt(trials * q * (1 - q))
    assert len(set(sizes.tolist())) > 1


def test_many_clients_drawn_together_get_exactly_their_own_streams():
    """A batched engine draws a round for many clients at once; each must see what it alone would."""
    clients = [(StepRandomness(f"7:client-{i}"), 3 * i, 1 + i % 3, 40 + 17 * i, 0.05 * (i + 1)) for i in range(5)]
    keep, noise = draw_batch([DrawRequest(r, first, steps, n, q) for r, first, steps, n, q in clients], 33)
    row = 0
    for randomness, first, steps, n, q in clients:
        alone = randomness.draws(first, steps, n, q, 33)
        assert torch.equal(keep[row : row + steps, :n], alone.keep) and not keep[row : row + steps, n:].any()
        assert torch.equal(noise[row : row + steps], alone.noise)
        row += steps
    assert row == keep.shape[0] == noise.shape[0]


def test_clients_of_one_width_drawn_into_one_buffer_get_exactly_their_own_streams():
    """Clients whose steps read the same number of blocks (the usual round) share one buffer; some
    take no step this round. Each must still see what it alone would, seeded or not."""
    clients = [
        (StepRandomness(f"7:same-{i}" if i % 4 else None), 5 * i, i % 3, 160 - i % 5, 0.02 * (i + 1)) for i in range(9)
    ]
    keep, noise = draw_batch([DrawRequest(r, first, steps, n, q) for r, first, steps, n, q in clients], 32)
    row = 0
    for randomness, first, steps, n, q in clients:
        if randomness.seeded:
            alone = randomness.draws(first, steps, n, q, 32)
            assert torch.equal(keep[row : row + steps, :n], alone.keep) and torch.equal(
                noise[row : row + steps], alone.noise
            )
        assert not keep[row : row + steps, n:].any()
        row += steps
    assert row == keep.shape[0] == noise.shape[0] == sum(steps for _, _, steps, _, _ in clients)


def test_steps_that_span_several_nonces_read_the_same_bytes_in_any_split(monkeypatch):
    """A step's bytes start at block t·⌈size/64⌉; past 2³² blocks the nonce moves on. With a tiny
    counter range (three steps per nonce here) every split must still give every step the same bytes."""
    monkeypatch.setattr(rng_module, "COUNTER_BLOCKS", 3 * 4)  # 4 blocks per step of 25 words
    randomness = StepRandomness(11)
    together = randomness.stream_words(2, 9, 25)
    alone = np.concatenate([randomness.stream_words(step, 1, 25) for step in range(2, 11)])
    assert together.shape == (9, 25) and np.array_equal(together, alone)
    assert len({row.tobytes() for row in together}) == 9


def box_muller_closed_form(words: np.ndarray) -> np.ndarray:
    """Box–Muller of raw keystream rows [m radius words, m angle words], in float64, written out
    independently of rng.py: u₁ = (w + ½)·2⁻⁶⁴ from the whole radius word (no word is 0 in these
    streams: probability 2⁻⁶⁴ each), θ = 2π·s·2⁻⁶⁴ with s the angle word read as a signed integer."""
    pairs = words.shape[1] // 2
    radius_words, angle_words = words[:, :pairs], words[:, pairs : 2 * pairs]
    assert radius_words.all()
    u1 = (radius_words.astype(np.float64) + 0.5) * 2.0**-64
    radius = np.sqrt(-2.0 * np.log(u1))
    signed = np.where(angle_words >= 2**63, angle_words.astype(np.float64) - 2.0**64, angle_words.astype(np.float64))
    angle = 2.0 * np.pi * signed * 2.0**-64
    return np.concatenate([radius * np.cos(angle), radius * np.sin(angle)], axis=1)


def test_a_round_of_draws_is_its_streams_words_compared_and_transformed(monkeypatch):
    """Independently of `draw_batch`'s buffers: record i of a step is kept iff the top 53 bits of
    its Poisson word are below ⌊q·2⁵³⌋, and the noise is Box–Muller of the step's whole 64-bit noise
    words (computed here in float64); the transform gives the same bits however its rows are
    chunked and spread over threads. The clients read the same blocks per step (one buffer, one
    comparison for all) with different n."""
    clients = [(StepRandomness(f"7:words-{i}"), 2 * i, 1 + i % 3, 150 - i % 4, 0.03 * (i + 1)) for i in range(8)]
    requests = [DrawRequest(r, first, steps, n, q) for r, first, steps, n, q in clients]
    count = 30
    keep, noise = draw_batch(requests, count)
    monkeypatch.setattr(rng_module, "TRANSFORM_CHUNK", 64)  # two rows per chunk, nine chunks
    monkeypatch.setattr(rng_module, "PARALLEL_WORDS", 0)
    chunked = rng_module.box_muller(StepRandomness("7:words-x").stream_words(0, 17, count), np.float32, threads=3)
    plain = rng_module.box_muller(StepRandomness("7:words-x").stream_words(0, 17, count), np.float32, threads=1)
    assert np.array_equal(chunked, plain)
    _, noise_in_threads = draw_batch(requests, count)
    assert torch.equal(noise_in_threads, noise)
    row = 0
    for randomness, first, steps, n, q in clients:
        words = randomness.stream_words(first, steps, count + n)
        poisson = words[:, count:] >> np.uint64(64 - UNIFORM_BITS)  # the top 53 bits
        assert np.array_equal(keep[row : row + steps, :n].numpy(), poisson < sampling_threshold(q))
        assert not keep[row : row + steps, n:].any()
        expected = box_muller_closed_form(words[:, :count])
        np.testing.assert_allclose(noise[row : row + steps].numpy(), expected, rtol=1e-5, atol=1e-5)
        row += steps
    assert row == keep.shape[0]
    _, noise64 = draw_batch(requests[:1], count, dtype=torch.float64)  # float64 noise: radius and angle in float64
    randomness, first, steps, n, _ = clients[0]
    expected = box_muller_closed_form(randomness.stream_words(first, steps, count + n)[:, :count])
    np.testing.assert_allclose(noise64.numpy(), expected, rtol=1e-12, atol=1e-12)


def test_the_radius_is_rayleigh_from_its_whole_words():
    """The noise's radius sqrt(z₁² + z₂²) of a pair is Rayleigh, and it is the radius of the pair's
    whole 64-bit radius word (`radius_from_words`, float64), to rounding."""
    count = 200_000
    draws = StepRandomness(13).draws(0, 1, 0, 0.5, count, dtype=torch.float64).noise[0].numpy()
    radius = np.hypot(draws[: count // 2], draws[count // 2 :])
    assert stats.kstest(radius, "rayleigh").pvalue > 1e-3
    assert stats.kstest(radius**2 / 2, "expon").pvalue > 1e-3
    words = StepRandomness(13).stream_words(0, 1, count)[0, : count // 2]
    np.testing.assert_allclose(radius, rng_module.radius_from_words(words), rtol=1e-13)


def test_draws_larger_than_the_kept_buffer_are_the_same_draws(monkeypatch):
    """A thread keeps its keystream buffer between draws up to a size; a larger draw gets a buffer
    of its own, and a kept buffer reused by the next draw gives that draw its own bytes."""
    requests = [DrawRequest(StepRandomness(f"7:kept-{i}"), i, 2, 60, 0.2) for i in range(4)]
    kept = [draw_batch(requests, 16), draw_batch(requests[:2], 16)]
    # two clients' draw (two steps of ten 64-byte blocks each) fits, four clients' does not
    monkeypatch.setattr(rng_module, "SCRATCH_KEPT", 2 * 2 * 640)
    monkeypatch.setattr(rng_module._scratch, "words", bytearray())  # this thread keeps nothing yet
    fresh = [draw_batch(requests, 16), draw_batch(requests[:2], 16)]
    assert len(rng_module._scratch.words) == 2 * 2 * 640  # only the draw that fits was kept
    for (keep_a, noise_a), (keep_b, noise_b) in zip(kept, fresh, strict=True):
        assert torch.equal(keep_a, keep_b) and torch.equal(noise_a, noise_b)
    assert torch.equal(kept[1][1], kept[0][1][:4])  # the first two clients' rows, redrawn


def test_a_round_filled_by_several_threads_is_the_round_filled_by_one(monkeypatch):
    """The keystream of a large round is written by the transform's helper threads, each client
    into its own stretch of the buffer: the words are those one thread writes, client by client,
    and each client's are its own stream's, seeded or not (unseeded: only checked to differ)."""
    monkeypatch.setattr(rng_module, "PARALLEL_WORDS", 1 << 10)  # parallel from 8 KiB of keystream
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    requests = [DrawRequest(StepRandomness(f"7:threads-{i}" if i % 5 else None), 3 * i, 2, 40, 0.1) for i in range(11)]
    blocks = rng_module._blocks(2 * 64 + 40)
    together = rng_module._filled_rows(requests, blocks).copy()
    assert together.nbytes >= 8 * rng_module.PARALLEL_WORDS  # the threaded path
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    alone = rng_module._filled_rows(requests, blocks).copy()
    for i, request in enumerate(requests):
        rows = slice(2 * i, 2 * i + 2)
        if request.randomness.seeded:
            assert np.array_equal(together[rows], alone[rows])
            assert np.array_equal(together[rows], request.randomness.stream_words(3 * i, 2, blocks * 8))
        else:
            assert not np.array_equal(together[rows], alone[rows])
