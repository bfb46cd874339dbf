"""What a simulation's run config says to build: the clients' rows (the one data recipe the
simulated clients, the server's central set and the engines share, so they agree on every row),
the data set's identity (what a simulated account is named after) and the run's model.

A deployed client reads none of this: its node config says how its own file is read
(`fedprivacy.identity.deployed_client`).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedprivacy.data.loaders import load_dataset
from fedprivacy.data.registry import find_source, sources
from fedprivacy.data.types import Dataset
from fedprivacy.errors import InputError
from fedprivacy.models import build_model
from fedprivacy.runconfig import DEFAULTS, RunSettings
from fedprivacy.runconfig_keys import RUN_KEYS
from fedprivacy.training.norms import UnsupportedLayerError

_FIELDS = {key.name: key.field for key in RUN_KEYS}


def run_value(settings: RunSettings, key: str) -> Any:
    """The parsed value of run-config key `key` (e.g. `num-classes`)."""
    return getattr(settings, _FIELDS[key])


def asked_for(settings: RunSettings, key: str) -> bool:
    """Whether the run config sets `key` away from its default (unset '' , () and None included)."""
    return run_value(settings, key) not in (DEFAULTS[key], (), None)


def _data_options(settings: RunSettings) -> dict[str, Any]:
    """The loader options the run config sets for its source (fedprivacy/data/registry.py maps each
    option to its key); a key left unset ('', () or None) keeps the loader's own default."""
    values = {option: run_value(settings, key) for option, key in find_source(settings.dataset).run_keys.items()}
    return {option: value for option, value in values.items() if value not in ("", None, ())}


def unused_data_keys(settings: RunSettings) -> str | None:
    """The loader keys the run config sets (away from their defaults) that its data set does not
    read, e.g. num-classes for digits, which fixes its own 10, as one line to say at the start of
    a simulation (None when there are none), so that a setting that changes nothing is noticed."""
    read_somewhere = {key for source in sources().values() for key in source.run_keys.values()}
    read_here = set(find_source(settings.dataset).run_keys.values())
    unused = [
        f"{key}={run_value(settings, key)}" for key in sorted(read_somewhere - read_here) if asked_for(settings, key)
    ]
    return f"run config {' '.join(unused)} ignored: dataset {settings.dataset} does not read it" if unused else None


def _scheme(settings: RunSettings) -> tuple[str, str | None]:
    """(partition scheme, client column): `auto` is natural when partition-by names a column."""
    by = settings.partition_by or None
    if settings.partitioning == "auto":
        return ("natural" if by else "iid"), by
    return settings.partitioning, by


def partition_kwargs(settings: RunSettings, num_clients: int) -> dict[str, Any]:
    """`load_clients`/`load_client`'s arguments: the one recipe the simulated clients, the server's
    central set and the fast engine all build their rows from, so they agree on every row.

    `seed` is the data seed (`split-seed`, or `seed`). `validation_fraction` is present only under
    evaluate-on='validation' (the clients are then (fit, validation) rows): without it the
    arguments, and so the partitioning a ledger pins, are those of runs made before it existed."""
    scheme, by = _scheme(settings)
    validation = {"validation_fraction": settings.validation_fraction} if settings.evaluate_on == "validation" else {}
    return dict(
        name=settings.dataset,
        path=settings.data_path,
        scheme=scheme,
        num_partitions=num_clients,
        seed=settings.data_seed,
        by=by,
        alpha=settings.dirichlet_alpha,
        skew=settings.size_skew,
        test_fraction=settings.test_fraction,
        **validation,
        **_data_options(settings),
    )


def data_file_missing(settings: RunSettings) -> bool:
    """A data set read from data-path (a file or a folder) whose data-path is not one on this machine."""
    return not find_source(settings.dataset).path_present(settings.data_path)


