"""The training engine: building a run from its config (:mod:`repro.engine.build`), the loop
(:mod:`repro.engine.loop`), the step and its ordered gradient reduction, the process group,
evaluation, inference, and the doctor that finds the module behind a nondeterministic or
slow op (``repro doctor``; the loop asks it to name the op strict mode refused). Imports
every layer below it (docs/architecture.md).
"""
