"""A fast engine's worker: holds a share of the clients' data on one device and trains their rounds.

A worker is told, once, its clients (their rows, their noise seed material) and, as they appear,
their plans; each round it gets the global weights and which of its clients train, and returns
their new weights stacked in one tensor per parameter. A round's clients train together, whatever
the model (`stack.ClientStack`); `batched=False` trains them one by one with the trainer itself
(`DPTrainer`): the same algorithm, kept as the benchmark's comparison.

`LocalWorker` runs in the caller's process; `ray_worker` wraps the same class as a Ray actor so
that a run spreads its clients over several processes, GPUs or machines.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedprivacy.client_round import released_state
from fedprivacy.cohort import TrainedRows
from fedprivacy.models import build_model, evaluation_sums
from fedprivacy.privacy.plan import Plan
from fedprivacy.protocol import diagnostics as training_diagnostics
from fedprivacy.training import DPTrainer, stack
from fedprivacy.training.rng import SeededRunWarning, StepRandomness
from fedprivacy.training.schedule import StepSizes
from fedprivacy.training.steps import ClientSteps, StackRows, take_steps


@dataclass(frozen=True)
class WorkerClient:
    """One client's rows and noise seed material (None: fresh OS entropy every round)."""

    index: int
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    seed: str | None


@dataclass(frozen=True)
class RoundRequest:
    """Client `index` trains round `server_round` of its plan; `state` is its trainer state."""

    index: int
    state: dict[str, Any] | None


_NUMPY = {torch.float32: np.float32, torch.long: np.int64}  # the dtypes of the worker's tables


