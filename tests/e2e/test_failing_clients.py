"""Slow tier: failing clients through `flwr run` (a simulation SuperLink, Ray actors).

The project's app is not changed: the test builds a test-only Flower app next to it whose
ClientApp is the real one wrapped by `faultkit` (pyproject's clientapp points at it), so no run
config and no server message can ever switch faults on.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from faultkit import Faults, check_run
from test_flower_processes import only_folder, start_simulation_superlink

pytestmark = pytest.mark.slow

PROJECT = Path(__file__).resolve().parents[2]
CLIENTS, ROUNDS, TIMEOUT = 6, 3, 60.0  # Ray starts its actors within round 1
SEED = 98  # 9 faults in 18 client rounds, every kind, the hang in the last round (checked below)

FAULTY_APP = '''"""Test-only ClientApp: the real one, with the faults that faults.json schedules."""
from pathlib import Path

from clients.app import app as real
from faultkit import Faults, faulty

app = faulty(real, Faults.from_file(Path(__file__).with_name("faults.json")))
'''


def faulty_app_dir(folder: Path, faults: Faults) -> Path:
    """A Flower app folder: the project's pyproject with the wrapped ClientApp, and the wrapper."""
    folder.mkdir()
    pyproject = (PROJECT / "pyproject.toml").read_text()
    assert 'clientapp = "clients.app:app"' in pyproject
    (folder / "pyproject.toml").write_text(pyproject.replace('clientapp = "clients.app:app"', 'clientapp = "faulty_app:app"'))
    (folder / "faulty_app.py").write_text(FAULTY_APP)
    shutil.copy(PROJECT / "tests" / "faultkit.py", folder / "faultkit.py")
    faults.to_file(folder / "faults.json")
    return folder


@pytest.mark.timeout(300)
def test_flwr_run_completes_while_thirty_percent_of_clients_fail(flower, tmp_path):
    faults = Faults(rate=0.3, seed=SEED, hang_s=TIMEOUT + 5, log=tmp_path / "faults.jsonl")
    schedule = faults.schedule(ROUNDS, [str(i) for i in range(CLIENTS)])
    assert len(set(schedule.values())) == 7 and [r for (r, _), k in schedule.items() if k == "hang"] == [ROUNDS]
    app = faulty_app_dir(tmp_path / "app", faults)
    start_simulation_superlink(flower)
    results = tmp_path / "results"
    reply = flower.cli(
        "run", str(app), "e2e",
        "--run-config", f"results-dir='{results}' num-server-rounds={ROUNDS} round-timeout={TIMEOUT}",
        "--federation-config", f"num-supernodes={CLIENTS} client-resources-num-cpus=1",
    )  # fmt: skip
    assert reply.get("success"), reply
    run = flower.wait_finished(str(reply["run-id"]), timeout=240)
    log = flower.run_log(str(reply["run-id"]))
    assert run["status"] == "finished:completed", log
    injected = check_run(only_folder(results), faults, schedule, log)
    assert len(injected) >= 5  # the hung client's later faults are never asked for
