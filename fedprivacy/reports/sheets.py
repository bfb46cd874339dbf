"""Planning sheets: one page per client (Markdown, HTML, JSON), a figure per distinct plan, and an index.

A sheet shows the inputs, the chosen plan, its certificate,
the budget left unused, the rule's conditions by name, the σ every other rule would need (added
here when a run's plans came without it), and a
figure of ε versus steps (PLD, RDP, naive, strong) beside a bar chart of σ by rule.

The figure is the only costly part (about 0.6 s of accounting and drawing, against about 1 ms for
the tables), so it is drawn once per `PlanFigure`: the exact values it shows. Clients whose
plans agree on all of them (the same ε, δ, rule, σ schedule, q and T, whatever their N) link to
the same file, named by a digest of those values, so the same inputs always give the same figure.

Writing is all-or-nothing: files go to a temporary folder beside the target and are moved in
only when every sheet has been written, so a failure leaves no partial output.
"""

from __future__ import annotations

import csv
import hashlib
import html
import json
import math
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from fedprivacy.privacy import accountants, classical
from fedprivacy.privacy.accountants import NoiseEvent
from fedprivacy.privacy.plan import NEIGHBOUR_RELATIONS, Plan
from fedprivacy.privacy.planner import with_rule_comparison

CURVE_POINTS = 24


def _safe_name(client_id: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in str(client_id)) or "client"


def _fmt(value: float | None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value:.{digits}g}"


@dataclass(frozen=True)
class PlanFigure:
    """Everything a sheet's figure shows and nothing else (no client id, no N), so that it can be shared."""

    rule: str
    epsilon: float
    delta: float
    sigma: float
    sampling_rate: float
    steps: int
    noise_segments: tuple[tuple[float, int], ...]
    sigma_by_rule: tuple[tuple[str, float | None], ...]
    neighbours: str = "add-remove"

    @classmethod
    def of(cls, plan: Plan) -> PlanFigure:
        return cls(
            rule=plan.rule,
            epsilon=plan.epsilon,
            delta=plan.delta,
            sigma=plan.sigma,
            sampling_rate=plan.sampling_rate,
            steps=plan.steps,
            noise_segments=tuple((float(sigma), int(count)) for sigma, count in plan.noise_segments),
            sigma_by_rule=tuple(plan.sigma_by_rule.items()),
            neighbours=plan.neighbours,
        )

    @property
    def file_name(self) -> str:
        """`plan-<digest>.png`: repr keeps every float exactly, so equal names mean equal figures."""
        return f"plan-{hashlib.sha256(repr(self).encode()).hexdigest()[:12]}.png"


def epsilon_curves(figure: PlanFigure) -> dict[str, list[float]]:
    """ε after t steps of this plan under each accountant, at CURVE_POINTS step counts."""
    checkpoints = sorted({int(round(x)) for x in np.geomspace(1, figure.steps, CURVE_POINTS)})
    events = [NoiseEvent(sigma, figure.sampling_rate, count) for sigma, count in figure.noise_segments]
    if figure.neighbours != "add-remove":  # dp-accounting's PLD under that relation; no other analysis here
        prefixes = [accountants.prefix_events(events, t) for t in checkpoints]
        pld_curve = [
            accountants.pld_epsilon(e, figure.delta, accountants.SEARCH_DISCRETIZATION, figure.neighbours)
            for e in prefixes
        ]
        return {"steps": checkpoints, "PLD": pld_curve}
    curves = {
        "steps": checkpoints,
        "PLD": accountants.pld_epsilon_curve(events, figure.delta, checkpoints),
        "RDP": accountants.rdp_epsilon_curve(events, figure.delta, checkpoints),
    }
    if len(figure.noise_segments) == 1:  # classical composition is stated for a constant σ
        curves["naive"] = [
            classical.naive_epsilon(figure.sigma, figure.delta, figure.sampling_rate, t) for t in checkpoints
        ]
        curves["strong"] = [
            classical.strong_epsilon(figure.sigma, figure.delta, figure.sampling_rate, t) for t in checkpoints
        ]
    return curves


