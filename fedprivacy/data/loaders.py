"""`load_dataset`, the one way a data set is loaded by name, its per-process cache, and the loaders
of the four built-in sources (digits, pums, csv, synthetic; fedprivacy/data/sources/ registers
them beside the others).

A Flower ClientApp may be started once per message, so every load goes through a module-level
cache keyed by (name, file or folder and its modification time, options): a second load costs a lookup.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fedprivacy.data.arrays import class_labels, declared_classes
from fedprivacy.data.registry import find_source, path_key
from fedprivacy.data.rows import read_numeric_rows
from fedprivacy.data.tables import cell, integer_labels, numeric_column, read_table
from fedprivacy.data.types import Dataset
from fedprivacy.errors import InputError, integer_at_least

logger = logging.getLogger(__name__)

# The seed slides' binary features, then the optional ones that lift accuracy (see pums/README.md).
PUMS_BASE_FEATURES = (
    "sex",
    "married",
    "black",
    "asian",
    "collegedegree",
    "militaryservice",
    "uscitizen",
    "disability",
    "englishability",
    "blackfemale",
)
PUMS_EXTRA_FEATURES = ("age/100", "educ/16", "latino", "divorced", "children")
PUMS_LABEL = "employed"
_PUMS_COLUMNS = (
    "sex",
    "married",
    "black",
    "asian",
    "educ",
    "militaryservice",
    "uscitizen",
    "disability",
    "englishability",
    PUMS_LABEL,
)
_PUMS_EXTRA_COLUMNS = ("age", "latino", "divorced", "children")
_PUMS_NOT_BINARY = ("educ", "age")
# Life stages with employment rates far apart (study, prime age, early and full retirement ages):
# fixed in advance, not fitted to any records, so the encoding itself reveals nothing.
PUMS_AGE_BANDS = (25, 35, 45, 55, 62, 67, 75)
PUMS_AGE_ENCODINGS = ("linear", "bands")


def _flag(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InputError(field, value, "must be true or false")
    return value


def _no_path(name: str, path: Path | None) -> None:
    if path is not None:
        raise InputError("path", str(path), f"the {name} dataset is built in and reads no file; leave path unset")


def _needs_path(name: str, path: Path | None) -> Path:
    if path is None:
        raise InputError("path", None, f"the {name} dataset needs path=<a CSV file>")
    return path


def load_digits(path: Path | None = None, images: bool = False) -> Dataset:
    """The embedded default (scikit-learn's bundled 8x8 digits): runs anywhere, no download.

    Pixels are scaled to [0, 1]; `images=True` gives the [n, 1, 8, 8] view a CNN expects.
    """
    from sklearn.datasets import load_digits as sklearn_digits

    _no_path("digits", path)
    bunch = sklearn_digits()
    features = (bunch.data / 16.0).astype(np.float32)
    if _flag("images", images):
        features = features.reshape(-1, 1, 8, 8)
    return Dataset(
        features=features,
        labels=bunch.target.astype(np.int64),
        feature_names=tuple(bunch.feature_names),
        num_classes=10,
        name="digits",
    )


def load_pums(
    path: Path | str | None = None,
    extended: bool = True,
    client_column: str | None = "puma",
    age: str = "linear",
    per_row: bool = False,
) -> Dataset:
    """The census PUMS layout: predict `employed`; 10 binary features, 15 with `extended`.

    `client_column` (default the PUMA) is kept as each row's natural client. `age="bands"` replaces
    the single age/100 feature by one indicator per band of `PUMS_AGE_BANDS`: employment rises and
    falls with age, which a linear feature cannot express. `per_row` (a deployed client's file):
    each line is read alone (`fedprivacy.data.rows`), and a row with a bad cell is left out alone
    instead of refusing the file (`_rows_kept`), so no record can change how another is read.
    """
    file = _needs_path("pums", path)
    extended = _flag("extended", extended)
    if age not in PUMS_AGE_ENCODINGS:
        raise InputError("pums-age", age, f"must be one of: {', '.join(PUMS_AGE_ENCODINGS)}")
    needed = _PUMS_COLUMNS + (_PUMS_EXTRA_COLUMNS if extended else ())
    if per_row:
        _one_client(client_column)
        table = read_numeric_rows(file, needed)
        binary = [c for c in needed if c not in _PUMS_NOT_BINARY]
        table = _rows_kept(table, table[binary].isin((0.0, 1.0)).all(axis=1).to_numpy(), file)
    else:
        clients = {client_column: "partition-by"} if client_column else {}
        table = read_table(file, [*needed, *clients], clients)
    col = {c: numeric_column(table, c, str(file)) for c in needed}
    for c in (c for c in needed if c not in _PUMS_NOT_BINARY):
        outside = ~np.isin(col[c], (0.0, 1.0))
        if outside.any():
            row = int(np.flatnonzero(outside)[0])
            raise InputError(f"column {c}", cell(table, c, row), f"must be 0 or 1 (data row {row + 1} of {file})")
    columns = [
        col["sex"],
        col["married"],
        col["black"],
        col["asian"],
        col["educ"] >= 13,
        col["militaryservice"],
        col["uscitizen"],
        col["disability"],
        col["englishability"],
        col["black"] * col["sex"],
    ]
    names = PUMS_BASE_FEATURES
    if extended:
        ages = {"age/100": col["age"] / 100} if age == "linear" else _age_bands(col["age"])
        columns += [*ages.values(), col["educ"] / 16, col["latino"], col["divorced"], col["children"]]
        names += (*ages, *PUMS_EXTRA_FEATURES[1:])
    features = np.clip(np.column_stack(columns).astype(np.float32), 0.0, 1.0)
    # `employed` is checked 0/1 above: two classes whatever the records (were they counted from the
    # labels, a file whose one employed record was removed would have one class and be refused)
    labels, num_classes = col[PUMS_LABEL].astype(np.int64), 2
    return Dataset(
        features=features,
        labels=labels,
        feature_names=names,
        num_classes=num_classes,
        name="pums",
        groups=table[client_column].to_numpy() if client_column else None,
        group_name=client_column,
    )


def _age_bands(age: np.ndarray) -> dict[str, np.ndarray]:
    """One 0/1 column per age band, named by its range (`age<25`, `25<=age<35`, ..., `age>=75`)."""
    edges = (-np.inf, *PUMS_AGE_BANDS, np.inf)
    bands = {}
    for low, high in zip(edges[:-1], edges[1:]):
        name = f"age<{high:g}" if low == -np.inf else f"age>={low:g}" if high == np.inf else f"{low:g}<=age<{high:g}"
        bands[name] = ((age >= low) & (age < high)).astype(np.float32)
    return bands


def load_csv(
    path: Path | str | None = None,
    label: str | None = None,
    features: Sequence[str] | None = None,
    client_column: str | None = None,
    num_classes: int | None = None,
    per_row: bool = False,
) -> Dataset:
    """Any CSV: the user names the label column and declares the number of classes (never read
    from the labels, see `class_labels`), and optionally the features and the client column.

    Features default to every column of the header but the label and client columns (the header
    decides, never the cells; a cell that is not a number is refused by name). With `per_row` (a
    deployed client's file, whose node config names its feature columns), nothing is inferred from
    the records and each line is read alone (`fedprivacy.data.rows`): a row whose features are
    not all finite numbers or whose label is not an integer in [0, num_classes) is left out alone
    (`_rows_kept`), so no record can fail the client or change how another is read.
    """
    file = _needs_path("csv", path)
    if not label:
        raise InputError("label", label, "the csv dataset needs label=<the label column>")
    if num_classes is not None:
        num_classes = declared_classes("num-classes", num_classes)
    if per_row:
        if not features or num_classes is None:
            raise InputError("per_row", per_row, "reading row by row needs declared features and num_classes")
        _one_client(client_column)
        table = read_numeric_rows(file, [label, *features])
        labels = table[label].to_numpy()
        table = _rows_kept(table, (labels == np.round(labels)) & (labels >= 0) & (labels < num_classes), file)
    else:
        clients = {client_column: "partition-by"} if client_column else {}
        named = {**dict.fromkeys(features or [], "feature-columns"), label: "label-column", **clients}
        table = read_table(file, [label, *(features or []), *clients], named)
    chosen = features is not None
    if features is None:  # from the header alone: which cells are read never depends on the cells
        features = [str(c) for c in table.columns if c not in (label, client_column)]
    if not features:
        raise InputError("features", [], f"{file} has no column besides the label {label!r} and the client column")
    if label in features:
        raise InputError("features", label, "the label column cannot also be a feature")
    if len(set(features)) != len(features):
        raise InputError("features", list(features), "names a column twice")
    labels, num_classes = class_labels(
        integer_labels(table, label, str(file)), f"label column {label}", str(file), len(table), num_classes
    )
    matrix = np.column_stack([_feature(table, c, str(file), chosen) for c in features]).astype(np.float32)
    return Dataset(
        features=matrix,
        labels=labels,
        feature_names=tuple(str(c) for c in features),
        num_classes=num_classes,
        name=f"csv:{file.name}",
        groups=table[client_column].to_numpy() if client_column else None,
        group_name=client_column,
    )


def _one_client(client_column: str | None) -> None:
    """A file read row by row is one deployed node's: it holds one client, so no client column."""
    if client_column is not None:
        raise InputError("client_column", client_column, "a file read row by row (per_row) is one client's: set None")


def _rows_kept(table: pd.DataFrame, keep: np.ndarray, file: Path) -> pd.DataFrame:
    """The rows of `keep`; how many were dropped goes to this machine's log only (it counts records)."""
    if not keep.all():
        logger.warning(
            "%s: %d row(s) with a value outside its column's range left out (each row is kept or left out alone)",
            file,
            int((~keep).sum()),
        )
    return table[keep].reset_index(drop=True)


def _feature(table: pd.DataFrame, column: str, source: str, chosen: bool) -> np.ndarray:
    """A feature column as numbers; a column the user did not choose says how to leave it out."""
    try:
        return numeric_column(table, column, source)
    except InputError as refused:
        if chosen:
            raise
        hint = "; or name the feature columns (run key feature-columns, Python features=)"
        raise InputError(refused.field, refused.value, refused.allowed + hint) from None


def synthetic_optimum(num_features: int, seed: int) -> np.ndarray:
    """w*: the weights that generated the synthetic labels.

    The model is well specified (no intercept), so w* minimises the population logistic loss:
    convex training checks can compare their result with it.
    """
    rng = np.random.default_rng([seed, 1])
    weights = rng.normal(size=num_features)
    return 2.0 * weights / np.linalg.norm(weights)


SYNTHETIC_BLOCK_ROWS = 4096


def load_synthetic(
    path: Path | None = None, num_examples: int = 2000, num_features: int = 10, seed: int = 0
) -> Dataset:
    """Logistic data with a known optimum: x ~ N(0, I), y ~ Bernoulli(sigmoid(x · w*))."""
    _no_path("synthetic", path)
    n = integer_at_least("num_examples", num_examples, 2)
    d = integer_at_least("num_features", num_features, 1)
    seed = integer_at_least("seed", seed, 0)
    rng = np.random.default_rng([seed, 0])
    optimum = synthetic_optimum(d, seed)
    # x is drawn in float64 blocks of rows, cast into the float32 features as it goes: the same
    # stream as one (n, d) draw, without its float64 copy (page faults, and the peak memory).
    features, logits = np.empty((n, d), dtype=np.float32), np.empty(n)
    block = np.empty((min(n, SYNTHETIC_BLOCK_ROWS), d))
    for start in range(0, n, len(block)):
        rows = block[: min(len(block), n - start)]
        rng.standard_normal(out=rows)
        features[start : start + len(rows)] = rows
        logits[start : start + len(rows)] = rows @ optimum
    labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logits))).astype(np.int64)
    return Dataset(
        features=features,
        labels=labels,
        feature_names=tuple(f"x{i}" for i in range(d)),
        num_classes=2,
        name="synthetic",
    )


_CACHE: dict[tuple[Any, ...], Dataset] = {}


def _freeze(value: Any) -> Any:
    """A hashable stand-in for an option value (lists come from configs)."""
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


def load_dataset(name: str, path: str | Path | None = None, **options: Any) -> Dataset:
    """Load the registered source `name` (fedprivacy/data/registry.py) with its options, through the cache.

    The returned arrays are shared by every caller and therefore read-only; `Dataset.subset`
    (and so every partition) returns writable copies.
    """
    source = find_source(name)
    file = None if path is None else Path(path)
    where = None if file is None or not file.exists() else path_key(file)
    key = (name, str(file), where, tuple(sorted((k, _freeze(v)) for k, v in options.items())))
    if key in _CACHE:
        return _CACHE[key]
    source.check_options(options)
    dataset = source.loader(file, **options)
    for array in (dataset.features, dataset.labels, dataset.groups):
        if array is not None:
            array.setflags(write=False)
    _CACHE[key] = dataset
    return dataset
