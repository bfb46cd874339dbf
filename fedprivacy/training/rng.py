"""Randomness for DP steps: a cryptographically strong byte stream per step, turned into the
Poisson sample and the Gaussian noise.

- **Production (no seed)**: every step reads fresh bytes from the operating system's CSPRNG
  (`os.urandom`). Nothing about one step's noise can be learnt from another's, and nothing can be
  replayed: there is no seed to recover.
- **Experiments (a seed)**: every step reads the ChaCha20 keystream (the `cryptography` package)
  under a 256-bit key derived by BLAKE2b from the *whole* seed material, with the step number as
  nonce. Any change of the seed material gives an unrelated key; the same seed gives the same noise
  whatever the split of the steps into rounds or resumptions.

Either way the security level is that of the stream (≥ 128 bits; ChaCha20 has a 256-bit key), not
the 32 or 64 bits of a seeded PRNG such as torch's CPU generator, whose state can be searched.

From the stream, on the CPU (noise for a GPU model is copied there: the stream is the same on
every device):
- uniforms are 53-bit integers u (the top bits of 64-bit words);
- Poisson sampling keeps record i iff uᵢ < ⌊q·2⁵³⌋, so the realised rate is ⌊q·2⁵³⌋/2⁵³ ≤ q
  exactly (a float32 comparison with q rounds q *up* to the next multiple of 2⁻²⁴);
- Gaussians come from the Box–Muller transform in float64, then cast to the parameters' dtype.
Floating-point Gaussian samplers have known side channels (Mironov 2012); SECURITY.md says what
that does and does not cover.
"""

from __future__ import annotations

import hashlib
import math
import os
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from torch import Tensor

UNIFORM_BITS = 53
_UNIFORM_SCALE = 2.0**-UNIFORM_BITS
_KEY_DOMAIN = b"fedprivacy/noise-key/v1"


class SeededRunWarning(UserWarning):
    """A run whose noise is reproducible from its seed: fine for experiments, never for release."""


def seed_key(seed: int | bytes | str) -> bytes:
    """The 256-bit ChaCha20 key of a seed: BLAKE2b over all of its material (no truncation)."""
    material = seed if isinstance(seed, bytes) else str(seed).encode()
    return hashlib.blake2b(material, digest_size=32, person=b"fedprivacy-key", salt=_KEY_DOMAIN[:16]).digest()


def sampling_threshold(q: float) -> int:
    """⌊q·2⁵³⌋: a 53-bit uniform below it has probability ≤ q (exact integer arithmetic)."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"sampling rate q={q} outside [0, 1]")
    return math.floor(q * (1 << UNIFORM_BITS))  # q·2⁵³ is exact in binary floating point


class StepStream:
    """The random bytes of one step, read in order: first the Poisson sample, then the noise."""

    def __init__(self, read: Callable[[int], bytes]) -> None:
        self._read = read

    def uniform_words(self, count: int) -> np.ndarray:
        """`count` independent uniform integers in [0, 2⁵³), as int64."""
        raw = np.frombuffer(self._read(8 * count), dtype="<u8")
        return (raw >> np.uint64(64 - UNIFORM_BITS)).astype(np.int64)

    def poisson_sample(self, n: int, q: float, device: torch.device | str = "cpu") -> Tensor:
        """Indices of the records kept, each independently with probability ⌊q·2⁵³⌋/2⁵³ ≤ q."""
        keep = np.flatnonzero(self.uniform_words(n) < sampling_threshold(q))
        return torch.from_numpy(keep).to(device)

    def gaussians(self, count: int) -> np.ndarray:
        """`count` independent N(0, 1) draws (float64), by Box–Muller on pairs of uniforms."""
        pairs = (count + 1) // 2
        words = self.uniform_words(2 * pairs).reshape(2, pairs)
        radius = np.sqrt(-2.0 * np.log((words[0] + 1) * _UNIFORM_SCALE))  # u₁ ∈ (0, 1]: no log(0)
        angle = (2.0 * math.pi * _UNIFORM_SCALE) * words[1]
        return np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:count]

    def normal_like(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """One N(0, 1) tensor per input, same shape, dtype and device, from one read."""
        sizes = [t.numel() for t in tensors]
        flat = torch.from_numpy(self.gaussians(sum(sizes)))
        return [
            chunk.view(t.shape).to(device=t.device, dtype=t.dtype)
            for chunk, t in zip(flat.split(sizes), tensors, strict=True)
        ]


class StepRandomness:
    """Each DP step's random stream: OS entropy by default, a keyed ChaCha20 stream with a seed."""

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

    def for_step(self, step: int) -> StepStream:
        """The stream of local step `step` (0-based)."""
        if self._key is None:
            return StepStream(os.urandom)
        nonce = bytes(4) + int(step).to_bytes(8, "little") + bytes(4)  # 32-bit block counter, then the step
        encryptor = Cipher(algorithms.ChaCha20(self._key, nonce), mode=None).encryptor()
        return StepStream(lambda size: encryptor.update(bytes(size)))
