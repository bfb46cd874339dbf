"""A forked child that runs one check, for tests of what a process inherits across fork."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest


def fork_running(check: Callable[[], bool]) -> int:
    """Fork; the child runs `check` and exits 0 if it returned true, 1 if not or if it raised."""
    child = os.fork()
    if child == 0:  # pragma: no cover (runs in the child)
        try:
            ok = check()
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    return child


def child_exit_code(child: int, what: str, timeout: float = 30.0) -> int:
    """The child's exit code; the test fails (and the child is killed) if it has not ended within
    `timeout` s: a child waiting on something its parent's threads held never ends by itself."""
    deadline = time.monotonic() + timeout
    while (done := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(child, 9)
        os.waitpid(child, 0)
        pytest.fail(f"the forked child never finished {what}")
    return os.waitstatus_to_exitcode(done[1])
