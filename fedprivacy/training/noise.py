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
go on with refinement words drawn only when needed. Elementary functions are allowed 2⁻⁴⁸
relative error (4× the 4 ulp, 2⁻⁵⁰, that glibc, SLEEF and CUDA document at most). Three tiers:

1. On the model's device, in float64, y = s/γ + σ'·ẑ at the words' cell, with one bound for all
   cells with 2⁻²⁰ ≤ U ≤ 1 − 2⁻²⁰ (`CELL_BOUND`); a row whose every coordinate lies further than
   that bound from a half-integer is rounded (a coordinate is closer with probability below
   3·10⁻⁷; one reduction per row).
2. In the rows left, the coordinates tier 1 could not decide, and every pair whose U may lie
   outside that range (about 2·10⁻⁶ of pairs), again in float64 with a bound for their own cell
   (`box_muller_bounds`): all but about 4·10⁻¹¹ of coordinates are decided.
3. Elsewhere the pair's expansions are extended and evaluated in interval arithmetic (mpmath.iv)
   until the rounding is decided. An expansion stops after `RADIUS_WORDS` words: outcomes of
   probability below 2⁻¹⁰²⁴ are cut.

Every tier releases the exact rounding, so which tier decides a coordinate does not change a bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from types import ModuleType
from typing import NamedTuple

import mpmath
import numpy as np
import torch
from torch import Tensor

from fedprivacy.privacy.plan import RELEASE_GRID_BITS  # γ ≤ σC/2⁸: rounding adds ≤ (σC/256)²/12 of variance

RADIUS_WORDS = 16  # 64-bit words an expansion may use before it is cut (probability < 2⁻¹⁰²⁴)
MAX_RADIUS = math.sqrt(2 * (64 * RADIUS_WORDS + 1) * math.log(2))  # |Z| never exceeds it: 37.70
LIBM_ERROR = 2.0**-48  # relative error allowed for float64 log, sqrt, cos, sin, products
WORD_UNIT = 2.0**-64
ANGLE_UNIT = 2.0 * math.pi * WORD_UNIT  # θ = 2πV, V the angle word as a signed integer times 2⁻⁶⁴
# |Z − ẑ| ≤ CELL_BOUND for both coordinates of every cell with 2⁻²⁰ ≤ U ≤ 1 − 2⁻²⁰, i.e. radius
# words in [LOW_RADIUS_WORD, HIGH_RADIUS_WORD): `box_muller_bounds`' bound is < 1.8·10⁻¹⁰ there
# (`box_muller` gives the argument); 2⁻³² = 2.33·10⁻¹⁰
CELL_BOUND = 2.0**-32
LOW_RADIUS_WORD = -(1 << 63) + (1 << 44)  # U's first word 2⁴⁴: U ≥ 2⁻²⁰ from it on
HIGH_RADIUS_WORD = (1 << 63) - (1 << 44)  # U's first word 2⁶⁴ − 2⁴⁴: U ≤ 1 − 2⁻²⁰ below it
# −2 ln u of every word outside that range, and of no more than about 2⁻¹⁸ of the others, lies
# outside [OUTSIDE_BELOW, OUTSIDE_ABOVE] (27.73 and 1.9·10⁻⁶ at the ends): a block whose −2 ln u
# all lie within needs no look at its words
OUTSIDE_BELOW, OUTSIDE_ABOVE = 2.0**-18, 27.0
SMALLEST_NOISE_STD = 2.0**-60  # σC is 0 (no noise) or at least this: γ ≥ 2⁻⁶⁹, s/γ finite in float64
BLOCK_PAIRS = {"cpu": 1 << 16}  # pairs per block of the tier-1 pass: its temporaries stay in cache
DEVICE_BLOCK_PAIRS = 1 << 22  # elsewhere: few blocks (each block's check waits for the device)

Array = Tensor | np.ndarray
# (pair index, level) -> the next 64 bits of the pair's radius and angle expansions (unsigned ints)
Refiner = Callable[[int, int], tuple[int, int]]
Candidates = list[tuple[Tensor, Tensor]]  # (rows, columns) of coordinates tier 1 left open


