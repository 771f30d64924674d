"""The CUDA-graph step's capture logic on the CPU, with the CUDA calls replaced by fakes
(``tests/client/train/fast/test_cuda.py`` runs the real thing on a GPU)."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from fedshard.client.train import EagerStep, TrainConfig
from fedshard.client.train.fast import TrainStep
from fedshard.client.train.fast.step import _StepGraphs


class _Capture:
    active = False


class _FakeGraph:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


class _FakeStream:
    def wait_stream(self, other: object) -> None:
        pass


@contextlib.contextmanager
def _fake_capture(graph: _FakeGraph) -> Iterator[None]:
    _Capture.active = True
    try:
        yield
    finally:
        _Capture.active = False


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", _fake_capture)


def _recording_step(seen: list[tuple[bool, bool]], fail_in_capture: bool = False):
    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        seen.append((_Capture.active, gc.isenabled()))
        if fail_in_capture and _Capture.active:
            raise RuntimeError("CUDA error: operation failed due to a previous error "
                               "during capture")
        return x.sum(), y.sum(), torch.tensor(len(y))
    return step


def test_no_automatic_garbage_collection_inside_a_capture(fake_cuda: None) -> None:
    """A collection inside a capture can destroy an unreachable CUDA graph, which invalidates
    the capture: the warm-up step runs with the collector on, the captured one with it off,
    replays do not run the step, and the collector is on again after each call."""
    assert gc.isenabled()
    seen: list[tuple[bool, bool]] = []
    graphs = _StepGraphs(_recording_step(seen))
    x, y = torch.ones(4, 3), torch.zeros(4, dtype=torch.long)
    for _ in range(4):
        graphs(x, y)
        assert gc.isenabled()
    assert seen == [(False, True), (True, False)]  # warm-up, capture; then two replays
    (graph, *_), = graphs.graphs.values()
    assert graph.replays == 3


def test_a_failed_capture_turns_the_collector_back_on(fake_cuda: None) -> None:
    seen: list[tuple[bool, bool]] = []
    graphs = _StepGraphs(_recording_step(seen, fail_in_capture=True))
    x, y = torch.ones(2, 3), torch.zeros(2, dtype=torch.long)
    graphs(x, y)
    with pytest.raises(RuntimeError, match="during capture"):
        graphs(x, y)
    assert gc.isenabled() and seen == [(False, True), (True, False)]
    assert not graphs.graphs  # nothing half-captured is kept


def test_a_collector_the_caller_turned_off_stays_off(fake_cuda: None) -> None:
    seen: list[tuple[bool, bool]] = []
    graphs = _StepGraphs(_recording_step(seen))
    x, y = torch.ones(2, 3), torch.zeros(2, dtype=torch.long)
    gc.disable()
    try:
        graphs(x, y)
        graphs(x, y)
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert seen == [(False, False), (True, False)]


def _captured(graphs: _StepGraphs) -> _FakeGraph:
    x, y = torch.ones(2, 3), torch.zeros(2, dtype=torch.long)
    graphs(x, y)  # warm-up
    graphs(x, y)  # capture
    (graph, *_), = graphs.graphs.values()
    return graph


def test_clear_destroys_the_graphs_at_once(fake_cuda: None) -> None:
    """Not at the collector's next pass: with the collector off, the graph is gone on clear()."""
    graphs = _StepGraphs(_recording_step([]))
    ref = weakref.ref(_captured(graphs))
    gc.disable()
    try:
        assert ref() is not None
        graphs.clear()
        assert ref() is None and not graphs.seen
    finally:
        gc.enable()


def test_a_train_step_releases_its_graphs_when_its_with_block_ends(fake_cuda: None) -> None:
    """``with TrainStep(...)`` (what ``train`` does for an unpooled step) frees the graphs on
    exit, although the step itself, a reference cycle, waits for the collector."""
    model = nn.Sequential(nn.Linear(3, 2))
    with TrainStep(model, TrainConfig(log_every_epoch=False)) as step:
        # what cuda_graph=True builds on a GPU
        step._graphs = _StepGraphs(lambda x, y: EagerStep.__call__(step, x, y))
        ref = weakref.ref(_captured(step._graphs))
        gc.disable()
    try:
        assert ref() is None
    finally:
        gc.enable()
