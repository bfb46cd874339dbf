"""The built-in models (logistic regression, a small MLP, a small CNN) and `build_model`, the one
way every engine turns a model's name into a module.

A factory takes one example's shape and the number of classes: `factory(input_shape, num_classes)`,
with `(d,)` for a table row and `(C, H, W)` for an image. Users add their own by name
(fedprivacy/model_registry.py: an entry point or `register_model`). Every built-in is made only
of layers the DP trainer can clip per example (Linear, Conv2d and parameter-free layers), and none
mixes examples within a batch (no BatchNorm), so per-example gradients are well defined.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fedprivacy.data.types import Dataset
from fedprivacy.errors import InputError, did_you_mean
from fedprivacy.model_checks import check_model
from fedprivacy.model_registry import InputShape, ModelFactory, factory_target, model_factory, register_model
from fedprivacy.training import UnsupportedLayerError, check_supported
from fedprivacy.training.isolation import register_rowwise

__all__ = [
    "MODELS",
    "AsImage",
    "build_model",
    "cnn",
    "evaluate_model",
    "evaluation_sums",
    "input_shape",
    "logreg",
    "mlp",
    "register_model",
]


def input_shape(value: Sequence[int] | int) -> InputShape:
    """One example's shape as a tuple: an int d (the older form, a flat row) is (d,)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):  # numpy's integers too
        shape: tuple[object, ...] = (value,)
    else:
        shape = tuple(value) if isinstance(value, Sequence) and not isinstance(value, str) else ()
    if not shape or not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 1 for n in shape):
        raise ValueError(
            f"input_shape={value!r}: must be a feature count >= 1 or a shape of sizes >= 1, e.g. (1, 8, 8)"
        )
    return tuple(int(n) for n in shape)


class AsImage(nn.Module):
    """Reshape each example to `shape` (C, H, W): flat rows of C·H·W features become images and
    images pass through, so tabular loaders (64 pixels a row) and image loaders (1×8×8) feed one CNN."""

    def __init__(self, shape: InputShape) -> None:
        super().__init__()
        self.shape = shape

    def forward(self, x: Tensor) -> Tensor:
        return x.reshape(x.shape[0], *self.shape)


register_rowwise(AsImage)  # a reshape within each row: the built-in CNN runs as one batched forward


def logreg(input_shape_or_features: Sequence[int] | int, num_classes: int) -> nn.Module:
    """Multinomial logistic regression: one Linear layer on the flattened input."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape(input_shape_or_features)), num_classes))


def mlp(input_shape_or_features: Sequence[int] | int, num_classes: int, hidden: int = 64) -> nn.Module:
    """One hidden ReLU layer: the smallest model that is not linear in its input."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape(input_shape_or_features)), hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )


def _image_shape(shape: InputShape) -> InputShape:
    """(C, H, W) for the cnn: a flat row of side² features is one channel of side×side."""
    if len(shape) == 1:
        side = math.isqrt(shape[0])
        image = (1, side, side) if side * side == shape[0] else shape
    else:
        image = shape
    if len(image) != 3 or image[1] % 4 or image[2] % 4:
        raise ValueError(
            f"input_shape={shape}: the cnn needs an image (C, H, W) with H and W multiples of 4, or a square "
            "one-channel image as a flat row (e.g. (64,) or (1, 8, 8) for 8×8 digits)"
        )
    return image


