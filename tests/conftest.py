"""Shared helpers: train as a user does (``python train.py``, a subprocess) where a separate
process is the point (kills, signals, re-exec, torchrun, the command line), and in this
process (:func:`train_here`) everywhere else; runs that several tests read are trained once
(session fixtures below)."""

from __future__ import annotations

import csv
import fcntl
import json
import logging
import multiprocessing.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import launch
import repro.tools.testing

ROOT = Path(__file__).resolve().parents[1]
# The runs of a fork's generated tests (repro new: repro.tools.testing) start as this
# suite's do: forked from an interpreter that imported torch once (torchrun and its ranks
# too); the same processes, without the interpreters' starts.
repro.tools.testing.run_process = launch.run
CONF_DIR = ROOT / "conf"
# Strict mode's layer 0 needs these before the interpreter starts, and the in-process runs
# of this suite are strict: pytest re-executes itself once with them, as train.py does.
PINNED = {"PYTHONHASHSEED": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
# And for the whole session (every process it starts inherits it): OpenMP threads that wait
# for work sleep instead of spinning, so that the test workers (`make test` runs pytest-xdist,
# one worker a core and one more) do not burn each other's cores while their runs' threads
# wait. It changes when a thread wakes, not what it computes.
SESSION = {"OMP_WAIT_POLICY": "PASSIVE"}


def pytest_configure(config: pytest.Config) -> None:
    wanted = {**PINNED, **SESSION}
    if all(os.environ.get(k) == v for k, v in wanted.items()):
        return
    if os.environ.get("REPRO_TESTS_REEXECUTED"):
        raise pytest.UsageError(f"tests: {', '.join(wanted)} lost in re-exec")
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.stop_global_capturing()  # give the new process the terminal, not a capture file
    sys.stdout.flush()
    sys.stderr.flush()
    env = {**os.environ, **wanted, "REPRO_TESTS_REEXECUTED": "1"}
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_in_the_session():
    """What this worker and the processes it starts put in the temporary folder (torchrun's
    logs, multiprocessing's sockets, the launcher's output files) goes into a folder of the
    session's, removed as it ends, not into /tmp for good. A short path under the system's:
    a socket's path must fit in 108 bytes (a fork's own test session nests in this one)."""
    folder = tempfile.mkdtemp(prefix="repro-tests-")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = folder
    tempfile.tempdir = None  # read TMPDIR again
    yield
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None
    # removed as this process ends, after multiprocessing has removed its own folder in it
    # (the forkserver's socket; exit priority -100), which would fail if it went first
    multiprocessing.util.Finalize(
        None, shutil.rmtree, args=(folder,), kwargs={"ignore_errors": True}, exitpriority=-1000
    )


# what this process saw as the session began (the cuda marker's skip reads it too)
_SEES_A_GPU = torch.cuda.is_available
_VISIBLE = os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.fixture(scope="session", autouse=True)
def _on_the_cpu():
    """The tests not marked ``cuda`` mean the CPU, on every machine: CI has no GPU, and a
    lab's GPU workstation runs the same tests (``make test``) and must pass them. Their runs
    see no GPU -- ``device=auto`` is the CPU, torchrun's ranks use gloo and ask for no GPU
    each, a digest is compared with another CPU run's -- through ``CUDA_VISIBLE_DEVICES=""``
    for the processes they start and ``torch.cuda.is_available()`` False in this one (whose
    CUDA, if any, started with the session: the variable no longer changes it). Session-wide,
    so that the runs shared through session fixtures are CPU runs too."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        patch.setattr(torch.cuda, "is_available", lambda: False)
        yield


@pytest.fixture(autouse=True)
def _the_gpu_for_cuda_tests(request, monkeypatch):
    """The GPU's own tests (marked ``cuda``; they skip without one) see it, in this process
    and in those they start."""
    if request.node.get_closest_marker("cuda") is not None:
        monkeypatch.setattr(torch.cuda, "is_available", _SEES_A_GPU)
        if _VISIBLE is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", _VISIBLE)


# The longest files first: `make test` gives each xdist worker whole files, in collection
# order, so these start at once instead of finishing alone while the other workers idle
# (test_resume.py is split in two for the same reason: one file of ~490 worker-seconds
# was the suite's tail on the 2-core machine).
LONGEST_FIRST = [  # worker-seconds in a `make test` here, 2026-12-04, before torchrun was forked
    "test_resume.py",  # 354
    "test_dist.py",  # 282
    "test_resume_checkpoints.py",  # 207
    "test_train.py",  # 206
    "test_sweep.py",  # 204
    "test_segmentation.py",  # 165
    "test_scripts.py",  # 148
    "test_config.py",  # 91
    "test_scaffold.py",  # 73
    "test_augment.py",  # 64
    "test_search.py",  # 63
    "test_data.py",  # 56
    "test_determinism.py",  # 55
    "test_verify.py",  # 48
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest as found


# Short runs: 40 steps of the default ConvNet (2 micro-batches a step), evaluated at the end.
SHORT = ["trainer.max_steps=40", "trainer.eval_every=40", "trainer.log_every=10"]
# Smaller data where the property does not need the default 4096/1024 samples (16 steps an
# epoch at batch 64): generation and evaluation take a fraction of the time.
SMALL_DATA = ["data.train_size=1024", "data.val_size=128"]
# The traced short run several test files read (trace digests every 10 steps)
TRACED = [*SHORT, "trainer.trace_every=10", *SMALL_DATA, "model.width=16"]
# A native segmentation run at its smallest (test_native, test_sealed_record): a folder of
# 1-channel images of their own sizes, 3 named classes, 64-px patches, 6 steps
NATIVE = [
    "experiment=segmentation_native",
    "data.num_classes=3",
    "data.channels=1",
    "data.class_names=[background,nucleus,boundary]",
    "data.image_size=64",
    "data.val_fraction=0.3",
    "model.width=8",
    "model.depth=2",
    "trainer.batch_size=8",
    "trainer.micro_batch_size=4",
    "trainer.max_steps=6",
    "trainer.eval_every=3",
    "trainer.checkpoint_every=3",
    "inference.tile_batch=2",
]
# A sweep's job at its smallest (test_sweep, test_search): 6 steps, 512 samples, width 8
TINY = [
    "trainer.max_steps=6",
    "trainer.eval_every=3",
    "data.train_size=512",
    "data.val_size=128",
    "model.width=8",
]


@dataclass
class Run:
    dir: Path
    summary: dict
    output: str  # what the run printed (stdout and stderr, or its log records in-process)
    proc: subprocess.CompletedProcess | None = None  # None: trained in this process

    @property
    def losses(self) -> list[str]:
        """Per-step losses as written (repr of the float: exact)."""
        with open(self.dir / "metrics.csv") as f:
            return [row["loss"] for row in csv.DictReader(f)]

    @property
    def report(self) -> dict:
        return json.loads((self.dir / "determinism.json").read_text())

    @property
    def env(self) -> dict:
        return json.loads((self.dir / "env.json").read_text())

    def entry(self, name: str) -> dict:
        return next(e for e in self.report["entries"] if e["name"] == name)


def user_env(pinned: bool = True, **extra: str) -> dict[str, str]:
    """The environment of a user's shell, CI=true so no progress bar.

    ``pinned``: PYTHONHASHSEED and CUBLAS_WORKSPACE_CONFIG exported as strict mode needs them
    (what a user may do to skip the re-exec), so each run starts one interpreter instead of
    two. ``pinned=False`` leaves them out: train.py must pin them itself by re-executing
    (tests/test_determinism.py checks that path)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (*PINNED, "REPRO_REEXECUTED", "REPRO_TESTS_REEXECUTED")
    }
    if pinned:
        env.update(PINNED)
    env.update(CI="true", PYTHONUNBUFFERED="1", **extra)
    return env


