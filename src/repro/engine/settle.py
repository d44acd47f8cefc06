"""Every ``auto`` of a run, settled in one place (docs/architecture.md).

A config may leave four things to the machine: ``device=auto``, ``dist.backend=auto``,
``trainer.channels_last=auto`` and ``loader=auto`` (which loader, and how many workers).
The device and the backend are settled with the world when the run starts
(:func:`resolve_device`; the process group and the determinism flags need them before
anything is built). The rest need the data, the model (on the CPU, where its initial
weights are drawn) and the free GPU memory, so :func:`settle` runs once those exist and
before anything is hashed, moved or trained, and returns the values with the reasons the
determinism report prints. Nothing downstream decides again: the loop, the step, the
loader and the records read :class:`Settled`.

Of the settled values only those that decide the bits enter the config that is hashed,
recorded and compared on a resume (:meth:`Settled.recorded`): the memory format (other
kernels, other bits). The loader and its worker count do not (every loader gives the same
bits), nor does the free GPU memory behind the choice, so a resume on a busier GPU is not
refused. The device's type is part of the run's identity beside the config.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from torch import nn

from repro.base.world import World, device_for
from repro.components.data import DataSplits, KeyedPipeline


@dataclass(frozen=True)
class Settled:
    """A run's ``auto`` values, settled (:func:`settle`), and why each."""

    device: torch.device
    channels_last: bool
    loader: LoaderChoice
    memory_format: tuple[str, str]  # the determinism report's value and note

    def recorded(self, cfg: DictConfig) -> DictConfig:
        """``cfg`` with the settled values that decide the bits in place of ``auto``: what
        the run hashes, records and compares on a resume."""
        return record_channels_last(cfg, self.channels_last)


def settle(cfg: DictConfig, device: torch.device, data: DataSplits, model: nn.Module) -> Settled:
    """Settle what ``cfg`` left to the machine, once: the memory format for ``model`` (built,
    not yet moved) on ``device``, and the loader for ``data`` with the free GPU memory that
    the model will not take."""
    channels_last = uses_channels_last(cfg.trainer.get("channels_last", False), model, device)
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return Settled(
        device=device,
        channels_last=channels_last,
        loader=choose_loader(cfg, data, device, reserved=model_bytes),
        memory_format=memory_format_row(cfg.trainer.channels_last, channels_last, device),
    )


def resolve_device(name: str, world: World | None = None) -> torch.device:
    """``auto`` -> cuda when available, else cpu (``validate`` has checked the others); under
    torchrun, rank r's GPU is ``cuda:LOCAL_RANK``."""
    return device_for(name, world or World())


def uses_channels_last(setting: Any, model: nn.Module, device: torch.device) -> bool:
    """``trainer.channels_last``: true or false as set; ``auto``: on for a CUDA run of a
    model with 2-D convolutions (cuDNN's NHWC kernels, faster there: docs/speed.md), off
    elsewhere: on a CPU, and for a model without a Conv2d, whose kernels the format would
    not change. Another format is other kernels, other bits: the value chosen is recorded in
    the run's config before its hash (:meth:`repro.engine.loop.Run.resolved`)."""
    if setting == "auto":
        return device.type == "cuda" and any(isinstance(m, nn.Conv2d) for m in model.modules())
    return bool(setting)


def record_channels_last(cfg: DictConfig, channels_last: bool) -> DictConfig:
    """``cfg`` with ``trainer.channels_last=auto`` replaced by the format the model was built
    in (a copy; ``cfg`` itself when it names one): what a run records, hashes and compares
    on a resume, so an ``auto`` run and one that set the same format are one config."""
    if cfg.trainer.channels_last != "auto":
        return cfg
    cfg = copy.deepcopy(cfg)
    with read_write(cfg), open_dict(cfg):
        cfg.trainer.channels_last = channels_last
    return cfg


