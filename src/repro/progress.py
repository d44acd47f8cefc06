"""A one-line progress bar on stderr: shown on a TTY, silent under ``CI=true`` or in a pipe."""

from __future__ import annotations

import os
import sys
import time


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
