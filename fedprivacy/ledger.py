"""The privacy ledger: a durable record of every noisy step a client has released.

Privacy loss composes across rounds, restarts and runs, so the ledger lives in a SQLite file and
is keyed by an *account* (one client's data set), not by the run. Each recorded spend is a group
of Poisson-subsampled Gaussian steps (σ, q, count); the ε spent is the PLD composition of all of
them at the client's δ, never a sum of per-round ε. A spend is written in one transaction that
re-checks the budget, so two writers (a restarted client, two runs) can never overshoot it.

This module never imports flwr: the ClientApp calls it, tests drive it directly.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from itertools import groupby
from pathlib import Path

from fedprivacy.privacy.accountants import NoiseEvent, pld_epsilon
from fedprivacy.privacy.plan import Plan

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
"""


class BudgetExceeded(RuntimeError):
    """Recording these steps would push the account's ε above its budget."""


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


class Ledger:
    """One SQLite file holding the spends of any number of accounts."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            db.executescript(_SCHEMA)

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        # Autocommit mode: transactions are explicit (BEGIN IMMEDIATE) where they matter.
        db = sqlite3.connect(self.path, timeout=60.0, isolation_level=None)
        try:
            db.execute("PRAGMA synchronous=FULL")
            yield db
        finally:
            db.close()

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

    def epsilon_spent(self, account: str, delta: float) -> float:
        """Cumulative PLD ε of everything `account` has released, at `delta`."""
        return composed_epsilon(self.events(account), delta)

    def epsilon_if(self, account: str, new_events: Sequence[NoiseEvent], delta: float) -> float:
        """ε the account would have spent after also releasing `new_events`."""
        return composed_epsilon([*self.events(account), *new_events], delta)

    def record(
        self,
        account: str,
        run_id: str,
        server_round: int,
        new_events: Sequence[NoiseEvent],
        *,
        delta: float,
        budget: float,
    ) -> float:
        """Durably add `new_events` to `account`; return the new cumulative ε.

        The check and the write happen in one IMMEDIATE transaction (a write lock taken up
        front), so a concurrent writer cannot slip a spend in between. Raises `BudgetExceeded`
        and writes nothing if the new ε would exceed `budget`.
        """
        new_events = [e for e in new_events if e.count > 0]
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                epsilon = composed_epsilon([*self._events(db, account), *new_events], delta)
                if epsilon > budget:
                    raise BudgetExceeded(
                        f"account {account!r}: ε would reach {epsilon:.4f} > budget {budget:g}"
                    )
                now = datetime.now(timezone.utc).isoformat()
                db.executemany(
                    "INSERT INTO spends (account, run_id, server_round, sigma, sampling_rate, steps,"
                    " epsilon_after, delta, recorded_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [
                        (account, run_id, server_round, e.sigma, e.sampling_rate, e.count, epsilon, delta, now)
                        for e in new_events
                    ],
                )
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return epsilon

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
