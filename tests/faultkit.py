"""Faults injected into the real ClientApp, for tests only.

`faulty(app, faults)` wraps a ClientApp: in every train round a seeded share of the clients (drawn
per round and client, so a schedule never depends on the order of calls) misbehaves in one of
`KINDS`. Everything else is the real client: a faulty reply comes from a client that really
planned, trained and wrote its ledger, so the test can count spends against what the server got.

- raise: crash before training (no spend, an error reply);
- hang: train, then sleep past the round timeout (a spend, no reply in time);
- nan, inf, shape, keys: train, then corrupt the weights (NaN, ∞, a row short, a renamed key);
- huge-n: train, then claim 10¹² examples (a client trying to dominate the average).

The e2e tier ships this module inside a test-only Flower app (never in the project's app): the
schedule comes from `faults.json` beside it, and every injected fault is appended to a JSON-lines
log so the test knows what it did, even across Ray's worker processes.
"""

from __future__ import annotations

import csv
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message
from flwr.clientapp import ClientApp

KINDS = ("raise", "hang", "nan", "inf", "shape", "keys", "huge-n")
OUTCOMES = {"raise": "error", "hang": "no reply"} | dict.fromkeys(("nan", "inf", "shape", "keys", "huge-n"), "invalid")
REASONS = {
    "raise": "injected crash",
    "hang": "no reply within the round timeout",
    "nan": "NaN or infinite",
    "inf": "NaN or infinite",
    "shape": "the model's are",
    "keys": "the model lacks",
    "huge-n": "num-examples=1e+12",
}


@dataclass(frozen=True)
class Faults:
    """Which client misbehaves in which round, how, and where that is logged."""

    rate: float
    seed: int
    hang_s: float
    log: Path

    @classmethod
    def from_file(cls, path: Path) -> Faults:
        data = json.loads(path.read_text())
        return cls(float(data["rate"]), int(data["seed"]), float(data["hang_s"]), Path(data["log"]))

    def kind(self, server_round: int, client: str) -> str | None:
        """The fault of `client` in `server_round`, or None (a seeded draw, the same in any process)."""
        digest = hashlib.sha256(f"{self.seed}:{server_round}:{client}".encode()).digest()
        if int.from_bytes(digest[:8], "big") / 2.0**64 >= self.rate:
            return None
        return KINDS[digest[8] % len(KINDS)]

    def schedule(self, rounds: int, clients: list[str]) -> dict[tuple[int, str], str]:
        """Every fault the schedule holds (whether or not the client is asked in that round)."""
        return {(r, c): k for r in range(1, rounds + 1) for c in clients if (k := self.kind(r, c)) is not None}

    def injected(self) -> list[dict[str, Any]]:
        """The faults actually injected so far, from the log."""
        if not self.log.is_file():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]


def _client_name(context: Context) -> str:
    config = context.node_config
    return str(config["partition-id"] if "partition-id" in config else config["client-id"])


def _corrupt(reply: Message, kind: str) -> Message:
    if kind == "huge-n":
        reply.content["metrics"]["num-examples"] = 10**12
        return reply
    arrays = {key: value.numpy().copy() for key, value in reply.content["arrays"].items()}
    key = sorted(arrays)[0]
    if kind in ("nan", "inf"):
        arrays[key].flat[0] = np.nan if kind == "nan" else np.inf
    elif kind == "shape":
        arrays[key] = arrays[key][:-1]
    elif kind == "keys":
        arrays[f"{key}-renamed"] = arrays.pop(key)
    reply.content["arrays"] = ArrayRecord({k: Array(v) for k, v in arrays.items()})
    return reply


def with_train(real: ClientApp, train: Callable[[Message, Context], Message]) -> ClientApp:
    """A ClientApp whose train handler is `train`; evaluation and queries go to `real`."""
    app = ClientApp()
    app.train()(train)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        return real(message, context)

    @app.query()
    def query(message: Message, context: Context) -> Message:
        return real(message, context)

    return app


def faulty(real: ClientApp, faults: Faults) -> ClientApp:
    """A ClientApp that is `real`, except for the train replies `faults` schedules."""

    def train(message: Message, context: Context) -> Message:
        client, server_round = _client_name(context), int(message.content["config"]["server-round"])
        kind = faults.kind(server_round, client)
        if kind is None:
            return real(message, context)
        with faults.log.open("a") as log:
            log.write(
                json.dumps({"round": server_round, "client": client, "node": context.node_id, "kind": kind}) + "\n"
            )
        if kind == "raise":
            raise RuntimeError(f"injected crash of client {client} in round {server_round}")
        reply = real(message, context)
        if kind == "hang":
            time.sleep(faults.hang_s)
            return reply
        return _corrupt(reply, kind)

    return with_train(real, train)


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def check_run(
    folder: Path, faults: Faults, schedule: dict[tuple[int, str], str], log_text: str
) -> dict[tuple[int, str], str]:
    """Assert what a run with injected faults must show; return the faults injected.

    The run completed within budget; every injected fault, and nothing else, was dropped with the
    outcome and reason it deserves and a log line naming the client (by its node id if it never
    replied before); each round trained everyone else; the global model is finite.
    """
    import torch

    summary = json.loads((folder / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["all_within_budget"] is True, summary
    injected = {(f["round"], f["client"]): f["kind"] for f in faults.injected()}
    nodes = {f["client"]: f["node"] for f in faults.injected()}
    assert injected and set(injected.items()) <= set(schedule.items())
    replies = read_csv(folder / "replies.csv")
    named = {f"node-{node}": client for client, node in nodes.items()}  # a client that never replied validly
    dropped = {
        (int(r["round"]), named.get(r["client_id"], r["client_id"])): r
        for r in replies
        if r["outcome"] not in ("trained", "exhausted")
    }
    assert set(dropped) == set(injected), (dropped, injected)
    for key, kind in injected.items():
        assert dropped[key]["outcome"] == OUTCOMES[kind], (key, kind, dropped[key])
        assert REASONS[kind] in dropped[key]["reason"], (key, kind, dropped[key])
        names = (f"reply of client {key[1]} dropped", f"reply of client node-{nodes[key[1]]} dropped")
        assert any(f"round {key[0]}: {name}" in log_text for name in names), key
    clients = {named.get(r["client_id"], r["client_id"]): r for r in read_csv(folder / "clients.csv")}
    for (server_round, client), kind in injected.items():
        if kind == "hang":  # its node is gone for the run (a restarted SuperNode has a new id)
            assert clients[client]["excluded_round"] == str(server_round)
    for row in read_csv(folder / "rounds.csv"):
        count = sum(1 for k in injected if k[0] == int(row["round"]))
        assert int(row["clients_dropped"]) == count, row
        assert int(row["clients_trained"]) == int(row["clients_sampled"]) - count > 0, row
    model = torch.load(folder / "model.pt")
    assert all(torch.isfinite(v).all() for v in model.values())  # never a NaN in the global model
    return injected
