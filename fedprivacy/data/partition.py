"""Federated partitions: which rows each client holds, then each client's own train/test split.

For tuning (`validation_fraction` > 0), a client's training rows are split again into fit rows
and validation rows, and its `ClientData` is (fit, validation): everything downstream (planning
on N, training, the server's central set, federated evaluation) then works on them unchanged,
and no test row is handed out.

The row assignment comes from flwr-datasets partitioners run offline on a small in-memory table
(row position, label, client column); features never leave numpy. Everything is seeded, and the
assignment is cached per (dataset, scheme, options), so a ClientApp started once per message
pays for the assignment once per process; so is each client's split as `load_client` and
`load_evaluation_union` make it (a simulation's server takes every client's evaluation rows as
its central test set, and its clients their own), not `partition`'s, whose data set is the caller's.
"""

from __future__ import annotations

import contextlib
import functools
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from fedprivacy.data.loaders import load_dataset
from fedprivacy.data.registry import find_source
from fedprivacy.data.splits import (
    check_test_fraction,
    check_validation_fraction,
    held_out_count,
    train_and_evaluation_rows,
)
from fedprivacy.data.tables import partition_sizes
from fedprivacy.data.types import ClientData, Dataset
from fedprivacy.errors import InputError, integer_at_least, positive

SCHEMES = ("natural", "iid", "dirichlet", "size")
SIZE_SKEWS = ("linear", "square", "exponential")
MIN_CLIENT_ROWS = 2  # a DP plan for N < 2 is meaningless, and a client needs a train and a test row
SPLITS_KEPT = 1 << 14  # clients' splits cached per process (their row positions: 1.6 kB a 200-row client)


def _hf_table(columns: dict[str, np.ndarray]) -> Any:
    import datasets

    return datasets.Dataset.from_pandas(pd.DataFrame(columns), preserve_index=False)


def _rows(part: Any) -> np.ndarray:
    return np.asarray(part.with_format("numpy")[:]["row"], dtype=np.int64)


def _natural(dataset: Dataset, by: str | None, num_partitions: int | None) -> list[tuple[str, np.ndarray]]:
    """One client per value of the dataset's client column, in sorted value order."""
    from flwr_datasets.partitioner import NaturalIdPartitioner

    if dataset.groups is None:
        raise InputError("partition-by", by, f"the {dataset.name} dataset was loaded without a client column")
    if by is not None and by != dataset.group_name:
        raise InputError(
            "partition-by",
            by,
            f"the {dataset.name} dataset was loaded with client column {dataset.group_name!r}",
        )
    column = str(dataset.group_name)
    sizes = partition_sizes(pd.DataFrame({column: dataset.groups}), column, min_rows=1)  # small ones: see _client
    if num_partitions is not None and integer_at_least("num-partitions", num_partitions, 1) != len(sizes):
        raise InputError(
            "num-partitions",
            num_partitions,
            f"the natural scheme gives one client per {column} value: {len(sizes)}; run as many clients "
            f'(flwr run: --federation-config "num-supernodes={len(sizes)}"; a sweep: clients = {len(sizes)})',
        )
    partitioner = NaturalIdPartitioner(partition_by=column)
    partitioner.dataset = _hf_table({"row": np.arange(len(dataset)), column: dataset.groups})
    # NaturalIdPartitioner draws a tqdm bar on stderr; one per ClientApp message is only noise.
    with contextlib.redirect_stderr(io.StringIO()):
        parts = [(i, _rows(partitioner.load_partition(i))) for i in range(partitioner.num_partitions)]
    names = partitioner.partition_id_to_natural_id
    return [(str(names[i]), rows) for i, rows in parts]


