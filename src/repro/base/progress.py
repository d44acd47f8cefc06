"""How far and how fast: a one-line progress bar on stderr (shown on a TTY, silent under
``CI=true`` or in a pipe), the steady throughput, and the named ranges of a step that
``scripts/profile_step.py`` reports."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.autograd.profiler import record_function


def span(name: str) -> AbstractContextManager[Any]:
    """A named range (``repro.<part>``) of the step in ``torch.profiler``'s tables; nothing
    at all when no profiler runs (the step is bound by host time on GPUs)."""
    return record_function(name) if torch.autograd._profiler_enabled() else nullcontext()


class Progress:
    def __init__(self, total: int, start: int = 0, enabled: bool = True, width: int = 24) -> None:
        self.total, self.done, self.width = total, start, width
        self.enabled = enabled and sys.stderr.isatty() and os.environ.get("CI", "") == ""
        self.t0, self.start = time.perf_counter(), start
        self.line_open = False  # a bar is on screen without its newline yet

    def update(self, done: int, **fields: object) -> None:
        self.done = done
        if not self.enabled:
            return
        frac = done / max(self.total, 1)
        filled = int(frac * self.width)
        rate = (done - self.start) / max(time.perf_counter() - self.t0, 1e-9)
        extra = " ".join(f"{k} {v}" for k, v in fields.items())
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (self.width - filled)}] "
            f"{done}/{self.total} {rate:.1f} step/s {extra}\033[K"
        )
        sys.stderr.flush()
        self.line_open = True

    def close(self) -> None:
        """End the bar's line (before a log line, and at the end); idempotent."""
        if self.line_open:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self.line_open = False


class Throughput:
    """Images a second over the whole loop, and steady: from the end of the first steps
    (at most 10: the warm-up, compilation included) to the last update, the device
    synchronised at both marks. Evaluations and
    checkpoints in between count; the final ones do not."""

    def __init__(self, start: int, max_steps: int, batch_size: int, device: torch.device) -> None:
        self.start, self.max_steps, self.batch_size, self.device = (
            start,
            max_steps,
            batch_size,
            device,
        )
        self.warm = start + min(10, (max_steps - start) // 2)
        self.marks: dict[int, float] = {}
        self.t0 = time.perf_counter()
        self.seconds: float | None = None
        self.waited = 0.0  # seconds the loop waited for the loader, between the marks
        self.steady = False

    def timed(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches``, with the time each ``next`` takes between the two marks added to
        ``waited``: the loop waiting for the loader (for worker processes: until a batch is
        in pinned memory; the copy to the device is queued, not waited for)."""
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            if self.steady:
                self.waited += time.perf_counter() - t0
            yield batch

    def tick(self, done: int) -> None:
        self.steady = self.warm <= done < self.max_steps  # the next step's batches: in the window
        if done in (self.warm, self.max_steps) and done > self.start:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.marks[done] = time.perf_counter()

    def stop(self) -> None:
        self.seconds = time.perf_counter() - self.t0

    def summary(self) -> dict[str, float | None]:
        seconds = self.seconds if self.seconds is not None else time.perf_counter() - self.t0
        steady = waiting = None
        if self.warm in self.marks and self.max_steps in self.marks and self.max_steps > self.warm:
            span = self.marks[self.max_steps] - self.marks[self.warm]
            steady = (self.max_steps - self.warm) * self.batch_size / span
            waiting = self.waited / span
        warm = self.marks.get(self.warm)
        return {
            "images_per_second": (self.max_steps - self.start) * self.batch_size / seconds,
            "steady_images_per_second": steady,
            # the part of the steady span the loop waited for batches: near 0, the loader
            # keeps up; near 1, the loader sets the pace (more workers, loader=device)
            "loader_wait_fraction": waiting,
            # the first steps, until steady: torch.compile's compilation falls here
            "warmup_seconds": warm - self.t0 if warm is not None else None,
        }
