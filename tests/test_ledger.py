"""The ledger: durable, composes with PLD, never lets an account exceed its budget."""

from __future__ import annotations

import os
import signal
import sqlite3
import stat
import threading
import time

import pytest
from forking import child_exit_code, fork_running
from independent import CERTIFICATE_REL_TOL, pld_epsilon

from fedprivacy.errors import InputError
from fedprivacy.ledger import (
    SCHEMA_VERSION,
    Budget,
    BudgetExceeded,
    BudgetMismatch,
    Ledger,
    PartitioningMismatch,
    RoundRepeated,
    composition,
    noise_schedule,
    round_events,
    writes,
)
from fedprivacy.privacy import accountants
from fedprivacy.privacy.accountants import NoiseEvent
from fedprivacy.privacy.accountants import pld_epsilon as ledger_accounting
from fedprivacy.privacy.plan import Plan

DELTA = 1e-5


def test_records_compose_with_pld_and_survive_reopening(tmp_path):
    path = tmp_path / "ledger.sqlite"
    ledger = Ledger(path)
    assert ledger.epsilon_spent("a") == 0.0
    ledger.open_account("a", 10.0, DELTA)
    first = ledger.record("a", "run1", 1, [NoiseEvent(4.0, 0.1, 10)])
    second = ledger.record("a", "run1", 2, [NoiseEvent(3.0, 0.1, 5)])
    assert 0 < first < second
    expected = pld_epsilon([(4.0, 0.1, 10), (3.0, 0.1, 5)], DELTA)
    assert second == pytest.approx(expected, rel=CERTIFICATE_REL_TOL)

    reopened = Ledger(path)  # a restarted client opens the same file
    assert reopened.steps_spent("a") == 15
    assert reopened.epsilon_spent("a") == pytest.approx(expected, rel=CERTIFICATE_REL_TOL)
    assert reopened.steps_spent("b") == 0  # accounts are separate


