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


def test_show_folds_long_accounts_on_a_narrow_terminal_never_cuts_them(tmp_path):
    """set-budget takes an account as show lists it: at 60 columns a file account's 30 characters
    are folded over lines, whole."""
    path = tmp_path / "ledger.sqlite"
    account = "file:0123456789abcdef/PUMA-1101"
    Ledger(path).open_account(account, 1.0, 1e-5)
    result = subprocess.run(
        [sys.executable, "-m", "fedprivacy", "ledger", "show", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "60"},
    )
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("│")]
    cells = "".join(line.split("│")[1].strip() for line in rows)
    assert cells == account and "…" not in result.stdout


def test_set_budget_asks_and_changes_only_what_the_operator_confirms(ledger):
    declined = fedprivacy(
        "ledger", "set-budget", str(ledger), "data:aaa", "--epsilon", "3", "--delta", "1e-5", stdin="n\n"
    )
    assert declined.returncode == 1 and Ledger(ledger).budget("data:aaa").epsilon == 1.0
    done = fedprivacy("ledger", "set-budget", str(ledger), "data:aaa", "--epsilon", "3", "--delta", "1e-5", "--yes")
    assert done.returncode == 0, done.stderr
    assert "data:aaa: ε=3, δ=1e-05 (was ε=1, δ=1e-05)" in done.stdout
    assert Ledger(ledger).budget("data:aaa").epsilon == 3.0 and Ledger(ledger).steps_spent("data:aaa") == 120


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
