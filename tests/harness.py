"""How tests drive the product, kept out of it because nothing in the product needs them.

- `app_defaults`: the run config `flwr run .` starts from, read from pyproject.toml;
- `RecordingGrid`: `sims.inprocess.InProcessGrid` that also records whom it sent what, and can
  restart a node;
- `load_scenario`: a scenario file validated as `fedprivacy sweep FILE` does with no flags;
- `CountingRunner`: the fast engine's cell runner, recording which tuning runs and cells it ran;
- `PUMS_DIR`, `PUMS`, `PUMS_SAMPLE` and `pums_file`: the PUMS extract beside the repository.

Import it by name (`from harness import ...`), as faultkit or independent: pytest puts tests/ on
the path.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Message, RecordDict

from sims.inprocess import InProcessGrid
from sims.sweep.engines.fast import FastCellRunner
from sims.sweep.spec import SweepSpec, read_scenario, validate

PROJECT = Path(__file__).resolve().parents[1]
PUMS_DIR = PROJECT.parent / "shared" / "data" / "pums"
PUMS = PUMS_DIR / "fulton_pums5_full.csv"
PUMS_SAMPLE = PUMS_DIR / "fulton_pums5_sample100.csv"


def pums_file(name: str = PUMS.name) -> Path:
    """A PUMS test file; a missing one fails the test and says what is missing (never a silent skip)."""
    path = PUMS_DIR / name
    if not path.is_file():
        pytest.fail(f"missing test data {path}: the PUMS files live in ../shared/data/pums beside the repo")
    return path


def app_defaults() -> dict[str, Any]:
    """`[tool.flwr.app.config]` of pyproject.toml: what `flwr run .` starts from."""
    with (PROJECT / "pyproject.toml").open("rb") as handle:
        return dict(tomllib.load(handle)["tool"]["flwr"]["app"]["config"])


class RecordingGrid(InProcessGrid):
    """An `InProcessGrid` whose `calls` list (node id, message type) of every message it delivered,
    in order, so a test can count a node's train rounds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[int, str]] = []

    def push_messages(self, messages: Iterable[Message], timeout: float | None = None) -> Iterable[str]:
        messages = list(messages)
        self.calls += [(m.metadata.dst_node_id, m.metadata.message_type) for m in messages]
        return super().push_messages(messages, timeout)

    def restart_node(self, node_id: int) -> None:
        """What a SuperNode restart loses: its in-memory `context.state`."""
        self.contexts[node_id].state = RecordDict()


def load_scenario(path: Path) -> SweepSpec:
    """Read and validate a scenario file; its name defaults to the file's stem."""
    return validate(read_scenario(path), base_dir=path.resolve().parent, default_name=path.stem)


class CountingRunner(FastCellRunner):
    """The fast engine's cell runner, counting what it runs (tuning runs and cells, as
    `<parent folder>/<folder>`); tests reset `ran` before a sweep."""

    ran: list[str] = []

    def run_cell(self, cell: Any, results_dir: Path, on_round: Any) -> None:
        CountingRunner.ran.append(f"{results_dir.parent.name}/{results_dir.name}")
        super().run_cell(cell, results_dir, on_round)
