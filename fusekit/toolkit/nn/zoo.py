"""torchvision's ResNets and VGGs, written in fusekit with exactly torchvision's tensor names
and shapes (torchvision itself is not a dependency), at any widths.

A state_dict of ``resnet18(num_classes=K)`` here is interchangeable with one of
``torchvision.models.resnet18(num_classes=K)``; a fused checkpoint whose groups changed
width rebuilds through the same classes from its ``fusekit.arch`` (``"widths"``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fusekit.core.arch import (
    named_arch,
    resnet_blocks,
    resnet_groups,
    validate_arch,
    with_hidden_widths,
)


def _conv(c_in: int, c_out: int, kernel: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False)


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: two 3x3 convs; ``widths`` = (inner, out)."""

    def __init__(self, c_in: int, widths: Sequence[int], stride: int, downsample: bool):
        super().__init__()
        inner, out = widths
        self.conv1 = _conv(c_in, inner, 3, stride)
        self.bn1 = nn.BatchNorm2d(inner)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv(inner, out, 3)
        self.bn2 = nn.BatchNorm2d(out)
        self.downsample = _shortcut(c_in, out, stride) if downsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class Bottleneck(nn.Module):
    """torchvision's Bottleneck (v1.5: stride on the 3x3 conv); ``widths`` = (inner1,
    inner2, out)."""

    def __init__(self, c_in: int, widths: Sequence[int], stride: int, downsample: bool):
        super().__init__()
        first, second, out = widths
        self.conv1 = _conv(c_in, first, 1)
        self.bn1 = nn.BatchNorm2d(first)
        self.conv2 = _conv(first, second, 3, stride)
        self.bn2 = nn.BatchNorm2d(second)
        self.conv3 = _conv(second, out, 1)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(c_in, out, stride) if downsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


def _shortcut(c_in: int, c_out: int, stride: int) -> nn.Sequential:
    return nn.Sequential(_conv(c_in, c_out, 1, stride), nn.BatchNorm2d(c_out))


class ResNet(nn.Module):
    """torchvision's ResNet (``conv1, bn1, relu, maxpool, layer1..N, avgpool, fc``) built from
    a ``resnet`` architecture description; the CIFAR stem has a 3x3 ``conv1`` and no max
    pool."""

    def __init__(self, arch: Mapping[str, Any]):
        super().__init__()
        self.arch = validate_arch(arch)
        widths = [width for _, width in resnet_groups(self.arch)]
        imagenet = self.arch["stem"] == "imagenet"
        self.conv1 = (nn.Conv2d(self.arch["in_channels"], widths[0], 7, 2, 3, bias=False)
                      if imagenet else _conv(self.arch["in_channels"], widths[0], 3))
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1) if imagenet else nn.Identity()
        block_class = BasicBlock if self.arch["block"] == "basic" else Bottleneck
        stages: dict[str, list[nn.Module]] = {}
        for block in resnet_blocks(self.arch):
            own = [widths[g] for g in (*block["inner"], block["writes"])]
            stages.setdefault(block["name"].split(".")[0], []).append(block_class(
                widths[block["reads"]], own, block["stride"], block["downsample"]))
        for name, blocks in stages.items():
            self.add_module(name, nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[resnet_blocks(self.arch)[-1]["writes"]],
                            self.arch["out_features"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for index in range(len(self.arch["layers"])):
            x = getattr(self, f"layer{index + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


class VGG(nn.Module):
    """torchvision's VGG (``features``, 7x7 ``avgpool``, ``classifier`` of Linear-ReLU-Dropout
    blocks) built from a ``vgg`` architecture description."""

    def __init__(self, arch: Mapping[str, Any], dropout: float = 0.5):
        super().__init__()
        self.arch = validate_arch(arch)
        layers: list[nn.Module] = []
        channels = self.arch["in_channels"]
        for item in self.arch["config"]:
            if item == "M":
                layers.append(nn.MaxPool2d(2, 2))
                continue
            layers.append(nn.Conv2d(channels, item, 3, padding=1))
            if self.arch["batchnorm"]:
                layers.append(nn.BatchNorm2d(item))
            layers.append(nn.ReLU(inplace=True))
            channels = item
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        head: list[nn.Module] = []
        width = channels * 49
        for hidden in self.arch["hidden"]:
            head += [nn.Linear(width, hidden), nn.ReLU(True), nn.Dropout(dropout)]
            width = hidden
        head.append(nn.Linear(width, self.arch["out_features"]))
        self.classifier = nn.Sequential(*head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def _named(name: str, num_classes: int, in_channels: int,
           widths: Sequence[int] | None) -> nn.Module:
    arch = named_arch(name, num_classes, in_channels=in_channels)
    if widths is not None:
        arch = with_hidden_widths(arch, widths)
    return (ResNet if validate_arch(arch)["type"] == "resnet" else VGG)(arch)


def resnet18(num_classes: int = 1000, *, in_channels: int = 3,
             widths: Sequence[int] | None = None) -> nn.Module:
    """torchvision's resnet18 (BasicBlock, [2, 2, 2, 2]); ``widths``: one per group."""
    return _named("resnet18", num_classes, in_channels, widths)


def resnet34(num_classes: int = 1000, *, in_channels: int = 3,
             widths: Sequence[int] | None = None) -> nn.Module:
    """torchvision's resnet34 (BasicBlock, [3, 4, 6, 3])."""
    return _named("resnet34", num_classes, in_channels, widths)


def resnet50(num_classes: int = 1000, *, in_channels: int = 3,
             widths: Sequence[int] | None = None) -> nn.Module:
    """torchvision's resnet50 (Bottleneck, [3, 4, 6, 3])."""
    return _named("resnet50", num_classes, in_channels, widths)


def resnet20(num_classes: int = 10, *, in_channels: int = 3,
             widths: Sequence[int] | None = None) -> nn.Module:
    """He et al.'s CIFAR ResNet-20 (BasicBlock, [3, 3, 3], 16/32/64 channels)."""
    return _named("resnet20", num_classes, in_channels, widths)


def resnet56(num_classes: int = 10, *, in_channels: int = 3,
             widths: Sequence[int] | None = None) -> nn.Module:
    """He et al.'s CIFAR ResNet-56 (BasicBlock, [9, 9, 9])."""
    return _named("resnet56", num_classes, in_channels, widths)


def vgg(name: str, num_classes: int = 1000, *, in_channels: int = 3,
        widths: Sequence[int] | None = None) -> nn.Module:
    """torchvision's ``vgg11``, ``vgg16``, ``vgg11_bn`` or ``vgg16_bn``; ``widths``: conv
    widths then the classifier's hidden widths."""
    return _named(name, num_classes, in_channels, widths)
