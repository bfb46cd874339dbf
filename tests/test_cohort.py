"""The cohort round (`fedprivacy.cohort`) that the ClientApp runs with one client and the fast
engine with many: who trains, what is recorded before anything is returned, and every reply, in
both orders (train then record; record while training), on a real ledger file."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedprivacy.cohort import Member, TrainedRows, cohort_round
from fedprivacy.data.types import ClientData, Dataset
from fedprivacy.identity import LocalClient
from fedprivacy.ledger import BudgetExceeded, Ledger, RoundRepeated, composed_epsilon, round_events
from fedprivacy.privacy.plan import Plan
from fedprivacy.protocol import PUBLIC_REPLY_KEYS

DELTA = 1e-5


def _member(name: str, rows: int, epsilon: float, ledger: Path, sigma: float = 1.2) -> Member:
    features, labels = np.zeros((rows, 2), np.float32), np.zeros(rows, np.int64)
    data = ClientData(
        name, Dataset(features, labels, ("a", "b"), 2, "t"), Dataset(features[:1], labels[:1], ("a", "b"), 2, "t")
    )
    local = LocalClient(name, f"acct/{name}", data, epsilon, DELTA, None, ledger)
    plan = Plan(
        client_id=name,
        rule="calibrated",
        n=rows,
        epsilon=epsilon,
        delta=DELTA,
        clip_norm=1.0,
        sigma=sigma,
        sampling_rate=0.1,
        steps=4,
        rounds=2,
        noise_segments=((sigma, 4),),
        epsilon_pld=epsilon,
        epsilon_rdp=epsilon,
    )
    return Member(local, plan)


@dataclass
class _Training:
    """A stand-in for the trainer or the workers: records whom it trained, returns their states."""

    seen: list[list[str]] = field(default_factory=list)

    def __call__(self, ready: list[Member]) -> Any:
        self.seen.append([m.account for m in ready])
        return TrainedRows([], [{"step": len(self.seen)} for _ in ready], [{"train-loss": 0.5} for _ in ready])


@pytest.mark.parametrize("while_recording", [False, True])
def test_a_cohort_trains_what_the_ledger_affords_and_replies_for_every_member(tmp_path, while_recording):
    """Three members: one whose budget affords both rounds, one that affords none (σ small for its
    ε), one whose round was already recorded. Only the first trains; its reply states the ε and
    steps the ledger holds (checked against the ledger's own composition); the second replies out
    of budget with weight zero; the third is refused with RoundRepeated; nothing else is spent."""
    path = tmp_path / "ledger.sqlite"
    rich, poor, repeated = (
        _member("rich", 500, 8.0, path),
        _member("poor", 500, 0.01, path, sigma=0.6),
        _member("again", 500, 8.0, path),
    )
    training = _Training()
    with Ledger(path) as ledger:
        for m in (rich, poor, repeated):
            ledger.open_account(m.account, m.local.epsilon, DELTA)
        ledger.record(repeated.account, "run", 1, round_events(repeated.plan, 1))
        outcome = cohort_round(
            [rich, poor, repeated], ledger, "run", 1, training, while_recording=while_recording, diagnostics=True
        )
        assert training.seen == [[rich.account]]
        assert [m.account for m, _ in outcome.trained] == [rich.account]
        assert set(outcome.refused) == {repeated.account} and isinstance(
            outcome.refused[repeated.account], RoundRepeated
        )
        reply = outcome.replies[rich.account]
        assert set(reply) == set(PUBLIC_REPLY_KEYS) | {"train-loss"}
        assert reply["epsilon-spent"] == pytest.approx(composed_epsilon(ledger.events(rich.account), DELTA))
        assert reply["steps-done"] == 2 == ledger.steps_spent(rich.account)
        assert (reply["num-examples"], reply["budget-exhausted"]) == (500, 0)
        assert rich.trainer_state == {"step": 1}
        assert (
            outcome.replies[poor.account]["budget-exhausted"] == 1
            and outcome.replies[poor.account]["num-examples"] == 0
        )
        assert ledger.steps_spent(poor.account) == 0 and ledger.steps_spent(repeated.account) == 2
        with pytest.raises(BudgetExceeded):
            ledger.record(poor.account, "run", 2, round_events(poor.plan, 2))


def test_a_spend_refused_after_training_drops_the_update(tmp_path):
    """Train then record (the ClientApp's order): another writer spends the budget while the member
    trains, so its spend is refused; its update does not leave (not in `trained`), it replies out
    of budget, and its trainer state is not moved on."""
    path = tmp_path / "ledger.sqlite"
    member = _member("c", 500, 1.0, path, sigma=2.0)
    events = round_events(member.plan, 1)
    with Ledger(path) as ledger:
        ledger.open_account(member.account, 1.0, DELTA)

        def train_while_another_spends(ready: list[Member]) -> TrainedRows:
            with Ledger(path) as other:  # a second writer on the same file
                while True:
                    try:
                        other.record(member.account, f"other-{len(other.events(member.account))}", 1, events)
                    except BudgetExceeded:
                        break
            return TrainedRows([], [{"step": 9}], [{}])

        outcome = cohort_round([member], ledger, "run", 1, train_while_another_spends, while_recording=False)
    assert outcome.trained == [] and member.trainer_state is None
    assert outcome.replies[member.account]["budget-exhausted"] == 1
