"""Models. The default ConvNet, a ResNet-18-size preset for heavier GPU work, and a UNet for
segmentation.

Anything else arrives by ``_target_`` (``conf/model/*.yaml``): a callable that takes
``num_classes`` and ``in_channels`` (filled in from the dataset) plus its own config keys.

Both use a plain mean over H×W instead of ``AdaptiveAvgPool2d``, whose CUDA backward has no
deterministic kernel (it raises under ``use_deterministic_algorithms``).
"""

from __future__ import annotations

import torch
from torch import nn

from repro.base.errors import ConfigError
from repro.components.ops import Upsample2x


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


def _double_conv(cin: int, cout: int, groups: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False),
        nn.GroupNorm(min(groups, cout), cout),
        nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False),
        nn.GroupNorm(min(groups, cout), cout),
        nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    """A small UNet: ``depth`` times (two 3×3 conv + GroupNorm + ReLU, then a 2×2 max-pool),
    a bottleneck, and back up: bilinear 2× upsampling, concatenation with the skip, two
    convolutions; a 1×1 convolution gives the per-pixel logits. Channels: ``width × 2^level``.

    ``upsample="repro"`` upsamples with :class:`repro.components.ops.Upsample2x` (gather form forward
    and backward: strict mode at fast mode's speed); ``"torch"`` with ``nn.Upsample``,
    whose deterministic CUDA backward is a sort (``repro doctor --cost``
    shows the difference). GroupNorm: per-sample statistics, so micro-batching cannot change
    them. Image sides must be multiples of ``2^depth``."""

    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        width: int = 32,
        depth: int = 4,
        groups: int = 8,
        upsample: str = "repro",
    ) -> None:
        super().__init__()
        if upsample not in ("repro", "torch"):
            raise ConfigError(
                f"model.upsample={upsample!r} is invalid; allowed: repro (deterministic and "
                "fast on CUDA), torch (nn.Upsample)."
            )
        if depth < 1 or width < 1:
            raise ConfigError("model: UNet needs depth >= 1 and width >= 1.")
        self.depth = depth
        chans = [width * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList(
            [_double_conv(in_channels, chans[0], groups)]
            + [_double_conv(chans[i], chans[i + 1], groups) for i in range(depth)]
        )
        self.pool = nn.MaxPool2d(2)
        self.up = nn.ModuleList(
            [
                Upsample2x()
                if upsample == "repro"
                else nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
                for _ in range(depth)
            ]
        )
        self.merge = nn.ModuleList(
            [_double_conv(chans[i + 1] + chans[i], chans[i], groups) for i in range(depth)]
        )
        self.head = nn.Conv2d(chans[0], num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = 2**self.depth
        if x.shape[-2] % side or x.shape[-1] % side:
            raise ConfigError(
                f"model: a UNet of depth {self.depth} needs image sides divisible by {side}, "
                f"got {x.shape[-2]}×{x.shape[-1]}; change data.image_size or model.depth."
            )
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else self.pool(x))
            skips.append(x)
        x = skips.pop()
        for i in reversed(range(self.depth)):
            x = self.merge[i](torch.cat([self.up[i](x), skips.pop()], dim=1))
        return self.head(x)
