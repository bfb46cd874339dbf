"""Clipped sums of per-example gradients in one backward pass ("book-keeping", Bu et al.).

For a Linear or Conv2d layer the gradient of example i is Dᵢᵀ·Aᵢ, where Aᵢ is the layer's
input (unfolded into patches for a convolution) and Dᵢ the gradient of the summed loss with
respect to the layer's output. So one forward pass that stores A and one backward pass that
returns D (only with respect to the layer outputs: autograd never forms the parameter
gradients) give, per layer,
  - the per-example squared norms, without materialising per-example gradients when the
    Gram form ⟨AᵢAᵢᵀ, DᵢDᵢᵀ⟩ is smaller (always for a 2-D Linear: ‖aᵢ‖²‖dᵢ‖²), and
  - the clipped sum Σᵢ wᵢ·DᵢᵀAᵢ = (w⊙D)ᵀA as one matrix product, wᵢ = C / max(‖gᵢ‖, C).
This is exact (no approximation) for any model whose trainable parameters all live in Linear or
Conv2d layers and whose layers never mix examples; anything else is refused by name.

An example whose gradient norm is not finite (an overflow, a NaN: a diverging run, or a model
crafted so that one record overflows) contributes exactly zero, and its rows are zeroed before the
sums are formed, since 0·inf would otherwise turn the whole clipped sum into NaN. Each example's
contribution is then still a function of that example alone with norm ≤ C, which is all the
accountant assumes. How many were dropped is counted for the client's own diagnostics only.

The norms are bounds on what is actually summed, computed where they cannot underflow or overflow
(a security audit found that a crafted model could give one record a float32 squared norm of
exactly 0, so that it entered the sum unclipped at 100·C):
  - They are computed in float64 from the very float32 tensors that enter the sums (A, D, or the
    materialised DᵢᵀAᵢ). The square or product of two float32 values lies in [2⁻²⁹⁸, 2²⁵⁶] or is
    exactly 0: float32's smallest subnormal 1.4e-45 squared is 2e-90 and its largest value squared
    1.2e77, far inside float64's normal range [2.2e-308, 1.8e308]; Gram products of two such sums
    stay above 4e-180, and sums over any realistic size (10¹² terms) below 1e200. So no term can
    underflow to 0 or overflow to inf, and float64 adds only its own relative rounding (10⁻¹⁶).
  - The Gram ("ghost") form ⟨AᵢAᵢᵀ, DᵢDᵢᵀ⟩ = ‖Σₜ dₜaₜᵀ‖² can cancel, and the float32 sum of those
    T terms may then be much larger than its exact value. So it is used as the upper bound
    (√(max(Gram, 0) + ε₆₄Sᵢ²) + γSᵢ)², Sᵢ = Σₜ‖aₜ‖‖dₜ‖, which covers both the float64 error and
    the float32 rounding of forming the sum (see `_conservative`). Closed forms that are products
    of squares (a 2-D Linear's ‖d‖²(‖a‖² + 1), one position) cannot cancel and are used as they are.
  - The weights wᵢ = C / max(‖gᵢ‖, C) are formed in float64 and cast to the sums' dtype so that
    the cast never raises them; a product w·x rounded into float32's subnormal range can be off by
    up to 2⁻¹⁵⁰ whatever its size, and a later product with a huge activation would amplify that,
    so each example's weight also leaves room for that absolute error (`clip_weights`; for any
    realistic input that room is below C's last bit).
Each example's summed contribution therefore has norm ≤ C up to relative rounding of order 10⁻⁷
(tests/test_norm_underflow.py checks ≤ C·(1 + 10⁻⁵) against per-example gradients from
torch.func, their norms taken in float64). A gradient that is finite but beyond float32's squared
range (a feature of 3e38) is therefore clipped like any other, no longer dropped as non-finite.
Parameters must be float32: for float64 ones the same squares could underflow (1e-200² = 0), and
no model here is float64, so they are refused by name rather than handled by rescaling.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SUPPORTED_LAYERS: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv2d)
SUPPORTED_DTYPE = torch.float32  # of trainable parameters, hence of A, D and the sums
NORM_DTYPE = torch.float64  # of every per-example norm and clip weight


class UnsupportedLayerError(TypeError):
    """A layer with trainable parameters whose per-example gradients we cannot compute."""


@dataclass
class ClippedBatch:
    """What one batch gives the DP step: clipped gradient sums and statistics (on device)."""

    grad_sums: list[Tensor]  # Σᵢ clip(gᵢ), aligned with PerExampleClipper.parameters
    sq_norms: Tensor  # per-example squared norms before clipping (float64 upper bounds), shape (B,); 0 where dropped
    loss_sum: Tensor  # Σᵢ loss_i over the examples kept (scalar)
    clip_norm: float
    nonfinite: int = 0  # examples dropped because their gradient norm was not finite

    @property
    def clipped(self) -> Tensor:
        """Number of examples whose gradient norm exceeded C (scalar tensor)."""
        return (self.sq_norms > self.clip_norm**2).sum()


def _trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]


def check_supported(model: nn.Module) -> None:
    """Refuse a model holding trainable parameters outside Linear/Conv2d, or a batch norm
    (frozen or not, in training it mixes the examples of a batch), naming the layer; and trainable
    parameters that are not float32, naming the parameter."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise UnsupportedLayerError(
                f"layer {name or '<root>'!r} ({type(module).__name__}) normalises with batch "
                "statistics, so one example's gradient depends on the others: DP-SGD cannot "
                "clip per example; remove it"
            )
        params = _trainable(module)
        if params and not isinstance(module, SUPPORTED_LAYERS):
            raise UnsupportedLayerError(
                f"layer {name or '<root>'!r} ({type(module).__name__}) has trainable parameters "
                f"({', '.join(n for n, _ in params)}) but per-example gradients are only "
                f"supported for {', '.join(t.__name__ for t in SUPPORTED_LAYERS)}; "
                "freeze it (requires_grad=False) or replace it (e.g. no BatchNorm: it mixes "
                "examples in a batch)"
            )
    for name, parameter in model.named_parameters():
        if parameter.requires_grad and parameter.dtype != SUPPORTED_DTYPE:
            raise UnsupportedLayerError(
                f"parameter {name!r} is {parameter.dtype}: per-example clipping supports "
                f"{SUPPORTED_DTYPE} parameters only (its norms are exact in float64 only for float32 "
                "values: a float64 square can underflow to 0, a float16 sum overflow); convert the "
                "model with model.float()"
            )


