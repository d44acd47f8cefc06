"""Checkpoints (docs/design.md, principle 6): atomic, checksummed, rotated, loaded safely.

A checkpoint is a ``torch.save`` file plus a ``sha256sum``-style sidecar
(``step-00000200.pt.sha256``, checkable with ``sha256sum -c``). The file is written through a
temporary file (fsync, rename), then the sidecar the same way: a crash at any moment leaves
the previous checkpoints intact, and a checkpoint without its sidecar — an interrupted write
— is never trusted. Loading reads the bytes once, checks them against the sidecar, then
unpickles with ``weights_only=True``: plain data only, so a file carrying code is refused
without running it.
"""

from __future__ import annotations

import hashlib
import io
import logging
import math
import os
import pickle
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import torch

from repro.config import flatten
from repro.errors import CheckpointError
from repro.files import BEST_FILE, CHECKPOINT_DIR
from repro.rng import global_rng_states, set_global_rng_states

if TYPE_CHECKING:
    from repro.build import Training

CHECKPOINT_FORMAT = "repro.checkpoint.v1"
BAD_SUFFIX = ".bad"  # a checkpoint a resume found damaged, set aside until the next rotation
LAST_GOOD = "last_good"  # names the newest checkpoint read back and verified after writing
_NAME = re.compile(r"step-(\d{8})\.pt")
log = logging.getLogger("repro")


def atomic_write(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """Write through a temporary file in the same folder, fsync it, then rename over ``path``.

    A crash at any moment leaves either the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give what open() would
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"step-{step:08d}.pt"


def save_checkpoint(path: Path, state: dict[str, Any]) -> str:
    """Write ``state`` and its checksum sidecar atomically; return the SHA-256."""
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    path = Path(path)
    atomic_write(path, lambda f: f.write(data))
    atomic_write(sidecar(path), lambda f: f.write(f"{digest}  {path.name}\n".encode()))
    return digest


def check_file(path: Path) -> tuple[bytes | None, str | None]:
    """The file's bytes when they match the sidecar, else ``(None, what is wrong)``."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        return None, f"unreadable ({err.strerror})"
    try:
        expected = sidecar(path).read_text().split()[0]
    except (OSError, IndexError):
        return None, "no checksum file (the write was interrupted)"
    except ValueError:  # not text: the sidecar itself is damaged
        return None, "checksum file damaged"
    if hashlib.sha256(data).hexdigest() != expected:
        return None, "checksum mismatch (truncated or corrupted)"
    return data, None


def load_checkpoint(
    path: Path, map_location: str | torch.device = "cpu", *, require_checksum: bool = True
) -> dict[str, Any]:
    """Verify and load a checkpoint; :class:`CheckpointError` (one line) when it is damaged,
    not a checkpoint, or would run code. ``require_checksum=False`` also reads a file with no
    sidecar (but never one whose sidecar disagrees)."""
    path = Path(path)
    data, problem = check_file(path)
    if data is None:
        if require_checksum or sidecar(path).exists() or not path.is_file():
            raise CheckpointError(f"{path}: {problem}; use an earlier checkpoint.")
        data = path.read_bytes()
    try:
        state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        # weights_only refused a global it would have imported: a file that carries code.
        # Releases word it differently; they name the global after "GLOBAL" (2.11, 2.13)
        # and all say "global", which a file that is simply not a pickle does not.
        text = str(err)
        found = re.search(r"GLOBAL ([\w.]+)", text)
        if found is None and "global" not in text.lower():
            raise CheckpointError(
                f"{path}: not a readable checkpoint (not a torch.save file); use another file."
            ) from None
        name = found.group(1) if found else "an object it does not allow"
        raise CheckpointError(
            f"{path}: refused: it holds Python objects that loading would run "
            f"({name}; weights_only=True stopped it); do not load it unless you "
            "trust its source."
        ) from None
    except Exception as err:
        raise CheckpointError(
            f"{path}: not a readable checkpoint ({type(err).__name__}); use another file."
        ) from None
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path}: not a repro checkpoint (no 'model' entry).")
    return state


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of the run's periodic checkpoints, newest first."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.fullmatch(p.name))]
    return sorted(found, reverse=True)


def mark_good(path: Path) -> bool:
    """Read a just-written checkpoint back; if it verifies, record it as the last good one."""
    data, _ = check_file(path)
    if data is None:
        return False
    atomic_write(path.parent / LAST_GOOD, lambda f: f.write(path.name.encode() + b"\n"))
    return True


def set_aside(path: Path) -> Path:
    """A checkpoint found damaged: renamed ``*.bad`` (with its checksum), out of the
    rotation's count; the next rotation deletes it."""
    bad = path.with_name(path.name + BAD_SUFFIX)
    os.replace(path, bad)
    if sidecar(path).exists():
        os.replace(sidecar(path), sidecar(bad))
    return bad


