"""The `fedprivacy` command: plan one client, write sheets for a partitioned CSV, list feasible plans,
run a sweep of federated runs and report on it.

Bad input never produces a traceback or partial files: it prints one line naming the field,
the value and what is allowed, and exits with code 2 (the code Click uses for usage errors).
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from fedprivacy.errors import InputError, PlanRefused
from fedprivacy.ledger_cli import app as ledger_app

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
app.add_typer(ledger_app, name="ledger")
T = TypeVar("T")

RULE_HELP = "proactive (σ from the proactive rule), calibrated (smallest σ PLD certifies), adp (ADP-SGD schedule)"


def _guarded(action: Callable[[], T]) -> T:
    """Run `action`; turn user errors into one line on stderr and exit code 2."""
    try:
        return action()
    except (InputError, PlanRefused) as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(code=2) from None


def _write_sheets(plans: list[Any], out: Path, **options: Any) -> list[Path]:
    """write_sheets, with an unwritable `--out` (a file, no permission, a full disk) as a user error."""
    from fedprivacy.reports.sheets import write_sheets

    try:
        return write_sheets(plans, out, **options)
    except OSError as error:
        raise InputError("out", str(out), f"cannot write the sheets there: {error.strerror or error}") from None


def _plan_table(plan: Any) -> Table:
    table = Table(title=f"{plan.rule.capitalize()} plan for {plan.client_id}", show_header=True)
    table.add_column("quantity")
    table.add_column("value", justify="right")
    rows = [
        ("N, ε, δ", f"{plan.n}, {plan.epsilon:g}, {plan.delta:.3g}"),
        ("σ (noise multiplier)", f"{plan.sigma:.4f}"),
        ("q (Poisson rate) / expected batch", f"{plan.sampling_rate:.4g} / {plan.expected_batch_size:.1f}"),
        ("T steps / epochs k", f"{plan.steps} / {plan.epochs:.3g}"),
        ("certified ε: PLD / RDP", f"{plan.epsilon_pld:.4f} / {plan.epsilon_rdp:.4f}"),
        ("budget unused", f"{plan.budget_unused:.4f}"),
        ("noise std on averaged gradient", f"{plan.noise_std_on_mean:.4g}"),
    ]
    rows += [(f"σ {name}", "n/a" if value is None else f"{value:.4g}") for name, value in plan.sigma_by_rule.items()]
    rows += [(f"condition {c.name}", ("met" if c.met else "[red]NOT met[/red]") + ("" if c.kind == "required" else " (info)"))
             for c in plan.conditions]
    for name, value in rows:
        table.add_row(name, value)
    return table


@app.command()
def plan(
    n: int = typer.Option(..., "--n", help="local data size N of the client"),
    epsilon: float = typer.Option(..., "--epsilon", help="target ε (finite, > 0)"),
    delta: float = typer.Option(1e-5, "--delta", help="target δ in (0, 1)"),
    rule: str = typer.Option("proactive", "--rule", help=RULE_HELP),
    clip_norm: float = typer.Option(1.0, "--clip-norm", help="per-example clipping norm C"),
    epochs: float | None = typer.Option(None, "--epochs", help="epochs k = qT (default: smallest k meeting the proactive ln N condition)"),
    sampling_rate: float | None = typer.Option(None, "--sampling-rate", help="Poisson sampling rate q in (0, 1]"),
    batch_size: float | None = typer.Option(None, "--batch-size", help="expected batch size qN (instead of --sampling-rate)"),
    steps: int | None = typer.Option(None, "--steps", help="total local steps T"),
    rounds: int = typer.Option(1, "--rounds", help="federated rounds the steps are split over"),
    client_id: str = typer.Option("client", "--client-id"),
    learning_rate: float = typer.Option(0.1, "--learning-rate"),
    lr_schedule: str | None = typer.Option(None, "--lr-schedule", help="constant | inverse_sqrt | adagrad_norm"),
    alpha_schedule: str | None = typer.Option(None, "--alpha-schedule", help="ADP noise schedule: constant | inverse_sqrt_lr | power"),
    alpha_power: float = typer.Option(0.5, "--alpha-power", help="p in [0, 1] of the power schedule α_t² ∝ t^p (0.5: the paper's choice with adagrad_norm)"),
    as_json: bool = typer.Option(False, "--json", help="print the plan as one JSON object and nothing else"),
    out: Path = typer.Option(Path("sheets"), "--out", help="folder for the planning sheet"),
    sheet: bool = typer.Option(True, "--sheet/--no-sheet", help="write the planning sheet"),
) -> None:
    """Plan, certify and explain one client's DP-SGD parameters."""
    from fedprivacy.privacy.planner import plan_client

    the_plan = _guarded(lambda: plan_client(
        n, epsilon, delta, rule=rule, clip_norm=clip_norm, epochs=epochs, sampling_rate=sampling_rate,
        expected_batch_size=batch_size, steps=steps, rounds=rounds, client_id=client_id,
        learning_rate=learning_rate, lr_schedule=lr_schedule, alpha_schedule=alpha_schedule, alpha_power=alpha_power,
    ))
    written = _guarded(lambda: _write_sheets([the_plan], out, index=False)) if sheet else []
    if as_json:
        sys.stdout.write(the_plan.to_json() + "\n")
        return
    console = Console()
    console.print(_plan_table(the_plan))
    if written:
        console.print(f"planning sheet: {out / (written[0].stem + '.html')}")


