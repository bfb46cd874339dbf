"""Users' models by name: `register_model` decorations and installed packages' entry points.

Entry points are installed the way pip leaves them, without pip: a `*.dist-info` folder (METADATA
and entry_points.txt) and the module it names, in a temporary folder put on sys.path.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from clients.app import app as client_app
from fedprivacy import model_registry
from fedprivacy.errors import InputError
from fedprivacy.models import build_model, register_model
from fedprivacy.recipe import new_model
from fedprivacy.runconfig import parse_run_config
from fedprivacy.training import UnsupportedLayerError
from server.app import app as server_app

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "custom_model"

TINY_NET = """
from torch import nn

def tiny_net(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(int(__import__("math").prod(input_shape)), num_classes))
"""


@pytest.fixture(autouse=True)
def no_decorations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no decorated models and leaves none behind."""
    monkeypatch.setattr(model_registry, "_decorated", {})


@pytest.fixture
def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Path]:
    """install(package, {entry name: target}, {module file: source}) as pip would, onto sys.path."""

    def make(package: str, entries: dict[str, str], modules: dict[str, str]) -> Path:
        site = tmp_path / "site"
        info = site / f"{package.replace('-', '_')}-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 1.0\n", encoding="utf-8")
        lines = "".join(f"{name} = {target}\n" for name, target in entries.items())
        (info / "entry_points.txt").write_text(f"[fedprivacy.models]\n{lines}", encoding="utf-8")
        for file, source in modules.items():
            (site / file).write_text(source, encoding="utf-8")
            monkeypatch.delitem(sys.modules, file.removesuffix(".py"), raising=False)  # forgotten afterwards
        monkeypatch.syspath_prepend(str(site))
        return site

    return make


def linear(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), num_classes))


# ---------------- decorations ----------------


