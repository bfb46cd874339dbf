"""The fast engine's workers: one in this process, or several Ray actors (one per device share).

Clients are dealt to workers once, round-robin by index, so each worker keeps its clients' rows
for the whole run; a round sends each worker the global weights and its share of the requests,
and merges what they return in request order. Ray is Flower's own simulation engine, so the same
pool spans a Ray cluster when one machine is not enough (`ray start --head`, then
`RAY_ADDRESS=auto`).

The device is the caller's choice, by name (`DEVICES`): `cpu`, `cuda` (refused where no GPU is
visible), or `auto` (`cuda` where one is visible). Ray workers on `cuda` share the cluster's GPUs
evenly, several per GPU when there are more workers than GPUs (`gpu_share`), unless the caller
gives each worker's share.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import torch

from fedprivacy.cohort import TrainedRows
from fedprivacy.errors import InputError
from fedprivacy.privacy.plan import Plan
from sims.fast.worker import LocalWorker, RoundRequest, WorkerClient, ray_worker

DEVICES = ("cpu", "cuda", "auto")


def check_device(device: str, gpus_per_worker: float = 0.0, workers: int = 1) -> None:
    """Refuse, by name, a device choice that is not one of `DEVICES`, contradicts the GPU share, or
    (one worker, in this process) asks for a GPU this process cannot see; before anything starts."""
    _check_choice(device, gpus_per_worker)
    if workers == 1:
        resolve_device(device, gpus_per_worker)


def _check_choice(device: str, gpus_per_worker: float) -> None:
    if device not in DEVICES:
        raise InputError("device", device, f"must be one of {', '.join(DEVICES)}")
    if isinstance(gpus_per_worker, bool) or not 0 <= gpus_per_worker <= 1:
        raise InputError("worker-gpus", gpus_per_worker, "must be a fraction of a GPU in [0, 1]")
    if device == "cpu" and gpus_per_worker > 0:
        raise InputError("worker-gpus", gpus_per_worker, "a GPU share needs device cuda or auto, not cpu")


def resolve_device(device: str, gpus_per_worker: float = 0.0, visible_gpus: float | None = None) -> str:
    """`cpu` or `cuda` for the choice `device` (`DEVICES`), refusing by name what cannot run.

    `visible_gpus`: the GPUs the workers can use (a Ray cluster's); None: this process's CUDA
    devices. A GPU share per worker > 0 asks for `cuda`."""
    _check_choice(device, gpus_per_worker)
    gpus = torch.cuda.device_count() if visible_gpus is None else visible_gpus
    if device == "cuda" or gpus_per_worker > 0:
        if gpus <= 0:
            raise InputError("device", "cuda", "no CUDA GPU is visible here: use cpu (or auto, which picks one if any)")
        return "cuda"
    return "cuda" if device == "auto" and gpus > 0 else "cpu"


def gpu_share(workers: int, gpus: float) -> float:
    """Each of `workers` workers' share of `gpus` GPUs, so that they all fit at once: a whole GPU
    each while there are enough, else 1/⌈workers/GPUs⌉ (three workers on two GPUs: half each, the
    third beside one of the others; an even split of 2/3 would leave it no GPU to fit on)."""
    if workers <= gpus:
        return 1.0
    return 1.0 / math.ceil(workers / max(1, math.floor(gpus)))


class WorkerPool:
    """`workers` workers over `clients` on `device` (`DEVICES`); one worker runs in this process,
    more are Ray actors, each on `gpus_per_worker` of a GPU on `cuda` (0: `gpu_share`).
    `private=False` turns clipping and noise off in every worker, and `batched=False` trains
    each worker's clients one by one (see `LocalWorker`)."""

    def __init__(
        self,
        clients: list[WorkerClient],
        model: tuple[str, tuple[int, ...] | int, int, dict[str, Any]],  # name, example shape, classes, options
        workers: int = 1,
        device: str = "auto",
        gpus_per_worker: float = 0.0,
        *,
        private: bool = True,
        batched: bool = True,
    ) -> None:
        if workers < 1:
            raise InputError("workers", workers, "need at least one fast-engine worker")
        _check_choice(device, gpus_per_worker)  # before Ray starts
        self.owner: dict[int, int] = {c.index: k % workers for k, c in enumerate(clients)}
        shares = [[c for k, c in enumerate(clients) if k % workers == w] for w in range(workers)]
        self.remote = workers > 1
        if not self.remote:
            self.device = resolve_device(device, gpus_per_worker)
            self.workers: list[Any] = [
                LocalWorker(shares[0], *model, device=self.device, private=private, batched=batched)
            ]
            return
        import ray

        if not ray.is_initialized():
            with (
                warnings.catch_warnings()
            ):  # Ray's tip on how a future version will treat num_gpus=0: CPU workers here use the CPU by name
                warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)
                ray.init(
                    include_dashboard=False,
                    log_to_driver=False,
                    configure_logging=False,
                    address=os.environ.get("RAY_ADDRESS"),
                )
        cluster = ray.cluster_resources()
        cpus = max(1.0, float(cluster.get("CPU", 1)) // workers)
        self.device = resolve_device(device, gpus_per_worker, float(cluster.get("GPU", 0)))
        gpus = 0.0
        if self.device == "cuda":
            gpus = gpus_per_worker or gpu_share(workers, float(cluster.get("GPU", 0)))
        actor = ray_worker(num_cpus=cpus, num_gpus=gpus)
        self.workers = [
            actor.remote(share, *model, device=self.device, threads=int(cpus), private=private, batched=batched)
            for share in shares
        ]

    def add_plans(self, plans: dict[int, Plan]) -> None:
        if not plans:
            return
        if not self.remote:
            self.workers[0].add_plans(plans)
            return
        import ray

        shares: list[dict[int, Plan]] = [{} for _ in self.workers]
        for index, plan in plans.items():
            shares[self.owner[index]][index] = plan
        ray.get([w.add_plans.remote(share) for w, share in zip(self.workers, shares, strict=True)])

    def train(
        self,
        global_state: dict[str, torch.Tensor],
        server_round: int,
        requests: list[RoundRequest],
        diagnostics: bool,
    ) -> TrainedRows:
        """Every request's new weights, merged in request order."""
        shares: list[list[RoundRequest]] = [[] for _ in self.workers]
        for request in requests:
            shares[self.owner[request.index]].append(request)
        if not self.remote:
            return self.workers[0].train(global_state, server_round, shares[0], diagnostics)
        import ray

        state = ray.put(global_state)
        parts = ray.get(
            [
                w.train.remote(state, server_round, share, diagnostics)
                for w, share in zip(self.workers, shares, strict=True)
            ]
        )
        return _merge(parts, [r.index for r in requests])

    def evaluate(self, global_state: dict[str, torch.Tensor], indices: list[int]) -> list[tuple[int, float, int]]:
        shares: list[list[int]] = [[] for _ in self.workers]
        for index in indices:
            shares[self.owner[index]].append(index)
        if not self.remote:
            return self.workers[0].evaluate(global_state, shares[0])
        import ray

        state = ray.put(global_state)
        parts = ray.get([w.evaluate.remote(state, share) for w, share in zip(self.workers, shares, strict=True)])
        found = {
            index: row
            for share, part in zip(shares, parts, strict=True)
            for index, row in zip(share, part, strict=True)
        }
        return [found[index] for index in indices]

    def close(self) -> None:
        if self.remote:
            import ray

            for worker in self.workers:
                ray.kill(worker)


def _merge(parts: list[TrainedRows], order: list[int]) -> TrainedRows:
    """The workers' results as one, rows in `order`."""
    where = {index: (p, k) for p, part in enumerate(parts) for k, index in enumerate(part.indices)}
    rows = [where[index] for index in order]
    non_empty = [part for part in parts if part.indices]
    if not non_empty:
        return TrainedRows([], [], [])
    weights = [torch.stack([parts[p].weights[w][k] for p, k in rows]) for w in range(len(non_empty[0].weights))]
    return TrainedRows(
        weights,
        [parts[p].states[k] for p, k in rows],
        [parts[p].diagnostics[k] for p, k in rows],
        any(part.on_gpu for part in non_empty),
        order,
    )
