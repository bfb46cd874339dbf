"""The ledger: durable, composes with PLD, never lets an account exceed its budget."""

from __future__ import annotations

import threading

import pytest

from fedprivacy.ledger import BudgetExceeded, Ledger, round_events
from fedprivacy.privacy.accountants import NoiseEvent, pld_epsilon as ledger_accounting
from fedprivacy.privacy.plan import Plan
from independent import CERTIFICATE_REL_TOL, pld_epsilon

DELTA = 1e-5


def test_records_compose_with_pld_and_survive_reopening(tmp_path):
    path = tmp_path / "ledger.sqlite"
    ledger = Ledger(path)
    assert ledger.epsilon_spent("a", DELTA) == 0.0
    first = ledger.record("a", "run1", 1, [NoiseEvent(4.0, 0.1, 10)], delta=DELTA, budget=10.0)
    second = ledger.record("a", "run1", 2, [NoiseEvent(3.0, 0.1, 5)], delta=DELTA, budget=10.0)
    assert 0 < first < second
    expected = pld_epsilon([(4.0, 0.1, 10), (3.0, 0.1, 5)], DELTA)
    assert second == pytest.approx(expected, rel=CERTIFICATE_REL_TOL)

    reopened = Ledger(path)  # a restarted client opens the same file
    assert reopened.steps_spent("a") == 15
    assert reopened.epsilon_spent("a", DELTA) == pytest.approx(expected, rel=CERTIFICATE_REL_TOL)
    assert reopened.steps_spent("b") == 0  # accounts are separate


def test_a_spend_over_budget_is_refused_and_not_written(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    spent = ledger.record("a", "run1", 1, [NoiseEvent(2.0, 0.2, 20)], delta=DELTA, budget=5.0)
    more = [NoiseEvent(2.0, 0.2, 200)]
    assert ledger.epsilon_if("a", more, DELTA) > 5.0
    with pytest.raises(BudgetExceeded, match="budget 5"):
        ledger.record("a", "run2", 1, more, delta=DELTA, budget=5.0)
    assert ledger.steps_spent("a") == 20
    assert ledger.epsilon_spent("a", DELTA) == pytest.approx(spent)


def test_concurrent_writers_never_overshoot(tmp_path):
    """Two writers race for a budget that fits only some of their spends."""
    path = tmp_path / "ledger.sqlite"
    Ledger(path)
    step = [NoiseEvent(1.5, 0.2, 10)]
    budget = ledger_accounting([NoiseEvent(1.5, 0.2, 30)], DELTA) + 1e-6  # room for exactly 3 spends (concurrency, not accounting, is under test)
    outcomes: list[str] = []

    def writer() -> None:
        ledger = Ledger(path)
        for _ in range(3):
            try:
                ledger.record("a", "run", 1, step, delta=DELTA, budget=budget)
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


def test_round_events_follow_the_plan_slices():
    plan = Plan(
        client_id="c", rule="adp", n=100, epsilon=1.0, delta=DELTA, clip_norm=1.0, sigma=3.0,
        sampling_rate=0.1, steps=10, rounds=3, noise_segments=((3.0, 5), (2.0, 5)),
        epsilon_pld=0.9, epsilon_rdp=1.0,
    )
    # rounds of 4, 3, 3 steps; the σ change at step 5 falls inside round 2
    assert round_events(plan, 1) == [NoiseEvent(3.0, 0.1, 4)]
    assert round_events(plan, 2) == [NoiseEvent(3.0, 0.1, 1), NoiseEvent(2.0, 0.1, 2)]
    assert round_events(plan, 3) == [NoiseEvent(2.0, 0.1, 3)]
    assert round_events(plan, 4) == []


def test_plans_are_kept_per_account_and_run(tmp_path):
    ledger = Ledger(tmp_path / "l.sqlite")
    plan = Plan(
        client_id="c", rule="proactive", n=100, epsilon=1.0, delta=DELTA, clip_norm=1.0, sigma=3.0,
        sampling_rate=0.1, steps=10, rounds=2, noise_segments=((3.0, 10),), epsilon_pld=0.5,
        epsilon_rdp=0.6,
    )
    ledger.save_plan("a", "run1", plan)
    assert Ledger(tmp_path / "l.sqlite").load_plan("a", "run1") == plan
    assert ledger.load_plan("a", "run2") is None
