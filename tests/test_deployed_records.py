"""What a deployed client's records may reach: only the noised update.

The attacks this file holds shut, each through the real deployed client:
- neighbouring files (one cell of one record changed, or one record added) must give training sets
  that differ in that record only (a split seeded by the whole file moved 67 of 400 records);
- the run config must not decide how records are read (a label column that one record breaks made
  the client fail exactly when that record was present: a free membership oracle);
- the ledger account is the node's declared name, and the data under it cannot change silently;
- one misconfigured node does not end a deployed run.
"""

from __future__ import annotations

import csv
import sqlite3
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from harness import PUMS_SAMPLE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from clients.app import app as client_app
from fedprivacy.admission import open_account
from fedprivacy.cli import app as cli_app
from fedprivacy.errors import ClientRefusal, InputError
from fedprivacy.identity import deployed_client
from fedprivacy.ledger import DataMismatch, Ledger
from fedprivacy.privacy.accountants import NoiseEvent
from fedprivacy.recipe import file_digest
from fedprivacy.runconfig import parse_node_config, parse_run_config
from server.app import app as server_app

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
RUN = parse_run_config({"dataset": "csv", "label-column": "y"})


def csv_node(path: Path, tmp_path: Path, **extra: object) -> dict[str, object]:
    return {
        "client-id": "a",
        "data-path": str(path),
        "epsilon": 1.0,
        "delta": 1e-6,
        "public-size": 100,
        "dataset": "csv",
        "label-column": "y",
        "feature-columns": "f0,f1,f2",
        "num-classes": 2,
        "ledger-path": str(tmp_path / "ledger.sqlite"),
        **extra,
    }


def training_rows(path: Path, tmp_path: Path, run=RUN) -> Counter:
    client = deployed_client(run, parse_node_config(csv_node(path, tmp_path)))
    train = client.data.train
    return Counter(
        tuple(map(float, row)) + (int(label),) for row, label in zip(train.features, train.labels, strict=True)
    )


def random_table(seed: int, n: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    table = pd.DataFrame(rng.integers(0, 5, size=(n, 3)).astype(float), columns=["f0", "f1", "f2"])
    table["y"] = np.arange(n) % 2  # both classes
    return table


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), n=st.integers(4, 60), data=st.data())
def test_neighbouring_files_give_training_sets_that_differ_in_the_one_record(tmp_path, seed, n, data):
    """Replace one cell of one record (same N), or remove one record: the deployed client's training
    multiset changes by exactly that record, whatever the rest of the file."""
    table = random_table(seed, n)
    target = data.draw(st.integers(0, n - 1))
    replaced = table.copy()
    replaced.loc[target, "f1"] = 99.0
    removed = table.drop(index=target)
    files = {}
    for name, frame in (("d", table), ("replaced", replaced), ("removed", removed)):
        files[name] = tmp_path / f"{name}-{seed}-{n}-{target}.csv"
        frame.to_csv(files[name], index=False)
    base = training_rows(files["d"], tmp_path)
    assert sum(base.values()) == n  # every row: nothing held out
    swapped = training_rows(files["replaced"], tmp_path)
    assert sum((base - swapped).values()) == 1 and sum((swapped - base).values()) == 1
    assert sum((base - training_rows(files["removed"], tmp_path)).values()) == 1


def test_the_attack_on_the_split_finds_one_record_to_score_not_sixty_seven(tmp_path):
    """The audit's setting: N = 400, a changed cell in one record. A server scoring releases by the
    gradients of records trained under one file only had 67 + 67 records to use; now it has the
    changed record alone, which is what the certificate covers."""
    table = random_table(1, 400)
    neighbour = table.copy()
    neighbour.loc[123, "f0"] = 7.0
    table.to_csv(tmp_path / "d.csv", index=False)
    neighbour.to_csv(tmp_path / "d2.csv", index=False)
    only_d = training_rows(tmp_path / "d.csv", tmp_path) - training_rows(tmp_path / "d2.csv", tmp_path)
    assert list(only_d.elements()) == [
        tuple(map(float, table.loc[123, ["f0", "f1", "f2"]])) + (int(table.loc[123, "y"]),)
    ]


