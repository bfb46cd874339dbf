"""The results folder of one federated run, and the bookkeeping that fills it.

Results are files (DESIGN.md): sweeps, reports and tests all read the same folder:

    config.json       the resolved run config (and where the data and ledger were)
    rounds.csv        one row per round: accuracy, loss, ε spent (max/mean), clients sampled,
                      trained and dropped this round, clients out of budget / failed so far, and
                      with client-level DP the federation's ε spent and update clip…
    clients.csv       one row per client: budget, ε spent (all runs), σ, steps (this run, all
                      runs, planned), rounds trained and dropped, exhausted round, its last
                      federated evaluation (accuracy and loss on its own test rows), status
    replies.csv       one row per train reply (or missing one): round, client, outcome, reason
    plans/            every client's planning sheet (md, html, json), one figure per distinct plan, an index
    federation-plan.json, federation-ledger.sqlite
                      with client-level DP: the federation's certified plan and (unless the run
                      config names another) its ledger
    model.pt          the final global model's state_dict
    progress.png      accuracy and ε spent per round
    clients.png       each client's accuracy on its own test rows (simulations: clients that evaluated)
    summary.json      status (completed, or failed with its error) and the headline numbers, with
                      `evaluation_rows`: how many rows the central accuracy was measured on, and
                      `largest_class_share` and `beats_largest_class` (see `beats_largest_class`)

`RunRecorder` is fed plain dicts by the ServerApp (no flwr here) and rewrites the CSV files after
every round, so a run that dies midway still leaves readable results.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from fedprivacy.errors import error_summary
from fedprivacy.privacy.plan import Plan
from fedprivacy.reports.progress_figure import draw_client_accuracy, draw_progress
from fedprivacy.reports.sheets import write_sheets

ROUND_COLUMNS = (
    "round",
    "accuracy",
    "loss",
    "federated_accuracy",
    "federated_loss",
    "clients_sampled",
    "clients_trained",
    "clients_dropped",
    "clients_exhausted",
    "clients_failed",
    "epsilon_spent_max",
    "epsilon_spent_mean",
    "federation_epsilon_spent",
    "federation_update_clip",
    "train_loss",
    "clip_fraction",
    "elapsed_s",
)
# Scopes: `steps_this_run` counts the steps of this run's updates the server received;
# `steps_all_runs` and `epsilon_spent` are the client's ledger (every run on its records).
CLIENT_COLUMNS = (
    "client_id",
    "num_examples",
    "epsilon_budget",
    "epsilon_spent",
    "delta",
    "sigma",
    "steps_planned",
    "steps_this_run",
    "steps_all_runs",
    "rounds_trained",
    "rounds_dropped",
    "exhausted_round",
    "excluded_round",
    "accuracy",
    "loss",
    "test_examples",
    "evaluated_round",
    "device",
    "status",
)
REPLY_COLUMNS = ("round", "client_id", "outcome", "reason")


DIAGNOSTICS_NOTE = "not private: clients returned their raw training loss and clip fraction (simulation only)"


def resolved_config(
    settings: Any, run_id: int | str, run_config: dict[str, Any], extra: dict[str, Any]
) -> dict[str, Any]:
    """config.json: the run config as given, every setting as resolved, and where things went."""
    return {
        "run_id": run_id,
        "run_config": dict(run_config),
        "resolved": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(settings).items()},
        **extra,
    }


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def progress_line(row: dict[str, Any], rounds: int) -> str:
    """One round, as the user reads it while the run goes."""
    accuracy = row["accuracy"] if row["accuracy"] is not None else row["federated_accuracy"]
    label = "accuracy" if row["accuracy"] is not None else "federated accuracy"
    return (
        f"round {row['round']}/{rounds}: {label} {_fmt(accuracy)} | ε spent max {row['epsilon_spent_max']:.4f}"
        f" mean {row['epsilon_spent_mean']:.4f}{_federation_part(row)} | {row['clients_trained']} trained, "
        f"{row['clients_exhausted']} out of budget, {row['clients_failed']} failed"
    )


def _federation_part(values: dict[str, Any]) -> str:
    """The federation's client-level ε spent, when the run has client-level DP."""
    spent = values.get("federation_epsilon_spent")
    return "" if spent is None else f", federation ε spent {spent:.4f}"


