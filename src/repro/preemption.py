"""Pre-emption: a cluster's notice (SIGTERM, SIGUSR1; SIGUSR2 when a launcher listens for
it) stops the run at the next step boundary, after a checkpoint, with exit status
``PREEMPTED_EXIT_CODE`` (75); ``trainer.resume=auto`` then continues with the uninterrupted
run's bits. Ctrl-C (SIGINT) does the same with exit status 130; a second Ctrl-C stops at
once (``KeyboardInterrupt``), the last checkpoint intact. Under torchrun every rank stops
after the same step."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Any

from repro.dist import StopVote, World, barrier
from repro.errors import Preempted
from repro.progress import span

log = logging.getLogger("repro")


class PreemptionSignals:
    """SIGTERM / SIGUSR1 (a cluster's notice before it kills or requeues a job) set a flag;
    the loop checkpoints at the next step boundary and exits with ``PREEMPTED_EXIT_CODE``.

    SIGUSR2 is caught too when some Python code already handles it: submitit (Hydra's SLURM
    launcher) requeues a job on SIGUSR2. The loop checkpoints first, then hands the signal to
    that handler (:meth:`hand_over`), so the requeued job resumes from this very step."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> PreemptionSignals:
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
            log.warning(
                "Ctrl-C: stopping after this step, with a checkpoint (Ctrl-C again: at once)"
            )
        if self.received is None:  # the first notice decides (and is the one handed over)
            self.received = signal.Signals(signum)

    def hand_over(self) -> None:
        """Call the handler that was there before us for the received signal, if any."""
        previous = self._previous.get(self.received) if self.received else None
        if callable(previous) and self.received != signal.SIGINT:  # Python's: KeyboardInterrupt
            self.__exit__()
            previous(int(self.received), None)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


class Preemption(PreemptionSignals):
    """The signals, and under torchrun the ranks' agreement on when to stop: each rank casts
    its flag after a step and reads the outcome after the next one (:class:`StopVote`), so
    no rank waits for a vote and all stop after the same step."""

    def __init__(self, world: World, max_steps: int) -> None:
        super().__init__()
        self.world, self.max_steps = world, max_steps
        self.vote = StopVote(world) if world.distributed else None

    def poll(self, done: int) -> bool:
        """Stop after step ``done``? (Never after the last step: the run is complete.) Call
        it once after every step on every rank: under torchrun it reads the vote of the step
        before and casts this step's."""
        if self.vote is None:
            stop = self.received is not None
        else:  # the vote of the step before
            with span("repro.preemption"):
                stop = self.vote.outcome()
                if not stop and done < self.max_steps:
                    self.vote.cast(self.received is not None)
        return stop and done < self.max_steps

    def stop(self, done: int, checkpoint: Path, run_dir: Path) -> None:
        """After the checkpoint of step ``done`` is written (rank 0): every rank past a
        barrier, the message, the signal handed over, :class:`Preempted` raised."""
        barrier(self.world)  # no rank leaves (and has torchrun stop the others) early
        name = self.received.name if self.received else "a signal to a peer"
        stopping = Preempted(done, name)
        (log.warning if self.world.main else log.info)(
            f"{name} received: stopped after step {done}/{self.max_steps}, checkpoint "
            f"{checkpoint}; exit status {stopping.code}. Resume with the same command "
            f"plus trainer.resume=auto hydra.run.dir={run_dir}"
        )
        self.hand_over()  # e.g. submitit: requeue this job (and exit)
        raise stopping