def test_the_run_config_cannot_turn_a_record_into_a_failure(tmp_path):
    """A column of 0/1 values where the target record holds 3 (and a text cell): named as the label
    (or left for the content-based feature rule) by the run config, it failed the client exactly
    when the target was present. The node config decides the columns; the run config's are ignored."""
    table = random_table(2, 40)
    table["z"] = 0.0
    table["w"] = "1"
    with_target = table.copy()
    with_target.loc[7, ["z", "w"]] = [3.5, "x"]
    for name, frame in (("without", table), ("with", with_target)):
        frame.to_csv(tmp_path / f"{name}.csv", index=False)
    for run in (
        {"dataset": "csv", "label-column": "z"},
        {"dataset": "csv", "label-column": "w"},
        {"dataset": "pums"},
    ):
        settings_ = parse_run_config(run)
        rows = {name: training_rows(tmp_path / f"{name}.csv", tmp_path, settings_) for name in ("without", "with")}
        assert rows["with"] == rows["without"]  # both read, the same way, whatever the run config names


def test_a_csv_node_declares_how_its_records_are_read(tmp_path):
    base = {
        "client-id": "a",
        "data-path": str(tmp_path / "a.csv"),
        "epsilon": 1,
        "delta": 1e-6,
        "public-size": 10,
        "dataset": "csv",
    }
    with pytest.raises(InputError, match="label-column"):
        parse_node_config(base)
    with pytest.raises(InputError, match="feature-columns"):
        parse_node_config({**base, "label-column": "y", "num-classes": 2})
    with pytest.raises(InputError, match="feature-columns=.*label column"):
        parse_node_config({**base, "label-column": "y", "feature-columns": "a,y", "num-classes": 2})
    with pytest.raises(InputError, match="test-fraction=0.2: a deployed client trains on every row"):
        parse_node_config({**base, "test-fraction": 0.2})
    with pytest.raises(InputError, match="label-column=.*pums layout fixes its columns"):
        parse_node_config({**base, "dataset": "pums", "label-column": "y"})


def _spend(path: Path, tmp_path: Path, **node_extra: object) -> None:
    client = deployed_client(RUN, parse_node_config(csv_node(path, tmp_path, **node_extra)))
    with Ledger(client.ledger_path) as ledger:
        open_account(client, RUN, ledger, "run-1")
        ledger.record(client.account, "run-1", 1, [NoiseEvent(3.0, 0.1, 10)])


def test_a_changed_file_under_an_account_is_refused_until_the_operator_accepts_it(tmp_path, caplog):
    """Appending a row, or saving the same rows with CRLF line endings, opened a fresh budget
    (the account was the file's digest). Now the account is the declared client-id: a changed file
    is refused, without digests in the message (they are functions of every record), until the
    operator accepts it; its spends keep counting."""
    data = tmp_path / "a.csv"
    random_table(3, 30).to_csv(data, index=False)
    _spend(data, tmp_path)
    ledger_path = tmp_path / "ledger.sqlite"
    spent = Ledger(ledger_path).epsilon_spent("node:a")
    for change in ("append", "crlf"):
        if change == "append":
            pd.concat([pd.read_csv(data), random_table(4, 1)]).to_csv(data, index=False)
        else:
            data.write_bytes(data.read_bytes().replace(b"\r\n", b"\n").replace(b"\n", b"\r\n"))
        client = deployed_client(RUN, parse_node_config(csv_node(data, tmp_path)))
        with (
            Ledger(ledger_path) as ledger,
            pytest.raises(ClientRefusal, match="its ledger refused its data file") as refused,
        ):
            open_account(client, RUN, ledger, "run-2")
        assert "another data file" not in str(refused.value)  # what changed stays on the node ...
        assert "opened on another data file" in caplog.text  # ... in its log, with the remedy
        assert file_digest(data) not in str(refused.value) + caplog.text
        result = CliRunner().invoke(
            cli_app, ["ledger", "accept-data", str(ledger_path), "node:a", "--data", str(data), "--yes"]
        )
        assert result.exit_code == 0, result.output
        with Ledger(ledger_path) as ledger:
            open_account(client, RUN, ledger, "run-2")
            assert ledger.epsilon_spent("node:a") == spent  # the same account, the same spends


