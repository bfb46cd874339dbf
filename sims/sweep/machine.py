"""What this machine can give a scenario's `[resources]`, checked before anything is written (and
by `--dry-run`): a GPU asked for where none is visible, or more CPUs per simulated client than the
machine has, would otherwise fail every cell one by one (Ray's simulation then places no client and
says so only in each cell's flwr-run.log). Where a Ray cluster may be joined, its machines decide,
not this one: Flower's simulation and the fast engine's Ray workers join the cluster that
`RAY_ADDRESS` names or that `ray start` last started here (docs/deployment.md, "A Ray cluster")."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from fedprivacy.errors import InputError
from sims.sweep.baseline_jobs import tunes_baseline
from sims.sweep.spec import SweepSpec


def visible_cpus() -> int:
    """The CPUs this process may run on (its affinity where the platform tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def ray_cluster_may_be_joined() -> bool:
    """Whether `ray.init()` without an address would join a cluster: `RAY_ADDRESS` is set, or
    `ray start` left its address file in Ray's temporary folder."""
    if os.environ.get("RAY_ADDRESS"):
        return True
    return (_ray_temp_folder() / "ray" / "ray_current_cluster").exists()


def _ray_temp_folder() -> Path:
    """The folder Ray keeps its temporary files under, found as Ray finds it."""
    if os.environ.get("RAY_TMPDIR"):
        return Path(os.environ["RAY_TMPDIR"])
    if sys.platform.startswith("linux") and os.environ.get("TMPDIR"):
        return Path(os.environ["TMPDIR"])
    if sys.platform.startswith(("linux", "darwin")):
        return Path("/tmp")
    return Path(tempfile.gettempdir())


def check_machine(spec: SweepSpec) -> None:
    """Refuse, naming the `[resources]` key, what no cell of `spec` could get here."""
    import torch

    resources, gpus = spec.resources, torch.cuda.device_count()
    cluster = ray_cluster_may_be_joined()
    # the device is read by fast-engine cells and by the baseline's learning-rate tuning (fast, too)
    reads_device = spec.engine == "fast" or (spec.baseline and tunes_baseline(spec.tune, spec.baseline_learning_rate))
    if reads_device and not (cluster and resources.workers > 1):  # one worker runs in this process
        from sims.fast.pool import resolve_device

        try:
            resolve_device(resources.device, resources.worker_gpus)
        except InputError as error:
            if resources.device == "cuda":
                raise InputError("resources.device", "cuda", error.allowed) from None
            raise InputError(
                "resources.worker-gpus", resources.worker_gpus, "no CUDA GPU is visible here: use 0"
            ) from None
    if spec.engine != "flower" or cluster:
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
