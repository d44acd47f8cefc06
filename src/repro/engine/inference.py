"""A trained run's checkpoint on data it did not train on: the test split (``trainer.test``
at the end of a run, ``repro evaluate RUN_DIR`` later), an annotated folder (``repro
evaluate RUN_DIR --folder``) and new inputs (``repro predict``).

``trainer.test`` and ``repro evaluate`` are one function, :func:`evaluate_checkpoint`: the
model (and its weight average, with ``trainer.ema``) rebuilt from the run's config, the
checkpoint's weights loaded, :func:`repro.engine.evaluation.evaluate` in its fixed order, under the
run's determinism settings. So the two give the same bits: a test score cannot depend on
whether it was computed at the end of training or a week later (as long as the machine and
versions are the same; ``env.json`` says which they were).

What the training data decided -- the normalisation statistics, the intensity rule, the
channel count, the class names -- comes from the checkpoint's scoring record
(:mod:`repro.records.scoring`, :func:`scoring_data`), never from the training folder:
``--folder`` and ``repro predict`` do not open it (it may have grown, moved or gone), and
a test split is normalised as the model was trained. A checkpoint written before the
record falls back to the training folder, with one warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from repro.base.errors import CheckpointError, ConfigError
from repro.base.files import BEST_FILE
from repro.components.data import Augmented, DataSplits, DeviceNormalizer, Intensity, Split
from repro.defense.config import check_data_path, flatten
from repro.engine.build import Training, build_data, build_training, keyed_pipeline
from repro.engine.evaluation import csv_field, evaluate_split, logits_at_own_size
from repro.engine.settle import record_channels_last
from repro.records.checkpoint import (
    cannot_restore,
    evaluation_mismatches,
    load_checkpoint,
    mismatches,
    read_checkpoint,
)
from repro.records.scoring import ScoringRecord

log = logging.getLogger("repro")
SPLITS = ("test", "val")


def choose_checkpoint(run_dir: Path, cfg: DictConfig, which: str = "best") -> Path:
    """``best``: the run's ``best.pt``, or its final checkpoint when no evaluation gave a
    finite value; ``last``: the final checkpoint; anything else: a checkpoint file."""
    final = run_dir / str(cfg.trainer.checkpoint_name)
    if which == "best":
        return run_dir / BEST_FILE if (run_dir / BEST_FILE).is_file() else final
    if which == "last":
        return final
    return Path(which)


def evaluate_checkpoint(
    cfg: DictConfig,
    checkpoint: Path,
    device: torch.device,
    split: str = "test",
    data: DataSplits | None = None,
    force: bool = False,
    per_sample: Path | None = None,
) -> dict[str, Any]:
    """The task's metrics of ``checkpoint`` on ``split`` (``test`` or ``val``), with the
    checkpoint it used (path, step, SHA-256) and the number of samples; each sample's row
    into the CSV ``per_sample`` if given (:meth:`repro.engine.evaluation.Evaluation.write_per_sample`).
    A config that differs from the checkpoint's where it can change them is refused
    (:func:`settings_differ`), unless ``force``."""
    if split not in SPLITS:
        raise ConfigError(f"split {split!r}: give test or val.")
    data = data or build_data(cfg)  # the split is drawn from the training data's folder
    held_out = data.test if split == "test" else data.val
    if held_out is None:
        raise ConfigError(
            f"data ({cfg.data._target_}) has no test split; give it one (data.test_size for "
            "the synthetic sets, data.test_fraction for the image folders), or evaluate the "
            "validation split: --split val."
        )
    return _evaluated(cfg, checkpoint, device, lambda _: held_out, split, force, per_sample, data)


def evaluate_folder(
    cfg: DictConfig,
    checkpoint: Path,
    device: torch.device,
    folder: Path,
    force: bool = False,
    per_sample: Path | None = None,
) -> dict[str, Any]:
    """The task's metrics of ``checkpoint`` on every file of an annotated ``folder`` of the
    run's layout (``image_mask_folder``: ``images/`` and ``masks/``; ``image_folder``: a
    sub-folder per class, the run's classes), read as the run reads its data (channels, bit
    depth, intensity mapping, ``mask_map``) and evaluated as its validation split is
    (``inference.*``), metrics named ``external_*``. No split of the folder is made and the
    run's training split is not checked against it. A folder whose classes or channels do
    not fit the run is refused in one line naming the file. What the training data decided
    comes from the checkpoint (:func:`scoring_data`): the training folder is not opened."""

    def split(scored: ScoredData) -> Split:
        return Augmented(external_split(cfg, scored, folder), scored.eval_pipeline)

    result = _evaluated(cfg, checkpoint, device, split, "external", force, per_sample)
    return {"folder": str(folder), **result}


def _evaluated(
    cfg: DictConfig,
    checkpoint: Path,
    device: torch.device,
    split_of: Callable[[ScoredData], Split],
    name: str,
    force: bool,
    per_sample: Path | None,
    data: DataSplits | None = None,
) -> dict[str, Any]:
    """``checkpoint`` restored into the run's model, evaluated on ``split_of(scored)`` (the
    split, given the checkpoint's :class:`ScoredData`; metrics named ``<name>_*``), each
    sample's row into ``per_sample``: the result :func:`evaluate_checkpoint` and
    :func:`evaluate_folder` give. ``data``: the run's data, where the split is drawn from it."""
    loaded = read_checkpoint(checkpoint, map_location=device)  # verified
    state = loaded.state
    scored = scoring_data(cfg, state, checkpoint, data)
    split = split_of(scored)
    # another machine or version than the checkpoint's: the bits may differ from
    # trainer.test's (the metrics are still this machine's, deterministic)
    training, differences = restored(cfg, checkpoint, state, device, scored, force)
    normalize = DeviceNormalizer(scored, device, training.channels_last)
    result = evaluate_split(training, split, normalize, int(cfg.trainer.eval_batch_size))
    if per_sample is not None:
        result.write_per_sample(per_sample)
    return {
        "split": name,
        "checkpoint": checkpoint.name,
        "step": int(state["step"]),
        "checkpoint_sha256": loaded.sha256,
        "samples": len(result.names),
        "metrics": {k.replace("val_", f"{name}_", 1): v for k, v in result.metrics.items()},
        **differences,
    }


