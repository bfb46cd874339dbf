"""`PrivacyFedAvg`: Flower's FedAvg that knows clients have budgets and that replies can be bad.

What it adds to FedAvg:
- the average weighs each update by its client's examples, or by the inverse of its noise
  variance (`aggregation`, from the client's public plan: `fedprivacy.aggregation`), and a server
  optimiser (Flower's FedAvgM or FedAdam, `server.optimizers`) may then step to it;
- the round's participation rules (`fedprivacy.participation`, shared with the fast engine): seeded
  sampling (its own `random.Random`, not Python's global RNG that FedAvg uses) of the clients that
  can still train, and of those asked to evaluate;
- every reply is checked (`fedprivacy.replies`) against the global model's keys, shapes and dtypes,
  for finite numbers, public keys only, and a `num-examples` no larger than the client's own plan N;
  a bad reply, an error reply and a missing reply (no answer within the round timeout) are each
  dropped from aggregation with a logged reason that names the client, and recorded per round;
  replies that reached the SuperLink while Flower's polling was blocked are still collected, and an
  error the runtime made on a client's behalf counts as that client's (`server.outbox`);
- a client whose replies were dropped too often, or that did not answer at all, is not sampled
  again in this run (`fedprivacy.participation` says when);
- clients that said they cannot afford a round are not sampled for training again, and their
  zero-weight replies never reach aggregation (no division by zero);
- an aggregate that is not finite is discarded (the global model stays as it was);
- with client-level DP (`fedprivacy.client_level`, set by `protect_members`) the members are
  Poisson-sampled at the federation plan's rate and the new model is the federation's noisy mean
  of the clipped updates, released every round, with or without a trained member.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedprivacy.aggregation import aggregate, aggregate_client_level, aggregation_weight
from fedprivacy.client_level import ClientLevel
from fedprivacy.errors import error_summary
from fedprivacy.participation import DropKind, Participation
from fedprivacy.privacy.plan import Plan
from fedprivacy.replies import (
    InvalidReply,
    TrainReply,
    check_evaluate_reply,
    check_train_reply,
    model_spec,
)
from fedprivacy.results import RunRecorder
from server.optimizers import WEIGHT_KEY, ServerOptimizer
from server.outbox import Outbox

logger = logging.getLogger(__name__)
NO_REPLY = "no reply within the round timeout"


def aggregate_train_metrics(records: list[RecordDict], weight_key: str) -> MetricRecord:
    """The largest ε spent among the replies; with diagnostics (simulations), the example-weighted
    raw train loss and clip fraction too."""
    metrics = [next(iter(r.metric_records.values())) for r in records]
    aggregated = {"epsilon-spent-max": max(float(m["epsilon-spent"]) for m in metrics)}
    total = sum(float(m[weight_key]) for m in metrics) or 1.0
    for key in ("train-loss", "clip-fraction"):
        if all(key in m for m in metrics):
            aggregated[key] = sum(float(m[weight_key]) * float(m[key]) for m in metrics) / total
    return MetricRecord(aggregated)


def _numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {key: value.numpy() for key, value in record.items()}


def _train_content(reply: Message) -> tuple[dict, dict, dict[str, np.ndarray] | None]:
    """(metrics, client, weights) of a reply with exactly the records a ClientApp sends."""
    content = reply.content
    kinds = {"metrics": MetricRecord, "client": ConfigRecord, "arrays": ArrayRecord}
    unknown = sorted(set(content.keys()) - set(kinds))
    if unknown:
        raise InvalidReply(f"its reply holds a record {unknown[0]!r} that clients never send")
    for key in ("metrics", "client"):
        if not isinstance(content.get(key), kinds[key]):
            raise InvalidReply(f"its reply lacks the {key!r} record")
    arrays = content.get("arrays")
    try:
        weights = None if arrays is None else _numpy(arrays)
    except Exception as error:  # bytes that do not decode are the reply's fault
        raise InvalidReply(f"its weights do not decode ({type(error).__name__})") from None
    return dict(content["metrics"]), dict(content["client"]), weights


class PrivacyFedAvg(FedAvg):
    """FedAvg over clients with their own privacy budgets (see the module docstring)."""

    def __init__(
        self,
        recorder: RunRecorder,
        *,
        seed: int,
        client_config: dict[str, str],
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_available_nodes: int = 2,
        wait_timeout: float = 600.0,
        aggregation: str = "examples",
        optimizer: ServerOptimizer | None = None,
    ) -> None:
        super().__init__(
            fraction_train=fraction_train,
            fraction_evaluate=fraction_evaluate,
            min_train_nodes=1,
            min_evaluate_nodes=1,
            min_available_nodes=min_available_nodes,
            train_metrics_aggr_fn=aggregate_train_metrics,
        )
        self.recorder = recorder
        self.participation = Participation(
            recorder,
            seed=seed,
            fraction_train=fraction_train,
            fraction_evaluate=fraction_evaluate,
            min_clients=min_available_nodes,
            logger=logger,
        )
        self.client_config = dict(client_config)
        self.wait_timeout = wait_timeout
        self.names: dict[int, str] = {}
        self.plans: dict[int, Plan] = {}
        self.outbox: dict[str, Outbox] = {}  # message type -> this round's messages
        self.model: dict[str, tuple[tuple[int, ...], str]] = {}  # what a train reply must hold
        self.released: list[str] = []  # the model's trained parameters: all that clients send
        self.aggregation = aggregation
        self.optimizer = optimizer
        self.current: ArrayRecord | None = None  # the global model this round's clients started from
        self.client_level: ClientLevel | None = None

    def protect_members(self, client_level: ClientLevel) -> None:
        """Client-level DP from now on: the federation's sampling and noisy aggregate."""
        self.client_level = client_level
        self.participation.client_level = client_level

    def connected_nodes(self, grid: Grid) -> list[int]:
        """Node ids once enough are connected (`min-clients`; sorted, so seeded sampling repeats)."""
        deadline = time.monotonic() + self.wait_timeout
        while not self.participation.enough(nodes := sorted(grid.get_node_ids())):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {len(nodes)} of min-clients={self.participation.min_clients} SuperNodes connected "
                    f"within {self.wait_timeout:g} s"
                )
            time.sleep(1.0)
        return nodes

    def _messages(
        self, grid: Grid, nodes: list[int], arrays: ArrayRecord, config: ConfigRecord, kind: str
    ) -> list[Message]:
        # A fresh ConfigRecord per message: FedAvg shares one RecordDict between all of them.
        messages = [
            Message(
                RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: ConfigRecord(dict(config))}),
                dst_node_id=node,
                message_type=kind,
            )
            for node in nodes
        ]
        self.outbox[kind] = Outbox(grid, messages)
        return messages

    def round_config(self, config: ConfigRecord, server_round: int) -> ConfigRecord:
        return ConfigRecord({**dict(config), **self.client_config, "server-round": server_round})

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        current = _numpy(arrays)
        self.model = model_spec({key: current[key] for key in self.released})
        self.current = arrays
        nodes = self.participation.trainers(server_round, self.connected_nodes(grid))
        return self._messages(grid, nodes, arrays, self.round_config(config, server_round), MessageType.TRAIN)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        nodes = self.participation.evaluators(self.connected_nodes(grid))
        return self._messages(grid, nodes, arrays, self.round_config(config, server_round), MessageType.EVALUATE)

    def _name(self, node: int) -> str:
        """The client's id once it has sent a valid reply; its node id until then."""
        return self.names.get(node, f"node-{node}")

    def _drop(self, server_round: int, node: int, outcome: DropKind, reason: str) -> None:
        """Leave a reply out of this round (the participation rules say whether the client is asked again)."""
        self.participation.dropped(server_round, node, self._name(node), outcome, reason)

    def _accept(self, server_round: int, node: int, reply: Message) -> TrainReply:
        metrics, client, weights = _train_content(reply)
        checked = check_train_reply(metrics, client, weights, self.model, self.plans.get(node))
        known = self.names.get(node)
        if known is not None and known != checked.client_id:
            raise InvalidReply(f"it changed its client-id from {known!r} to {checked.client_id!r}")
        if known is None:
            self.recorder.rename(self._name(node), checked.client_id)
        self.names[node], self.plans[node] = checked.client_id, checked.plan
        return checked

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        trained: list[RecordDict] = []  # each trained reply's metrics with its weight
        updates: list[dict[str, np.ndarray]] = []
        answered: set[int] = set()
        outbox = self.outbox[MessageType.TRAIN]
        for reply in outbox.with_late_replies(replies):
            node = outbox.node_of(reply)
            if node is None or node in answered:
                logger.warning(
                    "round %d: ignored a reply from node %s, which was not asked or already answered",
                    server_round,
                    reply.metadata.src_node_id,
                )
                continue
            answered.add(node)
            if reply.has_error():
                self._drop(server_round, node, "error", error_summary(reply.error.reason))
                continue
            try:
                checked = self._accept(server_round, node, reply)
            except InvalidReply as error:
                self._drop(server_round, node, "invalid", str(error))
                continue
            self.participation.replied(server_round, node, checked.client_id, checked.metrics, checked.plan)
            if not checked.exhausted:
                weight = aggregation_weight(
                    self.aggregation, checked.plan, server_round, int(checked.metrics["num-examples"])
                )
                trained.append(RecordDict({"metrics": MetricRecord({**checked.metrics, WEIGHT_KEY: weight})}))
                updates.append(checked.arrays)
        for node in sorted(outbox.nodes - answered):
            self._drop(server_round, node, "no reply", NO_REPLY)
        metrics = aggregate_train_metrics(trained, self.weighted_by_key) if trained else None
        assert self.current is not None  # configure_train set it
        current = self.current.to_torch_state_dict()
        stacked = {
            key: torch.from_numpy(np.stack([u[key] for u in updates])) if updates else current[key][None][:0]
            for key in self.released
        }
        step = None if self.optimizer is None else self.optimizer.for_round(server_round)
        if self.client_level is not None:  # the federation's noise is released even when nobody trained
            new = aggregate_client_level(current, stacked, self.client_level, server_round, step)
            self.recorder.federation_round(self.client_level.epsilon_spent(), self.client_level.last_clip)
        elif not trained:
            return None, None
        else:  # over the checked replies only, weighed by examples or by inverse noise variance
            new = aggregate(current, stacked, [float(r["metrics"][WEIGHT_KEY]) for r in trained], step)
        if new is None:
            logger.warning("round %d: the aggregate is not finite; the global model stays as it was", server_round)
            return None, metrics
        return ArrayRecord(new), metrics

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        outbox = self.outbox[MessageType.EVALUATE]
        evaluated, repliers = [], set()
        for reply in outbox.with_late_replies(replies):
            node = outbox.node_of(reply)
            if node is None:
                logger.warning(
                    "round %d: ignored an evaluation reply from node %s, which was not asked",
                    server_round,
                    reply.metadata.src_node_id,
                )
                continue
            repliers.add(node)
            if reply.has_error():
                logger.warning(
                    "evaluation failed on client %s: %s", self._name(node), error_summary(reply.error.reason)
                )
                continue
            try:
                values = check_evaluate_reply(dict(reply.content["metrics"]) if "metrics" in reply.content else {})
            except InvalidReply as error:
                logger.warning(
                    "round %d: evaluation reply of client %s dropped: %s",
                    server_round,
                    self._name(node),
                    error,
                )
                continue
            if values.get("evaluation-off"):
                self.participation.releases_no_evaluation(node)
            else:
                evaluated.append(RecordDict({"metrics": MetricRecord(values)}))
                self.recorder.client_evaluated(
                    server_round, self._name(node), values["accuracy"], values["loss"], int(values["num-examples"])
                )
        if repliers and repliers <= self.participation.evaluation_off and not evaluated:
            logger.info(
                "clients release no evaluation (deployed clients keep their test rows private): "
                "federated evaluation stops"
            )
        metrics = self.evaluate_metrics_aggr_fn(evaluated, self.weighted_by_key) if evaluated else None
        if metrics is not None:
            self.recorder.evaluated("federated_", float(metrics["accuracy"]), float(metrics["loss"]))
        return metrics
