"""The ClientApp: each message is handled by the library's client modules; this file only translates.

Simulation: the node config holds `partition-id`/`num-partitions`; data and budgets come from the
run config, and the ledger path from the server's train config (the run's results folder unless
the run config names one). Deployment: the SuperNode's `--node-config` names the client, its data
file and how to read it, its budget (ε and δ), the size it declares public, and optionally its
ledger (default ~/.fedprivacy/ledger.sqlite); nothing the server sends can change them. Every
message, whatever its type, reads the node's config and file first, so a misconfigured node is
known from the first message the server sends it (the initial-model query).

Errors. A deployed client's exception may quote its records, so only errors built from public
values leave it with their text: refusals (`ClientRefusal`, `PlanRefused`) and bad run or node
config. Anything else reaches the server as one constant sentence, not even its exception type;
the full text is logged on the SuperNode. (A bad row of its file is not an error: it is dropped
alone, `fedprivacy.data.loaders`.)
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedprivacy import recipe
from fedprivacy.admission import open_account
from fedprivacy.client_round import evaluate_local, train_round
from fedprivacy.errors import ClientRefusal, PlanRefused
from fedprivacy.identity import LocalClient, deployed_client, simulation_client
from fedprivacy.ledger import Ledger
from fedprivacy.plans import run_plan
from fedprivacy.protocol import RELEASED_KEY
from fedprivacy.runconfig import NodeSettings, RunSettings, parse_node_config, parse_run_config
from fedprivacy.training.capture import trained_names

app = ClientApp()
logger = logging.getLogger(__name__)
Handler = Callable[[Message, Context], Message]


def _configs(context: Context) -> tuple[RunSettings, NodeSettings | None]:
    """The run config (untrusted) and, on a deployed SuperNode, its node config (trusted)."""
    return parse_run_config(context.run_config), parse_node_config(context.node_config)


def _client(context: Context, config: ConfigRecord, settings: RunSettings, node: NodeSettings | None) -> LocalClient:
    if node is not None:
        return deployed_client(settings, node)
    ledger_path = Path(str(config.get("ledger-path", ""))) if config.get("ledger-path") else None
    if ledger_path is None:
        raise RuntimeError("simulation train message without 'ledger-path': the ServerApp must send it")
    partition_id = int(context.node_config["partition-id"])
    num_partitions = int(context.node_config["num-partitions"])
    return simulation_client(settings, partition_id, num_partitions, ledger_path)


def _handler(body: Callable[[Message, Context, RunSettings, NodeSettings | None], Message]) -> Handler:
    """Parse the configs (their errors are public), then run `body`, keeping private error text home."""

    @functools.wraps(body)
    def handle(msg: Message, context: Context) -> Message:
        settings, node = _configs(context)
        try:
            return body(msg, context, settings, node)
        except (ClientRefusal, PlanRefused):
            raise
        except Exception:
            if node is None:  # a simulation: the researcher's own machine sees everything
                raise
            logger.exception("client %s: %s failed", node.client_id, msg.metadata.message_type)
            raise ClientRefusal(
                f"client {node.client_id} failed; its message stays in the SuperNode's log (it may quote "
                "the client's records, and so may the kind of error)"
            ) from None

    return handle


def _say_it_resumes(client: LocalClient, ledger: Ledger, run_id: str) -> None:
    """A SuperNode restarted mid-run (its in-memory state is gone, its ledger has spent in this
    run): tell its operator, in the node's own log, that the plan and the spends carry on."""
    logger.warning(
        "client %s resumes run %s after a restart: its plan and spends come from its ledger "
        "(%d steps recorded over all runs, epsilon spent %.4f of %g)",
        client.client_id,
        run_id,
        ledger.steps_spent(client.account),
        ledger.epsilon_spent(client.account),
        client.epsilon,
    )


@app.train()
@_handler
def train(msg: Message, context: Context, settings: RunSettings, node: NodeSettings | None) -> Message:
    """Train this round's slice of the plan if the budget affords it; record it, then reply."""
    config = msg.content["config"]
    client = _client(context, config, settings, node)
    run_id = str(context.run_id)
    saved = context.state.get("trainer")
    with Ledger(client.ledger_path) as ledger:
        open_account(client, settings, ledger, run_id)
        plan, made_now = run_plan(client, settings, ledger, run_id)
        if saved is None and not made_now and run_id in ledger.runs(client.account):
            _say_it_resumes(client, ledger, run_id)
        result = train_round(
            client,
            settings,
            plan,
            ledger,
            run_id,
            int(config["server-round"]),
            msg.content["arrays"].to_torch_state_dict(),
            json.loads(str(saved["state"])) if isinstance(saved, ConfigRecord) else None,
        )
    if result.trainer_state is not None:
        context.state["trainer"] = ConfigRecord({"state": json.dumps(result.trainer_state)})
    content = RecordDict(
        {
            "metrics": MetricRecord(result.metrics),
            "client": ConfigRecord({"client-id": client.client_id, "plan": plan.to_json()}),
        }
    )
    if result.state_dict is not None:
        content["arrays"] = ArrayRecord(result.state_dict)
    return Message(content, reply_to=msg)


@app.evaluate()
@_handler
def evaluate(msg: Message, context: Context, settings: RunSettings, node: NodeSettings | None) -> Message:
    """Local test loss and accuracy of the global model (a deployed client declines: zero weight)."""
    client = _client(context, msg.content["config"], settings, node)
    metrics = evaluate_local(client, settings, msg.content["arrays"].to_torch_state_dict())
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


@app.query()
@_handler
def initial_model(msg: Message, context: Context, settings: RunSettings, node: NodeSettings | None) -> Message:
    """The seeded initial model, for a server that has no data to size it (a deployment)."""
    client = _client(context, msg.content["config"], settings, node)
    model = recipe.initial_model(settings, client.data.train.features, client.data.train.num_classes)
    released = ConfigRecord({RELEASED_KEY: trained_names(model)})
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "model": released}), reply_to=msg)
