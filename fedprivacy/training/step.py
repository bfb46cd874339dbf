"""One DP-SGD step, exactly the mechanism the accountants certify (after sampling).

Σ clipped per-example gradients + N(0, σ²C²·I), divided by the EXPECTED batch size q·N (not the
realised one, so the sensitivity of the released average is C/(qN) whatever the batch), then a
plain SGD update. The trainer and the step-overhead benchmark both run this code.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from fedprivacy.training.clipping import ClippedBatch, PerExampleClipper


def noise_scale(sigma: float | Tensor, clip_norm: float | Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """σ·C formed in float64 and rounded once into `dtype`, upwards: the noise's standard deviation
    is never below the certified σC (a float32 σ times a float32 C could land 1 ulp under it). The
    trainer and the fast engine both scale their normals by it; on the tensors' own device (a
    batched round's scales never leave the GPU)."""
    device = sigma.device if isinstance(sigma, Tensor) else None
    exact = torch.as_tensor(sigma, dtype=torch.float64, device=device) * torch.as_tensor(
        clip_norm, dtype=torch.float64, device=device
    )
    rounded = exact.to(dtype)
    upward = torch.nextafter(rounded, torch.full_like(rounded, float("inf")))
    return torch.where(rounded.to(torch.float64) < exact, upward, rounded)


def release(
    grad_sums: list[Tensor],
    sigma: float,
    clip_norm: float,
    expected_batch: float,
    normals: Tensor,
) -> list[Tensor]:
    """The noisy averaged gradient (Σ clipped + N(0, σ²C²I)) / (qN), in place on `grad_sums`.

    `normals` holds one standard normal per coordinate, in parameter order (see rng.py).
    """
    noise = [
        chunk.view_as(g) for chunk, g in zip(normals.split([g.numel() for g in grad_sums]), grad_sums, strict=True)
    ]
    # torch._foreach_*: one call per list instead of one per tensor (what torch.optim uses).
    torch._foreach_add_(grad_sums, noise, alpha=float(noise_scale(sigma, clip_norm, grad_sums[0].dtype)))
    torch._foreach_div_(grad_sums, expected_batch)
    return grad_sums


@torch.no_grad()
def sgd_update(parameters: list[torch.nn.Parameter], grads: list[Tensor], lr: float) -> None:
    """θ ← θ − η·g (plain SGD, no momentum: the released gradient is all the update sees)."""
    torch._foreach_add_(parameters, grads, alpha=-lr)


def dp_step(
    clipper: PerExampleClipper,
    inputs: Tensor,
    targets: Tensor,
    *,
    sigma: float,
    clip_norm: float,
    expected_batch: float,
    normals: Tensor,
    learning_rate: Callable[[list[Tensor]], float],
) -> ClippedBatch | None:
    """One noisy step on an already sampled batch; an empty batch still adds noise and steps.

    `learning_rate` maps the released gradient to η (it only reads it for AdaGrad-norm).
    Returns the batch statistics, or None for an empty batch.
    """
    batch = None
    if inputs.shape[0] == 0:
        grads = [torch.zeros_like(p) for p in clipper.parameters]
    else:
        batch = clipper.clipped_sum(inputs, targets, clip_norm)
        grads = batch.grad_sums
    grads = release(grads, sigma, clip_norm, expected_batch, normals)
    sgd_update(clipper.parameters, grads, learning_rate(grads))
    return batch
