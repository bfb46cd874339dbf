"""What this machine can give a scenario's `[resources]`, checked before anything is written (and
by `--dry-run`): a GPU asked for where none is visible, or more CPUs per simulated client than the
machine has, would otherwise fail every cell one by one (Ray's simulation then places no client and
says so only in each cell's flwr-run.log)."""

from __future__ import annotations

import os

from fedprivacy.errors import InputError
from sims.sweep.spec import SweepSpec


def visible_cpus() -> int:
    """The CPUs this process may run on (its affinity where the platform tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check_machine(spec: SweepSpec) -> None:
    """Refuse, naming the `[resources]` key, what no cell of `spec` could get here."""
    import torch

    resources, gpus = spec.resources, torch.cuda.device_count()
    # Ray workers of a cluster named by RAY_ADDRESS may have GPUs this process lacks: the pool decides
    remote_workers = resources.workers > 1 and bool(os.environ.get("RAY_ADDRESS"))
    if (spec.engine == "fast" or spec.baseline) and not remote_workers:  # fast-engine cells, or the baseline's
        from sims.fast.pool import resolve_device

        try:
            resolve_device(resources.device, resources.worker_gpus)
        except InputError as error:
            if resources.device == "cuda":
                raise InputError("resources.device", "cuda", error.allowed) from None
            raise InputError(
                "resources.worker-gpus", resources.worker_gpus, "no CUDA GPU is visible here: use 0"
            ) from None
    if spec.engine != "flower":
        return
    cpus = visible_cpus()
    if resources.client_cpus > cpus:
        raise InputError(
            "resources.client-cpus",
            resources.client_cpus,
            f"this machine has {cpus} CPUs: Flower's simulation could place no client (at most {cpus})",
        )
    if resources.client_gpus > 0 and gpus == 0:
        raise InputError("resources.client-gpus", resources.client_gpus, "no CUDA GPU is visible here: use 0")
