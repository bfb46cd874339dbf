"""Hugging Face `datasets` on local disk: a folder written by `save_to_disk` (a Dataset, or a
DatasetDict of splits), or parquet: one .parquet file, or a folder of them read as one table.

Nothing is downloaded and no dataset script runs: `load_from_disk` maps Arrow files and reads
JSON metadata, parquet is read by pyarrow (its schema carries the `datasets` features). An Image
column is decoded by Pillow to float32 [n, C, H, W] in [0, 1]; any other feature column must be
numeric arrays of one shape. Labels are a ClassLabel (its classes are K) or integers.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

from fedprivacy.data.arrays import class_labels, client_groups, feature_names, float_features, pixels
from fedprivacy.data.limits import check_load
from fedprivacy.data.registry import Source
from fedprivacy.data.types import Dataset
from fedprivacy.errors import InputError

IMAGE_COLUMNS = ("image", "img")  # tried in this order when image_column is unset (img: CIFAR-10 on the Hub)
CHANNELS = {"L": 1, "RGB": 3, "RGBA": 4}  # 8-bit Pillow modes
DECODE_BATCH = 1024
LAYOUT = "a folder written by save_to_disk, a .parquet file, or a folder of .parquet files"


def _parquet(path: Path, files: list[Path]) -> Any:
    """The parquet files as one in-memory table (nothing is written to a cache)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        # what the columns take once decompressed, from each file's metadata, before any is read
        check_load(path, "its parquet columns decompressed", sum(_parquet_bytes(pq.ParquetFile(f)) for f in files))
        table = pa.concat_tables([pq.read_table(f) for f in files])
    except (pa.ArrowException, OSError) as exc:
        raise InputError("data", str(path), f"its parquet cannot be read as one table ({exc})") from None
    return datasets.Dataset(table)


def _parquet_bytes(file: Any) -> int:
    """The uncompressed size of a parquet file's row groups, as its metadata declares it."""
    metadata = file.metadata
    return sum(metadata.row_group(i).total_byte_size for i in range(metadata.num_row_groups))


def _from_disk(path: Path) -> Any:
    """A folder written by save_to_disk: its Arrow files mapped, its JSON metadata read."""
    import datasets

    try:
        return datasets.load_from_disk(str(path))
    except (OSError, ValueError, KeyError, TypeError) as exc:  # missing or damaged files, bad JSON, bad Arrow
        raise InputError(
            "data", str(path), f"is not a readable save_to_disk folder ({type(exc).__name__}: {exc})"
        ) from None


def _table(path: Path, split: str | None) -> Any:
    """The examples as one `datasets.Dataset`: `split` of a DatasetDict, or all its splits in order."""
    import datasets

    if path.is_dir() and (path / "dataset_dict.json").is_file():
        splits = _from_disk(path)
        if split is not None and split not in splits:
            raise InputError("data-split", split, f"{path} has splits: {', '.join(splits)} (or unset: all of them)")
        chosen = [splits[split]] if split is not None else list(splits.values())
        try:
            return datasets.concatenate_datasets(chosen)
        except ValueError as exc:
            raise InputError("data", str(path), f"its splits have different columns or types ({exc})") from None
    if split is not None:
        raise InputError("data-split", split, f"{path} has no splits (only a saved DatasetDict has): leave it unset")
    if path.is_dir() and (path / "state.json").is_file():
        return _from_disk(path)
    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path] if path.suffix == ".parquet" else []
    if not files:
        raise InputError("data", str(path), f"is not a Hugging Face data set on disk: pass {LAYOUT}")
    return _parquet(path, files)


def _column(table: Any, field: str, name: str, where: str) -> str:
    if name not in table.column_names:
        raise InputError(field, name, f"not a column of {where}; its columns are: {', '.join(table.column_names)}")
    return name


def _image_column(table: Any, image_column: str | None, where: str) -> str:
    if image_column is not None:
        return _column(table, "image-column", image_column, where)
    for name in IMAGE_COLUMNS:
        if name in table.column_names:
            return name
    raise InputError(
        "image-column",
        None,
        f"{where} has no {' or '.join(IMAGE_COLUMNS)} column; name its feature column, one of: "
        f"{', '.join(table.column_names)}",
    )


def _opened(cell: Any, column: str, row: int, where: str) -> Any:
    """One image cell opened by Pillow, which reads its header only (mode, size): nothing decoded yet.
    A cell holds the encoded bytes, or the path of a local file (the `datasets` Image layout)."""
    from PIL import Image

    source = None if cell is None else cell.get("bytes") or cell.get("path")
    if source is None:
        raise InputError(f"column {column}", f"example {row}", f"{where}: image is missing")
    try:
        return Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InputError(f"column {column}", f"example {row}", f"{where}: not a readable image ({exc})") from None


def _unlike(column: str, row: int, where: str, image: Any, first: tuple[str, tuple[int, int]] | None) -> InputError:
    """An image whose mode is not one of `CHANNELS`, or whose size or mode is not the first's."""
    if image.mode not in CHANNELS:
        why = f"image is mode {image.mode}; images must be 8-bit {', '.join(CHANNELS)}"
    else:
        shown = "" if first is None else f", example 0 is {first[0]} {first[1][0]}×{first[1][1]}"
        why = f"image is {image.mode} {image.size[0]}×{image.size[1]}{shown}: every image needs the same size and mode"
    return InputError(f"column {column}", f"example {row}", f"{where}: {why}")


