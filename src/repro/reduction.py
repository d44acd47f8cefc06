"""The fixed-order sum of a step's gradients (docs/design.md, principle 3).

A step is K micro-batches; their losses and gradients are summed by one fixed binary tree
over k (:func:`tree_reduce`, split at the midpoint), whoever computes them. With W processes
(``torchrun``, any W that divides K), rank r computes the contiguous share
``[r*K/W, (r+1)*K/W)`` and sums each of its *canonical nodes* -- the largest nodes of that
tree inside its share (:func:`canonical_nodes`: the share itself when W is a power of two) --
locally. The ranks then exchange those partial sums (collectives that copy bytes and add
nothing) and finish the same tree over them (:func:`finish_tree`, :class:`Reducer`). Every
addition is the one a single process makes, in the same order, so 1, 2, 3, 4... processes
give the same bits, and NCCL's choice of algorithm cannot enter the sum.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from repro.dist import World, gather_into, moves_cuda_tensors
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


def canonical_nodes(lo: int, hi: int, k: int) -> list[tuple[int, int]]:
    """The largest nodes of the midpoint tree over ``[0, k)`` that lie inside ``[lo, hi)``,
    left to right: they cover it exactly, and their sums are partial sums the tree makes.
    ``[lo, hi)`` itself when it is a node (a power-of-two W's share)."""
    nodes: list[tuple[int, int]] = []

    def visit(a: int, b: int) -> None:
        if lo <= a and b <= hi:
            nodes.append((a, b))
        elif a < hi and lo < b:  # overlaps: a node of 2+ leaves, partly inside
            mid = a + (b - a) // 2
            visit(a, mid)
            visit(mid, b)

    visit(0, k)
    return nodes


def finish_tree(k: int, known: dict[tuple[int, int], T], add: Callable[[T, T], T]) -> T:
    """The midpoint tree over ``[0, k)`` whose nodes in ``known`` are given (partial sums
    made elsewhere): the additions above them, in the tree's order."""

    def node(a: int, b: int) -> T:
        if (a, b) in known:
            return known[(a, b)]
        mid = a + (b - a) // 2
        return add(node(a, mid), node(mid, b))

    return node(0, k)


def check_split(k: int, world: World) -> None:
    """The K micro-batches must split into W equal contiguous shares: W divides K."""
    if k % world.size:
        raise ConfigError(
            f"config error: trainer.batch_size / trainer.micro_batch_size = {k} micro-batches "
            f"cannot be split among {world.size} processes; use a number of processes that "
            f"divides {k}, or change trainer.batch_size or trainer.micro_batch_size."
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
    """Combine the ranks' partial sums ``(loss, grads)`` of a step -- one per canonical node
    of the rank's share, left to right -- and their micro-batches' extra tensors (BatchNorm
    statistics, in micro-batch order): the same result on every rank.

    ``ordered`` (:data:`repro.config.Reduction`): a reduce-scatter in the tree's order. The
    flat ``(loss, grads)`` vector is cut into W shards; an all-to-all gives each rank every
    node's partial sum of its shard, it finishes the tree over them (:func:`finish_tree`),
    and an all-gather brings the shards back: about 2x the gradient's bytes through each
    rank, where gathering every rank's partials whole moves W x. ``ordered_allgather``: that
    older path (the same bits), for comparison. ``all_reduce``: one all-reduce SUM, as
    plain DDP does (NCCL's order: repeatable, but the bits depend on W)."""

    def __init__(self, world: World, reduction: str) -> None:
        self.world, self.reduction = world, reduction
        self._nodes: dict[int, list[list[tuple[int, int]]]] = {}
        self._grads: list[torch.Tensor] = []  # the reduced gradients' buffers, kept

    def __call__(
        self, partials: list[Partial], extras: list[list[torch.Tensor]]
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[list[torch.Tensor]]]:
        """``(loss, gradients, extras)`` of the whole step, the same on every rank. The
        ordered paths' gradients are buffers this reducer keeps: the next call overwrites
        them (the step consumes them before)."""
        w, count = self.world.size, len(extras)  # extras: one list per micro-batch
        k = count * w
        if count not in self._nodes:
            shares = [(r * count, (r + 1) * count) for r in range(w)]
            self._nodes[count] = [canonical_nodes(a, b, k) for a, b in shares]
        nodes = self._nodes[count]
        extra_flat = [t for mb in extras for t in mb]
        gathered = self._gather(extra_flat) if extra_flat else []
        regrouped = _regroup(gathered, extras, w)
        if self.reduction == "all_reduce":
            loss, grads = partials[0]
            for other in partials[1:]:  # the rank's own nodes, then NCCL's order
                loss, grads = add_partials((loss, grads), other)
            summed = [loss.reshape(1), *grads]
            for flat, index in _flat_by_dtype(summed):
                if flat.is_cuda and not moves_cuda_tensors(self.world):  # gloo: through the CPU
                    host = flat.cpu()
                    dist.all_reduce(host, op=dist.ReduceOp.SUM)
                    flat.copy_(host)
                else:
                    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
                group = [summed[i] for i in index]
                torch._foreach_copy_(group, _unflatten_dense_tensors(flat, group))
            return summed[0].reshape(()), summed[1:], regrouped
        if self.reduction == "ordered_allgather":
            total = self._gather_then_finish(partials, nodes, k)
        else:
            total = self._scatter_then_finish(partials, nodes, k)
        # Own allocations, as autograd's gradients are: views into a received buffer sit at
        # arbitrary offsets, and CUDA's multi-tensor kernels (the gradient norm's
        # _foreach_norm) take another summation path for unaligned tensors (seen on H200).
        # Allocated once (empty_like keeps each local gradient's layout, so channels_last
        # stays so; again if a layout changes) and filled every step by one multi-tensor
        # copy: each step's gradients are consumed (optimizer step, clipping) before the
        # next one's reduction writes them.
        grads = partials[0][1]
        if not _same_layouts(self._grads, grads):
            self._grads = [torch.empty_like(g) for g in grads]
        torch._foreach_copy_(self._grads, total[1:])
        # the loss in its own storage: a view would keep the received buffer (a whole
        # gradient's size) alive as long as the logs hold the step's loss
        return total[0].reshape(()).clone(), list(self._grads), regrouped

    def _gather_then_finish(
        self, partials: list[Partial], nodes: list[list[tuple[int, int]]], k: int
    ) -> list[torch.Tensor]:
        """``ordered_allgather``: every rank's node partials, whole, to every rank (ranks
        with fewer nodes send zeros in their place), and the tree finished over them."""
        n, m = 1 + len(partials[0][1]), max(len(ns) for ns in nodes)
        padding = [
            (torch.zeros_like(partials[0][0]), [torch.zeros_like(g) for g in partials[0][1]])
        ]
        mine = [
            t
            for loss, grads in [*partials, *padding * (m - len(partials))]
            for t in (loss.reshape(1), *grads)
        ]
        parts = self._gather(mine)
        known = {
            node: (parts[r][j * n].reshape(()), list(parts[r][j * n + 1 : (j + 1) * n]))
            for r, rank_nodes in enumerate(nodes)
            for j, node in enumerate(rank_nodes)
        }
        loss, grads = finish_tree(k, known, add_partials)
        return [loss.reshape(1), *grads]

    def _scatter_then_finish(
        self, partials: list[Partial], nodes: list[list[tuple[int, int]]], k: int
    ) -> list[torch.Tensor]:
        """``ordered``: per dtype, the node partials as flat vectors cut into W shards; an
        all-to-all hands rank d every node's shard d; rank d finishes the tree on its shard
        (elementwise: the additions of one process, in its order); an all-gather of the
        finished shards gives every rank the whole."""
        w, m = self.world.size, max(len(ns) for ns in nodes)
        first = [partials[0][0].reshape(1), *partials[0][1]]
        result: list[torch.Tensor | None] = [None] * len(first)
        for index in _dtype_groups(first):
            group = [first[i] for i in index]
            size = sum(t.numel() for t in group)
            shard = -(-size // w)  # ceil: the last shard is padded with zeros
            send = group[0].new_zeros((m, w * shard))
            for j, (loss, grads) in enumerate(partials):
                whole = [loss.reshape(1), *grads]
                send[j, :size] = _flatten_dense_tensors([whole[i] for i in index])
            send = send.view(m, w, shard).transpose(0, 1).contiguous()  # [d, j]: node j, shard d
            received = torch.empty_like(send)  # [r, j]: rank r's node j, this rank's shard
            self._all_to_all(received, send)
            known = {
                node: received[r, j]
                for r, rank_nodes in enumerate(nodes)
                for j, node in enumerate(rank_nodes)
            }
            mine = finish_tree(k, known, lambda a, b: a.add_(b))  # a + b, into a's buffer
            gathered = torch.empty((w, shard), dtype=mine.dtype, device=mine.device)
            self._all_gather(gathered, mine.contiguous())
            views = _unflatten_dense_tensors(gathered.view(-1)[:size], group)
            for i, view in zip(index, views, strict=True):
                result[i] = view
        return result  # type: ignore[return-value]

    def _all_to_all(self, out: torch.Tensor, tensor: torch.Tensor) -> None:
        if tensor.is_cuda and not moves_cuda_tensors(self.world):  # gloo: through the CPU
            host = torch.empty(out.shape, dtype=out.dtype)
            dist.all_to_all_single(host, tensor.cpu())
            out.copy_(host)
        else:
            dist.all_to_all_single(out, tensor)

    def _all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> None:
        if tensor.is_cuda and not moves_cuda_tensors(self.world):
            host = torch.empty(out.shape, dtype=out.dtype)
            gather_into(host, tensor.cpu())
            out.copy_(host)
        else:
            gather_into(out, tensor)

    def _gather(self, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Every rank's ``tensors`` (same shapes and dtypes on every rank), rank by rank."""
        w = self.world.size
        result: list[list[torch.Tensor | None]] = [[None] * len(tensors) for _ in range(w)]
        for flat, index in _flat_by_dtype(tensors):
            out = torch.empty((w, flat.numel()), dtype=flat.dtype, device=flat.device)
            self._all_gather(out, flat)
            group = [tensors[i] for i in index]
            for r in range(w):
                for i, view in zip(index, _unflatten_dense_tensors(out[r], group), strict=True):
                    result[r][i] = view
        return result  # type: ignore[return-value]


def _dtype_groups(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """The indices of ``tensors``, grouped by dtype (in order of first appearance)."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return list(groups.values())


def _flat_by_dtype(tensors: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, list[int]]]:
    """One flat copy per dtype (a collective moves one buffer, not one per tensor), with
    the indices of the tensors in it; :func:`_unflatten_dense_tensors` gives them back as
    views (both loops in C++: the step is bound by host time on GPUs)."""
    groups = _dtype_groups(tensors)
    return [(_flatten_dense_tensors([tensors[i] for i in idx]), idx) for idx in groups]


def _same_layouts(kept: list[torch.Tensor], tensors: list[torch.Tensor]) -> bool:
    """Can ``kept`` receive ``tensors`` as they are: same shapes, strides, dtypes, device?"""
    if len(kept) != len(tensors) or (kept and kept[0].device != tensors[0].device):
        return False
    return all(
        a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
        for a, b in zip(kept, tensors, strict=True)
    )


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
