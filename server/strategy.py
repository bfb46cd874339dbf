"""`PrivacyFedAvg`: Flower's FedAvg that knows clients have budgets.

What it adds to FedAvg (weighting by `num-examples` is unchanged):
- seeded sampling (its own `random.Random`, not Python's global RNG that FedAvg uses);
- clients that said they cannot afford a round, or whose reply was an error, are not sampled for
  training again (failed clients not for evaluation either), and their replies never reach
  aggregation, so a zero-weight reply cannot divide by zero;
- clients that release no evaluation (deployed ones) are not asked to evaluate again;
- every reply is handed to the `RunRecorder` (per-client privacy, per-round metrics).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterable
from logging import INFO, WARNING

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedprivacy.errors import error_summary
from fedprivacy.privacy.plan import Plan
from fedprivacy.results import RunRecorder
from fedprivacy.sampling import sample_clients


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
        self.rng = random.Random(seed)
        self.client_config = dict(client_config)
        self.wait_timeout = wait_timeout
        self.exhausted: set[int] = set()
        self.failed: set[int] = set()
        self.evaluation_off: set[int] = set()  # deployed clients, which release no evaluation
        self.names: dict[int, str] = {}

    def connected_nodes(self, grid: Grid) -> list[int]:
        """Node ids once `min_available_nodes` are connected (sorted, so seeded sampling repeats)."""
        deadline = time.monotonic() + self.wait_timeout
        while len(nodes := sorted(grid.get_node_ids())) < self.min_available_nodes:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {len(nodes)} of min-clients={self.min_available_nodes} SuperNodes connected "
                    f"within {self.wait_timeout:g} s"
                )
            time.sleep(1.0)
        return nodes

    def _sample(self, nodes: list[int], fraction: float) -> list[int]:
        return sample_clients(self.rng, nodes, fraction)

    def _messages(self, nodes: list[int], arrays: ArrayRecord, config: ConfigRecord, kind: str) -> list[Message]:
        # A fresh ConfigRecord per message: FedAvg shares one RecordDict between all of them.
        return [
            Message(
                RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: ConfigRecord(dict(config))}),
                dst_node_id=node,
                message_type=kind,
            )
            for node in nodes
        ]

    def round_config(self, config: ConfigRecord, server_round: int) -> ConfigRecord:
        return ConfigRecord({**dict(config), **self.client_config, "server-round": server_round})

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        eligible = [n for n in self.connected_nodes(grid) if n not in self.exhausted | self.failed]
        if not eligible:
            log(WARNING, "round %d: no client can still train (budgets spent or clients failed)", server_round)
        nodes = self._sample(eligible, self.fraction_train)
        log(INFO, "configure_train: sampled %d of %d clients that can still train", len(nodes), len(eligible))
        return self._messages(nodes, arrays, self.round_config(config, server_round), MessageType.TRAIN)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        eligible = [n for n in self.connected_nodes(grid) if n not in self.failed | self.evaluation_off]
        nodes = self._sample(eligible, self.fraction_evaluate)
        return self._messages(nodes, arrays, self.round_config(config, server_round), MessageType.EVALUATE)

    def _name(self, node: int) -> str:
        return self.names.get(node, f"node-{node}")

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        trained = []
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error():
                self.failed.add(node)
                self.recorder.failed(self._name(node), reply.error.reason)
                log(WARNING, "client %s failed and is dropped from the run: %s", self._name(node), error_summary(reply.error.reason))
                continue
            client = reply.content["client"]
            self.names[node] = str(client["client-id"])
            metrics = dict(reply.content["metrics"])
            self.recorder.trained(server_round, self.names[node], metrics, Plan.from_dict(json.loads(str(client["plan"]))))
            if metrics["budget-exhausted"]:
                self.exhausted.add(node)
                log(INFO, "client %s cannot afford round %d: budget spent, not sampled again", self.names[node], server_round)
            else:
                trained.append(reply)
        return super().aggregate_train(server_round, trained)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        replies = list(replies)
        evaluated = []
        for reply in replies:
            if reply.has_error():
                log(WARNING, "evaluation failed on client %s: %s", self._name(reply.metadata.src_node_id),
                    error_summary(reply.error.reason))
            elif reply.content["metrics"].get("evaluation-off"):
                self.evaluation_off.add(reply.metadata.src_node_id)
            else:
                evaluated.append(reply)
        if replies and len(self.evaluation_off) == len({r.metadata.src_node_id for r in replies}) and not evaluated:
            log(INFO, "clients release no evaluation (deployed clients keep their test rows private): "
                "federated evaluation stops")
        metrics = super().aggregate_evaluate(server_round, evaluated) if evaluated else None
        if metrics is not None:
            self.recorder.evaluated("federated_", float(metrics["accuracy"]), float(metrics["loss"]))
        return metrics
