"""An in-process Flower Grid: the real ServerApp and ClientApp objects, no Ray, no processes.

Tests (tests/conftest.py) and simulation scenarios (sims/runner.py) both drive the apps with it.

`InProcessGrid` implements Flower's `Grid` by calling the ClientApp object directly, one
`Context` per node that persists across rounds, exactly as the simulation engine keeps
`context.state`. Messages are delivered through Flower's public API (`Message`, `Metadata`); the
one internal it needs is isolated in `act_as_serverapp`. An exception in a handler becomes an
error reply, as Flower does, so the ServerApp sees failing clients the way it would in a real
run. Nodes are called one after the other in this process, so a run uses one core (plus torch's
threads). Real nodes run side by side, so each call gets the whole `timeout` of `send_and_receive`
to itself: a call that takes longer gives no reply, as a hung node gives none to Flower's grid (it
finishes in the background).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from flwr.app import Context, Error, Message, Metadata, RecordDict
from flwr.serverapp import Grid


class InProcessGrid(Grid):
    """A Grid whose nodes are ClientApp calls in this process."""

    def __init__(
        self,
        client_app: Any,
        node_configs: list[dict[str, Any]],
        run_config: Mapping[str, Any],
        run_id: int = 1,
    ) -> None:
        act_as_serverapp(run_id)
        self.client_app = client_app
        self.run_id = run_id
        self.contexts = {
            node_id: Context(
                run_id=run_id,
                node_id=node_id,
                node_config=dict(cfg),
                state=RecordDict(),
                run_config=dict(run_config),
            )
            for node_id, cfg in enumerate(node_configs, start=101)
        }
        self.replies: dict[str, Message] = {}
        self._run = None

    @classmethod
    def simulation(
        cls, client_app: Any, num_nodes: int, run_config: Mapping[str, Any], run_id: int = 1
    ) -> InProcessGrid:
        configs = [{"partition-id": i, "num-partitions": num_nodes} for i in range(num_nodes)]
        return cls(client_app, configs, run_config, run_id)

    def set_run(self, run_id: int) -> None:
        self._run = run_id

    @property
    def run(self) -> Any:
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content=content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl)

    @staticmethod
    def _delivered(message: Message, message_id: str) -> Message:
        """The message as the SuperLink delivers it: the same, with the id it assigns (public API only)."""
        m = message.metadata
        metadata = Metadata(
            run_id=m.run_id,
            message_id=message_id,
            src_node_id=m.src_node_id,
            dst_node_id=m.dst_node_id,
            reply_to_message_id=m.reply_to_message_id,
            group_id=m.group_id,
            created_at=m.created_at,
            ttl=m.ttl,
            message_type=m.message_type,
            src_task_id=m.src_task_id,
            dst_task_id=m.dst_task_id,
        )
        return Message(content=message.content, metadata=metadata)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def _call(self, message: Message) -> Message:
        node = message.metadata.dst_node_id
        try:
            reply = self.client_app(message, self.contexts[node])
        except Exception as exc:  # Flower turns a handler's exception into an error reply
            reply = Message(Error(code=0, reason=f"{type(exc).__name__}: {exc}"), reply_to=message)
        return reply

    def _call_within(self, message: Message, timeout: float | None) -> Message | None:
        """The node's reply, or None when it takes longer than `timeout` seconds."""
        if timeout is None:
            return self._call(message)
        box: list[Message] = []
        done = threading.Event()

        def call() -> None:
            try:
                box.append(self._call(message))
            finally:
                done.set()

        threading.Thread(target=call, daemon=True).start()
        try:
            done.wait(timeout)
        except BaseException:
            # Ctrl-C: let the node's call end first, or the process aborts as it exits with a thread
            # inside PyTorch. Not `Thread.join`: interrupted, it can mark a running thread stopped.
            done.wait(timeout)
            raise
        return box[0] if box else None

    def push_messages(self, messages: Iterable[Message], timeout: float | None = None) -> Iterable[str]:
        ids = []
        for message in messages:
            message_id = uuid.uuid4().hex
            message = self._delivered(message, message_id)
            reply = self._call_within(message, timeout)
            if reply is not None:  # a reply's source is the message's destination
                self.replies[message_id] = reply
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self.replies.pop(i) for i in message_ids if i in self.replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages, timeout))


def act_as_serverapp(run_id: int) -> None:
    """Let this process build instruction messages, as Flower's runtimes let a ServerApp.

    The one Flower internal the in-process grid uses: since flwr 1.38, `Message(...)` reads the
    sender's identity from `flwr.supercore.task_identity.TaskIdentity`, which only the runtimes set
    (tests/test_sims.py fails loudly if a Flower upgrade moves it).
    """
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, 1, 1


def run_server(server_app: Any, grid: InProcessGrid, run_config: Mapping[str, Any]) -> None:
    """Run the ServerApp to completion on `grid`, as the SuperLink would."""
    context = Context(run_id=grid.run_id, node_id=0, node_config={}, state=RecordDict(), run_config=dict(run_config))
    server_app(grid, context)