def draw_figure(figure: PlanFigure, curves: dict[str, list[float]], path: Path) -> None:
    """ε versus steps (left) and σ by rule (right)."""
    fig = Figure(figsize=(11, 4.2), layout="tight")
    left, right = fig.subplots(1, 2)
    for name, style in (("PLD", "-"), ("RDP", "--"), ("naive", ":"), ("strong", "-.")):
        if name in curves:
            left.plot(curves["steps"], curves[name], style, label=name, linewidth=2 if name == "PLD" else 1.4)
    left.axhline(figure.epsilon, color="black", linewidth=1, alpha=0.6, label=f"target ε = {figure.epsilon:g}")
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("local noisy steps t")
    left.set_ylabel(f"ε after t steps (δ = {figure.delta:.2g})")
    left.set_title(
        f"{figure.rule} plan ({figure.neighbours}): σ = {figure.sigma:.3g}, q = {figure.sampling_rate:.3g}, "
        f"T = {figure.steps}"
    )
    left.legend(fontsize=8)
    left.grid(True, which="both", alpha=0.25)

    rules = [(name, value) for name, value in figure.sigma_by_rule if value is not None and math.isfinite(value)]
    if rules:
        names, values = zip(*rules)
        colours = [
            "tab:red"
            if name.startswith(figure.rule) or (figure.rule == "calibrated" and name == "pld_calibrated")
            else "tab:blue"
            for name in names
        ]
        right.barh(names, values, color=colours)
        right.set_xscale("log")
        for y, value in enumerate(values):
            right.text(value, y, f" {value:.3g}", va="center", fontsize=8)
    right.set_xlabel("noise multiplier σ needed for the same ε, δ, q, T (log)")
    right.set_title("σ by rule (red: this plan's rule)")
    fig.suptitle(f"ε = {figure.epsilon:g}, δ = {figure.delta:.2g}: every client with this plan")
    fig.savefig(path, dpi=110)


def write_figure(plan: Plan, out_dir: Path) -> Path:
    """The plan's figure in out_dir, drawn only if no client with the same figure has drawn it."""
    figure = PlanFigure.of(plan)
    path = out_dir / figure.file_name
    if not path.exists():
        draw_figure(figure, epsilon_curves(figure), path)
    return path


def _rows(plan: Plan) -> list[tuple[str, str]]:
    return (
        [
            ("client", str(plan.client_id)),
            ("local records N", str(plan.n)),
            ("target (ε, δ)", f"({plan.epsilon:g}, {plan.delta:.3g})"),
            ("neighbouring data sets", NEIGHBOUR_RELATIONS.get(plan.neighbours, plan.neighbours)),
            ("clipping norm C", f"{plan.clip_norm:g}"),
            ("rule", plan.rule),
            (
                "noise multiplier σ",
                _fmt(plan.sigma)
                + (
                    ""
                    if len(plan.noise_segments) == 1
                    else f" at step 1, rising to {_fmt(plan.noise_segments[-1][0])} "
                    f"({len(plan.noise_segments)} segments)"
                ),
            ),
            ("sampling rate q (Poisson)", _fmt(plan.sampling_rate)),
            ("expected batch qN", _fmt(plan.expected_batch_size)),
            ("total local steps T", str(plan.steps)),
            ("epochs k = qT", _fmt(plan.epochs)),
            ("rounds / steps per round", f"{plan.rounds} / {plan.steps_in_round(1)}"),
            (
                "learning rate",
                f"{plan.learning_rate:g} ({plan.lr_schedule}"
                f"{' ' + json.dumps(plan.lr_params) if plan.lr_params else ''})",
            ),
            ("noise std on averaged gradient σC/(qN)", _fmt(plan.noise_std_on_mean)),
            ("certified ε, PLD", _fmt(plan.epsilon_pld)),
            ("certified ε, RDP", _fmt(plan.epsilon_rdp)),
            ("budget unused ε − ε_PLD", _fmt(plan.budget_unused)),
        ]
        + [(f"ε of this plan, {name} bound", _fmt(value)) for name, value in plan.epsilon_bounds.items()]
        + ([("moments accountant constant c", _fmt(plan.moments_constant))] if plan.moments_constant else [])
    )


def _markdown(plan: Plan, figure_name: str) -> str:
    lines = [f"# Planning sheet: client {plan.client_id}", "", "| quantity | value |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in _rows(plan)]
    lines += ["", "## Validity conditions", "", "| condition | met | detail |", "| --- | --- | --- |"]
    lines += [f"| {c.name} ({c.kind}) | {'yes' if c.met else 'NO'} | {c.detail} |" for c in plan.conditions]
    lines += ["", "## σ each rule needs for the same ε, δ, q and T", "", "| rule | σ |", "| --- | --- |"]
    lines += [f"| {name} | {_fmt(value)} |" for name, value in plan.sigma_by_rule.items()]
    lines += ["", f"![ε versus steps and σ by rule]({figure_name})", ""]
    return "\n".join(lines)


def _html(plan: Plan, figure_name: str) -> str:
    def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>Planning sheet: client {html.escape(str(plan.client_id))}</title>"
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}"
        "table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}</style></head><body>"
        f"<h1>Planning sheet: client {html.escape(str(plan.client_id))}</h1>"
        + table(["quantity", "value"], _rows(plan))
        + "<h2>Validity conditions</h2>"
        + table(
            ["condition", "met", "detail"],
            [(f"{c.name} ({c.kind})", "yes" if c.met else "NO", c.detail) for c in plan.conditions],
        )
        + "<h2>σ each rule needs for the same ε, δ, q and T</h2>"
        + table(["rule", "σ"], [(name, _fmt(value)) for name, value in plan.sigma_by_rule.items()])
        + f"<img src='{html.escape(figure_name)}' alt='ε versus steps and σ by rule' width='100%'></body></html>"
    )


