"""The run directory: start a new run in it, or find where to resume; refuse what would
overwrite a run or could not give the uninterrupted run's bits.

Rank 0 decides (:func:`prepare_run_dir`); every rank gets its answer. Nothing is written
into the directory before the decision, so a refused launch leaves it as it was.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import json
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from repro.base.errors import CheckpointError, ConfigError
from repro.base.files import (
    BEST_FILE,
    CHECKPOINT_DIR,
    ENV_FILE,
    ERROR_FILE,
    EVAL_FILE,
    LAUNCH_DIR,
    LOCK_FILE,
    LOG_FILE,
    LOGGERS_FILE,
    METRICS_FILE,
    RUN_MARKERS,
    SUMMARY_FILE,
    TEST_FILE,
    TEST_PER_SAMPLE_FILE,
    TRACE_FILE,
    VAL_PER_SAMPLE_FILE,
    atomic_write,
    finite_or_null,
    link_refused,
    open_run_file,
    parse_json,
    resume_command,
    write_file,
)
from repro.records.checkpoint import (
    LAST_GOOD,
    RunIdentity,
    find_resume_point,
    list_checkpoints,
    mismatches,
    repair_sidecar,
    set_aside,
    sidecar,
)

log = logging.getLogger("repro")
LOG_FILES = (TRACE_FILE, METRICS_FILE, EVAL_FILE, ENV_FILE)


@dataclass
class ResumePoint:
    path: Path  # the checkpoint
    state: dict[str, Any] | None  # its contents (let go once restored)
    forced: list[str]  # differences accepted with trainer.resume_force=true
    step: int = 0
    last: dict[str, Any] = field(default_factory=dict)  # the loss and metrics logged last
    history: list[dict[str, Any]] = field(default_factory=list)  # earlier resumes of the run
    best: dict[str, Any] | None = None  # the best evaluation up to the checkpoint's step

    def __post_init__(self) -> None:
        if self.state is not None:
            self.step = int(self.state["step"])
            self.last = dict(self.state.get("last") or {})
            self.history = list(self.state.get("resumes") or [])
            self.best = self.state.get("best")

    @property
    def source_run(self) -> Path:
        """The run directory the checkpoint belongs to."""
        folder = self.path.parent
        return folder.parent if folder.name == CHECKPOINT_DIR else folder


def prepare_run_dir(
    cfg: DictConfig,
    run_dir: Path,
    identity: RunIdentity,
    fits: Callable[[dict[str, Any]], str | None] = lambda state: None,
) -> tuple[ResumePoint | None, dict[str, Any] | None]:
    """(where to resume, or None to start at step 0; the summary of a run that is already
    complete, or None). Raises a one-line error for what cannot be done. ``fits(state)``
    says why a checkpoint cannot be restored into this run (None if it can): such a
    checkpoint is passed over like a damaged one."""
    run_dir.mkdir(parents=True, exist_ok=True)
    refuse_links(run_dir)
    refuse_what_is_not_a_run(run_dir, bool(cfg.trainer.allow_existing_dir))
    found = _resume_point(cfg, run_dir, identity, fits)
    max_steps = int(cfg.trainer.max_steps)
    if found is not None and found.step > max_steps:
        raise CheckpointError(
            f"{found.path} is at step {found.step}, beyond trainer.max_steps={max_steps}."
        )
    if found is not None and found.step == max_steps and (run_dir / SUMMARY_FILE).is_file():
        try:
            summary = parse_json((run_dir / SUMMARY_FILE).read_bytes())
            if isinstance(summary, dict):
                return found, summary
            raise ValueError("not a JSON object")
        except ValueError as err:  # UnicodeDecodeError included: cut short, or overwritten
            log.warning(
                f"{run_dir / SUMMARY_FILE} is damaged ({type(err).__name__}); finishing the "
                "run again from its last checkpoint to write it"
            )
    return found, None


def _resume_point(
    cfg: DictConfig,
    run_dir: Path,
    identity: RunIdentity,
    fits: Callable[[dict[str, Any]], str | None],
) -> ResumePoint | None:
    t = cfg.trainer
    if t.resume is None:
        refuse_to_overwrite(run_dir)
        return None
    auto = str(t.resume) == "auto"
    source = run_dir if auto else Path(str(t.resume)).expanduser()
    source_run = source.parent if source.is_file() else source
    if source_run.name == CHECKPOINT_DIR:
        source_run = source_run.parent
    own = source_run.resolve() == run_dir.resolve()
    if not own:
        refuse_to_overwrite(run_dir)  # resuming another run writes here: it must be new

    mine = (identity.config, identity.environment, identity.device)
    # under other settings the weights may differ by design: that has its own message below
    found, passed_over = find_resume_point(
        source, lambda state: None if mismatches(state, *mine) else fits(state)
    )
    if found is None:
        return _start_at_step_0(cfg, run_dir, source, passed_over, own)
    differ = mismatches(found.state, identity.config, identity.environment, identity.device)
    if differ and not t.resume_force:
        raise CheckpointError(
            f"{found.path} was written under another configuration or environment, so "
            "resuming would not give the uninterrupted run's bits; resume with the "
            "checkpoint's settings, or set trainer.resume_force=true to go on anyway "
            "(recorded). Differences: " + "; ".join(differ)
        )
    for d in differ:
        log.warning(f"resume_force: {d}")
    remove_partial_writes(run_dir)  # only now: a refusal changes nothing
    if own:  # this run's own checkpoints: the passed-over set aside, a lost sidecar restored
        for bad, why, _ in passed_over:
            log.warning(f"resume: {bad}: {why}. Falling back to the previous checkpoint.")
            log.warning(f"resume: set {bad.name} aside as {set_aside(bad).name} (unusable)")
        if repair_sidecar(found):
            log.info(f"resume: {found.path.name} verified by its own digest; checksum restored")
    return ResumePoint(found.path, found.state, differ)


def _start_at_step_0(
    cfg: DictConfig,
    run_dir: Path,
    source: Path,
    passed_over: list[tuple[Path, str, bool]],
    own: bool,
) -> None:
    """``trainer.resume`` found no checkpoint to resume from. ``auto`` in the run's own
    directory starts at step 0 there -- when there was none yet (killed before the first),
    and when every one is damaged (set aside, one warning): a requeued job must not fail
    forever, and a run started again ends on the same bits. Checkpoints that are intact
    but cannot be restored (the model's code changed, say) are never set aside for that:
    one line, nothing changed. Otherwise, one line."""
    t = cfg.trainer
    listed = "; ".join(f"{p.name}: {why}" for p, why, _ in passed_over)
    if not (own and str(t.resume) == "auto"):
        if passed_over:
            raise CheckpointError(
                f"{source / CHECKPOINT_DIR}: no usable checkpoint ({listed}); resume from "
                "another one (trainer.resume=PATH) or start a new run (another hydra.run.dir)."
            )
        raise CheckpointError(f"{source}: holds no checkpoints/ to resume from.")
    finished = [n for n in (SUMMARY_FILE, str(t.checkpoint_name)) if (run_dir / n).exists()]
    if finished:
        what = f"checkpoints that cannot be used ({listed})" if passed_over else "checkpoints/"
        raise CheckpointError(
            f"{run_dir} holds a finished run ({', '.join(finished)}) but no {what} to resume "
            "from; choose another hydra.run.dir (nothing was overwritten)."
        )
    if passed_over and not all(damaged for _, _, damaged in passed_over):
        raise CheckpointError(
            f"{run_dir / CHECKPOINT_DIR}: no checkpoint can be resumed, and not every one is "
            f"damaged ({listed}); nothing was changed: resume with the settings and code they "
            "were written with, or start a new run (another hydra.run.dir)."
        )
    remove_partial_writes(run_dir)
    if passed_over:
        for bad, _, _ in passed_over:
            set_aside(bad)
        log.warning(
            f"resume: no usable checkpoint in {run_dir / CHECKPOINT_DIR} ({listed}); every one "
            "damaged: set aside as *.bad, starting again from step 0 in this directory: the run "
            "ends on the bits of one never interrupted"
        )
    else:
        log.info(f"resume=auto: no checkpoint in {run_dir} yet; starting at step 0")
    # what an earlier attempt wrote that the new one would not overwrite at once
    stale_files = [BEST_FILE, TEST_FILE, TEST_PER_SAMPLE_FILE, VAL_PER_SAMPLE_FILE]
    for stale in [*(run_dir / n for n in stale_files), *run_dir.glob("env-resume-*.json")]:
        stale.unlink(missing_ok=True)
        sidecar(stale).unlink(missing_ok=True)
    return None


def remove_partial_writes(run_dir: Path) -> None:
    """Temporary files left by writes killed before their rename (:func:`atomic_write`'s
    ``.<name>.<random>.tmp``): in ``checkpoints/``, and beside the run's own files."""
    folder = run_dir / CHECKPOINT_DIR
    leftovers = list(folder.glob(".*.tmp")) if folder.is_dir() else []
    for p in run_dir.glob(".*.tmp"):
        name = _TEMPORARY.fullmatch(p.name)
        if name and _ours(name.group(1)):
            leftovers.append(p)
    for p in leftovers:
        p.unlink(missing_ok=True)
        log.info(f"resume: removed {p.name}, a write interrupted before its rename")


_TEMPORARY = re.compile(r"\.(.+)\.[A-Za-z0-9_]{8}\.tmp")


def refuse_to_overwrite(run_dir: Path) -> None:
    existing = [n for n in (CHECKPOINT_DIR, TRACE_FILE, SUMMARY_FILE) if (run_dir / n).exists()]
    if existing:
        raise ConfigError(
            f"{run_dir} already holds a run ({', '.join(existing)}); resume it with "
            "trainer.resume=auto, or choose another hydra.run.dir (nothing was overwritten)."
        )


# What a run of this project writes into its directory: anything else is someone's file.
RUN_FILES = {
    LOCK_FILE,
    LAUNCH_DIR,
    LOG_FILE,
    LOGGERS_FILE,
    "determinism.json",
    "determinism.txt",
    ENV_FILE,
    TRACE_FILE,
    METRICS_FILE,
    EVAL_FILE,
    SUMMARY_FILE,
    ERROR_FILE,
    CHECKPOINT_DIR,
    BEST_FILE,
    TEST_FILE,
    TEST_PER_SAMPLE_FILE,
    VAL_PER_SAMPLE_FILE,
    "tensorboard",  # the loggers' own (conf/logger/)
    "wandb",
    "rerun",
}


def _ours(name: str) -> bool:
    return (
        name in RUN_FILES
        or name.startswith(("checkpoint", "env-resume-"))
        or name.endswith((".tmp", ".sha256"))
    )


def refuse_links(run_dir: Path) -> None:
    """A file the run writes (``train.log``, ``metrics.csv``...) that is a symbolic link is
    refused, naming it, before anything is written: a run's files are never written
    through links. So is a linked ``.hydra/`` (the launch's record is written into it, and a
    resume, ``repro rerun`` and ``evaluate`` read the run's config from it) and a linked
    ``checkpoints/`` (rotation deletes files in it: through a link, files outside the run;
    to keep checkpoints on another disk, put the run directory there)."""
    for p in sorted(run_dir.iterdir()):
        if not p.is_symlink():
            continue
        if p.name == CHECKPOINT_DIR:
            raise ConfigError(
                f"{str(link_refused(p)).rstrip('.')} (rotation deletes old checkpoints in it; to "
                "keep them on another disk, put the whole run there: hydra.run.dir=...)."
            )
        if p.name == LAUNCH_DIR or (_ours(p.name) and not p.is_dir()):
            raise link_refused(p)


def refuse_what_is_not_a_run(run_dir: Path, allow: bool) -> None:
    """A directory that is neither empty nor a run is someone's: refused, unless ``allow``;
    and even then, a file there with a name the run writes (a ``metrics.csv`` of one's own)
    is never overwritten: refused too."""
    entries = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_FILE)
    if not entries or any((run_dir / m).exists() for m in RUN_MARKERS):
        return  # a new run, or a run of this project (the resume rules apply)
    clash = [n for n in entries if _ours(n)]
    if clash:
        raise ConfigError(
            f"{run_dir} holds {', '.join(clash[:3])}, which a run would overwrite, but no run "
            "of this project; move them, or choose a new hydra.run.dir (nothing was written)."
        )
    if not allow:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise ConfigError(
            f"{run_dir} is not empty and holds no run of this project ({shown}); choose a new "
            "hydra.run.dir, or set trainer.allow_existing_dir=true to run beside those files "
            "(nothing was written)."
        )