def _sampled(
    dataset: Dataset, scheme: str, num_partitions: int | None, seed: int, alpha: float, skew: str
) -> list[tuple[str, np.ndarray]]:
    """IID, label-skewed (Dirichlet) or size-skewed clients over a seeded shuffle of the rows."""
    k = integer_at_least("num-partitions", num_partitions, 1)
    if k * MIN_CLIENT_ROWS > len(dataset):
        raise InputError(
            "num-partitions", k, f"{len(dataset)} rows cannot give {k} clients {MIN_CLIENT_ROWS} rows each"
        )
    # IID and size partitioners cut contiguous blocks: the seeded shuffle is what makes them random.
    order = np.random.default_rng(seed).permutation(len(dataset))
    if scheme == "iid":
        return iid_shards(order, k)
    from flwr_datasets import partitioner as fp

    if scheme == "dirichlet":
        partitioner = fp.DirichletPartitioner(
            k,
            partition_by="label",
            alpha=positive("alpha", alpha),
            min_partition_size=MIN_CLIENT_ROWS,
            seed=seed,
        )
    else:
        growth = (fp.LinearPartitioner, fp.SquarePartitioner, fp.ExponentialPartitioner)
        skews = dict(zip(SIZE_SKEWS, growth, strict=True))
        if skew not in skews:
            raise InputError("skew", skew, f"must be one of: {', '.join(SIZE_SKEWS)}")
        partitioner = skews[skew](k)
    partitioner.dataset = _hf_table({"row": order, "label": dataset.labels[order]})
    try:
        return [(str(i), _rows(partitioner.load_partition(i))) for i in range(k)]
    except ValueError as exc:
        if scheme == "dirichlet":
            advice = "raise alpha or lower num-partitions"
            failure = f"no Dirichlet draw gave {k} clients {MIN_CLIENT_ROWS} rows each"
            raise InputError("alpha", alpha, f"{failure}; {advice}") from None
        raise InputError(
            "num-partitions", k, f"the {skew} size skew cannot split {len(dataset)} rows ({exc})"
        ) from None


def iid_shards(order: np.ndarray, k: int) -> list[tuple[str, np.ndarray]]:
    """The rows flwr-datasets' `IidPartitioner` gives each of k clients (contiguous shards of the
    shuffled order, the first len % k one row longer), computed directly: through Hugging Face
    datasets it cost 1 ms per client, 3 s of a 1,000-client run (tests/test_data.py holds the two equal)."""
    size, extra = divmod(len(order), k)
    bounds = [size * i + min(i, extra) for i in range(k + 1)]
    return [(str(i), order[bounds[i] : bounds[i + 1]].copy()) for i in range(k)]


@functools.lru_cache(maxsize=32)
def partition_rows(
    dataset: Dataset,
    scheme: str,
    num_partitions: int | None = None,
    seed: int = 0,
    by: str | None = None,
    alpha: float = 0.5,
    skew: str = "linear",
) -> tuple[tuple[str, np.ndarray], ...]:
    """(client id, row positions in `dataset`) per client; cached, so the arrays are read-only.

    Client ids are the column values for `natural` and "0".."k-1" otherwise. A client with too few
    rows is kept here and refused only when its own data is asked for (`_client`), so in a
    federated run that client fails alone and the others go on.
    """
    seed = integer_at_least("seed", seed, 0)
    if scheme == "natural":
        parts = _natural(dataset, by, num_partitions)
    elif scheme in SCHEMES:
        parts = _sampled(dataset, scheme, num_partitions, seed, alpha, skew)
    else:
        raise InputError("partition-scheme", scheme, f"must be one of: {', '.join(SCHEMES)}")
    for _, rows in parts:
        rows.setflags(write=False)
    return tuple(parts)


def _too_small(rows: int, fraction: float, validation: float) -> str | None:
    """Why a client of `rows` rows cannot be split, or None: it needs 2 rows, and under a validation
    split 2 training rows (one to fit, one to validate on)."""
    if rows < MIN_CLIENT_ROWS:
        return f"row(s) in its partition; each client needs at least {MIN_CLIENT_ROWS}"
    training = rows - held_out_count(rows, fraction)
    if validation > 0 and training < MIN_CLIENT_ROWS:
        return (
            f"row(s) in its partition leave {training} training row(s) after its test split; a validation "
            f"split (validation-fraction={validation:g}) needs at least {MIN_CLIENT_ROWS}"
        )
    return None


