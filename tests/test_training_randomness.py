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
from fedprivacy.training.noise import box_muller_bounds
from fedprivacy.training.rng import (
    UNIFORM_BITS,
    DrawRequest,
    SeededRunWarning,
    StepRandomness,
    draw_batch,
    sampling_threshold,
)

pytestmark = pytest.mark.filterwarnings("ignore::fedprivacy.training.SeededRunWarning")


def normals(words: torch.Tensor, count: int) -> np.ndarray:
    """The Box–Muller values at the cells of one step's noise words (`box_muller_bounds`)."""
    pairs = words.shape[-1] // 2
    cosine, sine, _ = box_muller_bounds(words[None, :pairs], words[None, pairs:])
    return torch.cat([cosine[0], sine[0]]).numpy()[:count]


def noise(seed, step: int = 0, count: int = 64) -> np.ndarray:
    return normals(StepRandomness(seed).draws(step, 1, 0, 0.5, count).noise[0], count)


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
        assert torch.equal(alone.noise[0], together.noise_words(step))
        assert torch.equal(alone.sample(step), together.sample(step))
    assert not torch.any(together.noise_words(3) == together.noise_words(4))


def test_unseeded_streams_come_from_the_os_and_never_repeat():
    with warnings.catch_warnings():
        warnings.simplefilter("error", SeededRunWarning)  # no warning without a seed
        r = StepRandomness()
    assert not r.seeded
    first, second = (r.draws(0, 1, 0, 0.5, 1000).noise[0] for _ in range(2))
    assert not torch.any(first == second)


def test_the_noise_is_standard_normal():
    draws = noise(11, count=200_001)  # odd: a pair is cut
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


