"""Fast tier: the ServerApp and ClientApp driven in process (no Ray, no processes).

Privacy checks recompute ε with dp_accounting directly (not the project's wrapper) from each
client's plan and the steps it reports.
"""

from __future__ import annotations

import csv
import json
import logging
import re
import tomllib
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from harness import PUMS
from independent import CERTIFICATE_REL_TOL, plan_prefix_events, pld_epsilon

from clients.app import app as client_app
from fedprivacy import plans
from fedprivacy.errors import InputError
from fedprivacy.models import build_model
from fedprivacy.privacy.plan import Plan
from fedprivacy.results import RunRecorder
from fedprivacy.runconfig import DEFAULTS, parse_node_config, parse_run_config
from server.app import DEPLOYED_LEDGERS
from server.app import app as server_app

PROJECT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # seeded-noise warnings: tests seed on purpose


def independent_epsilon(plan: dict[str, Any], steps: int, delta: float) -> float:
    """PLD ε of the first `steps` steps of `plan` (Poisson-subsampled Gaussian, add/remove-one)."""
    return independent_epsilon_of([(plan, steps)], delta)


def independent_epsilon_of(parts: list[tuple[dict[str, Any], int]], delta: float) -> float:
    """PLD ε of the first n steps of each plan in `parts`, all composed (dp_accounting directly)."""
    return pld_epsilon([run for plan, steps in parts for run in plan_prefix_events(plan, steps)], delta)


def run_folder(results_dir: Path) -> Path:
    (folder,) = [p for p in results_dir.iterdir() if p.is_dir()]
    return folder


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def test_default_run_learns_stays_within_budget_and_writes_results(simulate, run_config, capsys):
    simulate(run_config, num_nodes=3)
    folder = run_folder(Path(run_config["results-dir"]))
    out = capsys.readouterr().out
    assert out.count(f"results folder: {folder}") == 2  # printed at start and end
    assert "round 3/3: accuracy" in out and "ε spent max" in out
    assert "3 clients, 3 rounds, dataset digits, model logreg, rule proactive" in out
    assert out.count("first round: each client plans its DP-SGD before it trains") == 1  # said once

    rounds = pd.read_csv(folder / "rounds.csv")
    assert list(rounds["round"]) == [1, 2, 3]
    config = json.loads((folder / "config.json").read_text())
    assert config["resolved"]["epsilon"] == 1.0 and config["clients"] == 3

    summary = json.loads((folder / "summary.json").read_text())
    assert summary["all_within_budget"] is True and summary["rounds"] == 3
    # the initial model is at chance (~0.1 on 10 digits); private training must clearly beat it
    assert rounds["accuracy"].iloc[-1] > 0.5
    assert rounds["accuracy"].iloc[-1] > rounds["accuracy"].iloc[0]

    clients = read_csv(folder / "clients.csv")
    assert len(clients) == 3
    expected_device = "gpu" if torch.cuda.is_available() else "cpu"  # in process, clients see what we see
    for row in clients:
        assert row["device"] == expected_device
        plan = json.loads((folder / "plans" / f"{row['client_id']}.json").read_text())
        steps = int(row["steps_all_runs"])
        assert steps == plan["steps"]  # a fresh ledger: every planned step ran
        spent = float(row["epsilon_spent"])
        assert spent <= float(row["epsilon_budget"]) == 1.0
        assert spent == pytest.approx(independent_epsilon(plan, steps, float(row["delta"])), rel=CERTIFICATE_REL_TOL)
    assert (folder / "plans" / "index.csv").is_file() and (folder / "plans" / "0.html").is_file()
    assert (folder / "progress.png").read_bytes()[:4] == b"\x89PNG"
    model = build_model("logreg", 64, 10)
    model.load_state_dict(torch.load(folder / "model.pt"))
    assert (folder / "ledger.sqlite").is_file()  # a simulation's fresh ledger lives in its results folder
    assert config["ledger"] == summary["ledger"] == str(folder / "ledger.sqlite")


