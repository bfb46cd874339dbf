"""Reading pickled NumPy arrays without letting the pickle run code.

A pickle can call any importable function while it loads (its GLOBAL and REDUCE opcodes), so
`pickle.load` of a file named by an untrusted run config would run whatever the file says. Every
callable a pickle uses is looked up through `Unpickler.find_class`; `ArrayUnpickler` answers it
only for what pickled arrays need (array reconstruction, `numpy.ndarray`, `numpy.dtype`) and
refuses any other name before anything is called. Dicts, lists, numbers, strings and bytes need
no lookup.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from fedprivacy.data.limits import check_load
from fedprivacy.errors import InputError

# The reconstruction functions, taken from numpy's own reductions (public API): their module is
# numpy.core.multiarray in pickles written by NumPy 1 (and Python 2), numpy._core.* by NumPy 2.
_RECONSTRUCT = np.empty(0).__reduce__()[0]
_FROM_BUFFER = np.empty(0).__reduce_ex__(5)[0]  # protocol 5 (Python 3.14's default) pickles arrays by buffer
ALLOWED: dict[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy.core.numeric", "_frombuffer"): _FROM_BUFFER,
    ("numpy._core.numeric", "_frombuffer"): _FROM_BUFFER,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}


class Refused(pickle.UnpicklingError):
    """The pickle names a callable outside `ALLOWED`; nothing it names was called."""

    def __init__(self, module: str, name: str) -> None:
        self.qualified = f"{module}.{name}"
        super().__init__(self.qualified)


class ArrayUnpickler(pickle.Unpickler):
    """An unpickler that resolves only `ALLOWED` names (bytes kept as bytes, as Python 2 pickles need)."""

    def find_class(self, module: str, name: str) -> Any:
        found = ALLOWED.get((module, name))
        if found is None:
            raise Refused(module, name)
        return found


def load_arrays(file: Path, what: str) -> Any:
    """The object pickled in `file`, refused with the file and the callable named if it needs any
    other than `ALLOWED`, or if it is not a pickle at all. `what` says what the file should be.
    A pickle's objects take at most a few times its size (a reference costs 2 bytes in the file and 8
    in memory; an array's data is in the file): the file, counted 8 times, must fit the limit."""
    check_load(file, f"{what}, unpickled", 8 * file.stat().st_size)
    try:
        return ArrayUnpickler(io.BytesIO(file.read_bytes()), encoding="bytes").load()
    except Refused as refused:
        raise InputError(
            "data",
            str(file),
            f"its pickle calls {refused.qualified}, which {what} never needs (allowed: numpy arrays and "
            "dtypes, lists, dicts, numbers, bytes): refused without running it",
        ) from None
    except Exception as exc:  # a damaged pickle may raise almost anything (the pickle module's docs say so)
        raise InputError("data", str(file), f"is not readable as {what} ({type(exc).__name__}: {exc})") from None
