"""Simulation throughput: the fast engine, the apps in process and a real `flwr run`, side by side.

Scenario (one per model, logreg and MLP): synthetic data, 200 rows per client (80/20 split),
DP on (proactive plans, seeded noise), every client every round, no federated evaluation (the
server evaluates centrally every round). Each engine runs in its own child process, so its peak
RSS is its own:

- `fast`: every client, every round (`sims.fast.run_fast`); its planning sheets (their rule comparison
  and figures) are written after the clock stops, and timed on their own (`sheets_s`);
- `inprocess`: the ServerApp and ClientApp in process (`sims.runner`) on a subset of the clients;
- `flower`: `flwr run` against a simulation SuperLink started here, on a 50-client subset.

Subsets are scaled per client-round (client-rounds per second). Python imports happen before the
clock starts for `fast` and `inprocess` (a sweep pays them once); `flower` is timed from `flwr run`
to the run's end. Also measured: a DP round of the fast engine against the same engine's round
with clipping and noise off (same sampling, same steps), a steady round's split into accounting
(and, of it, the wait for the ledger's commit after training, aggregation and central evaluation)
and training, with every client on one budget and with the clients on five ε levels (five plans:
five histories to compose per round while they all train), and the fast engine's peak RSS at
10,000 clients.

Models that are not Linear stacks (`--batched-models`: the digits CNN on 64 synthetic features,
i.e. 8×8 images, and `bench-gn-cnn`, a user-style CNN with GroupNorm registered here), side by side
in one process per model, rounds interleaved, medians over rounds: the compute floor (the same
examples' plain non-private forward and backward, whole or in pieces, image outputs as the model
makes them or channels-last, whichever of those is fastest on the first round: what the DP rounds
must also do), the batched engine's DP round and its round with clipping and noise off, the engine
client by client (`LocalWorker(batched=False)`, the trainer per client, on a subset), and the
fast engine's whole run against the apps in process (a subset); peak memory. With `--device
cuda`, also the GPU's kernel time in a DP round (torch.profiler).

Usage: python benchmarks/sim_throughput.py [--clients 1000] [--rounds 20] [--models logreg,mlp]
       [--inprocess-clients 100] [--flower-clients 50] [--flower-rounds 5] [--workers 1]
       [--scale-clients 3000,10000] [--memory-clients 10000] [--batched-models cnn,bench-gn-cnn]
       [--batched-clients 1000] [--batched-rounds 20] [--one-by-one-clients 100] [--device cpu]
       [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fedprivacy  # noqa: F401  # before anything loads PyTorch, here and in the children: its OpenMP setting
from fedprivacy.models import register_model

if TYPE_CHECKING:
    from torch import Tensor

PROJECT = Path(__file__).resolve().parents[1]
ROWS_PER_CLIENT = 200
IMAGE_FEATURES = 64  # 8×8 one-channel images, as the digits
FEATURES = {"cnn": IMAGE_FEATURES, "bench-gn-cnn": IMAGE_FEATURES}  # any other model: 15 tabular features


# The user-registered model of the batched rows: the GroupNorm CNN of examples/custom_model (the layer
# a user picks when BatchNorm is refused), registered here by decorator so that the benchmark needs
# no install; the children this script starts run this module too, so they register it as well.
sys.path.insert(0, str(PROJECT / "examples" / "custom_model" / "src"))
from fedprivacy_gn_cnn.models import gn_cnn  # noqa: E402  (found through the path above)

register_model("bench-gn-cnn")(gn_cnn)


def scenario(model: str, clients: int, rounds: int, results: Path) -> dict[str, Any]:
    return {
        "dataset": "synthetic",
        "synthetic-examples": ROWS_PER_CLIENT * clients,
        "synthetic-features": FEATURES.get(model, 15),
        "model": model,
        "num-server-rounds": rounds,
        "fraction-train": 1.0,
        "fraction-evaluate": 0.0,
        "noise-seed": 7,
        "results-dir": str(results),
        "min-clients": 1,
    }


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ----- one engine, in a child process -----
def run_one(
    engine: str, model: str, clients: int, rounds: int, workers: int, results: Path, device: str = "auto"
) -> dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore")
    config = scenario(model, clients, rounds, results)
    import fedprivacy.results as results_module  # imports before the clock: a sweep pays them once
    from sims.fast.engine import run_fast
    from sims.runner import Scenario, run_scenario

    started = time.perf_counter()
    accounting = sheets = None
    if engine == "fast":
        write_plans, deferred = results_module.RunRecorder.write_plans, []
        results_module.RunRecorder.write_plans = lambda self: deferred.append(self) or []  # sheets after the timed part
        folder, timings = run_fast(config, clients, workers=workers, device=device, say=lambda _: None)
        wall = time.perf_counter() - started
        accounting = timings.accounting_s
        results_module.RunRecorder.write_plans = write_plans
        started = time.perf_counter()
        for recorder in deferred:
            recorder.write_plans()
        sheets = time.perf_counter() - started
    elif engine == "inprocess":
        run_scenario(Scenario("bench", config, num_clients=clients), results, quiet=True)
        wall = time.perf_counter() - started
    else:
        wall = _flower(config, clients)
    return {
        "engine": engine,
        "model": model,
        "clients": clients,
        "rounds": rounds,
        "wall_s": round(wall, 3),
        "client_rounds_per_s": round(clients * rounds / wall, 1),
        "accounting_s": None if accounting is None else round(accounting, 3),
        "sheets_s": None if sheets is None else round(sheets, 3),  # fast only: written after the clock stops
        # flower's clients run in the SuperLink's processes (Ray): this process's RSS would not be theirs
        "peak_rss_mb": None if engine == "flower" else round(peak_rss_mb(), 1),
    }


def _flower(config: dict[str, Any], clients: int) -> float:
    """A real `flwr run` through the sweep's flower engine (its own SuperLink, judged by run
    status); wall time of the run, SuperLink start-up excluded."""
    from sims.sweep.engines.flower import create
    from sims.sweep.grid import Cell
    from sims.sweep.spec import Resources

    engine = create(Resources(client_cpus=1))
    engine.setup()
    try:
        started = time.perf_counter()
        results = Path(config["results-dir"])
        results.mkdir(parents=True, exist_ok=True)
        run_config = {k: v for k, v in config.items() if k != "results-dir"}
        engine.run_cell(Cell("bench", {}, run_config, clients), results, lambda _: None)
        return time.perf_counter() - started
    finally:
        engine.teardown()


# ----- a steady round of the fast engine: where its time goes -----
BUDGET_LEVELS = (0.5, 1.0, 2.0, 4.0, 8.0)  # ε of the mixed-budget steady round, dealt to clients in turn
SCALE_ROUNDS = 6  # rounds of the steady rows with more clients (a 10,000-client round takes ~0.5 s)


def steady_round(model: str, clients: int, rounds: int, budgets: int = 1) -> dict[str, Any]:
    """Rounds 2..R of a run: wall time per round from the engine's end-of-round callback, and the
    engine's own accounting time of those rounds (round 1 also plans). With `budgets` > 1 the
    clients hold that many ε levels in turn (the first of `BUDGET_LEVELS`): each level is its own
    plan, so a round composes one history per level still training. A 1-round run first warms the
    caches shared between runs, as a sweep's first cell does."""
    import statistics
    import warnings

    import fedprivacy.results as results_module
    from sims.fast.engine import run_fast

    warnings.filterwarnings("ignore")
    results_module.RunRecorder.write_plans = lambda self: []  # sheets are not part of a round
    for count in (1, rounds):
        with tempfile.TemporaryDirectory() as results:
            ends: list[float] = []
            config = {**scenario(model, clients, count, Path(results)), **mixed_budgets(clients, budgets)}
            _, timings = run_fast(
                config, clients, say=lambda _: None, on_round=lambda row, ends=ends: ends.append(time.perf_counter())
            )
    wall = (ends[-1] - ends[0]) / (rounds - 1)
    accounting = statistics.fmean(timings.accounting_by_round[1:])
    wait = statistics.fmean(timings.commit_wait_by_round[1:])
    return {
        "model": model,
        "clients": clients,
        "budgets": budgets,
        "rounds": rounds,
        "round_ms": round(1000 * wall, 1),
        "accounting_ms": round(1000 * accounting, 1),
        "accounting_share": round(accounting / wall, 3),
        "commit_wait_ms": round(1000 * wait, 1),
    }


