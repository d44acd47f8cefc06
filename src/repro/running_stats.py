"""BatchNorm running statistics that do not depend on who computed which micro-batch.

In training, BatchNorm normalises with the statistics of the batch it sees -- here always one
micro-batch of fixed size, so the forward pass is the same on any rank. But PyTorch also
folds each batch's statistics into the running buffers as it goes, so a process that computes
micro-batches 2 and 3 of a step would end with other buffers than one that computes 0 to 3.

:class:`RunningStats` defers that update: during a training forward the layers leave their
buffers alone (``track_running_stats`` off for the call) and a pre-hook records each layer's
mean and unbiased variance of its input. After the step, :meth:`RunningStats.update` folds
the K micro-batches' statistics into the buffers in micro-batch order, with PyTorch's
formula (``momentum``, or the cumulative average when it is None). Every rank gets all K
micro-batches' statistics (:class:`repro.dist.Reducer`), so every rank, and a single process,
make the same updates in the same order.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from repro.errors import ConfigError


class RunningStats:
    def __init__(self, model: nn.Module) -> None:
        self.layers = [
            (name, m)
            for name, m in model.named_modules()
            if isinstance(m, _BatchNorm) and m.track_running_stats and m.running_mean is not None
        ]
        for name, m in self.layers:
            if isinstance(m, nn.SyncBatchNorm):
                raise ConfigError(
                    f"model: {name} is a SyncBatchNorm, whose statistics depend on the "
                    "number of processes; use BatchNorm (statistics per micro-batch, running "
                    "buffers reconciled in a fixed order by the loop)."
                )
        self._recorded: list[torch.Tensor] | None = None

    def __bool__(self) -> bool:
        return bool(self.layers)

    @contextmanager
    def capture(self) -> Iterator[list[torch.Tensor]]:
        """Around one micro-batch's training forward: yields the list that receives, per
        layer in order, its input's mean and unbiased variance (float32)."""
        recorded: list[torch.Tensor] = []
        if not self.layers:
            yield recorded
            return
        handles = [m.register_forward_pre_hook(self._record) for _, m in self.layers]
        for _, m in self.layers:
            m.track_running_stats = False  # normalise with batch statistics, update nothing
        self._recorded = recorded
        try:
            yield recorded
        finally:
            self._recorded = None
            for _, m in self.layers:
                m.track_running_stats = True
            for h in handles:
                h.remove()

    def _record(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._recorded is None or not module.training:
            return
        x = args[0]
        dims = [d for d in range(x.dim()) if d != 1]
        with torch.no_grad():
            var, mean = torch.var_mean(x.detach().float(), dim=dims, correction=1)
        self._recorded += [mean, var]

    @torch.no_grad()
    def update(self, per_micro_batch: list[list[torch.Tensor]]) -> None:
        """Fold the statistics of each micro-batch, in order, into the running buffers."""
        for recorded in per_micro_batch:
            if len(recorded) != 2 * len(self.layers):
                raise RuntimeError(
                    f"RunningStats: {len(recorded) // 2} of {len(self.layers)} BatchNorm "
                    "layers ran in a training forward; a layer called twice or skipped cannot "
                    "be reconciled."
                )
            for (_, m), mean, var in zip(self.layers, recorded[::2], recorded[1::2], strict=True):
                m.num_batches_tracked.add_(1)
                if m.momentum is None:  # cumulative moving average, as PyTorch does
                    factor = 1.0 / float(m.num_batches_tracked)
                else:
                    factor = float(m.momentum)
                m.running_mean.mul_(1 - factor).add_(mean.to(m.running_mean.dtype), alpha=factor)
                m.running_var.mul_(1 - factor).add_(var.to(m.running_var.dtype), alpha=factor)
