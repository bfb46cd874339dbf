"""The privacy ledger: a durable record of every noisy step a client has released.

Privacy loss composes across rounds, restarts and runs, so the ledger lives in a SQLite file and
is keyed by an *account* (one client's records), not by the run. Each recorded spend is a group
of Poisson-subsampled Gaussian steps (σ, q, count); the ε spent is the PLD composition of all of
them at the account's δ, never a sum of per-round ε.

The budget belongs to the data owner, so the ledger, not the caller, holds it:
- an account's (ε, δ) is pinned on first use; training under any other value is refused, and
  changing it is a deliberate act of the node operator (`fedprivacy ledger set-budget`);
- a (run, round) is recorded at most once per account: a repeated round would release a second
  update on the same records that nobody planned;
- a spend is written in one IMMEDIATE transaction that re-checks all of this, so two writers (a
  restarted client, two SuperNodes on one file) can never overshoot the budget;
- in a simulation, the partitioning that decides which rows an account holds is pinned per data
  set, so a ledger reused under another seed or scheme cannot move records to a fresh account;
- in a deployment, an account is the node's declared client-id and its data file's digest is
  pinned beside it: a changed file under the account, or the same file under another account,
  is refused until the operator says otherwise (`fedprivacy ledger accept-data`).

The file is created readable by its owner only (0600): it tells how much each data set has spent.
This module never imports flwr: the ClientApp calls it, tests drive it directly.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache
from itertools import groupby
from pathlib import Path
from typing import TypeVar

from fedprivacy.errors import ClientRefusal, InputError
from fedprivacy.privacy.accountants import NoiseEvent, pld_epsilon
from fedprivacy.privacy.plan import Plan

SCHEMA_VERSION = 4  # PRAGMA user_version; older layouts are migrated on open (`_migrate`)
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


class BudgetExceeded(RuntimeError):
    """Recording these steps would push the account's ε above its budget."""


class BudgetMismatch(ClientRefusal):
    """A request to train under another (ε, δ) than the one pinned for the account."""


class RoundRepeated(ClientRefusal):
    """A (run, round) that the account has already released an update for."""


class DataMismatch(ClientRefusal):
    """A deployed account's data file is not the one it was opened on, or its data is another account's."""


class PartitioningMismatch(ClientRefusal):
    """A simulation asks for accounts of a data set that this ledger knows under another partitioning."""


@dataclass(frozen=True)
class Budget:
    """An account's pinned privacy budget."""

    epsilon: float
    delta: float


@dataclass(frozen=True)
class AccountSummary:
    """One account as a node operator sees it."""

    account: str
    epsilon: float
    delta: float
    steps: int
    epsilon_spent: float
    runs: int
    last_spend: str | None

    @property
    def epsilon_left(self) -> float:
        return max(0.0, self.epsilon - self.epsilon_spent)


def round_events(plan: Plan, server_round: int) -> tuple[NoiseEvent, ...]:
    """The noise events of one round's slice of `plan`, consecutive equal σ merged (one tuple
    shared by every plan with the same schedule: the ledger checks equal spends once)."""
    return _round_events(*noise_schedule(plan), server_round)


NoiseSchedule = tuple[tuple[tuple[float, int], ...], float, int, int]  # (σ segments, q, steps, rounds)


def noise_schedule(plan: Plan) -> NoiseSchedule:
    """What `round_events` reads of a plan, as one tuple shared by every plan with an equal
    schedule: a simulator keys its clients' round events by its id, one look-up per schedule."""
    return _interned_schedule(plan.noise_segments, plan.sampling_rate, plan.steps, plan.rounds)


@lru_cache(maxsize=4096)
def _interned_schedule(segments: tuple[tuple[float, int], ...], q: float, steps: int, rounds: int) -> NoiseSchedule:
    return segments, q, steps, rounds  # built once per distinct schedule: the cache hands back this tuple


@lru_cache(maxsize=4096)
def _round_events(
    segments: tuple[tuple[float, int], ...], q: float, steps: int, rounds: int, server_round: int
) -> tuple[NoiseEvent, ...]:
    """Cached per schedule: clients with the same plan ask for the same rounds."""
    base, extra = divmod(steps, rounds)
    count = base + (1 if server_round <= extra else 0) if 1 <= server_round <= rounds else 0
    first = base * (server_round - 1) + min(server_round - 1, extra)
    sigmas = []
    position = 0
    for sigma, length in segments:  # σ of steps first .. first + count − 1, read from the segments
        overlap = min(position + length, first + count) - max(position, first)
        sigmas += [sigma] * max(overlap, 0)
        position += length
    return tuple(NoiseEvent(sigma=sigma, sampling_rate=q, count=len(list(group))) for sigma, group in groupby(sigmas))


def composed_epsilon(events: Sequence[NoiseEvent], delta: float) -> float:
    """PLD ε of `events` at `delta`; 0 when nothing was released."""
    events = [e for e in events if e.count > 0]
    return float(pld_epsilon(events, delta)) if events else 0.0


def _now() -> str:
    return datetime.now(UTC).isoformat()


_SQL_VARIABLES = 900  # below SQLite's oldest limit on bound parameters per statement (999)


