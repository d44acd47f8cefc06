"""Deterministic replacements for ops whose deterministic CUDA kernels are missing or slow.

Under ``use_deterministic_algorithms(True)`` (``determinism=strict``) PyTorch either raises
for an op with no deterministic kernel or switches to a slower one. Two of them stand
between a segmentation model and strict mode at fast mode's speed (measured on an H200,
torch 2.11; ``docs/segmentation.md``):

- **bilinear upsampling**: its backward scatters every output gradient into the input with
  atomic adds; the deterministic kernel sorts the scatter (``indexing_backward_kernel``), most
  of a small UNet's strict step. :class:`Upsample2x` keeps PyTorch's forward (the very same
  call, so the same bits) and computes the backward in *gather* form: each input pixel reads
  the (at most four) output gradients that touch it along each axis. No atomics, no sort.
- **per-pixel cross-entropy**: ``F.cross_entropy`` on (N, C, H, W) dispatches to
  ``nll_loss2d``, which raises in strict mode on CUDA (and not on a CPU, so CI never sees
  it). :func:`dense_cross_entropy` is the same loss from ``log_softmax`` and a one-hot mask:
  elementwise ops and a reduction over C, all deterministic.

Both are checked against PyTorch's ops (values, to a tolerance) and for repeatability (bits)
in ``tests/test_ops.py``, on the CPU and, marked ``cuda``, on the GPU. ``repro doctor
--cost`` names the module a replacement is for (:data:`REPLACEMENTS`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# What `repro doctor` suggests for a module type (or the loss) that raises in strict mode or
# is slow there. Keys: the module's class name; LOSS_KEY: the task's loss.
LOSS_KEY = "loss"
REPLACEMENTS = {
    "Upsample": "repro.ops.Upsample2x (bilinear, scale 2: same forward, gather-form backward)",
    "UpsamplingBilinear2d": "repro.ops.Upsample2x (note: align_corners=False)",
    "AdaptiveAvgPool2d": "x.mean(dim=(2, 3), keepdim=True) (for output size 1)",
    "AdaptiveMaxPool2d": "x.amax(dim=(2, 3), keepdim=True) (for output size 1)",
    LOSS_KEY: "repro.ops.dense_cross_entropy (task=segmentation uses it: task.cross_entropy=repro)",
}


def _adjoint_2x(grad: torch.Tensor, dim: int) -> torch.Tensor:
    """The transpose of 2× linear upsampling (``align_corners=False``) along ``dim``.

    Forward, per axis, for input x of length n and output y of length 2n:
    ``y[2i] = 0.75 x[i] + 0.25 x[i-1]``, ``y[2i+1] = 0.75 x[i] + 0.25 x[i+1]``, with
    ``y[0] = x[0]`` and ``y[2n-1] = x[n-1]`` at the edges. So input i gathers
    ``0.75 (y[2i] + y[2i+1]) + 0.25 (y[2i-1] + y[2i+2])``; at an edge the missing neighbour is
    the edge's own other output (the edge output's weight is 1, not 0.75)."""
    assert dim < 0  # counted from the end: the pair axis is then `dim` itself after unflatten
    pairs = grad.unflatten(dim, (grad.shape[dim] // 2, 2))
    even, odd = pairs.select(dim, 0), pairs.select(dim, 1)
    n = even.shape[dim]
    before = torch.cat([even.narrow(dim, 0, 1), odd.narrow(dim, 0, n - 1)], dim)
    after = torch.cat([even.narrow(dim, 1, n - 1), odd.narrow(dim, n - 1, 1)], dim)
    return 0.75 * (even + odd) + 0.25 * (before + after)


class _Upsample2xBilinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.input_dtype = x.dtype
        return F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        g = grad.to(torch.promote_types(grad.dtype, torch.float32))
        g = _adjoint_2x(_adjoint_2x(g, -2), -1)
        return g.to(ctx.input_dtype)


def upsample2x(x: torch.Tensor) -> torch.Tensor:
    """``F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)`` for an
    N×C×H×W tensor, with a deterministic gather-form backward (module docstring).

    The forward *is* that call, so its output is bit-equal to it (under autocast too: it is
    computed in float32, as autocast does for upsampling). The backward computes in float32
    (float64 for float64) and differs from PyTorch's in the last bits (its atomic adds run in no fixed order)."""
    if x.dim() != 4:
        raise ValueError(f"upsample2x takes an N×C×H×W tensor, got {x.dim()} dimensions")
    return _Upsample2xBilinear.apply(x)


class Upsample2x(nn.Module):
    """:func:`upsample2x` as a module: the drop-in for ``nn.Upsample(scale_factor=2,
    mode="bilinear")`` in strict mode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return upsample2x(x)


def dense_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Per-pixel cross-entropy: ``F.cross_entropy(logits, target, weight,
    ignore_index=ignore_index, reduction="none")`` for N×C×H×W logits and N×H×W class
    indices, computed as ``-sum_c log_softmax(logits)_c * [target == c]`` (float32): no
    ``nll_loss2d``, so it runs in strict mode on CUDA, deterministically.

    Returns N×H×W. A pixel whose target is ``ignore_index`` or outside ``[0, C)`` (the
    padding of a crop) has loss 0; with ``weight``, pixel losses are scaled by their class's
    weight, as PyTorch's are (the normalisation is the caller's)."""
    c = logits.shape[1]
    logp = F.log_softmax(logits.float(), dim=1)
    classes = torch.arange(c, device=logits.device).view(1, c, *([1] * (logits.dim() - 2)))
    target = target.long()
    hit = target.unsqueeze(1) == classes  # one-hot; all False where the target is not a class
    if 0 <= ignore_index < c:
        hit = hit & (target != ignore_index).unsqueeze(1)
    if weight is not None:
        loss = -(logp * (hit * weight.to(logp).view_as(classes))).sum(1)
    else:
        loss = -(logp * hit).sum(1)
    return loss
