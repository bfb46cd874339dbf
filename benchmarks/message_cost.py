"""What a Flower message would cost the fast engine: a train message and its reply per client,
against the engine's whole client-round, in one run.

Why it is asked: the fast engine could have been a grid that batches the ServerApp's messages, so
that the strategy ran unchanged on it (docs/simulator.md, "The fast engine"). Per model (logreg
and the MLP on 15 features, the digits CNN on 8×8 images), `message_ms` is one pair as the apps
exchange it: the global model into an `ArrayRecord` with the round's config, the message, the
client reading its arrays back, its reply with its update and metrics, and the server reading
those (Flower's public `Message` API; the sender's identity set as the in-process grid sets it).
`client_round_ms` is the fast engine's whole round per client, planning aside (`run_fast` on
`benchmarks/sim_throughput.py`'s scenario, in a child process). `ratio` = message / client-round:
above 1, the messages alone would cost more than the round does now.

    python benchmarks/message_cost.py [--clients 1000] [--rounds 10] [--pairs 500] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

import fedprivacy  # noqa: F401  # before PyTorch loads: its OpenMP setting
from fedprivacy.models import build_model
from sims.inprocess import act_as_serverapp

BENCHMARKS = Path(__file__).resolve().parent
MODELS = {"logreg": 15, "mlp": 15, "cnn": 64}  # features per example, as sim_throughput.py's scenario


def message_pair_ms(model: str, pairs: int) -> float:
    """The median over `pairs` of one train message and its reply, built and read as the apps do."""
    state = build_model(model, MODELS[model], 2 if model != "cnn" else 10).state_dict()
    act_as_serverapp(1)
    times = []
    for node in range(pairs + 20):  # the first 20: warm-up
        start = time.perf_counter()
        content = RecordDict({"arrays": ArrayRecord(state), "config": ConfigRecord({"server-round": 1})})
        message = Message(content, dst_node_id=node + 1, message_type="train")
        update = message.content["arrays"].to_torch_state_dict()
        metrics = MetricRecord({"num-examples": 160, "epsilon-spent": 0.1, "steps-done": 3})
        reply = Message(RecordDict({"arrays": ArrayRecord(update), "metrics": metrics}), reply_to=message)
        reply.content["arrays"].to_torch_state_dict()
        if node >= 20:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def client_round_ms(model: str, clients: int, rounds: int) -> float:
    """The fast engine's wall time per client-round (sim_throughput.py's `run fast` row, a child process)."""
    args = [sys.executable, str(BENCHMARKS / "sim_throughput.py"), "--child", "run", "fast", model, str(clients)]
    output = subprocess.run([*args, str(rounds), "1"], capture_output=True, text=True, check=True)
    row = json.loads(output.stdout.strip().splitlines()[-1])
    return 1e3 / row["client_rounds_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--pairs", type=int, default=500)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    rows = []
    for model in MODELS:
        message = message_pair_ms(model, args.pairs)
        engine = client_round_ms(model, args.clients, args.rounds)
        rows.append(
            {
                "model": model,
                "message_ms": round(message, 4),
                "client_round_ms": round(engine, 4),
                "ratio": round(message / engine, 2),
            }
        )
    print(f"{'model':<8}{'message ms':>12}{'client-round ms':>17}{'ratio':>8}")
    for r in rows:
        print(f"{r['model']:<8}{r['message_ms']:>12.3f}{r['client_round_ms']:>17.3f}{r['ratio']:>8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
