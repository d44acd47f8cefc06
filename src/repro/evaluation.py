"""Evaluation on the validation split: the task's statistics, summed over batches in a fixed
order, then its metrics."""

from __future__ import annotations

import torch

from repro.build import Training
from repro.data import DeviceNormalizer, TensorImages


@torch.no_grad()
def evaluate(
    training: Training, split: TensorImages, normalize: DeviceNormalizer, batch_size: int
) -> dict[str, float]:
    """The task's metrics on ``split`` (fixed order, no augmentation, no dropout)."""
    model, task = training.model, training.task
    model.eval()
    totals: dict[str, torch.Tensor] = {}
    for i in range(0, len(split), batch_size):
        inputs, targets = normalize(
            split.images[i : i + batch_size], split.labels[i : i + batch_size]
        )
        with training.precision.autocast():
            outputs = model(inputs)
        for name, value in task.statistics(outputs, targets).items():
            totals[name] = totals[name] + value if name in totals else value
    model.train()
    return task.metrics(totals)
