"""`fedprivacy plan`, `sheets` and `calculator`: one client's plan, a sheet per client of a CSV,
and every feasible plan ranked a priori."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from fedprivacy.cli.common import (
    Adjacency,
    AdjacencyOption,
    AlphaSchedule,
    ClipNormOption,
    DeltaOption,
    EpsilonOption,
    Level,
    LrSchedule,
    RoundsOption,
    Rule,
    RuleOption,
    SizeOption,
    guarded,
    value,
)
from fedprivacy.errors import InputError
from fedprivacy.privacy.plan import RELEASED_MECHANISM

ENFORCED_BY = "the server of a run with federation-epsilon (fedprivacy.client_level)"

app = typer.Typer()


def _write_sheets(plans: list[Any], out: Path, **options: Any) -> list[Path]:
    """write_sheets, with an unwritable `--out` (a file, no permission, a full disk) as a user error."""
    from fedprivacy.reports.sheets import write_sheets

    try:
        return write_sheets(plans, out, **options)
    except OSError as error:
        raise InputError("out", str(out), f"cannot write the sheets there: {error.strerror or error}") from None


RECORD_LABELS = {
    "size": "N, ε, δ",
    "rate": "q (Poisson rate) / expected batch",
    "steps": "T steps / epochs k",
    "noise": "noise std on averaged gradient",
}
FEDERATION_LABELS = {
    "size": "members M, ε, δ",
    "rate": "p (Poisson participation rate) / expected cohort pM",
    "steps": "rounds / participations per member k = pR",
    "noise": "noise std on the averaged update, σS/(pM)",
}


def _plan_table(plan: Any, spent: dict[str, float], federation: bool = False) -> Table:
    """The plan, with `spent`: its PLD ε under each neighbour relation (the one it was planned for
    marked); `federation`: in the federation's words (members, rounds, cohort)."""
    from fedprivacy.privacy.federation import RELEASED_AGGREGATE

    label = FEDERATION_LABELS if federation else RECORD_LABELS
    table = Table(title=f"{plan.rule.capitalize()} plan for {plan.client_id}", show_header=True)
    table.add_column("quantity")
    table.add_column("value", justify="right")
    rows = [
        (label["size"], f"{plan.n}, {plan.epsilon:g}, {plan.delta:.3g}"),
        ("neighbours", "add/remove one member; M public" if federation else plan.neighbours),
        ("σ (noise multiplier)", f"{plan.sigma:.4f}"),
        (label["rate"], f"{plan.sampling_rate:.4g} / {plan.expected_batch_size:.1f}"),
        (label["steps"], f"{plan.steps} / {plan.epochs:.3g}"),
        (
            "certified ε: PLD / RDP",
            f"{plan.epsilon_pld:.4f} / " + ("n/a" if plan.epsilon_rdp is None else f"{plan.epsilon_rdp:.4f}"),
        ),
        ("budget unused", f"{plan.budget_unused:.4f}"),
        *(
            (
                f"ε of this plan, {relation} (PLD)",
                f"{epsilon:.4f}" + (" (planned)" if relation == plan.neighbours else ""),
            )
            for relation, epsilon in spent.items()
        ),
        (label["noise"], f"{plan.noise_std_on_mean:.4g}"),
        ("released mechanism", RELEASED_AGGREGATE if federation else RELEASED_MECHANISM),
        *((("enforced by", ENFORCED_BY),) if federation else ()),
    ]
    rows += [
        (f"σ {name}", "n/a" if v is None else f"{v:.4g}")
        for name, v in plan.sigma_by_rule.items()
        if not (federation and name == "adp")  # ADP-SGD follows a local step size: no rule for a federation
    ]
    rows += [
        (
            f"condition {c.name}",
            ("met" if c.met else "[red]NOT met[/red]") + ("" if c.kind == "required" else " (info)"),
        )
        for c in plan.conditions
    ]
    for name, cell in rows:
        table.add_row(name, cell)
    return table