def require_data_file(settings: RunSettings) -> None:
    """Refuse a simulation whose data file (or folder) is not on this machine: each simulated client
    checks before it reads, and the simulators before anything runs."""
    if data_file_missing(settings):
        path = settings.data_path
        absent = "no such file or folder; " if path is not None and not path.exists() else ""
        raise InputError(
            "data-path",
            "" if path is None else str(path),
            f"{absent}dataset {settings.dataset!r} needs {find_source(settings.dataset).path_help}: in a "
            "simulation every client reads the run config's data-path (an absolute path on this machine)",
        )


_DIGESTS: dict[tuple[str, int, int], str] = {}


def file_digest(path: Path) -> str:
    """The first 16 hex digits of the file's SHA-256 (cached per path, size and mtime)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        _DIGESTS[key] = digest.hexdigest()[:16]
    return _DIGESTS[key]


def folder_digest(path: Path) -> str:
    """The first 16 hex digits of a SHA-256 over a folder's files: each one's path inside it and digest."""
    files = sorted(f for f in path.rglob("*") if f.is_file())
    listing = "\n".join(f"{f.relative_to(path).as_posix()} {file_digest(f)}" for f in files)
    return hashlib.sha256(listing.encode()).hexdigest()[:16]


def dataset_identity(settings: RunSettings) -> str:
    """What the records are: a file's or a folder's content, or a built-in data set's arrays."""
    if find_source(settings.dataset).reads is not None and settings.data_path is not None:
        if settings.data_path.is_dir():
            return f"folder:{folder_digest(settings.data_path)}"
        return f"file:{file_digest(settings.data_path)}"
    return f"{settings.dataset}:{_arrays_digest(load_dataset(settings.dataset, None, **_data_options(settings)))}"


@functools.lru_cache(maxsize=16)
def _arrays_digest(dataset: Dataset) -> str:
    """Hashed once per loaded data set (loaded data sets are cached and never change): the features'
    bytes then the labels', read in place (a copy of both cost more than the hash)."""
    digest = hashlib.sha256()
    for array in (dataset.features, dataset.labels):
        digest.update(np.ascontiguousarray(array))
    return digest.hexdigest()[:16]


# Loader options that change how a row is encoded or checked (num_classes: the labels' range;
# features: which cells are read), not which rows a client holds or trains on.
_ENCODING_ONLY = ("age", "image_column", "num_classes", "features")


def partitioning_of(settings: RunSettings, num_clients: int) -> dict[str, Any]:
    """Everything that decides which rows each simulated client holds, and which it trains on
    (not how a row is encoded: the same records under another encoding are the same accounts)."""
    options = partition_kwargs(settings, num_clients)
    for key in ("path", *_ENCODING_ONLY):
        options.pop(key, None)
    return options


def new_model(settings: RunSettings, features: np.ndarray, num_classes: int) -> nn.Module:
    # one example's shape: (d,) or (C, H, W)
    return build_model(settings.model, features.shape[1:], num_classes, dict(settings.model_options))


def model_and_data(settings: RunSettings) -> tuple[Any, ...]:
    """What the run's model is built from: its name, and the data set and options that give its
    input shape and classes (runs equal in these build the same model)."""
    data = tuple(sorted(_data_options(settings).items()))
    return settings.model, settings.model_options, settings.dataset, str(settings.data_path), data


def check_model_builds(settings: RunSettings) -> None:
    """Build the run's model once on its data's shape and classes, so that a model the trainer
    cannot clip (BatchNorm, a layer without a rule) or whose checks fail is refused, naming it,
    before a sweep runs anything (a run refuses it when it starts)."""
    data = load_dataset(settings.dataset, settings.data_path, **_data_options(settings))
    try:
        new_model(settings, data.features, data.num_classes)
    except UnsupportedLayerError as error:  # its text names the model already: keep the rest
        raise InputError("model", settings.model, str(error).removeprefix(f"model={settings.model!r} ")) from None


def initial_model(settings: RunSettings, features: np.ndarray, num_classes: int) -> nn.Module:
    """The run's seeded initial model, the same wherever it is made: the ServerApp (from its test
    set), the client it asks when it has none, and the fast engine."""
    torch.manual_seed(settings.seed)
    return new_model(settings, features, num_classes)
