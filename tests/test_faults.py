"""Failing clients, in process: 30% of the clients misbehave in every round (faultkit), the server
drops each bad reply naming the client, aggregates the rest, and the run completes.

Spends are counted three ways: what the wrapper injected, what the server recorded per reply
(replies.csv), and what each client's ledger holds. None may disagree.
"""

from __future__ import annotations

import csv
import json
import logging
import sqlite3
from collections import Counter
from pathlib import Path

import pytest
import torch

from clients.app import app as client_app
from faultkit import KINDS, OUTCOMES, REASONS, Faults, faulty
from server.app import app as server_app

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # seeded noise on purpose

CLIENTS, ROUNDS, TIMEOUT = 10, 4, 8.0
SEED = 1  # a schedule that holds every kind of fault, checked below


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def ledger_rounds(path: Path) -> Counter:
    """(account, run, round) -> number of distinct spends recorded for it."""
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT account, run_id, server_round, COUNT(DISTINCT recorded_at) FROM spends "
                          "GROUP BY account, run_id, server_round").fetchall()
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
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["all_within_budget"] is True

    injected = {(f["round"], f["client"]): f["kind"] for f in faults.injected()}
    nodes = {f["client"]: f["node"] for f in faults.injected()}
    assert injected and set(injected.items()) <= set(schedule.items())
    replies = read_csv(folder / "replies.csv")
    dropped = {(int(r["round"]), r["client_id"]): r for r in replies if r["outcome"] not in ("trained", "exhausted")}
    # every injected fault, and nothing else, was dropped, with the outcome and reason it deserves
    assert set(dropped) == set(injected)
    for key, kind in injected.items():
        assert dropped[key]["outcome"] == OUTCOMES[kind], (key, kind, dropped[key])
        assert REASONS[kind] in dropped[key]["reason"], (key, kind, dropped[key])
        named = (f"reply of client {key[1]} dropped", f"reply of client node-{nodes[key[1]]} dropped")  # before its first reply
        assert any(f"round {key[0]}: {name}" in caplog.text for name in named), key
    # a hung client's node is gone for the run; others are retried (3 strikes in a row exclude)
    clients = {r["client_id"]: r for r in read_csv(folder / "clients.csv")}
    for (server_round, client), kind in injected.items():
        if kind == "hang":
            assert clients[client]["excluded_round"] == str(server_round)

    rounds = read_csv(folder / "rounds.csv")
    for row in rounds:
        r = int(row["round"])
        assert int(row["clients_dropped"]) == sum(1 for k in injected if k[0] == r)
        assert int(row["clients_trained"]) == int(row["clients_sampled"]) - int(row["clients_dropped"]) > 0
    assert float(rounds[-1]["accuracy"]) > float(rounds[0]["accuracy"]) - 0.05 and float(rounds[-1]["accuracy"]) > 0.3
    model = torch.load(folder / "model.pt")
    assert all(torch.isfinite(v).all() for v in model.values())  # never a NaN in the global model

    # spends: every client that ran its real round has exactly one ledger spend for it (a crash
    # before training has none); the ledger never counts fewer steps than the server received
    trained_for_real = {(int(r["round"]), r["client_id"]) for r in replies if r["outcome"] == "trained"}
    trained_for_real |= {k for k, kind in injected.items() if kind != "raise"}
    spends = ledger_rounds(folder / "ledger.sqlite")
    assert all(count == 1 for count in spends.values())
    by_client = Counter(account.rsplit("/", 1)[1] for account, _, _ in spends)
    assert by_client == Counter(client for _, client in trained_for_real)
    for row in clients.values():
        assert int(row["steps_all_runs"]) >= int(row["steps_this_run"])
        assert float(row["epsilon_spent"]) <= float(row["epsilon_budget"])
