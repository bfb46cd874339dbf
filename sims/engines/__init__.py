"""Engines run one sweep cell each; a new engine is one module in this package.

An engine module defines `create(resources) -> Engine`. Its name (the module's) is what
`--engine` and `[sweep] engine` accept: the registry is this package's list of modules, so adding
`sims/engines/fast.py` makes `--engine fast` work without touching anything else.

Every engine runs the same ServerApp and ClientApp logic (plan, mechanism, ledger), so a cell's
results folder is the same whatever engine wrote it; only speed and isolation differ.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from sims.sweep.grid import Cell
    from sims.sweep.spec import Resources


class Engine(Protocol):
    """Runs cells. `setup` once before the first cell, `teardown` once after the last (also when
    the sweep is interrupted); `run_cell` runs one cell with `results_dir` as its results-dir, so
    the run writes its results folder (fedprivacy.results) below it, calls `on_round(r)` as rounds
    finish, and raises if the run did not complete."""

    def setup(self) -> None: ...

    def run_cell(self, cell: Cell, results_dir: Path, on_round: Callable[[int], None]) -> None: ...

    def teardown(self) -> None: ...


def engine_names() -> tuple[str, ...]:
    """The engines there are: the modules of this package."""
    return tuple(sorted(module.name for module in pkgutil.iter_modules(__path__)))


def create_engine(name: str, resources: Resources) -> Engine:
    """The engine `name` (one of `engine_names()`, which the scenario has checked)."""
    return importlib.import_module(f"{__name__}.{name}").create(resources)