class Slack(NamedTuple):
    """Per-example bounds Eᵢ ≤ coefficient·massᵢ + constant on the absolute error that rounding into
    float32's subnormal range can add to an example's contribution (see `clip_weights`); mass ≥ 0,
    float64, (B,). Kept in this form so that it costs one operation per layer."""

    mass: Tensor
    coefficient: float
    constant: float

    def plus(self, other: Slack) -> Slack:
        """Both layers' errors (they add): a valid bound since the masses are ≥ 0."""
        return Slack(self.mass + other.mass, max(self.coefficient, other.coefficient), self.constant + other.constant)


# Per layer: (per-example squared-norm bounds (B,), float64; their slack; A; D; per-example weight
# gradients or None).
Terms = tuple[Tensor, Slack, Tensor, Tensor, Tensor | None]


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


SCRATCH_MIN = 1 << 16  # elements; a smaller tensor is cast afresh (cheaper than the bookkeeping)


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


ToFloat64 = Callable[[Tensor, object], Tensor]


def _norms64(x: Tensor, to64: ToFloat64, slot: object) -> Tensor:
    """‖x‖ over the last dimension in float64: every entry is cast to float64 before it is squared
    (a large or strided x into a contiguous copy: vector_norm along a strided dimension, as in a
    convolution's D, was 16× slower on CPU)."""
    if x.numel() < SCRATCH_MIN and x.stride(-1) == 1:
        return torch.linalg.vector_norm(x, dim=-1, dtype=NORM_DTYPE)
    return torch.linalg.vector_norm(to64(x, slot), dim=-1)


