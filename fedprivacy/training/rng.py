"""Randomness for sampling and noise: unpredictable by default, reproducible only on request.

Each step reseeds one torch generator: from fresh OS entropy (`secrets`) when no seed is given,
so nobody can predict or replay the noise, and one step's outputs reveal nothing about another
step's state; or from a hash of (seed, step) when a seed is given, so a seeded run gives the same
noise whatever the split into rounds or resumptions. torch's generators are not cryptographic
PRNGs and float Gaussian sampling has known side channels (Mironov 2012); reseeding from the OS
each step limits, but does not remove, that exposure.
"""

from __future__ import annotations

import hashlib
import secrets
import warnings

import torch


class SeededRunWarning(UserWarning):
    """A run whose noise is reproducible from its seed: fine for experiments, never for release."""


class StepRandomness:
    """The generator for each DP step's Poisson sampling and Gaussian noise."""

    def __init__(self, device: torch.device | str, seed: int | None = None) -> None:
        self.device = torch.device(device)
        self.seed = seed
        self.generator = torch.Generator(device=self.device)
        if seed is not None:
            warnings.warn(
                f"seed={seed}: DP noise and sampling are reproducible from the seed; "
                "seeded runs are for experiments, not production",
                SeededRunWarning,
                stacklevel=3,
            )

    @property
    def seeded(self) -> bool:
        return self.seed is not None

    def for_step(self, step: int) -> torch.Generator:
        """The generator, freshly seeded for local step `step`."""
        if self.seed is None:
            state = secrets.randbits(64)
        else:
            digest = hashlib.blake2b(f"{self.seed}:{step}".encode(), digest_size=8).digest()
            state = int.from_bytes(digest, "little")
        self.generator.manual_seed(state)
        return self.generator