def _outside(radius_words: Array) -> Array:
    """Where a radius word leaves `CELL_BOUND` unproven: U may lie below 2⁻²⁰ or above 1 − 2⁻²⁰."""
    return (radius_words < LOW_RADIUS_WORD) | (radius_words >= HIGH_RADIUS_WORD)


def grid(noise_std: Array, xp: ModuleType = torch) -> Array:
    """γ per row: the largest power of two ≤ σC/2⁸ (float64, exact, σC > 0), so that σ' = σC/γ ∈
    [256, 512); `xp` is the array library of `noise_std` (torch or numpy)."""
    _, exponent = xp.frexp(noise_std)  # σC = m·2^e, m ∈ [½, 1)
    return xp.ldexp(xp.ones_like(noise_std), exponent - 1 - RELEASE_GRID_BITS)


def _squared_radius(radius_words: Tensor) -> tuple[Tensor, Tensor]:
    """The cell's anchor u (the word rounded to float64, read in [0, 1): U's first word is the
    radius word plus 2⁶³) and −2 ln u."""
    u = radius_words.to(torch.float64).mul_(WORD_UNIT).add_(0.5)
    return u, torch.log(u).mul_(-2.0)


def box_muller(radius_words: Tensor, angle_words: Tensor, scale: Tensor | float = 1.0) -> Tensor:
    """a·ẑ, Box–Muller at the words' cell ([..., 2m]: the m cosines, then the m sines), for radius
    and angle words (int64 views of 64-bit words) and a scale a (1, or σ' per row), computed by the
    same operations as `box_muller_bounds`.

    For radius words in [`LOW_RADIUS_WORD`, `HIGH_RADIUS_WORD`), |Z − ẑ| ≤ `CELL_BOUND` for every
    real (U, V) the words leave open: `box_muller_bounds`' bound, b = 2(1 + 4ε)(s/√(L + s) +
    1.5ε·r̂) with s = 2⁻⁵¹/(u − 2⁻⁵²) + ε(L + 1), L = −2 ln u, ε = `LIBM_ERROR`, is there at most
    (i) for ½ ≤ u ≤ 1 − 2⁻²⁰: s < 2.65·2⁻⁴⁸ (L ≤ 1.39, r̂ ≤ 1.18) and L ≥ 2⁻¹⁹(1 − 2⁻²⁰), so
    b ≤ 2(1 + 4ε)(s/√L + 1.8ε) < 1.4·10⁻¹¹; (ii) for 2⁻²⁰ ≤ u < ½: s/√L ≤ 2⁻⁵¹/(u√L)·(1 + 2⁻³⁰) + ε(L + 1)/√L,
    and u√(−2 ln u) increases on (0, ½], so b < 2·2⁻⁵¹/(2⁻²⁰·√(40 ln 2)) + 10⁻¹³ < 1.8·10⁻¹⁰."""
    shape = (*radius_words.shape[:-1], 2 * radius_words.shape[-1])
    out = torch.empty(shape, dtype=torch.float64, device=radius_words.device)
    cosine, sine = out.chunk(2, dim=-1)
    squared = _squared_into(radius_words, torch.empty_like(cosine))
    _rotate_into(squared, angle_words, scale, cosine, sine)
    return out


def _squared_into(radius_words: Tensor, out: Tensor) -> Tensor:
    """−2 ln u of the cells' anchors (`_squared_radius`, the same operations) into a float64 buffer."""
    return out.copy_(radius_words).mul_(WORD_UNIT).add_(0.5).log_().mul_(-2.0)


def _rotate_into(squared: Tensor, angle_words: Tensor, scale: Tensor | float, cosine: Tensor, sine: Tensor) -> None:
    """a·r̂·cos θ and a·r̂·sin θ into float64 buffers (`squared` becomes a·r̂): `box_muller`'s second
    half, in buffers the engine reuses block after block (fresh pages cost more than the arithmetic)."""
    radius = squared.sqrt_().mul_(scale)
    sine.copy_(angle_words).mul_(ANGLE_UNIT)
    torch.cos(sine, out=cosine).mul_(radius)
    sine.sin_().mul_(radius)


