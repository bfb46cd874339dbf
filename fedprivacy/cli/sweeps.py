"""`fedprivacy sweep` and `report`: a grid of federated runs through an engine, and its figures.

The sweep machinery lives in `sims/` (it drives Flower); it is imported inside the command, so
`fedprivacy` itself never imports flwr at module level.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from fedprivacy.catalog import DATASETS
from fedprivacy.cli.common import choices, guarded, value
from fedprivacy.errors import InputError
from fedprivacy.model_registry import model_names
from fedprivacy.runconfig_keys import PARTITIONINGS

app = typer.Typer()
Dataset = choices("Dataset", DATASETS)
Partitioning = choices("Partitioning", PARTITIONINGS)


SCENARIO_HELP = "scenario file (TOML, see scenarios/); or build the grid with the flags below"


def _sweep_scenario(
    scenario: Path | None,
    run_flags: dict[str, str | None],
    grid_flags: dict[str, str | None],
    sets: list[str],
    grids: list[str],
    sweep: dict[str, Any],
    resources: dict[str, Any],
    out: Path,
) -> Any:
    """The validated scenario from a file or from the flags (not both); --engine, --no-baseline and the
    resource flags (where it runs, not what: the results are the same) apply to either, and
    --data-path to a file's [run] too (where its data file lives on this machine)."""
    from sims.sweep.flags import scenario_from_flags
    from sims.sweep.spec import read_scenario, validate

    if scenario is None:
        raw = scenario_from_flags(run_flags, grid_flags, sets, grids, sweep, resources)
        return validate(raw, base_dir=Path.cwd(), default_name=out.name)
    located = run_flags["data-path"]
    inline = {
        **{key: flag for key, flag in run_flags.items() if key != "data-path"},
        **grid_flags,
        "clients": sweep["clients"],
        "seeded-noise": sweep["seeded-noise"],
        "set": sets or None,
        "grid": grids or None,
    }
    given = [flag for flag, value in inline.items() if value is not None]
    if given:
        raise InputError(
            given[0],
            inline[given[0]],
            f"the scenario file {scenario} declares the grid: give it by a file or by flags, not both",
        )
    raw = read_scenario(scenario)
    if located is not None:
        _relocate_data(raw, scenario, located)
    overrides = {key: sweep[key] for key in ("engine", "baseline") if sweep[key] is not None}
    if overrides and isinstance(raw.get("sweep", {}), dict):
        raw["sweep"] = {**raw.get("sweep", {}), **overrides}
    placement = {key: value for key, value in resources.items() if value is not None}
    if placement and isinstance(raw.get("resources", {}), dict):
        raw["resources"] = {**raw.get("resources", {}), **placement}
    return validate(raw, base_dir=scenario.resolve().parent, default_name=scenario.stem)


def _relocate_data(raw: dict[str, Any], scenario: Path, data_path: str) -> None:
    """The scenario's [run] data-path replaced by `data_path` (relative to the working folder), for a
    copy of its data elsewhere; refused where the scenario varies data-path ([grid] or [linked])."""
    linked = raw.get("linked")
    tables = {"[grid]": raw.get("grid")} | (
        {f"[linked.{name}]": group for name, group in linked.items()} if isinstance(linked, dict) else {}
    )
    for table, values in tables.items():
        if isinstance(values, dict) and "data-path" in values:
            raise InputError(
                "data-path",
                data_path,
                f"the scenario file {scenario} varies data-path in its {table}: edit the file instead",
            )
    run = raw.get("run", {})
    if isinstance(run, dict):
        raw["run"] = {**run, "data-path": str(Path(data_path).expanduser().resolve())}