def mixed_budgets(clients: int, budgets: int) -> dict[str, str]:
    """Run-config keys that give the clients `budgets` ε levels in turn (none for one level)."""
    if budgets <= 1:
        return {}
    levels = BUDGET_LEVELS[:budgets]
    return {"epsilons": ",".join(f"{levels[k % budgets]:g}" for k in range(clients))}


# ----- the mechanism's cost inside the fast engine -----
def worker_clients(model: str, clients: int, rounds: int) -> tuple[list[Any], dict[int, Any]]:
    """The scenario's clients as a worker takes them (seeded noise) and their plans (ε = 1)."""
    from fedprivacy.data.partition import load_clients
    from fedprivacy.plans import plan_from_settings
    from fedprivacy.recipe import partition_kwargs
    from fedprivacy.runconfig import DEFAULTS, parse_run_config
    from sims.fast.worker import WorkerClient

    settings = parse_run_config({**DEFAULTS, **scenario(model, clients, rounds, Path(tempfile.gettempdir()))})
    data = load_clients(**partition_kwargs(settings, clients))
    shared = [
        WorkerClient(i, c.train.features, c.train.labels, c.test.features, c.test.labels, f"7:{i}")
        for i, c in enumerate(data)
    ]
    plans = {
        i: plan_from_settings(settings, c.num_examples, 1.0, 1e-5, c.client_id, compare=False)
        for i, c in enumerate(data)
    }
    return shared, plans


