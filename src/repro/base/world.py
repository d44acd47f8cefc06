"""Who this process is among the ranks of a run, and the small messages the ranks exchange
(``torch.distributed`` collectives over an initialised group; one process: rank 0 of 1 and
every call a no-op). Joining the group is :mod:`repro.engine.dist`; the gradient sum is
:mod:`repro.engine.reduction`.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from repro.base.errors import ConfigError, DeterminismError, FromRank0, ReproError

T = TypeVar("T")
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class World:
    """This process's place among the processes of the run (one process: rank 0 of 1)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str | None = None

    @property
    def main(self) -> bool:
        """Rank 0: the one process that writes logs, trace, checkpoints and the summary."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def launched_world() -> World:
    """What ``torchrun`` (or any env:// launcher) put in the environment; rank 0 of 1 when
    nothing did. Nothing is initialised."""
    values = {}
    for name in LAUNCH_VARS:
        raw = os.environ.get(name)
        if raw is None:
            values[name] = None
            continue
        try:
            values[name] = int(raw)
        except ValueError:
            raise ConfigError(
                f"environment: {name}={raw!r} is not an integer; start multi-process runs "
                "with torchrun, which sets it."
            ) from None
    size = values["WORLD_SIZE"] or 1
    rank = values["RANK"] or 0
    if size < 1 or not 0 <= rank < size:
        raise ConfigError(
            f"environment: RANK={rank} with WORLD_SIZE={size} is inconsistent; start "
            "multi-process runs with torchrun."
        )
    return World(rank, size, values["LOCAL_RANK"] or 0)


def current() -> World:
    """The world of the initialised process group, else :func:`launched_world`."""
    if dist.is_available() and dist.is_initialized():
        return World(
            dist.get_rank(),
            dist.get_world_size(),
            launched_world().local_rank,
            dist.get_backend_config(),
        )
    return launched_world()


def device_for(name: str, world: World) -> torch.device:
    """The device this process trains on: ``auto`` is CUDA when there is one, else the CPU;
    under torchrun each rank takes ``cuda:LOCAL_RANK``."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if not world.distributed or name == "cpu":
        return torch.device(name)
    if name != "cuda":
        raise ConfigError(
            f"config error: device={name} would put every one of the {world.size} processes "
            "on one GPU; use device=cuda (each rank takes cuda:LOCAL_RANK) or device=auto."
        )
    if world.local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"LOCAL_RANK={world.local_rank} but this machine has {torch.cuda.device_count()} "
            "CUDA device(s); start at most that many processes per node (--nproc_per_node)."
        )
    return torch.device("cuda", world.local_rank)


# ------------------------------------------------------------------- small messages


def broadcast_object(obj: Any, world: World) -> Any:
    """Rank 0's ``obj`` on every rank (pickled; our own processes only). Goes over the CPU
    (gloo), so it works before any GPU collective and with any backend."""
    if not world.distributed:
        return obj
    payload = pickle.dumps(obj) if world.main else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(size, src=0)
    data = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if world.main
        else torch.empty(int(size), dtype=torch.uint8)
    )
    dist.broadcast(data, src=0)
    return obj if world.main else pickle.loads(data.numpy().tobytes())


def on_main(fn: Callable[[], T], world: World) -> T:
    """Run ``fn`` on rank 0 and give every rank its result. A :class:`ReproError` that rank 0
    meets is raised on every rank (as :class:`FromRank0` elsewhere), so all stop together
    instead of waiting for rank 0 in the next collective."""
    if not world.distributed:
        return fn()
    outcome: tuple[str, Any] = ("ok", None)
    if world.main:
        try:
            outcome = ("ok", fn())
        except ReproError as err:
            broadcast_object(("error", str(err)), world)
            raise
    kind, value = broadcast_object(outcome, world)
    if kind == "error":
        raise FromRank0(value)
    return value


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def all_gather_cpu(tensor: torch.Tensor, world: World) -> torch.Tensor:
    """Every rank's CPU ``tensor`` (same shape everywhere), stacked in rank order."""
    if not world.distributed:
        return tensor[None]
    out = torch.empty((world.size, *tensor.shape), dtype=tensor.dtype)
    gather_into(out, tensor.contiguous())
    return out


def check_same(digest: str, world: World, what: str, step: int) -> None:
    """Raise on every rank when the ranks' SHA-256 hex digests of ``what`` differ."""
    if not world.distributed:
        return
    mine = torch.frombuffer(bytearray(bytes.fromhex(digest)), dtype=torch.uint8)
    all_ = all_gather_cpu(mine, world)
    differ = [r for r in range(world.size) if not torch.equal(all_[r], all_[0])]
    if differ:
        raise DeterminismError(
            f"after step {step} the {what} of rank(s) {differ} differ from rank 0's; the "
            "ranks no longer train the same model (a nondeterministic op, or different "
            "GPUs/software on the nodes): run repro doctor on one GPU."
        )


class StopVote:
    """Agree on stopping (pre-emption) without waiting: each rank casts its flag after a step
    (an asynchronous all-reduce of one CPU number over gloo) and reads the outcome after the
    next step, so every rank stops after the same step."""

    def __init__(self, world: World) -> None:
        self.world = world
        self._flag: torch.Tensor | None = None
        self._work: Any = None

    def cast(self, stop: bool) -> None:
        self._flag = torch.tensor([int(stop)], dtype=torch.int32)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, async_op=True)

    def outcome(self) -> bool:
        """The vote cast after the previous step: did any rank want to stop? (False before
        the first vote.)"""
        if self._work is None:
            return False
        self._work.wait()
        self._work = None
        return bool(self._flag.item())


def gather_into(out: torch.Tensor, tensor: torch.Tensor, async_op: bool = False) -> Any:
    """All-gather ``tensor`` from every rank into ``out`` (rank-major, same size each); with
    ``async_op`` the collective's work, in flight."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out.view(-1), tensor.view(-1), async_op=async_op)


def wait(work: Any) -> None:
    """Wait for a collective in flight (on GPUs: the current stream waits, not the host).
    A peer lost meanwhile raises here (``repro.base.errors`` recognises this frame: the error
    is most likely that peer's, and its own report goes first)."""
    work.wait()


def moves_cuda_tensors(world: World) -> bool:
    """Does the process group move CUDA tensors itself (NCCL), or only through the CPU
    (gloo)? ``world.backend`` is ``nccl``, ``gloo`` or per device, ``cpu:gloo,cuda:nccl``;
    any CUDA backend but gloo counts (torch's ``fake`` group of ``scripts/profile_step.py
    --fake-world`` too: its collectives copy on the device)."""
    backend = str(world.backend or "")
    if ":" not in backend:
        return backend == "nccl"
    per_device = dict(part.split(":", 1) for part in backend.split(","))
    return per_device.get("cuda", "gloo") != "gloo"
