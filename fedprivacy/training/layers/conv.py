"""Convolutions (Conv1d, Conv2d; grouped, strided, dilated, any padding mode) as Linear maps over
patches: at each of L output positions the layer multiplies its input patch (C/G·k values per group)
by the group's weight, so A is the patches (R·G, L, C/G·k) and D the output gradient (R·G, L, O/G),
and the Linear book-keeping applies per group (`linear.positional_norms`)."""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn

from fedprivacy.training.layers.base import LayerRule, LayerTerms
from fedprivacy.training.layers.linear import positional_norms, positional_sums
from fedprivacy.training.norms import Slack, ToFloat64, UnsupportedLayerError


def patches(module: nn.Conv1d | nn.Conv2d, x: Tensor) -> Tensor:
    """The input patches each output position sees, as one contiguous (R, L, C·k₁·…) tensor.

    Built from strided views (pad, then Tensor.unfold per spatial dimension) and a single copy: on
    CPU F.unfold loops over the batch and was 7-20× slower on the CNN's two layers at batch 256.
    """
    if any(module._reversed_padding_repeated_twice):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, module._reversed_padding_repeated_twice, mode=mode)
    spatial = len(module.kernel_size)
    for dim, (size, dilation, stride) in enumerate(zip(module.kernel_size, module.dilation, module.stride)):
        x = x.unfold(2 + dim, dilation * (size - 1) + 1, stride)
    view = x[(..., *(slice(None, None, dilation) for dilation in module.dilation))]  # (R, C, *out, *kernel)
    rows, channels, out = view.shape[0], view.shape[1], view.shape[2 : 2 + spatial]
    order = (0, *range(2, 2 + spatial), 1, *range(2 + spatial, 2 + 2 * spatial))
    return view.permute(order).reshape(rows, math.prod(out), channels * math.prod(module.kernel_size))


class ConvRule(LayerRule):
    """nn.Conv1d and nn.Conv2d with a batch dimension."""

    def terms(self, module: nn.Module, x: Tensor, d: Tensor, to64: ToFloat64) -> LayerTerms:
        if x.dim() != len(module.kernel_size) + 2:
            raise UnsupportedLayerError(
                f"{type(module).__name__} called on {x.dim()}-D input: per-example clipping needs a batch "
                f"dimension, input (batch, channels, {len(module.kernel_size)} spatial dimensions)"
            )
        rows, groups = x.shape[0], module.groups
        a = patches(module, x)
        if groups > 1:
            a = a.reshape(rows, a.shape[1], groups, -1).transpose(1, 2).reshape(rows * groups, a.shape[1], -1)
        d = d.reshape(rows * groups, d.shape[1] // groups, -1).transpose(1, 2)
        sq, slack, per_example, bias_per_example = positional_norms(module, a, d, to64)
        if groups > 1:  # the groups' squared norms add, and so do their slacks
            sq = sq.view(rows, groups).sum(1)
            slack = Slack(slack.mass.view(rows, groups).sum(1), slack.coefficient, groups * slack.constant)
        return LayerTerms(sq, slack, (a, d, per_example, bias_per_example))

    def weighted_sums(self, module: nn.Module, terms: LayerTerms, weights: Tensor) -> list[Tensor]:
        return positional_sums(module, *terms.state, weights, module.groups)
