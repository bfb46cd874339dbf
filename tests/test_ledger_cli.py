"""`fedprivacy ledger`: the node operator's view and the one way to change a budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from independent import CERTIFICATE_REL_TOL, pld_epsilon

from fedprivacy.ledger import Ledger
from fedprivacy.privacy.accountants import NoiseEvent


def fedprivacy(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fedprivacy", *args], input=stdin, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def ledger(tmp_path) -> Path:
    path = tmp_path / "ledger.sqlite"
    book = Ledger(path)
    book.open_account("data:aaa", 1.0, 1e-5)
    book.record("data:aaa", "7", 1, [NoiseEvent(3.0, 0.05, 100)])
    book.record("data:aaa", "8", 1, [NoiseEvent(3.0, 0.05, 20)])
    book.open_account("data:bbb", 2.0, 1e-6)
    return path


def test_show_lists_each_account_with_its_spend(ledger):
    result = fedprivacy("ledger", "show", str(ledger), "--json")
    assert result.returncode == 0, result.stderr
    accounts = {a["account"]: a for a in json.loads(result.stdout)}
    a = accounts["data:aaa"]
    assert (a["epsilon"], a["delta"], a["steps"], a["runs"]) == (1.0, 1e-5, 120, 2)
    assert a["epsilon_spent"] == pytest.approx(pld_epsilon([(3.0, 0.05, 120)], 1e-5), rel=CERTIFICATE_REL_TOL)
    assert a["epsilon_left"] == pytest.approx(1.0 - a["epsilon_spent"])
    assert accounts["data:bbb"]["steps"] == 0 and accounts["data:bbb"]["epsilon_spent"] == 0.0
    table = fedprivacy("ledger", "show", str(ledger))
    assert table.returncode == 0 and "data:aaa" in table.stdout and "2 account(s)" in table.stdout


@pytest.mark.parametrize("columns", [60, 200])
def test_show_prints_each_account_whole_on_one_line_at_any_width(tmp_path, columns):
    """set-budget takes an account as show lists it: a table where one fits, else an account per
    line with its figures below; an account is never folded, cut or read as markup."""
    path = tmp_path / "ledger.sqlite"
    account = "file:0123456789abcdef/[red]PUMA-1101"
    Ledger(path).open_account(account, 1.0, 1e-5)
    result = subprocess.run(
        [sys.executable, "-m", "fedprivacy", "ledger", "show", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": str(columns)},
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "…" not in result.stdout and sum(account in line for line in lines) == 1
    if columns == 60:
        below = lines[lines.index(account) + 1].split()
        assert below[:3] == ["ε", "budget", "1"] and "left" in below
    else:
        assert any(line.startswith("│ " + account) and "1.0000" in line for line in lines)


def test_an_empty_file_is_refused_and_left_empty(tmp_path):
    """SQLite would turn an empty file into a ledger: an operator's command never creates one."""
    empty = tmp_path / "empty.sqlite"
    empty.touch()
    result = fedprivacy("ledger", "show", str(empty))
    assert result.returncode == 2 and "an empty file, not a ledger" in result.stderr
    assert empty.stat().st_size == 0


def test_set_budget_asks_and_changes_only_what_the_operator_confirms(ledger):
    declined = fedprivacy(
        "ledger", "set-budget", str(ledger), "data:aaa", "--epsilon", "3", "--delta", "1e-5", stdin="n\n"
    )
    assert declined.returncode == 1 and Ledger(ledger).budget("data:aaa").epsilon == 1.0
    done = fedprivacy("ledger", "set-budget", str(ledger), "data:aaa", "--epsilon", "3", "--delta", "1e-5", "--yes")
    assert done.returncode == 0, done.stderr
    assert "data:aaa: ε=3, δ=1e-05 (was ε=1, δ=1e-05)" in done.stdout
    assert Ledger(ledger).budget("data:aaa").epsilon == 3.0 and Ledger(ledger).steps_spent("data:aaa") == 120
    spent = pld_epsilon([(3.0, 0.05, 120)], 1e-5)
    below = fedprivacy(
        "ledger", "set-budget", str(ledger), "data:aaa", "--epsilon", f"{spent / 2:.4f}", "--delta", "1e-5", "--yes"
    )
    assert (
        below.returncode == 0
        and f"has already spent ε={spent:.4f} at δ=1e-05: it trains no further round" in below.stdout
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["show", "{missing}"], "ledger='{missing}': no such file"),
        (
            ["set-budget", "{ledger}", "data:zzz", "--epsilon", "2", "--delta", "1e-5", "--yes"],
            "account='data:zzz': no such account",
        ),
        (
            ["set-budget", "{ledger}", "data:aaa", "--epsilon", "-2", "--delta", "1e-5", "--yes"],
            "epsilon=-2.0: must be a finite number in [0.01, 100]",
        ),
        (
            ["set-budget", "{ledger}", "data:aaa", "--epsilon", "2", "--delta", "1.5", "--yes"],
            "delta=1.5: must be a number in the open interval",
        ),
    ],
)
def test_bad_ledger_commands_are_one_line_and_exit_2(ledger, tmp_path, args, message):
    fill = {"ledger": str(ledger), "missing": str(tmp_path / "none.sqlite")}
    result = fedprivacy("ledger", *[a.format(**fill) for a in args])
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and message.format(**fill) in result.stderr
