"""``trainer.ema``: an exponential moving average of the weights, used for evaluation.

After every optimizer step ``s`` (1-based), each parameter's average becomes
``decay * average + (1 - decay) * parameter`` (one multi-tensor multiply and one add: the
same elementwise operations on every rank, whose parameters are the same bits, so the
average does not depend on the world size either); up to step ``start`` it is a copy of the
parameters. Evaluations (and ``best.pt``'s choice) see the averaged weights; training never
does. Buffers (BatchNorm's running statistics) are the model's own. The average is saved in
every checkpoint and restored on resume, so a resumed run evaluates the same averages.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from repro.base.errors import CheckpointError


class WeightAverage:
    def __init__(self, model: nn.Module, decay: float, start: int = 0) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.decay, self.start = float(decay), int(start)
        self.average = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self, done: int) -> None:
        """After optimizer step ``done`` (1-based)."""
        if done <= self.start:
            torch._foreach_copy_(self.average, self.params)
            return
        torch._foreach_mul_(self.average, self.decay)
        torch._foreach_add_(self.average, self.params, alpha=1.0 - self.decay)

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Inside: the model's parameters hold the averages (copied in place, so a compiled
        model sees the same tensors); afterwards, their own values again, bit for bit."""
        with torch.no_grad():
            kept = [p.detach().clone() for p in self.params]
            torch._foreach_copy_(self.params, self.average)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self.params, kept)

    def state_dict(self) -> dict[str, object]:
        return {
            "decay": self.decay,
            "start": self.start,
            "average": dict(zip(self.names, self.average, strict=True)),
        }

    def load_state_dict(self, state: object, where: object) -> None:
        """Restore the averages; one line naming ``where`` when they are not this model's."""
        average = state.get("average") if isinstance(state, dict) else None
        if not isinstance(average, dict) or sorted(average) != sorted(self.names):
            raise CheckpointError(
                f"{where}: its weight average (trainer.ema) is missing or for another model; "
                "resume from a checkpoint of a run with the same trainer.ema."
            )
        with torch.no_grad():
            for name, mine in zip(self.names, self.average, strict=True):
                theirs = average[name]
                if not isinstance(theirs, torch.Tensor) or theirs.shape != mine.shape:
                    raise CheckpointError(
                        f"{where}: its weight average of {name!r} does not fit this model; "
                        "resume from a checkpoint of a run with the same model."
                    )
                mine.copy_(theirs)

    def digest(self) -> str:
        """SHA-256 of the averages, as ``weights_sha256`` is of the state dict."""
        from repro.records.trace import state_dict_sha256

        return state_dict_sha256(dict(zip(self.names, self.average, strict=True)))
