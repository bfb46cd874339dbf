"""σ as the number of steps T grows, by rule: naive and strong composition, the moments
accountant (RDP), PLD and the proactive rule (Abadi et al. 2016 §3; Dwork & Roth §3.5; van Dijk et
al. 2024); and σ_strong/σ_naive against T^(−1/2), the scaling strong composition promises.

Every σ is the smallest each analysis certifies for the same target (ε, δ) and sampling rate q;
the proactive σ does not depend on T. A rule's σ is reported only where its conditions hold
(`fedprivacy.privacy.classical` for naive and strong, `proactive_conditions` with N records for the
proactive rule; the accountants need none): elsewhere the table prints "—", the JSON has null and
names the conditions not met, and the figure draws nothing. Prints a table, writes JSON and a figure.

Usage: python experiments/sigma_vs_steps.py [--epsilon 1] [--delta 1e-5] [--q 0.01] [--n N] [--out docs/figures]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from fedprivacy.privacy import accountants, classical
from fedprivacy.privacy.proactive import proactive_conditions, proactive_sigma, proactive_step_range

STEPS = (10, 30, 100, 300, 1000, 3000, 10_000)
RULES = ("naive", "strong", "moments accountant (RDP)", "PLD", "proactive")


def _failed(conditions) -> list[str]:
    return [c.name for c in conditions if c.kind == "required" and not c.met]


def row(epsilon: float, delta: float, q: float, n: int, steps: int) -> dict:
    """One T: each rule's σ (None where its conditions fail), and what failed with the formula's value."""
    constant = ((1.0, steps),)
    naive = classical.naive(epsilon, delta, q, steps)
    strong = classical.strong(epsilon, delta, q, steps)
    pro = proactive_sigma(epsilon, delta)
    pro_failed = _failed(proactive_conditions(n, epsilon, delta, q * steps, steps))
    values = {
        "naive": naive.value,
        "strong": strong.value,
        "moments accountant (RDP)": accountants.calibrate_rdp(epsilon, delta, q, constant),
        "PLD": accountants.calibrate_pld(epsilon, delta, q, constant),
        "proactive": pro,
    }
    failed = {"naive": list(naive.failed), "strong": list(strong.failed), "proactive": pro_failed}
    return {
        "steps": steps,
        **{name: None if failed.get(name) else value for name, value in values.items()},
        "not_met": {name: {"sigma": values[name], "conditions": names} for name, names in failed.items() if names},
    }


def _cell(value: float | None, width: int, fmt: str = ".4g") -> str:
    return f"{'—' if value is None else format(value, fmt):>{width}}"


def print_table(rows: list[dict], args: argparse.Namespace, pro_range: tuple[int, ...]) -> None:
    print(f"ε = {args.epsilon:g}, δ = {args.delta:g}, q = {args.q:g}, N = {args.n} (— : conditions not met)")
    print(f"{'T':>7}" + "".join(f"{n:>26}" for n in RULES) + f"{'strong/naive':>14}")
    for r in rows:
        ratio = r["strong"] / r["naive"] if r["strong"] is not None and r["naive"] is not None else None
        print(f"{r['steps']:>7}" + "".join(_cell(r[n], 26) for n in RULES) + _cell(ratio, 14, ".4f"))
    print("not met (formula's σ, conditions):")
    for r in rows:
        for name, unmet in r["not_met"].items():
            print(f"  T = {r['steps']:>6} {name:>9}: σ {unmet['sigma']:.4g}, {', '.join(unmet['conditions'])}")
    span = f"T ∈ [{pro_range[0]}, {pro_range[1]}]" if pro_range else "no T"
    print(f"proactive conditions hold for {span} (T ≤ {STEPS[-1]})")


def draw(rows: list[dict], args: argparse.Namespace, pro_range: tuple[int, ...], path: Path) -> None:
    """σ against T where each rule's conditions hold (left); σ_strong/σ_naive against T^(−1/2) (right)."""
    figure = Figure(figsize=(11, 4.2))
    left, right = figure.subplots(1, 2)
    steps = np.array(STEPS)
    for name, style in zip(RULES[:4], ("o-", "s-", "^-", "v-"), strict=True):
        shown = [math.nan if r[name] is None else r[name] for r in rows]
        label = name if not any(math.isnan(v) for v in shown) else f"{name} (where its conditions hold)"
        left.plot(steps, shown, style, label=label)
    sigma_pro = proactive_sigma(args.epsilon, args.delta)
    if pro_range:
        left.plot(pro_range, [sigma_pro] * 2, "k|--", label=f"proactive, T ∈ [{pro_range[0]}, {pro_range[1]}]")
    else:
        left.plot([], [], "k--", label=f"proactive (σ = {sigma_pro:.3g}): conditions met at no T")
    left.set(
        xscale="log",
        yscale="log",
        xlabel="steps T",
        ylabel="noise multiplier σ",
        title=f"σ each analysis needs (ε = {args.epsilon:g}, δ = {args.delta:g}, q = {args.q:g}, N = {args.n})",
    )
    left.legend(fontsize=8)
    left.grid(True, which="both", alpha=0.25)
    both = [(r["steps"], r["strong"] / r["naive"]) for r in rows if r["strong"] is not None and r["naive"] is not None]
    if both:
        t, ratio = (np.array(v, dtype=float) for v in zip(*both, strict=True))
        right.plot(t, ratio, "o-", label="σ_strong / σ_naive (both valid)")
        right.plot(t, ratio[0] * np.sqrt(t[0] / t), "k--", label="∝ T^(−1/2)")
        right.legend(fontsize=8)
    right.set(xscale="log", yscale="log", xlim=(steps[0] / 1.5, steps[-1] * 1.5), xlabel="steps T")
    right.set_title("strong against naive composition")
    right.grid(True, which="both", alpha=0.25)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--q", type=float, default=0.01, help="Poisson sampling rate")
    parser.add_argument(
        "--n",
        type=int,
        default=None,
        help="records N for the proactive conditions (default 1/δ: its theorem's δ = 1/N)",
    )
    parser.add_argument("--out", type=Path, default=Path("docs/figures"))
    args = parser.parse_args()
    args.n = args.n or round(1 / args.delta)

    rows = [row(args.epsilon, args.delta, args.q, args.n, t) for t in STEPS]
    pro_range = proactive_step_range(args.n, args.epsilon, args.delta, args.q, STEPS[-1])
    print_table(rows, args, pro_range)
    args.out.mkdir(parents=True, exist_ok=True)
    draw(rows, args, pro_range, args.out / "sigma_vs_steps.png")
    (args.out / "sigma_vs_steps.json").write_text(
        json.dumps(
            {
                "epsilon": args.epsilon,
                "delta": args.delta,
                "q": args.q,
                "n": args.n,
                "proactive_steps": list(pro_range),
                "rows": rows,
            },
            indent=2,
            ensure_ascii=False,
        )
    )


if __name__ == "__main__":
    main()
