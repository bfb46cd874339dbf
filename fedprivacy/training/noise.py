"""The noisy sum a client releases, exact on a finite computer: the Gaussian mechanism's output
rounded to a power-of-two grid, the rounding computed as that of a real Gaussian.

Float32 noise added to a float32 sum reaches a set of values that depends on the sum (Mironov 2012,
"On significance of the least significant bits for differential privacy"), so a server that crafts
the model can tell a record apart from the outputs alone. A step here releases the integers
R = ⌊s/γ + σ'·Z⌉ (nearest), σ' = σC/γ, where Z ~ N(0, I) is a real Gaussian and γ the largest
power of two ≤ σC/2⁸ (`grid`), then γR. R is a function of the Gaussian mechanism's output
s + σC·Z, so the certificate of the subsampled Gaussian holds for it unchanged: rounding is
post-processing. This is the construction of Haney et al. 2022 ("Precision-based attacks and
interval refining: how to break, then fix, differential privacy on finite computers"): release the
exact rounding of the ideal output, refining the randomness where floating point cannot decide.

How R is found. Z is Box–Muller (Box & Muller 1958) of two uniforms U, V whose binary expansions
start with the step's keystream words (a radius word, an angle word per pair of coordinates) and
go on with refinement words drawn only when needed. On the model's device, in float64, each
coordinate's y = s/γ + σ'·Z is computed with a bound on its error over every (U, V) the words
leave open, elementary functions allowed 2⁻⁴⁸ relative error (4× the 4 ulp, 2⁻⁵⁰, that glibc,
SLEEF and CUDA document at most); y is rounded where it lies further than the bound from a
half-integer. Elsewhere (about 4·10⁻¹¹ of coordinates, and every cell of U within 2⁻⁵² of 0) the
pair's expansions are extended and evaluated in interval arithmetic (mpmath.iv) until the rounding
is decided. An
expansion stops after `RADIUS_WORDS` words: outcomes of probability below 2⁻¹⁰²⁴ are cut.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from types import ModuleType

import mpmath
import numpy as np
import torch
from torch import Tensor

from fedprivacy.privacy.plan import RELEASE_GRID_BITS  # γ ≤ σC/2⁸: rounding adds ≤ (σC/256)²/12 of variance

RADIUS_WORDS = 16  # 64-bit words an expansion may use before it is cut (probability < 2⁻¹⁰²⁴)
MAX_RADIUS = math.sqrt(2 * (64 * RADIUS_WORDS + 1) * math.log(2))  # |Z| never exceeds it: 37.70
LIBM_ERROR = 2.0**-48  # relative error allowed for float64 log, sqrt, cos, sin, products
WORD_UNIT = 2.0**-64
BLOCK_ELEMENTS = 1 << 16  # pairs per block of the float64 pass: its temporaries stay in cache

Array = Tensor | np.ndarray
# (pair index, level) -> the next 64 bits of the pair's radius and angle expansions (unsigned ints)
Refiner = Callable[[int, int], tuple[int, int]]


def grid(noise_std: Array, xp: ModuleType = torch) -> Array:
    """γ per row: the largest power of two ≤ σC/2⁸ (float64, exact, σC > 0), so that σ' = σC/γ ∈
    [256, 512); `xp` is the array library of `noise_std` (torch or numpy)."""
    _, exponent = xp.frexp(noise_std)  # σC = m·2^e, m ∈ [½, 1)
    return xp.ldexp(xp.ones_like(noise_std), exponent - 1 - RELEASE_GRID_BITS)


def box_muller_bounds(
    radius_words: Tensor, angle_words: Tensor, scale: Tensor | float = 1.0
) -> tuple[Tensor, Tensor, Tensor]:
    """(a·r·cos θ, a·r·sin θ, a·bound), float64 of the words' shape, for radius and angle words
    (int64 views of 64-bit words) and a scale a (1, or σ' per row): Box–Muller at the words' cell,
    |Z − z| ≤ bound for both coordinates and every real (U, V) whose expansions start with these
    words (a·z exact to its rounding, which the bound's margin covers). U's first word is the
    radius word plus 2⁶³ (mod 2⁶⁴), V's the angle word as a signed integer, times 2⁻⁶⁴. Cells of U
    within 2⁻⁵² of 0 get an infinite bound."""
    # the cell's anchor: the word rounded to float64, read in [0, 1)
    u = radius_words.to(torch.float64).mul_(WORD_UNIT).add_(0.5)
    squared = torch.log(u).mul_(-2.0)  # −2 ln u
    radius = torch.sqrt(squared)
    # −2 ln U over the cell moves by ≤ 2·2⁻⁵²/(u − 2⁻⁵²): the anchor is within 2⁻⁵² of every U
    # in it (the word's float64 rounding, the sum's, the cell's width); plus the float evaluation's
    # error. An anchor ≤ 2⁻⁵² (a first word below 2¹²) gets an infinite bound, NaN included.
    spread = torch.sub(u, 2.0**-52).clamp_(min=0.0).reciprocal_().mul_(2.0**-51)
    spread.add_(squared, alpha=LIBM_ERROR).add_(LIBM_ERROR)
    # r over the cell: within sqrt(L + s) − sqrt(max(L − s, 0)) ≤ 2s/sqrt(L + s) of r̂ = sqrt(L)
    # and |Δ(r·trig)| ≤ Δr + r·Δtrig, Δtrig covering the angle cell (2π·2⁻⁶⁴) and the float errors:
    # bound = (2s/sqrt(L + s) + 3·LIBM_ERROR·r)·(1 + 4·LIBM_ERROR), its own rounding included
    bound = spread.div_(torch.add(squared, spread).sqrt_()).add_(radius, alpha=1.5 * LIBM_ERROR)
    bound.mul_(2.0 * (1.0 + 4 * LIBM_ERROR)).nan_to_num_(nan=math.inf).mul_(scale)
    radius.mul_(scale)
    angle = angle_words.to(torch.float64).mul_(2.0 * math.pi * WORD_UNIT)  # θ = 2πV, V ∈ [−½, ½)
    return torch.cos(angle).mul_(radius), torch.sin(angle).mul_(radius), bound


@dataclass(frozen=True)
class NoiseAhead:
    """Noise rows made before their steps (a trainer's round, drawn at once): per row γ and σ'
    ([rows, 1]), σ'·z and its error bound in grid units ([rows, 2m]: σ'·bound plus the rounding of
    y's own evaluation), and whether the row has noise at all (σC > 0)."""

    gamma: Tensor
    scale: Tensor
    offset: Tensor
    slack: Tensor
    noisy: Tensor

    def row(self, index: int) -> NoiseAhead:
        """Row `index` alone, as a stack of one."""
        return NoiseAhead(
            *(t[index : index + 1] for t in (self.gamma, self.scale, self.offset, self.slack, self.noisy))
        )


def noise_ahead(words: Tensor, noise_std: Tensor) -> NoiseAhead:
    """`NoiseAhead` of keystream rows [rows, 2m] (m radius words, then m angle words) and their σC
    [rows] (float64): Box–Muller and its bounds for every row in one pass."""
    noisy = noise_std > 0
    gamma, scale, rounding = _grid_scale(torch.where(noisy, noise_std, 1.0), torch)
    pairs = words.shape[1] // 2
    cosine, sine, bound = box_muller_bounds(words[:, :pairs], words[:, pairs : 2 * pairs], scale)
    offset = torch.cat([cosine, sine], dim=1)
    slack = torch.cat([bound, bound], dim=1).add_(rounding)
    return NoiseAhead(gamma, scale, offset, slack, noisy)


def _grid_scale(noise_std: Array, xp: ModuleType) -> tuple[Array, Array, Array]:
    """γ, σ' = σC/γ (exact: γ is a power of two) and the rounding of y = s/γ + σ'z's float64
    evaluation beyond its |s/γ| part, (σ'·MAX_RADIUS + 1)·2⁻⁵¹, each [K, 1]."""
    gamma = grid(noise_std, xp)[:, None]
    scale = noise_std[:, None] / gamma
    return gamma, scale, (scale * MAX_RADIUS + 1.0) * 2.0**-51


def rounded_gaussian(
    sums: Tensor,
    words: Tensor,
    noise_std: Tensor,
    refiners: Sequence[Refiner],
    active: Tensor,
    ahead: NoiseAhead | None = None,
) -> Tensor:
    """γ·⌊s/γ + σ'·Z⌉ per row, in the sums' dtype (exact while |R| < 2²⁴ in float32), for clipped
    sums `sums` [K, P], keystream rows `words` [K, 2m] (2m ≥ P: m radius words, then m angle
    words), σC per row `noise_std` [K] (float64, never below the certified σC), the rows'
    refinement streams, and which rows take the step (the others' values are not used); a row
    with σC = 0 is its sums unchanged.

    With the rows' `NoiseAhead` (made from the same words and σC), only the rounding is left, in
    NumPy on a CPU: a small model's step is then a few array operations, not tens of tensor
    dispatches. Otherwise Box–Muller is computed here, in blocks of columns whose float64
    temporaries stay in cache."""
    width = sums.shape[1]
    if ahead is not None:
        noisy = ahead.noisy & active
        on_cpu = sums.device.type == "cpu"
        xp: ModuleType = np if on_cpu else torch
        parts = (sums, ahead.gamma, ahead.offset[:, :width], ahead.slack[:, :width])
        plain, *rest = (t.numpy() for t in parts) if on_cpu else parts
        out, decided = xp.empty_like(plain), xp.empty_like(plain, dtype=xp.bool)
        _round_into(plain, *rest, _limit(plain, rest[0], xp), out, decided, xp)
        convert = torch.from_numpy if on_cpu else (lambda a: a)
        released, decided, gamma, scale = convert(out), convert(decided), ahead.gamma, ahead.scale
    else:
        noisy = active & (noise_std > 0)  # a client not taking the step may have σ = 0: no noise
        gamma, scale, rounding = _grid_scale(torch.where(noisy, noise_std, 1.0), torch)
        released, decided = torch.empty_like(sums), torch.empty_like(sums, dtype=torch.bool)
        limit = _limit(sums, gamma, torch)
        pairs = words.shape[1] // 2
        rows_per_block = max(1, BLOCK_ELEMENTS // max(pairs, 1))  # whole rows, contiguous, when they fit
        pairs_per_block = min(pairs, BLOCK_ELEMENTS)
        for top in range(0, len(sums), rows_per_block):
            rows = slice(top, top + rows_per_block)
            for start in range(0, pairs, pairs_per_block):
                stop = min(start + pairs_per_block, pairs)
                cells = box_muller_bounds(
                    words[rows, start:stop], words[rows, pairs + start : pairs + stop], scale[rows]
                )
                slack = cells[2].add_(rounding[rows])
                for z, first in ((cells[0], start), (cells[1], pairs + start)):
                    last = min(first + stop - start, width)
                    if last > first:
                        columns, used = slice(first, last), slice(0, last - first)
                        parts = (z[:, used], slack[:, used], limit[rows])
                        into = (released[rows, columns], decided[rows, columns], torch)
                        _round_into(sums[rows, columns], gamma[rows], *parts, *into)
    undecided = ~decided  # NaN (an infinite bound) is undecided
    if not bool(noisy.all()):
        undecided &= noisy[:, None]
    if bool(undecided.any()):  # rare: only then is finiteness looked at (a non-finite sum stays so)
        undecided &= torch.isfinite(sums)
        _decide_exactly(released, undecided, sums, words, gamma[:, 0], scale[:, 0], refiners)
    return released if bool(noisy.all()) else torch.where(noisy[:, None], released, sums)


def _round_into(
    sums: Array, gamma: Array, offset: Array, slack: Array, limit: Array, out: Array, decided: Array, xp: ModuleType
) -> None:
    """y = s/γ + σ'z rounded, times γ, into `out`; `decided` where y's distance to the nearest
    integer plus `slack` (the error bound of σ'z and of y's evaluation) stays below `limit` (½ less
    the rounding of s/γ's part: `_limit`). Torch tensors or NumPy arrays (`xp`), with the operators
    both share."""
    quiet = np.errstate(over="ignore", invalid="ignore") if xp is np else contextlib.nullcontext()
    with quiet:  # an infinite bound makes a NaN gap: undecided
        y = sums / gamma  # float64, exact
        y += offset
        nearest = xp.round(y) + 0.0  # −0 to +0: the sign of a zero would tell y's
        y -= nearest
        decided[...] = abs(y) + slack < limit
        out[...] = nearest * gamma


def _limit(sums: Array, gamma: Array, xp: ModuleType) -> Array:
    """½ less what adding s/γ to σ'z can round away, |s|/γ·2⁻⁵¹ (`_round_into`): per element in
    NumPy (a trainer's small rows: no reduction), per row, from the largest |s|, in torch (an
    engine's large ones: fewer passes)."""
    if xp is np:
        return 0.5 - abs(sums) * (2.0**-51 / gamma)
    return 0.5 - sums.abs().amax(1, keepdim=True) / gamma * 2.0**-51


def _decide_exactly(
    out: Tensor,
    undecided: Tensor,
    sums: Tensor,
    words: Tensor,
    gamma: Tensor,
    scale: Tensor,
    refiners: Sequence[Refiner],
) -> None:
    """Write into `out` γ times the exact rounding of every undecided coordinate, pair by pair."""
    pairs, width = words.shape[1] // 2, out.shape[1]
    rows, columns = (index.tolist() for index in torch.nonzero(undecided.cpu(), as_tuple=True))
    todo = sorted({(row, column % pairs) for row, column in zip(rows, columns, strict=True)})
    host_words, host_sums, host_gamma, host_scale = words.cpu(), sums.cpu().double(), gamma.cpu(), scale.cpu()
    for row, pair in todo:
        members = [(trig, column) for trig, column in ((0, pair), (1, pair + pairs)) if column < width]
        scaled = [float(host_sums[row, column] / host_gamma[row]) for _, column in members]  # exact
        whole = [round(value) for value in scaled]
        decided = exact_pair_rounding(
            int(host_words[row, pair]) + (1 << 63),  # U's first word (see `box_muller_bounds`)
            int(host_words[row, pair + pairs]),  # V's, signed
            [(trig, value - base) for (trig, _), value, base in zip(members, scaled, whole, strict=True)],
            float(host_scale[row]),
            lambda level, row=row, pair=pair: refiners[row](pair, level),
        )
        for (_, column), base, value in zip(members, whole, decided, strict=True):
            out[row, column] = (base + value) * float(host_gamma[row])


def exact_pair_rounding(
    radius_word: int,
    angle_word: int,
    coordinates: Sequence[tuple[int, float]],
    scale: float,
    refine: Callable[[int], tuple[int, int]],
) -> list[int]:
    """⌊f + σ'·Z⌉ for each (trig, f) of a Box–Muller pair (trig 0: r·cos θ, 1: r·sin θ), Z the
    real value of the pair's expansions: evaluated in interval arithmetic over the cell the words
    leave open, extended by `refine` (level → next radius and angle words) until every rounding is
    decided. At `RADIUS_WORDS` words the expansion stops: the cell's midpoint is taken (the radius
    of an all-zero U is then `MAX_RADIUS`)."""
    previous = mpmath.iv.prec
    try:
        for level in range(RADIUS_WORDS - 1):
            if level:
                radius_word, angle_word = _extended(radius_word, angle_word, refine(level - 1))
            if radius_word > 0:  # else U's cell reaches 0: no bound yet
                low, high = _roundings(radius_word, angle_word, coordinates, scale, level, (0, 1))
                if low == high:
                    return low
        radius_word, angle_word = _extended(radius_word, angle_word, refine(RADIUS_WORDS - 2))
        return _roundings(radius_word, angle_word, coordinates, scale, RADIUS_WORDS - 1, (0.5, 0.5))[0]
    finally:
        mpmath.iv.prec = previous


def _extended(radius_word: int, angle_word: int, more: tuple[int, int]) -> tuple[int, int]:
    """Both expansions one 64-bit word longer (the angle's stays signed: its low bits are added)."""
    return (radius_word << 64) | more[0], (angle_word << 64) | more[1]


def _roundings(
    radius_word: int,
    angle_word: int,
    coordinates: Sequence[tuple[int, float]],
    scale: float,
    level: int,
    ends: tuple[float, float],
) -> tuple[list[int], list[int]]:
    """The roundings of f + σ'·Z at both ends of its interval over the words' cell (`ends` (0, 1)),
    or at the cell's midpoint (`ends` (½, ½)), for expansions of `level` + 1 words."""
    bits = 64 * (level + 1)
    mpmath.iv.prec = bits + 64
    unit = mpmath.iv.mpf(2) ** -bits
    u = mpmath.iv.mpf([radius_word + ends[0], radius_word + ends[1]]) * unit
    radius = mpmath.iv.sqrt(-2 * mpmath.iv.log(u))
    angle = 2 * mpmath.iv.pi * mpmath.iv.mpf([angle_word + ends[0], angle_word + ends[1]]) * unit
    trig = (mpmath.iv.cos(angle), mpmath.iv.sin(angle))
    values = [mpmath.iv.mpf(f) + scale * radius * trig[which] for which, f in coordinates]
    return [_nearest_integer(v.a) for v in values], [_nearest_integer(v.b) for v in values]


def _nearest_integer(end: mpmath.ctx_iv.ivmpf) -> int:
    """⌊x + ½⌋ of an interval's end point, in exact rational arithmetic."""
    value = mpmath.mpf(end)
    mantissa, exponent = value.man_exp  # of |x|
    exact = Fraction(mantissa) * Fraction(2) ** exponent * (-1 if value < 0 else 1)
    return math.floor(exact + Fraction(1, 2))