def external_split(cfg: DictConfig, data: ScoredData, folder: Path) -> Any:
    """Every file of ``folder`` as one split, read as the run's training data was (the
    checkpoint's record of it, ``data``: channels, intensity rule, mask map, classes; see
    :func:`evaluate_folder`)."""
    from repro.components.data import LazyImageMasks, LazyImages
    from repro.components.data.folders import IMAGE_SUFFIXES, check_text_name, image_mask_pairs

    target = str(cfg.data._target_)
    rule = data.intensity
    if target in ("repro.data.image_mask_folder", "repro.components.data.image_mask_folder"):
        stems, images, masks = image_mask_pairs(folder, "--folder", least=1)
        return LazyImageMasks(
            [images[s] for s in stems],
            [masks[s] for s in stems],
            data.num_classes,
            data.mask_map,
            data.in_channels,
            rule,
        )
    if target in ("repro.data.image_folder", "repro.components.data.image_folder"):
        known = list(data.class_names or ())
        classes = sorted(d.name for d in folder.iterdir() if d.is_dir() and not d.name[0] == ".")
        unknown = [c for c in classes if c not in known]
        if unknown or not classes:
            raise ConfigError(
                f"--folder {folder}: class folders {classes}, but the run's classes are "
                f"{known}; give a folder whose sub-folders are some of the run's classes."
            )
        files = [
            (f, known.index(name))
            for name in classes
            for f in sorted((folder / name).rglob("*"))
            if f.suffix.lower() in IMAGE_SUFFIXES
        ]
        if not files:
            raise ConfigError(f"--folder {folder}: no image files in its class folders.")
        for f, _ in files:
            check_text_name(f, "--folder", folder)
        labels = torch.tensor([label for _, label in files])
        return LazyImages([f for f, _ in files], labels, "stop", data.in_channels, rule, folder)
    raise ConfigError(
        f"--folder evaluates runs on image_folder or image_mask_folder data; this run's data is "
        f"{target}: use --split test or val."
    )