def _client(
    dataset: Dataset,
    parts: tuple[tuple[str, np.ndarray], ...],
    position: int,
    seed: int,
    fraction: float,
    validation: float,
    split: Callable[[int], tuple[np.ndarray, np.ndarray]] | None = None,
) -> ClientData:
    """Client `position`'s (train, test) pair, or (fit, validation) when `validation` > 0; its split
    seeds depend only on (seed, position). `split(position)` gives its rows, if given (a cache)."""
    client, rows = parts[position]
    reason = _too_small(rows.size, fraction, validation)
    if reason is not None:
        raise InputError(f"client {client}", int(rows.size), reason)
    if split is None:
        train, evaluation = _split(dataset, rows, position, seed, fraction, validation)
    else:
        train, evaluation = split(position)
    return ClientData(client_id=client, train=dataset.subset(train), test=dataset.subset(evaluation))


def _split(
    dataset: Dataset, rows: np.ndarray, position: int, seed: int, fraction: float, validation: float
) -> tuple[np.ndarray, np.ndarray]:
    """The (training, evaluation) rows of `dataset` for the client at `position` holding `rows`;
    its split seeds depend only on (seed, position)."""
    train, evaluation = train_and_evaluation_rows(dataset.labels[rows], fraction, validation, (seed, position))
    return rows[train], rows[evaluation]


def partition(
    dataset: Dataset,
    scheme: str,
    num_partitions: int | None = None,
    seed: int = 0,
    by: str | None = None,
    alpha: float = 0.5,
    skew: str = "linear",
    test_fraction: float = 0.2,
    drop_too_small: bool = False,
    *,
    validation_fraction: float = 0.0,
) -> list[ClientData]:
    """Every client's train/test data; the same seed gives identical clients.

    Schemes: `natural` (one client per value of the dataset's client column `by`), `iid`,
    `dirichlet` (label skew, smaller `alpha` = more skew), `size` (size skew: `skew` is
    linear, square or exponential in the client index). `by` matters to `natural` only.
    A client with fewer than 2 rows is an error naming it, or left out with `drop_too_small`.
    `validation_fraction` > 0: each client is (fit rows, validation rows) of its training rows.
    """
    fraction = check_test_fraction(test_fraction)
    validation = check_validation_fraction(validation_fraction)
    seed = integer_at_least("seed", seed, 0)
    parts = partition_rows(dataset, scheme, num_partitions, seed, by, alpha, skew)
    positions = [
        p
        for p, (_, rows) in enumerate(parts)
        if not drop_too_small or _too_small(rows.size, fraction, validation) is None
    ]
    return [_client(dataset, parts, position, seed, fraction, validation) for position in positions]


def _load(name: str, path: str | Path | None, by: str | None, options: dict[str, Any]) -> Dataset:
    """The dataset, with `by` as its client column where the source takes one by name (an npz file's
    clients are its `client_ids` array, whatever `by` says; `_natural` then checks the name)."""
    client_option = find_source(name).client_option
    if by is not None and client_option is not None:
        options = {**options, client_option: by}
    return load_dataset(name, path, **options)


def _partitioned(
    name: str,
    path: str | Path | None,
    scheme: str,
    num_partitions: int | None,
    seed: int,
    by: str | None,
    alpha: float,
    skew: str,
    test_fraction: float,
    validation_fraction: float,
    options: dict[str, Any],
) -> _Partitioned:
    """The loaded dataset, its clients' rows (`partition_rows`) and the checked test and validation
    fractions: what `load_client` and `load_evaluation_union` split from."""
    dataset = _load(name, path, by, options)
    fraction = check_test_fraction(test_fraction)
    validation = check_validation_fraction(validation_fraction)
    key = (dataset, scheme, num_partitions, integer_at_least("seed", seed, 0), by, alpha, skew)
    return _Partitioned(dataset, partition_rows(*key), key, fraction, validation)