def _outside_possible(squared: Tensor) -> bool:
    """Whether some −2 ln u may belong to a radius word outside [`LOW_RADIUS_WORD`,
    `HIGH_RADIUS_WORD`) (`OUTSIDE_BELOW`, `OUTSIDE_ABOVE`): False means none does."""
    return not (float(squared.amin()) > OUTSIDE_BELOW and float(squared.amax()) < OUTSIDE_ABOVE)


def box_muller_bounds(
    radius_words: Tensor, angle_words: Tensor, scale: Tensor | float = 1.0
) -> tuple[Tensor, Tensor, Tensor]:
    """(a·r·cos θ, a·r·sin θ, a·bound), float64 of the words' shape, for radius and angle words
    (int64 views of 64-bit words) and a scale a (1, or σ' per row): Box–Muller at the words' cell,
    |Z − z| ≤ bound for both coordinates and every real (U, V) whose expansions start with these
    words (a·z exact to its rounding, which the bound's margin covers). U's first word is the
    radius word plus 2⁶³ (mod 2⁶⁴), V's the angle word as a signed integer, times 2⁻⁶⁴. Cells of U
    within 2⁻⁵² of 0 get an infinite bound."""
    u, squared = _squared_radius(radius_words)
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
    angle = angle_words.to(torch.float64).mul_(ANGLE_UNIT)
    return torch.cos(angle).mul_(radius), torch.sin(angle).mul_(radius), bound


class NoiseAhead(NamedTuple):
    """Noise rows made before their steps (a trainer's round, drawn at once): per row γ and σ'
    ([rows, 1]), tier 1's room and room per unit of |s| ([rows], `_room`), σ'·ẑ ([rows, 2m],
    `box_muller`), whether a radius word lies outside `CELL_BOUND`'s range (`_outside`) and whether
    the row has noise at all (σC > 0) ([rows]); and whether every row is noisy with no such word
    (`plain`: the step looks at neither). NumPy arrays on a CPU (a step's rounding is then a few
    NumPy operations, not tens of tensor dispatches), tensors on the model's device elsewhere."""

    gamma: Array
    scale: Array
    room: Array
    room_per_sum: Array
    offset: Array
    small: Array
    noisy: Array
    plain: bool

    def row(self, index: int) -> NoiseAhead:
        """Row `index` alone, as a stack of one."""
        return self.rows(slice(index, index + 1))

    def rows(self, index: slice | np.ndarray) -> NoiseAhead:
        """The rows at `index` (a slice, or positions as a NumPy array), in that order."""
        if not isinstance(index, slice) and not isinstance(self.offset, np.ndarray):
            index = torch.as_tensor(index, device=self.offset.device)
        fields = [field[index] for field in self[:-1]]
        return NoiseAhead(*fields, plain=bool(fields[-1].all()) and not bool(fields[-2].any()))


def noise_ahead(words: Tensor, noise_std: Tensor) -> NoiseAhead:
    """`NoiseAhead` of keystream rows [rows, 2m] (m radius words, then m angle words) and their σC
    [rows] (float64): Box–Muller for every row in one pass (torch's, vectorised), the per-row
    values in NumPy on a CPU."""
    pairs = words.shape[1] // 2
    radius_words = words[:, :pairs]
    host = words.device.type == "cpu"
    xp: ModuleType = np if host else torch
    std = noise_std.numpy() if host else noise_std
    noisy = _noisy(std)
    gamma, scale = _grid_scale(xp.where(noisy, std, 1.0), xp)
    offset = box_muller(radius_words, words[:, pairs : 2 * pairs], torch.from_numpy(scale) if host else scale)
    small = _outside(radius_words.numpy() if host else radius_words).any(1)
    plain = bool(noisy.all()) and not bool(small.any())
    return NoiseAhead(gamma, scale, *_room(gamma, scale), offset.numpy() if host else offset, small, noisy, plain)