def test_a_spend_over_budget_is_refused_and_not_written(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.open_account("a", 5.0, DELTA)
    spent = ledger.record("a", "run1", 1, [NoiseEvent(2.0, 0.2, 20)])
    more = [NoiseEvent(2.0, 0.2, 200)]
    assert ledger.epsilon_if("a", more) > 5.0
    with pytest.raises(BudgetExceeded, match="budget 5"):
        ledger.record("a", "run2", 1, more)
    assert ledger.steps_spent("a") == 20
    assert ledger.epsilon_spent("a") == pytest.approx(spent)


def test_the_budget_is_pinned_on_first_use_and_only_the_operator_changes_it(tmp_path):
    """A server asking for a larger ε or δ gets a refusal; re-evaluating the history at a larger δ
    (which would show a smaller ε and leave room to spend) is impossible."""
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.open_account("a", 1.0, DELTA)
    ledger.record("a", "run1", 1, [NoiseEvent(3.0, 0.05, 100)])
    for epsilon, delta in ((1.0, 1e-2), (2.0, DELTA), (1.0, 1e-6)):
        with pytest.raises(BudgetMismatch, match="pinned at ε=1, δ=1e-05.*fedprivacy ledger set-budget"):
            ledger.open_account("a", epsilon, delta)
    assert ledger.budget("a") == Budget(1.0, DELTA)
    assert ledger.epsilon_spent("a") == pytest.approx(pld_epsilon([(3.0, 0.05, 100)], DELTA), rel=CERTIFICATE_REL_TOL)
    ledger.set_budget("a", 2.0, DELTA)  # the node operator's deliberate act
    assert ledger.open_account("a", 2.0, DELTA) == Budget(2.0, DELTA)
    with pytest.raises(KeyError, match="open_account"):
        ledger.record("never-opened", "run1", 1, [NoiseEvent(1.0, 0.1, 1)])
    with pytest.raises(
        KeyError, match="'never-opened' has no pinned budget"
    ):  # beside an account whose budget is known
        ledger.record_round("run1", 1, {"a": [NoiseEvent(1.0, 0.1, 1)], "never-opened": [NoiseEvent(1.0, 0.1, 1)]})


def test_a_round_is_recorded_at_most_once_per_run(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.open_account("a", 10.0, DELTA)
    ledger.record("a", "run1", 3, [NoiseEvent(2.0, 0.1, 5)])
    assert ledger.trained("a", "run1", 3) and not ledger.trained("a", "run1", 4) and not ledger.trained("a", "run2", 3)
    with pytest.raises(RoundRepeated, match="round 3 of run run1"):
        ledger.record("a", "run1", 3, [NoiseEvent(2.0, 0.1, 5)])
    assert ledger.steps_spent("a") == 5
    ledger.record("a", "run2", 3, [NoiseEvent(2.0, 0.1, 5)])  # another run's round 3 composes
    assert ledger.runs("a") == {"run1", "run2"}


def test_a_data_set_keeps_its_partitioning(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.pin_partitioning("file:abc", {"scheme": "iid", "seed": 0})
    ledger.pin_partitioning("file:abc", {"seed": 0, "scheme": "iid"})  # same, any key order
    ledger.pin_partitioning("file:other", {"scheme": "iid", "seed": 1})
    with pytest.raises(PartitioningMismatch, match="fresh budgets"):
        Ledger(tmp_path / "ledger.sqlite").pin_partitioning("file:abc", {"scheme": "iid", "seed": 1})


def test_ledger_files_are_private_and_versioned(tmp_path):
    path = tmp_path / "ledger.sqlite"
    Ledger(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(InputError, match="newer fedprivacy"):
        Ledger(path)
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"not a database at all" * 100)
    with pytest.raises(InputError, match="not a readable fedprivacy ledger"):
        Ledger(garbage)


def test_concurrent_writers_never_overshoot(tmp_path):
    """Two writers race for a budget that fits only some of their spends."""
    path = tmp_path / "ledger.sqlite"
    step = [NoiseEvent(1.5, 0.2, 10)]
    budget = (
        ledger_accounting([NoiseEvent(1.5, 0.2, 30)], DELTA) + 1e-6
    )  # room for exactly 3 spends (concurrency, not accounting, is under test)
    Ledger(path).open_account("a", budget, DELTA)
    outcomes: list[str] = []
    rounds = iter(range(1, 1000))  # each spend its own round (next() is atomic under the GIL)

    def writer() -> None:
        ledger = Ledger(path)
        for _ in range(3):
            try:
                ledger.record("a", "run", next(rounds), step)
                outcomes.append("ok")
            except BudgetExceeded:
                outcomes.append("refused")

    threads = [threading.Thread(target=writer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert outcomes.count("ok") == 3 and outcomes.count("refused") == 3
    assert Ledger(path).steps_spent("a") == 30


def test_a_writer_sees_what_another_writer_spent_since_its_last_round(tmp_path):
    """A ledger object keeps the histories it has seen between rounds: a spend by another writer
    (another process, a twin) must still count in its next check, and in the steps its round's
    decision reports (what a simulated client's reply says it has done)."""
    path = tmp_path / "ledger.sqlite"
    step = [NoiseEvent(1.5, 0.2, 10)]
    budget = ledger_accounting([NoiseEvent(1.5, 0.2, 20)], DELTA) + 1e-6  # room for exactly 2 spends
    first, second = Ledger(path), Ledger(path)
    first.open_accounts({"a": Budget(budget, DELTA), "b": Budget(budget, DELTA), "c": Budget(5.0, DELTA)})
    assert not any(
        isinstance(o, Exception) for o in first.record_round("run", 1, {"a": step, "b": step, "c": step}).values()
    )
    second.record("a", "other-run", 1, step)  # the other writer spends a's second share
    second.record("c", "other-run", 1, step)
    decisions = []
    outcomes, _ = first.record_round_while("run", 2, {"a": step, "b": step, "c": step}, decisions.append)
    assert isinstance(outcomes["a"], BudgetExceeded)
    assert outcomes["b"] == pytest.approx(pld_epsilon([(1.5, 0.2, 20)], DELTA), rel=CERTIFICATE_REL_TOL)
    assert decisions[0].outcomes == outcomes
    assert decisions[0].steps == {"b": 20, "c": 30}  # only the recorded accounts; c's other spend counted
    assert {name: Ledger(path).steps_spent(name) for name in "abc"} == {"a": 20, "b": 20, "c": 30}
    second.record("c", "other-run", 2, [NoiseEvent(1.5, 0.2, 2)])
    assert first.record_with_steps("c", "run", 3, step)[1] == 42  # the other writer's new 2 steps counted


def test_a_budget_the_operator_changes_counts_in_the_next_round_of_a_running_writer(tmp_path):
    """A ledger object reuses the budgets it read until another connection writes: the operator
    lowering a budget from another process must refuse the writer's next spend."""
    path = tmp_path / "ledger.sqlite"
    step = [NoiseEvent(1.5, 0.2, 10)]
    writer = Ledger(path)
    writer.open_accounts({"a": Budget(5.0, DELTA), "b": Budget(5.0, DELTA)})
    assert not any(isinstance(o, Exception) for o in writer.record_round("run", 1, {"a": step, "b": step}).values())
    Ledger(path).set_budget("a", ledger_accounting(step, DELTA) + 1e-6, DELTA)  # the operator: room for no second spend
    outcomes = writer.record_round("run", 2, {"a": step, "b": step})
    assert isinstance(outcomes["a"], BudgetExceeded)
    assert not isinstance(outcomes["b"], Exception)
    writer.set_budget("b", ledger_accounting(step * 2, DELTA) + 1e-6, DELTA)  # and through the writer itself
    assert isinstance(writer.record_round("run", 3, {"b": step})["b"], BudgetExceeded)


def test_work_done_while_a_round_commits_is_returned_only_with_a_durable_record(tmp_path):
    """The fast engine trains while the round's spends are written and committed: the work sees
    the outcomes, and its result comes back only if the commit succeeded. A reader holding the
    file (a real concurrent read transaction) makes the commit fail: the error is raised, the work's
    result is dropped, and nothing of the round is in the ledger."""

    path = tmp_path / "ledger.sqlite"
    step = [NoiseEvent(1.5, 0.2, 10)]
    writer = Ledger(path, busy_timeout=0.2)
    writer.open_accounts({"a": Budget(5.0, DELTA), "b": Budget(ledger_accounting(step, DELTA) / 2, DELTA)})
    seen = []
    outcomes, result = writer.record_round_while(
        "run", 1, {"a": step, "b": step}, lambda d: seen.append(d) or "trained"
    )
    assert result == "trained" and [d.outcomes for d in seen] == [outcomes] and seen[0].steps == {"a": 10}
    assert isinstance(outcomes["b"], BudgetExceeded) and outcomes["a"] == Ledger(path).epsilon_spent("a")

    reader = sqlite3.connect(path, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT COUNT(*) FROM spends").fetchone()  # holds a shared lock until it ends
    try:
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            writer.record_round_while("run", 2, {"a": step}, lambda decision: "trained")
    finally:
        reader.execute("ROLLBACK")
        reader.close()
    assert Ledger(path).steps_spent("a") == 10
    assert writer.record_round("run", 2, {"a": step})["a"] == pytest.approx(ledger_accounting(step * 2, DELTA))


def test_ctrl_c_while_a_round_commits_waits_for_the_writer(tmp_path, monkeypatch):
    """Ctrl-C while the work is done and the writer still commits: the interrupt is raised only
    once the writer is done with the connection (the round then stands: recorded, never less),
    and the ledger goes on."""
    path = tmp_path / "ledger.sqlite"
    step = [NoiseEvent(1.5, 0.2, 10)]
    writer = Ledger(path)
    writer.open_account("a", 5.0, DELTA)
    committed = threading.Event()
    commit = writes.write_and_commit

    def slow_commit(db, rows):  # injected: a commit that takes a second
        time.sleep(1.0)
        last = commit(db, rows)
        committed.set()
        return last

    monkeypatch.setattr(writes, "write_and_commit", slow_commit)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a suite run in the background ignores SIGINT
    try:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            writer.record_round_while("run", 1, {"a": step}, lambda decision: "trained")
        assert committed.is_set(), "the interrupt went on while the writer still held the connection"
    finally:
        signal.signal(signal.SIGINT, previous)
    monkeypatch.undo()
    assert Ledger(path).steps_spent("a") == 10
    assert writer.record_round("run", 2, {"a": step})["a"] == pytest.approx(ledger_accounting(step * 2, DELTA))


def test_any_account_name_is_recorded_intact(tmp_path):
    """Accounts of many clients are written as one JSON list, which SQLite ends at a NUL: a name
    holding one (a natural partition's id is a data value) must still be charged, not a prefix."""
    path = tmp_path / "ledger.sqlite"
    step = [NoiseEvent(1.5, 0.2, 10)]
    names = ["natural\x00user-7", 'ünïcødé \u2028 "quoted" \\ 🙂', "plain"]
    writer = Ledger(path)
    writer.open_accounts({name: Budget(5.0, DELTA) for name in names})
    writer.record_round("run", 1, dict.fromkeys(names, step))
    writer.record_round_while("run", 2, dict.fromkeys(names, step), lambda decision: None)
    reader = Ledger(path)
    assert {name: reader.steps_spent(name) for name in [*names, "natural"]} == {
        **dict.fromkeys(names, 20),
        "natural": 0,
    }


def test_a_round_that_cannot_start_its_writer_leaves_the_ledger_usable(tmp_path, monkeypatch):
    """If the thread that writes the round cannot start (an injected fault: no thread left), the
    round's transaction is rolled back: nothing is written, and this ledger and others can write."""
    path = tmp_path / "ledger.sqlite"
    step = [NoiseEvent(1.5, 0.2, 10)]
    writer = Ledger(path, busy_timeout=0.5)
    writer.open_accounts({"a": Budget(5.0, DELTA)})

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as patch:
        patch.setattr(threading.Thread, "start", no_thread)
        with pytest.raises(RuntimeError, match="new thread"):
            writer.record_round_while("run", 1, {"a": step}, lambda decision: "trained")
    assert Ledger(path).steps_spent("a") == 0
    Ledger(path, busy_timeout=0.5).record("a", "other", 1, step)
    assert writer.record_round_while("run", 1, {"a": step}, lambda decision: "trained")[1] == "trained"
    assert Ledger(path).steps_spent("a") == 20


def test_a_child_forked_while_another_thread_writes_has_its_own_connection(tmp_path):
    """A process may fork while one of its threads is inside a ledger call (holding the ledger's
    lock: here, training while its round commits); the child must not wait for that thread, which
    it does not have, and must write through a connection of its own. (Forking while a thread is
    inside SQLite itself is unsafe by SQLite's own rules: the fork waits until the write is done.)"""
    import time

    path = tmp_path / "ledger.sqlite"
    step = [NoiseEvent(1.5, 0.2, 10)]
    ledger = Ledger(path)
    ledger.open_accounts({"a": Budget(5.0, DELTA), "b": Budget(5.0, DELTA)})
    inside, release = threading.Event(), threading.Event()

    def slow_work(decision):
        inside.set()
        release.wait(30)

    writer = threading.Thread(target=ledger.record_round_while, args=("run", 1, {"a": step}, slow_work))
    writer.start()
    assert inside.wait(30)
    deadline = time.monotonic() + 30
    while any(t.name == "ledger-write" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    child = fork_running(lambda: ledger.record("b", "child", 1, step) > 0)
    release.set()
    writer.join(30)
    assert child_exit_code(child, "its ledger call") == 0
    assert (Ledger(path).steps_spent("a"), Ledger(path).steps_spent("b")) == (10, 10)


def test_round_events_follow_the_plan_slices():
    plan = Plan(
        client_id="c",
        rule="adp",
        n=100,
        epsilon=1.0,
        delta=DELTA,
        clip_norm=1.0,
        sigma=3.0,
        sampling_rate=0.1,
        steps=10,
        rounds=3,
        noise_segments=((3.0, 5), (2.0, 5)),
        epsilon_pld=0.9,
        epsilon_rdp=1.0,
    )
    # rounds of 4, 3, 3 steps; the σ change at step 5 falls inside round 2
    assert round_events(plan, 1) == (NoiseEvent(3.0, 0.1, 4),)
    assert round_events(plan, 2) == (
        NoiseEvent(3.0, 0.1, 1),
        NoiseEvent(2.0, 0.1, 2),
    )
    assert round_events(plan, 3) == (NoiseEvent(2.0, 0.1, 3),)
    assert round_events(plan, 4) == ()


def test_plans_with_equal_noise_schedules_share_one_schedule_object():
    """A simulator keys a round's events by the schedule's identity: clients whose plans differ
    only in who they are share it, and any difference `round_events` reads gives another."""

    def plan(client_id: str, **changes: object) -> Plan:
        fields = dict(
            client_id=client_id,
            rule="adp",
            n=100,
            epsilon=1.0,
            delta=DELTA,
            clip_norm=1.0,
            sigma=3.0,
            sampling_rate=0.1,
            steps=10,
            rounds=3,
            noise_segments=((3.0, 5), (2.0, 5)),
            epsilon_pld=0.9,
            epsilon_rdp=1.0,
        )
        return Plan(**{**fields, **changes})

    shared = noise_schedule(plan("a"))
    assert noise_schedule(plan("b", n=500, epsilon=2.0)) is shared
    assert round_events(plan("b", n=500, epsilon=2.0), 2) == round_events(plan("a"), 2)
    for change in (
        {"sampling_rate": 0.2},
        {"steps": 9},
        {"rounds": 2},
        {"noise_segments": ((3.0, 5), (2.5, 5))},
    ):
        other = noise_schedule(plan("c", **change))
        assert other is not shared and other != shared, change


def _plan(epsilon: float, segments: tuple[tuple[float, int], ...], rounds: int) -> Plan:
    steps = sum(count for _, count in segments)
    return Plan(
        client_id="c",
        rule="adp",
        n=100,
        epsilon=epsilon,
        delta=DELTA,
        clip_norm=1.0,
        sigma=segments[0][0],
        sampling_rate=0.1,
        steps=steps,
        rounds=rounds,
        noise_segments=segments,
        epsilon_pld=0.5,
        epsilon_rdp=0.6,
    )


def _play_rounds(ledger: Ledger, plans: dict[str, Plan], rounds: int) -> list[tuple[dict[str, object], dict[str, int]]]:
    """Every account asks for its plan's slice in every round, as a simulation's clients do,
    until its budget refuses one; each round's (outcomes, steps)."""
    played, refused = [], set()
    for server_round in range(1, rounds + 1):
        spends = {a: round_events(p, server_round) for a, p in plans.items() if a not in refused}
        decisions = []
        outcomes, _ = ledger.record_round_while("run", server_round, spends, decisions.append)
        refused |= {a for a, o in outcomes.items() if isinstance(o, BudgetExceeded)}
        played.append(
            (
                {a: o if isinstance(o, float) else type(o).__name__ for a, o in outcomes.items()},
                decisions[0].steps,
            )
        )
    return played


def _ahead_accounts(ledger: Ledger) -> dict[str, Plan]:
    """Two accounts sharing a plan and budget, the same plan under a budget pinned at another δ
    (the ledger's δ counts, not the plan's), a budget that runs out in round 3, an ADP plan whose
    σ changes inside a round, and an account that spent before."""
    constant, adp = _plan(3.0, ((2.0, 40),), 5), _plan(3.0, ((2.5, 18), (2.0, 22)), 5)
    ledger.open_accounts(
        {
            "a": Budget(3.0, DELTA),
            "b": Budget(3.0, DELTA),
            "c": Budget(3.0, 1e-7),
            "d": Budget(1.1, DELTA),
            "e": Budget(3.0, DELTA),
            "f": Budget(3.0, DELTA),
        }
    )
    ledger.record("f", "earlier-run", 1, [NoiseEvent(1.5, 0.2, 7)])
    return {"a": constant, "b": constant, "c": constant, "d": constant, "e": adp, "f": constant}


def test_rounds_composed_ahead_decide_exactly_as_rounds_composed_when_asked(tmp_path, monkeypatch):
    """`compose_ahead` moves the rounds' compositions before them and changes no decision: the
    same outcomes, ε (to the bit) and steps as a ledger that composes when each round asks; and
    the rounds it prepared compose nothing."""
    accountants.clear_caches()
    plain = Ledger(tmp_path / "plain.sqlite")
    expected = _play_rounds(plain, _ahead_accounts(plain), 6)  # round 6: past the plans, nobody spends
    assert expected[2][0]["d"] == "BudgetExceeded" and isinstance(expected[1][0]["d"], float)

    accountants.clear_caches()
    ahead = Ledger(tmp_path / "ahead.sqlite")
    plans = _ahead_accounts(ahead)
    # folds: a with b, c, d (refused in round 3: three rounds), e, f; five rounds each but d's
    assert ahead.compose_ahead(plans, first_round=1) == 5 * 4 + 3
    composed = []
    monkeypatch.setattr(composition, "composed_epsilon", lambda *args: composed.append(args) or pytest.fail("composed"))
    assert _play_rounds(ahead, plans, 6) == expected
    assert composed == []


def test_composing_ahead_stops_before_the_shared_histories_would_be_forgotten(tmp_path, monkeypatch):
    """The folds stop at half the shared histories' limit (past it they would all be dropped,
    and the work with them); the rounds compose the rest themselves, to the same decisions."""
    plain = Ledger(tmp_path / "plain.sqlite")
    expected = _play_rounds(plain, _ahead_accounts(plain), 5)
    monkeypatch.setattr(composition.SharedHistories, "LIMIT", 40)
    ahead = Ledger(tmp_path / "ahead.sqlite")
    plans = _ahead_accounts(ahead)
    computed = ahead.compose_ahead(plans, first_round=1)
    assert 0 < computed < 5 * 4 + 3 and ahead._shared.size() <= 20
    assert _play_rounds(ahead, plans, 5) == expected


def test_plans_are_kept_per_account_and_run(tmp_path):
    ledger = Ledger(tmp_path / "l.sqlite")
    plan = Plan(
        client_id="c",
        rule="proactive",
        n=100,
        epsilon=1.0,
        delta=DELTA,
        clip_norm=1.0,
        sigma=3.0,
        sampling_rate=0.1,
        steps=10,
        rounds=2,
        noise_segments=((3.0, 10),),
        epsilon_pld=0.5,
        epsilon_rdp=0.6,
    )
    ledger.save_plan("a", "run1", plan)
    assert Ledger(tmp_path / "l.sqlite").load_plan("a", "run1") == plan
    assert ledger.load_plan("a", "run2") is None


def test_a_round_of_many_accounts_is_one_call_with_an_outcome_each(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    opened = ledger.open_accounts({"a": Budget(1.0, DELTA), "b": Budget(0.1, DELTA), "c": Budget(1.0, DELTA)})
    assert opened == {"a": Budget(1.0, DELTA), "b": Budget(0.1, DELTA), "c": Budget(1.0, DELTA)}
    ledger.record("c", "run1", 1, [NoiseEvent(3.0, 0.05, 10)])
    step = [NoiseEvent(3.0, 0.05, 10)]
    outcomes = ledger.record_round("run1", 1, {"a": step, "b": [NoiseEvent(1.0, 0.5, 100)], "c": step})
    assert outcomes["a"] == pytest.approx(pld_epsilon([(3.0, 0.05, 10)], DELTA), rel=CERTIFICATE_REL_TOL)
    assert isinstance(outcomes["b"], BudgetExceeded) and isinstance(outcomes["c"], RoundRepeated)
    assert (ledger.steps_spent("a"), ledger.steps_spent("b"), ledger.steps_spent("c")) == (10, 0, 10)
    mismatch = ledger.open_accounts({"a": Budget(2.0, DELTA), "d": Budget(1.0, DELTA)})
    assert isinstance(mismatch["a"], BudgetMismatch) and mismatch["d"] == Budget(1.0, DELTA)


# The layout of ledger schema 2, which named the account in every spend (written by earlier
# releases; a ledger holds budgets for years, so every later release must read it).
_SCHEMA_2 = """
CREATE TABLE spends (id INTEGER PRIMARY KEY AUTOINCREMENT, account TEXT NOT NULL, run_id TEXT NOT NULL,
    server_round INTEGER NOT NULL, sigma REAL NOT NULL, sampling_rate REAL NOT NULL, steps INTEGER NOT NULL,
    epsilon_after REAL NOT NULL, delta REAL NOT NULL, recorded_at TEXT NOT NULL);
CREATE INDEX spends_account ON spends(account);
CREATE INDEX spends_round ON spends(run_id, server_round, account);
CREATE TABLE plans (account TEXT NOT NULL, run_id TEXT NOT NULL, plan_json TEXT NOT NULL,
    PRIMARY KEY (account, run_id));
CREATE TABLE accounts (account TEXT PRIMARY KEY, epsilon REAL NOT NULL, delta REAL NOT NULL, pinned_at TEXT NOT NULL,
    changed_at TEXT);
CREATE TABLE partitionings (dataset TEXT PRIMARY KEY, partitioning TEXT NOT NULL, pinned_at TEXT NOT NULL);
PRAGMA user_version = 2;
"""


def test_a_ledger_of_the_earlier_layout_keeps_every_spend_and_budget(tmp_path):
    """Opening a schema-2 file moves it to account keys in place: the same histories, budgets, runs
    and spend ids, and new spends continue after every id the file ever gave. An account spent
    from before budgets were pinned (schema 0) keeps its spends too."""
    path = tmp_path / "ledger.sqlite"
    old = sqlite3.connect(path)
    old.executescript(_SCHEMA_2)
    rows = [
        (3, "a", "r1", 1, 2.0, 0.1, 5),
        (4, "b\x00x", "r1", 1, 2.0, 0.1, 5),
        (9, "a", "r2", 1, 1.5, 0.1, 7),
        (12, "unpinned", "r0", 1, 3.0, 0.2, 4),
    ]
    old.executemany(
        "INSERT INTO spends (id, account, run_id, server_round, sigma, sampling_rate, steps, epsilon_after, delta, "
        "recorded_at) VALUES (?, ?, ?, ?, ?, ?, ?, 0.5, 1e-5, '2026-01-01')",
        rows,
    )
    old.executemany(
        "INSERT INTO accounts VALUES (?, 5.0, 1e-5, '2026-01-01', NULL)",
        [("a",), ("b\x00x",), ("never-spent",)],
    )
    old.execute("UPDATE sqlite_sequence SET seq = 20 WHERE name = 'spends'")  # ids up to 20 were given once
    old.commit()
    old.close()

    ledger = Ledger(path)
    assert ledger.events("a") == [NoiseEvent(2.0, 0.1, 5), NoiseEvent(1.5, 0.1, 7)]
    assert ledger.events("b\x00x") == [NoiseEvent(2.0, 0.1, 5)] and ledger.events("unpinned") == [
        NoiseEvent(3.0, 0.2, 4)
    ]
    assert ledger.runs("a") == {"r1", "r2"} and ledger.budget("a") == Budget(5.0, DELTA)
    assert ledger.epsilon_spent("a") == pytest.approx(
        pld_epsilon([(2.0, 0.1, 5), (1.5, 0.1, 7)], DELTA), rel=CERTIFICATE_REL_TOL
    )
    assert {s.account: s.steps for s in ledger.accounts()} == {"a": 12, "b\x00x": 5, "never-spent": 0}
    ledger.record_round("r3", 1, {"a": [NoiseEvent(2.0, 0.1, 1)], "never-spent": [NoiseEvent(2.0, 0.1, 1)]})
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert [r[0] for r in db.execute("SELECT id FROM spends ORDER BY id")] == [
            3,
            4,
            9,
            12,
            21,
            22,
        ]  # ids only grow
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert Ledger(path).steps_spent("a") == 13 and Ledger(path).steps_spent("never-spent") == 1


def test_a_round_rolled_back_gives_its_new_accounts_keys_again(tmp_path):
    """A new account gets its key in the round's transaction; if that round fails, a later account
    may get the same key, so the writer must not keep the first one's (its spends would be charged
    to the other account)."""
    path = tmp_path / "ledger.sqlite"
    step = [NoiseEvent(1.5, 0.2, 10)]
    writer = Ledger(path, busy_timeout=0.2)
    writer.open_accounts({name: Budget(5.0, DELTA) for name in ("first", "second")})
    reader = sqlite3.connect(path, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT COUNT(*) FROM spends").fetchone()  # the commit cannot take the file
    try:
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            writer.record_round("run", 1, {"first": step})
    finally:
        reader.execute("ROLLBACK")
        reader.close()
    writer.record_round("run", 1, {"second": step})  # a new account may take the freed key
    writer.record_round("run", 1, {"first": step})
    assert (Ledger(path).steps_spent("first"), Ledger(path).steps_spent("second")) == (10, 10)


def test_a_current_ledger_opens_while_another_writer_holds_it(tmp_path):
    """Opening a ledger of the current layout writes nothing, so an operator's `ledger show` or a
    ClientApp's next message does not wait for (or time out on) another process's transaction."""
    path = tmp_path / "ledger.sqlite"
    Ledger(path).open_accounts({"a": Budget(5.0, DELTA)})
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another writer's transaction, under way
    try:
        assert Ledger(path, busy_timeout=0.1).budget("a") == Budget(5.0, DELTA)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
