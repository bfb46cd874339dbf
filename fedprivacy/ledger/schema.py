"""The ledger file's layout (schema 4, `PRAGMA user_version`) and the migration of older layouts."""

from __future__ import annotations

import sqlite3

from fedprivacy.ledger.sql import rollback

SCHEMA_VERSION = 4  # PRAGMA user_version; older layouts are migrated on open (`migrate`)
# Spends name their account by a small integer key (`account_keys`), not by its name: every
# account of a round appends to its own place in the account index, so a round dirties a page
# per account there; with names (~30 characters for a simulated account) the index entries were
# several times larger and a 1,000-account round's write 1.6-3× slower (benchmarks/ledger_writes.py).
_SPENDS_COLUMNS = """
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    account_key INTEGER NOT NULL REFERENCES account_keys(id),
    run_id TEXT NOT NULL,
    server_round INTEGER NOT NULL,
    sigma REAL NOT NULL,
    sampling_rate REAL NOT NULL,
    steps INTEGER NOT NULL,
    epsilon_after REAL NOT NULL,
    delta REAL NOT NULL,
    recorded_at TEXT NOT NULL
"""
_TABLES = f"""
CREATE TABLE IF NOT EXISTS account_keys (
    id INTEGER PRIMARY KEY,
    account TEXT NOT NULL UNIQUE
);
CREATE TABLE IF NOT EXISTS spends ({_SPENDS_COLUMNS});
CREATE TABLE IF NOT EXISTS plans (
    account TEXT NOT NULL,
    run_id TEXT NOT NULL,
    plan_json TEXT NOT NULL,
    PRIMARY KEY (account, run_id)
);
CREATE TABLE IF NOT EXISTS accounts (
    account TEXT PRIMARY KEY,
    epsilon REAL NOT NULL,
    delta REAL NOT NULL,
    pinned_at TEXT NOT NULL,
    changed_at TEXT
);
CREATE TABLE IF NOT EXISTS partitionings (
    dataset TEXT PRIMARY KEY,
    partitioning TEXT NOT NULL,
    pinned_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS account_data (
    account TEXT PRIMARY KEY,
    digest TEXT NOT NULL,
    pinned_at TEXT NOT NULL,
    changed_at TEXT
);
"""
_INDEXES = """
CREATE INDEX IF NOT EXISTS spends_account ON spends(account_key);
CREATE INDEX IF NOT EXISTS spends_round ON spends(run_id, server_round, account_key);
"""
SCHEMA = _TABLES + _INDEXES  # the current layout, as one script

# Earlier layouts named the account in each spend. Rebuilding the table keeps every spend's id
# and gives each account named anywhere its key (`migrate` checks no spend was left out and keeps
# the id sequence's high-water mark: the ledger relies on ids only growing).
_MIGRATE_ACCOUNT_NAMES = f"""
INSERT OR IGNORE INTO account_keys (account)
    SELECT account FROM (SELECT account, MIN(id) AS first FROM spends GROUP BY account ORDER BY first);
INSERT OR IGNORE INTO account_keys (account) SELECT account FROM accounts ORDER BY account;
CREATE TABLE spends_keyed ({_SPENDS_COLUMNS});
INSERT INTO spends_keyed
    SELECT s.id, k.id, s.run_id, s.server_round, s.sigma, s.sampling_rate, s.steps, s.epsilon_after, s.delta,
        s.recorded_at
    FROM spends AS s JOIN account_keys AS k ON k.account = s.account
    ORDER BY s.id;
DROP TABLE spends;
ALTER TABLE spends_keyed RENAME TO spends;
"""


def migrate(db: sqlite3.Connection) -> None:
    """Bring the file to `SCHEMA_VERSION` in one write transaction (another process may be opening
    it too: the version is read again once the write lock is held). A current file is only read:
    opening it never waits for another writer (a ClientApp opens its ledger on every message)."""
    if db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION:
        return
    db.execute("BEGIN IMMEDIATE")
    try:
        if db.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
            named = "account" in {row[1] for row in db.execute("PRAGMA table_info(spends)")}
            _run_script(db, _TABLES)  # the tables a layout lacks (layout 0 had no accounts table)
            if named:
                _rekey_spends(db)
            _run_script(db, _INDEXES)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        db.execute("COMMIT")
    except BaseException:
        rollback(db)
        raise


def _run_script(db: sqlite3.Connection, script: str) -> None:
    """Each statement of `script` inside the open transaction (`executescript` would commit it)."""
    for statement in script.split(";"):
        if statement.strip():
            db.execute(statement)


def _rekey_spends(db: sqlite3.Connection) -> None:
    """Inside `migrate`: the spends of a layout that named accounts, moved to account keys."""
    spends = db.execute("SELECT COUNT(*) FROM spends").fetchone()[0]
    sequence = db.execute("SELECT COALESCE(MAX(seq), 0) FROM sqlite_sequence WHERE name = 'spends'").fetchone()[0]
    _run_script(db, _MIGRATE_ACCOUNT_NAMES)
    moved = db.execute("SELECT COUNT(*) FROM spends").fetchone()[0]
    if moved != spends:  # raised inside the transaction: the file stays as it was
        raise RuntimeError(f"ledger migration kept {moved} of {spends} spends; the ledger was left unchanged")
    db.execute("UPDATE sqlite_sequence SET seq = MAX(seq, ?) WHERE name = 'spends'", (sequence,))
