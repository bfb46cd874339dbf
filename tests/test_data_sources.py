"""Bring-your-own-data sources (npz, Hugging Face datasets on disk and parquet, CIFAR-10 batches) and
the registry that names every source: files the tests write in each format load by name with the
arrays they were written from, partition naturally by their client column, refuse bad files and
options by name, and a pickle that would run code is refused without running it."""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import os
import pickle
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest
from PIL import Image

from fedprivacy.catalog import DATASETS, FILE_DATASETS, PATH_DATASETS
from fedprivacy.data import load_clients, load_dataset
from fedprivacy.data.docs import with_tables
from fedprivacy.data.registry import sources
from fedprivacy.errors import InputError
from fedprivacy.recipe import data_file_missing, dataset_identity, partition_kwargs, partitioning_of, require_data_file
from fedprivacy.runconfig import parse_node_config, parse_run_config
from fedprivacy.runconfig_keys import RUN_KEYS

ROOT = Path(__file__).resolve().parents[1]
RNG_SEED = 20240601


@contextlib.contextmanager
def refused(field: str, match: str) -> Iterator[None]:
    """An InputError on `field` whose message matches `match`."""
    with pytest.raises(InputError, match=match) as info:
        yield
    assert info.value.field == field, f"field {info.value.field!r}, expected {field!r}"


# --- the registry ------------------------------------------------------------------------------


def test_the_catalog_names_are_the_registry():
    assert tuple(sources()) == DATASETS
    assert tuple(s.name for s in sources().values() if s.reads is not None) == PATH_DATASETS
    assert tuple(s.name for s in sources().values() if s.deployable) == FILE_DATASETS


def test_every_source_takes_a_path_first_and_its_run_keys_are_data_keys():
    data_keys = {key.name for key in RUN_KEYS if key.group == "data"}
    for source in sources().values():
        assert next(iter(inspect.signature(source.loader).parameters)) == "path", source.name
        for option in source.options:
            assert option.run_key is None or option.run_key in data_keys, (source.name, option)


def test_docs_data_md_holds_the_rendered_tables():
    text = (ROOT / "docs" / "data.md").read_text(encoding="utf-8")
    assert with_tables(text) == text, (
        "docs/data.md's tables are out of date: run python -m fedprivacy.data.docs docs/data.md"
    )


def test_a_source_must_describe_exactly_its_loaders_options():
    from fedprivacy.data.registry import Source

    def loader(path: Path | None = None, colour: bool = False) -> Any:
        raise AssertionError("never called")

    with pytest.raises(ValueError, match="option_help must describe exactly"):
        Source("x", "x", loader, None, "nothing", option_help={})
    with pytest.raises(ValueError, match=r"\['client_column'\] are not options"):
        Source("x", "x", loader, None, "nothing", option_help={"colour": "c"}, client_option="client_column")


def test_an_unknown_source_or_option_is_refused_with_the_choices():
    with refused("dataset", "must be one of: digits, pums, csv, synthetic, npz, hf, cifar10"):
        load_dataset("mnist")
    with refused("option", r"\['label'\].*the npz dataset accepts: num_classes$"):
        load_dataset("npz", "/nowhere.npz", label="y")


def test_a_deployed_node_still_reads_only_csv_or_pums():
    node = {"client-id": "a", "data-path": "/x.npz", "epsilon": 1, "delta": 1e-6, "public-size": 100}
    with refused("dataset", "must be one of: pums, csv"):
        parse_node_config({**node, "dataset": "npz"})


# --- npz ---------------------------------------------------------------------------------------


def write_npz(folder: Path, n: int = 60, shape: tuple[int, ...] = (1, 8, 8), clients: int | None = 3, **extra: Any):
    """Images (or rows) whose pixel [0, 0, 0] is the example's index, labels i % 4, clients i % k."""
    rng = np.random.default_rng(RNG_SEED)
    features = rng.random((n, *shape)).astype(np.float64)
    features.reshape(n, -1)[:, 0] = np.arange(n)
    arrays = {"features": features, "labels": np.arange(n) % 4, **extra}
    if clients is not None:
        arrays["client_ids"] = np.array([f"site{i % clients}" for i in range(n)])
    path = folder / "data.npz"
    np.savez(path, **arrays)
    return path, arrays


