"""Files that declare far more than they hold (a zip bomb, a .npy header asking for terabytes, a
parquet of huge images, a label beyond any integer type) are refused with one line that names the
file and the limit, in bounded memory: before the data is inflated or decoded."""

from __future__ import annotations

import io
import pickle
import tracemalloc
import zipfile
from pathlib import Path

import datasets
import numpy as np
import pytest
from PIL import Image

from fedprivacy.data import load_dataset
from fedprivacy.data.limits import DEFAULT_MAX_LOAD_BYTES, MAX_LOAD_BYTES_VARIABLE, max_load_bytes
from fedprivacy.errors import InputError

LIMIT = 16 * 2**20  # what these tests allow a load to take
HEADROOM = 8 * 2**20  # what a refusal may allocate on the way (headers, metadata, the file's own bytes)


@pytest.fixture(autouse=True)
def small_limit(monkeypatch):
    monkeypatch.setenv(MAX_LOAD_BYTES_VARIABLE, str(LIMIT))


def _refused_within(load, *needles: str) -> InputError:
    """The load's error, checked to be one line naming `needles`, and its peak traced allocation."""
    tracemalloc.start()
    try:
        with pytest.raises(InputError) as refused:
            load()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(refused.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message
    assert peak < HEADROOM, f"the refusal allocated {peak / 2**20:.1f} MiB"
    return refused.value


def _npy(array_header: dict, data: bytes) -> bytes:
    """A .npy member: a version 1.0 header (any shape it likes) followed by `data`."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, array_header)
    return buffer.getvalue() + data


def test_a_zip_bomb_npz_is_refused_before_it_inflates(tmp_path):
    """64 MiB of zeros deflate to about 64 KiB: the headers say what the arrays will take."""
    file = tmp_path / "bomb.npz"
    rows = 64 * 2**20 // (8 * 64)
    with zipfile.ZipFile(file, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        with archive.open("features.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array(member, np.zeros((rows, 64)))
        archive.writestr(
            "labels.npy", _npy({"descr": "<i8", "fortran_order": False, "shape": (rows,)}, bytes(8 * rows))
        )
    assert file.stat().st_size < 2**20
    _refused_within(lambda: load_dataset("npz", file, num_classes=2), str(file), "16.0 MiB", MAX_LOAD_BYTES_VARIABLE)


def test_a_npy_header_declaring_terabytes_is_refused_naming_the_array(tmp_path):
    file = tmp_path / "liar.npz"
    eight_tib = {"descr": "<f8", "fortran_order": False, "shape": (2**40, 1)}
    with zipfile.ZipFile(file, "w") as archive:
        archive.writestr("features.npy", _npy(eight_tib, bytes(64)))
        archive.writestr("labels.npy", _npy({"descr": "<i8", "fortran_order": False, "shape": (8,)}, bytes(64)))
    error = _refused_within(lambda: load_dataset("npz", file, num_classes=2), str(file), "features.npy")
    assert "holds 192 bytes" in str(error)  # its 128-byte header and 64 bytes of data


def test_an_honest_npz_within_the_limit_still_loads(tmp_path):
    file = tmp_path / "fine.npz"
    np.savez(file, features=np.ones((100, 5)), labels=np.arange(100) % 2)
    data = load_dataset("npz", file, num_classes=2)
    assert data.features.shape == (100, 5)


def _png(side: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (side, side)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_parquet_of_huge_images_is_refused_before_any_is_decoded(tmp_path):
    """30 PNGs of 3,000² (27 MB each once decoded) in a file of a few hundred KiB."""
    png = _png(3000)
    table = datasets.Dataset.from_dict(
        {"image": [{"bytes": png, "path": None}] * 30, "label": [0, 1] * 15},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=2)}),
    )
    file = tmp_path / "images.parquet"
    table.to_parquet(str(file))
    assert file.stat().st_size < 2**20
    _refused_within(lambda: load_dataset("hf", file), "30 images of 3000×3000", "16.0 MiB")


def test_a_parquet_whose_columns_inflate_past_the_limit_is_refused(tmp_path):
    """Its metadata declares the decompressed size: 32 MiB of zeros in a file of a few KiB."""
    table = datasets.Dataset.from_dict(
        {"image": [np.zeros(2**15, dtype=np.float32)] * 256, "label": [0, 1] * 128},
        features=datasets.Features(
            {"image": datasets.Sequence(datasets.Value("float32")), "label": datasets.ClassLabel(num_classes=2)}
        ),
    )
    file = tmp_path / "columns.parquet"
    table.to_parquet(str(file))
    with pytest.raises(InputError, match="parquet columns decompressed would take"):
        load_dataset("hf", file)


def _cifar_folder(folder: Path, labels: list[int]) -> Path:
    folder.mkdir()
    data = np.zeros((len(labels), 3072), dtype=np.uint8)
    for name in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]:
        (folder / name).write_bytes(pickle.dumps({b"data": data, b"labels": labels}))
    (folder / "batches.meta").write_bytes(pickle.dumps({b"label_names": [b"a", b"b"]}))
    return folder


def test_a_cifar_label_beyond_int64_is_refused_with_the_file_named(tmp_path):
    folder = _cifar_folder(tmp_path / "cifar-10-batches-py", [2**100, 0])
    with pytest.raises(InputError, match="data_batch_1.*b'labels' must be 2 integers"):
        load_dataset("cifar10", folder)


def test_a_pickle_larger_than_the_limit_allows_is_refused_unread(tmp_path, monkeypatch):
    folder = _cifar_folder(tmp_path / "cifar-10-batches-py", [0, 1] * 1000)
    monkeypatch.setenv(MAX_LOAD_BYTES_VARIABLE, str(2**20))  # each batch: 6 MB of pixels
    _refused_within(lambda: load_dataset("cifar10", folder), "data_batch_1", "unpickled")


def test_the_limit_is_the_machines_and_refuses_a_malformed_setting(monkeypatch):
    monkeypatch.delenv(MAX_LOAD_BYTES_VARIABLE)
    assert max_load_bytes() == DEFAULT_MAX_LOAD_BYTES == 4 * 2**30
    monkeypatch.setenv(MAX_LOAD_BYTES_VARIABLE, "lots")
    with pytest.raises(InputError, match=f"{MAX_LOAD_BYTES_VARIABLE}=.*whole number of bytes"):
        max_load_bytes()
