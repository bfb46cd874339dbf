"""LayerNorm and GroupNorm with an elementwise affine: y = x̂·γ + β, x̂ normalised within each example
(unlike BatchNorm, which normalises with statistics of the batch and is refused). Example i's
gradients are Σ dᵢ⊙x̂ᵢ for γ and Σ dᵢ for β, summed over the positions that share a γ entry; they
are as small as γ and β, so they are formed outright (`PerExampleRule`), with x̂ recomputed from the
layer's input as the layer computes it."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from fedprivacy.training.layers.per_example import PerExampleRule
from fedprivacy.training.norms import UnsupportedLayerError


def _affine_grads(module: nn.Module, normalised: Tensor, d: Tensor, shape: tuple[int, ...], dim: int) -> list[Tensor]:
    """Per-example gradients of γ (weight) and β (bias), each trained one: x̂ and D reshaped to `shape`,
    summed over the positions that share an entry of γ, dimension `dim`."""
    grads = []
    if module.weight is not None and module.weight.requires_grad:
        grads.append((d * normalised).reshape(shape).sum(dim))
    if module.bias is not None and module.bias.requires_grad:
        grads.append(d.reshape(shape).sum(dim))
    return grads


class LayerNormRule(PerExampleRule):
    """nn.LayerNorm(elementwise_affine=True), over trailing dimensions of a batched input."""

    parameters = ("weight", "bias")

    def per_example(self, module: nn.Module, a: Tensor, d: Tensor) -> list[Tensor]:
        normalised_dims = len(module.normalized_shape)
        if a.dim() <= normalised_dims:
            raise UnsupportedLayerError(
                f"LayerNorm{tuple(module.normalized_shape)} normalises over all {a.dim()} dimensions of its input, "
                "the batch dimension included, so one example's output depends on the others; normalise over "
                "the trailing (per-example) dimensions only"
            )
        normalised = F.layer_norm(a, module.normalized_shape, None, None, module.eps)
        return _affine_grads(module, normalised, d, (a.shape[0], -1, *module.normalized_shape), 1)


class GroupNormRule(PerExampleRule):
    """nn.GroupNorm(affine=True) on (batch, channels, *) input: γ and β are per channel."""

    parameters = ("weight", "bias")

    def per_example(self, module: nn.Module, a: Tensor, d: Tensor) -> list[Tensor]:
        normalised = F.group_norm(a, module.num_groups, None, None, module.eps)
        return _affine_grads(module, normalised, d, (a.shape[0], module.num_channels, -1), 2)
