"""The round's participation rules (`fedprivacy.participation`), and that both engines follow them.

The class is driven directly (eligibility after a spent budget, after dropped rounds and their
recovery, min-clients, the seeded fractions, who evaluates); then the same run, with a client that
fails every round and clients whose budgets run out, goes once through the ServerApp's strategy
(the real apps on a recording grid) and once through the fast engine: both must ask the same
clients to train and to evaluate, round by round, through the shared class.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from clients.app import app as client_app
from fedprivacy import identity
from fedprivacy.participation import MAX_CONSECUTIVE_FAILURES, Participation, sample_clients
from fedprivacy.results import RunRecorder
from server.app import app as server_app
from sims.fast import engine as fast_engine
from sims.fast.engine import run_fast

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # seeded noise on purpose


def participation(tmp_path: Path, **options: Any) -> Participation:
    return Participation(
        RunRecorder(tmp_path),
        seed=options.pop("seed", 0),
        fraction_train=options.pop("fraction_train", 1.0),
        fraction_evaluate=options.pop("fraction_evaluate", 1.0),
        **options,
    )


def reply(exhausted: bool = False) -> dict[str, float]:
    """A train reply's public metrics, as the ClientApp sends them."""
    return {
        "num-examples": 0 if exhausted else 10,
        "epsilon-budget": 1.0,
        "epsilon-spent": 1.0 if exhausted else 0.5,
        "delta": 1e-5,
        "sigma": 1.0,
        "steps-planned": 6,
        "steps-done": 6 if exhausted else 3,
        "budget-exhausted": int(exhausted),
        "on-gpu": 0,
    }


def test_a_client_out_of_budget_is_not_asked_to_train_again_but_still_evaluates(tmp_path):
    rules = participation(tmp_path)
    clients = [0, 1, 2]
    assert rules.trainers(1, clients) == clients
    rules.replied(1, 0, "a", reply(), None)
    rules.replied(1, 1, "b", reply(exhausted=True), None)
    assert rules.eligible(clients) == [0, 2]
    assert rules.evaluators(clients) == clients  # its test rows still measure the model
    assert rules.trainers(2, clients) == [0, 2]
    assert rules.recorder.clients["b"].exhausted_round == 1 and rules.recorder.clients["a"].exhausted_round is None


def test_dropped_rounds_in_a_row_exclude_a_client_and_a_good_reply_starts_the_count_again(tmp_path):
    assert MAX_CONSECUTIVE_FAILURES == 3  # docs/flower.md and docs/deployment.md say three rounds in a row
    rules = participation(tmp_path)
    clients = [0, 1]
    for server_round, outcome in ((1, "error"), (2, "invalid"), (3, None), (4, "error"), (5, "error")):
        assert rules.trainers(server_round, clients) == clients
        if outcome is None:  # a reply that passes the checks, between two pairs of drops
            rules.replied(server_round, 1, "b", reply(), None)
        else:
            rules.dropped(server_round, 1, "b", outcome, "injected")
    assert rules.eligible(clients) == clients and rules.recorder.clients["b"].excluded_round is None
    assert rules.trainers(6, clients) == clients
    rules.dropped(6, 1, "b", "invalid", "injected")  # the third in a row
    assert rules.eligible(clients) == [0]
    assert rules.trainers(7, clients) == [0] and 1 not in rules.evaluators(clients)
    record = rules.recorder.clients["b"]
    assert (record.excluded_round, record.rounds_dropped, record.status) == (6, 5, "failed: injected")


def test_a_client_that_gave_no_reply_is_excluded_at_once(tmp_path, caplog):
    rules = participation(tmp_path, logger=logging.getLogger("server.test"))
    rules.trainers(1, [0, 1])
    with caplog.at_level(logging.WARNING, logger="server.test"):
        rules.dropped(1, 1, "node-102", "no reply", "no reply within the round timeout")
    assert rules.eligible([0, 1]) == [0] and rules.recorder.clients["node-102"].excluded_round == 1
    assert caplog.messages == [
        "round 1: reply of client node-102 dropped (no reply): no reply within the round timeout; "
        "not sampled again in this run"
    ]


