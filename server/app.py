"""The ServerApp: FedAvg over DP-SGD clients, central evaluation, and the results folder.

The results folder is `<results-dir>/<time>-run<run id>` (results-dir from the run config,
default ~/fedprivacy-results; it must be absolute, see fedprivacy.runconfig). It is printed at
the start and at the end of every run. In a simulation the clients' ledger lives in it too,
unless the run config names a `ledger-path`; deployed clients keep theirs on their SuperNodes,
where the server cannot see them, and config.json / summary.json say so.
"""

from __future__ import annotations

import logging
import random
import warnings
from pathlib import Path
from typing import Any

import flwr
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedprivacy.client_level import ClientLevel
from fedprivacy.errors import error_summary
from fedprivacy.models import evaluate_model
from fedprivacy.protocol import RELEASED_KEY
from fedprivacy.recipe import initial_model, new_model, unused_data_keys
from fedprivacy.replies import InvalidReply, check_released
from fedprivacy.results import DIAGNOSTICS_NOTE, RunRecorder, largest_class_share, progress_line, resolved_config
from fedprivacy.run_life import finish, recorded_run
from fedprivacy.runconfig import RunSettings
from fedprivacy.training.capture import trained_names
from server.console import reporting
from server.evaluation import central_evaluation, server_test_set
from server.optimizers import ServerOptimizer
from server.strategy import PrivacyFedAvg

app = ServerApp()
logger = logging.getLogger(__name__)
# Flower's simulation starts its Ray actors in this process; Ray's tip that num_gpus=0 actors may
# one day see the GPUs concerns a future version (docs/deployment.md, "Simulations on GPUs").
warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)
SAME_REFUSALS = 3  # nodes refusing the initial model for one reason before the others are not asked
DEPLOYED_LEDGERS = "on each SuperNode (its node config's ledger-path); the server cannot see them"


def _ledgers_without_server_data(ledger_path: Path) -> str:
    """Where the clients' ledgers are when the server has no data of its own. It cannot tell
    deployed SuperNodes from simulated clients whose data-path is not a file here either (these
    fail before they train), so it names both until a client trains (`_rounds`); a file at
    `ledger_path` may be another run's."""
    return f"{DEPLOYED_LEDGERS}; simulated clients would keep theirs in {ledger_path}"


def _initial_arrays(
    settings: RunSettings, test: Any, grid: Grid, nodes: list[int], config: ConfigRecord
) -> tuple[ArrayRecord, list[str]]:
    """The seeded initial model and the names of its trained parameters (what clients release):
    sized from the server's test set, or asked of the clients in turn (one misconfigured node must
    not end the run: its refusal is logged and the next one asked), until `SAME_REFUSALS` nodes
    gave one reason. Only what every node reads alike gives one reason: a simulation's run config
    or data-path; a deployed node's own failure names its client, so a deployment asks them all."""
    if test is not None:
        model = initial_model(settings, test.features, test.num_classes)
        return ArrayRecord(model.state_dict()), trained_names(model)
    refusals: dict[str, list[int]] = {}  # reason -> the nodes that gave it
    for node in nodes:
        query = Message(RecordDict({"config": config}), dst_node_id=node, message_type=MessageType.QUERY)
        (reply,) = grid.send_and_receive([query], timeout=settings.round_timeout)
        if reply.has_error():
            reason = error_summary(reply.error.reason)
        else:
            try:
                arrays = reply.content["arrays"]
                return arrays, check_released(reply.content["model"][RELEASED_KEY], arrays)
            except (KeyError, TypeError, InvalidReply) as error:
                reason = f"its initial model is not usable ({error})"
        refusals.setdefault(reason, []).append(node)
        left = len(nodes) - sum(map(len, refusals.values()))
        if not left:
            logger.warning("client on node %d could not build the initial model (%s)", node, reason)
        elif len(refusals[reason]) == SAME_REFUSALS:
            logger.warning(
                "client on node %d could not build the initial model (%s), as %d nodes before it: "
                "the other %s not asked",
                node,
                reason,
                SAME_REFUSALS - 1,
                "node is" if left == 1 else f"{left} nodes are",
            )
            break
        else:
            logger.warning(
                "client on node %d could not build the initial model (%s); asking another node", node, reason
            )
    grouped = "; ".join(
        f"{'node' if len(ids) == 1 else 'nodes'} {', '.join(map(str, ids))}: {reason}"
        for reason, ids in refusals.items()
    )
    raise RuntimeError(f"no client could build the initial model: {grouped}")


