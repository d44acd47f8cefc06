"""The base every layer stands on: errors, run files and atomic writes, keyed randomness,
progress, signals, and who this process is among the ranks (:mod:`repro.base.world`).
Imports nothing of repro above it (docs/architecture.md).
"""
