"""ResNet-18 for small images (CIFAR 32x32x3, MNIST-like 28x28x1) with GroupNorm.

Built from ``torchvision.models.resnet.BasicBlock`` and ``conv1x1`` (unchanged residual block
and shortcut), with a new stem and stage layout: torchvision's ``ResNet`` class hard-codes the
7x7 stride-2 stem, the max-pool and the widths 64/128/256/512, none of which fit here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["ResNet", "resnet18"]


class ResNet(nn.Module):
    """ResNet with a 3x3 stride-1 stem, no max-pool and GroupNorm (paper, Sec. 4.1).

    Parameters
    ----------
    layers : sequence of int
        Number of ``BasicBlock``s per stage, ``(2, 2, 2, 2)`` for ResNet-18.
    num_classes : int
        Output logits.
    in_channels : int
        Input image channels (3 for CIFAR, 1 for MNIST-like data).
    width : int
        Channels of the first stage; the stages have ``width * (1, 2, 4, 8)`` channels
        (64 is the standard ResNet-18, 16 a 16x cheaper CPU variant of the same structure).
    norm_groups : int
        GroupNorm groups in every normalization layer; must divide ``width``.

    Notes
    -----
    Module names follow torchvision (``conv1``, ``bn1``, ``layer1.0.conv1``, ...,
    ``layer2.0.downsample.0``, ``fc``) even though the ``bn*`` modules are GroupNorm. Modules
    are registered in forward order, so the default layer selection of
    :func:`fedshard.spectral.sharded_layer_names` keeps ``conv1`` and ``fc`` dense with or
    without an example input. The output is ``(B, num_classes)`` for any input of at least
    8x8 pixels (28x28 gives 28 -> 14 -> 7 -> 4 spatially).
    """

    def __init__(
        self,
        layers: tuple[int, ...] = (2, 2, 2, 2),
        *,
        num_classes: int = 10,
        in_channels: int = 3,
        width: int = 64,
        norm_groups: int = 2,
    ) -> None:
        super().__init__()
        for label, value in (
            ("num_classes", num_classes),
            ("in_channels", in_channels),
            ("width", width),
            ("norm_groups", norm_groups),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ResNet {label}={value!r}: expected an int >= 1.")
        if width % norm_groups:
            raise ValueError(
                f"ResNet width={width} is not divisible by norm_groups={norm_groups}; every "
                "GroupNorm needs channels divisible by its groups. Pick an even width for the "
                "default 2 groups."
            )

        # A partial of the class (not a closure) keeps the model picklable.
        norm = functools.partial(nn.GroupNorm, norm_groups)
        self._norm: Callable[[int], nn.Module] = norm
        self.inplanes = width
        self.conv1 = nn.Conv2d(in_channels, width, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = norm(width)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = self._make_stage(width, layers[0], stride=1)
        self.layer2 = self._make_stage(2 * width, layers[1], stride=2)
        self.layer3 = self._make_stage(4 * width, layers[2], stride=2)
        self.layer4 = self._make_stage(8 * width, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * width, num_classes)
        # torchvision's initialization: He (fan_out) for convs, GroupNorm affine = (1, 0).
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.GroupNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _make_stage(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        # imported here: torchvision takes ~3 s to import, and a process that never builds a
        # ResNet (the MLP's ServerApp and ClientApps) need not pay it
        from torchvision.models.resnet import BasicBlock, conv1x1

        downsample = None
        if stride != 1 or self.inplanes != planes:
            # 1x1 projection shortcut (torchvision's "option B").
            downsample = nn.Sequential(conv1x1(self.inplanes, planes, stride), self._norm(planes))
        stage = [BasicBlock(self.inplanes, planes, stride, downsample, norm_layer=self._norm)]
        self.inplanes = planes
        stage += [BasicBlock(planes, planes, norm_layer=self._norm) for _ in range(1, blocks)]
        return nn.Sequential(*stage)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, num_classes)`` of images ``(B, in_channels, H, W)``."""
        x = self.relu(self.bn1(self.conv1(x)))  # (B, w, H, W)
        x = self.layer1(x)  # (B, w, H, W)
        x = self.layer2(x)  # (B, 2w, H/2, W/2)
        x = self.layer3(x)  # (B, 4w, H/4, W/4)
        x = self.layer4(x)  # (B, 8w, H/8, W/8)
        x = torch.flatten(self.avgpool(x), 1)  # (B, 8w)
        return self.fc(x)


def resnet18(
    num_classes: int = 10,
    in_channels: int = 3,
    width: int = 64,
    *,
    norm_groups: int = 2,
    seed: int | None = None,
) -> ResNet:
    """ResNet-18 of the paper: 3x3 stem, no max-pool, GroupNorm, ``width`` multiplier.

    Parameters
    ----------
    num_classes : int
        Output logits (10 for CIFAR-10 / Fashion-MNIST, 100 for CIFAR-100).
    in_channels : int
        3 for 32x32 colour images, 1 for 28x28 grey images.
    width : int
        First-stage channels; 64 is the standard network, 16 (or 8) a narrow CPU variant with
        the same 20 affine layers.
    norm_groups : int
        GroupNorm groups, default 2 (see Notes).
    seed : int, optional
        If given, the weights are initialized from a forked torch RNG seeded with it (the
        global RNG is untouched); otherwise from the global RNG, as torch modules are.

    Returns
    -------
    ResNet

    Notes
    -----
    Paper, Sec. 4.1: ResNet-18 with a 3x3 first convolution and BatchNorm replaced by GroupNorm
    (Hsieh et al., 2020, the work the paper cites for it). We use 2 groups, the setting of
    Hsieh et al.: it divides every channel count for any even width, so widths 8 and 16 have
    exactly the same normalization structure as width 64 (two halves of the channels), which
    ``min(32, channels)`` would not (16 groups of 1 channel at width 16 is InstanceNorm).
    """
    if seed is None:
        return ResNet(
            (2, 2, 2, 2),
            num_classes=num_classes,
            in_channels=in_channels,
            width=width,
            norm_groups=norm_groups,
        )
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return ResNet(
            (2, 2, 2, 2),
            num_classes=num_classes,
            in_channels=in_channels,
            width=width,
            norm_groups=norm_groups,
        )
