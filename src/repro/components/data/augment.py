"""Augmentation, keyed per sample: the ``augment`` config group (``conf/augment/``).

A pipeline is any callable built from a ``_target_`` (``augment.train``, ``augment.eval``):
called with one sample, ``(image, target)`` -- a ``C×H×W`` tensor at the file's own size,
and a class index or an ``H×W`` mask -- it returns the pair, the image now
``data.image_size`` square. torchvision's v2 transforms are such callables as they are;
albumentations' are, through :func:`albumentations`; so is your own function.

**The image's dtype** (``data.intensity``, :mod:`repro.components.data.intensity`): uint8 for an 8-bit
file under ``auto`` (the loop divides it by 255 on the device), float32 for everything else
(16-bit, float, TIFF, ``.npy``, and any file under ``fixed``, ``percentile`` or ``zscore``:
already mapped when read, so the loop only normalises it). A pipeline returns the dtype it
got. Colour transforms of other libraries (torchvision's ColorJitter, albumentations')
assume floats in [0, 1]: give them ``fixed`` or ``percentile`` inputs.

**Keyed by construction** (:class:`KeyedPipeline`). Before a sample's pipeline runs, the
global torch (CPU), NumPy (legacy) and Python ``random`` states are set from ``(seed,
"augment", epoch, index)`` (and in the main process put back afterwards; a loader worker's
are left so: nothing else draws from them there): a transform that draws from them --
torchvision's, most user code -- draws the same numbers for that sample in any worker, any
process, after any resume, whatever it does not know about keys. A pipeline that accepts a
``generator`` argument gets a ``torch.Generator`` keyed the same way; one that accepts
``key`` gets ``(seed, epoch, index)`` itself. A pipeline that does not say it is keyed
gets its own copy of the sample (one that writes into its input cannot change a stored
image). Before the first step each pipeline is built twice and run on several samples under
several keys, in two orders, at two clock times (:mod:`repro.components.data.pipeline_check`): one whose
output depends on anything but the sample and its key -- a random state of its own, a call
counter, the clock -- is refused in one line naming the transform.

The shipped transforms draw only from their key, so they skip the global states:
:class:`CropFlip` (today's pad, crop and flip: draws counted from the key, so a whole batch
is one vectorised gather, on the host or on the GPU), :class:`Resize`,
:class:`RandomResizedCrop` and :class:`CenterResize` (the ``imagenet`` preset), and
:class:`SegmentationAugment` (geometry for image and mask together, intensity for the image).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from repro.base.errors import ConfigError, DataError, ReproError
from repro.base.rng import derive_seed, keyed_draws
from repro.components.data.sample_settings import SampleSettings
from repro.components.data.splits import IGNORE, stack_images

log = logging.getLogger("repro")

CROP_PAD = 4


def crop_flip_batch(
    images: torch.Tensor, params: torch.Tensor, pad: int = CROP_PAD, fill: int = 0
) -> torch.Tensor:
    """Pad each image of an N×C×H×W batch with ``pad`` pixels of ``fill``, crop it back to
    H×W at offset (dy, dx) and flip it horizontally if asked, on its device: ``params`` holds
    each sample's (dy, dx, flip). Pure data movement (one gather of every output pixel's
    source), so the bytes equal the naive crop's, image by image (tested), in any dtype
    (uint8, float32)."""
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
    epoch, index)`` (:func:`repro.base.rng.keyed_draws`: a few tensor ops for the whole batch)."""
    draws = keyed_draws(seed, "augment", epochs, index, draws=3)
    return torch.stack(
        [draws[:, 0] % (2 * pad + 1), draws[:, 1] % (2 * pad + 1), draws[:, 2] & 1], 1
    )


# ------------------------------------------------------------------- the shipped transforms


def resize_image(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """A uint8 or float32 ``C×H×W`` image resized to ``size`` (h, w): bilinear with
    antialiasing, in its own dtype -- uint8 in PyTorch's fixed-point path (the same bytes
    wherever this CPU code runs), float32 in float32 (deterministic on the machine; its
    weights are positive, so no value leaves the image's range)."""
    if tuple(image.shape[-2:]) == tuple(size):
        return image
    x = image[None].contiguous(memory_format=torch.channels_last)
    out = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)
    return out[0].contiguous()


