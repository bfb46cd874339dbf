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
  set, so a ledger reused under another seed or scheme cannot move records to a fresh account.

The file is created readable by its owner only (0600): it tells how much each data set has spent.
This module never imports flwr: the ClientApp calls it, tests drive it directly.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from itertools import groupby
from pathlib import Path

from fedprivacy.errors import ClientRefusal, InputError
from fedprivacy.privacy.accountants import NoiseEvent, pld_epsilon
from fedprivacy.privacy.plan import Plan

SCHEMA_VERSION = 2  # PRAGMA user_version; 0 is the first layout (no pinned budgets), migrated on open
_SCHEMA = """
CREATE TABLE IF NOT EXISTS spends (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    account TEXT NOT NULL,
    run_id TEXT NOT NULL,
    server_round INTEGER NOT NULL,
    sigma REAL NOT NULL,
    sampling_rate REAL NOT NULL,
    steps INTEGER NOT NULL,
    epsilon_after REAL NOT NULL,
    delta REAL NOT NULL,
    recorded_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS spends_account ON spends(account);
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
"""


class BudgetExceeded(RuntimeError):
    """Recording these steps would push the account's ε above its budget."""


class BudgetMismatch(ClientRefusal):
    """A request to train under another (ε, δ) than the one pinned for the account."""


class RoundRepeated(ClientRefusal):
    """A (run, round) that the account has already released an update for."""


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


def round_events(plan: Plan, server_round: int) -> list[NoiseEvent]:
    """The noise events of one round's slice of `plan`, consecutive equal σ merged."""
    first = plan.first_step_of_round(server_round)
    sigmas = [plan.noise_multiplier(s) for s in range(first, first + plan.steps_in_round(server_round))]
    return [
        NoiseEvent(sigma=sigma, sampling_rate=plan.sampling_rate, count=len(list(group)))
        for sigma, group in groupby(sigmas)
    ]


def composed_epsilon(events: Sequence[NoiseEvent], delta: float) -> float:
    """PLD ε of `events` at `delta`; 0 when nothing was released."""
    events = [e for e in events if e.count > 0]
    return float(pld_epsilon(events, delta)) if events else 0.0


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


