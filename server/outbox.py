"""A round's messages to the clients, and which client each reply answers.

Two things Flower's runtime (1.41–1.42) does that would otherwise cost a live client its place in
the run:
- `Grid.send_and_receive` polls for replies (every 3 s in a deployment) until the round timeout
  and then stops without a last pull, and in a deployment one of its pulls can block for
  minutes: a reply whose upload was cut (a SuperNode killed while sending) is retried until the
  SuperLink's object push session expires, 180 s after the last piece arrived. A reply that
  reached the SuperLink while the pull was blocked, or in the last seconds of the round, was
  never handed to the strategy: its client counted as silent and was not asked again.
  `Outbox.with_late_replies` pulls once more for every message still unanswered when Flower's
  loop returns, and keeps what clients sent: an error the runtime makes in that pull (a message
  the SuperLink refused or let expire, another cut upload) leaves its client without a reply,
  as before.
- An error reply the runtime makes on a client's behalf (the node is gone, its reply's upload
  was cut) comes from the SuperLink's own node id, not the client's. `Outbox.node_of` names the
  client by the message the reply answers, so the error is the client's dropped reply, not a
  stray message.

Message ids are read after Flower's grid has sent the messages (it writes each id on the message
it sends); a grid that gives the messages no id (the in-process one) gets no extra pull.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from flwr.app import Message
from flwr.serverapp import Grid


class Outbox:
    """The messages of one round and kind (train or evaluate), sent through `grid`."""

    def __init__(self, grid: Grid, messages: list[Message]) -> None:
        self.grid = grid
        self.messages = messages
        self.nodes = frozenset(m.metadata.dst_node_id for m in messages)  # the nodes asked

    @functools.cached_property
    def _sent(self) -> dict[str, int]:
        """Message id -> the node it went to, for the messages the grid gave an id (read once,
        at the first reply: the grid writes the ids as it sends)."""
        return {m.metadata.message_id: m.metadata.dst_node_id for m in self.messages if m.metadata.message_id}

    def node_of(self, reply: Message) -> int | None:
        """The client a reply comes from: its sender when that was asked; for an error reply made
        on a client's behalf, the node its message went to; otherwise None (nobody asked)."""
        sender = reply.metadata.src_node_id
        if sender in self.nodes:
            return sender
        if reply.has_error():
            return self._sent.get(reply.metadata.reply_to_message_id)
        return None

    def with_late_replies(self, replies: Iterable[Message]) -> list[Message]:
        """`replies`, and the replies clients sent to the still unanswered messages that the
        SuperLink holds now."""
        replies = list(replies)
        answered = {r.metadata.reply_to_message_id for r in replies}
        waiting = [message_id for message_id in self._sent if message_id not in answered]
        late = self.grid.pull_messages(waiting) if waiting else []
        return replies + [r for r in late if r.metadata.src_node_id in self.nodes]