def largest_class_share(labels: Any) -> float:
    """The accuracy of always predicting the most frequent label of `labels` (a 1-D int array)."""
    counts = np.bincount(np.asarray(labels, dtype=np.int64))
    return float(counts.max() / counts.sum())


def beats_largest_class(accuracy: float | None, share: float | None, rows: int | None) -> bool | None:
    """Whether `accuracy` on `rows` evaluation rows is above what always predicting the largest class
    scores there (`share`) by more than 1.96 standard errors of an accuracy of `share` on `rows` rows
    (sqrt(share·(1 − share)/rows)); None when the run measured no central accuracy."""
    if accuracy is None or share is None or not rows:
        return None
    return accuracy > share + 1.96 * math.sqrt(share * (1.0 - share) / rows)


def no_better_line(summary: dict[str, Any]) -> str | None:
    """A completed run's warning when its final accuracy is no better than predicting the largest class."""
    if summary.get("beats_largest_class") is not False:
        return None
    federation = summary.get("federation")
    advice = (
        "try more local steps (epochs), another learning-rate, more num-server-rounds or a larger epsilon, or "
        "tune them in a sweep (docs/simulator.md)"
    )
    if federation is not None:  # the likelier cause first
        advice = (
            f"client-level DP adds noise σS/pM to every coordinate with {federation['members']} members: it needs "
            "hundreds of them, an update-clip matched to the updates' norms (or update-clip-quantile) and a larger "
            f"federation-cohort or federation-epsilon; else {advice}"
        )
    return (
        f"warning: final accuracy {_fmt(summary['final_accuracy'])} is no better than always predicting the "
        f"largest class ({summary['largest_class_share']:.4f} of the {summary['evaluation_rows']} evaluation rows): "
        f"the model learned nothing it shows; {advice}"
    )


def done_line(summary: dict[str, Any]) -> str:
    return (
        f"done: final accuracy {_fmt(summary['final_accuracy'] or summary['final_federated_accuracy'])}, "
        f"max ε spent {summary['epsilon_spent_max']:.4f}{_federation_part(summary)}, "
        f"all within budget: {summary['all_within_budget']}"
    )


def new_run_folder(results_dir: Path, run_id: int | str) -> Path:
    """A fresh folder `<results_dir>/<local time>-run<run_id>` (never reuses an existing one)."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = results_dir / f"{stamp}-run{run_id}"
    folder, n = base, 1
    while folder.exists():
        n += 1
        folder = base.with_name(f"{base.name}-{n}")
    folder.mkdir(parents=True)
    return folder


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _csv_text(columns: tuple[str, ...], rows: list[dict[str, Any]]) -> str:
    """The rows as CSV lines (None as an empty cell), in the columns' order, formatted in one pass."""
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerows(
        ["" if (value := row.get(k)) is None else value for k in columns] for row in rows
    )
    return buffer.getvalue()


def _write_csv(path: Path, columns: tuple[str, ...], rows: list[dict[str, Any]], body: str | None = None) -> None:
    """Rewrite a CSV file atomically (a reader or a crash never sees half of it). `body`: the rows
    already formatted, so a file that only grows formats each row once."""
    _atomic_write(path, ",".join(columns) + "\n" + (_csv_text(columns, rows) if body is None else body))


def _weighted(pairs: list[tuple[int, float | None]]) -> float | None:
    """Example-weighted mean of raw diagnostics; None when clients sent none (the private default)."""
    weight = sum(n for n, _ in pairs)
    if not weight or any(value is None for _, value in pairs):
        return None
    return sum(n * float(value) for n, value in pairs) / weight