def resize_mask(mask: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """An ``H×W`` class mask resized to ``size`` by nearest neighbour on the image's grid: no
    class invented, and no shift. :func:`resize_image` is centre-aligned (``align_corners=
    False``: output pixel ``i`` covers source ``[i·h/size, (i+1)·h/size)``), so the mask takes
    the source pixel under each output pixel's centre (:func:`source_pixels`). Top-left
    nearest (``floor(i·h/size)``, PyTorch's ``nearest``) would put every mask up to half an
    output pixel down and right of its image."""
    if tuple(mask.shape[-2:]) == tuple(size):
        return mask
    rows = source_pixels(mask.shape[-2], size[0])
    return mask[rows[:, None], source_pixels(mask.shape[-1], size[1])]


def source_pixels(n: int, size: int, device: torch.device | None = None) -> torch.Tensor:
    """For each of ``size`` output pixels along an axis of ``n`` source pixels, the source
    pixel under its centre, ``floor((i + ½)·n/size)``, in exact integers (PyTorch's
    ``nearest-exact`` away from ties). Where a centre falls exactly on the border of two
    source pixels (every pixel of a 2× or 4× reduction), the earlier one is taken for even
    ``i`` and the later for odd ``i``: a fixed side would shift the mask by a quarter of an
    output pixel at 2×, alternating leaves no shift on average."""
    i = torch.arange(size, device=device)
    centre = (2 * i + 1) * n
    pixel = centre // (2 * size)
    tie = (centre % (2 * size) == 0) & (pixel > 0)
    return pixel - (tie & (i % 2 == 0)).long()


def _square(size: int | None, image: torch.Tensor) -> tuple[int, int]:
    return (size, size) if size else tuple(image.shape[-2:])


def _resized(image: torch.Tensor, target: Any, size: tuple[int, int]) -> tuple[torch.Tensor, Any]:
    """Image and (if a mask) target resized to ``size``."""
    image = resize_image(image, size)
    if isinstance(target, torch.Tensor) and target.dim() == 2:
        target = resize_mask(target, size)
    return image, target


class Resize:
    """Every image (and mask) resized to ``size`` × ``size``, aspect ratio not kept (what
    ``image_folder`` did when it read a file); None leaves the size as it is. No randomness:
    an evaluation pipeline, and the first part of :class:`CropFlip`."""

    keyed = True  # draws nothing: no global state to key

    def __init__(self, size: int | None = None) -> None:
        self.size = size

    def __call__(self, image: torch.Tensor, target: Any) -> tuple[torch.Tensor, Any]:
        return _resized(image, target, _square(self.size, image))

    def keyed_batch(self, images, targets, seed, epochs, index):  # noqa: ANN001, ANN201
        return images, targets  # a batch is stacked: already one size (see fits_batch)

    def fits_batch(self, images: torch.Tensor) -> bool:
        return self.size is None or tuple(images.shape[-2:]) == (self.size, self.size)


class CropFlip(Resize):
    """The default augmentation: resized to ``size`` (if not already), padded by ``pad``
    pixels, cropped back at a random offset and flipped horizontally half the time; a mask
    gets its image's very crop and flip, its border :data:`IGNORE`. The offsets and the flip
    are counted from the sample's key (:func:`keyed_crop_flip_params`), so a whole batch is
    one vectorised gather (:meth:`keyed_batch`), on the host or on the GPU
    (``loader=device``), with the bytes of the sample-by-sample call."""

    def __init__(self, size: int | None = None, pad: int = CROP_PAD) -> None:
        super().__init__(size)
        if pad < 0:
            raise ConfigError(f"config error: augment.train.pad={pad} is invalid; allowed: >= 0.")
        self.pad = pad

    def __call__(
        self, image: torch.Tensor, target: Any, *, key: tuple[int, int, int]
    ) -> tuple[torch.Tensor, Any]:
        image, target = super().__call__(image, target)
        seed, epoch, index = key
        one = torch.tensor([index])
        is_mask = isinstance(target, torch.Tensor) and target.dim() == 2
        images, targets = self.keyed_batch(
            image[None],
            target[None] if is_mask else torch.tensor([0]),
            seed,
            torch.tensor([epoch]),
            one,
        )
        return images[0], targets[0] if is_mask else target

    def keyed_batch(
        self,
        images: torch.Tensor,
        targets: torch.Tensor,
        seed: int,
        epochs: torch.Tensor,
        index: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A stacked batch (N×C×H×W, the targets N or N×H×W) on any device, cropped and
        flipped with each sample's keyed draws."""
        params = keyed_crop_flip_params(seed, epochs, index, self.pad)
        images = crop_flip_batch(images, params, self.pad)
        if targets.dim() == 3:  # per-pixel masks move with their images
            targets = crop_flip_batch(targets[:, None], params, self.pad, fill=IGNORE)[:, 0]
        elif targets.dim() != 1:
            raise DataError(
                f"augment: the crop and flip move class labels (N) and masks (N×H×W), not "
                f"targets of shape {tuple(targets.shape)}; choose augment=none or a pipeline "
                "of your own."
            )
        return images, targets


class RandomResizedCrop:
    """A random part of the image -- ``scale`` of its area, aspect ratio in ``ratio`` (log
    uniform), as torchvision draws it -- resized to ``size`` × ``size``, and a horizontal
    flip with probability ``flip`` (masks: nearest, the same crop and flip). Draws from the
    keyed ``generator`` only."""

    keyed = True

    def __init__(
        self,
        size: int,
        scale: Sequence[float] = (0.08, 1.0),
        ratio: Sequence[float] = (3 / 4, 4 / 3),
        flip: float = 0.5,
    ) -> None:
        if not size or size < 1 or not 0 < scale[0] <= scale[1] <= 1 or ratio[0] > ratio[1]:
            raise ConfigError(
                f"config error: augment RandomResizedCrop(size={size}, scale={list(scale)}, "
                f"ratio={list(ratio)}) is invalid; allowed: size >= 1, 0 < scale[0] <= "
                "scale[1] <= 1, ratio[0] <= ratio[1]."
            )
        self.size, self.scale, self.ratio, self.flip = int(size), tuple(scale), tuple(ratio), flip

    def __call__(
        self, image: torch.Tensor, target: Any, *, generator: torch.Generator
    ) -> tuple[torch.Tensor, Any]:
        h, w = image.shape[-2:]
        top, left, ch, cw = self._box(h, w, generator)
        image = image[:, top : top + ch, left : left + cw]
        if isinstance(target, torch.Tensor) and target.dim() == 2:
            target = target[top : top + ch, left : left + cw]
        image, target = _resized(image, target, (self.size, self.size))
        if float(torch.rand((), generator=generator)) < self.flip:
            image = image.flip(-1)
            if isinstance(target, torch.Tensor) and target.dim() == 2:
                target = target.flip(-1)
        return image, target

    def _box(self, h: int, w: int, g: torch.Generator) -> tuple[int, int, int, int]:
        area, log_ratio = h * w, (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            u = torch.rand(4, generator=g, dtype=torch.float64).tolist()
            target_area = area * (self.scale[0] + u[0] * (self.scale[1] - self.scale[0]))
            aspect = math.exp(log_ratio[0] + u[1] * (log_ratio[1] - log_ratio[0]))
            cw = int(round(math.sqrt(target_area * aspect)))
            ch = int(round(math.sqrt(target_area / aspect)))
            if 0 < cw <= w and 0 < ch <= h:
                return int(u[2] * (h - ch + 1)), int(u[3] * (w - cw + 1)), ch, cw
        # no box fits in ten draws: the centre, with the ratio clamped (as torchvision does)
        ratio = w / h
        if ratio < self.ratio[0]:
            cw, ch = w, int(round(w / self.ratio[0]))
        elif ratio > self.ratio[1]:
            ch, cw = h, int(round(h * self.ratio[1]))
        else:
            cw, ch = w, h
        return (h - ch) // 2, (w - cw) // 2, ch, cw


class CenterResize:
    """The evaluation half of the ``imagenet`` preset: the shorter side resized to
    ``resize`` (default: ``size`` × 256/224), then the centre ``size`` × ``size`` cut out."""

    keyed = True

    def __init__(self, size: int, resize: int | None = None) -> None:
        self.size = int(size)
        self.resize = int(resize or round(size * 256 / 224))

    def __call__(self, image: torch.Tensor, target: Any) -> tuple[torch.Tensor, Any]:
        h, w = image.shape[-2:]
        scale = self.resize / min(h, w)
        shape = (max(self.size, round(h * scale)), max(self.size, round(w * scale)))
        image, target = _resized(image, target, shape)
        top, left = (shape[0] - self.size) // 2, (shape[1] - self.size) // 2
        image = image[:, top : top + self.size, left : left + self.size].contiguous()
        if isinstance(target, torch.Tensor) and target.dim() == 2:
            target = target[top : top + self.size, left : left + self.size].contiguous()
        return image, target


class SegmentationAugment:
    """Segmentation's augmentation: the image and its mask resized to ``size``, then moved
    together -- rotated by up to ``degrees``, scaled in ``scale``, shifted by up to
    ``translate`` of the size, flipped horizontally half the time (the image bilinear, the
    mask nearest, the pixels moved in from outside :data:`IGNORE` in the mask) -- then the
    image alone brightened and contrasted by factors in ``1 ± brightness``, ``1 ±
    contrast``. With ``elastic`` > 0, also deformed elastically along a smooth random
    field: displacements drawn in ±``elastic`` output pixels on an ``elastic_grid`` ×
    ``elastic_grid`` lattice and interpolated bicubically (which overshoots the lattice's
    values a little between its points: up to about 1.3 × ``elastic``); image and mask by
    the same field.
    Draws from the keyed ``generator`` only (``elastic`` 0 draws no more than before, so the
    default's bits are unchanged). Keeps the image's dtype: uint8 rounded and clamped to
    0..255, float32 (already mapped) neither."""

    keyed = True

    def __init__(
        self,
        size: int,
        degrees: float = 15.0,
        scale: Sequence[float] = (0.9, 1.1),
        translate: float = 0.1,
        flip: float = 0.5,
        brightness: float = 0.2,
        contrast: float = 0.2,
        elastic: float = 0.0,
        elastic_grid: int = 4,
    ) -> None:
        self.size, self.degrees, self.scale = int(size), float(degrees), tuple(scale)
        self.translate, self.flip = float(translate), float(flip)
        self.brightness, self.contrast = float(brightness), float(contrast)
        if not (math.isfinite(float(elastic)) and float(elastic) >= 0) or int(elastic_grid) < 2:
            raise ConfigError(
                f"config error: augment SegmentationAugment(elastic={elastic!r}, "
                f"elastic_grid={elastic_grid!r}) is invalid; allowed: elastic >= 0 (pixels) "
                "and elastic_grid >= 2."
            )
        self.elastic, self.elastic_grid = float(elastic), int(elastic_grid)

    def __call__(
        self, image: torch.Tensor, target: Any, *, generator: torch.Generator
    ) -> tuple[torch.Tensor, Any]:
        image, target = _resized(image, target, (self.size, self.size))
        u = torch.rand(7, generator=generator, dtype=torch.float64).tolist()
        angle = math.radians(self.degrees * (2 * u[0] - 1))
        zoom = self.scale[0] + u[1] * (self.scale[1] - self.scale[0])
        tx, ty = self.translate * (2 * u[2] - 1), self.translate * (2 * u[3] - 1)
        mirror = -1.0 if u[4] < self.flip else 1.0
        # where each output pixel comes from, in [-1, 1] coordinates: the inverse map
        cos, sin = math.cos(angle) / zoom, math.sin(angle) / zoom
        theta = torch.tensor([[mirror * cos, -sin, tx], [mirror * sin, cos, ty]])
        grid = F.affine_grid(theta[None], [1, 1, self.size, self.size], align_corners=False)
        if self.elastic:
            g = self.elastic_grid
            field = torch.rand(1, 2, g, g, generator=generator, dtype=torch.float64)
            field = (2 * field - 1).float() * (2 * self.elastic / self.size)  # pixels -> [-1, 1]
            smooth = F.interpolate(
                field, size=(self.size, self.size), mode="bicubic", align_corners=True
            )
            grid = grid + smooth.permute(0, 2, 3, 1)
        moved = F.grid_sample(image[None].float(), grid, mode="bilinear", align_corners=False)
        image = _brightness_contrast(
            moved[0], 1 + self.brightness * (2 * u[5] - 1), 1 + self.contrast * (2 * u[6] - 1),
            image.dtype,
        )  # fmt: skip
        if isinstance(target, torch.Tensor) and target.dim() == 2:
            both = torch.stack([target.float(), torch.ones_like(target, dtype=torch.float32)])
            moved = F.grid_sample(both[None], grid, mode="nearest", align_corners=False)[0]
            inside = moved[1] > 0.5
            target = torch.where(inside, moved[0], float(IGNORE)).to(target.dtype)
        return image, target


class RandomPatch:
    """Training at each image's own scale (``augment=patches``): a ``size`` × ``size`` patch
    cut from the image where a keyed draw puts it, nothing resized;
    where the image is smaller than the patch it sits at a drawn place inside it, padded
    with 0 (its mask with :data:`IGNORE`: not scored). Then flipped left-right and up-down,
    each with probability ``flip``, and turned by a drawn multiple of 90°
    (``rotate``); the image alone scaled by brightness and contrast factors in ``1 ±
    brightness`` and ``1 ± contrast``. The geometry is pure data movement, so the mask keeps
    its image's very grid. Draws from the keyed ``generator`` only. Evaluation then runs at
    each image's own size (``inference.mode=native``)."""

    keyed = True

    def __init__(
        self,
        size: int,
        flip: float = 0.5,
        rotate: bool = True,
        brightness: float = 0.0,
        contrast: float = 0.0,
    ) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(
                f"config error: augment RandomPatch(size={size!r}) is invalid; allowed: an "
                "integer >= 1 (the patch's side: data.image_size)."
            )
        self.size = size
        self.flip, self.rotate = float(flip), bool(rotate)
        self.brightness, self.contrast = float(brightness), float(contrast)

    def __call__(
        self, image: torch.Tensor, target: Any, *, generator: torch.Generator
    ) -> tuple[torch.Tensor, Any]:
        u = torch.rand(7, generator=generator, dtype=torch.float64).tolist()
        (ph, pw), (c, h, w) = (self.size, self.size), image.shape
        ys, yd, hh = _placement(h, ph, u[0])
        xs, xd, ww = _placement(w, pw, u[1])
        patch = image.new_zeros((c, ph, pw))
        patch[:, yd : yd + hh, xd : xd + ww] = image[:, ys : ys + hh, xs : xs + ww]
        is_mask = isinstance(target, torch.Tensor) and target.dim() == 2
        if is_mask:
            mask = target.new_full((ph, pw), IGNORE)
            mask[yd : yd + hh, xd : xd + ww] = target[ys : ys + hh, xs : xs + ww]
        dims = [d for d, draw in ((-1, u[2]), (-2, u[3])) if draw < self.flip]
        turns = int(u[4] * 4) if self.rotate else 0
        patch = torch.rot90(patch.flip(dims), turns, (-2, -1)) if dims or turns else patch
        if is_mask:
            target = torch.rot90(mask.flip(dims), turns, (-2, -1)) if dims or turns else mask
        if self.brightness or self.contrast:
            patch = _brightness_contrast(
                patch, 1 + self.brightness * (2 * u[5] - 1), 1 + self.contrast * (2 * u[6] - 1)
            )
        return patch.contiguous(), target.contiguous() if is_mask else target


def _placement(n: int, size: int, u: float) -> tuple[int, int, int]:
    """Along one axis of ``n`` pixels, a patch of ``size``: (source start, start in the
    patch, length), drawn by ``u`` in [0, 1)."""
    if n >= size:
        return int(u * (n - size + 1)), 0, size
    return 0, int(u * (size - n + 1)), n


def _brightness_contrast(
    image: torch.Tensor, brightness: float, contrast: float, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The image scaled by ``brightness``, then its contrast about its mean by ``contrast``,
    returned as ``dtype`` (the image's own if None): uint8 rounded and clamped to 0..255;
    float32 left as computed. The mean is :func:`image_mean`'s: the same bits whatever the
    thread count."""
    x = image.float() * brightness
    mean = image_mean(x)
    x = (x - mean) * contrast + mean
    return x.round().clamp(0, 255).to(torch.uint8) if (dtype or image.dtype) == torch.uint8 else x


def image_mean(x: torch.Tensor) -> float:
    """The mean of every value of ``x``, summed in float64 by NumPy: one fixed order on one
    thread. torch's own ``x.mean()`` splits a sum of more than 32,768 elements across the
    intra-op threads, so its last bits follow the thread count (a 3 × 128 × 128 image
    already; docs/determinism.md#threads); NumPy's pairwise sum is never threaded, and the
    intensity mapping reduces the same way (:mod:`repro.components.data.intensity`)."""
    return float(np.mean(x.numpy(force=True), dtype=np.float64))


class Compose:
    """Transforms one after another. Those taking a ``generator`` share the sample's one
    (each draws on where the one before stopped); those taking a ``key`` get the sample's
    key, the second and later with their place in the list folded into it, so that two of
    them (two :class:`CropFlip`) do not draw the same numbers."""

    def __init__(self, transforms: Sequence[Callable]) -> None:
        self.transforms = list(transforms)
        self.keyed = all(getattr(t, "keyed", False) for t in self.transforms)

    def __call__(
        self,
        image: torch.Tensor,
        target: Any,
        *,
        key: tuple[int, int, int],
        generator: torch.Generator,
    ) -> tuple[torch.Tensor, Any]:
        seed, epoch, index = key
        for place, t in enumerate(self.transforms):
            own = key if place == 0 else (derive_seed(seed, "augment-compose", place), epoch, index)
            image, target = _call(t, image, target, own, generator)
        return image, target


def albumentations(transforms: Sequence[Any], **compose: Any) -> Callable:
    """An albumentations pipeline (``pip install -e '.[albumentations]'``) as a pipeline of
    this project: ``A.Compose(transforms, **compose)`` called on the image as HWC NumPy and
    the mask (a class label passes by), reseeded from the sample's key before each call
    (albumentations 2 draws from a generator of its own)."""
    try:
        import albumentations as A
    except ImportError as err:
        raise ConfigError(
            "config error: augment with albumentations needs the albumentations package: "
            "pip install -e '.[albumentations]'."
        ) from err
    return _Albumentations(A.Compose(list(transforms), **compose))


class _Albumentations:
    def __init__(self, compose: Any) -> None:
        self.compose = compose
        self.transforms = list(getattr(compose, "transforms", []))

    def __call__(
        self, image: torch.Tensor, target: Any, *, key: tuple[int, int, int]
    ) -> tuple[torch.Tensor, Any]:
        if hasattr(self.compose, "set_random_seed"):  # albumentations >= 2: its own generator
            self.compose.set_random_seed(derive_seed(*key[:1], "augment-albumentations", *key[1:]))
        mask = isinstance(target, torch.Tensor) and target.dim() == 2
        inputs = {"image": np.ascontiguousarray(image.permute(1, 2, 0).numpy())}
        if mask:
            inputs["mask"] = target.numpy()
        out = self.compose(**inputs)
        image = torch.from_numpy(np.ascontiguousarray(out["image"])).permute(2, 0, 1)
        if mask:
            target = torch.from_numpy(np.ascontiguousarray(out["mask"]))
        return image.contiguous(), target


class TorchvisionMasks:
    """torchvision's v2 transforms for segmentation (``augment=torchvision_segmentation``):
    the image and mask resized to ``size`` by :class:`Resize` first (the image antialiased,
    the mask on its grid: v2's ``Resize`` and ``RandomResizedCrop`` sample a ``Mask`` at the
    top-left of each output pixel, half a pixel off), then ``transforms`` (a list, or one v2
    transform) called on a ``tv_tensors.Image`` and a ``tv_tensors.Mask`` -- a plain tensor
    beside an image passes through every v2 transform untouched -- and returned as plain
    tensors. What a geometric transform moves in from outside is 255 in the mask (not
    scored): the mask goes through as ``class + 1``, with 0 (v2's default fill; leave the
    transforms' ``fill`` for masks at it) read back as 255. A class label passes by. Keyed
    per sample as any pipeline: v2 draws from the global torch state."""

    def __init__(self, transforms: Any, size: int | None = None) -> None:
        try:
            from torchvision.transforms import v2
        except Exception as err:  # not installed, or a build that does not fit torch's
            raise ConfigError(
                f"config error: augment with TorchvisionMasks needs torchvision, whose import "
                f"fails here ({type(err).__name__}: {err}): make add PKG=torchvision."
            ) from None

        self.resize = Resize(size)
        listed = list(transforms) if isinstance(transforms, list | tuple) else [transforms]
        self.v2 = v2.Compose(listed)

    def __call__(self, image: torch.Tensor, target: Any) -> tuple[torch.Tensor, Any]:
        from torchvision import tv_tensors

        image, target = self.resize(image, target)
        if not (isinstance(target, torch.Tensor) and target.dim() == 2):
            return self.v2(tv_tensors.Image(image)).as_subclass(torch.Tensor), target
        shifted = tv_tensors.Mask(target.long() + 1)  # 0: moved in from outside
        image, mask = self.v2(tv_tensors.Image(image), shifted)
        mask = mask.as_subclass(torch.Tensor)
        mask = torch.where(mask == 0, IGNORE, mask - 1).to(target.dtype)
        return image.as_subclass(torch.Tensor), mask


# --------------------------------------------------------------------------- keying


def _accepts(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params


def _call(
    fn: Callable,
    image: torch.Tensor,
    target: Any,
    key: tuple[int, int, int],
    generator: torch.Generator | None = None,
) -> Any:
    """``fn(image, target)``, with the ``key`` or keyed ``generator`` it accepts (the given
    one, or one made from the key)."""
    kwargs: dict[str, Any] = {}
    if _accepts(fn, "key"):
        kwargs["key"] = key
    if _accepts(fn, "generator"):
        if generator is None:
            seed, epoch, index = key
            generator = torch.Generator().manual_seed(
                derive_seed(seed, "augment-generator", epoch, index)
            )
        kwargs["generator"] = generator
    return fn(image, target, **kwargs)


@contextlib.contextmanager
def keyed_global_state(seed: int, epoch: int, index: int) -> Iterator[None]:
    """Inside: the global torch (CPU), NumPy (legacy) and ``random`` states set from
    ``(seed, "augment", epoch, index)``; afterwards, what they were -- except in a loader
    worker, whose global states nothing else draws from (saving and restoring NumPy's alone
    costs about 110 µs a sample)."""
    worker = torch.utils.data.get_worker_info() is not None
    saved = None if worker else (torch.get_rng_state(), np.random.get_state(), random.getstate())
    value = derive_seed(seed, "augment-global", epoch, index)
    torch.default_generator.manual_seed(value)  # the CPU's only: CUDA's are the forward's
    np.random.seed([value & 0xFFFFFFFF, value >> 32])
    random.seed(value)
    try:
        yield
    finally:
        if saved is not None:
            torch.set_rng_state(saved[0])
            np.random.set_state(saved[1])
            random.setstate(saved[2])


class KeyedPipeline:
    """A built pipeline and the training seed: called with a sample and its key ``(epoch,
    index)``, it runs the pipeline keyed (see the module docstring) and checks what comes
    out (a C×H×W image of the input's dtype, uint8 or float32; a mask of the image's size)."""

    def __init__(self, pipeline: Callable | None, seed: int, where: str = "augment") -> None:
        self.pipeline, self.seed, self.where = pipeline, seed, where
        # a pipeline of shipped transforms draws only from its key: no global state to set
        self.own_keys = pipeline is None or bool(getattr(pipeline, "keyed", False))
        # what every call runs under, in any process: one thread, this process's flags now
        # (after the determinism layers), carried into the loader's workers with the pipeline
        self.settings = SampleSettings.here()

    @property
    def name(self) -> str:
        return _name(self.pipeline)

    def __call__(self, image: torch.Tensor, target: Any, epoch: int, index: int) -> Any:
        if self.pipeline is None:
            return image, target
        key = (self.seed, int(epoch), int(index))
        try:
            with self.settings.pinned():
                if self.own_keys:
                    out = _call(self.pipeline, image, target, key)
                else:
                    # its own copy: a transform that writes into its input (a Cutout) would
                    # otherwise change an in-memory split's stored image for every later epoch
                    image, target = image.clone(), _copy(target)
                    with keyed_global_state(*key):
                        out = _call(self.pipeline, image, target, key)
        except ReproError:
            raise
        except Exception as err:  # in a loader worker too: the message and the sample kept
            raise DataError(
                f"{self.where}: {self.name} raised {one_line(err)} on sample {index} (epoch "
                f"{epoch}); fix the transform or its config keys."
            ) from err
        return _checked(out, self.name, image.dtype)

    @property
    def size(self) -> int | None:
        return getattr(self.pipeline, "size", None)

    @property
    def device_capable(self) -> bool:
        """Can it run on a batch on the device (``loader=device``): none, or a pipeline
        whose draws are counted from the key, a batch at once (:class:`CropFlip`)."""
        p = self.pipeline
        return p is None or (hasattr(p, "keyed_batch") and hasattr(p, "fits_batch"))

    def identity_on(self, split: Any) -> bool:
        """Does it leave a split in memory as it is (none, or a resize to its own size)?"""
        p = self.pipeline
        images = getattr(split, "images", None)
        return isinstance(images, torch.Tensor) and (
            p is None or (type(p) is Resize and p.fits_batch(images))
        )

    def batched(self, images: Any) -> bool:
        """Can a stacked batch take the vectorised path (:meth:`keyed_batch`)?"""
        fits = getattr(self.pipeline, "fits_batch", None)
        return isinstance(images, torch.Tensor) and (
            self.pipeline is None or fits is not None and fits(images)
        )

    def keyed_batch(self, images: torch.Tensor, targets: torch.Tensor, epochs, index):  # noqa: ANN001, ANN201
        if self.pipeline is None:
            return images, targets
        with self.settings.pinned():
            return self.pipeline.keyed_batch(images, targets, self.seed, epochs, index)

    def samples(self, images: Any, targets: Any, epochs: torch.Tensor, index: torch.Tensor):  # noqa: ANN201
        """Each sample of a fetch through the pipeline, stacked."""
        epochs = epochs.expand(len(index)) if epochs.numel() == 1 else epochs
        out = [
            self(images[i], targets[i], int(epochs[i]), int(index[i])) for i in range(len(index))
        ]
        return stack([o[0] for o in out], self.name), stack_targets([o[1] for o in out])


def _copy(target: Any) -> Any:
    return target.clone() if isinstance(target, torch.Tensor) else target


def one_line(err: BaseException) -> str:
    """``Type: first line of the message``."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def _name(pipeline: Any) -> str:
    if pipeline is None:
        return "none"
    kind = type(pipeline)
    if isinstance(pipeline, functools.partial):
        return _name(pipeline.func)
    if inspect.isfunction(pipeline):
        return f"{pipeline.__module__}.{pipeline.__qualname__}"
    return f"{kind.__module__}.{kind.__qualname__}"


def _checked(out: Any, name: str, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, Any]:
    """``out`` if it is an (image, target) pair whose image is a uint8 or float32 C×H×W
    tensor -- of ``dtype``, the input's, when given: uint8 stays uint8 (the loop divides it
    by 255), float32 stays float32 (already mapped) -- and whose mask has its size."""
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise DataError(
            f"augment: {name} returned {type(out).__name__}, not (image, target); a pipeline "
            "takes one sample's (image, target) and returns the pair."
        )
    image, target = out
    if (
        not isinstance(image, torch.Tensor)
        or image.dtype not in (torch.uint8, torch.float32)
        or image.dim() != 3
    ):
        what = (
            f"a {image.dtype} tensor of shape {tuple(image.shape)}"
            if isinstance(image, torch.Tensor)
            else type(image).__name__
        )
        raise DataError(
            f"augment: {name} returned {what} as the image, not a uint8 or float32 C×H×W "
            "tensor; end the pipeline on one (torchvision: no ToDtype/Normalize, the loop "
            "normalises)."
        )
    if dtype is not None and image.dtype != dtype:
        raise DataError(
            f"augment: {name} turned a {dtype} image into a {image.dtype} one; a pipeline "
            "returns the dtype it gets (uint8: the loop divides by 255; float32: already "
            "mapped by data.intensity), so no ToDtype or Normalize."
        )
    if isinstance(target, torch.Tensor) and target.dim() == 2 and target.shape != image.shape[1:]:
        raise DataError(
            f"augment: {name} returned a {tuple(target.shape)} mask for a "
            f"{tuple(image.shape[1:])} image; geometric transforms must move the mask too."
        )
    return image, target


def stack(images: list[torch.Tensor], name: str) -> torch.Tensor:
    shapes = {tuple(i.shape) for i in images}
    if len(shapes) > 1:
        raise DataError(
            f"augment: {name} returned images of several sizes "
            f"({', '.join(str(x) for x in sorted(shapes)[:3])}); end the pipeline with a resize "
            "or crop to data.image_size."
        )
    return stack_images(images)


def stack_targets(targets: list[Any]) -> torch.Tensor:
    if isinstance(targets[0], torch.Tensor) and targets[0].dim() == 2:
        return torch.stack(targets)
    return torch.tensor([int(t) for t in targets], dtype=torch.int64)
