"""Your own images from disk: a folder per class (:func:`image_folder`), or images with
masks (:func:`image_mask_folder`), read when fetched (in the loader's workers), so memory
does not grow with the dataset."""

from __future__ import annotations

import errno
import logging
import warnings
from pathlib import Path

import numpy as np
import torch

from repro.data.splits import IGNORE, DataSplits, ImageList, Split
from repro.errors import DataError
from repro.rng import keyed_permutation

log = logging.getLogger("repro")

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


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
    in_memory: bool = False,
    on_bad_image: str = "stop",
    test_fraction: float = 0.0,
    channels: int = 3,
) -> DataSplits:
    """Your own images, one sub-folder per class (``root/cat/1.png``, ``root/dog/7.jpg``);
    the folder names are the class names (``DataSplits.class_names``, in sorted order).

    Classes and files are taken in sorted order and the validation split is a permutation
    keyed by ``seed``, so the same folder gives the same splits everywhere. Each image is
    read (``channels`` 3: RGB, 1: grayscale; at its own size) when fetched, in the loader's workers (:class:`LazyImages`:
    memory does not grow with the folder), or, with ``in_memory``, all of them once, up
    front, kept as they are (:class:`ImageList`: faster for a small folder); the ``augment``
    pipelines bring them to ``image_size``×``image_size``. Both read every file with the same
    function, so they give the same bits.

    ``test_fraction``: a test split held out of the training files by another keyed
    permutation (the validation split stays the one without it; trainer.test, repro
    evaluate). ``on_bad_image``: ``stop`` (a file that cannot be read stops the run with one line
    naming it) or ``skip`` (it is replaced by the next readable file of its split, in file
    order -- the same one in any worker, process or resume -- and named in a warning)."""
    _pillow()
    _check_channels(channels)
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
        lazy = LazyImages([files[i][0] for i in index], labels[index], on_bad_image, channels)
        return lazy.read_all() if in_memory else lazy

    return DataSplits(
        split(train_idx),
        split(val_idx),
        len(classes),
        test=split(test_idx) if test_idx is not None else None,
        image_size=image_size,
        class_names=tuple(classes),
    )


def _check_channels(channels: int) -> None:
    if channels not in (1, 3):
        raise DataError(f"data.channels={channels} is invalid; allowed: 3 (RGB) or 1 (grayscale).")


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
    """A split of labelled image files read when fetched (``channels``: 3 RGB, 1 grayscale;
    each at its own size): in the loader's workers during training, so memory does not grow
    with the dataset.
    ``on_bad_image="skip"``: a file that cannot be read is replaced by the next readable
    file in the split's order (its label with it), named once per process in a warning."""

    device = torch.device("cpu")

    def __init__(
        self, files: list[Path], labels: torch.Tensor, on_bad_image: str, channels: int = 3
    ) -> None:
        self.files, self.labels, self.on_bad_image = files, labels, on_bad_image
        self.channels = channels
        self._skipped: set[int] = set()

    def __len__(self) -> int:
        return len(self.files)

    def fetch(self, index: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        read = [self._read(i) for i in index.tolist()]
        images = [image for _, image in read]
        return images, self.labels[torch.tensor([j for j, _ in read], dtype=torch.int64)]

    def _read(self, i: int) -> tuple[int, torch.Tensor]:
        """(the file actually read, its image): ``i``, or with ``skip`` the next readable."""
        if self.on_bad_image == "stop":
            return i, read_image(self.files[i], self.channels)
        n = len(self.files)
        for j in (i + k for k in range(n)):
            j %= n
            try:
                return j, read_image(self.files[j], self.channels)
            except DataError as err:
                cause = err.__cause__
                if isinstance(cause, OSError) and cause.errno not in (None, *BAD_FILE_ERRNOS):
                    raise  # the disk or filesystem (EIO, EMFILE...), not the file: no skip
                if j not in self._skipped:
                    self._skipped.add(j)
                    log.warning(f"{err} Skipped (data.on_bad_image=skip): the next file instead.")
        raise DataError(f"data: none of the {n} files of a split can be read; check data.path.")

    def read_all(self) -> ImageList:
        """The whole split read into memory, each image at its own size (``in_memory``)."""
        images, labels = self.fetch(torch.arange(len(self)))
        return ImageList(images, labels)


# errno values that say a file is bad -- a symlink to nowhere or in a loop, a folder named
# like an image, a file gone since the folder was listed -- not that the disk failed
BAD_FILE_ERRNOS = (errno.ENOENT, errno.ELOOP, errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG)


def _pillow():
    try:
        from PIL import Image
    except ImportError as err:
        raise DataError("reading images needs Pillow: pip install -e '.[images]'.") from err
    return Image


def read_image(path: Path, channels: int = 3) -> torch.Tensor:
    """An image file as uint8 C×H×W at its own size (``channels`` 3: RGB; 1: grayscale, as
    Pillow's ``L`` conversion gives it): the augmentation resizes it."""
    return read_image_sized(path, channels)[0]


def read_image_sized(path: Path, channels: int = 3) -> tuple[torch.Tensor, tuple[int, int]]:
    """:func:`read_image`, and the file's own width and height."""
    _check_channels(channels)
    Image = _pillow()
    try:
        with warnings.catch_warnings():  # PIL's own line for a large image: ours instead
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as im:
                _warn_if_large(path, im.width, im.height, Image.MAX_IMAGE_PIXELS)
                original = (im.width, im.height)
                im = im.convert("RGB" if channels == 3 else "L")
                data = bytearray(im.tobytes())
                shape = (im.height, im.width, channels)
    except Exception as err:  # OSError, PIL's DecompressionBombError, a decoder's ValueError
        raise DataError(
            f"data: cannot read image {path} ({type(err).__name__}: {err}); remove or fix the file."
        ) from err
    image = torch.frombuffer(data, dtype=torch.uint8).view(shape).permute(2, 0, 1).contiguous()
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
    num_classes: int,
    mask_map: dict[int, int] | None = None,
    image: tuple[Path, tuple[int, int]] | None = None,
) -> torch.Tensor:
    """A mask PNG of class indices as uint8 H×W at its own size, its values mapped by
    ``mask_map``. Values are classes ``0 .. num_classes - 1`` or :data:`IGNORE` (not
    scored). ``image``: its image's path and width and height, which the mask must have."""
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


