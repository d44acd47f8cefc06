"""Checkpoints (docs/design.md, principle 6): atomic, checksummed, rotated, loaded safely.

A checkpoint is a ``torch.save`` file plus a ``sha256sum``-style sidecar
(``step-00000200.pt.sha256``, checkable with ``sha256sum -c``). The file also carries a
digest of its own content (``content_sha256``: every tensor's bytes and every other value),
so it can prove itself intact without its sidecar. Each is written through a temporary file
(fsync, rename), the checkpoint first: a crash at any moment leaves the previous
checkpoints intact, and one between a checkpoint's rename and its sidecar's leaves a
checkpoint that its own digest verifies. A sidecar is removed just before a new file is
renamed over an old one, so a sidecar never describes other bytes than its file's: one
that disagrees means damage. Loading reads the bytes once, checks them against the sidecar
(or, without one, the content against its own digest), unpickling with
``weights_only=True``: plain data only, so a file carrying code is refused without running
it.
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging
import math
import os
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from repro.base.errors import CheckpointError
from repro.base.files import BEST_FILE, CHECKPOINT_DIR, atomic_write
from repro.base.rng import global_rng_states, set_global_rng_states
from repro.defense.config import RELEVANT_ENVIRONMENT, RELEVANT_ON_CPU, flatten
from repro.records.fingerprint import SPLIT_KEY, split_mismatches
from repro.records.scoring import SCORING_KEY
from repro.records.weights import KEY as WEIGHTS_KEY
from repro.records.weights import weights_mismatches

CHECKPOINT_FORMAT = "repro.checkpoint.v1"
CONTENT_KEY = "content_sha256"  # the checkpoint's digest of its own content
BAD_SUFFIX = ".bad"  # a checkpoint a resume found damaged, set aside until the next rotation
LAST_GOOD = "last_good"  # names the newest checkpoint read back and verified after writing
_NAME = re.compile(r"step-(\d{8})\.pt")
log = logging.getLogger("repro")


class TrainingState(Protocol):
    """What a checkpoint saves of a run's training and restores into it
    (:class:`repro.engine.build.Training` has it; the records do not import the engine)."""

    model: torch.nn.Module
    task: Any
    optimizer: torch.optim.Optimizer
    schedule: Any
    precision: Any
    ema: Any


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"step-{step:08d}.pt"


def content_sha256(state: dict[str, Any]) -> str:
    """SHA-256 of a checkpoint's content, the entry that holds it left out: every tensor's
    dtype, shape and bytes, every other value's type and ``repr``, in order. What
    ``torch.load`` gives back hashes the same, so a checkpoint verifies without its
    sidecar."""
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in state.items() if k != CONTENT_KEY})
    return h.hexdigest()


def _feed(h: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        h.update(f"tensor {value.dtype} {tuple(value.shape)}\n".encode())
        flat = value.detach().to("cpu").contiguous().reshape(-1)
        h.update(flat.view(torch.uint8).numpy())
    elif isinstance(value, dict):
        h.update(f"dict {len(value)}\n".encode())
        for key, item in value.items():
            _feed(h, key)
            _feed(h, item)
    elif isinstance(value, (list, tuple)):
        h.update(f"{type(value).__name__} {len(value)}\n".encode())
        for item in value:
            _feed(h, item)
    else:
        h.update(f"{type(value).__name__} {value!r}\n".encode())


def save_checkpoint(path: Path, state: dict[str, Any]) -> str:
    """Write ``state`` (with its content digest) and its checksum sidecar; return the
    file's SHA-256."""
    buf = io.BytesIO()
    torch.save({**state, CONTENT_KEY: content_sha256(state)}, buf)
    return write_checkpoint_bytes(Path(path), buf.getvalue())


def write_checkpoint_bytes(path: Path, data: bytes) -> str:
    """A checkpoint's bytes to ``path``, then its sidecar; the old sidecar goes just before
    the new file is renamed into place (see the module docstring). Returns the SHA-256."""
    digest = hashlib.sha256(data).hexdigest()
    atomic_write(
        path, lambda f: f.write(data), before_replace=lambda: sidecar(path).unlink(missing_ok=True)
    )
    write_sidecar(path, digest)
    return digest


