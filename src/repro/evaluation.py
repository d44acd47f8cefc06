"""Evaluation on the validation split: the task's statistics, summed over batches in a fixed
order, then its metrics."""

from __future__ import annotations

import contextlib

import torch

from repro.build import Training
from repro.data import DeviceNormalizer, Split
from repro.errors import ConfigError
from repro.rng import global_rng_states, set_global_rng_states
from repro.tasks import Task


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
    model, task = training.model, training.task
    n = len(split) if limit is None else min(limit, len(split))
    model.eval()
    totals: dict[str, torch.Tensor] = {}
    with training.evaluated_weights():  # trainer.ema: the averaged weights
        for i in range(0, n, batch_size):
            inputs, targets = normalize(*split.fetch(torch.arange(i, min(i + batch_size, n))))
            with training.precision.autocast():
                outputs = model(inputs)
            for name, value in task.statistics(outputs, targets).items():
                totals[name] = totals[name] + value if name in totals else value
    model.train()
    metrics = task.metrics(totals)
    check_metrics(task, metrics)
    return metrics


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
