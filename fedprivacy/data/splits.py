"""Seeded, stratified splits: each client's train/test split (and, for tuning, a validation split
cut from its training rows), and the central (non-federated) one."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedprivacy.data.types import ClientData, Dataset
from fedprivacy.errors import InputError


def check_test_fraction(test_fraction: float) -> float:
    """0 (no test set) up to, but excluding, 1."""
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, int | float) or not 0 <= test_fraction < 1:
        raise InputError("test-fraction", test_fraction, "must be a number in [0, 1)")
    return float(test_fraction)


VALIDATION_STREAM = 1  # the validation split's seed is (seed, position, this): the test split's stays (seed, position)


def check_validation_fraction(validation_fraction: float) -> float:
    """0 (no validation split: evaluate on the test rows) up to, but excluding, 1."""
    if (
        isinstance(validation_fraction, bool)
        or not isinstance(validation_fraction, int | float)
        or not 0 <= validation_fraction < 1
    ):
        raise InputError("validation-fraction", validation_fraction, "must be a number in [0, 1)")
    return float(validation_fraction)


def held_out_count(n: int, fraction: float) -> int:
    """How many of n rows a split with `fraction` holds out: none for 0, else at least 1 and at most n - 1."""
    return 0 if fraction == 0 else min(max(round(fraction * n), 1), n - 1)


def split_indices(labels: np.ndarray, test_fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Sorted train and test positions; each class goes to test in proportion to its count.

    Shuffling, grouping by class, then taking evenly spaced positions is a stratified sample
    that also works when a class has a single row: a class's held-out count is within one row of
    `fraction` × its count, so a class of at least n / held-out rows is always held out at least
    once. With test_fraction > 0 and n >= 2 both sides get at least one row.
    """
    n = labels.shape[0]
    num_test = held_out_count(n, test_fraction)
    order = rng.permutation(n)
    order = order[np.argsort(labels[order], kind="stable")]
    picks = np.floor((np.arange(num_test) + 0.5) * n / max(num_test, 1)).astype(np.int64)
    return np.sort(np.delete(order, picks)), np.sort(order[picks])


def train_and_evaluation_rows(
    labels: np.ndarray, test_fraction: float, validation_fraction: float, seed: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted positions (into `labels`) a client trains on and is evaluated on.

    Without validation (`validation_fraction` 0): its train and test splits. With it: its training
    rows split again, by the same stratified rule under a seed of their own, into fit rows (trained
    on) and validation rows (evaluated on); the test rows are then returned to no one, so tuning
    can never read them. The test split's seed is `seed` either way, so the test rows do not depend
    on whether a run validates.
    """
    train, test = split_indices(labels, test_fraction, np.random.default_rng(list(seed)))
    if validation_fraction == 0:
        return train, test
    rng = np.random.default_rng([*seed, VALIDATION_STREAM])
    fit, validation = split_indices(labels[train], validation_fraction, rng)
    return train[fit], train[validation]


def split_client(client_id: str, dataset: Dataset, test_fraction: float, rng: np.random.Generator) -> ClientData:
    """One client's train/test pair from its rows."""
    train, test = split_indices(dataset.labels, test_fraction, rng)
    return ClientData(client_id=client_id, train=dataset.subset(train), test=dataset.subset(test))


def central_split(dataset: Dataset, test_fraction: float = 0.2, seed: int = 0) -> ClientData:
    """The non-federated baseline: the whole dataset as one client named "central"."""
    rng = np.random.default_rng(seed)
    return split_client("central", dataset, check_test_fraction(test_fraction), rng)