@app.command()
def plan(
    n: SizeOption,
    epsilon: EpsilonOption,
    delta: DeltaOption = 1e-5,
    rule: RuleOption = Rule("proactive"),
    clip_norm: ClipNormOption = 1.0,
    epochs: Annotated[
        float | None,
        typer.Option("--epochs", help="epochs k = qT (default: the smallest k meeting the proactive ln N condition)"),
    ] = None,
    sampling_rate: Annotated[
        float | None, typer.Option("--sampling-rate", help="Poisson sampling rate q in (0, 1]")
    ] = None,
    batch_size: Annotated[
        float | None, typer.Option("--batch-size", help="expected batch size qN (instead of --sampling-rate)")
    ] = None,
    steps: Annotated[int | None, typer.Option("--steps", help="total local steps T")] = None,
    rounds: Annotated[
        int | None,
        typer.Option(
            "--rounds", help="federated rounds the steps are split over (default 1); with --level federation, required"
        ),
    ] = None,
    client_id: Annotated[str, typer.Option("--client-id", help="the name on the plan and its sheet")] = "client",
    learning_rate: Annotated[float, typer.Option("--learning-rate", help="the step size η")] = 0.1,
    lr_schedule: Annotated[
        LrSchedule | None, typer.Option("--lr-schedule", help="default: constant (adp: inverse_sqrt)")
    ] = None,
    alpha_schedule: Annotated[
        AlphaSchedule | None, typer.Option("--alpha-schedule", help="the noise schedule α_t of rule adp")
    ] = None,
    alpha_power: Annotated[
        float, typer.Option("--alpha-power", help="p in [0, 1] of the power schedule α_t² ∝ t^p")
    ] = 0.5,
    adjacency: AdjacencyOption = Adjacency("add-remove"),
    level: Annotated[
        Level,
        typer.Option(
            "--level",
            help="record: a client's DP-SGD over its N records; federation: client-level DP-FedAvg over N "
            "members, one noisy aggregation per round (--rounds), --batch-size the expected cohort, --epochs "
            "the participations per member, --clip-norm the update clip S",
        ),
    ] = Level("record"),
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as one JSON object and nothing else")] = False,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="also write the planning sheet (md, html, png, json) into this folder"),
    ] = None,
) -> None:
    """Plan, certify and explain one client's DP-SGD parameters (or, with --level federation, the
    federation's client-level plan), and the ε the plan spends under each neighbour relation
    (add/remove and replace-one) without recalibrating it."""
    from fedprivacy.privacy import limits
    from fedprivacy.privacy.planner import plan_client
    from fedprivacy.privacy.relations import epsilon_by_neighbours

    if value(level) == "federation":
        _plan_federation(
            n,
            epsilon,
            delta,
            value(rule),
            clip_norm,
            epochs,
            sampling_rate,
            batch_size,
            rounds,
            {
                "steps": steps,
                "lr-schedule": lr_schedule,
                "alpha-schedule": alpha_schedule,
                "out": out,
                "learning-rate": None if learning_rate == RECORD_DEFAULTS["learning-rate"] else learning_rate,
                "alpha-power": None if alpha_power == RECORD_DEFAULTS["alpha-power"] else alpha_power,
                "client-id": None if client_id == RECORD_DEFAULTS["client-id"] else client_id,
            },
            value(adjacency),
            as_json,
        )
        return

    the_plan = guarded(
        lambda: plan_client(
            n,
            epsilon,
            delta,
            rule=value(rule),
            clip_norm=limits.clip_norm("clip-norm", clip_norm),
            epochs=epochs,
            sampling_rate=sampling_rate,
            expected_batch_size=batch_size,
            steps=steps,
            rounds=1 if rounds is None else rounds,
            client_id=client_id,
            learning_rate=learning_rate,
            lr_schedule=value(lr_schedule),
            alpha_schedule=value(alpha_schedule),
            alpha_power=alpha_power,
            neighbours=value(adjacency),
        )
    )
    spent = epsilon_by_neighbours(the_plan)
    written = guarded(lambda: _write_sheets([the_plan], out, index=False)) if out is not None else []
    if as_json:
        sys.stdout.write(json.dumps({**the_plan.to_dict(), "epsilon_by_neighbours": spent}, allow_nan=False) + "\n")
        return
    console = Console()
    console.print(_plan_table(the_plan, spent))
    if written:
        console.print(f"planning sheet: {out / (written[0].stem + '.html')}")