def _parse_epsilons(text: str | None, count: int) -> list[float] | None:
    """`--epsilons 0.5,1,2`: one budget per client, in sorted client order."""
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if len(parts) != count:
        raise InputError("epsilons", text, f"needs one ε per client: {count} comma-separated values, got {len(parts)}")
    try:
        return [float(p) for p in parts]
    except ValueError:
        raise InputError("epsilons", text, "must be comma-separated numbers, e.g. 0.5,1,2") from None


@app.command()
def sheets(
    data: Path = typer.Option(..., "--data", help="CSV file with one row per record"),
    partition_by: str = typer.Option(..., "--partition-by", help="column whose values define the clients"),
    epsilon: float = typer.Option(1.0, "--epsilon", help="target ε of every client"),
    epsilons: str | None = typer.Option(None, "--epsilons", help="one ε per client, comma-separated, in sorted client order"),
    delta: float = typer.Option(1e-5, "--delta"),
    rule: str = typer.Option("proactive", "--rule", help=RULE_HELP),
    clip_norm: float = typer.Option(1.0, "--clip-norm"),
    epochs: float | None = typer.Option(None, "--epochs"),
    rounds: int = typer.Option(1, "--rounds"),
    out: Path = typer.Option(Path("sheets"), "--out", help="folder for the sheets and the index"),
) -> None:
    """One planning sheet per client of a CSV split by a column, plus an index."""
    from fedprivacy.data.tables import partition_sizes, read_table
    from fedprivacy.privacy.planner import plan_client

    console = Console(stderr=True)

    def build() -> list[Any]:
        sizes = partition_sizes(read_table(data, [partition_by]), partition_by)
        budgets = _parse_epsilons(epsilons, len(sizes)) or [epsilon] * len(sizes)
        plans = []
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("planning clients", total=len(sizes))
            for (client, size), budget in zip(sizes.items(), budgets):
                plans.append(plan_client(size, budget, delta, rule=rule, clip_norm=clip_norm, epochs=epochs,
                                         rounds=rounds, client_id=f"{partition_by}-{client}"))
                progress.advance(task)
        return plans

    plans = _guarded(build)
    with console.status("writing sheets"):
        _guarded(lambda: _write_sheets(plans, out))
    table = Table(title=f"{len(plans)} clients of {data.name} by {partition_by}")
    for column in ("client", "N", "ε", "σ", "q", "T", "PLD ε", "unused"):
        table.add_column(column, justify="right")
    for p in plans:
        table.add_row(p.client_id, str(p.n), f"{p.epsilon:g}", f"{p.sigma:.3f}", f"{p.sampling_rate:.3g}",
                      str(p.steps), f"{p.epsilon_pld:.3f}", f"{p.budget_unused:.3f}")
    Console().print(table)
    Console().print(f"sheets and index: {out / 'index.html'}")


