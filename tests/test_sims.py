"""sims/: the scenario runner drives the real apps in process; the baseline and the validation file."""

from __future__ import annotations

import os

import pandas as pd
import pytest
from harness import PUMS_SAMPLE

from fedprivacy.errors import InputError
from sims.baseline import nonprivate_baseline
from sims.runner import Scenario, read_results, run_scenario
from sims.validation import training_rows_file

TINY = {"num-server-rounds": 2, "noise-seed": 3, "epochs": 2.0}  # digits, 2 clients: a few seconds


def test_a_scenario_runs_the_apps_and_reads_their_results(tmp_path):
    scenario = Scenario("tiny ε=1", {**TINY, "rule": "calibrated"}, num_clients=2)
    result = run_scenario(scenario, tmp_path, quiet=True)

    assert result.folder is not None and result.folder.parent == tmp_path / "tiny ε=1"
    for name in ("summary.json", "rounds.csv", "clients.csv"):
        assert (result.folder / name).is_file()
    assert [r["round"] for r in result.rounds] == [1, 2] and len(result.clients) == 2
    result.check_budgets()
    assert all(0 < c["epsilon_spent"] <= c["epsilon_budget"] == 1.0 for c in result.clients)
    assert read_results(result.folder).rounds == result.rounds
    assert 0.0 <= result.final_accuracy <= 1.0 and result.wall_s > 0


@pytest.mark.parametrize(
    ("config", "clients", "field"),
    [
        ({"epsilons": "1,2"}, 4, "epsilons"),  # one ε per client: 4 clients, 2 values
        ({}, 1, "num_clients"),  # fewer clients than min-clients: the ServerApp would wait for ever
        ({}, 0, "num_clients"),  # 0 is a number of clients given, not "one per natural partition"
        ({"dataset": "pums", "data-path": "/nowhere/pums.csv"}, 2, "data-path"),  # every client would fail
    ],
)
def test_a_scenario_the_apps_cannot_run_is_refused_before_any_client_starts(tmp_path, config, clients, field):
    with pytest.raises(InputError) as refused:
        run_scenario(Scenario("bad", {**TINY, **config}, num_clients=clients), tmp_path, quiet=True)
    assert refused.value.field == field
    assert not any(tmp_path.rglob("*"))  # no results folder left behind


def test_the_baseline_uses_the_private_schedule_and_learns(tmp_path):
    baseline = nonprivate_baseline({**TINY, "results-dir": str(tmp_path)}, num_clients=2)
    assert baseline.private is False and baseline.epsilon_spent_max is None and baseline.folder is None
    assert [r["round"] for r in baseline.rounds] == [1, 2]
    assert [c["steps_this_run"] for c in baseline.clients] == [8, 8]  # k=2 at ε=1: T = 2k²/ε = 8
    assert baseline.final_accuracy > 0.5  # 10 digits: chance is 0.1
    baseline.check_budgets()  # nothing to check for a non-private run, and it says so by passing


def test_the_baseline_says_it_is_not_private_and_names_no_epsilon(tmp_path):
    """Its result carries no ε figure a report could take for a private run's, and it writes
    nothing under the run config's results folder or ledger."""
    ledger = tmp_path / "ledger.sqlite"
    baseline = nonprivate_baseline(
        {**TINY, "results-dir": str(tmp_path / "results"), "ledger-path": str(ledger)}, num_clients=2
    )
    assert baseline.summary["private"] is False and baseline.row()["private"] is False
    rows = [baseline.summary, *baseline.rounds, *baseline.clients]
    assert not any(key.startswith("epsilon") or key in ("sigma", "all_within_budget") for row in rows for key in row)
    assert not any(tmp_path.iterdir())


def test_the_baseline_follows_the_step_size_schedule(tmp_path):
    """η_t = η/sqrt(a + c·t) with a huge a is η/1e6 at every step: the same run as a constant η/1e6."""
    decayed = nonprivate_baseline(
        {**TINY, "results-dir": str(tmp_path), "lr-schedule": "inverse_sqrt", "lr-offset": 1e12}, 2
    )
    tiny_constant = nonprivate_baseline({**TINY, "results-dir": str(tmp_path), "learning-rate": 1e-6}, 2)
    full_constant = nonprivate_baseline({**TINY, "results-dir": str(tmp_path)}, 2)
    accuracy = lambda run: [r["accuracy"] for r in run.rounds]  # noqa: E731
    assert accuracy(decayed) == pytest.approx(accuracy(tiny_constant), abs=1e-9)
    assert accuracy(full_constant) != pytest.approx(accuracy(tiny_constant), abs=1e-3)


