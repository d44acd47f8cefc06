"""``torchrun`` and ``torch.distributed`` glue (docs/distributed.md): joining the process
group, the heartbeat that names a silent rank, and restarts under ``torchrun
--max-restarts``. Who this process is and the small messages the ranks exchange are
:mod:`repro.base.world`; the gradient sum itself is :mod:`repro.engine.reduction`.

Only rank 0 writes files. Every rank agrees on the run directory (rank 0's), and an error
that rank 0 meets while preparing the run stops every rank with rank 0's message.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous

from repro.base.errors import ConfigError, ReproError
from repro.base.world import World, broadcast_object, current, device_for, launched_world


def init(dist_cfg: Any, nccl_env: dict[str, str] | None = None, device_name: str = "auto") -> World:
    """Join the process group ``torchrun`` set up (env:// rendezvous); idempotent.

    Does nothing for a single process. ``dist.backend=auto`` takes NCCL for CUDA tensors
    with gloo alongside for small CPU messages, and gloo alone on CPUs. ``nccl_env`` is put
    into the environment first (GPU runs), so NCCL reads it when it starts."""
    world = launched_world()
    if not world.distributed:
        return world
    if dist.is_initialized():
        return current()
    device = device_for(device_name, world)
    if device.type == "cuda":  # NCCL reads them when it starts its first communicator
        for name, value in (nccl_env or {}).items():
            os.environ[str(name)] = str(value)
    backend = str(dist_cfg.backend)
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError(
            "config error: dist.backend=nccl needs CUDA devices; use dist.backend=auto or gloo."
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "gloo" if backend == "gloo" else "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    timeout = datetime.timedelta(seconds=int(dist_cfg.timeout_s))
    # torchrun's store outlives a restart of the group (--max-restarts): under a prefix of
    # this start's own, a restarted rank cannot read a dead rank's address (gloo then
    # failed to connect, or connected to nothing, at random)
    store, rank, size = next(rendezvous("env://", timeout=timeout))
    store = dist.PrefixStore(start_prefix(), store)
    dist.init_process_group(
        backend=backend, store=store, rank=rank, world_size=size, timeout=timeout
    )
    Heartbeat.start(rank, size)
    return current()


def start_prefix() -> str:
    """This start's keys in torchrun's store, which outlives a restart of the group. On one
    node the restart count is every rank's: a restarted rank then cannot read a dead rank's
    address (gloo failed to connect, at random). Across nodes the counts can differ, so all
    starts share one prefix, as torch's own ``env://`` does."""
    return f"repro/start_{restart_count()}" if single_node_elastic() else "repro"


class Heartbeat:
    """Under torchrun each rank adds 1 to its counter in torchrun's store every second, from
    a thread of its own (over its own connection), so that when a collective times out
    (``dist.timeout_s``) the ranks that stopped answering can be named:
    :func:`silent_ranks`. A rank stopped (SIGSTOP), swapped out or frozen stops counting;
    one stuck in its own code keeps counting, and the verdict then says no rank went silent."""

    INTERVAL = 1.0

    @staticmethod
    def key(rank: int) -> str:
        return f"{start_prefix()}/heartbeat/{rank}"

    @staticmethod
    def connect(timeout_s: float = 10.0) -> Any:
        return dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )

    @classmethod
    def start(cls, rank: int, size: int) -> None:
        def beat() -> None:
            store = None
            while True:
                try:  # a slow connection or a lost one is tried again, next second
                    store = store or cls.connect()
                    store.add(cls.key(rank), 1)
                except Exception:
                    store = None
                time.sleep(cls.INTERVAL)

        threading.Thread(target=beat, name="repro-heartbeat", daemon=True).start()


SILENT_AFTER_S = 3.0  # a heartbeat that did not advance in this long: a silent rank


def silent_ranks(world: World, wait_s: float = SILENT_AFTER_S) -> list[int] | None:
    """The other ranks whose heartbeat did not advance over ``wait_s`` seconds (after a
    collective timed out); None when torchrun's store cannot be reached."""
    try:
        store = Heartbeat.connect(timeout_s=5.0)
        first = [store.add(Heartbeat.key(r), 0) for r in range(world.size)]
        time.sleep(wait_s)
        then = [store.add(Heartbeat.key(r), 0) for r in range(world.size)]
    except Exception:
        return None
    # a counter still at 0 never started (its thread could not connect): not a verdict
    return [r for r in range(world.size) if r != world.rank and 0 < then[r] == first[r]]


