"""Segmentation at each image's own size (``inference.mode=native``): the whole image in one
forward where it fits in a tile, otherwise a sliding window -- nnU-Net's and MONAI's
practice -- made deterministic.

- **Tiles in a fixed order**: along each axis, ``ceil((size - tile) / step) + 1`` starts
  spread evenly from 0 to ``size - tile`` (``step = tile × (1 - overlap)``), rounded; rows
  then columns; cut into batches of ``inference.tile_batch`` tiles in that order.
- **Gaussian weighting**: each tile's logits are weighted by a Gaussian centred on the tile
  (σ = ``inference.sigma`` × the tile's side, nnU-Net's 1/8), so a pixel near a tile's
  border, where the network sees least context, counts least; weights are computed in
  float64 on the CPU, once per tile shape.
- **fp32 accumulation**: logits (float32, also under autocast) × weight are added into the
  image's sum one tile at a time in tile order, then divided by the summed weights:
  elementwise adds in a fixed order, no atomics, so the same bits on every call.
- **Mirroring** (``inference.mirror``): each tile's logits are the mean of the network's on
  the tile as it is, flipped left-right, flipped up-down, and both (flipped back), in that
  order.

An image smaller than a tile is padded to the tile (with the value 0 of the input as read,
as a training patch is padded) and the logits cropped back. A network's output for a tile
can differ in its last bits with the batch it runs in (other kernels for another batch
size), so ``tile_batch`` is part of the result: it is a config key, recorded and hashed
with the rest. One image's tiles are batched together, never with another image's, so an
image's prediction does not depend on which images come with it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from repro.base.errors import ConfigError


@dataclass(frozen=True)
class Window:
    """The ``inference`` config: how a segmentation model sees a whole image."""

    mode: str = "pipeline"  # pipeline | native
    tile: tuple[int, int] | None = None  # native: the window (h, w)
    overlap: float = 0.5  # fraction of a tile shared with its neighbour
    sigma: float = 0.125  # Gaussian σ as a fraction of the tile's side
    tile_batch: int = 64  # tiles a forward (part of the bits)
    mirror: bool = False  # test-time mirroring: 4 forwards a tile

    @classmethod
    def from_config(cls, node: Any, image_size: int | None = None) -> Window:
        """From ``cfg.inference`` (None: the defaults); a native run without ``tile`` uses
        ``data.image_size`` × ``data.image_size``, the training patch's size."""
        if node is None:
            return cls()
        tile = node.get("tile")
        if tile is None and image_size:
            tile = (image_size, image_size)
        if tile is not None:
            sides = [tile] if isinstance(tile, int) else list(tile)  # a list or ListConfig
            tile = tuple(int(t) for t in (sides * 2 if len(sides) == 1 else sides))
        window = cls(
            str(node.get("mode", "pipeline")),
            tile,
            float(node.get("overlap", 0.5)),
            float(node.get("sigma", 0.125)),
            int(node.get("tile_batch", 64)),
            bool(node.get("mirror", False)),
        )
        if window.mode == "native" and window.tile is None:
            raise ConfigError(
                "config error: inference.mode=native needs inference.tile=[h,w] (or "
                "data.image_size, the training patch's side); set one."
            )
        return window

    @property
    def native(self) -> bool:
        return self.mode == "native"


def tile_starts(size: int, tile: int, overlap: float) -> list[int]:
    """Where the tiles along one axis of ``size`` pixels start: 0 and ``size - tile`` and
    evenly between, at most ``tile × (1 - overlap)`` apart (one tile when it covers all)."""
    if size <= tile:
        return [0]
    step = max(1.0, tile * (1 - overlap))
    n = math.ceil((size - tile) / step) + 1
    return [round(i * (size - tile) / (n - 1)) for i in range(n)]