def cnn(input_shape_or_features: Sequence[int] | int, num_classes: int) -> nn.Module:
    """Two 3×3 conv blocks for small images (8×8 digits: (1, 8, 8), or 64 features)."""
    channels, height, width = _image_shape(input_shape(input_shape_or_features))
    return nn.Sequential(
        AsImage((channels, height, width)),
        nn.Conv2d(channels, 16, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * (height // 4) * (width // 4), num_classes),
    )


MODELS: dict[str, ModelFactory] = {"logreg": logreg, "mlp": mlp, "cnn": cnn}  # the built-ins (catalog.MODEL_NAMES)


def build_model(
    name: str,
    input_shape_or_num_features: Sequence[int] | int,
    num_classes: int,
    options: Mapping[str, Any] | None = None,
) -> nn.Module:
    """The model called `name` for examples of the given shape (or feature count) and `num_classes`,
    its factory given `options` as keyword arguments (the run config's `model-options`).

    Binary problems use num_classes=2 (two-class cross-entropy), so one loss serves all. Whatever
    the factory, the result must be a module the trainer can clip per example and give one logit
    per class; every failure names the model, so a user's factory is never blamed on the run.
    """
    shape = input_shape(input_shape_or_num_features)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes={num_classes!r}: need an integer >= 2")
    factory, target = (MODELS[name], factory_target(MODELS[name])) if name in MODELS else model_factory(name)
    options = dict(options or {})
    _check_options(name, target, factory, options)
    try:
        model = factory(shape, num_classes, **options)
    except Exception as error:  # a factory's own failure, for this shape: say which model and which factory
        given = "".join(f", {key}={value!r}" for key, value in options.items())
        raise InputError(
            "model",
            name,
            f"its factory {target} failed for input_shape={shape}, num_classes={num_classes}{given}: "
            f"{type(error).__name__}: {error}",
        ) from error
    if not isinstance(model, nn.Module):
        raise InputError(
            "model", name, f"its factory {target} returned a {type(model).__name__}, not a torch.nn.Module"
        )
    try:
        check_supported(model)
    except UnsupportedLayerError as error:
        raise UnsupportedLayerError(f"model={name!r} (factory {target}): {error}") from None
    checked = (factory, shape, num_classes, tuple(sorted(options.items())))
    if checked not in _CHECKED:  # once per process: engines rebuild per client
        check_model(name, target, model, shape, num_classes)
        _CHECKED.add(checked)
    return model


_CHECKED: set[tuple[Any, ...]] = set()


def _check_options(name: str, target: str, factory: ModelFactory, options: Mapping[str, Any]) -> None:
    """Refuse, naming the model and what its factory takes, an option that is not one of the
    factory's keyword parameters (the shape and class count are the run's, never an option)."""
    try:
        parameters = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):  # a callable without a signature: let the call decide
        return
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return
    named = [p.name for p in parameters[2:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in options:
        if key not in named:
            takes = f"takes {', '.join(named)}" if named else "takes no options"
            raise InputError(
                "model-options",
                ",".join(f"{k}={v}" for k, v in options.items()),
                f"model {name}'s factory {target} {takes}, not {key}{did_you_mean(key, named)}",
            )


EVALUATION_ROWS = 1024  # rows per forward pass when evaluating


def evaluation_sums(model: nn.Module, features: Tensor, labels: Tensor) -> tuple[int, float, int]:
    """(rows, summed cross-entropy, correct predictions) of `model` in evaluation mode on the rows,
    `EVALUATION_ROWS` at a time (on 2 CPU cores the digits CNN took 422 ms for 40,000 rows in one
    pass and 135 ms in 1,024-row pieces), the loss summed in float64: the server's central test set
    and each simulated client's own test rows alike."""
    model.eval()
    loss = torch.zeros((), dtype=torch.float64, device=features.device)
    correct = torch.zeros((), dtype=torch.long, device=features.device)
    with torch.no_grad():
        for x, y in zip(features.split(EVALUATION_ROWS), labels.split(EVALUATION_ROWS), strict=True):
            logits = model(x)
            loss += nn.functional.cross_entropy(logits, y, reduction="sum").double()
            correct += (logits.argmax(dim=1) == y).sum()
    return len(labels), float(loss), int(correct)


def evaluate_model(model: nn.Module, dataset: Dataset) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of `model` on `dataset` (NaN for no rows)."""
    dev = next(model.parameters()).device
    features = torch.as_tensor(dataset.features, dtype=torch.float32, device=dev)
    labels = torch.as_tensor(dataset.labels, dtype=torch.long, device=dev)
    rows, loss, correct = evaluation_sums(model, features, labels)
    if rows == 0:
        return math.nan, math.nan
    return loss / rows, correct / rows
