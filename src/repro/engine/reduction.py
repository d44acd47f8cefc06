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

import functools
import weakref
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from repro.base.errors import ConfigError, ReproError
from repro.base.progress import span
from repro.base.world import World, gather_into, moves_cuda_tensors, wait

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


def check_split(k: int, world: World, batch_size: int | None = None) -> None:
    """The K micro-batches must split into W equal contiguous shares: W divides K."""
    if k % world.size:
        w = world.size
        fix = "trainer.batch_size and trainer.micro_batch_size"
        if batch_size is not None and batch_size % w == 0:
            fix = f"trainer.micro_batch_size={batch_size // w} ({w} micro-batches a step)"
        many = f"{k} micro-batch{'es' if k > 1 else ''} a step"
        fewer = f"use a number of processes that divides {k}, or " if k > 1 else ""
        raise ConfigError(
            f"config error: trainer.batch_size / trainer.micro_batch_size = {many} cannot be "
            f"split among {w} processes; {fewer}set {fix}, which changes the bits: give it "
            "to the one-process run you compare with too (docs/distributed.md)."
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


Forward = Callable[[int], tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]]
Backward = Callable[[torch.Tensor], list[torch.Tensor]]

FIRST_BUCKET_BYTES = 1 << 20  # as DDP: a small first bucket, so the exchange starts early


def left_siblings(lo: int, hi: int, leaf: Callable[[int], Partial]) -> list[Partial]:
    """The tree sums of the left children on the path from the node ``[lo, hi)`` down to
    its last leaf ``hi - 1``, top first: the node's sum is ``lefts[0] + (lefts[1] + (... +
    leaf(hi - 1)))``, the additions :func:`tree_reduce` makes, in its order. Leaves are
    evaluated in order; the last is left to the caller."""
    lefts = []
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        lefts.append(tree_reduce(lo, mid, leaf, add_partials))
        lo = mid
    return lefts


@dataclass(eq=False)
class _Bucket:
    """Entries of the flat ``[loss, *grads]`` list exchanged together (one dtype), with the
    buffers the exchange reuses every step (``send`` is a fresh flatten each step when every
    rank holds one node)."""

    indices: list[int]
    size: int  # elements
    shard: int  # elements of each rank's shard (the last padded with zeros)
    send: torch.Tensor | None = None  # [d, j]: shard d of this rank's node j
    stage: torch.Tensor | None = None  # [j, :]: node j whole (W not a power of two)
    pad: torch.Tensor | None = None  # zeros after the entries, to W equal shards
    received: torch.Tensor | None = None  # [r, j]: this rank's shard of rank r's node j
    gathered: torch.Tensor | None = None  # [d]: shard d, finished
    work: Any = None  # the collective in flight


@dataclass(eq=False)
class _Exchange:
    """One step's reduce-scatter: the rank's finished nodes, the left siblings still to add
    to the last micro-batch's gradients, and which buckets have gone."""

    done: list[Partial]
    lefts: list[Partial]
    nodes: list[list[tuple[int, int]]]
    m: int  # the most nodes any rank holds
    k: int
    buckets: list[_Bucket]
    bucket_of: list[int]
    leaf: list[torch.Tensor | None]  # the last micro-batch's [loss node sum, *gradients]
    missing: list[int]  # per bucket: gradients not yet arrived
    launched: int = 0  # buckets launched, in order (every rank launches in the same order)