@functools.lru_cache(maxsize=8)
def gaussian_weights(tile: tuple[int, int], sigma: float) -> torch.Tensor:
    """A ``tile``-shaped Gaussian importance map (float32, CPU): σ = ``sigma`` × each side,
    peak 1, its smallest values raised to the smallest positive one (none is 0)."""
    axes = []
    for n in tile:
        x = torch.arange(n, dtype=torch.float64) - (n - 1) / 2
        axes.append(torch.exp(-0.5 * (x / max(sigma * n, 1e-6)) ** 2))
    weights = axes[0][:, None] * axes[1][None, :]
    weights = weights / weights.max()
    smallest = weights[weights > 0].min()
    return weights.clamp_min(smallest).to(torch.float32)


def predict_logits(
    forward: Callable[[torch.Tensor], torch.Tensor],
    image: torch.Tensor,
    window: Window,
    pad_value: torch.Tensor | None = None,
    memory_format: torch.memory_format = torch.contiguous_format,
) -> torch.Tensor:
    """The float32 logits (classes × H × W) of one normalised ``C×H×W`` image at its own
    size (see the module docstring). ``forward`` maps an N×C×h×w batch to N×classes×h×w
    logits (the model, under the run's autocast); ``pad_value`` (C, on the image's device):
    what an image smaller than a tile is padded with, per channel (the normalised 0)."""
    assert window.tile is not None
    th, tw = window.tile
    c, h, w = image.shape
    ph, pw = max(h, th), max(w, tw)
    if (ph, pw) != (h, w):  # smaller than a tile: padded up to it, cropped back below
        fill = torch.zeros(c, device=image.device) if pad_value is None else pad_value
        padded = fill.to(image.dtype).view(c, 1, 1).expand(c, ph, pw).clone()
        padded[:, :h, :w] = image
        image = padded
    boxes = [
        (y, x)
        for y in tile_starts(ph, th, window.overlap)
        for x in tile_starts(pw, tw, window.overlap)
    ]
    if len(boxes) == 1:  # the whole image in one forward: its logits as they are
        return _tile_logits(forward, image[None], window.mirror, memory_format)[0][:, :h, :w]
    weight = gaussian_weights((th, tw), window.sigma).to(image.device)
    total = norm = None
    for i in range(0, len(boxes), window.tile_batch):
        part = boxes[i : i + window.tile_batch]
        tiles = torch.stack([image[:, y : y + th, x : x + tw] for y, x in part])
        logits = _tile_logits(forward, tiles, window.mirror, memory_format)
        if total is None:
            total = torch.zeros((logits.shape[1], ph, pw), dtype=torch.float32, device=image.device)
            norm = torch.zeros((ph, pw), dtype=torch.float32, device=image.device)
        for (y, x), tile in zip(part, logits, strict=True):  # in tile order: fixed sums
            total[:, y : y + th, x : x + tw] += tile * weight
            norm[y : y + th, x : x + tw] += weight
    return (total / norm)[:, :h, :w]


def _tile_logits(
    forward: Callable[[torch.Tensor], torch.Tensor],
    tiles: torch.Tensor,
    mirror: bool,
    memory_format: torch.memory_format,
) -> torch.Tensor:
    """float32 logits of a batch of tiles; with ``mirror``, the mean over the 4 flips."""
    out = forward(tiles.contiguous(memory_format=memory_format)).float()
    if not mirror:
        return out
    for dims in ((3,), (2,), (2, 3)):
        flipped = tiles.flip(dims).contiguous(memory_format=memory_format)
        out = out + forward(flipped).float().flip(dims)
    return out / 4


def resize_logits(logits: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``classes×h×w`` float32 logits brought to ``size`` (an image's own), bilinear and
    centre-aligned (``align_corners=False``): the grid :func:`repro.components.data.augment.resize_image`
    took the image from, so a square-trained model's prediction lies on its image."""
    if tuple(logits.shape[-2:]) == tuple(size):
        return logits
    return F.interpolate(logits[None], size=size, mode="bilinear", align_corners=False)[0]