class HeldFileLogs:
    """Log records for files in ``run_dir`` (Hydra's ``train.log``, which opens at its first
    record), held back from the moment this is made until :meth:`release`: written then if
    the directory became the run's, dropped (they still went to the console) if it was
    refused. A warning logged while the data is built (a skipped image) must neither create a
    file in a directory that is refused, nor make this launch's own directory look taken.
    When the file opens, it opens never through a link (:func:`repro.base.files.open_run_file`)."""

    def __init__(self, run_dir: Path) -> None:
        root, folder = logging.getLogger(), Path(run_dir).resolve()
        self.swapped: list[tuple[logging.FileHandler, _Holding]] = []
        for i, handler in enumerate(root.handlers):
            if (
                isinstance(handler, logging.FileHandler)
                and handler.stream is None  # not opened yet (delay=True)
                and Path(handler.baseFilename).parent.resolve() == folder  # a link's too
            ):
                handler._open = functools.partial(_open_log, handler)  # type: ignore[method-assign]
                holding = _Holding(handler.level)
                root.handlers[i] = holding
                self.swapped.append((handler, holding))

    def release(self, write: bool) -> None:
        """Put the file handlers back; with ``write``, hand them the held records. Once."""
        root = logging.getLogger()
        for handler, holding in self.swapped:
            if holding in root.handlers:
                root.handlers[root.handlers.index(holding)] = handler
            for record in holding.records if write else []:
                handler.handle(record)
        self.swapped = []


