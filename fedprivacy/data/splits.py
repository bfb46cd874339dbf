"""Seeded, stratified train/test splits: each client's own, and the central (non-federated) one."""

from __future__ import annotations

import numpy as np

from fedprivacy.data.types import ClientData, Dataset
from fedprivacy.errors import InputError


def check_test_fraction(test_fraction: float) -> float:
    """0 (no test set) up to, but excluding, 1."""
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, int | float) or not 0 <= test_fraction < 1:
        raise InputError("test-fraction", test_fraction, "must be a number in [0, 1)")
    return float(test_fraction)


def split_indices(labels: np.ndarray, test_fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Sorted train and test positions; each class goes to test in proportion to its count.

    Shuffling, grouping by class, then taking evenly spaced positions is a stratified sample
    that also works when a class has a single row. With test_fraction > 0 and n >= 2 both sides
    get at least one row.
    """
    n = labels.shape[0]
    num_test = 0 if test_fraction == 0 else min(max(round(test_fraction * n), 1), n - 1)
    order = rng.permutation(n)
    order = order[np.argsort(labels[order], kind="stable")]
    picks = np.floor((np.arange(num_test) + 0.5) * n / max(num_test, 1)).astype(np.int64)
    return np.sort(np.delete(order, picks)), np.sort(order[picks])


def split_client(client_id: str, dataset: Dataset, test_fraction: float, rng: np.random.Generator) -> ClientData:
    """One client's train/test pair from its rows."""
    train, test = split_indices(dataset.labels, test_fraction, rng)
    return ClientData(client_id=client_id, train=dataset.subset(train), test=dataset.subset(test))


def central_split(dataset: Dataset, test_fraction: float = 0.2, seed: int = 0) -> ClientData:
    """The non-federated baseline: the whole dataset as one client named "central"."""
    rng = np.random.default_rng(seed)
    return split_client("central", dataset, check_test_fraction(test_fraction), rng)
