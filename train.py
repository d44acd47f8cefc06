"""Train: `python train.py [group=option ...] [key=value ...]` (see README.md)."""

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import repro.config  # noqa: F401  (registers the schema and resolvers before Hydra composes)
from repro.determinism import exit_with
from repro.errors import ReproError
from repro.loop import train


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float:
    try:
        summary = train(cfg, Path(HydraConfig.get().runtime.output_dir))
    except ReproError as err:
        exit_with(err)
    return summary["val_accuracy"]


if __name__ == "__main__":
    main()
