"""A run's life, one for the ServerApp and the fast engine: its results folder, what it says, and
what it leaves when it ends, completed or not.

Every run, whatever stops it (a bad run config included), ends with a results folder holding
`summary.json` and a `run failed: …` line or a `done: …` line: `recorded_run` opens the folder
first (from the run config's `results-dir` when that one is usable, else the default) and writes
the summary on the way out. `finish` writes what a completed run adds: the figure, the planning
sheets and the model, after refusing a run in which no client trained.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedprivacy.errors import InputError, error_summary
from fedprivacy.results import RunRecorder, done_line, new_run_folder, no_better_line
from fedprivacy.runconfig import DEFAULTS, RunSettings, parse_run_config
from fedprivacy.runconfig_keys import RUN_KEYS

Say = Callable[[str], None]


@dataclass
class RecordedRun:
    """What a run's body gets: its settings, its recorder, and `extra`, what summary.json adds (the
    body may add to it)."""

    settings: RunSettings
    recorder: RunRecorder
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def folder(self) -> Path:
        return self.recorder.folder


def _results_dir(run_config: Mapping[str, Any]) -> Path:
    """Where the folder of a run whose config did not parse goes: its `results-dir` if that key
    parses, else the default."""
    (key,) = [k for k in RUN_KEYS if k.name == "results-dir"]
    try:
        return key.parse(key.name, run_config.get(key.name, DEFAULTS[key.name]))
    except InputError:
        return key.parse(key.name, DEFAULTS[key.name])


def _folder(results_dir: Path, run_id: int | str) -> Path:
    try:
        return new_run_folder(results_dir, run_id)
    except OSError as error:
        raise InputError(
            "results-dir",
            str(results_dir),
            f"cannot create the run's folder there ({error.strerror or error}): name a writable folder",
        ) from None


@contextmanager
def recorded_run(
    run_config: Mapping[str, Any], run_id: int | str, say: Say, extra: dict[str, Any]
) -> Iterator[RecordedRun]:
    """The run's folder and recorder around its body. A run config that does not parse still gets
    its folder and a failed summary; a body that raises leaves its folder with what it had (the
    planning sheets, rounds.csv and clients.csv so far) and a failed summary, then raises again."""
    try:
        settings = parse_run_config({**DEFAULTS, **run_config})
    except InputError as refused:
        folder = _folder(_results_dir(run_config), run_id)
        reason = error_summary(f"{type(refused).__name__}: {refused}")
        RunRecorder(folder).write_summary({"run_id": run_id, **extra}, error=reason)
        say(f"run failed: {reason}")
        say(f"results folder: {folder} (the run config was refused)")
        raise
    run = RecordedRun(settings, RunRecorder(_folder(settings.results_dir, run_id)), {"run_id": run_id, **extra})
    say(f"results folder: {run.folder}")
    try:
        yield run
    except Exception as exc:
        reason = error_summary(f"{type(exc).__name__}: {exc}")
        run.recorder.write_plans()
        run.recorder.write_summary(run.extra, error=reason)
        say(f"run failed: {reason}")
        say(f"results folder: {run.folder} (partial)")
        raise
    summary = run.recorder.write_summary(run.extra)
    say(done_line(summary))
    warning = no_better_line(summary)
    if warning is not None:
        say(warning)
    say(f"results folder: {run.folder}")


def finish(recorder: RunRecorder, model_state: dict[str, Any]) -> None:
    """What a completed run writes: the progress figure, the planning sheets and the final model
    (refused, naming why, when no client trained: an untrained model.pt would pass for a result)."""
    recorder.write_figure()
    recorder.require_training()
    recorder.write_plans()
    recorder.save_model(model_state)
