"""BatchNorm running statistics that do not depend on who computed which micro-batch.

In training, BatchNorm normalises with the statistics of the batch it sees -- here always one
micro-batch of fixed size, so the forward pass is the same on any rank. But PyTorch also
folds each batch's statistics into the running buffers as it goes, so a process that computes
micro-batches 2 and 3 of a step would end with other buffers than one that computes 0 to 3.

:class:`RunningStats` defers that update. During a training forward each layer's running
buffers are swapped for zeroed scratch buffers and its momentum for 1, so BatchNorm's own
kernel writes its batch mean and unbiased variance there (``1 * batch + 0 * 0``: exact) and
leaves the real buffers alone; no second pass over the activations computes them again.
After the step, :meth:`RunningStats.update` folds the K micro-batches' statistics into the
buffers in micro-batch order, with PyTorch's formula (``momentum``, or the cumulative
average when it is None). Every rank gets all K micro-batches' statistics
(:class:`repro.engine.reduction.Reducer`), so every rank, and a single process, make the same updates in
the same order.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase

from repro.base.errors import ConfigError

log = logging.getLogger("repro")


class RunningStats:
    def __init__(self, model: nn.Module) -> None:
        self.layers: list[tuple[str, _BatchNorm]] = []
        for name, m in model.named_modules():
            if not (isinstance(m, _NormBase) and m.track_running_stats):
                continue
            if isinstance(m, nn.SyncBatchNorm):
                raise ConfigError(
                    f"model: {name} is a SyncBatchNorm, whose statistics depend on the "
                    "number of processes; use BatchNorm (statistics per micro-batch, running "
                    "buffers reconciled in a fixed order by the loop)."
                )
            if not isinstance(m, _BatchNorm):
                raise ConfigError(
                    f"model: {name} ({type(m).__name__}) keeps running statistics that only "
                    "BatchNorm layers get reconciled in micro-batch order; set "
                    "track_running_stats=False or use BatchNorm/GroupNorm."
                )
            if m.running_mean is not None:
                self.layers.append((name, m))
        self._norms = [m for _, m in self.layers]
        self._index = {id(m): i for i, m in enumerate(self._norms)}
        # layers the first training forward did not run: left out (see capture())
        self.idle: list[str] = []
        self._idle_ids: dict[int, str] = {}
        self._first = True
        self._ran: list[bool] | None = None
        # registered once: they count calls only inside capture() (a no-op in evaluation)
        for m in self._norms:
            m.register_forward_pre_hook(self._count)

    def __bool__(self) -> bool:
        return bool(self.layers)

    @contextmanager
    def capture(self) -> Iterator[list[torch.Tensor]]:
        """Around one micro-batch's training forward: yields the list that receives the
        batch means and unbiased variances the layers' kernels computed, as one flat tensor
        per dtype and device (the layers' means, then their variances, in module order,
        whatever order the forward calls them in): few tensors for the ranks to exchange.

        A layer the first captured forward does not run is a layer the model never runs (an
        encoder deeper than its decoder reads: smp's ``encoder_depth`` below 5): it is left
        out from then on, named in a warning, its buffers as initialised. Raises if a layer
        runs twice, or runs in one forward and not in another (a layer that runs on some
        micro-batches only): its running statistics could not be reconciled."""
        recorded: list[torch.Tensor] = []
        if not self.layers:
            yield recorded
            return
        scratch, flats = self._scratch()
        saved = []
        for m, (mean, var) in zip(self._norms, scratch, strict=True):
            # the dicts nn.Module.__setattr__ writes to, without its checks: this runs for
            # every layer and micro-batch, on a step bound by host time on GPUs
            b = m._buffers
            saved.append((b["running_mean"], b["running_var"], b["num_batches_tracked"]))
            b["running_mean"], b["running_var"] = mean, var
            b["num_batches_tracked"] = None  # no counter to add to: momentum is used as is
            saved[-1] += (m.__dict__["momentum"],)
            m.__dict__["momentum"] = 1.0
        ran = self._ran = [False] * len(self.layers)
        try:
            yield recorded
        finally:
            self._ran = None
            for m, (mean, var, tracked, momentum) in zip(self._norms, saved, strict=True):
                b = m._buffers
                b["running_mean"], b["running_var"], b["num_batches_tracked"] = mean, var, tracked
                m.__dict__["momentum"] = momentum
        missing = [name for (name, _), r in zip(self.layers, ran, strict=True) if not r]
        first, self._first = self._first, False
        if missing and first:
            recorded += self._leave_out(ran, scratch)
            return
        if missing:
            raise RuntimeError(
                f"RunningStats: BatchNorm layer(s) {', '.join(missing)} ran in the first "
                "training forward but not in this one; a layer that runs on some micro-batches "
                "only cannot have its running statistics reconciled in a fixed order: make "
                "the model run every layer on every micro-batch."
            )
        recorded += flats

    def _leave_out(
        self, ran: list[bool], scratch: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> list[torch.Tensor]:
        """After the first captured forward: the layers it did not run become idle (named in
        a warning, their buffers left as they are); returns that forward's statistics in the
        layout of the layers that ran."""
        kept = [i for i, r in enumerate(ran) if r]
        idle = [self.layers[i][0] for i, r in enumerate(ran) if not r]
        self._idle_ids = {id(self._norms[i]): self.layers[i][0] for i, r in enumerate(ran) if not r}
        self.idle = idle
        stats = [scratch[i] for i in kept]
        self.layers = [self.layers[i] for i in kept]
        self._norms = [m for _, m in self.layers]
        self._index = {id(m): i for i, m in enumerate(self._norms)}
        shown = ", ".join(idle[:4]) + (f" and {len(idle) - 4} more" if len(idle) > 4 else "")
        log.warning(
            "BatchNorm layer(s) %s never ran in the training forward: left out of the running "
            "statistics (theirs stay as initialised; their parameters get zero gradients). If the "
            "model builds layers it does not use (smp: encoder_depth below 5), that is all; "
            "delete them from the model to save their memory.",
            shown,
        )
        out = []
        for idx, _ in self._layout():  # the flat tensors of the layers that ran
            out.append(torch.cat([stats[i][0] for i in idx] + [stats[i][1] for i in idx]))
        return out

    def _layout(self) -> list[tuple[list[int], list[int]]]:
        """The layers grouped by their buffers' dtype and device: ``(layer indices, sizes)``
        per group, the layout of a recorded flat tensor."""
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, m in enumerate(self._norms):
            rm = m.running_mean
            groups.setdefault((rm.dtype, rm.device), []).append(i)
        return [
            (idx, [self._norms[i].running_mean.numel() for i in idx]) for idx in groups.values()
        ]

    def _split(
        self, flats: list[torch.Tensor], layout: list[tuple[list[int], list[int]]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (mean, variance): views into the flat tensors of ``layout``."""
        out: list[Any] = [None] * len(self._norms)
        for flat, (idx, sizes) in zip(flats, layout, strict=True):
            views = flat.split(sizes + sizes)
            for j, i in enumerate(idx):
                out[i] = (views[j], views[len(idx) + j])
        return out

    def _scratch(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
        """Zeroed (mean, variance) buffers for every layer, views into one allocation per
        dtype and device (one fill, not two per layer); and those allocations."""
        layout = self._layout()
        flats = []
        for idx, sizes in layout:
            rm = self._norms[idx[0]].running_mean
            flats.append(torch.zeros(2 * sum(sizes), dtype=rm.dtype, device=rm.device))
        return self._split(flats, layout), flats

    def _count(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        ran = self._ran
        if ran is None or not module.training:
            return
        i = self._index.get(id(module))
        if i is None:  # idle: it did not run in the first training forward
            raise RuntimeError(
                f"RunningStats: BatchNorm layer {self._idle_ids.get(id(module), '?')} did not "
                "run in the first training forward but runs in this one; a layer that runs on "
                "some micro-batches only cannot have its running statistics reconciled in a "
                "fixed order: make the model run every layer on every micro-batch."
            )
        if ran[i]:
            raise RuntimeError(
                f"RunningStats: BatchNorm layer {self.layers[i][0]} ran twice in one forward; "
                "its running statistics cannot be reconciled (use one layer per call)."
            )
        ran[i] = True

    @torch.no_grad()
    def update(self, per_micro_batch: list[list[torch.Tensor]]) -> None:
        """Fold the statistics of each micro-batch, in order, into the running buffers.

        Layers with a momentum are updated together: per micro-batch, one multi-tensor
        multiply and one add (means and variances alike) per (momentum, dtype) group, plus
        one for the counters, instead of four kernels per layer (the step is launch-bound on
        GPUs). The formula is BatchNorm's, ``(1 - m) * running + m * batch``, rounded after
        the multiply and after the add."""
        layers = self._norms
        groups: dict[tuple[float, torch.dtype], list[int]] = {}
        cumulative: list[int] = []
        for i, m in enumerate(layers):
            if m.momentum is None:
                cumulative.append(i)
            else:
                groups.setdefault((float(m.momentum), m.running_mean.dtype), []).append(i)
        tracked = [m.num_batches_tracked for m in layers]
        layout = self._layout()
        sizes = [2 * sum(s) for _, s in layout]
        for recorded in per_micro_batch:
            if [t.numel() for t in recorded] != sizes:
                raise RuntimeError("RunningStats.update: statistics of another model")
            means, variances = zip(*self._split(recorded, layout), strict=True)
            torch._foreach_add_(tracked, 1)
            for (factor, _dtype), idx in groups.items():
                buffers = [layers[i].running_mean for i in idx]
                buffers += [layers[i].running_var for i in idx]
                stats = [means[i] for i in idx] + [variances[i] for i in idx]
                torch._foreach_mul_(buffers, 1 - factor)
                torch._foreach_add_(buffers, stats, alpha=factor)
            for i in cumulative:  # cumulative moving average, as PyTorch does
                m = layers[i]
                factor = 1.0 / float(m.num_batches_tracked)
                m.running_mean.mul_(1 - factor).add_(means[i], alpha=factor)
                m.running_var.mul_(1 - factor).add_(variances[i], alpha=factor)