RECORD_ONLY = {  # options of a client's plan that a federation's has no use for, and why
    "steps": "a federation runs one noisy aggregation per round: give --rounds",
    "lr-schedule": "a federation's plan has no local step size",
    "alpha-schedule": "a federation's plan has no local step size",
    "learning-rate": "a federation's plan has no local step size",
    "alpha-power": "a federation's plan has no local step size",
    "client-id": "the federation's plan is named 'federation'",
    "out": "the planning sheet is a client's; print the federation's plan with --json",
}
RECORD_DEFAULTS = {"learning-rate": 0.1, "alpha-power": 0.5, "client-id": "client"}  # plan's defaults, as declared
CLIENT_FIELDS = ("learning_rate", "lr_schedule", "lr_params", "alpha_schedule", "alpha_params")  # not a federation's


def _plan_federation(
    members: int,
    epsilon: float,
    delta: float,
    rule: str,
    update_clip: float,
    participations: float | None,
    participation_rate: float | None,
    cohort: float | None,
    rounds: int | None,
    record_only: dict[str, Any],
    adjacency: str,
    as_json: bool,
) -> None:
    """`fedprivacy plan --level federation`: the federation's plan, printed or as JSON."""
    from fedprivacy.privacy import limits
    from fedprivacy.privacy.federation import RELEASED_AGGREGATE, plan_federation

    def build() -> Any:
        given = next((key for key, option in record_only.items() if option is not None), None)
        if given is not None:
            raise InputError(
                given,
                str(getattr(record_only[given], "value", record_only[given])),
                RECORD_ONLY[given],
            )
        if adjacency != "add-remove":
            raise InputError("adjacency", adjacency, "a federation plans add/remove of one member (M public)")
        if rounds is None:
            raise InputError(
                "rounds",
                None,
                f"--level federation needs --rounds R, the federation's rounds, an integer in [1, {limits.ROUNDS_MAX}]",
            )
        return plan_federation(
            members,
            epsilon,
            delta,
            rounds,
            rule=rule,
            update_clip=limits.clip_norm("clip-norm", update_clip),
            participations=participations,
            participation_rate=participation_rate,
            expected_cohort=cohort,
        )

    the_plan = guarded(build)
    if as_json:
        fields = {key: v for key, v in the_plan.to_dict().items() if key not in CLIENT_FIELDS}
        fields["sigma_by_rule"] = {rule: v for rule, v in fields["sigma_by_rule"].items() if rule != "adp"}
        printed = {
            **fields,
            "released_mechanism": RELEASED_AGGREGATE,
            "level": "federation",
            "enforced_by": ENFORCED_BY,
        }
        sys.stdout.write(json.dumps(printed, allow_nan=False) + "\n")
        return
    Console().print(_plan_table(the_plan, {"add-remove": the_plan.epsilon_pld}, federation=True))


@app.command()
def sheets(
    data: Annotated[Path, typer.Option("--data", help="CSV file with one row per record")],
    partition_by: Annotated[str, typer.Option("--partition-by", help="the column whose values are the clients")],
    epsilon: Annotated[
        float | None, typer.Option("--epsilon", help="target ε of every client [default: 1.0]", show_default=False)
    ] = None,
    epsilons: Annotated[
        str | None,
        typer.Option("--epsilons", help="one ε per client, comma-separated, in sorted client order"),
    ] = None,
    delta: Annotated[float, typer.Option("--delta", help="target δ, below 1/N of every client")] = 1e-5,
    rule: RuleOption = Rule("proactive"),
    clip_norm: ClipNormOption = 1.0,
    epochs: Annotated[float | None, typer.Option("--epochs", help="epochs k = qT")] = None,
    rounds: RoundsOption = 1,
    adjacency: AdjacencyOption = Adjacency("add-remove"),
    out: Annotated[Path, typer.Option("--out", help="folder for the sheets and the index")] = Path("sheets"),
) -> None:
    """One planning sheet per client of a CSV split by a column, plus an index."""
    from fedprivacy.data.tables import partition_sizes, read_table
    from fedprivacy.privacy import limits
    from fedprivacy.privacy.planner import plan_client
    from fedprivacy.runconfig import one_per_client
    from fedprivacy.runconfig_keys import per_client_values

    console = Console(stderr=True)

    def build() -> list[Any]:
        limits.clip_norm("clip-norm", clip_norm)
        sizes = partition_sizes(read_table(data, [partition_by], {partition_by: "partition-by"}), partition_by)
        if epsilon is not None and epsilons is not None:
            raise InputError("epsilons", epsilons, "give either --epsilon (every client) or --epsilons, not both")
        given = per_client_values("epsilons", epsilons or "", limits.epsilon, "0.5,1,2")
        budgets = (
            one_per_client("epsilons", given, len(sizes))
            if given
            else (1.0 if epsilon is None else epsilon,) * len(sizes)
        )
        plans = []
        # off where stderr is not a terminal: a refusal then is the only line there
        with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
            task = progress.add_task("planning clients", total=len(sizes))
            for (client, size), budget in zip(sizes.items(), budgets, strict=True):
                plans.append(
                    plan_client(
                        size,
                        budget,
                        delta,
                        rule=value(rule),
                        clip_norm=clip_norm,
                        epochs=epochs,
                        rounds=rounds,
                        client_id=f"{partition_by}-{client}",
                        neighbours=value(adjacency),
                    )
                )
                progress.advance(task)
        return plans

    plans = guarded(build)
    with console.status("writing sheets"):
        guarded(lambda: _write_sheets(plans, out))
    table = Table(title=f"{len(plans)} clients of {data.name} by {partition_by}")
    for column in ("client", "N", "ε", "σ", "q", "T", "PLD ε", "unused"):
        table.add_column(column, justify="right")
    for p in plans:
        table.add_row(
            p.client_id,
            str(p.n),
            f"{p.epsilon:g}",
            f"{p.sigma:.3f}",
            f"{p.sampling_rate:.3g}",
            str(p.steps),
            f"{p.epsilon_pld:.3f}",
            f"{p.budget_unused:.3f}",
        )
    Console().print(table)
    Console().print(f"sheets and index: {out / 'index.html'}")


