"""Evaluation: the task's statistics, summed over batches in a fixed order, then its metrics;
each sample's row of counts (the task's ``per_sample``) beside its name.

Segmentation is scored against each image's own mask, at its own size:

- ``inference.mode=native``: each image whole, at its size, in tiles where it is larger than
  one (:mod:`repro.engine.sliding_window`);
- ``inference.mode=pipeline`` (the default): the evaluation pipeline's images in batches,
  as the model trained on them; when that pipeline is :class:`repro.components.data.augment.Resize`
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
from omegaconf import DictConfig

from repro.base.errors import ConfigError
from repro.base.rng import global_rng_states, set_global_rng_states
from repro.components.data import (
    Augmented,
    DataSplits,
    DeviceNormalizer,
    KeyedPipeline,
    Resize,
    Split,
)
from repro.components.data.augment import stack, stack_targets
from repro.components.data.sample_settings import pinned_here
from repro.components.tasks import Task
from repro.engine.build import Training, class_count_problem
from repro.engine.sliding_window import predict_logits, resize_logits


@dataclass
class Evaluation:
    """What one evaluation gives: the task's metrics and, where the task keeps them, each
    sample's row (:meth:`repro.components.tasks.Task.per_sample`, concatenated in sample order) and
    each sample's name (its file, else its index)."""

    metrics: dict[str, float]
    samples: dict[str, torch.Tensor] | None
    names: list[str]

    # each sample's share of the headline (Task.sample_scores), written after the counts
    scores: dict[str, torch.Tensor] | None = None

    def write_per_sample(self, path: Path, step: int | None = None) -> None:
        """``<split>_per_image.csv``: a row per sample, ``sample`` (its name) then the
        task's columns and its headline scores (``step`` first when given); atomically
        replaced."""
        from repro.base.files import write_file

        if self.samples is None:
            return
        table = {**self.samples, **(self.scores or {})}
        columns = list(table)
        values = [table[c].tolist() for c in columns]
        head = ["step"] if step is not None else []
        lines = [",".join([*head, "sample", *columns])]
        for i, name in enumerate(self.names):
            row = [str(step)] if step is not None else []
            lines.append(",".join([*row, csv_field(name), *(repr(v[i]) for v in values)]))
        text = "\n".join(lines) + "\n"
        write_file(path, text)


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
    scores = task.sample_scores(samples) if samples is not None and _scores(task) else None
    return Evaluation(metrics, samples, sample_names(split, n), scores)


def _scores(task: Task) -> bool:
    """Whether ``task`` gives each sample's share of the headline (a fork's task need not
    subclass :class:`repro.components.tasks.Task`)."""
    return callable(getattr(task, "sample_scores", None))