def _open_log(handler: logging.FileHandler) -> Any:
    """What ``handler`` opens its file with (logging's ``FileHandler._open``), but never
    through a link."""
    return open_run_file(
        handler.baseFilename, handler.mode, encoding=handler.encoding, errors=handler.errors
    )


class _Holding(logging.Handler):
    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class RunDirLock:
    """The run directory's owner, for the run's lifetime: ``.lock``, holding a POSIX record
    lock (``fcntl.lockf``; on NFS, its lock manager's) and the holder's host, pid and start
    time. The kernel releases the lock when its process ends, however it ends (SIGKILL, a
    full disk, a crash between creating the file and writing it), so the lock of a run that
    is gone is simply free: there is no stale lock to judge and take over, and so no race
    between launches taking one over at once. A second launch into the directory is
    refused, naming the holder.

    On a filesystem without locks (Lustre mounted without ``flock``) the lock is a file
    created with ``O_CREAT | O_EXCL`` instead: a run killed there leaves it behind, and the
    refusal says which file to delete.

    Until :meth:`accept` (the directory is the run's), log records for files in it are held
    back (:class:`HeldFileLogs`)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self.held = False
        self.fd: int | None = None  # the locked file's descriptor (closing it unlocks)
        self.logs = HeldFileLogs(run_dir)

    def accept(self) -> None:
        """The directory is the run's: the held log records are written."""
        self.logs.release(write=True)

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        for _ in range(10):
            try:
                fd, created = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:  # a link too: O_EXCL follows none
                try:
                    fd, created = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW), False
                except FileNotFoundError:  # its holder removed it as we looked
                    continue
                except OSError as err:
                    if err.errno == errno.ELOOP:  # never locked, written or removed
                        raise link_refused(self.path) from None
                    raise
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno in _NO_LOCKS and created:  # no locks here: the file itself is it
                    self._hold(fd, me)
                    return
                holder = _read_holder(fd)
                os.close(fd)
                if err.errno in (errno.EACCES, errno.EAGAIN):
                    raise self._in_use(holder) from None
                if err.errno in _NO_LOCKS:
                    raise self._in_use(holder, locks=False) from None
                raise
            if not _same_file(fd, self.path):  # its holder removed it as we opened it
                os.close(fd)
                continue
            previous = _read_holder(fd)
            self._hold(fd, me)
            if previous.get("pid") is not None:
                print(
                    f"{self.path}: taking over the lock of pid {previous['pid']} (host "
                    f"{previous.get('host', '?')}), which ended without releasing it",
                    file=sys.stderr,
                )
            return
        raise ConfigError(f"{self.path}: could not take the lock; try again.")

    def _hold(self, fd: int, me: dict[str, Any]) -> None:
        """The lock is ours: say who holds it (or, failing to, leave nothing behind)."""
        self.fd, self.held = fd, True
        try:
            _write_holder(fd, me)
        except BaseException:
            self.release()  # a full disk, say: no lock file that looks held is left
            raise

    def _in_use(self, holder: dict[str, Any], locks: bool = True) -> ConfigError:
        # with locks, a held lock is a live process's (the kernel frees a dead one's): never
        # advise deleting it; without, a killed run leaves its file behind
        gone = (
            ""
            if locks
            else f" If that run is gone, delete {self.path} (this filesystem has no file "
            "locks: a killed run leaves it)."
        )
        return ConfigError(
            f"{self.path.parent} is in use by another run (host {holder.get('host', '?')}, pid "
            f"{holder.get('pid', '?')}, started {_when(holder.get('started'))}); wait for it, "
            f"or choose another hydra.run.dir.{gone}"
        )

    def release(self) -> None:
        self.logs.release(write=False)  # refused (or failed) before it was accepted
        if self.held:
            self.held = False
            # removed while still locked (the next launch locks a new file) -- if it is still
            # this lock's file: one deleted by hand and made again is another run's
            if self.fd is None or _same_file(self.fd, self.path):
                try:
                    self.path.unlink(missing_ok=True)
                except OSError:  # a filesystem gone read-only: the lock is released all the same
                    pass
        if self.fd is not None:
            os.close(self.fd)  # the kernel releases the lock
            self.fd = None