@app.command()
def sweep(
    scenario: Path | None = typer.Argument(None, help=SCENARIO_HELP, show_default=False),
    out: Path = typer.Option(..., "--out", help="folder for the cells, sweep.csv and the baselines; rerun to resume"),
    engine: str | None = typer.Option(
        None,
        "--engine",
        help="inprocess (default: the apps in this process), flower (a flwr run per cell) "
        "or fast (a round's clients trained together)",
    ),
    baseline: bool | None = typer.Option(
        None, "--baseline/--no-baseline", help="also run the non-private baseline (default: yes)"
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="validate and list the cells (and count the tuning runs), run nothing"
    ),
    dataset: Dataset | None = typer.Option(None, "--dataset", help="the data set of every cell"),
    data_path: str | None = typer.Option(
        None,
        "--data-path",
        help="data file (relative paths are taken from here); with a scenario file, replaces its [run] data-path",
    ),
    partition_by: str | None = typer.Option(
        None, "--partition-by", help="column whose values are the clients, e.g. puma"
    ),
    partitioning: Partitioning | None = typer.Option(
        None, "--partitioning", help="how the rows are dealt to the clients"
    ),
    model: str | None = typer.Option(
        None,
        "--model",
        help=f"the model of every cell: {', '.join(model_names())} (built-in or installed: an entry point "
        "in group fedprivacy.models)",
    ),
    rounds: str | None = typer.Option(None, "--rounds", help="federated rounds of every cell"),
    fraction_train: str | None = typer.Option(None, "--fraction-train", help="fraction of clients trained per round"),
    clients: int | None = typer.Option(
        None, "--clients", help="simulated clients (default: one per natural partition)"
    ),
    epsilons: str | None = typer.Option(None, "--epsilons", help="grid of ε, e.g. 0.25,0.5,1,2,4,8"),
    rules: str | None = typer.Option(None, "--rules", help="grid of rules, e.g. proactive,calibrated"),
    seeds: str | None = typer.Option(None, "--seeds", help="grid of seeds, e.g. 0-4 or 0,3"),
    seeded_noise: bool = typer.Option(
        False, "--seeded-noise", help="every cell's noise-seed is its seed (reproducible; experiments only)"
    ),
    grid: list[str] = typer.Option([], "--grid", help="KEY=V1,V2: vary any run-config key (repeatable)"),
    sets: list[str] = typer.Option([], "--set", help="KEY=VALUE: fix any run-config key (repeatable)"),
    client_cpus: int | None = typer.Option(
        None, "--client-cpus", help="CPUs per simulated client (flower engine; default 1)"
    ),
    client_gpus: float | None = typer.Option(
        None, "--client-gpus", help="GPU fraction per simulated client (flower engine; default 0)"
    ),
    workers: int | None = typer.Option(
        None, "--workers", help="fast engine workers: 1 in this process, more as Ray actors (default 1)"
    ),
    device: str | None = typer.Option(
        None,
        "--device",
        help="fast engine workers' device: cpu, cuda or auto (default: cuda if a GPU is visible, else cpu)",
    ),
    worker_gpus: float | None = typer.Option(
        None, "--worker-gpus", help="GPU fraction per fast-engine worker (default 0: the GPUs shared evenly)"
    ),
) -> None:
    """Run a grid of federated runs from a scenario file (TOML, see scenarios/) or flags; rerun to resume.

    Each cell writes one results folder, and the sweep writes sweep.csv beside them.
    """
    from sims.sweep.grid import cells as grid_cells
    from sims.sweep.grid import schedule_note
    from sims.sweep.machine import check_machine
    from sims.sweep.tuning import check_resumable as check_tuning_resumable
    from sims.sweep.tuning import plan_tuning

    run_flags = {
        "dataset": value(dataset),
        "data-path": data_path,
        "partition-by": partition_by,
        "partitioning": value(partitioning),
        "model": model,
        "rounds": rounds,
        "fraction-train": fraction_train,
    }
    grid_flags = {"epsilons": epsilons, "rules": rules, "seeds": seeds}
    sweep_table = {
        "engine": engine,
        "baseline": baseline,
        "clients": clients,
        "seeded-noise": seeded_noise or None,
    }
    resources = {
        "client-cpus": client_cpus,
        "client-gpus": client_gpus,
        "workers": workers,
        "device": device,
        "worker-gpus": worker_gpus,
    }
    spec = guarded(lambda: _sweep_scenario(scenario, run_flags, grid_flags, sets, grid, sweep_table, resources, out))
    console = Console(stderr=True)
    with console.status("validating every cell"):
        cells = guarded(lambda: grid_cells(spec))
        plan = guarded(lambda: plan_tuning(spec, cells))  # every tuning run's config validated too
        if plan is not None and out is not None:  # a folder the run would refuse, refused now
            guarded(lambda: check_tuning_resumable(out, plan))
        guarded(lambda: check_machine(spec))
    if dry_run:
        about = "about " if plan is not None and plan.tune.private is not None else ""  # private: a random count
        tuning = f" after {about}{plan.runs} tuning runs" if plan is not None else ""
        table = Table(title=f"{spec.name}: {len(cells)} cells{tuning}, engine {spec.engine}")
        for column in ("cell", "clients", "rounds"):
            table.add_column(column)
        for cell in cells:
            table.add_row(cell.name, str(cell.num_clients), str(cell.run_config["num-server-rounds"]))
        Console().print(table)
        for line in _tuning_lines(spec, cells, plan):
            Console().print(line)
        if (note := schedule_note(spec)) is not None:
            console.print(note)
        return
    _run_sweep(spec, cells, out, console)


