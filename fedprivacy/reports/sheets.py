"""Planning sheets: one page per client (Markdown, HTML, JSON), a figure per distinct plan, and an index.

A sheet shows the inputs, the chosen plan, its certificate,
the budget left unused, the rule's conditions by name, the σ every other rule would need (added
here when a run's plans came without it), and a
figure of ε versus steps (PLD, RDP, naive, strong) beside a bar chart of σ by rule.

A rule's σ (and a classical ε curve) is shown only where the rule's conditions hold: elsewhere
the tables read "—" and name the conditions not met, and the figure leaves it out and lists it
(`planner.comparison_conditions`). The plan's own σ is always shown: the PLD certifies it.

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
from fedprivacy.privacy.plan import NEIGHBOUR_RELATIONS, RELEASED_MECHANISM, Condition, Plan
from fedprivacy.privacy.planner import comparison_conditions, with_rule_comparison
from fedprivacy.privacy.proactive import proactive_step_range

CURVE_POINTS = 24


def _safe_name(client_id: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in str(client_id)) or "client"


def _fmt(value: float | None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value:.{digits}g}"


def _failed(conditions: Sequence[Condition]) -> tuple[str, ...]:
    return tuple(c.name for c in conditions if c.kind == "required" and not c.met)


def _omitted(failed: Sequence[str]) -> str:
    """The cell of a value left out because its formula does not hold here."""
    return f"— (not met: {', '.join(failed)})"


def checkpoints(steps: int) -> list[int]:
    """The step counts at which a figure's curves are evaluated."""
    return sorted({int(round(x)) for x in np.geomspace(1, steps, CURVE_POINTS)})


def rule_comparison(plan: Plan) -> list[tuple[str, float | None, tuple[Condition, ...]]]:
    """(rule, σ shown, its required conditions not met) for each rule beside the plan: σ is None
    where a condition fails, except for the plan's own rule (its σ is certified by PLD)."""
    conditions = comparison_conditions(plan)
    rows = []
    for name, value in plan.sigma_by_rule.items():
        failed = tuple(c for c in conditions.get(name, ()) if c.kind == "required" and not c.met)
        own = name == plan.rule
        rows.append((name, value if own or not failed else None, () if own else failed))
    return rows


@dataclass(frozen=True)
class PlanFigure:
    """Everything a sheet's figure shows and nothing else (no client id, no N), so that it can be shared.

    N enters only through what it decides: whether the proactive rule's conditions hold (`omitted`,
    `proactive_steps`), so clients whose N decides them alike share the figure."""

    rule: str
    epsilon: float
    delta: float
    sigma: float
    sampling_rate: float
    steps: int
    noise_segments: tuple[tuple[float, int], ...]
    sigma_by_rule: tuple[tuple[str, float | None], ...]  # None: not drawn (a condition fails)
    neighbours: str = "add-remove"
    omitted: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (rule, its conditions not met)
    proactive_steps: tuple[int, ...] = ()  # (first, last) step count where the proactive rule's conditions hold

    @classmethod
    def of(cls, plan: Plan) -> PlanFigure:
        comparison = rule_comparison(plan)
        proactive_steps = ()
        if plan.rule == "proactive":  # its claim: (ε, δ) after t steps of this σ at rate q, where its conditions hold
            proactive_steps = proactive_step_range(plan.n, plan.epsilon, plan.delta, plan.sampling_rate, plan.steps)
        return cls(
            rule=plan.rule,
            epsilon=plan.epsilon,
            delta=plan.delta,
            sigma=plan.sigma,
            sampling_rate=plan.sampling_rate,
            steps=plan.steps,
            noise_segments=tuple((float(sigma), int(count)) for sigma, count in plan.noise_segments),
            sigma_by_rule=tuple((name, value) for name, value, _ in comparison),
            neighbours=plan.neighbours,
            omitted=tuple((name, tuple(c.name for c in failed)) for name, _, failed in comparison if failed),
            proactive_steps=proactive_steps,
        )

    @property
    def file_name(self) -> str:
        """`plan-<digest>.png`: repr keeps every float exactly, so equal names mean equal figures."""
        return f"plan-{hashlib.sha256(repr(self).encode()).hexdigest()[:12]}.png"


