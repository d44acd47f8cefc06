"""The promise, checked for your own experiment: helpers for a fork's tests.

``repro new NAME`` writes ``tests/test_NAME.py`` with them: the experiment gives the same bits
twice, with loader workers, after a kill and resume, and over two processes. Each run is
``python train.py ...`` in a subprocess, as a user starts it, so a failure reads as theirs::

    from repro.tools.testing import assert_same_bits, train, train_killed

    reference = train(tmp_path / "a", "experiment=mylab", "loader=single")
    assert_same_bits(reference, train(tmp_path / "b", "experiment=mylab", "loader=multi"))

Comparisons are of bits: the weights' SHA-256, every step's loss, gradient norm and learning
rate as written (``metrics.csv``), and the trace (``repro compare``). Runs are compared with
each other, never with a digest written down: another CPU's kernels give other bits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from repro.defense.config import find_conf_dir

# What strict mode needs before the interpreter starts: exported here, so that a run starts
# one interpreter, not two (train.py would re-execute itself to set them).
PINNED = {"PYTHONHASHSEED": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
# Set in the run's environment: the process SIGKILLs itself after that optimizer step.
KILL_AFTER_STEP = "REPRO_FAULT_KILL_AFTER_STEP"
# How a run's process starts (subprocess.run's signature). A suite may put a cheaper one in
# its place: this template's tests/conftest.py forks each run from an interpreter that has
# imported torch once (tests/launch.py), which a fork's tests/ inherits with it.
run_process: Callable[..., subprocess.CompletedProcess] = subprocess.run


@dataclass
class Trained:
    """A finished (or killed) ``train.py`` run: its directory and what it printed."""

    dir: Path
    returncode: int
    output: str

    @property
    def summary(self) -> dict[str, Any]:
        return json.loads((self.dir / "summary.json").read_text())

    @property
    def weights(self) -> str:
        return self.summary["weights_sha256"]

    @property
    def metrics(self) -> str:
        """``metrics.csv`` as written: every step's loss, gradient norm, learning rate."""
        return (self.dir / "metrics.csv").read_text()


def project_root() -> Path:
    """The project whose ``train.py`` runs: the folder holding ``conf/train.yaml`` (the
    current directory's, else the one next to the installed package)."""
    return find_conf_dir().parent


def environment(**extra: str) -> dict[str, str]:
    """This process's environment, with strict mode's variables pinned, no progress bar
    (``CI=true``) and the project's ``src/`` first on ``PYTHONPATH`` (its packages and
    yours import from this checkout)."""
    env = {k: v for k, v in os.environ.items() if k not in ("REPRO_REEXECUTED", KILL_AFTER_STEP)}
    path = [str(project_root() / "src"), env.get("PYTHONPATH", "")]
    env.update(
        PINNED, CI="true", PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(filter(None, path))
    )
    env.update(extra)
    return env


def command(run_dir: Path, *overrides: str, nproc: int | None = None) -> list[str]:
    """``python train.py hydra.run.dir=RUN_DIR ...``; with ``nproc``, under
    ``torchrun --standalone --nproc_per_node=NPROC`` (gloo on CPUs, NCCL on GPUs)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [
        sys.executable,
        *(launcher if nproc else []),
        str(project_root() / "train.py"),
        f"hydra.run.dir={run_dir}",
        *overrides,
    ]


def train(
    run_dir: Path | str,
    *overrides: str,
    nproc: int | None = None,
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> Trained:
    """Train into ``run_dir`` (``python train.py``; ``nproc`` processes under torchrun) and
    return the finished run; a run that fails raises AssertionError with its output."""
    run = _run(Path(run_dir), overrides, nproc, timeout, env or environment())
    if run.returncode != 0:
        raise AssertionError(f"train.py failed (exit {run.returncode}):\n{run.output[-4000:]}")
    return run


def train_killed(run_dir: Path | str, *overrides: str, after: int, timeout: float = 600) -> Trained:
    """Train until optimizer step ``after`` is done, then SIGKILL the process at that exact
    point (it kills itself: no race with a fast run); resume it with
    ``train(run_dir, *overrides, "trainer.resume=auto")``."""
    env = environment(**{KILL_AFTER_STEP: str(after)})
    run = _run(Path(run_dir), overrides, None, timeout, env)
    if run.returncode != -9:
        raise AssertionError(
            f"train.py was to be killed after step {after}, but it ended with exit "
            f"{run.returncode} (does the run have more than {after} steps?):\n{run.output[-4000:]}"
        )
    return run


def _run(
    run_dir: Path, overrides: tuple[str, ...], nproc: int | None, timeout: float, env: dict
) -> Trained:
    proc = run_process(
        command(run_dir, *overrides, nproc=nproc),
        cwd=project_root(),
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Trained(run_dir, proc.returncode, proc.stdout + proc.stderr)


def differences(a: Trained, b: Trained) -> list[str]:
    """What differs between two finished runs' bits, in words; empty when nothing does."""
    from repro.tools.compare import compare_dirs

    found = []
    if a.weights != b.weights:
        found.append(f"final weights: {a.weights} vs {b.weights}")
    if a.metrics != b.metrics:
        found.append("metrics.csv differs (a step's loss, gradient norm or learning rate)")
    result = compare_dirs(a.dir, b.dir)
    if not result.identical:
        found.append(result.text())
    return found


def assert_same_bits(a: Trained, b: Trained) -> None:
    """The two runs are bit-identical: weights, every step's metrics, and the trace."""
    found = differences(a, b)
    assert not found, f"{a.dir} and {b.dir} differ:\n" + "\n".join(found)
