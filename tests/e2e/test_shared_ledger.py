"""Slow tier: two SuperNodes started with the same node config (one client-id, one data file, one
ledger: one account), as separate processes, in the same run: every round is spent once, by the
one whose update the server aggregates; the other is refused before its update leaves. No spend
lost, none doubled. (Two client-ids on one file and ledger are refused outright:
tests/test_deployed_records.py.)"""

from __future__ import annotations

import csv
import json
import sqlite3

import pytest
from test_flower_processes import only_folder, pums_nodes, start_superlink, start_supernode

from fedprivacy.privacy.plan import Plan

pytestmark = pytest.mark.slow
ROUNDS = 3


@pytest.mark.timeout(300)
def test_two_supernodes_on_one_ledger_and_data_spend_each_round_once(flower, tmp_path):
    (config,) = pums_nodes(tmp_path, {1101: 1.0})
    port = start_superlink(flower)
    for name in ("twin-a", "twin-b"):
        start_supernode(flower, name, port, config)
    run_id = flower.submit(
        "deployment",
        f"dataset='pums' min-clients=2 fraction-evaluate=0 num-server-rounds={ROUNDS} results-dir='{tmp_path / 'r'}'",
    )
    run = flower.wait_finished(run_id, timeout=240)
    assert run["status"] == "finished:completed", flower.run_log(run_id)

    folder = only_folder(tmp_path / "r")
    with (folder / "replies.csv").open(newline="") as handle:
        replies = list(csv.DictReader(handle))
    trained = sorted(int(r["round"]) for r in replies if r["outcome"] == "trained")
    assert trained == list(range(1, ROUNDS + 1))  # one update per round reached the server, never two
    refused = [r for r in replies if r["outcome"] == "error"]
    assert len(refused) == ROUNDS and all("already trained" in r["reason"] for r in refused), replies

    with sqlite3.connect(tmp_path / "ledger-1101.sqlite") as db:
        spends = db.execute(
            "SELECT server_round, COUNT(DISTINCT recorded_at), SUM(steps) FROM spends "
            "WHERE run_id = ? GROUP BY server_round ORDER BY server_round",
            (run_id,),
        ).fetchall()
        (plan_json,) = db.execute("SELECT plan_json FROM plans WHERE run_id = ?", (run_id,)).fetchone()
    plan = Plan.from_dict(json.loads(plan_json))
    assert spends == [(r, 1, plan.steps_in_round(r)) for r in range(1, ROUNDS + 1)]  # none lost, none doubled
