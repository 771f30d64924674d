"""Why a node's reply is dropped: a :class:`Drop`, a reason from a fixed set
(:class:`DropReason`, the suffix of the round's ``dropped-<reason>`` metric) and its details.

The reply checks (:func:`~fedshard.protocol.check_train_reply`,
:func:`~fedshard.protocol.check_eval_reply`) return one instead of the checked reply; the
round counts it under its reason and logs ``str(drop)``, ``"<reason>: <details>"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["Drop", "DropReason"]


class DropReason(str, Enum):
    """Every reason a reply is dropped; the value names the round's metric
    (``dropped-<value>``, ``eval-dropped-<value>``)."""

    ERROR_REPLY = "error-reply"  # the node replied with an error
    DIVERGED = "diverged"  # the node's training diverged (it said so)
    UNEXPECTED_SENDER = "unexpected-sender"  # the node was not sent a message this round
    DUPLICATE = "duplicate"  # a second reply of the node in the round
    WRONG_SENDER = "wrong-sender"  # the reply came from another node than the one asked
    STALE_REPLY = "stale-reply"  # it answers another round
    MISSING_RECORD = "missing-record"  # no ArrayRecord / MetricRecord of the protocol
    BAD_NUM_EXAMPLES = "bad-num-examples"  # not a whole number in [1, max-num-examples]
    BAD_KEYS = "bad-keys"  # other arrays than the node was sent
    BAD_ARRAY = "bad-array"  # an array that cannot be decoded
    BAD_SHAPE = "bad-shape"
    BAD_DTYPE = "bad-dtype"
    NON_FINITE = "non-finite"  # NaN or inf in a floating array
    BAD_INDICES = "bad-indices"  # the term indices differ from those sent
    UPDATE_NORM = "update-norm"  # a change beyond max-update-ratio, update-policy "drop"


@dataclass(frozen=True)
class Drop:
    """A dropped reply: ``reason`` (:class:`DropReason`) and ``detail`` (what was found)."""

    reason: DropReason
    detail: str

    def __str__(self) -> str:
        return f"{self.reason.value}: {self.detail}"
