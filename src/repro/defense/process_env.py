"""Layer 0 of the defense (docs/design.md, principle 2): the process environment.

``PYTHONHASHSEED`` is read only when the interpreter starts, and ``CUBLAS_WORKSPACE_CONFIG``
only when cuBLAS starts: setting ``os.environ`` later changes nothing. So strict (and warn)
mode re-executes the process once with them in place (:func:`pin_process_environment`,
called by the Hydra callback before any run directory exists). This module imports no
torch (only :mod:`repro.base.errors`), so the first interpreter re-executes cheaply;
:mod:`repro.defense.determinism` verifies afterwards that the variables took effect.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from repro.base.errors import DeterminismError
from repro.base.signals import armed

REEXEC_MARKER = "REPRO_REEXECUTED"
TF32_OVERRIDE = "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"
_HASH_PROBE = "repro determinism probe"


def under_torchrun() -> bool:
    """Started by torchrun (or another env:// launcher) with more than one process?"""
    return os.environ.get("WORLD_SIZE", "1") not in ("", "1")


def strict_like(dcfg: Any) -> bool:
    return str(dcfg.mode) in ("strict", "warn")


def required_process_env(dcfg: Any) -> dict[str, str]:
    return {
        "PYTHONHASHSEED": str(dcfg.pythonhashseed),
        "CUBLAS_WORKSPACE_CONFIG": str(dcfg.cublas_workspace_config),
    }


def process_env_missing(dcfg: Any) -> list[str]:
    """Names of the layer-0 variables that are not as strict mode needs them."""
    missing = [k for k, v in required_process_env(dcfg).items() if os.environ.get(k) != v]
    if os.environ.get(TF32_OVERRIDE) == "1" and not dcfg.allow_tf32:
        missing.append(TF32_OVERRIDE)
    return missing


def pin_process_environment(dcfg: Any) -> None:
    """In strict/warn mode, re-execute this process once with the environment it needs
    (``dcfg``: the ``determinism`` config). Must run before torch touches CUDA and before
    any run directory is created."""
    if not (strict_like(dcfg) and dcfg.pin_process_env):
        return
    missing = process_env_missing(dcfg)
    if not missing:
        return
    if os.environ.get(REEXEC_MARKER):
        raise DeterminismError(
            f"determinism: {', '.join(missing)} still not in effect after re-executing; "
            "something resets the environment: export them before starting, or use "
            "determinism=fast."
        )
    env = dict(os.environ)
    env.update(required_process_env(dcfg))
    if not dcfg.allow_tf32:
        env.pop(TF32_OVERRIDE, None)  # it silently turns TF32 on
    env[REEXEC_MARKER] = "1"
    with armed() as signals:  # a notice received so far would be lost in the exec
        signals.stop_before_training()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def hash_seed_in_effect(value: str) -> bool:
    """Does this interpreter hash strings the way one started with PYTHONHASHSEED=value does?

    Setting ``os.environ`` later changes nothing in a running interpreter; this compares the
    hash of a fixed string here with the one a fresh interpreter computes."""
    probe = f"print(hash({_HASH_PROBE!r}))"
    env = {**os.environ, "PYTHONHASHSEED": value}
    out = subprocess.run(
        [sys.executable, "-S", "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    return int(out.stdout) == hash(_HASH_PROBE)