def test_the_same_file_under_another_client_id_is_refused(tmp_path):
    data = tmp_path / "a.csv"
    random_table(5, 30).to_csv(data, index=False)
    _spend(data, tmp_path)
    renamed = deployed_client(RUN, parse_node_config(csv_node(data, tmp_path, **{"client-id": "b"})))
    with (
        Ledger(tmp_path / "ledger.sqlite") as ledger,
        pytest.raises(ClientRefusal, match="its ledger refused its data file"),
    ):
        open_account(renamed, RUN, ledger, "run-2")
    with (
        Ledger(tmp_path / "ledger.sqlite") as ledger,
        pytest.raises(DataMismatch, match="already accounted under 'node:a'"),
    ):
        ledger.pin_data("node:b", file_digest(data))
    with Ledger(tmp_path / "ledger.sqlite") as ledger:  # nor can the operator put one file under two budgets
        ledger.open_account("node:b", 1.0, 1e-6)
        with pytest.raises(InputError, match="already the data of account 'node:a'"):
            ledger.accept_data("node:b", file_digest(data))


def test_an_account_named_by_its_file_in_an_older_ledger_is_adopted_with_its_spends(tmp_path):
    data = tmp_path / "a.csv"
    random_table(6, 30).to_csv(data, index=False)
    ledger_path = tmp_path / "ledger.sqlite"
    legacy = f"data:{file_digest(data)}"
    with Ledger(ledger_path) as ledger:
        ledger.open_account(legacy, 1.0, 1e-6)
        ledger.record(legacy, "old-run", 1, [NoiseEvent(3.0, 0.1, 10)])
        spent = ledger.epsilon_spent(legacy)
    client = deployed_client(RUN, parse_node_config(csv_node(data, tmp_path)))
    with Ledger(ledger_path) as ledger:
        open_account(client, RUN, ledger, "run-2")
        assert ledger.epsilon_spent("node:a") == spent > 0
    with sqlite3.connect(ledger_path) as db:
        assert [r[0] for r in db.execute("SELECT account FROM accounts")] == ["node:a"]


def test_one_misconfigured_node_does_not_end_a_deployed_run(in_process, run_config, tmp_path, caplog):
    """The server asked one node for the initial model; a node that rightly refuses (no δ in its
    node config) ended the run whenever it was the one asked. Now the next node is asked, and the
    refusing node is named in the log."""
    data = tmp_path / "a.csv"
    random_table(7, 200).to_csv(data, index=False)
    good = csv_node(data, tmp_path, **{"client-id": "good"})
    bad = {k: v for k, v in csv_node(data, tmp_path, **{"client-id": "bad"}).items() if k != "delta"}
    config = {
        **run_config,
        "dataset": "csv",
        "label-column": "y",
        "noise-seed": -1,
        "min-clients": 2,
        "num-server-rounds": 1,
        "rule": "calibrated",
    }
    in_process.run_server(server_app, in_process.Grid(client_app, [bad, good], config), config)
    assert "client on node 101 could not build the initial model" in caplog.text
    (folder,) = [p for p in Path(config["results-dir"]).iterdir() if p.is_dir()]
    clients = pd.read_csv(folder / "clients.csv", dtype=str).set_index("client_id")
    assert clients.loc["good", "status"] == "ok"


def test_advice_about_the_real_size_stays_in_the_nodes_log(tmp_path, caplog):
    """δ ≥ 1/N for the real N, or a public size far from it, is the operator's business: logged on
    the node, never a refusal (a refusal would tell neighbours apart by N)."""
    data = tmp_path / "a.csv"
    random_table(8, 400).to_csv(data, index=False)
    client = deployed_client(RUN, parse_node_config(csv_node(data, tmp_path, delta=0.004, **{"public-size": 100})))
    assert client.data.num_examples == 400 and client.planning_size == 100
    assert "delta=0.004 is not below 1/N for the 400 rows" in caplog.text
    assert "holds 400 rows, its public-size is 100" in caplog.text