def write_sidecar(path: Path, digest: str) -> None:
    atomic_write(sidecar(path), lambda f: f.write(f"{digest}  {path.name}\n".encode()))


def _sidecar_digest(path: Path) -> tuple[str | None, str | None]:
    """``(digest, None)`` from the sidecar; ``(None, None)`` when there is none; ``(None,
    what is wrong)`` when it cannot be read."""
    try:
        return sidecar(path).read_text().split()[0], None
    except FileNotFoundError:
        return None, None
    except (OSError, IndexError, ValueError):  # not text, empty: the sidecar itself is damaged
        return None, "checksum file damaged"


def check_file(path: Path) -> tuple[bytes | None, str | None]:
    """The file's bytes when they match its sidecar, else ``(None, what is wrong)``."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        return None, f"unreadable ({err.strerror})"
    expected, problem = _sidecar_digest(path)
    if expected is None:
        return None, problem or "no checksum file"
    if hashlib.sha256(data).hexdigest() != expected:
        return None, "checksum mismatch (truncated or corrupted)"
    return data, None


@dataclass
class Loaded:
    """A checkpoint read and verified (:func:`read_checkpoint`)."""

    path: Path
    data: bytes  # the file's bytes
    state: dict[str, Any]
    by_sidecar: bool  # verified by its sidecar; False: by its own content digest

    @functools.cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


def read_checkpoint(
    path: Path, map_location: str | torch.device = "cpu", *, require_checksum: bool = True
) -> Loaded:
    """Verify and load a checkpoint: by its sidecar when there is one, else by the digest of
    its own content; :class:`CheckpointError` (one line; ``damaged`` when the bytes are not
    what was written) when it is damaged, not a checkpoint, or would run code.
    ``require_checksum=False`` also reads a file with neither (but never one whose sidecar
    or digest disagrees)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CheckpointError(
            f"{path}: unreadable ({err.strerror}); nothing was changed: try again once it can "
            "be read, or use an earlier checkpoint."
        ) from None
    expected, problem = _sidecar_digest(path)
    if problem or (expected is not None and hashlib.sha256(data).hexdigest() != expected):
        problem = problem or "checksum mismatch (truncated or corrupted)"
        raise CheckpointError(f"{path}: {problem}; use an earlier checkpoint.", damaged=True)
    try:
        state = _unpickle(path, data, map_location)
    except CheckpointError as err:  # without a sidecar, bytes that do not load are damage
        err.damaged = expected is None and "refused" not in str(err)
        raise
    if expected is None:  # no sidecar: a write interrupted after the rename, or a copy
        held = state.get(CONTENT_KEY)
        if held is None and require_checksum:
            raise CheckpointError(
                f"{path}: no checksum file, and no digest of its own (written before they "
                "were); use an earlier checkpoint.",
                damaged=True,
            )
        if held is not None and content_sha256(state) != held:
            raise CheckpointError(
                f"{path}: its content does not match its own digest (corrupted); use an "
                "earlier checkpoint.",
                damaged=True,
            )
    return Loaded(path, data, state, by_sidecar=expected is not None)


def verified_bytes(path: Path) -> bytes:
    """A checkpoint's bytes, verified without unpickling it when its sidecar is there (a
    copy needs no second copy of its tensors in memory); by :func:`read_checkpoint` when
    not."""
    data, _ = check_file(path)
    return data if data is not None else read_checkpoint(path).data


def held_best(path: Path) -> tuple[Any, int | None, str | None]:
    """``(its "best" record, its step, None)`` for a verified checkpoint file -- its tensors
    loaded on the meta device when its sidecar vouches for its bytes, so no memory is spent
    on them -- or ``(None, None, what is wrong)``."""
    data, _ = check_file(path)
    try:
        state = _unpickle(path, data, "meta") if data is not None else read_checkpoint(path).state
    except CheckpointError as err:
        there = path.exists() or sidecar(path).exists()
        return None, None, (f"it was damaged ({_why(err, path)})" if there else "it was missing")
    step = state.get("step")
    return state.get("best"), step if isinstance(step, int) else None, None