def linear_norms(a: Tensor, d: Tensor, to64: ToFloat64 = _fresh_float64, slot: object = None) -> tuple[Tensor, Slack]:
    """A Linear layer with a trained weight and bias on 2-D input (or a batch of them, [..., B, ·]):
    per-example ‖gᵢ‖² = ‖dᵢ‖²(‖aᵢ‖² + 1) in float64 (products of squares: no cancellation, no
    underflow), and the absolute slack `clip_weights` leaves for the weighted factors' rounding."""
    n_a, n_d = _norms64(a, to64, (slot, "a")), _norms64(d, to64, (slot, "d"))
    d_sq = n_d.square()
    _, eta = _rounding(d.dtype)
    k, o = a.shape[-1], d.shape[-1]
    # The sums weight the narrower side ((w⊙D)ᵀA or Dᵀ(A⊙w)) and form w·D for the bias: an error of
    # ≤ η in fl(w·dⱼ) is multiplied by ‖(aᵢ, 1)‖ ≤ ‖aᵢ‖ + 1, one in fl(w·aₖ) by ‖dᵢ‖, and the
    # products themselves add ≤ η each, unamplified: in all ≤ 2η(√O(‖aᵢ‖ + 1) + √K‖dᵢ‖ + 2√(O(K+1))).
    coefficient = 2 * eta * (math.sqrt(o) + math.sqrt(k) + 2 * math.sqrt(o * (k + 1)))
    return torch.addcmul(d_sq, d_sq, n_a.square()), Slack(torch.add(n_a, n_d), coefficient, coefficient)


def _linear_terms(module: nn.Linear, a: Tensor, d: Tensor, to64: ToFloat64 = _fresh_float64) -> Terms:
    """A Linear layer's terms; A and D as (B, T, ·) unless the input is plain 2-D."""
    if a.dim() == 2 and module.weight.requires_grad and module.bias is not None and module.bias.requires_grad:
        # The common case in closed form: ‖gᵢ‖² = ‖dᵢ‖²‖aᵢ‖² + ‖dᵢ‖² (weight, then bias).
        sq, slack = linear_norms(a, d, to64, module)
        return sq, slack, a, d, None
    batch = a.shape[0]
    a = a.reshape(batch, -1, a.shape[-1])
    d = d.reshape(batch, -1, d.shape[-1])
    sq, slack, per_example = _sq_norms(module, a, d, to64)
    return sq, slack, a, d, per_example


def _sq_norms(
    module: nn.Module, a: Tensor, d: Tensor, to64: ToFloat64 = _fresh_float64
) -> tuple[Tensor, Slack, Tensor | None]:
    """Upper bounds on ‖DᵢᵀAᵢ‖² (+ ‖Σₜ Dᵢₜ‖² for the bias) as summed, for A: (B, T, K), D: (B, T, O),
    by the cheaper of the Gram ("ghost") form and the per-example gradients DᵢᵀAᵢ, which are then
    returned too; and each example's absolute slack (see `clip_weights`). All in float64."""
    t, k, o = a.shape[1], a.shape[2], d.shape[2]
    u, eta = _rounding(d.dtype)
    weight = module.weight.requires_grad
    bias = module.bias is not None and module.bias.requires_grad
    d64 = to64(d, (module, "d"))
    if weight and t > 1 and t * t <= k * o:  # the Gram form, in float64
        a64 = to64(a, (module, "a"))
        gram_a, gram_d = torch.bmm(a64, a64.transpose(1, 2)), torch.bmm(d64, d64.transpose(1, 2))
        if bias:
            gram_a += 1.0  # (aₜ, 1)·(aₛ, 1): the bias multiplies a constant 1
        # The diagonals are the positions' squared norms ‖(aₜ, 1)‖², ‖dₜ‖².
        n_a, n_d = gram_a.diagonal(dim1=1, dim2=2).sqrt(), gram_d.diagonal(dim1=1, dim2=2).sqrt()
        estimate = torch.linalg.vecdot(gram_a.flatten(1), gram_d.flatten(1))  # ⟨AAᵀ, DDᵀ⟩ ≈ ‖G‖²
        s = torch.linalg.vecdot(n_d, n_a)  # Sᵢ = Σₜ ‖dₜ‖‖(aₜ, 1)‖ ≥ ‖Σₜ dₜ(aₜ, 1)ᵀ‖
        return _conservative(estimate, s, t, k + 1, o, u), _slack(n_a, t, k, o, eta), None
    n_d = torch.linalg.vector_norm(d64, dim=-1)  # (B, T): ‖dₜ‖
    if t == 1:  # one position: ‖d(a, 1)ᵀ‖ = ‖d‖‖(a, 1)‖ exactly, no cancellation
        if weight:  # ‖(a, 1)‖ over the trained parts
            n_a = _norms64(a, to64, (module, "a"))
            n_a = n_a.square().add_(1.0).sqrt_() if bias else n_a
        else:
            n_a = torch.ones_like(n_d)
        return (n_d * n_a).square().sum(1), _slack(n_a, t, k, o, eta), None
    # Several positions: the slack's Σₜ‖(aₜ, 1)‖ is at most √T·‖A‖_F + T (one norm per example).
    c = 2 * eta * math.sqrt(o)
    c0 = 2 * eta * (t + 1) * math.sqrt(o * (k + 1)) + (c * t if bias else 0.0)
    if weight:
        slack = Slack(_norms64(a.flatten(1), to64, (module, "a")), c * math.sqrt(t), c0)
    else:
        slack = Slack(torch.zeros_like(n_d[:, 0]), 0.0, c0)
    bias_sq = None
    if bias:  # Σₜ w·dₜ is summed in float32 and may cancel
        bias_sq = _conservative(torch.linalg.vector_norm(d64.sum(1), dim=-1).square(), n_d.sum(1), t, 1, o, u)
    if not weight:
        return bias_sq, slack, None
    per_example = torch.bmm(d.transpose(1, 2), a)
    # The norm of the very tensor that is summed (weights @ per_example): exact in float64.
    sq = _norms64(per_example.flatten(1), to64, (module, "g")).square()
    return (sq if bias_sq is None else sq + bias_sq), slack, per_example


