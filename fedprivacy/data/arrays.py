"""Checks shared by the array sources (npz, Hugging Face datasets, CIFAR batches): what a file's
arrays must be before they become a `Dataset`, refused with the file and the array named.

CSV tables have their own checks (fedprivacy/data/tables.py), cell by cell; these work on whole
arrays, so a message names the array and the first bad example.
"""

from __future__ import annotations

import numpy as np

from fedprivacy.data.tables import MAX_CLASSES
from fedprivacy.errors import InputError


def example_count(values: np.ndarray, field: str, source: str) -> int:
    """n, the examples of a features array, which needs at least 2 (a client needs a train and a test row)."""
    if values.ndim < 1 or values.shape[0] < 2:
        raise InputError(field, list(values.shape), f"{source} needs at least 2 examples along its first axis")
    return int(values.shape[0])


def float_features(values: np.ndarray, field: str, source: str) -> np.ndarray:
    """Numeric features [n, ...] as float32: finite after the cast, or refused at their first bad example.

    A one-number-per-example array [n] becomes [n, 1], as every model expects one row per example.
    """
    if values.dtype == np.bool_ or not np.issubdtype(values.dtype, np.number) or np.iscomplexobj(values):
        raise InputError(field, str(values.dtype), f"{source}: features must be real numbers (int or float)")
    example_count(values, field, source)
    with np.errstate(over="ignore"):  # a value beyond float32 becomes inf, refused just below
        features = values.astype(np.float32)
    if features.ndim == 1:
        features = features[:, None]
    finite = np.isfinite(features.reshape(features.shape[0], -1)).all(axis=1)
    if not finite.all():
        row = int(np.flatnonzero(~finite)[0])
        raise InputError(field, f"example {row}", f"{source}: a feature is NaN or infinite as float32; fix or drop it")
    return features


def pixels(values: np.ndarray) -> np.ndarray:
    """8-bit images [n, C, H, W] as float32 in [0, 1], the scale the built-in digits use."""
    return values.astype(np.float32) / np.float32(255.0)


def class_labels(
    values: np.ndarray, field: str, source: str, n: int, num_classes: int | None = None
) -> tuple[np.ndarray, int]:
    """Integer labels [n] as int64 and the number of classes K: the metadata's when it declares one,
    else the largest label + 1. Labels must lie in [0, K) with K in [2, MAX_CLASSES]."""
    if values.shape != (n,):
        raise InputError(field, list(values.shape), f"{source}: needs one integer label per example, shape [{n}]")
    if not np.issubdtype(values.dtype, np.integer) or values.dtype == np.bool_:
        raise InputError(field, str(values.dtype), f"{source}: labels must be integers (class 0, 1, …)")
    labels = values.astype(np.int64)
    largest = int(labels.max()) if labels.size else -1
    limit = num_classes if num_classes is not None else min(largest + 1, MAX_CLASSES)
    bad = (labels < 0) | (labels >= limit)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        classes = "its declared classes" if num_classes is not None else "the classes allowed"
        raise InputError(field, int(labels[row]), f"{source}: example {row}'s label is outside [0, {limit}), {classes}")
    classes = limit if num_classes is not None else largest + 1
    if classes < 2:
        raise InputError(field, classes, f"{source}: a classifier needs at least two classes")
    return labels, classes


def client_groups(values: np.ndarray, field: str, source: str, n: int) -> np.ndarray:
    """Each example's natural client (ids of any kind, none missing), for the `natural` partition."""
    if values.shape != (n,):
        raise InputError(field, list(values.shape), f"{source}: needs one client id per example, shape [{n}]")
    if values.dtype.kind == "f" and np.isnan(values).any():
        row = int(np.flatnonzero(np.isnan(values))[0])
        raise InputError(field, f"example {row}", f"{source}: a client id is missing (NaN); every example needs one")
    if values.dtype.kind == "O" and any(v is None for v in values):
        row = next(i for i, v in enumerate(values) if v is None)
        raise InputError(field, f"example {row}", f"{source}: a client id is missing; every example needs one")
    return values


def feature_names(shape: tuple[int, ...]) -> tuple[str, ...]:
    """One name per feature of an example of `shape`: x0, x1, … for rows, x<c>_<y>_<x> for images."""
    if len(shape) == 1:
        return tuple(f"x{i}" for i in range(shape[0]))
    return tuple("x" + "_".join(map(str, index)) for index in np.ndindex(*shape))
