"""``repro preview [overrides]``: what does the training augmentation do to my samples?

A user who cannot see the augmentation cannot tell a random transform from one that does
nothing (an elastic deformation of 0.25 px looks "random" in a config file). The preview
composes the config as training does (:func:`repro.engine.build.build_data`: the same data, the
same ``augment.train`` pipeline, the same training seed) and shows N training samples:

- **a picture** (:meth:`Preview.grid`): a row per sample -- the image as the split gives
  it, the image as training's loader gives it in epoch E (:class:`repro.components.data.loading.
  KeyedBatches`, keyed by ``(seed, "augment", epoch, index)``: the training draw, bit for
  bit), and for segmentation the mask over the augmented image (the class colours of
  ``repro predict --overlay``, grey where the mask is 255, not scored);
- **a table** (:meth:`Preview.format`): each transform's mean displacement and mean
  intensity change over the N samples, so a no-op is visible (:class:`Effect`).

**How each transform is measured.** A composition (``repro.components.data.augment.Compose``,
torchvision's v2 ``Compose``, any object with a ``.transforms`` list whose items take and
return ``(image, target)``) is replayed step by step on each sample under the sample's
key, as :class:`repro.components.data.KeyedPipeline` runs it whole: the keyed global torch, NumPy and
``random`` states around the chain (for a pipeline that does not draw from its key
alone), and for ``Compose`` the sample's shared generator and each step's folded key.
The replay must end on training's own output, bit for bit; where it does not (a
composition that does more between its steps than call them: albumentations' ``Compose``,
with its own generator and checks), the pipeline is measured as a whole, one line, and
the table says why. Each step is measured on the sample as it reaches that step:

- *intensity change*: the mean ``|out - in|`` over pixels and channels, on the images'
  scale (0-255 for uint8; for float32 the range of the shown raw images) and as a
  percentage of it; where the step changes the size, against the input resized to the
  output's size (bilinear, :func:`repro.components.data.augment.resize_image`);
- *displacement*: the same step, under the very state it drew from for the image, run on a
  4-channel float32 *coordinate image* -- each pixel's column and row (in the output's
  pixel units), a channel of ones and one of zeros -- instead of the image. Where a pixel
  of the output came from is read off it: ``(x - zeros) / (ones - zeros)``, so a
  brightness or contrast change applied alike to every channel (one affine map an image,
  as the shipped transforms do) cancels; pixels moved in from outside the image (ones
  channel near 0) are left out. The mean distance to the output pixel's own position is
  the displacement. A step that will not take such an image, or that changes channels
  unequally (noise, per-channel colour), gives 'n/a' or a number that is not a pure
  displacement: read it with the intensity column.

A step with displacement < 0.5 px and intensity change < 0.5% of the scale (or, where the
displacement is n/a, the intensity change alone: the pixels did not visibly change) is
flagged: "no visible effect (check its parameters)"; a step that moves pixels, but by less
than half a pixel on average (0.05 to 0.5 px: an elastic deformation whose alpha is too
small for its sigma), "moves pixels under half a pixel". A step that changes the image's
size is not flagged (the table says 'resized').
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import random
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from repro.base.errors import ReproError
from repro.base.files import atomic_write
from repro.base.rng import derive_seed
from repro.components.data import IGNORE, Compose, DataSplits, KeyedPipeline, Resize
from repro.components.data.augment import (
    _Albumentations,
    _call,
    keyed_global_state,
    one_line,
    resize_image,
)
from repro.components.data.loading import KeyedBatches
from repro.engine.build import build_data
from repro.engine.inference import overlay_image

# the flag's thresholds: below both, a transform did nothing anyone would see
NO_EFFECT_PX = 0.5
NO_EFFECT_FRACTION = 0.005  # of the images' scale
BARELY_MOVED_PX = 0.05  # below: no geometric step (colour steps measure ~0 here)
CELL = 128  # a picture's cells are enlarged (nearest, by a whole factor) towards this side
GAP = 4  # pixels between cells
BACKGROUND = 32  # the grid's background grey
NOT_SCORED = (160, 160, 160)  # mask value 255 in the overlay


@dataclass
class Effect:
    """One transform's (or the whole pipeline's) effect on the shown samples: mean
    displacement in output pixels and mean intensity change on the images' scale (None:
    n/a), ``resized`` the first size change seen ("" when it kept the size)."""

    name: str
    displacement: float | None
    intensity: float | None
    scale: float
    resized: str = ""
    # the step rounded its output to whole values (a colour step on 8-bit images): its
    # displacement is that rounding's, a fraction of a pixel, not a move
    rounded: bool = False

    @property
    def barely_moves(self) -> bool:
        """A geometric step that moves pixels, but by less than half a pixel on average (an
        elastic deformation with a small alpha): it changes the intensity (resampling
        smooths) and nothing a model could learn from."""
        return (
            not self.resized
            and not self.rounded
            and self.displacement is not None
            and BARELY_MOVED_PX <= self.displacement < NO_EFFECT_PX
        )

    @property
    def flagged(self) -> bool:
        """No visible effect: moved less than 0.5 px (or n/a) and changed the intensity by
        less than 0.5% of the scale, without changing the size."""
        return (
            not self.resized
            and self.intensity is not None
            and self.intensity < NO_EFFECT_FRACTION * self.scale
            and (self.displacement is None or self.displacement < NO_EFFECT_PX)
        )


@dataclass
class Preview:
    """The shown samples (raw and, with a training pipeline, augmented), each transform's
    :class:`Effect`, and notes on what could not be measured."""

    pipeline: str
    epoch: int
    indices: list[int]
    raw: list[tuple[torch.Tensor, Any]]
    augmented: list[tuple[torch.Tensor, Any]] | None
    effects: list[Effect] = field(default_factory=list)
    scale: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def segmentation(self) -> bool:
        target = self.raw[0][1]
        return isinstance(target, torch.Tensor) and target.dim() == 2

    def columns(self) -> list[str]:
        shown = "raw" if self.augmented is None else "augmented"
        cols = ["raw"] if self.augmented is None else ["raw", f"augmented (epoch {self.epoch})"]
        return cols + ([f"mask over {shown}"] if self.segmentation else [])

    def format(self) -> str:
        """The table printed by ``repro preview``: one line per transform."""
        samples = ", ".join(str(i) for i in self.indices)
        lines = [f"augment.train: {self.pipeline}; training samples {samples}"]
        if self.augmented is None:
            return "\n".join([*lines, *self.notes])
        width = max([9, *(len(e.name) for e in self.effects)])
        lines.append(f"intensity change: mean |out - in| on {self.scale}")
        lines.append(f"  {'transform':<{width}}  {'displacement':>12}  {'intensity change':>16}")
        for e in self.effects:
            moved = "n/a" if e.displacement is None else f"{e.displacement:.2f} px"
            if e.intensity is None:
                changed = "n/a"
            else:
                changed = f"{e.intensity:.3g} ({100 * e.intensity / e.scale:.1f}%)"
            flag = "no visible effect (check its parameters)" if e.flagged else ""
            if e.barely_moves and not e.flagged:
                flag = "moves pixels under half a pixel (check its parameters)"
            flag = f"resized {e.resized}" if e.resized else flag
            lines.append(f"  {e.name:<{width}}  {moved:>12}  {changed:>16}  {flag}".rstrip())
        return "\n".join([*lines, *self.notes])

    def grid(self) -> torch.Tensor:
        """The picture (3×H×W uint8): a row per sample, the columns of :meth:`columns`."""
        rows = []
        for k, (image, target) in enumerate(self.raw):
            row = [rgb8(image)]
            shown, mask = (image, target) if self.augmented is None else self.augmented[k]
            if self.augmented is not None:
                row.append(rgb8(shown))
            if self.segmentation:
                row.append(mask_overlay(shown, mask))
            rows.append(row)
        side = max(max(c.shape[1:]) for row in rows for c in row)
        zoom = max(1, CELL // side)
        h = max(c.shape[1] for row in rows for c in row) * zoom
        w = max(c.shape[2] for row in rows for c in row) * zoom
        out = torch.full(
            (3, GAP + len(rows) * (h + GAP), GAP + len(rows[0]) * (w + GAP)),
            BACKGROUND,
            dtype=torch.uint8,
        )
        for r, row in enumerate(rows):
            for c, cell in enumerate(row):
                big = cell.repeat_interleave(zoom, 1).repeat_interleave(zoom, 2)
                top, left = GAP + r * (h + GAP), GAP + c * (w + GAP)
                out[:, top : top + big.shape[1], left : left + big.shape[2]] = big
        return out


def rgb8(image: torch.Tensor) -> torch.Tensor:
    """An image as 8-bit RGB (3×H×W): 3 channels as RGB, more: the first 3, 1 or 2: the
    first as grey; float32 stretched from its own min/max to 0-255."""
    return overlay_image(image, torch.zeros(image.shape[1:], dtype=torch.uint8))


def mask_overlay(image: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The image with its mask: each class other than 0 in its colour (``repro predict
    --overlay``'s), pixels marked 255 (not scored) in grey."""
    ignored = mask == IGNORE
    shown = overlay_image(image, torch.where(ignored, 0, mask))
    grey = torch.tensor(NOT_SCORED, dtype=torch.uint8).view(3, 1, 1)
    return torch.where(ignored[None], grey, shown)


