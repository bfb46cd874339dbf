"""Server optimisers: Flower's own FedAvgM and FedAdam, applied to the privacy-aware average.

The server's step is post-processing of the clients' released updates, so it costs no privacy
and leaves every budget rule as it is. `PrivacyFedAvg` (and the fast engine) first average the
checked updates with their own weights (examples, or inverse noise variance); the chosen Flower
strategy then receives that average as its one reply (weight 1, so its own averaging returns it
unchanged) and takes its step from the current global model: momentum SGD on the pseudo-gradient
(FedAvgM, Hsu et al. 2019) or Adam on it (FedAdam, Reddi et al. 2021).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from flwr.app import Array, ArrayRecord, Message, Metadata, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAdam, FedAvgM
from torch import Tensor

from fedprivacy.runconfig import RunSettings

WEIGHT_KEY = "aggregation-weight"


class ServerOptimizer:
    """One of Flower's server-side optimisers, stepping from the global model to the average."""

    def __init__(self, strategy: FedAvgM | FedAdam) -> None:
        self.strategy = strategy

    @classmethod
    def from_settings(cls, settings: RunSettings) -> ServerOptimizer | None:
        """The run config's `server-optimizer`; None for plain FedAvg (the average is the model)."""
        common = {
            "min_train_nodes": 1,
            "min_evaluate_nodes": 1,
            "min_available_nodes": 1,
            "weighted_by_key": WEIGHT_KEY,
        }
        if settings.server_optimizer == "fedavgm":
            return cls(
                FedAvgM(
                    server_learning_rate=settings.server_learning_rate,
                    server_momentum=settings.server_momentum,
                    **common,
                )
            )
        if settings.server_optimizer == "fedadam":
            return cls(FedAdam(eta=settings.server_learning_rate, tau=settings.server_tau, **common))
        return None

    def for_round(self, server_round: int) -> Callable[[dict[str, Tensor], dict[str, Tensor]], dict[str, Tensor]]:
        """This round's step as `fedprivacy.aggregation.aggregate` takes it: (current, average) -> new."""

        def step(current: dict[str, Tensor], average: dict[str, Tensor]) -> dict[str, Tensor]:
            return self.step(server_round, ArrayRecord(current), ArrayRecord(average)).to_torch_state_dict()

        return step

    def step(self, server_round: int, current: ArrayRecord, average: ArrayRecord) -> ArrayRecord:
        """The new global model: the strategy's step from `current` given the clients' `average`."""
        if isinstance(self.strategy, FedAdam):
            # FedOpt strategies read the global model they step from (configure_train sets it)
            self.strategy.current_arrays = {key: array.numpy() for key, array in current.items()}
        elif self.strategy.current_arrays is None:  # FedAvgM keeps its own copy after the first round
            self.strategy.current_arrays = current
        stepped, _ = self.strategy.aggregate_train(server_round, [_average_reply(average)])
        # FedAdam's arithmetic promotes float32 to float64: the model keeps its own dtypes
        return ArrayRecord(
            {key: Array(array.numpy().astype(current[key].numpy().dtype)) for key, array in stepped.items()}
        )


def _average_reply(average: ArrayRecord) -> Message:
    """The average as one reply of weight 1 (public Message/Metadata constructors)."""
    metadata = Metadata(
        run_id=0,
        message_id="average",
        src_node_id=0,
        dst_node_id=0,
        reply_to_message_id="",
        group_id="",
        created_at=time.time(),
        ttl=3600.0,
        message_type="train",
    )
    return Message(
        content=RecordDict({"arrays": average, "metrics": MetricRecord({WEIGHT_KEY: 1.0})}), metadata=metadata
    )
