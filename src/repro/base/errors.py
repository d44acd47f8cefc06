"""Errors a user can cause. Each message is one sentence naming the key or file and what to do.

Entry points print them as that one line and exit 1 (:func:`exit_with`), never a traceback.
They derive from Hydra's ``CompactHydraException`` so that one that escapes under Hydra is
still printed without a traceback.
"""

from __future__ import annotations

import os
import sys
import time
from typing import NoReturn

from hydra.errors import CompactHydraException


class ReproError(CompactHydraException):
    """Base class: a problem the user can fix, reported as one line."""


class ConfigError(ReproError):
    """A bad config value."""


class MissingPackage(ConfigError):
    """A ``_target_`` that needs a package which is not installed (an optional extra, a model
    zoo): ``package`` names it."""

    def __init__(self, message: str, package: str) -> None:
        super().__init__(message)
        self.package = package


class DeterminismError(ReproError):
    """A determinism requirement that is not in effect."""


class DataError(ReproError):
    """A dataset that cannot be read or built."""


class Untrusted(ReproError):
    """A received run's config that would run code the user has not trusted
    (``repro.records.trust``, docs/trust.md)."""


class JobFailed(ReproError):
    """A sweep's job that failed and said why in one line (``train.py``): its sweep runs its
    other jobs and ends with this line, without Hydra's own lines about it
    (:func:`repro.engine.callbacks.quiet_reported_failures`)."""


class FromRank0(ReproError):
    """Raised on ranks > 0 of a torchrun for an error that rank 0 met and reported."""


def exit_with(error: ReproError) -> NoReturn:
    """Print a user error as its one line on stderr and exit 1.

    ``SystemExit`` rather than the exception itself: Hydra turns exceptions raised in a
    callback into warnings and goes on, but lets ``SystemExit`` through. Under torchrun the
    line names the rank and also goes into torchrun's error file, so its failure summary
    shows it; an error rank 0 reported is not repeated by the other ranks."""
    report_error(error)
    raise SystemExit(1)


def report_error(error: BaseException) -> None:
    """Print ``error: <message>`` on stderr (a user error as its one line, anything else as
    its type and message after the traceback); under torchrun name the rank and record it in
    torchrun's error file. An error rank 0 reported is not repeated by the other ranks."""
    if isinstance(error, FromRank0):
        return
    world_size = os.environ.get("WORLD_SIZE", "1")
    rank = f"[rank {os.environ.get('RANK', '?')}/{world_size}] " if world_size != "1" else ""
    text = str(error) if isinstance(error, ReproError) else f"{type(error).__name__}: {error}"
    print(f"error: {rank}{text}", file=sys.stderr)
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        if inside_a_collective(error):
            # most likely a peer failed first and this rank lost it mid-collective: record
            # later, so that torchrun (which names the earliest record, to the second) shows
            # the peer's error as the root cause (it may stop this rank before: fine)
            sys.stderr.flush()
            time.sleep(2)
        ErrorHandler().record_exception(error)


def inside_a_collective(error: BaseException) -> bool:
    """Was ``error`` raised inside ``torch.distributed`` (a collective, a barrier) or while
    waiting for a collective in flight (:func:`repro.base.world.wait`)?"""
    tb, last = error.__traceback__, None
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "wait" and code.co_filename.endswith(
            os.path.join("repro", "base", "world.py")
        ):
            return True
        last, tb = code, tb.tb_next
    return last is not None and f"torch{os.sep}distributed{os.sep}" in last.co_filename


class Diverged(ReproError):
    """A loss or gradient norm that is not finite (``trainer.on_nonfinite=stop``)."""


class CheckpointError(ReproError):
    """A checkpoint that is damaged, foreign, unsafe or missing. ``damaged``: its bytes are
    not what was written (a checksum or its own digest disagrees, or, with neither to check,
    it cannot be read as a checkpoint) -- unlike a file that cannot be read now, or one that
    is intact but foreign."""

    def __init__(self, message: str, damaged: bool = False) -> None:
        super().__init__(message)
        self.damaged = damaged


# Exit status of a run stopped by SIGTERM/SIGUSR1 after writing its checkpoint: EX_TEMPFAIL
# ("try again later"), so a requeue can resume it with trainer.resume=auto.
PREEMPTED_EXIT_CODE = 75


# Exit status of a run stopped by Ctrl-C (SIGINT) after writing its checkpoint: the shell's
# 128 + SIGINT.
INTERRUPTED_EXIT_CODE = 130


class Preempted(SystemExit):
    """Raised at a step boundary after a pre-emption signal (or Ctrl-C) and the checkpoint it
    asked for: exit status 75, or 130 for Ctrl-C."""

    def __init__(self, step: int, signal_name: str) -> None:
        code = INTERRUPTED_EXIT_CODE if signal_name == "SIGINT" else PREEMPTED_EXIT_CODE
        super().__init__(code)
        self.step, self.signal_name = step, signal_name
