"""The data-set registry: every source `load_dataset` can read by name, what it reads and its options.

Each module of fedprivacy/data/sources/ declares one `SOURCE`; `sources()` finds them, so adding a
data set is one file there (and its name in fedprivacy/catalog.py, which lists the names without
importing any loader; tests hold the two equal). A source's options are its loader's keyword
parameters: their types and defaults are read from the signature, their help from the source, so
the tables of docs/data.md (fedprivacy/data/docs.py) and the run config's mapping (`run_keys`)
cannot drift from the code.

A run config only names a registered source: nothing in it decides what is imported or unpickled.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedprivacy.catalog import DATASETS
from fedprivacy.data.types import Dataset
from fedprivacy.errors import InputError, did_you_mean

PATH_KINDS = ("file", "folder", "file or folder")


@dataclass(frozen=True)
class Option:
    """One loader keyword: `type` as the loader annotates it; `run_key` the run-config key that sets it."""

    name: str
    type: str
    default: Any
    help: str
    run_key: str | None


@dataclass(frozen=True, eq=False)
class Source:
    """A data set by name: its loader `loader(path, **options) -> Dataset` and how to describe it.

    `reads`: what the path names ("file", "folder" or "file or folder"), None for a built-in that
    reads nothing; `path_help` says it in words, for messages. `option_help`: one line per loader
    option. `run_keys`: option → the run-config key that sets it in a simulation. `client_option`:
    the option naming the natural client column, set from the run config's partition-by.
    `deployable`: a deployed node may read it (its node config says how; fedprivacy/identity.py
    `deployed_client`).
    """

    name: str
    summary: str
    loader: Callable[..., Dataset]
    reads: str | None
    path_help: str
    option_help: Mapping[str, str]
    run_keys: Mapping[str, str] = field(default_factory=dict)
    client_option: str | None = None
    deployable: bool = False

    def __post_init__(self) -> None:
        names = list(self._parameters())
        if sorted(self.option_help) != sorted(names):
            raise ValueError(f"source {self.name}: option_help must describe exactly its loader's options {names}")
        stray = [o for o in (*self.run_keys, self.client_option) if o is not None and o not in names]
        if stray:
            raise ValueError(f"source {self.name}: {stray} are not options of its loader ({names})")
        if self.reads is not None and self.reads not in PATH_KINDS:
            raise ValueError(f"source {self.name}: reads={self.reads!r} must be None or one of {PATH_KINDS}")

    def _parameters(self) -> dict[str, inspect.Parameter]:
        parameters = dict(inspect.signature(self.loader).parameters)
        parameters.pop("path")
        return parameters

    @property
    def options(self) -> tuple[Option, ...]:
        """The loader's keywords, in its signature's order."""
        return tuple(
            Option(name, str(p.annotation), p.default, self.option_help[name], self._run_key(name))
            for name, p in self._parameters().items()
        )

    def _run_key(self, option: str) -> str | None:
        return "partition-by" if option == self.client_option else self.run_keys.get(option)

    def path_present(self, path: Path | None) -> bool:
        """Whether `path` is what this source reads (always true for a built-in, which reads none)."""
        if self.reads is None:
            return True
        if path is None:
            return False
        return {"file": path.is_file(), "folder": path.is_dir(), "file or folder": path.exists()}[self.reads]

    def check_options(self, options: Mapping[str, Any]) -> None:
        """Refuse an option the loader does not take, listing those it does."""
        accepted = list(self._parameters())
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            raise InputError("option", unknown, f"the {self.name} dataset accepts: {', '.join(accepted)}")


@functools.cache
def sources() -> dict[str, Source]:
    """Every module's `SOURCE` under fedprivacy/data/sources/, in the catalog's order (then by name)."""
    from fedprivacy.data import sources as package

    found = [
        importlib.import_module(f"{package.__name__}.{module.name}").SOURCE
        for module in pkgutil.iter_modules(package.__path__)
        if not module.name.startswith("_")
    ]
    order = {name: i for i, name in enumerate(DATASETS)}
    return {s.name: s for s in sorted(found, key=lambda s: (order.get(s.name, len(order)), s.name))}


def find_source(name: str) -> Source:
    """The source called `name`, or an error listing the registered ones."""
    source = sources().get(name)
    if source is None:
        raise InputError("dataset", name, f"must be one of: {', '.join(sources())}{did_you_mean(name, sources())}")
    return source


def path_key(path: Path) -> tuple[str, int, int]:
    """(resolved path, newest modification time, files): what a cached load depends on, so an
    edited file, or a folder with a file added or rewritten, is read again."""
    resolved = path.expanduser().resolve()
    if resolved.is_file():
        return (str(resolved), resolved.stat().st_mtime_ns, 1)
    files = [Path(root, name) for root, _, names in os.walk(resolved) for name in names]
    return (str(resolved), max((f.stat().st_mtime_ns for f in files), default=-1), len(files))
