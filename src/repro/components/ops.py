"""Deterministic replacements for ops whose deterministic CUDA kernels are missing or slow.

Under ``use_deterministic_algorithms(True)`` (``determinism=strict``) PyTorch either raises
for an op with no deterministic kernel or switches to a slower one. Two of them stand
between a segmentation model and strict mode at fast mode's speed (measured on an H200,
torch 2.11; ``docs/segmentation.md``):

- **bilinear upsampling**: its backward scatters every output gradient into the input with
  atomic adds. Under strict mode ``F.interpolate`` switches on CUDA to a decomposition into
  indexing ops whose backward is a sorted ``index_put`` (``indexing_backward_kernel``): most
  of a small UNet's strict step. :class:`Upsample2x` computes 2× bilinear upsampling in
  *gather* form both ways, separably: each output reads its two neighbours along an axis
  (forward), each input reads the (at most four) output gradients that touch it (backward).
  Seven and nine kernels, no atomics, no sort, the same in strict and fast mode.
- **per-pixel cross-entropy**: ``F.cross_entropy`` on (N, C, H, W) with its default
  (mean) or sum reduction dispatches to ``nll_loss2d``'s reducing kernel, which raises in
  strict mode on CUDA (and not on a CPU, so CI never sees it). :func:`dense_cross_entropy` is
  the per-pixel loss from ``log_softmax`` and a one-hot mask: elementwise ops and a reduction
  over C, all deterministic, and a crop's padded border costs nothing whatever
  ``ignore_index`` is (``F.cross_entropy`` fails on a target outside the classes).

Both are checked against PyTorch's ops (values, to a tolerance) and for repeatability (bits)
in ``tests/test_ops.py``, on the CPU and, marked ``cuda``, on the GPU. ``repro doctor
--cost`` names the module a replacement is for (:data:`REPLACEMENTS`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# What `repro doctor` suggests for a module type (or the loss) that raises in strict mode or
# is slow there (:func:`replacement_for`). Keys: the module's class name; LOSS_KEY: the loss.
LOSS_KEY = "loss"
REPLACEMENTS = {
    "Upsample": "repro.components.ops.Upsample2x (bilinear, scale 2, gather form both ways)",
    "AdaptiveAvgPool2d": "x.mean(dim=(2, 3), keepdim=True) (for output size 1)",
    "AdaptiveMaxPool2d": "x.amax(dim=(2, 3), keepdim=True) (for output size 1)",
    LOSS_KEY: "repro.components.ops.dense_cross_entropy (task=segmentation uses it: task.cross_entropy=repro)",
}


def replacement_for(module: nn.Module) -> str | None:
    """The replacement :data:`REPLACEMENTS` has for ``module``, if it fits its settings."""
    kind = type(module).__name__
    if kind in ("Upsample", "UpsamplingBilinear2d"):
        fits = (
            getattr(module, "mode", None) == "bilinear"
            and getattr(module, "size", None) is None
            and module.scale_factor in (2, 2.0, (2, 2), (2.0, 2.0))
            and not getattr(module, "align_corners", False)
        )
        return REPLACEMENTS["Upsample"] if fits else None
    if kind in ("AdaptiveAvgPool2d", "AdaptiveMaxPool2d"):
        size = getattr(module, "output_size", None)
        return REPLACEMENTS[kind] if size in (1, (1, 1)) else None
    return REPLACEMENTS.get(kind)


def _pad_one(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` with its first and last entries along ``dim`` repeated once: one ``cat``, not
    ``F.pad(mode="replicate")``, which under strict mode on CUDA turns into slower indexing."""
    n = x.shape[dim]
    return torch.cat([x.narrow(dim, 0, 1), x, x.narrow(dim, n - 1, 1)], dim)


def _upsample_axis(x: torch.Tensor, dim: int) -> torch.Tensor:
    """2× linear upsampling along ``dim`` (-1 or -2), ``align_corners=False``:
    ``y[2i] = 0.75 x[i] + 0.25 x[i-1]`` and ``y[2i+1] = 0.75 x[i] + 0.25 x[i+1]``, an edge's
    missing neighbour being the edge itself (so ``y[0] = x[0]``). Each output reads its two
    inputs (a gather): three kernels, a padding and two ``lerp`` into the interleaved output."""
    n = x.shape[dim]
    padded = _pad_one(x, dim)
    centre = padded.narrow(dim, 1, n)
    shape = list(x.shape)
    shape[dim:] = [n, 2] if dim == -1 else [n, 2, shape[-1]]
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    torch.lerp(centre, padded.narrow(dim, 0, n), 0.25, out=out.select(dim, 0))
    torch.lerp(centre, padded.narrow(dim, 2, n), 0.25, out=out.select(dim, 1))
    return out.flatten(dim - 1, dim)


def _adjoint_axis(grad: torch.Tensor, dim: int) -> torch.Tensor:
    """The transpose of :func:`_upsample_axis`, also in gather form: input i collects
    ``0.75 (g[2i] + g[2i+1]) + 0.25 (g[2i-1] + g[2i+2])``, where at an edge the missing
    gradient is the edge output's own (its weight on the edge input is 1, not 0.75): a
    replicating pad gives exactly that. Four kernels, no atomics, no sort."""
    n = grad.shape[dim] // 2
    pairs = _pad_one(grad, dim).unflatten(dim, (n + 1, 2))  # pair k: (g[2k-1], g[2k])
    lead, tail = pairs.narrow(dim - 1, 0, n), pairs.narrow(dim - 1, 1, n)
    near = lead.select(dim, 1) + tail.select(dim, 0)  # g[2i] + g[2i+1]
    far = lead.select(dim, 0) + tail.select(dim, 1)  # g[2i-1] + g[2i+2]
    return torch.lerp(near, far, 0.25)  # 0.75 near + 0.25 far


class _Upsample2xBilinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.input_dtype = x.dtype
        y = x.to(torch.promote_types(x.dtype, torch.float32))
        y = _upsample_axis(_upsample_axis(y, -1), -2)
        return y if torch.is_autocast_enabled(x.device.type) else y.to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        g = grad.to(torch.promote_types(grad.dtype, torch.float32))
        return _adjoint_axis(_adjoint_axis(g, -2), -1).to(ctx.input_dtype)


def upsample2x(x: torch.Tensor) -> torch.Tensor:
    """``F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)`` for an
    N×C×H×W tensor, forward and backward in gather form (module docstring): deterministic in
    strict and fast mode alike, with no atomics and no sort.

    Computed in float32 (float64 for float64); the result has ``x``'s dtype, or float32
    under autocast, as autocast runs upsampling. Not bit-equal to ``F.interpolate``: the same
    weights, rounded in another order (within 2 ulp of it; on CUDA, ``F.interpolate`` itself
    gives other bits under strict mode than under fast mode: ``docs/segmentation.md``)."""
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
