"""A NumPy .npz of arrays: `features` [n, ...], `labels` [n], optional `client_ids` [n].

Read with `allow_pickle=False`: an object array (which NumPy can only unpickle) is refused, so a
file named by an untrusted run config runs no code.
"""

from __future__ import annotations

import math
import zipfile
from pathlib import Path

import numpy as np

from fedprivacy.data.arrays import class_labels, client_groups, example_count, feature_names, float_features
from fedprivacy.data.limits import check_load
from fedprivacy.data.registry import Source
from fedprivacy.data.types import Dataset
from fedprivacy.errors import InputError

REQUIRED = ("features", "labels")
CLIENT_IDS = "client_ids"
ZIP_MAGIC = b"PK\x03\x04"  # np.savez writes a zip of .npy files
NPY_MAGIC = b"\x93NUMPY"


def _arrays(file: Path) -> dict[str, np.ndarray]:
    """Every array of the archive, or an error naming the file and what is wrong with it."""
    with file.open("rb") as handle:
        magic = handle.read(6)
    if magic.startswith(NPY_MAGIC):
        raise InputError(
            "data", str(file), "is a single .npy array; save features and labels in one file with np.savez"
        )
    if not magic.startswith(ZIP_MAGIC):
        raise InputError("data", str(file), "is not a .npz file (the zip of .npy arrays that np.savez writes)")
    try:
        check_load(file, "its arrays, with the features as float32", _declared_bytes(file))
        with np.load(file, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except InputError:
        raise
    except ValueError as exc:  # np.load refuses an object array, which only pickle can read
        if "allow_pickle" in str(exc):
            raise InputError(
                "data", str(file), "holds an object array, which only pickle can read: save numeric arrays"
            ) from None
        raise InputError("data", str(file), f"is not a readable .npz file ({exc})") from None
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        raise InputError("data", str(file), f"is not a readable .npz file ({exc})") from None


def _declared_bytes(file: Path) -> int:
    """What the archive's arrays will take in memory, from their .npy headers (read without the
    data), plus the float32 copy of the features: refused when a header declares more data than
    the archive says its member holds (a shape that would allocate terabytes for a few bytes)."""
    total = 0
    with zipfile.ZipFile(file) as archive:
        for info in archive.infolist():
            with archive.open(info) as member:
                version = np.lib.format.read_magic(member)
                if version == (1, 0):
                    shape, _, dtype = np.lib.format.read_array_header_1_0(member)
                elif version == (2, 0):
                    shape, _, dtype = np.lib.format.read_array_header_2_0(member)
                else:
                    raise ValueError(f"{info.filename} is a .npy of version {version}; numeric arrays use 1.0 or 2.0")
                nbytes = math.prod(shape) * dtype.itemsize
                if nbytes > info.file_size:
                    raise InputError(
                        "data",
                        str(file),
                        f"its {info.filename} declares shape {list(shape)} of {dtype} ({nbytes:,} bytes) but holds "
                        f"{info.file_size:,} bytes: not a file np.savez wrote",
                    )
                total += nbytes
                if info.filename == "features.npy":
                    total += math.prod(shape) * np.dtype(np.float32).itemsize
    return total


def load_npz(path: Path | None = None, num_classes: int | None = None) -> Dataset:
    """Features (any per-example shape: [n, d] rows or [n, C, H, W] images) as float32, labels as
    int64 in [0, num_classes) (declared, never read from the labels), and `client_ids` (if present)
    as each example's natural client."""
    if path is None or not path.is_file():
        raise InputError("path", None if path is None else str(path), "the npz dataset needs path=<a .npz file>")
    arrays = _arrays(path)
    unknown = sorted(set(arrays) - {*REQUIRED, CLIENT_IDS})
    missing = [name for name in REQUIRED if name not in arrays]
    if unknown or missing:
        shown = ", ".join(arrays) or "no arrays"
        raise InputError(
            "data",
            str(path),
            f"holds {shown}; a .npz data set holds features, labels and optionally {CLIENT_IDS}, and nothing else",
        )
    where = str(path)
    n = example_count(arrays["features"], "features", where)
    features = float_features(arrays["features"], "features", where)
    labels, num_classes = class_labels(arrays["labels"], "labels", where, n, num_classes)
    groups = client_groups(arrays[CLIENT_IDS], CLIENT_IDS, where, n) if CLIENT_IDS in arrays else None
    return Dataset(
        features=features,
        labels=labels,
        feature_names=feature_names(features.shape[1:]),
        num_classes=num_classes,
        name=f"npz:{path.name}",
        groups=groups,
        group_name=CLIENT_IDS if groups is not None else None,
    )


SOURCE = Source(
    name="npz",
    summary="NumPy arrays: `features` (any per-example shape), integer `labels` (the number of classes "
    "declared), optional `client_ids` (natural clients); read without pickle",
    loader=load_npz,
    reads="file",
    path_help="a .npz file",
    option_help={"num_classes": "the number of classes (required): labels lie in [0, num_classes)"},
    run_keys={"num_classes": "num-classes"},
)
