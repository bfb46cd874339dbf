"""What a server (through the run config and its messages) can no longer make a client do:
train a round twice, reuse noise across runs, move records to a fresh account, set a deployed
client's budget or split."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from harness import PUMS

from clients.app import app as client_app
from fedprivacy.errors import ClientRefusal
from fedprivacy.identity import deployed_client
from fedprivacy.ledger import Ledger
from fedprivacy.recipe import new_model
from fedprivacy.runconfig import parse_node_config, parse_run_config
from server.app import app as server_app

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def run_folder(results_dir: Path) -> Path:
    (folder,) = [p for p in results_dir.iterdir() if p.is_dir()]
    return folder


def clients_csv(folder: Path) -> dict[str, dict[str, str]]:
    return {str(r["client_id"]): r for r in pd.read_csv(folder / "clients.csv", dtype=str).to_dict("records")}


def _accounts(ledger: Path) -> list[str]:
    with sqlite3.connect(ledger) as db:
        return [r[0] for r in db.execute("SELECT account FROM accounts ORDER BY account")]


def train_message(in_process, config: dict, server_round: int, ledger: Path) -> tuple[Message, Context]:
    """A train message for simulated client 0 of 2, as the ServerApp sends it."""
    in_process.Grid.simulation(client_app, 2, config)  # sets the task identity messages need
    settings = parse_run_config(config)
    model = new_model(settings, np.zeros((1, 64), dtype=np.float32), 10)
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "config": ConfigRecord({"server-round": server_round, "ledger-path": str(ledger)}),
        }
    )
    context = Context(
        run_id=9,
        node_id=101,
        node_config={"partition-id": 0, "num-partitions": 2},
        state=RecordDict(),
        run_config=config,
    )
    return Message(content, dst_node_id=101, message_type=MessageType.TRAIN), context


def test_a_client_never_trains_the_same_round_of_a_run_twice(in_process, run_config, tmp_path):
    """A re-sent round would release a second update on the same records (with a fixed seed, the
    same noise: their difference cancels it)."""
    ledger = tmp_path / "ledger.sqlite"
    message, context = train_message(in_process, run_config, 1, ledger)
    first = client_app(message, context)
    assert not first.has_error() and first.content["metrics"]["budget-exhausted"] == 0
    again, _ = train_message(in_process, run_config, 1, ledger)
    with pytest.raises(ClientRefusal, match="round 1 of run 9 was already trained by client 0"):
        client_app(again, context)
    later, _ = train_message(in_process, run_config, 2, ledger)
    assert not client_app(later, context).has_error()


def test_a_reply_states_the_ledger_as_its_own_record_left_it(in_process, run_config, tmp_path, monkeypatch):
    """The ε and steps a client reports come from the transaction that recorded its round: a
    spend another writer makes on the account right after that commit is in neither."""
    from fedprivacy.ledger import writes
    from fedprivacy.privacy.accountants import NoiseEvent

    ledger = tmp_path / "ledger.sqlite"
    write, injected = writes.write_and_commit, []

    def another_writer_spends_after_the_commit(db, rows):
        last = write(db, rows)
        if not injected:
            injected.append(db.execute("SELECT account FROM account_keys").fetchone()[0])
            Ledger(ledger).record(injected[0], "another-run", 1, [NoiseEvent(5.0, 0.01, 5)])
        return last

    monkeypatch.setattr(writes, "write_and_commit", another_writer_spends_after_the_commit)
    message, context = train_message(in_process, run_config, 1, ledger)
    reply = client_app(message, context).content["metrics"]
    assert injected and reply["budget-exhausted"] == 0
    with sqlite3.connect(ledger) as db:
        ((steps, epsilon),) = db.execute("SELECT steps, epsilon_after FROM spends WHERE run_id = '9'").fetchall()
    assert reply["steps-done"] == steps and reply["epsilon-spent"] == epsilon
    (account,) = Ledger(ledger).accounts()
    assert account.steps == steps + 5  # the other writer's spend is in the ledger, after the reply's


def test_a_seeded_simulation_refuses_a_ledger_that_another_run_spent_from(in_process, run_config, tmp_path):
    ledger = tmp_path / "ledger.sqlite"
    config = {**run_config, "ledger-path": str(ledger), "num-server-rounds": 1}  # noise-seed 7
    in_process.run_server(server_app, in_process.Grid.simulation(client_app, 2, config, run_id=1), config)
    second = {**config, "results-dir": str(tmp_path / "results2")}
    with pytest.raises(RuntimeError):
        in_process.run_server(server_app, in_process.Grid.simulation(client_app, 2, second, run_id=2), second)
    statuses = [row["status"] for row in clients_csv(run_folder(tmp_path / "results2")).values()]
    assert statuses and all("noise-seed=7 on ledger" in s and "would repeat that run's noise" in s for s in statuses)
    assert [Ledger(ledger).runs(account) for account in _accounts(ledger)] == [
        {"1"},
        {"1"},
    ]  # run 2 spent nothing


def test_a_ledger_refuses_another_partitioning_of_the_same_records(in_process, run_config, tmp_path):
    """Another seed deals the same digits to the clients differently: with the old `dataset/partition`
    key, records moved to accounts with fresh budgets."""
    ledger = tmp_path / "ledger.sqlite"
    config = {**run_config, "ledger-path": str(ledger), "num-server-rounds": 1, "noise-seed": -1}
    in_process.run_server(server_app, in_process.Grid.simulation(client_app, 2, config, run_id=1), config)
    reshuffled = {**config, "seed": 1, "results-dir": str(tmp_path / "results2")}
    with pytest.raises(RuntimeError):
        in_process.run_server(server_app, in_process.Grid.simulation(client_app, 2, reshuffled, run_id=2), reshuffled)
    statuses = [row["status"] for row in clients_csv(run_folder(tmp_path / "results2")).values()]
    assert statuses and all("partitioned as" in s and "fresh budgets" in s for s in statuses)
    assert len(_accounts(ledger)) == 2  # no new accounts were opened
    # the same partitioning on the same ledger goes on (a second run spends from the same accounts)
    again = {**config, "results-dir": str(tmp_path / "results3")}
    in_process.run_server(server_app, in_process.Grid.simulation(client_app, 2, again, run_id=3), again)
    assert len(_accounts(ledger)) == 2


@pytest.mark.skipif(not PUMS.is_file(), reason=f"PUMS file missing: {PUMS}")
def test_another_encoding_of_the_same_records_spends_from_the_same_accounts(in_process, run_config, tmp_path):
    """`pums-age` changes the features, not the rows: the second run is neither refused as another
    partitioning nor given fresh accounts, and starts from the first run's spend."""
    ledger = tmp_path / "ledger.sqlite"
    config = {
        **run_config,
        "dataset": "pums",
        "data-path": str(PUMS),
        "partition-by": "puma",
        "ledger-path": str(ledger),
        "num-server-rounds": 1,
        "noise-seed": -1,
        "epochs": 2.0,
    }
    in_process.run_server(server_app, in_process.Grid.simulation(client_app, 7, config, run_id=1), config)
    spent = {a: Ledger(ledger).steps_spent(a) for a in _accounts(ledger)}
    banded = {**config, "pums-age": "bands", "results-dir": str(tmp_path / "results2")}
    in_process.run_server(server_app, in_process.Grid.simulation(client_app, 7, banded, run_id=2), banded)
    assert _accounts(ledger) == sorted(spent) and len(spent) == 7
    assert all(Ledger(ledger).steps_spent(a) > spent[a] > 0 for a in spent)  # run 2 spent from run 1's accounts
    assert {row["status"] for row in clients_csv(run_folder(tmp_path / "results2")).values()} == {"ok"}


