"""ChaCha20 (Bernstein 2008; RFC 8439's block function) as tensor operations, on any device.

The keystream of many (key, nonce, first block, block count) segments at once, bit-equal to the
`cryptography` package's ChaCha20 with its 16-byte nonce (a 32-bit block counter, then a 96-bit
nonce whose first 64 bits are ours and the rest zero), so that a round's noise words can be made
where the model is, with nothing waiting for the CPU. 32-bit words are held in int64 tensors:
additions are masked to 32 bits, rotations are two shifts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

MASK = 0xFFFFFFFF
CONSTANTS = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)  # "expand 32-byte k"
COLUMNS = ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15))
DIAGONALS = ((0, 5, 10, 15), (1, 6, 11, 12), (2, 7, 8, 13), (3, 4, 9, 14))


def keystream_words(segments: Sequence[tuple[bytes, int, int, int]], device: torch.device | str = "cpu") -> Tensor:
    """The keystream of each segment (key, 64-bit nonce, first block, blocks), in order, as 64-bit
    little-endian words (int64 [Σ blocks, 8]) on `device`. A segment's block counter must stay
    below 2³² (one nonce addresses 2³² blocks)."""
    counts = [blocks for *_, blocks in segments]
    if any(first + blocks > 1 << 32 for _, _, first, blocks in segments):
        raise ValueError("a segment runs past its nonce's 2³² blocks")
    per_segment = torch.tensor(
        [
            [*CONSTANTS, *_key_words(key), first, nonce & MASK, (nonce >> 32) & MASK, 0]
            for key, nonce, first, _ in segments
        ],
        dtype=torch.int64,
    ).to(device)
    repeats = torch.tensor(counts, device=device)
    state = per_segment.repeat_interleave(repeats, dim=0).T.contiguous()  # [16, blocks]
    starts = torch.cumsum(repeats, 0) - repeats
    state[12] += torch.arange(state.shape[1], device=device) - starts.repeat_interleave(repeats)
    words = _block_function(state)
    return (words[0::2] | (words[1::2] << 32)).T.contiguous()  # [blocks, 8]


def _key_words(key: bytes) -> list[int]:
    if len(key) != 32:
        raise ValueError("a ChaCha20 key has 32 bytes")
    return [int.from_bytes(key[4 * i : 4 * i + 4], "little") for i in range(8)]


def _block_function(initial: Tensor) -> Tensor:
    """Twenty rounds over the states [16, blocks], then the initial state added (mod 2³²)."""
    state = initial.clone()
    columns = torch.tensor(COLUMNS, device=state.device).T  # [4 (a, b, c, d), 4 quarter rounds]
    diagonals = torch.tensor(DIAGONALS, device=state.device).T
    for _ in range(10):
        for lanes in (columns, diagonals):
            a, b, c, d = (state[lanes[k]] for k in range(4))
            a, b, c, d = _quarter_round(a, b, c, d)
            for k, part in enumerate((a, b, c, d)):
                state[lanes[k]] = part
    return (state + initial) & MASK


def _quarter_round(a: Tensor, b: Tensor, c: Tensor, d: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    a = (a + b) & MASK
    d = _rotate(d ^ a, 16)
    c = (c + d) & MASK
    b = _rotate(b ^ c, 12)
    a = (a + b) & MASK
    d = _rotate(d ^ a, 8)
    c = (c + d) & MASK
    b = _rotate(b ^ c, 7)
    return a, b, c, d


def _rotate(x: Tensor, bits: int) -> Tensor:
    return ((x << bits) & MASK) | (x >> (32 - bits))