def _padded(arrays: list[np.ndarray], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Rows of every client in one [clients, most rows, ...] tensor, and each client's row count
    (no clients: an empty tensor, as when every client of a run failed to load its data)."""
    counts = torch.tensor([len(a) for a in arrays], dtype=torch.long)
    trailing = arrays[0].shape[1:] if arrays else ()
    # filled in NumPy: a row block's copy there costs a tenth of a torch indexing call
    out = np.zeros((len(arrays), max((len(a) for a in arrays), default=0), *trailing), dtype=_NUMPY[dtype])
    for k, a in enumerate(arrays):
        out[k, : len(a)] = a
    return torch.from_numpy(out), counts


class LocalWorker:
    """Trains and evaluates its clients' rounds on one device."""

    def __init__(
        self,
        clients: list[WorkerClient],
        model: str,
        input_shape: tuple[int, ...] | int,
        num_classes: int,
        model_options: dict[str, Any] | None = None,
        device: str = "cpu",
        threads: int | None = None,
        private: bool = True,
        batched: bool = True,
    ) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device(device)
        self.private = private  # False: clipping and noise off (the non-private baseline, a benchmark)
        self.model_args = (model, input_shape, num_classes, model_options)
        self.template = build_model(*self.model_args).to(self.device)
        self.keys = list(self.template.state_dict())
        self.stack = stack.ClientStack(self.template) if batched else None
        self.position = {c.index: k for k, c in enumerate(clients)}
        self.clients = clients
        train_x, train_n = _padded([c.train_x for c in clients], torch.float32)
        train_y = _padded([c.train_y for c in clients], torch.long)[0]
        self.rows = StackRows.of(train_x.to(self.device), train_y.to(self.device), train_n.tolist())
        self.test_x, self.test_n = (t.to(self.device) for t in _padded([c.test_x for c in clients], torch.float32))
        self.test_y = _padded([c.test_y for c in clients], torch.long)[0].to(self.device)
        with warnings.catch_warnings():  # the run warns once that its noise is seeded
            warnings.simplefilter("ignore", SeededRunWarning)
            self.randomness = [StepRandomness(c.seed) for c in clients]
        self.plans: dict[int, Plan] = {}

    def add_plans(self, plans: dict[int, Plan]) -> None:
        """Learn the plans of clients about to train."""
        self.plans.update(plans)

    # ----- training -----
    def train(
        self,
        global_state: dict[str, Tensor],
        server_round: int,
        requests: list[RoundRequest],
        diagnostics: bool,
    ) -> TrainedRows:
        if not requests:
            return TrainedRows([], [], [])
        if self.stack is None:
            return self._train_one_by_one(global_state, server_round, requests, diagnostics)
        return self._train_stacked(self.stack, global_state, server_round, requests, diagnostics)

    def _train_one_by_one(
        self,
        global_state: dict[str, Tensor],
        server_round: int,
        requests: list[RoundRequest],
        diagnostics: bool,
    ) -> TrainedRows:
        results, states, notes = [], [], []
        for request in requests:
            k, plan = self.position[request.index], self.plans[request.index]
            model = build_model(*self.model_args).to(self.device)
            model.load_state_dict(global_state)
            features, labels = self.rows.client(k)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", SeededRunWarning)
                trainer = DPTrainer(
                    model,
                    plan,
                    features,
                    labels,
                    seed=self.clients[k].seed,
                    state={**(request.state or {}), "step": plan.first_step_of_round(server_round)},
                    private=self.private,
                )
            report = trainer.run_round(server_round)
            results.append(list(released_state(model).values()))
            states.append(trainer.state_dict())
            notes.append(
                training_diagnostics(report.mean_loss, report.clip_fraction, report.nonfinite_examples)
                if diagnostics
                else {}
            )
        weights = [torch.stack(parts) for parts in zip(*results, strict=True)]
        return TrainedRows(
            [w.cpu() for w in weights], states, notes, self.device.type == "cuda", [r.index for r in requests]
        )

    def _train_stacked(
        self,
        clients: stack.ClientStack,
        global_state: dict[str, Tensor],
        server_round: int,
        requests: list[RoundRequest],
        diagnostics: bool,
    ) -> TrainedRows:
        plans = [self.plans[r.index] for r in requests]
        rounds: dict[int, tuple[int, int]] = {}  # each distinct plan's (first step, steps) of the round
        for plan in plans:
            if id(plan) not in rounds:
                rounds[id(plan)] = (plan.first_step_of_round(server_round), plan.steps_in_round(server_round))
        slices = [
            ClientSteps(plan, *rounds[id(plan)], self.randomness[position], position)
            for plan, position in zip(plans, (self.position[r.index] for r in requests), strict=True)
        ]
        sizes = StepSizes(plans, [(r.state or {}).get("b_squared") for r in requests], self.device)
        weights = [
            global_state[key].to(self.device).expand(len(requests), *global_state[key].shape).clone()
            for key in self.keys
        ]
        done = take_steps(clients, weights, self.rows, slices, sizes, private=self.private, diagnostics=diagnostics)
        notes = [{} for _ in requests]
        if done.diagnostics is not None:
            notes = [training_diagnostics(*client) for client in done.diagnostics]
        states = [
            {"step": c.first_step + c.steps, "b_squared": b} for c, b in zip(slices, sizes.b_squared_of(), strict=True)
        ]
        released = [weights[position].cpu() for position in clients.trained]  # never a buffer
        return TrainedRows(released, states, notes, self.device.type == "cuda", [r.index for r in requests])

    # ----- evaluation -----
    def evaluate(self, global_state: dict[str, Tensor], indices: list[int]) -> list[tuple[int, float, int]]:
        """(test rows, summed cross-entropy, correct predictions) of the global model per client."""
        model = build_model(*self.model_args).to(self.device)
        model.load_state_dict(global_state)
        out = []
        for index in indices:
            k = self.position[index]
            rows = int(self.test_n[k])
            out.append(evaluation_sums(model, self.test_x[k, :rows], self.test_y[k, :rows]))
        return out


def ray_worker(num_cpus: float, num_gpus: float) -> Any:
    """`LocalWorker` as a Ray actor class with these resources."""
    import ray

    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(LocalWorker)