def test_npz_loads_images_labels_and_client_ids_as_written(tmp_path):
    path, arrays = write_npz(tmp_path)
    data = load_dataset("npz", path, num_classes=4)
    assert data.features.dtype == np.float32 and data.features.shape == (60, 1, 8, 8)
    np.testing.assert_array_equal(data.features, arrays["features"].astype(np.float32))
    assert data.labels.dtype == np.int64 and data.labels.tolist() == (np.arange(60) % 4).tolist()
    assert data.num_classes == 4 and len(data.feature_names) == 64
    assert data.groups.tolist() == arrays["client_ids"].tolist() and data.group_name == "client_ids"


def test_npz_rows_without_client_ids(tmp_path):
    path, arrays = write_npz(tmp_path, n=30, shape=(5,), clients=None)
    data = load_dataset("npz", path, num_classes=4)
    assert data.features.shape == (30, 5) and data.groups is None
    assert data.feature_names == ("x0", "x1", "x2", "x3", "x4")


def test_npz_natural_partition_gives_one_client_per_client_id(tmp_path):
    path, _ = write_npz(tmp_path, n=60, clients=3)
    clients = load_clients("npz", path, scheme="natural", by="client_ids", test_fraction=0.25, num_classes=4)
    assert [c.client_id for c in clients] == ["site0", "site1", "site2"]
    for k, client in enumerate(clients):
        rows = np.concatenate([client.train.features[:, 0, 0, 0], client.test.features[:, 0, 0, 0]]).astype(int)
        assert sorted(rows.tolist()) == list(range(k, 60, 3))  # pixel [0, 0, 0] is the row index
        assert len(client.test) == 5 and set(client.train.groups) == {f"site{k}"}
    with refused("partition-by", "loaded with client column 'client_ids'"):
        load_clients("npz", path, scheme="natural", by="writer", num_classes=4)


@pytest.mark.parametrize(
    ("arrays", "field", "match"),
    [
        ({"features": np.zeros((4, 2))}, "data", "holds features; a .npz data set holds features, labels"),
        ({"features": np.zeros((4, 2)), "labels": np.arange(4) % 2, "client_id": np.arange(4)}, "data", "client_id"),
        ({"features": np.array(["a", "b"]), "labels": np.arange(2)}, "features", "must be real numbers"),
        ({"features": np.array([[0.0], [np.nan], [1.0]]), "labels": np.arange(3) % 2}, "features", "NaN or infinite"),
        ({"features": np.array([[0.0], [1e300]]), "labels": np.arange(2)}, "features", "example 1.*as float32"),
        ({"features": np.zeros((1, 3)), "labels": np.arange(1)}, "features", "at least 2 examples"),
        ({"features": np.zeros((4, 2)), "labels": np.arange(4) / 2}, "labels", "must be integers"),
        (
            {"features": np.zeros((4, 2)), "labels": np.arange(3)},
            "labels",
            r"one integer label per example, shape \[4\]",
        ),
        ({"features": np.zeros((4, 2)), "labels": np.array([0, 1, -1, 0])}, "labels", "example 2's label is outside"),
        ({"features": np.zeros((4, 2)), "labels": np.array([0, 1, 2, 0])}, "labels", r"2's label is outside \[0, 2\)"),
        (
            {"features": np.zeros((4, 2)), "labels": np.arange(4) % 2, "client_ids": np.array([1.0, np.nan, 1, 1])},
            "client_ids",
            "example 1.*client id is missing",
        ),
    ],
)
def test_npz_bad_arrays_are_refused_by_name(tmp_path, arrays, field, match):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with refused(field, match):
        load_dataset("npz", path, num_classes=2)


def test_npz_an_object_array_is_refused_without_unpickling(tmp_path):
    path = tmp_path / "objects.npz"
    np.savez(path, features=np.array([{"a": 1}, {"b": 2}], dtype=object), labels=np.arange(2))
    with refused("data", "object array, which only pickle can read"):
        load_dataset("npz", path)