def _slack(n_a: Tensor, t: int, k: int, o: int, eta: float) -> Slack:
    """The slack of a (B, T) layer: the sums form fl(w·dₜ) (an error ≤ η per entry, amplified by
    ‖(aₜ, 1)‖), then the products and w·(DᵢᵀAᵢ) (≤ η each, unamplified); doubled for the rest."""
    return Slack(n_a.sum(1), 2 * eta * math.sqrt(o), 2 * eta * (t + 1) * math.sqrt(o * (k + 1)))


def _patches(module: nn.Conv2d, x: Tensor) -> Tensor:
    """The input patches each output position sees, as one contiguous (B, L, C·kh·kw) tensor.

    Built from strided views (pad, then Tensor.unfold) and a single copy: on CPU F.unfold loops
    over the batch and was 7-20× slower on the CNN's two layers at batch 256.
    """
    if any(module._reversed_padding_repeated_twice):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, module._reversed_padding_repeated_twice, mode=mode)
    (kh, kw), (dh, dw), (sh, sw) = module.kernel_size, module.dilation, module.stride
    view = x.unfold(2, dh * (kh - 1) + 1, sh).unfold(3, dw * (kw - 1) + 1, sw)[..., ::dh, ::dw]
    batch, channels, out_h, out_w = view.shape[:4]
    return view.permute(0, 2, 3, 1, 4, 5).reshape(batch, out_h * out_w, channels * kh * kw)