def _noisy(noise_std: Array) -> Array:
    """Which rows get noise (σC > 0); σC must be 0 or in [`SMALLEST_NOISE_STD`, ∞): a NaN or
    negative σC would otherwise mean no noise at all."""
    if not bool(((noise_std == 0) | ((noise_std >= SMALLEST_NOISE_STD) & (noise_std < math.inf))).all()):
        raise ValueError(
            f"noise_std (σ·C) must be 0 or a finite value of at least 2⁻⁶⁰ per row; got {noise_std.tolist()}"
        )
    return noise_std > 0


def _grid_scale(noise_std: Array, xp: ModuleType = torch) -> tuple[Array, Array]:
    """γ and σ' = σC/γ (exact: γ is a power of two), each [K, 1]."""
    gamma = grid(noise_std, xp)[:, None]
    return gamma, noise_std[:, None] / gamma


def _rounding(scale: Array) -> Array:
    """What y = s/γ + σ'ẑ's float64 evaluation can round away beyond its |s/γ| part (`_limit`):
    (σ'·MAX_RADIUS + 1)·2⁻⁵¹."""
    return (scale * MAX_RADIUS + 1.0) * 2.0**-51


def _room(gamma: Array, scale: Array) -> tuple[Array, Array]:
    """Tier 1 decides a row whose every y lies closer than room − max|s|·room_per_sum to an integer:
    room = ½ − σ'·`CELL_BOUND` − `_rounding`, and room_per_sum = 2⁻⁵¹/γ for what adding s/γ can
    round away (`_limit`); each [K]."""
    return (0.5 - scale * CELL_BOUND - _rounding(scale))[:, 0], (2.0**-51 / gamma)[:, 0]


def _limit(sums: Array, gamma: Array) -> Array:
    """½ less what adding s/γ to σ'ẑ can round away, |s|/γ·2⁻⁵¹ (elementwise)."""
    return 0.5 - abs(sums) * (2.0**-51 / gamma)


def rounded_gaussian(
    sums: Tensor,
    words: Tensor,
    noise_std: Tensor,
    refiners: Sequence[Refiner],
    ahead: NoiseAhead | None = None,
) -> Tensor:
    """γ·⌊s/γ + σ'·Z⌉ per row, in the sums' dtype (exact while |R| < 2²⁴ in float32), for clipped
    sums `sums` [K, P], keystream rows `words` [K, 2m] (2m ≥ P: m radius words, then m angle
    words), σC per row `noise_std` [K] (float64, never below the certified σC) and the rows'
    refinement streams; a row with σC = 0 is its sums unchanged.

    With the rows' `NoiseAhead` (made from the same words and σC), only the rounding is left.
    Otherwise Box–Muller is computed here, in blocks whose float64 temporaries stay in
    cache on a CPU."""
    if ahead is None:
        noisy = _noisy(noise_std)  # a client not taking the step may have σ = 0: no noise
        gamma, scale = _grid_scale(torch.where(noisy, noise_std, 1.0))
        released, candidates = _tier_one_blocks(sums, words, gamma, scale, noisy)
    else:
        noisy, gamma, scale = ahead.noisy, ahead.gamma, ahead.scale
        released, candidates = _tier_one_ahead(sums, words, ahead)
        if ahead.plain and not candidates:
            return released
    if candidates:
        rows, columns = (torch.cat(parts) for parts in zip(*candidates, strict=True))
        gamma, scale = (torch.as_tensor(t, device=sums.device)[:, 0] for t in (gamma, scale))
        _tier_two(released, rows, columns, sums, words, gamma, scale, refiners)
    if bool(noisy.all()):
        return released
    return torch.where(torch.as_tensor(noisy, device=sums.device)[:, None], released, sums)