class Reducer:
    """Sum a rank's share of a step -- its canonical nodes, each by :func:`tree_reduce` --
    and combine the ranks' partial sums ``(loss, grads)`` and their micro-batches' extra
    tensors (BatchNorm statistics, in micro-batch order): the same result on every rank.

    ``ordered`` (:data:`repro.defense.config.Reduction`): a reduce-scatter in the tree's order, in
    buckets (``bucket_mb``; the parameters in reverse, roughly the order the backward pass
    finishes their gradients). For each bucket the flat ``(loss, grads)`` entries are cut
    into W shards; an all-to-all gives each rank every node's partial sum of its shard, it
    finishes the tree over them (:func:`finish_tree`), and an all-gather brings the shards
    back: about 2x the gradient's bytes through each rank, where gathering every rank's
    partials whole moves W x. With ``overlap`` a bucket goes as soon as the last
    micro-batch's backward pass has produced its gradients (a hook on each parameter adds
    them to the left siblings' sums there, on a side stream on GPUs), so the exchange runs
    during the rest of the backward pass; the additions, and so the bits, are the same.
    ``ordered_allgather``: the older path (the same bits, after the backward pass), for
    comparison. ``all_reduce``: one all-reduce SUM, as plain DDP does (NCCL's order:
    repeatable, but the bits depend on W)."""

    def __init__(
        self, world: World, reduction: str, *, overlap: bool = True, bucket_mb: float = 25.0
    ) -> None:
        self.world, self.reduction, self.overlap = world, reduction, overlap
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self._nodes: dict[int, list[list[tuple[int, int]]]] = {}
        self._grads: list[torch.Tensor] = []  # the reduced gradients' buffers, kept
        self._plan: tuple[Any, list[_Bucket], list[int]] | None = None  # (key, buckets, bucket_of)
        self._hooked: list[torch.Tensor] = []  # the parameters whose gradient hooks are ours
        self._handles: list[Any] = []  # and the hooks, to remove them if the parameters change
        self._exchange: _Exchange | None = None  # set during the last micro-batch's backward
        self._side: torch.cuda.Stream | None = None

    def reduce_share(
        self,
        first: int,
        count: int,
        forward: Forward,
        backward: Backward,
        params: list[torch.Tensor],
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[list[torch.Tensor]]]:
        """This rank's micro-batches ``first ... first + count - 1`` of the step, summed and
        combined with the other ranks': ``(loss, gradients, extras)`` of the whole step, the
        same on every rank. ``forward(k)`` gives micro-batch k's ``(loss, scaled loss,
        extras)``, ``backward(scaled loss)`` the gradients of ``params``.

        The ordered paths' gradients are buffers this reducer keeps: the next call
        overwrites them (the step consumes them before)."""
        w = self.world.size
        k = count * w
        if count not in self._nodes:
            shares = [(r * count, (r + 1) * count) for r in range(w)]
            self._nodes[count] = [canonical_nodes(a, b, k) for a, b in shares]
        nodes = self._nodes[count]
        *whole, (lo, hi) = nodes[self.world.rank]
        extras: list[list[torch.Tensor]] = []

        def leaf(i: int) -> Partial:
            loss, scaled, recorded = forward(i)
            extras.append(recorded)
            return loss, backward(scaled)

        done = [tree_reduce(a, b, leaf, add_partials) for a, b in whole]
        lefts = left_siblings(lo, hi, leaf)
        loss, scaled, recorded = forward(hi - 1)  # the last micro-batch: its backward below
        extras.append(recorded)
        for left in reversed(lefts):  # the loss's additions up the tree, now
            loss = left[0] + loss
        if self.reduction == "ordered":
            return self._reduce_scatter(done, lefts, loss, scaled, backward, params, extras, k)
        grads = backward(scaled)
        for left in reversed(lefts):
            torch._foreach_add_(left[1], grads)
            grads = left[1]
        return self._combine([*done, (loss, grads)], extras, nodes, k)

    # ------------------------------------------------------------ ordered: reduce-scatter

    def _reduce_scatter(
        self,
        done: list[Partial],
        lefts: list[Partial],
        loss: torch.Tensor,
        scaled: torch.Tensor,
        backward: Backward,
        params: list[torch.Tensor],
        extras: list[list[torch.Tensor]],
        k: int,
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[list[torch.Tensor]]]:
        """``ordered``, a step in order: the BatchNorm statistics' all-gather starts; the
        last micro-batch's backward pass runs, and as each parameter's gradient arrives
        (:meth:`_arrived`, from its hook) every bucket whose gradients are all in is
        launched, in bucket order (:meth:`_launch`: the additions to the left siblings, the
        flatten, the all-to-all; on GPUs :meth:`_finish` too, queued on the side stream);
        after it, the buckets no hook completed (unused parameters) go, on the CPU
        :meth:`_finish` runs for each (the rest of the tree on this rank's shard, the
        all-gather), and everything is waited for and unflattened into the kept buffers.
        Without ``overlap`` no hook is armed: all of it happens after the backward pass."""
        nodes = self._nodes[k // self.world.size]
        extra_flat = [t for mb in extras for t in mb]
        extras_in_flight = self._gather_start(extra_flat)  # during the backward pass
        device = params[0].device
        direct = device.type == "cpu" or moves_cuda_tensors(self.world)  # no CPU staging
        if device.type == "cuda" and direct and self._side is None:
            self._side = torch.cuda.Stream(device)
        m = max(len(ns) for ns in nodes)  # nodes a rank: 1 when W is a power of two
        buckets, bucket_of = self._buckets(loss, params, m)
        ex = _Exchange(
            done=done,
            lefts=lefts,
            nodes=nodes,
            m=m,
            k=k,
            buckets=buckets,
            bucket_of=bucket_of,
            leaf=[loss.reshape(1), *[None] * len(params)],
            missing=[sum(1 for i in b.indices if i) for b in buckets],
        )
        if self.overlap and direct:
            self._hook(params)
            self._exchange = ex
            self._launch_ready(ex)  # a bucket of the loss alone goes now
        try:
            grads = backward(scaled)
        except BaseException:
            for bucket in buckets:  # the run stops: no work of this step is waited for
                bucket.work = None
            raise
        finally:
            self._exchange = None
        with span("repro.reduce"):
            for i, g in enumerate(grads, 1):
                if ex.leaf[i] is None:  # no hook saw it: an unused parameter's zeros
                    ex.leaf[i] = g
                    ex.missing[bucket_of[i]] -= 1
                elif ex.leaf[i] is not g:  # W = 1 would sum g: the bits would follow W
                    raise ReproError(
                        f"the gradient of parameter {i - 1} was replaced after the reduction "
                        "took it (a gradient hook registered on the model's parameters "
                        "after training started?); register such hooks before the first "
                        "step, or use dist.overlap=false."
                    )
            self._launch_ready(ex)  # the rest, in order
            if self._side is None:  # CPU (or staged): the second half after the backward
                for bucket in buckets:
                    self._finish(ex, bucket)
            for bucket in buckets:
                if bucket.work is not None:
                    wait(bucket.work)  # on GPUs: the compute stream waits, not the host
                    bucket.work = None
                if bucket.stage is None:
                    bucket.send = None  # a fresh flatten each step: not kept to the next
            if self._side is not None:
                torch.cuda.current_stream(device).wait_stream(self._side)
            total: list[torch.Tensor | None] = [None] * len(ex.leaf)
            for bucket in buckets:
                assert bucket.gathered is not None
                flat = bucket.gathered.view(-1)[: bucket.size]
                views = _unflatten_dense_tensors(flat, [ex.leaf[i] for i in bucket.indices])
                for i, view in zip(bucket.indices, views, strict=True):
                    total[i] = view
            gathered_extras = self._gather_finish(extras_in_flight)
        loss, grads = self._kept(total, grads)  # type: ignore[arg-type]
        return loss, grads, _regroup(gathered_extras, extras, self.world.size)

    def _kept(
        self, total: list[torch.Tensor], like: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The ordered paths' result ``[loss, *grads]`` (views into received buffers) copied
        out: the loss into its own storage (a view would keep a whole buffer alive as long
        as the logs hold the step's loss), the gradients into buffers this reducer keeps.
        Own allocations, as autograd's gradients are: views sit at arbitrary offsets, and
        CUDA's multi-tensor kernels (the gradient norm's _foreach_norm) take another
        summation path for unaligned tensors (seen on H200). Allocated once (empty_like
        keeps each local gradient's layout, so channels_last stays so; again if a layout
        changes) and filled every step by one multi-tensor copy: each step's gradients are
        consumed (optimizer step, clipping) before the next one's reduction writes them."""
        if not _same_layouts(self._grads, like):
            self._grads = [torch.empty_like(g) for g in like]
        torch._foreach_copy_(self._grads, total[1:])
        return total[0].reshape(()).clone(), list(self._grads)

    def _buckets(
        self, loss: torch.Tensor, params: list[torch.Tensor], m: int
    ) -> tuple[list[_Bucket], list[int]]:
        """The buckets of ``[loss, *grads]`` (made once; again if the parameters change):
        the loss first (known before the backward pass), then the parameters in reverse;
        a new bucket at ``bucket_bytes`` (the first at 1 MiB) or a change of dtype."""
        key = (m, loss.dtype, loss.device, *[(p.dtype, p.numel()) for p in params])
        if self._plan is not None and self._plan[0] == key:
            return self._plan[1], self._plan[2]
        items = [
            (loss.dtype, 1, loss.element_size()),
            *[(p.dtype, p.numel(), p.element_size()) for p in params],
        ]
        groups: list[list[int]] = []
        nbytes = 0
        for i in [0, *range(len(params), 0, -1)]:
            dtype, numel, itemsize = items[i]
            first = not any(j for group in groups[:-1] for j in group)  # no parameters before
            limit = min(FIRST_BUCKET_BYTES if first else self.bucket_bytes, self.bucket_bytes)
            if not groups or items[groups[-1][0]][0] != dtype or nbytes + numel * itemsize > limit:
                groups.append([])
                nbytes = 0
            groups[-1].append(i)
            nbytes += numel * itemsize
        w = self.world.size
        buckets = []
        for indices in groups:
            size = sum(items[i][1] for i in indices)
            buckets.append(_Bucket(indices=indices, size=size, shard=-(-size // w)))
        bucket_of = [0] * len(items)
        for b, bucket in enumerate(buckets):
            for i in bucket.indices:
                bucket_of[i] = b
        self._plan = (key, buckets, bucket_of)
        return buckets, bucket_of

    def _hook(self, params: list[torch.Tensor]) -> None:
        """A hook on each parameter's gradient (registered once): during the last
        micro-batch's backward pass it hands the gradient to :meth:`_arrived`; otherwise it
        does nothing."""
        if len(self._hooked) == len(params) and all(
            a is b for a, b in zip(self._hooked, params, strict=True)
        ):
            return
        for handle in self._handles:  # another list (a layer frozen, say): other indices
            handle.remove()
        me = weakref.ref(self)

        def arrived(i: int, grad: torch.Tensor) -> None:
            reducer = me()
            if reducer is not None and reducer._exchange is not None:
                reducer._arrived(reducer._exchange, i, grad)

        self._handles = [
            p.register_hook(functools.partial(arrived, i)) for i, p in enumerate(params, 1)
        ]
        self._hooked = list(params)

    def _arrived(self, ex: _Exchange, i: int, grad: torch.Tensor) -> None:
        if ex.leaf[i] is not None:
            raise RuntimeError(
                f"repro.engine.reduction: parameter {i - 1}'s gradient arrived twice"
            )
        ex.leaf[i] = grad
        ex.missing[ex.bucket_of[i]] -= 1
        self._launch_ready(ex)

    def _launch_ready(self, ex: _Exchange) -> None:
        """Launch the buckets whose gradients have all arrived, in bucket order (NCCL needs
        every rank to issue its collectives in the same order)."""
        while ex.launched < len(ex.buckets) and ex.missing[ex.launched] == 0:
            self._launch(ex, ex.buckets[ex.launched])
            ex.launched += 1

    def _launch(self, ex: _Exchange, bucket: _Bucket) -> None:
        """The bucket's entries of the rank's node sums, into the send buffer, and the
        all-to-all. On GPUs this runs on the side stream (after what the compute stream has
        queued: the gradients) and queues the second half at once; on the CPU the second
        half waits for the backward pass."""
        side = self._side
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(side.device))
        with (
            torch.cuda.stream(side) if side is not None else nullcontext(),
            span("repro.reduce.bucket"),
        ):
            grads = [i for i in bucket.indices if i]
            last = [ex.leaf[i] for i in grads]
            for left in reversed(ex.lefts):  # the additions tree_reduce makes, in its order
                into = [left[1][i - 1] for i in grads]
                if into:
                    torch._foreach_add_(into, last)  # type: ignore[arg-type]
                last = into
            mine = dict(zip(grads, last, strict=True))
            mine[0] = ex.leaf[0]  # the last node's loss (summed before the backward pass)
            own = [mine[i] for i in bucket.indices]
            w, m = self.world.size, ex.m
            self._allocate(bucket, m, own[0])
            if m == 1:  # one node a rank (W a power of two): flattened, it is the send buffer
                pad = [bucket.pad] if bucket.pad is not None else []
                bucket.send = _flatten_dense_tensors([*own, *pad]).view(w, 1, bucket.shard)
            else:  # [d, j] = shard d of node j; ranks with fewer nodes send zeros for the rest
                assert bucket.stage is not None and bucket.send is not None
                nodes = [[_entry(p, i) for i in bucket.indices] for p in ex.done]
                for j, items in enumerate([*nodes, own]):
                    bucket.stage[j, : bucket.size].copy_(_flatten_dense_tensors(items))
                bucket.send.copy_(bucket.stage.view(m, w, bucket.shard).transpose(0, 1))
            bucket.work = self._start(dist.all_to_all_single, bucket.received, bucket.send)
            if side is not None:
                self._finish(ex, bucket)

    def _finish(self, ex: _Exchange, bucket: _Bucket) -> None:
        """After the bucket's all-to-all: the rest of the tree over this rank's shard of
        every node, then the all-gather of the finished shards."""
        side = self._side
        with torch.cuda.stream(side) if side is not None else nullcontext():
            if bucket.work is not None:
                wait(bucket.work)  # on the side stream: the host goes on
            assert bucket.received is not None and bucket.gathered is not None
            known = {
                node: bucket.received[r, j]
                for r, rank_nodes in enumerate(ex.nodes)
                for j, node in enumerate(rank_nodes)
            }
            mine = finish_tree(ex.k, known, lambda a, b: a.add_(b))  # a + b, into a's buffer
            bucket.work = self._start(gather_into, bucket.gathered, mine)

    def _allocate(self, bucket: _Bucket, m: int, like: torch.Tensor) -> None:
        """The bucket's buffers, once (on the stream that uses them)."""
        if bucket.received is not None:
            return
        w, shard = self.world.size, bucket.shard
        if m == 1 and w * shard > bucket.size:  # the last shard's padding
            bucket.pad = like.new_zeros(w * shard - bucket.size)
        if m > 1:
            bucket.stage = like.new_zeros((m, w * shard))  # padding stays zero
            bucket.send = like.new_empty((w, m, shard))
        bucket.received = like.new_empty((w, m, shard))
        bucket.gathered = like.new_empty((w, shard))

    def _start(
        self, collective: Callable[..., Any], out: torch.Tensor, tensor: torch.Tensor
    ) -> Any:
        """``collective(out, tensor)`` in flight (its work), or done (None) where CUDA
        tensors must pass through the CPU (gloo)."""
        if tensor.is_cuda and not moves_cuda_tensors(self.world):
            host = torch.empty(out.shape, dtype=out.dtype)
            collective(host, tensor.cpu())
            out.copy_(host)
            return None
        return collective(out, tensor, async_op=True)

    # ------------------------------------------------ the others: after the backward pass

    def _combine(
        self,
        partials: list[Partial],
        extras: list[list[torch.Tensor]],
        nodes: list[list[tuple[int, int]]],
        k: int,
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[list[torch.Tensor]]]:
        """``ordered_allgather`` and ``all_reduce``: the node partials, once the backward
        pass is over."""
        extra_flat = [t for mb in extras for t in mb]
        gathered = self._gather_finish(self._gather_start(extra_flat))
        regrouped = _regroup(gathered, extras, self.world.size)
        if self.reduction == "all_reduce":
            loss, grads = partials[0]
            for other in partials[1:]:  # the rank's own nodes, then NCCL's order
                loss, grads = add_partials((loss, grads), other)
            summed = [loss.reshape(1), *grads]
            for flat, index in _flat_by_dtype(summed):
                if flat.is_cuda and not moves_cuda_tensors(self.world):  # gloo: via the CPU
                    host = flat.cpu()
                    dist.all_reduce(host, op=dist.ReduceOp.SUM)
                    flat.copy_(host)
                else:
                    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
                group = [summed[i] for i in index]
                torch._foreach_copy_(group, _unflatten_dense_tensors(flat, group))
            return summed[0].reshape(()), summed[1:], regrouped
        loss, grads = self._kept(self._gather_then_finish(partials, nodes, k), partials[0][1])
        return loss, grads, regrouped

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
        parts = self._gather_finish(self._gather_start(mine))
        known = {
            node: (parts[r][j * n].reshape(()), list(parts[r][j * n + 1 : (j + 1) * n]))
            for r, rank_nodes in enumerate(nodes)
            for j, node in enumerate(rank_nodes)
        }
        loss, grads = finish_tree(k, known, add_partials)
        return [loss.reshape(1), *grads]

    def _gather_start(self, tensors: list[torch.Tensor]) -> Any:
        """Every rank's ``tensors`` (same shapes and dtypes on every rank), in flight:
        :meth:`_gather_finish` gives them rank by rank."""
        w = self.world.size
        flights = []
        for flat, index in _flat_by_dtype(tensors):
            out = torch.empty((w, flat.numel()), dtype=flat.dtype, device=flat.device)
            flights.append((out, index, self._start(gather_into, out, flat), flat))
        return tensors, flights  # flat stays referenced until the gather is done

    def _gather_finish(self, in_flight: Any) -> list[list[torch.Tensor]]:
        tensors, flights = in_flight
        w = self.world.size
        result: list[list[torch.Tensor | None]] = [[None] * len(tensors) for _ in range(w)]
        for out, index, work, _ in flights:
            if work is not None:
                wait(work)
            group = [tensors[i] for i in index]
            for r in range(w):
                for i, view in zip(index, _unflatten_dense_tensors(out[r], group), strict=True):
                    result[r][i] = view
        return result  # type: ignore[return-value]


def _entry(partial: Partial, i: int) -> torch.Tensor:
    """Entry ``i`` of a partial sum's flat ``[loss, *grads]``."""
    return partial[0].reshape(1) if i == 0 else partial[1][i - 1]


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