def write_sheet(plan: Plan, out_dir: str | Path) -> dict[str, Path]:
    """Write `<client>.md`, `<client>.html` and `<client>.json` into out_dir, and the plan's figure
    (`png`, shared with every client of the same figure) unless it is there already."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plan = with_rule_comparison(plan)
    stem = _safe_name(plan.client_id)
    paths = {kind: out / f"{stem}.{kind}" for kind in ("md", "html", "json")}
    paths["png"] = write_figure(plan, out)
    paths["md"].write_text(_markdown(plan, paths["png"].name), encoding="utf-8")
    paths["html"].write_text(_html(plan, paths["png"].name), encoding="utf-8")
    paths["json"].write_text(plan.to_json(indent=2), encoding="utf-8")
    return paths


INDEX_FIELDS = (
    "client_id",
    "rule",
    "n",
    "epsilon",
    "delta",
    "clip_norm",
    "sigma",
    "sampling_rate",
    "expected_batch_size",
    "steps",
    "epochs",
    "epsilon_pld",
    "epsilon_rdp",
    "budget_unused",
    "noise_std_on_mean",
)


def index_row(plan: Plan) -> dict[str, object]:
    """The JSON contract flattened to one CSV row (conditions and σ by rule as columns)."""
    data = plan.to_dict()
    row: dict[str, object] = {k: data[k] for k in INDEX_FIELDS}
    row.update({f"sigma_{name}": value for name, value in plan.sigma_by_rule.items()})
    row["conditions_failed"] = ";".join(c.name for c in plan.conditions if not c.met and c.kind == "required")
    row["conditions"] = ";".join(f"{c.name}={'met' if c.met else 'not met'}" for c in plan.conditions)
    return row


def write_index(plans: Sequence[Plan], out_dir: str | Path) -> dict[str, Path]:
    """index.csv (one row per client), index.md and index.html linking every sheet."""
    out = Path(out_dir)
    rows = [index_row(p) for p in plans]
    fields = list(dict.fromkeys(k for row in rows for k in row))
    paths = {"csv": out / "index.csv", "md": out / "index.md", "html": out / "index.html"}
    with paths["csv"].open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    shown = (
        "client_id",
        "n",
        "epsilon",
        "rule",
        "sigma",
        "sampling_rate",
        "steps",
        "epsilon_pld",
        "budget_unused",
    )
    md = ["# Planning sheets", "", "| " + " | ".join(shown) + " | sheet |", "|" + " --- |" * (len(shown) + 1)]
    for plan, row in zip(plans, rows):
        cells = [_fmt(row[k]) if isinstance(row[k], float) else str(row[k]) for k in shown]
        md.append("| " + " | ".join(cells) + f" | [{_safe_name(plan.client_id)}.md]({_safe_name(plan.client_id)}.md) |")
    paths["md"].write_text("\n".join(md) + "\n", encoding="utf-8")
    body = "".join(
        "<tr>"
        + "".join(f"<td>{html.escape(_fmt(row[k]) if isinstance(row[k], float) else str(row[k]))}</td>" for k in shown)
        + f"<td><a href='{_safe_name(plan.client_id)}.html'>sheet</a></td></tr>"
        for plan, row in zip(plans, rows)
    )
    paths["html"].write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>Planning sheets</title>"
        "<style>body{font-family:sans-serif;margin:2em}td,th{border:1px solid #ccc;padding:4px 8px}"
        "table{border-collapse:collapse}</style></head><body><h1>Planning sheets</h1><table><thead><tr>"
        + "".join(f"<th>{k}</th>" for k in shown)
        + "<th></th></tr></thead><tbody>"
        + body
        + "</tbody></table></body></html>",
        encoding="utf-8",
    )
    return paths


def write_sheets(plans: Sequence[Plan], out_dir: str | Path, *, index: bool = True) -> list[Path]:
    """Write every plan's sheet (and the index) all-or-nothing into out_dir."""
    plans = [with_rule_comparison(plan) for plan in plans]
    target = Path(out_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".sheets-", dir=target.parent))
    try:
        for plan in plans:
            write_sheet(plan, staging)
        if index:
            write_index(plans, staging)
        target.mkdir(exist_ok=True)
        written = []
        for file in sorted(staging.iterdir()):
            destination = target / file.name
            file.replace(destination)
            written.append(destination)
        return written
    finally:
        shutil.rmtree(staging, ignore_errors=True)
