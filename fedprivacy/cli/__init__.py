"""The `fedprivacy` command: plan a client, write sheets, list feasible plans, sweep and report,
and look after a privacy ledger. One module per group of commands:

- `planning`: `plan`, `sheets`, `calculator`;
- `sweeps`: `sweep`, `report` (the sweep machinery in sims/ is imported inside the command);
- `ledger`: `ledger show`, `ledger set-budget`;
- `common`: one-line errors with exit code 2, and the choices `--help` lists.
"""

from __future__ import annotations

import re
import sys

import click
import typer

from fedprivacy import __version__
from fedprivacy.cli import ledger, planning, sweeps

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Federated, proactive DP-SGD: plan and certify each client's privacy budget, run and sweep federations.",
)
app.registered_commands += planning.app.registered_commands + sweeps.app.registered_commands
app.add_typer(ledger.app, name="ledger")


def _version(shown: bool) -> None:
    if shown:
        typer.echo(f"fedprivacy {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="print the version and exit"
    ),
) -> None:
    """Federated, proactive DP-SGD: plan and certify each client's privacy budget, run and sweep federations."""


_HINT = re.compile(r" ?\(?Did you mean [^?]*\?\)?")


def _once(message: str) -> str:
    """Click (from 8.2) and typer each add a "Did you mean …?" to an unknown command: the first only."""
    hints = _HINT.findall(message)
    if len(hints) < 2:
        return message
    first = message.index(hints[0]) + len(hints[0])
    return message[:first] + _HINT.sub("", message[first:])


def main() -> None:
    """The `fedprivacy` command. Click's own errors (a non-number, an unknown or missing option)
    become one line too, instead of a usage box, with Click's exit codes (2 for usage errors)."""
    try:
        code = app(standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError:  # the help has been printed
        sys.exit(2)
    except click.UsageError as error:
        command = error.ctx.command_path if error.ctx else "fedprivacy"
        typer.echo(f"error: {_once(error.format_message())} (see: {command} --help)", err=True)
        sys.exit(error.exit_code)
    except click.ClickException as error:
        typer.echo(f"error: {error.format_message()}", err=True)
        sys.exit(error.exit_code)
    except click.Abort:  # Ctrl-C, as Click's standalone mode reports it
        typer.echo("Aborted!", err=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
