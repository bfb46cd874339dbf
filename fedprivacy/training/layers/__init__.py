"""Per-layer clipping rules, one registry: which layers DP-SGD can clip per example, and how.

Built in: Linear, Conv1d, Conv2d (grouped too), Embedding, LayerNorm and GroupNorm (with their
affine γ, β). A layer without parameters needs no rule. Register a rule for a layer of your own
with `register_layer_rule(MyLayer, MyRule())` (see docs/training.md, "Layers and their rules").
"""

from torch import nn

from fedprivacy.training.layers.base import (
    LayerRule,
    LayerTerms,
    UnsupportedLayerError,
    register_layer_rule,
    registered_layers,
    rule_for,
    trainable,
)
from fedprivacy.training.layers.conv import ConvRule
from fedprivacy.training.layers.embedding import EmbeddingRule
from fedprivacy.training.layers.linear import LinearRule
from fedprivacy.training.layers.normalization import GroupNormRule, LayerNormRule
from fedprivacy.training.layers.per_example import PerExampleRule

register_layer_rule(nn.Linear, LinearRule())
register_layer_rule(nn.Conv1d, ConvRule())
register_layer_rule(nn.Conv2d, ConvRule())
register_layer_rule(nn.Embedding, EmbeddingRule())
register_layer_rule(nn.LayerNorm, LayerNormRule())
register_layer_rule(nn.GroupNorm, GroupNormRule())

__all__ = [
    "ConvRule",
    "EmbeddingRule",
    "GroupNormRule",
    "LayerNormRule",
    "LayerRule",
    "LayerTerms",
    "LinearRule",
    "PerExampleRule",
    "UnsupportedLayerError",
    "register_layer_rule",
    "registered_layers",
    "rule_for",
    "trainable",
]
