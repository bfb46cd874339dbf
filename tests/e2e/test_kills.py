"""Slow tier: SuperNodes killed with SIGKILL at 20 moments of their rounds, in a real deployment.

Four victim SuperNodes (each its own data file and ledger) and one steady one train a long run of
the test-only app `killpoints` (the real ClientApp with named points). Five times, each victim is
armed at a point of its next round and its whole process group is SIGKILLed there (or a random
delay after it); then its ledger must open, pass `PRAGMA integrity_check`, hold at most one spend
per (run, round) and never fewer steps than any reply that was about to leave; the victim is
restarted with the same node config. The run must complete, and every victim must resume its plan
(the same one before and after each kill) and stay within budget.
"""

from __future__ import annotations

import csv
import json
import os
import random
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
from killpoints import arm, marker
from test_flower_processes import only_folder, pums_nodes, start_superlink, start_supernode
from testapps import wrapped_app

from fedprivacy.ledger import Ledger

pytestmark = pytest.mark.slow

PUMAS = (1101, 1102, 1103, 1104)  # the victims; 1105 trains undisturbed
POINTS = ("received", "training", "recorded", "returning", "random", "sending")
DELAYS = {"random": 1.0, "sending": 0.3}  # a timed kill lands uniformly within this many seconds
# The round timeout must cover round 1, when five clientapp processes start at once on the same
# cores (each imports torch and dp-accounting and plans: about 21 s on 2 cores); a client whose
# reply misses it is not asked again, and a killed victim's round lasts that long.
BATCHES, ROUNDS, TIMEOUT = 5, 11, 60.0
# A kill while a reply uploads holds the ServerApp's pull until Flower's object push session
# expires (180 s), past the round timeout: a batch, and the run, must leave room for that.
UPLOAD_CUT_S = 200


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL a SuperNode and everything it started (its clientapp processes share its group)."""
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(_group(pid) == process.pid for pid in _pids()):
        assert time.monotonic() < deadline, "processes of a killed SuperNode survived"
        time.sleep(0.1)


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _group(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None


def released(control: Path) -> list[dict]:
    log = control / "released.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.is_file() else []


def check_ledger(path: Path, released_steps: int, budget: float) -> dict:
    """The promises a ledger keeps after a kill; returns its state."""
    if not path.exists():  # killed before its first spend: nothing may have left
        assert released_steps == 0
        return {"steps": 0, "rounds": []}
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        repeats = db.execute(
            "SELECT MAX(n) FROM (SELECT COUNT(DISTINCT recorded_at) AS n FROM spends "
            "GROUP BY account_key, run_id, server_round)"
        ).fetchone()[0]
        rounds = [r for (r,) in db.execute("SELECT DISTINCT server_round FROM spends ORDER BY server_round")]
    assert repeats in (None, 1), f"{path}: a (run, round) spent twice"
    accounts = Ledger(path).accounts()  # the project's own reader opens it
    steps = accounts[0].steps if accounts else 0
    assert steps >= released_steps, f"{path}: ledger counts {steps} steps, a reply left with {released_steps}"
    assert all(a.epsilon_spent <= a.epsilon == budget for a in accounts)
    return {"steps": steps, "rounds": rounds}


@pytest.mark.timeout(2100)
def test_supernodes_killed_at_twenty_moments_keep_consistent_ledgers_and_resume(flower, tmp_path):
    rng = random.Random(20)
    control = tmp_path / "control"
    control.mkdir()
    configs = pums_nodes(tmp_path, {**dict.fromkeys(PUMAS, 1.0), 1105: 1.0})
    port = start_superlink(flower)
    victims = {f"puma-{puma}": (config, tmp_path / f"ledger-{puma}.sqlite") for puma, config in zip(PUMAS, configs)}
    processes = {name: start_supernode(flower, f"{name}-0", port, config) for name, (config, _) in victims.items()}
    start_supernode(flower, "steady", port, configs[-1])
    app = wrapped_app(
        tmp_path / "app", "killpoints", "killpoints.killable(real)", "killpoints.json", {"dir": str(control)}
    )
    results = tmp_path / "results"
    reply = flower.cli(
        "run",
        str(app),
        "deployment",
        "--run-config",
        f"dataset='pums' rule='calibrated' min-clients=5 num-server-rounds={ROUNDS} round-timeout={TIMEOUT} "
        f"fraction-evaluate=0 results-dir='{results}'",
    )
    assert reply.get("success"), reply
    run_id = str(reply["run-id"])

    kills = []
    for batch in range(BATCHES):
        points = {name: POINTS[(batch * len(PUMAS) + i) % len(POINTS)] for i, name in enumerate(victims)}
        for name, point in points.items():
            arm(control, name, batch, point)
        pending, deadline, polled = set(victims), time.monotonic() + 240 + UPLOAD_CUT_S, time.monotonic()
        while pending:
            assert time.monotonic() < deadline, f"batch {batch}: {pending} never reached their points"
            if time.monotonic() - polled > 10:  # a run that ended can reach no point: say why at once
                (state,) = flower.cli("list", "--run-id", run_id)["runs"]
                assert not state["status"].startswith("finished:"), flower.run_log(run_id)
                polled = time.monotonic()
            for name in sorted(pending):
                reached = marker(control, name, batch)
                if not reached.is_file():
                    continue
                time.sleep(rng.uniform(0, DELAYS.get(points[name], 0.0)))
                kill_group(processes[name])
                config, ledger = victims[name]
                mine = [r["steps"] for r in released(control) if r["client"] == name]
                state = check_ledger(ledger, max(mine, default=0), 1.0)
                kill_round = json.loads(reached.read_text())["round"]
                kills.append(
                    {
                        "kill": len(kills) + 1,
                        "client": name,
                        "point": points[name],
                        "round": kill_round,
                        "ledger_steps": state["steps"],
                        "released_steps": max(mine, default=0),
                        "round_spent": kill_round in state["rounds"],
                    }
                )
                processes[name] = start_supernode(flower, f"{name}-{batch + 1}", port, config)
                pending.discard(name)
            time.sleep(0.05)

    run = flower.wait_finished(run_id, timeout=400 + UPLOAD_CUT_S)
    log = flower.run_log(run_id)
    assert run["status"] == "finished:completed", log
    assert "ignored a reply" not in log  # an error the runtime made for a killed client is that client's
    assert len(kills) == BATCHES * len(PUMAS) == 20
    folder = only_folder(results)
    with (folder / "replies.csv").open(newline="") as handle:
        outcomes = {(int(r["round"]), r["client_id"]): r["outcome"] for r in csv.DictReader(handle)}
    last_kill = {name: max(k["round"] for k in kills if k["client"] == name) for name in victims}
    for name, (_, ledger) in victims.items():
        mine = [r for r in released(control) if r["client"] == name]
        state = check_ledger(ledger, max(r["steps"] for r in mine), 1.0)
        assert len({r["plan"] for r in mine}) == 1, f"{name} changed its plan across restarts"
        assert any(r["round"] > last_kill[name] for r in mine), f"{name} did not train after its last restart"
        with sqlite3.connect(ledger) as db:
            assert db.execute("SELECT COUNT(*) FROM plans WHERE run_id = ?", (run_id,)).fetchone()[0] == 1
        # a round the server aggregated was spent in the ledger, once
        assert {r for (r, c), o in outcomes.items() if c == name and o == "trained"} <= set(state["rounds"])
        last = max((k for k in kills if k["client"] == name), key=lambda k: k["kill"])
        if last["ledger_steps"] > 0:  # it had spent in this run: its last SuperNode says it resumed
            assert f"client {name} resumes run {run_id} after a restart" in flower.log(f"{name}-{BATCHES}")
    for k in kills:
        k["reply_reached_server"] = outcomes.get((k["round"], k["client"])) == "trained"
    (tmp_path / "kills.json").write_text(json.dumps(kills, indent=1))
    print("\n".join(json.dumps(k) for k in kills))


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.timeout(420)
def test_a_killed_superlink_leaves_ledgers_and_finished_rounds_and_a_new_run_continues(flower, tmp_path):
    """SIGKILL the SuperLink (with its SuperExec and ServerApp) mid-run: every finished round is in
    the results folder, the clients' ledgers are intact, and a new run on a restarted SuperLink
    (same port and database, created 0600) continues from the ledgers."""
    database = tmp_path / "superlink.db"
    os.close(os.open(database, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # SQLite keeps the mode
    configs = pums_nodes(tmp_path, {1106: 1.0, 1107: 1.0})
    ledgers = [tmp_path / "ledger-1106.sqlite", tmp_path / "ledger-1107.sqlite"]
    port = start_superlink(flower, None, "--database", str(database))
    superlink = flower.processes[-1]
    for i, config in enumerate(configs):
        start_supernode(flower, f"supernode{i}", port, config)
    common = "dataset='pums' min-clients=2 fraction-evaluate=0 round-timeout=60"
    flower.submit("deployment", f"{common} num-server-rounds=8 results-dir='{tmp_path / 'r1'}'")
    deadline = time.monotonic() + 240
    while not (
        (tmp_path / "r1").is_dir()
        and any((tmp_path / "r1").glob("*/rounds.csv"))
        and len(read_rows(next((tmp_path / "r1").glob("*/rounds.csv")))) >= 2
    ):
        assert time.monotonic() < deadline, "two rounds never finished"
        time.sleep(0.2)
    kill_group(superlink)

    folder = only_folder(tmp_path / "r1")
    finished = [int(r["round"]) for r in read_rows(folder / "rounds.csv")]
    assert finished == list(range(1, len(finished) + 1)) and len(finished) >= 2
    received = {r["client_id"]: int(r["steps_all_runs"]) for r in read_rows(folder / "clients.csv")}
    clients = ("puma-1106", "puma-1107")
    for ledger, client in zip(ledgers, clients):
        state = check_ledger(ledger, received[client], 1.0)
        assert set(finished) <= set(state["rounds"])
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in tmp_path.glob("superlink.db*"))

    flower.start(
        "superlink-restarted",
        [
            "flower-superlink",
            "--insecure",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--database",
            str(database),
        ],
    )
    flower.wait_healthy(port)
    # A client that was training when the server died records that round, then idles: read the
    # ledgers once none has changed for 5 s (a loaded machine trains slower than any fixed wait).
    time.sleep(10)
    before: dict[str, int] = {}
    stable_since, deadline = time.monotonic(), time.monotonic() + 120
    while True:
        now = {}
        for ledger, client in zip(ledgers, clients):
            state = check_ledger(ledger, received[client], 1.0)
            assert set(finished) <= set(state["rounds"]) <= set(range(1, len(finished) + 2))  # + the round in flight
            now[client] = state["steps"]
        if now != before:
            before, stable_since = now, time.monotonic()
        elif time.monotonic() - stable_since >= 5:
            break
        assert time.monotonic() < deadline, f"the ledgers never settled: {now}"
        time.sleep(0.5)
    second = flower.submit("deployment", f"{common} num-server-rounds=1 results-dir='{tmp_path / 'r2'}'")
    run = flower.wait_finished(second, timeout=180)
    assert run["status"] == "finished:completed", flower.run_log(second)
    rows = {r["client_id"]: r for r in read_rows(only_folder(tmp_path / "r2") / "clients.csv")}
    assert set(rows) == set(clients), flower.run_log(second)  # a client that did not reply has only its node id
    for client, row in rows.items():
        assert int(row["steps_all_runs"]) == before[client] + int(row["steps_this_run"]) > before[client]
    for ledger in ledgers:
        check_ledger(ledger, 0, 1.0)
