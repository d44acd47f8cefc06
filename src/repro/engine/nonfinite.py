"""``trainer.on_nonfinite=stop`` without a host synchronisation per step.

The contract: when a step's loss or gradient norm is inf or NaN, nothing of that step is
applied, and the run stops with a checkpoint of the last finite step. Reading a device flag
after every step keeps it, but the read waits for the step's kernels: the host cannot queue
the next step while the GPU runs this one, which is what a small model's step is made of.

:class:`FiniteGuard` keeps it without the wait. The steps run unchecked; the host reads their
losses and gradient norms where it reads the device anyway (:meth:`FiniteGuard.due`: every
``log_every`` steps, where the logs are written, and before anything that shows the state --
an evaluation, a digest, a checkpoint, the last step, a stop). Until then it holds each
step's loaded batches; at each read that finds every step finite it keeps a copy of the
training state (:class:`Snapshot`). When a read finds step N not finite, it puts the copy
back and trains again, from the same batches, the steps after the copy up to N - 1: the
template's steps are deterministic, so this gives the bits the unchecked steps had (under
``determinism=fast`` a state of the same steps, not bit-equal). The loop then writes the
checkpoint of step N - 1 and stops, as before, with nothing of step N or later applied,
written or evaluated.

It costs one copy of the weights, buffers and optimizer state, in memory beside them, and the
loaded batches of at most ``log_every`` steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from repro.base.progress import span
from repro.engine.build import Training
from repro.engine.step import NotFinite
from repro.records.checkpoint import restore_training, training_state

Batch = tuple[torch.Tensor, torch.Tensor]


class Snapshot:
    """The training state after step ``done``, copied in memory on the state's own devices:
    what a checkpoint holds of it (:func:`repro.records.checkpoint.training_state`)."""

    def __init__(self, training: Training, done: int) -> None:
        self.done = done
        with span("repro.snapshot"):
            state = training_state(training)  # its generator states are copies already
            self.state = {k: v if k == "rng" else _copied(v) for k, v in state.items()}

    def restore(self, training: Training) -> None:
        """Put it back (once: the optimizer may then hold the copy's tensors)."""
        restore_training(training, self.state, Path(f"<the copy of step {self.done}>"))


def _copied(value: Any) -> Any:
    """``value`` with every tensor in it cloned and every dict and list rebuilt (what
    ``copy.deepcopy`` gives a state dict, at a tenth of its cost: the rest is immutable)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return type(value)((k, _copied(v)) for k, v in value.items())
    if isinstance(value, list):
        return [_copied(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_copied(v) for v in value)
    return value


@dataclass
class Step:
    """A step not read yet: its loss and gradient norm (device tensors), learning rate, trace
    record as the step left it (the input digests), and its batches as loaded."""

    done: int
    loss: torch.Tensor
    grad_norm: torch.Tensor
    lr: float
    record: dict[str, Any]
    raw: list[Batch] = field(repr=False)


class FiniteGuard:
    """Holds the steps since the last read (:meth:`note`), reads them where the loop reads the
    device anyway (:meth:`verify`), and on a step that is not finite brings the state back to
    the step before it (module docstring).

    ``replay(step, raw)`` trains step ``step`` (0-based) on its batches as loaded and returns
    its (loss, gradient norm), raising :class:`NotFinite` as the synchronous check does;
    ``loss_only``: under fp16 an infinite gradient is the GradScaler's business (it skips the
    step), so only the loss is read."""

    def __init__(
        self,
        training: Training,
        start: int,
        replay: Callable[[int, list[Batch]], tuple[torch.Tensor, torch.Tensor]],
        loss_only: bool,
    ) -> None:
        self.training, self.replay, self.loss_only = training, replay, loss_only
        self.unread: list[Step] = []
        self.snapshot = Snapshot(training, start)

    def note(self, step: Step) -> None:
        self.unread.append(step)

    def verify(self) -> Step | None:
        """Read the steps since the last read. All finite: keep a copy of the state, and
        None. Else the first step that is not, after the state is brought back to the step
        before it (every rank at once: the values read are the reduced ones)."""
        if not self.unread:
            return None
        with span("repro.wait_finite"):  # the host synchronisation, once for the block
            losses = torch.stack([s.loss.float() for s in self.unread]).tolist()
            norms = torch.stack([s.grad_norm.float() for s in self.unread]).tolist()
        bad = next(
            (
                i
                for i, (loss, norm) in enumerate(zip(losses, norms, strict=True))
                if not (math.isfinite(loss) and (self.loss_only or math.isfinite(norm)))
            ),
            None,
        )
        if bad is None:
            self.snapshot = Snapshot(self.training, self.unread[-1].done)
            self.unread.clear()
            return None
        first = self.unread[bad]
        redo, self.unread = self.unread[:bad], []
        return self._back_to_before(first, redo)

    def _back_to_before(self, first: Step, redo: list[Step]) -> Step:
        """Put the copy back and train again the finite steps after it (``redo``); the step
        that is not finite (the first one the replay finds, under nondeterministic kernels
        perhaps an earlier one), its values as computed."""
        with span("repro.replay"):
            self.snapshot.restore(self.training)
            for step in redo:
                try:
                    self.replay(step.done - 1, step.raw)
                except NotFinite as bad:  # determinism=fast: not the bits it had
                    step.loss, step.grad_norm = bad.loss, bad.grad_norm
                    return step
        return first
