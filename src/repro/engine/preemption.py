"""Pre-emption during training: a notice caught by :mod:`repro.base.signals` (SIGTERM, SIGUSR1;
SIGUSR2 when a launcher listens for it) stops the run at the next step boundary, after a
checkpoint, with exit status ``PREEMPTED_EXIT_CODE`` (75); ``trainer.resume=auto`` then
continues with the uninterrupted run's bits. Ctrl-C (SIGINT) does the same with exit status
130; a second Ctrl-C stops at once (``KeyboardInterrupt``), the last checkpoint intact.
Under torchrun every rank stops after the same step."""

from __future__ import annotations

import logging
from pathlib import Path

from repro.base.errors import Preempted
from repro.base.files import resume_command
from repro.base.progress import span
from repro.base.signals import PreemptionSignals
from repro.base.world import StopVote, World, barrier

log = logging.getLogger("repro")


class Preemption:
    """The loop's side of the notices: under torchrun the ranks' agreement on when to stop:
    each rank casts its flag after a step and reads the outcome after the next one
    (:class:`StopVote`), so no rank waits for a vote and all stop after the same step."""

    def __init__(self, signals: PreemptionSignals, world: World, max_steps: int) -> None:
        self.signals, self.world, self.max_steps = signals, world, max_steps
        self.vote = StopVote(world) if world.distributed else None

    def poll(self, done: int) -> bool:
        """Stop after step ``done``? (Never after the last step: the run is complete.) Call
        it once after every step on every rank: under torchrun it reads the vote of the step
        before and casts this step's."""
        received = self.signals.received is not None
        if self.vote is None:
            stop = received
        else:  # the vote of the step before
            with span("repro.preemption"):
                stop = self.vote.outcome()
                if not stop and done < self.max_steps:
                    self.vote.cast(received)
        return stop and done < self.max_steps

    def stop(self, done: int, checkpoint: Path, run_dir: Path) -> None:
        """After the checkpoint of step ``done`` is written (rank 0): every rank past a
        barrier, the message, the signal handed over, :class:`Preempted` raised."""
        barrier(self.world)  # no rank leaves (and has torchrun stop the others) early
        received = self.signals.received
        name = received.name if received else "a signal to a peer"
        stopping = Preempted(done, name)
        (log.warning if self.world.main else log.info)(
            f"{name} received: stopped after step {done}/{self.max_steps}, checkpoint "
            f"{checkpoint}; exit status {stopping.code}. Resume with the same command "
            f"plus {resume_command(run_dir)}"
        )
        self.signals.hand_over()  # e.g. submitit: requeue this job (and exit)
        raise stopping
