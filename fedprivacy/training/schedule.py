"""The learning rate of each step: the plan's deterministic schedules, or AdaGrad-norm.

AdaGrad-norm (ADP-SGD paper, §5.2) sets η_t = η / b_{t+1} with b²_{t+1} = b_t² + max(‖g_t‖², ν).
Here g_t is the released NOISY averaged gradient, never the clean one, so the adaptation is
post-processing and costs no privacy.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fedprivacy.privacy.plan import Plan

DEFAULT_B0 = 1.0
DEFAULT_NU = 1e-4


class StepSize:
    """η_t for the plan's `lr_schedule`; holds b_t² for AdaGrad-norm (part of trainer state)."""

    def __init__(self, plan: Plan, b_squared: float | None = None) -> None:
        self.plan = plan
        self.adaptive = plan.lr_schedule == "adagrad_norm"
        self.nu = float(plan.lr_params.get("nu", DEFAULT_NU))
        b0 = float(plan.lr_params.get("b0", DEFAULT_B0))
        self.b_squared = b0 * b0 if b_squared is None else float(b_squared)
        if self.adaptive and not (self.b_squared > 0 and self.nu > 0):
            raise ValueError(f"lr_params={plan.lr_params}: adagrad_norm needs b0 > 0 and nu > 0")

    def rate(self, step: int, released: list[Tensor]) -> float:
        """η for `step`, given the noisy gradient about to be applied (read only if adaptive)."""
        if not self.adaptive:
            return self.plan.learning_rate_at(step)
        sq_norm = float(torch.stack([g.square().sum() for g in released]).sum())
        self.b_squared += max(sq_norm, self.nu)
        return self.plan.learning_rate / math.sqrt(self.b_squared)
