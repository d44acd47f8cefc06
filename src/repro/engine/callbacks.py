"""Hydra callbacks: what must happen before Hydra creates a run or sweep directory.

``conf/train.yaml`` registers :class:`PrepareRunCallback` under ``hydra.callbacks``: it pins
the process environment (layer 0, :mod:`repro.defense.process_env`: strict mode may re-execute the
process, which it does before torch is imported), validates the config (every job's, for a
sweep) and, under torchrun, has every rank agree on one run directory. A bad value
therefore leaves nothing behind.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from repro.base.errors import ConfigError, JobFailed, ReproError, exit_with
from repro.defense.config import validate, validate_process_settings
from repro.defense.process_env import pin_process_environment, under_torchrun


def validate_sweep_jobs(config: DictConfig) -> None:
    """Compose and validate every job of a sweep the way Hydra's basic sweeper will, so that a
    bad value in any job stops the sweep before its directory exists or a job has run; and
    list the data each job reads from disk once for each distinct ``data`` config
    (:func:`check_sweep_data`): a folder that cannot be a dataset is one line before the
    first job, not the same failure in every job."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not _basic_sweeper(config):
        return  # other sweepers choose their jobs as they go
    loader = GlobalHydra.instance().config_loader()
    parser = OverridesParser.create(config_loader=loader)
    overrides = parser.parse_overrides(list(config.hydra.overrides.task))
    jobs = []
    for batch in BasicSweeper.split_arguments(overrides, None):
        for job in batch:
            try:
                composed = loader.load_sweep_config(config, list(job))
                validate(composed)
            except ConfigError as err:
                raise ConfigError(f"{err} (in the sweep job {' '.join(job)})") from None
            jobs.append((list(job), composed))
    check_sweep_data(jobs)


def check_sweep_data(jobs: list[tuple[list[str], DictConfig]]) -> None:
    """Each distinct ``data`` config of a sweep's jobs that is an image folder
    (``image_folder``, ``image_mask_folder``) built once, lazily (``in_memory`` off: its
    files are listed and split, not read), before the first job: a missing mask, a class
    folder too few, a group CSV without a file's row, a name that is not text is one line
    naming the job. Each job builds its data again, as a run does (the same function: no
    result is carried from here)."""
    from omegaconf import OmegaConf

    from repro.base.errors import DataError
    from repro.engine.build import instantiate_target

    seen: set[str] = set()
    for job, cfg in jobs:
        node = cfg.get("data")
        target = str(node.get("_target_", "")) if isinstance(node, DictConfig) else ""
        if not target.endswith((".image_folder", ".image_mask_folder")):
            continue
        try:
            listed = OmegaConf.to_container(node, resolve=True)
        except Exception:  # an interpolation it cannot resolve: the job says so itself
            continue
        key = repr(sorted(listed.items(), key=str))  # the same data config, listed once
        if key in seen:
            continue
        seen.add(key)
        if "in_memory" in listed:
            listed["in_memory"] = False  # list, do not read
        try:
            instantiate_target(OmegaConf.create(listed), "data")
        except ReproError as err:
            kind = ConfigError if isinstance(err, ConfigError) else DataError
            raise kind(f"{err} (in the sweep job {' '.join(job)})") from None


def _basic_sweeper(config: DictConfig) -> bool:
    return str(config.hydra.sweeper.get("_target_", "")).endswith("BasicSweeper")


# the folders make_output_dir created in this process, the run's (or sweep's) own first
_CREATED: list[Path] = []


def make_output_dir(path: str, key: str) -> None:
    """Create the run's (or sweep's) directory, as Hydra is about to: a read-only
    filesystem, a path under /proc or one longer than the OS allows is then one line naming
    the key, not Hydra's traceback. Called last: a refused config leaves nothing (and a
    launch refused later, before it takes the directory, removes what this made:
    :func:`remove_unused_output_dir`)."""
    target = Path(path)
    missing = [p for p in (target, *target.parents) if not p.exists()]
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(
            f"config error: {key}={path}: cannot be created ({err.strerror}); choose another {key}."
        ) from None
    _CREATED[:] = missing


def remove_unused_output_dir() -> None:
    """A launch refused before it took its run directory (a config that cannot build, a
    run directory that is someone else's): the folders :func:`make_output_dir` created for
    it go again, each only while empty, so a refused launch leaves no trace."""
    for folder in _CREATED:
        try:
            folder.rmdir()
        except OSError:  # not empty (or gone): someone's now; nothing above it is removed
            break
    _CREATED.clear()


_HYDRAS: dict[str, Any] = {}  # Hydra's own JobReturn.return_value, before it is replaced


def quiet_reported_failures(basic_sweeper: bool) -> None:
    """Hydra's sweepers read each job's result through ``JobReturn.return_value``, which for a
    failed job writes "Error executing job with overrides: [...]" before raising its error,
    and Hydra then ends on that error again and a hint about ``HYDRA_FULL_ERROR``. A job of
    this template that fails has already said why in one line (``train.py``) and raises
    :class:`~repro.base.errors.JobFailed`: for that error alone the getter skips the extra line;
    under the basic sweeper (and its joblib and submitit launchers), which reads the results
    once every job of the batch has run and stops at the first failed one, it ends the sweep
    with the error's one line (exit status 1). Other sweepers (Optuna's counts failures
    against its ``max_failure_rate``) get the error to handle. Any other failure keeps
    Hydra's behaviour."""
    from hydra.core.utils import JobReturn, JobStatus

    hydras = _HYDRAS.setdefault("return_value", JobReturn.__dict__.get("return_value"))
    if not isinstance(hydras, property):
        return  # another Hydra than 1.3's: its lines stay

    def return_value(self: JobReturn) -> Any:
        if self.status == JobStatus.FAILED and isinstance(self._return_value, JobFailed):
            if basic_sweeper:
                exit_with(self._return_value)
            raise self._return_value
        return hydras.fget(self)

    JobReturn.return_value = property(return_value, hydras.fset)  # type: ignore[method-assign]


class PrepareRunCallback(Callback):
    """Hydra callback: pin the process environment and validate the config (every job's, for
    a sweep) before Hydra creates any run or sweep directory, so that a bad value leaves
    nothing behind."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            validate_process_settings(config)  # what the re-exec would put in the environment
            pin_process_environment(config.determinism)
            validate(config)
            from repro.engine import dist  # torch: after the re-exec

            # under torchrun: join the process group and agree on one run directory
            world = dist.init(config.dist, dict(config.determinism.nccl_env), str(config.device))
            dist.join_hydra_run(config, world)
            make_output_dir(config.hydra.run.dir, "hydra.run.dir")
        except ReproError as err:
            exit_with(err)
        except Exception:  # Hydra would only warn, and run the job without what failed:
            traceback.print_exc()  # a rank that cannot join its group would then hang
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)  # torchrun sees the failure (and restarts the group, if allowed)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            if under_torchrun():
                raise ConfigError(
                    "a sweep (-m) cannot run under torchrun: start one torchrun per job "
                    "(for s in 0 1 2; do torchrun ... train.py seed=$s; done)."
                )
            validate_process_settings(config)
            pin_process_environment(config.determinism)
            validate(config)
            validate_sweep_jobs(config)
            make_output_dir(config.hydra.sweep.dir, "hydra.sweep.dir")
            quiet_reported_failures(_basic_sweeper(config))
        except ReproError as err:
            exit_with(err)
