"""A trained run's checkpoint on data it did not train on: the test split (``trainer.test``
at the end of a run, ``repro evaluate RUN_DIR`` later) and new inputs (``repro predict``).

``trainer.test`` and ``repro evaluate`` are one function, :func:`evaluate_checkpoint`: the
model (and its weight average, with ``trainer.ema``) rebuilt from the run's config, the
checkpoint's weights loaded, :func:`repro.evaluation.evaluate` in its fixed order, under the
run's determinism settings. So the two give the same bits: a test score cannot depend on
whether it was computed at the end of training or a week later (as long as the machine and
versions are the same; ``env.json`` says which they were).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from repro.build import Training, build_data, build_training, record_channels_last
from repro.checkpoint import (
    cannot_restore,
    evaluation_mismatches,
    load_checkpoint,
    mismatches,
    read_checkpoint,
)
from repro.config import flatten
from repro.data import DataSplits, DeviceNormalizer
from repro.errors import CheckpointError, ConfigError
from repro.evaluation import evaluate
from repro.files import BEST_FILE

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
) -> dict[str, Any]:
    """The task's metrics of ``checkpoint`` on ``split`` (``test`` or ``val``), with the
    checkpoint it used (path, step, SHA-256); a config that differs from the checkpoint's
    where it can change them is refused (:func:`settings_differ`), unless ``force``."""
    if split not in SPLITS:
        raise ConfigError(f"split {split!r}: give test or val.")
    data = data or build_data(cfg)
    held_out = data.test if split == "test" else data.val
    if held_out is None:
        raise ConfigError(
            f"data ({cfg.data._target_}) has no test split; give it one (data.test_size for "
            "the synthetic sets, data.test_fraction for the image folders), or evaluate the "
            "validation split: --split val."
        )
    loaded = read_checkpoint(checkpoint, map_location=device)  # verified
    state = loaded.state
    # another machine or version than the checkpoint's: the bits may differ from
    # trainer.test's (the metrics are still this machine's, deterministic)
    training, differences = restored(cfg, checkpoint, state, device, data, force)
    normalize = DeviceNormalizer(data, device, training.channels_last)
    metrics = evaluate(training, held_out, normalize, int(cfg.trainer.eval_batch_size))
    return {
        "split": split,
        "checkpoint": checkpoint.name,
        "step": int(state["step"]),
        "checkpoint_sha256": loaded.sha256,
        "metrics": {k.replace("val_", f"{split}_", 1): v for k, v in metrics.items()},
        **differences,
    }


def restored(
    cfg: DictConfig,
    checkpoint: Path,
    state: dict[str, Any],
    device: torch.device,
    data: DataSplits,
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
    (:func:`repro.checkpoint.evaluation_mismatches`: a conf/ default edited since, an
    override such as data.test_size): one line listing them, unless ``force``. Returns the
    differences that are only recorded: the environment's (another torch, GPU or CPU
    instruction set) and, with ``force``, the config's."""
    from repro.config import resolved_container
    from repro.fingerprint import environment

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
) -> int:
    """The model of ``checkpoint`` on every image under ``inputs`` (sorted paths, read as RGB
    and brought to ``data.image_size`` by the run's evaluation pipeline, as its validation
    images are; normalised with the run's statistics), in batches of
    ``trainer.eval_batch_size``, in evaluation mode (the weight average with ``trainer.ema``).
    Classification: ``out`` is a CSV of ``file, prediction``, the class's name (when the data
    names its classes: an image folder's sub-folders) and each class's probability (``repr``
    floats: exact). Segmentation: ``out`` is a folder of ``<file>.png`` class masks.
    Deterministic: the same bytes every time on the same machine; a config that differs from
    the checkpoint's where it can change them is refused, unless ``force``. Returns the
    count."""
    from repro.data import IMAGE_SUFFIXES, read_image

    files = sorted(p for p in inputs.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ConfigError(f"{inputs}: no image files ({', '.join(sorted(IMAGE_SUFFIXES))}).")
    data = build_data(cfg)  # its evaluation pipeline and normalisation statistics
    state = load_checkpoint(checkpoint, map_location=device)
    training, differences = restored(cfg, checkpoint, state, device, data, force)
    for difference in differences.get("config_differs", []):  # --force: said, then on
        log.warning(f"predict --force: {difference} (the bytes may differ from the run's)")
    normalize = DeviceNormalizer(data, device, training.channels_last)
    names = [str(p.relative_to(inputs)) for p in files]
    batch = int(cfg.trainer.eval_batch_size)
    results: list[torch.Tensor] = []
    model = training.model
    model.eval()
    with torch.no_grad(), training.evaluated_weights():
        for i in range(0, len(files), batch):
            part = files[i : i + batch]
            images = [read_image(p, data.in_channels) for p in part]
            index = torch.arange(i, i + len(part))
            images, _ = data.eval_pipeline.samples(images, [0] * len(part), torch.zeros(1), index)
            x, _ = normalize(images, torch.zeros(len(images), dtype=torch.int64))
            with training.precision.autocast():
                outputs = model(x)
            if outputs.dim() == 2:  # class scores
                results.append(outputs.float().softmax(dim=1).cpu())
            else:  # per-pixel class scores: the mask
                results.append(outputs.argmax(dim=1).to(torch.uint8).cpu())
    scores = torch.cat(results)
    if scores.dim() == 2:
        _write_probabilities(out, names, scores, data.class_names)
    else:
        _write_masks(out, names, scores)
    return len(files)


def _write_probabilities(
    out: Path, names: list[str], probs: torch.Tensor, classes: tuple[str, ...] | None
) -> None:
    """``file, prediction[, class], p0, p1...``: ``class`` is the predicted class's name when
    the dataset names its classes (an image folder's sub-folders)."""
    from repro.checkpoint import atomic_write

    named = classes is not None and len(classes) == probs.shape[1]
    header = ["file", "prediction", *(["class"] if named else [])]
    header += [f"p{c}" for c in range(probs.shape[1])]
    lines = [",".join(header)]
    for name, p in zip(names, probs.tolist(), strict=True):
        best = max(range(len(p)), key=p.__getitem__)
        label = [_csv_field(classes[best])] if named else []
        lines.append(",".join([_csv_field(name), str(best), *label, *map(repr, p)]))
    text = "\n".join(lines) + "\n"
    atomic_write(out, lambda f: f.write(text.encode()))


def _csv_field(name: str) -> str:
    return '"' + name.replace('"', '""') + '"' if any(c in name for c in ',"\n') else name


def _write_masks(out: Path, names: list[str], masks: torch.Tensor) -> None:
    from repro.checkpoint import atomic_write
    from repro.data.folders import _pillow

    Image = _pillow()
    targets = [Path(name).with_suffix(".png") for name in names]
    if len(set(targets)) != len(targets):
        clash = next(t for t in targets if targets.count(t) > 1)
        raise ConfigError(f"two inputs would both give the mask {clash}; rename one of them.")
    for name, mask in zip(names, masks, strict=True):
        target = out / Path(name).with_suffix(".png")
        image = Image.fromarray(mask.numpy(), mode="L")
        atomic_write(target, lambda f, image=image: image.save(f, format="PNG"))
