"""Shared fixtures for the Flower apps: an in-process grid (no Ray, no processes).

Tests reach these through fixtures, never `import conftest`: tests/e2e has its own conftest and
two top-level `conftest` modules cannot both be imported by name.

The grid itself lives in `sims.inprocess` (simulation scenarios drive the apps with it too):
`InProcessGrid` calls the ClientApp object directly, one `Context` per node that persists across
rounds, and turns a handler's exception into an error reply, as Flower does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import RecordingGrid, app_defaults

from sims.inprocess import run_server


@pytest.fixture
def in_process() -> Any:
    """The harness: `in_process.Grid` (harness.RecordingGrid), `.run_server`, `.defaults()`."""
    return type(
        "InProcessHarness",
        (),
        {
            "Grid": RecordingGrid,
            "run_server": staticmethod(run_server),
            "defaults": staticmethod(app_defaults),
        },
    )


@pytest.fixture
def run_config(tmp_path: Path) -> dict[str, Any]:
    """The app defaults, results under tmp_path, reproducible noise."""
    return {**app_defaults(), "results-dir": str(tmp_path / "results"), "noise-seed": 7}


@pytest.fixture(
    params=[
        "cpu",
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
    ]
)
def compute_device(request: pytest.FixtureRequest) -> torch.device:
    """Each device-sensitive training test runs on the CPU, and on the GPU too when one is visible."""
    return torch.device(request.param)


@pytest.fixture
def simulate() -> Any:
    """`simulate(run_config, num_nodes, run_id=1)`: the ServerApp and ClientApp in process on
    `num_nodes` simulated clients; returns the grid (its call log)."""
    from clients.app import app as client_app
    from server.app import app as server_app

    def run(run_config: dict[str, Any], num_nodes: int, run_id: int = 1) -> RecordingGrid:
        grid = RecordingGrid.simulation(client_app, num_nodes, run_config, run_id)
        run_server(server_app, grid, run_config)
        return grid

    return run


@pytest.fixture
def fedprivacy_cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """`fedprivacy_cli(*args)`: the `fedprivacy` command in this process: (exit code, stdout, stderr)."""
    import sys

    from fedprivacy import cli

    def run(*args: str) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", ["fedprivacy", *args])
        with pytest.raises(SystemExit) as exit_info:
            cli.main()
        captured = capsys.readouterr()
        return int(exit_info.value.code or 0), captured.out, captured.err

    return run
