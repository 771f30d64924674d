"""A wide MLP with LayerNorm: cheap to train on a CPU, with wide (N = width) sharded layers."""

from __future__ import annotations

from itertools import pairwise

from torch import Tensor, nn

__all__ = ["mlp"]


class MLP(nn.Module):
    """``in → width → … → width → classes``; LayerNorm + ReLU after each hidden layer.

    The first and last Linear stay dense under the default layer selection, the
    ``depth - 1`` width×width layers in between are sharded. The normalization matters: without
    it the multipliers ω (up to C for Collective) compound from layer to layer.
    """

    def __init__(self, in_features: int, num_classes: int, width: int, depth: int) -> None:
        super().__init__()
        if depth < 2:
            raise ValueError(f"depth={depth}: expected ≥ 2 hidden layers so that one is sharded")
        layers: list[nn.Module] = [nn.Flatten()]
        dims = [in_features] + [width] * depth
        for a, b in pairwise(dims):
            layers += [nn.Linear(a, b), nn.LayerNorm(b), nn.ReLU()]
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)  # (B, classes)


def mlp(in_features: int, num_classes: int, *, width: int = 512, depth: int = 3) -> nn.Module:
    """The wide MLP (``depth`` hidden layers of ``width`` units)."""
    return MLP(in_features, num_classes, width, depth)