def test_without_a_logger_outcomes_are_recorded_and_nothing_is_logged(tmp_path, caplog):
    """The fast engine reports through the results folder alone."""
    rules = participation(tmp_path)
    with caplog.at_level(logging.DEBUG):
        rules.trainers(1, [])  # nobody can train: the strategy would warn
        rules.dropped(1, 0, "a", "error", "injected")
        rules.replied(2, 1, "b", reply(exhausted=True), None)
    assert caplog.records == []
    assert [r["outcome"] for r in rules.recorder.replies] == ["error", "exhausted"]


def test_a_dropped_client_sits_out_only_that_rounds_evaluation(tmp_path):
    rules = participation(tmp_path)
    clients = [0, 1, 2]
    rules.trainers(1, clients)
    rules.dropped(1, 2, "c", "error", "injected")
    assert rules.evaluators(clients) == [0, 1]
    rules.trainers(2, clients)
    assert rules.evaluators(clients) == clients


def test_a_client_that_releases_no_evaluation_still_trains_and_is_not_asked_to_evaluate_again(tmp_path):
    rules = participation(tmp_path)
    clients = [101, 102]
    rules.trainers(1, clients)
    rules.releases_no_evaluation(102)
    for server_round in (2, 3):
        assert rules.trainers(server_round, clients) == clients
        assert rules.evaluators(clients) == [101]


def test_a_round_waits_for_min_clients(tmp_path):
    rules = participation(tmp_path, min_clients=3)
    assert not rules.enough([101, 102]) and rules.enough([101, 102, 103]) and rules.enough(range(4))
    assert participation(tmp_path).enough([101])  # one client is enough by default


@pytest.mark.parametrize(
    ("fraction", "eligible", "asked"),
    [(0.5, 10, 5), (0.75, 4, 3), (0.3, 7, 2), (0.1, 4, 1), (1.0, 6, 6), (0.0, 6, 0), (0.5, 0, 0)],
)
def test_a_round_asks_the_floor_of_its_fraction_at_least_one_sorted(fraction, eligible, asked):
    """⌊fraction·eligible⌋ clients, at least one while any is eligible and the fraction is not 0."""
    import random

    clients = list(range(100, 100 + 2 * eligible, 2))
    chosen = sample_clients(random.Random(3), clients, fraction)
    assert len(chosen) == asked and chosen == sorted(set(chosen)) and set(chosen) <= set(clients)


def test_one_seeded_stream_draws_train_then_evaluation_samples(tmp_path):
    """The same seed asks the same clients in every round; the evaluation sample is drawn from the
    same stream between two train samples (so an engine that skipped it would fall out of step)."""
    clients = list(range(20))

    def rounds(seed: int, evaluate: bool) -> list[list[int]]:
        rules = participation(tmp_path, seed=seed, fraction_train=0.5, fraction_evaluate=0.25)
        picks = []
        for server_round in (1, 2, 3):
            picks.append(rules.trainers(server_round, clients))
            if evaluate:
                picks.append(rules.evaluators(clients))
        return picks

    first = rounds(1, evaluate=True)
    assert first == rounds(1, evaluate=True) and first != rounds(2, evaluate=True)
    assert [len(p) for p in first] == [10, 5] * 3
    assert first[::2] != rounds(1, evaluate=False)


# --- both engines through the shared class ------------------------------------------------------


def failing_client(real, failing: int):
    """`simulation_client` whose partition `failing` cannot read its data (an injected fault)."""

    def load(settings, partition_id, num_partitions, ledger_path):
        if partition_id == failing:
            raise OSError("injected: the data disk is gone")
        return real(settings, partition_id, num_partitions, ledger_path)

    return load


def recording(monkeypatch) -> dict[str, list[list[int]]]:
    """Every answer of the shared class's `trainers` and `evaluators`, in order."""
    seen: dict[str, list[list[int]]] = {"trainers": [], "evaluators": []}
    for name in seen:
        real = getattr(Participation, name)

        def spy(self, *args, _real=real, _name=name):
            chosen = _real(self, *args)
            seen[_name].append(list(chosen))
            return chosen

        monkeypatch.setattr(Participation, name, spy)
    return seen


