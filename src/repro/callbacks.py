"""Hydra callbacks: what must happen before Hydra creates a run or sweep directory.

``conf/train.yaml`` registers :class:`PrepareRunCallback` under ``hydra.callbacks``: it pins
the process environment (layer 0, :mod:`repro.process_env`: strict mode may re-execute the
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

from repro.config import validate, validate_process_settings
from repro.errors import ConfigError, ReproError, exit_with
from repro.process_env import pin_process_environment, under_torchrun


def validate_sweep_jobs(config: DictConfig) -> None:
    """Compose and validate every job of a sweep the way Hydra's basic sweeper will, so that a
    bad value in any job stops the sweep before its directory exists or a job has run."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not str(config.hydra.sweeper.get("_target_", "")).endswith("BasicSweeper"):
        return  # other sweepers choose their jobs as they go
    loader = GlobalHydra.instance().config_loader()
    parser = OverridesParser.create(config_loader=loader)
    overrides = parser.parse_overrides(list(config.hydra.overrides.task))
    for batch in BasicSweeper.split_arguments(overrides, None):
        for job in batch:
            try:
                validate(loader.load_sweep_config(config, list(job)))
            except ConfigError as err:
                raise ConfigError(f"{err} (in the sweep job {' '.join(job)})") from None


def make_output_dir(path: str, key: str) -> None:
    """Create the run's (or sweep's) directory, as Hydra is about to: a read-only
    filesystem, a path under /proc or one longer than the OS allows is then one line naming
    the key, not Hydra's traceback. Called last: a refused config leaves nothing."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(
            f"config error: {key}={path}: cannot be created ({err.strerror}); choose another {key}."
        ) from None


class PrepareRunCallback(Callback):
    """Hydra callback: pin the process environment and validate the config (every job's, for
    a sweep) before Hydra creates any run or sweep directory, so that a bad value leaves
    nothing behind."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            validate_process_settings(config)  # what the re-exec would put in the environment
            pin_process_environment(config.determinism)
            validate(config)
            from repro import dist  # torch: after the re-exec

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
        except ReproError as err:
            exit_with(err)