def mechanism_cost(model: str, clients: int, rounds: int) -> dict[str, Any]:
    """Rounds of the fast engine's worker with DP and with clipping and noise off, interleaved."""
    import statistics
    import warnings

    import torch

    from sims.fast.worker import LocalWorker, RoundRequest

    warnings.filterwarnings("ignore")
    shared, plans = worker_clients(model, clients, rounds)
    workers = {private: LocalWorker(shared, model, 15, 2, private=private) for private in (True, False)}
    for worker in workers.values():
        worker.add_plans(plans)
    torch.manual_seed(0)
    from fedprivacy.models import build_model

    state = build_model(model, 15, 2).state_dict()
    times: dict[bool, list[float]] = {True: [], False: []}
    requests = [RoundRequest(i, None) for i in range(clients)]
    for server_round in range(1, rounds + 1):
        for private, worker in workers.items():
            started = time.perf_counter()
            worker.train(state, server_round, requests, False)
            times[private].append(time.perf_counter() - started)
    dp, plain = statistics.median(times[True]), statistics.median(times[False])
    return {
        "model": model,
        "clients": clients,
        "dp_round_s": round(dp, 4),
        "nonprivate_round_s": round(plain, 4),
        "ratio": round(dp / plain, 3),
    }


# ----- any model batched: against its compute floor, without the mechanism, and client by client -----
FLOOR_WHOLE = 1 << 30  # rows: a step's batch in one piece
# The floor is the fastest of these plain ways through a step's rows, (rows per piece, image outputs
# channels-last): on 2 CPU cores the digits CNN's forward and backward of 20,000 rows in one batch
# took 341 ms, in pieces of 1,024 with channels-last outputs 87 ms (measured 2026-11-26).
FLOOR_WAYS = [(rows, laid_out) for rows in (FLOOR_WHOLE, 4096, 1024, 256) for laid_out in (False, True)]