# ----------------------------------------------------------------------------- the preview


def run_preview(cfg: DictConfig, n: int = 8, epoch: int = 0) -> Preview:
    """The preview of ``n`` training samples (the first ``n`` of the split) in ``epoch``,
    for the config as training composes it."""
    check_counts(n, epoch)
    data = build_data(cfg)
    return preview_splits(data, list(range(min(n, len(data.train)))), epoch)


def check_counts(n: int, epoch: int) -> None:
    """``--n`` and ``--epoch``, in one line each when they cannot be shown."""
    if n <= 0:
        raise ReproError(f"--n {n}: give the number of samples to show, 1 or more.")
    if epoch < 0:
        raise ReproError(f"--epoch {epoch}: give an epoch of 0 or more.")


def preview_splits(data: DataSplits, indices: list[int], epoch: int = 0) -> Preview:
    """The preview of the training samples ``indices`` of ``data`` (built, its pipelines
    attached: :func:`repro.engine.build.build_data`) in ``epoch``."""
    split = data.train
    pipeline = data.train_pipeline or KeyedPipeline(None, 0)
    raw = [_first(split.fetch(torch.tensor([i]))) for i in indices]
    p = pipeline.pipeline
    if p is None or type(p) is Resize:
        note = (
            f"no training augmentation (augment.train: {pipeline.name}, resizing at most): "
            "nothing to preview beyond the raw samples."
        )
        return Preview(pipeline.name, epoch, list(indices), raw, None, notes=[note])
    batches = KeyedBatches(split, pipeline)  # as training's loader fetches a sample
    augmented = [_first(batches.fetch(torch.tensor([epoch]), torch.tensor([i]))) for i in indices]
    scale = Scale.of([image for image, _ in raw])
    preview = Preview(pipeline.name, epoch, list(indices), raw, augmented, scale=scale.text)
    steps, why = _steps(p)
    if steps:
        effects = _replayed(pipeline, steps, raw, augmented, indices, epoch, scale)
        if isinstance(effects, str):
            why = effects
        else:
            preview.effects = effects
    if not preview.effects:
        preview.effects = [_whole(pipeline, raw, augmented, indices, epoch, scale)]
        if why:
            preview.notes.append(f"measured as a whole: {why}.")
    return preview