def rotate(run_dir: Path, keep: int) -> list[Path]:
    """Delete checkpoints known to be damaged (``*.bad``), then periodic ones beyond the
    newest ``keep``, never the last good one. Returns what was deleted."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    try:
        last_good = (folder / LAST_GOOD).read_text().strip()
    except (OSError, ValueError):
        last_good = None
    deleted = []
    for path in sorted(folder.glob(f"*{BAD_SUFFIX}")):
        path.unlink(missing_ok=True)
        sidecar(path).unlink(missing_ok=True)
        deleted.append(path)
    for _, path in list_checkpoints(run_dir)[keep:]:
        if path.name == last_good:
            continue
        path.unlink(missing_ok=True)
        sidecar(path).unlink(missing_ok=True)
        deleted.append(path)
    return deleted


def remove_partial_writes(run_dir: Path) -> list[Path]:
    """Temporary files left by a write that was killed before its rename: the checkpoints'
    and ``best.pt``'s."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    leftovers = list(folder.glob(".*.tmp")) if folder.is_dir() else []
    leftovers += list(Path(run_dir).glob(f".{BEST_FILE}.*.tmp"))
    for p in leftovers:
        p.unlink(missing_ok=True)
    return leftovers


# What must be equal for a resumed run to give the uninterrupted run's bits.
RELEVANT_CONFIG = (
    "seed",
    "model",
    "data",
    "task",
    "optim",
    "schedule",
    "amp",
    "determinism",
    "trainer.batch_size",
    "trainer.micro_batch_size",
    "dist.reduction",
    "trainer.max_steps",
    "trainer.compile",  # compiled kernels are other kernels
    "trainer.channels_last",  # so are those of another memory format
    "trainer.ema",  # the evaluations (and best.pt) see the average
    "trainer.overfit_batch",  # which samples every step trains on
    "trainer.eval_every",  # which evaluations best.pt chooses from
    "trainer.eval_batch_size",  # the evaluation's sums, in their order
)
# Keys that checkpoints written before they existed lack, and what their absence meant then.
ABSENT_MEANS = {
    "dist.reduction": "ordered",
    "trainer.compile": "off",
    "trainer.channels_last": False,
    "trainer.ema.decay": None,
    "trainer.ema.start": 0,
    "optim.clip_grad_norm": None,
    "trainer.overfit_batch": False,
    "data.test_fraction": 0.0,  # image_folder, image_mask_folder: no test split
}
# Values of a relevant key that give the same bits (mapped to one before comparing).
SAME_BITS = {"dist.reduction": {"ordered_allgather": "ordered"}}  # one tree, other collectives
# Relevant-looking keys that cannot change the bits of a resumed run: the NCCL settings only
# matter to dist.reduction=all_reduce, which is compared itself; filling new tensors with
# NaN only changes memory that no op reads (strict mode leaves it off: it costs a kernel a
# tensor and changes no bit).
# A test split is generated apart from the training and validation data: its size changes
# no bit of training.
NOT_COMPARED = (
    "determinism.nccl_env",
    "determinism.fill_uninitialized_memory",
    "data.test_size",
    "data.in_memory",  # image_folder read up front or per sample: the same bytes (tested)
)
RELEVANT_ENVIRONMENT = ("torch", "cuda", "cudnn", "gpu", "gpu_sm_count")
# Where the CPU computes the step, the kernels it dispatches to decide the bits too.
RELEVANT_ON_CPU = ("cpu_capability", "cpu_isa", "cpu_dispatch_limits")


def mismatches(
    state: dict[str, Any], config: dict[str, Any], environment: dict[str, Any], device: str
) -> list[str]:
    """``key: checkpoint vs now`` for each determinism-relevant config or environment entry
    that differs between a checkpoint and this run. A checkpoint written before an entry was
    recorded (the CPU's instruction set, say) is not refused for lacking it."""
    old = flatten(upgrade_config(state.get("config") or {}))
    new = flatten(upgrade_config(config))
    out = []
    for key in sorted(set(old) | set(new)):
        if key.startswith(NOT_COMPARED):
            continue
        if any(key == r or key.startswith(r + ".") for r in RELEVANT_CONFIG):
            absent = ABSENT_MEANS.get(key, "(absent)")
            a, b = old.get(key, absent), new.get(key, absent)
            same = SAME_BITS.get(key, {})
            if (same.get(a, a) if same else a) != (same.get(b, b) if same else b):
                out.append(f"{key}: {a} (checkpoint) vs {b} (now)")
    written_on = torch.device(state.get("device", device)).type  # cuda:1 and cuda are one kind
    if written_on != torch.device(device).type:
        out.append(f"device: {written_on} (checkpoint) vs {torch.device(device).type} (now)")
    old_env = state.get("environment") or {}
    relevant = RELEVANT_ENVIRONMENT + (RELEVANT_ON_CPU if written_on == "cpu" else ())
    for key in relevant:
        a, b = old_env.get(key), environment.get(key)
        if a != b and (key in old_env or key in RELEVANT_ENVIRONMENT):
            out.append(f"environment.{key}: {a} (checkpoint) vs {b} (now)")
    return out


