"""The extension points a fork plugs into: models, tasks, data (datasets, splits,
augmentation, loaders), ops and schedules. Each is named by ``_target_`` in conf/;
they import only :mod:`repro.base`, so a new one never needs the engine
(docs/architecture.md, docs/extending.md).
"""