def epsilon_curves(figure: PlanFigure) -> dict[str, list[float]]:
    """ε after t steps of this plan under each accountant, at CURVE_POINTS step counts; for the
    classical bounds also `<name>_holds`, whether their conditions hold at each count."""
    steps = checkpoints(figure.steps)
    events = [NoiseEvent(sigma, figure.sampling_rate, count) for sigma, count in figure.noise_segments]
    if figure.neighbours != "add-remove":  # dp-accounting's PLD under that relation; no other analysis here
        prefixes = [accountants.prefix_events(events, t) for t in steps]
        pld_curve = [
            accountants.pld_epsilon(e, figure.delta, accountants.SEARCH_DISCRETIZATION, figure.neighbours)
            for e in prefixes
        ]
        return {"steps": steps, "PLD": pld_curve}
    curves = {
        "steps": steps,
        "PLD": accountants.pld_epsilon_curve(events, figure.delta, steps),
        "RDP": accountants.rdp_epsilon_curve(events, figure.delta, steps),
    }
    if len(figure.noise_segments) == 1:  # classical composition is stated for a constant σ
        for name, bound in (("naive", classical.naive_epsilon_bound), ("strong", classical.strong_epsilon_bound)):
            bounds = [bound(figure.sigma, figure.delta, figure.sampling_rate, t) for t in steps]
            curves[name] = [b.value for b in bounds]
            curves[f"{name}_holds"] = [b.holds for b in bounds]
    return curves


def draw_figure(figure: PlanFigure, curves: dict[str, list[float]], path: Path) -> None:
    """ε versus steps (left) and σ by rule (right)."""
    fig = Figure(figsize=(11, 4.2), layout="tight")
    left, right = fig.subplots(1, 2)
    for name, style in (("PLD", "-"), ("RDP", "--"), ("naive", ":"), ("strong", "-.")):
        if name not in curves:
            continue
        holds = curves.get(f"{name}_holds", [True] * len(curves[name]))
        shown = [value if ok else math.nan for value, ok in zip(curves[name], holds)]
        label = (
            name if all(holds) else f"{name} (where its conditions hold)" if any(holds) else f"{name}: not valid here"
        )
        left.plot(curves["steps"], shown, style, label=label, linewidth=2 if name == "PLD" else 1.4)
    if figure.proactive_steps:
        left.plot(
            figure.proactive_steps,
            [figure.epsilon] * len(figure.proactive_steps),
            "|-",
            color="tab:red",
            linewidth=5,
            alpha=0.35,
            label="proactive bound (its conditions met)",
        )
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
            if name.startswith(figure.rule)
            or (figure.rule == "calibrated" and name == "pld_calibrated")
            or (figure.rule == "calibrated-rdp" and name == "rdp_calibrated")
            else "tab:blue"
            for name in names
        ]
        right.barh(names, values, color=colours)
        right.set_xscale("log")
        for y, value in enumerate(values):
            right.text(value, y, f" {value:.3g}", va="center", fontsize=8)
    right.set_xlabel(
        "noise multiplier σ needed for the same ε, δ, q, T (log)"
        + "".join(f"\n{name} not shown, not met: {', '.join(failed)}" for name, failed in figure.omitted)
    )
    right.set_title("σ by rule where its conditions hold (red: this plan's rule)")
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
            ("released mechanism", RELEASED_MECHANISM),
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
            ("rounds / steps per round", f"{plan.rounds} / {_steps_per_round(plan)}"),
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
        + [
            (f"ε of this plan, {name} bound", _epsilon_bound_cell(plan, name, value))
            for name, value in plan.epsilon_bounds.items()
        ]
        + ([("moments accountant constant c", _moments_cell(plan))] if plan.moments_constant else [])
    )


_EPSILON_BOUNDS = {"naive": classical.naive_epsilon_bound, "strong": classical.strong_epsilon_bound}


