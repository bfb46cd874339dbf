"""Process-level fixtures: a private SuperLink (simulation or deployment), SuperNodes, the CLI.

Every process is started in its own session and ended by its PID's process group in teardown,
even when the test fails; each test gets its own FLWR_HOME and free ports, so a SuperLink that
another checkout left on Flower's default ports can never capture our runs. A run's success is
its final status from `flwr list` (`finished:completed`), never `flwr run`'s exit code.
Tests use the `flower` fixture (never `import conftest`: tests/conftest.py has that name too).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
OFFLINE_ENV = {
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _end(process: subprocess.Popen) -> None:
    """Terminate the process group we started (SIGTERM, then SIGKILL after 15 s)."""
    if process.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@dataclass
class Flower:
    """One test's Flower world: its FLWR_HOME, its processes, and the CLI pointed at them."""

    home: Path
    processes: list[subprocess.Popen] = field(default_factory=list)
    free_port = staticmethod(free_port)

    def env(self, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            **OFFLINE_ENV,
            "FLWR_HOME": str(self.home),
            "PATH": f"{BIN}:{os.environ['PATH']}",
            **extra,
        }

    def start(self, name: str, args: list[str], home: Path | None = None) -> subprocess.Popen:
        log = (self.home / f"{name}.log").open("w")
        env = self.env(FLWR_HOME=str(home or self.home))
        process = subprocess.Popen(
            [str(BIN / args[0]), *args[1:]],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.processes.append(process)
        return process

    def log(self, name: str) -> str:
        return (self.home / f"{name}.log").read_text(errors="replace")

    def wait_healthy(self, port: int, *, scheme: str = "http", timeout: float = 60, context=None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{scheme}://127.0.0.1:{port}/health", timeout=2, context=context)
                return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"SuperLink on port {port} not healthy after {timeout} s:\n{self.log('superlink')}")

    def connect(self, name: str, port: int, *, root_certificates: Path | None = None) -> None:
        """Write the CLI connection `name` into this FLWR_HOME's config.toml."""
        security = f'root-certificates = "{root_certificates}"' if root_certificates else "insecure = true"
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{name}"\n\n[superlink.{name}]\naddress = "127.0.0.1:{port}"\n{security}\n'
        )

    def cli(self, *args: str, timeout: float = 120) -> dict:
        result = subprocess.run(
            [str(BIN / "flwr"), *args, "--format", "json"],
            cwd=PROJECT,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        try:
            return json.loads(result.stdout)
        except json.JSONDecodeError:
            raise AssertionError(f"flwr {' '.join(args)} gave no JSON:\n{result.stdout}\n{result.stderr}") from None

    def submit(self, connection: str, run_config: str, federation_config: str | None = None) -> str:
        args = ["run", ".", connection, "--run-config", run_config]
        if federation_config:
            args += ["--federation-config", federation_config]
        reply = self.cli(*args)
        assert reply.get("success"), reply
        return str(reply["run-id"])

    def wait_finished(self, run_id: str, timeout: float) -> dict:
        """Poll `flwr list --run-id` until the run's status starts with `finished:`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            (run,) = self.cli("list", "--run-id", run_id)["runs"]
            if run["status"].startswith("finished:"):
                return run
            time.sleep(3)
        raise TimeoutError(f"run {run_id} not finished after {timeout} s")

    def run_log(self, run_id: str) -> str:
        result = subprocess.run(
            [str(BIN / "flwr"), "log", run_id, "--show"],
            cwd=PROJECT,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        return result.stdout + result.stderr


@pytest.fixture
def flower(tmp_path: Path) -> Iterator[Flower]:
    world = Flower(home=tmp_path / "flwr-home")
    world.home.mkdir()
    try:
        yield world
    finally:
        for process in reversed(world.processes):  # SuperNodes first, the SuperLink last
            _end(process)