class LazyImageMasks:
    """A split of (image, mask) files read from disk when fetched, each at its own size: in
    the loader's workers during training, so memory does not grow with the dataset."""

    device = torch.device("cpu")

    def __init__(
        self,
        images: list[Path],
        masks: list[Path],
        num_classes: int,
        mask_map: dict[int, int] | None = None,
        channels: int = 3,
    ) -> None:
        self.images, self.masks = images, masks
        self.num_classes, self.mask_map = num_classes, mask_map
        self.channels = channels

    def __len__(self) -> int:
        return len(self.images)

    def fetch(self, index: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        images, masks = [], []
        for i in index.tolist():
            image, size = read_image_sized(self.images[i], self.channels)
            masks.append(
                read_mask(self.masks[i], self.num_classes, self.mask_map, (self.images[i], size))
            )
            images.append(image)
        return images, masks


def image_mask_folder(
    path: str,
    num_classes: int,
    image_size: int = 128,
    val_fraction: float = 0.1,
    seed: int = 1234,
    mask_map: dict[int, int] | None = None,
    test_fraction: float = 0.0,
    channels: int = 3,
) -> DataSplits:
    """Your own segmentation data: ``path/images/<stem>.<ext>`` and ``path/masks/<stem>.png``
    with matching stems; masks hold class indices ``0 .. num_classes - 1`` (255: ignore),
    after ``mask_map`` (``{255: 1}`` for binary masks stored as 0/255).

    Files are listed here, in sorted order, and read lazily (:class:`LazyImageMasks`), each
    at its own size (a mask must have its image's); the ``augment`` pipelines bring them to
    ``image_size``×``image_size``, the masks with the very same geometry. The validation split is a permutation keyed by ``seed``,
    so the same folder gives the same splits everywhere; ``test_fraction`` holds a test
    split out of the training files, as :func:`image_folder` does; ``channels``: 3 (RGB) or
    1 (grayscale)."""
    _pillow()
    _check_channels(channels)
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
            num_classes,
            {int(k): int(v) for k, v in mask_map.items()} if mask_map else None,
            channels,
        )

    test = split(test_idx) if test_idx is not None else None
    return DataSplits(
        split(train_idx), split(val_idx), num_classes, test=test, image_size=image_size
    )
