"""Failing clients, in process: 30% of the clients misbehave in every round (faultkit), the server
drops each bad reply naming the client, aggregates the rest, and the run completes.

Spends are counted three ways: what the wrapper injected, what the server recorded per reply
(replies.csv), and what each client's ledger holds. None may disagree.
"""

from __future__ import annotations

import logging
import sqlite3
from collections import Counter
from pathlib import Path

import pytest
from faultkit import KINDS, Faults, check_run, faulty, read_csv

from clients.app import app as client_app
from server.app import app as server_app

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # seeded noise on purpose

CLIENTS, ROUNDS, TIMEOUT = 10, 4, 8.0
SEED = 1  # a schedule that holds every kind of fault, checked below


def ledger_spends(path: Path) -> Counter:
    """(account, run, round) -> number of distinct spends recorded for it."""
    with sqlite3.connect(path) as db:
        rows = db.execute(
            "SELECT k.account, s.run_id, s.server_round, COUNT(DISTINCT s.recorded_at) FROM spends AS s "
            "JOIN account_keys AS k ON k.id = s.account_key GROUP BY k.account, s.run_id, s.server_round"
        ).fetchall()
    return Counter({(a, r, n): c for a, r, n, c in rows})


def test_thirty_percent_of_clients_fail_every_round_and_the_run_completes(in_process, run_config, tmp_path, caplog):
    faults = Faults(rate=0.3, seed=SEED, hang_s=TIMEOUT + 2, log=tmp_path / "faults.jsonl")
    schedule = faults.schedule(ROUNDS, [str(i) for i in range(CLIENTS)])
    assert set(schedule.values()) == set(KINDS)  # the test exercises every kind of fault
    config = {**run_config, "num-server-rounds": ROUNDS, "round-timeout": TIMEOUT}
    grid = in_process.Grid.simulation(faulty(client_app, faults), CLIENTS, config)
    with caplog.at_level(logging.WARNING):
        in_process.run_server(server_app, grid, config)
    (folder,) = [p for p in Path(config["results-dir"]).iterdir() if p.is_dir()]
    injected = check_run(folder, faults, schedule, caplog.text)

    # spends: every client that ran its real round has exactly one ledger spend for it (a crash
    # before training has none); the ledger never counts fewer steps than the server received
    replies = read_csv(folder / "replies.csv")
    ran = {(int(r["round"]), r["client_id"]) for r in replies if r["outcome"] == "trained"}
    ran |= {key for key, kind in injected.items() if kind != "raise"}
    spends = ledger_spends(folder / "ledger.sqlite")
    assert set(spends.values()) == {1}
    assert Counter(account.rsplit("/", 1)[1] for account, _, _ in spends) == Counter(client for _, client in ran)
    for row in read_csv(folder / "clients.csv"):
        assert int(row["steps_all_runs"]) >= int(row["steps_this_run"]) > 0
        assert float(row["epsilon_spent"]) <= float(row["epsilon_budget"])
