"""Named points in a deployed client's train round, where a test SIGKILLs its SuperNode (tests only).

The e2e kill test ships this module in a test-only Flower app (`killable(real)` wraps the real
ClientApp) and arms one point per SuperNode through a control file. When a clientapp process of
that SuperNode reaches the armed point it writes a marker, and at a pause point it waits to be
killed, so the kill lands exactly there:

- received: the train message arrived, before the ledger or the data are touched;
- training: the plan is made and the trainer starts its steps;
- recorded: the ledger has just committed this round's spend, the reply is not built yet;
- returning: the reply is built and about to leave the ClientApp.

Two timed points write their marker and go on; the test kills after a random delay:
- random: from `received`, a delay anywhere in the round (training, ledger write, reply);
- sending: from `returning`, a delay of up to 0.3 s, while Flower sends the reply.

Every reply about to leave is logged (round, steps in the ledger, plan) to `released.jsonl`: the
ledger may never count fewer steps than that.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from faultkit import with_train
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedprivacy.ledger import Ledger
from fedprivacy.training.trainer import DPTrainer

PAUSES = ("received", "training", "recorded", "returning")
TIMED = {"random": "received", "sending": "returning"}  # timed kill -> the marker it starts from
HERE = Path(__file__).resolve().parent
_current: dict[str, Any] = {}


def control_dir() -> Path:
    return Path(json.loads((HERE / "killpoints.json").read_text())["dir"])


def arm(folder: Path, client: str, token: int, point: str) -> None:
    """Ask `client` to stop at `point` in its next train round (the test's side)."""
    tmp = folder / f"control-{client}.tmp"
    tmp.write_text(json.dumps({"token": token, "point": point}))
    os.replace(tmp, folder / f"control-{client}.json")


def marker(folder: Path, client: str, token: int) -> Path:
    return folder / f"reached-{client}-{token}.json"


def _reach(point: str) -> None:
    client = _current.get("client")
    if client is None:
        return
    folder = control_dir()
    control = folder / f"control-{client}.json"
    if not control.is_file():
        return
    armed = json.loads(control.read_text())
    wanted = TIMED.get(armed["point"], armed["point"])
    target = marker(folder, client, armed["token"])
    if wanted != point or target.exists():
        return
    written = target.with_suffix(".tmp")  # whole or not at all: the test reads it as soon as it exists
    written.write_text(json.dumps({"point": armed["point"], "round": _current.get("round"), "pid": os.getpid()}))
    os.replace(written, target)
    if armed["point"] in PAUSES:
        time.sleep(3600)  # the test kills this SuperNode now


def _patch(cls: type, name: str, point: str, before: bool) -> None:
    original = getattr(cls, name)

    def wrapped(self, *args, **kwargs):
        if before:
            _reach(point)
        result = original(self, *args, **kwargs)
        if not before:
            _reach(point)
        return result

    setattr(cls, name, wrapped)


def killable(real: ClientApp) -> ClientApp:
    """The real ClientApp, with the named points in its train handler (and, in this process, in the
    trainer and the ledger: the app module runs in a clientapp process of its own)."""
    _patch(DPTrainer, "run_round", "training", before=True)
    _patch(Ledger, "record_with_steps", "recorded", before=False)  # what the ClientApp records with

    def train(message: Message, context: Context) -> Message:
        _current.update(
            client=str(context.node_config["client-id"]), round=int(message.content["config"]["server-round"])
        )
        _reach("received")
        reply = real(message, context)
        if reply.has_content() and "metrics" in reply.content:
            plan = str(reply.content["client"]["plan"])
            entry = {
                "client": _current["client"],
                "round": _current["round"],
                "pid": os.getpid(),
                "steps": int(reply.content["metrics"]["steps-done"]),
                "plan": hashlib.sha256(plan.encode()).hexdigest(),
            }
            with (control_dir() / "released.jsonl").open("a") as log:
                log.write(json.dumps(entry) + "\n")
        _reach("returning")
        return reply

    return with_train(real, train)
