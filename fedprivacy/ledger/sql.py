"""What every SQL-facing module of the ledger shares: bound-parameter limits, timestamps, rollback."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from datetime import UTC, datetime

SQL_VARIABLES = 900  # below SQLite's oldest limit on bound parameters per statement (999)


def chunks(items: list[str]) -> Iterator[list[str]]:
    """`items` in slices that one statement can bind (an `IN` list of 1,000 accounts cannot)."""
    for start in range(0, len(items), SQL_VARIABLES):
        yield items[start : start + SQL_VARIABLES]


def marks(chunk: list[str]) -> str:
    """The placeholders of an `IN (…)` list binding `chunk`."""
    return ", ".join("?" * len(chunk))


def now() -> str:
    """A row's timestamp: UTC, so ledgers written on machines in different zones compare."""
    return datetime.now(UTC).isoformat()


def rollback(db: sqlite3.Connection) -> None:
    """End the open transaction, if SQLite has not already rolled it back itself (as it may after
    an I/O or full-disk error, when a second ROLLBACK would hide the first error)."""
    if db.in_transaction:
        db.execute("ROLLBACK")
