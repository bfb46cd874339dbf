"""The empirical privacy audit, with more trials than the tests: prints a table and writes JSON.

For one-step, full-batch plans certified at several ε (δ = 1e-5, N = 10): the canary membership
attack's ε lower bound (95%: Clopper–Pearson, each rate at 97.5%) beside the certificate, for the
real trainer and for the negative control whose noise is divided by 3, under add/remove
neighbours (the canary in or out) and replace-one neighbours (the canary or its mirror image,
judged against the plan's replace-one ε from dp-accounting); the noise std per
parameter; and the rate of non-finite releases under a crafted overflow model, with and without
the canary. See sims/audit.py for the method.

Usage: python benchmarks/privacy_audit.py [--trials 20000] [--epsilons 1,2,3] [--engines trainer,fast]
       [--neighbours add-remove,replace-one] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import time
import warnings

from sims import audit


def measure(epsilons: list[float], trials: int, engines: list[str], neighbours: list[str]) -> list[dict[str, object]]:
    rows = []
    for relation in neighbours:
        for engine in engines:
            rows += _measure_engine(epsilons, trials, engine, relation)
    return rows


def _measure_engine(epsilons: list[float], trials: int, engine: str, neighbours: str) -> list[dict[str, object]]:
    rows = []
    for epsilon in epsilons:
        plan = audit.one_step_plan(epsilon, 1e-5, 10)
        certified = plan.epsilon_pld if neighbours == "add-remove" else audit.replace_one_epsilon(plan)
        for label, tested in ((engine, plan), (f"{engine}, noise ÷ 3 (control)", audit.weakened(plan, 3.0))):
            started = time.perf_counter()
            bound = audit.audit_canary(tested, trials, engine=engine, neighbours=neighbours)
            rows.append(
                {
                    "case": label,
                    "neighbours": neighbours,
                    "certified_epsilon": round(certified, 4),
                    "add_remove_epsilon": round(plan.epsilon_pld, 4),
                    "sigma": round(tested.noise_segments[0][0], 4),
                    "epsilon_lower_bound": round(bound.epsilon_lower_bound, 4),
                    "false_positive_upper": round(bound.false_positive_upper, 5),
                    "false_negative_upper": round(bound.false_negative_upper, 5),
                    "trials_per_side": trials,
                    "caught": bound.epsilon_lower_bound > certified,
                    "wall_s": round(time.perf_counter() - started, 1),
                }
            )
    return rows


ENGINES = ("trainer", "fast")
NEIGHBOURS = ("add-remove", "replace-one")


def _choices(parser: argparse.ArgumentParser, option: str, given: str, allowed: tuple[str, ...]) -> list[str]:
    """The comma-separated values of `option`, each one of `allowed` (an unknown one would audit
    another case under its name)."""
    values = given.split(",")
    unknown = [v for v in values if v not in allowed]
    if unknown or not values:
        parser.error(f"{option}={given!r}: comma-separated, each one of {', '.join(allowed)}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20_000, help="releases per side (with / without the canary)")
    parser.add_argument("--epsilons", default="1,2,3", help="certified ε of the audited plans")
    parser.add_argument("--engines", default="trainer,fast", help="trainer (DPTrainer), fast (the batched worker)")
    parser.add_argument(
        "--neighbours",
        default="add-remove,replace-one",
        help="add-remove, replace-one (the certificate each is judged by)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    engines, neighbours = (
        _choices(parser, "--engines", args.engines, ENGINES),
        _choices(parser, "--neighbours", args.neighbours, NEIGHBOURS),
    )
    try:
        epsilons = [float(e) for e in args.epsilons.split(",")]
    except ValueError:
        parser.error(f"--epsilons={args.epsilons!r}: comma-separated numbers, e.g. 1,2,3")
    if not all(0 < e < float("inf") for e in epsilons):
        parser.error(f"--epsilons={args.epsilons!r}: every ε must be a finite number > 0")
    if args.trials < 100:
        parser.error(f"--trials={args.trials}: at least 100 releases per side (the controls need about 20,000)")
    rows = measure(epsilons, args.trials, engines, neighbours)
    print(
        f"{'case':<36}{'neighbours':>13}{'certified ε':>12}{'σ':>8}"
        f"{'ε lower bound':>15}{'FPR⁺':>9}{'FNR⁺':>9}{'caught':>8}"
    )
    for r in rows:
        print(
            f"{r['case']:<36}{r['neighbours']:>13}{r['certified_epsilon']:>12.3f}{r['sigma']:>8.3f}"
            f"{r['epsilon_lower_bound']:>15.3f}{r['false_positive_upper']:>9.4f}{r['false_negative_upper']:>9.4f}"
            f"{str(r['caught']):>8}"
        )

    plan = audit.one_step_plan(epsilons[0], 1e-5, 10)
    noise = audit.noise_per_coordinate(plan, 4000)
    ratios = noise.std(axis=0) / (plan.sigma * plan.clip_norm)
    tolerance = 5 / math.sqrt(2 * noise.shape[0])
    print(
        f"\nnoise std / σC over {noise.shape[1]} parameters, {noise.shape[0]} releases: "
        f"min {ratios.min():.4f}, max {ratios.max():.4f} (5 s.e. = {tolerance:.4f})"
    )
    without, with_canary = audit.nonfinite_release_rates(plan, 2000)
    print(
        f"non-finite releases under the crafted overflow model: {without:.3%} without the canary, "
        f"{with_canary:.3%} with it (2,000 releases each)"
    )

    if args.json:
        payload = {
            "canary": rows,
            "noise_std_ratio": {
                "min": float(ratios.min()),
                "max": float(ratios.max()),
                "releases": int(noise.shape[0]),
            },
            "nonfinite_release_rate": {"without_canary": without, "with_canary": with_canary},
        }
        with open(args.json, "w") as handle:
            json.dump(payload, handle, indent=2)


if __name__ == "__main__":
    main()
