"""How an image's pixel values become the model's input: ``data.intensity`` of the image
folders (:class:`Intensity`), applied to each image as it is read, before augmentation.

The augmentation pipeline receives, and must return, a uint8 ``C×H×W`` tensor (an 8-bit
image under ``auto``: the loop divides it by 255 on the device, as it always did) or a
float32 ``C×H×W`` tensor (everything else, already mapped here: the loop only normalises it).

Modes (``data.intensity.mode``):

- ``auto``: uint8 stays uint8; an unsigned integer image of more bits becomes float32
  divided by its dtype's maximum (uint16: /65535, so in [0, 1], nothing clipped); a float
  or signed integer image becomes float32 as it is.
- ``fixed``: ``(x - low) / (high - low)`` with ``range: [low, high]`` in the file's units; a
  value outside the range is refused (never clipped).
- ``percentile``: per image and channel, the ``percentiles: [low, high]`` percentiles map
  to 0 and 1, and the values beyond them are clipped to [0, 1].
- ``zscore``: per image and channel ``(x - mean) / std`` (std at least :data:`STD_FLOOR`),
  clipped to ``±clip`` when ``clip`` is set.

The per-image statistics are computed in float64 on the CPU (NumPy; deterministic), the
result is float32. Each call also returns how many values it clipped; the lazy splits keep
those counts for the images of the normalisation's statistics sample, and
:func:`clipped_record` makes the run's record of them (``DataSplits.intensity``, logged and
written into ``summary.json``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from repro.base.errors import ConfigError, DataError

MODES = ("auto", "fixed", "percentile", "zscore")
# the settings and their defaults (conf/data/image_folder.yaml's intensity block)
DEFAULTS: dict[str, Any] = {"mode": "auto", "range": None, "percentiles": [0.5, 99.5], "clip": None}
# the setting each mode uses besides ``mode``
USES = {"auto": (), "fixed": ("range",), "percentile": ("percentiles",), "zscore": ("clip",)}
# zscore: the smallest standard deviation divided by (a constant channel maps to 0)
STD_FLOOR = 1e-8


def _number(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


def _pair(value: Any) -> bool:
    return isinstance(value, list | tuple) and len(value) == 2 and all(map(_number, value))


class Intensity:
    """The ``data.intensity`` rule, checked at construction (one-line
    :class:`~repro.base.errors.ConfigError` naming ``data.intensity.<key>``); called with an
    image at its file's depth (a ``C×H×W`` tensor of any integer or float dtype), it gives
    the pipeline's input: uint8 (``auto`` on a uint8 image: the very tensor it was given)
    or float32, and the number of values it clipped. ``settings`` None: ``auto``."""

    def __init__(self, settings: Mapping[str, Any] | None = None) -> None:
        if settings is not None and not isinstance(settings, Mapping):
            raise ConfigError(
                f"config error: data.intensity={settings!r} is invalid; allowed: a mapping "
                "such as {mode: percentile, percentiles: [0.5, 99.5]}."
            )
        given = dict(settings or {})
        for key in given:
            if key not in DEFAULTS:
                raise ConfigError(
                    f"config error: data.intensity.{key} is not a setting of data.intensity; "
                    f"allowed: {', '.join(DEFAULTS)}."
                )
        s = {**DEFAULTS, **given}
        mode = s["mode"]
        if mode not in MODES:
            raise ConfigError(
                f"config error: data.intensity.mode={mode!r} is invalid; allowed: "
                f"{', '.join(MODES[:-1])} or {MODES[-1]}."
            )
        if mode == "fixed" and s["range"] is None:
            raise ConfigError(
                "config error: data.intensity.mode=fixed needs data.intensity.range=[low, high] "
                "(in the file's units, mapped to [0, 1])."
            )
        if s["range"] is not None and not (_pair(s["range"]) and s["range"][0] < s["range"][1]):
            raise ConfigError(
                f"config error: data.intensity.range={s['range']} is invalid; allowed: [low, "
                "high], two finite numbers with low < high."
            )
        p = s["percentiles"]
        if not (_pair(p) and 0 <= p[0] < p[1] <= 100):
            raise ConfigError(
                f"config error: data.intensity.percentiles={p} is invalid; allowed: [low, high] "
                "with 0 <= low < high <= 100."
            )
        if s["clip"] is not None and not (_number(s["clip"]) and s["clip"] > 0):
            raise ConfigError(
                f"config error: data.intensity.clip={s['clip']} is invalid; allowed: a number > "
                "0 (z-scores clipped to ±clip) or null."
            )
        for key in ("range", "percentiles", "clip"):  # set, but ignored by this mode?
            if key not in USES[mode] and _differs(s[key], DEFAULTS[key]):
                raise ConfigError(
                    f"config error: data.intensity.{key} is set but data.intensity.mode={mode} "
                    f"does not use it; set the mode that does or leave data.intensity.{key} at "
                    f"{DEFAULTS[key] if DEFAULTS[key] is not None else 'null'}."
                )
        self.mode: str = mode
        self.range = tuple(float(v) for v in s["range"]) if s["range"] is not None else None
        self.percentiles = (float(p[0]), float(p[1]))
        self.clip = float(s["clip"]) if s["clip"] is not None else None

    def record(self) -> dict[str, Any]:
        """The mode and the settings it uses, as the run records them."""
        values = {"range": self.range, "percentiles": self.percentiles, "clip": self.clip}
        used = {k: values[k] for k in USES[self.mode]}
        return {
            "mode": self.mode,
            **{k: list(v) if isinstance(v, tuple) else v for k, v in used.items()},
        }

    def __repr__(self) -> str:
        return f"Intensity({self.record()})"

    def __call__(self, image: torch.Tensor, path: Path | str) -> tuple[torch.Tensor, int]:
        """``(the pipeline's input, the number of values clipped)`` for the ``C×H×W``
        ``image`` read from ``path`` (named in the errors: a NaN or infinite value, a value
        outside ``data.intensity.range``)."""
        if self.mode == "auto" and image.dtype == torch.uint8:
            return image, 0  # today's path: uint8 to the pipeline, /255 on the device
        x = image.numpy()
        if x.dtype.kind == "f" and not bool(np.isfinite(x).all()):
            raise DataError(
                f"data: image {path} holds NaN or infinite values, which would reach the "
                "model as they are; fix or remove the file."
            )
        if self.mode == "auto":
            if x.dtype.kind == "u":
                x = x.astype(np.float64) / np.iinfo(x.dtype).max
            return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), 0
        if self.mode == "fixed":
            return self._fixed(x, path), 0
        out = np.empty(x.shape, dtype=np.float64)
        clipped = 0
        for c in range(x.shape[0]):  # per channel, in float64
            xc = x[c].astype(np.float64)
            if self.mode == "percentile":
                lo, hi = np.percentile(xc, self.percentiles)
                clipped += int(np.count_nonzero((xc < lo) | (xc > hi)))
                y = (xc - lo) / (hi - lo) if hi > lo else (xc > hi).astype(np.float64)
                out[c] = np.clip(y, 0.0, 1.0)
            else:  # zscore
                y = (xc - xc.mean()) / max(float(xc.std()), STD_FLOOR)
                if self.clip is not None:
                    clipped += int(np.count_nonzero(np.abs(y) > self.clip))
                    y = np.clip(y, -self.clip, self.clip)
                out[c] = y
        return torch.from_numpy(out.astype(np.float32)), clipped

    def _fixed(self, x: np.ndarray, path: Path | str) -> torch.Tensor:
        low, high = self.range
        smallest, largest = x.min().item(), x.max().item()
        if smallest < low or largest > high:
            value = smallest if smallest < low else largest
            raise DataError(
                f"data: image {path} holds the value {value}, outside data.intensity.range="
                f"[{low:g}, {high:g}] (values are never clipped); widen the range to the "
                "files' or fix the file."
            )
        y = (x.astype(np.float64) - low) / (high - low)
        return torch.from_numpy(y.astype(np.float32))


def _differs(value: Any, default: Any) -> bool:
    if isinstance(value, list | tuple) and isinstance(default, list | tuple):
        return [float(v) for v in value] != [float(v) for v in default]
    return value != default


def clipped_record(split: Any, count: int) -> dict[str, Any] | None:
    """The run's record of a split's intensity rule (its :meth:`Intensity.record`) and the
    fraction of the values clipped in its first ``count`` images (the normalisation's
    statistics sample, read in this process: the counts a lazy split keeps in ``clipped``,
    by index); None for a split without a rule (the synthetic sets, CIFAR-10)."""
    rule = getattr(split, "intensity", None)
    if not isinstance(rule, Intensity):
        return None
    counts = getattr(split, "clipped", None) or {}
    seen = [counts[i] for i in range(count) if i in counts]
    values = sum(n for _, n in seen)
    return {
        **rule.record(),
        "clipped_fraction": sum(c for c, _ in seen) / values if values else 0.0,
        "sample_images": len(seen),
    }


def describe(record: dict[str, Any]) -> str:
    """One line for the log: the rule and the fraction clipped."""
    settings = ", ".join(f"{k} {v}" for k, v in record.items() if k in DEFAULTS and k != "mode")
    return (
        f"data.intensity {record['mode']}{f' ({settings})' if settings else ''}: "
        f"{record['clipped_fraction']:.4%} of the values of the first "
        f"{record['sample_images']} training images clipped"
    )
