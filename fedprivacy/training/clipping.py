"""Clipped sums of per-example gradients in one backward pass ("book-keeping", Bu et al.).

For a Linear or Conv2d layer the gradient of example i is Dᵢᵀ·Aᵢ, where Aᵢ is the layer's
input (unfolded into patches for a convolution) and Dᵢ the gradient of the summed loss with
respect to the layer's output. So one forward pass that stores A and one backward pass that
returns D (only with respect to the layer outputs: autograd never forms the parameter
gradients) give, per layer,
  - the per-example squared norms, without materialising per-example gradients when the
    Gram form ⟨AᵢAᵢᵀ, DᵢDᵢᵀ⟩ is smaller (always for a 2-D Linear: ‖aᵢ‖²‖dᵢ‖²), and
  - the clipped sum Σᵢ wᵢ·DᵢᵀAᵢ = (w⊙D)ᵀA as one matrix product, wᵢ = C / max(‖gᵢ‖, C).
This is exact (no approximation) for any model whose trainable parameters all live in Linear or
Conv2d layers and whose layers never mix examples; anything else is refused by name.

An example whose gradient norm is not finite (an overflow, a NaN: a diverging run, or a model
crafted so that one record overflows) contributes exactly zero, and its rows are zeroed before the
sums are formed, since 0·inf would otherwise turn the whole clipped sum into NaN. Each example's
contribution is then still a function of that example alone with norm ≤ C, which is all the
accountant assumes. How many were dropped is counted for the client's own diagnostics only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SUPPORTED_LAYERS: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv2d)


class UnsupportedLayerError(TypeError):
    """A layer with trainable parameters whose per-example gradients we cannot compute."""


@dataclass
class ClippedBatch:
    """What one batch gives the DP step: clipped gradient sums and statistics (on device)."""

    grad_sums: list[Tensor]  # Σᵢ clip(gᵢ), aligned with PerExampleClipper.parameters
    sq_norms: Tensor  # per-example squared gradient norms before clipping, shape (B,); 0 where dropped
    loss_sum: Tensor  # Σᵢ loss_i over the examples kept (scalar)
    clip_norm: float
    nonfinite: int = 0  # examples dropped because their gradient norm was not finite

    @property
    def norms(self) -> Tensor:
        return self.sq_norms.sqrt()

    @property
    def clipped(self) -> Tensor:
        """Number of examples whose gradient norm exceeded C (scalar tensor)."""
        return (self.sq_norms > self.clip_norm**2).sum()


def _trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]


def check_supported(model: nn.Module) -> None:
    """Refuse a model holding trainable parameters outside Linear/Conv2d, or a batch norm
    (frozen or not, in training it mixes the examples of a batch), naming the layer."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise UnsupportedLayerError(
                f"layer {name or '<root>'!r} ({type(module).__name__}) normalises with batch "
                "statistics, so one example's gradient depends on the others: DP-SGD cannot "
                "clip per example; remove it"
            )
        params = _trainable(module)
        if params and not isinstance(module, SUPPORTED_LAYERS):
            raise UnsupportedLayerError(
                f"layer {name or '<root>'!r} ({type(module).__name__}) has trainable parameters "
                f"({', '.join(n for n, _ in params)}) but per-example gradients are only "
                f"supported for {', '.join(t.__name__ for t in SUPPORTED_LAYERS)}; "
                "freeze it (requires_grad=False) or replace it (e.g. no BatchNorm: it mixes "
                "examples in a batch)"
            )


# Per layer: (per-example squared norms (B,), A, D, per-example weight gradients or None).
Terms = tuple[Tensor, Tensor, Tensor, Tensor | None]


