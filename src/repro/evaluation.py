"""Evaluation: the task's statistics, summed over batches in a fixed order, then its metrics;
each sample's row of counts (the task's ``per_sample``) beside its name.

Segmentation is scored against each image's own mask, at its own size:

- ``inference.mode=native``: each image whole, at its size, in tiles where it is larger than
  one (:mod:`repro.sliding_window`);
- ``inference.mode=pipeline`` (the default): the evaluation pipeline's images in batches,
  as the model trained on them; when that pipeline is :class:`repro.data.augment.Resize`
  and a mask has another size, the logits are brought back to the mask's grid (bilinear,
  centre-aligned) and scored there. Another pipeline (a crop) is scored at its own output.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from repro.build import Training
from repro.data import DeviceNormalizer, Resize, Split
from repro.data.augment import stack, stack_targets
from repro.errors import ConfigError
from repro.rng import global_rng_states, set_global_rng_states
from repro.sliding_window import predict_logits, resize_logits
from repro.tasks import Task


@dataclass
class Evaluation:
    """What one evaluation gives: the task's metrics and, where the task keeps them, each
    sample's row (:meth:`repro.tasks.Task.per_sample`, concatenated in sample order) and
    each sample's name (its file, else its index)."""

    metrics: dict[str, float]
    samples: dict[str, torch.Tensor] | None
    names: list[str]

    def write_per_sample(self, path: Path, prefix: str = "val", step: int | None = None) -> None:
        """``<split>_per_image.csv``: a row per sample, ``sample`` (its name) then the
        task's columns (``step`` first when given); atomically replaced."""
        from repro.checkpoint import atomic_write

        if self.samples is None:
            return
        columns = list(self.samples)
        values = [self.samples[c].tolist() for c in columns]
        head = ["step"] if step is not None else []
        lines = [",".join([*head, "sample", *columns])]
        for i, name in enumerate(self.names):
            row = [str(step)] if step is not None else []
            lines.append(",".join([*row, csv_field(name), *(repr(v[i]) for v in values)]))
        text = "\n".join(lines) + "\n"
        atomic_write(path, lambda f: f.write(text.encode()))


@torch.no_grad()
def evaluate(
    training: Training,
    split: Split,
    normalize: DeviceNormalizer,
    batch_size: int,
    limit: int | None = None,
) -> dict[str, float]:
    """The task's metrics on ``split`` (its first ``limit`` samples; fixed order, no
    augmentation, no dropout)."""
    return evaluate_split(training, split, normalize, batch_size, limit).metrics


@torch.no_grad()
def evaluate_split(
    training: Training,
    split: Split,
    normalize: DeviceNormalizer,
    batch_size: int,
    limit: int | None = None,
) -> Evaluation:
    """:func:`evaluate`, with each sample's row and name."""
    model, task = training.model, training.task
    n = len(split) if limit is None else min(limit, len(split))
    model.eval()
    totals: dict[str, torch.Tensor] = {}
    rows: list[dict[str, torch.Tensor]] = []
    with training.evaluated_weights():  # trainer.ema: the averaged weights
        for outputs, targets in scored_batches(training, split, normalize, batch_size, n):
            for name, value in task.statistics(outputs, targets).items():
                totals[name] = totals[name] + value if name in totals else value
            row = task.per_sample(outputs, targets) if hasattr(task, "per_sample") else None
            if row is not None:
                rows.append({k: v.cpu() for k, v in row.items()})
    model.train()
    samples = {k: torch.cat([r[k] for r in rows]) for k in rows[0]} if rows else None
    if samples is not None and _takes_samples(task):
        metrics = task.metrics(totals, samples)
    else:
        metrics = task.metrics(totals)
    check_metrics(task, metrics)
    return Evaluation(metrics, samples, sample_names(split, n))


