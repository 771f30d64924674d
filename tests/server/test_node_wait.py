"""A round that waits for nodes says so: at once, then once a minute, with what it waits for."""

from __future__ import annotations

import logging

import pytest

from fedshard.server import nodes as nodes_module
from fedshard.server.nodes import NodeDirectory
from fedshard.settings import NodePolicy


class _Grid:
    """Two connected nodes, forever."""

    def get_node_ids(self) -> list[int]:
        return [11, 12]


class _Clock:
    """A monotonic clock that advances 10 s every time the code sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += 10.0


def test_waiting_for_nodes_is_logged_once_a_minute_then_times_out(monkeypatch, caplog) -> None:
    clock = _Clock()
    monkeypatch.setattr(nodes_module.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(nodes_module.time, "sleep", clock.sleep)
    directory = NodeDirectory(seed=0, min_available_nodes=3,
                              policy=NodePolicy(node_wait_timeout=150.0))
    with caplog.at_level(logging.WARNING), pytest.raises(
            TimeoutError, match=r"Only 2 node\(s\) connected after 160 s, but 3 are required"):
        directory.wait(_Grid(), 3)
    lines = [r.getMessage() for r in caplog.records if "Waiting for nodes" in r.getMessage()]
    # waited 0, 10, ..., 150 s before giving up at 160 s: a line at 0, 60 and 120 s
    assert lines == [
        f"Waiting for nodes: 2 connected, 3 required by min-available-nodes=3 (or the round's "
        f"minimum); the run stops in {left} s (round-timeout)." for left in (150, 90, 30)]


def test_enough_nodes_means_no_waiting_line(caplog) -> None:
    directory = NodeDirectory(seed=0, min_available_nodes=2)
    with caplog.at_level(logging.WARNING):
        assert directory.wait(_Grid(), 2) == [11, 12]
    assert not [r for r in caplog.records if "Waiting for nodes" in r.getMessage()]
