"""What a run leaves behind and how it is read back: the run directory, checkpoints, the
per-step trace, the environment fingerprint, metrics loggers, weights digests and the
trust check of a received run directory. Imports :mod:`repro.base` and
:mod:`repro.defense` (docs/architecture.md).
"""
