"""The float64 numerics every per-layer clipping rule shares: norm bounds that cannot underflow or
overflow, their rounding slack, and the clip weights formed from them.

A security audit found that a crafted model could give one record a float32 squared norm of
exactly 0, so that it entered the sum unclipped at 100·C. So the norms are bounds on what is
actually summed, computed where they cannot underflow or overflow:
  - They are computed in float64 from the very float32 tensors that enter the sums (A, D, or the
    materialised per-example gradients). The square or product of two float32 values lies in
    [2⁻²⁹⁸, 2²⁵⁶] or is exactly 0: float32's smallest subnormal 1.4e-45 squared is 2e-90 and its
    largest value squared 1.2e77, far inside float64's normal range [2.2e-308, 1.8e308]; Gram
    products of two such sums stay above 4e-180, and sums over any realistic size (10¹² terms)
    below 1e200. So no term can underflow to 0 or overflow to inf, and float64 adds only its own
    relative rounding (10⁻¹⁶).
  - The Gram ("ghost") form ⟨AᵢAᵢᵀ, DᵢDᵢᵀ⟩ = ‖Σₜ dₜaₜᵀ‖² can cancel, and the float32 sum of those
    T terms may then be much larger than its exact value. So it is used as the upper bound
    (√(max(Gram, 0) + ε₆₄Sᵢ²) + γSᵢ)², Sᵢ = Σₜ‖aₜ‖‖dₜ‖, which covers both the float64 error and
    the float32 rounding of forming the sum (see `_conservative`). Closed forms that are products
    of squares (a 2-D Linear's ‖d‖²(‖a‖² + 1), one position) cannot cancel and are used as they are.
  - The weights wᵢ = C / max(‖gᵢ‖, C) are formed in float64 and cast to the sums' dtype so that
    the cast never raises them; a product w·x rounded into float32's subnormal range can be off by
    up to 2⁻¹⁵⁰ whatever its size, and a later product with a huge activation would amplify that,
    so each example's weight also leaves room for that absolute error (`clip_weights`, from each
    rule's `Slack`; for any realistic input that room is below C's last bit).
Each example's summed contribution therefore has norm ≤ C up to relative rounding of order 10⁻⁷.
Parameters must be float32: for float64 ones the same squares could underflow (1e-200² = 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

SUPPORTED_DTYPE = torch.float32  # of trainable parameters, hence of A, D and the sums
NORM_DTYPE = torch.float64  # of every per-example norm and clip weight
SCRATCH_MIN = 1 << 16  # elements; a smaller tensor is cast afresh (cheaper than the bookkeeping)
GRAM_BLOCK = 1 << 17  # float64 elements of one block of rows copied for a Gram product (1 MiB)


class UnsupportedLayerError(TypeError):
    """A layer whose per-example gradients cannot be computed or bounded (defined here, the bottom
    of the clipping modules, since the bounds below raise it too; `layers.base` exports it)."""


class Slack(NamedTuple):
    """Per-example bounds Eᵢ ≤ coefficient·massᵢ + constant on the absolute error that rounding into
    float32's subnormal range can add to an example's contribution (see `clip_weights`); mass ≥ 0,
    float64, one per row. Kept in this form so that it costs one operation per layer."""

    mass: Tensor
    coefficient: float
    constant: float

    def plus(self, other: Slack) -> Slack:
        """Both layers' errors (they add): a valid bound since the masses are ≥ 0."""
        return Slack(self.mass + other.mass, max(self.coefficient, other.coefficient), self.constant + other.constant)


def _rounding(dtype: torch.dtype) -> tuple[float, float]:
    """(u, η) of arithmetic in `dtype`: a product rounds to x·y·(1 + δ) + e with |δ| ≤ u, and
    |e| ≤ η only where the result falls below the normal range (gradual underflow; η is the
    subnormal spacing, twice the largest such error); an addition never underflows."""
    info = torch.finfo(dtype)
    return info.eps / 2, info.smallest_normal * info.eps


