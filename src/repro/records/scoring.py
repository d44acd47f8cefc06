"""What scoring a checkpoint needs besides its weights, the evaluated images and the code:
the *scoring record* every checkpoint carries (``state["scoring"]``), so that ``repro
evaluate --folder`` and ``repro predict`` never open the training folder.

A model is trained on inputs normalised with statistics of its training data (the first
:data:`repro.components.data.STATISTICS_SAMPLE` training images' channel mean and std),
read by a rule (``data.intensity``), with so many channels and classes of given names.
Recomputed from the training folder at evaluation time, they move when the folder grows,
and vanish with it; recorded when the checkpoint is written, the checkpoint scores the same
for as long as it is kept. nnU-Net keeps its normalisation scheme and intensity properties
with the trained model (``plans.json``, ``dataset_fingerprint.json``) for the same reason.

One versioned mapping (:data:`SCORING_FORMAT`), plain values only (it loads with
``torch.load(weights_only=True)``, and reads as JSON)::

    format         "repro.scoring.v1"
    num_classes    the model's output classes
    channels       input channels the model takes
    class_names    class i's name, or null (unnamed: their index)
    image_size     data.image_size (the training patch's side), or null
    mean, std      per channel (or one for all channels, where the dataset gives one):
                   inputs are (x - mean) / std after the intensity rule (8-bit files
                   under data.intensity auto divided by 255 first)
    intensity      data.intensity's rule ({mode, and the settings it uses}), or null
                   (not a folder: auto)
    mask_map       data.mask_map (file mask value -> class), or null
    inference      the run's inference.* settings
    eval_pipeline  the run's augment.eval node (what each evaluated image goes through)

The data-derived entries (classes, channels, statistics, the intensity rule, the mask
map) are what scoring reads from here; ``inference`` and ``eval_pipeline`` are copies of
the run's config (which the checkpoint also holds and evaluation compares key by key), so
that the record alone says how the checkpoint is scored. A later format (3-D geometry:
spacing, orientation) adds keys and a new version; a reader refuses a version it does not
know in one line. A checkpoint written before the record fell back to the training folder
(``repro.engine.inference.scoring_data``, with one warning).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from repro.base.errors import CheckpointError

SCORING_FORMAT = "repro.scoring.v1"
SCORING_KEY = "scoring"  # its key in a checkpoint's state
# the keys of data.intensity's rule (repro.components.data.intensity.DEFAULTS)
_RULE_KEYS = ("mode", "range", "percentiles", "clip")


def scoring_record(data: Any, cfg: DictConfig) -> dict[str, Any]:
    """The record of a run's ``data`` (its :class:`repro.components.data.DataSplits`, the
    normalisation computed) and settled ``cfg``, as checkpoints carry it."""
    mean, std = data.normalisation()
    intensity = getattr(data, "intensity", None)  # the rule and what it clipped, or None
    rule = {k: v for k, v in intensity.items() if k in _RULE_KEYS} if intensity else None
    node = cfg.get("data") or {}
    mask_map = node.get("mask_map") if isinstance(node, DictConfig) else None
    augment = cfg.get("augment") or {}
    evaluation = augment.get("eval") if isinstance(augment, DictConfig) else None
    return {
        "format": SCORING_FORMAT,
        "num_classes": int(data.num_classes),
        "channels": int(data.in_channels),
        "class_names": [str(n) for n in data.class_names] if data.class_names else None,
        "image_size": int(data.image_size) if data.image_size is not None else None,
        "mean": [float(v) for v in mean],
        "std": [float(v) for v in std],
        "intensity": rule,
        "mask_map": {int(k): int(v) for k, v in mask_map.items()} if mask_map else None,
        "inference": _plain(cfg.get("inference")),
        "eval_pipeline": _plain(evaluation),
    }


def _plain(node: Any) -> Any:
    if node is None:
        return None
    if not isinstance(node, DictConfig):
        return node
    return OmegaConf.to_container(node, resolve=True, enum_to_str=True)


@dataclass(frozen=True)
class ScoringRecord:
    """A checkpoint's scoring record, checked (:meth:`from_state`)."""

    num_classes: int
    channels: int
    class_names: tuple[str, ...] | None
    image_size: int | None
    mean: tuple[float, ...]
    std: tuple[float, ...]
    intensity: dict[str, Any] | None
    mask_map: dict[int, int] | None
    inference: dict[str, Any] | None
    eval_pipeline: dict[str, Any] | None

    @classmethod
    def from_state(cls, state: dict[str, Any], path: Path) -> ScoringRecord | None:
        """The record of the checkpoint ``state`` read from ``path``; None when it has none
        (written before checkpoints carried one). A record of another format, or one whose
        entries are not what they must be, is one :class:`CheckpointError` naming the
        file."""
        record = state.get(SCORING_KEY)
        if record is None:
            return None

        def bad(what: str) -> CheckpointError:
            return CheckpointError(
                f"{path}: its scoring record {what}; the checkpoint is damaged or not "
                "this template's: use the run's own checkpoint file."
            )

        if not isinstance(record, dict):
            raise bad(f"is a {type(record).__name__}, not a mapping")
        if record.get("format") != SCORING_FORMAT:
            raise bad(
                f"has the format {record.get('format')!r}, which this version does not read "
                f"(it reads {SCORING_FORMAT!r}: a newer template wrote it?)"
            )
        count, channels = record.get("num_classes"), record.get("channels")
        if not (_positive_int(count) and _positive_int(channels)):
            raise bad(f"has num_classes={count!r}, channels={channels!r}")
        mean, std = record.get("mean"), record.get("std")
        if not (_floats(mean, channels) and _floats(std, channels) and min(std) > 0):
            raise bad(f"has no channel statistics for its {channels} channels")
        if len(mean) != len(std):
            raise bad(f"has {len(mean)} means and {len(std)} standard deviations")
        names = record.get("class_names")
        if names is not None and not (
            isinstance(names, list)
            and len(names) == count
            and all(isinstance(n, str) for n in names)
        ):
            raise bad(f"names {names!r} for {count} classes")
        size = record.get("image_size")
        if size is not None and not _positive_int(size):
            raise bad(f"has image_size={size!r}")
        mapping = record.get("mask_map")
        if mapping is not None and not (
            isinstance(mapping, dict) and all(_int(k) and _int(v) for k, v in mapping.items())
        ):
            raise bad(f"has mask_map={mapping!r}")
        for key in ("intensity", "inference", "eval_pipeline"):
            if record.get(key) is not None and not isinstance(record.get(key), dict):
                raise bad(f"has {key}={record.get(key)!r}")
        return cls(
            num_classes=count,
            channels=channels,
            class_names=tuple(names) if names is not None else None,
            image_size=size,
            mean=tuple(float(v) for v in mean),
            std=tuple(float(v) for v in std),
            intensity=record.get("intensity"),
            mask_map=dict(mapping) if mapping is not None else None,
            inference=record.get("inference"),
            eval_pipeline=record.get("eval_pipeline"),
        )


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value: Any) -> bool:
    return _int(value) and value > 0


def _floats(values: Any, count: int) -> bool:
    """One finite float a channel, or one for all (a dataset's own statistics may be one
    number: the normaliser broadcasts it)."""
    return (
        isinstance(values, list)
        and len(values) in (1, count)
        and all(isinstance(v, float) and math.isfinite(v) for v in values)
    )