def _round_block(
    sums: Array,
    gamma: Array,
    offset: Array,
    room: Array,
    room_per_sum: Array,
    out: Array,
    y: Array | None = None,
    nearest: Array | None = None,
) -> tuple[Array, Array]:
    """Tier 1 for a block of rows: ⌊s/γ + σ'ẑ⌉·γ into `out`; returns each element's distance to the
    nearest integer and each row's threshold (`_room`): a row whose every distance is below it is
    decided. Torch tensors or NumPy arrays, with the operators both share; `y` and `nearest` are
    float64 scratch of the block's shape, if given. A NaN distance (a non-finite sum, an infinite
    ẑ) is never below it."""
    xp = np if isinstance(sums, np.ndarray) else torch
    if y is None:
        y = sums.astype(np.float64) if xp is np else sums.to(torch.float64)
    else:
        y[...] = sums  # then y /= γ, not s/γ: an operation on mixed dtypes is several times slower
    y /= gamma  # exact
    y += offset
    nearest = (np.rint if xp is np else torch.round)(y, out=nearest)  # both: to nearest, ties to even
    nearest += 0.0  # −0 to +0: the sign of a zero would tell y's
    y -= nearest
    nearest *= gamma
    out[...] = nearest
    return xp.abs(y, out=y), room - _row_max(abs(sums)) * room_per_sum


def _row_max(values: Array) -> Array:
    """Each row's largest value (NaN if it holds one), NumPy or torch, by the method either has."""
    return values.max(1) if isinstance(values, np.ndarray) else values.amax(1)


def _open_rows(distance: Array, threshold: Array, noisy: Array, top: int, first: int) -> Candidates:
    """The coordinates of a block's noisy rows that tier 1 left open ((rows, columns), offset by the
    block's `top` row and `first` column)."""
    passed = _row_max(distance) < threshold
    if bool(passed.all()):
        return []
    failing = ~passed & noisy
    if not bool(failing.any()):
        return []
    distance, threshold, failing = (torch.as_tensor(a) for a in (distance, threshold, failing))
    rows = torch.nonzero(failing)[:, 0]
    local_rows, columns = torch.nonzero(~(distance[rows] < threshold[rows, None]), as_tuple=True)
    return [(rows[local_rows] + top, columns + first)]


def _outside_pairs(radius_words: Tensor, noisy: Tensor, top: int, first: int, pairs: int, width: int) -> Candidates:
    """Both coordinates of every pair in a block whose radius word is `_outside` (there `CELL_BOUND`
    is not proven), in noisy rows."""
    rows, columns = torch.nonzero(_outside(radius_words) & noisy[:, None], as_tuple=True)
    rows, columns = torch.cat([rows, rows]) + top, torch.cat([columns, columns + pairs]) + first
    inside = columns < width
    return [(rows[inside], columns[inside])]


