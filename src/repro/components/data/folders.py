"""Your own images from disk: a folder per class (:func:`image_folder`), or images with
masks (:func:`image_mask_folder`), read when fetched (in the loader's workers), so memory
does not grow with the dataset."""

from __future__ import annotations

import errno
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from repro.base.errors import DataError, MissingPackage
from repro.components.data.intensity import Intensity
from repro.components.data.splits import IGNORE, STATISTICS_SAMPLE, DataSplits, ImageList, Split
from repro.components.data.splitting import assign_splits, limit_splits, split_inputs

log = logging.getLogger("repro")

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".npy"}
TIFF_SUFFIXES = (".tif", ".tiff")
# what a mask may be: masks/<stem> with one of these suffixes (one file a stem)
MASK_SUFFIXES = (".png", ".tif", ".tiff", ".npy")


def image_folder(
    path: str,
    image_size: int = 32,
    val_fraction: float = 0.1,
    seed: int = 1234,
    in_memory: bool = False,
    on_bad_image: str = "stop",
    test_fraction: float = 0.0,
    channels: int = 3,
    intensity: dict[str, Any] | None = None,
    group_regex: str | None = None,
    group_csv: str | None = None,
    split_file: str | None = None,
    folds: int = 0,
    fold: int = 0,
    limit: int | None = None,
) -> DataSplits:
    """Your own images, one sub-folder per class (``root/cat/1.png``, ``root/dog/7.jpg``);
    the folder names are the class names (``DataSplits.class_names``, in sorted order).

    Classes and files are taken in sorted order. A file's split is decided by a keyed hash
    (``seed``) of its path relative to ``path`` (``cat/1.png``), so the same folder gives the
    same splits everywhere and adding a file moves no other
    (:func:`repro.components.data.splitting.assign_splits`): ``val_fraction`` and ``test_fraction`` are
    met approximately; ``group_regex`` or ``group_csv`` keep each group (a patient, a slide)
    in one split; ``split_file`` (CSV: file,split) decides instead; ``folds`` K >= 2 makes
    fold ``fold`` of the non-test files the validation split. Each image is
    read at its own size and depth with ``channels`` channels (:func:`read_image_sized`: 3
    RGB, 1 grayscale, or any number: multi-page or H×W×C TIFF, ``.npy``) and mapped by
    ``intensity`` (``data.intensity``, :class:`repro.components.data.intensity.Intensity`; None: auto)
    when fetched, in the loader's workers (:class:`LazyImages`:
    memory does not grow with the folder), or, with ``in_memory``, all of them once, up
    front, kept as they are (:class:`ImageList`: faster for a small folder); the ``augment``
    pipelines get them as uint8 (8-bit files under auto) or float32 C×H×W and bring them to
    ``image_size``×``image_size``. Both read every file with the same
    function, so they give the same bits.

    ``test_fraction``: a test split held out of the training files (the validation split
    stays the one without it; trainer.test, repro evaluate). ``limit``: at most that many
    files of each split, the same ones everywhere (:func:`repro.components.data.splitting.limit_splits`):
    a quick run on a large folder. ``on_bad_image``: ``stop`` (a file that cannot be read stops the run with one line
    naming it) or ``skip`` (it is replaced by the next readable file of its split, in file
    order -- the same one in any worker, process or resume -- and named in a warning)."""
    _pillow()
    _check_channels(channels)
    mapping = Intensity(intensity)
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
    classes, files = _class_files(root, path)
    labels = torch.tensor([label for _, label in files])
    names = [f.relative_to(root).as_posix() for f, _ in files]
    splits = assign_splits(
        names,
        seed=seed,
        val_fraction=val_fraction,
        test_fraction=test_fraction,
        path=path,
        purpose="image-folder",
        group_regex=group_regex,
        group_csv=group_csv,
        split_file=split_file,
        folds=folds,
        fold=fold,
    )
    train_idx, val_idx, test_idx = limit_splits(
        splits, names, limit, seed=seed, purpose="image-folder"
    )

    def split(index: torch.Tensor) -> Split:
        lazy = LazyImages(
            [files[i][0] for i in index], labels[index], on_bad_image, channels, mapping, root
        )
        return lazy.read_all() if in_memory else lazy

    return DataSplits(
        split(train_idx),
        split(val_idx),
        len(classes),
        test=split(test_idx) if test_idx is not None else None,
        image_size=image_size,
        class_names=tuple(classes),
        split_inputs=split_inputs(names, group_csv, split_file),
    )


