"""A round's spends written and committed, on this thread or on another while the round trains."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from typing import TypeVar

from fedprivacy.ledger.queries import last_spend_id

T = TypeVar("T")

# One statement per group of accounts spending the same: SQLite expands the JSON list of account
# keys itself (one call, no per-row binding), and inserts them in key order (kinder to the index).
INSERT_SPENDS = """
INSERT INTO spends (account_key, run_id, server_round, sigma, sampling_rate, steps, epsilon_after, delta, recorded_at)
SELECT value, ?, ?, ?, ?, ?, ?, ?, ? FROM json_each(?) ORDER BY value
"""

SpendRow = tuple[object, ...]  # `INSERT_SPENDS`'s parameters: one spend for a JSON list of account keys


def write_and_commit(db: sqlite3.Connection, rows: list[SpendRow]) -> int:
    """Write a round's spends (`INSERT_SPENDS` rows) and commit its transaction; returns the
    largest spend id (the write lock is ours until the commit: every id up to it is this ledger's
    to know). The caller rolls back if this fails."""
    db.executemany(INSERT_SPENDS, rows)
    last = last_spend_id(db)
    db.execute("COMMIT")
    return last


def write_and_commit_during(db: sqlite3.Connection, rows: list[SpendRow], job: Callable[[], T]) -> tuple[int, T]:
    """`write_and_commit` on another thread while `job` runs on this one; (last id, `job`'s
    result) once the commit is done, or the write's error. Each grouped insert is one SQLite call,
    which releases the GIL while it runs: the job keeps the interpreter (binding one row per call
    there was measured to slow the job down more than the write saved)."""
    done: list[int] = []
    failed: list[BaseException] = []
    finished = threading.Event()

    def write() -> None:
        try:
            done.append(write_and_commit(db, rows))
        except BaseException as error:
            failed.append(error)
        finally:
            finished.set()

    threading.Thread(target=write, name="ledger-write").start()
    try:
        result = job()
    finally:
        _wait(finished)  # the connection is the writer's until it is done, even on Ctrl-C
        if failed:
            raise failed[0]
    return done[0], result


def _wait(finished: threading.Event) -> None:
    """Wait for `finished`; an interrupt while waiting is raised once it is set. An event, not
    `Thread.join`: on Python 3.11 an interrupted join can mark a thread that still runs stopped."""
    interrupted: BaseException | None = None
    while not finished.is_set():
        try:
            finished.wait()
        except BaseException as error:
            interrupted = error
    if interrupted is not None:
        raise interrupted