# errno values of a filesystem that does not support POSIX locks
_NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}


def _read_holder(fd: int) -> dict[str, Any]:
    """What a lock file says of its holder ({} while it is being written, or if damaged)."""
    try:
        holder = parse_json(os.pread(fd, 4096, 0))
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _write_holder(fd: int, holder: dict[str, Any]) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder).encode(), 0)


def _same_file(fd: int, path: Path) -> bool:
    try:
        there = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def _when(started: Any) -> str:
    if not isinstance(started, (int, float)):
        return "?"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))


def adopt_logs(source_run: Path, run_dir: Path) -> None:
    """Resuming from another run's directory: start from its logs (its ``best.pt`` is
    :meth:`repro.records.checkpoint.Checkpointer.check_best`'s)."""
    if source_run.resolve() == run_dir.resolve():
        return
    for name in LOG_FILES:
        if (source_run / name).is_file():
            with open(source_run / name, "rb") as source:  # replaced by rename: never a link's
                atomic_write(run_dir / name, lambda f, source=source: shutil.copyfileobj(source, f))


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as JSON, atomically; a value that is not finite is written as ``null``."""
    text = json.dumps(finite_or_null(obj), indent=2, allow_nan=False) + "\n"
    write_file(path, text)


# Errors of a write that more space or a writable filesystem would fix.
DISK_ERRORS = {errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EACCES, errno.EPERM}


def disk_error(err: OSError, run_dir: Path) -> CheckpointError | None:
    """A full, read-only or forbidden disk met at a write, as one line: the path, the free
    space, the last good checkpoint (intact: checkpoints are renamed into place only when
    complete) and the resume command. None for any other error."""
    if err.errno not in DISK_ERRORS:
        return None
    where = Path(err.filename) if err.filename else run_dir
    return CheckpointError(
        f"cannot write {where}: {err.strerror} ({_free(where)} free there); "
        f"{_last_checkpoint(run_dir)}. Free space or make it writable, then resume: the same "
        f"command plus {resume_command(run_dir)}"
    )


def _last_checkpoint(run_dir: Path) -> str:
    """Which checkpoint a resume would start from, as the error of a failed write says it:
    the last one read back and verified (``last_good``), or, where that record could not be
    written (a disk that became read-only), the newest on disk; none only where there is
    none."""
    last = run_dir / CHECKPOINT_DIR / LAST_GOOD
    try:
        good = last.read_text().strip() if last.is_file() else None
    except (OSError, UnicodeDecodeError):
        good = None
    if good and (run_dir / CHECKPOINT_DIR / good).is_file():
        return f"the last good checkpoint is {run_dir / CHECKPOINT_DIR / good}"
    on_disk = list_checkpoints(run_dir)
    if on_disk:
        return f"the newest checkpoint is {on_disk[0][1]} (resume checks it)"
    return "no checkpoint was written yet (a resume starts at step 0)"


def _free(path: Path) -> str:
    for folder in (path, *path.parents):
        try:
            return f"{shutil.disk_usage(folder).free / 2**20:.1f} MiB"
        except OSError:
            continue
    return "unknown"


def check_room(run_dir: Path, state_bytes: int) -> None:
    """Before the first step: the run directory takes a file, and has room for two
    checkpoints (estimated as 3× the model's state: weights and two optimizer moments)."""
    try:
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as err:
        raise CheckpointError(
            f"{run_dir}: cannot write there ({err.strerror}); choose another hydra.run.dir."
        ) from None
    need = 2 * 3 * state_bytes
    free = shutil.disk_usage(run_dir).free
    if free < need:
        raise CheckpointError(
            f"{run_dir}: {free / 2**20:.1f} MiB free, and two checkpoints of this model need "
            f"about {need / 2**20:.1f} MiB; free space or choose another hydra.run.dir."
        )