@pytest.mark.parametrize(
    "damage",
    [
        "text cell",
        "empty cell",
        "infinite cell",
        "label out of range",
        "fractional label",
        "negative label",
        "too many fields",
    ],
)
def test_a_bad_row_is_dropped_alone_so_no_record_can_fail_the_client(tmp_path, damage):
    """A deployed client that refused its file for one bad row failed exactly when that row was
    present (the server sees the failure): now the row is dropped on its own, and the client trains
    on the same rows as on the neighbouring file without it."""
    table = random_table(9, 40).astype(object)
    without = table.drop(index=5)
    without.to_csv(tmp_path / "without.csv", index=False)
    if damage == "text cell":
        table.loc[5, "f1"] = "secret-value"
    elif damage == "empty cell":
        table.loc[5, "f1"] = ""
    elif damage == "infinite cell":
        table.loc[5, "f1"] = "inf"
    elif damage == "label out of range":
        table.loc[5, "y"] = 3
    elif damage == "fractional label":
        table.loc[5, "y"] = 0.5
    elif damage == "negative label":
        table.loc[5, "y"] = -1
    table.to_csv(tmp_path / "with.csv", index=False)
    if damage == "too many fields":
        lines = (tmp_path / "without.csv").read_text().splitlines()
        lines.insert(6, "1.0,2.0,3.0,1,extra")
        (tmp_path / "with.csv").write_text("\n".join(lines) + "\n")
    assert training_rows(tmp_path / "with.csv", tmp_path) == training_rows(tmp_path / "without.csv", tmp_path)


BAD_LINES = {  # (where it goes: 1 = the first data row, the bad line)
    # an unmatched quote: pandas read on through the next lines' quotes, swallowing their records
    "unmatched quote": (6, b'7.0,"oops,3.0,1'),
    # one field too many in the first data row: pandas took the first column for the index and
    # shifted every column of every row
    "extra field, first row": (1, b"1.0,2.0,3.0,1,extra"),
    # a byte that is not UTF-8: pandas failed the whole file
    "not UTF-8": (6, b"1.0,\xff,3.0,1"),
    # a 400-digit integer in the integer label column: pandas kept it as a Python int, and the
    # finiteness check overflowed
    "400 digits": (6, b"1.0,2.0,3.0,1" + b"0" * 400),
    # finite as float64, infinite as float32: it reached training as inf
    "beyond float32": (6, b"1e39,2.0,3.0,1"),
    # Python's float() reads these, a CSV reader would not: the line reader must not either
    "python-only number": (6, b"1_000,2.0,3.0,1"),
    "arabic-indic digit": (6, "\u0663,2.0,3.0,1".encode()),
    # a line longer than any row of numbers: left out unread, never held whole
    "line over 1 MiB": (6, b"1." + b"0" * 2**20 + b",2.0,3.0,1"),
    # a quoted cell holding a line break: both pieces hold an odd number of quotes
    "quoted line break": (6, b'"1.0\n2.0",2.0,3.0,1'),
}


@pytest.mark.parametrize("damage", sorted(BAD_LINES))
def test_no_line_can_change_how_another_is_read(tmp_path, damage):
    """Each line of a deployed node's file is decoded, split and converted alone: a bad line is left
    out, and every other record reads as in the neighbouring file without it. The file's cells are
    quoted, as spreadsheets often write them, so that a stray quote has quotes to pair with."""
    position, bad = BAD_LINES[damage]
    random_table(11, 40).to_csv(tmp_path / "without.csv", index=False, quoting=csv.QUOTE_ALL)
    lines = (tmp_path / "without.csv").read_bytes().splitlines()
    lines.insert(position, bad)
    (tmp_path / "with.csv").write_bytes(b"\n".join(lines) + b"\n")
    without = training_rows(tmp_path / "without.csv", tmp_path)
    assert sum(without.values()) == 40
    assert training_rows(tmp_path / "with.csv", tmp_path) == without


