"""``resnet18``: torchvision's ResNet-18 (He et al., 2015) in plain ``torch.nn``.

The same layers, shapes and parameter count (11,689,512) as ``torchvision.models.resnet18()``,
so that the synthetic benchmark moves the gradients it moves with torchvision.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["ResNet", "resnet18"]

_MODELS = ("resnet18",)


class _BasicBlock(nn.Module):
    """Two 3x3 convolutions and a shortcut (a 1x1 convolution where the shape changes)."""

    def __init__(self, inplanes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class ResNet(nn.Module):
    """A ResNet of basic blocks: ``blocks`` gives how many at widths 64, 128, 256, 512."""

    def __init__(self, blocks: Sequence[int], num_classes: int = 1000) -> None:
        super().__init__()
        if len(blocks) != 4:
            raise ValueError(f"expected 4 stage lengths, got {len(blocks)}")
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        widths, inplanes = (64, 128, 256, 512), 64
        for i, (width, count) in enumerate(zip(widths, blocks, strict=True)):
            stride = 1 if i == 0 else 2
            stage = [_BasicBlock(inplanes if j == 0 else width, width, stride if j == 0 else 1)
                     for j in range(count)]
            setattr(self, f"layer{i + 1}", nn.Sequential(*stage))
            inplanes = width
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(*, num_classes: int = 1000, **kwargs: Any) -> ResNet:
    """ResNet-18, randomly initialised (pretrained weights would need a download).

    Raises:
        NotImplementedError: for ``weights`` or ``pretrained``.
    """
    if kwargs.get("weights") or kwargs.get("pretrained"):
        raise NotImplementedError("the stand-in resnet18 has no pretrained weights")
    return ResNet((2, 2, 2, 2), num_classes=num_classes)


def __getattr__(name: str) -> Any:
    raise AttributeError(f"the stand-in torchvision.models has {', '.join(_MODELS)}; "
                         f"got {name!r}")
