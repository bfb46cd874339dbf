"""Planning sheets: one page per client (Markdown, HTML, PNG figure) and an index of all clients.

A sheet shows what notes/privacy.md §6 asks: the inputs, the chosen plan, its certificate,
the budget left unused, the rule's conditions by name, the σ every other rule would need, and a
figure of ε versus steps (PLD, RDP, naive, strong) beside a bar chart of σ by rule.

Writing is all-or-nothing: files go to a temporary folder beside the target and are moved in
only when every sheet has been written, so a failure leaves no partial output.
"""

from __future__ import annotations

import csv
import html
import json
import math
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (backend first: sheets are written headless)
import numpy as np  # noqa: E402

from fedprivacy.privacy import accountants, classical  # noqa: E402
from fedprivacy.privacy.accountants import NoiseEvent  # noqa: E402
from fedprivacy.privacy.plan import Plan  # noqa: E402

CURVE_POINTS = 24


def _safe_name(client_id: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in str(client_id)) or "client"


def _fmt(value: float | None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value:.{digits}g}"


def epsilon_curves(plan: Plan) -> dict[str, list[float]]:
    """ε after t steps of this plan under each accountant, at CURVE_POINTS step counts."""
    checkpoints = sorted({int(round(x)) for x in np.geomspace(1, plan.steps, CURVE_POINTS)})
    events = [NoiseEvent(sigma, plan.sampling_rate, count) for sigma, count in plan.noise_segments]
    curves = {
        "steps": checkpoints,
        "PLD": accountants.pld_epsilon_curve(events, plan.delta, checkpoints),
        "RDP": accountants.rdp_epsilon_curve(events, plan.delta, checkpoints),
    }
    if len(plan.noise_segments) == 1:  # classical composition is stated for a constant σ
        curves["naive"] = [classical.naive_epsilon(plan.sigma, plan.delta, plan.sampling_rate, t) for t in checkpoints]
        curves["strong"] = [classical.strong_epsilon(plan.sigma, plan.delta, plan.sampling_rate, t) for t in checkpoints]
    return curves


def draw_figure(plan: Plan, curves: dict[str, list[float]], path: Path) -> None:
    """ε versus steps (left) and σ by rule (right)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, style in (("PLD", "-"), ("RDP", "--"), ("naive", ":"), ("strong", "-.")):
        if name in curves:
            left.plot(curves["steps"], curves[name], style, label=name, linewidth=2 if name == "PLD" else 1.4)
    left.axhline(plan.epsilon, color="black", linewidth=1, alpha=0.6, label=f"target ε = {plan.epsilon:g}")
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("local noisy steps t")
    left.set_ylabel(f"ε after t steps (δ = {plan.delta:.2g})")
    left.set_title(f"{plan.rule} plan: σ = {plan.sigma:.3g}, q = {plan.sampling_rate:.3g}, T = {plan.steps}")
    left.legend(fontsize=8)
    left.grid(True, which="both", alpha=0.25)

    rules = [(name, value) for name, value in plan.sigma_by_rule.items() if value is not None and math.isfinite(value)]
    if rules:
        names, values = zip(*rules)
        colours = ["tab:red" if name.startswith(plan.rule) or (plan.rule == "calibrated" and name == "pld_calibrated")
                   else "tab:blue" for name in names]
        right.barh(names, values, color=colours)
        right.set_xscale("log")
        for y, value in enumerate(values):
            right.text(value, y, f" {value:.3g}", va="center", fontsize=8)
    right.set_xlabel("noise multiplier σ needed for the same ε, δ, q, T (log)")
    right.set_title("σ by rule (red: this plan's rule)")
    fig.suptitle(f"N = {plan.n}, ε = {plan.epsilon:g}, δ = {plan.delta:.2g}")  # the same for equal plans: drawn once
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rows(plan: Plan) -> list[tuple[str, str]]:
    return [
        ("client", str(plan.client_id)),
        ("local records N", str(plan.n)),
        ("target (ε, δ)", f"({plan.epsilon:g}, {plan.delta:.3g})"),
        ("clipping norm C", f"{plan.clip_norm:g}"),
        ("rule", plan.rule),
        ("noise multiplier σ", _fmt(plan.sigma)
         + ("" if len(plan.noise_segments) == 1 else f" at step 1, rising to {_fmt(plan.noise_segments[-1][0])} ({len(plan.noise_segments)} segments)")),
        ("sampling rate q (Poisson)", _fmt(plan.sampling_rate)),
        ("expected batch qN", _fmt(plan.expected_batch_size)),
        ("total local steps T", str(plan.steps)),
        ("epochs k = qT", _fmt(plan.epochs)),
        ("rounds / steps per round", f"{plan.rounds} / {plan.steps_in_round(1)}"),
        ("learning rate", f"{plan.learning_rate:g} ({plan.lr_schedule}{' ' + json.dumps(plan.lr_params) if plan.lr_params else ''})"),
        ("noise std on averaged gradient σC/(qN)", _fmt(plan.noise_std_on_mean)),
        ("certified ε, PLD", _fmt(plan.epsilon_pld)),
        ("certified ε, RDP", _fmt(plan.epsilon_rdp)),
        ("budget unused ε − ε_PLD", _fmt(plan.budget_unused)),
    ] + [(f"ε of this plan, {name} bound", _fmt(value)) for name, value in plan.epsilon_bounds.items()] + (
        [("moments accountant constant c", _fmt(plan.moments_constant))] if plan.moments_constant else []
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
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}</style></head><body>"
        f"<h1>Planning sheet: client {html.escape(str(plan.client_id))}</h1>"
        + table(["quantity", "value"], _rows(plan))
        + "<h2>Validity conditions</h2>"
        + table(["condition", "met", "detail"], [(f"{c.name} ({c.kind})", "yes" if c.met else "NO", c.detail) for c in plan.conditions])
        + "<h2>σ each rule needs for the same ε, δ, q and T</h2>"
        + table(["rule", "σ"], [(name, _fmt(value)) for name, value in plan.sigma_by_rule.items()])
        + f"<img src='{html.escape(figure_name)}' alt='ε versus steps and σ by rule' width='100%'></body></html>"
    )


def write_sheet(plan: Plan, out_dir: str | Path, drawn: dict[str, Path] | None = None) -> dict[str, Path]:
    """Write `<client>.md`, `<client>.html`, `<client>.png` and `<client>.json` into out_dir.

    `drawn` maps plans (less their client id) to figures already drawn: a figure costs about a
    second, and the clients of an IID split often share one plan (200 clients: 2 distinct plans).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = _safe_name(plan.client_id)
    paths = {kind: out / f"{stem}.{kind}" for kind in ("md", "html", "png", "json")}
    drawn = {} if drawn is None else drawn
    key = json.dumps({**plan.to_dict(), "client_id": None}, sort_keys=True)
    if key in drawn:
        if drawn[key] != paths["png"]:  # two clients may share one plan, and so one sheet name
            shutil.copyfile(drawn[key], paths["png"])
    else:
        draw_figure(plan, epsilon_curves(plan), paths["png"])
        drawn[key] = paths["png"]
    paths["md"].write_text(_markdown(plan, paths["png"].name), encoding="utf-8")
    paths["html"].write_text(_html(plan, paths["png"].name), encoding="utf-8")
    paths["json"].write_text(plan.to_json(indent=2), encoding="utf-8")
    return paths