def test_npz_a_file_that_is_not_an_archive_is_refused(tmp_path):
    (tmp_path / "text.npz").write_text("features,labels\n1,0\n")
    with refused("data", "is not a .npz file"):
        load_dataset("npz", tmp_path / "text.npz")
    (tmp_path / "cut.npz").write_bytes(b"PK\x03\x04 and then nothing")
    with refused("data", "not a readable .npz file"):
        load_dataset("npz", tmp_path / "cut.npz")
    np.save(tmp_path / "one.npy", np.zeros((3, 2)))
    with refused("data", "single .npy array"):
        load_dataset("npz", tmp_path / "one.npy")
    with refused("path", "needs path=<a .npz file>"):
        load_dataset("npz", tmp_path / "missing.npz")


def test_npz_an_edited_file_is_read_again(tmp_path):
    path, _ = write_npz(tmp_path, n=30)
    first = load_dataset("npz", path, num_classes=4)
    assert load_dataset("npz", path, num_classes=4) is first
    write_npz(tmp_path, n=40)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert len(load_dataset("npz", path, num_classes=4)) == 40


def test_npz_the_number_of_classes_is_declared_and_no_record_changes_it(tmp_path):
    """K is the declared count, whatever the labels hold: without the only example of the largest
    label it stays, and an example with a label beyond it refuses the file instead of widening K."""
    path, arrays = write_npz(tmp_path, n=12)  # labels i % 4
    with refused("num-classes", "must be declared, not read from the labels"):
        load_dataset("npz", path)
    for bad in (1, 1001, 2.5, True):
        with refused("num-classes", "must be an integer from 2 to 1000"):
            load_dataset("npz", path, num_classes=bad)
    assert load_dataset("npz", path, num_classes=6).num_classes == 6
    without = tmp_path / "without.npz"
    np.savez(without, features=arrays["features"][:-1], labels=np.arange(11) % 4 % 3)  # no label 3 left
    assert load_dataset("npz", without, num_classes=6).num_classes == 6
    added = tmp_path / "added.npz"
    np.savez(added, features=arrays["features"], labels=np.append(np.arange(11) % 4, 6))
    with refused("labels", r"example 11's label is outside \[0, 6\), the declared classes"):
        load_dataset("npz", added, num_classes=6)


# --- Hugging Face datasets ---------------------------------------------------------------------


def images_and_labels(n: int, mode: str = "L", size: int = 8) -> tuple[np.ndarray, list[Image.Image], np.ndarray]:
    """uint8 pixels [n, H, W(, C)], the same as PIL images, and labels in 0..2 (class 3 never used)."""
    rng = np.random.default_rng(RNG_SEED)
    shape = (n, size, size) if mode == "L" else (n, size, size, len(mode))
    pixels = rng.integers(0, 256, size=shape, dtype=np.uint8)
    return pixels, [Image.fromarray(p, mode=mode) for p in pixels], np.arange(n) % 3


def hf_table(n: int, mode: str = "L", image: str = "image", start: int = 0) -> tuple[datasets.Dataset, np.ndarray]:
    pixels, pictures, labels = images_and_labels(n, mode)
    features = datasets.Features(
        {image: datasets.Image(), "label": datasets.ClassLabel(num_classes=4), "writer": datasets.Value("string")}
    )
    writers = [f"w{(start + i) % 4}" for i in range(n)]
    table = datasets.Dataset.from_dict({image: pictures, "label": labels, "writer": writers}, features=features)
    return table, pixels


def expected_images(pixels: np.ndarray) -> np.ndarray:
    """[n, C, H, W] in [0, 1], computed from the pixels the images were made from."""
    channels = pixels[:, None] if pixels.ndim == 3 else pixels.transpose(0, 3, 1, 2)
    return channels.astype(np.float32) / 255


@pytest.fixture
def saved_dict(tmp_path) -> tuple[Path, np.ndarray, np.ndarray]:
    """A DatasetDict saved to disk: train (40 images) and test (12), 8×8 grey, 4 writers."""
    train, train_pixels = hf_table(40)
    test, _ = hf_table(12, start=40)
    test_pixels = images_and_labels(12)[0]
    folder = tmp_path / "femnist-like"
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(folder))
    return folder, train_pixels, test_pixels