def batched_cost(model: str, clients: int, rounds: int, one_by_one: int, device: str) -> dict[str, Any]:
    """Median round times of one model's workers, rounds interleaved: the batched engine with DP and
    without, the compute floor (the DP rounds' own sampled batches, replayed through the plain
    model: one forward and one backward per step, parameter gradients and all), and the engine
    client by client on the first `one_by_one` clients (scaled per client-round)."""
    import statistics
    import warnings

    import torch
    import torch.nn.functional as F

    from fedprivacy.models import build_model
    from sims.fast.worker import LocalWorker, RoundRequest

    warnings.filterwarnings("ignore")
    shared, plans = worker_clients(model, clients, rounds)
    features = FEATURES.get(model, 15)
    workers = {
        "dp": LocalWorker(shared, model, features, 2, device=device),
        "nonprivate": LocalWorker(shared, model, features, 2, device=device, private=False),
        "one_by_one": LocalWorker(shared[:one_by_one], model, features, 2, device=device, batched=False),
    }
    for worker in workers.values():
        worker.add_plans(plans)
    torch.manual_seed(0)
    plain = build_model(model, features, 2).to(device)
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    batches: list[tuple[Tensor, Tensor]] = []  # the DP round's sampled rows, step by step
    stack, dp_step = workers["dp"].stack, workers["dp"].stack.step
    stack.step = lambda weights, step, *rest, **options: (  # type: ignore[method-assign]
        batches.append((step.features[step.valid], step.labels[step.valid])) or dp_step(weights, step, *rest, **options)
    )

    channels_last = [False]  # the plain model's image-shaped outputs laid out channels-last (a hook)
    for module in plain.modules():
        if any(True for _ in module.parameters(recurse=False)):
            module.register_forward_hook(
                lambda m, i, out: (
                    out.contiguous(memory_format=torch.channels_last)
                    if channels_last[0] and isinstance(out, torch.Tensor) and out.dim() == 4
                    else None
                )
            )

    def floor(chunk: int, laid_out: bool) -> None:
        channels_last[0] = laid_out
        for x, y in batches:
            plain.zero_grad(set_to_none=True)
            for xs, ys in zip(x.split(chunk), y.split(chunk), strict=True):
                F.cross_entropy(plain(xs), ys, reduction="sum").backward()

    def timed(work: Any) -> float:
        synchronize()
        started = time.perf_counter()
        work()
        synchronize()
        return time.perf_counter() - started

    def synchronize() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    requests = [RoundRequest(i, None) for i in range(clients)]
    times: dict[str, list[float]] = {"dp": [], "nonprivate": [], "floor": [], "one_by_one": []}
    fastest: tuple[int, bool] | None = None
    for server_round in range(1, rounds + 1):
        batches.clear()
        for name, worker in workers.items():
            share = requests[:one_by_one] if name == "one_by_one" else requests
            times[name].append(timed(lambda w=worker, r=share, t=server_round: w.train(state, t, r, False)))
        if fastest is None:  # the floor's fastest way, on the first round's batches (each tried twice)
            fastest = min(FLOOR_WAYS, key=lambda way: min(timed(lambda: floor(*way)) for _ in range(2)))
        times["floor"].append(timed(lambda way=fastest: floor(*way)))
    kernel_ms = None
    if device == "cuda":  # the GPU's own time in one more DP round (its plans have none left: replay round 1)
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            workers["dp"].train(state, 1, requests, False)
            synchronize()
        kernel_ms = (  # the device's own events (kernels, copies), as the profiler's table totals them
            sum(
                e.self_device_time_total
                for e in profiler.key_averages()
                if e.device_type == DeviceType.CUDA and not e.is_user_annotation
            )
            / 1000
        )
    median = {name: statistics.median(values) for name, values in times.items()}
    per_client = {name: value / (one_by_one if name == "one_by_one" else clients) for name, value in median.items()}
    return {
        "model": model,
        "clients": clients,
        "rounds": rounds,
        "device": device,
        "one_by_one_clients": one_by_one,
        **{f"{name}_round_s": round(value, 4) for name, value in median.items()},
        **{f"{name}_client_rounds_per_s": round(1 / value, 1) for name, value in per_client.items()},
        "floor_chunk_rows": None if fastest is None or fastest[0] >= FLOOR_WHOLE else fastest[0],
        "floor_channels_last": None if fastest is None else fastest[1],
        "dp_over_floor": round(median["dp"] / median["floor"], 3),
        "dp_over_nonprivate": round(median["dp"] / median["nonprivate"], 3),
        "speedup_over_one_by_one": round(per_client["one_by_one"] / per_client["dp"], 2),
        "kernel_ms_per_dp_round": None if kernel_ms is None else round(kernel_ms, 2),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "peak_gpu_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if device == "cuda" else None,
    }


