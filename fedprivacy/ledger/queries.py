"""Reads of the ledger file that keep no state: each runs on a connection the caller holds, inside
its transaction where the answer must agree with what the caller writes next."""

from __future__ import annotations

import json
import sqlite3

from fedprivacy.ledger.accounts import Budget
from fedprivacy.ledger.sql import chunks, marks
from fedprivacy.privacy.accountants import NoiseEvent
from fedprivacy.privacy.plan import Plan


def last_spend_id(db: sqlite3.Connection) -> int:
    """The largest spend id (ids only grow: AUTOINCREMENT), 0 for a ledger with no spends."""
    return int(db.execute("SELECT COALESCE(MAX(id), 0) FROM spends").fetchone()[0])


def pinned_budget(db: sqlite3.Connection, account: str) -> Budget | None:
    row = db.execute("SELECT epsilon, delta FROM accounts WHERE account = ?", (account,)).fetchone()
    return Budget(float(row[0]), float(row[1])) if row else None


def histories(db: sqlite3.Connection, accounts: list[str]) -> dict[str, list[NoiseEvent]]:
    """Every recorded event of each account that has any, oldest first."""
    found: dict[str, list[NoiseEvent]] = {}
    for chunk in chunks(accounts):
        rows = db.execute(
            "SELECT k.account, s.sigma, s.sampling_rate, s.steps FROM spends AS s"
            " JOIN account_keys AS k ON k.id = s.account_key"
            f" WHERE k.account IN ({marks(chunk)}) ORDER BY s.id",
            chunk,
        )
        for account, sigma, q, count in rows:
            found.setdefault(account, []).append(NoiseEvent(sigma=sigma, sampling_rate=q, count=int(count)))
    return found


def accounts_spent_since(db: sqlite3.Connection, spend_id: int) -> list[str]:
    """The accounts with a spend after `spend_id` (a scan of the newest spends only)."""
    rows = db.execute(
        "SELECT DISTINCT k.account FROM spends AS s NOT INDEXED"
        " JOIN account_keys AS k ON k.id = s.account_key"
        " WHERE s.id > ?",
        (spend_id,),
    )
    return [account for (account,) in rows]


def rounds_recorded(db: sqlite3.Connection, accounts: list[str], run_id: str, server_round: int) -> set[str]:
    """Those `accounts` that already recorded this (run, round)."""
    found: set[str] = set()
    anyone = db.execute(
        "SELECT 1 FROM spends WHERE run_id = ? AND server_round = ? LIMIT 1", (run_id, server_round)
    ).fetchone()
    if anyone is None:
        return found  # a round nobody recorded yet: one index probe instead of a lookup per account
    for chunk in chunks(accounts):
        rows = db.execute(
            "SELECT DISTINCT k.account FROM spends AS s"
            " JOIN account_keys AS k ON k.id = s.account_key"
            f" WHERE s.run_id = ? AND s.server_round = ? AND k.account IN ({marks(chunk)})",
            [run_id, server_round, *chunk],
        )
        found.update(r[0] for r in rows)
    return found


def runs_of(db: sqlite3.Connection, accounts: list[str]) -> dict[str, set[str]]:
    """The runs that spent from each of `accounts` (accounts that never spent are absent)."""
    found: dict[str, set[str]] = {}
    for chunk in chunks(accounts):
        rows = db.execute(
            "SELECT DISTINCT k.account, s.run_id FROM spends AS s"
            " JOIN account_keys AS k ON k.id = s.account_key"
            f" WHERE k.account IN ({marks(chunk)})",
            chunk,
        )
        for account, run_id in rows:
            found.setdefault(account, set()).add(run_id)
    return found


def activity(db: sqlite3.Connection, account: str) -> tuple[int, str | None]:
    """How many runs spent from `account`, and when its last spend was recorded."""
    runs, last = db.execute(
        "SELECT COUNT(DISTINCT s.run_id), MAX(s.recorded_at) FROM spends AS s"
        " JOIN account_keys AS k ON k.id = s.account_key"
        " WHERE k.account = ?",
        (account,),
    ).fetchone()
    return int(runs), last


def plans(db: sqlite3.Connection, accounts: list[str], run_id: str) -> dict[str, Plan]:
    """The run's saved plans of those `accounts` that have one."""
    found: dict[str, Plan] = {}
    for chunk in chunks(accounts):
        rows = db.execute(
            f"SELECT account, plan_json FROM plans WHERE run_id = ? AND account IN ({marks(chunk)})",
            [run_id, *chunk],
        )
        found.update({account: Plan.from_dict(json.loads(text)) for account, text in rows})
    return found
