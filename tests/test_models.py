"""The built-in models: shapes, both input forms, and that every one is a model the DP trainer can clip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedprivacy.errors import InputError
from fedprivacy.models import MODELS, build_model, cnn, input_shape, mlp
from fedprivacy.training import check_supported


@pytest.mark.parametrize(
    "name,built_for,classes,fed",
    [
        ("logreg", 15, 2, (15,)),
        ("mlp", (15,), 2, (15,)),
        ("logreg", (1, 8, 8), 10, (1, 8, 8)),
        ("mlp", 64, 10, (1, 8, 8)),
        ("cnn", 64, 10, (1, 8, 8)),
        ("cnn", (64,), 10, (64,)),
        ("cnn", (1, 8, 8), 10, (1, 8, 8)),
        ("cnn", (1, 8, 8), 10, (64,)),
        ("cnn", (3, 16, 12), 4, (3, 16, 12)),
    ],
)
def test_models_give_one_logit_per_class(name: str, built_for, classes: int, fed: tuple) -> None:
    model = build_model(name, built_for, classes)
    assert model(torch.randn(5, *fed)).shape == (5, classes)
    check_supported(model)


def test_the_cnn_is_one_model_whichever_form_its_input_shape_takes() -> None:
    """(64,) and (1, 8, 8) name the same 8×8 image: same layers, and with the same seed the same
    logits, for flat rows and images alike."""
    torch.manual_seed(3)
    flat = build_model("cnn", 64, 10)
    torch.manual_seed(3)
    image = build_model("cnn", (1, 8, 8), 10)
    assert {k: v.shape for k, v in flat.state_dict().items()} == {k: v.shape for k, v in image.state_dict().items()}
    x = torch.randn(4, 1, 8, 8)
    assert torch.equal(flat(x), image(x))
    assert torch.equal(flat(x.flatten(1)), image(x))


def test_the_cnn_takes_its_channels_from_the_shape() -> None:
    first_conv = next(m for m in cnn((3, 8, 8), 10).modules() if isinstance(m, torch.nn.Conv2d))
    assert first_conv.in_channels == 3


def test_logreg_is_one_linear_layer() -> None:
    params = list(build_model("logreg", 15, 2).parameters())
    assert [p.shape for p in params] == [torch.Size([2, 15]), torch.Size([2])]


def test_the_factories_still_take_a_feature_count() -> None:
    """benchmarks and experiments call the factories with an int (mlp(d, classes, hidden=…))."""
    assert mlp(15, 2, hidden=8)[1].weight.shape == (8, 15)
    assert input_shape(15) == (15,) and input_shape((1, 8, 8)) == (1, 8, 8)
    assert input_shape(np.int64(15)) == (15,) and input_shape(np.zeros((3, 1, 8, 8)).shape[1:]) == (1, 8, 8)


def test_every_built_in_is_listed_in_the_catalog() -> None:
    from fedprivacy.catalog import MODEL_NAMES

    assert tuple(MODELS) == MODEL_NAMES


@pytest.mark.parametrize("shape", [0, (), (1, 0, 8), (15.0,), True, (2, True)])
def test_bad_input_shapes_are_refused(shape) -> None:
    with pytest.raises(ValueError, match="input_shape"):
        build_model("mlp", shape, 2)


@pytest.mark.parametrize("classes", [1, 2.0, True])
def test_bad_class_counts_are_refused(classes) -> None:
    with pytest.raises(ValueError, match="num_classes"):
        build_model("mlp", 15, classes)


@pytest.mark.parametrize("shape", [15, (1, 6, 6), (8, 8), (1, 1, 8, 8)])
def test_the_cnn_needs_an_image_with_sides_divisible_by_four(shape) -> None:
    with pytest.raises(InputError, match=r"model='cnn': its factory fedprivacy\.models:cnn failed .*multiples of 4"):
        build_model("cnn", shape, 2)


def test_evaluation_in_pieces_is_the_whole_batch_mean() -> None:
    """`evaluate_model` goes `EVALUATION_ROWS` rows at a time: over 2,500 rows (three pieces, the
    last short) its loss and accuracy are those of one pass over all of them; an empty set is NaN."""
    from fedprivacy.data.types import Dataset
    from fedprivacy.models import EVALUATION_ROWS, evaluate_model

    generator = torch.Generator().manual_seed(0)
    rows = 2 * EVALUATION_ROWS + 452
    features = torch.rand(rows, 64, generator=generator)
    labels = torch.randint(0, 3, (rows,), generator=generator)
    dataset = Dataset(features.numpy(), labels.numpy(), tuple(f"x{i}" for i in range(64)), 3, "test")
    torch.manual_seed(1)
    model = build_model("cnn", 64, 3)
    with torch.no_grad():
        logits = model.eval()(features)
    loss, accuracy = evaluate_model(model, dataset)
    assert loss == pytest.approx(float(torch.nn.functional.cross_entropy(logits.double(), labels)), rel=1e-6)
    assert accuracy == float((logits.argmax(1) == labels).double().mean())
    empty = Dataset(features[:0].numpy(), labels[:0].numpy(), dataset.feature_names, 3, "empty")
    assert all(np.isnan(evaluate_model(model, empty)))
