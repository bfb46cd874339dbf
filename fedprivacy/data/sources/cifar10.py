"""CIFAR-10 in its "python version" layout (Krizhevsky 2009): the folder cifar-10-batches-py.

Each batch is a pickled dict: b"data" uint8 [n, 3072] (1,024 red, then green, then blue values,
each a 32x32 image row by row) and b"labels" (n integers); batches.meta holds b"label_names".
The pickles are read by `fedprivacy.data.safe_pickle`, which refuses any callable but NumPy's
array reconstruction: the folder may be named by an untrusted run config.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from fedprivacy.data.arrays import class_labels, feature_names, pixels
from fedprivacy.data.registry import Source
from fedprivacy.data.safe_pickle import load_arrays
from fedprivacy.data.types import Dataset
from fedprivacy.errors import InputError

SPLITS = {"train": tuple(f"data_batch_{i}" for i in range(1, 6)), "test": ("test_batch",)}
META = "batches.meta"
IMAGE = (3, 32, 32)
INT64_MIN, INT64_MAX = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)
LAYOUT = "a CIFAR-10 python folder holds data_batch_1 … data_batch_5, test_batch and batches.meta"


def _entry(batch: object, key: bytes, file: Path) -> object:
    if not isinstance(batch, dict) or key not in batch:
        raise InputError("data", str(file), f"is not a CIFAR-10 batch: it needs a dict with key {key!r}")
    return batch[key]


def _batch(file: Path) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 images [n, 3, 32, 32], labels [n]) of one batch file, checked against the layout."""
    batch = load_arrays(file, "a CIFAR-10 batch")
    data = _entry(batch, b"data", file)
    if (
        not isinstance(data, np.ndarray)
        or data.dtype != np.uint8
        or data.ndim != 2
        or data.shape[1] != math.prod(IMAGE)
    ):
        shown = f"{data.dtype} {list(data.shape)}" if isinstance(data, np.ndarray) else type(data).__name__
        raise InputError("data", str(file), f"its b'data' is {shown}; CIFAR-10 batches hold uint8 [n, 3072]")
    labels = _entry(batch, b"labels", file)
    # The type, length and range are checked before any conversion: a pickle can make a list of n
    # references to one huge bytes object for a few bytes of file, and np.asarray of it would ask for n
    # times its size; an integer beyond int64 would overflow.
    if isinstance(labels, list) and all(type(label) is int and INT64_MIN <= label <= INT64_MAX for label in labels):
        labels = np.asarray(labels, dtype=np.int64)
    if (
        not isinstance(labels, np.ndarray)
        or labels.shape != (data.shape[0],)
        or not np.issubdtype(labels.dtype, np.integer)
    ):
        raise InputError("data", str(file), f"its b'labels' must be {data.shape[0]} integers, one per image of b'data'")
    return data.reshape(-1, *IMAGE), labels


def _num_classes(folder: Path) -> int:
    names = _entry(load_arrays(folder / META, "the CIFAR-10 metadata"), b"label_names", folder / META)
    if not isinstance(names, list) or len(names) < 2:
        raise InputError("data", str(folder / META), "its b'label_names' must be a list of at least 2 class names")
    return len(names)


def load_cifar10(path: Path | None = None, split: str | None = None) -> Dataset:
    """The images of `split` ("train": the five data batches, "test": test_batch; None: both, train
    first) as float32 [n, 3, 32, 32] in [0, 1], labels int64, classes from batches.meta."""
    if path is None or not path.is_dir():
        shown = None if path is None else str(path)
        raise InputError("path", shown, "the cifar10 dataset needs path=<the cifar-10-batches-py folder>")
    if split is not None and split not in SPLITS:
        raise InputError("split", split, f"must be one of: {', '.join(SPLITS)} (or unset: both)")
    names = [META, *(name for key, files in SPLITS.items() if split in (None, key) for name in files)]
    missing = [name for name in names if not (path / name).is_file()]
    if missing:
        raise InputError("data", str(path), f"has no {missing[0]}: {LAYOUT}")
    num_classes = _num_classes(path)
    batches = [_batch(path / name) for name in names[1:]]
    images = np.concatenate([images for images, _ in batches])
    labels, _ = class_labels(
        np.concatenate([labels for _, labels in batches]), "labels", str(path), len(images), num_classes
    )
    return Dataset(
        features=pixels(images),
        labels=labels,
        feature_names=feature_names(IMAGE),
        num_classes=num_classes,
        name="cifar10" if split is None else f"cifar10:{split}",
    )


SOURCE = Source(
    name="cifar10",
    summary="CIFAR-10's python batches: 32×32 colour images as [n, 3, 32, 32] in [0, 1], 10 classes; "
    "pickles read by an unpickler that refuses any code",
    loader=load_cifar10,
    reads="folder",
    path_help="the cifar-10-batches-py folder",
    option_help={"split": "`train` (data_batch_1…5) or `test` (test_batch); unset: both, pooled"},
    run_keys={"split": "data-split"},
)
