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


UNDECLARED_CLASSES = (
    "the number of classes must be declared, not read from the labels: the largest label would set "
    "the model's output size, which every client sends, so one record could decide it. Set num-classes "
    "in the run config (num_classes= when loading in Python)"
)


def declared_classes(field: str, value: object) -> int:
    """A declared number of classes: an integer in [2, MAX_CLASSES]."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not 2 <= int(value) <= MAX_CLASSES:
        raise InputError(field, value, f"must be an integer from 2 to {MAX_CLASSES}")
    return int(value)


def class_labels(
    values: np.ndarray, field: str, source: str, n: int, num_classes: int | None
) -> tuple[np.ndarray, int]:
    """Integer labels [n] as int64, each in [0, num_classes).

    K is declared (by the caller, or by the file's own metadata), never read from the labels: a
    file whose labels set K would let one record decide the model's shape (docs/data.md).
    """
    if values.shape != (n,):
        raise InputError(field, list(values.shape), f"{source}: needs one integer label per example, shape [{n}]")
    if not np.issubdtype(values.dtype, np.integer) or values.dtype == np.bool_:
        raise InputError(field, str(values.dtype), f"{source}: labels must be integers (class 0, 1, …)")
    if num_classes is None:
        raise InputError("num-classes", 0, f"{source}: {UNDECLARED_CLASSES}")  # 0: the run config's unset
    num_classes = declared_classes("num-classes", num_classes)
    labels = values.astype(np.int64)
    bad = (labels < 0) | (labels >= num_classes)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        where = f"{source}: example {row}'s label"
        raise InputError(field, int(labels[row]), f"{where} is outside [0, {num_classes}), the declared classes")
    return labels, num_classes


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