def test_a_budget_overrun_is_caught(tmp_path):
    result = run_scenario(Scenario("over", TINY, num_clients=2), tmp_path, quiet=True)
    result.clients[0]["epsilon_spent"] = result.clients[0]["epsilon_budget"] + 1e-9
    with pytest.raises(AssertionError, match="over budget"):
        result.check_budgets()


@pytest.mark.skipif(not PUMS_SAMPLE.is_file(), reason=f"PUMS sample missing: {PUMS_SAMPLE}")
def test_the_validation_file_holds_only_training_rows(tmp_path):
    config = {"dataset": "pums", "data-path": str(PUMS_SAMPLE), "partition-by": "puma"}
    out = training_rows_file(config, tmp_path / "train_rows.csv")
    full, carved = pd.read_csv(PUMS_SAMPLE), pd.read_csv(out)
    assert list(carved.columns) == list(full.columns)
    assert 70 <= len(carved) <= 85  # each PUMA keeps ~80% of its rows for training
    assert carved.merge(full, how="left", indicator=True)["_merge"].eq("both").all()


@pytest.mark.skipif(not PUMS_SAMPLE.is_file(), reason=f"PUMS sample missing: {PUMS_SAMPLE}")
def test_the_validation_file_is_cut_by_the_split_seed_as_the_runs_cut_their_rows(tmp_path):
    base = {"dataset": "pums", "data-path": str(PUMS_SAMPLE), "partition-by": "puma"}
    split_seed = pd.read_csv(training_rows_file({**base, "seed": 3, "split-seed": 0}, tmp_path / "a.csv"))
    seed_zero = pd.read_csv(training_rows_file({**base, "seed": 0}, tmp_path / "b.csv"))
    seed_three = pd.read_csv(training_rows_file({**base, "seed": 3}, tmp_path / "c.csv"))
    assert split_seed.equals(seed_zero)  # split-seed 0 decides the rows, whatever the seed
    assert not split_seed.equals(seed_three)


def test_the_validation_command_writes_a_csv_files_training_rows(tmp_path, monkeypatch, capsys):
    """A csv needs its class count (and here its feature columns, past a text column) on the command line."""
    import sys

    from sims import validation

    data = tmp_path / "clinic.csv"
    data.write_text("site,x,note,y\n" + "".join(f"s{i % 2},{i},text,{i % 2}\n" for i in range(40)))
    out = tmp_path / "rows.csv"
    args = ["--data", str(data), "--dataset", "csv", "--partition-by", "site", "--label-column", "y"]
    monkeypatch.setattr(sys, "argv", ["validation", *args, "--out", str(out)])
    with pytest.raises(InputError, match="num-classes=0: .*must be declared"):
        validation.main()
    monkeypatch.setattr(
        sys, "argv", ["validation", *args, "--num-classes", "2", "--feature-columns", "x", "--out", str(out)]
    )
    validation.main()
    assert capsys.readouterr().out.strip() == str(out)
    assert 28 <= len(pd.read_csv(out)) <= 34  # each site keeps ~80% of its 20 rows for training


def test_the_one_flower_internal_the_in_process_engine_needs_is_still_there():
    """If a Flower upgrade moves the sender identity `Message(...)` reads, this fails first, naming it."""
    from flwr.app import ConfigRecord, Message, RecordDict

    from sims.inprocess import act_as_serverapp

    act_as_serverapp(42)
    message = Message(RecordDict({"config": ConfigRecord({"x": 1})}), dst_node_id=7, message_type="train")
    assert (message.metadata.run_id, message.metadata.dst_node_id) == (42, 7)


def test_ctrl_c_while_a_node_trains_waits_for_its_call_to_end():
    """The in-process grid calls a node on a thread (so that a hung node can time out). Ctrl-C
    while it trains must let the call end before the interrupt goes on: a process that exits with
    a thread inside PyTorch aborts ('terminate called without an active exception', exit 134)."""
    import signal
    import threading
    import time

    from flwr.app import Message, RecordDict

    from sims.inprocess import InProcessGrid

    ended = threading.Event()

    def training_node(message: Message, context) -> Message:
        time.sleep(1.0)  # still training when Ctrl-C comes
        ended.set()
        return Message(RecordDict(), reply_to=message)

    grid = InProcessGrid(training_node, [{}], {})
    message = grid.create_message(RecordDict(), "train", dst_node_id=101, group_id="1")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a suite run in the background ignores SIGINT
    try:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            grid.push_messages([message], timeout=30)
        assert ended.is_set(), "the interrupt went on while the node was still training"
    finally:
        signal.signal(signal.SIGINT, previous)
