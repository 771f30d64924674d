"""Shared test set-up.

pytest puts this directory on ``sys.path`` (it holds this ``conftest.py``), so every test imports
the shared helpers by name:

- ``fakedata`` - small data files in the real formats (IDX, CIFAR pickles, TinyImageNet folders,
  Shakespeare JSON), written from a seed;
- ``flower_grid`` - ``InProcessGrid``: fedshard's (or any) ClientApp behind Flower's ``Grid``
  interface, in this process, with real ``Message`` objects;
- ``fault_setup`` - the apps, the strategy and a small real Fashion-MNIST run, for the fault
  and attack tests;
- ``golden_run`` / ``resume_worker`` - scripts that tests run in a fresh process.
- ``doc_commands`` - the ``flwr run`` commands of the docs, read from the pages and parsed by
  Flower's own parsers.

Tests of one package live in the folder of the same name (``tests/client/train/fast`` tests
``fedshard.client.train.fast``); ``tests/faults`` holds the hostile-node and broken-file tests
that cross packages.
"""

from __future__ import annotations

import logging

import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """A test that sets torch's thread count (the golden runs pin one thread) does not leak it
    into the next test."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _restore_library_logging():
    """A test that changes the ``fedshard`` logger (its level, its handlers) does not leak
    that into the next test: fedshard's lines reach Flower's logger through
    :func:`fedshard.logs.route_to_flower`, and only that way."""
    library = logging.getLogger("fedshard")
    handlers, level, propagate = list(library.handlers), library.level, library.propagate
    yield
    library.handlers[:] = handlers
    library.setLevel(level)
    library.propagate = propagate