def _first(fetched: tuple[Any, Any]) -> tuple[torch.Tensor, Any]:
    """The one sample of a fetch, its target as the pipeline gets it (a 0-d label tensor)."""
    images, targets = fetched
    return images[0], targets[0]


@dataclass
class Scale:
    """The images' value scale: intensity changes are given on it, and the coordinate image
    lives in its middle half (:func:`coordinate_image`)."""

    low: float
    high: float
    text: str

    @property
    def span(self) -> float:
        return self.high - self.low

    @classmethod
    def of(cls, images: list[torch.Tensor]) -> Scale:
        """0-255 for uint8 images, else the range of the shown raw images."""
        if all(i.dtype == torch.uint8 for i in images):
            return cls(0.0, 255.0, "0-255 (uint8)")
        low = min(float(i.double().min()) for i in images)
        high = max(float(i.double().max()) for i in images)
        high = high if high > low else low + 1.0
        return cls(low, high, f"{low:.3g} to {high:.3g} (float32: the shown raw images' range)")


def _steps(pipeline: Any) -> tuple[list[Any] | None, str]:
    """The transforms of a composition, or None (and why, when it has some)."""
    transforms = getattr(pipeline, "transforms", None)
    if not isinstance(transforms, list | tuple) or not transforms:
        return None, ""
    if isinstance(pipeline, _Albumentations):
        return None, (
            "albumentations' Compose runs its transforms itself, from its own generator; to "
            "see one of them, preview a pipeline of it alone"
        )
    if not all(callable(t) for t in transforms):
        return None, f"{type(pipeline).__name__}.transforms holds items that are not callable"
    return list(transforms), ""