def _epsilon_bound_cell(plan: Plan, name: str, value: float | None) -> str:
    """A classical ε of this plan, or "—" where its formula does not hold for the plan's σ, q, T."""
    if name not in _EPSILON_BOUNDS or len(plan.noise_segments) != 1:
        return _fmt(value)
    failed = _EPSILON_BOUNDS[name](plan.sigma, plan.delta, plan.sampling_rate, plan.steps).failed
    return _omitted(failed) if failed else _fmt(value)


def _moments_cell(plan: Plan) -> str:
    """Abadi et al.'s constant c, or "—" where Lemma 3 (σ ≥ 1, q < 1/(16σ)) does not hold."""
    failed = _failed(comparison_conditions(plan).get("moments_constant", ()))
    return _omitted(failed) if failed else _fmt(plan.moments_constant)


def _sigma_rows(plan: Plan) -> list[tuple[str, str]]:
    return [
        (name, _omitted([c.name for c in failed]) if failed else _fmt(value))
        for name, value, failed in rule_comparison(plan)
    ]


def _unmet_rows(plan: Plan) -> list[tuple[str, str, str]]:
    """(rule, condition, detail) for every condition that keeps a rule's σ (or c) off the sheet."""
    rows = [(name, c.name, c.detail) for name, _, failed in rule_comparison(plan) for c in failed]
    moments = comparison_conditions(plan).get("moments_constant", ())
    return rows + [("moments_constant", c.name, c.detail) for c in moments if c.kind == "required" and not c.met]


UNMET_NOTE = "— : the rule's formula is not a valid bound for this plan; the conditions it does not meet:"
CONDITIONS_NOTE = (
    "`required`: a condition of the theorem behind the plan's rule. Where one is not met (NO) the rule's own "
    "bound does not vouch for this plan, but the plan still runs: its ε is the PLD certificate's, which holds "
    "whatever the conditions."
)


def _steps_per_round(plan: Plan) -> str:
    """T split over the rounds: `11` when every round has as many, `10–11` when the first T mod R
    rounds take one more (`plan.round_steps`)."""
    fewest, most = plan.steps_in_round(plan.rounds), plan.steps_in_round(1)
    return f"{most}" if fewest == most else f"{fewest}–{most} (the first {plan.steps % plan.rounds} take {most})"


def _markdown(plan: Plan, figure_name: str) -> str:
    lines = [f"# Planning sheet: client {plan.client_id}", "", "| quantity | value |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in _rows(plan)]
    lines += [
        "",
        "## Validity conditions",
        "",
        CONDITIONS_NOTE,
        "",
        "| condition | met | detail |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {c.name} ({c.kind}) | {'yes' if c.met else 'NO'} | {c.detail} |" for c in plan.conditions]
    lines += ["", "## σ each rule needs for the same ε, δ, q and T", "", "| rule | σ |", "| --- | --- |"]
    lines += [f"| {name} | {cell} |" for name, cell in _sigma_rows(plan)]
    unmet = _unmet_rows(plan)
    if unmet:
        lines += ["", UNMET_NOTE, "", "| rule | condition | detail |", "| --- | --- | --- |"]
        lines += [f"| {rule} | {name} | {detail} |" for rule, name, detail in unmet]
    lines += ["", f"![ε versus steps and σ by rule]({figure_name})", ""]
    return "\n".join(lines)


def _html(plan: Plan, figure_name: str) -> str:
    def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    unmet = _unmet_rows(plan)
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>Planning sheet: client {html.escape(str(plan.client_id))}</title>"
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}"
        "table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}</style></head><body>"
        f"<h1>Planning sheet: client {html.escape(str(plan.client_id))}</h1>"
        + table(["quantity", "value"], _rows(plan))
        + "<h2>Validity conditions</h2>"
        + f"<p>{html.escape(CONDITIONS_NOTE.replace('`', ''))}</p>"
        + table(
            ["condition", "met", "detail"],
            [(f"{c.name} ({c.kind})", "yes" if c.met else "NO", c.detail) for c in plan.conditions],
        )
        + "<h2>σ each rule needs for the same ε, δ, q and T</h2>"
        + table(["rule", "σ"], _sigma_rows(plan))
        + (f"<p>{html.escape(UNMET_NOTE)}</p>" + table(["rule", "condition", "detail"], unmet) if unmet else "")
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