def _chunks(items: list[str]) -> Iterator[list[str]]:
    for start in range(0, len(items), _SQL_VARIABLES):
        yield items[start : start + _SQL_VARIABLES]


def _marks(chunk: list[str]) -> str:
    return ", ".join("?" * len(chunk))


class _SharedHistories:
    """Accounts with the same spends hold one history tuple, and each history's ε is computed once:
    a round of 1,000 clients under one plan asks for one ε, not 1,000 (each hashing a whole
    history for the accountant's cache). Forgotten wholesale past `LIMIT` entries."""

    LIMIT = 200_000

    def __init__(self) -> None:
        self._by_value: dict[tuple[NoiseEvent, ...], tuple[NoiseEvent, ...]] = {}
        self._extended: dict[
            tuple[int, tuple[NoiseEvent, ...]], tuple[tuple[NoiseEvent, ...], tuple[NoiseEvent, ...]]
        ] = {}
        self._epsilon: dict[tuple[int, float], tuple[tuple[NoiseEvent, ...], float]] = {}
        self._steps: dict[int, tuple[tuple[NoiseEvent, ...], int]] = {}

    def size(self) -> int:
        return len(self._by_value) + len(self._extended) + len(self._epsilon) + len(self._steps)

    def intern(self, events: Sequence[NoiseEvent]) -> tuple[NoiseEvent, ...]:
        if self.size() > self.LIMIT:
            self._by_value, self._extended, self._epsilon, self._steps = {}, {}, {}, {}
        events = tuple(events)
        return self._by_value.setdefault(events, events)

    def extend(self, history: tuple[NoiseEvent, ...], events: tuple[NoiseEvent, ...]) -> tuple[NoiseEvent, ...]:
        """`history` + `events`, shared with every account that had the same history and spends the same."""
        if not events:
            return history
        hit = self._extended.get((id(history), events))
        if hit is None or hit[0] is not history:  # ids are only trusted for the object they were taken from
            hit = (history, self.intern(history + events))
            self._extended[(id(history), events)] = hit
        return hit[1]

    def steps(self, history: tuple[NoiseEvent, ...]) -> int:
        hit = self._steps.get(id(history))
        if hit is None or hit[0] is not history:
            hit = (history, sum(e.count for e in history))
            self._steps[id(history)] = hit
        return hit[1]

    def epsilon(self, history: tuple[NoiseEvent, ...], delta: float) -> float:
        hit = self._epsilon.get((id(history), delta))
        if hit is None or hit[0] is not history:
            hit = (history, composed_epsilon(history, delta))
            self._epsilon[(id(history), delta)] = hit
        return hit[1]


T = TypeVar("T")


@lru_cache(maxsize=1)
def _sqlite_has_json() -> bool:
    db = sqlite3.connect(":memory:")
    try:
        db.execute("SELECT value FROM json_each('[1]')").fetchall()
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        db.close()


# One statement per group of accounts spending the same: SQLite expands the JSON list of account
# keys itself (one call, no per-row binding), and inserts them in key order (kinder to the index).
_INSERT_SPENDS = (
    "INSERT INTO spends (account_key, run_id, server_round, sigma, sampling_rate, steps, epsilon_after, delta,"
    " recorded_at)"
    " SELECT value, ?, ?, ?, ?, ?, ?, ?, ? FROM json_each(?) ORDER BY value"
)


SpendRow = tuple[object, ...]  # `_INSERT_SPENDS`'s parameters: one spend for a JSON list of account keys


# Earlier layouts named the account in each spend. Rebuilding the table keeps every spend's id
# and gives each account named anywhere its key (`_migrate` checks no spend was left out and keeps
# the id sequence's high-water mark: the ledger relies on ids only growing).
_MIGRATE_ACCOUNT_NAMES = f"""
INSERT OR IGNORE INTO account_keys (account) SELECT account FROM (SELECT account, MIN(id) AS first FROM spends
    GROUP BY account ORDER BY first);
INSERT OR IGNORE INTO account_keys (account) SELECT account FROM accounts ORDER BY account;
CREATE TABLE spends_keyed ({_SPENDS_COLUMNS});
INSERT INTO spends_keyed SELECT s.id, k.id, s.run_id, s.server_round, s.sigma, s.sampling_rate, s.steps,
    s.epsilon_after, s.delta, s.recorded_at FROM spends AS s JOIN account_keys AS k ON k.account = s.account
    ORDER BY s.id;
DROP TABLE spends;
ALTER TABLE spends_keyed RENAME TO spends;
"""


def _run_script(db: sqlite3.Connection, script: str) -> None:
    """Each statement of `script` inside the open transaction (`executescript` would commit it)."""
    for statement in script.split(";"):
        if statement.strip():
            db.execute(statement)


def _migrate(db: sqlite3.Connection) -> None:
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
        _rollback(db)
        raise


