"""The processes the flower engine starts: a free port for them, and ending them all.

Flower's SuperLink starts a SuperExec in a session of its own, which starts each run's simulation
process and Ray below it, so ending the SuperLink's process group alone leaves those running for
a while; `end_tree` ends every descendant as well, found through /proc on Linux.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def descendants(root: int) -> set[int]:
    """Every descendant of `root`, from /proc (Linux; elsewhere none are found)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # ended meanwhile
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Running: it exists and is not a zombie (an ended process its parent has not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def end_tree(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to `process`'s group (it was started in a session of its own) and to each of its
    descendants, SIGKILL to what is left after a grace period; return once all have ended."""
    pids = {process.pid} | descendants(process.pid)
    for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        for pid in [pid for pid in pids if alive(pid)]:
            with contextlib.suppress(ProcessLookupError):
                if pid == process.pid:
                    os.killpg(pid, sig)
                else:
                    os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            process.poll()  # reap our own child
            if not any(alive(pid) for pid in pids):
                return
            time.sleep(0.1)
