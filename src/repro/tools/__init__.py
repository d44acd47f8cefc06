"""The tools that read runs and sweeps: ``repro compare`` (the first divergent step),
``repro report`` and its statistics, sweeps' confirmation, ``repro new`` (the scaffold),
``repro preview``, and the helpers a fork's generated tests use
(:mod:`repro.tools.testing`). Imports any layer but the command line
(docs/architecture.md).
"""