def test_pyproject_declares_the_app_and_no_federations(in_process):
    with (PROJECT / "pyproject.toml").open("rb") as handle:
        flwr_table = tomllib.load(handle)["tool"]["flwr"]
    assert "federations" not in flwr_table
    assert flwr_table["app"]["components"] == {"serverapp": "server.app:app", "clientapp": "clients.app:app"}
    declared = in_process.defaults()
    assert declared == DEFAULTS  # fedprivacy/runconfig_keys.py declares the keys; pyproject repeats them for Flower
    assert list(declared) == list(DEFAULTS)  # in the same order: the two read alike
    assert {key: type(v) for key, v in declared.items()} == {key: type(v) for key, v in DEFAULTS.items()}
    parse_run_config(declared)  # the defaults work with no overrides


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("data-path", "data/pums.csv", "must be an absolute path"),
        ("results-dir", "./results", "must be an absolute path"),
        ("rule", "magic", "must be one of"),
        ("epsilons", "1,x", "finite number"),
        ("deltas", "1e-5,2", "open interval"),
        ("no-such-key", 1, "not a run-config key"),
        ("pums-age", "cubic", "must be one of: linear, bands"),
        ("lr-schedule", "cosine", "must be one of: , constant, inverse_sqrt, adagrad_norm"),
        ("lr-offset", 0, "finite number > 0"),
        ("lr-decay", -0.1, "finite number ≥ 0"),
        ("lr-decay", 0.5, "shapes only lr-schedule='inverse_sqrt'; this run's schedule is 'constant'"),
    ],
)
def test_bad_run_config_names_the_key(key, value, message):
    with pytest.raises(InputError, match=message) as info:
        parse_run_config({key: value})
    assert info.value.field == key


def test_budgets_must_match_the_clients():
    settings = parse_run_config({"epsilons": "0.5,1,2", "deltas": "1e-5,1e-6,1e-7"})
    assert settings.client_epsilon(2, 3) == 2.0 and settings.client_delta(1, 3) == 1e-6
    with pytest.raises(InputError, match="one value per client: 2 clients, 3 values"):
        settings.client_epsilon(0, 2)
    with pytest.raises(InputError, match="deltas=.*one value per client"):
        settings.client_delta(0, 2)
    assert parse_run_config({}).client_delta(1, 3) == 1e-5  # the common delta when deltas is empty


def test_each_simulated_client_plans_with_its_own_delta(simulate, run_config):
    simulate({**run_config, "epsilons": "1,2", "deltas": "1e-5,1e-7", "num-server-rounds": 1}, num_nodes=2)
    folder = run_folder(Path(run_config["results-dir"]))
    rows = read_csv(folder / "clients.csv")
    assert sorted(row["client_id"] for row in rows) == ["0", "1"]  # both clients, each checked below
    for row in rows:
        plan = json.loads((folder / "plans" / f"{row['client_id']}.json").read_text())
        expected = {"0": (1.0, 1e-5), "1": (2.0, 1e-7)}[row["client_id"]]
        assert (plan["epsilon"], plan["delta"]) == expected and float(row["delta"]) == expected[1]
        spent = float(row["epsilon_spent"])
        assert spent == pytest.approx(
            independent_epsilon(plan, int(row["steps_all_runs"]), expected[1]), rel=CERTIFICATE_REL_TOL
        )


def test_node_config_for_a_deployed_client(tmp_path):
    assert parse_node_config({"partition-id": 0, "num-partitions": 2}) is None
    node = parse_node_config(
        {
            "client-id": "a",
            "data-path": str(tmp_path / "a.csv"),
            "epsilon": 2,
            "delta": 1e-6,
            "public-size": 1000,
        }
    )
    assert node is not None and (node.epsilon, node.delta, node.public_size, node.dataset) == (
        2.0,
        1e-6,
        1000,
        "pums",
    )
    with pytest.raises(InputError, match="client-id"):
        parse_node_config({"data-path": "/x.csv", "epsilon": 1, "delta": 1e-6, "public-size": 10})
    with pytest.raises(InputError, match="absolute path"):
        parse_node_config({"client-id": "a", "data-path": "a.csv", "epsilon": 1, "delta": 1e-6, "public-size": 10})
    with pytest.raises(InputError, match="delta=None: .*its own budget, .*the run config cannot set it"):
        parse_node_config({"client-id": "a", "data-path": "/a.csv", "epsilon": 1, "public-size": 10})
    with pytest.raises(InputError, match="public-size=None: .*only that size is sent"):
        parse_node_config({"client-id": "a", "data-path": "/a.csv", "epsilon": 1, "delta": 1e-6})


