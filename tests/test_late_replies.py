"""Replies Flower's polling would lose, in process: the server still counts them to the right client.

`LinkGrid` behaves as Flower's HTTP grid did in a deployment where a SuperNode was killed while
sending its reply: the killed node's reply comes back as an error the ServerApp's runtime made
(from the SuperLink's node id, answering the node's message), and the pull that waited for it
returns after the round timeout, so Flower's polling never pulls the reply another node had sent
meanwhile. Both clients must be told apart from silent ones: the late reply is aggregated, the cut
one is that client's error, and neither is excluded as a client that never answered. A third
client's message finds only a runtime error in that last pull (the SuperLink let it expire): that
client did not answer, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import pytest
from faultkit import read_csv
from flwr.app import Error, Message, Metadata

from clients.app import app as client_app
from server.app import app as server_app

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # seeded noise on purpose

SUPERLINK_NODE = 1  # the node id the SuperLink and the ServerApp's runtime send from
CUT, LATE, EXPIRED = 101, 102, 103  # the in-process nodes of clients 0, 1 and 2
CUT_REASON = (
    "Reply message objects are unavailable. The sender may not have completed the upload before the "
    "object-push session expired."
)
EXPIRED_REASON = "Message Unavailable: the message could not be found, it expired or never existed."


def link_grid(base: type) -> type:
    class LinkGrid(base):
        """Round 1 as the HTTP grid delivers it when node CUT was killed while uploading, LATE's
        reply came while the pull waited, and EXPIRED's message had expired by the last pull."""

        def push_messages(self, messages: Iterable[Message], timeout: float | None = None) -> Iterable[str]:
            messages = list(messages)
            ids = list(super().push_messages(messages, timeout))
            for message, message_id in zip(messages, ids, strict=True):
                message.metadata.__dict__["_message_id"] = message_id  # as Flower's grid marks what it sent
            self.last = dict(zip(ids, messages, strict=True))
            return ids

        def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
            ids = list(self.push_messages(messages, timeout))
            if self.last[ids[0]].metadata.message_type != "train" or self.rounds_cut:
                return list(self.pull_messages(ids))
            self.rounds_cut += 1
            by_node = {self.last[i].metadata.dst_node_id: i for i in ids}
            self.replies[by_node[CUT]] = self._runtime_error(by_node[CUT], CUT_REASON)
            self.replies[by_node[EXPIRED]] = self._runtime_error(by_node[EXPIRED], EXPIRED_REASON)
            held = {by_node[LATE], by_node[EXPIRED]}  # not there yet when Flower pulled
            return list(self.pull_messages([i for i in ids if i not in held]))

        def _runtime_error(self, message_id: str, reason: str) -> Message:
            sent = self.last[message_id].metadata
            asked_of_link = Metadata(
                run_id=sent.run_id,
                message_id=message_id,
                src_node_id=SUPERLINK_NODE,
                dst_node_id=SUPERLINK_NODE,
                reply_to_message_id="",
                group_id=sent.group_id,
                created_at=sent.created_at,
                ttl=sent.ttl,
                message_type=sent.message_type,
            )
            return Message(
                Error(code=0, reason=reason),
                reply_to=Message(content=self.last[message_id].content, metadata=asked_of_link),
            )

    LinkGrid.rounds_cut = 0
    return LinkGrid


def test_a_reply_pulled_late_and_an_error_made_for_a_client_count_for_their_clients(
    in_process, run_config, tmp_path, caplog
):
    config = {**run_config, "num-server-rounds": 2, "round-timeout": 30.0}
    grid = link_grid(in_process.Grid).simulation(client_app, 3, config)
    with caplog.at_level(logging.INFO):
        in_process.run_server(server_app, grid, config)
    (folder,) = [p for p in Path(config["results-dir"]).iterdir() if p.is_dir()]
    replies = read_csv(folder / "replies.csv")
    first = {r["client_id"]: (r["outcome"], r["reason"]) for r in replies if r["round"] == "1"}
    assert first == {
        "0": ("error", CUT_REASON),
        "1": ("trained", ""),
        "node-103": ("no reply", "no reply within the round timeout"),
    }, first
    assert "ignored a reply" not in caplog.text
    second = {r["client_id"]: r["outcome"] for r in replies if r["round"] == "2"}
    assert second == {"0": "trained", "1": "trained"}  # the silent one is excluded, nobody else
