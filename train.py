"""Train: `python train.py [group=option ...] [key=value ...]` (see README.md)."""

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from repro.config import check_overrides
from repro.errors import ReproError, exit_with
from repro.loop import train

CONF_DIR = Path(__file__).resolve().parent / "conf"


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float:
    try:
        summary = train(cfg, Path(HydraConfig.get().runtime.output_dir))
    except ReproError as err:
        exit_with(err)
    return summary["val_accuracy"]


if __name__ == "__main__":
    try:
        check_overrides(sys.argv[1:], CONF_DIR)  # one line for a bad value, before Hydra starts
    except ReproError as err:
        exit_with(err)
    main()
