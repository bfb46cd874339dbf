"""The fast engine's workers: one in this process, or several Ray actors (one per device share).

Clients are dealt to workers once, round-robin by index, so each worker keeps its clients' rows
for the whole run; a round sends each worker the global weights and its share of the requests,
and merges what they return in request order. Ray is Flower's own simulation engine, so the same
pool spans a Ray cluster when one machine is not enough (`ray start --head`, then
`RAY_ADDRESS=auto`).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from fedprivacy.privacy.plan import Plan
from sims.fast.worker import LocalWorker, RoundRequest, WorkerClient, WorkerRoundResult, ray_worker


class WorkerPool:
    """`workers` workers over `clients`; with one worker and no GPU share, no Ray at all.
    `private=False` turns clipping and noise off in every worker (see `LocalWorker`)."""

    def __init__(
        self,
        clients: list[WorkerClient],
        model: tuple[str, int, int],
        workers: int = 1,
        gpus_per_worker: float = 0.0,
        *,
        private: bool = True,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers}: need at least one")
        self.owner: dict[int, int] = {c.index: k % workers for k, c in enumerate(clients)}
        shares = [[c for k, c in enumerate(clients) if k % workers == w] for w in range(workers)]
        self.remote = workers > 1 or gpus_per_worker > 0
        if not self.remote:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            self.workers: list[Any] = [LocalWorker(shares[0], *model, device=device, private=private)]
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
        cpus = max(1.0, float(ray.cluster_resources().get("CPU", 1)) // workers)
        actor = ray_worker(num_cpus=cpus, num_gpus=gpus_per_worker)
        device = "cuda" if gpus_per_worker > 0 else "cpu"
        self.workers = [
            actor.remote(share, *model, device=device, threads=int(cpus), private=private) for share in shares
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
    ) -> WorkerRoundResult:
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


def _merge(parts: list[WorkerRoundResult], order: list[int]) -> WorkerRoundResult:
    """The workers' results as one, rows in `order`."""
    where = {index: (p, k) for p, part in enumerate(parts) for k, index in enumerate(part.indices)}
    rows = [where[index] for index in order]
    non_empty = [part for part in parts if part.indices]
    if not non_empty:
        return WorkerRoundResult([], [], [], [])
    weights = [torch.stack([parts[p].weights[w][k] for p, k in rows]) for w in range(len(non_empty[0].weights))]
    return WorkerRoundResult(
        order,
        weights,
        [parts[p].states[k] for p, k in rows],
        [parts[p].diagnostics[k] for p, k in rows],
        any(part.on_gpu for part in non_empty),
    )
