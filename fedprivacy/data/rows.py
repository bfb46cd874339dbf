r"""A deployed node's CSV file, read one physical line at a time: no record can change how another
is read, nor fail the file.

pandas parses a file as a whole: a column's type, the quoting and the index are decided from all
of its lines, so one record (an unmatched quote, an extra field in the first row, `Ture` in a
column of `True`/`False`, a byte that is not UTF-8, a 400-digit number) could drop many other
records or make the read fail, and a failure is what the server sees. Here each line is decoded,
split and converted on its own; a line that fails any step is left out alone. The header is the
operator's, not a record: it is read and checked as for any file (`tables.read_header`), and must
be the first line. Nothing limits the file's size, since one record could push it over a limit:
lines are streamed, only the used cells are kept (as float64), and a line over `MAX_LINE_BYTES`
is left out without being held whole.

So the unit of privacy is a line (ended by \n, \r\n or a lone \r). A quoted cell that holds a
line break cuts its record into several lines: the first and the last hold an odd number of
quotes and are left out, but a middle one that reads as a row of numbers would be kept. A deployed
file must not hold line breaks inside cells (docs/deployment.md).
"""

from __future__ import annotations

import csv
import logging
import math
import re
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pandas as pd

from fedprivacy.data.tables import FLOAT32_MAX, read_header
from fedprivacy.errors import InputError

logger = logging.getLogger(__name__)

MAX_LINE_BYTES = 2**20  # a row of numbers is far shorter; a longer line is left out unread
_BLOCK_BYTES = 2**16  # read in blocks, split on both line ends
_LINE_END = re.compile(rb"[\r\n]")


def _numbers(line: bytes, width: int, positions: Sequence[int]) -> list[float] | None:
    """The cells at `positions` of one line as floats finite in float32, or None for a line to leave out."""
    if line.count(b'"') % 2:  # a piece of a quoted cell cut by a line break
        return None
    try:
        text = line.decode("utf-8")
        fields = text.split(",") if '"' not in text else next(csv.reader([text], strict=True))  # same fields
    except (UnicodeDecodeError, csv.Error, StopIteration):
        return None
    if len(fields) != width:
        return None
    values = []
    for position in positions:
        cell = fields[position].strip()
        if not cell.isascii() or "_" in cell:  # float() also reads "1_000", "٣" and "２": no CSV number
            return None
        try:
            value = float(cell)
        except ValueError:
            return None
        if not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):  # finite once stored as float32
            return None
        values.append(value)
    return values


def _physical_lines(handle: BinaryIO) -> Iterator[bytes | None]:
    r"""The file's lines, without their ends: each \n and each \r ends one (so \r\n gives a line
    and a blank one, and a lone \r ends a line as a spreadsheet on an old Mac saves it); None for a
    line over `MAX_LINE_BYTES`, whose bytes are dropped as they stream by, never held whole. The
    limit applies to each such line whatever ends it, so no line's length depends on another's."""
    carried = b""  # the start of a line that the block's end cut
    skipping = False  # inside a line over the limit: drop its bytes until it ends
    while block := handle.read(_BLOCK_BYTES):
        *ended, rest = _LINE_END.split(block)
        for piece in ended:
            if skipping or len(carried) + len(piece) > MAX_LINE_BYTES:
                yield None
            else:
                yield carried + piece
            carried, skipping = b"", False
        if not skipping and len(carried) + len(rest) > MAX_LINE_BYTES:
            carried, skipping = b"", True
        elif not skipping:
            carried += rest
    if skipping:
        yield None
    elif carried:
        yield carried


def read_numeric_rows(path: Path | str, columns: Sequence[str]) -> pd.DataFrame:
    """`columns` of every line of `path` whose cells there are all numbers (finite in float32), as
    float64; every other line is left out on its own, and how many goes to this machine's log only.

    Refused, whatever the records: a missing file, an empty one, a header lacking a column or not
    on the first line."""
    path = Path(path).expanduser()
    header = read_header(path, columns)
    positions = [header.index(column) for column in columns]
    kept = array("d")
    left_out = 0
    with path.open("rb") as handle:
        lines = _physical_lines(handle)
        first = next(lines, None) or b""
        if next(csv.reader([first.decode("utf-8-sig", errors="replace")]), []) != header:
            raise InputError("data", str(path), "its header must be the first line: no line break inside a name")
        for line in lines:
            if line is not None and not line.strip():
                continue  # a blank line holds no record (nor the empty one between \r and \n)
            values = None if line is None else _numbers(line, len(header), positions)
            if values is None:
                left_out += 1
            else:
                kept.extend(values)
    if left_out:
        logger.warning(
            "%s: %d line(s) left out, each alone: not UTF-8, over 1 MiB, another number of fields than the "
            "header, an odd number of quotes, or a used cell that is not a number finite in float32",
            path,
            left_out,
        )
    table = np.frombuffer(kept, dtype=np.float64).reshape(-1, len(columns)).copy()
    return pd.DataFrame(table, columns=list(columns))
