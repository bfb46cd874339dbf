"""Randomness for DP steps: a ChaCha20 keystream per step (the `cryptography` package), turned
into the Poisson sample and the words of the noise (docs/training.md, "Randomness", says why each
choice).

- Production (no seed): a fresh 256-bit key from `os.urandom` for every batch of steps drawn
  together (one key for the unseeded clients of a batched round, each reading its own stretch):
  nothing to recover, nothing to replay. Experiments (a seed): a key derived by BLAKE2b
  from the whole seed material; step t reads its own stretch, so any split into rounds replays.
- Each step's 64-bit words: m radius words, m angle words (m pairs of coordinates of noise, turned
  into the released values by `fedprivacy.training.noise`), then one word per record. Record i is
  kept iff the top 53 bits of its word are below ⌊q·2⁵³⌋ (the rate never exceeds q).
- The rare noise coordinates that need more random bits than their words (`StepRandomness.refiner`)
  take them from BLAKE2b of the seed's key and their position, or from `os.urandom` without a seed.
- Draws are made for many steps at once: on a CPU by `cryptography`, the keystream spread over
  torch's threads; for a model on a GPU there, by `chacha` (the same bits).
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from torch import Tensor

from fedprivacy.training.chacha import keystream_words
from fedprivacy.training.noise import Refiner

UNIFORM_BITS = 53  # Poisson words: their top 53 bits
COUNTER_BLOCKS = 1 << 32  # ChaCha20 blocks one nonce addresses (its 32-bit block counter)
NOISE_CHUNK = 1 << 22  # random words drawn per pass at most (32 MiB)
PARALLEL_WORDS = 1 << 20  # words from which the keystream is spread over torch's threads
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


@lru_cache(maxsize=1)
def _helpers(pid: int, count: int) -> ThreadPoolExecutor:
    """The process's helper threads for the keystream (keyed by pid: a forked child inherits its
    parent's executor, not its threads)."""
    return ThreadPoolExecutor(max_workers=count, thread_name_prefix="keystream")


class _Scratch(threading.local):
    """Buffers a thread reuses from one draw to the next. A batched round draws tens of MB of
    keystream, and a fresh buffer each round is fresh pages from the kernel whose first writes
    (page faults) cost time on a VM (a 1,000-client MLP round's draws: 19–20 → 18–19 ms; a
    1,000-client CNN round's, 101 MB, 87 → 42 ms on 2 cores once 256 MiB were kept instead of 64).
    Buffers up to `SCRATCH_KEPT` bytes are kept; a larger draw (10,000 CNN clients) gets one of its
    own, so that a run's peak memory does not grow by it. The words are handed out as views of the
    buffer: while anything still refers to the last ones, a draw gets a fresh buffer instead."""

    def __init__(self) -> None:
        self.words = bytearray()
        self.zeros = b""

    def buffer(self, size: int) -> memoryview:
        """`size` bytes for the caller to overwrite and keep: the thread's kept buffer if nothing
        refers to what it last held (a view of it holds a reference to it), else a fresh one."""
        if sys.getrefcount(self.words) > 2:  # the attribute and the call's argument: no view left
            return memoryview(bytearray(size))
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


def _keystream_cipher(key: bytes, nonce: int, block: int) -> Any:
    """ChaCha20 under `key` and a 64-bit `nonce`, positioned at 64-byte block `block` (`cryptography`
    takes the 32-bit block counter and a 96-bit nonce as one 16-byte value)."""
    value = int(block).to_bytes(4, "little") + int(nonce).to_bytes(8, "little") + bytes(4)
    return Cipher(algorithms.ChaCha20(key, value), mode=None).encryptor()


def _keystream_into(key: bytes, nonce: int, block: int, out: memoryview) -> None:
    """Fill `out` with the keystream under `key` and `nonce` from block `block` on."""
    _keystream_cipher(key, nonce, block).update_into(_scratch.plaintext(len(out)), out)


