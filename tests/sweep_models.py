"""Models (and a logger) that misbehave on purpose, at one point of a run: a sweep job that
fails at run time, an error on one torchrun rank, Ctrl-C during evaluation, a pre-emption
notice before the first step."""

import torch

from repro.base.rng import derive_seed
from repro.components.models import ConvNet
from repro.records.loggers import Logger


class FailsForSeed(ConvNet):
    """The default ConvNet, except that it raises when built for ``fail_seed`` (the loop seeds
    the CPU generator with ``derive_seed(seed, "init")`` right before building the model)."""

    def __init__(self, num_classes, in_channels=3, width=32, dropout=0.1, fail_seed=1):
        if torch.initial_seed() == derive_seed(fail_seed, "init"):
            raise RuntimeError(f"this model refuses seed {fail_seed} (a test of failing jobs)")
        super().__init__(num_classes, in_channels, width, dropout)


class FailsOnRank(ConvNet):
    """The default ConvNet, except that its forward raises on one torchrun rank after a few
    steps: an error on one process of a multi-process run."""

    def __init__(self, num_classes, in_channels=3, width=32, dropout=0.1, fail_rank=1):
        super().__init__(num_classes, in_channels, width, dropout)
        self.fail = int(__import__("os").environ.get("RANK", "0")) == fail_rank
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.fail and self.calls > 6:
            raise RuntimeError("this rank's forward fails (a test of errors under torchrun)")
        return super().forward(x)


class CtrlCInEvaluation(ConvNet):
    """The default ConvNet, except that at its ``at_eval``-th evaluation forward it sends
    SIGINT to its whole process group ``presses`` times (a Ctrl-C in the terminal reaches the
    loader workers too), as a user pressing Ctrl-C during evaluation."""

    def __init__(self, num_classes, in_channels=3, width=32, dropout=0.1, at_eval=2, presses=1):
        super().__init__(num_classes, in_channels, width, dropout)
        self.at_eval, self.presses, self.eval_calls = at_eval, presses, 0

    def forward(self, x):
        if not self.training:
            self.eval_calls += 1
            if self.eval_calls == self.at_eval:
                import os
                import signal
                import time

                for _ in range(self.presses):
                    os.killpg(os.getpgid(0), signal.SIGINT)
                    time.sleep(0.2)  # the handler runs between bytecodes
        return super().forward(x)


class TerminatedWhileBuilt(ConvNet):
    """The default ConvNet, except that building it sends this process SIGTERM (a cluster's
    pre-emption notice arriving before the first step), then goes on building."""

    def __init__(self, num_classes, in_channels=3, width=8, dropout=0.1):
        import os
        import signal

        os.kill(os.getpid(), signal.SIGTERM)
        super().__init__(num_classes, in_channels, width, dropout)


class TerminatedWhileStarting(Logger):
    """A logger whose start is where this process receives SIGTERM (a tracking server being
    slow to answer when the notice comes)."""

    def start(self, info):
        import os
        import signal

        os.kill(os.getpid(), signal.SIGTERM)