# ----------------------------------------------------------------------------- measuring


def describe(transform: Any) -> str:
    """A transform's class (or function) name and its simple settings, at most 60 characters."""
    if isinstance(transform, functools.partial):
        return describe(transform.func)
    if inspect.isfunction(transform) or inspect.isbuiltin(transform):
        return transform.__qualname__
    settings = []
    for key, value in getattr(transform, "__dict__", {}).items():
        if key.startswith("_") or key in ("training", "keyed", "size"):
            continue
        if isinstance(value, bool | int | float | str) or (
            isinstance(value, list | tuple)
            and len(value) <= 4
            and all(isinstance(v, int | float) for v in value)
        ):
            settings.append(f"{key}={_short(value)}")
    text = f"{type(transform).__name__}({', '.join(settings)})"
    return text if len(text) <= 60 else text[:58] + "…)"


def _short(value: Any) -> str:
    if isinstance(value, float) and not isinstance(value, bool):
        return f"{value:g}"
    if isinstance(value, list | tuple):
        return "(" + ", ".join(_short(v) for v in value) + ")"
    return repr(value) if isinstance(value, str) else str(value)


def coordinate_image(size: tuple[int, int], scale: Scale) -> torch.Tensor:
    """4×H×W float32 for an input of ``size`` (h, w): each pixel's column and row (its
    centre, as a fraction of the width and height) mapped into ``[low, high]``, a channel of
    ``high`` and one of ``low``, where ``low`` and ``high`` bound the middle half of the
    images' scale: values a transform that rounds or clamps to that scale keeps."""
    low = scale.low + scale.span / 4
    high = scale.high - scale.span / 4
    (h, w), span = size, high - low
    rows = low + span * (torch.arange(h, dtype=torch.float64) + 0.5) / h
    cols = low + span * (torch.arange(w, dtype=torch.float64) + 0.5) / w
    y, x = torch.meshgrid(rows, cols, indexing="ij")
    return torch.stack([x, y, torch.full_like(x, high), torch.full_like(x, low)]).float()


def displacement(coordinates: Any, size: tuple[int, int]) -> float | None:
    """The mean distance (in pixels of the output, of ``size``) from each output pixel to
    where it came from, read off a step's output for :func:`coordinate_image` (see the
    module docstring); None when that output is not one (another shape, no pixel from
    inside the image)."""
    shape = (4, *size)
    if not (isinstance(coordinates, torch.Tensor) and tuple(coordinates.shape) == shape):
        return None
    c = coordinates.double()
    gain = c[2] - c[3]  # (high - low) times the step's gain at each pixel; 0 outside
    top = float(gain.max())
    if not math.isfinite(top) or top <= 0:
        return None
    inside = gain > 0.5 * top
    x = (c[0] - c[3]) / gain * size[1] - 0.5  # the source's column, in output pixels
    y = (c[1] - c[3]) / gain * size[0] - 0.5
    rows, cols = torch.meshgrid(
        torch.arange(size[0], dtype=torch.float64),
        torch.arange(size[1], dtype=torch.float64),
        indexing="ij",
    )
    value = float(torch.hypot(x - cols, y - rows)[inside].mean())
    return value if math.isfinite(value) else None


