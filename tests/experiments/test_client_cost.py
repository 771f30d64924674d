"""benchmarks/client_cost.py, the cost columns of the mixed-capacity table, against counts done
by hand: the FLOPs of a two-layer MLP's training step, and a lower bound on what SGD with
momentum must hold for a model of known size."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import client_cost


def test_training_flops_per_example_are_forward_plus_backward_by_hand() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    # forward: 2·8·16 + 2·16·4; backward: the first layer's weight gradient only (its input
    # needs none), the second layer's input and weight gradients: 2·8·16 + 2·(2·16·4)
    expected = (2 * 8 * 16 + 2 * 16 * 4) + (2 * 8 * 16 + 2 * 2 * 16 * 4)
    assert client_cost.train_flops(model, (8,), batch=5) == expected


def test_peaks_hold_at_least_parameters_gradients_and_momentum() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 10))
    params = sum(p.numel() * p.element_size() for p in model.parameters())  # about 4 MB
    tensors, split = client_cost.tensor_peak(model, (1000,), batch=8)
    rss = client_cost.rss_peak(model, (1000,), batch=8, steps=2)
    # parameters, their gradients and SGD's momentum are live together during a step
    assert 3 * params <= tensors < 6 * params
    assert 3 * params <= rss < 3 * params + 200 * 2**20  # plus allocator and runtime
    assert split["conv_mm"] > 0