@app.command()
def calculator(
    n: SizeOption,
    epsilon: EpsilonOption,
    delta: DeltaOption = 1e-5,
    rule: RuleOption = Rule("calibrated"),
    clip_norm: ClipNormOption = 1.0,
    adjacency: AdjacencyOption = Adjacency("add-remove"),
    as_json: Annotated[bool, typer.Option("--json", help="print the table as a JSON list")] = False,
) -> None:
    """List every feasible plan over a grid of epochs and sampling rates, ranked a priori."""
    from fedprivacy.privacy import limits
    from fedprivacy.privacy.calculator import DEFAULT_EPOCHS, DEFAULT_RATES, UTILITY_PROXY, feasible_plans, usable_rates
    from fedprivacy.privacy.planner import below_one_over_n

    def run() -> list[Any]:
        below_one_over_n(delta, limits.records("n", n))
        limits.epsilon("epsilon", epsilon)
        limits.clip_norm("clip-norm", clip_norm)
        with Progress(console=Console(stderr=True), transient=True, disable=as_json) as progress:
            task = progress.add_task("certifying grid", total=None)
            return feasible_plans(
                n,
                epsilon,
                delta,
                rule=value(rule),
                clip_norm=clip_norm,
                neighbours=value(adjacency),
                on_progress=lambda done, total: progress.update(task, completed=done, total=total),
            )

    rows = guarded(run)
    if as_json:
        sys.stdout.write(json.dumps([r.to_dict() for r in rows]) + "\n")
        return
    rates = usable_rates(n)
    refused = len(DEFAULT_EPOCHS) * len(rates) - len(rows)
    left_out = []
    if len(rates) < len(DEFAULT_RATES):
        too_small = ", ".join(f"{q:g}" for q in DEFAULT_RATES if q not in rates)
        left_out.append(f"q = {too_small}: an expected batch below one record")
    if refused:
        left_out.append(f"{refused} grid point{'s' if refused > 1 else ''} the rule does not certify")
    table = Table(
        title=f"Feasible plans for N={n}, ε={epsilon:g}, δ={delta:.2g} ({value(rule)}, {value(adjacency)}); "
        f"ranked by {UTILITY_PROXY}",
        caption=f"left out: {'; '.join(left_out)}" if left_out else None,
    )
    for column in ("k", "q", "batch", "T", "σ", "σC/(qN)", "PLD ε", "rank"):
        table.add_column(column, justify="right")
    for r in rows:
        d = r.to_dict()
        table.add_row(
            f"{d['epochs']:.3g}",
            f"{d['sampling_rate']:.3g}",
            f"{d['expected_batch_size']:.1f}",
            str(d["steps"]),
            f"{d['sigma']:.3f}",
            f"{d['noise_std_on_mean']:.3g}",
            f"{d['epsilon_pld']:.3f}",
            ("[bold green]1[/bold green]" if r.rank == 1 else str(r.rank)),
        )
    Console().print(table)