def intensity_change(before: torch.Tensor, after: torch.Tensor) -> float | None:
    """Mean ``|after - before|`` over pixels and channels on the images' own scale; where
    the size changed, against ``before`` resized to ``after``'s size; None for another
    number of channels or dtype."""
    if not isinstance(after, torch.Tensor) or after.dim() != 3:
        return None
    if after.shape[0] != before.shape[0] or after.dtype != before.dtype:
        return None
    reference = resize_image(before, tuple(after.shape[-2:]))
    return float((after.double() - reference.double()).abs().mean())


class _Tally:
    """Sums one transform's measurements over the samples."""

    def __init__(self, name: str, scale: Scale) -> None:
        self.name, self.scale = name, scale
        self.moved: list[float | None] = []
        self.changed: list[float | None] = []
        self.rounded: list[bool] = []  # the step rounded the coordinates to whole values
        self.resized = ""

    def add(self, before: torch.Tensor, after: torch.Tensor, coordinates: Any) -> None:
        size = tuple(after.shape[-2:])
        if size != tuple(before.shape[-2:]) and not self.resized:
            self.resized = f"{before.shape[-2]}×{before.shape[-1]} -> {size[0]}×{size[1]}"
        self.moved.append(displacement(coordinates, size))
        self.changed.append(intensity_change(before, after))
        if isinstance(coordinates, torch.Tensor) and coordinates.is_floating_point():
            self.rounded.append(bool(torch.equal(coordinates, coordinates.round())))

    def effect(self) -> Effect:
        def mean(values: list[float | None]) -> float | None:
            return None if None in values else sum(values) / len(values)  # type: ignore[arg-type]

        return Effect(
            self.name,
            mean(self.moved),
            mean(self.changed),
            self.scale.span,
            self.resized,
            rounded=bool(self.rounded) and all(self.rounded),
        )


def _whole(
    pipeline: KeyedPipeline,
    raw: list[tuple[torch.Tensor, Any]],
    augmented: list[tuple[torch.Tensor, Any]],
    indices: list[int],
    epoch: int,
    scale: Scale,
) -> Effect:
    """The whole pipeline as one transform: its coordinate run through the very call
    training makes (:class:`KeyedPipeline`, which sets the state from the key)."""
    tally = _Tally(describe(pipeline.pipeline), scale)
    for (image, target), (out, _), index in zip(raw, augmented, indices, strict=True):
        coords = coordinate_image(tuple(image.shape[-2:]), scale)
        try:
            moved = pipeline(coords, _copy(target), epoch, index)[0]
        except Exception:  # a transform that will not take a float 4-channel image: n/a
            moved = None
        tally.add(image, out, moved)
    return tally.effect()


def _replayed(
    pipeline: KeyedPipeline,
    steps: list[Any],
    raw: list[tuple[torch.Tensor, Any]],
    augmented: list[tuple[torch.Tensor, Any]],
    indices: list[int],
    epoch: int,
    scale: Scale,
) -> list[Effect] | str:
    """Each step's effect, replayed sample by sample under the sample's key; why not (a
    str) when a step cannot be called alone or the replay does not end on training's
    output."""
    tallies = [_Tally(describe(t), scale) for t in steps]
    for (image, target), (out, out_target), index in zip(raw, augmented, indices, strict=True):
        key = (pipeline.seed, int(epoch), int(index))
        with pipeline.settings.pinned(), _key_states(pipeline, key):  # as training calls it
            generator = torch.Generator().manual_seed(
                derive_seed(pipeline.seed, "augment-generator", epoch, index)
            )  # the one KeyedPipeline gives a pipeline that takes a generator
            for place, (step, tally) in enumerate(zip(steps, tallies, strict=True)):
                run = _step_call(pipeline, step, place, key, generator)
                before = _states(generator)
                try:
                    result = run(image.clone(), _copy(target))
                except Exception as err:
                    return f"{describe(step)} cannot be called alone ({one_line(err)})"
                if not (isinstance(result, tuple | list) and len(result) == 2):
                    return f"{describe(step)} does not return (image, target) alone"
                after = _states(generator)
                _restore(before, generator)  # the coordinates take the very same draws
                coords = coordinate_image(tuple(image.shape[-2:]), scale)
                try:
                    moved = run(coords, _copy(target))[0]
                except Exception:  # it will not take a float 4-channel image: n/a
                    moved = None
                _restore(after, generator)
                tally.add(image, result[0], moved)
                image, target = result
        if not (_equal(image, out) and _equal(target, out_target)):
            return "its transforms called one by one do not give training's output"
    return [t.effect() for t in tallies]