def _float64_error(*lengths: int) -> float:
    """ε₆₄ with |Gram₆₄ − ‖Σₜ dₜaₜᵀ‖²| ≤ ε₆₄·Sᵢ²: the Gram entries are float64 dot products of
    lengths K and O (error ≤ γ_K·‖aₜ‖‖aₛ‖, γ_O·‖dₜ‖‖dₛ‖, γ_n = n·u/(1 − n·u)), their products one more
    rounding and their sum over T² terms γ_{T²}; all of it is at most (K + O + T² + 3)·u₆₄·Σₜₛ
    ‖aₜ‖‖aₛ‖‖dₜ‖‖dₛ‖ = (K + O + T² + 3)·u₆₄·Sᵢ², doubled for the second-order terms."""
    return 2 * (sum(lengths) + 3) * torch.finfo(NORM_DTYPE).eps / 2


def _conservative(sq_estimate: Tensor, s: Tensor, positions: int, k: int, o: int, u: float) -> Tensor:
    """An upper bound on ‖F‖² for F the float32 sum of one example's T terms wₜ·dₜaₜᵀ (per unit weight),
    from a float64 estimate of ‖G‖², G = Σₜ dₜaₜᵀ, that may have cancelled, and Sᵢ = Σₜ‖dₜ‖‖aₜ‖.

    ‖G‖ ≤ √(max(estimate, 0) + ε₆₄Sᵢ²) by `_float64_error`. What is summed is F: each fl(w·dₜ) is
    w·dₜ(1 + δ) (|δ| ≤ u; the subnormal part is `clip_weights`' slack), and the float32 sum of the
    T products fl(w·dₜ)·aₜᵀ, in any order, has an entry-wise error ≤ γ_T·Σₜ|fl(w·dₜ)||aₜ|ᵀ, whose
    Frobenius norm is ≤ γ_T·Σₜ‖fl(w·dₜ)‖‖aₜ‖ (each term's Frobenius norm is the product of two
    vector norms). So ‖F‖ ≤ w·(‖G‖ + (u + γ_T(1 + u))·Sᵢ) ≤ w·(‖G‖ + γSᵢ) with γ = 2(T + 1)u, valid
    while (T + 1)u ≤ 1/2 (T < 8·10⁶ positions in float32). The bound never underestimates: the
    rounding term is added to the norm, not in quadrature (a sum of squares would miss up to √2).
    """
    if (positions + 1) * u > 0.5:
        raise UnsupportedLayerError(f"{positions} positions per example: too many to bound the rounding of their sum")
    gamma = 2 * (positions + 1) * u
    upper = torch.addcmul(sq_estimate.clamp(min=0), s, s, value=_float64_error(k, o, positions * positions)).sqrt_()
    return upper.add_(s, alpha=gamma).square_()


