"""Models of the paper's experiments (torch only)."""

from fedshard.models.resnet import ResNet, resnet18

__all__ = ["ResNet", "resnet18"]
