"""Linear layers by book-keeping (Bu et al.): example i's gradient is Dᵢᵀ·Aᵢ (+ Σₜ Dᵢₜ for the bias),
so its norm and the clipped sum (w⊙D)ᵀA come from A and D without per-example gradients.

`positional_norms` and `positional_sums` also serve convolutions: a convolution is a Linear map
applied at every output position to that position's input patch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn

from fedprivacy.training.layers.base import LayerRule, LayerTerms
from fedprivacy.training.norms import (
    Slack,
    ToFloat64,
    _conservative,
    _fresh_float64,
    _norms64,
    _rounding,
    gram64,
    materialised_slack,
)


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


class Positional(NamedTuple):
    """A layer's norm bounds and slack over positions, and the per-example gradients of its weight
    (R, O, K) and bias (R, O) where they were formed (None where the sums use A and D)."""

    sq_norms: Tensor
    slack: Slack
    per_example: Tensor | None
    bias_per_example: Tensor | None


def gram_is_cheaper(positions: int, k: int, o: int) -> bool:
    """Whether to take the Gram form (T²·(K + O) multiply-adds per example, in float64) rather than
    form the per-example gradients (T·K·O, then a float64 norm of K·O entries): when its products
    are no larger, T² ≤ K·O. Kept although float64 arithmetic costs more: on the digits CNN's second
    convolution (T, K, O = 16, 144, 32) forming them was 1.9× faster alone at 1,400 rows on 2 CPU
    cores, but the fast engine's round 1.2-1.7× slower with them (their float64 copy and the sums'
    traffic; measured 2026-11-26)."""
    return positions * positions <= k * o


def takes_gram_form(module: nn.Module, positions: int, k: int, o: int) -> bool:
    """Whether `positional_norms` bounds this layer's norms by the Gram form: its weight is trained,
    it sees several positions and the Gram form is the cheaper (else A is read, if at all, only to
    form the per-example gradients or, at one position, its rows' norms)."""
    return module.weight.requires_grad and positions > 1 and gram_is_cheaper(positions, k, o)


def positional_norms(module: nn.Module, a: Tensor, d: Tensor, to64: ToFloat64 = _fresh_float64) -> Positional:
    """Upper bounds on ‖DᵢᵀAᵢ‖² (+ ‖Σₜ Dᵢₜ‖² for the bias) as summed, for A: (R, T, K), D: (R, T, O),
    by the cheaper of the Gram ("ghost") form and the per-example gradients (`gram_is_cheaper`),
    which are then returned too; and each row's absolute slack (see `clip_weights`). All in float64."""
    t, k, o = a.shape[1], a.shape[2], d.shape[2]
    u, eta = _rounding(d.dtype)
    weight = module.weight.requires_grad
    bias = module.bias is not None and module.bias.requires_grad
    if takes_gram_form(module, t, k, o):  # the Gram form, in float64
        gram_a, gram_d = gram64(a, to64, (module, "a")), gram64(d, to64, (module, "d"))
        if bias:
            gram_a += 1.0  # (aₜ, 1)·(aₛ, 1): the bias multiplies a constant 1
        # The diagonals are the positions' squared norms ‖(aₜ, 1)‖², ‖dₜ‖².
        n_a, n_d = gram_a.diagonal(dim1=1, dim2=2).sqrt(), gram_d.diagonal(dim1=1, dim2=2).sqrt()
        estimate = torch.linalg.vecdot(gram_a.flatten(1), gram_d.flatten(1))  # ⟨AAᵀ, DDᵀ⟩ ≈ ‖G‖²
        s = torch.linalg.vecdot(n_d, n_a)  # Sᵢ = Σₜ ‖dₜ‖‖(aₜ, 1)‖ ≥ ‖Σₜ dₜ(aₜ, 1)ᵀ‖
        return Positional(_conservative(estimate, s, t, k + 1, o, u), _positions_slack(n_a, t, k, o, eta), None, None)
    if t == 1:  # one position: ‖d(a, 1)ᵀ‖ = ‖d‖‖(a, 1)‖ exactly, no cancellation
        n_d = _norms64(d, to64, (module, "d")).squeeze(1)
        if weight:  # ‖(a, 1)‖ over the trained parts
            n_a = _norms64(a, to64, (module, "a")).squeeze(1)
            n_a = n_a.square().add_(1.0).sqrt_() if bias else n_a
        else:
            n_a = torch.ones_like(n_d)
        return Positional((n_d * n_a).square(), _positions_slack(n_a.unsqueeze(1), t, k, o, eta), None, None)
    # Several positions: the per-example gradients are formed, and their norms are those of the very
    # tensors summed (exact in float64); the sums weight them entry by entry (`materialised_slack`).
    per_example = torch.bmm(d.transpose(1, 2), a) if weight else None
    bias_per_example = d.sum(1) if bias else None
    formed = [g.flatten(1) for g in (per_example, bias_per_example) if g is not None]
    flat = formed[0] if len(formed) == 1 else torch.cat(formed, dim=1)
    sq = _norms64(flat, to64, (module, "g")).square()
    return Positional(
        sq, materialised_slack(a.shape[0], flat.shape[1], d.dtype, d.device), per_example, bias_per_example
    )


def _positions_slack(n_a: Tensor, t: int, k: int, o: int, eta: float) -> Slack:
    """The slack of an (R, T) layer summed from A and D: the sums form fl(w·dₜ) (an error ≤ η per
    entry, amplified by ‖(aₜ, 1)‖), then the products (≤ η each, unamplified); doubled for the rest."""
    return Slack(n_a.sum(1), 2 * eta * math.sqrt(o), 2 * eta * (t + 1) * math.sqrt(o * (k + 1)))


def positional_sums(
    module: nn.Module,
    a: Tensor,
    d: Tensor,
    per_example: Tensor | None,
    bias_per_example: Tensor | None,
    weights: Tensor,
    groups: int = 1,
) -> list[Tensor]:
    """Per client Σᵢ wᵢ·DᵢᵀAᵢ (and Σᵢ wᵢ·Σₜ Dᵢₜ for the bias) for A: (R·G, T, K), D: (R·G, T, O/G),
    G groups per example, as [K, O, K] (the weight, in A's column order) and [K, O] (the bias): from
    the per-example gradients where they were formed, else one batched product over clients (and
    groups)."""
    clients, batch = weights.shape
    weight = module.weight.requires_grad
    bias = module.bias is not None and module.bias.requires_grad
    sums = []
    wd = None
    if (weight and per_example is None) or (bias and bias_per_example is None):  # summed from A and D
        wd = d.view(-1, groups, *d.shape[1:]) * weights.view(-1, 1, 1, 1)  # (R, G, T, O/G)
    if weight:
        if per_example is not None:
            g = torch.bmm(weights.unsqueeze(1), per_example.reshape(clients, batch, -1))
        elif groups == 1:
            g = torch.bmm(wd.reshape(clients, -1, wd.shape[-1]).transpose(1, 2), a.reshape(clients, -1, a.shape[-1]))
        else:  # (K·G, B·T, ·): one product per client and group
            wg = wd.unflatten(0, (clients, batch)).transpose(1, 2).reshape(clients * groups, -1, wd.shape[-1])
            ag = a.unflatten(0, (clients, batch, groups)).transpose(1, 2).reshape(clients * groups, -1, a.shape[-1])
            g = torch.bmm(wg.transpose(1, 2), ag)
        sums.append(g.reshape(clients, module.weight.shape[0], -1))
    if bias:
        if bias_per_example is not None:
            b = torch.bmm(weights.unsqueeze(1), bias_per_example.reshape(clients, batch, -1)).squeeze(1)
        else:
            b = wd.reshape(clients, batch, groups, -1, wd.shape[-1]).sum((1, 3)).reshape(clients, -1)
        sums.append(b)
    return sums


class LinearRule(LayerRule):
    """nn.Linear, on input of any rank: the last dimension is the features, the others positions."""

    parameters = ("weight", "bias")

    def terms(self, module: nn.Module, a: Tensor, d: Tensor, to64: ToFloat64) -> LayerTerms:
        if a.dim() == 2 and module.weight.requires_grad and module.bias is not None and module.bias.requires_grad:
            # The common case in closed form: ‖gᵢ‖² = ‖dᵢ‖²‖aᵢ‖² + ‖dᵢ‖² (weight, then bias).
            sq, slack = linear_norms(a, d, to64, module)
            return LayerTerms(sq, slack, (a, d, None, None))
        rows = a.shape[0]
        a = a.reshape(rows, -1, a.shape[-1])
        d = d.reshape(rows, -1, d.shape[-1])
        formed = positional_norms(module, a, d, to64)
        return LayerTerms(formed.sq_norms, formed.slack, (a, d, formed.per_example, formed.bias_per_example))

    def weighted_sums(self, module: nn.Module, terms: LayerTerms, weights: Tensor) -> list[Tensor]:
        a, d, per_example, bias_per_example = terms.state
        if a.dim() > 2:
            return positional_sums(module, a, d, per_example, bias_per_example, weights)
        # Plain 2-D input, weight and bias trained: weight the narrower side; the bias is Σ w·d.
        clients = weights.shape[0]
        rows = weights.view(-1, 1)
        if clients == 1:  # the trainer's case: plain matrix products (a batched one of one costs more)
            if d.shape[1] <= a.shape[1]:
                wd = d * rows
                return [(wd.t() @ a).unsqueeze(0), wd.sum(0, keepdim=True)]
            return [(d.t() @ (a * rows)).unsqueeze(0), weights @ d]
        if d.shape[1] <= a.shape[1]:
            wd = (d * rows).view(clients, -1, d.shape[1])
            return [torch.bmm(wd.transpose(1, 2), a.reshape(clients, -1, a.shape[1])), wd.sum(1)]
        d = d.reshape(clients, -1, d.shape[1])
        g = torch.bmm(d.transpose(1, 2), (a * rows).view(clients, -1, a.shape[1]))
        return [g, torch.bmm(weights.unsqueeze(1), d).squeeze(1)]
