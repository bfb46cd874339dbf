"""The ServerApp: FedAvg over DP-SGD clients, central evaluation, and the results folder.

The results folder is `<results-dir>/<time>-run<run id>` (results-dir from the run config,
default ~/fedprivacy-results; it must be absolute, see fedprivacy.runconfig). It is printed at
the start and at the end of every run. In a simulation the clients' ledger lives in it too,
unless the run config names a `ledger-path`; deployed clients keep theirs on their SuperNodes,
where the server cannot see them, and config.json / summary.json say so.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import flwr
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedprivacy.errors import InputError, error_summary
from fedprivacy.participant import evaluate_model, new_model, server_test_set
from fedprivacy.results import RunRecorder, new_run_folder
from fedprivacy.runconfig import RunSettings, parse_run_config
from server.strategy import PrivacyFedAvg

app = ServerApp()
DIAGNOSTICS_NOTE = "not private: clients returned their raw training loss and clip fraction (simulation only)"
DEPLOYED_LEDGERS = "on each SuperNode (its node config's ledger-path); the server cannot see them"


def say(text: str) -> None:
    """Progress for the user: flwr streams the ServerApp's stdout (`flwr run --stream`, `flwr log`)."""
    print(f"[fedprivacy] {text}", flush=True)


def _initial_arrays(settings: RunSettings, test: Any, grid: Grid, node: int, config: ConfigRecord) -> ArrayRecord:
    """The seeded initial model: sized from the server's test set, or asked of a client."""
    if test is not None:
        torch.manual_seed(settings.seed)
        return ArrayRecord(new_model(settings, test.features, test.num_classes).state_dict())
    query = Message(RecordDict({"config": config}), dst_node_id=node, message_type=MessageType.QUERY)
    (reply,) = grid.send_and_receive([query], timeout=settings.round_timeout)
    if reply.has_error():
        raise RuntimeError(f"client on node {node} could not build the initial model: {error_summary(reply.error.reason)}")
    return reply.content["arrays"]


def _resolved_config(settings: RunSettings, context: Context, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "run_id": context.run_id,
        "run_config": dict(context.run_config),
        "resolved": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(settings).items()},
        "flwr_version": flwr.__version__,
        **extra,
    }


@app.main()
def main(grid: Grid, context: Context) -> None:
    settings = parse_run_config(context.run_config)
    try:
        folder = new_run_folder(settings.results_dir, context.run_id)
    except OSError as error:
        raise InputError("results-dir", str(settings.results_dir),
                         f"cannot create the run's folder there ({error.strerror or error}): name a writable folder") from None
    say(f"results folder: {folder}")
    recorder = RunRecorder(folder)
    ledger_path = settings.ledger_path or folder / "ledger.sqlite"
    extra = {
        "run_id": context.run_id,
        "ledger": str(ledger_path),
        "diagnostics": DIAGNOSTICS_NOTE if settings.diagnostics else "off",
    }
    if settings.diagnostics:
        say(f"diagnostics on: {DIAGNOSTICS_NOTE}")
    try:
        _federate(grid, context, settings, recorder, ledger_path, extra)
    except Exception as exc:
        # Keep what the run had (rounds.csv and clients.csv are already written), and say why
        # it stopped in one line; Flower then reports the run as finished:failed.
        reason = error_summary(f"{type(exc).__name__}: {exc}")
        recorder.write_plans()
        recorder.write_summary(extra, error=reason)
        say(f"run failed: {reason}")
        say(f"results folder: {folder} (partial)")
        raise
    summary = recorder.write_summary(extra)
    say(
        f"done: final accuracy {_fmt(summary['final_accuracy'] or summary['final_federated_accuracy'])}, "
        f"max ε spent {summary['epsilon_spent_max']:.4f}, all within budget: {summary['all_within_budget']}"
    )
    say(f"results folder: {folder}")


def _federate(
    grid: Grid, context: Context, settings: RunSettings, recorder: RunRecorder, ledger_path: Path, extra: dict[str, Any]
) -> None:
    """The rounds: FedAvg with privacy-aware sampling, evaluation each round, then the model and figure."""
    random.seed(settings.seed)  # anything left that draws from the global RNG
    strategy = PrivacyFedAvg(
        recorder,
        seed=settings.seed,
        client_config={"ledger-path": str(ledger_path)},
        fraction_train=settings.fraction_train,
        fraction_evaluate=settings.fraction_evaluate,
        min_available_nodes=settings.min_clients,
        wait_timeout=settings.round_timeout,
    )
    nodes = strategy.connected_nodes(grid)
    test = server_test_set(settings, len(nodes))
    if test is None and settings.data_path is not None:
        say(f"data-path {settings.data_path} is not a file on the server: evaluating through the clients "
            "(as in a deployment, where each SuperNode reads its own file)")
    evaluation = "central (union of the clients' test splits)" if test is not None else "federated (the server has no data)"
    if test is None:  # the clients read their own data, so they are (or act as) deployed SuperNodes
        extra["ledger"] = DEPLOYED_LEDGERS
    recorder.write_config(
        _resolved_config(
            settings, context,
            {"results_folder": str(recorder.folder), "ledger": extra["ledger"], "clients": len(nodes), "evaluation": evaluation},
        )
    )
    say(f"{len(nodes)} clients, {settings.num_server_rounds} rounds, dataset {settings.dataset}, rule {settings.rule}; evaluation: {evaluation}")
    initial = _initial_arrays(settings, test, grid, nodes[0], strategy.round_config(ConfigRecord(), 0))
    model = None if test is None else new_model(settings, test.features, test.num_classes)

    def end_of_round(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """Called by FedAvg.start after round r's training and federated evaluation (and at r=0)."""
        metrics = None
        if model is not None:
            model.load_state_dict(arrays.to_torch_state_dict())
            loss, accuracy = evaluate_model(model, test)
            recorder.evaluated("", accuracy, loss)
            metrics = MetricRecord({"accuracy": accuracy, "loss": loss})
        if server_round == 0:
            if metrics is not None:
                say(f"round 0: accuracy {metrics['accuracy']:.4f} (initial model)")
            return metrics
        row = recorder.end_round(server_round)
        say(_progress(row, settings.num_server_rounds))
        return metrics

    result = strategy.start(
        grid=grid,
        initial_arrays=initial,
        num_rounds=settings.num_server_rounds,
        timeout=settings.round_timeout,
        evaluate_fn=end_of_round,
    )
    recorder.write_figure()
    if not any(c.rounds_trained for c in recorder.clients.values()):
        # An untrained model.pt would pass for a result: no model, and the run fails saying why.
        failed = sum(c.rounds_dropped > 0 for c in recorder.clients.values())
        exhausted = sum(c.exhausted_round is not None for c in recorder.clients.values())
        raise RuntimeError(f"no client trained in any round ({failed} failed, {exhausted} out of budget): "
                           "no model was saved; see clients.csv")
    recorder.write_plans()
    recorder.save_model((result.arrays or initial).to_torch_state_dict())


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _progress(row: dict[str, Any], rounds: int) -> str:
    accuracy = row["accuracy"] if row["accuracy"] is not None else row["federated_accuracy"]
    label = "accuracy" if row["accuracy"] is not None else "federated accuracy"
    return (
        f"round {row['round']}/{rounds}: {label} {_fmt(accuracy)} | ε spent max {row['epsilon_spent_max']:.4f}"
        f" mean {row['epsilon_spent_mean']:.4f} | {row['clients_trained']} trained, "
        f"{row['clients_exhausted']} out of budget, {row['clients_failed']} failed"
    )

