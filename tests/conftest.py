"""Shared helpers: run `train.py` as a user would (a subprocess), read what it wrote."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "conf"

# Short runs: 40 steps of the default ConvNet (2 micro-batches a step), evaluated at the end.
SHORT = ["trainer.max_steps=40", "trainer.eval_every=40", "trainer.log_every=10"]


@dataclass
class Run:
    dir: Path
    summary: dict
    proc: subprocess.CompletedProcess

    @property
    def losses(self) -> list[str]:
        """Per-step losses as written (repr of the float: exact)."""
        with open(self.dir / "metrics.csv") as f:
            return [row["loss"] for row in csv.DictReader(f)]

    @property
    def report(self) -> dict:
        return json.loads((self.dir / "determinism.json").read_text())

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
        if k not in ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG", "REPRO_REEXECUTED")
    }
    if pinned:
        env.update(PYTHONHASHSEED="0", CUBLAS_WORKSPACE_CONFIG=":4096:8")
    env.update(CI="true", PYTHONUNBUFFERED="1", **extra)
    return env


def train_cmd(*overrides: str, nproc: int | None = None) -> list[str]:
    """``python train.py ...``; with ``nproc``, under ``torchrun --nproc_per_node=nproc``."""
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        if nproc
        else []
    )
    return [sys.executable, *launcher, str(ROOT / "train.py"), *overrides]


def run_train(
    run_dir: Path,
    *overrides: str,
    check: bool = True,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    nproc: int | None = None,
) -> Run:
    if not any(o.startswith(("loader=", "+loader=", "~loader")) for o in overrides):
        # The default loader starts 2 worker processes (about 0.8 s a run here); the bits do
        # not depend on them (test_data, test_train, test_resume, test_dist prove it), so a
        # test that does not choose a loader loads in the main process.
        overrides = ("loader=single", *overrides)
    proc = subprocess.run(
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
    return Run(run_dir, summary, proc)


@pytest.fixture
def train_run(tmp_path):
    """`train_run("name", *overrides)` -> Run, in a fresh directory under tmp_path."""

    def _run(name: str, *overrides: str, **kwargs) -> Run:
        return run_train(tmp_path / name, *overrides, **kwargs)

    return _run


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