def test_a_second_run_on_the_same_ledger_stops_clients_at_their_budget(simulate, run_config, tmp_path, capsys):
    """Privacy composes across runs: run 2 starts from run 1's spend and stops each client
    before the round it cannot afford; it is never asked to train again."""
    ledger = tmp_path / "shared-ledger.sqlite"
    first = {
        **run_config,
        "ledger-path": str(ledger),
        "rule": "proactive",
        "num-server-rounds": 3,
        "noise-seed": -1,
    }
    simulate(first, num_nodes=2, run_id=1)
    folder1 = run_folder(Path(first["results-dir"]))
    second = {
        **first,
        "results-dir": str(tmp_path / "results2"),
        "rule": "calibrated",
        "num-server-rounds": 4,
    }
    grid = simulate(second, num_nodes=2, run_id=2)
    folder2 = run_folder(tmp_path / "results2")

    rows = read_csv(folder2 / "clients.csv")
    for row in rows:
        plan1 = json.loads((folder1 / "plans" / f"{row['client_id']}.json").read_text())
        plan2 = json.loads((folder2 / "plans" / f"{row['client_id']}.json").read_text())
        stopped = int(row["exhausted_round"])  # proactive spends ~half; calibrated alone would spend all
        assert 1 < stopped <= 4
        steps2 = Plan.from_dict(plan2).first_step_of_round(stopped)
        refused = Plan.from_dict(plan2).steps_in_round(stopped)
        assert int(row["steps_all_runs"]) == plan1["steps"] + steps2
        spent = float(row["epsilon_spent"])
        assert spent <= float(row["epsilon_budget"]) == 1.0
        assert spent == pytest.approx(
            independent_epsilon_of([(plan1, plan1["steps"]), (plan2, steps2)], 1e-5), rel=CERTIFICATE_REL_TOL
        )
        # the round it skipped would have overspent
        assert independent_epsilon_of([(plan1, plan1["steps"]), (plan2, steps2 + refused)], 1e-5) > 1.0

    trains = [node for node, kind in grid.calls if kind == "train"]
    for node in set(trains):  # one train call per round up to and including the refused one, none after
        name = node - 101
        stopped = int(next(r["exhausted_round"] for r in rows if r["client_id"] == str(name)))
        assert trains.count(node) == stopped
    rounds = read_csv(folder2 / "rounds.csv")
    assert rounds[-1]["clients_trained"] == "0" and rounds[-1]["clients_exhausted"] == "2"
    assert "2 out of budget" in capsys.readouterr().out


def test_a_restarted_client_resumes_its_plan_from_the_ledger(in_process, run_config, monkeypatch, caplog):
    """A node loses its in-memory state before round 2: it must take its plan and its spend
    from the ledger (re-planning is made impossible), and finish exactly its plan; its log says it
    resumed, once, and the other node's says nothing of the kind."""
    restarted = 101

    def no_replanning(*args, **kwargs):
        raise AssertionError("a client re-planned in the middle of a run")

    class RestartBeforeRound2:
        grid = None

        def __call__(self, message, context):
            if message.metadata.message_type == "train" and int(message.content["config"]["server-round"]) == 2:
                monkeypatch.setattr(plans, "plan_client", no_replanning)
                if context.node_id == restarted:
                    self.grid.restart_node(restarted)
                    context = self.grid.contexts[restarted]
            return client_app(message, context)

    wrapper = RestartBeforeRound2()
    grid = in_process.Grid.simulation(wrapper, 2, run_config)
    wrapper.grid = grid
    with caplog.at_level(logging.WARNING, logger="clients.app"):
        in_process.run_server(server_app, grid, run_config)
    resumed = [r.getMessage() for r in caplog.records if "resumes run" in r.getMessage()]
    assert len(resumed) == 1 and resumed[0].startswith("client 0 resumes run 1 after a restart"), resumed
    folder = run_folder(Path(run_config["results-dir"]))
    rows = read_csv(folder / "clients.csv")
    assert len(rows) == 2
    for row in rows:
        plan = json.loads((folder / "plans" / f"{row['client_id']}.json").read_text())
        assert row["status"] == "ok" and row["rounds_trained"] == "3"
        assert int(row["steps_all_runs"]) == plan["steps"]
        assert float(row["epsilon_spent"]) == pytest.approx(
            independent_epsilon(plan, plan["steps"], plan["delta"]), rel=CERTIFICATE_REL_TOL
        )


