"""Randomness for DP steps: a ChaCha20 keystream per step (the `cryptography` package), turned
into the Poisson sample and the Gaussian noise (docs/training.md, "Randomness", says why each
choice).

- Production (no seed): a fresh 256-bit key from `os.urandom` for every batch of steps drawn
  together: nothing to recover, nothing to replay. Experiments (a seed): a key derived by BLAKE2b
  from the whole seed material; step t reads its own stretch, so any split into rounds replays.
- Each step's 64-bit words: m radius words, m angle words (m pairs of Gaussians), then one word
  per record. Record i is kept iff the top 53 bits of its word are below ⌊q·2⁵³⌋ (the rate never
  exceeds q). Box–Muller (Box & Muller 1958): radius in float64 from u₁ = (w + ½)·2⁻⁶⁴, a zero word
  continuing u₁'s binary expansion with fresh OS words up to `RADIUS_WORDS` deep, so the tail is
  exact to 2⁻¹⁰²⁵ (|z| ≤ `MAX_RADIUS`; a cut tail is a δ no certificate holds); the angle in the
  parameters' dtype.
- Draws are made on the CPU for many steps at once, in chunks spread over torch's threads (same
  bits either way), and copied to the model's device. Floating-point samplers keep known side
  channels (Mironov 2012): SECURITY.md.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from torch import Tensor

UNIFORM_BITS = 53  # Poisson words: their top 53 bits
RADIUS_BITS = 64  # radius words: all of their bits
RADIUS_WORDS = 16  # a radius's expansion stops after this many words (the keystream's, then 15 more)
MAX_RADIUS = math.sqrt(2 * (RADIUS_BITS * RADIUS_WORDS + 1) * math.log(2))  # −ln u₁ ≤ 1025·ln 2: 37.70
COUNTER_BLOCKS = 1 << 32  # ChaCha20 blocks one nonce addresses (its 32-bit block counter)
NOISE_CHUNK = 1 << 22  # random words drawn per pass at most (32 MiB)
TRANSFORM_CHUNK = 1 << 17  # words per pass of the Gaussian transform (1 MiB: its temporaries stay in cache)
PARALLEL_WORDS = 1 << 20  # words from which the transform spreads over torch's threads
SCRATCH_KEPT = 1 << 28  # bytes of keystream buffer a thread keeps between draws (256 MiB)


class SeededRunWarning(UserWarning):
    """A run whose noise is reproducible from its seed: fine for experiments, never for release."""


def seed_key(seed: int | bytes | str) -> bytes:
    """The 256-bit ChaCha20 key of a seed: BLAKE2b over all of its material (no truncation)."""
    material = seed if isinstance(seed, bytes) else str(seed).encode()
    return hashlib.blake2b(material, digest_size=32, person=b"fedprivacy-key").digest()


def sampling_threshold(q: float) -> int:
    """⌊q·2⁵³⌋: a 53-bit uniform below it has probability ≤ q (exact integer arithmetic)."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"sampling rate q={q} outside [0, 1]")
    return math.floor(q * (1 << UNIFORM_BITS))  # q·2⁵³ is exact in binary floating point


def uniform53(words: np.ndarray) -> np.ndarray:
    """64-bit words (uint64, any view) reduced to their top 53 bits, in place: the Poisson uniforms."""
    words >>= np.uint64(64 - UNIFORM_BITS)
    return words


