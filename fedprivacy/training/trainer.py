"""The local DP-SGD trainer: runs exactly the plan's steps, in any slices, and nothing else.

It reads σ_t, q, C and T from the `Plan` and never recomputes them (ADP-SGD's α_t is already in
σ_t). Every step Poisson-samples each local record with probability q, so batches vary in size
and an empty batch is still a step: it spends privacy and adds noise like any other. The step
itself is the stack's (`fedprivacy.training.stack.ClientStack`, K = 1, on the model's own
weights): the trainer draws the samples and noise and keeps the count. The step counter and the
AdaGrad-norm accumulator are the whole state needed to resume.

`private=False` runs the same steps with the mechanism off (σ = 0, nothing clipped): the
non-private baseline's local training (`sims.baseline`). It is a Python argument only: no run
config, and so no ClientApp, can ask for it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fedprivacy.errors import ClientRefusal
from fedprivacy.privacy.plan import Plan
from fedprivacy.training.noise import noise_ahead
from fedprivacy.training.norms import NORM_DTYPE
from fedprivacy.training.rng import StepDraws, StepRandomness
from fedprivacy.training.schedule import StepSizes
from fedprivacy.training.stack import UNCLIPPED, ClientStack, RoundTotals, StepInputs, noise_scale


class PlanExhausted(RuntimeError):
    """A request for steps beyond the plan's T (they would spend privacy nobody certified)."""


@dataclass(frozen=True)
class TrainReport:
    """What one slice of training did: steps, data seen, clipping and the noise it added."""

    first_step: int
    steps: int
    examples: int
    empty_steps: int
    mean_loss: float  # mean cross-entropy of sampled examples, before each step's update; nan if none
    clip_fraction: float  # sampled examples whose gradient norm exceeded C; nan if none
    nonfinite_examples: int  # sampled examples dropped for a non-finite gradient (contributed zero)
    sigma_mean: float  # mean noise multiplier σ_t over the slice
    noise_std_on_mean: float  # mean σ_t·C/(qN): noise std per coordinate of the averaged gradient
    last_learning_rate: float
    seeded: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class NonFiniteModel(ClientRefusal):
    """A model with a NaN or infinite weight: refused before any record is touched."""


def check_finite(state: dict[str, Tensor] | nn.Module) -> None:
    """Refuse weights that are not all finite (a crafted or diverged global model)."""
    tensors = state.state_dict() if isinstance(state, nn.Module) else state
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise NonFiniteModel(f"model weight {name!r} is not finite (NaN or ±inf): refused before training")