def test_hf_saved_dict_pools_its_splits_train_first(saved_dict):
    folder, train_pixels, test_pixels = saved_dict
    data = load_dataset("hf", folder)
    assert data.features.dtype == np.float32 and data.features.shape == (52, 1, 8, 8)
    np.testing.assert_array_equal(data.features, expected_images(np.concatenate([train_pixels, test_pixels])))
    assert data.labels.dtype == np.int64
    assert data.labels.tolist() == [i % 3 for i in range(40)] + [i % 3 for i in range(12)]
    assert data.num_classes == 4  # the ClassLabel's, though class 3 never occurs
    test = load_dataset("hf", folder, split="test")
    np.testing.assert_array_equal(test.features, expected_images(test_pixels))


def test_hf_natural_partition_by_writer(saved_dict):
    folder, _, _ = saved_dict
    clients = load_clients("hf", folder, scheme="natural", by="writer")
    assert [c.client_id for c in clients] == ["w0", "w1", "w2", "w3"]
    assert sum(len(c.train) + len(c.test) for c in clients) == 52
    assert all(set(c.train.groups) | set(c.test.groups) == {c.client_id} for c in clients)
    assert [len(c.train) + len(c.test) for c in clients] == [13, 13, 13, 13]


def test_hf_colour_images_default_to_the_img_column_channels_first(tmp_path):
    table, pixels = hf_table(10, mode="RGB", image="img")
    table.save_to_disk(str(tmp_path / "cifar-like"))
    data = load_dataset("hf", tmp_path / "cifar-like")
    assert data.features.shape == (10, 3, 8, 8)
    np.testing.assert_array_equal(data.features[:, 0], pixels[..., 0] / np.float32(255))  # channel 0 is red
    np.testing.assert_array_equal(data.features, expected_images(pixels))


def test_hf_parquet_file_and_folder_give_the_saved_arrays(tmp_path, saved_dict):
    folder, train_pixels, test_pixels = saved_dict
    splits = datasets.load_from_disk(str(folder))
    parquet = tmp_path / "parquet"
    parquet.mkdir()
    splits["train"].to_parquet(str(parquet / "train-00000-of-00001.parquet"))
    splits["test"].to_parquet(str(parquet / "test-00000-of-00001.parquet"))
    one = load_dataset("hf", parquet / "train-00000-of-00001.parquet")
    np.testing.assert_array_equal(one.features, expected_images(train_pixels))
    assert one.num_classes == 4  # the ClassLabel travels in the parquet schema
    both = load_dataset("hf", parquet)  # files in name order: test, then train
    np.testing.assert_array_equal(both.features, expected_images(np.concatenate([test_pixels, train_pixels])))
    clients = load_clients("hf", parquet, scheme="natural", by="writer")
    assert [c.client_id for c in clients] == ["w0", "w1", "w2", "w3"]


def test_hf_numeric_array_column_and_integer_labels(tmp_path):
    rows = np.arange(12, dtype=np.float64).reshape(6, 2)
    datasets.Dataset.from_dict({"x": rows.tolist(), "y": [0, 1, 2, 0, 1, 2]}).save_to_disk(str(tmp_path / "rows"))
    with refused("num-classes", "must be declared, not read from the labels"):
        load_dataset("hf", tmp_path / "rows", image_column="x", label="y")
    data = load_dataset("hf", tmp_path / "rows", image_column="x", label="y", num_classes=5)
    np.testing.assert_array_equal(data.features, rows.astype(np.float32))
    assert data.labels.tolist() == [0, 1, 2, 0, 1, 2] and data.num_classes == 5


def test_hf_a_class_label_declares_the_count_and_num_classes_may_only_agree(saved_dict):
    folder, _, _ = saved_dict  # label: a ClassLabel of 4 names
    assert load_dataset("hf", folder).num_classes == load_dataset("hf", folder, num_classes=4).num_classes == 4
    with refused("num-classes", "its label column label is a ClassLabel of 4 classes"):
        load_dataset("hf", folder, num_classes=5)