def _conv_terms(module: nn.Conv2d, x: Tensor, d: Tensor, to64: ToFloat64 = _fresh_float64) -> Terms:
    """A Conv2d layer as G grouped Linear maps over L patch positions: A (B·G, L, K), D (B·G, L, O)."""
    batch, groups = x.shape[0], module.groups
    a = _patches(module, x)
    if groups > 1:
        a = a.reshape(batch, a.shape[1], groups, -1).transpose(1, 2).reshape(batch * groups, a.shape[1], -1)
    d = d.reshape(batch * groups, d.shape[1] // groups, -1).transpose(1, 2)
    sq, slack, per_example = _sq_norms(module, a, d, to64)
    if groups > 1:
        sq = sq.reshape(batch, groups).sum(1)
        slack = Slack(slack.mass.reshape(batch, groups).sum(1), slack.coefficient, groups * slack.constant)
    return sq, slack, a, d, per_example


def clip_weights(sq_norms: Tensor, slack: Slack, clip_norm: float | Tensor, dtype: torch.dtype) -> Tensor:
    """The clip weights wᵢ = min(1, (C − Eᵢ)⁺ / ‖gᵢ‖), computed in float64 from the norm bounds
    ‖gᵢ‖ and slacks Eᵢ, and cast to the sums' `dtype` so that the weight used never exceeds that.

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
    # dropped as non-finite by clipped_sum's fallback)
    return sq_norms.rsqrt().mul_(room).sub_(info.smallest_normal * info.eps / 2).clamp_(0.0, 1.0).to(dtype)


def _all_finite(tensors: list[Tensor]) -> bool:
    """One check for a list: NaN and ±inf reach the sum of their norms (so does an overflowing
    norm, which only sends a finite batch down the slower, still exact, path)."""
    return math.isfinite(float(torch.stack(torch._foreach_norm(tensors)).sum()))


def _drop_rows(
    layer: nn.Module, keep: Tensor, a: Tensor, d: Tensor, per_example: Tensor | None
) -> tuple[nn.Module, Tensor, Tensor, Tensor | None]:
    """Zero the A and D rows (and per-example gradients) of the examples not kept.

    Rows are per example, or per (example, group) for a grouped convolution (B·G rows).
    """
    rows = keep.repeat_interleave(a.shape[0] // keep.shape[0])

    def zeroed(t: Tensor) -> Tensor:
        return torch.where(rows.view(-1, *(1,) * (t.dim() - 1)), t, 0.0)

    return layer, zeroed(a), zeroed(d), None if per_example is None else zeroed(per_example)


class PerExampleClipper:
    """Computes clipped per-example gradient sums for a model, by forward hooks on its layers.

    The hooks record only while `clipped_sum` runs, so the model is usable normally otherwise.
    """

    def __init__(self, model: nn.Module) -> None:
        check_supported(model)
        self.model = model
        self.layers = [m for m in model.modules() if isinstance(m, SUPPORTED_LAYERS) and _trainable(m)]
        if not self.layers:
            raise UnsupportedLayerError("the model has no trainable Linear or Conv2d parameters")
        # Parameters in layer order, weight before bias; grad_sums follow this order.
        self.parameters: list[nn.Parameter] = [p for m in self.layers for _, p in _trainable(m)]
        self._records: dict[nn.Module, tuple[Tensor, Tensor, int]] = {}
        self._recording = False
        self._float64 = Float64Scratch()
        for layer in self.layers:
            layer.register_forward_hook(self._record)

    def _record(self, module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        if not self._recording:
            return
        if module in self._records:
            raise UnsupportedLayerError(
                f"layer {type(module).__name__} is called more than once per forward pass "
                "(shared weights): per-example norms would not add up per call"
            )
        self._records[module] = (inputs[0].detach(), output, output._version)

    def clipped_sum(self, inputs: Tensor, targets: Tensor, clip_norm: float) -> ClippedBatch:
        """Σᵢ clip_C(∇loss_i) over the batch, with each example's gradient clipped over ALL
        trainable parameters together; cross-entropy loss on the model's logits.

        Examples whose gradient norm is not finite contribute zero. The common case pays one
        check (the sums and the norms' total are finite); otherwise the batch is redone without
        those examples, and, should its sums still overflow (finite norms built from terms that
        overflow when summed), one example at a time, so that only the offenders are dropped.
        """
        terms, sq_norms, slack, losses = self._terms(inputs, targets)
        grad_sums = self._weighted_sums(terms, sq_norms, clip_norm, slack)
        # A finite norm bound implies a finite slack. (The float32 cast only sends a batch whose squared
        # norms sum past 3.4e38, a diverged or crafted one, down the slower, still exact, path below.)
        if _all_finite([sq_norms.sum().float(), *grad_sums]):
            return ClippedBatch(grad_sums, sq_norms, losses.detach().sum(), clip_norm)
        finite = torch.isfinite(sq_norms) & torch.isfinite(slack.mass)
        nonfinite = int(finite.numel() - finite.sum())
        if nonfinite:
            terms = [_drop_rows(layer, finite, a, d, per_example) for layer, a, d, per_example in terms]
            sq_norms = torch.where(finite, sq_norms, 0.0)
            slack = Slack(torch.where(finite, slack.mass, 0.0), slack.coefficient, slack.constant)
            losses = torch.where(finite, losses, 0.0)
            grad_sums = self._weighted_sums(terms, sq_norms, clip_norm, slack)
        if _all_finite(grad_sums):
            return ClippedBatch(grad_sums, sq_norms, losses.detach().sum(), clip_norm, nonfinite)
        if inputs.shape[0] == 1:
            zeros = [torch.zeros_like(g) for g in grad_sums]
            return ClippedBatch(
                zeros, torch.zeros_like(sq_norms), torch.zeros((), device=sq_norms.device), clip_norm, 1
            )
        singles = [self.clipped_sum(inputs[i : i + 1], targets[i : i + 1], clip_norm) for i in range(inputs.shape[0])]
        return ClippedBatch(
            [torch.stack(parts).sum(0) for parts in zip(*(b.grad_sums for b in singles), strict=True)],
            torch.cat([b.sq_norms for b in singles]),
            torch.stack([b.loss_sum for b in singles]).sum(),
            clip_norm,
            sum(b.nonfinite for b in singles),
        )

    def _terms(
        self, inputs: Tensor, targets: Tensor
    ) -> tuple[list[tuple[nn.Module, Tensor, Tensor, Tensor | None]], Tensor, Slack, Tensor]:
        """One forward and one backward pass: each layer's (A, D, per-example gradients or None),
        the per-example squared-norm bounds and slacks (float64, see `clip_weights`) and the
        per-example losses."""
        self._records.clear()
        self._recording = True
        try:
            logits = self.model(inputs)
        finally:
            self._recording = False
        losses = F.cross_entropy(logits, targets, reduction="none")
        loss_sum = losses.sum()
        outputs = []
        for layer in self.layers:
            if layer not in self._records:
                raise UnsupportedLayerError(
                    f"layer {layer} was not called in the forward pass; freeze its parameters "
                    "(requires_grad=False) if it is not meant to be trained"
                )
            _, out, version = self._records[layer]
            if out._version != version:
                raise UnsupportedLayerError(
                    f"the output of {layer} was modified in place (e.g. ReLU(inplace=True)); "
                    "use out-of-place activations"
                )
            outputs.append(out)
        # Gradients with respect to layer outputs only: autograd skips the parameter gradients.
        deltas = torch.autograd.grad(loss_sum, outputs, allow_unused=True)

        terms = []
        sq_norms: Tensor | None = None
        slack: Slack | None = None
        for layer, delta in zip(self.layers, deltas):
            a, out, _ = self._records[layer]
            if delta is None:
                delta = torch.zeros_like(out)
            sq, layer_slack, a, d, per_example = (_conv_terms if isinstance(layer, nn.Conv2d) else _linear_terms)(
                layer, a, delta, self._float64
            )
            # Squared bounds of the layers' parts add; their absolute errors add by the triangle inequality.
            sq_norms = sq if sq_norms is None else sq_norms + sq
            slack = layer_slack if slack is None else slack.plus(layer_slack)
            terms.append((layer, a, d, per_example))
        self._records.clear()
        assert sq_norms is not None and slack is not None  # at least one layer (checked in __init__)
        return terms, sq_norms, slack, losses

    @staticmethod
    def _weighted_sums(
        terms: list[tuple[nn.Module, Tensor, Tensor, Tensor | None]],
        sq_norms: Tensor,
        clip_norm: float,
        slack: Slack,
    ) -> list[Tensor]:
        """Σᵢ wᵢ·gᵢ per parameter, wᵢ = C / max(‖gᵢ‖, C): 1 below C, C/‖gᵢ‖ above (`clip_weights`),
        in the dtype of A and D, from exactly the tensors the norms were computed from."""
        weights = clip_weights(sq_norms, slack, clip_norm, terms[0][2].dtype)
        grad_sums: list[Tensor] = []
        for layer, a, d, per_example in terms:
            if a.dim() == 2:  # plain Linear: weight the narrower side; the bias is w·D
                if layer.weight.requires_grad:
                    if d.shape[1] <= a.shape[1]:
                        grad_sums.append((d * weights[:, None]).t() @ a)
                    else:
                        grad_sums.append(d.t() @ (a * weights[:, None]))
                if layer.bias is not None and layer.bias.requires_grad:
                    grad_sums.append(weights @ d)
                continue
            groups = layer.groups if isinstance(layer, nn.Conv2d) else 1
            w = weights if groups == 1 else weights.repeat_interleave(groups)
            wd = d * w.view(-1, *(1,) * (d.dim() - 1))
            if layer.weight.requires_grad:
                if per_example is not None:  # already formed for the norms: Σᵢ wᵢ·gᵢ
                    g = weights @ per_example.reshape(weights.shape[0], -1)
                elif groups == 1:
                    g = wd.reshape(-1, wd.shape[-1]).t() @ a.reshape(-1, a.shape[-1])
                else:  # (B·G, L, ·) -> (G, B·L, ·) and one batched product per group
                    wg = wd.reshape(-1, groups, *wd.shape[1:]).transpose(0, 1).flatten(1, 2)
                    ag = a.reshape(-1, groups, *a.shape[1:]).transpose(0, 1).flatten(1, 2)
                    g = torch.bmm(wg.transpose(1, 2), ag)
                grad_sums.append(g.reshape(layer.weight.shape))
            if layer.bias is not None and layer.bias.requires_grad:
                if groups == 1:
                    grad_sums.append(wd.reshape(-1, wd.shape[-1]).sum(0))
                else:
                    grad_sums.append(wd.reshape(-1, groups, *wd.shape[1:]).sum((0, 2)).reshape(-1))
        return grad_sums