def scored_batches(
    training: Training, split: Split, normalize: DeviceNormalizer, batch_size: int, n: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(outputs, targets) on the device for the first ``n`` samples of ``split``, in order,
    as the module docstring says they are scored."""
    model, window = training.model, training.window
    raw = getattr(split, "split", split)  # an Augmented split's samples as read
    pipeline = getattr(split, "pipeline", None)

    def forward(x: torch.Tensor) -> torch.Tensor:
        with training.precision.autocast():
            return model(x)

    if window.native:
        pad = normalize.normalised_zero()
        for i in range(n):
            images, targets = raw.fetch(torch.tensor([i]))
            x, y = normalize(stack(list(images), "data"), stack_targets(list(targets)))
            if y.dim() != 3:
                raise ConfigError(
                    "config error: inference.mode=native evaluates per-pixel masks at each "
                    "image's size; this data gives class labels: use inference.mode=pipeline."
                )
            logits = predict_logits(forward, x[0], window, pad, normalize.memory_format)
            yield logits[None], y
        return
    back = pipeline is not None and type(pipeline.pipeline) is Resize and pipeline.size
    for i in range(0, n, batch_size):
        index = torch.arange(i, min(i + batch_size, n))
        if pipeline is None:
            yield _forward_batch(forward, normalize, *split.fetch(index))
            continue
        images, targets = raw.fetch(index)
        if back and _masks_off_size(targets, pipeline.size):
            x, _ = split.apply(images, torch.zeros(len(index), dtype=torch.int64), index)
            inputs, _ = normalize(x, torch.zeros(len(index), dtype=torch.int64))
            outputs = forward(inputs).float()
            for logits, mask in zip(outputs, targets, strict=True):
                size = tuple(mask.shape[-2:])
                yield resize_logits(logits, size)[None], mask[None].to(outputs.device).long()
            continue
        yield _forward_batch(forward, normalize, *split.apply(images, targets, index))


def _forward_batch(forward, normalize, images, targets):  # noqa: ANN001, ANN202
    inputs, targets = normalize(images, targets)
    return forward(inputs), targets


def _masks_off_size(targets: object, size: int) -> bool:
    """Are these per-pixel masks, some not ``size`` × ``size``?"""
    masks = list(targets) if isinstance(targets, list | torch.Tensor) else []
    return (
        bool(masks)
        and all(isinstance(m, torch.Tensor) and m.dim() == 2 for m in masks)
        and any(tuple(m.shape) != (size, size) for m in masks)
    )


def sample_names(split: Split, n: int) -> list[str]:
    """The first ``n`` samples' names: the split's ``names`` (files), else their indices."""
    names = getattr(split, "names", None)
    return [str(x) for x in names[:n]] if names is not None else [str(i) for i in range(n)]


def csv_field(name: str) -> str:
    """A CSV field: quoted when it holds a comma, a quote or a line break."""
    return '"' + name.replace('"', '""') + '"' if any(c in name for c in ',"\n') else name


def _takes_samples(task: Task) -> bool:
    try:
        return len(inspect.signature(task.metrics).parameters) >= 2
    except (TypeError, ValueError):
        return False


def check_task(training: Training, split: Split, normalize: DeviceNormalizer) -> list[str]:
    """The task's metrics on a few validation samples before the first step, so that a wrong
    headline or metric name fails now, not at the first evaluation; returns their names. The
    global RNGs are put back afterwards (a model may draw from them even in evaluation), so
    the run's bits are those it would have without the check."""
    states = global_rng_states()
    try:
        with _eager(training.model):  # compiled, it would compile a graph for this shape
            return list(evaluate(training, split, normalize, 4, limit=4))
    except RuntimeError as err:  # strict mode and an op with no deterministic kernel?
        from repro.doctor import explain_nondeterministic_op

        sample = split.fetch(torch.arange(min(2, len(split))))
        explain_nondeterministic_op(err, training, *normalize(*sample))
        raise
    finally:
        set_global_rng_states(states)


def _eager(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """Run a model compiled in place (``trainer.compile``) as plain PyTorch inside (torch 2.6
    and later); leave an eager model alone."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    compiled = getattr(model, "_compiled_call_impl", None) is not None
    return set_stance("force_eager") if compiled and set_stance else contextlib.nullcontext()


def check_metrics(task: Task, metrics: dict[str, float]) -> None:
    """Metrics are named ``val_*`` (beside the summary's own fields, never over them) and hold
    the task's headline."""
    name = type(task).__name__
    for key in metrics:
        if not key.startswith("val_"):
            raise ConfigError(
                f"task {name}: metric {key!r} must be named val_* (metrics go into "
                "summary.json beside its own fields); rename it in metrics()."
            )
    if task.headline not in metrics:
        raise ConfigError(
            f"task {name}: its headline {task.headline!r} is not one of its metrics "
            f"({', '.join(metrics)}); set headline to one of them."
        )
