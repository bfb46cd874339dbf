"""How much memory a data file may ask for, checked before anything is allocated.

A file can declare far more than it holds: a zip member that inflates a thousandfold, a .npy header
whose shape asks for terabytes, a small parquet of images 12,000 pixels wide, a pickle of numbers
too large for any integer type. Every loader computes what a file will take in memory from what it
declares (headers, shapes, image sizes, parquet metadata) and refuses it, naming the file and the
limit, before reading the data. The limit is the machine's to set, never a run's: the environment
variable `FEDPRIVACY_MAX_LOAD_BYTES` (bytes; default 4 GiB), read when a file is loaded.
"""

from __future__ import annotations

import os

from fedprivacy.errors import InputError

MAX_LOAD_BYTES_VARIABLE = "FEDPRIVACY_MAX_LOAD_BYTES"
DEFAULT_MAX_LOAD_BYTES = 4 * 2**30


def max_load_bytes() -> int:
    """The limit in bytes: the environment's `FEDPRIVACY_MAX_LOAD_BYTES`, else 4 GiB."""
    value = os.environ.get(MAX_LOAD_BYTES_VARIABLE, "").strip()
    if not value:
        return DEFAULT_MAX_LOAD_BYTES
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if limit < 1:
        raise InputError(MAX_LOAD_BYTES_VARIABLE, value, "must be a whole number of bytes >= 1 (e.g. 8589934592)")
    return limit


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


def check_load(path: object, what: str, nbytes: int) -> None:
    """Refuse `path` when `what` (in words: "its arrays", "its 30 images decoded") would take more
    than the limit in memory."""
    limit = max_load_bytes()
    if nbytes > limit:
        raise InputError(
            "data",
            str(path),
            f"{what} would take {_size(nbytes)} in memory, over the limit of {_size(limit)} "
            f"(set {MAX_LOAD_BYTES_VARIABLE} on this machine to allow more)",
        )