# The optimizer settings of checkpoints written before the optimizer was a _target_.
_LEGACY_OPTIMIZERS = {
    "sgd": ("torch.optim.SGD", ("lr", "momentum", "nesterov", "weight_decay")),
    "adamw": ("torch.optim.AdamW", ("lr", "betas", "eps", "weight_decay")),
}


def upgrade_config(config: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's config in today's shape, so that one written before the optimizer was
    a ``_partial_`` target (``optim.name``, ``optim.implementation``, ``optim.schedule``,
    ``optim.warmup_steps``) and before tasks (classification) resumes when nothing that
    decides the bits changed: the same SGD or AdamW, the same schedule, the same loss."""
    config = dict(config)
    optim = dict(config.get("optim") or {})
    if "name" in optim and optim["name"] in _LEGACY_OPTIMIZERS:
        target, keys = _LEGACY_OPTIMIZERS[optim["name"]]
        implementation = optim.get("implementation", "foreach")
        pin = {"fused": {"foreach": False, "fused": True}, "for_loop": {"foreach": False}}
        config["optim"] = {
            "_target_": target,
            "_partial_": True,
            **{k: optim[k] for k in keys if k in optim},
            "fused": None,
            **pin.get(implementation, {"foreach": True}),
        }
        config.setdefault(
            "schedule",
            {
                "_target_": f"repro.schedules.warmup_{optim.get('schedule', 'cosine')}",
                "_partial_": True,
                "warmup_steps": optim.get("warmup_steps", 20),
            },
        )
    config.setdefault("task", {"_target_": "repro.tasks.Classification"})
    return config


def find_resume_point(
    source: Path,
    log: Callable[[str], None],
    fits: Callable[[dict[str, Any]], str | None] = lambda state: None,
) -> tuple[Path, dict[str, Any], list[Path]] | None:
    """The checkpoint to resume from: ``source`` itself when it is a file (it must be good),
    else the newest good one of the run directory ``source``, saying why any newer one was
    passed over; and those passed over (damaged). Good means intact and, by ``fits`` (say
    why not, or None), restorable into this run. ``None`` when the directory holds no
    checkpoint at all."""
    source = Path(source)
    if source.is_file():
        state = load_checkpoint(source)
        problem = fits(state)
        if problem:
            raise CheckpointError(f"{source}: cannot be restored into this run: {problem}.")
        return source, state, []
    candidates = list_checkpoints(source)
    if not candidates:
        return None
    problems, bad = [], []
    for _, path in candidates:
        try:
            state = load_checkpoint(path)
            problem = fits(state)
            if problem:
                raise CheckpointError(f"{path}: cannot be restored into this run: {problem}.")
        except CheckpointError as err:
            problems.append(str(err))
            bad.append(path)
            log(f"resume: {err} Falling back to the previous checkpoint.")
            continue
        return path, state, bad
    raise CheckpointError(
        f"{source / CHECKPOINT_DIR}: no usable checkpoint ({'; '.join(problems)}); start a new "
        "run (another hydra.run.dir) or restore a checkpoint from a backup."
    )


@dataclass
class RunIdentity:
    """What a checkpoint records and a resume must match: the resolved config and its hash,
    the environment (:func:`repro.fingerprint.environment` plus the world size) and the
    device type the run trains on."""

    config: dict[str, Any]
    config_hash: str
    environment: dict[str, Any]
    device: str


class Checkpointer:
    """Writes a run's checkpoints (``checkpoints/step-N.pt`` + sidecar): everything a resume
    needs to continue with the uninterrupted run's bits, then a read-back check
    (:func:`mark_good`) and rotation to the newest ``keep``. And ``best.pt``: the checkpoint
    of the evaluation with the best headline metric so far (:meth:`consider_best`)."""

    def __init__(
        self,
        run_dir: Path,
        training: Training,
        identity: RunIdentity,
        keep: int,
        steps_per_epoch: int,
        resumes: list[dict[str, Any]],
        best: dict[str, Any] | None = None,
    ) -> None:
        self.run_dir, self.training, self.identity = Path(run_dir), training, identity
        self.keep, self.steps_per_epoch, self.resumes = keep, steps_per_epoch, resumes
        self.last_saved: int | None = None
        self.best = best  # {"step", "metric", "value"} of the best evaluation so far

    def save(self, step: int, logs: Any) -> Path:
        """Flush ``logs`` (a :class:`repro.logs.TrainingLog`) first, so that the logs on
        disk cover every step the checkpoint does; its ``last`` values (the latest loss and
        metrics) go into the checkpoint."""
        path = checkpoint_path(self.run_dir, step)
        save_checkpoint(path, self._state(step, logs))
        if not mark_good(path):
            log.warning(f"{path}: did not verify when read back; keeping the last good one")
        rotate(self.run_dir, self.keep)
        self.last_saved = step
        return path

    def consider_best(self, step: int, metrics: dict[str, float], logs: Any) -> bool:
        """After the evaluation at ``step``: if its headline metric is finite and strictly
        better than every earlier one (the first of equal ones is kept), write ``best.pt``
        (atomically, with its sidecar, outside the rotation). Called before that step's
        periodic checkpoint, which then records this best for a resume."""
        task = self.training.task
        value = metrics.get(task.headline)
        if value is None or not math.isfinite(value):
            return False
        if self.best is not None:
            old = self.best["value"]
            if not (value > old if task.higher_is_better else value < old):
                return False
        self.best = {"step": step, "metric": task.headline, "value": float(value)}
        save_checkpoint(self.run_dir / BEST_FILE, self._state(step, logs))
        return True

    def _state(self, step: int, logs: Any) -> dict[str, Any]:
        logs.flush(wait=True)
        t, ident = self.training, self.identity
        return {
            "format": CHECKPOINT_FORMAT,
            "model": t.model.state_dict(),
            "optimizer": t.optimizer.state_dict(),
            "schedule": t.schedule.state_dict(),
            "scaler": t.precision.scaler.state_dict(),
            "step": step,
            "device": ident.device,
            "last": logs.last,
            "epoch": step // self.steps_per_epoch,
            "position_in_epoch": step % self.steps_per_epoch,
            "rng": global_rng_states(),
            "config": ident.config,
            "config_hash": ident.config_hash,
            "environment": ident.environment,
            "resumes": self.resumes,
            "best": self.best,
            "ema": t.ema.state_dict() if t.ema is not None else None,
        }


def cannot_restore(training: Training, state: dict[str, Any]) -> str | None:
    """Why the checkpoint ``state`` cannot be restored into ``training`` (its model's tensor
    names and shapes, its optimizer's parameter groups), or None. A checkpoint whose config
    matches the run's but whose weights do not (a file copied in from another run) is
    then passed over like a damaged one."""
    saved, ours = state.get("model"), training.model.state_dict()
    if not isinstance(saved, dict):
        return "it holds no model state"
    extra, missing = sorted(saved.keys() - ours.keys()), sorted(ours.keys() - saved.keys())
    if extra or missing:
        which = f"lacks {missing[0]!r}" if missing else f"has {extra[0]!r}, which it does not"
        return f"its model state {which} (another architecture's weights)"
    for name, tensor in ours.items():
        theirs = saved[name]
        shape = tuple(theirs.shape) if isinstance(theirs, torch.Tensor) else type(theirs).__name__
        if shape != tuple(tensor.shape):
            return f"its {name!r} is {shape} where this model's is {tuple(tensor.shape)}"
    optimizer = state.get("optimizer")
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    ours_groups = training.optimizer.state_dict()["param_groups"]
    if not isinstance(groups, list) or [len(g.get("params", ())) for g in groups] != [
        len(g["params"]) for g in ours_groups
    ]:
        return "its optimizer state is for other parameters"
    return None


def restore_training(training: Training, state: dict[str, Any], path: Path) -> None:
    """Load a checkpoint's model, optimizer, schedule, GradScaler and global RNG states; one
    line naming the file when it does not fit this run."""
    try:
        training.model.load_state_dict(state["model"])
        training.optimizer.load_state_dict(state["optimizer"])
        training.schedule.load_state_dict(state["schedule"])
        training.precision.scaler.load_state_dict(state["scaler"])
        set_global_rng_states(state["rng"])
        if training.ema is not None:
            training.ema.load_state_dict(state.get("ema"), path)
    except (KeyError, RuntimeError, ValueError, TypeError) as err:
        first_line = (str(err).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(
            f"{path}: cannot be restored into this run ({type(err).__name__}: "
            f"{first_line}); it holds another model's or optimizer's state than this config "
            "builds: resume from an earlier checkpoint (trainer.resume=PATH) or start a new run."
        ) from None