def check_text_name(file: Path, key: str, path: str | Path) -> None:
    """A file whose name (its path under ``path``, the folder ``key`` gave) is not UTF-8 text
    (bytes the file system holds but no text encodes, as Python's surrogate escapes) is one
    line naming the file: a split is a keyed hash of the name's text, and records write
    it."""
    root = Path(path).expanduser()
    try:
        str(file.relative_to(root) if file.is_relative_to(root) else file.name).encode("utf-8")
    except UnicodeEncodeError:
        raise DataError(
            f"{key}={str(path)!r}: the file name {os.fsencode(file)!r} is not UTF-8 text; "
            "rename it (its split is a keyed hash of the name as text)."
        ) from None


def _class_files(root: Path, path: str) -> tuple[list[str], list[tuple[Path, int]]]:
    """The sorted class folders under ``root`` and every image in them with its class index
    (sorted within each class); fewer than 2 classes, or no image, is one line."""
    folders = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    for d in folders:
        check_text_name(d, "data.path", path)
    classes = [d.name for d in folders]
    files = [
        (f, label)
        for label, name in enumerate(classes)
        for f in sorted((root / name).rglob("*"))
        if f.suffix.lower() in IMAGE_SUFFIXES
    ]
    for f, _ in files:  # its path under data.path: class and sub-folders too
        check_text_name(f, "data.path", path)
    if len(classes) < 2 or not files:
        raise DataError(
            f"data.path={path!r} holds {len(classes)} class folder(s) and {len(files)} "
            "image(s); it needs at least 2 class sub-folders with images in them."
        )
    return classes, files


def _check_channels(channels: int) -> None:
    if isinstance(channels, bool) or not isinstance(channels, int) or channels < 1:
        raise DataError(
            f"data.channels={channels} is invalid; allowed: an integer >= 1 (3: RGB, 1: "
            "grayscale, or the files' own number of channels)."
        )


BAD_IMAGE_CHOICES = ("stop", "skip")