class Ledger:
    """One SQLite file holding the spends of any number of accounts."""

    def __init__(self, path: str | Path, busy_timeout: float = 60.0) -> None:
        """Open (or create, 0600) the ledger at `path`; wait up to `busy_timeout` s for another writer."""
        self.path = Path(path)
        self.busy_timeout = busy_timeout
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not self.path.exists():
                # Created 0600 before SQLite writes anything into it.
                os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except OSError as error:
            raise InputError("ledger-path", str(self.path), f"cannot create a ledger there ({error.strerror or error})") from None
        try:
            with self._connect() as db:
                version = db.execute("PRAGMA user_version").fetchone()[0]
                if version > SCHEMA_VERSION:
                    raise InputError(
                        "ledger-path", str(self.path),
                        f"written by a newer fedprivacy (ledger schema {version}, this version reads up to "
                        f"{SCHEMA_VERSION}): upgrade fedprivacy, never downgrade a ledger",
                    )
                tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
                if tables and "spends" not in tables:
                    raise InputError("ledger-path", str(self.path), "is an SQLite database of another application "
                                     f"(tables: {', '.join(sorted(tables)[:3])}…), not a fedprivacy ledger; it is left as it was")
                db.executescript(_SCHEMA)
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except sqlite3.OperationalError as error:
            if "locked" not in str(error):
                raise InputError("ledger-path", str(self.path), f"not a readable fedprivacy ledger ({error})") from None
            raise InputError("ledger-path", str(self.path), f"locked by another process for more than {busy_timeout:g} s "
                             "(a SuperNode writing to it?): try again when it is done") from None
        except sqlite3.DatabaseError as error:
            raise InputError("ledger-path", str(self.path), f"not a readable fedprivacy ledger ({error})") from None

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        # Autocommit mode: transactions are explicit (BEGIN IMMEDIATE) where they matter.
        db = sqlite3.connect(self.path, timeout=self.busy_timeout, isolation_level=None)
        try:
            db.execute("PRAGMA synchronous=FULL")
            yield db
        finally:
            db.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """A write transaction whose lock is taken up front, so checks and writes cannot interleave."""
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
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
        with self._transaction() as db:
            pinned = self._budget(db, account)
            if pinned is None:
                db.execute("INSERT INTO accounts (account, epsilon, delta, pinned_at) VALUES (?, ?, ?, ?)",
                           (account, float(epsilon), float(delta), _now()))
                return Budget(float(epsilon), float(delta))
        if (pinned.epsilon, pinned.delta) != (float(epsilon), float(delta)):
            raise BudgetMismatch(
                f"ledger account {account!r} is pinned at ε={pinned.epsilon:g}, δ={pinned.delta:g}; this client "
                f"was asked to train at ε={epsilon:g}, δ={delta:g}. A budget changes only by the node operator's "
                f"own act: fedprivacy ledger set-budget {self.path} {account} --epsilon E --delta D"
            )
        return pinned

    def set_budget(self, account: str, epsilon: float, delta: float) -> Budget:
        """The node operator changes an account's budget (the ClientApp never calls this)."""
        with self._transaction() as db:
            if self._budget(db, account) is None:
                raise InputError("account", account, f"no such account in {self.path}")
            db.execute("UPDATE accounts SET epsilon = ?, delta = ?, changed_at = ? WHERE account = ?",
                       (float(epsilon), float(delta), _now(), account))
        return Budget(float(epsilon), float(delta))

    # ----- partitionings (simulations) -----
    def pin_partitioning(self, dataset: str, partitioning: dict[str, object]) -> None:
        """Refuse to serve accounts of `dataset` under another partitioning than the first one used."""
        text = json.dumps(partitioning, sort_keys=True)
        with self._transaction() as db:
            row = db.execute("SELECT partitioning FROM partitionings WHERE dataset = ?", (dataset,)).fetchone()
            if row is None:
                db.execute("INSERT INTO partitionings (dataset, partitioning, pinned_at) VALUES (?, ?, ?)",
                           (dataset, text, _now()))
                return
        if row[0] != text:
            raise PartitioningMismatch(
                f"ledger {self.path} holds accounts of this data set partitioned as {row[0]}; this run partitions "
                f"it as {text}: the same records would get fresh budgets. Use the same partitioning, or another ledger-path "
                "for data that is truly distinct"
            )

    # ----- spends -----
    @staticmethod
    def _events(db: sqlite3.Connection, account: str) -> list[NoiseEvent]:
        rows = db.execute(
            "SELECT sigma, sampling_rate, steps FROM spends WHERE account = ? ORDER BY id", (account,)
        ).fetchall()
        return [NoiseEvent(sigma=s, sampling_rate=q, count=int(c)) for s, q, c in rows]

    def events(self, account: str) -> list[NoiseEvent]:
        """Every noise event recorded for `account`, oldest first."""
        with self._connect() as db:
            return self._events(db, account)

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
            return db.execute(
                "SELECT 1 FROM spends WHERE account = ? AND run_id = ? AND server_round = ? LIMIT 1",
                (account, run_id, server_round),
            ).fetchone() is not None

    def runs(self, account: str) -> set[str]:
        """The runs that spent from `account`."""
        with self._connect() as db:
            return {r[0] for r in db.execute("SELECT DISTINCT run_id FROM spends WHERE account = ?", (account,))}

    def record(self, account: str, run_id: str, server_round: int, new_events: Sequence[NoiseEvent]) -> float:
        """Durably add `new_events` to `account` under its pinned budget; return the new cumulative ε.

        Raises `RoundRepeated` if this (run, round) was already recorded and `BudgetExceeded` if the
        new ε would exceed the budget; either way nothing is written.
        """
        new_events = [e for e in new_events if e.count > 0]
        with self._transaction() as db:
            budget = self._budget(db, account)
            if budget is None:
                raise KeyError(f"ledger account {account!r} has no pinned budget: open_account first")
            if db.execute("SELECT 1 FROM spends WHERE account = ? AND run_id = ? AND server_round = ? LIMIT 1",
                          (account, run_id, server_round)).fetchone():
                raise RoundRepeated(f"round {server_round} of run {run_id} was already trained by this client")
            epsilon = composed_epsilon([*self._events(db, account), *new_events], budget.delta)
            if epsilon > budget.epsilon:
                raise BudgetExceeded(f"account {account!r}: ε would reach {epsilon:.4f} > budget {budget.epsilon:g}")
            now = _now()
            db.executemany(
                "INSERT INTO spends (account, run_id, server_round, sigma, sampling_rate, steps,"
                " epsilon_after, delta, recorded_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (account, run_id, server_round, e.sigma, e.sampling_rate, e.count, epsilon, budget.delta, now)
                    for e in new_events
                ],
            )
        return epsilon

    # ----- the operator's view -----
    def accounts(self) -> list[AccountSummary]:
        """Every account: its pinned budget and what it has spent (ε at its pinned δ)."""
        with self._connect() as db:
            rows = db.execute("SELECT account, epsilon, delta FROM accounts ORDER BY account").fetchall()
            summaries = []
            for account, epsilon, delta in rows:
                events = self._events(db, account)
                runs, last = db.execute(
                    "SELECT COUNT(DISTINCT run_id), MAX(recorded_at) FROM spends WHERE account = ?", (account,)
                ).fetchone()
                summaries.append(AccountSummary(
                    account=account, epsilon=float(epsilon), delta=float(delta), steps=sum(e.count for e in events),
                    epsilon_spent=composed_epsilon(events, float(delta)), runs=int(runs), last_spend=last,
                ))  # fmt: skip
        return summaries

    # ----- plans -----
    def save_plan(self, account: str, run_id: str, plan: Plan) -> None:
        """Keep the run's plan so a restarted client resumes the same plan, not a new one."""
        with self._connect() as db:
            db.execute(
                "INSERT OR IGNORE INTO plans (account, run_id, plan_json) VALUES (?, ?, ?)",
                (account, run_id, plan.to_json()),
            )

    def load_plan(self, account: str, run_id: str) -> Plan | None:
        with self._connect() as db:
            row = db.execute(
                "SELECT plan_json FROM plans WHERE account = ? AND run_id = ?", (account, run_id)
            ).fetchone()
        return Plan.from_dict(json.loads(row[0])) if row else None
