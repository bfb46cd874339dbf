"""The ClientApp: each message is handled by fedprivacy.participant; this file only translates.

Simulation: the node config holds `partition-id`/`num-partitions`; data and budgets come from the
run config, and the ledger path from the server's train config (the run's results folder unless
the run config names one). Deployment: the SuperNode's `--node-config` names the client, its data
file, its budget and optionally its ledger (default ~/.fedprivacy/ledger.sqlite).
"""

from __future__ import annotations

from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedprivacy.ledger import Ledger
from fedprivacy.participant import (
    LocalClient,
    deployed_client,
    evaluate_local,
    new_model,
    run_plan,
    simulation_client,
    train_round,
)
from fedprivacy.runconfig import RunSettings, parse_node_config, parse_run_config

app = ClientApp()


def _client(context: Context, config: ConfigRecord) -> tuple[RunSettings, LocalClient]:
    settings = parse_run_config(context.run_config)
    node = parse_node_config(context.node_config)
    if node is not None:
        return settings, deployed_client(settings, node)
    ledger_path = Path(str(config.get("ledger-path", ""))) if config.get("ledger-path") else None
    if ledger_path is None:
        raise RuntimeError("simulation train message without 'ledger-path': the ServerApp must send it")
    partition_id = int(context.node_config["partition-id"])
    num_partitions = int(context.node_config["num-partitions"])
    return settings, simulation_client(settings, partition_id, num_partitions, ledger_path)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train this round's slice of the plan if the budget affords it; record it, then reply."""
    config = msg.content["config"]
    settings, client = _client(context, config)
    ledger = Ledger(client.ledger_path)
    run_id = str(context.run_id)
    plan, _ = run_plan(client, settings, ledger, run_id)
    trainer_state = context.state.get("trainer")
    b_squared = trainer_state.get("b-squared") if isinstance(trainer_state, ConfigRecord) else None
    result = train_round(
        client,
        settings,
        plan,
        ledger,
        run_id,
        int(config["server-round"]),
        msg.content["arrays"].to_torch_state_dict(),
        None if b_squared is None else float(b_squared),
    )
    if result.b_squared is not None:
        context.state["trainer"] = ConfigRecord({"b-squared": float(result.b_squared)})
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
def evaluate(msg: Message, context: Context) -> Message:
    """Local test loss and accuracy of the global model."""
    settings, client = _client(context, msg.content["config"])
    metrics = evaluate_local(client, settings, msg.content["arrays"].to_torch_state_dict())
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


@app.query()
def initial_model(msg: Message, context: Context) -> Message:
    """The seeded initial model, for a server that has no data to size it (a deployment)."""
    settings, client = _client(context, msg.content["config"])
    torch.manual_seed(settings.seed)
    model = new_model(settings, client.data.train.features, client.data.train.num_classes)
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict())}), reply_to=msg)
