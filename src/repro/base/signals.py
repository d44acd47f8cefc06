"""Pre-emption notices, caught from the start of the process: a cluster's SIGTERM or
SIGUSR1 (SIGUSR2 when a launcher listens for it) and Ctrl-C (SIGINT) set a flag instead of
ending the process, so that the run can stop where it loses nothing -- at the next step
boundary, after a checkpoint (:mod:`repro.engine.preemption`), or before the first step, with exit
status ``PREEMPTED_EXIT_CODE`` (75; 130 for Ctrl-C) either way.

``train.py`` arms them first thing (:func:`arm`), before torch is imported; a run started
another way (the tests' in-process runs) arms them for its own duration (:func:`armed`).
Imports no torch."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from repro.base.errors import Preempted
from repro.base.files import resume_command

log = logging.getLogger("repro")


class PreemptionSignals:
    """SIGTERM / SIGUSR1 (a cluster's notice before it kills or requeues a job) and SIGINT
    set :attr:`received`; the run stops at its next safe point.

    SIGUSR2 is caught too when some Python code already handles it: submitit (Hydra's SLURM
    launcher) requeues a job on SIGUSR2. The run stops first, then hands the signal to that
    handler (:meth:`hand_over`), so the requeued job resumes from this very step."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> PreemptionSignals:
        if threading.current_thread() is threading.main_thread():
            signals = [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT]
            if callable(signal.getsignal(signal.SIGUSR2)):
                signals.append(signal.SIGUSR2)
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT:
            if self.received == signal.SIGINT:  # the second Ctrl-C: stop now
                raise KeyboardInterrupt
            log.warning("Ctrl-C: stopping at the next safe point (Ctrl-C again: at once)")
        if self.received is None:  # the first notice decides (and is the one handed over)
            self.received = signal.Signals(signum)

    def hand_over(self) -> None:
        """Call the handler that was there before us for the received signal, if any."""
        previous = self._previous.get(self.received) if self.received else None
        if callable(previous) and self.received != signal.SIGINT:  # Python's: KeyboardInterrupt
            self.uninstall()
            previous(int(self.received), None)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def stop_before_training(self, run_dir: Any = None, checkpoint_step: int = 0) -> None:
        """Before the first step: a notice already received stops the run here (exit status
        75, 130 for Ctrl-C), in one line with the resume command; nothing to save
        (``checkpoint_step``: that of the checkpoint the run would resume from, intact)."""
        if self.received is None:
            return
        name = self.received.name
        stopping = Preempted(checkpoint_step, name)
        kept = (
            f"its checkpoint of step {checkpoint_step} is intact"
            if checkpoint_step
            else "nothing was trained yet"
        )
        log.warning(
            f"{name} received before the first step: stopped ({kept}); exit status "
            f"{stopping.code}. Resume with the same command plus {resume_command(run_dir)}"
        )
        self.hand_over()  # e.g. submitit: requeue this job (and exit)
        raise stopping


_armed: PreemptionSignals | None = None


def arm() -> PreemptionSignals:
    """Catch the notices for the rest of this process (``train.py``, first thing)."""
    global _armed
    if _armed is None:
        _armed = PreemptionSignals().install()
    return _armed


def received() -> signal.Signals | None:
    """The notice this process has received, if it armed them."""
    return _armed.received if _armed is not None else None


@contextmanager
def armed() -> Iterator[PreemptionSignals]:
    """The process's notices, caught inside: the ones :func:`arm` installed, or, if it was
    not called, installed here and the earlier handlers put back on the way out."""
    global _armed
    if _armed is not None:
        yield _armed
        return
    _armed = PreemptionSignals().install()
    try:
        yield _armed
    finally:
        _armed.uninstall()
        _armed = None
