"""The fixed-order sum of a step's gradients (docs/design.md, principle 3).

A step is K micro-batches; their losses and gradients are summed by one fixed binary tree
over k (:func:`tree_reduce`, split at the midpoint), whoever computes them. With W processes
(``torchrun``), rank r computes the contiguous share ``[r*K/W, (r+1)*K/W)`` -- a whole
subtree of that tree -- and sums it locally; the ranks all-gather the W partial sums (an
all-gather copies bytes and adds nothing) and every rank finishes the same tree over them
(:class:`Reducer`). Every addition is the one a single process makes, in the same order, so
1, 2 or 4 processes give the same bits, and NCCL's choice of algorithm cannot enter the sum.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from repro.dist import World, gather_into, uses_nccl
from repro.errors import ConfigError

T = TypeVar("T")


def tree_reduce(lo: int, hi: int, leaf: Callable[[int], T], add: Callable[[T, T], T]) -> T:
    """Sum ``leaf(lo) + ... + leaf(hi - 1)`` as a fixed binary tree (split at the midpoint).

    Leaves are evaluated in order, left to right; at most ceil(log2 K) + 1 partial sums (one
    gradient copy each) are alive at once."""
    if hi - lo == 1:
        return leaf(lo)
    mid = lo + (hi - lo) // 2
    left = tree_reduce(lo, mid, leaf, add)
    return add(left, tree_reduce(mid, hi, leaf, add))


def is_subtree(lo: int, hi: int, k: int) -> bool:
    """Is ``[lo, hi)`` a node of the midpoint binary tree over ``[0, k)``?"""
    a, b = 0, k
    while (a, b) != (lo, hi):
        if b - a == 1 or not a <= lo < hi <= b:
            return False
        mid = a + (b - a) // 2
        if hi <= mid:
            b = mid
        elif lo >= mid:
            a = mid
        else:
            return False
    return True


def check_split(k: int, world: World) -> None:
    """The K micro-batches must split into W equal contiguous shares that are whole
    subtrees of the fixed tree (true whenever W is a power of two that divides K)."""
    if world.size == 1:
        return
    share = k // world.size
    if k % world.size or not all(
        is_subtree(r * share, (r + 1) * share, k) for r in range(world.size)
    ):
        raise ConfigError(
            f"config error: trainer.batch_size / trainer.micro_batch_size = {k} micro-batches "
            f"cannot be split among {world.size} processes as whole subtrees of the fixed "
            "summation tree; use a power-of-two number of processes that divides it, or "
            "change trainer.micro_batch_size."
        )


def share(k: int, world: World) -> tuple[int, int]:
    """``(first, count)``: the micro-batches of each step this rank computes."""
    count = k // world.size
    return world.rank * count, count


Partial = tuple[torch.Tensor, list[torch.Tensor]]


def add_partials(a: Partial, b: Partial) -> Partial:
    """``(loss, grads)`` + ``(loss, grads)``, into ``a``'s gradient tensors (elementwise
    IEEE additions: the same bits on any device of a kind, any kernel)."""
    torch._foreach_add_(a[1], b[1])
    return a[0] + b[0], a[1]


class Reducer:
    """Combine the ranks' partial sums ``(loss, grads)`` of a step and their micro-batches'
    extra tensors (BatchNorm statistics, in micro-batch order) -- the same on every rank.

    ``ordered``: all-gather, then the fixed tree over ranks (:data:`repro.config.Reduction`).
    ``all_reduce``: one all-reduce SUM of the partial sums (NCCL's order)."""

    def __init__(self, world: World, reduction: str) -> None:
        self.world, self.reduction = world, reduction

    def __call__(
        self, loss: torch.Tensor, grads: list[torch.Tensor], extras: list[list[torch.Tensor]]
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[list[torch.Tensor]]]:
        w = self.world.size
        extra_flat = [t for mb in extras for t in mb]
        if self.reduction == "all_reduce":
            summed = [loss.reshape(1), *grads]
            for flat, views in _buckets(summed):
                if flat.is_cuda and not uses_nccl(self.world):  # gloo: through the CPU
                    host = flat.cpu()
                    dist.all_reduce(host, op=dist.ReduceOp.SUM)
                    flat.copy_(host)
                else:
                    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
                _unflatten(flat, views)
            gathered = self._gather(extra_flat) if extra_flat else []
            return summed[0].reshape(()), summed[1:], _regroup(gathered, extras, w)
        parts = self._gather([loss.reshape(1), *grads, *extra_flat])
        n = 1 + len(grads)

        def part(r: int) -> Partial:
            return parts[r][0].reshape(()), list(parts[r][1:n])

        total_loss, total_grads = tree_reduce(0, w, part, add_partials)
        # Own allocations, as autograd's gradients are: views into the gathered buffer sit at
        # arbitrary offsets, and CUDA's multi-tensor kernels (the gradient norm's
        # _foreach_norm) take another summation path for unaligned tensors (seen on H200).
        # (empty_like keeps each local gradient's memory format: channels_last stays so)
        own = [torch.empty_like(g) for g in grads]
        torch._foreach_copy_(own, total_grads)  # one multi-tensor copy, not one per tensor
        total_grads = own
        return total_loss, total_grads, _regroup([p[n:] for p in parts], extras, w)

    def _gather(self, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Every rank's ``tensors`` (same shapes and dtypes on every rank), rank by rank."""
        w = self.world.size
        result: list[list[torch.Tensor | None]] = [[None] * len(tensors) for _ in range(w)]
        for flat, index in _flat_by_dtype(tensors):
            out = torch.empty((w, flat.numel()), dtype=flat.dtype, device=flat.device)
            if flat.is_cuda and not uses_nccl(self.world):
                host = torch.empty(out.shape, dtype=out.dtype)
                gather_into(host, flat.cpu())
                out.copy_(host)
            else:
                gather_into(out, flat)
            for r in range(w):
                offset = 0
                for i in index:
                    t = tensors[i]
                    result[r][i] = out[r, offset : offset + t.numel()].view(t.shape)
                    offset += t.numel()
        return result  # type: ignore[return-value]


def _flat_by_dtype(tensors: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, list[int]]]:
    """One flat copy per dtype (a collective moves one buffer, not one per tensor)."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return [(torch.cat([tensors[i].reshape(-1) for i in idx]), idx) for idx in groups.values()]


def _buckets(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    return [(flat, [tensors[i] for i in idx]) for flat, idx in _flat_by_dtype(tensors)]


def _unflatten(flat: torch.Tensor, views: list[torch.Tensor]) -> None:
    offset = 0
    for t in views:
        t.copy_(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()


def _regroup(
    per_rank: list[list[torch.Tensor]], local: list[list[torch.Tensor]], w: int
) -> list[list[torch.Tensor]]:
    """Rank-major flat lists of per-micro-batch tensors -> one list per micro-batch, in
    micro-batch order (rank r holds micro-batches r*count ... (r+1)*count - 1)."""
    width = len(local[0]) if local else 0
    if width == 0:  # nothing recorded (no BatchNorm): one empty list per micro-batch
        return [[] for _ in range(w * len(local))]
    return [
        list(per_rank[r][j * width : (j + 1) * width]) for r in range(w) for j in range(len(local))
    ]