def _linear_terms(module: nn.Linear, a: Tensor, d: Tensor) -> Terms:
    """A Linear layer's terms; A and D as (B, T, ·) unless the input is plain 2-D."""
    if a.dim() == 2 and module.weight.requires_grad and module.bias is not None and module.bias.requires_grad:
        # The common case in closed form: ‖gᵢ‖² = ‖dᵢ‖²‖aᵢ‖² + ‖dᵢ‖² (weight, then bias).
        d_sq = torch.linalg.vecdot(d, d)
        return torch.addcmul(d_sq, d_sq, torch.linalg.vecdot(a, a)), a, d, None
    batch = a.shape[0]
    a = a.reshape(batch, -1, a.shape[-1])
    d = d.reshape(batch, -1, d.shape[-1])
    sq, per_example = _sq_norms(module, a, d)
    return sq, a, d, per_example


def _sq_norms(module: nn.Module, a: Tensor, d: Tensor) -> tuple[Tensor, Tensor | None]:
    """‖DᵢᵀAᵢ‖² (+ ‖Σₜ Dᵢₜ‖² for the bias) for A: (B, T, K), D: (B, T, O), by the cheaper of
    the Gram ("ghost") form and the per-example gradients DᵢᵀAᵢ, which are then returned too."""
    sq = d.new_zeros(d.shape[0])
    per_example = None
    if module.weight.requires_grad:
        t, k, o = a.shape[1], a.shape[2], d.shape[2]
        if t == 1:
            sq = a.square().sum((1, 2)) * d.square().sum((1, 2))
        elif t * t <= k * o:
            sq = (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(d, d.transpose(1, 2))).sum((1, 2))
        else:
            per_example = torch.bmm(d.transpose(1, 2), a)
            sq = per_example.square().sum((1, 2))
    if module.bias is not None and module.bias.requires_grad:
        sq = sq + d.sum(1).square().sum(1)
    return sq, per_example


def _patches(module: nn.Conv2d, x: Tensor) -> Tensor:
    """The input patches each output position sees, as one contiguous (B, L, C·kh·kw) tensor.

    Built from strided views (pad, then Tensor.unfold) and a single copy: on CPU F.unfold loops
    over the batch and was 7-20× slower on the CNN's two layers at batch 256.
    """
    if any(module._reversed_padding_repeated_twice):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, module._reversed_padding_repeated_twice, mode=mode)
    (kh, kw), (dh, dw), (sh, sw) = module.kernel_size, module.dilation, module.stride
    view = x.unfold(2, dh * (kh - 1) + 1, sh).unfold(3, dw * (kw - 1) + 1, sw)[..., ::dh, ::dw]
    batch, channels, out_h, out_w = view.shape[:4]
    return view.permute(0, 2, 3, 1, 4, 5).reshape(batch, out_h * out_w, channels * kh * kw)


