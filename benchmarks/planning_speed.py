"""How fast planning is: certifying one plan with PLD, calibrating σ, writing the 7 PUMS sheets.

Targets: certifying one plan ≤ 1 s for T ≤ 10⁵ on the CI machine; the 7 PUMS sheets
in ≤ 30 s. Each certificate is timed beside the baseline it replaces, dp-accounting's stock
`PLDAccountant` on the same plan and loss grid, in the same run (`speedup` = baseline / ours).
Prints a table; `--json PATH` writes the rows. Caches are cleared before each timing so every
number is a cold computation.

    python benchmarks/planning_speed.py [--json out.json] [--pums ../shared/data/pums/fulton_pums5_full.csv]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from dp_accounting import pld

from fedprivacy.data.tables import partition_sizes, read_table
from fedprivacy.privacy import accountants
from fedprivacy.privacy.planner import plan_client
from fedprivacy.reports.sheets import write_sheets

DEFAULT_PUMS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "pums" / "fulton_pums5_full.csv"


def timed(action) -> float:
    accountants.clear_caches()
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def stock_pld_epsilon(events: tuple[accountants.NoiseEvent, ...], delta: float) -> float:
    """The baseline: dp-accounting's PLDAccountant with its defaults and the certificate's grid."""
    accountant = pld.PLDAccountant(
        accountants.ADJACENCY, value_discretization_interval=accountants.CERTIFICATE_DISCRETIZATION
    )
    accountant.compose(accountants.dp_event_of(events))
    return accountant.get_epsilon(delta)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--pums", type=Path, default=DEFAULT_PUMS)
    args = parser.parse_args()

    rows = []
    for steps in (100, 1_000, 10_000, 100_000):
        q = min(1.0, 10 / steps)  # a 10-epoch plan of T steps at ε = 2, as the planner would make it
        segments = ((1.0, steps),)
        rows.append(
            {
                "task": "calibrate σ (PLD, within 1%)",
                "steps": steps,
                "seconds": timed(lambda q=q, segments=segments: accountants.calibrate_pld(2.0, 1e-5, q, segments)),
                "target_seconds": None,
            }
        )
        events = accountants.constant_events(accountants.calibrate_pld(2.0, 1e-5, q, segments), q, steps)
        rows.append(
            {
                "task": "certify that plan (PLD, 1e-4 grid)",
                "steps": steps,
                "seconds": timed(lambda events=events: accountants.pld_epsilon(events, 1e-5)),
                "target_seconds": 1.0,
                "baseline_seconds": timed(lambda events=events: stock_pld_epsilon(events, 1e-5)),
            }
        )

    sizes = partition_sizes(read_table(args.pums, ["puma"]), "puma")

    def sheets() -> None:
        plans = [plan_client(n, 1.0, 1e-5, client_id=f"puma-{c}") for c, n in sizes.items()]
        with tempfile.TemporaryDirectory() as out:
            write_sheets(plans, out)

    rows.append(
        {
            "task": "plan + write 7 PUMS sheets",
            "steps": None,
            "seconds": timed(sheets),
            "target_seconds": 30.0,
        }
    )

    for row in rows:
        if "baseline_seconds" in row:
            row["speedup"] = row["baseline_seconds"] / row["seconds"]

    print(f"{'task':40} {'T':>8} {'seconds':>9} {'target':>8} {'ok':>3} {'stock dp-acc.':>13} {'speedup':>8}")
    for row in rows:
        target = row["target_seconds"]
        ok = "" if target is None else ("yes" if row["seconds"] <= target else "NO")
        baseline = f"{row['baseline_seconds']:13.3f} {row['speedup']:7.2f}×" if "speedup" in row else ""
        print(f"{row['task']:40} {row['steps'] or '':>8} {row['seconds']:9.3f} {target or '':>8} {ok:>3} {baseline}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
