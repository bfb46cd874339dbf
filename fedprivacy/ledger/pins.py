"""What a ledger pins so that records cannot move to a fresh budget: a deployed account's data file
(by digest) and a simulated data set's partitioning. Each function runs inside the caller's write
transaction; the policy is told at `Ledger.pin_data`, `Ledger.accept_data` and `Ledger.pin_partitioning`."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from fedprivacy.errors import InputError
from fedprivacy.ledger.queries import pinned_budget
from fedprivacy.ledger.refusals import DataMismatch
from fedprivacy.ledger.sql import now


def pin_data(db: sqlite3.Connection, path: Path, account: str, digest: str, legacy_account: str | None) -> str | None:
    """`Ledger.pin_data`; returns `legacy_account` if it was renamed to `account` here."""
    row = db.execute("SELECT digest FROM account_data WHERE account = ?", (account,)).fetchone()
    if row is not None:
        if row[0] == digest:
            return None
        raise DataMismatch(
            f"ledger account {account!r} was opened on another data file than the one its node config names "
            f"now. If the records are the same data set grown or corrected, the operator accepts it with: "
            f"fedprivacy ledger accept-data {path} {account} --data FILE; a different data set needs "
            "its own client-id"
        )
    other = db.execute("SELECT account FROM account_data WHERE digest = ?", (digest,)).fetchone()
    if other is not None:
        raise DataMismatch(
            f"this data file is already accounted under {other[0]!r} in ledger {path}: "
            f"start the node with that client-id, so that its spends keep counting"
        )
    renamed = None
    legacy_known = (
        legacy_account is not None
        and db.execute(
            "SELECT 1 FROM account_keys WHERE account = ? UNION SELECT 1 FROM accounts WHERE account = ?",
            (legacy_account, legacy_account),
        ).fetchone()
        is not None
    )  # spends of a layout without budgets too
    if legacy_known and pinned_budget(db, account) is None:
        for table in ("account_keys", "accounts", "plans"):
            db.execute(f"UPDATE {table} SET account = ? WHERE account = ?", (account, legacy_account))
        renamed = legacy_account
    db.execute(
        "INSERT INTO account_data (account, digest, pinned_at) VALUES (?, ?, ?)",
        (account, digest, now()),
    )
    return renamed


def accept_data(db: sqlite3.Connection, path: Path, account: str, digest: str) -> None:
    """`Ledger.accept_data`."""
    if pinned_budget(db, account) is None:
        raise InputError("account", account, f"no such account in {path}")
    other = db.execute(
        "SELECT account FROM account_data WHERE digest = ? AND account != ?", (digest, account)
    ).fetchone()
    if other is not None:
        raise InputError("data", digest, f"is already the data of account {other[0]!r}: one file, one budget")
    db.execute(
        "INSERT INTO account_data (account, digest, pinned_at, changed_at) VALUES (?, ?, ?, ?)"
        " ON CONFLICT(account) DO UPDATE SET digest = excluded.digest, changed_at = excluded.changed_at",
        (account, digest, now(), now()),
    )


def pin_partitioning(db: sqlite3.Connection, dataset: str, partitioning: str) -> str:
    """The partitioning pinned for `dataset` (as JSON), pinned now as `partitioning` if it had none."""
    row = db.execute("SELECT partitioning FROM partitionings WHERE dataset = ?", (dataset,)).fetchone()
    if row is not None:
        return row[0]
    db.execute(
        "INSERT INTO partitionings (dataset, partitioning, pinned_at) VALUES (?, ?, ?)",
        (dataset, partitioning, now()),
    )
    return partitioning