@pytest.fixture
def deployment_nodes(tmp_path) -> list[dict[str, Any]]:
    """Two PUMA clients with their own files, budgets and ledgers, plus one with 3 rows."""
    if not PUMS.is_file():
        pytest.skip(f"PUMS file missing: {PUMS}")
    table = pd.read_csv(PUMS)
    nodes = []
    for puma, epsilon in ((1101, 1.0), (1102, 2.0)):
        path = tmp_path / f"puma{puma}.csv"
        table[table.puma == puma].sample(400, random_state=0).to_csv(path, index=False)
        nodes.append(
            {
                "client-id": f"puma-{puma}",
                "data-path": str(path),
                "epsilon": epsilon,
                "delta": 1e-5,
                "public-size": 400,
                "ledger-path": str(tmp_path / f"ledger-{puma}.sqlite"),
            }
        )
    tiny = tmp_path / "tiny.csv"
    table.head(3).to_csv(tiny, index=False)
    nodes.append(
        {
            "client-id": "tiny",
            "data-path": str(tiny),
            "epsilon": 1.0,
            "delta": 1e-5,
            "public-size": 3,
            "ledger-path": str(tmp_path / "ledger-tiny.sqlite"),
        }
    )
    return nodes


def test_deployment_clients_without_server_data_and_a_too_small_client(
    in_process, run_config, deployment_nodes, capsys
):
    """Each node brings its own file and budget; the server has no data, and deployed clients
    release no evaluation (exact metrics on their test rows are not private); the 3-row client
    fails clearly and the run goes on without it."""
    config = {**run_config, "dataset": "pums", "noise-seed": -1}
    grid = in_process.Grid(client_app, deployment_nodes, config)
    in_process.run_server(server_app, grid, config)
    folder = run_folder(Path(config["results-dir"]))
    out = capsys.readouterr().out
    assert "federated (the server has no data)" in out
    for name in ("config.json", "summary.json"):  # the ledgers are on the SuperNodes, not in the folder
        assert json.loads((folder / name).read_text())["ledger"].startswith(
            "on each SuperNode (its node config's ledger-path)"
        )
    # once a client trained without the server's data, the run was a deployment: one place only
    assert json.loads((folder / "summary.json").read_text())["ledger"] == DEPLOYED_LEDGERS
    assert not (folder / "ledger.sqlite").exists()
    rounds = pd.read_csv(folder / "rounds.csv")
    assert rounds["accuracy"].isna().all() and rounds["federated_accuracy"].isna().all()
    evaluations = [k for _, k in grid.calls if k == "evaluate"]
    assert len(evaluations) == 2  # the two clients that trained are asked once, then never again
    assert list(rounds["clients_trained"]) == [2, 2, 2]
    clients = {r["client_id"]: r for r in read_csv(folder / "clients.csv")}
    (failed,) = [r for r in clients.values() if r["status"].startswith("failed")]
    assert "too little data for client tiny" in failed["status"]
    assert "query" in {k for _, k in grid.calls}  # the initial model came from a client
    for node in deployment_nodes[:2]:
        row = clients[node["client-id"]]
        assert row["accuracy"] == "nan" and row["test_examples"] == "0"  # a deployed client releases no evaluation
        plan = json.loads((folder / "plans" / f"{node['client-id']}.json").read_text())
        assert float(row["epsilon_budget"]) == node["epsilon"]
        assert float(row["epsilon_spent"]) == pytest.approx(
            independent_epsilon(plan, int(row["steps_all_runs"]), plan["delta"]), rel=CERTIFICATE_REL_TOL
        )
        assert Path(node["ledger-path"]).is_file()


def test_a_simulated_client_with_one_row_fails_alone(simulate, run_config, tmp_path):
    """Natural partitions: a PUMA with a single row cannot train; it fails with its name and the
    other clients finish the run, evaluated on their own test splits."""
    if not PUMS.is_file():
        pytest.skip(f"PUMS file missing: {PUMS}")
    table = pd.read_csv(PUMS)
    path = tmp_path / "three_pumas.csv"
    pieces = [
        table[table.puma == 1101].sample(400, random_state=0),
        table[table.puma == 1102].sample(400, random_state=0),
        table[table.puma == 1103].head(1),
    ]
    pd.concat(pieces).to_csv(path, index=False)
    config = {**run_config, "dataset": "pums", "data-path": str(path), "partition-by": "puma"}
    simulate(config, num_nodes=3)
    folder = run_folder(Path(config["results-dir"]))
    rounds = pd.read_csv(folder / "rounds.csv")
    assert list(rounds["clients_trained"]) == [2, 2, 2] and rounds["accuracy"].notna().all()
    clients = {r["client_id"]: r for r in read_csv(folder / "clients.csv")}
    assert clients["1101"]["status"] == clients["1102"]["status"] == "ok"
    (failed,) = [r for r in clients.values() if r["status"] != "ok"]  # known by its node: it never got to reply
    assert failed["status"].startswith("failed: InputError: client 1103=1: row(s) in its partition")


