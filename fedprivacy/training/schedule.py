"""The learning rate of each step, for K clients at once: each plan's deterministic schedule, or
AdaGrad-norm.

AdaGrad-norm (ADP-SGD paper, §5.2) sets η_t = η / b_{t+1} with b²_{t+1} = b_t² + max(‖g_t‖², ν).
Here g_t is the released NOISY averaged gradient, never the clean one, so the adaptation is
post-processing and costs no privacy. b_t² is part of each client's trainer state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fedprivacy.privacy.plan import Plan

DEFAULT_B0 = 1.0
DEFAULT_NU = 1e-4


class StepSizes:
    """η_t of K clients' plans; holds each client's b_t² (float64) for AdaGrad-norm."""

    def __init__(self, plans: Sequence[Plan], b_squared: Sequence[float | None], device: torch.device) -> None:
        adaptive, nu, start = [], [], []
        for plan, b2 in zip(plans, b_squared, strict=True):
            adaptive.append(plan.lr_schedule == "adagrad_norm")
            nu.append(float(plan.lr_params.get("nu", DEFAULT_NU)))
            b0 = float(plan.lr_params.get("b0", DEFAULT_B0))
            start.append(b0 * b0 if b2 is None else float(b2))
            if adaptive[-1] and not (start[-1] > 0 and nu[-1] > 0):
                raise ValueError(f"lr_params={plan.lr_params}: adagrad_norm needs b0 > 0 and nu > 0")
        self.any_adaptive = any(adaptive)
        self.adaptive = torch.tensor(adaptive, device=device)
        self.b_squared = torch.tensor(start, dtype=torch.float64, device=device)
        self.nu = torch.tensor(nu, dtype=torch.float64, device=device)
        self.base = torch.tensor([p.learning_rate for p in plans], dtype=torch.float64, device=device)

    def rate(self, released: list[Tensor], active: Tensor, scheduled: Tensor) -> Tensor:
        """Each client's η [K] for this step: `scheduled` (the plans' schedules, [K]) where not
        adaptive; AdaGrad-norm on the released gradients [K, ...] of the active clients otherwise."""
        if not self.any_adaptive:
            return scheduled
        sq = torch.stack([g.flatten(1).double().square().sum(1) for g in released]).sum(0)
        grow = self.adaptive & active
        self.b_squared = torch.where(grow, self.b_squared + torch.maximum(sq, self.nu), self.b_squared)
        return self.current(scheduled)

    def current(self, scheduled: Tensor) -> Tensor:
        """Each client's η [K] as of its last step: η/b for AdaGrad-norm, `scheduled` otherwise."""
        if not self.any_adaptive:
            return scheduled
        return torch.where(self.adaptive, (self.base / self.b_squared.sqrt()).to(scheduled.dtype), scheduled)

    def b_squared_of(self) -> list[float]:
        """Each client's b² to keep in its trainer state."""
        return [float(b) for b in self.b_squared.tolist()]
