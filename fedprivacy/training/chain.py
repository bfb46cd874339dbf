"""A and D of a chain of Linear layers and ReLUs in closed form: the capture of logistic
regression, the MLP and any `nn.Sequential` of the same pieces, without hooks or autograd.

For such a model the forward is a few matrix products, and the gradient of the summed
cross-entropy with respect to the logits is known: D = softmax(z) − onehot(y) on each sampled row
(0 on padding rows). Each earlier layer's D is the next one's D times its weight, zeroed where the
ReLU between them output 0 (as autograd's ReLU backward does). Computed this way a step of a small
model makes a fraction of the calls the hooked capture makes (probes, hooks, an autograd graph);
A, the losses and the products are the same operations on the same tensors, D agrees with
autograd's to float32 rounding (its softmax is formed by another kernel). The norms and clipped
sums are the layer rules' own, from this A and D, so whatever the sums hold the norms bound.

A chain is recognised only among models kept apart by construction
(`isolation.rows_apart_by_construction`: exact PyTorch types, no hooks): an `nn.Sequential` of
`nn.Flatten` (over all dimensions after the batch), `nn.Linear` with weight and bias both
trained, `nn.ReLU` and `nn.Identity`, ending in a Linear. Anything else takes the hooked capture.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedprivacy.training.isolation import rows_apart_by_construction


@dataclass(frozen=True)
class _Layer:
    """One Linear of the chain: its module, its state-dict names, and whether a ReLU follows it."""

    module: nn.Linear
    weight: str
    bias: str
    relu: bool


class LinearChain:
    """The closed-form capture of one recognised chain (`of`): `single` for one client's rows,
    `stacked` for K clients' rows each with its own weights."""

    def __init__(self, layers: Sequence[_Layer], flatten: bool) -> None:
        self.layers = list(layers)
        self.flatten = flatten  # the rows are flattened before the first Linear

    @classmethod
    def of(cls, model: nn.Module) -> LinearChain | None:
        """The chain `model` is, or None when it is not one (see the module docstring)."""
        if type(model) is not nn.Sequential or not rows_apart_by_construction(model):
            return None
        layers: list[_Layer] = []
        flatten = False
        for name, module in model.named_children():
            kind = type(module)
            if kind is nn.Flatten:
                if module.start_dim != 1 or module.end_dim != -1:
                    return None
                if not layers:
                    flatten = True  # after a Linear its 2-D output is left as it is
            elif kind is nn.Linear:
                if module.bias is None or not (module.weight.requires_grad and module.bias.requires_grad):
                    return None
                layers.append(_Layer(module, f"{name}.weight", f"{name}.bias", relu=False))
            elif kind is nn.ReLU:
                if not layers or layers[-1].relu:
                    return None
                layers[-1] = _Layer(layers[-1].module, layers[-1].weight, layers[-1].bias, relu=True)
            elif kind is not nn.Identity:
                return None
        if not layers or layers[-1].relu:
            return None
        return cls(layers, flatten)

    def takes(self, features: Tensor, leading: int) -> bool:
        """Whether rows `features` (`leading` batch dimensions, then one example's) reach every
        Linear as a matrix of rows: a plain vector per example, or one the chain flattens."""
        return self.flatten or features.dim() == leading + 1

    def single(
        self, weights: Mapping[str, Tensor] | None, features: Tensor, labels: Tensor, valid: Tensor | None
    ) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """Per Linear its input A [B, in] and output gradient D [B, out], and the losses [B], for
        one client's rows `features` [B, ...] with its `weights` by state-dict name (None: the
        modules' own)."""

        def own(layer: _Layer) -> tuple[Tensor, Tensor]:
            if weights is None:
                return layer.module.weight.detach(), layer.module.bias.detach()
            return weights[layer.weight], weights[layer.bias]

        parameters = [own(layer) for layer in self.layers]
        h = features.flatten(1) if self.flatten else features
        inputs, outputs = [], []
        for layer, (w, b) in zip(self.layers, parameters, strict=True):
            inputs.append(h)
            h = F.linear(h, w, b)
            if layer.relu:
                h = h.relu_()  # in place: the product is this call's own
                outputs.append(h)
        losses, d = _cross_entropy_and_delta(h, labels, valid)
        deltas = [d]
        for k in range(len(self.layers) - 1, 0, -1):
            d = _through_relu(d @ parameters[k][0], outputs[k - 1])
            deltas.append(d)
        return inputs, deltas[::-1], losses

    def stacked(
        self, state: Mapping[str, Tensor], features: Tensor, labels: Tensor, valid: Tensor
    ) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """`single` for K clients at once: rows `features` [K, B, ...], each client's weights the
        [K, ...] entries of `state`; A and D per Linear as [K·B, ·] (client-major rows), losses [K, B]."""
        parameters = [(state[layer.weight], state[layer.bias]) for layer in self.layers]
        h = features.flatten(2) if self.flatten else features
        inputs, outputs = [], []
        for layer, (w, b) in zip(self.layers, parameters, strict=True):
            inputs.append(h)
            # the product, then its bias in place: baddbmm with a broadcast bias costs 1.1-2.2× more on a CPU
            h = torch.bmm(h, w.transpose(1, 2)).add_(b.unsqueeze(1))
            if layer.relu:
                h = h.relu_()  # in place: the product is this call's own
                outputs.append(h)
        losses, d = _cross_entropy_and_delta(h, labels, valid)
        deltas = [d]
        for k in range(len(self.layers) - 1, 0, -1):
            d = _through_relu(torch.bmm(d, parameters[k][0]), outputs[k - 1])
            deltas.append(d)
        rows = labels.numel()
        return [a.reshape(rows, -1) for a in inputs], [d.reshape(rows, -1) for d in deltas[::-1]], losses

    def gradient_sums(
        self, state: Mapping[str, Tensor], features: Tensor, labels: Tensor, valid: Tensor
    ) -> tuple[list[Tensor], Tensor]:
        """Each client's plain Σ∇loss over its rows, [K, *shape] per weight and bias in layer
        order, and the losses [K, B]: what the engine without the mechanism takes from the chain."""
        clients = labels.shape[0]
        inputs, deltas, losses = self.stacked(state, features, labels, valid)
        sums = []
        for a, d in zip(inputs, deltas, strict=True):
            d = d.view(clients, -1, d.shape[-1])
            sums += [torch.bmm(d.transpose(1, 2), a.view(clients, -1, a.shape[-1])), d.sum(1)]
        return sums, losses


def _through_relu(gradient: Tensor, output: Tensor) -> Tensor:
    """A ReLU's input gradient from its output's: 0 where the output is ≤ 0 (autograd's own rule,
    `threshold_backward`: one pass, where torch.where over a 3-D mask costs 6-8× more on a CPU)."""
    return torch.ops.aten.threshold_backward(gradient, output, 0)


def _cross_entropy_and_delta(logits: Tensor, labels: Tensor, valid: Tensor | None) -> tuple[Tensor, Tensor]:
    """Per-row cross-entropy of `logits` [..., classes] and its gradient softmax − onehot, both 0
    where `valid` is False (padding rows)."""
    log_p = torch.log_softmax(logits, -1)
    target = labels.unsqueeze(-1)
    losses = log_p.gather(-1, target).squeeze(-1).neg_()
    d = log_p.exp_().scatter_add_(-1, target, torch.full_like(target, -1.0, dtype=logits.dtype))
    if valid is not None:
        losses = torch.where(valid, losses, 0.0)
        d = torch.where(valid.unsqueeze(-1), d, 0.0)
    return losses, d