def with_tests_on_path(**extra: str) -> dict[str, str]:
    """:func:`user_env` with tests/ importable (the test models and plug-ins live there)."""
    path = os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    return user_env(PYTHONPATH=path, **extra)


def repro(*args: object, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m repro ARGS`` as a user runs it (forked: tests/launch.py), output captured."""
    return launch.run(
        [sys.executable, "-m", "repro", *map(str, args)],
        capture_output=True,
        text=True,
        env=user_env(),
        cwd=cwd,
    )


def train_cmd(*overrides: str, nproc: int | None = None) -> list[str]:
    """``python train.py ...`` (on one thread: :func:`one_thread`); with ``nproc``, under
    ``torchrun --nproc_per_node=nproc``."""
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        if nproc
        else []
    )
    return [sys.executable, *launcher, str(ROOT / "train.py"), *one_thread(overrides)]


def _chosen(overrides, *keys: str) -> bool:
    return any(o.lstrip("+~").startswith(keys) for o in overrides)


def one_thread(overrides) -> tuple[str, ...]:
    """``overrides`` with ``determinism.cpu_threads=1`` unless they choose the thread count or
    ``determinism=fast`` (PyTorch's own count): every ``python train.py`` a test starts
    (:func:`train_cmd`) and every run it trains in this process.

    Strict's 2 threads on the 2-core CI machine, where the test workers already outnumber the
    cores, make the same run about 1.3 times as long (tests/README.md). A run's bits depend
    on its thread count, and a test compares its runs with each other, so they all use one.
    What two threads in the main process change (per-sample work runs on one thread in
    every process: docs/determinism.md) is test_threads.py's, which chooses them."""
    overrides = tuple(overrides)
    if _chosen(overrides, "determinism.cpu_threads", "determinism=fast"):
        return overrides
    # among the overrides, not before a flag such as -m (argparse takes them in one run)
    at = next((i for i, o in enumerate(overrides) if "=" in o and o[0] != "-"), len(overrides))
    return (*overrides[:at], "determinism.cpu_threads=1", *overrides[at:])


def run_defaults(overrides) -> tuple[str, ...]:
    """What a test's run uses where the test does not say (``run_train``, ``train_here``):
    one thread (:func:`one_thread`) and the main process's loader. The default loader starts
    2 worker processes (about 0.8 s a run here); the bits do not depend on them (test_data,
    test_train, test_resume, test_dist prove it), so a test that does not choose a loader
    loads in the main process."""
    overrides = one_thread(overrides)
    if not _chosen(overrides, "loader"):
        overrides = ("loader=single", *overrides)
    return overrides


def run_train(
    run_dir: Path,
    *overrides: str,
    check: bool = True,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    nproc: int | None = None,
) -> Run:
    """``python train.py hydra.run.dir=RUN_DIR ...`` in a subprocess."""
    overrides = run_defaults(overrides)
    proc = launch.run(
        train_cmd(f"hydra.run.dir={run_dir}", *overrides, nproc=nproc),
        cwd=cwd or run_dir.parent,
        env=env or user_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    summary = json.loads((run_dir / "summary.json").read_text()) if proc.returncode == 0 else {}
    return Run(run_dir, summary, proc.stdout + proc.stderr, proc)


@contextmanager
def preserved_global_state():
    """Put back what a run changes in this process: torch's determinism flags and thread
    count, and the global RNGs."""
    from repro.base.rng import global_rng_states, set_global_rng_states
    from repro.defense.determinism import flags_restored

    rng = global_rng_states()
    try:
        with flags_restored():
            yield
    finally:
        set_global_rng_states(rng)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class Stop(Exception):
    """What :func:`stop_after`'s hook raises: a run stopped in this process at a known step."""


def stop_after(step: int):
    """``train_here(..., after_step=stop_after(N))``: the run stops right after step N (its
    checkpoints up to then written), as a kill would leave it."""

    def hook(done, model):
        if done == step:
            raise Stop

    return hook


def repro_here(*args: object) -> int:
    """The ``repro`` command in this process (its torch flags and RNGs put back after):
    the tools' own wiring, without a process's start."""
    from repro.cli import main

    with preserved_global_state():
        return main([str(a) for a in args])


def train_here(run_dir: Path, *overrides: str, after_step=None, conf_dir: Path = CONF_DIR) -> Run:
    """``repro.engine.loop.train`` in this process, on the config ``train.py`` would compose (no
    Hydra run: no ``.hydra/`` or ``train.log``) from ``conf_dir``. Errors are raised, as the
    exception."""
    from repro.defense.config import compose
    from repro.engine.loop import train

    overrides = run_defaults(overrides)
    cfg = compose(list(overrides), conf_dir)
    logger, records = logging.getLogger("repro"), _Records()
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        with preserved_global_state():
            summary = train(cfg, Path(run_dir), after_step=after_step)
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    return Run(Path(run_dir), summary, "\n".join(records.lines))


@pytest.fixture
def train_run(tmp_path):
    """`train_run("name", *overrides)` -> Run, a subprocess in a fresh directory."""

    def _run(name: str, *overrides: str, **kwargs) -> Run:
        return run_train(tmp_path / name, *overrides, **kwargs)

    return _run


@pytest.fixture(scope="session")
def traced_runs(tmp_path_factory, request):
    """The short traced run (40 steps, strict, main-process loader) trained once for the
    whole suite as a user would (``python train.py``), and beside it, in this process, what
    it must equal or differ from: again, with 2 loader workers, with seed 1. Read, never
    written. Once for the session, not once a pytest-xdist worker: the first worker to need
    them trains them, the others wait on a lock file and read them (about 20 s of the 2-core
    machine each saved)."""
    shared = tmp_path_factory.getbasetemp()
    if hasattr(request.config, "workerinput"):  # an xdist worker (not a pytest it started)
        shared = shared.parent  # the session's: its workers' temporary folders are inside
    record = shared / "traced.json"
    with open(shared / "traced.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not record.is_file():  # a worker that failed to train them left no record
            base = Path(tempfile.mkdtemp(prefix="traced-", dir=shared))
            runs = {
                "a": run_train(base / "a", *TRACED),
                "b": train_here(base / "b", *TRACED),
                "multi": train_here(
                    base / "multi", *TRACED, "loader=multi", "loader.num_workers=2"
                ),
                "seed1": train_here(base / "seed1", *TRACED, "seed=1"),
            }
            record.write_text(json.dumps({k: _as_record(r) for k, r in runs.items()}))
            return runs
    return {k: _from_record(r) for k, r in json.loads(record.read_text()).items()}


def _as_record(run: Run) -> dict:
    proc = run.proc
    done = None if proc is None else [proc.args, proc.returncode, proc.stdout, proc.stderr]
    return {"dir": str(run.dir), "summary": run.summary, "output": run.output, "proc": done}


def _from_record(record: dict) -> Run:
    proc = record["proc"] and subprocess.CompletedProcess(*record["proc"])
    return Run(Path(record["dir"]), record["summary"], record["output"], proc)


def mixed_image_folder(root: Path, corrupt: tuple[str, ...] = ()) -> Path:
    """3 classes of 24 PNG and JPEG files of varied sizes (``corrupt``: file names, in every
    class, whose bytes are not an image)."""
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for c, name in enumerate(["ant", "bee", "cow"]):
        (root / name).mkdir(parents=True)
        for i in range(24):
            h, w = 12 + (i % 5) * 3, 14 + (i % 7) * 2
            pixels = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g)
            pixels[..., c] = 220  # a colour per class: learnable
            path = root / name / f"{i:02d}{'.png' if i % 2 else '.jpg'}"
            Image.fromarray(pixels.numpy()).save(path)
            if path.name in corrupt:
                path.write_bytes(b"not an image")
    return root


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def broken_links(root=ROOT) -> list[str]:
    """Relative links of the README, docs/ and tests/README.md that lead nowhere."""
    docs = [root / "README.md", *sorted((root / "docs").glob("*.md")), root / "tests" / "README.md"]
    broken = []
    for doc in docs:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if (
                not target.startswith(("http://", "https://"))
                and not (doc.parent / target).exists()
            ):
                broken.append(f"{doc.relative_to(root)}: {target}")
    return broken


# what an option needs to compose that its YAML leaves required (???)
NEEDS = {
    "data=image_folder": ["data.path=/tmp"],
    "data=image_mask_folder": ["data.path=/tmp", "data.num_classes=3"],
    "experiment=segmentation_native": ["data.path=/tmp", "data.num_classes=3"],
}


def compose_option(group: str, option: str, conf_dir: Path = CONF_DIR) -> str:
    """Compose and validate one option of ``group`` from ``conf_dir``: "ok", or one line
    saying it was skipped because its ``_target_`` needs an optional package (declared in
    pyproject.toml) that is not installed, or whose import fails (said). A real config error
    raises."""
    from optional import usable
    from repro.base.errors import ConfigError, MissingPackage
    from repro.defense.config import compose

    extra = NEEDS.get(f"{group}={option}", [])
    if group == "hparams_search" and (conf_dir / "experiment" / f"{option}.yaml").is_file():
        extra = [f"experiment={option}"]  # a preset's search runs with that preset
    selected = f"{group}=[{option}]" if group == "logger" else f"{group}={option}"
    try:
        compose([selected, *extra], conf_dir)
    except MissingPackage as err:
        why = usable(err.package)  # installed but broken: say so (a fork's environment)
        broken = f" ({why})" if why and why != "not installed" else ""
        return f"skipped {group}={option}: needs {err.package}{broken}"
    except ConfigError as err:  # a fork's data on its own disk: not on this machine
        if not re.fullmatch(r"config error: data\.path=.* does not exist; .*", str(err)):
            raise
        return f"skipped {group}={option}: its data.path is not on this machine"
    return "ok"


def compose_every_option(group: str, conf_dir: Path = CONF_DIR) -> dict[str, str]:
    """:func:`compose_option` for each option of ``group`` found in ``conf_dir`` (a fork's
    options included): ``{option: "ok" | the skip line}``."""
    options = sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))
    return {option: compose_option(group, option, conf_dir) for option in options}