def test_a_renamed_deployed_client_cannot_open_a_fresh_budget_on_the_same_file(
    in_process, run_config, deployment_nodes, tmp_path
):
    """The ledger account is the node's declared client-id, and the file's digest is pinned beside
    it: the same file under a new name on the same ledger is refused (a fresh account would restart
    its budget at zero), while the other client trains."""
    first = deployment_nodes[0]
    renamed = {**first, "client-id": "puma-1101-renamed"}
    rows = {}
    for run, node in ((1, first), (2, renamed)):
        config = {**run_config, "dataset": "pums", "results-dir": str(tmp_path / f"r{run}"), "noise-seed": -1}
        in_process.run_server(
            server_app, in_process.Grid(client_app, [node, deployment_nodes[1]], config, run_id=run), config
        )
        rows[run] = {r["client_id"]: r for r in read_csv(run_folder(tmp_path / f"r{run}") / "clients.csv")}
    assert rows[1][first["client-id"]]["status"] == "ok"
    statuses = [r["status"] for name, r in rows[2].items() if name != deployment_nodes[1]["client-id"]]
    assert statuses and all(
        "its ledger refused its data file for account node:puma-1101-renamed" in s for s in statuses
    )
    assert rows[2][deployment_nodes[1]["client-id"]]["status"] == "ok"


def test_a_missing_data_file_fails_the_run_in_one_line_and_marks_its_results(in_process, run_config, tmp_path, capsys):
    """The server cannot tell a simulation from a deployment, so it evaluates through the clients;
    the clients then refuse the file by its key (three alike, and the rest are not asked), and the
    results folder says the run failed."""
    missing = tmp_path / "nowhere" / "pums.csv"
    config = {**run_config, "dataset": "pums", "data-path": str(missing), "partition-by": "puma"}
    grid = in_process.Grid.simulation(client_app, 5, config)
    with pytest.raises(
        RuntimeError,
        match="no client could build the initial model: nodes 101, 102, 103: InputError: data-path=.*no such file",
    ):
        in_process.run_server(server_app, grid, config)
    assert [node for node, kind in grid.calls if kind == "query"] == [101, 102, 103]
    out = capsys.readouterr().out
    assert f"data-path {missing} is not a file on the server" in out
    assert "as 2 nodes before it: the other 2 nodes are not asked" in out
    assert "run failed: RuntimeError: no client could build the initial model: nodes 101, 102, 103" in out
    folder = run_folder(Path(config["results-dir"]))
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["rounds"] == 0
    assert summary["error"].endswith(
        "needs a CSV file: in a simulation every client reads the run config's "
        "data-path (an absolute path on this machine)"
    )
    # simulated clients or deployed SuperNodes: the server cannot tell, and says both
    assert summary["ledger"] == (
        f"{DEPLOYED_LEDGERS}; simulated clients would keep theirs in {folder / 'ledger.sqlite'}"
    )


FIVE_REFUSED = "nodes 101, 103, 105: ClientRefusal: A; node 102: ClientRefusal: B; node 104: ClientRefusal: C"