def test_hf_bad_folders_columns_and_images_are_refused_by_name(tmp_path, saved_dict):
    folder, _, _ = saved_dict
    with refused("image-column", "not a column of .*its columns are: image, label, writer"):
        load_dataset("hf", folder, image_column="pixels")
    with refused("label-column", "not a column"):
        load_dataset("hf", folder, label="character")
    with refused("partition-by", "not a column"):
        load_dataset("hf", folder, client_column="writer_id")
    with refused("data-split", "has splits: train, test"):
        load_dataset("hf", folder, split="validation")
    with refused("column writer", "labels must be integers"):
        load_dataset("hf", folder, label="writer")
    with refused("label-column", "cannot also be the image column"):
        load_dataset("hf", folder, label="image")
    single = tmp_path / "single"
    hf_table(4)[0].save_to_disk(str(single))
    with refused("data-split", "has no splits"):
        load_dataset("hf", single, split="train")
    (single / "state.json").write_text("{not json")
    with refused("data", "is not a readable save_to_disk folder"):
        load_dataset("hf", single)
    (tmp_path / "empty").mkdir()
    with refused("data", "not a Hugging Face data set on disk"):
        load_dataset("hf", tmp_path / "empty")
    with refused("image-column", "has no image or img column"):
        datasets.Dataset.from_dict({"x": [1, 2], "label": [0, 1]}).save_to_disk(str(tmp_path / "noimage"))
        load_dataset("hf", tmp_path / "noimage")


def test_hf_images_of_another_size_or_mode_are_refused(tmp_path):
    _, small, _ = images_and_labels(3, size=8)
    _, large, _ = images_and_labels(1, size=16)
    datasets.Dataset.from_dict(
        {"image": [*small, large[0]], "label": [0, 1, 0, 1]},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")}),
    ).save_to_disk(str(tmp_path / "sizes"))
    with refused("column image", "example 3.*same size and mode"):
        load_dataset("hf", tmp_path / "sizes")
    wide = Image.fromarray(np.zeros((8, 8), dtype=np.int32), mode="I")
    datasets.Dataset.from_dict(
        {"image": [wide, wide], "label": [0, 1]},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")}),
    ).save_to_disk(str(tmp_path / "modes"))
    with refused("column image", "mode I; images must be 8-bit L, RGB, RGBA"):
        load_dataset("hf", tmp_path / "modes")


# --- CIFAR-10 python batches -------------------------------------------------------------------


class Python2Pickler(pickle._Pickler):
    """Writes bytes with Python 2's str opcodes, as cPickle wrote the CIFAR-10 batches (a Python 3
    pickler at protocol 2 would call _codecs.encode instead, which those files never need)."""

    dispatch = dict(pickle._Pickler.dispatch)

    def save_bytes(self, obj: bytes) -> None:
        if len(obj) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(obj)]) + obj)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(obj)) + obj)
        self.memoize(obj)

    dispatch[bytes] = save_bytes


def python2_pickle(value: Any) -> bytes:
    """`value` pickled as Python 2 with NumPy 1 wrote it: NumPy's reconstruct under numpy.core."""
    buffer = io.BytesIO()
    Python2Pickler(buffer, protocol=2).dump(value)
    return buffer.getvalue().replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")


def write_cifar(folder: Path, per_batch: int = 6, python2: bool = True) -> dict[str, tuple[np.ndarray, list[int]]]:
    """A CIFAR-10 python folder with `per_batch` images per batch; returns each batch's (data, labels)."""
    folder.mkdir(parents=True, exist_ok=True)
    dump = python2_pickle if python2 else pickle.dumps
    rng = np.random.default_rng(RNG_SEED)
    written = {}
    for index, name in enumerate([*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]):
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        labels = [(index + i) % 10 for i in range(per_batch)]
        batch = {b"batch_label": name.encode(), b"labels": labels, b"data": data, b"filenames": [b"x.png"] * per_batch}
        (folder / name).write_bytes(dump(batch))
        written[name] = (data, labels)
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]
    meta = {b"num_cases_per_batch": per_batch, b"label_names": names, b"num_vis": 3072}
    (folder / "batches.meta").write_bytes(dump(meta))
    return written