@app.command()
def calculator(
    n: int = typer.Option(..., "--n"),
    epsilon: float = typer.Option(..., "--epsilon"),
    delta: float = typer.Option(1e-5, "--delta"),
    rule: str = typer.Option("calibrated", "--rule", help=RULE_HELP),
    clip_norm: float = typer.Option(1.0, "--clip-norm"),
    as_json: bool = typer.Option(False, "--json", help="print the table as a JSON list"),
) -> None:
    """List every feasible plan over a grid of epochs and sampling rates, ranked a priori."""
    from fedprivacy import errors
    from fedprivacy.privacy import limits
    from fedprivacy.privacy.calculator import UTILITY_PROXY, feasible_plans

    def run() -> list[Any]:
        limits.records("n", n)
        limits.epsilon("epsilon", epsilon)
        errors.open_unit("delta", delta)
        with Progress(console=Console(stderr=True), transient=True, disable=as_json) as progress:
            task = progress.add_task("certifying grid", total=None)
            return feasible_plans(n, epsilon, delta, rule=rule, clip_norm=clip_norm,
                                  on_progress=lambda done, total: progress.update(task, completed=done, total=total))

    rows = _guarded(run)
    if as_json:
        sys.stdout.write(json.dumps([r.to_dict() for r in rows]) + "\n")
        return
    table = Table(title=f"Feasible plans for N={n}, ε={epsilon:g}, δ={delta:.2g} ({rule}); ranked by {UTILITY_PROXY}")
    for column in ("k", "q", "batch", "T", "σ", "σC/(qN)", "PLD ε", "rank"):
        table.add_column(column, justify="right")
    for r in rows:
        d = r.to_dict()
        table.add_row(f"{d['epochs']:.3g}", f"{d['sampling_rate']:.3g}", f"{d['expected_batch_size']:.1f}", str(d["steps"]),
                      f"{d['sigma']:.3f}", f"{d['noise_std_on_mean']:.3g}", f"{d['epsilon_pld']:.3f}",
                      ("[bold green]1[/bold green]" if r.rank == 1 else str(r.rank)))
    Console().print(table)


SCENARIO_HELP = "scenario file (TOML, see scenarios/); or build the grid with the flags below"


def _sweep_scenario(scenario: Path | None, run_flags: dict[str, str | None], grid_flags: dict[str, str | None],
                    sets: list[str], grids: list[str], sweep: dict[str, Any], resources: dict[str, Any], out: Path) -> Any:
    """The validated scenario from a file or from the flags (not both); --engine and --no-baseline apply to either."""
    from sims.sweep.flags import scenario_from_flags
    from sims.sweep.spec import read_scenario, validate

    if scenario is None:
        raw = scenario_from_flags(run_flags, grid_flags, sets, grids, sweep, resources)
        return validate(raw, base_dir=Path.cwd(), default_name=out.name)
    inline = {**run_flags, **grid_flags, **resources, "clients": sweep["clients"], "seeded-noise": sweep["seeded-noise"],
              "set": sets or None, "grid": grids or None}  # fmt: skip
    given = [flag for flag, value in inline.items() if value is not None]
    if given:
        raise InputError(given[0], inline[given[0]], f"the scenario file {scenario} declares the grid: give it by a file or by flags, not both")
    raw = read_scenario(scenario)
    overrides = {key: sweep[key] for key in ("engine", "baseline") if sweep[key] is not None}
    if overrides and isinstance(raw.get("sweep", {}), dict):
        raw["sweep"] = {**raw.get("sweep", {}), **overrides}
    return validate(raw, base_dir=scenario.resolve().parent, default_name=scenario.stem)