def _tier_one_blocks(
    sums: Tensor, words: Tensor, gamma: Tensor, scale: Tensor, noisy: Tensor
) -> tuple[Tensor, Candidates]:
    """Tier 1 with Box–Muller computed block by block (the fast engine's path): whole rows per
    block where they fit, their cosines' columns, then their sines'."""
    width, pairs = sums.shape[1], words.shape[1] // 2
    block = BLOCK_PAIRS.get(sums.device.type, DEVICE_BLOCK_PAIRS)
    rows_per_block = max(1, block // max(pairs, 1))
    pairs_per_block = min(pairs, block)
    room, room_per_sum = _room(gamma, scale)
    released, candidates = torch.empty_like(sums), []
    shape = (min(rows_per_block, len(sums)), pairs_per_block)
    scratch = [torch.empty(shape, dtype=torch.float64, device=sums.device) for _ in range(5)]
    for top in range(0, len(sums), rows_per_block):
        rows = slice(top, top + rows_per_block)
        count = min(rows_per_block, len(sums) - top)
        for start in range(0, pairs, pairs_per_block):
            stop = min(start + pairs_per_block, pairs)
            squared, cosine, sine, y, nearest = (buffer[:count, : stop - start] for buffer in scratch)
            radius_words = words[rows, start:stop]
            outside = _outside_possible(_squared_into(radius_words, squared))
            _rotate_into(squared, words[rows, pairs + start : pairs + stop], scale[rows], cosine, sine)
            for z, first in ((cosine, start), (sine, pairs + start)):
                last = min(first + stop - start, width)
                if last > first:
                    columns, used = slice(first, last), slice(0, last - first)
                    distance, threshold = _round_block(
                        sums[rows, columns],
                        gamma[rows],
                        z[:, used],
                        room[rows],
                        room_per_sum[rows],
                        released[rows, columns],
                        y[:, used],
                        nearest[:, used],
                    )
                    candidates += _open_rows(distance, threshold, noisy[rows], top, first)
            if outside:
                candidates += _outside_pairs(radius_words, noisy[rows], top, start, pairs, width)
    return released, candidates


def _tier_one_ahead(sums: Tensor, words: Tensor, ahead: NoiseAhead) -> tuple[Tensor, Candidates]:
    """Tier 1 with Box–Muller made ahead (the trainer's path), in NumPy on a CPU."""
    width = sums.shape[1]
    parts = (ahead.gamma, ahead.offset[:, :width], ahead.room, ahead.room_per_sum)
    if isinstance(ahead.offset, np.ndarray):
        plain = sums.numpy()
        out = np.empty(plain.shape, plain.dtype)
        with np.errstate(invalid="ignore", over="ignore"):  # a non-finite sum or ẑ: NaN, never decided
            distance, threshold = _round_block(plain, *parts, out)
        released = torch.from_numpy(out)
    else:
        released = torch.empty_like(sums)
        distance, threshold = _round_block(sums, *parts, released)
    candidates = _open_rows(distance, threshold, ahead.noisy, 0, 0)
    if not ahead.plain and bool((ahead.small & ahead.noisy).any()):
        pairs = words.shape[1] // 2
        noisy = torch.as_tensor(ahead.noisy, device=words.device)
        candidates += _outside_pairs(words[:, :pairs], noisy, 0, 0, pairs, width)
    return released, candidates


def _tier_two(
    out: Tensor,
    rows: Tensor,
    columns: Tensor,
    sums: Tensor,
    words: Tensor,
    gamma: Tensor,
    scale: Tensor,
    refiners: Sequence[Refiner],
) -> None:
    """Decide the coordinates (rows, columns) tier 1 left open with the bound of their own cell
    (`box_muller_bounds`), and the rest exactly (`_decide_exactly`); write γ·R into `out`."""
    pairs = words.shape[1] // 2
    sine = columns >= pairs
    pair = torch.where(sine, columns - pairs, columns)
    cosine_z, sine_z, bound = box_muller_bounds(words[rows, pair], words[rows, pairs + pair], scale[rows])
    row_gamma = gamma[rows]
    plain = sums[rows, columns].to(torch.float64)
    y = plain / row_gamma + torch.where(sine, sine_z, cosine_z)
    nearest = torch.round(y).add_(0.0)
    decided = (y - nearest).abs_().add_(bound).add_(_rounding(scale[rows])) < _limit(plain, row_gamma)
    out[rows, columns] = (nearest * row_gamma).to(out.dtype)
    undecided = ~decided & torch.isfinite(plain)  # NaN (an infinite bound) is undecided; a non-finite sum stays so
    if bool(undecided.any()):
        _decide_exactly(out, rows[undecided], columns[undecided], sums, words, gamma, scale, refiners)


def _decide_exactly(
    out: Tensor,
    rows: Tensor,
    columns: Tensor,
    sums: Tensor,
    words: Tensor,
    gamma: Tensor,
    scale: Tensor,
    refiners: Sequence[Refiner],
) -> None:
    """Write into `out` γ times the exact rounding of the coordinates (rows, columns), pair by pair."""
    pairs, width = words.shape[1] // 2, out.shape[1]
    todo = sorted({(row, column % pairs) for row, column in zip(rows.tolist(), columns.tolist(), strict=True)})
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
