"""Embeddings: example i's gradient is sparse, Gᵢ = Σₜ e_{idxₜ}dₜᵀ (row idxₜ of the table receives
dₜ), so ‖Gᵢ‖² = Σₜₛ [idxₜ = idxₛ]⟨dₜ, dₛ⟩, a Gram form over the example's T positions: the one-hot
rows play the role of a Linear layer's inputs. It can cancel like any Gram form, so the bound used
is `norms._conservative`'s. The clipped sum adds w·dₜ into row idxₜ (index_add), one table per
client; positions holding `padding_idx` get no gradient, as in PyTorch."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from fedprivacy.training.layers.base import LayerRule, LayerTerms
from fedprivacy.training.norms import NORM_DTYPE, Slack, ToFloat64, UnsupportedLayerError, _conservative, _rounding


class EmbeddingRule(LayerRule):
    """nn.Embedding without max_norm or scale_grad_by_freq."""

    parameters = ("weight",)

    def check(self, module: nn.Module) -> None:
        if module.max_norm is not None:
            raise UnsupportedLayerError(
                f"max_norm={module.max_norm} renormalises the looked-up rows of the table in place during the "
                "forward pass, so the model trained is not the one whose gradients are clipped; use max_norm=None"
            )
        if module.scale_grad_by_freq:
            raise UnsupportedLayerError(
                "scale_grad_by_freq=True divides each gradient by how often its index occurs in the whole batch, "
                "so one example's gradient depends on the others; use scale_grad_by_freq=False"
            )

    def terms(self, module: nn.Module, a: Tensor, d: Tensor, to64: ToFloat64) -> LayerTerms:
        rows, width = a.shape[0], d.shape[-1]
        index = a.reshape(rows, -1)  # (R, T)
        d = d.reshape(rows, -1, width)  # (R, T, E)
        positions = index.shape[1]
        counted = torch.ones_like(index, dtype=NORM_DTYPE)
        if module.padding_idx is not None:  # the padding row receives no gradient
            padding = index == module.padding_idx
            d = d.masked_fill(padding.unsqueeze(-1), 0.0)
            counted.masked_fill_(padding, 0.0)
        u, eta = _rounding(d.dtype)
        d64 = to64(d, (module, "d"))
        if positions == 1:  # one row: ‖d‖², a sum of squares, no cancellation
            sq = torch.linalg.vector_norm(d64, dim=(1, 2)).square()
        else:
            gram = torch.bmm(d64, d64.transpose(1, 2))  # ⟨dₜ, dₛ⟩
            same = index.unsqueeze(2) == index.unsqueeze(1)  # [idxₜ = idxₛ]: exact, the one-hot Gram
            estimate = torch.where(same, gram, 0.0).sum((1, 2))
            s = gram.diagonal(dim1=1, dim2=2).sqrt().sum(1)  # Sᵢ = Σₜ ‖dₜ‖·‖e_{idxₜ}‖
            sq = _conservative(estimate, s, positions, 1, width, u)
        # The sum forms fl(w·dₜ) (an error ≤ η per entry, times ‖e_{idxₜ}‖ = 1, doubled); adding into the
        # table is exact below the normal range.
        slack = Slack(counted.sum(1), 2 * eta * math.sqrt(width), 0.0)
        return LayerTerms(sq, slack, (index, d))

    def weighted_sums(self, module: nn.Module, terms: LayerTerms, weights: Tensor) -> list[Tensor]:
        index, d = terms.state
        clients, batch = weights.shape
        tables = module.num_embeddings
        wd = d * weights.view(-1, 1, 1)
        if clients > 1:  # client k's rows go to its own table, k·V … k·V + V − 1
            offsets = torch.arange(clients, device=index.device).mul_(tables).repeat_interleave(batch)
            index = index + offsets.unsqueeze(1)
        sums = wd.new_zeros(clients * tables, d.shape[-1]).index_add_(0, index.reshape(-1), wd.reshape(-1, d.shape[-1]))
        return [sums.view(clients, tables, -1)]
