"""The bad-input catalogue: what a new user (or a typo) feeds fedprivacy, and the one line it gets.

Every case names where the input enters (a CLI command, a run config, a node config, a CSV file,
a ledger file, a results folder), the input, and the field its message must name. CLI cases run
the real `fedprivacy` entry point in process: exit code 2, one line `error: field=value: allowed`
on stderr, nothing on stdout and no file written. Library cases (the Flower apps' configs and
loaders) must raise `InputError` whose one-line message names the field and the value.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from harness import app_defaults

from fedprivacy.cli import ledger as ledger_cli
from fedprivacy.data.loaders import load_dataset
from fedprivacy.errors import InputError
from fedprivacy.runconfig import parse_node_config, parse_run_config
from server.app import app as server_app
from sims.inprocess import InProcessGrid, run_server

PUMS_HEADER = "puma,sex,age,educ,employed"
ROW = "1101,1,40,12,1"


def write(name: str, text: str) -> Callable[[Path], Path]:
    def make(folder: Path) -> Path:
        path = folder / name
        path.write_text(text, encoding="utf-8")
        return path

    return make


def sparse_gigabyte(folder: Path) -> Path:
    """A 1 GiB CSV that costs nothing to make (a sparse file): it must be refused unread."""
    path = folder / "huge.csv"
    with path.open("wb") as handle:
        handle.write(f"{PUMS_HEADER}\n".encode())
        handle.truncate(2**30)
    return path


def sqlite_file(name: str, statements: str) -> Callable[[Path], Path]:
    def make(folder: Path) -> Path:
        path = folder / name
        with sqlite3.connect(path) as db:
            db.executescript(statements)
        return path

    return make


def corrupt_ledger(folder: Path) -> Path:
    path = folder / "corrupt.sqlite"
    path.write_bytes(b"SQLite format 3\x00" + bytes(range(256)) * 16)
    return path


@dataclass(frozen=True)
class Case:
    """One bad input: `where` it enters, the `field` its message names, and the value it shows."""

    where: str
    args: tuple[Any, ...]
    field: str
    shows: str
    make: Callable[[Path], Path] | None = None  # a file the input names ({file} in args)

    @property
    def id(self) -> str:
        command = f"-{self.args[0]}" if self.where == "cli" else ""
        return f"{self.where}{command}:{self.field}:{self.shows}"[:80]


def cli_case(field: str, shows: str, *args: str, make: Callable[[Path], Path] | None = None) -> Case:
    return Case("cli", args, field, shows, make)


def lib_case(where: str, field: str, shows: str, value: Any, make: Callable[[Path], Path] | None = None) -> Case:
    return Case(where, (value,), field, shows, make)


PLAN = ("plan", "--n", "5736")
CASES = [
    # CLI flags: extreme but valid-looking values, refused in one line within bounded memory and time
    cli_case("delta", "0.5", *PLAN, "--epsilon", "1", "--delta", "0.5"),
    cli_case("epsilon", "1e-09", *PLAN, "--epsilon", "1e-9"),
    cli_case("epsilon", "1000000000.0", *PLAN, "--epsilon", "1e9"),
    cli_case("epsilon", "nan", *PLAN, "--epsilon", "nan"),
    cli_case("n", "1", "plan", "--n", "1", "--epsilon", "1"),
    cli_case("n", "10000000000", "plan", "--n", "10000000000", "--epsilon", "1", "--delta", "1e-12"),
    cli_case("steps", "100000000", *PLAN, "--epsilon", "1", "--steps", "100000000", "--sampling-rate", "0.01"),
    cli_case("sampling-rate", "1e-05", *PLAN, "--epsilon", "1", "--epochs", "100", "--sampling-rate", "1e-5"),
    cli_case("rounds", "100000", *PLAN, "--epsilon", "1", "--rounds", "100000"),
    cli_case("clip-norm", "-1.0", *PLAN, "--epsilon", "1", "--clip-norm", "-1"),
    cli_case("clip-norm", "0.0", *PLAN, "--epsilon", "1", "--clip-norm", "0"),
    cli_case("rule", "magic", *PLAN, "--epsilon", "1", "--rule", "magic"),
    cli_case("delta", "1.0", *PLAN, "--epsilon", "1", "--delta", "1"),
    cli_case("epsilon", "1000000000.0", "calculator", "--n", "5736", "--epsilon", "1e9"),
    cli_case("n", "0", "calculator", "--n", "0", "--epsilon", "1"),
    cli_case("n", "3", "calculator", "--n", "3", "--epsilon", "1", "--delta", "0.1"),  # no grid rate gives q·N ≥ 1
    # CSV files, through `fedprivacy sheets`
    cli_case("data", "nowhere.csv", "sheets", "--data", "{folder}/nowhere.csv", "--partition-by", "puma"),
    cli_case(
        "data",
        "empty.csv",
        "sheets",
        "--data",
        "{file}",
        "--partition-by",
        "puma",
        make=write("empty.csv", ""),
    ),
    cli_case(
        "data",
        "header.csv",
        "sheets",
        "--data",
        "{file}",
        "--partition-by",
        "puma",
        make=write("header.csv", PUMS_HEADER + "\n"),
    ),
    cli_case(
        "partition-by",
        "region",
        "sheets",
        "--data",
        "{file}",
        "--partition-by",
        "region",
        make=write("ok.csv", f"{PUMS_HEADER}\n{ROW}\n{ROW}\n"),
    ),
    cli_case(
        "column",
        "age",
        "sheets",
        "--data",
        "{file}",
        "--partition-by",
        "puma",
        make=write("dup.csv", f"{PUMS_HEADER},age\n{ROW},41\n{ROW},42\n"),
    ),
    cli_case(
        "data",
        "semicolon.csv",
        "sheets",
        "--data",
        "{file}",
        "--partition-by",
        "puma",
        make=write("semicolon.csv", PUMS_HEADER.replace(",", ";") + "\n" + ROW.replace(",", ";") + "\n"),
    ),
    cli_case(
        "data",
        "tab.csv",
        "sheets",
        "--data",
        "{file}",
        "--partition-by",
        "puma",
        make=write("tab.csv", PUMS_HEADER.replace(",", "\t") + "\n" + ROW.replace(",", "\t") + "\n"),
    ),
    cli_case(
        "partition-by puma",
        "1101",
        "sheets",
        "--data",
        "{file}",
        "--partition-by",
        "puma",
        make=write("one_row_each.csv", f"{PUMS_HEADER}\n1101,1,40,12,1\n1102,0,30,16,0\n1103,1,50,10,1\n"),
    ),
    cli_case("data", "huge.csv", "sheets", "--data", "{file}", "--partition-by", "puma", make=sparse_gigabyte),
    cli_case(
        "epsilons",
        "1,2",
        "sheets",
        "--data",
        "{file}",
        "--partition-by",
        "puma",
        "--epsilons",
        "1,2",
        make=write("one_client.csv", f"{PUMS_HEADER}\n{ROW}\n{ROW}\n"),
    ),
    # ledger files, through `fedprivacy ledger`
    cli_case("ledger", "missing.sqlite", "ledger", "show", "{folder}/missing.sqlite"),
    cli_case("ledger-path", "corrupt.sqlite", "ledger", "show", "{file}", make=corrupt_ledger),
    cli_case(
        "ledger-path",
        "newer.sqlite",
        "ledger",
        "show",
        "{file}",
        make=sqlite_file("newer.sqlite", "PRAGMA user_version = 99;"),
    ),
    cli_case(
        "ledger-path",
        "superlink.db",
        "ledger",
        "show",
        "{file}",
        make=sqlite_file("superlink.db", "CREATE TABLE run (run_id INTEGER); CREATE TABLE node (node_id INTEGER);"),
    ),
    cli_case(
        "ledger-path",
        "locked.sqlite",
        "ledger",
        "show",
        "{file}",
        make=sqlite_file("locked.sqlite", "CREATE TABLE t (x)"),
    ),
    cli_case(
        "epsilon",
        "1000000000.0",
        "ledger",
        "set-budget",
        "{file}",
        "data:x",
        "--epsilon",
        "1e9",
        "--delta",
        "1e-5",
        "--yes",
        make=sqlite_file("ledger.sqlite", ""),
    ),
    # the run config (untrusted in a deployment; the researcher's in a simulation)
    lib_case("run-config", "epsilon", "1000000000.0", {"epsilon": 1e9}),
    lib_case("run-config", "epsilons", "1e-9", {"epsilons": "1,1e-9"}),
    lib_case("run-config", "num-server-rounds", "100000000", {"num-server-rounds": 10**8}),
    lib_case("run-config", "delta", "1.5", {"delta": 1.5}),
    lib_case("run-config", "data-path", "data/pums.csv", {"data-path": "data/pums.csv"}),
    lib_case("run-config", "results-dir", "''", {"results-dir": ""}),
    lib_case("run-config", "round-timeout", "-1", {"round-timeout": -1}),
    lib_case("run-config", "fraction-train", "0", {"fraction-train": 0}),
    lib_case("run-config", "diagnostics", "yes", {"diagnostics": "yes"}),
    lib_case("run-config", "epsilon-budget", "2", {"epsilon-budget": 2}),
    lib_case("run-config", "min-clients", "0", {"min-clients": 0}),
    lib_case("run-config", "model", "resnet", {"model": "resnet"}),
    # the node config (a SuperNode's own)
    lib_case(
        "node-config",
        "epsilon",
        "None",
        {"client-id": "a", "data-path": "/a.csv", "delta": 1e-6, "public-size": 100},
    ),
    lib_case(
        "node-config",
        "epsilon",
        "1000000000.0",
        {"client-id": "a", "data-path": "/a.csv", "epsilon": 1e9, "delta": 1e-6, "public-size": 100},
    ),
    lib_case(
        "node-config",
        "data-path",
        "a.csv",
        {"client-id": "a", "data-path": "a.csv", "epsilon": 1, "delta": 1e-6, "public-size": 100},
    ),
    lib_case(
        "node-config",
        "budget",
        "3",
        {
            "client-id": "a",
            "data-path": "/a.csv",
            "epsilon": 1,
            "delta": 1e-6,
            "public-size": 100,
            "budget": 3,
        },
    ),
    lib_case(
        "node-config",
        "num-classes",
        "1",
        {
            "client-id": "a",
            "data-path": "/a.csv",
            "epsilon": 1,
            "delta": 1e-6,
            "public-size": 100,
            "num-classes": 1,
        },
    ),
    lib_case(
        "node-config",
        "test-fraction",
        "1",
        {
            "client-id": "a",
            "data-path": "/a.csv",
            "epsilon": 1,
            "delta": 1e-6,
            "public-size": 100,
            "test-fraction": 1,
        },
    ),
    lib_case(
        "node-config",
        "ledger-path",
        "ledger.sqlite",
        {
            "client-id": "a",
            "data-path": "/a.csv",
            "epsilon": 1,
            "delta": 1e-6,
            "public-size": 100,
            "ledger-path": "ledger.sqlite",
        },
    ),
    lib_case(
        "node-config",
        "client-id",
        "' '",
        {"client-id": " ", "data-path": "/a.csv", "epsilon": 1, "delta": 1e-6, "public-size": 100},
    ),
    # CSV cells and labels, through the general loader the apps use (label column y, 2 classes declared)
    lib_case("csv", "column x", "abc", 2, write("text.csv", "x,y\n1,0\n2,1\nabc,1\n")),
    lib_case("csv", "column x", "''", 2, write("nan.csv", "x,y\n1,0\nnan,1\n")),
    lib_case("csv", "column x", "inf", 2, write("inf.csv", "x,y\n1,0\ninf,1\n")),
    lib_case("csv", "label column y", "2", 2, write("third_class.csv", "x,y\n1,1\n2,0\n3,2\n")),
    lib_case(
        "csv",
        "label column y",
        "1000",
        2,
        write("classes.csv", "x,y\n" + "".join(f"{i},{i}\n" for i in range(10_000))),
    ),
    lib_case("csv", "label column y", "0.5", 2, write("fraction.csv", "x,y\n1,0\n2,0.5\n")),
    # the number of classes is declared, never read from the labels
    lib_case("csv", "num-classes", "0", None, write("undeclared.csv", "x,y\n1,0\n2,1\n")),
    lib_case("csv", "num-classes", "1", 1, write("one_class.csv", "x,y\n1,0\n2,0\n")),
    # a results folder that cannot be written (a file stands where its parent folder should be)
    lib_case("results-dir", "results-dir", "taken", None, write("taken", "a file, not a folder")),
]


def attempt_library(case: Case, file: Path | None) -> None:
    """Feed the input where the Flower apps take it; must raise InputError."""
    if case.where == "run-config":
        parse_run_config(case.args[0])
    elif case.where == "node-config":
        parse_node_config(case.args[0])
    elif case.where == "csv":
        load_dataset("csv", file, label="y", num_classes=case.args[0])
    else:  # results-dir: the ServerApp refuses before it writes anything
        config = {**app_defaults(), "results-dir": str(file / "results")}
        run_server(server_app, InProcessGrid.simulation(None, 2, config), config)


def test_the_catalogue_holds_at_least_forty_cases_across_every_category():
    assert len(CASES) >= 40
    assert {c.where for c in CASES} == {"cli", "run-config", "node-config", "csv", "results-dir"}
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_naming_field_value_and_what_is_allowed(fedprivacy_cli, case, tmp_path, monkeypatch):
    inputs, work = tmp_path / "inputs", tmp_path / "work"
    inputs.mkdir(), work.mkdir()
    monkeypatch.chdir(work)
    file = case.make(inputs) if case.make else None
    if case.where == "cli":
        args = [a.replace("{file}", str(file)).replace("{folder}", str(inputs)) for a in case.args]
        monkeypatch.setattr(ledger_cli, "OPERATOR_WAIT_S", 0.2)
        holder = None
        if file is not None and file.name == "locked.sqlite":
            holder = sqlite3.connect(file, isolation_level=None)
            holder.execute("BEGIN EXCLUSIVE")
        try:
            code, out, err = fedprivacy_cli(*args)
        finally:
            if holder is not None:
                holder.close()
        assert code == 2 and out == "", (code, out, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        message = lines[0].removeprefix("error: ")
    else:
        with pytest.raises(InputError) as raised:
            attempt_library(case, file)
        assert raised.value.field == case.field
        message = str(raised.value)
        assert "\n" not in message
    if message.startswith("Invalid value for"):  # a choice Click checked: "'--rule': 'magic' is not one of …"
        assert f"'--{case.field}'" in message and f"'{case.shows}' is not one of" in message, message
        return
    assert message.startswith(f"{case.field}="), message
    value, allowed = message[len(case.field) + 1 :].split(": ", 1)
    assert case.shows in value and len(allowed) > 10, message
    assert list(work.iterdir()) == [], "partial output"  # no sheets, no results folder
    assert not list(inputs.glob("**/results*")), "partial output"


@pytest.mark.parametrize(
    ("n", "epsilon", "delta", "rule"),
    [
        (5736, 0.01, 1e-5, "proactive"),
        (5736, 100.0, 1e-5, "proactive"),
        (5736, 100.0, 1e-5, "calibrated"),
        (10**9, 1.0, 1e-10, "proactive"),
        (2, 1.0, 0.49, "proactive"),
    ],
)
def test_extreme_but_valid_inputs_get_a_certified_plan(n, epsilon, delta, rule):
    """The edges of the limits (docs/privacy.md, "Limits") get correct answers, not refusals or blow-ups
    (their memory and time were measured by hand: README)."""
    from fedprivacy.privacy.planner import plan_client

    plan = plan_client(n, epsilon, delta, rule=rule)
    assert plan.epsilon_pld <= epsilon and plan.steps >= 1


def test_a_csv_with_a_byte_order_mark_reads_like_one_without(tmp_path):
    plain, marked = tmp_path / "plain.csv", tmp_path / "marked.csv"
    text = "x,y\n1,0\n2,1\n3,0\n"
    plain.write_text(text, encoding="utf-8")
    marked.write_text(text, encoding="utf-8-sig")
    assert marked.read_bytes().startswith(b"\xef\xbb\xbf")
    a, b = (load_dataset("csv", path, label="x", num_classes=4) for path in (plain, marked))
    assert a.feature_names == b.feature_names == ("y",) and (a.labels == b.labels).all()


# ---------------- schedules that sample (almost) nothing ----------------
# epochs = 1e-9 used to plan q = 1e-9 (T = ⌈2k²/ε⌉ = 1): the σ calibration then allocated until the
# process died, and the proactive rule raised a bare "math domain error". Such schedules are refused
# in one line naming the input that set q, before any accountant work, for every rule.

from fedprivacy.plans import plan_from_settings  # noqa: E402
from fedprivacy.privacy import limits  # noqa: E402
from fedprivacy.privacy.planner import plan_client  # noqa: E402

RULES = ("proactive", "calibrated", "adp")
TINY_SCHEDULES = [  # (schedule inputs for N = 5736, the field the refusal names)
    (dict(epochs=1e-9), "epochs"),  # the audit's case: q = 1e-9, T = 1
    (dict(epochs=1e-4, steps=1), "epochs"),  # q·N = 0.57
    (dict(epochs=1e-300), "epochs"),
    (dict(sampling_rate=limits.SAMPLING_RATE_MIN / 10), "sampling-rate"),  # below the minimum rate
    (dict(sampling_rate=1e-5, epochs=1e-5), "sampling-rate"),  # q·N = 0.057
    (dict(sampling_rate=1e-5, steps=10), "sampling-rate"),
    (dict(expected_batch_size=0.5, steps=10), "batch-size"),
    (dict(expected_batch_size=1e-6), "batch-size"),
    (dict(steps=10**6), "steps"),  # the default k over 10⁶ steps: q·N = 0.03
    (dict(epochs=1e155), "epochs"),  # T ≥ k > STEPS_MAX (2k²/ε overflowed a float)
]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize(("schedule", "field"), TINY_SCHEDULES, ids=[f"{f}:{s}" for s, f in TINY_SCHEDULES])
def test_a_schedule_sampling_under_one_record_per_step_is_refused_quickly_by_every_rule(
    rule, schedule, field, monkeypatch
):
    from fedprivacy.privacy import accountants

    def no_accountant(*_args, **_kwargs):
        raise AssertionError("the accountant ran before the schedule was checked")

    for name in ("calibrate_pld", "calibrate_rdp", "pld_epsilon", "rdp_epsilon"):
        monkeypatch.setattr(accountants, name, no_accountant)
    with pytest.raises(InputError) as refused:
        plan_client(5736, 1.0, 1e-5, rule=rule, **schedule)
    message = str(refused.value)
    assert refused.value.field == field and message.startswith(f"{field}=") and "\n" not in message, message
    assert "[" in message and "]" in message, message  # the allowed range


@pytest.mark.timeout(20)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize(
    ("flags", "field", "shows"),
    [
        (("--epochs", "1e-9"), "epochs", "1e-09"),
        (("--sampling-rate", "1e-10"), "sampling-rate", "1e-10"),
        (("--sampling-rate", "0.0001", "--steps", "10"), "sampling-rate", "0.0001"),
        (("--batch-size", "0.5"), "batch-size", "0.5"),
    ],
)
def test_the_cli_refuses_a_schedule_sampling_under_one_record_per_step(
    fedprivacy_cli, rule, flags, field, shows, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    code, out, err = fedprivacy_cli(*PLAN, "--epsilon", "1", "--delta", "1e-5", "--rule", rule, *flags)
    assert code == 2 and out == "", (code, out, err)
    (line,) = err.strip().splitlines()
    assert line.startswith(f"error: {field}={shows}: ") and "q·N" in line, line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(20)
@pytest.mark.parametrize("rule", RULES)
def test_a_run_config_with_tiny_epochs_is_refused_when_a_client_plans(rule, tmp_path):
    """The run config (and a scenario's [run] table, which becomes one) passes `epochs` to every
    client's planner: each client refuses it in one line instead of calibrating for ever."""
    from fedprivacy.runconfig import parse_run_config

    settings = parse_run_config({"epochs": 1e-9, "rule": rule, "results-dir": str(tmp_path / "r")})
    with pytest.raises(InputError) as refused:
        plan_from_settings(settings, 5736, 1.0, 1e-5, "c0", compare=False)
    assert refused.value.field == "epochs" and "q·N" in str(refused.value)


@pytest.mark.parametrize("rule", RULES)
def test_a_batch_of_exactly_one_record_plans(rule):
    """q·N = 1 is the edge, not a refusal (q = 1/N rounds either way in floating point)."""
    for n in (49, 5736):
        plan = plan_client(n, 1.0, 0.5 / n, rule=rule, expected_batch_size=1, epochs=1, compare=False)
        assert plan.sampling_rate * n == pytest.approx(1.0) and plan.epsilon_pld <= 1.0


def test_a_ledger_path_that_cannot_be_created_is_refused_in_one_line(tmp_path):
    """A file stands where the ledger's folder should be: the ledger names the path and why."""
    from fedprivacy.ledger import Ledger

    (tmp_path / "taken").write_text("a file, not a folder")
    path = tmp_path / "taken" / "ledger.sqlite"
    with pytest.raises(InputError) as refused:
        Ledger(path)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"ledger-path={str(path)!r}"), message
    assert "cannot create a ledger there" in message


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "x"])
def test_a_clip_norm_outside_its_range_is_refused_naming_the_range(value):
    """Zero and negative norms name the same range as a norm too small or too large."""
    with pytest.raises(InputError, match=r"clip-norm=.*: must be a finite number in \[1e-06, 1e\+06\]"):
        limits.clip_norm("clip-norm", value)


def test_a_node_config_missing_required_keys_names_every_one():
    """The keys a SuperNode must be given, all of them, before the template that shows how."""
    with pytest.raises(InputError) as refused:
        parse_node_config({"client-id": "a", "data-path": "/data/a.csv", "epsilon": 1.0})
    assert refused.value.field == "delta"
    assert str(refused.value).startswith(
        "delta=None: missing from the node config (delta, public-size not given): a deployed SuperNode needs"
    )