@pytest.mark.parametrize("python2", [True, False], ids=["python2-numpy1-layout", "python3-pickle"])
def test_cifar10_batches_load_as_channel_first_images(tmp_path, python2):
    written = write_cifar(tmp_path / "cifar-10-batches-py", python2=python2)
    data = load_dataset("cifar10", tmp_path / "cifar-10-batches-py")
    order = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    raw = np.concatenate([written[name][0] for name in order])
    assert data.features.dtype == np.float32 and data.features.shape == (36, 3, 32, 32)
    assert data.labels.dtype == np.int64 and data.labels.tolist() == sum((written[n][1] for n in order), [])
    assert data.num_classes == 10
    for row, channel, y, x in [(0, 0, 0, 0), (7, 1, 5, 31), (35, 2, 31, 3)]:  # the layout: R, G, B planes, rows
        assert data.features[row, channel, y, x] == np.float32(raw[row, 1024 * channel + 32 * y + x]) / 255
    assert len(load_dataset("cifar10", tmp_path / "cifar-10-batches-py", split="train")) == 30
    test = load_dataset("cifar10", tmp_path / "cifar-10-batches-py", split="test")
    np.testing.assert_array_equal(test.features.reshape(6, 3072) * 255, written["test_batch"][0].astype(np.float32))


class RunsACommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


class Evaluates:
    def __reduce__(self) -> tuple[Any, ...]:
        return (eval, ("__import__('os').getpid()",))


@pytest.mark.parametrize("python2", [True, False], ids=["protocol2", "protocol4"])
def test_cifar10_a_pickle_that_calls_os_system_is_refused_without_running(tmp_path, python2):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar(folder)
    marker = tmp_path / "ran"
    dump = python2_pickle if python2 else pickle.dumps
    (folder / "data_batch_3").write_bytes(dump({b"data": RunsACommand(marker), b"labels": [0]}))
    with refused("data", r"data_batch_3.*calls posix\.system, which a CIFAR-10 batch never needs.*without running"):
        load_dataset("cifar10", folder)
    assert not marker.exists()
    (folder / "data_batch_3").write_bytes(dump(Evaluates()))
    with refused("data", r"calls (__builtin__|builtins)\.eval"):  # protocol 2 writes Python 2's name
        load_dataset("cifar10", folder)
    # a module that is not even installed: refused by its name, never imported
    (folder / "data_batch_3").write_bytes(b"cfedprivacy_no_such_module\nrun\n(tR.")
    with refused("data", r"calls fedprivacy_no_such_module\.run"):
        load_dataset("cifar10", folder)


@pytest.mark.parametrize(
    ("damage", "field", "match"),
    [
        (lambda f: (f / "data_batch_4").unlink(), "data", "has no data_batch_4: a CIFAR-10 python folder holds"),
        (lambda f: (f / "batches.meta").unlink(), "data", "has no batches.meta"),
        (lambda f: (f / "test_batch").write_bytes(b"not a pickle"), "data", "is not readable as a CIFAR-10 batch"),
        (
            lambda f: (f / "test_batch").write_bytes(pickle.dumps({b"data": np.zeros((2, 3072)), b"labels": [0, 1]})),
            "data",
            r"its b'data' is float64 \[2, 3072\]; CIFAR-10 batches hold uint8",
        ),
        (
            lambda f: (f / "test_batch").write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8)})),
            "data",
            "needs a dict with key b'labels'",
        ),
        (
            lambda f: (f / "test_batch").write_bytes(
                pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]})
            ),
            "data",
            "must be 2 integers",
        ),
        (
            lambda f: (f / "test_batch").write_bytes(
                pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]})
            ),
            "labels",
            r"example 31's label is outside \[0, 10\), the declared classes",
        ),
    ],
)
def test_cifar10_bad_folders_are_refused_by_name(tmp_path, damage, field, match):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar(folder)
    damage(folder)
    with refused(field, match):
        load_dataset("cifar10", folder)


