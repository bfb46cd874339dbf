"""`--engine flower`: every cell is a real `flwr run` on a simulation SuperLink that the sweep starts.

`setup` starts `flower-superlink --simulation` on a free port of 127.0.0.1 with a private
FLWR_HOME (a temporary folder holding the CLI connection and the SuperLink's log) and Flower kept
offline: no runtime dependency installation (it would reinstall torch for every run), no
telemetry, no update checks. The SuperLink keeps this environment for every run it starts.

`run_cell` writes the cell's run config to a TOML file and submits it with
`flwr run <project> fedprivacy-sweep --run-config FILE --federation-config "num-supernodes=…
client-resources-num-cpus=… client-resources-num-gpus=…" --format json`, follows the rounds through
the rounds.csv the ServerApp rewrites, and judges the run by its final status from
`flwr list --run-id ID` (`finished:completed`), never by flwr's exit code, which is 0 for failed
runs too. `teardown` ends the SuperLink and everything it started (`sims.processes.end_tree`) and
removes the FLWR_HOME; the sweep calls it also when interrupted (Ctrl-C, or SIGTERM, which the
command turns into an interrupt).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedprivacy.sweepfiles import read_json
from sims.processes import end_tree, free_port
from sims.sweep.grid import Cell
from sims.sweep.progress import watching_rounds
from sims.sweep.spec import Resources

CONNECTION = "fedprivacy-sweep"
OFFLINE_ENV = {
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
}
HEALTHY_WITHIN_S = 60.0
POLL_S = 2.0
RUN_LOG = "flwr-run.log"
PENDING_LIMIT_S = 300.0  # a run still `pending` this long will not start (a known SuperLink hang)
PROJECT = Path(__file__).resolve().parents[3]  # the source folder: `flwr run` builds the app from its pyproject.toml


def _tool(name: str) -> str:
    """A Flower command from this Python's environment (the one that has fedprivacy installed)."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    if found is None:
        raise RuntimeError(f"`{name}` not found beside {sys.executable} or on PATH: install flwr[simulation]")
    return found


def _toml_value(value: Any) -> str:
    """A run-config value (bool, int, float or str) as TOML; JSON's string escapes are TOML's."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(value, ensure_ascii=False)


def write_run_config(config: dict[str, Any], path: Path) -> Path:
    path.write_text("".join(f"{key} = {_toml_value(value)}\n" for key, value in config.items()), encoding="utf-8")
    return path


class FlowerCellRunner:
    """Runs a sweep cell as a `flwr run` on the SuperLink that `setup` starts."""

    def __init__(self, resources: Resources) -> None:
        self.resources = resources
        self.home: Path | None = None
        self.superlink: subprocess.Popen[bytes] | None = None

    def _env(self) -> dict[str, str]:
        # The SuperLink starts `flower-superexec` (and that, the run) by name: this Python's
        # commands come first on PATH even when its environment was not activated.
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        return {**os.environ, **OFFLINE_ENV, "FLWR_HOME": str(self.home), "PATH": path}

    def setup(self) -> None:
        if not (PROJECT / "pyproject.toml").is_file():
            raise RuntimeError(
                f"the flower engine runs the app from its source folder, and {PROJECT} has no pyproject.toml"
            )
        self.home = Path(tempfile.mkdtemp(prefix="fedprivacy-flwr-home-"))
        port = free_port()
        with (self.home / "superlink.log").open("wb") as log:
            self.superlink = subprocess.Popen(
                [
                    _tool("flower-superlink"),
                    "--insecure",
                    "--simulation",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--database",
                    ":flwr-in-memory:",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env(),
                start_new_session=True,
            )
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n'
            f'[superlink.{CONNECTION}]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
        )
        self._wait_healthy(port)
        print(
            f"flower engine: SuperLink pid {self.superlink.pid} on 127.0.0.1:{port}, FLWR_HOME {self.home}",
            file=sys.stderr,
            flush=True,
        )

    def _wait_healthy(self, port: int) -> None:
        deadline = time.monotonic() + HEALTHY_WITHIN_S
        while time.monotonic() < deadline:
            if self.superlink is not None and self.superlink.poll() is not None:
                break
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                return
            except OSError:
                time.sleep(0.5)
        log = (self.home / "superlink.log").read_text(errors="replace").strip().splitlines()[-5:] if self.home else []
        raise RuntimeError(
            f"the SuperLink on port {port} did not come up within {HEALTHY_WITHIN_S:g} s: {' | '.join(log)}"
        )

    def _flwr(self, *args: str) -> dict[str, Any]:
        result = subprocess.run(
            [_tool("flwr"), *args, "--format", "json"],
            cwd=PROJECT,
            env=self._env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        try:
            return json.loads(result.stdout)
        except json.JSONDecodeError:
            raise RuntimeError(
                f"flwr {args[0]} answered no JSON: {(result.stdout + result.stderr).strip()[-300:]}"
            ) from None

    def run_cell(self, cell: Cell, results_dir: Path, on_round: Callable[[int], None]) -> None:
        config = write_run_config(
            {**cell.run_config, "results-dir": str(results_dir.resolve())}, results_dir / "run-config.toml"
        )
        federation = (
            f"num-supernodes={cell.num_clients} client-resources-num-cpus={self.resources.client_cpus} "
            f"client-resources-num-gpus={self.resources.client_gpus:g}"
        )
        reply = self._flwr(
            "run", str(PROJECT), CONNECTION, "--run-config", str(config), "--federation-config", federation
        )
        if not reply.get("success"):
            raise RuntimeError(f"flwr run refused the cell: {reply.get('error-message', reply)}")
        run_id = str(reply["run-id"])
        with watching_rounds(results_dir, on_round):
            run = self._wait_finished(run_id)
        if run["status"] != "finished:completed":
            summaries = list(results_dir.rglob("summary.json"))
            reason = read_json(summaries[0]).get("error") if summaries else None
            self._save_log(run_id, results_dir / RUN_LOG)
            raise RuntimeError(
                f"flwr run {run_id} ended {run['status']}: {reason or run.get('status-details') or 'no reason given'} "
                f"(its log: {RUN_LOG} in the cell's folder)"
            )

    def _save_log(self, run_id: str, path: Path) -> None:
        """The run's log as `flwr log` shows it: the SuperLink and its FLWR_HOME end with the sweep."""
        result = subprocess.run(
            [_tool("flwr"), "log", run_id, "--show"],
            cwd=PROJECT,
            env=self._env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        path.write_text(result.stdout + result.stderr, encoding="utf-8")

    def _wait_finished(self, run_id: str) -> dict[str, Any]:
        pending_since = time.monotonic()
        while True:
            (run,) = self._flwr("list", "--run-id", run_id)["runs"]
            if run["status"].startswith("finished:"):
                return run
            if run["status"] != "pending":
                pending_since = time.monotonic()
            elif time.monotonic() - pending_since > PENDING_LIMIT_S:
                self._flwr("stop", run_id)
                raise RuntimeError(f"flwr run {run_id} stayed pending for {PENDING_LIMIT_S:g} s and was stopped")
            time.sleep(POLL_S)

    def teardown(self) -> None:
        if self.superlink is not None:
            end_tree(self.superlink)
        self.superlink = None
        if self.home is not None:
            shutil.rmtree(self.home, ignore_errors=True)
            self.home = None


def create(resources: Resources) -> FlowerCellRunner:
    return FlowerCellRunner(resources)