INDEX_FIELDS = (
    "client_id", "rule", "n", "epsilon", "delta", "clip_norm", "sigma", "sampling_rate", "expected_batch_size",
    "steps", "epochs", "epsilon_pld", "epsilon_rdp", "budget_unused", "noise_std_on_mean",
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
    shown = ("client_id", "n", "epsilon", "rule", "sigma", "sampling_rate", "steps", "epsilon_pld", "budget_unused")
    md = ["# Planning sheets", "", "| " + " | ".join(shown) + " | sheet |", "|" + " --- |" * (len(shown) + 1)]
    for plan, row in zip(plans, rows):
        cells = [_fmt(row[k]) if isinstance(row[k], float) else str(row[k]) for k in shown]
        md.append("| " + " | ".join(cells) + f" | [{_safe_name(plan.client_id)}.md]({_safe_name(plan.client_id)}.md) |")
    paths["md"].write_text("\n".join(md) + "\n", encoding="utf-8")
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(row[k]) if isinstance(row[k], float) else str(row[k]))}</td>" for k in shown)
        + f"<td><a href='{_safe_name(plan.client_id)}.html'>sheet</a></td></tr>"
        for plan, row in zip(plans, rows)
    )
    paths["html"].write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>Planning sheets</title>"
        "<style>body{font-family:sans-serif;margin:2em}td,th{border:1px solid #ccc;padding:4px 8px}"
        "table{border-collapse:collapse}</style></head><body><h1>Planning sheets</h1><table><thead><tr>"
        + "".join(f"<th>{k}</th>" for k in shown) + "<th></th></tr></thead><tbody>" + body + "</tbody></table></body></html>",
        encoding="utf-8",
    )
    return paths


def write_sheets(plans: Sequence[Plan], out_dir: str | Path, *, index: bool = True) -> list[Path]:
    """Write every plan's sheet (and the index) all-or-nothing into out_dir."""
    target = Path(out_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".sheets-", dir=target.parent))
    try:
        drawn: dict[str, Path] = {}
        for plan in plans:
            write_sheet(plan, staging, drawn)
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
