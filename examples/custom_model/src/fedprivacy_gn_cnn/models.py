"""gn-cnn: two 3×3 conv blocks with GroupNorm, for 8×8 digits or any image with sides of 4 or more.

DP-SGD clips each example's gradient, so no layer may mix the examples of a batch: BatchNorm does,
GroupNorm (Wu and He, 2018) normalises each example over groups of its own channels and does not,
which is why DP-SGD models use it in BatchNorm's place.
"""

from __future__ import annotations

import math

from torch import nn


def image_shape(input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(C, H, W) of one example: a flat row of side² features is a one-channel square image."""
    if len(input_shape) == 1 and math.isqrt(input_shape[0]) ** 2 == input_shape[0]:
        side = math.isqrt(input_shape[0])
        input_shape = (1, side, side)
    if len(input_shape) != 3 or min(input_shape[1:]) < 4:
        raise ValueError(
            f"input_shape={input_shape}: gn-cnn needs an image (C, H, W) or a flat square image (d,), sides >= 4"
        )
    channels, height, width = input_shape
    return channels, height, width


def gn_cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The factory fedprivacy calls with one example's shape and the number of classes."""
    channels, height, width = image_shape(input_shape)
    return nn.Sequential(
        nn.Flatten(),  # with Unflatten: flat rows and images alike become (batch, C, H, W)
        nn.Unflatten(1, (channels, height, width)),
        nn.Conv2d(channels, 16, kernel_size=3, padding=1),
        nn.GroupNorm(4, 16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, kernel_size=3, padding=1),
        nn.GroupNorm(8, 32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * (height // 4) * (width // 4), num_classes),  # each pooling halves a side, rounding down
    )