def _images(table: Any, column: str, where: str) -> np.ndarray:
    """Every image of `column`, decoded: all must share one size and one of the `CHANNELS` modes.
    Sizes and modes are read from each image's header before it is decoded, and the whole
    array's memory is checked against the limit (`fedprivacy.data.limits`) before the first is."""
    import datasets
    from PIL import ImageOps

    cells = table.select_columns([column]).cast_column(column, datasets.Image(decode=False))
    out: np.ndarray | None = None
    first: tuple[str, tuple[int, int]] | None = None
    first_pixels = 0
    for start in range(0, len(cells), DECODE_BATCH):
        for row, cell in enumerate(cells[start : start + DECODE_BATCH][column], start):
            with _opened(cell, column, row, where) as opened:
                width, height = opened.size
                if opened.mode not in CHANNELS or (first_pixels and width * height != first_pixels):
                    raise _unlike(column, row, where, opened, first)
                if not first_pixels:
                    first_pixels = width * height
                    values = len(cells) * CHANNELS[opened.mode] * first_pixels
                    check_load(where, f"its {len(cells)} images of {width}×{height} decoded", values * 5)
                image = ImageOps.exif_transpose(opened)  # decoded now, turned as its EXIF orientation says
            if out is None:
                first = (image.mode, image.size)
                out = np.empty((len(cells), CHANNELS[image.mode], image.size[1], image.size[0]), dtype=np.uint8)
            elif (image.mode, image.size) != first:
                raise _unlike(column, row, where, image, first)
            array = np.asarray(image)
            out[row] = array[None] if array.ndim == 2 else array.transpose(2, 0, 1)
    assert out is not None  # the table has at least 2 rows (checked by the caller)
    return pixels(out)


def _numbers(table: Any, column: str) -> np.ndarray:
    return np.asarray(table.with_format("numpy", columns=[column])[:][column])


def load_hf(
    path: Path | None = None,
    image_column: str | None = None,
    label: str = "label",
    client_column: str | None = None,
    split: str | None = None,
    num_classes: int | None = None,
) -> Dataset:
    """Features from `image_column` (an Image feature, decoded; or numeric arrays), labels from
    `label`, each example's natural client from `client_column` (e.g. FEMNIST's writer).

    The number of classes is the label's `ClassLabel` (the files' own declaration) or `num_classes`;
    both given must agree; neither is refused (`class_labels`)."""
    import datasets

    if path is None or not path.exists():
        shown = None if path is None else str(path)
        raise InputError("path", shown, f"the hf dataset needs path=<{LAYOUT}>")
    table = _table(path, split)
    where = str(path)
    if len(table) < 2:
        raise InputError("data", where, f"holds {len(table)} example(s); a data set needs at least 2")
    feature = _image_column(table, image_column, where)
    label = _column(table, "label-column", label, where)
    if feature == label:
        raise InputError("label-column", label, "the label column cannot also be the image column")
    if isinstance(table.features[feature], datasets.Image):
        features = _images(table, feature, where)
    else:
        features = float_features(_numbers(table, feature), f"column {feature}", where)
    label_type = table.features[label]
    if isinstance(label_type, datasets.ClassLabel):
        if num_classes is not None and num_classes != label_type.num_classes:
            raise InputError(
                "num-classes",
                num_classes,
                f"{where}: its label column {label} is a ClassLabel of {label_type.num_classes} classes",
            )
        num_classes = label_type.num_classes
    labels, num_classes = class_labels(_numbers(table, label), f"column {label}", where, len(table), num_classes)
    groups = None
    if client_column is not None:
        column = _column(table, "partition-by", client_column, where)
        groups = client_groups(_numbers(table, column), f"column {column}", where, len(table))
    return Dataset(
        features=features,
        labels=labels,
        feature_names=feature_names(features.shape[1:]),
        num_classes=num_classes,
        name=f"hf:{path.name}" if split is None else f"hf:{path.name}:{split}",
        groups=groups,
        group_name=client_column,
    )


SOURCE = Source(
    name="hf",
    summary="Hugging Face `datasets` on disk (`save_to_disk`) or parquet: an Image column decoded to "
    "[n, C, H, W] in [0, 1] (or numeric arrays), ClassLabel labels (or integers and a declared number of "
    "classes), an optional client column",
    loader=load_hf,
    reads="file or folder",
    path_help="a `save_to_disk` folder, a .parquet file or a folder of them",
    option_help={
        "image_column": "the feature column: an Image feature or numeric arrays (unset: `image`, else `img`)",
        "label": "the label column: a ClassLabel (its classes are K) or integers from 0",
        "client_column": "each example's natural client, e.g. a writer id (FEMNIST)",
        "split": "one split of a saved DatasetDict (`train`, `test`, …); unset: every split, pooled",
        "num_classes": "the number of classes, required unless the label is a ClassLabel (then it must agree)",
    },
    run_keys={
        "image_column": "image-column",
        "label": "label-column",
        "split": "data-split",
        "num_classes": "num-classes",
    },
    client_option="client_column",
)
