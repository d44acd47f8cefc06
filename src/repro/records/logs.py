"""What a run logs as it goes: ``trace.jsonl`` (:mod:`repro.records.trace`), the console (progress
bar, a line per evaluation), and the rows it hands the chosen loggers (:mod:`repro.records.loggers`:
``metrics.csv`` and ``eval.csv`` by default). Only rank 0 logs; the other ranks hold a
:class:`NullLog`.

Losses and gradient norms stay on the device until a flush (every ``trainer.log_every``
steps, at evaluations and before checkpoints), so logging adds no host synchronisation to a
step. Floats are written with ``repr``, which round-trips them exactly.
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from repro.base.files import TRACE_FILE, atomic_write, parse_trace_record
from repro.base.progress import Progress, span
from repro.records.loggers import METRICS_FIELDS, Loggers
from repro.records.trace import TraceWriter

log = logging.getLogger("repro")
# The console line shows a task's first metrics; eval.csv and trace.jsonl hold them all.
CONSOLE_METRICS = 4


def keep_trace_prefix(path: Path, step: int) -> int:
    """Keep the records of steps <= ``step`` of a trace (a resumed run); return the last
    step kept (less than ``step`` when records are missing, or a line is not a record: it is
    named in a warning)."""
    kept: list[str] = []
    if path.is_file():
        # bytes that are not UTF-8 (garbage appended, a damaged disk) become U+FFFD
        lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
        for n, line in enumerate(lines, 1):
            try:
                record = parse_trace_record(line)
            except ValueError as err:  # a line cut short by the kill, or damaged
                if len(kept) - 1 < step:
                    log.warning(
                        f"{path}:{n}: not a trace record ({err}); the trace is kept up to "
                        f"step {len(kept) - 1}"
                    )
                break
            if record["step"] != len(kept) or record["step"] > step:
                break
            kept.append(line + "\n")
    atomic_write(path, lambda f: f.write("".join(kept).encode()))
    return len(kept) - 1


class TrainingLog:
    """Rank 0's logs of a run (see the module docstring).

    ``step()`` queues a step's row and trace record (with its evaluation, if any);
    ``flush()`` writes what is queued (trace records wait for their
    background state digests unless ``wait``). ``last`` is what the summary and checkpoints
    report: the latest flushed loss and the latest metrics."""

    def __init__(
        self,
        run_dir: Path,
        *,
        max_steps: int,
        steps_per_epoch: int,
        log_every: int,
        loggers: Loggers,
        progress: bool,
        trace: bool,
        start: int = 0,
        resumed: dict[str, Any] | None = None,
        initial: dict[str, Any] | None = None,
    ) -> None:
        """``loggers``: started (:meth:`repro.records.loggers.Loggers.open`); they are closed by
        their owner, after the summary. ``resumed``: the checkpoint's ``last`` values (a
        resumed run, from step ``start``); ``initial``: the step-0 trace record of a new run
        (initial weights' digests)."""
        at = start if resumed is not None else None
        self.max_steps, self.steps_per_epoch, self.log_every = max_steps, steps_per_epoch, log_every
        self.loggers = loggers
        self.trace = self._open_trace(run_dir / TRACE_FILE, trace, at, initial)
        self.progress = Progress(max_steps, enabled=progress, start=start)
        last = dict(resumed or {})
        self.last_loss: float = last.pop("loss", math.nan)
        self.last_metrics: dict[str, float] = last
        # (step, loss, grad norm) of the first step that was not finite, once a flush saw it
        self.diverged: tuple[int, float, float] | None = None
        self.warned = False  # about it (trainer.on_nonfinite=continue)
        # (step, loss, grad norm, lr, trace record): tensors on the device until a flush
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor, float, dict[str, Any]]] = []
        self.held: list[dict[str, Any]] = []  # trace records whose state digest is hashing

    @staticmethod
    def _open_trace(
        path: Path, enabled: bool, resume_at: int | None, initial: dict[str, Any] | None
    ) -> TraceWriter | None:
        if resume_at is not None and (enabled or path.is_file()):
            kept = keep_trace_prefix(path, resume_at)  # no records past the checkpoint
            if enabled and kept != resume_at:
                log.warning(f"{TRACE_FILE} held steps up to {kept} only: the trace has a gap")
        if not enabled:
            return None
        if resume_at is not None:
            return TraceWriter(path, mode="a")
        trace = TraceWriter(path)
        trace.write([initial])
        return trace

    @property
    def last(self) -> dict[str, Any]:
        return {"loss": self.last_loss, **self.last_metrics}

    def step(
        self,
        done: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        lr: float,
        record: dict[str, Any],
        evaluation: dict[str, float] | None = None,
    ) -> None:
        """Queue step ``done``'s values; write them every ``log_every`` steps, and at once
        with the step's ``evaluation`` metrics (into its trace record, the loggers and a
        console line)."""
        self.pending.append((done, loss, grad_norm, lr, record))
        if evaluation is not None:
            record["eval"] = evaluation
            self.last_metrics = dict(evaluation)
            self.flush()
            self.loggers.log_eval(done, evaluation)
            self.progress.close()
            shown = "  ".join(f"{k} {v:.4f}" for k, v in list(evaluation.items())[:CONSOLE_METRICS])
            log.info(f"step {done}/{self.max_steps}  loss {self.last_loss:.4f}  {shown}")
        elif done % self.log_every == 0:
            self.flush()
            self.progress.update(done, loss=f"{self.last_loss:.4f}")

    def forget_from(self, step: int) -> None:
        """Drop the pending rows of step ``step`` and after (steps that were not applied:
        :class:`repro.engine.nonfinite.FiniteGuard`)."""
        self.pending = [p for p in self.pending if p[0] < step]

    def flush(self, wait: bool = False) -> None:
        """Hand the pending steps' rows to the loggers, and write their trace records up to the first one
        whose state digest the background thread is still hashing (all, with ``wait``)."""
        with span("repro.log"):
            self._flush(wait)

    def _flush(self, wait: bool) -> None:
        if self.pending:
            # two device reads for the block, whatever its length (each value exact in a float)
            losses = torch.stack([loss for _, loss, _, _, _ in self.pending]).tolist()
            norms = torch.stack([norm.float() for _, _, norm, _, _ in self.pending]).tolist()
            rows = [
                [s, (s - 1) // self.steps_per_epoch, loss, norm, lr]
                for (s, _, _, lr, _), loss, norm in zip(self.pending, losses, norms, strict=True)
            ]
            self.loggers.log_steps([dict(zip(METRICS_FIELDS, r, strict=True)) for r in rows])
            if self.trace:
                self.held.extend(
                    {"step": s, "epoch": e, "loss": loss, "grad_norm": norm, "lr": lr, **record}
                    for (s, e, loss, norm, lr), (*_, record) in zip(rows, self.pending, strict=True)
                )
            self.last_loss = rows[-1][2]
            self.pending.clear()
            if self.diverged is None:  # the first step whose loss or gradient norm is not finite
                self.diverged = next(
                    ((s, loss, norm) for s, _, loss, norm, _ in rows if not _finite(loss, norm)),
                    None,
                )
        ready = 0
        for record in self.held:
            digest = record.get("tensors")
            if isinstance(digest, Future):
                if not (wait or digest.done()):
                    break
                record["tensors"], record["weights_sha256"] = digest.result()
            ready += 1
        if self.trace and ready:
            self.trace.write(self.held[:ready])
            del self.held[:ready]

    def warn_if_diverged(self) -> None:
        """``trainer.on_nonfinite=continue``: one warning, once a step was not finite."""
        if self.diverged and not self.warned:
            log.warning(
                f"step {self.diverged[0]}: the loss or gradient norm is not finite; "
                "training on (trainer.on_nonfinite=continue)"
            )
            self.warned = True

    def close(self) -> None:
        """The trace closed and the loggers flushed (their owner closes them)."""
        self.progress.close()
        if self.trace:
            self.trace.close()
        self.loggers.flush()

    def __enter__(self) -> TrainingLog:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class NullLog(TrainingLog):
    """What ranks other than 0 log to: nothing."""

    def __init__(self) -> None:
        self.last_loss, self.last_metrics = math.nan, {}
        self.diverged = None

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass

    def forget_from(self, step: int) -> None:
        pass

    def flush(self, wait: bool = False) -> None:
        pass

    def close(self) -> None:
        pass


def _finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)
