"""σ as the number of steps T grows, by rule: naive and strong composition, the moments
accountant (RDP), PLD and the proactive rule (Abadi et al. 2016 §3; Dwork & Roth §3.5; van Dijk et
al. 2024); and σ_strong/σ_naive against T^(−1/2), the scaling strong composition promises.

Every σ is the smallest each analysis certifies for the same target (ε, δ) and sampling rate q;
the proactive σ does not depend on T. Prints a table, writes JSON and a figure.

Usage: python experiments/sigma_vs_steps.py [--epsilon 1] [--delta 1e-5] [--q 0.01] [--out docs/figures]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from fedprivacy.privacy import accountants, classical
from fedprivacy.privacy.proactive import proactive_sigma

STEPS = (10, 30, 100, 300, 1000, 3000, 10_000)


def sigmas(epsilon: float, delta: float, q: float, steps: int) -> dict[str, float]:
    constant = ((1.0, steps),)
    return {
        "naive": classical.naive_sigma(epsilon, delta, q, steps),
        "strong": classical.strong_sigma(epsilon, delta, q, steps),
        "moments accountant (RDP)": accountants.calibrate_rdp(epsilon, delta, q, constant),
        "PLD": accountants.calibrate_pld(epsilon, delta, q, constant),
        "proactive": proactive_sigma(epsilon, delta),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--q", type=float, default=0.01, help="Poisson sampling rate")
    parser.add_argument("--out", type=Path, default=Path("docs/figures"))
    args = parser.parse_args()

    rows = [{"steps": t, **sigmas(args.epsilon, args.delta, args.q, t)} for t in STEPS]
    names = [k for k in rows[0] if k != "steps"]
    print(f"ε = {args.epsilon:g}, δ = {args.delta:g}, q = {args.q:g}")
    print(f"{'T':>7}" + "".join(f"{n:>26}" for n in names) + f"{'strong/naive':>14}{'√(T₀/T)':>10}")
    for r in rows:
        ratio = r["strong"] / r["naive"]
        print(
            f"{r['steps']:>7}"
            + "".join(f"{r[n]:>26.4g}" for n in names)
            + f"{ratio:>14.4f}{math.sqrt(STEPS[0] / r['steps']) * rows[0]['strong'] / rows[0]['naive']:>10.4f}"
        )

    args.out.mkdir(parents=True, exist_ok=True)
    figure = Figure(figsize=(11, 4.2))
    left, right = figure.subplots(1, 2)
    steps = np.array(STEPS)
    for name, style in zip(names, ("o-", "s-", "^-", "v-", "k--"), strict=True):
        left.plot(steps, [r[name] for r in rows], style, label=name)
    left.set(
        xscale="log",
        yscale="log",
        xlabel="steps T",
        ylabel="noise multiplier σ",
        title=f"σ each analysis needs (ε = {args.epsilon:g}, δ = {args.delta:g}, q = {args.q:g})",
    )
    left.legend(fontsize=8)
    left.grid(True, which="both", alpha=0.25)
    ratio = np.array([r["strong"] / r["naive"] for r in rows])
    right.plot(steps, ratio, "o-", label="σ_strong / σ_naive")
    right.plot(steps, ratio[0] * np.sqrt(steps[0] / steps), "k--", label="∝ T^(−1/2)")
    right.set(xscale="log", yscale="log", xlabel="steps T", title="strong against naive composition")
    right.legend(fontsize=8)
    right.grid(True, which="both", alpha=0.25)
    figure.tight_layout()
    figure.savefig(args.out / "sigma_vs_steps.png", dpi=110)
    (args.out / "sigma_vs_steps.json").write_text(
        json.dumps({"epsilon": args.epsilon, "delta": args.delta, "q": args.q, "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