def _step_call(
    pipeline: KeyedPipeline, step: Any, place: int, key: tuple[int, int, int], generator: Any
) -> Callable[[torch.Tensor, Any], Any]:
    """How the composition calls its step ``place``: ``repro.components.data.augment.Compose`` with the
    key (folded with the place after the first) and the shared generator it accepts, others
    (torchvision's v2 ``Compose``) plainly with ``(image, target)``."""
    if isinstance(pipeline.pipeline, Compose):
        seed, epoch, index = key
        own = key if place == 0 else (derive_seed(seed, "augment-compose", place), epoch, index)
        return lambda image, target: _call(step, image, target, own, generator)
    return step


@contextlib.contextmanager
def _key_states(pipeline: KeyedPipeline, key: tuple[int, int, int]) -> Iterator[None]:
    """The global states as :class:`KeyedPipeline` sets them around the pipeline's call."""
    if pipeline.own_keys:
        yield
    else:
        with keyed_global_state(*key):
            yield


def _states(generator: torch.Generator) -> tuple[Any, ...]:
    return (
        torch.get_rng_state(),
        np.random.get_state(),
        random.getstate(),
        generator.get_state(),
    )


def _restore(states: tuple[Any, ...], generator: torch.Generator) -> None:
    torch.set_rng_state(states[0])
    np.random.set_state(states[1])
    random.setstate(states[2])
    generator.set_state(states[3])


def _copy(target: Any) -> Any:
    return target.clone() if isinstance(target, torch.Tensor) else target


def _equal(a: Any, b: Any) -> bool:
    """Images and masks bit for bit (dtype, shape, values); class labels as integers (the
    loader stacks them into int64)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() > 0:
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    try:
        return int(a) == int(b)
    except (TypeError, ValueError, RuntimeError):
        return False


# ------------------------------------------------------------------------------- the PNG


def png_bytes(rgb: torch.Tensor) -> bytes:
    """A 3×H×W uint8 picture as an 8-bit RGB PNG: zlib and struct, no imaging library. Each
    row is filtered by PNG's Sub (the difference to the pixel on its left: an enlarged
    cell's repeated pixels become zeros; zlib finds its repeated rows itself)."""
    pixels = rgb.permute(1, 2, 0).contiguous().numpy()
    h, w, _ = pixels.shape
    sub = pixels.copy()
    sub[:, 1:] = pixels[:, 1:] - pixels[:, :-1]  # uint8 arithmetic wraps, as PNG's Sub does
    data = np.concatenate([np.ones((h, 1), np.uint8), sub.reshape(h, w * 3)], axis=1).tobytes()

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(data, 9))
        + chunk(b"IEND", b"")
    )


def write_preview(preview: Preview, out: Path, force: bool = False) -> None:
    """The picture to ``out``, atomically; an existing file only with ``force``."""
    if out.exists() and not force:
        raise ReproError(f"{out}: exists; give another --out, or --force to overwrite it.")
    if out.is_dir():
        raise ReproError(f"{out}: is a directory; give a file name for --out (preview.png).")
    data = png_bytes(preview.grid())
    atomic_write(out, lambda f: f.write(data))
