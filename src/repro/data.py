"""Datasets, keyed augmentation, the resumable keyed sampler and the loader factory.

Layer 3 of the defense. The sampler yields micro-batches of *keys* ``(epoch, index)``, not
bare indices; :class:`KeyedBatches` derives each sample's augmentation draws from
``(seed, "augment", epoch, index)`` (counter-based: :func:`repro.rng.keyed_draws`). Which
worker loads a sample, how many workers there are, and whether the batch is cut on the host
or on the GPU cannot change them.

A dataset is any function that returns :class:`DataSplits`; a config selects it with
``_target_`` (see ``conf/data/``). Its splits are in memory (:class:`TensorImages`) or read
from disk when fetched (:class:`LazyImageMasks`); both answer ``len`` and ``fetch(index)``.
Images are uint8 ``C×H×W`` tensors; they become floats on the device
(:class:`DeviceNormalizer`), where the conversion is cheap and the transfer 4× smaller.
Targets are class indices, or per-pixel class masks ``H×W`` that the augmentation moves
with their image.
"""

from __future__ import annotations

import errno
import logging
import math
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from repro.errors import DataError, ReproError
from repro.rng import keyed_draws, keyed_generator, keyed_permutation, worker_init_fn

log = logging.getLogger("repro")

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


@dataclass
class TensorImages:
    """An in-memory split: ``images`` uint8 N×C×H×W; ``labels`` the targets: class indices
    (int64, N) or per-pixel class masks (uint8 or int64, N×H×W, the images' H×W)."""

    images: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.dim() != 4:
            raise ValueError("images must be a uint8 tensor of shape N×C×H×W")
        if len(self.images) != len(self.labels):
            raise ValueError("images and labels differ in length")
        if self.labels.dim() == 3:
            if self.labels.shape[1:] != self.images.shape[2:]:
                raise ValueError("masks must have the images' height and width (N×H×W)")
            if self.labels.dtype.is_floating_point or self.labels.dtype == torch.bool:
                raise ValueError("masks must hold class indices (an integer dtype)")
            if self.labels.dtype not in (torch.uint8, torch.int64):
                self.labels = self.labels.to(torch.int64)
        elif self.labels.dim() == 1:
            self.labels = self.labels.to(torch.int64)
        else:
            raise ValueError(
                "targets must be class labels (N) or per-pixel class masks (N×H×W), got "
                f"shape {tuple(self.labels.shape)}"
            )

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def channels(self) -> int:
        return int(self.images.shape[1])

    @property
    def device(self) -> torch.device:
        return self.images.device

    def fetch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The images and targets at ``index`` (int64; on the split's device)."""
        return self.images[index], self.labels[index]

    def to(self, device: torch.device) -> TensorImages:
        return TensorImages(self.images.to(device), self.labels.to(device))


class Split(Protocol):
    """What a split is to the loader, the evaluation and the trace: :class:`TensorImages`
    (in memory) and :class:`LazyImageMasks` (read when fetched) are two; a split of your own
    needs these three members (``to`` for ``loader=device``, ``device`` if it lives on one)."""

    channels: int

    def __len__(self) -> int: ...

    def fetch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 images N×C×H×W and the targets (labels N or masks N×H×W) at ``index``."""
        ...


@dataclass
class DataSplits:
    """What a dataset factory returns: a training and a validation split plus metadata."""

    train: Split
    val: Split
    num_classes: int
    augment: bool = True
    mean: tuple[float, ...] | None = None  # per channel, in [0, 1]; computed from train if None
    std: tuple[float, ...] | None = None
    test: Split | None = None  # held out until the end (trainer.test, repro evaluate)

    def __post_init__(self) -> None:
        if self.mean is None or self.std is None:
            self.mean, self.std = channel_statistics(statistics_sample(self.train))

    @property
    def in_channels(self) -> int:
        return self.train.channels


# At most this many training images give the normalisation of a split read from disk.
STATISTICS_SAMPLE = 256


def channel_statistics(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and standard deviation (at least 1e-3) of uint8 N×C×H×W images, in
    [0, 1]: what the inputs are normalised with."""
    x = images.to(torch.float64).div(255)
    return tuple(x.mean(dim=(0, 2, 3)).tolist()), tuple(
        x.std(dim=(0, 2, 3)).clamp_min(1e-3).tolist()
    )


def statistics_sample(split: Split) -> torch.Tensor:
    """The images the channel mean and std are computed from: all of an in-memory split; the
    first :data:`STATISTICS_SAMPLE` (in file order) of one read from disk (images only)."""
    if isinstance(split, TensorImages):
        return split.images
    index = torch.arange(min(len(split), STATISTICS_SAMPLE))
    if isinstance(split, LazyImageMasks):
        return split.fetch_images(index)
    return split.fetch(index)[0]


# --------------------------------------------------------------------------- datasets


def synthetic(
    seed: int = 1234,
    num_classes: int = 10,
    train_size: int = 4096,
    val_size: int = 1024,
    image_size: int = 32,
    noise: float = 0.35,
    augment: bool = True,
    test_size: int = 0,
) -> DataSplits:
    """A learnable image-classification set generated from ``seed`` (the *data* seed), with
    a test split of ``test_size`` samples when it is not 0 (generated from its own keyed
    stream: the training and validation samples do not depend on it).

    Class c is an oriented sinusoidal grating (angle and frequency set by c) tinted with a
    class colour; every sample gets a random phase, contrast, slight rotation and Gaussian
    noise, so the task needs a few hundred SGD steps, not one.
    """
    if num_classes < 2 or train_size < 1 or val_size < 1 or image_size < 8 or test_size < 0:
        raise DataError(
            "data: synthetic needs num_classes >= 2, train_size/val_size >= 1, "
            "test_size >= 0 and image_size >= 8; fix the data.* values."
        )
    palette = torch.rand(num_classes, 3, generator=keyed_generator(seed, "synthetic-palette"))
    palette = 0.35 + 0.65 * palette

    def make(split: str, n: int) -> TensorImages:
        g = keyed_generator(seed, "synthetic-" + split)
        labels = torch.arange(n) % num_classes
        labels = labels[torch.randperm(n, generator=g)]
        angle = math.pi * labels / num_classes + 0.15 * torch.randn(n, generator=g)
        freq = 1.5 + (labels % 4).to(torch.float32) * 0.9
        phase = 2 * math.pi * torch.rand(n, generator=g)
        contrast = 0.5 + 0.5 * torch.rand(n, generator=g)
        coords = torch.linspace(-0.5, 0.5, image_size)
        yy, xx = torch.meshgrid(coords, coords, indexing="ij")
        proj = (
            xx[None] * torch.cos(angle)[:, None, None] + yy[None] * torch.sin(angle)[:, None, None]
        )
        wave = torch.sin(2 * math.pi * freq[:, None, None] * proj + phase[:, None, None])
        img = (
            0.5
            + 0.45
            * contrast[:, None, None, None]
            * wave[:, None]
            * palette[labels][:, :, None, None]
        )
        img = img + noise * torch.randn(n, 3, image_size, image_size, generator=g)
        images = (img.clamp(0, 1) * 255).round().to(torch.uint8)
        return TensorImages(images, labels)

    test = make("test", test_size) if test_size else None
    return DataSplits(
        make("train", train_size), make("val", val_size), num_classes, augment, test=test
    )


def keyed_split(
    n: int, val_fraction: float, seed: int, purpose: str, path: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(training, validation) indices of ``n`` files in sorted order: a permutation keyed by
    ``(seed, purpose)`` holds out ``val_fraction`` (at least one), so the same folder gives
    the same splits everywhere."""
    order = keyed_permutation(n, seed, purpose)
    n_val = max(1, round(val_fraction * n))
    if n_val >= n:
        raise DataError(f"data.path={path!r}: too few images to hold out data.val_fraction.")
    return order[n_val:].sort().values, order[:n_val].sort().values


def image_folder(
    path: str,
    image_size: int = 32,
    val_fraction: float = 0.1,
    seed: int = 1234,
    augment: bool = True,
    in_memory: bool = False,
    on_bad_image: str = "stop",
    test_fraction: float = 0.0,
) -> DataSplits:
    """Your own images, one sub-folder per class (``root/cat/1.png``, ``root/dog/7.jpg``).

    Classes and files are taken in sorted order and the validation split is a permutation
    keyed by ``seed``, so the same folder gives the same splits everywhere. Each image is
    read and resized to ``image_size``×``image_size`` RGB when fetched, in the loader's
    workers (:class:`LazyImages`: memory does not grow with the folder), or, with
    ``in_memory``, all of them once, up front (faster for a small folder). Both read every
    file with the same function and normalise with the statistics of the same first
    training images (:data:`STATISTICS_SAMPLE`), so they give the same bits.

    ``test_fraction``: a test split held out of the training files by another keyed
    permutation (the validation split stays the one without it; trainer.test, repro
    evaluate). ``on_bad_image``: ``stop`` (a file that cannot be read stops the run with one line
    naming it) or ``skip`` (it is replaced by the next readable file of its split, in file
    order -- the same one in any worker, process or resume -- and named in a warning)."""
    _pillow()
    root = Path(path).expanduser()
    if not root.is_dir():
        raise DataError(
            f"data.path={path!r} is not a directory; point it at a folder with one "
            "sub-folder of images per class."
        )
    if not 0 < val_fraction < 1:
        raise DataError(
            f"data.val_fraction={val_fraction} is invalid; allowed: a number in (0, 1)."
        )
    if on_bad_image not in BAD_IMAGE_CHOICES:
        raise DataError(
            f"data.on_bad_image={on_bad_image!r} is invalid; allowed: "
            f"{' or '.join(BAD_IMAGE_CHOICES)}."
        )
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    files = [
        (f, label)
        for label, name in enumerate(classes)
        for f in sorted((root / name).rglob("*"))
        if f.suffix.lower() in IMAGE_SUFFIXES
    ]
    if len(classes) < 2 or not files:
        raise DataError(
            f"data.path={path!r} holds {len(classes)} class folder(s) and {len(files)} "
            "image(s); it needs at least 2 class sub-folders with images in them."
        )
    labels = torch.tensor([label for _, label in files])
    train_idx, val_idx = keyed_split(len(files), val_fraction, seed, "image-folder-split", path)
    train_idx, test_idx = hold_out_test(
        train_idx, len(files), test_fraction, seed, "image-folder-test", path
    )

    def split(index: torch.Tensor) -> Split:
        lazy = LazyImages([files[i][0] for i in index], labels[index], image_size, on_bad_image)
        return lazy.to(torch.device("cpu")) if in_memory else lazy

    train = split(train_idx)
    # the same first training images, in memory or not (statistics_sample would take all of
    # an in-memory split): the same statistics, so the same bits
    first = torch.arange(min(len(train), STATISTICS_SAMPLE))
    mean, std = channel_statistics(train.fetch(first)[0])
    return DataSplits(
        train,
        split(val_idx),
        len(classes),
        augment,
        mean=mean,
        std=std,
        test=split(test_idx) if test_idx is not None else None,
    )


def hold_out_test(
    train_idx: torch.Tensor, total: int, test_fraction: float, seed: int, key: str, path: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(train, test)``: ``test_fraction`` of all ``total`` files taken out of the training
    indices by a permutation keyed by ``(seed, key)`` (so the validation split is the one
    without a test split); ``test`` is None when the fraction is 0."""
    if not test_fraction:
        return train_idx, None
    if not 0 < test_fraction < 1:
        raise DataError(
            f"data.test_fraction={test_fraction} is invalid; allowed: a number in [0, 1)."
        )
    order = keyed_permutation(len(train_idx), seed, key)
    n_test = max(1, round(test_fraction * total))
    if n_test >= len(train_idx):
        raise DataError(f"data.path={path!r}: too few images to hold out data.test_fraction.")
    return train_idx[order[n_test:]].sort().values, train_idx[order[:n_test]].sort().values


BAD_IMAGE_CHOICES = ("stop", "skip")


class LazyImages:
    """A split of labelled image files read when fetched: in the loader's workers during
    training, so memory does not grow with the dataset. Same interface as
    :class:`TensorImages` (``len``, ``fetch``, ``channels``; ``to`` reads it all in).
    ``on_bad_image="skip"``: a file that cannot be read is replaced by the next readable
    file in the split's order (its label with it), named once per process in a warning."""

    channels = 3
    device = torch.device("cpu")

    def __init__(
        self, files: list[Path], labels: torch.Tensor, image_size: int, on_bad_image: str
    ) -> None:
        self.files, self.labels = files, labels
        self.image_size, self.on_bad_image = image_size, on_bad_image
        self._skipped: set[int] = set()

    def __len__(self) -> int:
        return len(self.files)

    def fetch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        read = [self._read(i) for i in index.tolist()]
        images = torch.stack([image for _, image in read])
        return images, self.labels[torch.tensor([j for j, _ in read], dtype=torch.int64)]

    def _read(self, i: int) -> tuple[int, torch.Tensor]:
        """(the file actually read, its image): ``i``, or with ``skip`` the next readable."""
        if self.on_bad_image == "stop":
            return i, read_image(self.files[i], self.image_size)
        n = len(self.files)
        for j in (i + k for k in range(n)):
            j %= n
            try:
                return j, read_image(self.files[j], self.image_size)
            except DataError as err:
                cause = err.__cause__
                if isinstance(cause, OSError) and cause.errno not in (None, *BAD_FILE_ERRNOS):
                    raise  # the disk or filesystem (EIO, EMFILE...), not the file: no skip
                if j not in self._skipped:
                    self._skipped.add(j)
                    log.warning(f"{err} Skipped (data.on_bad_image=skip): the next file instead.")
        raise DataError(f"data: none of the {n} files of a split can be read; check data.path.")

    def to(self, device: torch.device) -> TensorImages:
        """The whole split in memory on ``device`` (``in_memory``, ``loader=device``)."""
        images, labels = self.fetch(torch.arange(len(self)))
        return TensorImages(images, labels).to(device)


# errno values that say a file is bad -- a symlink to nowhere or in a loop, a folder named
# like an image, a file gone since the folder was listed -- not that the disk failed
BAD_FILE_ERRNOS = (errno.ENOENT, errno.ELOOP, errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG)


def _pillow():
    try:
        from PIL import Image
    except ImportError as err:
        raise DataError("reading images needs Pillow: pip install -e '.[images]'.") from err
    return Image


def read_image(path: Path, size: int) -> torch.Tensor:
    """An image file as uint8 3×size×size (RGB, resized bilinearly)."""
    return read_image_sized(path, size)[0]


def read_image_sized(path: Path, size: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """:func:`read_image`, and the file's own width and height."""
    Image = _pillow()
    try:
        with warnings.catch_warnings():  # PIL's own line for a large image: ours instead
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as im:
                _warn_if_large(path, im.width, im.height, Image.MAX_IMAGE_PIXELS)
                original = (im.width, im.height)
                im = im.convert("RGB").resize((size, size), Image.BILINEAR)
                data = bytearray(im.tobytes())
    except Exception as err:  # OSError, PIL's DecompressionBombError, a decoder's ValueError
        raise DataError(
            f"data: cannot read image {path} ({type(err).__name__}: {err}); remove or fix the file."
        ) from err
    image = torch.frombuffer(data, dtype=torch.uint8).view(size, size, 3).permute(2, 0, 1)
    return image, original


_warned_large: set[str] = set()


def _warn_if_large(path: Path, width: int, height: int, limit: int | None) -> None:
    """Once per file and process: an image above Pillow's decompression-bomb limit (which
    Pillow warns about, and refuses at twice the limit), read anyway."""
    if limit is None or width * height <= limit or str(path) in _warned_large:
        return
    _warned_large.add(str(path))
    log.warning(
        f"data: image {path} has {width * height} pixels, above Pillow's decompression-bomb "
        f"limit of {limit}; read anyway (PIL.Image.MAX_IMAGE_PIXELS sets the limit)."
    )


def read_mask(
    path: Path,
    size: int,
    num_classes: int,
    mask_map: dict[int, int] | None = None,
    image: tuple[Path, tuple[int, int]] | None = None,
) -> torch.Tensor:
    """A mask PNG of class indices as uint8 size×size (resized nearest: no invented
    classes), its values mapped by ``mask_map`` first. Values are classes ``0 ..
    num_classes - 1`` or :data:`IGNORE` (not scored). ``image``: its image's path and
    width and height, which the mask must have."""
    Image = _pillow()
    try:
        with Image.open(path) as im:
            if im.mode not in ("1", "L", "P", "I", "I;16"):
                raise DataError(
                    f"data: mask {path} is a {im.mode} image; masks must be single-channel "
                    "PNGs of class indices (mode L or P)."
                )
            if image is not None and im.size != image[1]:
                (w, h), (iw, ih) = im.size, image[1]
                raise DataError(
                    f"data: mask {path} is {w}×{h} but its image {image[0]} is {iw}×{ih}; a "
                    "mask must have its image's size: fix or remove the pair."
                )
            im = im.resize((size, size), Image.NEAREST)
            mask = torch.from_numpy(np.array(im, dtype=np.int64))
    except DataError:
        raise
    except Exception as err:  # OSError, PIL's DecompressionBombError, a decoder's ValueError
        raise DataError(
            f"data: cannot read mask {path} ({type(err).__name__}: {err}); remove or fix the file."
        ) from err
    if mask_map:
        mapped = mask.clone()
        for value, cls in mask_map.items():
            mapped[mask == int(value)] = int(cls)
        mask = mapped
    elif bool((mask == IGNORE).any()) and bool(((mask == 0) | (mask == IGNORE)).all()):
        raise DataError(
            f"data: mask {path} holds only 0 and {IGNORE}, and {IGNORE} means 'not scored': "
            f"if {IGNORE} is your foreground, map it, data.mask_map='{{{IGNORE}: 1}}' (or "
            f"'{{{IGNORE}: {IGNORE}}}' to keep it ignored)."
        )
    bad = (mask >= num_classes) & (mask != IGNORE)
    if bool(bad.any()):
        raise DataError(
            f"data: mask {path} holds class {int(mask[bad].max())}, not below "
            f"data.num_classes={num_classes}; fix the mask, map its values (data.mask_map) "
            f"or raise data.num_classes ({IGNORE} marks pixels to ignore)."
        )
    return mask.to(torch.uint8)


# The mask value of pixels that are not scored: unlabelled pixels in a mask (as in Pascal
# VOC) and the border a crop pads in. task=segmentation ignores it (task.ignore_index).
IGNORE = 255


class LazyImageMasks:
    """A split of (image, mask) files read from disk when fetched: in the loader's workers
    during training, so memory does not grow with the dataset. Same interface as
    :class:`TensorImages` (``len``, ``fetch``, ``channels``)."""

    channels = 3
    device = torch.device("cpu")

    def __init__(
        self,
        images: list[Path],
        masks: list[Path],
        image_size: int,
        num_classes: int,
        mask_map: dict[int, int] | None = None,
    ) -> None:
        self.images, self.masks = images, masks
        self.image_size, self.num_classes, self.mask_map = image_size, num_classes, mask_map

    def __len__(self) -> int:
        return len(self.images)

    def fetch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        images, masks = [], []
        for i in index.tolist():
            image, size = read_image_sized(self.images[i], self.image_size)
            mask = read_mask(
                self.masks[i],
                self.image_size,
                self.num_classes,
                self.mask_map,
                image=(self.images[i], size),
            )
            images.append(image)
            masks.append(mask)
        return torch.stack(images), torch.stack(masks)

    def fetch_images(self, index: torch.Tensor) -> torch.Tensor:
        return torch.stack([read_image(self.images[i], self.image_size) for i in index.tolist()])

    def to(self, device: torch.device) -> TensorImages:
        """The whole split in memory on ``device`` (``loader=device``)."""
        images, masks = self.fetch(torch.arange(len(self)))
        return TensorImages(images, masks).to(device)


def image_mask_folder(
    path: str,
    num_classes: int,
    image_size: int = 128,
    val_fraction: float = 0.1,
    seed: int = 1234,
    augment: bool = True,
    mask_map: dict[int, int] | None = None,
    test_fraction: float = 0.0,
) -> DataSplits:
    """Your own segmentation data: ``path/images/<stem>.<ext>`` and ``path/masks/<stem>.png``
    with matching stems; masks hold class indices ``0 .. num_classes - 1`` (255: ignore),
    after ``mask_map`` (``{255: 1}`` for binary masks stored as 0/255).

    Files are listed here, in sorted order, and read lazily (:class:`LazyImageMasks`), at
    ``image_size``×``image_size``. The validation split is a permutation keyed by ``seed``,
    so the same folder gives the same splits everywhere; ``test_fraction`` holds a test
    split out of the training files, as :func:`image_folder` does."""
    _pillow()
    root = Path(path).expanduser()
    image_dir, mask_dir = root / "images", root / "masks"
    if not image_dir.is_dir() or not mask_dir.is_dir():
        raise DataError(
            f"data.path={path!r} needs the sub-folders images/ and masks/ (one mask PNG per "
            "image, same file stem); point data.path at their parent."
        )
    if not 2 <= num_classes <= IGNORE:
        raise DataError(f"data.num_classes={num_classes} is invalid; allowed: 2 to {IGNORE}.")
    if not 0 < val_fraction < 1:
        raise DataError(
            f"data.val_fraction={val_fraction} is invalid; allowed: a number in (0, 1)."
        )
    images = {
        f.stem: f
        for f in sorted(image_dir.iterdir())
        if f.suffix.lower() in IMAGE_SUFFIXES and not f.name.startswith(".")
    }
    masks = {f.stem: f for f in sorted(mask_dir.glob("*.png")) if not f.name.startswith(".")}
    missing = sorted(set(images) - set(masks))
    if missing:
        raise DataError(
            f"data.path={path!r}: {len(missing)} image(s) have no mask, e.g. "
            f"images/{images[missing[0]].name} (expected masks/{missing[0]}.png); add the masks "
            "or move those images out."
        )
    stems = sorted(images)
    if len(stems) < 2:
        raise DataError(f"data.path={path!r}: images/ holds {len(stems)} image(s); need 2 or more.")
    train_idx, val_idx = keyed_split(
        len(stems), val_fraction, seed, "image-mask-folder-split", path
    )
    train_idx, test_idx = hold_out_test(
        train_idx, len(stems), test_fraction, seed, "image-mask-folder-test", path
    )

    def split(idx: torch.Tensor) -> LazyImageMasks:
        chosen = [stems[i] for i in idx.tolist()]
        return LazyImageMasks(
            [images[s] for s in chosen],
            [masks[s] for s in chosen],
            image_size,
            num_classes,
            {int(k): int(v) for k, v in mask_map.items()} if mask_map else None,
        )

    test = split(test_idx) if test_idx is not None else None
    return DataSplits(split(train_idx), split(val_idx), num_classes, augment, test=test)


SHAPES = ("disc", "square", "triangle", "ring", "cross")


def _shape_masks(kind: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, r: torch.Tensor):
    """Which pixels each sample's shape covers: ``kind`` (N, an index into :data:`SHAPES`),
    pixel offsets from the centre ``dy``/``dx`` (N×H×W) and radius ``r`` (N×1×1)."""
    dist = (dy**2 + dx**2).sqrt()
    ay, ax = dy.abs(), dx.abs()
    covers = torch.stack(
        [
            dist <= r,  # disc
            torch.maximum(ay, ax) <= 0.85 * r,  # square
            (dy >= -r) & (dy <= r) & (ax <= (dy + r) / 2),  # triangle, apex up
            (dist <= r) & (dist >= 0.55 * r),  # ring
            ((ax <= r / 3) & (ay <= r)) | ((ay <= r / 3) & (ax <= r)),  # cross
        ]
    )
    return covers[kind, torch.arange(len(kind))]


def synthetic_shapes(
    seed: int = 1234,
    num_classes: int = 4,
    train_size: int = 1024,
    val_size: int = 256,
    image_size: int = 64,
    max_shapes: int = 3,
    noise: float = 0.2,
    augment: bool = True,
    test_size: int = 0,
) -> DataSplits:
    """A learnable segmentation set generated from ``seed`` (the *data* seed), with a test
    split of ``test_size`` samples when it is not 0 (its own keyed stream): class 0 is the
    background, classes 1 .. num_classes-1 are shapes (disc, square, triangle, ring, cross).

    Each image holds 1 to ``max_shapes`` shapes of random class, place and size, later ones
    in front, on a shaded background with Gaussian noise; a shape's colour leans to its class
    but varies, so the model must learn the outline too. The mask is the per-pixel class."""
    if not 2 <= num_classes <= len(SHAPES) + 1 or min(train_size, val_size) < 1 or test_size < 0:
        raise DataError(
            f"data: synthetic_shapes needs 2 <= num_classes <= {len(SHAPES) + 1} and "
            "train_size/val_size >= 1, test_size >= 0; fix the data.* values."
        )
    if image_size < 16 or max_shapes < 1:
        raise DataError("data: synthetic_shapes needs image_size >= 16 and max_shapes >= 1.")
    # each channel of a class colour is dark or bright, never the background's mid-grey
    bright = torch.rand(num_classes, 3, generator=keyed_generator(seed, "palette")) < 0.5
    palette = 0.15 + 0.7 * bright.float()

    def make(split: str, n: int) -> TensorImages:
        g = keyed_generator(seed, "synthetic-shapes-" + split)
        coords = torch.arange(image_size, dtype=torch.float32) + 0.5
        yy, xx = coords.view(1, -1, 1), coords.view(1, 1, -1)
        tilt = torch.rand(n, 3, 2, generator=g) - 0.5  # a shaded background
        img = (
            0.5
            + 0.2 * (torch.rand(n, 3, 1, 1, generator=g) - 0.5)
            + 0.3 * (tilt[..., 0, None, None] * yy + tilt[..., 1, None, None] * xx) / image_size
        ).expand(n, 3, image_size, image_size)
        mask = torch.zeros(n, image_size, image_size, dtype=torch.uint8)
        count = torch.randint(1, max_shapes + 1, (n,), generator=g)
        for slot in range(max_shapes):
            cls = torch.randint(1, num_classes, (n,), generator=g)
            centre = (0.15 + 0.7 * torch.rand(n, 2, generator=g)) * image_size
            r = (0.09 + 0.13 * torch.rand(n, generator=g)).view(n, 1, 1) * image_size
            colour = (palette[cls] + 0.6 * (torch.rand(n, 3, generator=g) - 0.5)).clamp(0, 1)
            dy = yy - centre[:, 0, None, None]
            dx = xx - centre[:, 1, None, None]
            covered = _shape_masks(cls - 1, dy, dx, r) & (slot < count).view(n, 1, 1)
            img = torch.where(covered[:, None], colour[:, :, None, None], img)
            mask = torch.where(covered, cls.to(torch.uint8).view(n, 1, 1), mask)
        img = img + noise * torch.randn(n, 3, image_size, image_size, generator=g)
        return TensorImages((img.clamp(0, 1) * 255).round().to(torch.uint8), mask)

    test = make("test", test_size) if test_size else None
    return DataSplits(
        make("train", train_size), make("val", val_size), num_classes, augment, test=test
    )


CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"  # published with the archive
CIFAR10_DIR = "cifar-10-batches-py"


def cifar10(
    root: str = "data/cifar10",
    download: bool = True,
    augment: bool = True,
    url: str = CIFAR10_URL,
) -> DataSplits:
    """CIFAR-10 from the standard extracted ``cifar-10-batches-py`` folder under ``root``:
    the five ``data_batch_*`` files train, ``test_batch`` validates. Read without
    torchvision, by an unpickler that builds plain NumPy arrays and nothing else
    (:func:`read_cifar_batch`): a file that would run code is refused. With ``download`` and
    no folder there, the archive is fetched from ``url``, checked against its published MD5
    and extracted (only regular files and folders)."""
    folder = Path(root).expanduser() / CIFAR10_DIR
    if not folder.is_dir():
        if not download:
            raise DataError(
                f"data=cifar10: no {CIFAR10_DIR} folder in data.root={root!r}; place the "
                "extracted archive there, or set data.download=true."
            )
        fetch_cifar10(Path(root).expanduser(), url)

    def load(names: list[str]) -> TensorImages:
        parts = [read_cifar_batch(folder / name) for name in names]
        images = torch.cat([p[0] for p in parts]).view(-1, 3, 32, 32)
        return TensorImages(images, torch.cat([p[1] for p in parts]))

    return DataSplits(
        load([f"data_batch_{i}" for i in range(1, 6)]),
        load(["test_batch"]),
        10,
        augment,
        mean=(0.4914, 0.4822, 0.4465),
        std=(0.2470, 0.2435, 0.2616),
    )


class _RefusedGlobal(pickle.UnpicklingError):
    """A pickle names a global outside :class:`_PlainArrays`' list (truncated data raises
    the base class instead)."""


class _PlainArrays(pickle.Unpickler):
    """Builds what a CIFAR-10 batch holds -- a dict of lists, strings and NumPy arrays --
    and refuses every other global a pickle may name (the way pickled code runs)."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # how protocol 2 stores bytes
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise _RefusedGlobal(f"refused global {module}.{name}")
        return super().find_class(module, name)


def read_cifar_batch(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 N×3072 images, int64 labels) of one CIFAR-10 batch file; one line naming the
    file when it is missing, damaged or would run code."""
    try:
        with open(path, "rb") as f:
            batch = _PlainArrays(f, encoding="bytes").load()
        data, labels = batch[b"data"], batch[b"labels"]
        images = torch.from_numpy(np.asarray(data, dtype=np.uint8).reshape(-1, 3072).copy())
        targets = torch.tensor(list(labels), dtype=torch.int64)
    except _RefusedGlobal as err:
        raise DataError(
            f"data=cifar10: {path} was refused ({err}): it is not a plain CIFAR-10 batch "
            "and loading it could run code; replace it with the official archive's."
        ) from None
    except (OSError, EOFError, KeyError, TypeError, ValueError, pickle.UnpicklingError) as err:
        raise DataError(
            f"data=cifar10: cannot read {path} ({type(err).__name__}: {err}); extract the "
            "official archive there again."
        ) from None
    if len(images) != len(targets) or not targets.numel() or int(targets.max()) > 9:
        raise DataError(f"data=cifar10: {path} is not a CIFAR-10 batch (images and labels).")
    return images, targets


def fetch_cifar10(root: Path, url: str) -> None:
    """Download the archive into ``root``, check its MD5, extract the batches folder."""
    root.mkdir(parents=True, exist_ok=True)
    # everything in a private folder beside the destination, renamed into place at the end:
    # parallel jobs downloading at once never see each other's half-written files
    work = Path(tempfile.mkdtemp(prefix=".cifar10-", dir=root))
    try:
        _download_and_extract(url, work)
        try:
            os.rename(work / CIFAR10_DIR, root / CIFAR10_DIR)
        except OSError:
            if not (root / CIFAR10_DIR).is_dir():  # another job's rename won: use its copy
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _download_and_extract(url: str, work: Path) -> None:
    import hashlib
    import tarfile
    import urllib.request

    archive = work / Path(url).name
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(archive, "wb") as out:
            shutil.copyfileobj(response, out)
    except OSError as err:
        raise DataError(
            f"data=cifar10: could not download {url} ({err}); check the network, or place "
            f"the extracted {CIFAR10_DIR} folder in data.root."
        ) from None
    digest = hashlib.md5(archive.read_bytes()).hexdigest()
    if digest != CIFAR10_MD5:
        raise DataError(
            f"data=cifar10: {url} gave a file whose MD5 is {digest}, not the published "
            f"{CIFAR10_MD5}; it was deleted. Download the archive yourself."
        )
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.11.4 and later
            tar.extractall(work, filter="data")  # no links out, devices or absolute paths
        else:
            for member in tar.getmembers():
                parts = Path(member.name).parts
                if (
                    not (member.isfile() or member.isdir())
                    or member.name.startswith("/")
                    or ".." in parts
                ):
                    raise DataError(f"data=cifar10: {url} holds {member.name!r}; not extracted.")
            tar.extractall(work)


# --------------------------------------------------------------- keyed augmentation


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


class KeyedBatches(Dataset):
    """Fetches a whole micro-batch by its keys ``(epoch, index)``: one fetch of the images
    and targets, each image cropped and flipped with the draws keyed by ``(seed, "augment",
    epoch, index)`` (:func:`crop_flip_batch`, one vectorised gather for the batch), and a
    per-pixel mask with the very same crop and flip (pure data movement: no class is
    interpolated; the padded border is :data:`IGNORE`). The same sample in the same epoch gets
    the same crop and flip in any worker, any process, after any restart, and in any batch.
    Works where the split is: on the CPU for the DataLoader, on the GPU for
    ``loader.on_device``."""

    def __init__(self, split: Split, seed: int, augment: bool) -> None:
        self.split, self.seed, self.augment = split, seed, augment

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, keys: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        epochs, index = torch.tensor(keys, dtype=torch.int64).view(-1, 2).unbind(1)
        return self.fetch(epochs, index)

    def fetch(
        self, epochs: torch.Tensor, index: torch.Tensor, params: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples ``index`` (int64, on the split's device) in ``epochs`` (the same
        length, or one element), cropped and flipped; ``params``: their draws, if the caller
        has them (:func:`keyed_crop_flip_params` of these keys)."""
        images, targets = self.split.fetch(index)
        if self.augment:
            if params is None:
                params = keyed_crop_flip_params(self.seed, epochs, index)
            images = crop_flip_batch(images, params)
            if targets.dim() == 3:  # per-pixel masks move with their images
                targets = crop_flip_batch(targets[:, None], params, fill=IGNORE)[:, 0]
            elif targets.dim() != 1:
                raise DataError(
                    f"data: the crop and flip move class labels (N) and masks (N×H×W), not "
                    f"targets of shape {tuple(targets.shape)}; set data.augment=false."
                )
        return images, targets


# ------------------------------------------------------------------ sampler, loader


class KeyedBatchSampler:
    """Yields micro-batches of keys ``(epoch, index)``, forever, from global step ``start_step``.

    Step s covers positions ``[p*B, (p+1)*B)`` of epoch e's permutation (``e, p =
    divmod(s, steps_per_epoch)``), keyed by ``(seed, "order", e)``; the tail of an epoch that
    does not fill a global batch is dropped. Each step is split into K = B/m micro-batches.
    Where a step's samples come from is a pure function of the step: resuming is starting
    at another ``start_step``. ``shard=(first, count)`` yields only micro-batches ``first ...
    first + count - 1`` of each step: a process's share under torchrun (no sample is padded
    or repeated; the shares partition the global batch).
    """

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        micro_batch_size: int,
        seed: int,
        start_step: int = 0,
        shard: tuple[int, int] | None = None,
        same_step: bool = False,
    ) -> None:
        if dataset_size < batch_size:
            raise DataError(
                f"the training split has {dataset_size} samples, fewer than "
                f"trainer.batch_size={batch_size}; lower the batch size or use more data."
            )
        self.n, self.batch_size, self.micro = dataset_size, batch_size, micro_batch_size
        self.seed, self.start_step = seed, start_step
        self.first, self.count = shard or (0, batch_size // micro_batch_size)
        self.steps_per_epoch = dataset_size // batch_size
        self.same_step = same_step  # every step is step 0 (trainer.overfit_batch)
        self._cached_epoch, self._cached_perm = -1, []

    def step_keys(self, step: int) -> list[tuple[int, int]]:
        epoch, pos = divmod(0 if self.same_step else step, self.steps_per_epoch)
        perm = self._permutation(epoch)
        return [(epoch, i) for i in perm[pos * self.batch_size : (pos + 1) * self.batch_size]]

    def _permutation(self, epoch: int) -> list[int]:
        if self._cached_epoch != epoch:
            self._cached_epoch = epoch
            self._cached_perm = keyed_permutation(self.n, self.seed, "order", epoch).tolist()
        return self._cached_perm

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        step = self.start_step
        while True:
            keys = self.step_keys(step)
            for k in range(self.first, self.first + self.count):
                yield keys[k * self.micro : (k + 1) * self.micro]
            step += 1

    def index_tensors(self, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The same micro-batches as ``iter(self)``, as ``(epoch, indices)`` int64 tensors
        on ``device`` (a slice of the epoch's permutation, copied there once an epoch)."""
        step, held = self.start_step, (-1, None, None)
        while True:
            epoch, pos = divmod(0 if self.same_step else step, self.steps_per_epoch)
            if held[0] != epoch:
                perm = keyed_permutation(self.n, self.seed, "order", epoch).to(device)
                held = (epoch, perm, torch.tensor([epoch], dtype=torch.int64, device=device))
            _, perm, epoch_tensor = held
            start = pos * self.batch_size
            for k in range(self.first, self.first + self.count):
                a = start + k * self.micro
                yield epoch_tensor, perm[a : a + self.micro]
            step += 1


class DeviceBatches:
    """``loader=device``: the training split lives on the device and every micro-batch is
    cut there, with no worker processes: the same keys, draws and bytes as the DataLoader
    path (:meth:`KeyedBatches.fetch`), so the choice of loader cannot change the bits.

    At each epoch's start the whole split is cropped and flipped with that epoch's draws
    (:meth:`KeyedBatches.fetch` over all of it, in chunks), into one augmented copy of the
    split on the device; a micro-batch is then a slice of the epoch's permutation and one
    gather of its images and targets. The crop is pure data movement, so augmenting a
    sample with the epoch or with its micro-batch gives the same bytes; what changes is
    the work on the host, which the loop's step waits for on a fast GPU: two launches a
    micro-batch instead of a dozen. The cost is device memory for that copy (the split's
    size again)."""

    # at most this many bytes of gather indices (int64, one per output pixel) per chunk of
    # the epoch's crop: bounds the transient memory of augmenting a large split
    CHUNK_BYTES = 1 << 27

    def __init__(self, batches: KeyedBatches, sampler: KeyedBatchSampler) -> None:
        self.batches, self.sampler = batches, sampler

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        device = getattr(self.batches.split, "device", torch.device("cpu"))
        held: tuple[torch.Tensor | None, Any] = (None, None)
        for epoch, index in self.sampler.index_tensors(device):
            if held[0] is not epoch:  # a new epoch (index_tensors makes one tensor an epoch)
                held = images = targets = None  # the last epoch's copy goes first
                held = (epoch, self.augmented(epoch, device))
            images, targets = held[1]
            yield images[index], targets[index]

    def augmented(self, epoch: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The whole split as the epoch ``epoch`` sees it: cropped and flipped with its
        draws (or as stored, without augmentation)."""
        b = self.batches
        every = torch.arange(len(b.split), device=device)
        if not b.augment:
            return b.split.fetch(every)
        images, _ = b.split.fetch(every[:1])
        chunk = max(1, self.CHUNK_BYTES // (images[0, 0].numel() * 8))
        first = b.fetch(epoch, every[:chunk])
        if chunk >= len(every):
            return first
        out = tuple(
            torch.empty((len(every), *t.shape[1:]), dtype=t.dtype, device=t.device) for t in first
        )
        for i in range(0, len(every), chunk):
            part = first if i == 0 else b.fetch(epoch, every[i : i + chunk])
            for whole, t in zip(out, part, strict=True):
                whole[i : i + len(t)] = t
        return out


def _init_worker(worker_id: int) -> None:
    """Seed the worker's global RNGs (``repro.rng.worker_init_fn``) and leave pre-emption
    signals and Ctrl-C to the main process: a cluster sends SIGTERM to every process of the
    job, a terminal sends SIGINT to its whole process group, and the main process must be able
    to finish its step and write a checkpoint before the workers go."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    worker_init_fn(worker_id)


def _worker_context() -> multiprocessing.context.BaseContext:
    """The start method for loader workers: the process's own if it is a standard one, else
    the platform's default. A parallel sweep runs each job in a joblib (loky) worker whose
    default is ``loky``, under which a DataLoader cannot start its workers."""
    method = multiprocessing.get_start_method(allow_none=True)
    if method not in multiprocessing.get_all_start_methods():
        method = multiprocessing.get_all_start_methods()[0]
    return multiprocessing.get_context(method)


def make_train_loader(
    splits: DataSplits,
    seed: int,
    batch_size: int,
    micro_batch_size: int,
    loader_cfg,
    pin_memory: bool,
    start_step: int = 0,
    shard: tuple[int, int] | None = None,
    device: torch.device | None = None,
    overfit_batch: bool = False,
) -> DataLoader | DeviceBatches:
    """The micro-batches of the training split (infinite; the loop counts):
    ``shard=(first, count)``: only those micro-batches of each step (this rank's share).
    A DataLoader whose every item is a whole micro-batch (:class:`KeyedBatches`, fetched in
    ``loader.num_workers`` workers or in this process), or with ``loader.on_device``,
    :class:`DeviceBatches` on ``device``. Either way ``.sampler`` is the
    :class:`KeyedBatchSampler`."""
    sampler = KeyedBatchSampler(
        len(splits.train), batch_size, micro_batch_size, seed, start_step, shard, overfit_batch
    )
    if getattr(loader_cfg, "on_device", False):
        split = splits.train.to(device or torch.device("cpu"))  # a split on disk: read in
        return DeviceBatches(KeyedBatches(split, seed, splits.augment), sampler)
    workers = int(loader_cfg.num_workers)
    extra = {}
    if workers > 0:
        extra["persistent_workers"] = bool(loader_cfg.persistent_workers)
        if loader_cfg.prefetch_factor is not None:
            extra["prefetch_factor"] = int(loader_cfg.prefetch_factor)
    return DataLoader(
        KeyedBatches(splits.train, seed, splits.augment),
        sampler=sampler,
        batch_size=None,  # the sampler's items are whole micro-batches of keys
        num_workers=workers,
        pin_memory=pin_memory,
        worker_init_fn=_init_worker,
        multiprocessing_context=_worker_context() if workers > 0 else None,
        # the base seed of the workers' torch/random state: keyed, not the global RNG's
        generator=keyed_generator(seed, "loader"),
        **extra,
    )


@contextmanager
def loading(loader: DataLoader | DeviceBatches) -> Iterator[Iterator]:
    """Iterate ``loader``; on the way out (the last step, an error, pre-emption) stop its
    worker processes. They ignore SIGTERM, which is the main process's to handle, so none may
    outlive the run: multiprocessing's exit handler sends them SIGTERM and then waits for
    them, forever (an error in the middle of a run hung the process that way)."""
    batches = iter(loader)
    try:
        yield _one_line_errors(batches)
    finally:
        shutdown = getattr(batches, "_shutdown_workers", None)  # a multi-worker DataLoader
        if shutdown is not None:
            shutdown()


def _one_line_errors(batches: Iterator) -> Iterator:
    """``batches``, with a user error raised in a loader worker (a corrupt image, a bad mask)
    brought back to its one line: the DataLoader re-raises it in this process with the
    worker's traceback in the message."""
    while True:
        try:
            batch = next(batches)
        except ReproError as err:
            lines = [ln for ln in str(err).splitlines() if ln.strip()]
            if len(lines) > 1 and lines[0].startswith("Caught "):
                raise type(err)(lines[-1].split(": ", 1)[-1]) from None
            raise
        yield batch


class DeviceNormalizer:
    """uint8 images -> normalised float32 on the device (in ``channels_last`` memory format
    if asked: the model's)."""

    def __init__(
        self, splits: DataSplits, device: torch.device, channels_last: bool = False
    ) -> None:
        shape = (1, -1, 1, 1)
        self.device = device
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.mean = torch.tensor(splits.mean, device=device).view(shape)
        self.std = torch.tensor(splits.std, device=device).view(shape)

    def __call__(
        self, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = (
            images.to(self.device, non_blocking=True)
            .float()
            .div_(255)
            .sub_(self.mean)
            .div_(self.std)
            .contiguous(memory_format=self.memory_format)
        )
        return x, labels.to(self.device, non_blocking=True).long()  # uint8 masks too