def test_the_strategy_and_the_fast_engine_ask_the_same_clients_through_the_shared_rules(
    in_process, tmp_path, monkeypatch
):
    """A second run on a ledger its first run spent unevenly (half the clients asked per round, so
    budgets run out at different rounds of the second), a client that fails every round it is asked
    (excluded after its third), seeded fractions for training and evaluation: the apps on a
    recording grid and the fast engine ask the same clients, both through `Participation`, and
    write the same participation records."""
    clients, failing = 4, 3
    first = tmp_path / "first.sqlite"
    # calibrated: each run's plan spends the whole budget; a fixed noise seed is refused on a spent ledger
    base = {**in_process.defaults(), "rule": "calibrated", "noise-seed": -1}
    run_fast(
        {**base, "fraction-train": 0.5, "ledger-path": str(first), "results-dir": str(tmp_path / "r1")},
        clients,
        say=lambda _: None,
    )
    second = {**base, "num-server-rounds": 6, "fraction-train": 0.75, "fraction-evaluate": 0.5}

    def ledger_copy(name: str) -> str:
        path = tmp_path / name
        with sqlite3.connect(first) as source, sqlite3.connect(path) as copy:
            source.backup(copy)
        return str(path)

    apps_seen = recording(monkeypatch)
    monkeypatch.setattr("clients.app.simulation_client", failing_client(identity.simulation_client, failing))
    apps_config = {**second, "ledger-path": ledger_copy("apps.sqlite"), "results-dir": str(tmp_path / "apps")}
    grid = in_process.Grid.simulation(client_app, clients, apps_config, run_id=2)
    in_process.run_server(server_app, grid, apps_config)
    monkeypatch.undo()

    fast_seen = recording(monkeypatch)
    monkeypatch.setattr(fast_engine, "simulation_client", failing_client(identity.simulation_client, failing))
    fast_config = {**second, "ledger-path": ledger_copy("fast.sqlite"), "results-dir": str(tmp_path / "fast")}
    run_fast(fast_config, clients, run_id=2, say=lambda _: None)
    monkeypatch.undo()

    nodes = sorted(grid.contexts)  # node i + 101 is partition i
    as_indices = {kind: [[nodes.index(n) for n in pick] for pick in picks] for kind, picks in apps_seen.items()}
    assert len(fast_seen["trainers"]) == len(fast_seen["evaluators"]) == 6
    assert as_indices == fast_seen
    for kind, picks in (("train", "trainers"), ("evaluate", "evaluators")):  # the grid delivered those picks
        assert [nodes.index(n) for n, k in grid.calls if k == kind] == sum(fast_seen[picks], [])

    ((apps_folder,), (fast_folder,)) = ((tmp_path / "apps").iterdir(), (tmp_path / "fast").iterdir())
    columns = ["rounds_trained", "rounds_dropped", "exhausted_round", "excluded_round", "status"]
    apps_clients = pd.read_csv(apps_folder / "clients.csv")[columns]  # the failing client is "node-104" there
    pd.testing.assert_frame_equal(apps_clients, pd.read_csv(fast_folder / "clients.csv")[columns])
    counts = ["clients_sampled", "clients_trained", "clients_dropped", "clients_exhausted", "clients_failed"]
    rounds = pd.read_csv(fast_folder / "rounds.csv")
    pd.testing.assert_frame_equal(pd.read_csv(apps_folder / "rounds.csv")[counts], rounds[counts])

    # the run exercised the rules: budgets ran out and the failing client was excluded before the
    # last round, and neither was asked to train after
    stopped = pd.read_csv(fast_folder / "clients.csv").set_index("client_id")
    gone = stopped.exhausted_round.fillna(stopped.excluded_round).dropna().astype(int)
    assert stopped.exhausted_round.notna().sum() >= 2 and stopped.excluded_round.notna().sum() == 1
    assert stopped.rounds_dropped[failing] == MAX_CONSECUTIVE_FAILURES and gone.max() < 6
    for client, last in gone.items():
        assert all(client not in pick for pick in fast_seen["trainers"][last:])
