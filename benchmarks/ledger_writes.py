"""A round's ledger write as the ledger grows: spends keyed by account name against account keys.

Every account of a simulated round appends one spend, and the spends are indexed by account, so
each round rewrites an index page per account; how big those pages' entries are sets how many
pages a round dirties, copies to the journal and syncs. Two layouts, side by side, interleaved
round by round, each in its own SQLite file with the ledger's settings (`synchronous=FULL`,
rollback journal, one `BEGIN IMMEDIATE` transaction per round, one `INSERT … SELECT … FROM
json_each` per round):

- `names`: ledger schema 2, which named the account in every spend and in both of its indexes
  (a simulated client's account, as the simulator names it: 25–30 characters);
- `keys`: the current schema (`fedprivacy.ledger`), which names it by a small integer key.

Also timed: the whole `Ledger.record_round` of the current ledger (budgets, histories, one PLD
composition for the round's shared history, the write and the commit), at the same checkpoints.

Usage: python benchmarks/ledger_writes.py [--accounts 1000] [--rounds 100] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from fedprivacy.identity import simulated_account
from fedprivacy.ledger import SCHEMA, Budget, Ledger
from fedprivacy.privacy.accountants import NoiseEvent

NAMES_SCHEMA = """
CREATE TABLE spends (id INTEGER PRIMARY KEY AUTOINCREMENT, account TEXT NOT NULL, run_id TEXT NOT NULL,
    server_round INTEGER NOT NULL, sigma REAL NOT NULL, sampling_rate REAL NOT NULL, steps INTEGER NOT NULL,
    epsilon_after REAL NOT NULL, delta REAL NOT NULL, recorded_at TEXT NOT NULL);
CREATE INDEX spends_account ON spends(account);
CREATE INDEX spends_round ON spends(run_id, server_round, account);
"""
COLUMNS = "run_id, server_round, sigma, sampling_rate, steps, epsilon_after, delta, recorded_at"
INSERT = {
    "names": f"INSERT INTO spends (account, {COLUMNS})"
    " SELECT value, ?, ?, ?, ?, ?, ?, ?, ? FROM json_each(?) ORDER BY value",
    "keys": f"INSERT INTO spends (account_key, {COLUMNS})"
    " SELECT value, ?, ?, ?, ?, ?, ?, ?, ? FROM json_each(?) ORDER BY value",
}
EVENT = NoiseEvent(5.0, 0.125, 2)


def account_names(count: int) -> list[str]:
    """Simulated accounts as the simulator names them: a data set's identity and a partition."""
    return [simulated_account("synthetic:0f3a9c41d2b7e865", str(i)) for i in range(count)]


def open_layout(folder: Path, layout: str, accounts: list[str]) -> tuple[sqlite3.Connection, list[object]]:
    """The layout's file and the JSON values its round inserts name the accounts by."""
    db = sqlite3.connect(folder / f"{layout}.sqlite", isolation_level=None)
    db.execute("PRAGMA synchronous=FULL")
    if layout == "names":
        db.executescript(NAMES_SCHEMA)
        return db, list(accounts)
    db.executescript(SCHEMA)
    db.executemany("INSERT INTO account_keys (account) VALUES (?)", [(a,) for a in accounts])
    return db, [row[0] for row in db.execute("SELECT id FROM account_keys ORDER BY id")]


def write_round(db: sqlite3.Connection, layout: str, values: list[object], server_round: int) -> float:
    started = time.perf_counter()
    db.execute("BEGIN IMMEDIATE")
    db.execute(
        INSERT[layout],
        (
            "bench",
            server_round,
            EVENT.sigma,
            EVENT.sampling_rate,
            EVENT.count,
            0.5,
            1e-5,
            "2026-11-24T19:00:00.000000+00:00",
            json.dumps(values),
        ),
    )
    db.execute("SELECT COALESCE(MAX(id), 0) FROM spends").fetchone()
    db.execute("COMMIT")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accounts", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    accounts = account_names(args.accounts)
    checkpoints = sorted({r for r in (10, 20, 50, 100, 200) if r < args.rounds} | {args.rounds})
    times: dict[str, list[float]] = {"names": [], "keys": [], "record_round": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        layouts = {layout: open_layout(folder, layout, accounts) for layout in ("names", "keys")}
        ledger = Ledger(folder / "ledger.sqlite")
        ledger.open_accounts({a: Budget(1e6, 1e-5) for a in accounts})
        for server_round in range(1, args.rounds + 1):
            for layout, (db, values) in layouts.items():
                times[layout].append(write_round(db, layout, values, server_round))
            started = time.perf_counter()
            ledger.record_round("bench", server_round, dict.fromkeys(accounts, (EVENT,)))
            times["record_round"].append(time.perf_counter() - started)
            if server_round % 10 == 0:
                print(f"  round {server_round}/{args.rounds}", flush=True)
        sizes = {layout: (folder / f"{layout}.sqlite").stat().st_size / 1e6 for layout in layouts}
        sizes["record_round"] = (folder / "ledger.sqlite").stat().st_size / 1e6
    rows = []
    print(f"\n{args.accounts} accounts per round; ms per round (median of the 5 rounds up to each checkpoint)")
    print(f"{'round':>6}{'names ms':>10}{'keys ms':>10}{'names / keys':>14}{'record_round ms':>17}")
    for checkpoint in checkpoints:
        window = slice(max(0, checkpoint - 5), checkpoint)
        medians = {name: 1000 * statistics.median(values[window]) for name, values in times.items()}
        rows.append(
            {
                "round": checkpoint,
                **{f"{k}_ms": round(v, 2) for k, v in medians.items()},
                "ratio_names_vs_keys": round(medians["names"] / medians["keys"], 2),
            }
        )
        print(
            f"{checkpoint:>6}{medians['names']:>10.2f}{medians['keys']:>10.2f}"
            f"{medians['names'] / medians['keys']:>14.2f}"
            f"{medians['record_round']:>17.2f}"
        )
    print(
        f"file size after {args.rounds} rounds: names {sizes['names']:.1f} MB, keys {sizes['keys']:.1f} MB "
        f"(the ledger itself, plans and budgets included: {sizes['record_round']:.1f} MB)"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "accounts": args.accounts,
                    "rounds": args.rounds,
                    "rows": rows,
                    "file_mb": {k: round(v, 2) for k, v in sizes.items()},
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
