"""The ledger's SQLite file: created 0600, checked and migrated on open, one connection per process.

The file tells how much each data set has spent, so only its owner may read it. A Ledger keeps one
connection per process (opened on first use, guarded by a lock), so a round's transaction costs
no connect; `PRAGMA data_version` tells whether any other connection wrote since.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from functools import lru_cache
from pathlib import Path

from fedprivacy.errors import InputError
from fedprivacy.ledger.schema import SCHEMA_VERSION, migrate
from fedprivacy.ledger.sql import rollback


class Storage:
    """One ledger file and this process's connection to it."""

    def __init__(self, path: Path, busy_timeout: float) -> None:
        """Open (or create, 0600) the file at `path`; wait up to `busy_timeout` s for another writer."""
        self.path = path
        self.busy_timeout = busy_timeout
        self._db: sqlite3.Connection | None = None
        self._db_pid = 0
        self._inherited: list[sqlite3.Connection] = []  # a forked child's copy of its parent's connection
        self._lock = threading.RLock()
        self._data_version: int | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not self.path.exists():
                _create_private(self.path)
        except OSError as error:
            raise InputError(
                "ledger-path", str(self.path), f"cannot create a ledger there ({error.strerror or error})"
            ) from None
        if not _sqlite_has_json():
            raise RuntimeError(
                f"this Python's SQLite ({sqlite3.sqlite_version}) has no JSON functions, which the ledger "
                "writes with: use a Python whose SQLite has them (built in since SQLite 3.38)"
            )
        self._open()

    def _open(self) -> None:
        """Check that the file is a ledger this version reads, and migrate it to the current layout."""
        try:
            db = self._new_connection()
            try:
                version = db.execute("PRAGMA user_version").fetchone()[0]
                if version > SCHEMA_VERSION:
                    raise InputError(
                        "ledger-path",
                        str(self.path),
                        f"written by a newer fedprivacy (ledger schema {version}, this version reads up to "
                        f"{SCHEMA_VERSION}): upgrade fedprivacy, never downgrade a ledger",
                    )
                tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
                if tables and "spends" not in tables:
                    raise InputError(
                        "ledger-path",
                        str(self.path),
                        "is an SQLite database of another application "
                        f"(tables: {', '.join(sorted(tables)[:3])}…), not a fedprivacy ledger; it is left as it was",
                    )
                migrate(db)
            finally:
                db.close()
        except sqlite3.OperationalError as error:
            if "locked" not in str(error):
                raise InputError("ledger-path", str(self.path), f"not a readable fedprivacy ledger ({error})") from None
            raise InputError(
                "ledger-path",
                str(self.path),
                f"locked by another process for more than {self.busy_timeout:g} s "
                "(a SuperNode writing to it?): try again when it is done",
            ) from None
        except sqlite3.DatabaseError as error:
            raise InputError("ledger-path", str(self.path), f"not a readable fedprivacy ledger ({error})") from None

    def _new_connection(self) -> sqlite3.Connection:
        # Autocommit mode: transactions are explicit (BEGIN IMMEDIATE) where they matter. Used by
        # one thread at a time (the lock), possibly not the one that opened it (`record_round_while`).
        db = sqlite3.connect(self.path, timeout=self.busy_timeout, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA synchronous=FULL")
        return db

    @contextmanager
    def connect(self) -> Iterator[sqlite3.Connection]:
        """This process's connection. A forked child gets its own lock and connection; its parent's
        connection is kept, never used or closed, in the child."""
        # First use in this process: a forked child's lock may be held by a thread the child lacks.
        if self._db_pid != os.getpid():
            if self._db is not None:
                self._inherited.append(self._db)
            self._lock, self._db, self._db_pid = threading.RLock(), None, os.getpid()
        with self._lock:
            if self._db is None:
                self._db = self._new_connection()
                self._data_version = None
            yield self._db

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """A write transaction whose lock is taken up front, so checks and writes cannot interleave."""
        with self.connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
                db.execute("COMMIT")
            except BaseException:
                rollback(db)
                raise

    def written_elsewhere(self, db: sqlite3.Connection) -> bool:
        """Whether another connection wrote to the file since this one last asked (`PRAGMA
        data_version`; always true on a new connection): what was read before may be stale."""
        version = db.execute("PRAGMA data_version").fetchone()[0]
        if version == self._data_version:
            return False
        self._data_version = version
        return True

    def close(self) -> None:
        """Close this process's connection (a later call opens a new one)."""
        if self._db_pid != os.getpid():
            return
        with self._lock:
            if self._db is not None:
                self._db.close()
            self._db = None


def _create_private(path: Path) -> None:
    """Create `path` 0600 before SQLite writes anything into it; a file another process (a second
    SuperNode on this ledger) created since the caller looked is theirs to keep, not an error."""
    with suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


@lru_cache(maxsize=1)
def _sqlite_has_json() -> bool:
    db = sqlite3.connect(":memory:")
    try:
        db.execute("SELECT value FROM json_each('[1]')").fetchall()
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        db.close()
