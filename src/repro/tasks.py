"""Tasks: what is learned and how it is measured (``conf/task/``).

A task is the part of training that differs between projects; the loop never knows which
one it runs. It owns four things:

``loss(outputs, targets)``
    the loss of one micro-batch, **summed** over its samples (a scalar tensor). The loop
    divides it by the global batch size, so the fixed-order sum of the micro-batches'
    gradients is the gradient of the batch mean, whoever computed each micro-batch.
``statistics(outputs, targets)``
    the evaluation statistics of one batch as a dict of tensors that are **added** across
    batches: integer counts (exact, so the metrics derived from them do not depend on the
    eval batch size or the world size) and float64 sums.
``metrics(totals)``
    the metrics, from the summed statistics: ``{"val_loss": ..., "val_accuracy": ...}``.
``headline``
    the name of the one metric that ``summary.json``, ``repro report`` and ``repro compare
    --tolerance`` lead with (``higher_is_better`` says which way is better).

``outputs`` is what the model returns for a batch; ``targets`` is what the dataset gives
beside the inputs (class labels, ``N``; or anything else a dataset of yours returns as a
tensor: per-pixel masks need ``data.augment=false``, as the shipped crop and flip move the
images only). Metrics are named ``val_*``; the headline is one of them. A new task is a
subclass named by ``task._target_=mypkg.MyTask``; it receives ``num_classes`` from the
dataset when its constructor takes it. See ``docs/extending.md``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Task:
    """The interface (see the module docstring); :class:`Classification` implements it."""

    headline: str = "val_loss"
    higher_is_better: bool = False

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def statistics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def metrics(self, totals: dict[str, torch.Tensor]) -> dict[str, float]:
        raise NotImplementedError


class Classification(Task):
    """Single-label classification: cross-entropy on the logits (computed in float32, also
    under autocast), accuracy of the arg-max."""

    headline = "val_accuracy"
    higher_is_better = True

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.float(), targets, reduction="sum")

    def statistics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            "loss_sum": self.loss(outputs, targets).double(),
            "correct": (outputs.argmax(dim=1) == targets).sum(),
            "count": torch.tensor(len(targets), dtype=torch.int64, device=targets.device),
        }

    def metrics(self, totals: dict[str, torch.Tensor]) -> dict[str, float]:
        count = int(totals["count"])
        return {
            "val_loss": totals["loss_sum"].item() / count,
            "val_accuracy": int(totals["correct"]) / count,
        }
