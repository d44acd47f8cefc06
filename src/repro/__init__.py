"""repro: bit-exact reproducible PyTorch training (see README.md).

The package is layered (docs/architecture.md): :mod:`repro.base`, :mod:`repro.defense`,
:mod:`repro.records`, :mod:`repro.components` (the extension points a fork plugs into),
:mod:`repro.engine`, :mod:`repro.tools`, and :mod:`repro.cli` on top.

The modules used to sit side by side in this folder. Their old import paths keep working:
``_target_`` strings in conf/ are part of every config hash (so of every checkpoint written
before the layers), and forks import them. An old path is the moved module itself (not a
copy), so a patch through either name holds. New code imports the new paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.1.0"

# old module -> its home; a package's submodules follow it (repro.data.augment)
MOVED = {
    f"repro.{name}": f"repro.{layer}.{name}"
    for layer, names in {
        "base": ("errors", "files", "rng", "progress", "signals"),
        "defense": ("determinism", "process_env", "config"),
        "records": (
            "rundir", "checkpoint", "trace", "fingerprint", "loggers", "logs",
            "sample_records", "weights", "trust",
        ),
        "components": ("models", "tasks", "ops", "schedules", "data"),
        "engine": (
            "build", "loop", "dist", "reduction", "callbacks", "step", "ema",
            "running_stats", "preemption", "evaluation", "sliding_window", "inference", "doctor",
        ),
        "tools": (
            "compare", "report", "comparisons", "stats", "scaffold", "preview",
            "search", "testing",
        ),
    }.items()
    for name in names
}  # fmt: skip


def _home(name: str) -> str | None:
    """Where the module once imported as ``name`` lives now (None: it did not move)."""
    old = ".".join(name.split(".")[:2])  # repro.data.augment: its package moved
    return MOVED[old] + name[len(old) :] if old in MOVED else None


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old path as the module at its home (:data:`MOVED`)."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        if not name.startswith("repro.") or _home(name) is None:
            return None
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return importlib.import_module(_home(spec.name) or spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing: the module at its home ran when :meth:`create_module` imported it."""


if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
    sys.meta_path.insert(0, _OldPaths())