@app.command()
def sweep(
    scenario: Path | None = typer.Argument(None, help=SCENARIO_HELP, show_default=False),
    out: Path = typer.Option(..., "--out", help="folder for the cells, sweep.csv and the baselines; rerun to resume"),
    engine: str | None = typer.Option(None, "--engine", help="inprocess (default: the apps in this process) | flower (a flwr run per cell) | fast (a round's clients trained together)"),
    baseline: bool | None = typer.Option(None, "--baseline/--no-baseline", help="also run the non-private baseline (default: yes)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="validate and list the cells, run nothing"),
    dataset: str | None = typer.Option(None, "--dataset", help="digits | pums | csv | synthetic"),
    data_path: str | None = typer.Option(None, "--data-path", help="data file (relative paths are taken from here)"),
    partition_by: str | None = typer.Option(None, "--partition-by", help="column whose values are the clients, e.g. puma"),
    partitioning: str | None = typer.Option(None, "--partitioning", help="auto | iid | dirichlet | natural | size"),
    model: str | None = typer.Option(None, "--model", help="logreg | mlp | cnn"),
    rounds: str | None = typer.Option(None, "--rounds", help="federated rounds of every cell"),
    fraction_train: str | None = typer.Option(None, "--fraction-train", help="fraction of clients trained per round"),
    clients: int | None = typer.Option(None, "--clients", help="simulated clients (default: one per natural partition)"),
    epsilons: str | None = typer.Option(None, "--epsilons", help="grid of ε, e.g. 0.25,0.5,1,2,4,8"),
    rules: str | None = typer.Option(None, "--rules", help="grid of rules, e.g. proactive,calibrated"),
    seeds: str | None = typer.Option(None, "--seeds", help="grid of seeds, e.g. 0-4 or 0,3"),
    seeded_noise: bool = typer.Option(False, "--seeded-noise", help="every cell's noise-seed is its seed (reproducible; experiments only)"),
    grid: list[str] = typer.Option([], "--grid", help="KEY=V1,V2: vary any run-config key (repeatable)"),
    sets: list[str] = typer.Option([], "--set", help="KEY=VALUE: fix any run-config key (repeatable)"),
    client_cpus: int | None = typer.Option(None, "--client-cpus", help="CPUs per simulated client (flower engine; default 1)"),
    client_gpus: float | None = typer.Option(None, "--client-gpus", help="GPU fraction per simulated client (flower engine; default 0)"),
    workers: int | None = typer.Option(None, "--workers", help="fast engine workers: 1 in this process, more as Ray actors (default 1)"),
    worker_gpus: float | None = typer.Option(None, "--worker-gpus", help="GPU fraction per fast-engine worker (default 0: CPU)"),
) -> None:
    """Run a grid of federated runs, declared by a scenario file (TOML, see scenarios/) or by the
    flags, one results folder per cell and sweep.csv; rerun the same command to resume."""
    from sims.sweep.grid import cells as grid_cells

    run_flags = {"dataset": dataset, "data-path": data_path, "partition-by": partition_by, "partitioning": partitioning,
                 "model": model, "rounds": rounds, "fraction-train": fraction_train}  # fmt: skip
    grid_flags = {"epsilons": epsilons, "rules": rules, "seeds": seeds}
    sweep_table = {"engine": engine, "baseline": baseline, "clients": clients, "seeded-noise": seeded_noise or None}
    resources = {"client-cpus": client_cpus, "client-gpus": client_gpus, "workers": workers, "worker-gpus": worker_gpus}
    spec = _guarded(lambda: _sweep_scenario(scenario, run_flags, grid_flags, sets, grid, sweep_table, resources, out))
    console = Console(stderr=True)
    with console.status("validating every cell"):
        cells = _guarded(lambda: grid_cells(spec))
    if dry_run:
        table = Table(title=f"{spec.name}: {len(cells)} cells, engine {spec.engine}")
        for column in ("cell", "clients", "rounds"):
            table.add_column(column)
        for cell in cells:
            table.add_row(cell.name, str(cell.num_clients), str(cell.run_config["num-server-rounds"]))
        Console().print(table)
        return
    _run_sweep(spec, cells, out, console)


def _run_sweep(spec: Any, cells: list[Any], out: Path, console: Console) -> None:
    """Run it; SIGTERM is an interrupt too, so the engine is torn down (a SuperLink stopped) either way."""
    from sims.sweep.driver import EngineUnavailable, run_sweep

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        outcome = _guarded(lambda: run_sweep(spec, cells, out.resolve(), console=console))
    except KeyboardInterrupt:
        typer.echo(f"interrupted: rerun the same command to resume (finished cells in {out} are kept)", err=True)
        raise typer.Exit(code=130) from None
    except EngineUnavailable as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(code=1) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    failures = outcome.failures
    done = sum(1 for row in outcome.rows if row["status"] == "completed")
    typer.echo(f"{done} of {len(outcome.rows)} cells completed: {out / 'sweep.csv'}; figures and tables: fedprivacy report {out}")
    if failures:
        for failure in failures:
            typer.echo(f"failed: {failure}", err=True)
        raise typer.Exit(code=1)


@app.command()
def report(
    sweep_dir: Path = typer.Argument(..., help="a sweep's --out folder"),
    out: Path | None = typer.Option(None, "--out", help="folder for the figures and report.md (default: SWEEP_DIR/report)"),
) -> None:
    """Figures (PNG and SVG) and report.md from a sweep's sweep.csv and cell folders."""
    from fedprivacy.reports.sweep_report import write_report

    written = _guarded(lambda: write_report(sweep_dir, out))
    Console().print(f"{len(written)} files, report: {written[-1]}")


def main() -> None:
    """The `fedprivacy` command. Click's own errors (a non-number, an unknown or missing option)
    become one line too, instead of a usage box, with Click's exit codes (2 for usage errors)."""
    try:
        code = app(standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError:  # the help has been printed
        sys.exit(2)
    except click.UsageError as error:
        command = error.ctx.command_path if error.ctx else "fedprivacy"
        typer.echo(f"error: {error.format_message()} (see: {command} --help)", err=True)
        sys.exit(error.exit_code)
    except click.ClickException as error:
        typer.echo(f"error: {error.format_message()}", err=True)
        sys.exit(error.exit_code)
    except click.Abort:  # Ctrl-C, as Click's standalone mode reports it
        typer.echo("Aborted!", err=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