@dataclass
class ClientRecord:
    """What the server knows about one client, from its replies."""

    client_id: str
    num_examples: int = 0
    epsilon_budget: float = math.nan
    epsilon_spent: float = 0.0  # all runs: the client's ledger
    delta: float = math.nan
    sigma: float = math.nan
    steps_planned: int = 0  # this run's plan T
    steps_this_run: int = 0  # steps of the updates this server received in this run
    steps_all_runs: int = 0  # the client's ledger: every run on its records
    rounds_trained: int = 0
    rounds_dropped: int = 0  # rounds whose reply was an error, invalid or missing
    exhausted_round: int | None = None
    excluded_round: int | None = None  # the round after which it was not sampled again
    accuracy: float = math.nan  # the global model on its own test rows, at its last federated evaluation
    loss: float = math.nan  # (simulations only: a deployed client releases no evaluation)
    test_examples: int = 0
    evaluated_round: int | None = None
    device: str = ""  # where it last trained: "gpu" or "cpu"
    status: str = "ok"  # ok, exhausted, or "failed: <why its last reply was dropped>"


@dataclass
class RunRecorder:
    """Collects per-client replies and per-round evaluations; writes the results folder."""

    folder: Path
    started: float = field(default_factory=time.monotonic)
    clients: dict[str, ClientRecord] = field(default_factory=dict)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    plans: dict[str, Plan] = field(default_factory=dict)
    replies: list[dict[str, Any]] = field(default_factory=list)
    evaluation_rows: int | None = None  # the central evaluation set's rows (None: federated); a report's binomial s.e.
    largest_class_share: float | None = None  # what predicting the central evaluation set's largest class scores
    _round: dict[str, Any] = field(default_factory=dict)
    # rounds.csv, clients.csv and replies.csv are rewritten after a round only once this many seconds
    # have passed since they last were (0: after every round), and whenever a summary is written
    tables_every_s: float = 0.0
    # replies.csv grows by a round's rows: each row formatted once, (rows formatted, their text)
    _reply_text: tuple[int, list[str]] = field(default_factory=lambda: (0, []))
    _tables_written: tuple[float, int] | None = None  # (when, rounds in them) of the tables' last writing

    def write_config(self, config: dict[str, Any]) -> None:
        _atomic_write(self.folder / "config.json", json.dumps(config, indent=2, default=str) + "\n")

    def client(self, client_id: str) -> ClientRecord:
        record = self.clients.get(client_id)
        if record is None:  # not setdefault, which would build a record for every reply (8 µs each)
            record = self.clients[client_id] = ClientRecord(client_id)
        return record

    def trained(self, server_round: int, client_id: str, metrics: dict[str, float], plan: Plan | None) -> None:
        """A training reply: `metrics` carries the ClientApp's numbers (see clients/app.py)."""
        rec = self.client(client_id)
        rec.num_examples = plan.n if plan is not None else int(metrics["num-examples"])
        rec.epsilon_budget = float(metrics["epsilon-budget"])
        rec.epsilon_spent = float(metrics["epsilon-spent"])
        rec.delta = float(metrics["delta"])
        rec.sigma = float(metrics["sigma"])
        rec.steps_all_runs = int(metrics["steps-done"])
        rec.steps_planned = int(metrics["steps-planned"])
        if plan is not None:
            self.plans[client_id] = plan
        current = self._round.setdefault("trained", [])
        if metrics["budget-exhausted"]:
            rec.exhausted_round = rec.exhausted_round or server_round
            rec.status = "exhausted"
            self._reply(server_round, client_id, "exhausted", "")
            return
        rec.rounds_trained += 1
        rec.status = "ok"
        if plan is not None:
            rec.steps_this_run += plan.steps_in_round(server_round)
        rec.device = "gpu" if metrics["on-gpu"] else "cpu"
        current.append((int(metrics["num-examples"]), metrics.get("train-loss"), metrics.get("clip-fraction")))
        self._reply(server_round, client_id, "trained", "")

    def client_evaluated(self, server_round: int, client_id: str, accuracy: float, loss: float, rows: int) -> None:
        """A client's federated evaluation of the global model on its own test rows (its latest is kept)."""
        rec = self.client(client_id)
        rec.accuracy, rec.loss, rec.test_examples, rec.evaluated_round = (
            float(accuracy),
            float(loss),
            rows,
            server_round,
        )

    def sampled(self, server_round: int, count: int) -> None:
        """How many clients were asked to train in this round."""
        self._round["sampled"] = count

    def dropped(self, server_round: int, client_id: str, outcome: str, reason: str, excluded: bool = False) -> None:
        """A reply left out of aggregation (`outcome`: error, invalid or no reply), and why;
        `excluded`: the client is not sampled again in this run."""
        rec = self.client(client_id)
        rec.rounds_dropped += 1
        rec.status = f"failed: {error_summary(reason)}"
        if excluded:
            rec.excluded_round = server_round
        self._round["dropped"] = self._round.get("dropped", 0) + 1
        self._reply(server_round, client_id, outcome, error_summary(reason))

    def rename(self, old: str, new: str) -> None:
        """A client known only by its node (it failed before it ever replied) tells its name."""
        if old not in self.clients:
            return
        record = self.clients.pop(old)
        merged = self.client(new)
        merged.rounds_dropped += record.rounds_dropped
        merged.excluded_round = merged.excluded_round or record.excluded_round
        for row in self.replies:
            if row["client_id"] == old:
                row["client_id"] = new
        self._reply_text = (0, [])

    def _reply(self, server_round: int, client_id: str, outcome: str, reason: str) -> None:
        self.replies.append({"round": server_round, "client_id": client_id, "outcome": outcome, "reason": reason})

    def federation_round(self, epsilon: float, update_clip: float | None) -> None:
        """The federation's client-level ε spent once this round's aggregate was released, and the
        update clip S it used."""
        self._round["federation_epsilon_spent"] = float(epsilon)
        self._round["federation_update_clip"] = update_clip

    def evaluated(self, key: str, accuracy: float, loss: float) -> None:
        """Round metrics from central ('') or federated ('federated_') evaluation."""
        self._round[f"{key}accuracy"] = float(accuracy)
        self._round[f"{key}loss"] = float(loss)

    def end_round(self, server_round: int) -> dict[str, Any]:
        """Close the round: append its row, rewrite the CSV files when due (`tables_every_s`),
        return the row."""
        trained = self._round.pop("trained", [])
        spent = [c.epsilon_spent for c in self.clients.values() if not c.status.startswith("failed")]
        row = {
            "round": server_round,
            "accuracy": self._round.get("accuracy"),
            "loss": self._round.get("loss"),
            "federated_accuracy": self._round.get("federated_accuracy"),
            "federated_loss": self._round.get("federated_loss"),
            "clients_sampled": self._round.get("sampled", 0),
            "clients_trained": len(trained),
            "clients_dropped": self._round.get("dropped", 0),
            "clients_exhausted": sum(1 for c in self.clients.values() if c.exhausted_round is not None),
            "clients_failed": sum(1 for c in self.clients.values() if c.status.startswith("failed")),
            "epsilon_spent_max": max(spent, default=0.0),
            "epsilon_spent_mean": sum(spent) / len(spent) if spent else 0.0,
            "federation_epsilon_spent": self._round.get("federation_epsilon_spent"),
            "federation_update_clip": self._round.get("federation_update_clip"),
            "train_loss": _weighted([(n, loss) for n, loss, _ in trained]),
            "clip_fraction": _weighted([(n, clip) for n, _, clip in trained]),
            "elapsed_s": round(time.monotonic() - self.started, 3),
        }
        self._round = {}
        self.rounds.append(row)
        last_written = self.started if self._tables_written is None else self._tables_written[0]
        if time.monotonic() - last_written >= self.tables_every_s:
            self.write_tables()
        return row

    def write_tables(self) -> None:
        """Rewrite rounds.csv, clients.csv and replies.csv with everything recorded so far."""
        _write_csv(self.folder / "rounds.csv", ROUND_COLUMNS, self.rounds)
        _write_csv(self.folder / "clients.csv", CLIENT_COLUMNS, [vars(self.clients[c]) for c in sorted(self.clients)])
        done, chunks = self._reply_text
        chunks.append(_csv_text(REPLY_COLUMNS, self.replies[done:]))
        self._reply_text = (len(self.replies), chunks)
        _write_csv(self.folder / "replies.csv", REPLY_COLUMNS, self.replies, "".join(chunks))
        self._tables_written = (time.monotonic(), len(self.rounds))

    def require_training(self) -> None:
        """An untrained model.pt would pass for a result: a run in which no client trained fails."""
        if not any(c.rounds_trained for c in self.clients.values()):
            failed = sum(c.rounds_dropped > 0 for c in self.clients.values())
            exhausted = sum(c.exhausted_round is not None for c in self.clients.values())
            raise RuntimeError(
                f"no client trained in any round ({failed} failed, {exhausted} out of budget): "
                "no model was saved; see clients.csv"
            )

    def write_plans(self) -> list[Path]:
        """Every client's planning sheet (md, html, json), the plans' figures and the index, under plans/."""
        plans = [self.plans[c] for c in sorted(self.plans)]
        return write_sheets(plans, self.folder / "plans") if plans else []

    def save_model(self, state_dict: dict[str, Any]) -> Path:
        import torch

        path = self.folder / "model.pt"
        torch.save(state_dict, path)
        return path

    def write_figure(self) -> Path:
        """progress.png: accuracy (central, else federated) and max ε spent per round; and
        clients.png, each client's accuracy on its own test rows, where clients evaluated."""
        central = self.rounds[-1].get("accuracy") if self.rounds else None
        draw_client_accuracy([vars(c) for c in self.clients.values()], central, self.folder / "clients.png")
        return draw_progress(self.rounds, self.folder / "progress.png")

    def write_summary(self, extra: dict[str, Any], error: str | None = None) -> dict[str, Any]:
        """summary.json (the round tables first, if rounds are waiting for them); `error` marks a
        run that stopped on an exception (what it had is kept). A failed run that never created its
        ledger file says so instead of naming it as if it held spends (a deployment's `ledger` is a
        sentence: its ledgers are on the SuperNodes)."""
        if self.rounds and (self._tables_written is None or self._tables_written[1] < len(self.rounds)):
            self.write_tables()  # rounds that waited for `tables_every_s`
        ledger = extra.get("ledger")
        if error is not None and isinstance(ledger, str) and Path(ledger).is_absolute() and not Path(ledger).exists():
            extra = {**extra, "ledger": f"none: the run stopped before {ledger} was created"}
        last = self.rounds[-1] if self.rounds else {}
        summary = {
            "status": "completed" if error is None else "failed",
            "error": error,
            "results_dir": str(self.folder),
            "rounds": len(self.rounds),
            "final_accuracy": last.get("accuracy"),
            "final_federated_accuracy": last.get("federated_accuracy"),
            "evaluation_rows": self.evaluation_rows,
            "largest_class_share": self.largest_class_share,
            "beats_largest_class": beats_largest_class(
                last.get("accuracy"), self.largest_class_share, self.evaluation_rows
            ),
            "clients": len(self.clients),
            "clients_exhausted": sorted(c.client_id for c in self.clients.values() if c.exhausted_round),
            "clients_failed": sorted(c.client_id for c in self.clients.values() if c.status.startswith("failed")),
            "epsilon_spent_max": max((c.epsilon_spent for c in self.clients.values()), default=0.0),
            "epsilon_spent_mean": last.get("epsilon_spent_mean"),
            "federation_epsilon_spent": last.get("federation_epsilon_spent"),
            "all_within_budget": all(
                c.epsilon_spent <= c.epsilon_budget for c in self.clients.values() if not math.isnan(c.epsilon_budget)
            )
            if self.clients
            else None,  # no client replied: nothing to say
            "wall_time_s": round(time.monotonic() - self.started, 3),
            **extra,
        }
        _atomic_write(self.folder / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")
        return summary