def test_a_decorated_model_is_named_by_the_run_config_and_built_for_the_data() -> None:
    with pytest.raises(InputError, match="model='two-layer'"):
        parse_run_config({"model": "two-layer"})
    shapes = []

    @register_model("two-layer")
    def two_layer(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        shapes.append(input_shape)
        return nn.Sequential(
            nn.Flatten(), nn.Linear(int(np.prod(input_shape)), 5), nn.ReLU(), nn.Linear(5, num_classes)
        )

    settings = parse_run_config({"model": "two-layer"})
    assert settings.model == "two-layer"
    model = new_model(settings, np.zeros((7, 1, 8, 8), dtype=np.float32), 10)  # the client's call
    assert shapes[-1] == (1, 8, 8)  # one example's real shape, not a flattened count
    assert model(torch.zeros(3, 1, 8, 8)).shape == (3, 10)
    assert "two-layer" in model_registry.model_names()


@pytest.mark.filterwarnings("ignore:a noise seed")
def test_a_decorated_model_trains_in_a_federated_run(in_process, tmp_path: Path) -> None:
    """The apps, in process, take a registered name like a built-in one: a 2-round run completes."""
    register_model("flat-linear")(linear)
    config = {
        **in_process.defaults(),
        "model": "flat-linear",
        "num-server-rounds": 2,
        "noise-seed": 7,
        "results-dir": str(tmp_path / "results"),
    }
    in_process.run_server(server_app, in_process.Grid.simulation(client_app, 2, config), config)
    (folder,) = (tmp_path / "results").iterdir()
    assert json.loads((folder / "summary.json").read_text(encoding="utf-8"))["status"] == "completed"
    assert torch.load(folder / "model.pt")["1.weight"].shape == (10, 64)


def test_register_model_refuses_built_in_names_bad_names_and_a_second_function() -> None:
    with pytest.raises(ValueError, match="'cnn' is a built-in"):
        register_model("cnn")
    for bad in ("", "my model", "-x", "a:b"):
        with pytest.raises(ValueError, match="letters, digits"):
            register_model(bad)
    register_model("mine")(linear)
    register_model("mine")(linear)  # the same function again (a reloaded module): allowed

    def other(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        return linear(input_shape, num_classes)

    with pytest.raises(ValueError, match=r"'mine' is already registered to .*:linear"):
        register_model("mine")(other)


# ---------------- entry points ----------------


def test_an_installed_entry_point_is_found_by_name_and_built(install) -> None:
    install("tiny-models", {"tiny-net": "tiny_models:tiny_net"}, {"tiny_models.py": TINY_NET})
    assert "tiny-net" in model_registry.model_names()
    assert parse_run_config({"model": "tiny-net"}).model == "tiny-net"
    model = build_model("tiny-net", (1, 8, 8), 10)
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    assert model_registry.model_factory("tiny-net")[1] == "tiny_models:tiny_net"


def test_names_are_listed_and_checked_without_importing_the_target(install) -> None:
    install("loud-models", {"loud": "loud_models:factory"}, {"loud_models.py": "raise RuntimeError('imported')\n"})
    assert "loud" in model_registry.model_names()
    assert parse_run_config({"model": "loud"}).model == "loud"
    assert "loud_models" not in sys.modules
    with pytest.raises(InputError, match=r"model='loud': its entry point loud_models:factory cannot be imported: "):
        build_model("loud", 4, 2)


def test_the_cli_lists_installed_models_without_importing_them_or_torch(install) -> None:
    site = install("loud-models", {"loud": "loud_models:factory"}, {"loud_models.py": "raise RuntimeError('x')\n"})
    probe = (
        "import sys\n"
        "from fedprivacy.cli import main\n"
        "sys.argv = ['fedprivacy', 'sweep', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'loud_models') if m in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]), "COLUMNS": "240"}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env)
    assert "logreg, mlp, cnn, loud" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_the_sweep_flag_takes_an_installed_model_and_refuses_an_unknown_one(install, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from fedprivacy.cli import app

    install("tiny-models", {"tiny-net": "tiny_models:tiny_net"}, {"tiny_models.py": TINY_NET})
    flags = ["sweep", "--dataset", "digits", "--clients", "2", "--epsilons", "1,2", "--out", str(tmp_path / "out")]
    shown = CliRunner().invoke(app, [*flags, "--model", "tiny-net", "--dry-run"], env={"COLUMNS": "240"})
    assert shown.exit_code == 0 and "2 cells" in shown.stdout, shown.output
    refused = CliRunner().invoke(app, [*flags, "--model", "tiny-nett"])
    assert refused.exit_code == 2
    assert refused.output.startswith("error: model='tiny-nett': unknown model (did you mean 'tiny-net'?); ")
    assert len(refused.output.strip().splitlines()) == 1 and "tiny-net" in refused.output
    assert not (tmp_path / "out").exists()


def test_two_packages_giving_one_name_different_factories_are_refused(install, tmp_path: Path) -> None:
    install("tiny-models", {"tiny-net": "tiny_models:tiny_net"}, {"tiny_models.py": TINY_NET})
    other = tmp_path / "site" / "other_models-1.0.dist-info"
    other.mkdir()
    (other / "METADATA").write_text("Metadata-Version: 2.1\nName: other-models\nVersion: 1.0\n", encoding="utf-8")
    (other / "entry_points.txt").write_text("[fedprivacy.models]\ntiny-net = other:net\n", encoding="utf-8")
    with pytest.raises(
        InputError, match=r"different factories: other:net \(other-models\), tiny_models:tiny_net \(tiny-models\);"
    ):
        build_model("tiny-net", 4, 2)


# ---------------- what is refused, by name ----------------


@pytest.mark.parametrize("build", [lambda: build_model("resnet", 15, 2), lambda: parse_run_config({"model": "resnet"})])
def test_an_unknown_name_lists_the_known_ones_and_how_to_register(build) -> None:
    register_model("mine")(linear)
    with pytest.raises(InputError) as error:
        build()
    assert error.value.field == "model" and error.value.value == "resnet"
    message = str(error.value)
    assert "known models: logreg, mlp, cnn, mine;" in message
    assert "entry point in group 'fedprivacy.models'" in message and "register_model(" in message
    assert "\n" not in message


def test_a_name_is_never_read_as_an_import_path() -> None:
    for name in ("os:system", "fedprivacy.models:cnn", "tests.test_model_registry:linear"):
        with pytest.raises(InputError, match="unknown model"):
            parse_run_config({"model": name})


def test_a_factory_that_raises_is_named() -> None:
    @register_model("broken")
    def broken(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        raise ValueError("needs 3 channels")

    with pytest.raises(InputError) as error:
        build_model("broken", (1, 8, 8), 10)
    assert str(error.value).startswith("model='broken': its factory ")
    assert "test_model_registry:test_a_factory_that_raises_is_named.<locals>.broken failed for " in str(error.value)
    assert str(error.value).endswith("input_shape=(1, 8, 8), num_classes=10: ValueError: needs 3 channels")


def test_a_factory_that_returns_no_module_is_named() -> None:
    register_model("not-a-model")(lambda input_shape, num_classes: "a model")
    with pytest.raises(InputError, match="model='not-a-model': its factory .* returned a str, not a torch.nn.Module"):
        build_model("not-a-model", 4, 2)


def test_a_model_with_a_layer_the_trainer_cannot_clip_is_refused_by_name() -> None:
    @register_model("batch-normed")
    def batch_normed(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        return nn.Sequential(nn.Linear(input_shape[0], 8), nn.BatchNorm1d(8), nn.Linear(8, num_classes))

    with pytest.raises(UnsupportedLayerError, match=r"model='batch-normed' \(factory .*\): layer '1' \(BatchNorm1d\)"):
        build_model("batch-normed", 4, 2)


def test_a_model_that_ignores_its_arguments_is_refused_by_name() -> None:
    register_model("three-classes")(lambda input_shape, num_classes: nn.Linear(input_shape[0], 3))
    with pytest.raises(InputError, match=r"gives \(2, 3\) for 2 examples; need \(2, 10\)"):
        build_model("three-classes", 4, 10)
    register_model("wrong-width")(lambda input_shape, num_classes: nn.Linear(5, num_classes))
    with pytest.raises(InputError, match=r"model='wrong-width': the model from .* cannot take a batch of input_shape"):
        build_model("wrong-width", 4, 10)


# ---------------- the example package ----------------


def test_the_example_package_declares_its_factory_as_an_entry_point(install, monkeypatch) -> None:
    """examples/custom_model installed (its pyproject's entry point, its source on the path):
    gn-cnn is found by name and gives one logit per class for flat rows and images."""
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    entries = project["entry-points"]["fedprivacy.models"]
    assert project["dependencies"] == []
    install(project["name"], entries, {})
    monkeypatch.syspath_prepend(str(EXAMPLE / "src"))
    factory, target = model_registry.model_factory("gn-cnn")
    assert target == "fedprivacy_gn_cnn.models:gn_cnn"
    for shape in ((64,), (1, 8, 8), (3, 16, 16), (3, 6, 5)):
        model = factory(shape, 10)
        assert sum(isinstance(m, nn.GroupNorm) for m in model.modules()) == 2
        assert model(torch.randn(4, *shape)).shape == (4, 10)
    assert factory((3, 16, 16), 10)(torch.randn(4, 3 * 16 * 16)).shape == (4, 10)  # flat rows of an image too
    for bad in ((15,), (1, 3, 8), (8, 8)):
        with pytest.raises(ValueError, match=f"input_shape={re.escape(str(bad))}: gn-cnn needs"):
            factory(bad, 10)


def test_the_example_scenario_names_the_installed_model(install) -> None:
    from harness import load_scenario

    from sims.sweep.grid import cells

    scenario = EXAMPLE / "scenario.toml"
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    with pytest.raises(InputError, match="model='gn-cnn': unknown model"):
        cells(load_scenario(scenario))
    install(project["name"], project["entry-points"]["fedprivacy.models"], {})
    found = cells(load_scenario(scenario))
    assert len(found) == 10 and {cell.run_config["model"] for cell in found} == {"gn-cnn"}


def test_the_example_model_is_clipped_per_example_as_the_definition_says(install, monkeypatch) -> None:
    """gn-cnn built by name through build_model: the trainer's clipped sum equals per-example
    gradients from torch.func (each example alone through the model), clipped to C and summed."""
    from torch.func import functional_call, grad, vmap

    from fedprivacy.training import PerExampleClipper

    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    install(project["name"], project["entry-points"]["fedprivacy.models"], {})
    monkeypatch.syspath_prepend(str(EXAMPLE / "src"))
    torch.manual_seed(0)
    model = build_model("gn-cnn", (1, 8, 8), 10)
    x, y = torch.randn(6, 1, 8, 8), torch.randint(0, 10, (6,))
    clipper = PerExampleClipper(model)
    names = {id(p): n for n, p in model.named_parameters()}
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(weights: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, weights, (xi[None],)), yi[None])

    per_example = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    norms = torch.sqrt(sum(g.flatten(1).double().square().sum(1) for g in per_example.values()))
    clip = float(norms.median())  # some examples are clipped, some are not
    weights = (clip / norms).clamp(max=1.0)
    batch = clipper.clipped_sum(x, y, clip)
    assert torch.allclose(batch.sq_norms.sqrt(), norms, rtol=1e-4)
    for parameter, summed in zip(clipper.parameters, batch.grad_sums, strict=True):
        g = per_example[names[id(parameter)]].double()
        expected = (weights.view(-1, *[1] * (g.dim() - 1)) * g).sum(0)
        assert torch.allclose(summed.double(), expected, atol=1e-5), names[id(parameter)]


def test_a_model_that_mixes_the_examples_of_its_batch_is_refused_by_name() -> None:
    """Centring on the batch mean makes each example's logits depend on the others: clipping each
    example's own gradient would not bound its influence, so the model is refused when built."""

    class Centred(nn.Module):
        def __init__(self, features: int, classes: int) -> None:
            super().__init__()
            self.lin = nn.Linear(features, classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x - x.mean(0, keepdim=True))

    @register_model("centred")
    def centred(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        return Centred(int(np.prod(input_shape)), num_classes)

    with pytest.raises(UnsupportedLayerError, match="model='centred'.*mixes the examples of a batch"):
        build_model("centred", (6,), 3)
    build_model("mlp", (6,), 3)  # a model that computes every example alone passes the probe
