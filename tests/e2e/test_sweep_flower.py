"""Slow tier: `fedprivacy sweep --engine flower`, a real `flwr run` per cell on a SuperLink the sweep
starts and stops itself, with its own FLWR_HOME and port; and Ctrl-C stopping that SuperLink."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from harness import load_scenario

from sims.processes import alive
from sims.sweep.driver import run_sweep
from sims.sweep.grid import cells

pytestmark = pytest.mark.slow

PROJECT = Path(__file__).resolve().parents[2]
TINY = PROJECT / "scenarios" / "tiny.toml"
SUPERLINK_LINE = re.compile(r"SuperLink pid (\d+) on 127\.0\.0\.1:\d+, FLWR_HOME (\S+)")


def sweep_process(out: Path, log: Path) -> subprocess.Popen:
    """`fedprivacy sweep scenarios/tiny.toml --engine flower` with a clean Flower environment (the
    engine sets the offline variables and FLWR_HOME itself)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLWR_")}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fedprivacy",
            "sweep",
            str(TINY),
            "--out",
            str(out),
            "--engine",
            "flower",
            "--no-baseline",
        ],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        preexec_fn=_ctrl_c_as_in_a_terminal,
    )


def _ctrl_c_as_in_a_terminal() -> None:
    """A test suite started in the background by a shell (`pytest &`) ignores SIGINT, and its
    children inherit that: the sweep gets Ctrl-C's default handling, as it would in a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def superlink(log: Path) -> tuple[int, Path]:
    match = SUPERLINK_LINE.search(log.read_text())
    assert match, log.read_text()
    return int(match.group(1)), Path(match.group(2))


def processes_of(home: Path) -> list[int]:
    """Live processes whose environment has FLWR_HOME=home (the SuperLink and everything it started)."""
    marker = f"\0FLWR_HOME={home}\0".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker in b"\0" + environ.read_bytes() + b"\0" and alive(int(environ.parent.name)):
                found.append(int(environ.parent.name))
        except OSError:  # ended meanwhile, or not ours to read
            continue
    return found


@pytest.mark.timeout(420)
def test_the_tiny_scenario_through_flwr_run_gives_the_in_process_results(tmp_path):
    out, log = tmp_path / "flower", tmp_path / "sweep.log"
    process = sweep_process(out, log)
    try:
        assert process.wait(timeout=360) == 0, log.read_text()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    flower = pd.read_csv(out / "sweep.csv")
    assert set(flower["status"]) == {"completed"} and set(flower["engine"]) == {"flower"} and len(flower) == 2
    pid, home = superlink(log)
    assert not alive(pid) and not home.exists()  # the sweep stopped its SuperLink and removed its FLWR_HOME

    spec = load_scenario(TINY)  # the same cells in process: one algorithm, the same seeds, the same numbers
    in_process = pd.DataFrame(run_sweep(spec, cells(spec), tmp_path / "inprocess").rows)
    columns = ["final_accuracy", "best_accuracy", "epsilon_spent_max", "epsilon_spent_mean"]
    assert flower[columns].to_numpy() == pytest.approx(in_process[columns].to_numpy(dtype=float), abs=1e-6)


@pytest.mark.timeout(300)
def test_ctrl_c_stops_the_superlink_and_leaves_the_cell_to_a_rerun(tmp_path):
    out, log = tmp_path / "flower", tmp_path / "sweep.log"
    process = sweep_process(out, log)
    first = out / "cells" / "epsilon=1_rule=calibrated"
    deadline = time.monotonic() + 200
    while not list(first.rglob("rounds.csv")):  # the first cell's run is under way (Ray started, a round done)
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGINT)
    assert process.wait(timeout=90) == 130, log.read_text()
    assert "interrupted: rerun the same command to resume" in log.read_text()
    pid, home = superlink(log)
    assert not alive(pid) and not home.exists()
    assert processes_of(home) == []  # nor anything it started (the run's simulation process, Ray)
    assert set(pd.read_csv(out / "sweep.csv")["status"]) == {"pending"}