def scored_batches(
    training: Training, split: Split, normalize: DeviceNormalizer, batch_size: int, n: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(outputs, targets) on the device for the first ``n`` samples of ``split``, in order,
    as the module docstring says they are scored."""
    augmented = isinstance(split, Augmented)
    raw = split.split if augmented else split  # the samples as read
    pipeline = split.pipeline if augmented else None
    back = training.window.native or _resizes(pipeline)
    step = 1 if training.window.native else batch_size  # native: one image a call
    for i in range(0, n, step):
        index = torch.arange(i, min(i + step, n))
        if not augmented:
            with pinned_here():  # read as a loader worker reads (one thread, the run's flags)
                batch = split.fetch(index)
            yield _forward_batch(training, normalize, *batch)
            continue
        with pipeline.settings.pinned():
            images, targets = raw.fetch(index)
        if back and (training.window.native or _masks_off_size(targets, pipeline.size)):
            for logits, mask in zip(
                logits_at_own_size(training, normalize, list(images), index, pipeline),
                targets,
                strict=True,
            ):
                yield logits[None], mask[None].to(logits.device).long()
            continue
        yield _forward_batch(training, normalize, *split.apply(images, targets, index))


def logits_at_own_size(
    training: Training,
    normalize: DeviceNormalizer,
    images: list[torch.Tensor],
    index: torch.Tensor,
    pipeline: KeyedPipeline | None,
) -> list[torch.Tensor]:
    """The float32 logits (on the device) of ``images`` (``C×H×W`` each, as read; their
    sample indices ``index``), each at its own size for segmentation: with
    ``inference.mode=native`` each image whole or in tiles (:func:`predict_logits`); else
    all through ``pipeline`` in one batch, and per-pixel logits brought back to each image's
    grid (:func:`resize_logits`) when the pipeline is a :class:`Resize`. Class scores
    (classification) come as they are, one vector an image."""
    model, window = training.model, training.window

    def forward(x: torch.Tensor) -> torch.Tensor:
        with training.precision.autocast():
            return model(x)

    if window.native:
        pad = normalize.normalised_zero()
        labels = torch.zeros(1, dtype=torch.int64)
        return [
            predict_logits(
                forward, normalize(image[None], labels)[0][0], window, pad, normalize.memory_format
            )
            for image in images
        ]
    labels = torch.zeros(len(images), dtype=torch.int64)
    x = images if pipeline is None else pipeline.samples(images, labels, torch.zeros(1), index)[0]
    outputs = forward(normalize(stack(list(x), "data"), labels)[0]).float()
    back = _resizes(pipeline)
    return [
        resize_logits(out, tuple(image.shape[-2:])) if out.dim() == 3 and back else out
        for out, image in zip(outputs, images, strict=True)
    ]


def _resizes(pipeline: KeyedPipeline | None) -> bool:
    """Is the evaluation pipeline a plain resize (whose output's grid maps back onto each
    image's)?"""
    return pipeline is not None and type(pipeline.pipeline) is Resize and bool(pipeline.size)


def _forward_batch(
    training: Training, normalize: DeviceNormalizer, images: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets = normalize(images, targets)
    with training.precision.autocast():
        return training.model(inputs), targets


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
    """Does the task's ``metrics`` take the per-sample rows (a second positional parameter)?
    One written for ``metrics(totals)`` alone is called so."""
    try:
        params = list(inspect.signature(task.metrics).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in positional for p in params) >= 2 or any(
        p.kind is inspect.Parameter.VAR_POSITIONAL for p in params
    )


def check_task(
    training: Training,
    data: DataSplits,
    normalize: DeviceNormalizer,
    model_cfg: DictConfig | None = None,
) -> list[str]:
    """The task's metrics on a few validation samples before the first step, so that a wrong
    headline or metric name fails now, not at the first evaluation; returns their names. For
    a task with ``one_output_a_class`` (classification, segmentation and their subclasses),
    the model's outputs must have one channel a class of the data: a zoo model that did not get the count is one line naming the argument it
    wanted (:func:`repro.engine.build.class_count_problem`, from ``model_cfg``). The global RNGs are
    put back afterwards (a model may draw from them even in evaluation), so the run's bits
    are those it would have without the check."""
    split, num_classes = data.val, data.num_classes
    states = global_rng_states()
    channels: list[int] = []
    checked = bool(getattr(training.task, "one_output_a_class", False))

    def record(module: torch.nn.Module, inputs: object, output: object) -> None:
        if isinstance(output, torch.Tensor) and output.dim() >= 2 and not channels:
            channels.append(int(output.shape[1]))

    def wrong_count() -> str | None:
        if not checked or not channels:
            return None
        return class_count_problem(model_cfg or DictConfig({}), channels[0], int(num_classes))

    hook = training.model.register_forward_hook(record) if checked else None
    try:
        with _eager(training.model):  # compiled, it would compile a graph for this shape
            names = list(evaluate(training, split, normalize, 4, limit=4))
    except Exception as err:
        problem = wrong_count()  # the count, not what it broke downstream, is the cause
        if problem is not None:
            raise ConfigError(problem) from None
        if isinstance(err, RuntimeError) and not isinstance(err, ConfigError):
            _explain_op(err, training, split, normalize)
        raise
    finally:
        if hook is not None:
            hook.remove()
        set_global_rng_states(states)
    problem = wrong_count()
    if problem is not None:
        raise ConfigError(problem)
    return names


def _explain_op(
    err: RuntimeError, training: Training, split: Split, normalize: DeviceNormalizer
) -> None:
    """Strict mode and an op with no deterministic kernel? One line if so."""
    states = global_rng_states()
    try:
        from repro.engine.doctor import explain_nondeterministic_op

        raw = split.split if isinstance(split, Augmented) and training.window.native else split
        images, targets = raw.fetch(torch.arange(min(1 if raw is not split else 2, len(raw))))
        sample = stack(list(images), "data"), stack_targets(list(targets))
        explain_nondeterministic_op(err, training, *normalize(*sample))
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