def radius_from_words(words: np.ndarray, extension: Callable[[int], np.ndarray] | None = None) -> np.ndarray:
    """Box–Muller radii sqrt(−2 ln u₁) (float64, the shape of `words`) of 64-bit radius words (uint64).

    A word w ≥ 1 gives u₁ = (w + ½)·2⁻⁶⁴. A zero word's u₁ continues its binary expansion with
    `RADIUS_WORDS` − 1 further words: `extension(count)` gives `count` uint64 words for all the
    zero words at once, `RADIUS_WORDS` − 1 each in their C order (default: `os.urandom`). After k
    leading zero words and a word w_k, −ln u₁ = 64k·ln 2 − ln((w_k + ½)·2⁻⁶⁴), at most 1025·ln 2
    (all 16 words zero): radii up to `MAX_RADIUS` (see the module docstring).
    """
    radius = _midpoints(words)
    deep = radius.size > 0 and radius.min() < 2.0**-RADIUS_BITS  # only a zero word's midpoint, 2⁻⁶⁵, is below
    np.log(radius, out=radius)
    np.multiply(radius, -2.0, out=radius)
    if deep:
        _continue_zero_words(words, radius, extension or _fresh_words)
    np.sqrt(radius, out=radius)
    return radius


def _midpoints(words: np.ndarray) -> np.ndarray:
    """(w + ½)·2⁻⁶⁴ in float64 for uint64 words w. numpy converts a uint64 with its top bit set
    about 12× slower than an int64 (a branch per element that the random top bit mispredicts), so
    the words are read as int64 s and s·2⁻⁶⁴ + 2⁻⁶⁵ < 0 (w ≥ 2⁶³) is moved up by 1: exact up to
    float64's rounding, relative 2⁻⁵³, everywhere."""
    u = np.empty(words.shape, dtype=np.float64)
    np.copyto(u, words.view(np.int64), casting="unsafe")
    np.multiply(u, 2.0**-RADIUS_BITS, out=u)
    np.add(u, 2.0 ** -(RADIUS_BITS + 1), out=u)
    np.add(u, u < 0.0, out=u)
    return u


def _fresh_words(count: int) -> np.ndarray:
    """`count` uint64 words from the operating system's CSPRNG: zero radius words' continuations."""
    return np.frombuffer(os.urandom(8 * count), dtype="<u8").astype(np.uint64)


def _continue_zero_words(words: np.ndarray, squared: np.ndarray, extension: Callable[[int], np.ndarray]) -> None:
    """−2 ln u₁ into `squared` wherever a radius word is 0, from its continuation words."""
    where = np.nonzero(words == 0)
    count = len(where[0])
    more = np.asarray(extension(count * (RADIUS_WORDS - 1)), dtype=np.uint64).reshape(count, RADIUS_WORDS - 1)
    nonzero = more != 0
    # the word that ends each expansion: its first nonzero one, or its last one if all are zero
    last = np.where(nonzero.any(axis=1), nonzero.argmax(axis=1), RADIUS_WORDS - 2)
    zero_words = last + 1  # leading zero words, the keystream's included
    minus_log = zero_words * (RADIUS_BITS * math.log(2)) - np.log(_midpoints(more[np.arange(count), last]))
    squared[where] = 2.0 * minus_log


