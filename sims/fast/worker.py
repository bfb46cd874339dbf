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
from fedprivacy.models import build_model, evaluation_sums
from fedprivacy.privacy.plan import Plan
from fedprivacy.protocol import diagnostics as training_diagnostics
from fedprivacy.training import DPTrainer, stack
from fedprivacy.training.noise import noise_ahead
from fedprivacy.training.rng import DrawRequest, SeededRunWarning, StepRandomness, draw_batch, keystream_device
from fedprivacy.training.schedule import StepSizes

# Up to this many noise coordinates per step (clients × trained parameters), and per round, a round's
# Box–Muller is made before its steps and each step only rounds (`noise.noise_ahead`, the trainer's
# way): the per-step cost of small steps is their calls, not their arithmetic, and a round's float64
# rows stay within tens of MiB. Larger steps compute it block by block inside the step, keeping
# their temporaries in cache.
AHEAD_STEP_COORDINATES = 1 << 17
AHEAD_ROUND_COORDINATES = 1 << 21


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


@dataclass
class WorkerRoundResult:
    """New trained parameters of the clients that trained (stacked, in the trainer's order,
    `capture.trained_names`: all a client releases) and their trainer state."""

    indices: list[int]
    weights: list[Tensor]
    states: list[dict[str, Any]]
    diagnostics: list[dict[str, float]]
    on_gpu: bool = False