@pytest.mark.parametrize("ending", [b"\r\n", b"\r"])
def test_windows_and_old_mac_line_endings_read_as_unix_ones(tmp_path, ending):
    random_table(12, 30).to_csv(tmp_path / "unix.csv", index=False)
    (tmp_path / "other.csv").write_bytes((tmp_path / "unix.csv").read_bytes().replace(b"\n", ending))
    unix = training_rows(tmp_path / "unix.csv", tmp_path)
    assert sum(unix.values()) == 30 and training_rows(tmp_path / "other.csv", tmp_path) == unix


@pytest.mark.parametrize("header_end", [b"\r", b"\r\n"])
def test_one_more_record_in_a_file_of_lone_cr_endings_adds_only_itself_past_a_mebibyte(tmp_path, header_end):
    """Lone \r ends a line: the 1 MiB limit is each line's, so a file of them past 1 MiB is read
    whole, and one more record adds one row (it used to fail the client, or read no row at all)."""
    body = b"".join(b"%d,%d,%d,%d\r" % (i % 5, i % 3, i % 7, i % 2) for i in range(150_000))
    without = b"f0,f1,f2,y" + header_end + body
    assert len(without) > 2**20
    (tmp_path / "without.csv").write_bytes(without)
    (tmp_path / "with.csv").write_bytes(without + b"4,4,4,1\r")
    rows_without = training_rows(tmp_path / "without.csv", tmp_path)
    rows_with = training_rows(tmp_path / "with.csv", tmp_path)
    assert sum(rows_without.values()) == 150_000
    assert rows_with - rows_without == Counter({(4.0, 4.0, 4.0, 1): 1}) and not rows_without - rows_with


@settings(max_examples=200, deadline=None)
@given(
    lines=st.lists(st.binary(max_size=12).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")), max_size=12),
    ends=st.lists(st.sampled_from([b"\n", b"\r", b"\r\n"]), min_size=12, max_size=12),
    last_ended=st.booleans(),
    block=st.integers(1, 9),
)
def test_lines_and_the_length_limit_do_not_depend_on_how_the_file_is_read(lines, ends, last_ended, block):
    """Whatever the block size, each \n or \r ends a line and a line over the limit is None alone."""
    import io
    import re

    from fedprivacy.data import rows

    data = b"".join(line + end for line, end in zip(lines, ends, strict=False))
    if lines and not last_ended:
        data = data[: -len(ends[len(lines) - 1])]
    pieces = re.split(rb"[\r\n]", data)
    if pieces[-1] == b"":
        pieces.pop()  # what follows the last line end
    expected = [None if len(piece) > 6 else piece for piece in pieces]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rows, "MAX_LINE_BYTES", 6)
        patch.setattr(rows, "_BLOCK_BYTES", block)
        assert list(rows._physical_lines(io.BytesIO(data))) == expected


def test_a_node_config_declares_at_most_a_thousand_classes(tmp_path):
    with pytest.raises(InputError, match="num-classes=2000: must be an integer from 2 to 1000"):
        parse_node_config(csv_node(tmp_path / "d.csv", tmp_path, **{"num-classes": 2000}))


def test_a_header_cut_by_a_line_break_is_refused_for_every_file(tmp_path):
    """The operator's header, not a record: were it read as one CSV record spanning lines, its
    second line would be read as data by the line reader."""
    random_table(13, 10).to_csv(tmp_path / "d.csv", index=False)
    lines = (tmp_path / "d.csv").read_text().splitlines()
    (tmp_path / "cut.csv").write_text("\n".join([lines[0] + ',"no', 'te"', *lines[1:]]) + "\n")
    with pytest.raises(InputError, match="its header must be the first line"):
        training_rows(tmp_path / "cut.csv", tmp_path)