def child(args: list[str]) -> dict[str, Any]:
    output = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, cwd=PROJECT)
    if output.returncode != 0:
        raise RuntimeError(f"child {' '.join(args)} failed:\n{output.stderr[-3000:]}")
    return json.loads(output.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--models", default="logreg,mlp")
    parser.add_argument("--inprocess-clients", type=int, default=100)
    parser.add_argument("--flower-clients", type=int, default=50)
    parser.add_argument("--flower-rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=1, help="fast engine workers (more than 1: Ray actors)")
    parser.add_argument(
        "--scale-clients",
        default="3000,10000",
        help="clients of the extra steady logreg rows (6 rounds each) that show accounting's share as a round grows",
    )
    parser.add_argument("--memory-clients", type=int, default=10_000, help="clients of the peak-RSS run (0: skip)")
    parser.add_argument(
        "--batched-models",
        default="cnn,bench-gn-cnn",
        help="models compared with their compute floor, without DP and client by client ('' to skip)",
    )
    parser.add_argument("--batched-clients", type=int, default=1000, help="clients of the batched-model rows")
    parser.add_argument("--batched-rounds", type=int, default=20, help="rounds of the batched-model rows")
    parser.add_argument(
        "--one-by-one-clients", type=int, default=100, help="clients trained one by one (scaled per client-round)"
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="the fast engine's device in the batched-model rows"
    )
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "mechanism":
            print(json.dumps(mechanism_cost(rest[0], int(rest[1]), int(rest[2]))))
        elif kind == "batched":
            print(json.dumps(batched_cost(rest[0], int(rest[1]), int(rest[2]), int(rest[3]), rest[4])))
        elif kind == "steady":
            print(json.dumps(steady_round(rest[0], int(rest[1]), int(rest[2]), *map(int, rest[3:4]))))
        else:
            engine, model, clients, rounds, workers, *device = rest
            with tempfile.TemporaryDirectory() as results:
                print(
                    json.dumps(run_one(engine, model, int(clients), int(rounds), int(workers), Path(results), *device))
                )
        return

    models = [m for m in args.models.split(",") if m]
    batched = [
        report_batched(model, args) for model in args.batched_models.split(",") if model
    ]  # first: the rows the GPU runs are for
    rows: list[dict[str, Any]] = []
    for model in models:
        runs = {
            "fast": child(["run", "fast", model, str(args.clients), str(args.rounds), str(args.workers)]),
            "inprocess": child(["run", "inprocess", model, str(args.inprocess_clients), str(args.rounds), "1"]),
            "flower": child(["run", "flower", model, str(args.flower_clients), str(args.flower_rounds), "1"]),
        }
        for row in runs.values():
            row["ratio_vs_flower"] = round(row["client_rounds_per_s"] / runs["flower"]["client_rounds_per_s"], 1)
            row["ratio_vs_inprocess"] = round(row["client_rounds_per_s"] / runs["inprocess"]["client_rounds_per_s"], 1)
            rows.append(row)
    if rows:
        print(
            f"\n{'engine':<10}{'model':<8}{'clients':>8}{'rounds':>7}{'wall s':>9}{'client-rounds/s':>17}"
            f"{'accounting s':>14}{'sheets s':>10}{'peak RSS MB':>13}{'× flower':>10}{'× inprocess':>13}"
        )
    for r in rows:
        accounting = "" if r["accounting_s"] is None else f"{r['accounting_s']:.2f}"
        sheets = "" if r["sheets_s"] is None else f"{r['sheets_s']:.2f}"
        rss = "n/a" if r["peak_rss_mb"] is None else f"{r['peak_rss_mb']:.0f}"
        print(
            f"{r['engine']:<10}{r['model']:<8}{r['clients']:>8}{r['rounds']:>7}{r['wall_s']:>9.2f}{r['client_rounds_per_s']:>17.1f}"
            f"{accounting:>14}{sheets:>10}{rss:>13}{r['ratio_vs_flower']:>10.1f}{r['ratio_vs_inprocess']:>13.1f}"
        )
    mechanism = [child(["mechanism", model, str(args.clients), "5"]) for model in models]
    if mechanism:
        print("\nA fast-engine round with DP against the same round with clipping and noise off:")
    for m in mechanism:
        print(
            f"  {m['model']:<8} {m['clients']} clients: DP {m['dp_round_s']:.3f} s, "
            f"non-private {m['nonprivate_round_s']:.3f} s, ratio {m['ratio']:.2f}"
        )
    steady = [child(["steady", model, str(args.clients), str(args.rounds)]) for model in models]
    steady += [
        child(["steady", model, str(args.clients), str(args.rounds), str(len(BUDGET_LEVELS))]) for model in models
    ]
    steady += [
        child(["steady", "logreg", clients, str(SCALE_ROUNDS)]) for clients in args.scale_clients.split(",") if clients
    ]
    if steady:
        print("\nA steady fast-engine round (after the first round's planning):")
    for s in steady:
        levels = "one budget" if s["budgets"] == 1 else f"{s['budgets']} budgets"
        print(
            f"  {s['model']:<8} {s['clients']} clients, {levels}, {s['rounds']} rounds: "
            f"{s['round_ms']:.1f} ms per round, accounting {s['accounting_ms']:.1f} ms "
            f"({s['accounting_share']:.0%}; of it waiting for the ledger's commit after the round's work "
            f"{s['commit_wait_ms']:.1f} ms)"
        )
    memory = None
    if args.memory_clients:
        memory = child(["run", "fast", "logreg", str(args.memory_clients), "2", "1"])
        print(
            f"\nfast engine, {args.memory_clients} clients × {ROWS_PER_CLIENT} rows, 2 rounds: "
            f"peak RSS {memory['peak_rss_mb']:.0f} MB, "
            f"{memory['client_rounds_per_s']:.0f} client-rounds/s"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"batched": batched, "rows": rows, "mechanism": mechanism, "steady": steady, "memory": memory}, indent=2
            )
        )