def _rekey_spends(db: sqlite3.Connection) -> None:
    """Inside `_migrate`: the spends of a layout that named accounts, moved to account keys."""
    spends = db.execute("SELECT COUNT(*) FROM spends").fetchone()[0]
    sequence = db.execute("SELECT COALESCE(MAX(seq), 0) FROM sqlite_sequence WHERE name = 'spends'").fetchone()[0]
    _run_script(db, _MIGRATE_ACCOUNT_NAMES)
    moved = db.execute("SELECT COUNT(*) FROM spends").fetchone()[0]
    if moved != spends:  # raised inside the transaction: the file stays as it was
        raise RuntimeError(f"ledger migration kept {moved} of {spends} spends; the ledger was left unchanged")
    db.execute("UPDATE sqlite_sequence SET seq = MAX(seq, ?) WHERE name = 'spends'", (sequence,))


def _rollback(db: sqlite3.Connection) -> None:
    """End the open transaction, if SQLite has not already rolled it back itself (as it may after
    an I/O or full-disk error, when a second ROLLBACK would hide the first error)."""
    if db.in_transaction:
        db.execute("ROLLBACK")


def _write_and_commit(db: sqlite3.Connection, rows: list[SpendRow]) -> int:
    """Write a round's spends (`_INSERT_SPENDS` rows) and commit its transaction; returns the
    largest spend id (the write lock is ours until the commit: every id up to it is this ledger's
    to know). The caller rolls back if this fails."""
    db.executemany(_INSERT_SPENDS, rows)
    last = Ledger._last_id(db)
    db.execute("COMMIT")
    return last


def _write_and_commit_during(db: sqlite3.Connection, rows: list[SpendRow], job: Callable[[], T]) -> tuple[int, T]:
    """`_write_and_commit` on another thread while `job` runs on this one; (last id, `job`'s
    result) once the commit is done, or the write's error. Each grouped insert is one SQLite call,
    which releases the GIL while it runs: the job keeps the interpreter (binding one row per call
    there was measured to slow the job down more than the write saved)."""
    done: list[int] = []
    failed: list[BaseException] = []
    finished = threading.Event()

    def write() -> None:
        try:
            done.append(_write_and_commit(db, rows))
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


Outcome = float | RoundRepeated | BudgetExceeded  # a recorded spend's new ε, or why it was refused


@dataclass(frozen=True)
class RoundDecision:
    """What a round's transaction decided: each account's outcome, and each recorded account's
    steps once the round is committed (its whole history, other runs' and writers' spends
    included: read inside the transaction, under the write lock, so nobody can spend in between)."""

    outcomes: dict[str, Outcome]
    steps: dict[str, int]