def _conv_terms(module: nn.Conv2d, x: Tensor, d: Tensor) -> Terms:
    """A Conv2d layer as G grouped Linear maps over L patch positions: A (B·G, L, K), D (B·G, L, O)."""
    batch, groups = x.shape[0], module.groups
    a = _patches(module, x)
    if groups > 1:
        a = a.reshape(batch, a.shape[1], groups, -1).transpose(1, 2).reshape(batch * groups, a.shape[1], -1)
    d = d.reshape(batch * groups, d.shape[1] // groups, -1).transpose(1, 2)
    sq, per_example = _sq_norms(module, a, d)
    return sq.reshape(batch, groups).sum(1), a, d, per_example


def _all_finite(tensors: list[Tensor]) -> bool:
    """One check for a list: NaN and ±inf reach the sum of their norms (so does an overflowing
    norm, which only sends a finite batch down the slower, still exact, path)."""
    return math.isfinite(float(torch.stack(torch._foreach_norm(tensors)).sum()))


def _drop_rows(
    layer: nn.Module, keep: Tensor, a: Tensor, d: Tensor, per_example: Tensor | None
) -> tuple[nn.Module, Tensor, Tensor, Tensor | None]:
    """Zero the A and D rows (and per-example gradients) of the examples not kept.

    Rows are per example, or per (example, group) for a grouped convolution (B·G rows).
    """
    rows = keep.repeat_interleave(a.shape[0] // keep.shape[0])

    def zeroed(t: Tensor) -> Tensor:
        return torch.where(rows.view(-1, *(1,) * (t.dim() - 1)), t, 0.0)

    return layer, zeroed(a), zeroed(d), None if per_example is None else zeroed(per_example)


class PerExampleClipper:
    """Computes clipped per-example gradient sums for a model, by forward hooks on its layers.

    The hooks record only while `clipped_sum` runs, so the model is usable normally otherwise.
    """

    def __init__(self, model: nn.Module) -> None:
        check_supported(model)
        self.model = model
        self.layers = [m for m in model.modules() if isinstance(m, SUPPORTED_LAYERS) and _trainable(m)]
        if not self.layers:
            raise UnsupportedLayerError("the model has no trainable Linear or Conv2d parameters")
        # Parameters in layer order, weight before bias; grad_sums follow this order.
        self.parameters: list[nn.Parameter] = [p for m in self.layers for _, p in _trainable(m)]
        self._records: dict[nn.Module, tuple[Tensor, Tensor, int]] = {}
        self._recording = False
        for layer in self.layers:
            layer.register_forward_hook(self._record)

    def _record(self, module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        if not self._recording:
            return
        if module in self._records:
            raise UnsupportedLayerError(
                f"layer {type(module).__name__} is called more than once per forward pass "
                "(shared weights): per-example norms would not add up per call"
            )
        self._records[module] = (inputs[0].detach(), output, output._version)

    def clipped_sum(self, inputs: Tensor, targets: Tensor, clip_norm: float) -> ClippedBatch:
        """Σᵢ clip_C(∇loss_i) over the batch, with each example's gradient clipped over ALL
        trainable parameters together; cross-entropy loss on the model's logits.

        Examples whose gradient norm is not finite contribute zero. The common case pays one
        check (the sums and the norms' total are finite); otherwise the batch is redone without
        those examples, and, should its sums still overflow (finite norms built from terms that
        overflow when summed), one example at a time, so that only the offenders are dropped.
        """
        terms, sq_norms, losses = self._terms(inputs, targets)
        grad_sums = self._weighted_sums(terms, sq_norms, clip_norm)
        if _all_finite([sq_norms.sum(), *grad_sums]):
            return ClippedBatch(grad_sums, sq_norms, losses.detach().sum(), clip_norm)
        finite = torch.isfinite(sq_norms)
        nonfinite = int(finite.numel() - finite.sum())
        if nonfinite:
            terms = [_drop_rows(layer, finite, a, d, per_example) for layer, a, d, per_example in terms]
            sq_norms = torch.where(finite, sq_norms, 0.0)
            losses = torch.where(finite, losses, 0.0)
            grad_sums = self._weighted_sums(terms, sq_norms, clip_norm)
        if _all_finite(grad_sums):
            return ClippedBatch(grad_sums, sq_norms, losses.detach().sum(), clip_norm, nonfinite)
        if inputs.shape[0] == 1:
            zeros = [torch.zeros_like(g) for g in grad_sums]
            return ClippedBatch(zeros, torch.zeros_like(sq_norms), torch.zeros((), device=sq_norms.device), clip_norm, 1)
        singles = [self.clipped_sum(inputs[i : i + 1], targets[i : i + 1], clip_norm) for i in range(inputs.shape[0])]
        return ClippedBatch(
            [torch.stack(parts).sum(0) for parts in zip(*(b.grad_sums for b in singles), strict=True)],
            torch.cat([b.sq_norms for b in singles]),
            torch.stack([b.loss_sum for b in singles]).sum(),
            clip_norm,
            sum(b.nonfinite for b in singles),
        )

    def _terms(self, inputs: Tensor, targets: Tensor) -> tuple[list[tuple[nn.Module, Tensor, Tensor, Tensor | None]], Tensor, Tensor]:
        """One forward and one backward pass: each layer's (A, D, per-example gradients or None),
        the per-example squared norms and the per-example losses."""
        self._records.clear()
        self._recording = True
        try:
            logits = self.model(inputs)
        finally:
            self._recording = False
        losses = F.cross_entropy(logits, targets, reduction="none")
        loss_sum = losses.sum()
        outputs = []
        for layer in self.layers:
            if layer not in self._records:
                raise UnsupportedLayerError(
                    f"layer {layer} was not called in the forward pass; freeze its parameters "
                    "(requires_grad=False) if it is not meant to be trained"
                )
            _, out, version = self._records[layer]
            if out._version != version:
                raise UnsupportedLayerError(
                    f"the output of {layer} was modified in place (e.g. ReLU(inplace=True)); "
                    "use out-of-place activations"
                )
            outputs.append(out)
        # Gradients with respect to layer outputs only: autograd skips the parameter gradients.
        deltas = torch.autograd.grad(loss_sum, outputs, allow_unused=True)

        terms = []
        sq_norms: Tensor | None = None
        for layer, delta in zip(self.layers, deltas):
            a, out, _ = self._records[layer]
            if delta is None:
                delta = torch.zeros_like(out)
            sq, a, d, per_example = (_conv_terms if isinstance(layer, nn.Conv2d) else _linear_terms)(
                layer, a, delta
            )
            sq_norms = sq if sq_norms is None else sq_norms + sq
            terms.append((layer, a, d, per_example))
        self._records.clear()
        assert sq_norms is not None  # at least one layer (checked in __init__)
        return terms, sq_norms, losses

    @staticmethod
    def _weighted_sums(terms: list[tuple[nn.Module, Tensor, Tensor, Tensor | None]], sq_norms: Tensor, clip_norm: float) -> list[Tensor]:
        """Σᵢ wᵢ·gᵢ per parameter, wᵢ = C / max(‖gᵢ‖, C): 1 below C, C/‖gᵢ‖ above."""
        weights = sq_norms.clamp(min=clip_norm**2).rsqrt_().mul_(clip_norm)
        grad_sums: list[Tensor] = []
        for layer, a, d, per_example in terms:
            if a.dim() == 2:  # plain Linear: weight the narrower side; the bias is w·D
                if layer.weight.requires_grad:
                    if d.shape[1] <= a.shape[1]:
                        grad_sums.append((d * weights[:, None]).t() @ a)
                    else:
                        grad_sums.append(d.t() @ (a * weights[:, None]))
                if layer.bias is not None and layer.bias.requires_grad:
                    grad_sums.append(weights @ d)
                continue
            groups = layer.groups if isinstance(layer, nn.Conv2d) else 1
            w = weights if groups == 1 else weights.repeat_interleave(groups)
            wd = d * w.view(-1, *(1,) * (d.dim() - 1))
            if layer.weight.requires_grad:
                if per_example is not None:  # already formed for the norms: Σᵢ wᵢ·gᵢ
                    g = weights @ per_example.reshape(weights.shape[0], -1)
                elif groups == 1:
                    g = wd.reshape(-1, wd.shape[-1]).t() @ a.reshape(-1, a.shape[-1])
                else:  # (B·G, L, ·) -> (G, B·L, ·) and one batched product per group
                    wg = wd.reshape(-1, groups, *wd.shape[1:]).transpose(0, 1).flatten(1, 2)
                    ag = a.reshape(-1, groups, *a.shape[1:]).transpose(0, 1).flatten(1, 2)
                    g = torch.bmm(wg.transpose(1, 2), ag)
                grad_sums.append(g.reshape(layer.weight.shape))
            if layer.bias is not None and layer.bias.requires_grad:
                if groups == 1:
                    grad_sums.append(wd.reshape(-1, wd.shape[-1]).sum(0))
                else:
                    grad_sums.append(wd.reshape(-1, groups, *wd.shape[1:]).sum((0, 2)).reshape(-1))
        return grad_sums