class LazyImages:
    """A split of labelled image files read when fetched (``channels`` channels, each at its
    own size and depth, :func:`read_image_sized`) and mapped by ``intensity`` (None: auto):
    in the loader's workers during training, so memory does not grow with the dataset.
    :meth:`fetch` gives the pipeline's input: uint8 C×H×W (an 8-bit file under auto) or
    float32 C×H×W. ``clipped``: index -> (values clipped, values) of the images among the
    first :data:`~repro.components.data.splits.STATISTICS_SAMPLE` read in this process.
    ``on_bad_image="skip"``: a file that cannot be read is replaced by the next readable
    file in the split's order (its label with it), named once per process in a warning."""

    device = torch.device("cpu")

    def __init__(
        self,
        files: list[Path],
        labels: torch.Tensor,
        on_bad_image: str,
        channels: int = 3,
        intensity: Intensity | None = None,
        root: Path | None = None,
    ) -> None:
        self.files, self.labels, self.on_bad_image = files, labels, on_bad_image
        self.root = root  # what names are relative to
        self.channels = channels
        self.intensity = intensity or Intensity()
        self.clipped: dict[int, tuple[int, int]] = {}
        self._skipped: set[int] = set()

    def __len__(self) -> int:
        return len(self.files)

    @property
    def names(self) -> list[str]:
        """Each sample's name in per-sample records: its path under the folder's root
        (``cat/1.png``, as the split is keyed by), else ``<class folder>/<file>``."""
        if self.root is not None:
            return [f.relative_to(self.root).as_posix() for f in self.files]
        return [f"{f.parent.name}/{f.name}" for f in self.files]

    def fetch(self, index: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        read = [(i, *self._read(i)) for i in index.tolist()]
        images = [_mapped(self, i, self.files[j], image) for i, j, image in read]
        return images, self.labels[torch.tensor([j for _, j, _ in read], dtype=torch.int64)]

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
        return ImageList(images, labels, self.intensity, dict(self.clipped), self.names)


def _mapped(split: Any, i: int, path: Path, image: torch.Tensor) -> torch.Tensor:
    """``image`` (read from ``path`` for sample ``i``) mapped by ``split.intensity``; its
    clipped count kept in ``split.clipped`` when ``i`` is in the statistics sample."""
    image, clipped = split.intensity(image, path)
    if i < STATISTICS_SAMPLE:
        split.clipped[i] = (clipped, image.numel())
    return image


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
    """An image file as a C×H×W tensor at its own size and depth (:func:`read_image_sized`):
    an 8-bit file as uint8 (``channels`` 3: RGB; 1: grayscale, as Pillow's ``L`` conversion
    gives it). :class:`repro.components.data.intensity.Intensity` maps it to the pipeline's input; the
    augmentation resizes it."""
    return read_image_sized(path, channels)[0]


def read_image_sized(path: Path, channels: int = 3) -> tuple[torch.Tensor, tuple[int, int]]:
    """An image file as a ``channels``×H×W tensor at its own size and bit depth, and its
    width and height.

    - An 8-bit file Pillow reads (PNG, JPEG, BMP, GIF, WebP, a one-page 8-bit TIFF) with
      ``channels`` 1 or 3: uint8, converted as Pillow's ``L`` (luma) or ``RGB`` conversion
      gives it (grayscale replicated); with another ``channels``: its own bands (a palette
      image as RGB or RGBA), which must be that many.
    - A 16-bit or float PNG (Pillow's ``I;16``, ``I;16B``, ``I``, ``F``): uint16 (``I`` from
      a PNG, which holds at most 16 bits) or int32 / float32, one channel. A 16-bit colour
      PNG, which Pillow reads as 8 bits a channel, is refused.
    - Any other TIFF (16-bit, float, multi-page, several channels): through ``tifffile`` (the
      ``tiff`` extra), as stored; ``.npy``: ``numpy.load`` without pickles, as stored.
      The channel axis is the one tifffile's series axes name (``C`` or ``S``), else the
      last if it has ``channels`` elements (H×W×C), else the first (C×H×W; the pages of a
      multi-page TIFF).

    One channel with ``channels`` 3 is replicated; any other mismatch is a one-line
    :class:`DataError` naming the file, as is a file that cannot be read."""
    _check_channels(channels)
    suffix = Path(path).suffix.lower()
    try:
        array = _npy(path, channels) if suffix == ".npy" else _pillow_pixels(path, channels)
        if array is None:  # a TIFF that Pillow does not read at its depth
            array = _tiff_pixels(path, channels)
    except (DataError, MissingPackage):
        raise
    except Exception as err:  # OSError, PIL's DecompressionBombError, a decoder's ValueError
        raise DataError(
            f"data: cannot read image {path} ({type(err).__name__}: {err}); remove or fix the file."
        ) from err
    return torch.from_numpy(array), (array.shape[2], array.shape[1])


# Pillow's modes of 8 bits a band (or fewer): read as Pillow converts them, as always
EIGHT_BIT_MODES = {"1", "L", "P", "RGB", "RGBA", "CMYK", "YCbCr", "LA", "PA", "RGBX", "RGBa", "La"}
# Pillow's single-band modes of more bits: read at their depth
DEEP_MODES = {"I;16", "I;16L", "I;16B", "I;16N", "I", "F"}


def _pillow_pixels(path: Path, channels: int) -> np.ndarray | None:
    """The C×H×W pixels of a file Pillow reads, or None for a TIFF it does not read at its
    depth (more than 8 bits, signed or float samples, several pages) or cannot open."""
    Image = _pillow()
    tiff = Path(path).suffix.lower() in TIFF_SUFFIXES
    with warnings.catch_warnings():  # PIL's own line for a large image: ours instead
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            opened = Image.open(path)
        except Image.DecompressionBombError:
            raise
        except Exception:
            if tiff:
                return None  # tifffile reads more kinds of TIFF
            raise
        with opened as im:
            if tiff and not _eight_bit_tiff(im):
                return None
            _warn_if_large(path, im.width, im.height, Image.MAX_IMAGE_PIXELS)
            sixteen = any(";16" in str(tile[3]) for tile in im.tile)  # before EXIF loads it
            _warn_if_oriented(path, im)
            if im.mode in DEEP_MODES:
                pixels = np.array(im)
                if im.mode == "I" and im.format == "PNG":  # a 16-bit PNG as 32-bit integers
                    pixels = pixels.astype(np.uint16)
                return _channels_first(pixels, path, channels, "YX")
            if sixteen:
                raise DataError(
                    f"data: image {path} has 16 bits a channel in a mode ({im.mode}) that "
                    "Pillow reads as 8; save it as a 16-bit TIFF or .npy to keep its depth."
                )
            if channels in (1, 3):  # today's conversion, byte for byte
                im = im.convert("RGB" if channels == 3 else "L")
                data = bytearray(im.tobytes())
                pixels = np.frombuffer(data, dtype=np.uint8).reshape(im.height, im.width, channels)
                return np.ascontiguousarray(pixels.transpose(2, 0, 1))
            if im.mode in ("P", "PA"):
                palette_alpha = im.mode == "PA" or "transparency" in im.info
                im = im.convert("RGBA" if palette_alpha else "RGB")
            elif im.mode == "1":
                im = im.convert("L")
            pixels = np.array(im)
            return _channels_first(pixels, path, channels, "YX" if pixels.ndim == 2 else "YXS")


def _eight_bit_tiff(im: Any) -> bool:
    """Does Pillow read this TIFF as it is stored: one page of unsigned samples of at most
    8 bits in a mode of 8-bit bands?"""
    tags = getattr(im, "tag_v2", {})

    def values(tag: int, default: int) -> tuple:
        value = tags.get(tag, default)
        return value if isinstance(value, tuple) else (value,)

    return (
        getattr(im, "n_frames", 1) == 1
        and im.mode in EIGHT_BIT_MODES
        and all(bits <= 8 for bits in values(258, 1))  # BitsPerSample
        and all(kind == 1 for kind in values(339, 1))  # SampleFormat: unsigned integers
    )


def _tiff_pixels(path: Path, channels: int) -> np.ndarray:
    """A TIFF's first series through tifffile, C×H×W (its axes say where the channels are)."""
    try:
        import tifffile
    except ImportError as err:
        raise MissingPackage(
            f"data: {path}: reading TIFF needs tifffile: pip install -e '.[tiff]'.", "tifffile"
        ) from err
    with tifffile.TiffFile(path) as tif:
        series = tif.series[0]
        return _channels_first(series.asarray(), path, channels, series.axes)


def _npy(path: Path, channels: int) -> np.ndarray:
    """A ``.npy`` array (no pickles), C×H×W."""
    return _channels_first(np.load(path, allow_pickle=False), path, channels)


def _channels_first(
    array: np.ndarray, path: Path, channels: int, axes: str | None = None
) -> np.ndarray:
    """``array`` (H×W, H×W×C or C×H×W, of integers or floats) as a contiguous C×H×W array
    of ``channels`` channels, in native byte order. The channel axis: the one ``axes``
    (tifffile's series axes) names ``C`` or ``S``; else the last if it has ``channels``
    elements, else the first if it does, else a size-1 last or first axis. One channel with
    ``channels`` 3 is replicated; any other count is refused in one line."""
    shape = tuple(array.shape)
    told = f", axes {axes}" if axes else ""
    if array.dtype.kind not in "uif":
        raise DataError(
            f"data: image {path} holds {array.dtype} values; store unsigned or signed "
            "integers or floats (uint8, uint16, float32...)."
        )
    if array.ndim == 2:
        array = array[None]
    elif array.ndim == 3:
        named = [i for i, a in enumerate(axes or "") if a in "CS"] if axes else []
        if len(axes or "") == 3 and len(named) == 1:
            axis = named[0]
        elif shape[2] == channels or (shape[2] == 1 and shape[0] != channels):
            axis = 2
        elif shape[0] == channels or shape[0] == 1:
            axis = 0
        else:
            raise DataError(
                f"data: image {path} has shape {shape}{told}, with neither its first nor its "
                f"last axis of data.channels={channels}; store it H×W×C or C×H×W, or set "
                "data.channels."
            )
        array = np.moveaxis(array, axis, 0)
    else:
        raise DataError(
            f"data: image {path} has shape {shape}{told}; an image must be H×W, H×W×C or "
            "C×H×W: store one image a file."
        )
    if array.shape[0] != channels:
        if array.shape[0] != 1 or channels != 3:
            raise DataError(
                f"data: image {path} (shape {shape}{told}) has {array.shape[0]} channel(s) "
                f"but data.channels={channels}; set data.channels={array.shape[0]} or "
                "convert the file."
            )
        array = np.repeat(array, 3, axis=0)  # one channel as RGB, as Pillow converts it
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    return np.ascontiguousarray(array)


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


# EXIF orientation values (tag 0x0112) and what a viewer does to the stored pixels
ORIENTATIONS = {
    2: "mirrored",
    3: "rotated 180°",
    4: "flipped upside down",
    5: "transposed",
    6: "rotated 90° clockwise",
    7: "transversed",
    8: "rotated 90° counter-clockwise",
}


def _warn_if_oriented(path: Path, im: Any) -> None:
    """Once per process (the first such file): an image whose EXIF orientation tag says a
    viewer shows it turned. Its pixels are read as stored -- as torchvision's and Pillow's
    readers do, and on the grid a mask of it was saved on -- never as the viewer shows them."""
    if _warned_oriented:
        return
    try:
        orientation = im.getexif().get(0x0112)
    except Exception:  # a damaged EXIF block: the pixels are what is read
        return
    if orientation not in ORIENTATIONS:
        return
    _warned_oriented.append(str(path))
    log.warning(
        f"data: image {path} has EXIF orientation {orientation} (a viewer shows it "
        f"{ORIENTATIONS[orientation]}); its pixels are read as stored, not as shown, and so "
        "are any others' (docs/segmentation.md): to train on what a viewer shows, save the "
        "files turned (PIL.ImageOps.exif_transpose), masks with them."
    )


_warned_oriented: list[str] = []


def read_mask(
    path: Path,
    num_classes: int,
    mask_map: dict[int, int] | None = None,
    image: tuple[Path, tuple[int, int]] | None = None,
) -> torch.Tensor:
    """A mask of class indices -- a PNG (8 or 16 bits), a TIFF (through tifffile: 16-bit
    labels, say) or a ``.npy`` array, H×W of integers -- as uint8 H×W at its own size, its
    values mapped by ``mask_map``. Values are classes ``0 .. num_classes - 1`` or
    :data:`IGNORE` (not scored); a float mask is refused. ``image``: its image's path and
    width and height, which the mask must have."""
    suffix = Path(path).suffix.lower()
    try:
        if suffix in TIFF_SUFFIXES or suffix == ".npy":
            labels = _mask_array(path, suffix)
        else:
            with _pillow().open(path) as im:
                if im.mode == "F":
                    raise DataError(_float_mask(path, "float32"))
                if im.mode not in ("1", "L", "P", "I", "I;16", "I;16L", "I;16B"):
                    raise DataError(
                        f"data: mask {path} is a {im.mode} image; masks must be single-channel "
                        "PNGs of class indices (mode L or P)."
                    )
                labels = np.array(im)
        if image is not None and (labels.shape[1], labels.shape[0]) != tuple(image[1]):
            (h, w), (iw, ih) = labels.shape, image[1]
            raise DataError(
                f"data: mask {path} is {w}×{h} but its image {image[0]} is {iw}×{ih}; a "
                "mask must have its image's size: fix or remove the pair."
            )
        mask = torch.from_numpy(labels.astype(np.int64))
    except (DataError, MissingPackage):
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
    if bool((mask < 0).any()):
        raise DataError(
            f"data: mask {path} holds the value {int(mask.min())}, not a class; fix the mask "
            f"or map its values (data.mask_map) to classes 0 .. {num_classes - 1} or {IGNORE}."
        )
    bad = (mask >= num_classes) & (mask != IGNORE)
    if bool(bad.any()):
        raise DataError(
            f"data: mask {path} holds class {int(mask[bad].max())}, not below "
            f"data.num_classes={num_classes}; fix the mask, map its values (data.mask_map) "
            f"or raise data.num_classes ({IGNORE} marks pixels to ignore)."
        )
    return mask.to(torch.uint8)


def _float_mask(path: Path, dtype: Any) -> str:
    return (
        f"data: mask {path} holds {dtype} values; masks must hold integer class indices: "
        "store them as integers (uint8, uint16)."
    )


def _mask_array(path: Path, suffix: str) -> np.ndarray:
    """A TIFF (its first series, through tifffile) or ``.npy`` mask as an H×W integer array."""
    if suffix == ".npy":
        labels = np.load(path, allow_pickle=False)
    else:
        try:
            import tifffile
        except ImportError as err:
            raise MissingPackage(
                f"data: {path}: reading TIFF needs tifffile: pip install -e '.[tiff]'.", "tifffile"
            ) from err
        labels = tifffile.imread(path)
    if labels.ndim == 3 and 1 in (labels.shape[0], labels.shape[2]):
        labels = labels.reshape(labels.shape[1:] if labels.shape[0] == 1 else labels.shape[:2])
    if labels.dtype.kind == "f":
        raise DataError(_float_mask(path, labels.dtype))
    if labels.ndim != 2 or labels.dtype.kind not in "uib":
        raise DataError(
            f"data: mask {path} is a {labels.dtype} array of shape {tuple(labels.shape)}; "
            "masks must be H×W arrays of integer class indices (one channel)."
        )
    return labels


class LazyImageMasks:
    """A split of (image, mask) files read from disk when fetched, each at its own size: in
    the loader's workers during training, so memory does not grow with the dataset. Each
    image is read at its depth (:func:`read_image_sized`) and mapped by ``intensity`` (None:
    auto): :meth:`fetch` gives the pipeline uint8 C×H×W (an 8-bit file under auto) or
    float32 C×H×W images, and uint8 H×W masks. ``clipped``: as :class:`LazyImages` keeps it."""

    device = torch.device("cpu")

    def __init__(
        self,
        images: list[Path],
        masks: list[Path],
        num_classes: int,
        mask_map: dict[int, int] | None = None,
        channels: int = 3,
        intensity: Intensity | None = None,
    ) -> None:
        self.images, self.masks = images, masks
        self.num_classes, self.mask_map = num_classes, mask_map
        self.channels = channels
        self.intensity = intensity or Intensity()
        self.clipped: dict[int, tuple[int, int]] = {}

    def __len__(self) -> int:
        return len(self.images)

    @property
    def names(self) -> list[str]:
        """Each sample's name in per-sample records: its image's file stem."""
        return [f.stem for f in self.images]

    def fetch(self, index: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        images, masks = [], []
        for i in index.tolist():
            image, size = read_image_sized(self.images[i], self.channels)
            masks.append(
                read_mask(self.masks[i], self.num_classes, self.mask_map, (self.images[i], size))
            )
            images.append(_mapped(self, i, self.images[i], image))
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
    intensity: dict[str, Any] | None = None,
    group_regex: str | None = None,
    group_csv: str | None = None,
    split_file: str | None = None,
    folds: int = 0,
    fold: int = 0,
    class_names: list[str] | None = None,
    limit: int | None = None,
) -> DataSplits:
    """Your own segmentation data: ``path/images/<stem>.<ext>`` and one mask a stem,
    ``path/masks/<stem>.png`` (or ``.tif``, ``.tiff``, ``.npy``: :func:`read_mask`); masks
    hold class indices ``0 .. num_classes - 1`` (255: ignore), after ``mask_map``
    (``{255: 1}`` for binary masks stored as 0/255). Images are read at their depth with
    ``channels`` channels and mapped by ``intensity`` as :func:`image_folder` reads them.

    Files are listed here, in sorted order, and read lazily (:class:`LazyImageMasks`), each
    at its own size (a mask must have its image's); the ``augment`` pipelines bring them to
    ``image_size``×``image_size``, the masks with the very same geometry. The splits are decided as
    :func:`image_folder` decides them, by a keyed hash (``seed``) of each image's file stem
    (``group_regex`` is searched in the stem; ``group_csv`` and ``split_file`` name files by
    their stems), so adding a file moves no other; ``test_fraction`` holds a test split out
    of the training files. ``class_names``: each class's name, in metric names
    (``val_dice_nucleus``) and records. ``limit``: at most that many files of each split
    (:func:`repro.components.data.splitting.limit_splits`)."""
    _pillow()
    _check_channels(channels)
    mapping = Intensity(intensity)
    if not 2 <= num_classes <= IGNORE:
        raise DataError(f"data.num_classes={num_classes} is invalid; allowed: 2 to {IGNORE}.")
    if class_names is not None and len(class_names) != num_classes:
        raise DataError(
            f"data.class_names has {len(class_names)} names for data.num_classes={num_classes}; "
            "give one name per class, or null."
        )
    if not 0 < val_fraction < 1:
        raise DataError(
            f"data.val_fraction={val_fraction} is invalid; allowed: a number in (0, 1)."
        )
    stems, images, masks = image_mask_pairs(path, "data.path")
    splits = assign_splits(
        stems,
        seed=seed,
        val_fraction=val_fraction,
        test_fraction=test_fraction,
        path=path,
        purpose="image-mask-folder",
        group_regex=group_regex,
        group_csv=group_csv,
        split_file=split_file,
        folds=folds,
        fold=fold,
    )
    train_idx, val_idx, test_idx = limit_splits(
        splits, stems, limit, seed=seed, purpose="image-mask-folder"
    )

    def split(idx: torch.Tensor) -> LazyImageMasks:
        chosen = [stems[i] for i in idx.tolist()]
        return LazyImageMasks(
            [images[s] for s in chosen],
            [masks[s] for s in chosen],
            num_classes,
            {int(k): int(v) for k, v in mask_map.items()} if mask_map else None,
            channels,
            mapping,
        )

    test = split(test_idx) if test_idx is not None else None
    names = tuple(str(n) for n in class_names) if class_names is not None else None
    return DataSplits(
        split(train_idx),
        split(val_idx),
        num_classes,
        test=test,
        image_size=image_size,
        class_names=names,
        split_inputs=split_inputs(stems, group_csv, split_file),
    )


def image_mask_pairs(
    path: str | Path, key: str = "data.path", least: int = 2
) -> tuple[list[str], dict[str, Path], dict[str, Path]]:
    """The sorted stems of ``path/images/`` and each stem's image and mask file (one image
    and one mask a stem, ``masks/<stem>`` + one of :data:`MASK_SUFFIXES`); a folder without
    both sub-folders, an image without a mask, two images or two masks of one stem or fewer
    than ``least`` images is one line naming ``key`` (the config key or option that gave
    ``path``)."""
    root = Path(path).expanduser()
    image_dir, mask_dir = root / "images", root / "masks"
    if not image_dir.is_dir() or not mask_dir.is_dir():
        raise DataError(
            f"{key}={str(path)!r} needs the sub-folders images/ and masks/ (one mask per "
            "image, same file stem); point it at their parent."
        )
    images: dict[str, Path] = {}
    for f in sorted(image_dir.iterdir()):
        if f.suffix.lower() not in IMAGE_SUFFIXES or f.name.startswith("."):
            continue
        check_text_name(f, key, path)
        if f.stem in images:
            raise DataError(
                f"{key}={str(path)!r}: images/{images[f.stem].name} and images/{f.name} are two "
                "images of one stem (one mask each cannot tell them apart); keep one of them."
            )
        images[f.stem] = f
    masks: dict[str, Path] = {}
    for f in sorted(mask_dir.iterdir()):
        if f.suffix.lower() not in MASK_SUFFIXES or f.name.startswith("."):
            continue
        check_text_name(f, key, path)
        if f.stem in masks:
            raise DataError(
                f"{key}={str(path)!r}: masks/{masks[f.stem].name} and masks/{f.name} are two "
                "masks of one stem; keep one of them."
            )
        masks[f.stem] = f
    missing = sorted(set(images) - set(masks))
    if missing:
        raise DataError(
            f"{key}={str(path)!r}: {len(missing)} image(s) have no mask, e.g. "
            f"images/{images[missing[0]].name} (expected masks/{missing[0]}.png, .tif, .tiff "
            "or .npy); add the masks or move those images out."
        )
    stems = sorted(images)
    if len(stems) < least:
        raise DataError(
            f"{key}={str(path)!r}: images/ holds {len(stems)} image(s); need {least} or more."
        )
    return stems, images, masks
