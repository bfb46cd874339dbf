"""What every `fedprivacy` command shares: one-line errors, and the choices `--help` lists.

Bad input never produces a traceback or partial files: a command prints one line naming the field,
the value and what is allowed, and exits with code 2 (the code Click uses for usage errors).
Choices are Enums made from the library's own lists, so `--help` and the checks never disagree.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Annotated, TypeVar

import typer

from fedprivacy.catalog import RULE_NAMES
from fedprivacy.errors import InputError, PlanRefused
from fedprivacy.privacy.plan import ALPHA_SCHEDULES, LR_SCHEDULES, NEIGHBOUR_RELATIONS

T = TypeVar("T")


def guarded(action: Callable[[], T]) -> T:
    """Run `action`; turn user errors into one line on stderr and exit code 2."""
    try:
        return action()
    except (InputError, PlanRefused) as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(code=2) from None


def choices(name: str, values: tuple[str, ...]) -> type[Enum]:
    """An Enum of `values`, which typer shows in `--help` and checks."""
    return Enum(name, {v: v for v in values}, type=str)  # type: ignore[return-value]


Rule = choices("Rule", RULE_NAMES)
LrSchedule = choices("LrSchedule", LR_SCHEDULES)
AlphaSchedule = choices("AlphaSchedule", ALPHA_SCHEDULES)
Adjacency = choices("Adjacency", tuple(NEIGHBOUR_RELATIONS))
Level = choices("Level", ("record", "federation"))
RULE_HELP = (
    "proactive: σ of the proactive rule; calibrated: the smallest σ PLD certifies; "
    "calibrated-rdp: the smallest σ RDP certifies; adp: ADP-SGD's schedule"
)

# The options every planning command takes, declared once.
SizeOption = Annotated[int, typer.Option("--n", help="local data size N of the client")]
EpsilonOption = Annotated[float, typer.Option("--epsilon", help="target ε (0.01 to 100)")]
DeltaOption = Annotated[float, typer.Option("--delta", help="target δ, below 1/N")]
RuleOption = Annotated[Rule, typer.Option("--rule", help=RULE_HELP)]
ClipNormOption = Annotated[float, typer.Option("--clip-norm", help="per-example clipping norm C (1e-6 to 1e6)")]
RoundsOption = Annotated[int, typer.Option("--rounds", help="federated rounds the steps are split over")]
AdjacencyOption = Annotated[
    Adjacency,
    typer.Option(
        "--adjacency",
        help="the neighbour relation ε holds for: add-remove (N public: what a run plans) or replace-one "
        "(N may be the real size)",
    ),
]


def value(choice: Enum | None) -> str | None:
    """An Enum choice as the library takes it (its string), None left alone."""
    return None if choice is None else str(choice.value)
