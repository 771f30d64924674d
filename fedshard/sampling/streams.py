"""The random streams of a run, in one place.

Every random draw of a run comes from ``numpy.random.default_rng([seed, round, tag, *ids])``:
the seed, the (1-based) server round, a tag naming what is drawn, and the identities that make
the stream unique (a layer and a keep-ratio group, a node). NumPy's ``SeedSequence`` mixes the
whole list, so streams never collide the way ``seed + offset`` streams do (client 1 in round 2
is not client 2 in round 1), and a resumed run draws exactly what an uninterrupted one would.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

__all__ = ["Stream", "stream_rng"]


class Stream(IntEnum):
    """Tags of the independent streams (the third entry of the seed list)."""

    NODES = 0  # which nodes train this round:         [seed, round, 0]
    TERMS = 1  # the terms of layer l for group g:       [seed, round, 1, l, g]
    TRAIN = 2  # a node's local-training seed:           [seed, round, 2, node]
    NOISE = 3  # central DP's noise on entry j (part p): [seed, round, 3, j, p]


def stream_rng(seed: int, server_round: int, tag: Stream, *ids: int) -> np.random.Generator:
    """The generator ``default_rng([seed, server_round, tag, *ids])``."""
    return np.random.default_rng([int(seed), int(server_round), int(tag), *map(int, ids)])