@app.main()
def main(grid: Grid, context: Context) -> None:
    with reporting():
        _run(grid, context)


def _run(grid: Grid, context: Context) -> None:
    with recorded_run(context.run_config, context.run_id, logger.info, {"engine": "flower"}) as run:
        settings = run.settings
        ledger_path = settings.ledger_path or run.folder / "ledger.sqlite"
        run.extra.update(ledger=str(ledger_path), diagnostics=DIAGNOSTICS_NOTE if settings.diagnostics else "off")
        if unused := unused_data_keys(settings):
            logger.warning(unused)
        if settings.diagnostics:
            logger.info("diagnostics on: %s", DIAGNOSTICS_NOTE)
        _federate(grid, context, settings, run.recorder, ledger_path, run.extra)


def _federate(
    grid: Grid,
    context: Context,
    settings: RunSettings,
    recorder: RunRecorder,
    ledger_path: Path,
    extra: dict[str, Any],
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
        aggregation=settings.aggregation,
        optimizer=ServerOptimizer.from_settings(settings),
    )
    nodes = strategy.connected_nodes(grid)
    client_level = ClientLevel.start(settings, nodes, recorder.folder)
    if client_level is None:
        _rounds(grid, context, settings, recorder, strategy, nodes, ledger_path, extra)
        return
    with client_level:  # its roster: the SuperNodes connected now
        strategy.protect_members(client_level)
        extra["federation"] = client_level.describe()
        logger.info(client_level.headline())
        _rounds(grid, context, settings, recorder, strategy, nodes, ledger_path, extra)


def _rounds(
    grid: Grid,
    context: Context,
    settings: RunSettings,
    recorder: RunRecorder,
    strategy: PrivacyFedAvg,
    nodes: list[int],
    ledger_path: Path,
    extra: dict[str, Any],
) -> None:
    """From the server's test set and the initial model to the last round's model."""
    test = server_test_set(settings, len(nodes))
    if test is not None:
        recorder.evaluation_rows, recorder.largest_class_share = len(test.labels), largest_class_share(test.labels)
    if test is None and settings.data_path is not None:
        logger.info(
            "data-path %s is not a file on the server: evaluating through the clients "
            "(as in a deployment, where each SuperNode reads its own file)",
            settings.data_path,
        )
    evaluation = central_evaluation(settings) if test is not None else "federated (the server has no data)"
    if test is None:  # the clients read their own data: deployed SuperNodes, or simulated ones
        extra["ledger"] = _ledgers_without_server_data(ledger_path)
    recorder.write_config(
        resolved_config(
            settings,
            context.run_id,
            context.run_config,
            {
                "results_folder": str(recorder.folder),
                "ledger": extra["ledger"],
                "clients": len(nodes),
                "evaluation": evaluation,
                "engine": "flower",
                "flwr_version": flwr.__version__,
                **({"federation": extra["federation"]} if "federation" in extra else {}),
            },
        )
    )
    options = "".join(f", {key}={value}" for key, value in settings.model_options)
    logger.info(
        "%d clients, %d rounds, dataset %s, model %s%s, rule %s; evaluation: %s",
        len(nodes),
        settings.num_server_rounds,
        settings.dataset,
        settings.model,
        f" ({options[2:]})" if options else "",
        settings.rule,
        evaluation,
    )
    try:
        _train(grid, settings, recorder, strategy, nodes, test)
    finally:
        if test is None and any(client.rounds_trained for client in recorder.clients.values()):
            extra["ledger"] = DEPLOYED_LEDGERS  # a client trained without the server's data: a deployed one


def _train(
    grid: Grid, settings: RunSettings, recorder: RunRecorder, strategy: PrivacyFedAvg, nodes: list[int], test: Any
) -> None:
    """The initial model, the rounds with their evaluation, then the model and figure."""
    initial, strategy.released = _initial_arrays(
        settings, test, grid, list(nodes), strategy.round_config(ConfigRecord(), 0)
    )
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
                logger.info("round 0: accuracy %.4f (initial model)", metrics["accuracy"])
            return metrics
        row = recorder.end_round(server_round)
        logger.info(progress_line(row, settings.num_server_rounds))
        return metrics

    result = strategy.start(
        grid=grid,
        initial_arrays=initial,
        num_rounds=settings.num_server_rounds,
        timeout=settings.round_timeout,
        evaluate_fn=end_of_round,
    )
    finish(recorder, (result.arrays or initial).to_torch_state_dict())
