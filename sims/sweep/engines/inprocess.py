"""`--engine inprocess`, the default: each cell is a `run_scenario` (sims.runner), the real ServerApp
and ClientApp on the in-process grid (sims.inprocess), no Ray.

Cells run one after the other on this process's cores. Flower's per-round INFO log and the
per-client warning that noise is seeded are muted while a cell runs: the sweep's progress bar
says where it is, and the sweep says once when noise is seeded.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from pathlib import Path

from fedprivacy.training.rng import SeededRunWarning
from sims.runner import Scenario, run_scenario
from sims.sweep.grid import Cell
from sims.sweep.progress import watching_rounds
from sims.sweep.spec import Resources


class InProcessCellRunner:
    """Runs a sweep cell through the real apps in this process."""

    def __init__(self) -> None:
        self._flwr_level = logging.NOTSET

    def setup(self) -> None:
        logger = logging.getLogger("flwr")
        self._flwr_level = logger.level
        logger.setLevel(logging.WARNING)

    def run_cell(self, cell: Cell, results_dir: Path, on_round: Callable[[int], None]) -> None:
        with watching_rounds(results_dir, on_round), warnings.catch_warnings():
            warnings.simplefilter("ignore", SeededRunWarning)
            # run_scenario writes under <its results_dir>/<scenario name>: here, results_dir itself
            run_scenario(Scenario(results_dir.name, cell.run_config, cell.num_clients), results_dir.parent, quiet=True)

    def teardown(self) -> None:
        logging.getLogger("flwr").setLevel(self._flwr_level)


def create(resources: Resources) -> InProcessCellRunner:
    """Resources are Flower simulation settings: in process there is nothing to apply them to."""
    return InProcessCellRunner()