@pytest.fixture
def puma_file(tmp_path) -> Path:
    if not PUMS.is_file():
        pytest.skip(f"PUMS file missing: {PUMS}")
    path = tmp_path / "puma1101.csv"
    pd.read_csv(PUMS).query("puma == 1101").sample(300, random_state=0).to_csv(path, index=False)
    return path


def test_a_deployed_client_takes_budget_and_rows_from_its_node_config_only(puma_file, tmp_path, caplog):
    node = parse_node_config(
        {
            "client-id": "a",
            "data-path": str(puma_file),
            "epsilon": 1.0,
            "delta": 1e-6,
            "public-size": 300,
            "ledger-path": str(tmp_path / "l.sqlite"),
        }
    )
    honest = deployed_client(parse_run_config({"dataset": "pums"}), node)
    pushy = deployed_client(
        parse_run_config(
            {
                "dataset": "csv",
                "label-column": "sex",
                "feature-columns": "age",
                "num-classes": 3,
                "split-seed": 4,
                "epsilon": 50.0,
                "delta": 0.3,
                "seed": 9,
                "test-fraction": 0.7,
            }
        ),
        node,
    )
    assert (pushy.epsilon, pushy.delta) == (honest.epsilon, honest.delta) == (1.0, 1e-6)
    assert np.array_equal(
        pushy.data.train.features, honest.data.train.features
    )  # the same rows, whatever the run config
    assert np.array_equal(pushy.data.train.labels, honest.data.train.labels)
    assert pushy.data.num_examples == 300  # every row: a deployed client holds none out
    assert "run config epsilon=50 ignored" in caplog.text and "run config delta=0.3 ignored" in caplog.text
    assert "run config dataset=csv ignored" in caplog.text
    assert "run config label-column=sex feature-columns=('age',) num-classes=3 ignored: a deployed client reads" in (
        caplog.text
    )
    assert "run config split-seed=4 ignored: a deployed client trains on every row" in caplog.text


def test_the_ledger_budget_survives_a_server_that_asks_for_more_delta(in_process, run_config, puma_file, tmp_path):
    """The audit's measured attack: spend at δ = 1e-5, then a second run at δ = 1e-2 re-evaluated the
    history at the larger δ and recorded more rounds. Now the run config's δ is ignored and the
    ledger's pinned δ is used for every composition."""
    ledger = tmp_path / "ledger.sqlite"
    node = {
        "client-id": "a",
        "data-path": str(puma_file),
        "epsilon": 1.0,
        "delta": 1e-5,
        "public-size": 300,
        "ledger-path": str(ledger),
    }
    spent = []
    for run, delta in ((1, 1e-5), (2, 1e-2)):
        config = {
            **run_config,
            "dataset": "pums",
            "delta": delta,
            "noise-seed": -1,
            "min-clients": 1,
            "num-server-rounds": 4,
            "results-dir": str(tmp_path / f"r{run}"),
        }
        in_process.run_server(server_app, in_process.Grid(client_app, [node], config, run_id=run), config)
        row = clients_csv(run_folder(tmp_path / f"r{run}"))["a"]
        spent.append(float(row["epsilon_spent"]))
        assert float(row["delta"]) == 1e-5
    assert spent[0] <= spent[1] <= 1.0
    assert Ledger(ledger).budget(_accounts(ledger)[0]).delta == 1e-5
    plan = json.loads((run_folder(tmp_path / "r2") / "plans" / "a.json").read_text())
    assert plan["delta"] == 1e-5
