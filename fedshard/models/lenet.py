"""LeNet-5-style CNN (conv, conv, fc, fc, fc), the network of Flower's PyTorch quickstart."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["lenet"]


class LeNet(nn.Module):
    """``conv5x5(6) → pool → conv5x5(16) → pool → fc(120) → fc(84) → fc(classes)``, ReLU.

    Under the default layer selection ``conv1`` and ``fc3`` stay dense and ``conv2`` (16 terms),
    ``fc1`` (N = 120) and ``fc2`` (N = 84) are sharded. No normalization layer.
    """

    def __init__(self, in_channels: int, num_classes: int, image_size: int) -> None:
        super().__init__()
        if image_size < 16:
            raise ValueError(f"image_size={image_size}: expected ≥ 16 (two 5x5 convolutions "
                             "and two 2x2 poolings); no model was built.")
        side = ((image_size - 4) // 2 - 4) // 2  # 28 -> 4, 32 -> 5
        self.conv1 = nn.Conv2d(in_channels, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * side * side, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.pool(F.relu(self.conv1(x)))  # (B, 6, 12, 12) for 28x28
        x = self.pool(F.relu(self.conv2(x)))  # (B, 16, 4, 4)
        x = F.relu(self.fc1(x.flatten(1)))
        x = F.relu(self.fc2(x))
        return self.fc3(x)  # (B, classes)


def lenet(num_classes: int = 10, *, in_channels: int = 1, image_size: int = 28) -> nn.Module:
    """The LeNet-style CNN for ``image_size``² images with ``in_channels`` channels."""
    return LeNet(in_channels, num_classes, image_size)