def load_checkpoint(
    path: Path, map_location: str | torch.device = "cpu", *, require_checksum: bool = True
) -> dict[str, Any]:
    """:func:`read_checkpoint`'s state."""
    return read_checkpoint(path, map_location, require_checksum=require_checksum).state


def _unpickle(path: Path, data: bytes, map_location: str | torch.device) -> dict[str, Any]:
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


def copy_checkpoint(source: Loaded | Path, target: Path) -> None:
    """A verified checkpoint (read, or a file: :func:`verified_bytes`) written to ``target``
    as every checkpoint is (atomically, the old sidecar gone first, then the new one)."""
    data = source.data if isinstance(source, Loaded) else verified_bytes(source)
    write_checkpoint_bytes(Path(target), data)


def repair_sidecar(loaded: Loaded) -> bool:
    """Write the sidecar of a checkpoint its own digest verified (its write was interrupted
    after the rename), so that ``sha256sum -c`` works again. Returns whether it did."""
    if loaded.by_sidecar:
        return False
    write_sidecar(loaded.path, loaded.sha256)
    return True


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
    for orphan in folder.glob("step-*.pt.sha256"):  # its checkpoint deleted by a killed rotation
        if not orphan.with_suffix("").exists():
            orphan.unlink(missing_ok=True)
    return deleted


