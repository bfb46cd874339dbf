"""The model zoo: logistic regression, a small MLP and a small CNN, built by name.

Every model here is made only of layers the DP trainer can clip per example (Linear, Conv2d and
parameter-free layers), and none mixes examples within a batch (no BatchNorm), so per-example
gradients are well defined.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from fedprivacy.data.types import Dataset


class AsImage(nn.Module):
    """Reshape flat rows of side² features to 1×side×side images; pass images through.

    Lets tabular loaders (one row of 64 pixels) and image loaders (1×8×8) feed the same CNN.
    """

    def __init__(self, side: int) -> None:
        super().__init__()
        self.side = side

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 2:
            return x.reshape(x.shape[0], 1, self.side, self.side)
        return x


def logreg(num_features: int, num_classes: int) -> nn.Module:
    """Multinomial logistic regression: one Linear layer on the flattened input."""
    return nn.Sequential(nn.Flatten(), nn.Linear(num_features, num_classes))


def mlp(num_features: int, num_classes: int, hidden: int = 64) -> nn.Module:
    """One hidden ReLU layer: the smallest model that is not linear in its input."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(num_features, hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )


def cnn(num_features: int, num_classes: int) -> nn.Module:
    """Two 3×3 conv blocks for small square one-channel images (8×8 digits: 64 features)."""
    side = math.isqrt(num_features)
    if side * side != num_features or side < 4 or side % 4:
        raise ValueError(
            f"num_features={num_features}: the cnn needs a square image whose side is a "
            "multiple of 4 (e.g. 64 for 8×8 digits)"
        )
    return nn.Sequential(
        AsImage(side),
        nn.Conv2d(1, 16, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * (side // 4) ** 2, num_classes),
    )


MODELS: dict[str, Callable[[int, int], nn.Module]] = {"logreg": logreg, "mlp": mlp, "cnn": cnn}


def build_model(name: str, num_features: int, num_classes: int) -> nn.Module:
    """The model called `name` for inputs of `num_features` and `num_classes` classes.

    Binary problems use num_classes=2 (two-class cross-entropy), so one loss serves all.
    """
    if name not in MODELS:
        raise ValueError(f"model={name!r}: unknown model; known models are {', '.join(MODELS)}")
    if num_features < 1 or num_classes < 2:
        raise ValueError(f"num_features={num_features}, num_classes={num_classes}: need >= 1 feature and >= 2 classes")
    return MODELS[name](num_features, num_classes)


def evaluate_model(model: nn.Module, dataset: Dataset) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of `model` on `dataset`."""
    dev = next(model.parameters()).device
    model.eval()
    with torch.no_grad():
        features = torch.as_tensor(dataset.features, dtype=torch.float32, device=dev)
        labels = torch.as_tensor(dataset.labels, dtype=torch.long, device=dev)
        logits = model(features)
        loss = nn.functional.cross_entropy(logits, labels).item()
        accuracy = (logits.argmax(dim=1) == labels).float().mean().item()
    return float(loss), float(accuracy)
