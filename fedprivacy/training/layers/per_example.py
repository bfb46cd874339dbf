"""Rules for layers whose per-example gradients are small enough to form outright (a norm's γ and β,
a user's per-feature scale): the rule gives them, this class does the numerics.

The norm is that of the very tensor that is summed, taken in float64 (exact: no cancellation, no
underflow), and the sums weight it entry by entry, so the only rounding left to cover is a product
w·g that falls into float32's subnormal range (`norms.materialised_slack`).
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import Tensor, nn

from fedprivacy.training.layers.base import LayerRule, LayerTerms, trainable
from fedprivacy.training.norms import ToFloat64, _norms64, materialised_slack


class PerExampleRule(LayerRule):
    """A rule from materialised per-example gradients: subclasses implement `per_example`."""

    @abstractmethod
    def per_example(self, module: nn.Module, a: Tensor, d: Tensor) -> list[Tensor]:
        """Each trained parameter's per-example gradients, [R, *param.shape] (named_parameters
        order, requires_grad only), from the layer's input `a` and output gradient `d`."""

    def terms(self, module: nn.Module, a: Tensor, d: Tensor, to64: ToFloat64) -> LayerTerms:
        rows = a.shape[0]
        grads = self.per_example(module, a, d)
        flat = torch.cat([g.reshape(rows, -1) for g in grads], dim=1) if len(grads) > 1 else grads[0].reshape(rows, -1)
        sq = _norms64(flat, to64, (module, "g")).square()
        return LayerTerms(sq, materialised_slack(rows, flat.shape[1], flat.dtype, flat.device), flat)

    def weighted_sums(self, module: nn.Module, terms: LayerTerms, weights: Tensor) -> list[Tensor]:
        clients = weights.shape[0]
        flat: Tensor = terms.state
        sums = torch.bmm(weights.unsqueeze(1), flat.view(clients, -1, flat.shape[1])).squeeze(1)  # [K, P]
        shapes = [p.shape for _, p in trainable(module)]
        parts = sums.split([s.numel() for s in shapes], dim=1)
        return [part.reshape(clients, *shape) for part, shape in zip(parts, shapes, strict=True)]
