"""Load: 200 simulated clients per round for 20 rounds, in process (the real apps on
InProcessGrid), with every client within budget and memory that does not grow per round.

Resident memory is read after every train round (`/proc/self/statm`), with the process's peak so
far (`ru_maxrss`); the figures are printed and written to `load.json` in the test's folder
(README, docs/testing.md). Slow-marked: about two minutes on 2 cores.
"""

from __future__ import annotations

import csv
import json
import os
import resource
import time

import pytest
from harness import PUMS, app_defaults

from clients.app import app as client_app
from server.app import app as server_app
from sims.inprocess import InProcessGrid, run_server

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

CLIENTS, ROUNDS = 200, 20
MiB = 2**20


def rss_mib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MiB


class MeasuredGrid(InProcessGrid):
    """InProcessGrid that notes memory and time after every train round."""

    samples: list[dict[str, float]]

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        started = time.perf_counter()
        replies = super().send_and_receive(messages, timeout=timeout)
        if messages and messages[0].metadata.message_type == "train":
            self.samples.append(
                {
                    "round": len(self.samples) + 1,
                    "clients": len(messages),
                    "rss_mib": round(rss_mib(), 1),
                    "peak_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                    "seconds": round(time.perf_counter() - started, 2),
                }
            )
        return replies


@pytest.mark.timeout(900)
def test_two_hundred_clients_for_twenty_rounds_stay_within_budget_and_memory(tmp_path):
    if not PUMS.is_file():
        pytest.skip(f"PUMS file missing: {PUMS}")
    config = {
        **app_defaults(),
        "dataset": "pums",
        "data-path": str(PUMS),
        "partitioning": "iid",
        "num-server-rounds": ROUNDS,
        "min-clients": CLIENTS,
        "fraction-evaluate": 0.0,
        "results-dir": str(tmp_path / "results"),
    }
    grid = MeasuredGrid.simulation(client_app, CLIENTS, config)
    grid.samples = []
    started = time.perf_counter()
    run_server(server_app, grid, config)
    wall = time.perf_counter() - started

    (folder,) = (tmp_path / "results").iterdir()
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["all_within_budget"] is True and summary["clients"] == CLIENTS
    with (folder / "clients.csv").open(newline="") as handle:
        clients = list(csv.DictReader(handle))
    assert len(clients) == CLIENTS and all(float(c["epsilon_spent"]) <= float(c["epsilon_budget"]) for c in clients)
    with (folder / "rounds.csv").open(newline="") as handle:
        assert [int(r["clients_trained"]) for r in csv.DictReader(handle)] == [CLIENTS] * ROUNDS

    samples = grid.samples
    (tmp_path / "load.json").write_text(json.dumps({"wall_s": round(wall, 1), "rounds": samples}, indent=1))
    print(json.dumps({"wall_s": round(wall, 1), "rounds": samples}))
    assert [s["clients"] for s in samples] == [CLIENTS] * ROUNDS
    # memory does not grow per round: after the first rounds (caches, allocator) it stays flat
    settled = [s["rss_mib"] for s in samples[4:]]
    assert max(settled) - settled[0] < 40, samples
    assert samples[-1]["peak_mib"] - samples[4]["peak_mib"] < 40, samples
