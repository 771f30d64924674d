"""A Ray-free, in-process Flower ``Grid`` for tests: real ``Message``s, real ``ClientApp``s.

Each pushed message is deep-copied (as if serialized), handed to the ClientApp with that node's
``Context``; an exception becomes an error reply, as in Flower's runtimes. Nodes can be made to
vanish (no reply) or to reply through a hook that tampers with the reply.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity


class InProcessGrid(Grid):
    def __init__(self, client_app: Any, node_configs: list[dict[str, Any]],
                 run_config: dict[str, Any] | None = None, run_id: int = 1,
                 first_node_id: int = 1000) -> None:
        self._app = client_app
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, 0, 1
        self.contexts = {
            first_node_id + i: Context(run_id=run_id, node_id=first_node_id + i,
                                       node_config=dict(nc), state=RecordDict(),
                                       run_config=dict(run_config or {}))
            for i, nc in enumerate(node_configs)
        }
        self._replies: dict[str, Message] = {}
        self.sent: list[Message] = []          # every message the server pushed
        self.silent: set[int] = set()   # nodes that answer queries but never a train message
        self.offline: set[int] = set()  # nodes that answer nothing
        # node -> rewrite of its train replies
        self.tamper: dict[int, Callable[[Message], Message]] = {}

    def set_run(self, run_id: int) -> None:
        pass

    @property
    def run(self) -> Any:
        raise NotImplementedError

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        return Message(content, dst_node_id=dst_node_id, message_type=message_type,
                       group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            mid = uuid4().hex
            msg.metadata.__dict__["_message_id"] = mid
            msg.metadata.__dict__["_src_node_id"] = 0
            self.sent.append(msg)
            node = msg.metadata.dst_node_id
            ids.append(mid)
            if node in self.offline or (
                node in self.silent and msg.metadata.message_type == "train"
            ):
                continue
            try:
                reply = copy.deepcopy(self._app(copy.deepcopy(msg), self.contexts[node]))
            except Exception as ex:  # a ClientApp exception is an error reply in Flower
                reply = Message(Error(code=0, reason=repr(ex)), reply_to=msg)
            reply.metadata.__dict__["_src_node_id"] = node
            if node in self.tamper and msg.metadata.message_type == "train":
                reply = self.tamper[node](reply)
            self._replies[mid] = reply
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(m) for m in message_ids if m in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        return list(self.pull_messages(self.push_messages(messages)))