# What must be equal for a resumed run to give the uninterrupted run's bits.
RELEVANT_CONFIG = (
    "seed",
    "model",
    "data",
    "augment",  # what each sample becomes, and the normalisation (through augment.eval)
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
    # image_folder, image_mask_folder before data.intensity: 8-bit read as today's auto
    "data.intensity.mode": "auto",
    "data.intensity.range": None,
    "data.intensity.percentiles": [0.5, 99.5],
    "data.intensity.clip": None,
    # before native-size evaluation: the evaluation pipeline's images, batched
    "inference.mode": "pipeline",
    "inference.tile": None,
    "inference.overlap": 0.5,
    "inference.sigma": 0.125,
    "inference.tile_batch": 64,
    "inference.mirror": False,
    "task.unions": None,  # segmentation before named unions and class names
    "data.class_names": None,
    "data.limit": None,  # image_folder, image_mask_folder before data.limit: every file
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


def mismatches(
    state: dict[str, Any], config: dict[str, Any], environment: dict[str, Any], device: str
) -> list[str]:
    """``key: checkpoint vs now`` for each determinism-relevant config or environment entry
    that differs between a checkpoint and this run, the pretrained weights files' SHA-256s
    included. A checkpoint written before an entry was recorded (the CPU's instruction set,
    the weights files, say) is not refused for lacking it."""

    def relevant(key: str) -> bool:
        return not key.startswith(NOT_COMPARED) and _under(key, RELEVANT_CONFIG)

    out = config_mismatches(state, config, relevant)
    written_on = torch.device(state.get("device", device)).type  # cuda:1 and cuda are one kind
    if written_on != torch.device(device).type:
        out.append(f"device: {written_on} (checkpoint) vs {torch.device(device).type} (now)")
    old_env = state.get("environment") or {}
    relevant_env = RELEVANT_ENVIRONMENT + (RELEVANT_ON_CPU if written_on == "cpu" else ())
    for key in relevant_env:
        a, b = old_env.get(key), environment.get(key)
        if a != b and (key in old_env or key in RELEVANT_ENVIRONMENT):
            out.append(f"environment.{key}: {a} (checkpoint) vs {b} (now)")
    # the pretrained weights files read (unknown on either side: not compared)
    out += weights_mismatches(old_env.get(WEIGHTS_KEY), environment.get(WEIGHTS_KEY))
    # what decided a folder's split besides the config (unknown on either side: likewise)
    out += split_mismatches(old_env.get(SPLIT_KEY), environment.get(SPLIT_KEY))
    return out


def config_mismatches(
    state: dict[str, Any], config: dict[str, Any], compared: Callable[[str], bool]
) -> list[str]:
    """``key: checkpoint vs now`` for each ``compared`` key of the configs that differs
    (keys an older checkpoint lacks read as :data:`ABSENT_MEANS` says; values
    :data:`SAME_BITS` maps to one are equal)."""
    old = flatten(upgrade_config(state.get("config") or {}))
    new = flatten(upgrade_config(config))
    out = []
    for key in sorted(set(old) | set(new)):
        if not compared(key):
            continue
        absent = ABSENT_MEANS.get(key, "(absent)")
        a, b = old.get(key, absent), new.get(key, absent)
        same = SAME_BITS.get(key, {})
        if (same.get(a, a) if same else a) != (same.get(b, b) if same else b):
            out.append(f"{key}: {a} (checkpoint) vs {b} (now)")
    return out


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


# What cannot change what `repro evaluate` and `repro predict` compute from a checkpoint:
# how the run was launched, logged, checkpointed and resumed, its loader (evaluation reads
# the held-out split itself) and processes, and the device (an environment difference,
# recorded). Every other key -- a forker's data.* and model.* keys included -- is compared.
NOT_EVALUATED = (
    "trainer.resume",
    "trainer.resume_force",
    "trainer.allow_existing_dir",
    "trainer.progress",
    "trainer.log_every",
    "trainer.checkpoint_every",
    "trainer.keep_checkpoints",
    "trainer.checkpoint_name",
    "trainer.trace",
    "trainer.trace_every",
    "trainer.test",
    "trainer.on_nonfinite",
    "loader",
    "logger",
    "paths",
    "dist",
    "device",
    "determinism.nccl_env",
    "determinism.fill_uninitialized_memory",
    "data.in_memory",  # image_folder read up front or per sample: the same bytes (tested)
    "report",  # how runs are judged (repro.defense.config.ReportConfig)
)


def evaluation_mismatches(state: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """``key: checkpoint vs now`` for every config key that can change what an evaluation
    or a prediction of the checkpoint ``state`` gives (all but :data:`NOT_EVALUATED`)."""
    return config_mismatches(state, config, lambda key: not _under(key, NOT_EVALUATED))


# The optimizer settings of checkpoints written before the optimizer was a _target_.
_LEGACY_OPTIMIZERS = {
    "sgd": ("torch.optim.SGD", ("lr", "momentum", "nesterov", "weight_decay")),
    "adamw": ("torch.optim.AdamW", ("lr", "betas", "eps", "weight_decay")),
}


def upgrade_config(config: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's config in today's shape, so that one written before the optimizer was
    a ``_partial_`` target (``optim.name``, ``optim.implementation``, ``optim.schedule``,
    ``optim.warmup_steps``), before tasks (classification) and before the ``augment`` group
    (``data.augment``: true is ``crop_flip``, false ``none``) and ``data.channels`` (RGB
    then) resumes when nothing that
    decides the bits changed: the same SGD or AdamW, schedule, loss and augmentation. Not
    for the image folders: they resized each image as they read it then, so their bits
    differ now, and the difference is named."""
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
    data = dict(config.get("data") or {})
    folders = ("image_folder", "image_mask_folder")  # they squashed each image as it was read
    if (
        "augment" not in config
        and "augment" in data
        and not str(data.get("_target_")).endswith(folders)
    ):
        size = data.get("image_size")
        crop_flip = {"_target_": "repro.data.augment.CropFlip", "size": size, "pad": 4}
        kept = {"_target_": "repro.data.augment.Resize", "size": size}
        config["augment"] = {"train": crop_flip if data.pop("augment") else kept, "eval": kept}
        config["data"] = data
    if str(data.get("_target_")).endswith(folders) and "channels" not in data:
        config["data"] = {**data, "channels": 3}  # before data.channels: RGB
    return config


def find_resume_point(
    source: Path, fits: Callable[[dict[str, Any]], str | None] = lambda state: None
) -> tuple[Loaded | None, list[tuple[Path, str, bool]]]:
    """The checkpoint to resume from, and those passed over, newer ones (``(path, why,
    damaged)``: damaged, or intact but not restorable into this run). ``source`` is a
    checkpoint file (it must be good: else :class:`CheckpointError`) or a run directory: its
    newest good checkpoint, or None when it holds none (no checkpoint at all, or none good).
    Good means intact and, by ``fits`` (say why not, or None), restorable. A checkpoint that
    cannot be read now (EIO, a permission) stops the search: nothing is passed over for it."""
    source = Path(source)
    if source.is_file():
        loaded = read_checkpoint(source)
        problem = fits(loaded.state)
        if problem:
            raise CheckpointError(f"{source}: cannot be restored into this run: {problem}.")
        return loaded, []
    passed_over = []
    for _, path in list_checkpoints(source):
        try:
            loaded = read_checkpoint(path)
        except CheckpointError as err:
            if "unreadable (" in str(err):
                raise
            passed_over.append((path, _why(err, path), err.damaged))
            continue
        problem = fits(loaded.state)
        if problem:
            passed_over.append((path, f"cannot be restored into this run: {problem}", False))
            continue
        return loaded, passed_over
    return None, passed_over


def _why(err: CheckpointError, path: Path) -> str:
    """What is wrong with a checkpoint, from its one-line error: the part after its name."""
    text = str(err).removeprefix(f"{path}: ")
    return text.split("; use an", 1)[0].split("; use another", 1)[0]


@dataclass
class RunIdentity:
    """What a checkpoint records and a resume must match: the resolved config and its hash,
    the environment (:func:`repro.records.fingerprint.environment` plus the world size) and the
    device type the run trains on."""

    config: dict[str, Any]
    config_hash: str
    environment: dict[str, Any]
    device: str


class Checkpointer:
    """Writes a run's checkpoints (``checkpoints/step-N.pt`` + sidecar): everything a resume
    needs to continue with the uninterrupted run's bits and what scoring it needs
    (``scoring``: :func:`repro.records.scoring.scoring_record`), then a read-back check
    (:func:`mark_good`) and rotation to the newest ``keep``. And ``best.pt``: the checkpoint
    of the evaluation with the best headline metric so far (:meth:`consider_best`)."""

    def __init__(
        self,
        run_dir: Path,
        training: TrainingState,
        identity: RunIdentity,
        keep: int,
        steps_per_epoch: int,
        resumes: list[dict[str, Any]],
        best: dict[str, Any] | None = None,
        scoring: dict[str, Any] | None = None,
    ) -> None:
        self.run_dir, self.training, self.identity = Path(run_dir), training, identity
        self.scoring = scoring  # what scoring needs besides the weights (records.scoring)
        self.keep, self.steps_per_epoch, self.resumes = keep, steps_per_epoch, resumes
        self.last_saved: int | None = None
        self.best = best  # {"step", "metric", "value"} of the best evaluation so far
        self.lost: str | None = None  # why best.pt does not hold that evaluation, if it does not

    def save(self, step: int, logs: Any) -> Path:
        """Flush ``logs`` (a :class:`repro.records.logs.TrainingLog`) first, so that the logs on
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
        self.lost = None
        return True

    def check_best(self, reached: int, source_run: Path | None = None) -> None:
        """Make ``best.pt`` hold the best evaluation so far (:attr:`best`), intact: on resume
        (``reached``: the checkpoint's step) and at the end of a run. A damaged, missing or
        stale one is rewritten from a verified copy of that evaluation's state -- its step's
        periodic checkpoint, or, resuming from another run directory (``source_run``), that
        run's ``best.pt`` or checkpoint -- or, with none left, said lost in one line (and in
        the summary). A ``best.pt`` from a later evaluation than ``reached`` (by a process
        killed after the checkpoint) is left: the run writes it again when it gets there."""
        path = self.run_dir / BEST_FILE
        if self.lost is not None and not path.exists():
            return  # said already
        held, _, problem = held_best(path)
        if problem is None:
            later = isinstance(held, dict) and isinstance(held.get("step"), int)
            if (held is not None and held == self.best) or (later and held["step"] > reached):
                if not sidecar(path).exists():  # verified by its own digest: a kill's leftover
                    write_sidecar(path, hashlib.sha256(path.read_bytes()).hexdigest())
                    log.info(f"{path}: its checksum file, lost in a kill, written again")
                return
            problem = f"it held another evaluation ({held})"
        if self.best is None:  # no best evaluation yet: the run writes best.pt at its first
            path.unlink(missing_ok=True)
            sidecar(path).unlink(missing_ok=True)
            return
        step = self.best["step"]
        copies = [checkpoint_path(self.run_dir, step)]
        elsewhere = source_run is not None and Path(source_run).resolve() != self.run_dir.resolve()
        if elsewhere:
            copies = [Path(source_run) / BEST_FILE, checkpoint_path(source_run, step), *copies]
        for copy in copies:
            record, at, bad = held_best(copy)
            if bad is None and at == step and record == self.best:
                copy_checkpoint(copy, path)
                if elsewhere and problem == "it was missing":
                    log.info(f"{BEST_FILE}: taken from {copy}")  # resumed from another run
                else:
                    log.warning(f"{BEST_FILE}: rewritten from {copy.name} ({problem})")
                self.lost = None
                return
        path.unlink(missing_ok=True)
        sidecar(path).unlink(missing_ok=True)
        b = self.best
        self.lost = f"{problem}, and no checkpoint of its step {step} is left"
        log.warning(
            f"{path}: {problem}, and no checkpoint of step {step} is left (one is written "
            "where an evaluation step is also a checkpoint step, until rotated away): the "
            f"weights of the best evaluation ({b['metric']} {b['value']}) are lost; training "
            "goes on, summary.json records them as lost, and a better evaluation writes "
            "best.pt again."
        )

    def best_summary(self) -> dict[str, Any] | None:
        """summary.json's ``best``: the best evaluation and the file that holds it (null
        when its weights were lost, with why)."""
        if self.best is None:
            return None
        if self.lost is not None:
            return {**self.best, "file": None, "lost": self.lost}
        return {**self.best, "file": BEST_FILE}

    def _state(self, step: int, logs: Any) -> dict[str, Any]:
        logs.flush(wait=True)
        t, ident = self.training, self.identity
        state = training_state(t)
        return {
            "format": CHECKPOINT_FORMAT,
            "model": state["model"],
            "optimizer": state["optimizer"],
            "schedule": state["schedule"],
            "scaler": state["scaler"],
            "step": step,
            "device": ident.device,
            "last": logs.last,
            "epoch": step // self.steps_per_epoch,
            "position_in_epoch": step % self.steps_per_epoch,
            "rng": state["rng"],
            "config": ident.config,
            "config_hash": ident.config_hash,
            "environment": ident.environment,
            "resumes": self.resumes,
            "best": self.best,
            "ema": state["ema"],
            SCORING_KEY: self.scoring,
        }


def training_state(training: TrainingState) -> dict[str, Any]:
    """What a checkpoint holds of the training (:func:`restore_training` puts it back): the
    model's, optimizer's, schedule's, GradScaler's and weight average's state dicts and the
    global generators' states (references to the live tensors, not copies)."""
    return {
        "model": training.model.state_dict(),
        "optimizer": training.optimizer.state_dict(),
        "schedule": training.schedule.state_dict(),
        "scaler": training.precision.scaler.state_dict(),
        "rng": global_rng_states(),
        "ema": training.ema.state_dict() if training.ema is not None else None,
    }


def cannot_restore(training: TrainingState, state: dict[str, Any]) -> str | None:
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


def restore_training(training: TrainingState, state: dict[str, Any], path: Path) -> None:
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