class Ledger:
    """One SQLite file holding the spends of any number of accounts.

    A Ledger keeps one connection per process (opened on first use, guarded by a lock), so a
    round's transaction costs no connect, and `PRAGMA data_version` tells it whether any other
    connection wrote since: budgets read before are reused until then. `close()` releases it.
    """

    def __init__(self, path: str | Path, busy_timeout: float = 60.0) -> None:
        """Open (or create, 0600) the ledger at `path`; wait up to `busy_timeout` s for another writer."""
        self.path = Path(path)
        # Histories read or written before, current as of spend id `_synced` (ids only grow: AUTOINCREMENT)
        self._seen: dict[str, tuple[NoiseEvent, ...]] = {}
        self._synced: int | None = None
        self._shared = _SharedHistories()
        self._known_budgets: dict[str, Budget] = {}  # valid while no other connection writes
        self._known_keys: dict[str, int] = {}  # likewise (a key never changes, but the file might be replaced)
        self._budget_objects: dict[tuple[float, float], Budget] = {}
        self._data_version: int | None = None
        self._db: sqlite3.Connection | None = None
        self._db_pid = 0
        self._inherited: list[sqlite3.Connection] = []  # a forked child's copy of its parent's connection
        self._lock = threading.RLock()
        self.busy_timeout = busy_timeout
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not self.path.exists():
                # Created 0600 before SQLite writes anything into it.
                os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except OSError as error:
            raise InputError(
                "ledger-path", str(self.path), f"cannot create a ledger there ({error.strerror or error})"
            ) from None
        if not _sqlite_has_json():
            raise RuntimeError(
                f"this Python's SQLite ({sqlite3.sqlite_version}) has no JSON functions, which the ledger "
                "writes with: use a Python whose SQLite has them (built in since SQLite 3.38)"
            )
        try:
            with self._connect(fresh=True) as db:
                version = db.execute("PRAGMA user_version").fetchone()[0]
                if version > SCHEMA_VERSION:
                    raise InputError(
                        "ledger-path",
                        str(self.path),
                        f"written by a newer fedprivacy (ledger schema {version}, this version reads up to "
                        f"{SCHEMA_VERSION}): upgrade fedprivacy, never downgrade a ledger",
                    )
                tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
                if tables and "spends" not in tables:
                    raise InputError(
                        "ledger-path",
                        str(self.path),
                        "is an SQLite database of another application "
                        f"(tables: {', '.join(sorted(tables)[:3])}…), not a fedprivacy ledger; it is left as it was",
                    )
                _migrate(db)
        except sqlite3.OperationalError as error:
            if "locked" not in str(error):
                raise InputError("ledger-path", str(self.path), f"not a readable fedprivacy ledger ({error})") from None
            raise InputError(
                "ledger-path",
                str(self.path),
                f"locked by another process for more than {busy_timeout:g} s "
                "(a SuperNode writing to it?): try again when it is done",
            ) from None
        except sqlite3.DatabaseError as error:
            raise InputError("ledger-path", str(self.path), f"not a readable fedprivacy ledger ({error})") from None

    def _new_connection(self) -> sqlite3.Connection:
        # Autocommit mode: transactions are explicit (BEGIN IMMEDIATE) where they matter. Used by
        # one thread at a time (the lock), possibly not the one that opened it (`record_round_while`).
        db = sqlite3.connect(self.path, timeout=self.busy_timeout, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA synchronous=FULL")
        return db

    @contextmanager
    def _connect(self, fresh: bool = False) -> Iterator[sqlite3.Connection]:
        """This process's connection (`fresh`: a one-off, closed after). A forked child gets its own
        lock and connection; its parent's connection is kept, never used or closed, in the child."""
        if fresh:
            db = self._new_connection()
            try:
                yield db
            finally:
                db.close()
            return
        if (
            self._db_pid != os.getpid()
        ):  # first use in this process (a forked child's lock may be held by a thread it lacks)
            if self._db is not None:
                self._inherited.append(self._db)
            self._lock, self._db, self._db_pid = threading.RLock(), None, os.getpid()
        with self._lock:
            if self._db is None:
                self._db = self._new_connection()
                self._data_version = None
            yield self._db

    def close(self) -> None:
        """Close this process's connection (a later call opens a new one)."""
        if self._db_pid != os.getpid():
            return
        with self._lock:
            if self._db is not None:
                self._db.close()
            self._db = None

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """A write transaction whose lock is taken up front, so checks and writes cannot interleave."""
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
                db.execute("COMMIT")
            except BaseException:
                _rollback(db)
                raise

    # ----- budgets -----
    @staticmethod
    def _budget(db: sqlite3.Connection, account: str) -> Budget | None:
        row = db.execute("SELECT epsilon, delta FROM accounts WHERE account = ?", (account,)).fetchone()
        return Budget(float(row[0]), float(row[1])) if row else None

    def budget(self, account: str) -> Budget | None:
        """The account's pinned budget, or None if it was never used."""
        with self._connect() as db:
            return self._budget(db, account)

    def open_account(self, account: str, epsilon: float, delta: float) -> Budget:
        """Pin (ε, δ) for a new account, or check that an existing account was pinned at them."""
        outcome = self.open_accounts({account: Budget(float(epsilon), float(delta))})[account]
        if isinstance(outcome, BudgetMismatch):
            raise outcome
        return outcome

    def open_accounts(self, budgets: dict[str, Budget]) -> dict[str, Budget | BudgetMismatch]:
        """`open_account` for many accounts in one transaction; a mismatch is returned, not raised."""
        outcomes: dict[str, Budget | BudgetMismatch] = {}
        with self._transaction() as db:
            pinned = self._budgets(db, list(budgets))
            fresh = [(a, b.epsilon, b.delta, _now()) for a, b in budgets.items() if a not in pinned]
            db.executemany("INSERT INTO accounts (account, epsilon, delta, pinned_at) VALUES (?, ?, ?, ?)", fresh)
        for account, asked in budgets.items():
            have = pinned.get(account, asked)
            outcomes[account] = (
                have
                if have == asked
                else BudgetMismatch(
                    f"ledger account {account!r} is pinned at ε={have.epsilon:g}, δ={have.delta:g}; this client "
                    f"was asked to train at ε={asked.epsilon:g}, δ={asked.delta:g}. A budget changes only by the node "
                    f"operator's own act: fedprivacy ledger set-budget {self.path} {account} --epsilon E --delta D"
                )
            )
        return outcomes

    def _budgets(self, db: sqlite3.Connection, accounts: list[str]) -> dict[str, Budget]:
        """The pinned budgets of those `accounts` that have one. Budgets read before are kept while
        no other connection writes to the file (`PRAGMA data_version`); this one changes a budget
        only in `set_budget`, which forgets it."""
        self._forget_if_written_elsewhere(db)
        known, shared = (
            self._known_budgets,
            self._budget_objects,
        )  # one object per distinct budget: rounds group by it
        try:
            return {a: known[a] for a in accounts}  # a steady round: every budget read before
        except KeyError:
            pass
        for chunk in _chunks([a for a in accounts if a not in known]):
            rows = db.execute(f"SELECT account, epsilon, delta FROM accounts WHERE account IN ({_marks(chunk)})", chunk)
            for account, epsilon, delta in rows:
                known[account] = shared.setdefault((epsilon, delta), Budget(float(epsilon), float(delta)))
        return {a: known[a] for a in accounts if a in known}

    def _forget_if_written_elsewhere(self, db: sqlite3.Connection) -> None:
        version = db.execute("PRAGMA data_version").fetchone()[0]
        if version != self._data_version:
            self._known_budgets.clear()
            self._known_keys.clear()
            self._data_version = version

    def _account_keys(self, db: sqlite3.Connection, accounts: list[str]) -> dict[str, int]:
        """Inside a write transaction: each account's key in the spends table, given now to those
        that have none."""
        self._forget_if_written_elsewhere(db)
        known = self._known_keys
        try:
            return {a: known[a] for a in accounts}  # a steady round: every key given before
        except KeyError:
            pass
        missing = [a for a in accounts if a not in known]
        if missing:
            db.executemany("INSERT OR IGNORE INTO account_keys (account) VALUES (?)", [(a,) for a in missing])
            for chunk in _chunks(missing):
                known.update(
                    db.execute(f"SELECT account, id FROM account_keys WHERE account IN ({_marks(chunk)})", chunk)
                )
        return {a: known[a] for a in accounts}

    def set_budget(self, account: str, epsilon: float, delta: float) -> Budget:
        """The node operator changes an account's budget (the ClientApp never calls this)."""
        with self._transaction() as db:
            if self._budget(db, account) is None:
                raise InputError("account", account, f"no such account in {self.path}")
            self._known_budgets.pop(account, None)
            db.execute(
                "UPDATE accounts SET epsilon = ?, delta = ?, changed_at = ? WHERE account = ?",
                (float(epsilon), float(delta), _now(), account),
            )
        return Budget(float(epsilon), float(delta))

    # ----- data files (deployments) -----
    def pin_data(self, account: str, digest: str, legacy_account: str | None = None) -> None:
        """Pin the digest of the data file `account` trains on, or check it.

        Refused (`DataMismatch`): another file under the same account (appending rows, or saving
        them with other line endings, would otherwise open a fresh budget silently, and edited
        records would count as the old ones), and the same file under a second account (a node
        restarted under another client-id would draw on a fresh budget). The messages name
        accounts only, never digests: a digest is a function of every record. `legacy_account`
        (the content-keyed name earlier versions gave the account) is renamed to `account` when
        `account` is new, so its spends keep counting.
        """
        with self._transaction() as db:
            row = db.execute("SELECT digest FROM account_data WHERE account = ?", (account,)).fetchone()
            if row is not None:
                if row[0] == digest:
                    return
                raise DataMismatch(
                    f"ledger account {account!r} was opened on another data file than the one its node config names "
                    f"now. If the records are the same data set grown or corrected, the operator accepts it with: "
                    f"fedprivacy ledger accept-data {self.path} {account} --data FILE; a different data set needs "
                    "its own client-id"
                )
            other = db.execute("SELECT account FROM account_data WHERE digest = ?", (digest,)).fetchone()
            if other is not None:
                raise DataMismatch(
                    f"this data file is already accounted under {other[0]!r} in ledger {self.path}: "
                    f"start the node with that client-id, so that its spends keep counting"
                )
            legacy_known = (
                legacy_account is not None
                and db.execute(
                    "SELECT 1 FROM account_keys WHERE account = ? UNION SELECT 1 FROM accounts WHERE account = ?",
                    (legacy_account, legacy_account),
                ).fetchone()
                is not None
            )  # spends of a layout without budgets too
            if legacy_known and self._budget(db, account) is None:
                for table in ("account_keys", "accounts", "plans"):
                    db.execute(f"UPDATE {table} SET account = ? WHERE account = ?", (account, legacy_account))
                for cache in (self._known_budgets, self._known_keys, self._seen):
                    cache.pop(legacy_account, None)
            db.execute(
                "INSERT INTO account_data (account, digest, pinned_at) VALUES (?, ?, ?)",
                (account, digest, _now()),
            )

    def accept_data(self, account: str, digest: str) -> None:
        """The node operator declares that `account`'s records now live in the file of `digest`
        (the ClientApp never calls this)."""
        with self._transaction() as db:
            if self._budget(db, account) is None:
                raise InputError("account", account, f"no such account in {self.path}")
            other = db.execute(
                "SELECT account FROM account_data WHERE digest = ? AND account != ?", (digest, account)
            ).fetchone()
            if other is not None:
                raise InputError("data", digest, f"is already the data of account {other[0]!r}: one file, one budget")
            db.execute(
                "INSERT INTO account_data (account, digest, pinned_at, changed_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(account) DO UPDATE SET digest = excluded.digest, changed_at = excluded.changed_at",
                (account, digest, _now(), _now()),
            )

    # ----- partitionings (simulations) -----
    def pin_partitioning(self, dataset: str, partitioning: dict[str, object]) -> None:
        """Refuse to serve accounts of `dataset` under another partitioning than the first one used."""
        text = json.dumps(partitioning, sort_keys=True)
        with self._transaction() as db:
            row = db.execute("SELECT partitioning FROM partitionings WHERE dataset = ?", (dataset,)).fetchone()
            if row is None:
                db.execute(
                    "INSERT INTO partitionings (dataset, partitioning, pinned_at) VALUES (?, ?, ?)",
                    (dataset, text, _now()),
                )
                return
        if row[0] != text:
            raise PartitioningMismatch(
                f"ledger {self.path} holds accounts of this data set partitioned as {row[0]}; this run partitions "
                f"it as {text}: the same records would get fresh budgets. Use the same partitioning, "
                "or another ledger-path for data that is truly distinct"
            )

    # ----- spends -----
    def events(self, account: str) -> list[NoiseEvent]:
        """Every noise event recorded for `account`, oldest first."""
        return self.histories([account]).get(account, [])

    def steps_spent(self, account: str) -> int:
        return sum(e.count for e in self.events(account))

    def _pinned(self, account: str) -> Budget:
        budget = self.budget(account)
        if budget is None:
            raise KeyError(f"ledger account {account!r} has no pinned budget: open_account first")
        return budget

    def epsilon_spent(self, account: str) -> float:
        """Cumulative PLD ε of everything `account` has released, at its pinned δ (0 if new)."""
        budget = self.budget(account)
        return 0.0 if budget is None else composed_epsilon(self.events(account), budget.delta)

    def epsilon_if(self, account: str, new_events: Sequence[NoiseEvent]) -> float:
        """ε the account would have spent after also releasing `new_events`."""
        return composed_epsilon([*self.events(account), *new_events], self._pinned(account).delta)

    def trained(self, account: str, run_id: str, server_round: int) -> bool:
        """Whether `account` already released an update for this (run, round)."""
        with self._connect() as db:
            return account in self._rounds_recorded(db, [account], run_id, server_round)

    def runs(self, account: str) -> set[str]:
        """The runs that spent from `account`."""
        return self.runs_of([account]).get(account, set())

    def runs_of(self, accounts: list[str]) -> dict[str, set[str]]:
        """The runs that spent from each of `accounts` (accounts that never spent are absent)."""
        found: dict[str, set[str]] = {}
        with self._connect() as db:
            for chunk in _chunks(accounts):
                rows = db.execute(
                    "SELECT DISTINCT k.account, s.run_id FROM spends AS s "
                    "JOIN account_keys AS k ON k.id = s.account_key "
                    f"WHERE k.account IN ({_marks(chunk)})",
                    chunk,
                )
                for account, run_id in rows:
                    found.setdefault(account, set()).add(run_id)
        return found

    def compose_ahead(self, plans: dict[str, Plan], first_round: int) -> int:
        """Compute now the ε that each account's round decisions will ask for if it spends its
        plan's every round from `first_round` on (a simulation whose clients all train in every
        round), and keep them with the shared histories; returns for how many (history, round)
        pairs an ε is now ready (computed here, or already known).

        A decision composes the new history's PLD (an FFT convolution of a PLD that grows with the
        history) and walks it for ε. Here each distinct (history, plan's schedule, budget) is one
        fold, each round extending the PLD just composed, and the rounds find their ε by look-up.
        In the rounds, after training, a 2-core machine composes at about half the speed; and once
        a round holds more distinct histories than the accountant keeps composed PLDs
        (`COMPOSED_CACHE_SIZE`), it composes each again from its first spend, every round. Nothing
        is decided or written here: each decision still checks the account's actual history, and
        finds its ε here only if the account spent exactly as planned. A fold stops at the first
        round its budget would refuse; all stop before the shared histories would pass half their
        limit (and be forgotten, this work with them)."""
        accounts = list(plans)
        with self._connect() as db:
            db.execute("BEGIN")  # one snapshot of histories and budgets
            try:
                histories = self._current_histories(db, accounts)
                budgets = self._budgets(db, accounts)
            finally:
                db.execute("COMMIT")
        # a schedule by value (an id of the interned tuple could be reused once its cache drops it);
        # histories and budgets by id: the two dicts above hold them while the folds are grouped
        folds = {(id(histories[a]), noise_schedule(plans[a]), id(budgets[a])): a for a in accounts if a in budgets}
        shared, room, ready = self._shared, self._shared.LIMIT // 2, 0
        for account in folds.values():
            plan, budget, history = plans[account], budgets[account], histories[account]
            for server_round in range(first_round, plan.rounds + 1):
                new_events = tuple(e for e in round_events(plan, server_round) if e.count > 0)
                if not new_events:
                    continue
                if shared.size() + 3 > room:  # a new history adds up to two entries, its ε one
                    return ready
                history = shared.extend(history, new_events)
                ready += 1
                if shared.epsilon(history, budget.delta) > budget.epsilon:
                    break  # refused from this round on: the account spends no further
        return ready

    def record(self, account: str, run_id: str, server_round: int, new_events: Sequence[NoiseEvent]) -> float:
        """Durably add `new_events` to `account` under its pinned budget; return the new cumulative ε.

        Raises `RoundRepeated` if this (run, round) was already recorded and `BudgetExceeded` if the
        new ε would exceed the budget; either way nothing is written.
        """
        return self.record_with_steps(account, run_id, server_round, new_events)[0]

    def record_with_steps(
        self, account: str, run_id: str, server_round: int, new_events: Sequence[NoiseEvent]
    ) -> tuple[float, int]:
        """`record`, with the account's steps once the spend is recorded (its whole history, read
        in the same transaction: a client's reply then states one ledger state, even if another
        writer spends from the account right after)."""
        decision, _ = self._record_round(run_id, server_round, {account: new_events}, None)
        outcome = decision.outcomes[account]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome, decision.steps[account]

    def record_round(
        self, run_id: str, server_round: int, spends: dict[str, Sequence[NoiseEvent]]
    ) -> dict[str, Outcome]:
        """`record` for every account of a round, in one transaction: each account gets its new ε,
        or the refusal that kept its spend out (the others are written regardless)."""
        return self._record_round(run_id, server_round, spends, None)[0].outcomes

    def record_round_while(
        self,
        run_id: str,
        server_round: int,
        spends: dict[str, Sequence[NoiseEvent]],
        work: Callable[[RoundDecision], T] | None,
    ) -> tuple[dict[str, Outcome], T | None]:
        """`record_round`, running `work(decision)` while the round's spends are written and
        committed on another thread (a simulation's training overlaps the ledger's disk work); the
        work's result is returned only once the spends are durable. If the write or commit fails,
        its error is raised, the round rolled back and the result dropped. `work` runs before the
        spends are durable, so it must have no effect visible outside until it returns (training,
        and aggregation and evaluation in memory, whose results are used only after), and it must
        not use this ledger: its connection is busy."""
        decision, result = self._record_round(run_id, server_round, spends, work)
        return decision.outcomes, result

    def _record_round(
        self,
        run_id: str,
        server_round: int,
        spends: dict[str, Sequence[NoiseEvent]],
        work: Callable[[RoundDecision], T] | None,
    ) -> tuple[RoundDecision, T | None]:
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                decision, written, rows = self._decide_round(db, run_id, server_round, spends)
                if work is None:
                    last, result = _write_and_commit(db, rows), None
                else:
                    last, result = _write_and_commit_during(db, rows, lambda: work(decision))
            except BaseException:
                self._known_keys.clear()  # keys given in the rolled-back transaction are gone
                _rollback(db)
                raise
            self._seen.update(written)  # only once committed
            self._synced = last
        return decision, result

    def _decide_round(
        self, db: sqlite3.Connection, run_id: str, server_round: int, spends: dict[str, Sequence[NoiseEvent]]
    ) -> tuple[RoundDecision, dict[str, tuple[NoiseEvent, ...]], list[SpendRow]]:
        """Inside the round's transaction: the decision, the histories it writes, and the
        `_INSERT_SPENDS` rows that write them (one per group of equal spends and event)."""
        outcomes: dict[str, Outcome] = {}
        steps: dict[str, int] = {}
        written: dict[str, tuple[NoiseEvent, ...]] = {}
        rows: list[SpendRow] = []
        now = _now()
        accounts = list(spends)
        budgets = self._budgets(db, accounts)
        if len(budgets) < len(accounts):
            missing = next(a for a in accounts if a not in budgets)
            raise KeyError(f"ledger account {missing!r} has no pinned budget: open_account first")
        histories = self._current_histories(db, accounts)
        keys = self._account_keys(db, accounts)
        repeated = self._rounds_recorded(db, accounts, run_id, server_round)
        # accounts with the same history, spends and budget share one check (one ε per group)
        groups: dict[tuple[int, int, int], list[str]] = {}
        for account, new_events in spends.items():
            if account in repeated:
                outcomes[account] = RoundRepeated(
                    f"round {server_round} of run {run_id} was already trained by this client"
                )
            else:
                groups.setdefault((id(histories[account]), id(new_events), id(budgets[account])), []).append(account)
        for members in groups.values():
            budget = budgets[members[0]]
            new_events = tuple(e for e in spends[members[0]] if e.count > 0)
            history = self._shared.extend(histories[members[0]], new_events)
            epsilon = self._shared.epsilon(history, budget.delta)
            if epsilon > budget.epsilon:
                outcomes.update(
                    {
                        a: BudgetExceeded(f"account {a!r}: ε would reach {epsilon:.4f} > budget {budget.epsilon:g}")
                        for a in members
                    }
                )
                continue
            outcomes.update(dict.fromkeys(members, epsilon))
            written.update(dict.fromkeys(members, history))
            steps.update(dict.fromkeys(members, self._shared.steps(history)))
            members_keys = json.dumps(list(map(keys.__getitem__, members)))
            rows += [
                (
                    run_id,
                    server_round,
                    e.sigma,
                    e.sampling_rate,
                    e.count,
                    epsilon,
                    budget.delta,
                    now,
                    members_keys,
                )
                for e in new_events
            ]
        return RoundDecision(outcomes, steps), written, rows

    def _current_histories(self, db: sqlite3.Connection, accounts: list[str]) -> dict[str, tuple[NoiseEvent, ...]]:
        """The accounts' histories inside a transaction. Those seen before are kept unless another
        writer spent from them since (spends with a larger id): a steady round costs one lookup of
        the last id instead of reading every account's history or last spend."""
        last = self._last_id(db)
        if last != self._synced:
            if self._synced is None or last < self._synced:  # first use, or not the file seen before
                self._seen.clear()
                if self._synced is not None:  # nothing read from the other file is kept
                    self._known_keys.clear()
                    self._known_budgets.clear()
            else:
                for (account,) in db.execute(
                    "SELECT DISTINCT k.account FROM spends AS s NOT INDEXED JOIN account_keys AS k "
                    "ON k.id = s.account_key WHERE s.id > ?",
                    (self._synced,),
                ):
                    self._seen.pop(account, None)
            self._synced = last
        seen = self._seen
        try:
            return {a: seen[a] for a in accounts}  # a steady round: every history kept
        except KeyError:
            pass
        unknown = [a for a in accounts if a not in seen]
        fresh = self._histories(db, unknown)
        for account in unknown:
            self._seen[account] = self._shared.intern(fresh.get(account, ()))
        return {a: self._seen[a] for a in accounts}

    @staticmethod
    def _last_id(db: sqlite3.Connection) -> int:
        return int(db.execute("SELECT COALESCE(MAX(id), 0) FROM spends").fetchone()[0])

    def histories(self, accounts: list[str]) -> dict[str, list[NoiseEvent]]:
        """Every recorded event of each account, oldest first (one query for all of them)."""
        with self._connect() as db:
            return self._histories(db, accounts)

    @staticmethod
    def _histories(db: sqlite3.Connection, accounts: list[str]) -> dict[str, list[NoiseEvent]]:
        found: dict[str, list[NoiseEvent]] = {}
        for chunk in _chunks(accounts):
            rows = db.execute(
                "SELECT k.account, s.sigma, s.sampling_rate, s.steps FROM spends AS s "
                "JOIN account_keys AS k ON k.id = s.account_key "
                f"WHERE k.account IN ({_marks(chunk)}) ORDER BY s.id",
                chunk,
            )
            for account, sigma, q, count in rows:
                found.setdefault(account, []).append(NoiseEvent(sigma=sigma, sampling_rate=q, count=int(count)))
        return found

    @staticmethod
    def _rounds_recorded(db: sqlite3.Connection, accounts: list[str], run_id: str, server_round: int) -> set[str]:
        found: set[str] = set()
        if (
            db.execute(
                "SELECT 1 FROM spends WHERE run_id = ? AND server_round = ? LIMIT 1", (run_id, server_round)
            ).fetchone()
            is None
        ):
            return found  # a round nobody recorded yet: one index probe instead of a lookup per account
        for chunk in _chunks(accounts):
            rows = db.execute(
                f"SELECT DISTINCT k.account FROM spends AS s JOIN account_keys AS k ON k.id = s.account_key "
                f"WHERE s.run_id = ? AND s.server_round = ? AND k.account IN ({_marks(chunk)})",
                [run_id, server_round, *chunk],
            )
            found.update(r[0] for r in rows)
        return found

    # ----- the operator's view -----
    def accounts(self) -> list[AccountSummary]:
        """Every account: its pinned budget and what it has spent (ε at its pinned δ)."""
        with self._connect() as db:
            rows = db.execute("SELECT account, epsilon, delta FROM accounts ORDER BY account").fetchall()
            histories = self._histories(db, [row[0] for row in rows])
            summaries = []
            for account, epsilon, delta in rows:
                events = histories.get(account, [])
                runs, last = db.execute(
                    "SELECT COUNT(DISTINCT s.run_id), MAX(s.recorded_at) FROM spends AS s JOIN account_keys AS k "
                    "ON k.id = s.account_key WHERE k.account = ?",
                    (account,),
                ).fetchone()
                summaries.append(
                    AccountSummary(
                        account=account,
                        epsilon=float(epsilon),
                        delta=float(delta),
                        steps=sum(e.count for e in events),
                        epsilon_spent=composed_epsilon(events, float(delta)),
                        runs=int(runs),
                        last_spend=last,
                    )
                )
        return summaries

    # ----- plans -----
    def save_plan(self, account: str, run_id: str, plan: Plan) -> None:
        """Keep the run's plan so a restarted client resumes the same plan, not a new one."""
        self.save_plans(run_id, {account: plan})

    def save_plans(self, run_id: str, plans: dict[str, Plan]) -> dict[str, Plan]:
        """`save_plan` for many accounts in one transaction; returns the plan each account now has
        for the run: a plan saved before (by a restarted twin, say) is kept and returned instead."""
        other = [p.neighbours for p in plans.values() if p.neighbours != "add-remove"]
        if other:  # its spends are composed as add/remove steps: another relation would be misreported
            raise ValueError(f"a {other[0]} plan cannot be run: a ledger composes add/remove steps (N public)")
        with self._transaction() as db:
            kept = self._plans(db, list(plans), run_id)
            db.executemany(
                "INSERT INTO plans (account, run_id, plan_json) VALUES (?, ?, ?)",
                [(account, run_id, plan.to_json()) for account, plan in plans.items() if account not in kept],
            )
        return {**plans, **kept}

    def load_plan(self, account: str, run_id: str) -> Plan | None:
        return self.load_plans([account], run_id).get(account)

    def load_plans(self, accounts: list[str], run_id: str) -> dict[str, Plan]:
        """The run's saved plans of those `accounts` that have one."""
        with self._connect() as db:
            return self._plans(db, accounts, run_id)

    @staticmethod
    def _plans(db: sqlite3.Connection, accounts: list[str], run_id: str) -> dict[str, Plan]:
        found: dict[str, Plan] = {}
        for chunk in _chunks(accounts):
            rows = db.execute(
                f"SELECT account, plan_json FROM plans WHERE run_id = ? AND account IN ({_marks(chunk)})",
                [run_id, *chunk],
            )
            found.update({account: Plan.from_dict(json.loads(text)) for account, text in rows})
        return found
