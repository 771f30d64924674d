"""Models of the paper's experiments (torch only): every affine layer is an ``nn.Linear`` or
``nn.Conv2d``, so the default layer selection shards all but the first and the last."""

from fedshard.models.cct import cct_6_3x2
from fedshard.models.chargpt import char_transformer
from fedshard.models.lenet import lenet
from fedshard.models.mlp import mlp
from fedshard.models.resnet import ResNet, resnet18

__all__ = ["ResNet", "cct_6_3x2", "char_transformer", "lenet", "mlp", "resnet18"]
