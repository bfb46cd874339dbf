"""How a sweep runs its cells on each engine: one module per `--engine` value, named after it.

The engines themselves live elsewhere (the apps in process: sims.inprocess and sims.runner; the
fast engine: sims.fast; Flower's simulation: a `flwr run` per cell); a module here adapts one to
the sweep. It defines `create(resources) -> CellRunner`, and its name is what `--engine` and
`[sweep] engine` accept: the registry is this package's list of modules, so every module here is
an engine (helpers belong elsewhere).

What a new module gets without other edits: the scenario accepts its name (sims.sweep.spec checks
against `sims.sweep.engine_registry.engine_names()`, whose list is also its error message),
`--engine` passes it through, and the driver runs its cells. What it does not get: the `--engine` help text
(fedprivacy/cli/sweeps.py) and docs/simulator.md name the engines by hand, and settings of its
own need a `[resources]` key (sims.sweep.spec: `Resources`, `RESOURCE_KEYS`) and a flag, as
`fast` needed `workers` and `worker-gpus`.

Every engine runs the same ServerApp and ClientApp logic (plan, mechanism, ledger), so a cell's
results folder is the same whatever engine wrote it; only speed and isolation differ.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from sims.sweep.grid import Cell
    from sims.sweep.spec import Resources


class CellRunner(Protocol):
    """Runs cells on one engine. `setup` once before the first cell, `teardown` once after the
    last (also when the sweep is interrupted); `run_cell` runs one cell with `results_dir` as its
    results-dir, so the run writes its results folder (fedprivacy.results) below it, calls
    `on_round(r)` as rounds finish, and raises if the run did not complete."""

    def setup(self) -> None: ...

    def run_cell(self, cell: Cell, results_dir: Path, on_round: Callable[[int], None]) -> None: ...

    def teardown(self) -> None: ...


def create_runner(name: str, resources: Resources) -> CellRunner:
    """The cell runner of engine `name` (one of `engine_registry.engine_names()`, which the scenario
    has checked)."""
    return importlib.import_module(f"{__name__}.{name}").create(resources)
