"""`fedprivacy ledger`: a node operator's view of a privacy ledger, and the one way to change a budget.

Budgets belong to the data owner: the ClientApp pins an account's (ε, δ) on first use and never
changes it. Raising (or lowering) a budget is a deliberate, local act, done here.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import typer
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from fedprivacy import errors
from fedprivacy.cli.common import guarded
from fedprivacy.errors import InputError
from fedprivacy.privacy import limits

app = typer.Typer(
    no_args_is_help=True,
    help="A node operator's view of a privacy ledger, and the one way to change a budget.",
)
OPERATOR_WAIT_S = 5.0  # an operator waits this long for a SuperNode's write, then is told the file is locked


def _open(path: Path):
    from fedprivacy.ledger import Ledger

    if not path.is_file():
        raise InputError("ledger", str(path), "no such file: pass the ledger-path of a SuperNode or run")
    if path.stat().st_size == 0:  # SQLite would make it a ledger: an operator's command never creates one
        raise InputError("ledger", str(path), "an empty file, not a ledger: pass the ledger-path of a SuperNode or run")
    return Ledger(path, busy_timeout=OPERATOR_WAIT_S)


@app.command()
def show(
    path: Path = typer.Argument(..., help="the ledger file (a node's ledger-path)"),
    as_json: bool = typer.Option(False, "--json", help="print the accounts as one JSON list"),
) -> None:
    """Each account's budget, δ, steps, ε spent, ε left and runs."""
    accounts = guarded(lambda: _open(path).accounts())
    if as_json:
        sys.stdout.write(json.dumps([{**asdict(a), "epsilon_left": a.epsilon_left} for a in accounts]) + "\n")
        return
    columns = ("ε budget", "δ", "steps", "ε spent", "ε left", "runs", "last spend (UTC)")
    rows = [
        (
            a.account,
            f"{a.epsilon:g}",
            f"{a.delta:.3g}",
            str(a.steps),
            f"{a.epsilon_spent:.4f}",
            f"{a.epsilon_left:.4f}",
            str(a.runs),
            (a.last_spend or "")[:19] or "-",
        )
        for a in accounts
    ]
    title = f"{len(accounts)} account(s) in {path}"
    table = Table(title=Text(title))
    table.add_column("account", no_wrap=True)
    for column in columns:
        table.add_column(column, justify="right", no_wrap=True)
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))  # an account may hold "[...]": never read as markup
    console = Console()
    if Measurement.get(console, console.options.update(width=10_000), table).maximum <= console.width:
        console.print(table)
        return
    # Too narrow for the table: an account per line, whole (set-budget and accept-data take it as
    # written here), its figures on the line below; nothing is folded or cut.
    console.print(title, soft_wrap=True, highlight=False, markup=False)
    for account, *figures in rows:
        console.print(account, soft_wrap=True, highlight=False, markup=False)
        console.print(
            "  " + "  ".join(f"{c} {v}" for c, v in zip(columns, figures, strict=True)), soft_wrap=True, highlight=False
        )


@app.command("set-budget")
def set_budget(
    path: Path = typer.Argument(..., help="the ledger file"),
    account: str = typer.Argument(..., help="the account, as `fedprivacy ledger show` lists it"),
    epsilon: float = typer.Option(
        ..., "--epsilon", help=f"the new ε budget ({limits.EPSILON_MIN:g} to {limits.EPSILON_MAX:g})"
    ),
    delta: float = typer.Option(..., "--delta", help="the new δ in (0, 1); keep it below 1/N of the data"),
    yes: bool = typer.Option(False, "--yes", help="do not ask for confirmation"),
) -> None:
    """Change an account's (ε, δ): the data owner's decision, never the server's."""

    def change() -> None:
        limits.epsilon("epsilon", epsilon)
        errors.open_unit("delta", delta)
        ledger = _open(path)
        old = ledger.budget(account)
        if old is None:
            raise InputError("account", account, f"no such account in {path}; see: fedprivacy ledger show {path}")
        prompt = f"change {account} from ε={old.epsilon:g}, δ={old.delta:g} to ε={epsilon:g}, δ={delta:g}?"
        if not yes and not typer.confirm(prompt):
            raise typer.Exit(code=1)
        ledger.set_budget(account, epsilon, delta)
        typer.echo(f"{account}: ε={epsilon:g}, δ={delta:g} (was ε={old.epsilon:g}, δ={old.delta:g})")
        spent = ledger.epsilon_spent(account)
        if spent >= epsilon:
            typer.echo(f"{account} has already spent ε={spent:.4f} at δ={delta:g}: it trains no further round")

    guarded(change)


@app.command("accept-data")
def accept_data(
    path: Path = typer.Argument(..., help="the ledger file"),
    account: str = typer.Argument(..., help="the account, as `fedprivacy ledger show` lists it (node:<client-id>)"),
    data: Path = typer.Option(..., "--data", help="the data file the account's records now live in"),
    yes: bool = typer.Option(False, "--yes", help="do not ask for confirmation"),
) -> None:
    """Declare that an account's records now live in another file (rows added or corrected): its
    spends keep counting against the same budget. A different data set needs its own client-id."""

    def accept() -> None:
        from fedprivacy.recipe import file_digest

        if not data.is_file():
            raise InputError("data", str(data), "no such file")
        ledger = _open(path)
        if ledger.budget(account) is None:
            raise InputError("account", account, f"no such account in {path}; see: fedprivacy ledger show {path}")
        if not yes and not typer.confirm(f"count the records of {data} as {account}'s, against its budget?"):
            raise typer.Exit(code=1)
        ledger.accept_data(account, file_digest(data.resolve()))
        typer.echo(f"{account}: its records are now those of {data}")

    guarded(accept)