def _tuning_lines(spec: Any, cells: list[Any], plan: Any) -> list[str]:
    """What the tuning will run, for --dry-run: the runs per arm, the candidates, the baseline's own."""
    from sims.sweep.baseline_jobs import baseline_jobs, baseline_tuning, tunes_baseline

    if plan is None:
        return []
    varied = "split-seed" in spec.varied
    split = "each arm's own split-seed" if varied else f"split-seed {plan.tune.split_seed}"
    lines = [
        f"tuning: {plan.summary} ({plan.tune.select} score; {split})",
        f"candidates: {'; '.join(candidate.name for candidate in plan.candidates)}",
    ]
    if spec.baseline and tunes_baseline(spec.tune, spec.baseline_learning_rate):
        baseline = baseline_tuning(baseline_jobs(cells), spec.tune)
        more = f" (up to {baseline.close_runs} more for close candidates)" if baseline.close_runs else ""
        lines.append(
            f"non-private baseline: {baseline.runs} more tuning runs for its own learning rate{more} (fast engine)"
        )
    if plan.tune.private is None:
        lines.append("the tuning's privacy cost is not in the cells' ε (docs/simulator.md#tuning-per-cell)")
        return lines
    from sims.sweep.tuning import private_cost

    for arm in plan.arms:
        cost = private_cost(arm, plan)
        lines.append(
            f"private tuning, arm {arm.name}: ε with the tuning (the choice and one cell run), largest over "
            f"clients: {cost['tuned_max']:.3g} (one cell run alone, same RDP accountant: {cost['one_run_max']:.3g})"
        )
    return lines


def _run_sweep(spec: Any, cells: list[Any], out: Path, console: Console) -> None:
    """Run it; SIGTERM is an interrupt too, so the engine is torn down (a SuperLink stopped) either way."""
    from sims.sweep.driver import EngineUnavailable, run_sweep

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        outcome = guarded(lambda: run_sweep(spec, cells, out.resolve(), console=console))
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
    typer.echo(
        f"{done} of {len(outcome.rows)} cells completed: {out / 'sweep.csv'}; "
        f"figures and tables: fedprivacy report {out}"
    )
    if failures:
        for failure in failures:
            typer.echo(f"failed: {failure}", err=True)
        raise typer.Exit(code=1)


@app.command()
def report(
    sweep_dir: Path = typer.Argument(..., help="a sweep's --out folder"),
    out: Path | None = typer.Option(
        None, "--out", help="folder for the figures and report.md (default: SWEEP_DIR/report)"
    ),
    holm: bool = typer.Option(
        False,
        "--holm",
        help="also adjust the paired differences' p-values by Holm's step-down (Holm 1979) over every pair "
        "(p_holm, verdict_holm)",
    ),
) -> None:
    """Figures (PNG and SVG) and report.md from a sweep's sweep.csv and cell folders."""
    from fedprivacy.reports.sweep_report import write_report

    written = guarded(lambda: write_report(sweep_dir, out, holm=holm))
    Console().print(f"{len(written)} files, report: {written[-1]}")
