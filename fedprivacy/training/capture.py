"""Each trained layer's inputs A and output gradients D, for one client (the trainer) or for K
clients at once, each with its own weights (the fast engine): what the shared clipping
(`fedprivacy.training.clipping.clipped_sums`) needs.

Forward hooks on the model's trained layers record each layer's input (A) and add a zero "probe"
tensor to its output, so that the gradient of the summed losses with respect to the probes is D.
The backward forms only the gradients with respect to the layers' outputs, never the parameters'
(the weights do not require gradients here): the clipped sums are formed from A and D by the
layer rules. The model runs as `torch.func.functional_call(template, weights)`, so whatever a
forward assigns to its registered parameters and buffers is undone when it returns.

Each example is computed alone (`fedprivacy.training.isolation`): a model made only of modules that
keep rows apart by construction runs as one batched forward; any other runs one example at a time
under `torch.func.vmap`, so that no record can reach another example's activations or gradients
(a batch mean is the mean of one row). For K clients the same function runs under a second vmap,
over the clients: every operation is batched by PyTorch's own batching rules (a Linear's product
becomes a batched matrix product, a convolution with per-client weights a grouped convolution
with K·G groups, a norm layer's affine a broadcast), with no per-layer code here.

A model that is a chain of Linear layers and ReLUs (logistic regression, the MLP:
`fedprivacy.training.chain`) takes neither hooks nor autograd: its A, D and losses are formed in
closed form, for one client or K (the same A and losses; D to float32 rounding). On a GPU,
convolutions run as products of patches (`convolution_as_product`), 4× faster than the grouped
convolution (docs/simulator.md, "The fast engine").
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, vmap

from fedprivacy.training.chain import LinearChain
from fedprivacy.training.isolation import AttributeWatch, rows_apart_by_construction
from fedprivacy.training.layers.base import UnsupportedLayerError
from fedprivacy.training.layers.conv import patch_weight, patches


@dataclass
class LayerRecord:
    """What a capture gives one trained layer: its first forward input and its output gradient."""

    module: nn.Module
    a: Tensor  # [K·B, ...]
    d: Tensor  # [K·B, ...]


@dataclass
class Captured:
    """One step's capture: per trained layer (in the trainer's order) its A and D with K·B
    client-major rows, and the per-example losses [K, B] (0 on padding rows, whose D is 0 too)."""

    records: list[LayerRecord]
    losses: Tensor


def trained_layers(model: nn.Module) -> list[tuple[str, nn.Module, list[str]]]:
    """(name, module, names of its trained parameters) of every module holding trainable
    parameters, in `model.modules()` order and each module's own parameter order: the order of the
    trained parameters, of the noise and of the clipped sums everywhere."""
    layers = []
    for name, module in model.named_modules():
        own = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        if own:
            layers.append((name, module, own))
    return layers


def trained_names(model: nn.Module) -> list[str]:
    """The state-dict names of the trained parameters, in the trainer's order: the only entries of
    a model that go through clipping and noise, and so the only ones a client releases."""
    return [f"{layer}.{p}" if layer else p for layer, _, own in trained_layers(model) for p in own]


class _Call:
    """What the hooks see during one forward: the probes (None: only read the output shapes; `lazy`:
    make each layer's probe from its output, outside vmap), and the inputs, output shapes and
    probes made so far, by layer position; `plain`: record nothing (a forward for the plain
    gradients, where the hooks only lay the outputs out)."""

    def __init__(self, probes: Sequence[Tensor] | None, plain: bool = False, lazy: bool = False) -> None:
        self.probes = probes
        self.plain = plain
        self.lazy = lazy
        self.inputs: dict[int, Tensor] = {}
        self.shapes: dict[int, torch.Size] = {}
        self.made: dict[int, Tensor] = {}

    def recorded(self, layers: list[tuple[str, nn.Module, list[str]]]) -> list[Tensor]:
        """The inputs in layer order; every trained layer must have been called."""
        missing = [name for k, (name, _, _) in enumerate(layers) if k not in self.inputs]
        if missing:
            raise UnsupportedLayerError(
                f"layer {missing[0]!r} was not called in the forward pass; freeze its parameters "
                "(requires_grad=False) if it is not meant to be trained"
            )
        return [self.inputs[k] for k in range(len(layers))]


class BatchedCapture:
    """Forward and backward of `template` for one client's rows (`single`) or for K clients, each
    with its own state (`__call__`, `gradient_sums`), every example computed alone.

    `keys` are the names of the state (`template.state_dict()` order) whose stacked values
    [K, *shape] the stacked calls take. Hooks on `template` record only while a capture runs, so
    the template is usable normally otherwise. `conv_as_matmul` computes the template's
    convolutions as one batched product over patches (`convolution_as_product`), for GPUs;
    `channels_last` stores the image-shaped outputs of trained layers (K·B, C, H, W) with their
    channels innermost, for CPUs: the values are the same, but the layers after them run faster
    (the digits CNN's max-pooling 5× faster forward, 3× slower backward: a CPU round 9% faster);
    a model that cannot take them is run without them from its first failure (`_batched`).
    """

    IS_CAPTURE = True  # its hooks are not a user's (`isolation.rows_apart_by_construction`)

    def __init__(
        self,
        template: nn.Module,
        keys: Sequence[str] | None = None,
        conv_as_matmul: bool = False,
        channels_last: bool = False,
    ) -> None:
        self.template = template
        self.channels_last = channels_last
        self.keys = list(template.state_dict()) if keys is None else list(keys)
        self.layers = trained_layers(template)
        if not self.layers:
            raise UnsupportedLayerError("the model has no trainable parameters")
        self.trained_names = trained_names(template)
        self.dtype = template.get_parameter(self.trained_names[0]).dtype  # of the probes, hence of D
        self.rows_apart = rows_apart_by_construction(template)
        self.chain = LinearChain.of(template)  # a chain of Linear layers and ReLUs: A and D in closed form
        self._watch = None if self.rows_apart else AttributeWatch(template)
        self._position = {id(module): k for k, (_, module, _) in enumerate(self.layers)}
        self._call: _Call | None = None
        self._shapes: dict[tuple[Any, ...], tuple[list[torch.Size], int]] = {}
        self._probes: dict[tuple[Any, ...], Tensor] = {}
        self._handles = [module.register_forward_hook(self._hook) for _, module, _ in self.layers]
        if conv_as_matmul:
            for module in template.modules():
                if type(module) in (nn.Conv1d, nn.Conv2d):
                    module.forward = partial(convolution_as_product, module)

    def remove_hooks(self) -> None:
        """Detach the capture from its template (a model checked once and then handed on)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor | None:
        call = self._call
        if call is None:
            return None
        k = self._position[id(module)]
        if k in call.inputs:
            raise UnsupportedLayerError(
                f"layer {self.layers[k][0]!r} ({type(module).__name__}) is called more than once per forward "
                "pass (shared weights): per-example norms would not add up per call"
            )
        if not isinstance(output, Tensor):
            raise UnsupportedLayerError(
                f"layer {self.layers[k][0]!r} ({type(module).__name__}) returns {type(output).__name__}: its rule "
                "needs a single output tensor"
            )
        # A user's forward may later change a layer's input in place (`x += block(x)`): keep what the
        # layer saw. Modules kept apart by construction never do.
        call.inputs[k] = inputs[0] if self.rows_apart or call.plain else inputs[0].clone()
        if call.plain:
            return self._laid_out(output)
        if call.lazy:  # one batched forward, no vmap: the probe can take the output's own shape
            probe = call.made[k] = self._probe_like(k, output.shape, output.dtype, output.device)
            return self._laid_out(output + probe)
        if call.probes is None:
            call.shapes[k] = output.shape[1:]
            return None
        return self._laid_out(output + call.probes[k])

    def _template_call(
        self, weights: Mapping[str, Tensor] | None, probes: Sequence[Tensor] | None, x: Tensor, plain: bool
    ) -> tuple[Tensor, list[Tensor]]:
        """The template on rows `x` with `weights` (None: its own, for a model kept apart by
        construction, whose modules never assign to their state): its logits and its trained layers'
        inputs."""
        call = self._call = _Call(probes, plain)
        try:
            logits = self.template(x) if weights is None else functional_call(self.template, dict(weights), (x,))
        finally:
            self._call = None
        return logits, call.recorded(self.layers)

    def _client(
        self, weights: Mapping[str, Tensor] | None, probes: Sequence[Tensor], x: Tensor, plain: bool = False
    ) -> tuple[Tensor, list[Tensor]]:
        """One client's logits [B, classes] and layer inputs [B, ...] for its rows `x` [B, ...],
        probes [B, *output shape] per layer (none when `plain`): one batched forward for a model that keeps rows apart
        by construction, else one example at a time under vmap."""
        if self.rows_apart:
            return self._template_call(weights, probes, x, plain)

        def alone(x_i: Tensor, probes_i: Sequence[Tensor]) -> tuple[Tensor, list[Tensor]]:
            one = [p.unsqueeze(0) for p in probes_i]
            logits, inputs = self._template_call(weights, one, x_i.unsqueeze(0), plain)
            return _one_row(logits, "the model's output"), [
                _one_row(a, f"the input of layer {self.layers[k][0]!r}") for k, a in enumerate(inputs)
            ]

        return vmap(alone, randomness="different")(x, probes)

    @contextlib.contextmanager
    def _alone(self) -> Iterator[None]:
        """A forward that fails when each example is computed alone says so (a layer normalising
        over the batch dimension, a reshape across it, data-dependent Python control flow)."""
        if self.rows_apart:
            yield
            return
        try:
            yield
        except UnsupportedLayerError:
            raise
        except (RuntimeError, ValueError, IndexError, TypeError) as error:
            raise UnsupportedLayerError(
                "the model cannot run one example at a time (each example is computed alone, under "
                "torch.func.vmap, so that no record reaches another example's gradient; a model that mixes the "
                f"examples of its batch, or folds them together, cannot): {type(error).__name__}: {error}"
            ) from error

    def _checked(self, result: Any) -> Any:
        """`result` once the forward is known to have left no tensor behind (models not kept apart
        by construction, `isolation.AttributeWatch`)."""
        if self._watch is not None:
            self._watch.check()
        return result

    def _batched(self, forward: Callable[..., Any], *args: Any) -> Any:
        """`forward` under vmap over the clients (randomness="different": a dropout layer draws each
        client's masks on its own). Should the model fail with channels-last outputs (GroupNorm asks
        vmap for their memory format, which it cannot answer; `x.view(len(x), -1)` needs contiguous
        input), it runs from then on without them: the same call is redone from the same random
        state (channels-last is for CPUs only), and an error that has another cause raises again."""
        if not self.channels_last:
            return self._checked(vmap(forward, randomness="different")(*args))
        random_state = torch.get_rng_state()
        try:
            return self._checked(vmap(forward, randomness="different")(*args))
        except RuntimeError:
            self.channels_last = False
            torch.set_rng_state(random_state)
        return self._checked(vmap(forward, randomness="different")(*args))

    def _probe_like(self, layer: int, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
        """Layer `layer`'s zero probe of `shape`: one zero seen at every position (stride 0, nothing to
        fill), a leaf whose gradient autograd.grad returns without storing it, so one per layer and
        shape serves every step (each layer its own: one probe for two layers would add their D)."""
        key = (layer, tuple(shape), dtype, device)
        probe = self._probes.get(key)
        if probe is None:
            probe = self._probes[key] = torch.zeros((), dtype=dtype, device=device).expand(key[1]).requires_grad_()
        return probe

    def _laid_out(self, out: Tensor) -> Tensor:
        if self.channels_last and out.dim() == 4:  # (B, C, H, W) inside vmap over the clients
            return out.movedim(1, -1).contiguous().movedim(-1, 1)  # no copy if already so
        return out

    def _output_shapes(self, example: Tensor) -> list[torch.Size]:
        """Each trained layer's output shape per example (a layer's output has one row per example:
        BatchNorm, which mixes them, is refused)."""
        return self._probe(example)[0]

    def example_products(self, example: Tensor) -> int:
        """Multiply-adds of the trained Linear and convolution layers' forward on one example like
        `example`: a measure of how much arithmetic a row costs."""
        return self._probe(example)[1]

    def _probe(self, example: Tensor) -> tuple[list[torch.Size], int]:
        """Shapes and products from a zero example of `example`'s shape (never a record), on a copy
        of the template's state (whatever its forward writes is not kept)."""
        key = (tuple(example.shape), example.dtype, example.device)
        if key not in self._shapes:
            call = self._call = _Call(None)
            copies = {name: t.detach().clone() for name, t in self.template.state_dict(keep_vars=True).items()}
            try:
                with torch.no_grad(), self._alone():
                    functional_call(self.template, copies, (torch.zeros_like(example).unsqueeze(0),))
            finally:
                self._call = None
            call.recorded(self.layers)
            shapes = [call.shapes[k] for k in range(len(self.layers))]
            products = sum(  # each output element is a dot product of one weight row's length
                math.prod(shape) * module.weight[0].numel()
                for (_, module, _), shape in zip(self.layers, shapes, strict=True)
                if isinstance(module, nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d)
            )
            self._shapes[key] = (shapes, products)
        return self._shapes[key]

    def single(
        self, weights: Mapping[str, Tensor] | None, features: Tensor, labels: Tensor, valid: Tensor | None = None
    ) -> Captured:
        """A and D of every trained layer and the per-example losses [1, B] for one client's rows
        `features` [B, ...] with `labels` [B] (rows where `valid` is False are padding: loss and D
        0), with its state `weights` (by state-dict name, unstacked; None: the template's own)."""
        if self.chain is not None and self.chain.takes(features, 1):
            inputs, deltas, losses = self.chain.single(weights, features, labels, valid)
            return self._records(inputs, deltas, losses.unsqueeze(0))
        if self.rows_apart:  # one forward outside vmap: each probe made from its layer's output
            call = self._call = _Call(None, lazy=True)
            try:
                if weights is None:
                    logits = self.template(features)
                else:
                    logits = functional_call(self.template, dict(weights), (features,))
            finally:
                self._call = None
            inputs = call.recorded(self.layers)
            probes = [call.made[k] for k in range(len(self.layers))]
        else:
            if weights is None:
                named = [*self.template.named_parameters(), *self.template.named_buffers()]
                weights = {name: t.detach() for name, t in named}
            batch = labels.shape[0]
            probes = [
                self._probe_like(k, (batch, *shape), self.dtype, features.device)
                for k, shape in enumerate(self._output_shapes(features[0]))
            ]
            with self._alone():
                logits, inputs = self._checked(self._client(weights, probes, features))
        losses = F.cross_entropy(logits, labels, reduction="none")
        if valid is not None:
            losses = torch.where(valid, losses, 0.0)
        deltas = torch.autograd.grad(losses.sum(), probes, allow_unused=True, materialize_grads=True)
        records = [
            LayerRecord(module, a.detach(), d) for (_, module, _), a, d in zip(self.layers, inputs, deltas, strict=True)
        ]
        return Captured(records, losses.detach().unsqueeze(0))

    def __call__(self, state: Sequence[Tensor], features: Tensor, labels: Tensor, valid: Tensor) -> Captured:
        """A and D of every trained layer and the per-example cross-entropy losses, for the
        sampled rows `features` [K, B, ...] with `labels` [K, B]; rows where `valid` [K, B] is
        False are padding: their loss is 0 and so is their D."""
        if self.chain is not None and self.chain.takes(features, 2):
            weights = dict(zip(self.keys, state, strict=True))
            inputs, deltas, losses = self.chain.stacked(weights, features, labels, valid)
            return self._records(inputs, deltas, losses)
        clients, batch = labels.shape
        probes = [
            self._probe_like(k, (clients, batch, *shape), self.dtype, features.device)
            for k, shape in enumerate(self._output_shapes(features[0, 0]))
        ]
        weights = dict(zip(self.keys, state, strict=True))
        with self._alone():
            logits, inputs = self._batched(self._client, weights, probes, features)
        # the loss outside vmap, on all K·B rows at once (its batching rule cost a third of a logreg capture)
        losses = F.cross_entropy(_rows(logits), labels.reshape(-1), reduction="none").view(clients, batch)
        losses = torch.where(valid, losses, 0.0)
        deltas = torch.autograd.grad(losses.sum(), probes, allow_unused=True, materialize_grads=True)
        records = [
            LayerRecord(module, _rows(a.detach()), _rows(d))
            for (_, module, _), a, d in zip(self.layers, inputs, deltas, strict=True)
        ]
        return Captured(records, losses.detach())

    def _records(self, inputs: Sequence[Tensor], deltas: Sequence[Tensor], losses: Tensor) -> Captured:
        """A chain's (`LinearChain`) A and D per trained layer, and its losses [K, B]."""
        records = [LayerRecord(module, a, d) for (_, module, _), a, d in zip(self.layers, inputs, deltas, strict=True)]
        return Captured(records, losses)

    def gradient_sums(
        self, state: Sequence[Tensor], features: Tensor, labels: Tensor, valid: Tensor
    ) -> tuple[list[Tensor], Tensor] | None:
        """Without the mechanism: each client's Σ∇loss over its valid rows, [K, *shape] per trained
        parameter in the trainer's order, and the per-example losses [K, B], from one batched
        forward and an ordinary backward to the stacked weights (no A, D or norms: what a non-private
        engine costs). None when a sum is not finite: the caller then takes the clipped path, which
        drops the examples whose gradient is not finite, as the trainer's non-private steps do."""
        clients, batch = labels.shape
        if self.chain is not None and self.chain.takes(features, 2):  # the same closed form, summed plainly
            weights = dict(zip(self.keys, state, strict=True))
            sums, losses = self.chain.gradient_sums(weights, features, labels, valid)
        else:
            trained = set(self.trained_names)
            weights = {
                key: s.detach().requires_grad_() if key in trained else s
                for key, s in zip(self.keys, state, strict=True)
            }
            with self._alone():
                logits, _ = self._batched(partial(self._client, plain=True), weights, [], features)
            losses = F.cross_entropy(_rows(logits), labels.reshape(-1), reduction="none").view(clients, batch)
            losses = torch.where(valid, losses, 0.0)
            sums = list(torch.autograd.grad(losses.sum(), [weights[name] for name in self.trained_names]))
        if not math.isfinite(float(torch.stack(torch._foreach_norm(sums)).sum())):
            return None
        return sums, losses.detach()


def _one_row(x: Tensor, what: str) -> Tensor:
    """One example's `x` [1, ...] as [...]: a model that folds its example into other than one row
    (a reshape across the batch dimension) cannot be clipped per example."""
    if x.dim() == 0 or x.shape[0] != 1:
        raise UnsupportedLayerError(
            f"{what} has {x.shape[0] if x.dim() else 'no'} rows for one example: a model that reshapes or mixes "
            "the batch dimension cannot be clipped per example"
        )
    return x.squeeze(0)


def convolution_as_product(module: nn.Conv1d | nn.Conv2d, x: Tensor) -> Tensor:
    """`module`'s convolution of `x` (batch, channels, *spatial) as a product of its input patches
    with its weight, per group. Under `vmap` over clients with per-client weights a convolution
    becomes one grouped convolution with K·G groups, which cuDNN ran as one kernel per group (1,000
    launches per layer for 1,000 clients: most of a GPU round); this form is one batched product."""
    a = patches(module, x)  # (B, L, G·k·C/G)
    groups, out_channels = module.groups, module.out_channels
    w = patch_weight(module)  # (G, O/G, k·C/G)
    out = torch.einsum("blgc,goc->blgo", a.reshape(*a.shape[:2], groups, -1), w).reshape(*a.shape[:2], -1)
    if module.bias is not None:
        out = out + module.bias
    pads = module._reversed_padding_repeated_twice  # (left, right) per spatial dimension, the last first
    spatial = [
        (size + pads[-2 * i - 2] + pads[-2 * i - 1] - dilation * (kernel - 1) - 1) // stride + 1
        for i, (size, dilation, kernel, stride) in enumerate(
            zip(x.shape[2:], module.dilation, module.kernel_size, module.stride, strict=True)
        )
    ]
    return out.transpose(1, 2).reshape(x.shape[0], out_channels, *spatial).contiguous()


def _rows(x: Tensor) -> Tensor:
    """[K, B, ...] as [K·B, ...]: client-major rows, as the layer rules take them."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
