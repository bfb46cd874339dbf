"""The two shapes data takes once loaded: a whole dataset, and one client's train/test pair."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class Dataset:
    """Examples ready for a model: features float32 [n, d] (or [n, 1, 8, 8] images), labels int64 [n].

    `groups` holds each row's natural client (e.g. its PUMA) when the source has one, so that
    the `natural` partition scheme needs nothing but the dataset.
    """

    features: np.ndarray
    labels: np.ndarray
    feature_names: tuple[str, ...]
    num_classes: int
    name: str
    groups: np.ndarray | None = None
    group_name: str | None = None

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def subset(self, indices: np.ndarray) -> Dataset:
        """The rows at `indices`, as fresh arrays (the caller may modify them freely)."""
        return dataclasses.replace(
            self,
            features=self.features[indices],
            labels=self.labels[indices],
            groups=None if self.groups is None else self.groups[indices],
        )


@dataclass(frozen=True, eq=False)
class ClientData:
    """One client's local data: it trains on `train` (its N for privacy planning) and evaluates on `test`."""

    client_id: str
    train: Dataset
    test: Dataset

    @property
    def num_examples(self) -> int:
        """N, the local training set size that DP planning and FedAvg weighting use."""
        return len(self.train)