def test_cifar10_refuses_an_unknown_split_and_a_file(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar(folder)
    with refused("split", "must be one of: train, test"):
        load_dataset("cifar10", folder, split="validation")
    with refused("path", "needs path=<the cifar-10-batches-py folder>"):
        load_dataset("cifar10", folder / "test_batch")


# --- the run config ----------------------------------------------------------------------------


def test_the_run_config_sets_the_hf_options_and_pins_the_split(tmp_path, saved_dict):
    folder, _, _ = saved_dict
    config = {
        "dataset": "hf",
        "data-path": str(folder),
        "image-column": "image",
        "data-split": "train",
        "partition-by": "writer",
    }
    settings = parse_run_config(config)
    kwargs = partition_kwargs(settings, 4)
    assert kwargs["image_column"] == "image" and kwargs["split"] == "train"
    assert "label" not in kwargs  # label-column '' leaves the loader's default, `label`
    pinned = partitioning_of(settings, 4)
    assert pinned["split"] == "train" and "image_column" not in pinned  # the column encodes rows; the split picks them
    clients = load_clients(**kwargs)
    assert sum(len(c.train) + len(c.test) for c in clients) == 40


def test_a_folder_source_needs_a_folder_and_is_identified_by_its_content(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar(folder)
    settings = parse_run_config({"dataset": "cifar10", "data-path": str(folder)})
    assert not data_file_missing(settings)
    identity = dataset_identity(settings)
    assert identity.startswith("folder:")
    (folder / "readme.html").write_text("CIFAR-10")
    assert dataset_identity(settings) != identity  # any change to the folder is other records
    as_file = parse_run_config({"dataset": "cifar10", "data-path": str(folder / "test_batch")})
    with refused("data-path", "dataset 'cifar10' needs the cifar-10-batches-py folder: in a simulation"):
        require_data_file(as_file)
    npz = parse_run_config({"dataset": "npz", "data-path": str(tmp_path / "missing.npz")})
    with refused("data-path", "no such file or folder; dataset 'npz' needs a .npz file"):
        require_data_file(npz)


def test_num_classes_is_set_by_the_run_config_and_is_not_part_of_the_accounts(tmp_path):
    """The run key reaches the loader; changing it changes no account (the same records under
    another declared count spend from one budget), and leaving it unset refuses the simulation."""
    path, _ = write_npz(tmp_path, n=60, clients=3)
    base = {"dataset": "npz", "data-path": str(path), "partition-by": "client_ids"}
    four, six = (parse_run_config({**base, "num-classes": k}) for k in (4, 6))
    assert partition_kwargs(four, 3)["num_classes"] == 4
    assert [c.train.num_classes for c in load_clients(**partition_kwargs(six, 3))] == [6, 6, 6]
    assert partitioning_of(four, 3) == partitioning_of(six, 3) and "num_classes" not in partitioning_of(four, 3)
    assert dataset_identity(four) == dataset_identity(six)
    unset = parse_run_config(base)
    assert unset.num_classes is None and "num_classes" not in partition_kwargs(unset, 3)
    with refused("num-classes", "Set num-classes in the run config"):
        load_clients(**partition_kwargs(unset, 3))
    for bad in (1, 1001, 2.5, "4", True):
        with refused("num-classes", "must be an integer from 2 to 1000"):
            parse_run_config({**base, "num-classes": bad})


def test_feature_columns_are_set_by_the_run_config_and_are_not_part_of_the_accounts(tmp_path):
    path = tmp_path / "clinic.csv"
    path.write_text("site,x1,note,x2,y\n" + "".join(f"s{i % 2},{i},text,{i % 3},{i % 2}\n" for i in range(20)))
    base = {"dataset": "csv", "data-path": str(path), "label-column": "y", "num-classes": 2, "partition-by": "site"}
    chosen = parse_run_config({**base, "feature-columns": " x1, x2"})
    assert chosen.feature_columns == ("x1", "x2") and partition_kwargs(chosen, 2)["features"] == ("x1", "x2")
    assert [c.train.features.shape[1] for c in load_clients(**partition_kwargs(chosen, 2))] == [2, 2]
    unset = parse_run_config(base)
    assert "features" not in partition_kwargs(unset, 2) and partitioning_of(unset, 2) == partitioning_of(chosen, 2)
    with refused("column note", "name the feature columns"):
        load_clients(**partition_kwargs(unset, 2))
    for bad in ("x1,,x2", "x1,x1", 3):
        with refused("feature-columns", "comma-separated list of distinct column names"):
            parse_run_config({**base, "feature-columns": bad})


def test_a_data_key_the_data_set_does_not_read_is_said_to_be_ignored(tmp_path):
    from fedprivacy.recipe import unused_data_keys
    from sims.fast.engine import run_fast

    digits = {"dataset": "digits", "num-classes": 5, "feature-columns": "a,b", "label-column": "y"}
    assert unused_data_keys(parse_run_config(digits)) == (
        "run config feature-columns=('a', 'b') label-column=y num-classes=5 ignored: dataset digits does not read it"
    )
    assert unused_data_keys(parse_run_config({"dataset": "digits", "num-server-rounds": 3})) is None
    assert unused_data_keys(parse_run_config({"dataset": "npz", "num-classes": 5})) is None  # npz reads it
    said = []
    config = {"dataset": "synthetic", "num-classes": 3, "num-server-rounds": 1, "results-dir": str(tmp_path)}
    run_fast(config, 2, say=said.append)
    assert "run config num-classes=3 ignored: dataset synthetic does not read it" in said


@pytest.mark.parametrize("key", ["image-column", "data-split"])
def test_the_new_run_keys_take_strings_only(key):
    with refused(key, "must be a string"):
        parse_run_config({key: 3})


def test_pyproject_declares_the_new_keys_beside_label_column():
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert 'label-column = ""\nfeature-columns = ""\nimage-column = ""\ndata-split = ""\nnum-classes = 0\n' in text


# --- end to end --------------------------------------------------------------------------------


def test_an_npz_image_data_set_trains_the_cnn_for_two_rounds_on_the_fast_engine(tmp_path):
    """Digits saved as an npz of 8×8 one-channel images with three natural clients, through the fast
    engine: two rounds with the built-in CNN, every client trained, accuracy above chance."""
    from sklearn.datasets import load_digits

    from sims.fast.engine import run_fast

    digits = load_digits()
    images = (digits.images[:600] / 16.0).reshape(-1, 1, 8, 8)
    path = tmp_path / "digits.npz"
    np.savez(path, features=images, labels=digits.target[:600], client_ids=np.arange(600) % 3)
    config = {
        "dataset": "npz",
        "data-path": str(path),
        "partition-by": "client_ids",
        "num-classes": 10,
        "model": "cnn",
        "num-server-rounds": 2,
        "rule": "calibrated",
        "epsilon": 50.0,  # little noise: two rounds must show that the images reach the CNN intact
        "epochs": 8.0,
        "learning-rate": 2.0,
        "results-dir": str(tmp_path / "results"),
        "noise-seed": 3,
    }
    folder, _ = run_fast(config, 3, say=lambda _: None)
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["status"] == "completed"
    rounds = [line.split(",") for line in (folder / "rounds.csv").read_text().splitlines()]
    header, rows = rounds[0], rounds[1:]
    assert [int(r[header.index("round")]) for r in rows if r[header.index("round")]][-2:] == [1, 2]
    assert int(rows[-1][header.index("clients_trained")]) == 3
    assert float(rows[-1][header.index("accuracy")]) > 0.3  # ten classes: chance is 0.1 (this seed: 0.63)


def test_a_sweep_counts_natural_clients_per_data_split(tmp_path):
    """Writers that appear only in the published test split are clients only when that split is
    read: a sweep over `data-split` counts the natural clients of each split, not the first one's."""
    from harness import load_scenario

    from sims.sweep.grid import cells

    train, _ = hf_table(40)  # writers w0..w3
    test, _ = hf_table(10, start=0)
    test = test.map(lambda row: {"writer": "w9"})  # a writer of the test split only
    folder = tmp_path / "writers"
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(folder))
    scenario = tmp_path / "split.toml"
    scenario.write_text(
        f'[run]\ndataset = "hf"\ndata-path = "{folder}"\npartition-by = "writer"\n[grid]\ndata-split = ["", "train"]\n',
        encoding="utf-8",
    )
    counts = {cell.params["data-split"]: cell.num_clients for cell in cells(load_scenario(scenario))}
    assert counts == {"": 5, "train": 4}


def test_cifar10_labels_that_would_expand_in_memory_are_refused_before_conversion(tmp_path):
    """A pickle's memo lets b'labels' be n references to one large bytes object for a few bytes of
    file: converting it to an array would ask for n times its size. It is refused on its type first."""
    import tracemalloc

    folder = tmp_path / "cifar-10-batches-py"
    write_cifar(folder)
    big = b"x" * 1_000_000
    batch = {b"data": np.zeros((50, 3072), np.uint8), b"labels": [big] * 50}  # one object, 50 references
    (folder / "test_batch").write_bytes(pickle.dumps(batch))
    assert (folder / "test_batch").stat().st_size < 1_300_000
    tracemalloc.start()
    try:
        with refused("data", "must be 50 integers"):
            load_dataset("cifar10", folder)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20_000_000  # the file and its one bytes object, not 50 MB of labels
