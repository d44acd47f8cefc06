"""The run's contract: the config schema and its checks (:mod:`repro.defense.config`) and the
four-layer determinism defense they switch on -- process environment, CPU RNGs, GPU
kernels, ops (:mod:`repro.defense.determinism`, :mod:`repro.defense.process_env`).
Imports only :mod:`repro.base` (docs/architecture.md).
"""
