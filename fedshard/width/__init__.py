"""Width slicing, the alternative to spectral sharding: a model family at any width, which
channels a node trains and their average (:mod:`~fedshard.width.slicing`), and the width that
costs what a spectral sub-model costs (:mod:`~fedshard.width.budget`).

The strategy is :class:`fedshard.server.width.WidthSlicing`, the node's side
:func:`fedshard.client.width.handle_width_train`.
"""

from fedshard.width.budget import WidthMatch, match_width, state_bytes, training_memory
from fedshard.width.slicing import (
    SliceIndex,
    SliceUpdate,
    WidthFamily,
    aggregate_slices,
    channel_indices,
    slice_indices,
    take,
)

__all__ = [
    "SliceIndex",
    "SliceUpdate",
    "WidthFamily",
    "WidthMatch",
    "aggregate_slices",
    "channel_indices",
    "match_width",
    "slice_indices",
    "state_bytes",
    "take",
    "training_memory",
]
