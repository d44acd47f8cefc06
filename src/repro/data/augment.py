"""Keyed augmentation: every random draw of a sample's augmentation is a pure function of
``(seed, "augment", epoch, index)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from repro.rng import keyed_draws

CROP_PAD = 4


def crop_flip_batch(
    images: torch.Tensor, params: torch.Tensor, pad: int = CROP_PAD, fill: int = 0
) -> torch.Tensor:
    """Pad each image of an N×C×H×W batch with ``pad`` pixels of ``fill``, crop it back to
    H×W at offset (dy, dx) and flip it horizontally if asked, on its device: ``params`` holds
    each sample's (dy, dx, flip). Pure data movement (one gather of every output pixel's
    source), so the bytes equal the naive crop's, image by image (tested)."""
    n, c, h, w = images.shape
    params = params.to(images.device)
    dy, dx, flip = params[:, 0:1], params[:, 1:2], params[:, 2:3].bool()
    rows = dy + torch.arange(h, device=images.device)  # N×H
    cols = dx + torch.arange(w, device=images.device)  # N×W
    cols = torch.where(flip, cols.flip(1), cols)
    padded = F.pad(images, (pad, pad, pad, pad), value=fill).flatten(2)  # N×C×(H+2p)(W+2p)
    source = (rows[:, :, None] * (w + 2 * pad) + cols[:, None, :]).view(n, 1, h * w)
    return padded.gather(2, source.expand(n, c, h * w)).view(n, c, h, w)


def keyed_crop_flip_params(
    seed: int, epochs: torch.Tensor, index: torch.Tensor, pad: int = CROP_PAD
) -> torch.Tensor:
    """Each sample's ``(dy, dx, flip)`` as an N×3 int64 tensor on ``index``'s device: crop
    offsets in ``[0, 2·pad]`` and the flip, from the draws keyed by ``(seed, "augment",
    epoch, index)`` (:func:`repro.rng.keyed_draws`: a few tensor ops for the whole batch)."""
    draws = keyed_draws(seed, "augment", epochs, index, draws=3)
    return torch.stack(
        [draws[:, 0] % (2 * pad + 1), draws[:, 1] % (2 * pad + 1), draws[:, 2] & 1], 1
    )
