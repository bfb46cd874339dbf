"""The local DP-SGD trainer: runs exactly the plan's steps, in any slices, and nothing else.

It reads σ_t, q, C and T from the `Plan` and never recomputes them (ADP-SGD's α_t is already in
σ_t). Every step Poisson-samples each local record with probability q, so batches vary in size
and an empty batch is still a step: it spends privacy and adds noise like any other. The steps
are the mechanism's own loop (`fedprivacy.training.steps.take_steps`) with this one client on its
model's own weights (`ClientStack`, K = 1); the trainer keeps the count. The step counter and the
AdaGrad-norm accumulator are the whole state needed to resume.

`private=False` runs the same steps with the mechanism off (σ = 0, nothing clipped): the
non-private baseline's local training (`sims.baseline`). It is a Python argument only: no run
config, and so no ClientApp, can ask for it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fedprivacy.errors import ClientRefusal
from fedprivacy.privacy.plan import Plan
from fedprivacy.training.rng import StepRandomness
from fedprivacy.training.schedule import StepSizes
from fedprivacy.training.stack import ClientStack
from fedprivacy.training.steps import ClientSteps, StackRows, TrainReport, take_steps

__all__ = ["DPTrainer", "NonFiniteModel", "PlanExhausted", "TrainReport", "check_finite"]


class PlanExhausted(RuntimeError):
    """A request for steps beyond the plan's T (they would spend privacy nobody certified)."""


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
        trained = named[self.stack.capture.trained_names[0]]
        self.device, dtype = trained.device, trained.dtype
        features = torch.as_tensor(features).to(self.device, dtype)
        labels = torch.as_tensor(labels, dtype=torch.long).to(self.device)
        if len(features) != len(labels):
            raise ValueError(f"features/labels have {len(features)}/{len(labels)} rows: one label per row")
        # Every row is Poisson-sampled at the plan's q; the sum is divided by q·N with N the plan's
        # (public) size. Under add/remove neighbours the certificate holds whatever the real row
        # count, so a node that declared a public size different from its real one stays private.
        self.rows = StackRows.of(features.unsqueeze(0), labels.unsqueeze(0), [len(features)])
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

    @property
    def features(self) -> Tensor:
        """The client's records' features, on the model's device."""
        return self.rows.client(0)[0]

    @property
    def labels(self) -> Tensor:
        return self.rows.client(0)[1]

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

    def run_steps(self, count: int) -> TrainReport:
        """The next `count` steps of the plan; refuses (before doing any) to pass step T."""
        if count < 0:
            raise ValueError(f"count={count}: must be >= 0")
        if self.step + count > self.plan.steps:
            raise PlanExhausted(
                f"asked for {count} steps from step {self.step}, but the plan has only "
                f"{self.plan.steps} steps ({self.steps_left} left)"
            )
        self.model.train()
        mine = ClientSteps(self.plan, self.step, count, self.randomness)
        done = take_steps(self.stack, self.state, self.rows, [mine], self.step_sizes, private=self.private)
        self.step += count
        return done.client(0)