@pytest.mark.parametrize(
    ("reasons", "asked", "said", "grouped"),
    [
        ("ABACA", 5, "could not build the initial model (ClientRefusal: A)\n", FIVE_REFUSED),  # none left
        ("ABACAB", 5, "as 2 nodes before it: the other node is not asked", FIVE_REFUSED),
        ("AA", 2, "could not build the initial model (ClientRefusal: A)\n", "nodes 101, 102: ClientRefusal: A"),
    ],
)
def test_the_initial_model_is_asked_until_three_nodes_refuse_alike(
    in_process, run_config, caplog, reasons, asked, said, grouped
):
    """Nodes refusing for reasons of their own are each asked in turn; three alike stop the asking,
    and the run's error groups the nodes by reason, in the order asked."""
    from fedprivacy.errors import ClientRefusal

    def refusing(message, context):
        if message.metadata.message_type == "query":
            raise ClientRefusal(reasons[context.node_id - 101])
        return client_app(message, context)

    config = {**run_config, "dataset": "npz", "data-path": "/nowhere/data.npz", "num-classes": 10}
    grid = in_process.Grid.simulation(refusing, len(reasons), config)
    with caplog.at_level(logging.WARNING, logger="server.app"), pytest.raises(RuntimeError) as failed:
        in_process.run_server(server_app, grid, config)
    assert [node for node, kind in grid.calls if kind == "query"] == list(range(101, 101 + asked))
    assert said in caplog.text + "\n"
    assert str(failed.value) == f"no client could build the initial model: {grouped}"


def test_a_failed_runs_summary_names_a_ledger_only_once_it_exists(tmp_path):
    """A run that stopped before any client opened its ledger must not point at a file that is not
    there; one that got further, or a deployment's sentence, is kept as it is."""
    recorder = RunRecorder(tmp_path)
    absent, present = tmp_path / "absent.sqlite", tmp_path / "present.sqlite"
    present.touch()
    failed = recorder.write_summary({"ledger": str(absent)}, error="X: y")
    assert failed["ledger"] == f"none: the run stopped before {absent} was created"
    assert recorder.write_summary({"ledger": str(present)}, error="X: y")["ledger"] == str(present)
    assert recorder.write_summary({"ledger": str(absent)})["ledger"] == str(absent)  # completed: as configured
    assert recorder.write_summary({"ledger": DEPLOYED_LEDGERS}, error="X: y")["ledger"] == DEPLOYED_LEDGERS


def test_a_completed_run_says_so_in_its_summary(simulate, run_config):
    simulate({**run_config, "num-server-rounds": 1}, num_nodes=2)
    summary = json.loads((run_folder(Path(run_config["results-dir"])) / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["error"] is None


def test_each_round_is_reported_once(simulate, run_config, capsys):
    """fedprivacy's round line (accuracy and ε spent) is the round's one report: Flower's own
    evaluation lines, which repeat the accuracy, are kept out of its log during the run."""
    import logging

    from flwr.common.logger import FLOWER_LOGGER

    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    collector = Collect()
    FLOWER_LOGGER.addHandler(collector)
    try:
        simulate({**run_config, "num-server-rounds": 2}, num_nodes=2)
    finally:
        FLOWER_LOGGER.removeHandler(collector)
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("[fedprivacy] round ")] == [
        "[fedprivacy] round 0",
        "[fedprivacy] round 1/2",
        "[fedprivacy] round 2/2",
    ]
    assert any("[ROUND 1/2]" in message for message in seen)  # Flower's log is there ...
    assert not [
        m for m in seen if "Global evaluation" in m or "MetricRecord: {'accuracy'" in m
    ]  # ... without the repeats
    assert FLOWER_LOGGER.filters == []  # and Flower's log is whole again after the run


@pytest.mark.parametrize(
    ("overrides", "needle", "where"),
    [
        ({"model": "mlpp"}, "model='mlpp': unknown model", "results-dir"),  # a typo: the run's own folder
        ({"epsilon": -1.0}, "epsilon=-1.0", "results-dir"),
        ({"results-dir": "relative/folder"}, "results-dir='relative/folder'", "default"),  # the default folder
    ],
)
def test_a_refused_run_config_still_ends_with_a_failed_line_and_a_results_folder(
    simulate, run_config, tmp_path, capsys, monkeypatch, overrides, needle, where
):
    """A run config the ServerApp refuses (a model-name typo, a budget out of range) still leaves
    the `run failed:` line and a folder whose summary.json says why: in its results-dir when that
    one is usable, else in the default one."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the default results-dir is ~/fedprivacy-results
    config = {**run_config, **overrides}
    with pytest.raises(InputError, match=re.escape(needle)):
        simulate(config, num_nodes=2)
    out = capsys.readouterr().out
    assert f"[fedprivacy] run failed: InputError: {needle}" in out
    base = Path(run_config["results-dir"]) if where == "results-dir" else tmp_path / "home" / "fedprivacy-results"
    summary = json.loads((run_folder(base) / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["rounds"] == 0 and needle in summary["error"]
