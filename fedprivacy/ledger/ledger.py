"""`Ledger`: one SQLite file holding the spends of any number of accounts, under budgets it pins.

The rules are told in the package's docstring (`fedprivacy.ledger`); this class enforces them,
each decision in the transaction that writes it, and keeps what it read before (budgets, account
keys, histories) for as long as no other connection wrote to the file.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from fedprivacy.errors import InputError
from fedprivacy.ledger import composition, pins, queries, writes  # by module: a test's stand-in reaches every call
from fedprivacy.ledger.accounts import AccountSummary, Budget
from fedprivacy.ledger.refusals import BudgetExceeded, BudgetMismatch, PartitioningMismatch, RoundRepeated
from fedprivacy.ledger.rounds import noise_schedule, round_events
from fedprivacy.ledger.sql import chunks, marks, now, rollback
from fedprivacy.ledger.storage import Storage
from fedprivacy.ledger.writes import SpendRow
from fedprivacy.privacy.accountants import NoiseEvent
from fedprivacy.privacy.plan import Plan

T = TypeVar("T")

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

    A Ledger keeps one connection per process (`Storage`), so a round's transaction costs no
    connect, and `PRAGMA data_version` tells it whether any other connection wrote since: budgets
    read before are reused until then. `close()` releases it.
    """

    def __init__(self, path: str | Path, busy_timeout: float = 60.0) -> None:
        """Open (or create, 0600) the ledger at `path`; wait up to `busy_timeout` s for another writer."""
        self.path = Path(path)
        # Histories read or written before, current as of spend id `_synced` (ids only grow: AUTOINCREMENT)
        self._seen: dict[str, tuple[NoiseEvent, ...]] = {}
        self._synced: int | None = None
        self._shared = composition.SharedHistories()
        self._known_budgets: dict[str, Budget] = {}  # valid while no other connection writes
        self._known_keys: dict[str, int] = {}  # likewise (a key never changes, but the file might be replaced)
        self._budget_objects: dict[tuple[float, float], Budget] = {}
        self._storage = Storage(self.path, busy_timeout)

    def close(self) -> None:
        """Close this process's connection (a later call opens a new one)."""
        self._storage.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ----- budgets -----
    def budget(self, account: str) -> Budget | None:
        """The account's pinned budget, or None if it was never used."""
        with self._storage.connect() as db:
            return queries.pinned_budget(db, account)

    def open_account(self, account: str, epsilon: float, delta: float) -> Budget:
        """Pin (ε, δ) for a new account, or check that an existing account was pinned at them."""
        outcome = self.open_accounts({account: Budget(float(epsilon), float(delta))})[account]
        if isinstance(outcome, BudgetMismatch):
            raise outcome
        return outcome

    def open_accounts(self, budgets: dict[str, Budget]) -> dict[str, Budget | BudgetMismatch]:
        """`open_account` for many accounts in one transaction; a mismatch is returned, not raised."""
        outcomes: dict[str, Budget | BudgetMismatch] = {}
        with self._storage.transaction() as db:
            pinned = self._budgets(db, list(budgets))
            fresh = [(a, b.epsilon, b.delta, now()) for a, b in budgets.items() if a not in pinned]
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
        known = self._known_budgets
        shared = self._budget_objects  # one object per distinct budget: rounds group by it
        try:
            return {a: known[a] for a in accounts}  # a steady round: every budget read before
        except KeyError:
            pass
        for chunk in chunks([a for a in accounts if a not in known]):
            rows = db.execute(f"SELECT account, epsilon, delta FROM accounts WHERE account IN ({marks(chunk)})", chunk)
            for account, epsilon, delta in rows:
                known[account] = shared.setdefault((epsilon, delta), Budget(float(epsilon), float(delta)))
        return {a: known[a] for a in accounts if a in known}

    def _forget_if_written_elsewhere(self, db: sqlite3.Connection) -> None:
        if self._storage.written_elsewhere(db):
            self._known_budgets.clear()
            self._known_keys.clear()

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
            for chunk in chunks(missing):
                known.update(
                    db.execute(f"SELECT account, id FROM account_keys WHERE account IN ({marks(chunk)})", chunk)
                )
        return {a: known[a] for a in accounts}

    def set_budget(self, account: str, epsilon: float, delta: float) -> Budget:
        """The node operator changes an account's budget (the ClientApp never calls this)."""
        with self._storage.transaction() as db:
            if queries.pinned_budget(db, account) is None:
                raise InputError("account", account, f"no such account in {self.path}")
            self._known_budgets.pop(account, None)
            db.execute(
                "UPDATE accounts SET epsilon = ?, delta = ?, changed_at = ? WHERE account = ?",
                (float(epsilon), float(delta), now(), account),
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
        with self._storage.transaction() as db:
            renamed = pins.pin_data(db, self.path, account, digest, legacy_account)
            if renamed is not None:
                for cache in (self._known_budgets, self._known_keys, self._seen):
                    cache.pop(renamed, None)

    def accept_data(self, account: str, digest: str) -> None:
        """The node operator declares that `account`'s records now live in the file of `digest`
        (the ClientApp never calls this)."""
        with self._storage.transaction() as db:
            pins.accept_data(db, self.path, account, digest)

    # ----- partitionings (simulations) -----
    def pin_partitioning(self, dataset: str, partitioning: dict[str, object]) -> None:
        """Refuse to serve accounts of `dataset` under another partitioning than the first one used."""
        text = json.dumps(partitioning, sort_keys=True)
        with self._storage.transaction() as db:
            pinned = pins.pin_partitioning(db, dataset, text)
        if pinned != text:
            raise PartitioningMismatch(
                f"ledger {self.path} holds accounts of this data set partitioned as {pinned}; this run partitions "
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
        return 0.0 if budget is None else composition.composed_epsilon(self.events(account), budget.delta)

    def epsilon_if(self, account: str, new_events: Sequence[NoiseEvent]) -> float:
        """ε the account would have spent after also releasing `new_events`."""
        return composition.composed_epsilon([*self.events(account), *new_events], self._pinned(account).delta)

    def trained(self, account: str, run_id: str, server_round: int) -> bool:
        """Whether `account` already released an update for this (run, round)."""
        with self._storage.connect() as db:
            return account in queries.rounds_recorded(db, [account], run_id, server_round)

    def runs(self, account: str) -> set[str]:
        """The runs that spent from `account`."""
        return self.runs_of([account]).get(account, set())

    def runs_of(self, accounts: list[str]) -> dict[str, set[str]]:
        """The runs that spent from each of `accounts` (accounts that never spent are absent)."""
        with self._storage.connect() as db:
            return queries.runs_of(db, accounts)

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
        with self._storage.connect() as db:
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
        with self._storage.connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                decision, written, rows = self._decide_round(db, run_id, server_round, spends)
                if work is None:
                    last, result = writes.write_and_commit(db, rows), None
                else:
                    last, result = writes.write_and_commit_during(db, rows, lambda: work(decision))
            except BaseException:
                self._known_keys.clear()  # keys given in the rolled-back transaction are gone
                rollback(db)
                raise
            self._seen.update(written)  # only once committed
            self._synced = last
        return decision, result

    def _decide_round(
        self, db: sqlite3.Connection, run_id: str, server_round: int, spends: dict[str, Sequence[NoiseEvent]]
    ) -> tuple[RoundDecision, dict[str, tuple[NoiseEvent, ...]], list[SpendRow]]:
        """Inside the round's transaction: the decision, the histories it writes, and the
        `INSERT_SPENDS` rows that write them (one per group of equal spends and event)."""
        outcomes: dict[str, Outcome] = {}
        steps: dict[str, int] = {}
        written: dict[str, tuple[NoiseEvent, ...]] = {}
        rows: list[SpendRow] = []
        recorded_at = now()
        accounts = list(spends)
        budgets = self._budgets(db, accounts)
        if len(budgets) < len(accounts):
            missing = next(a for a in accounts if a not in budgets)
            raise KeyError(f"ledger account {missing!r} has no pinned budget: open_account first")
        histories = self._current_histories(db, accounts)
        keys = self._account_keys(db, accounts)
        repeated = queries.rounds_recorded(db, accounts, run_id, server_round)
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
                    recorded_at,
                    members_keys,
                )
                for e in new_events
            ]
        return RoundDecision(outcomes, steps), written, rows

    def _current_histories(self, db: sqlite3.Connection, accounts: list[str]) -> dict[str, tuple[NoiseEvent, ...]]:
        """The accounts' histories inside a transaction. Those seen before are kept unless another
        writer spent from them since (spends with a larger id): a steady round costs one lookup of
        the last id instead of reading every account's history or last spend."""
        last = queries.last_spend_id(db)
        if last != self._synced:
            if self._synced is None or last < self._synced:  # first use, or not the file seen before
                self._seen.clear()
                if self._synced is not None:  # nothing read from the other file is kept
                    self._known_keys.clear()
                    self._known_budgets.clear()
            else:
                for account in queries.accounts_spent_since(db, self._synced):
                    self._seen.pop(account, None)
            self._synced = last
        seen = self._seen
        try:
            return {a: seen[a] for a in accounts}  # a steady round: every history kept
        except KeyError:
            pass
        unknown = [a for a in accounts if a not in seen]
        fresh = queries.histories(db, unknown)
        for account in unknown:
            self._seen[account] = self._shared.intern(fresh.get(account, ()))
        return {a: self._seen[a] for a in accounts}

    def histories(self, accounts: list[str]) -> dict[str, list[NoiseEvent]]:
        """Every recorded event of each account, oldest first (one query for all of them)."""
        with self._storage.connect() as db:
            return queries.histories(db, accounts)

    # ----- the operator's view -----
    def accounts(self) -> list[AccountSummary]:
        """Every account: its pinned budget and what it has spent (ε at its pinned δ)."""
        with self._storage.connect() as db:
            rows = db.execute("SELECT account, epsilon, delta FROM accounts ORDER BY account").fetchall()
            histories = queries.histories(db, [row[0] for row in rows])
            summaries = []
            for account, epsilon, delta in rows:
                events = histories.get(account, [])
                runs, last = queries.activity(db, account)
                summaries.append(
                    AccountSummary(
                        account=account,
                        epsilon=float(epsilon),
                        delta=float(delta),
                        steps=sum(e.count for e in events),
                        epsilon_spent=composition.composed_epsilon(events, float(delta)),
                        runs=runs,
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
        with self._storage.transaction() as db:
            kept = queries.plans(db, list(plans), run_id)
            db.executemany(
                "INSERT INTO plans (account, run_id, plan_json) VALUES (?, ?, ?)",
                [(account, run_id, plan.to_json()) for account, plan in plans.items() if account not in kept],
            )
        return {**plans, **kept}

    def load_plan(self, account: str, run_id: str) -> Plan | None:
        return self.load_plans([account], run_id).get(account)

    def load_plans(self, accounts: list[str], run_id: str) -> dict[str, Plan]:
        """The run's saved plans of those `accounts` that have one."""
        with self._storage.connect() as db:
            return queries.plans(db, accounts, run_id)
