"""Convolutions (Conv1d, Conv2d; grouped, strided, dilated, any padding mode) as Linear maps over
patches: at each of L output positions the layer multiplies its input patch (k·C/G values per group)
by the group's weight, so A is the patches (R·G, L, k·C/G) and D the output gradient (R·G, L, O/G),
and the Linear book-keeping applies per group (`linear.positional_norms`). Patches hold each kernel
offset's channels together (`patches`); the weight sums are put back in the weight's own order."""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn

from fedprivacy.training.layers.base import LayerRule, LayerTerms
from fedprivacy.training.layers.linear import positional_norms, positional_sums, takes_gram_form
from fedprivacy.training.norms import Slack, ToFloat64, UnsupportedLayerError


def patches(module: nn.Conv1d | nn.Conv2d, x: Tensor) -> Tensor:
    """The input patches each output position sees, as one contiguous (R, L, G·k₁·…·C/G) tensor:
    per group, the kernel offsets, then the group's channels (`patch_weight` orders a weight alike).

    Built from strided views of the input with its channels last (pad, move the channels last, then
    Tensor.unfold per spatial dimension) and a single copy whose innermost runs are whole channel
    vectors: on CPU F.unfold loops over the batch and was 7-20× slower on the CNN's two layers at
    batch 256, and the channels-first order of the copy 6× slower on the second layer at 1,300 rows.
    """
    spatial = len(module.kernel_size)
    view = _patch_view(module, _padded_channels_last(module, x), 1)  # (R, *out, C, *kernel)
    rows, out = view.shape[0], view.shape[1 : 1 + spatial]
    view = view.unflatten(1 + spatial, (module.groups, -1))  # (R, *out, G, C/G, *kernel)
    group, channels = 1 + spatial, 2 + spatial
    order = (0, *range(1, 1 + spatial), group, *range(3 + spatial, 3 + 2 * spatial), channels)
    return view.permute(order).reshape(rows, math.prod(out), -1)


def offset_patches(module: nn.Conv1d | nn.Conv2d, x: Tensor) -> Tensor:
    """`patches` of an ungrouped convolution with few input channels, as the transposed view of an
    (R, k₁·…·C, L) copy whose innermost runs are output rows: where each patch's channel vector is
    short, `patches`' copy moves a few values per run (the digits CNN's first convolution, one
    channel, 2,560 rows: 2.0 ms, this one 0.6 ms; the per-example product over the view costs 0.2
    ms more). The same values in the same order, only laid out otherwise."""
    if module.groups != 1:
        raise ValueError("offset_patches: an ungrouped convolution only (patches order a group's own)")
    spatial = len(module.kernel_size)
    view = _patch_view(module, _padded(module, x), 2)  # (R, C, *out, *kernel)
    order = (0, *range(2 + spatial, 2 + 2 * spatial), 1, *range(2, 2 + spatial))  # (R, *kernel, C, *out)
    per_patch = module.weight.shape[1:].numel()
    return view.permute(order).reshape(x.shape[0], per_patch, -1).contiguous().transpose(1, 2)


def _padded(module: nn.Conv1d | nn.Conv2d, x: Tensor) -> Tensor:
    """x padded as the layer pads it (its padding mode), channels first."""
    if not any(module._reversed_padding_repeated_twice):
        return x
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(x, module._reversed_padding_repeated_twice, mode=mode)


def _padded_channels_last(module: nn.Conv1d | nn.Conv2d, x: Tensor) -> Tensor:
    """x padded as the layer pads it, as one contiguous (R, *spatial, C) tensor: zeros are padded
    after the channels move last, so that a channels-first x (the trainer's) is copied once, not
    padded and then transposed (a trainer step of the digits CNN 1-5% faster)."""
    pads = module._reversed_padding_repeated_twice
    if module.padding_mode != "zeros" or not any(pads):
        return _padded(module, x).movedim(1, -1).contiguous()
    return F.pad(x.movedim(1, -1), (0, 0, *pads)).contiguous()


def _patch_view(module: nn.Conv1d | nn.Conv2d, x: Tensor, first: int) -> Tensor:
    """Strided views of padded x's patches: x's spatial dimensions from `first` on become the
    output positions, and each patch's kernel offsets are appended last (no copy)."""
    for dim, (size, dilation, stride) in enumerate(zip(module.kernel_size, module.dilation, module.stride)):
        x = x.unfold(first + dim, dilation * (size - 1) + 1, stride)  # (..., *out, ..., *extents)
    return x[(..., *(slice(None, None, dilation) for dilation in module.dilation))]


def _short_channel_runs(module: nn.Conv1d | nn.Conv2d, x: Tensor, d: Tensor) -> bool:
    """Whether `offset_patches` moves longer runs than `patches`: an ungrouped convolution whose
    input rows are contiguous and longer (as output rows, stride 1) than its channel vectors."""
    return (
        module.groups == 1
        and x.stride(-1) == 1
        and all(s == 1 for s in module.stride)
        and module.in_channels < d.shape[-1]
    )


def patch_weight(module: nn.Conv1d | nn.Conv2d) -> Tensor:
    """The weight (O, C/G, *kernel) as (G, O/G, k₁·…·C/G), its columns in the order of `patches`."""
    weight = module.weight.unflatten(0, (module.groups, -1))  # (G, O/G, C/G, *kernel)
    return weight.movedim(2, -1).flatten(2)


def from_patch_order(module: nn.Conv1d | nn.Conv2d, sums: Tensor) -> Tensor:
    """Per-client weight sums [K, O, k₁·…·C/G] in the order of `patches` as [K, O, C/G, *kernel]."""
    return sums.unflatten(2, (*module.kernel_size, -1)).movedim(-1, 2)


class ConvRule(LayerRule):
    """nn.Conv1d and nn.Conv2d with a batch dimension."""

    parameters = ("weight", "bias")

    def terms(self, module: nn.Module, x: Tensor, d: Tensor, to64: ToFloat64) -> LayerTerms:
        if x.dim() != len(module.kernel_size) + 2:
            raise UnsupportedLayerError(
                f"{type(module).__name__} called on {x.dim()}-D input: per-example clipping needs a batch "
                f"dimension, input (batch, channels, {len(module.kernel_size)} spatial dimensions)"
            )
        rows, groups = x.shape[0], module.groups
        positions, k, o = math.prod(d.shape[2:]), module.weight.shape[1:].numel(), d.shape[1] // groups
        if not takes_gram_form(module, positions, k, o) and _short_channel_runs(module, x, d):
            a = offset_patches(module, x)  # only the per-example product reads it: any layout serves
        else:
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
        sums = positional_sums(module, *terms.state, weights, module.groups)
        if module.weight.requires_grad:
            sums[0] = from_patch_order(module, sums[0])
        return sums
