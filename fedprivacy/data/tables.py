"""Reading user CSV files with errors that name the file and the column.

Everything that reads a CSV (planning sheets, the PUMS and general loaders) goes through
`read_table`, so a missing file, an empty file or a missing column reads the same everywhere.
Files are comma-separated UTF-8 (a byte-order mark is fine). The header is checked before the
body is read (duplicated names, another separator), and a file larger than `MAX_FILE_BYTES` is
refused before any of it is read: every client process holds its table in memory, and pandas
needs several times the file's size while parsing.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import pandas as pd

from fedprivacy.errors import InputError

MAX_FILE_BYTES = 512 * 2**20
MAX_CLASSES = 1000
FLOAT32_MAX = float(np.finfo(np.float32).max)  # a larger value is inf once stored
OTHER_SEPARATORS = (";", "\t", "|")


def read_header(
    path: str | Path, required_columns: Iterable[str] = (), named: Mapping[str, str] | None = None
) -> list[str]:
    """The file's column names, once it is known to exist, to hold a header with distinct names
    separated by commas (a byte-order mark is fine), and to have every required column (a missing
    one is refused under the option that named it, `named[column]`, else as `column`)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise InputError("data", str(path), "no such file: pass the path of a CSV file")
    with file.open(newline="", encoding="utf-8-sig", errors="replace") as handle:
        header = next(csv.reader(handle), [])
    if not header:
        raise InputError("data", str(path), "the file is empty: it needs a header and rows")
    duplicated = sorted({name for name in header if header.count(name) > 1})
    if duplicated:
        raise InputError(
            "column",
            duplicated[0],
            f"appears {header.count(duplicated[0])} times in the header of {path}: every column needs its own name",
        )
    if len(header) == 1:
        for separator in OTHER_SEPARATORS:
            if separator in header[0]:
                raise InputError(
                    "data",
                    str(path),
                    f"its header is one column holding {separator!r}: fedprivacy reads "
                    "comma-separated files; save it with ',' as the separator",
                )
    missing = [c for c in required_columns if c not in header]
    if missing:
        field = (named or {}).get(missing[0], "column")
        raise InputError(field, missing[0], f"not a column of {path}; its columns are: {', '.join(header)}")
    return header


def read_table(
    path: str | Path, required_columns: Iterable[str] = (), named: Mapping[str, str] | None = None
) -> pd.DataFrame:
    """Read a CSV file; fail clearly if it is missing, empty, too large or lacks a required column
    (refused under the option that named it, see `read_header`). (A deployed node's own file is
    read line by line instead: `fedprivacy.data.rows`.)"""
    file = Path(path).expanduser()
    read_header(file, required_columns, named)
    size = file.stat().st_size
    if size > MAX_FILE_BYTES:
        raise InputError(
            "data",
            str(path),
            f"is {size / 2**20:,.0f} MiB; files up to {MAX_FILE_BYTES // 2**20} MiB are "
            "read (each client holds its table in memory): split it or keep only the columns used",
        )
    try:
        table = pd.read_csv(file, encoding="utf-8-sig")
    except pd.errors.EmptyDataError:
        raise InputError("data", str(path), "the file is empty: it needs a header and rows") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise InputError("data", str(path), f"not a readable CSV file ({exc})") from None
    if table.empty:
        raise InputError("data", str(path), "the file has a header but no rows")
    return table


def partition_sizes(table: pd.DataFrame, column: str, min_rows: int = 2) -> dict[str, int]:
    """Rows per value of `column` (one client per value), in sorted value order.

    Each client needs at least `min_rows` rows: a DP plan for N < 2 is meaningless.
    """
    if column not in table.columns:
        raise InputError("partition-by", column, f"not a column; columns are: {', '.join(map(str, table.columns))}")
    if table[column].isna().any():
        raise InputError("partition-by", column, "the column has empty values: every row needs a client")
    counts = table[column].value_counts().sort_index()
    sizes = {str(value): int(count) for value, count in counts.items()}
    for client, size in sizes.items():
        if size < min_rows:
            raise InputError(
                f"partition-by {column}",
                client,
                f"client {client} has {size} row(s); each client needs at least {min_rows}",
            )
    return sizes


def cell(table: pd.DataFrame, column: str, row: int) -> object:
    """One cell as a plain Python value (an empty one as ""), so messages read `x='abc'`, not numpy reprs."""
    value = table[column].iloc[row]
    if pd.isna(value):
        return ""
    return value.item() if isinstance(value, np.generic) else value


def _truth_values(values: pd.Series) -> np.ndarray:
    """Which cells hold True or False (pandas would count a column of them as 1 and 0)."""
    if pd.api.types.is_bool_dtype(values):
        return np.ones(len(values), dtype=bool)
    if pd.api.types.is_object_dtype(values) or pd.api.types.is_string_dtype(values):
        return values.map(
            lambda v: isinstance(v, bool | np.bool_) or (isinstance(v, str) and v.strip().lower() in ("true", "false"))
        ).to_numpy(dtype=bool, na_value=False)
    return np.zeros(len(values), dtype=bool)


def numeric_column(table: pd.DataFrame, column: str, source: str) -> np.ndarray:
    """The column as float64, or an error naming the first bad cell.

    A non-numeric or empty cell would otherwise become a silent NaN that poisons training, so
    the message names the column, the value and its data row (1 = first row after the header).
    """
    values = table[column]
    numbers = pd.to_numeric(values, errors="coerce").astype(np.float64).to_numpy()
    problems = (
        (_truth_values(values), "True/False", "write 1 and 0 (a deployed node reads only numbers)"),
        (np.isnan(numbers) & values.notna().to_numpy(), "not a number", "the column must be numeric"),
        (values.isna().to_numpy(), "empty or NaN value", "fill or drop the row"),
        (np.isinf(numbers), "infinite value", "fill or drop the row"),
        (np.abs(numbers) > FLOAT32_MAX, "beyond float32", "features and labels are stored as float32"),
    )
    for bad, what, fix in problems:
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            where = f"data row {row + 1} of {source}"
            raise InputError(f"column {column}", cell(table, column, row), f"{what} ({where}); {fix}")
    return numbers


def integer_labels(table: pd.DataFrame, column: str, source: str) -> np.ndarray:
    """The label column as int64, or an error naming the first cell that is not an integer >= 0
    (whether each lies below the declared number of classes is `arrays.class_labels`'s check)."""
    numbers = numeric_column(table, column, source)
    bad = (numbers != np.round(numbers)) | (numbers < 0) | (numbers >= MAX_CLASSES)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise InputError(
            f"label column {column}",
            cell(table, column, row),
            f"labels must be integers from 0 to {MAX_CLASSES - 1} (data row {row + 1} of {source})",
        )
    return numbers.astype(np.int64)