class Float64Scratch:
    """Float64 copies of float32 tensors, for the norms, made in buffers kept from one step to the
    next: allocating a fresh multi-megabyte float64 block every step cost more than the cast itself
    (page faults: on the CNN at batch 256, 13.8 against 9.5 ms per clipped sum on one CPU thread).
    One buffer per slot (a layer's A, its D, ...), grown when a batch needs more; a copy is only
    valid until the same slot is asked for again. Not for concurrent use."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[object, torch.device], Tensor] = {}

    def __call__(self, x: Tensor, slot: object) -> Tensor:
        if x.numel() < SCRATCH_MIN:
            return _fresh_float64(x, slot)
        key = (slot, x.device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < x.numel():  # headroom: Poisson batch sizes vary
            buffer = self._buffers[key] = torch.empty(x.numel() + x.numel() // 4, dtype=NORM_DTYPE, device=x.device)
        return buffer[: x.numel()].view(x.shape).copy_(x)  # contiguous, whatever x's strides


def _fresh_float64(x: Tensor, slot: object) -> Tensor:
    return x.to(NORM_DTYPE, memory_format=torch.contiguous_format)


# Casts a float32 tensor to float64 for the norms; the slot names the buffer it may reuse.
ToFloat64 = Callable[[Tensor, object], Tensor]


def _norms64(x: Tensor, to64: ToFloat64, slot: object) -> Tensor:
    """‖x‖ over the last dimension in float64: every entry is cast to float64 before it is squared
    (a large or strided x into a contiguous copy: vector_norm along a strided dimension, as in a
    convolution's D, was 16× slower on CPU)."""
    if x.numel() < SCRATCH_MIN and x.stride(-1) == 1:
        return torch.linalg.vector_norm(x, dim=-1, dtype=NORM_DTYPE)
    return torch.linalg.vector_norm(to64(x, slot), dim=-1)


def gram64(x: Tensor, to64: ToFloat64, slot: object) -> Tensor:
    """Each example's Gram matrix XᵢXᵢᵀ (R, T, T) of x (R, T, K), in float64 from float64 copies.

    On a CPU the copies are made a block of rows at a time (`GRAM_BLOCK`), each read back by its
    product while still in the core's cache, not a copy of the whole of x that goes out to memory
    and back (the digits CNN's second convolution on 2 cores: its norms 7-10% faster at 1,500-2,600
    rows, its A's copy and product 22 against 40 ms at 6,400). Each example's product is the same either
    way; no block holds a single row, which would take the unbatched kernel."""
    per_block = max(2, GRAM_BLOCK // max(1, x.shape[1] * x.shape[2]))
    if x.device.type != "cpu" or len(x) < 2 * per_block:
        x64 = to64(x, slot)
        return torch.bmm(x64, x64.transpose(1, 2))
    out = torch.empty((len(x), x.shape[1], x.shape[1]), dtype=NORM_DTYPE, device=x.device)
    tops = list(range(0, len(x), per_block))
    if len(x) - tops[-1] < 2:  # the last block would hold one row: the one before takes it
        tops.pop()
    for top, bottom in zip(tops, [*tops[1:], len(x)], strict=True):
        block = to64(x[top:bottom], slot)
        torch.bmm(block, block.transpose(1, 2), out=out[top:bottom])
    return out


def materialised_slack(rows: int, entries: int, dtype: torch.dtype, device: torch.device) -> Slack:
    """The slack of per-example gradients that are formed and then weighted (w·gᵢ, entry by entry):
    each product can round into the subnormal range with an error ≤ η/2, unamplified; so ≤ η√P per
    example over its P entries (doubled: the bound also covers the sum's own products)."""
    _, eta = _rounding(dtype)
    return Slack(torch.zeros(rows, dtype=NORM_DTYPE, device=device), 0.0, 2 * eta * math.sqrt(entries))


def clip_weights(sq_norms: Tensor, slack: Slack, clip_norm: float | Tensor, dtype: torch.dtype) -> Tensor:
    """The clip weights wᵢ = min(1, (C − Eᵢ)⁺ / ‖gᵢ‖), computed in float64 from the norm bounds
    ‖gᵢ‖ and slacks Eᵢ, and cast to the sums' `dtype` so that the weight used never exceeds that.
    `clip_norm` is a float or a tensor that broadcasts against `sq_norms` (each client's C).

    Eᵢ bounds the absolute error that rounding into the subnormal range adds to example i's
    contribution (≤ η per weighted entry, amplified by the norm of what that entry multiplies). Then
    ‖contribution‖ ≤ wᵢ‖gᵢ‖ + Eᵢ ≤ C, where C/max(‖gᵢ‖, C) alone would allow up to 2·C for a crafted
    record (a weighted entry of 0.5 subnormal spacings rounds to 1). For any realistic input Eᵢ is
    below 10⁻³⁰ and C − Eᵢ == C in float64.

    The cast rounds to nearest, which could round up: so the float64 weight is first lowered by the
    factor (1 − 2u) (in the normal range fl(x) ≤ x(1 + u)) and by half the subnormal spacing (below
    it fl(x) ≤ x + that). The weights thus sit up to 2u = 1.2·10⁻⁷ (relative) below C/max(‖gᵢ‖, C),
    and are exactly 1 for every example with ‖gᵢ‖ ≤ (C − Eᵢ)(1 − 2u).
    """
    info = torch.finfo(dtype)
    shrink = 1 - info.eps  # 1 − 2u
    if isinstance(clip_norm, Tensor):
        clip_norm = clip_norm.to(NORM_DTYPE)
    # (C − Eᵢ)(1 − 2u), Eᵢ ≤ coefficient·massᵢ + constant; a room below 0 gives w = 0
    room = torch.rsub(slack.mass, (clip_norm - slack.constant) * shrink, alpha=slack.coefficient * shrink)
    # 1/‖gᵢ‖: inf for a zero norm, so w = 1 (w = NaN, were the room exactly 0 too: the example is then
    # dropped as non-finite by the clipped sums' fallback)
    return sq_norms.rsqrt().mul_(room).sub_(info.smallest_normal * info.eps / 2).clamp_(0.0, 1.0).to(dtype)
