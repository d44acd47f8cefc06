"""Models. The default ConvNet, and a ResNet-18-size preset for heavier GPU work.

Anything else arrives by ``_target_`` (``conf/model/*.yaml``): a callable that takes
``num_classes`` and ``in_channels`` (filled in from the dataset) plus its own config keys.

Both use a plain mean over H×W instead of ``AdaptiveAvgPool2d``, whose CUDA backward has no
deterministic kernel (it raises under ``use_deterministic_algorithms``).
"""

from __future__ import annotations

import torch
from torch import nn


def _conv_gn(cin: int, cout: int, stride: int = 1, groups: int = 8) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        nn.GroupNorm(min(groups, cout), cout),
        nn.ReLU(inplace=True),
    )


class ConvNet(nn.Module):
    """Three stages of 3×3 convolutions with GroupNorm, then dropout and a linear head.

    GroupNorm, not BatchNorm: its statistics are per sample, so they do not depend on how a
    batch is cut into micro-batches or spread over processes. Dropout is there so the keyed
    forward randomness is exercised.
    """

    def __init__(
        self, num_classes: int, in_channels: int = 3, width: int = 32, dropout: float = 0.1
    ) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(
            _conv_gn(in_channels, w),
            _conv_gn(w, 2 * w, stride=2),
            _conv_gn(2 * w, 2 * w),
            _conv_gn(2 * w, 4 * w, stride=2),
            _conv_gn(4 * w, 4 * w),
        )
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(4 * w, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x).mean(dim=(2, 3))
        return self.head(self.dropout(x))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for 32×32 inputs (3×3 stem, no max-pool): 11M parameters at width 64."""

    def __init__(
        self, num_classes: int, in_channels: int = 3, width: int = 64, dropout: float = 0.0
    ) -> None:
        super().__init__()
        w = width
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, w, 3, padding=1, bias=False),
            nn.BatchNorm2d(w),
            nn.ReLU(inplace=True),
        )
        layers, cin = [], w
        for i, cout in enumerate((w, 2 * w, 4 * w, 8 * w)):
            for j in range(2):
                layers.append(BasicBlock(cin, cout, stride=2 if (i > 0 and j == 0) else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x)).mean(dim=(2, 3))
        return self.head(self.dropout(x))