def _padded(arrays: list[np.ndarray], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Rows of every client in one [clients, most rows, ...] tensor, and each client's row count
    (no clients: an empty tensor, as when every client of a run failed to load its data)."""
    counts = torch.tensor([len(a) for a in arrays], dtype=torch.long)
    trailing = arrays[0].shape[1:] if arrays else ()
    out = torch.zeros((len(arrays), max((len(a) for a in arrays), default=0), *trailing), dtype=dtype)
    for k, a in enumerate(arrays):
        out[k, : len(a)] = torch.as_tensor(a, dtype=dtype)
    return out, counts


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
        self.train_x, self.train_n = (t.to(self.device) for t in _padded([c.train_x for c in clients], torch.float32))
        self.train_y = _padded([c.train_y for c in clients], torch.long)[0].to(self.device)
        self.test_x, self.test_n = (t.to(self.device) for t in _padded([c.test_x for c in clients], torch.float32))
        self.test_y = _padded([c.test_y for c in clients], torch.long)[0].to(self.device)
        with warnings.catch_warnings():  # the run warns once that its noise is seeded
            warnings.simplefilter("ignore", SeededRunWarning)
            self.randomness = [StepRandomness(c.seed) for c in clients]
        self.plans: dict[int, Plan] = {}
        self.schedules: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # each client's σ_t and η_t
        self._schedule_of: dict[tuple[Any, ...], tuple[np.ndarray, np.ndarray]] = {}

    def add_plans(self, plans: dict[int, Plan]) -> None:
        """Learn the plans of clients about to train; their σ_t and η_t are read once per plan."""
        self.plans.update(plans)
        for index, plan in plans.items():
            key = (
                plan.steps,
                plan.noise_segments,
                plan.learning_rate,
                plan.lr_schedule,
                tuple(sorted(plan.lr_params.items())),
            )
            if key not in self._schedule_of:
                self._schedule_of[key] = (
                    np.array([plan.noise_multiplier(t) for t in range(plan.steps)]),
                    np.array([plan.learning_rate_at(t) for t in range(plan.steps)]),
                )
            self.schedules[index] = self._schedule_of[key]

    # ----- training -----
    def train(
        self,
        global_state: dict[str, Tensor],
        server_round: int,
        requests: list[RoundRequest],
        diagnostics: bool,
    ) -> WorkerRoundResult:
        if not requests:
            return WorkerRoundResult([], [], [], [])
        if self.stack is None:
            return self._train_one_by_one(global_state, server_round, requests, diagnostics)
        return self._train_stacked(self.stack, global_state, server_round, requests, diagnostics)

    def _train_one_by_one(
        self,
        global_state: dict[str, Tensor],
        server_round: int,
        requests: list[RoundRequest],
        diagnostics: bool,
    ) -> WorkerRoundResult:
        results, states, notes = [], [], []
        for request in requests:
            k, plan = self.position[request.index], self.plans[request.index]
            model = build_model(*self.model_args).to(self.device)
            model.load_state_dict(global_state)
            n = int(self.train_n[k])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", SeededRunWarning)
                trainer = DPTrainer(
                    model,
                    plan,
                    self.train_x[k, :n],
                    self.train_y[k, :n],
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
        return WorkerRoundResult(
            [r.index for r in requests], [w.cpu() for w in weights], states, notes, self.device.type == "cuda"
        )

    def _train_stacked(
        self,
        clients: stack.ClientStack,
        global_state: dict[str, Tensor],
        server_round: int,
        requests: list[RoundRequest],
        diagnostics: bool,
    ) -> WorkerRoundResult:
        positions = torch.tensor([self.position[r.index] for r in requests], device=self.device)
        plans = [self.plans[r.index] for r in requests]
        firsts = [p.first_step_of_round(server_round) for p in plans]
        counts = [p.steps_in_round(server_round) for p in plans]
        n = self.train_n[positions.cpu()]
        keep, noise = self._draws(requests, plans, firsts, counts, n, clients.noise_count)
        streams = [self.randomness[self.position[r.index]] for r in requests]
        most = max(counts)
        sigma, rate = np.zeros((len(requests), most)), np.zeros((len(requests), most))
        for k, (request, first, count) in enumerate(zip(requests, firsts, counts, strict=True)):
            sigmas, rates = self.schedules[request.index]
            sigma[k, :count], rate[k, :count] = sigmas[first : first + count], rates[first : first + count]
        # σ_t stays float64, as the plan has it, until its σ_t·C is rounded once (`stack.noise_scale`)
        sigma, rate = torch.from_numpy(sigma), torch.from_numpy(rate).float()
        sizes = StepSizes(plans, [(r.state or {}).get("b_squared") for r in requests], self.device)
        clip = torch.tensor([p.clip_norm for p in plans], dtype=torch.float64, device=self.device)
        expected = torch.tensor([p.expected_batch_size for p in plans], device=self.device)
        steps = torch.tensor(counts, device=self.device)
        sigma, rate = sigma.to(self.device), rate.to(self.device)
        noise_std = stack.noise_scale(sigma, clip.unsqueeze(1))  # [K, steps]
        weights = [
            global_state[key].to(self.device).expand(len(requests), *global_state[key].shape).clone()
            for key in self.keys
        ]
        totals = stack.RoundTotals()
        ahead = None  # small steps: the round's Box–Muller in one pass, as the trainer makes it
        step_coordinates = len(requests) * clients.noise_count
        if (
            self.private
            and step_coordinates <= AHEAD_STEP_COORDINATES
            and step_coordinates * most <= AHEAD_ROUND_COORDINATES
        ):
            ahead = noise_ahead(noise.flatten(0, 1), noise_std.flatten())  # row k·most + s
        for s in range(most):
            inputs = _gather(self.train_x, self.train_y, positions, keep[:, s])
            refiners = [stream.refiner(first + s) for stream, first in zip(streams, firsts, strict=True)]
            rows = None if ahead is None else ahead.rows(np.arange(len(requests)) * most + s)
            step = stack.StepInputs(*inputs, noise[:, s], noise_std[:, s], clip, expected, steps > s, refiners, rows)
            report = clients.step(
                weights,
                step,
                lambda released, s=s, step=step: sizes.rate(released, step.active, rate[:, s]),
                private=self.private,
            )
            if diagnostics:  # formed only when a simulation asks for them
                totals.add(report)
        notes = [{} for _ in requests]
        if diagnostics:
            notes = [training_diagnostics(*client) for client in totals.per_client()]
        states = [{"step": f + c, "b_squared": b} for f, c, b in zip(firsts, counts, sizes.b_squared_of(), strict=True)]
        released = [weights[position].cpu() for position in clients.trained]  # never a buffer
        return WorkerRoundResult([r.index for r in requests], released, states, notes, self.device.type == "cuda")

    def _draws(
        self,
        requests: list[RoundRequest],
        plans: list[Plan],
        firsts: list[int],
        counts: list[int],
        n: Tensor,
        parameters: int,
    ) -> tuple[Tensor, Tensor]:
        """Every client's Poisson masks [K, steps, rows] and noise words [K, steps, 2m] for the round
        (`rng.noise_width` of P = `parameters`, the trained parameters' count)."""
        batch = [
            DrawRequest(self.randomness[self.position[r.index]], first, count, int(rows), plan.sampling_rate)
            for r, plan, first, count, rows in zip(requests, plans, firsts, counts, n.tolist(), strict=True)
        ]
        keep_rows, noise_rows = draw_batch(batch, parameters, keystream_device(self.device))
        rows, width = self.train_x.shape[1], noise_rows.shape[1]
        if min(counts) == max(counts) and keep_rows.shape[1] == rows:  # rows already in [client, step] order
            shape = (len(requests), counts[0])
            return keep_rows.reshape(*shape, rows).to(self.device), noise_rows.reshape(*shape, width).to(self.device)
        made = keep_rows.device  # the CPU, or the device that made the keystream
        owner = torch.from_numpy(np.repeat(np.arange(len(counts)), counts)).to(made)
        step = torch.from_numpy(np.concatenate([np.arange(c) for c in counts])).to(made)
        keep = torch.zeros(len(requests), max(counts), rows, dtype=torch.bool, device=made)
        noise = torch.zeros(
            len(requests), max(counts), width, dtype=torch.int64, device=made
        )  # steps not taken: never read
        keep[owner, step, : keep_rows.shape[1]] = keep_rows
        noise[owner, step] = noise_rows
        return keep.to(self.device), noise.to(self.device)

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


def _gather(x: Tensor, y: Tensor, positions: Tensor, keep: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The sampled rows of the clients at `positions` of the worker's padded data (x, y), in row
    order, padded to the largest batch: (x, y, valid). Read straight from the worker's tensors: no
    copy of the clients' whole data per round. Padding rows hold zeros, never a record: no record
    that was not sampled enters a step, even through a model that (wrongly) mixes its batch."""
    clients = keep.shape[0]
    rank = keep.cumsum(1) - 1
    width = max(1, int(keep.sum(1).max()))
    rows, cols = keep.nonzero(as_tuple=True)
    index = torch.zeros(clients, width, dtype=torch.long, device=x.device)
    valid = torch.zeros(clients, width, dtype=torch.bool, device=x.device)
    index[rows, rank[rows, cols]] = cols
    valid[rows, rank[rows, cols]] = True
    owner = positions.unsqueeze(1)
    features = x[owner, index]
    features.masked_fill_(~valid.view(*valid.shape, *(1,) * (features.dim() - 2)), 0.0)
    return features, y[owner, index], valid


def ray_worker(num_cpus: float, num_gpus: float) -> Any:
    """`LocalWorker` as a Ray actor class with these resources."""
    import ray

    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(LocalWorker)
