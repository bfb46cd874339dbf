"""Concurrent writers on one ledger file, as separate processes (two SuperNodes on the same
ledger and data, or a restarted client racing its old self): no spend is lost, none is doubled,
and the budget holds however the writers interleave."""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
from pathlib import Path

from fedprivacy.ledger import BudgetExceeded, Ledger, RoundRepeated
from fedprivacy.privacy.accountants import NoiseEvent

ACCOUNT, RUN = "data:shared", "run-1"
EVENT = NoiseEvent(sigma=2.0, sampling_rate=0.05, count=10)
WRITERS, ROUNDS = 4, 12


def writer(path: str, start, outcomes, budget: float) -> None:
    """One process: open the account, then try to record every round of the run."""
    ledger = Ledger(path)
    ledger.open_account(ACCOUNT, budget, 1e-5)
    start.wait(timeout=120)
    for server_round in range(1, ROUNDS + 1):
        try:
            ledger.record(ACCOUNT, RUN, server_round, [EVENT])
            outcomes.put(("recorded", server_round))
        except (RoundRepeated, BudgetExceeded) as error:
            outcomes.put((type(error).__name__, server_round))


def race(path: Path, budget: float) -> list[tuple[str, int]]:
    """WRITERS processes (fresh interpreters, as separate SuperNodes are) released at once."""
    context = multiprocessing.get_context("spawn")
    start, outcomes = context.Barrier(WRITERS), context.Queue()
    processes = [
        context.Process(target=writer, args=(str(path), start, outcomes, budget), daemon=True) for _ in range(WRITERS)
    ]
    try:
        for process in processes:
            process.start()
        for process in processes:
            process.join(timeout=120)
            assert process.exitcode == 0
        return [outcomes.get(timeout=10) for _ in range(WRITERS * ROUNDS)]
    finally:  # a writer that failed leaves the others at the barrier: none may outlive the test
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()


def test_processes_racing_on_one_ledger_record_each_round_exactly_once(tmp_path: Path):
    path = tmp_path / "ledger.sqlite"
    results = race(path, 8.0)
    recorded = sorted(r for kind, r in results if kind == "recorded")
    assert recorded == list(range(1, ROUNDS + 1))  # every round once: none lost, none doubled
    assert all(kind in ("recorded", "RoundRepeated") for kind, _ in results)
    with sqlite3.connect(path) as db:
        rows = db.execute(
            "SELECT server_round, COUNT(*) FROM spends GROUP BY server_round ORDER BY server_round"
        ).fetchall()
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert rows == [(r, 1) for r in range(1, ROUNDS + 1)]
    ledger = Ledger(path)
    assert ledger.steps_spent(ACCOUNT) == ROUNDS * EVENT.count
    assert ledger.epsilon_spent(ACCOUNT) <= 8.0


def test_processes_racing_for_the_last_of_a_budget_never_overspend(tmp_path: Path):
    """A budget that affords only some rounds: the writers together stop exactly at it."""
    path = tmp_path / "ledger.sqlite"
    tight = 1.0
    affordable = 0
    probe = Ledger(tmp_path / "probe.sqlite")
    probe.open_account(ACCOUNT, tight, 1e-5)
    while True:
        try:
            probe.record(ACCOUNT, RUN, affordable + 1, [EVENT])
        except BudgetExceeded:
            break
        affordable += 1
    assert 0 < affordable < ROUNDS

    results = race(path, tight)
    assert sorted(r for kind, r in results if kind == "recorded") == list(range(1, affordable + 1))
    ledger = Ledger(path)
    assert ledger.steps_spent(ACCOUNT) == affordable * EVENT.count and ledger.epsilon_spent(ACCOUNT) <= tight


def test_a_ledger_file_another_process_created_since_the_check_is_opened(tmp_path: Path, monkeypatch):
    """Two SuperNodes opening a new ledger at once: the file the other created between this one's
    look and its create is opened as theirs, not refused (injected: the look misses the file)."""
    path = tmp_path / "ledger.sqlite"
    Ledger(path).open_account(ACCOUNT, 8.0, 1e-5)
    real_exists = Path.exists
    monkeypatch.setattr(Path, "exists", lambda self: False if self == path else real_exists(self))
    ledger = Ledger(path)
    ledger.record(ACCOUNT, RUN, 1, [EVENT])
    assert ledger.steps_spent(ACCOUNT) == EVENT.count
    assert os.stat(path).st_mode & 0o777 == 0o600
