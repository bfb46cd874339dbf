"""Where a sweep is: a cell's finished rounds read from its rounds.csv, and the progress bar.

The ServerApp rewrites `rounds.csv` (atomically) after every round, so watching that file tells the
round of a cell whose apps run in this process or in a Flower simulation (the inprocess and flower
cell runners); the fast engine reports its rounds itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn

POLL_SECONDS = 0.5


def rounds_done(results_dir: Path) -> int:
    """Rows of the newest rounds.csv below results_dir (0 before the run has written one)."""
    files = sorted(results_dir.rglob("rounds.csv"), key=lambda p: p.stat().st_mtime)
    if not files:
        return 0
    try:
        return max(0, len(files[-1].read_text(encoding="utf-8").splitlines()) - 1)
    except FileNotFoundError:  # replaced between listing and reading
        return 0


@contextmanager
def watching_rounds(results_dir: Path, on_round: Callable[[int], None]) -> Iterator[None]:
    """Call `on_round(r)` from a background thread whenever the run below results_dir finishes round r."""
    stop = threading.Event()

    def watch() -> None:
        seen = 0
        while not stop.wait(POLL_SECONDS):
            done = rounds_done(results_dir)
            if done != seen:
                seen = done
                on_round(done)

    thread = threading.Thread(target=watch, name="rounds-watcher", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class SweepProgress:
    """A rich progress bar: cells done out of all (counting the current cell's rounds), the current
    cell and its round, elapsed time and the ETA of the whole sweep."""

    def __init__(self, total_cells: int, finished_cells: int, console: Console | None = None) -> None:
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[detail]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
        )
        self.finished = finished_cells
        self.total = total_cells
        self.rounds = 1
        self.cells: TaskID = self.progress.add_task(
            "cells", total=total_cells, completed=finished_cells, detail=self._count()
        )
        self.current: TaskID = self.progress.add_task("", total=1, detail="", visible=False)

    def _count(self) -> str:
        return f"{self.finished}/{self.total}"

    def __enter__(self) -> SweepProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def log(self, text: str) -> None:
        """One line of the sweep's log, never broken by the console's width (a log read from a file
        or a pipe, where rich assumes 80 columns, keeps each line whole)."""
        self.progress.console.print(text, soft_wrap=True)

    def start(self, label: str, rounds: int) -> None:
        self.rounds = max(rounds, 1)
        self.progress.update(
            self.current,
            description=label,
            total=rounds,
            completed=0,
            detail=f"round 0/{rounds}",
            visible=True,
        )

    def round(self, done: int) -> None:
        """The current cell has finished `done` rounds (its cell runner's `on_round`)."""
        self.progress.update(self.current, completed=done, detail=f"round {done}/{self.rounds}")
        self.progress.update(self.cells, completed=self.finished + min(done / self.rounds, 0.99))

    def end(self, counts_as_cell: bool) -> None:
        self.progress.update(self.current, visible=False)
        if counts_as_cell:
            self.finished += 1
            self.progress.update(self.cells, completed=self.finished, detail=self._count())