@dataclass
class ScoredData:
    """What scoring a checkpoint needs of the data it was trained on, in the shape the model,
    task and normaliser are built from (:class:`repro.components.data.DataSplits`'s members
    they read): from the checkpoint's scoring record (:meth:`from_record`), or, for a
    checkpoint written before it, from the run's data as built again (:meth:`of`)."""

    num_classes: int
    in_channels: int
    class_names: tuple[str, ...] | None
    image_size: int | None
    mean: tuple[float, ...]
    std: tuple[float, ...]
    intensity: Intensity  # how an input file's values become the pipeline's input
    mask_map: dict[int, int] | None  # a mask file's value -> class (image_mask_folder)
    eval_pipeline: Any  # each evaluated image's way to the model (augment.eval, keyed)

    def normalisation(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        return self.mean, self.std

    @classmethod
    def from_record(cls, record: ScoringRecord, eval_pipeline: Any) -> ScoredData:
        return cls(
            num_classes=record.num_classes,
            in_channels=record.channels,
            class_names=record.class_names,
            image_size=record.image_size,
            mean=record.mean,
            std=record.std,
            intensity=Intensity(record.intensity),
            mask_map=record.mask_map,
            eval_pipeline=eval_pipeline,
        )

    @classmethod
    def of(cls, data: DataSplits, cfg: DictConfig) -> ScoredData:
        mean, std = data.normalisation()
        rule = getattr(data.train, "intensity", None)  # an image folder's data.intensity
        mask_map = OmegaConf.to_container(cfg.data, resolve=True).get("mask_map")
        return cls(
            num_classes=data.num_classes,
            in_channels=data.in_channels,
            class_names=data.class_names,
            image_size=data.image_size,
            mean=tuple(mean),
            std=tuple(std),
            intensity=rule if isinstance(rule, Intensity) else Intensity(),  # else auto
            mask_map={int(k): int(v) for k, v in mask_map.items()} if mask_map else None,
            eval_pipeline=data.eval_pipeline,
        )


def scoring_data(
    cfg: DictConfig, state: dict[str, Any], checkpoint: Path, data: DataSplits | None = None
) -> ScoredData:
    """What scoring ``checkpoint`` (its loaded ``state``) needs of its training data: its
    scoring record (:mod:`repro.records.scoring`), with the evaluation pipeline of ``data``
    (given where a split is drawn from the run's data) or built from ``cfg``. A checkpoint
    written before checkpoints carried the record: the run's data built again from its
    training folder (``data.path``), as before, with one warning that its score follows
    that folder."""
    record = ScoringRecord.from_state(state, checkpoint)
    if record is not None:
        if data is not None:  # a split drawn from the training data as it is now
            _drawn_from_the_same_data(record, data, state, checkpoint)
        pipeline = data.eval_pipeline if data is not None else keyed_pipeline(cfg, "eval")
        return ScoredData.from_record(record, pipeline)
    where = f" at data.path={cfg.data.path}" if "path" in cfg.data else ""
    log.warning(
        f"{checkpoint}: written before checkpoints carried their scoring record, so the "
        f"normalisation, channels and class names come from the training data{where} as it "
        "is now: its score changes if that data has; a run trained again writes "
        "checkpoints that carry them."
    )
    if data is None:
        check_data_path(cfg)
        data = build_data(cfg)
    return ScoredData.of(data, cfg)


def _drawn_from_the_same_data(
    record: ScoringRecord, data: DataSplits, state: dict[str, Any], checkpoint: Path
) -> None:
    """``repro evaluate --split``: the split comes from the training data as it is now. Other
    classes or channels than the checkpoint's (a class folder added, say: every label would
    shift) are refused in one line; other split inputs (files added, removed or renamed, an
    edited group or split CSV) are said: the split is another set of files than the run's."""
    from repro.records.fingerprint import SPLIT_KEY, split_mismatches

    now = (data.num_classes, data.in_channels, tuple(data.class_names or ()) or None)
    then = (record.num_classes, record.channels, record.class_names)
    if now != then:
        raise ConfigError(
            f"{checkpoint}: the training data now has {now[0]} classes {list(now[2] or [])} "
            f"and {now[1]} channels, the checkpoint's {then[0]} classes "
            f"{list(then[2] or [])} and {then[1]} channels: its labels would not be the "
            "model's. Evaluate an annotated folder of the run's classes instead (--folder)."
        )
    recorded = (state.get("environment") or {}).get(SPLIT_KEY)
    for difference in split_mismatches(recorded, getattr(data, "split_inputs", None)):
        log.warning(
            f"evaluate --split: {difference}; the split is drawn from the data as it is now, "
            "another set of files than the run's"
        )


def restored(
    cfg: DictConfig,
    checkpoint: Path,
    state: dict[str, Any],
    device: torch.device,
    data: ScoredData | DataSplits,
    force: bool = False,
) -> tuple[Training, dict[str, list[str]]]:
    """The run's model (and weight average) rebuilt from ``cfg`` with the weights of
    ``state``, the loaded ``checkpoint``; and what differs (:func:`settings_differ`, which
    refuses a config that would change the result, unless ``force``). With
    ``trainer.channels_last=auto`` the model is built in the format the run recorded
    (channels_last runs on a CPU too): a GPU run's checkpoint evaluates on a laptop."""
    recorded = flatten(state.get("config") or {}).get("trainer.channels_last", False)
    cfg = record_channels_last(cfg, bool(recorded))  # auto: the run's format, any device
    training = build_training(cfg, data, device)
    differences = settings_differ(state, cfg, device, force)
    wrong = cannot_restore(training, state)
    if wrong:
        raise CheckpointError(f"{checkpoint}: {wrong}; it is not this run's model.")
    training.model.load_state_dict(state["model"])
    if training.ema is not None:
        training.ema.load_state_dict(state.get("ema"), checkpoint)
    return training, differences


def settings_differ(
    state: dict[str, Any], cfg: DictConfig, device: torch.device, force: bool = False
) -> dict[str, list[str]]:
    """Refuse a config that differs from the checkpoint's anywhere it can change the result
    (:func:`repro.records.checkpoint.evaluation_mismatches`: a conf/ default edited since, an
    override such as data.test_size): one line listing them, unless ``force``. Returns the
    differences that are only recorded: the environment's (another torch, GPU or CPU
    instruction set) and, with ``force``, the config's."""
    from repro.defense.config import resolved_container
    from repro.records.fingerprint import environment

    config = resolved_container(cfg)
    differ = evaluation_mismatches(state, config)
    if differ and not force:
        raise ConfigError(
            f"the config differs from the checkpoint's where it decides the result "
            f"({'; '.join(differ)}); use the run's own settings, or --force to go on anyway "
            "(recorded)."
        )
    found = mismatches(state, config, environment(), device.type)
    env = [m for m in found if m.startswith(("environment.", "device:"))]
    return {"environment_differs": env, **({"config_differs": differ} if differ else {})}


def predict(
    cfg: DictConfig,
    checkpoint: Path,
    device: torch.device,
    inputs: Path,
    out: Path,
    force: bool = False,
    probabilities: bool = False,
    overlay: bool = False,
) -> int:
    """The model of ``checkpoint`` on every image under ``inputs`` (sorted paths, read as the
    run's data reads its images, normalised with the run's statistics), in evaluation mode
    (the weight average with ``trainer.ema``).

    Classification: each image through the run's evaluation pipeline, in batches of
    ``trainer.eval_batch_size``; ``out`` is a CSV of ``file, prediction``, the class's name
    (when the data names its classes) and each class's probability (``repr`` floats: exact).

    Segmentation: ``out`` is a folder of ``<file>.png`` class masks, each at its input's own
    size -- ``inference.mode=native``: the image whole or in tiles at its size
    (:mod:`repro.engine.sliding_window`); ``pipeline``: through the evaluation pipeline and, when
    that is a resize, the logits brought back to the input's grid (bilinear, centre-aligned)
    before the arg-max. ``probabilities``: also ``<file>.npy``, the per-class softmax
    (float32, classes × H × W); ``overlay``: also ``<file>.overlay.png``, the image with its
    predicted classes tinted, for a person to look at.

    Deterministic: the same bytes every time on the same machine; a config that differs from
    the checkpoint's where it can change them is refused, unless ``force``. Returns the
    count."""
    from repro.components.data import IMAGE_SUFFIXES
    from repro.components.data.folders import check_text_name

    files = sorted(p for p in inputs.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ConfigError(f"{inputs}: no image files ({', '.join(sorted(IMAGE_SUFFIXES))}).")
    for f in files:  # named in the output: text
        check_text_name(f, "INPUT_DIR", inputs)
    state = load_checkpoint(checkpoint, map_location=device)
    data = scoring_data(cfg, state, checkpoint)  # statistics, channels, classes: recorded
    training, differences = restored(cfg, checkpoint, state, device, data, force)
    for difference in differences.get("config_differs", []):  # --force: said, then on
        log.warning(f"predict --force: {difference} (the bytes may differ from the run's)")
    normalize = DeviceNormalizer(data, device, training.channels_last)
    names = [str(p.relative_to(inputs)) for p in files]
    writer = MaskWriter(out, names, probabilities, overlay)
    batch = int(cfg.trainer.eval_batch_size)
    scores: list[torch.Tensor] = []
    model = training.model
    model.eval()
    with torch.no_grad(), training.evaluated_weights():
        for i in range(0, len(files), batch):
            part = files[i : i + batch]
            images = [read_input(data, p) for p in part]
            index = torch.arange(i, i + len(part))
            logits = logits_at_own_size(training, normalize, images, index, data.eval_pipeline)
            for j, output in enumerate(logits):
                if output.dim() == 1:  # class scores: written together at the end
                    scores.append(output.cpu())
                else:  # per-pixel: this image's files now, nothing held
                    writer.write(i + j, images[j], output.cpu())
    if scores:
        if probabilities or overlay:
            raise ConfigError(
                "--probabilities and --overlay are for segmentation; a classifier's "
                "probabilities are the CSV's p0, p1... columns."
            )
        _write_probabilities(out, names, torch.stack(scores).softmax(dim=1), data.class_names)
    return len(files)


def read_input(data: ScoredData, path: Path) -> torch.Tensor:
    """An input file read as the run's data read its images (channels, bit depth, intensity
    mapping: ``data``, the checkpoint's record): ``C×H×W``, uint8 or float32."""
    from repro.components.data import read_image

    return data.intensity(read_image(path, data.in_channels), path)[0]


def _write_probabilities(
    out: Path, names: list[str], probs: torch.Tensor, classes: tuple[str, ...] | None
) -> None:
    """``file, prediction[, class], p0, p1...``: ``class`` is the predicted class's name when
    the dataset names its classes (an image folder's sub-folders)."""
    from repro.base.files import write_file

    named = classes is not None and len(classes) == probs.shape[1]
    header = ["file", "prediction", *(["class"] if named else [])]
    header += [f"p{c}" for c in range(probs.shape[1])]
    lines = [",".join(header)]
    for name, p in zip(names, probs.tolist(), strict=True):
        best = max(range(len(p)), key=p.__getitem__)
        label = [csv_field(classes[best])] if named else []
        lines.append(",".join([csv_field(name), str(best), *label, *map(repr, p)]))
    text = "\n".join(lines) + "\n"
    write_file(out, text)


class MaskWriter:
    """Segmentation's ``repro predict`` output, an image at a time: ``<name>.png`` (class
    indices at the input's size), and ``<name>.npy`` (softmax, float32) /
    ``<name>.overlay.png`` when asked; each written atomically."""

    def __init__(self, out: Path, names: list[str], probabilities: bool, overlay: bool) -> None:
        self.targets = [Path(name).with_suffix(".png") for name in names]
        if len(set(self.targets)) != len(self.targets):
            clash = next(t for t in self.targets if self.targets.count(t) > 1)
            raise ConfigError(f"two inputs would both give the mask {clash}; rename one of them.")
        self.out, self.probabilities, self.overlay = out, probabilities, overlay

    def write(self, i: int, image: torch.Tensor, logits: torch.Tensor) -> None:
        """Input ``i`` (``image``, as read) and its float32 logits C×H×W."""
        import io

        import numpy as np

        from repro.base.files import atomic_write
        from repro.components.data.folders import _pillow

        Image = _pillow()
        if int(logits.shape[0]) > 256:
            raise ConfigError("segmentation masks are 8-bit PNGs: at most 256 classes.")
        target = self.targets[i]
        mask = logits.argmax(dim=0).to(torch.uint8)
        picture = Image.fromarray(mask.numpy(), mode="L")
        atomic_write(self.out / target, lambda f: picture.save(f, format="PNG"))
        if self.probabilities:
            buffer = io.BytesIO()
            np.save(buffer, logits.softmax(dim=0).numpy().astype(np.float32), allow_pickle=False)
            atomic_write(
                self.out / target.with_suffix(".npy"), lambda f: f.write(buffer.getvalue())
            )
        if self.overlay:
            shown = Image.fromarray(overlay_image(image, mask).permute(1, 2, 0).numpy(), mode="RGB")
            path = self.out / target.with_suffix(".overlay.png")
            atomic_write(path, lambda f: shown.save(f, format="PNG"))


# class colours of the overlays (class 0, the background, is not tinted)
PALETTE = torch.tensor(
    [[0, 0, 0], [230, 25, 75], [60, 180, 75], [255, 225, 25], [0, 130, 200], [245, 130, 48],
     [145, 30, 180], [70, 240, 240], [240, 50, 230], [210, 245, 60]],
    dtype=torch.int32,
)  # fmt: skip


def overlay_image(image: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """An 8-bit RGB picture (3×H×W uint8) of ``image`` (its first three channels, or its
    first one as grey; floats stretched to their range) with each pixel of a class other
    than 0 mixed half and half with the class's colour: integer arithmetic, exact."""
    x = image[:3] if image.shape[0] >= 3 else image[:1].expand(3, *image.shape[1:])
    if x.dtype != torch.uint8:
        low, high = x.double().min(), x.double().max()
        x = ((x.double() - low) / (high - low).clamp_min(1e-12) * 255).round().to(torch.uint8)
    colour = PALETTE[mask.long() % len(PALETTE)].permute(2, 0, 1)
    mixed = (x.to(torch.int32) + colour) // 2
    return torch.where(mask[None] > 0, mixed, x.to(torch.int32)).to(torch.uint8)
