"""Errors a user can cause. Each message is one sentence naming the key or file and what to do.

They derive from Hydra's ``CompactHydraException`` so that, raised under ``train.py``, Hydra
prints the message alone (no traceback) and exits 1; ``repro`` subcommands do the same.
"""

from __future__ import annotations

from hydra.errors import CompactHydraException


class ReproError(CompactHydraException):
    """Base class: a problem the user can fix, reported as one line."""


class ConfigError(ReproError):
    """A bad config value."""


class DeterminismError(ReproError):
    """A determinism requirement that is not in effect."""


class DataError(ReproError):
    """A dataset that cannot be read or built."""
