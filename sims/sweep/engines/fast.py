"""`--engine fast`: each cell is one `run_fast` on the fast engine (sims.fast: a round's clients
trained together, the apps' rules for the rest).

The run gets the scenario's `[resources] workers` (1: in the sweep's process; more: Ray actors),
`device` and `worker-gpus`. The results folder has the apps' format, with `"engine": "fast"` in
config.json and summary.json. `FastCellRunner(resources, private=False)` runs a cell as the
non-private baseline runs (`sims.baseline.baseline_run_config`, clipping and noise off): the
baseline's tuning runs are cells run so (sims.sweep.baseline_jobs).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

from fedprivacy.training.rng import SeededRunWarning
from sims.baseline import baseline_run_config
from sims.fast.engine import run_fast
from sims.sweep.grid import Cell
from sims.sweep.spec import Resources


class FastCellRunner:
    """Runs a sweep cell on the fast engine."""

    def __init__(self, resources: Resources, private: bool = True) -> None:
        self.resources = resources
        self.private = private

    def setup(self) -> None:
        """Workers start with each cell: a cell's clients are dealt to them once, for the whole run."""

    def run_cell(self, cell: Cell, results_dir: Path, on_round: Callable[[int], None]) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SeededRunWarning)
            config = cell.run_config if self.private else baseline_run_config(cell.run_config)
            run_fast(
                {**config, "results-dir": str(results_dir)},
                cell.num_clients,
                private=self.private,
                workers=self.resources.workers,
                device=self.resources.device,
                gpus_per_worker=self.resources.worker_gpus,
                on_round=lambda row: on_round(int(row["round"])),
                say=lambda _: None,
            )

    def teardown(self) -> None:
        """Nothing outlives a cell."""


def create(resources: Resources) -> FastCellRunner:
    return FastCellRunner(resources)