def test_a_pums_node_reads_each_line_alone_and_has_no_size_limit(tmp_path, monkeypatch):
    """The PUMS layout too: an extra field in the first data row leaves that row out, not the file.
    A size limit would let one record push the file over it and fail the client, so a deployed
    node's file has none (it is streamed; only the used cells are kept)."""
    from fedprivacy.data import tables

    source = PUMS_SAMPLE.read_bytes()
    lines = source.splitlines()
    (tmp_path / "without.csv").write_bytes(source)
    (tmp_path / "with.csv").write_bytes(b"\n".join([lines[0], lines[1] + b",extra", *lines[1:]]) + b"\n")
    monkeypatch.setattr(tables, "MAX_FILE_BYTES", 100)
    node = {**csv_node(tmp_path / "without.csv", tmp_path), "dataset": "pums"}
    for key in ("label-column", "feature-columns", "num-classes"):
        node.pop(key)
    sizes = []
    for name in ("without.csv", "with.csv"):
        client = deployed_client(RUN, parse_node_config({**node, "data-path": str(tmp_path / name)}))
        sizes.append(client.data.num_examples)
    assert sizes == [100, 100]


def test_held_out_rows_read_as_a_node_reads_them_evaluate_a_deployments_model(tmp_path):
    """docs/deployment.md's way to score a deployment (which reports no accuracy): read held-out
    rows as a node would, from a path given as text, and evaluate the saved state dict."""
    import torch

    from fedprivacy.data.loaders import load_pums
    from fedprivacy.models import build_model, evaluate_model

    sample = PUMS_SAMPLE
    held_out = load_pums(str(sample), client_column=None, per_row=True)
    trained = build_model("logreg", held_out.features.shape[1], held_out.num_classes)
    torch.save(trained.state_dict(), tmp_path / "model.pt")
    model = build_model("logreg", held_out.features.shape[1], held_out.num_classes)
    model.load_state_dict(torch.load(tmp_path / "model.pt"))
    loss, accuracy = evaluate_model(model, held_out)
    assert (loss, accuracy) == evaluate_model(trained, held_out) and 0.0 <= accuracy <= 1.0
    assert len(held_out.labels) == 100


def test_a_file_of_one_class_or_no_rows_trains_as_any_other(tmp_path):
    """Refusing a file with a single class (or none) told apart the neighbour that held the one
    record of the other class; the node declares its classes, so it trains."""
    one_class = random_table(10, 20).assign(y=1)
    one_class.to_csv(tmp_path / "one.csv", index=False)
    one_class.head(0).to_csv(tmp_path / "none.csv", index=False)
    assert sum(training_rows(tmp_path / "one.csv", tmp_path).values()) == 20
    client = deployed_client(RUN, parse_node_config(csv_node(tmp_path / "none.csv", tmp_path)))
    assert client.data.num_examples == 0 and client.data.train.features.shape == (0, 3)


def test_a_deployment_whose_run_config_names_the_servers_own_data_set_is_refused_in_words(
    in_process, run_config, tmp_path
):
    """With the default dataset (digits, which the server reads itself) the server builds a digits
    model; csv nodes refuse it naming the misfit and the run-config fix, in words the server may
    read (a deployed node's other failures reach the server as one constant sentence)."""
    data = tmp_path / "a.csv"
    random_table(7, 200).to_csv(data, index=False)
    nodes = [
        csv_node(data, tmp_path, **{"client-id": name, "ledger-path": str(tmp_path / f"{name}.sqlite")})
        for name in ("a", "b")
    ]
    config = {**run_config, "noise-seed": -1, "min-clients": 2, "num-server-rounds": 1, "rule": "calibrated"}
    config.pop("dataset", None)
    with pytest.raises(RuntimeError, match="no client trained in any round"):
        in_process.run_server(server_app, in_process.Grid(client_app, nodes, config), config)
    (folder,) = [p for p in Path(config["results-dir"]).iterdir() if p.is_dir()]
    statuses = pd.read_csv(folder / "clients.csv", dtype=str)["status"].tolist()
    assert len(statuses) == 2
    for status in statuses:
        assert status.startswith(
            "failed: ClientRefusal: the server's model does not fit this client's data (1.weight is [10, 64] "
            "there, [2, 3] here; model 'logreg')"
        ), status
        assert "dataset='digits'" in status and "name the nodes' data set (e.g. dataset='csv')" in status
    for name in ("a", "b"):  # refused before anything was spent
        assert Ledger(tmp_path / f"{name}.sqlite").steps_spent(f"node:{name}") == 0
