"""Reading user CSV files with errors that name the file and the column.

Everything that reads a CSV (planning sheets, the PUMS and general loaders) goes through
`read_table`, so a missing file, an empty file or a missing column reads the same everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from fedprivacy.errors import InputError


def read_table(path: str | Path, required_columns: Iterable[str] = ()) -> pd.DataFrame:
    """Read a CSV file; fail clearly if it is missing, empty or lacks a required column."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise InputError("data", str(path), "no such file: pass the path of a CSV file")
    try:
        table = pd.read_csv(file)
    except pd.errors.EmptyDataError:
        raise InputError("data", str(path), "the file is empty: it needs a header and rows") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise InputError("data", str(path), f"not a readable CSV file ({exc})") from None
    if table.empty:
        raise InputError("data", str(path), "the file has a header but no rows")
    missing = [c for c in required_columns if c not in table.columns]
    if missing:
        raise InputError(
            "column",
            missing[0],
            f"not a column of {path}; its columns are: {', '.join(map(str, table.columns))}",
        )
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
            raise InputError(f"client {column}={client}", size, f"has {size} row(s); each client needs at least {min_rows}")
    return sizes
