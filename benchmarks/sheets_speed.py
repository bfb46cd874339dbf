"""How long planning sheets take: one figure per client (as before) against one figure per distinct plan.

Two measurements, side by side in one run:

1. Sheets alone, for 7 to 1,000 clients of the PUMS extract split with label skew (Dirichlet,
   α = 5, so that clients hold different N, as in a real partition): their plans are made first (not timed), then the
   whole `plans/` folder is written twice, once with a figure drawn for every client (each sheet
   written on its own, the former behaviour) and once with `write_sheets` sharing one figure
   between clients whose plans show the same figure. Target: 1,000 clients in ≤ 30 s.
2. 200-client federated runs in process (the real ServerApp and ClientApp, sims.runner, 3 rounds):
   the app's defaults (digits, IID) and PUMS with label skew, with the time the ServerApp spends
   writing `plans/` measured inside the run. Target: ≤ 10% of the run. The same run's plans are
   then written with one figure per client, for the former share. The runs come first, in a
   fresh process.

Accountant caches are cleared before every timing, so each is a cold computation. Both columns
draw the same figures with the same curves; only how many are drawn differs.

    python benchmarks/sheets_speed.py [--json out.json] [--pums ../shared/data/pums/fulton_pums5_full.csv]
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fedprivacy import results
from fedprivacy.data.partition import load_clients
from fedprivacy.privacy import accountants
from fedprivacy.privacy.plan import Plan
from fedprivacy.privacy.planner import plan_client
from fedprivacy.reports import sheets
from sims.runner import Scenario, run_scenario

DEFAULT_PUMS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "pums" / "fulton_pums5_full.csv"
CLIENT_COUNTS = (7, 40, 200, 1_000)
RUN_CLIENTS = 200
DIRICHLET_ALPHA = 5.0  # 1,000 clients of the extract then hold 6 to 46 training rows each


def clear_caches() -> None:
    for cached in (
        accountants._pld_epsilon_cached,
        accountants._rdp_epsilon_cached,
        accountants._calibrate_pld_cached,
        accountants._calibrate_rdp_cached,
    ):
        cached.cache_clear()


def timed(action: Callable[[], Any]) -> float:
    clear_caches()
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def figure_per_client(plans: Sequence[Plan], out: Path) -> None:
    """The former behaviour: every sheet draws its own figure (each client in its own folder)."""
    for plan in plans:
        sheets.write_sheet(plan, out / plan.client_id)
    sheets.write_index(plans, out)


def plans_for(pums: Path, num_clients: int) -> list[Plan]:
    """Each client's plan as a run makes it: ε = 1, δ = 1e-5, proactive, on its training rows."""
    clients = load_clients("pums", pums, scheme="dirichlet", num_partitions=num_clients, seed=0, alpha=DIRICHLET_ALPHA)
    return [plan_client(c.num_examples, 1.0, 1e-5, client_id=c.client_id, rounds=3) for c in clients]


def sheets_row(pums: Path, num_clients: int) -> dict[str, Any]:
    plans = plans_for(pums, num_clients)
    with tempfile.TemporaryDirectory() as old, tempfile.TemporaryDirectory() as new:
        per_client = timed(lambda: figure_per_client(plans, Path(old)))
        shared = timed(lambda: sheets.write_sheets(plans, Path(new) / "plans"))
        figures = len(list((Path(new) / "plans").glob("*.png")))
    return {
        "clients": num_clients,
        "distinct_n": len({p.n for p in plans}),
        "figures": figures,
        "per_client_figure_s": per_client,
        "shared_figure_s": shared,
        "target_s": 30.0 if num_clients == 1_000 else None,
    }


def run_configs(pums: Path) -> dict[str, dict[str, Any]]:
    """The 200-client runs: the app's defaults (digits, IID: clients share one plan) and PUMS with
    label skew (clients of different N, a few distinct plans)."""
    return {
        "digits, IID": {"num-server-rounds": 3, "noise-seed": 0},
        "PUMS, Dirichlet": {
            "dataset": "pums",
            "data-path": str(pums),
            "partitioning": "dirichlet",
            "dirichlet-alpha": DIRICHLET_ALPHA,
            "num-server-rounds": 3,
            "noise-seed": 0,
        },
    }


def run_row(name: str, config: dict[str, Any]) -> dict[str, Any]:
    """A 200-client in-process run; the ServerApp's `write_plans` is timed where it is called."""
    spent: dict[str, Any] = {}
    write_plans = results.RunRecorder.write_plans

    def timed_write_plans(recorder: results.RunRecorder) -> list[Path]:
        start = time.perf_counter()
        written = write_plans(recorder)
        spent["seconds"], spent["plans"] = time.perf_counter() - start, list(recorder.plans.values())
        return written

    results.RunRecorder.write_plans = timed_write_plans
    try:
        with tempfile.TemporaryDirectory() as out:
            clear_caches()
            run = run_scenario(Scenario("sheets-benchmark", config, num_clients=RUN_CLIENTS), Path(out), quiet=True)
            old = timed(lambda: figure_per_client(spent["plans"], Path(out) / "per-client"))
    finally:
        results.RunRecorder.write_plans = write_plans
    rest = run.wall_s - spent["seconds"]
    return {
        "run": name,
        "clients": RUN_CLIENTS,
        "rounds": config["num-server-rounds"],
        "run_s": run.wall_s,
        "figures": len({sheets.PlanFigure.of(plan) for plan in spent["plans"]}),
        "shared_sheets_s": spent["seconds"],
        "shared_share": spent["seconds"] / run.wall_s,
        "per_client_sheets_s": old,
        "per_client_share": old / (rest + old),
        "target_share": 0.10,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--pums", type=Path, default=DEFAULT_PUMS)
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # the seeded run warns once per client that seeded noise is for experiments
    logging.getLogger("flwr").setLevel(logging.WARNING)  # and Flower logs every round at INFO

    runs = [run_row(name, config) for name, config in run_configs(args.pums).items()]  # first: a cold process
    rows = [sheets_row(args.pums, n) for n in CLIENT_COUNTS]
    print(
        f"{'clients':>7} {'distinct N':>10} {'figures':>7} {'figure per client s':>19} "
        f"{'shared s':>9} {'speedup':>8} {'target':>7}"
    )
    for row in rows:
        ok = "" if row["target_s"] is None else ("met" if row["shared_figure_s"] <= row["target_s"] else "NOT met")
        print(
            f"{row['clients']:>7} {row['distinct_n']:>10} {row['figures']:>7} {row['per_client_figure_s']:>19.2f} "
            f"{row['shared_figure_s']:>9.2f} {row['per_client_figure_s'] / row['shared_figure_s']:>7.1f}× {ok:>7}"
        )
    print(
        f"\n{'200-client run, 3 rounds':<26} {'run s':>6} {'figures':>7} {'sheets s':>8} {'share':>6} {'target':>7} "
        f"{'figure per client s':>19} {'share':>6}"
    )
    for run in runs:
        ok = "met" if run["shared_share"] <= run["target_share"] else "NOT met"
        print(
            f"{run['run']:<26} {run['run_s']:>6.1f} {run['figures']:>7} {run['shared_sheets_s']:>8.2f} "
            f"{100 * run['shared_share']:>5.1f}% {ok:>7} {run['per_client_sheets_s']:>19.1f} "
            f"{100 * run['per_client_share']:>5.1f}%"
        )
    if args.json:
        args.json.write_text(json.dumps({"sheets": rows, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