class DPTrainer:
    """Runs a plan's DP-SGD steps on one client's local data, on the model's device."""

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        features: Tensor | np.ndarray,
        labels: Tensor | np.ndarray,
        *,
        seed: int | bytes | None = None,
        state: dict[str, Any] | None = None,
        private: bool = True,
    ) -> None:
        check_finite(model)
        self.model = model
        self.plan = plan
        self.private = private
        self.stack = ClientStack(model, stacked=False)
        self.state = [t.unsqueeze(0) for t in model.state_dict().values()]  # views: the step updates the model
        named = dict(model.named_parameters())
        self.parameters = [named[name] for name in self.stack.capture.trained_names]
        self.device = self.parameters[0].device
        dtype = self.parameters[0].dtype
        self.features = torch.as_tensor(features).to(self.device, dtype)
        self.labels = torch.as_tensor(labels, dtype=torch.long).to(self.device)
        if len(self.features) != len(self.labels):
            raise ValueError(f"features/labels have {len(self.features)}/{len(self.labels)} rows: one label per row")
        # Every row is Poisson-sampled at the plan's q; the sum is divided by q·N with N the plan's
        # (public) size. Under add/remove neighbours the certificate holds whatever the real row
        # count, so a node that declared a public size different from its real one stays private.
        self.num_rows = len(self.features)
        self.randomness = StepRandomness(seed)
        self.step = 0
        self.step_sizes = StepSizes([plan], [None], self.device)
        if state is not None:
            self.load_state_dict(state)

    # ----- state -----
    def state_dict(self) -> dict[str, Any]:
        """The step counter and AdaGrad-norm accumulator: JSON-serialisable."""
        return {"step": self.step, "b_squared": self.step_sizes.b_squared_of()[0]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        step = int(state["step"])
        if not 0 <= step <= self.plan.steps:
            raise PlanExhausted(f"state step={step} outside the plan's 0..{self.plan.steps} steps")
        self.step = step
        self.step_sizes = StepSizes([self.plan], [state.get("b_squared")], self.device)

    def _draws(self, steps_wanted: int) -> StepDraws:
        """Samples and noise for the next steps, drawn together (at most a chunk's worth)."""
        steps = min(steps_wanted, self.randomness.chunk_steps(self.num_rows, self.stack.noise_count))
        return self.randomness.draws(
            self.step,
            steps,
            self.num_rows,
            self.plan.sampling_rate,
            self.stack.noise_count,
            device=self.device,
        )

    @property
    def steps_left(self) -> int:
        return self.plan.steps - self.step

    # ----- running -----
    def run_round(self, round_number: int) -> TrainReport:
        """The steps of federated round `round_number` (1-based), which must be the next ones."""
        count = self.plan.steps_in_round(round_number)
        first = self.plan.first_step_of_round(round_number)
        if count == 0:
            raise PlanExhausted(
                f"round {round_number} has no steps: the plan has {self.plan.rounds} rounds "
                f"of {self.plan.steps} steps in all"
            )
        if first != self.step:
            raise ValueError(
                f"round {round_number} starts at step {first} but the trainer is at step "
                f"{self.step}: rounds must run in order, each exactly once"
            )
        return self.run_steps(count)

    def _batch(self, index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The sampled rows as a stack of one client: (features [1, B], labels [1, B], valid [1, B]);
        an empty sample is one padding row of zeros, which contributes nothing."""
        if len(index) == 0:
            features = torch.zeros((1, 1, *self.features.shape[1:]), dtype=self.features.dtype, device=self.device)
            labels = torch.zeros((1, 1), dtype=torch.long, device=self.device)
            return features, labels, torch.zeros((1, 1), dtype=torch.bool, device=self.device)
        rows = torch.ones((1, len(index)), dtype=torch.bool, device=self.device)
        return self.features[index].unsqueeze(0), self.labels[index].unsqueeze(0), rows

    def run_steps(self, count: int) -> TrainReport:
        """The next `count` steps of the plan; refuses (before doing any) to pass step T."""
        if count < 0:
            raise ValueError(f"count={count}: must be >= 0")
        if self.step + count > self.plan.steps:
            raise PlanExhausted(
                f"asked for {count} steps from step {self.step}, but the plan has only "
                f"{self.plan.steps} steps ({self.steps_left} left)"
            )
        plan = self.plan
        clip = plan.clip_norm if self.private else UNCLIPPED
        expected = plan.expected_batch_size
        first = self.step
        one = {"device": self.device}
        clip_t = torch.tensor([clip], dtype=NORM_DTYPE, **one)
        expected_t = torch.tensor([expected], dtype=self.parameters[0].dtype, **one)
        active = torch.ones(1, dtype=torch.bool, **one)
        totals = RoundTotals()
        examples = empty = 0
        steps = range(first, first + count)
        sigmas = [plan.noise_multiplier(t) if self.private else 0.0 for t in steps]
        # each step's σ_t·C, from σ_t in float64 as the plan has it, rounded upwards once
        noise_std = noise_scale(torch.tensor(sigmas, dtype=NORM_DTYPE, **one), clip_t)
        scheduled = torch.tensor([plan.learning_rate_at(t) for t in steps], dtype=self.parameters[0].dtype, **one)
        rate = torch.full((1,), math.nan)

        self.model.train()
        draws: StepDraws | None = None
        for i in range(count):
            if draws is None or self.step >= draws.first_step + len(draws.noise):
                draws = self._draws(first + count - self.step)
                done = self.step - first  # every drawn step's Box–Muller at once
                ahead = noise_ahead(draws.noise, noise_std[done : done + len(draws.noise)]) if self.private else None
            index = draws.sample(self.step)
            features, labels, valid = self._batch(index)
            inputs = StepInputs(
                features,
                labels,
                valid,
                draws.noise_words(self.step).unsqueeze(0),
                noise_std[i : i + 1],
                clip_t,
                expected_t,
                active,
                [self.randomness.refiner(self.step)],
                None if ahead is None else ahead.row(self.step - draws.first_step),
            )

            def learning_rate(released: list[Tensor], i: int = i) -> Tensor:
                nonlocal rate
                rate = self.step_sizes.rate(released, active, scheduled[i : i + 1])
                return rate

            report = self.stack.step(self.state, inputs, learning_rate, private=self.private)
            empty += len(index) == 0
            examples += len(index)
            totals.add(report)
            self.step += 1

        sigma_mean = sum(sigmas) / count if count else math.nan
        mean_loss, clip_fraction, nonfinite = totals.per_client()[0] if count else (math.nan, math.nan, 0)
        return TrainReport(
            first_step=first,
            steps=count,
            examples=examples,
            empty_steps=empty,
            mean_loss=mean_loss,
            clip_fraction=clip_fraction,
            nonfinite_examples=nonfinite,
            sigma_mean=sigma_mean,
            noise_std_on_mean=sigma_mean * clip / expected,
            last_learning_rate=float(rate[0]),
            seeded=self.randomness.seeded,
        )