def memory_format_row(setting: Any, channels_last: bool, device: torch.device) -> tuple[str, str]:
    """The determinism report's value and note for the memory format a model was built in."""
    value = "channels_last" if channels_last else "contiguous"
    if setting != "auto":
        return value, "model and inputs; the two formats use other kernels" if channels_last else ""
    if channels_last:
        return value, "auto: a CUDA run of a model with 2-D convolutions; other kernels, other bits"
    return value, "auto: not on CUDA" if device.type != "cuda" else "auto: no 2-D convolution"


# loader=auto on CUDA, images read per sample: workers between these (a core per local GPU
# less 2; ResNet-50 from JPEGs on one H200 with 16 cores: 12 fed it, 14 and 16 were slower;
# conf/loader/auto.yaml)
AUTO_WORKERS = (2, 12)


@dataclass
class LoaderChoice:
    """The loader a run uses (``loader=auto`` resolved): its name, its settings, and why."""

    name: str  # device | multi | single
    cfg: DictConfig  # loader.* as used
    why: str


def choose_loader(
    cfg: DictConfig, data: DataSplits, device: torch.device, reserved: int = 0
) -> LoaderChoice:
    """``loader=auto``: ``device`` on CUDA when the training split is in memory, its
    augmentation runs on the device, and the split with its augmented copy takes at most
    ``loader.device_fraction`` of the free GPU memory; else ``multi`` (on CUDA with workers
    for the host's cores: :data:`AUTO_WORKERS`). Any other loader is itself. The same bits
    either way."""
    ld = cfg.loader
    if not ld.get("auto", False):
        name = "device" if ld.on_device else "multi" if int(ld.num_workers) > 0 else "single"
        return LoaderChoice(name, ld, f"loader={name}, as configured")
    chosen = OmegaConf.to_container(ld)
    why = _device_loader_fits(ld, data, device, reserved)
    if why.startswith("fits"):
        chosen.update(on_device=True, num_workers=0, pin_memory=False)
        chosen.update(persistent_workers=False, prefetch_factor=None)
        return LoaderChoice("device", OmegaConf.create(chosen), f"auto: {why}")
    if device.type == "cuda":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        per_gpu = (cores or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        chosen["num_workers"] = max(AUTO_WORKERS[0], min(AUTO_WORKERS[1], per_gpu - 2))
        why += f"; {chosen['num_workers']} workers for {per_gpu} CPU cores a GPU"
    else:
        why += f" ({chosen['num_workers']} workers)"
    return LoaderChoice("multi", OmegaConf.create(chosen), f"auto: {why}")


def _device_loader_fits(
    ld: DictConfig, data: DataSplits, device: torch.device, reserved: int = 0
) -> str:
    """ "fits: ..." when ``loader=device`` can hold this training split, else why not
    (``reserved``: bytes of the free GPU memory already spoken for: the model's)."""
    if device.type != "cuda":
        return f"multi on {device.type}"
    split = data.train
    if not isinstance(getattr(split, "images", None), torch.Tensor):
        return "multi: the training split is read from disk per sample"
    pipeline = data.train_pipeline or KeyedPipeline(None, 0)
    if not pipeline.device_capable:
        return f"multi: augment.train ({pipeline.name}) runs sample by sample on the host"
    size = pipeline.size or int(split.images.shape[-1])
    per_sample = (  # bytes: uint8 or float32 images
        split.images.shape[1] * size * size * split.images.element_size()
        + split.labels[:1].numel() * 8
    )
    need = 2 * len(split) * per_sample  # the split and its augmented copy, each epoch
    free = torch.cuda.mem_get_info(device)[0] - reserved
    limit = float(ld.device_fraction) * free
    gib = 2.0**30
    sizes = f"{need / gib:.2f} GiB of {float(ld.device_fraction):g} x {free / gib:.1f} GiB free"
    if need > limit:
        return f"multi: the training split on the device would take {sizes}"
    return f"fits: the training split and its augmented copy take {sizes}"
