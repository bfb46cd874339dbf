"""The model zoo: shapes, names, and that every model is one the DP trainer can clip."""

from __future__ import annotations

import pytest
import torch

from fedprivacy.models import MODELS, build_model
from fedprivacy.training import check_supported


@pytest.mark.parametrize(
    "name,features,classes,shape",
    [
        ("logreg", 15, 2, (15,)),
        ("mlp", 15, 2, (15,)),
        ("logreg", 64, 10, (1, 8, 8)),
        ("mlp", 64, 10, (1, 8, 8)),
        ("cnn", 64, 10, (1, 8, 8)),
        ("cnn", 64, 10, (64,)),
    ],
)
def test_models_give_one_logit_per_class(name: str, features: int, classes: int, shape: tuple) -> None:
    model = build_model(name, features, classes)
    out = model(torch.randn(5, *shape))
    assert out.shape == (5, classes)
    check_supported(model)


def test_logreg_is_one_linear_layer() -> None:
    params = list(build_model("logreg", 15, 2).parameters())
    assert [p.shape for p in params] == [torch.Size([2, 15]), torch.Size([2])]


def test_unknown_model_lists_known_names() -> None:
    with pytest.raises(ValueError) as err:
        build_model("resnet", 15, 2)
    for name in MODELS:
        assert name in str(err.value)
    assert "resnet" in str(err.value)


@pytest.mark.parametrize("features,classes", [(0, 2), (15, 1)])
def test_bad_sizes_are_refused(features: int, classes: int) -> None:
    with pytest.raises(ValueError, match="num_features"):
        build_model("mlp", features, classes)


def test_cnn_needs_a_square_image() -> None:
    with pytest.raises(ValueError, match="square"):
        build_model("cnn", 15, 2)
