"""Slow tier: failing clients through `flwr run` (a simulation SuperLink, Ray actors).

The project's app is not changed: the test builds a test-only Flower app (testapps.py) whose
ClientApp is the real one wrapped by `faultkit`, so no run config and no server message can ever
switch faults on.
"""

from __future__ import annotations

import pytest
from faultkit import Faults, check_run
from test_flower_processes import only_folder, start_simulation_superlink
from testapps import wrapped_app

pytestmark = pytest.mark.slow

CLIENTS, ROUNDS, TIMEOUT = 6, 3, 60.0  # Ray starts its actors within round 1
SEED = 98  # 9 faults in 18 client rounds, every kind, the hang in the last round (checked below)


@pytest.mark.timeout(300)
def test_flwr_run_completes_while_thirty_percent_of_clients_fail(flower, tmp_path):
    faults = Faults(rate=0.3, seed=SEED, hang_s=TIMEOUT + 5, log=tmp_path / "faults.jsonl")
    schedule = faults.schedule(ROUNDS, [str(i) for i in range(CLIENTS)])
    assert len(set(schedule.values())) == 7 and [r for (r, _), k in schedule.items() if k == "hang"] == [ROUNDS]
    settings = {"rate": faults.rate, "seed": faults.seed, "hang_s": faults.hang_s, "log": str(faults.log)}
    app = wrapped_app(
        tmp_path / "app",
        "faultkit",
        'faultkit.faulty(real, faultkit.Faults.from_file(HERE / "faults.json"))',
        "faults.json",
        settings,
    )
    start_simulation_superlink(flower)
    results = tmp_path / "results"
    reply = flower.cli(
        "run",
        str(app),
        "e2e",
        "--run-config",
        f"results-dir='{results}' num-server-rounds={ROUNDS} round-timeout={TIMEOUT}",
        "--federation-config",
        f"num-supernodes={CLIENTS} client-resources-num-cpus=1",
    )
    assert reply.get("success"), reply
    run = flower.wait_finished(str(reply["run-id"]), timeout=240)
    log = flower.run_log(str(reply["run-id"]))
    assert run["status"] == "finished:completed", log
    injected = check_run(only_folder(results), faults, schedule, log)
    assert len(injected) >= 5  # the hung client's later faults are never asked for