def noise_width(noise_count: int) -> int:
    """Noise words per step for `noise_count` coordinates: a radius and an angle word per pair."""
    return 2 * ((noise_count + 1) // 2)


@dataclass(frozen=True)
class StepDraws:
    """The Poisson samples and noise words of consecutive steps, ready for the trainer."""

    first_step: int
    keep: Tensor  # bool [steps, n]: record i is in step t's batch
    noise: Tensor  # [steps, noise_width] int64 views of the noise's keystream words, on the device

    def sample(self, step: int) -> Tensor:
        """Indices of the records in step `step`'s batch (on the device of `keep`)."""
        return torch.nonzero(self.keep[step - self.first_step]).flatten()

    def noise_words(self, step: int) -> Tensor:
        return self.noise[step - self.first_step]


@dataclass(frozen=True)
class DrawRequest:
    """`steps` consecutive steps of one client, from `first_step`: n records sampled at rate q."""

    randomness: StepRandomness
    first_step: int
    steps: int
    n: int
    q: float


def keystream_device(device: torch.device | str) -> torch.device | None:
    """Where a model on `device` has its keystream made: on a GPU there (`chacha`), else by
    `cryptography` on the CPU (None), the faster of the two there."""
    device = torch.device(device)
    return None if device.type == "cpu" else device


def draw_batch(
    requests: Sequence[DrawRequest], noise_count: int, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor]:
    """Samples and noise words for many clients' steps in one vectorised pass (a trainer's round,
    or a whole round of a batched engine): (keep [rows, max n] bool, words [rows, noise_width]
    int64), one row per step, requests in order. Each row is exactly what its client's own stream
    gives, made by `cryptography` on the CPU or, with a `device`, by tensor operations there (the
    same bits)."""
    if device is not None:
        return _draw_batch_on(requests, noise_count, torch.device(device))
    width = noise_width(noise_count)
    widths = {_blocks(width + r.n) for r in requests}
    most = max((r.n for r in requests), default=0)
    thresholds = {q: np.uint64(sampling_threshold(q)) for q in {r.q for r in requests}}
    if len(widths) == 1:  # the usual round: every client's steps fill one buffer
        words = _filled_rows(requests, widths.pop())
        noise = words[:, :width].view(np.int64)
        # every row has `most` Poisson words (a shorter client's last ones are its padding): one comparison
        steps = [r.steps for r in requests]
        keep = (
            uniform53(words[:, width : width + most]) < np.repeat([thresholds[r.q] for r in requests], steps)[:, None]
        )
        if any(r.n < most for r in requests):
            keep &= np.arange(most) < np.repeat([r.n for r in requests], steps)[:, None]
        return torch.from_numpy(keep), torch.from_numpy(noise)
    streams = [r.randomness.stream_words(r.first_step, r.steps, width + r.n) for r in requests]
    noise = np.concatenate([s[:, :width] for s in streams]).view(np.int64)
    keep = np.zeros((noise.shape[0], most), dtype=bool)
    row = 0
    for r, words in zip(requests, streams, strict=True):
        np.less(
            uniform53(words[:, width : width + r.n]),
            thresholds[r.q],
            out=keep[row : row + r.steps, : r.n],
        )
        row += r.steps
    return torch.from_numpy(keep), torch.from_numpy(noise)


def _draw_batch_on(requests: Sequence[DrawRequest], noise_count: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """`draw_batch` with the keystream made on `device` (`chacha.keystream_words`), one pass for
    every request's steps: nothing is drawn on the CPU."""
    width = noise_width(noise_count)
    most = max((r.n for r in requests), default=0)
    blocks = _blocks(width + most)  # every row as wide as the widest: a row's words do not depend on it
    segments = [part for r in requests for part in r.randomness.segments(r.first_step, r.steps, _blocks(width + r.n))]
    flat = keystream_words(segments, device)
    rows, offset = [], 0
    for r in requests:  # each request's steps, padded to the widest row
        own = _blocks(width + r.n) * 8
        part = flat.view(-1)[offset : offset + r.steps * own].view(r.steps, own)
        rows.append(torch.nn.functional.pad(part, (0, blocks * 8 - own)))
        offset += r.steps * own
    words = torch.cat(rows)
    steps = torch.tensor([r.steps for r in requests], device=device)
    thresholds = torch.tensor([sampling_threshold(r.q) for r in requests], device=device).repeat_interleave(steps)
    sizes = torch.tensor([r.n for r in requests], device=device).repeat_interleave(steps)
    uniforms = (words[:, width : width + most] >> (64 - UNIFORM_BITS)) & ((1 << UNIFORM_BITS) - 1)  # the top 53 bits
    keep = (uniforms < thresholds[:, None]) & (torch.arange(most, device=device) < sizes[:, None])
    return keep, words[:, :width].contiguous()


def _blocks(width: int) -> int:
    """64-byte ChaCha20 blocks a step of `width` words reads (its words, then padding)."""
    return -(-width // 8)


def _filled_rows(requests: Sequence[DrawRequest], blocks: int) -> np.ndarray:
    """[rows, 8·blocks] keystream words (uint64): each request's steps in order, written straight
    into one buffer (the thread's kept one, if it fits and nothing refers to its last words);
    unseeded requests side by side read one fresh keystream (a cipher per client cost more than a
    small round's words). From `PARALLEL_WORDS` words on, the requests are dealt to torch's threads
    (the transform's helpers) in contiguous shares, each writing its requests' own stretches:
    `cryptography` lets go of the GIL while it encrypts (a 1,000-client CNN round's keystream:
    17.9 → 12.5 ms on 2 cores)."""
    view = _scratch.buffer(sum(r.steps for r in requests) * blocks * 64)
    ends = np.cumsum([r.steps * blocks * 64 for r in requests]).tolist()
    starts = [0, *ends[:-1]]

    def fill(part: range) -> None:
        i = part.start
        while i < part.stop:
            r = requests[i]
            if r.randomness.seeded:
                r.randomness.fill_steps(r.first_step, r.steps, blocks, view[starts[i] : ends[i]])
                i += 1
                continue
            last = i  # unseeded requests side by side: one stretch of one fresh keystream
            while last + 1 < part.stop and not requests[last + 1].randomness.seeded:
                last += 1
            _keystream_into(os.urandom(32), 0, 0, view[starts[i] : ends[last]])
            i = last + 1

    threads = torch.get_num_threads()
    if threads > 1 and len(requests) > 1 and len(view) >= 8 * PARALLEL_WORDS:
        size = -(-len(requests) // threads)
        parts = [range(k, min(k + size, len(requests))) for k in range(0, len(requests), size)]
        helpers = _helpers(os.getpid(), threads - 1)
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
        # A seeded stream's cipher where the last draw left it, (nonce, next block) and the cipher:
        # a client's rounds read consecutive stretches, and a fresh cipher costs more than a small
        # round's keystream (7–8 µs a client-round).
        self._resume: tuple[int, int, Any] | None = None
        self._resume_lock = threading.Lock()
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

    def segments(self, first_step: int, steps: int, blocks: int) -> list[tuple[bytes, int, int, int]]:
        """The keystream of `steps` steps of `blocks` blocks each, as (key, nonce, first block,
        blocks) segments in order.

        Seeded: step t's bytes start at keystream block t·blocks (nonce and 32-bit block counter
        split the position), so any split of the steps into calls gives the same bytes, and a
        client's round needs one cipher, not one per step. Unseeded: one keystream under a fresh
        OS key for the whole call.
        """
        if self._key is None:
            return [(os.urandom(32), 0, 0, steps * blocks)]
        per_nonce = max(1, COUNTER_BLOCKS // blocks)  # steps whose blocks fit one 32-bit counter
        step, end, parts = first_step, first_step + steps, []
        while step < end:
            nonce, offset = divmod(step, per_nonce)
            count = min(end, (nonce + 1) * per_nonce) - step
            parts.append((self._key, nonce, offset * blocks, count * blocks))
            step += count
        return parts

    def fill_steps(self, first_step: int, steps: int, blocks: int, out: memoryview) -> None:
        """The raw keystream of `steps` steps of `blocks` blocks each (`segments`), into `out`
        (steps·blocks·64 bytes). A seeded stream continues its last cipher when this stretch starts
        where the last one ended (the same bytes as a fresh cipher there)."""
        start = 0
        for key, nonce, first, count in self.segments(first_step, steps, blocks):
            part = out[start : start + count * 64]
            start += count * 64
            if self._key is None:
                _keystream_into(key, nonce, first, part)
                continue
            with self._resume_lock:
                resume = self._resume
                cipher = resume[2] if resume is not None and resume[:2] == (nonce, first) else None
                cipher = cipher or _keystream_cipher(key, nonce, first)
                cipher.update_into(_scratch.plaintext(len(part)), part)
                self._resume = (nonce, first + count, cipher)

    def draws(
        self, first_step: int, steps: int, n: int, q: float, noise_count: int, device: torch.device | str = "cpu"
    ) -> StepDraws:
        """Poisson samples of n records at rate ≤ q and the noise words of `noise_count`
        coordinates for each of `steps` consecutive steps, from each step's own stream."""
        keep, noise = draw_batch([DrawRequest(self, first_step, steps, n, q)], noise_count, keystream_device(device))
        return StepDraws(first_step, keep.to(device), noise.to(device))

    def refiner(self, step: int) -> Refiner:
        """Step `step`'s refinement words (`noise.Refiner`): BLAKE2b of the seed's key and the
        position (step, pair, level), or fresh OS words without a seed."""
        if self._key is None:
            return lambda pair, level: _two_words(os.urandom(16))

        def refine(pair: int, level: int) -> tuple[int, int]:
            position = b"".join(int(v).to_bytes(8, "little") for v in (step, pair, level))
            digest = hashlib.blake2b(position, digest_size=16, key=self._key, person=b"fedprivacy-ref")
            return _two_words(digest.digest())

        return refine

    @staticmethod
    def chunk_steps(n: int, noise_count: int) -> int:
        """How many steps to draw per pass, keeping a pass under NOISE_CHUNK words per step sum."""
        return max(1, NOISE_CHUNK // max(n + noise_count, 1))


def _two_words(material: bytes) -> tuple[int, int]:
    """Two unsigned 64-bit words of 16 bytes (little-endian)."""
    return int.from_bytes(material[:8], "little"), int.from_bytes(material[8:16], "little")