class _Partitioned(NamedTuple):
    """A data set partitioned for `load_client` and `load_evaluation_union`, whose clients' splits
    come from the process's cache (`_cached_split`), keyed by `key`."""

    dataset: Dataset
    parts: tuple[tuple[str, np.ndarray], ...]
    key: tuple[Any, ...]  # `partition_rows`' arguments
    fraction: float
    validation: float

    @property
    def seed(self) -> int:
        """The partitioning's seed, checked: its clients' split seeds start with it."""
        return self.key[3]

    def split(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        """Client `position`'s (training, evaluation) rows (`_split`), through the process's cache."""
        return _cached_split(self.key, position, self.fraction, self.validation)


@functools.lru_cache(maxsize=SPLITS_KEPT)
def _cached_split(
    partitioning: tuple[Any, ...], position: int, fraction: float, validation: float
) -> tuple[np.ndarray, np.ndarray]:
    """`_split` of client `position` of `partition_rows(*partitioning)`; read-only, being shared."""
    dataset, seed = partitioning[0], partitioning[3]
    rows = _split(dataset, partition_rows(*partitioning)[position][1], position, seed, fraction, validation)
    for part in rows:
        part.setflags(write=False)
    return rows


def load_clients(
    name: str,
    path: str | Path | None = None,
    scheme: str = "iid",
    num_partitions: int | None = None,
    seed: int = 0,
    by: str | None = None,
    alpha: float = 0.5,
    skew: str = "linear",
    test_fraction: float = 0.2,
    drop_too_small: bool = False,
    validation_fraction: float = 0.0,
    **options: Any,
) -> list[ClientData]:
    """Load a dataset by name (options as in `load_dataset`) and partition it."""
    dataset = _load(name, path, by, options)
    return partition(
        dataset,
        scheme,
        num_partitions,
        seed,
        by,
        alpha,
        skew,
        test_fraction,
        drop_too_small,
        validation_fraction=validation_fraction,
    )


def load_client(
    partition_id: int,
    name: str,
    path: str | Path | None = None,
    scheme: str = "iid",
    num_partitions: int | None = None,
    seed: int = 0,
    by: str | None = None,
    alpha: float = 0.5,
    skew: str = "linear",
    test_fraction: float = 0.2,
    validation_fraction: float = 0.0,
    **options: Any,
) -> ClientData:
    """`load_clients(...)[partition_id]`, splitting only that client: what a ClientApp needs."""
    loaded = _partitioned(
        name, path, scheme, num_partitions, seed, by, alpha, skew, test_fraction, validation_fraction, options
    )
    position = integer_at_least("partition-id", partition_id, 0)
    if position >= len(loaded.parts):
        raise InputError("partition-id", partition_id, f"must be below the number of clients, {len(loaded.parts)}")
    return _client(
        loaded.dataset, loaded.parts, position, loaded.seed, loaded.fraction, loaded.validation, loaded.split
    )


def load_evaluation_union(
    name: str,
    path: str | Path | None = None,
    scheme: str = "iid",
    num_partitions: int | None = None,
    seed: int = 0,
    by: str | None = None,
    alpha: float = 0.5,
    skew: str = "linear",
    test_fraction: float = 0.2,
    validation_fraction: float = 0.0,
    **options: Any,
) -> Dataset:
    """Every client's evaluation rows in one Dataset, in client order: the `test` sets of
    `load_clients(..., drop_too_small=True)` concatenated, without forming any training set (a
    simulation server's central test set). Refused when no client is large enough to split."""
    loaded = _partitioned(
        name, path, scheme, num_partitions, seed, by, alpha, skew, test_fraction, validation_fraction, options
    )
    rows = [
        loaded.split(position)[1]
        for position, (_, part) in enumerate(loaded.parts)
        if _too_small(part.size, loaded.fraction, loaded.validation) is None
    ]
    if not rows:
        reason = f"leaves no client with enough rows to split (each needs at least {MIN_CLIENT_ROWS})"
        raise InputError("partitioning", scheme, reason)
    return loaded.dataset.subset(np.concatenate(rows))