def report_batched(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """One batched model's rows (`batched_cost`, the fast engine's whole run and the apps'), printed."""
    clients, rounds = str(args.batched_clients), str(args.batched_rounds)
    cost = child(["batched", model, clients, rounds, str(args.one_by_one_clients), args.device])
    fast = child(["run", "fast", model, clients, rounds, str(args.workers), args.device])
    apps = child(["run", "inprocess", model, str(args.inprocess_clients), rounds, "1"])
    cost["run_fast_client_rounds_per_s"] = fast["client_rounds_per_s"]
    cost["apps_client_rounds_per_s"] = apps["client_rounds_per_s"]
    cost["run_fast_over_apps"] = round(fast["client_rounds_per_s"] / apps["client_rounds_per_s"], 2)
    cost["run_fast_peak_rss_mb"] = fast["peak_rss_mb"]
    print(
        f"\n{model}, {cost['clients']} clients × {ROWS_PER_CLIENT} rows, {cost['rounds']} rounds, DP on, "
        f"{cost['device']} (median round; client-rounds/s):"
    )
    pieces = "whole" if cost["floor_chunk_rows"] is None else f"{cost['floor_chunk_rows']}-row pieces"
    layout = ", channels-last" if cost["floor_channels_last"] else ""
    for name, label in (
        ("floor", f"compute floor (plain fwd + bwd, {pieces}{layout})"),
        ("dp", "batched engine, DP"),
        ("nonprivate", "batched engine, no clipping or noise"),
        ("one_by_one", f"engine client by client ({cost['one_by_one_clients']} clients)"),
    ):
        print(f"  {label:<48}{cost[f'{name}_round_s']:>9.3f} s{cost[f'{name}_client_rounds_per_s']:>12.1f}")
    print(
        f"  DP / floor {cost['dp_over_floor']:.2f}, DP / non-private {cost['dp_over_nonprivate']:.2f}, "
        f"batched / one by one {cost['speedup_over_one_by_one']:.1f}×; whole run: fast engine "
        f"{cost['run_fast_client_rounds_per_s']:.1f} client-rounds/s, apps in process "
        f"{cost['apps_client_rounds_per_s']:.1f} ({args.inprocess_clients} clients): {cost['run_fast_over_apps']:.1f}×"
    )
    memory = (
        f"peak RSS {cost['peak_rss_mb']:.0f} MB (all three workers), whole run {cost['run_fast_peak_rss_mb']:.0f} MB"
    )
    if cost["peak_gpu_mb"] is not None:
        memory += f", peak GPU memory {cost['peak_gpu_mb']:.0f} MB"
        memory += f", kernel time {cost['kernel_ms_per_dp_round']:.1f} ms per DP round"
    print(f"  {memory}")
    return cost


if __name__ == "__main__":
    main()
