"""One DP-SGD step, exactly the mechanism the accountants certify (after sampling).

Σ clipped per-example gradients + N(0, σ²C²·I), divided by the EXPECTED batch size q·N (not the
realised one, so the sensitivity of the released average is C/(qN) whatever the batch), then a
plain SGD update. The trainer and the step-overhead benchmark both run this code.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from fedprivacy.training.clipping import ClippedBatch, PerExampleClipper


def noise_scale(sigma: float | np.ndarray, clip_norm: float | np.ndarray, dtype: torch.dtype = torch.float32) -> np.ndarray:
    """σ·C formed in float64 and rounded once into `dtype`, upwards: the noise's standard deviation
    is never below the certified σC (a float32 σ times a float32 C could land 1 ulp under it). The
    trainer and the fast engine both scale their normals by it."""
    exact = np.asarray(sigma, dtype=np.float64) * np.asarray(clip_norm, dtype=np.float64)
    target = np.float32 if dtype == torch.float32 else np.float64
    rounded = exact.astype(target)
    return np.where(rounded < exact, np.nextafter(rounded, target(np.inf)), rounded)


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
    noise = [chunk.view_as(g) for chunk, g in zip(normals.split([g.numel() for g in grad_sums]), grad_sums, strict=True)]
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
