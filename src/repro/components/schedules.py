"""Learning-rate schedules (``conf/schedule/``): ``_partial_`` targets that the loop calls with
the optimizer, plus ``max_steps`` when they take it. Each returns a ``LambdaLR`` whose factor
is a pure function of the step, so a resumed run continues with the same rates."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def warmup_cosine(
    optimizer: torch.optim.Optimizer, max_steps: int, warmup_steps: int = 20
) -> LambdaLR:
    """Linear warm-up over ``warmup_steps`` steps, then a cosine decay to 0 at ``max_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return LambdaLR(optimizer, factor)


def warmup_constant(optimizer: torch.optim.Optimizer, warmup_steps: int = 20) -> LambdaLR:
    """Linear warm-up over ``warmup_steps`` steps, then the optimizer's learning rate."""

    def factor(step: int) -> float:
        return (step + 1) / warmup_steps if step < warmup_steps else 1.0

    return LambdaLR(optimizer, factor)