def explain_timeout(error: BaseException, world: World, timeout_s: int) -> ReproError | None:
    """A collective of this process group that timed out ("Timed out waiting ...",
    "Application timeout caused pair closure"), raised by it (not a download's), as
    one line naming the ranks that stopped answering (:class:`Heartbeat`) after the error's
    own first line; None for any other error."""
    from repro.base.errors import inside_a_collective

    text = (str(error).strip().splitlines() or [""])[0]
    if (
        not world.distributed
        or isinstance(error, ReproError)
        or not re.search(r"timed out|timeout", text, re.IGNORECASE)  # gloo's words vary
        or not (  # the process group's own: not a download's or a file system's timeout
            inside_a_collective(error)
            or isinstance(error, dist.DistError)
            or re.search(r"gloo|nccl", text, re.IGNORECASE)
        )
    ):
        return None
    silent = silent_ranks(world)
    if silent is None:
        who = "a rank stopped answering (torchrun's store cannot be reached to say which)"
    elif not silent:
        who = "every rank's heartbeat still moves: one may be stuck in its own code"
    else:
        names = ", ".join(f"rank {r}" for r in silent)
        who = f"{names} of {world.size} stopped answering (no heartbeat in {SILENT_AFTER_S:.0f} s)"
    return ReproError(
        f"a collective waited dist.timeout_s={timeout_s} s: {who}; the group stops "
        f"({type(error).__name__}: {text}). Resume with trainer.resume=auto."
    )


def shutdown() -> None:
    """Leave the process group (if this process joined one), after every rank is done with
    it: a rank that tears its connections down while a peer still talks over them can abort
    that peer (seen with gloo: "terminate called without an active exception")."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def restart_count() -> int:
    """How many times ``torchrun --max-restarts`` has restarted this group on one node: 0 at
    its first start, and outside torchrun. Used only when every rank is on one node: torchrun
    counts per node, and a node whose ranks did not fail does not count the restart."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def single_node_elastic() -> bool:
    """Under ``torchrun --max-restarts`` with every rank on this node (one agent, one count)."""
    env = os.environ
    return (
        int(env.get("TORCHELASTIC_MAX_RESTARTS") or 0) > 0
        and env.get("LOCAL_WORLD_SIZE") is not None
        and env.get("LOCAL_WORLD_SIZE") == env.get("WORLD_SIZE")
    )


def _elastic_record(output_dir: str) -> Path:
    """Where this torchrun's first start records the run directory it took: keyed by the run
    id and torchrun's own process (the ranks' parent), so another launch never reads it."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return Path(output_dir) / ".torchelastic" / f"{run_id}-{os.getppid()}.json"


def record_elastic_run(config: Any, run_dir: Path) -> None:
    """Rank 0, once the run directory is this run's: where a restart of this group resumes
    (:func:`elastic_resume`)."""
    if single_node_elastic() and restart_count() == 0:
        from repro.records.rundir import write_json  # atomically

        record = _elastic_record(str(config.paths.output_dir))
        record.parent.mkdir(parents=True, exist_ok=True)
        write_json(record, {"run_dir": str(run_dir)})


def elastic_resume(config: Any) -> str | None:
    """On a restart of a single-node group: the run directory its first start took (None
    when it took none: it was refused, or failed before), to resume there."""
    if not single_node_elastic() or restart_count() == 0:
        return None
    try:
        record = _elastic_record(str(config.paths.output_dir))
        return str(json.loads(record.read_text())["run_dir"])
    except (OSError, ValueError, KeyError):
        return None


def join_hydra_run(config: Any, world: World) -> None:
    """Under torchrun, before Hydra creates the run directory: every rank takes rank 0's
    ``hydra.run.dir`` (its timestamp and run id), and ranks > 0 write nothing there (no
    ``.hydra/``, no log file) and log warnings and errors only, marked with their rank.
    A single-node group that ``torchrun --max-restarts`` restarted after a rank failed
    takes the directory its first start took and resumes there (``trainer.resume=auto``):
    no flag to remember, and the uninterrupted run's bits. (Across nodes give
    ``trainer.resume=auto`` and ``hydra.run.dir`` yourself: docs/distributed.md.)"""
    from omegaconf import open_dict, read_write

    if not world.distributed:
        return
    resumed = elastic_resume(config) if world.main else None
    chosen = (resumed or str(config.hydra.run.dir), resumed is not None) if world.main else None
    run_dir, resume = broadcast_object(chosen, world)
    if resume:  # the first start's directory: resume it (a resume it was given is used up)
        with read_write(config), open_dict(config):
            config.trainer.resume = "auto"
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.run.dir = run_dir
        if world.main:
            return
        config.hydra.output_subdir = None
        logging_cfg = config.hydra.job_logging
        if logging_cfg and "root" in logging_cfg:
            handlers = logging_cfg.root.get("handlers") or []
            logging_cfg.root.handlers = [h for h in handlers if h != "file"]
            logging_cfg.root.level = "WARNING"
            for formatter in (logging_cfg.get("formatters") or {}).values():
                if "format" in formatter:
                    formatter.format = f"[rank {world.rank}] {formatter.format}"