def test_a_seeded_stream_read_in_consecutive_draws_equals_fresh_ciphers(monkeypatch):
    """A seeded stream keeps its cipher where a draw ended and continues it when the next draw
    starts there: the bytes must be those of a fresh cipher at each position (a new instance per
    draw here), whatever the order of the draws (consecutive, repeated, backwards, a jump, other
    widths, across nonces, the next nonce at the block where the last draw ended), and equal to
    the independent tensor ChaCha20 of `chacha`."""
    from fedprivacy.training.chacha import keystream_words

    monkeypatch.setattr(rng_module, "COUNTER_BLOCKS", 5 * 4)  # five steps of 25 words per nonce
    resumed = StepRandomness("9:resume")
    reads = [(0, 2), (2, 3), (5, 4), (9, 1), (3, 2), (5, 4), (40, 2), (42, 6), (0, 1), (1, 1)]
    for first, steps in reads:
        for width in (25, 25, 70):
            got = resumed.stream_words(first, steps, width)
            fresh = StepRandomness("9:resume").stream_words(first, steps, width)
            assert np.array_equal(got, fresh), (first, steps, width)
    # step 0 ends at block 4 of nonce 0, where step 6 starts in nonce 1: not the same stretch
    ends_there = StepRandomness("9:resume")
    ends_there.stream_words(0, 1, 25)
    assert np.array_equal(ends_there.stream_words(6, 1, 25), StepRandomness("9:resume").stream_words(6, 1, 25))
    blocks = -(-25 // 8)
    segments = resumed.segments(3, 9, blocks)
    assert len(segments) > 1  # the stretch crosses nonces
    independent = keystream_words(segments).numpy().view(np.uint64).reshape(9, blocks * 8)[:, :25]
    assert np.array_equal(resumed.stream_words(3, 9, 25), independent)


@pytest.mark.parametrize("threaded", [False, True])
def test_unseeded_clients_of_one_batch_read_disjoint_fresh_words(monkeypatch, threaded):
    """Unseeded clients side by side in one batch share one fresh key, each reading its own stretch:
    no two rows hold the same word, a seeded client between them still reads its own stream, and
    the next batch's words are fresh (on one thread, and dealt to threads in contiguous shares)."""
    if threaded:
        monkeypatch.setattr(rng_module, "PARALLEL_WORDS", 1)
        monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    seeded = StepRandomness("5:between")
    kinds = [None, None, seeded, None, None, None, None]
    requests = [DrawRequest(r or StepRandomness(), 0, 3, 40, 0.5) for r in kinds]
    _, words = draw_batch(requests, 64)
    again = draw_batch(requests, 64)[1]
    assert torch.equal(words[6:9], torch.from_numpy(seeded.stream_words(0, 3, 64 + 40)[:, :64].view(np.int64)))
    unseeded = torch.cat([words[:6], words[9:]])
    assert len(set(unseeded.flatten().tolist())) == unseeded.numel()  # 64-bit words: no repeats by chance
    assert not set(unseeded.flatten().tolist()) & set(torch.cat([again[:6], again[9:]]).flatten().tolist())


def box_muller_closed_form(words: np.ndarray) -> np.ndarray:
    """Box–Muller of raw keystream rows [m radius words, m angle words], in float64, written out
    independently of the library: u₁ = ((w + 2⁶³) mod 2⁶⁴ + ½)·2⁻⁶⁴ from the whole radius word,
    θ = 2π·s·2⁻⁶⁴ with s the angle word read as a signed integer."""
    pairs = words.shape[1] // 2
    radius_words, angle_words = words[:, :pairs], words[:, pairs : 2 * pairs]
    u1 = ((radius_words + np.uint64(2**63)).astype(np.float64) + 0.5) * 2.0**-64
    radius = np.sqrt(-2.0 * np.log(u1))
    signed = np.where(angle_words >= 2**63, angle_words.astype(np.float64) - 2.0**64, angle_words.astype(np.float64))
    angle = 2.0 * np.pi * signed * 2.0**-64
    return np.concatenate([radius * np.cos(angle), radius * np.sin(angle)], axis=1)


def test_a_round_of_draws_is_its_streams_words_compared_and_kept():
    """Independently of `draw_batch`'s buffers: record i of a step is kept iff the top 53 bits of
    its Poisson word are below ⌊q·2⁵³⌋, and the noise words are the step's first words, whole; their
    Box–Muller values (what the release rounds) are the closed form's within their stated bounds. The
    clients read the same blocks per step (one buffer, one comparison for all) with different n."""
    clients = [(StepRandomness(f"7:words-{i}"), 2 * i, 1 + i % 3, 150 - i % 4, 0.03 * (i + 1)) for i in range(8)]
    requests = [DrawRequest(r, first, steps, n, q) for r, first, steps, n, q in clients]
    count = 30
    keep, noise_words = draw_batch(requests, count)
    row = 0
    for randomness, first, steps, n, q in clients:
        words = randomness.stream_words(first, steps, count + n)
        poisson = words[:, count:] >> np.uint64(64 - UNIFORM_BITS)  # the top 53 bits
        assert np.array_equal(keep[row : row + steps, :n].numpy(), poisson < sampling_threshold(q))
        assert not keep[row : row + steps, n:].any()
        assert np.array_equal(noise_words[row : row + steps].numpy().view(np.uint64), words[:, :count])
        for step in range(steps):
            pairs = count // 2
            cosine, sine, bound = box_muller_bounds(
                noise_words[row + step : row + step + 1, :pairs], noise_words[row + step : row + step + 1, pairs:]
            )
            got = torch.cat([cosine, sine], 1)[0].numpy()
            expected = box_muller_closed_form(words[step : step + 1, :count])[0]
            assert (np.abs(got - expected) <= torch.cat([bound[0], bound[0]]).numpy()).all()
            np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
        row += steps
    assert row == keep.shape[0]


def test_draws_held_at_once_never_share_their_words():
    """A batch's words are views of the thread's kept buffer: a draw made while an earlier one is
    still held gets its own buffer (two unseeded draws are never the same words, and a held draw
    does not change), and once nothing refers to it the kept buffer serves the next draw."""
    first = draw_batch([DrawRequest(StepRandomness(), 0, 2, 10, 0.5)], 100)[1]
    held = first.clone()
    second = draw_batch([DrawRequest(StepRandomness(), 0, 2, 10, 0.5)], 100)[1]
    assert torch.equal(first, held) and not torch.equal(first, second)
    kept = first.data_ptr()
    assert second.data_ptr() != kept
    del first, second
    assert draw_batch([DrawRequest(StepRandomness(), 0, 2, 10, 0.5)], 100)[1].data_ptr() == kept


def test_the_radius_is_rayleigh_from_its_whole_words():
    """The noise's radius sqrt(z₁² + z₂²) of a pair is Rayleigh."""
    count = 200_000
    draws = noise(13, count=count)
    radius = np.hypot(draws[: count // 2], draws[count // 2 :])
    assert stats.kstest(radius, "rayleigh").pvalue > 1e-3
    assert stats.kstest(radius**2 / 2, "expon").pvalue > 1e-3


def test_chacha20_as_tensor_operations_is_the_cryptography_packages_keystream():
    """`chacha.keystream_words` against `cryptography`'s ChaCha20 for the same key, nonce and
    block: segments at the counter's ends, every bit of the nonce set, a zero key."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    from fedprivacy.training.chacha import keystream_words

    generator = np.random.default_rng(8)
    segments = [
        (generator.bytes(32), 12_345_678_901_234, 7, 5),
        (generator.bytes(32), 2**64 - 1, 2**32 - 3, 3),
        (bytes(32), 0, 0, 2),
        (generator.bytes(32), 2**63, 1000, 64),
    ]
    expected = []
    for key, nonce, first, blocks in segments:
        value = first.to_bytes(4, "little") + nonce.to_bytes(8, "little") + bytes(4)
        stream = Cipher(algorithms.ChaCha20(key, value), mode=None).encryptor().update(bytes(64 * blocks))
        expected.append(np.frombuffer(stream, dtype="<u8").view(np.int64).reshape(blocks, 8))
    assert np.array_equal(keystream_words(segments).numpy(), np.concatenate(expected))
    with pytest.raises(ValueError, match="2³² blocks"):
        keystream_words([(bytes(32), 0, 2**32 - 1, 2)])


@pytest.mark.parametrize("width", [33, 32])
def test_a_round_drawn_by_tensor_operations_is_the_cpus_round_bit_for_bit(width, monkeypatch, compute_device):
    """The draws a GPU makes for itself (`draw_batch` with a device: the keystream, the Poisson
    comparison and the noise words as tensor operations; on the CPU here, and on the GPU when one
    is visible) equal the `cryptography` path's, seeded clients of several sizes and steps, with a
    nonce per step (a tiny counter range)."""
    monkeypatch.setattr(rng_module, "COUNTER_BLOCKS", 16)
    clients = [(StepRandomness(f"7:device-{i}"), 3 * i, 1 + i % 3, 40 + 17 * i, 0.05 * (i + 1)) for i in range(6)]
    requests = [DrawRequest(r, first, steps, n, q) for r, first, steps, n, q in clients]
    keep, words = draw_batch(requests, width)
    keep_on, words_on = draw_batch(requests, width, device=compute_device)
    assert keep_on.device.type == words_on.device.type == compute_device.type
    assert torch.equal(keep, keep_on.cpu()) and torch.equal(words, words_on.cpu())
