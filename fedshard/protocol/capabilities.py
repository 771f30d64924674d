"""The ``query`` message: a node declares its keep ratio and a stable key."""

from __future__ import annotations

import hashlib
import math
import zlib
from dataclasses import dataclass

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common import MessageType

from fedshard.protocol.keys import (
    CAPABILITIES,
    KEEP_RATIO,
    MEMORY_MB,
    NODE_KEY,
    QUERY,
    TRAINING_PEAK_MB,
)
from fedshard.sampling import as_keep_ratio

__all__ = ["MAX_NODE_KEY", "Capabilities", "capabilities_reply", "is_capability_query",
           "query_message", "read_capabilities"]

#: Longest ``node-key`` a node may declare (characters): room for a name or the hex of a
#: public key's PEM block. A longer key is refused (the node is skipped, logged, and asked
#: again next round): it would be kept in every checkpoint and named in log lines.
MAX_NODE_KEY = 1024


@dataclass(frozen=True)
class Capabilities:
    """What a node declared: its keep ratio and a stable key (survives node-id changes);
    for a node that chose its ratio from its memory, that budget and the training peak it
    measured at the ratio (MiB)."""

    keep_ratio: float
    key: str
    memory_mb: float | None = None
    training_peak_mb: float | None = None

    def memory_line(self) -> str:
        """How the node chose its ratio from its memory ("" for a node that did not)."""
        if self.memory_mb is None:
            return ""
        peak = ("" if self.training_peak_mb is None
                else f", training peak {self.training_peak_mb:.1f} MB measured")
        return f"keep ratio {self.keep_ratio:g} chosen from memory-mb={self.memory_mb:g}{peak}"

    @property
    def stream(self) -> int:
        """Integer identity of the node for its random stream: the key itself if it is plain
        ASCII digits (at most 18; ``"²"`` passes ``isdigit`` but is not), else its CRC-32."""
        if self.key.isascii() and self.key.isdecimal() and len(self.key) <= 18:
            return int(self.key)
        return zlib.crc32(self.key.encode("utf-8", "surrogatepass"))


def query_message(node: int) -> Message:
    """The capability query sent to ``node``."""
    return Message(RecordDict({QUERY: ConfigRecord({"want": [KEEP_RATIO, NODE_KEY]})}),
                   dst_node_id=node, message_type=MessageType.QUERY)


def is_capability_query(msg: Message) -> bool:
    """Whether ``msg`` is fedshard's capability query (a ``query`` message with a
    :data:`~fedshard.protocol.keys.QUERY` record), not another query of the ClientApp's."""
    return msg.metadata.message_type == MessageType.QUERY and QUERY in msg.content


def capabilities_reply(msg: Message, keep_ratio: float, node_key: str | int | None, *,
                       memory_mb: float | None = None,
                       training_peak_mb: float | None = None) -> Message:
    """A node's answer to ``msg``; ``keep_ratio`` is checked (``ValueError`` if not in (0, 1]).
    A node that chose the ratio from its memory also sends its ``memory_mb`` and the training
    peak it measured (:func:`fedshard.client.memory.keep_ratio_for_memory`)."""
    r = as_keep_ratio(keep_ratio, "keep-ratio", "this node cannot take part until it declares "
                      "one (e.g. --node-config \"keep-ratio=0.2\")")
    caps = ConfigRecord({KEEP_RATIO: r})
    if node_key is not None:
        caps[NODE_KEY] = str(node_key)
    for key, value in ((MEMORY_MB, memory_mb), (TRAINING_PEAK_MB, training_peak_mb)):
        if value is not None:
            caps[key] = float(value)
    return Message(RecordDict({CAPABILITIES: caps}), reply_to=msg)


def read_capabilities(reply: Message, default_key: str = "") -> tuple[Capabilities | None, str]:
    """The node's declared capabilities, or ``None`` and the reason there are none.

    A node that declares no ``node-key`` is known by ``default_key``: what authenticates it,
    e.g. the hex of the public key Flower's SuperNode authentication checked
    (:class:`~fedshard.server.nodes.NodeDirectory` passes it); without one, by its Flower node
    id (stable within one launch only). A ``default_key`` longer than :data:`MAX_NODE_KEY`
    is known by its SHA-256 (``"sha256:<hex>"``), so no key a node's credentials bring is
    unbounded."""
    if reply.has_error():
        return None, f"error reply: {reply.error.reason}"
    caps = reply.content.config_records.get(CAPABILITIES)
    if caps is None or KEEP_RATIO not in caps:
        return None, f"no {CAPABILITIES!r} record with {KEEP_RATIO!r}"
    try:
        ratio = as_keep_ratio(caps[KEEP_RATIO], KEEP_RATIO)
    except ValueError as err:
        return None, str(err)
    key = caps.get(NODE_KEY, "")
    if not isinstance(key, str):
        return None, f"{NODE_KEY}={key!r:.60} is not a string"
    if len(key) > MAX_NODE_KEY:
        return None, (f"{NODE_KEY} of {len(key)} characters: expected at most {MAX_NODE_KEY} "
                      f"(a name, or the hex of a public key), found {key[:20]!r}…")
    if len(default_key) > MAX_NODE_KEY:
        default_key = "sha256:" + hashlib.sha256(default_key.encode()).hexdigest()
    memory: dict[str, float | None] = {}
    note = ""
    for name, wire in (("memory_mb", MEMORY_MB), ("training_peak_mb", TRAINING_PEAK_MB)):
        value = caps.get(wire)
        if value is None:
            memory[name] = None
        elif isinstance(value, (int, float)) and _positive_number(value):
            memory[name] = float(value)
        else:  # advice only: the ratio stands, the reading is dropped and said
            memory[name] = None
            note = f"its {wire}={value!r:.40} is not a number > 0 and is ignored"
    return Capabilities(ratio, key or default_key or str(reply.metadata.src_node_id),
                        **memory), note


def _positive_number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)