def box_muller(words: np.ndarray, dtype: type = np.float64, threads: int = 1) -> np.ndarray:
    """Standard normals from keystream rows [rows, 2m] of m radius words then m angle words (uint64,
    all 64 bits): a row of 2m words gives 2m draws.

    z = sqrt(−2 ln u₁)·(cos θ, sin θ) (Box & Muller 1958). The radius is `radius_from_words`:
    u₁ ∈ (0, 1] (no log(0)), its binary expansion continued past a zero word, so that the radius
    follows the Rayleigh tail down to 2⁻¹⁰²⁴ instead of stopping at 8.57 (53-bit words) or 9.42
    (64-bit words): a cut makes the outputs beyond it impossible under one neighbour and possible
    under the other, which no certified δ covers (the module docstring gives the numbers). The
    radius is always in float64; the angle θ = 2π·s·2⁻⁶⁴, s the angle word as a signed integer,
    in `dtype` (float32 trig is ten times faster, and float32 noise keeps no more digits anyway).
    numpy on contiguous halves: torch's float64 log on strided views was 100× slower here.

    Rows go in chunks of about `TRANSFORM_CHUNK` words (at least one row), so that the temporaries
    stay in cache and are reused rather than fresh pages (3.5 M words: 23 → 14 ms on 2 cores), and,
    with `threads` > 1 and at least `PARALLEL_WORDS` words, the chunks are spread over that many
    threads (numpy's ufuncs release the GIL: 14 → 8 ms). Every element goes through the same
    operations either way, so the draws do not depend on the chunking (a test checks the bits);
    the one exception is a zero radius word, whose continuation is fresh from `os.urandom`.
    """
    pairs = words.shape[1] // 2
    out = np.empty((words.shape[0], 2 * pairs), dtype=dtype)
    rows = max(1, TRANSFORM_CHUNK // max(words.shape[1], 1))
    chunks = [slice(start, start + rows) for start in range(0, words.shape[0], rows)]

    def transform(part: list[slice]) -> None:
        for chunk in part:
            _box_muller_into(words[chunk], out[chunk], dtype)

    if threads > 1 and len(chunks) > 1 and words.size >= PARALLEL_WORDS:
        helpers, others = _transform_helpers(os.getpid(), threads - 1), []
        for k in range(1, threads):
            try:
                others.append(helpers.submit(transform, chunks[k::threads]))
            except RuntimeError:  # the interpreter is shutting down and starts no threads: this one does it
                transform(chunks[k::threads])
        transform(chunks[0::threads])
        for other in others:
            other.result()
    else:
        transform(chunks)
    return out


def _box_muller_into(words: np.ndarray, out: np.ndarray, dtype: type) -> None:
    pairs = words.shape[1] // 2
    radius = radius_from_words(words[:, :pairs])
    angle = words[:, pairs : 2 * pairs].view(np.int64).astype(dtype)  # s ∈ [−2⁶³, 2⁶³)
    angle *= dtype(2.0 * math.pi * 2.0**-64)  # θ = 2π·s·2⁻⁶⁴ ∈ [−π, π)
    np.cos(angle, out=out[:, :pairs])
    np.sin(angle, out=out[:, pairs:])
    out[:, :pairs] *= radius
    out[:, pairs:] *= radius


@lru_cache(maxsize=1)
def _transform_helpers(pid: int, count: int) -> ThreadPoolExecutor:
    """The process's helper threads for `box_muller` (keyed by pid: a forked child inherits its
    parent's executor, not its threads)."""
    return ThreadPoolExecutor(max_workers=count, thread_name_prefix="noise-transform")


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


class _Scratch(threading.local):
    """Buffers a thread reuses from one draw to the next. A batched round draws tens of MB of
    keystream, and a fresh buffer each round is fresh pages from the kernel whose first writes
    (page faults) cost time on a VM (a 1,000-client MLP round's draws: 19–20 → 18–19 ms; a
    1,000-client CNN round's, 101 MB, 87 → 42 ms on 2 cores once 256 MiB were kept instead of 64).
    Buffers up to `SCRATCH_KEPT` bytes are kept; a larger draw (10,000 CNN clients) gets one of its
    own, so that a run's peak memory does not grow by it."""

    def __init__(self) -> None:
        self.words = bytearray()
        self.zeros = b""

    def buffer(self, size: int) -> memoryview:
        """`size` bytes for the caller to overwrite: the thread's kept buffer, or a fresh one."""
        return self._kept("words", size, bytearray)

    def plaintext(self, size: int) -> memoryview:
        """`size` zero bytes: ChaCha20 over zeros is its keystream."""
        return self._kept("zeros", size, bytes)

    def _kept(self, name: str, size: int, make: Callable[[int], bytes | bytearray]) -> memoryview:
        """The first `size` bytes of the kept buffer `name`, grown with `make` when too short; past
        `SCRATCH_KEPT`, a buffer of the draw's own."""
        if size > SCRATCH_KEPT:
            return memoryview(make(size))
        if len(getattr(self, name)) < size:
            setattr(self, name, make(size))
        return memoryview(getattr(self, name))[:size]


_scratch = _Scratch()


def _keystream_into(key: bytes, nonce: int, block: int, out: memoryview) -> None:
    """Fill `out` with ChaCha20 under `key` and a 64-bit `nonce`, from 64-byte block `block` on
    (`cryptography` takes the 32-bit block counter and a 96-bit nonce as one 16-byte value)."""
    value = int(block).to_bytes(4, "little") + int(nonce).to_bytes(8, "little") + bytes(4)
    Cipher(algorithms.ChaCha20(key, value), mode=None).encryptor().update_into(_scratch.plaintext(len(out)), out)


@dataclass(frozen=True)
class StepDraws:
    """The Poisson samples and noise of consecutive steps, ready for the trainer."""

    first_step: int
    keep: Tensor  # bool [steps, n]: record i is in step t's batch
    noise: Tensor  # [steps, noise_count] standard normals, on the device, in the requested dtype

    def sample(self, step: int) -> Tensor:
        """Indices of the records in step `step`'s batch (on the device of `keep`)."""
        return torch.nonzero(self.keep[step - self.first_step]).flatten()

    def normals(self, step: int) -> Tensor:
        return self.noise[step - self.first_step]


@dataclass(frozen=True)
class DrawRequest:
    """`steps` consecutive steps of one client, from `first_step`: n records sampled at rate q."""

    randomness: StepRandomness
    first_step: int
    steps: int
    n: int
    q: float


def draw_batch(
    requests: Sequence[DrawRequest], noise_count: int, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """Samples and noise for many clients' steps in one vectorised pass (a trainer's round, or a
    whole round of a batched engine): (keep [rows, max n] bool, noise [rows, noise_count]), one
    row per step, requests in order. Each row is exactly what its client's own stream gives."""
    pairs, float_type = (noise_count + 1) // 2, _NUMPY_DTYPES.get(dtype, np.float64)
    widths = {_blocks(2 * pairs + r.n) for r in requests}
    most = max((r.n for r in requests), default=0)
    thresholds = {q: np.uint64(sampling_threshold(q)) for q in {r.q for r in requests}}
    if len(widths) == 1:  # the usual round: every client's steps fill one buffer, no copies
        words = _filled_rows(requests, widths.pop())
        noise = box_muller(words[:, : 2 * pairs], float_type, torch.get_num_threads())
        # every row has `most` Poisson words (a shorter client's last ones are its padding): one comparison
        steps = [r.steps for r in requests]
        keep = (
            uniform53(words[:, 2 * pairs : 2 * pairs + most])
            < np.repeat([thresholds[r.q] for r in requests], steps)[:, None]
        )
        if any(r.n < most for r in requests):
            keep &= np.arange(most) < np.repeat([r.n for r in requests], steps)[:, None]
        return torch.from_numpy(keep), torch.from_numpy(noise[:, :noise_count]).to(dtype)
    streams = [r.randomness.stream_words(r.first_step, r.steps, 2 * pairs + r.n) for r in requests]
    noise = box_muller(np.concatenate([s[:, : 2 * pairs] for s in streams]), float_type, torch.get_num_threads())
    keep = np.zeros((noise.shape[0], most), dtype=bool)
    row = 0
    for r, words in zip(requests, streams, strict=True):
        np.less(
            uniform53(words[:, 2 * pairs : 2 * pairs + r.n]),
            thresholds[r.q],
            out=keep[row : row + r.steps, : r.n],
        )
        row += r.steps
    return torch.from_numpy(keep), torch.from_numpy(noise[:, :noise_count]).to(dtype)


def _blocks(width: int) -> int:
    """64-byte ChaCha20 blocks a step of `width` words reads (its words, then padding)."""
    return -(-width // 8)


def _filled_rows(requests: Sequence[DrawRequest], blocks: int) -> np.ndarray:
    """[rows, 8·blocks] keystream words (uint64): each request's steps in order, written straight
    into one buffer (the thread's kept one, if it fits: the result is valid until the thread's
    next draw). From `PARALLEL_WORDS` words on, the requests are dealt to torch's threads (the
    transform's helpers), each writing its requests' own stretches: `cryptography` lets go of the
    GIL while it encrypts (a 1,000-client CNN round's keystream: 17.9 → 12.5 ms on 2 cores)."""
    view = _scratch.buffer(sum(r.steps for r in requests) * blocks * 64)
    ends = np.cumsum([r.steps * blocks * 64 for r in requests]).tolist()
    starts = [0, *ends[:-1]]

    def fill(part: range) -> None:
        for i in part:
            r = requests[i]
            r.randomness.fill_steps(r.first_step, r.steps, blocks, view[starts[i] : ends[i]])

    threads = torch.get_num_threads()
    if threads > 1 and len(requests) > 1 and len(view) >= 8 * PARALLEL_WORDS:
        parts = [range(k, len(requests), threads) for k in range(threads)]
        helpers = _transform_helpers(os.getpid(), threads - 1)
        others = [helpers.submit(fill, part) for part in parts[1:]]
        fill(parts[0])
        for other in others:
            other.result()
    else:
        fill(range(len(requests)))
    return np.frombuffer(view, dtype="<u8").reshape(-1, blocks * 8)


class StepRandomness:
    """Each DP step's random stream: a fresh OS key by default, the seed's key with a seed."""

    def __init__(self, seed: int | bytes | str | None = None) -> None:
        self.seed = seed
        self._key = None if seed is None else seed_key(seed)
        if seed is not None:
            warnings.warn(
                "a noise seed makes DP noise and sampling reproducible from the seed; "
                "seeded runs are for experiments, not production",
                SeededRunWarning,
                stacklevel=3,
            )

    @property
    def seeded(self) -> bool:
        return self._key is not None

    def stream_words(self, first_step: int, steps: int, width: int) -> np.ndarray:
        """[steps, width] keystream words (uint64, all 64 bits), one row per step: its radius
        words, its angle words, then its Poisson words (see the module docstring)."""
        blocks = _blocks(width)
        buffer = bytearray(steps * blocks * 64)
        self.fill_steps(first_step, steps, blocks, memoryview(buffer))
        return np.frombuffer(buffer, dtype="<u8").reshape(steps, blocks * 8)[:, :width]

    def fill_steps(self, first_step: int, steps: int, blocks: int, out: memoryview) -> None:
        """The raw keystream of `steps` steps of `blocks` blocks each, into `out` (steps·blocks·64 bytes).

        Seeded: step t's bytes start at keystream block t·blocks (nonce and 32-bit block counter
        split the position), so any split of the steps into calls gives the same bytes, and a
        client's round needs one cipher, not one per step. Unseeded: one keystream under a fresh
        OS key for the whole call.
        """
        if self._key is None:
            _keystream_into(os.urandom(32), 0, 0, out)
            return
        per_nonce = max(1, COUNTER_BLOCKS // blocks)  # steps whose blocks fit one 32-bit counter
        step, end, start = first_step, first_step + steps, 0
        while step < end:
            nonce, offset = divmod(step, per_nonce)
            count = min(end, (nonce + 1) * per_nonce) - step
            _keystream_into(self._key, nonce, offset * blocks, out[start : start + count * blocks * 64])
            start += count * blocks * 64
            step += count

    def draws(
        self,
        first_step: int,
        steps: int,
        n: int,
        q: float,
        noise_count: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> StepDraws:
        """Poisson samples of n records at rate ≤ q and `noise_count` Gaussians for each of `steps`
        consecutive steps, from each step's own stream."""
        keep, noise = draw_batch([DrawRequest(self, first_step, steps, n, q)], noise_count, dtype)
        return StepDraws(first_step, keep.to(device), noise.to(device))

    @staticmethod
    def chunk_steps(n: int, noise_count: int) -> int:
        """How many steps to draw per pass, keeping a pass under NOISE_CHUNK words per step sum."""
        return max(1, NOISE_CHUNK // max(n + noise_count, 1))
