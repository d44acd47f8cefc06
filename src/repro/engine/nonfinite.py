"""``trainer.on_nonfinite=stop`` without a host synchronisation per step.

The contract: when a step's loss or gradient norm is inf or NaN, nothing of that step is
applied, and the run stops with a checkpoint of the last finite step. Reading a device flag
after every step keeps it, but the read waits for the step's kernels: the host cannot queue
the next step while the GPU runs this one, which is what a small model's step is made of.

:class:`FiniteGuard` keeps it without the wait. The steps run unchecked; the host reads their
losses and gradient norms where it reads the device anyway (:meth:`FiniteGuard.reads_at`:
every ``log_every`` steps, where the logs are written, and before anything that shows the
state -- an evaluation, a digest, a checkpoint, the last step, a stop). Now and then, at a
read that finds every step finite, it keeps a copy of the training state (:class:`Snapshot`).
When a read finds step N not finite, it puts the copy back and trains again the steps after
the copy up to N - 1, on their batches loaded again (the loader starts at any step, as for a
resume): the template's steps are deterministic, so this gives the bits the unchecked steps
had (under ``determinism=fast`` a state of the same steps, not bit-equal). The loop then
writes the checkpoint of step N - 1 and stops, as before, with nothing of step N or later
applied, written or evaluated.

It costs a copy of the weights, buffers and optimizer state, in memory beside them, taken
every ``HOLD_STEPS`` steps (at a read); nothing a step, and no batch is held. A run that
diverges trains up to ``HOLD_STEPS`` + ``log_every`` steps again before it stops.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from repro.base.progress import span
from repro.engine.build import Training
from repro.engine.step import NotFinite
from repro.records.checkpoint import restore_training, training_state


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
    """A step not read yet: its loss and gradient norm (device tensors), learning rate, and
    trace record as the step left it (the input digests)."""

    done: int
    loss: torch.Tensor
    grad_norm: torch.Tensor
    lr: float
    record: dict[str, Any]


class FiniteGuard:
    """Holds the steps since the copy of the state (:meth:`note`), reads them where the loop
    reads the device anyway (:meth:`verify`), and on a step that is not finite brings the
    state back to the step before it (module docstring).

    ``replay(steps)`` trains the given steps (0-based, consecutive) again, on their batches
    loaded again, raising :class:`NotFinite` (its ``step`` set) as the synchronous check does;
    ``loss_only``: under fp16 an infinite gradient is the GradScaler's business (it skips the
    step), so only the loss is read. ``every``: the loop's ``(log_every, eval_every,
    checkpoint_every, max_steps)``, where it reads the device (:meth:`reads_at`). A new copy
    is taken at a read once ``hold_steps`` steps were read since the last one."""

    HOLD_STEPS = 100

    def __init__(
        self,
        training: Training,
        start: int,
        replay: Callable[[list[int]], None],
        loss_only: bool,
        every: tuple[int, int, int, int] = (1, 0, 0, 0),
        hold_steps: int = HOLD_STEPS,
    ) -> None:
        self.training, self.replay, self.loss_only = training, replay, loss_only
        self.log_every, self.eval_every, self.checkpoint_every, self.max_steps = every
        self.hold_steps = hold_steps
        self.held: list[Step] = []  # every step since the copy, in order
        self.read = 0  # how many of them were read (all finite)
        self.snapshot = Snapshot(training, start)

    def reads_at(self, done: int, tracer: Any) -> bool:
        """Does the loop read the device after step ``done`` anyway -- the logs' block
        (``log_every``), a digest of the weights (``tracer``), an evaluation, a checkpoint,
        the last step -- so that the steps are read there first?"""
        return (
            done % self.log_every == 0
            or done == self.max_steps
            or tracer.digest_step(done)
            or bool(self.eval_every and done % self.eval_every == 0)
            or bool(self.checkpoint_every and done % self.checkpoint_every == 0)
        )

    def note(self, step: Step) -> None:
        self.held.append(step)

    def verify(self) -> Step | None:
        """Read the steps not read yet. All finite: None (and a new copy of the state, when
        enough steps were read since the last one). Else the first step that is not, after
        the state is brought back to the step before it (every rank at once: the values read
        are the reduced ones)."""
        unread = self.held[self.read :]
        if not unread:
            return None
        with span("repro.wait_finite"):  # the host synchronisation, once for the block
            losses = torch.stack([s.loss.float() for s in unread]).tolist()
            norms = torch.stack([s.grad_norm.float() for s in unread]).tolist()
        bad = next(
            (
                i
                for i, (loss, norm) in enumerate(zip(losses, norms, strict=True))
                if not (math.isfinite(loss) and (self.loss_only or math.isfinite(norm)))
            ),
            None,
        )
        if bad is None:
            self.read = len(self.held)
            if len(self.held) >= self.hold_steps:
                self.snapshot = Snapshot(self.training, self.held[-1].done)
                self.held, self.read = [], 0
            return None
        redo, first = self.held[: self.read + bad], unread[bad]
        self.held, self.read = [], 0
        return self._back_to_before(first, redo)

    def _back_to_before(self, first: Step, redo: list[Step]) -> Step:
        """Put the copy back and train again the finite steps after it (``redo``); the step
        that is not finite (the first one the replay finds, under nondeterministic kernels
        perhaps an earlier one), its values as computed."""
        with span("repro.replay"):
            self.snapshot.restore(self.training)
            try:
                if redo:
                    self.replay([s.done - 1 for s in redo])
            except NotFinite as bad:  # determinism=fast: not the bits it had
                step = next(s for s in redo if s.done - 1 == bad.step)
                step.loss, step.grad_norm = bad.loss, bad.grad_norm
                return step
        return first
