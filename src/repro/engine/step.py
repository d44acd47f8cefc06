"""One optimizer step (docs/design.md, principle 3): K micro-batches of fixed size whose
gradients are summed by a fixed binary tree over k (:func:`repro.engine.reduction.tree_reduce`),
whoever computes them."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from repro.base.progress import span
from repro.base.rng import seed_forward
from repro.engine.build import Training
from repro.engine.reduction import Reducer, add_partials, tree_reduce


class NotFinite(Exception):
    """Step ``step`` (0-based)'s loss or gradient norm is inf or NaN; nothing of the step was
    applied."""

    def __init__(self, loss: torch.Tensor, grad_norm: torch.Tensor, step: int = -1) -> None:
        super().__init__(f"loss {float(loss)}, gradient norm {float(grad_norm)}")
        self.loss, self.grad_norm, self.step = loss, grad_norm, step


def train_step(
    training: Training,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    step: int,
    *,
    first: int = 0,
    reducer: Reducer | None = None,
    stop_if_not_finite: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over K micro-batches, then one schedule step. Returns (loss, grad
    norm) as device tensors (no host synchronisation).

    With ``stop_if_not_finite`` a loss or gradient norm that is inf or NaN raises
    :class:`NotFinite` before the optimizer step, so that the weights, BatchNorm statistics,
    optimizer and schedule are still those of the last finite step. That costs one host
    synchronisation per step: the loop runs its steps without it and reads them in blocks
    (:class:`repro.engine.nonfinite.FiniteGuard`, which uses it when it trains steps again).
    Under fp16 an infinite gradient is the loss scaler's business (it skips the step and
    lowers the scale), so only the loss is checked then.

    Each micro-batch's loss is the task's summed loss / B, so the tree sum of the K gradients
    is the gradient of the mean loss over the global batch. Under torchrun this process holds
    micro-batches ``first, first + 1, ...`` and ``reducer`` sums them (the canonical nodes
    of the tree in that range) and combines the ranks' partial sums; BatchNorm statistics
    are folded in afterwards, in micro-batch order
    (:class:`repro.engine.running_stats.RunningStats`)."""
    model, scaler, stats = training.model, training.precision.scaler, training.running_stats
    params = [p for p in training.parameters if p.requires_grad]
    device = params[0].device
    recorded: list[list[torch.Tensor]] = []

    def forward(k: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Micro-batch k's loss, the loss to differentiate (scaled under fp16), and its
        BatchNorm statistics."""
        inputs, targets = micro_batches[k - first]
        seed_forward(device, training.seed, step, k)  # dropout masks keyed by (seed, step, k)
        with span("repro.forward"):
            with training.precision.autocast(), stats.capture() if stats else nullcontext([]) as bn:
                outputs = model(inputs)
            loss = training.task.loss(outputs, targets) / training.batch_size
        return loss.detach(), scaler.scale(loss), bn

    def backward(scaled: torch.Tensor) -> list[torch.Tensor]:
        with span("repro.backward"):
            return list(torch.autograd.grad(scaled, params, materialize_grads=True))

    def leaf(k: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        loss, scaled, bn = forward(k)
        recorded.append(bn)
        return loss, backward(scaled)

    if reducer is None:
        loss, grads = tree_reduce(first, first + len(micro_batches), leaf, add_partials)
    else:  # this rank's share, its exchange overlapping the last micro-batch's backward
        loss, grads, recorded = reducer.reduce_share(
            first, len(micro_batches), forward, backward, params
        )
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    scaler.unscale_(training.optimizer)  # a no-op unless fp16
    grad_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    if stop_if_not_finite:
        finite = torch.isfinite(loss)
        if not scaler.is_enabled():
            finite &= torch.isfinite(grad_norm)
        with span("repro.wait_finite"):  # the host synchronisation
            finite = bool(finite)
        if not finite:
            training.optimizer.zero_grad(set_to_none=True)
            raise NotFinite(loss, grad_norm, step)
    if training.clip_grad_norm is not None:  # torch.nn.utils.clip_grad_norm_'s formula
        coef = torch.clamp(training.clip_grad_norm / (grad_norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef)  # the global norm of the reduced gradients: any W
    if stats:  # after the check: a step that is not applied leaves the statistics alone
        with span("repro.running_stats"):
            stats.update(recorded)
    scaler.step(training.optimizer)
    scaler.update()
    training.optimizer.zero_grad(set_to_none=True)
    training.schedule.step()
    if training.ema is not None:
        training.ema.update(step + 1)
    return loss, grad_norm
