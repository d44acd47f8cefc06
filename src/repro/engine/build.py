"""Build what a run trains from the config: data, model, task, optimizer, schedule, precision.

Everything swappable arrives by ``_target_`` (``conf/data``, ``conf/model``, ``conf/task``,
``conf/optim``, ``conf/schedule``). A target receives its own config keys plus, from what
the run already knows, only the keys its signature takes (:func:`instantiate_target`):

- ``model``: ``num_classes`` and ``in_channels`` (from the dataset);
- ``task``: ``num_classes`` and ``class_names`` (the data's, when it names its classes);
- ``schedule``: ``max_steps``.

A key the config sets itself is not overridden. A target that takes ``**kwargs`` gets
``num_classes`` (torchvision's and timm's model constructors take it that way) but not
``in_channels``, whose name differs between model zoos (timm: ``in_chans``): set it in the
YAML. So a zoo model is a one-line YAML, ``_target_: torchvision.models.resnet18``.

The loop, ``repro doctor`` and the scripts build through here, never through the loop.
"""

from __future__ import annotations

import functools
import inspect
import logging
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from repro.base.errors import ConfigError, DataError, ReproError
from repro.base.rng import derive_seed
from repro.base.world import World, barrier
from repro.components.data import (
    DataSplits,
    DeviceBatches,
    InProcessBatches,
    KeyedPipeline,
    make_train_loader,
)
from repro.components.data.pipeline_check import check_pipelines
from repro.components.tasks import Task
from repro.defense.config import LOOP_KEYS, locate
from repro.engine.ema import WeightAverage
from repro.engine.running_stats import RunningStats
from repro.engine.settle import Settled, choose_loader, uses_channels_last
from repro.engine.sliding_window import Window
from repro.records.weights import recording_weights

# Passed into a target's **kwargs when its signature does not name the key.
THROUGH_KWARGS = {"num_classes"}

log = logging.getLogger("repro")


def accepted(target: Any, available: dict[str, Any], explicit: set[str]) -> dict[str, Any]:
    """The entries of ``available`` that ``target``'s signature takes and the config does not
    set itself (see the module docstring)."""
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):  # not introspectable: pass what is not set explicitly
        return {k: v for k, v in available.items() if k not in explicit}
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    return {
        k: v
        for k, v in available.items()
        if k not in explicit and (k in params or (takes_kwargs and k in THROUGH_KWARGS))
    }


def instantiate_target(node: DictConfig, group: str, **available: Any) -> Any:
    """``hydra.utils.instantiate`` of a ``_target_`` node, with the ``available`` keys its
    signature accepts; a failure is one line naming the group."""
    explicit = {str(k) for k in node if not str(k).startswith("_")}
    try:
        target = locate(str(node._target_))
        return instantiate(node, _convert_="all", **accepted(target, available, explicit))
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, ReproError):
            raise cause from None
        detail = f"{type(cause).__name__}: {cause}" if cause else str(err)
        raise ConfigError(
            f"{group}._target_={node._target_!r} could not be built ({detail.splitlines()[0]}); "
            f"check the {group}.* keys against its signature."
        ) from err


def build_data(cfg: DictConfig, world: World | None = None) -> DataSplits:
    """The dataset; under torchrun rank 0 builds it first (a download, say), then the others
    read what it left."""
    world = world or World()
    if not world.main:
        barrier(world)
    data = instantiate_target(cfg.data, "data")
    if world.main:
        barrier(world)
    batch = int(cfg.trainer.batch_size)
    if len(data.train) < batch:  # here, before the run directory is touched
        raise DataError(
            f"the training split has {len(data.train)} samples, fewer than "
            f"trainer.batch_size={batch}; lower the batch size or use more data."
        )
    if cfg.trainer.test and getattr(data, "test", None) is None:
        raise ConfigError(
            f"trainer.test=true, but data ({cfg.data._target_}) has no test split; give it "
            "one (data.test_size for the synthetic sets, data.test_fraction for image_folder), "
            "or set trainer.test=false."
        )
    return build_augmentation(cfg, data)


def build_augmentation(cfg: DictConfig, data: DataSplits) -> DataSplits:
    """The ``augment`` group's pipelines, keyed by the training seed, attached to ``data``
    (the training one for the loader, the evaluation one in front of the validation and
    test splits), and checked before anything is written: each built afresh for each pass
    of :func:`repro.components.data.pipeline_check.check_pipelines` (several samples and keys, two
    orders, two clock times, of ``data.image_size``), as every loader worker and every
    resume builds it."""
    native = str(cfg.get("inference", {}).get("mode", "pipeline")) == "native"
    if native and not _gives_masks(data.val):
        raise ConfigError(
            "config error: inference.mode=native evaluates and predicts per-pixel masks at "
            "each image's own size; this data gives class labels: use inference.mode=pipeline."
        )
    make_train = functools.partial(keyed_pipeline, cfg, "train")
    make_eval = functools.partial(keyed_pipeline, cfg, "eval")
    data.augment_check = check_pipelines(
        make_train, make_eval, data.train, data.val, data.image_size, native=native
    )
    return data.with_augmentation(make_train(), make_eval())


def keyed_pipeline(cfg: DictConfig, part: str) -> KeyedPipeline:
    """The ``augment`` group's ``part`` (``train`` or ``eval``), built afresh and keyed by the
    training seed: what each loader worker, each resume and each scoring of a checkpoint
    builds (no part: the images as they are)."""
    node = cfg.get("augment") or {}
    built = instantiate_target(node[part], f"augment.{part}") if node.get(part) else None
    return KeyedPipeline(built, int(cfg.seed), f"augment.{part}")


def _gives_masks(split: Any) -> bool:
    target = split.fetch(torch.tensor([0]))[1][0]
    return isinstance(target, torch.Tensor) and target.dim() == 2


def build_model(cfg: DictConfig, data: DataSplits, device: torch.device) -> nn.Module:
    """:func:`build_model_and_weights`'s model."""
    return build_model_and_weights(cfg, data, device)[0]


def build_model_and_weights(
    cfg: DictConfig, data: DataSplits, device: torch.device
) -> tuple[nn.Module, list[dict[str, Any]]]:
    """For the tools: :func:`instantiate_model`, then :func:`place_model` in the memory
    format ``trainer.channels_last`` asks for on ``device`` (a run places its model in the
    settled format: :func:`build_training`)."""
    model, weights = instantiate_model(cfg, data)
    t = cfg.get("trainer") or {}
    channels_last = uses_channels_last(t.get("channels_last", False), model, device)
    return place_model(model, cfg, device, channels_last), weights


def instantiate_model(cfg: DictConfig, data: DataSplits) -> tuple[nn.Module, list[dict[str, Any]]]:
    """Instantiate ``cfg.model`` on the CPU with the generator keyed by ``(seed, "init")``, so
    the initial weights are the same on every device. Returns the model and the weights files
    its construction read (pretrained weights: part of the bits;
    :func:`repro.records.weights.recording_weights`)."""
    # (a class count that is not the data's stops the run at the pre-check: check_task)
    if "in_channels" in cfg.model and cfg.model.in_channels != data.in_channels:
        log.warning(
            "model.in_channels=%s but the data (%s) has %s: the model's YAML wins; leave "
            "in_channels out of it to follow the data.",
            cfg.model.in_channels, cfg.data._target_, data.in_channels,
        )  # fmt: skip
    with torch.random.fork_rng(devices=[]):  # CPU generator only; restored afterwards
        torch.default_generator.manual_seed(derive_seed(int(cfg.seed), "init"))
        with recording_weights() as weights:
            model = instantiate_target(
                cfg.model, "model", num_classes=data.num_classes, in_channels=data.in_channels
            )
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model._target_={cfg.model._target_!r} returned a {type(model).__name__}, not a "
            "torch.nn.Module; point it at a model class or a function that returns one."
        )
    return model, weights


def place_model(
    model: nn.Module, cfg: DictConfig, device: torch.device, channels_last: bool
) -> nn.Module:
    """Move ``model`` to ``device`` (``channels_last``: in that memory format) and, with
    ``trainer.compile``, compile it: with static shapes, so that a micro-batch's kernels do
    not depend on which shapes were seen before (an evaluation's, a resume's)."""
    t = cfg.get("trainer") or {}
    model = model.to(device, memory_format=_memory_format(channels_last))
    mode = str(t.get("compile", "off"))
    if mode != "off":  # in place: the state dict keeps its keys
        model.compile(mode=None if mode == "default" else mode, dynamic=False)
    return model


# Constructor arguments model zoos take the class count by, instead of num_classes.
CLASS_COUNT_NAMES = (
    "classes",  # segmentation_models_pytorch
    "out_channels",  # MONAI
    "num_labels",  # transformers
    "n_classes",
    "num_class",
    "nclass",
    "out_classes",
    "num_outputs",
    "output_channels",
)


def class_count_problem(model_cfg: DictConfig, got: int, num_classes: int) -> str | None:
    """None when the model's outputs have one channel a class; else one line saying which
    constructor argument of ``model._target_`` probably wanted the class count (its
    signature's, from :data:`CLASS_COUNT_NAMES`), or that the model's last layer must give
    ``num_classes`` outputs. A zoo that takes ``**kwargs`` swallows ``num_classes`` without
    a word (smp's ``Unet`` wants ``classes``): its model has the default count."""
    if got == num_classes:
        return None
    dotted = str(model_cfg.get("_target_", "?"))
    head = (
        f"config error: model._target_={dotted!r} gives {got} output channel(s) a sample, the "
        f"data has {num_classes} classes"
    )
    try:
        params = inspect.signature(locate(dotted)).parameters
    except Exception:  # not introspectable: no name to suggest
        params = {}
    for name in CLASS_COUNT_NAMES:
        if name in params and name != "num_classes":
            if name in model_cfg:
                return (
                    f"{head}: model.{name}={model_cfg[name]} in its YAML; set it to "
                    f"${{data.num_classes}} (or leave num_classes to the data)."
                )
            return (
                f"{head}: its constructor takes the count as {name!r}, not num_classes; add "
                f"{name}: ${{data.num_classes}} to its YAML (or +model.{name}={num_classes})."
            )
    if "num_classes" in model_cfg:
        return f"{head}: model.num_classes={model_cfg.num_classes} in its YAML; leave it out."
    return (
        f"{head}: make its last layer give num_classes outputs (its constructor takes no "
        "argument the count could go to)."
    )


def _memory_format(channels_last: bool) -> torch.memory_format:
    return torch.channels_last if channels_last else torch.preserve_format


def build_task(cfg: DictConfig, data: DataSplits) -> Task:
    names = list(data.class_names) if data.class_names else None
    task = instantiate_target(cfg.task, "task", num_classes=data.num_classes, class_names=names)
    missing = [m for m in ("loss", "statistics", "metrics") if not callable(getattr(task, m, None))]
    if missing or not isinstance(getattr(task, "headline", None), str):
        raise ConfigError(
            f"task._target_={cfg.task._target_!r} is not a task (it lacks "
            f"{', '.join(missing) or 'headline'}); subclass repro.components.tasks.Task."
        )
    return task


def build_optimizer(cfg: DictConfig, model: nn.Module) -> torch.optim.Optimizer:
    """``cfg.optim`` is a ``_partial_`` target (``torch.optim.SGD`` ...) called with the
    trainable parameters."""
    node = cfg.optim
    loop_keys = LOOP_KEYS["optim"] & set(node)
    if loop_keys:  # read by the step, not arguments of the optimizer
        kept = OmegaConf.to_container(node, resolve=True)
        node = OmegaConf.create({k: v for k, v in kept.items() if k not in loop_keys})
    make = instantiate_target(node, "optim")
    return _call(make, "optim", model.parameters())


def build_schedule(cfg: DictConfig, optimizer: torch.optim.Optimizer) -> Any:
    """``cfg.schedule`` is a ``_partial_`` target called with the optimizer."""
    make = instantiate_target(cfg.schedule, "schedule", max_steps=int(cfg.trainer.max_steps))
    return _call(make, "schedule", optimizer)


def _call(make: Any, group: str, *args: Any) -> Any:
    """Call a ``_partial_`` target; what it raises is one line naming the group."""
    try:
        return make(*args)
    except (TypeError, ValueError, RuntimeError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        target = getattr(make, "func", make)
        name = f"{target.__module__}.{getattr(target, '__qualname__', target)}"
        raise ConfigError(
            f"{group}: {name} refused its settings ({type(err).__name__}: {first}); check "
            f"the {group}.* keys."
        ) from err


def build_loader(
    cfg: DictConfig,
    data: DataSplits,
    device: torch.device,
    start_step: int = 0,
    shard: tuple[int, int] | None = None,
    loader: DictConfig | None = None,
) -> torch.utils.data.DataLoader | InProcessBatches | DeviceBatches:
    """The training micro-batches from global step ``start_step`` on (``loader``: the
    settings :func:`choose_loader` chose, by default those of ``cfg.loader`` resolved; this
    rank's ``shard=(first, count)`` of each step under torchrun)."""
    loader = loader if loader is not None else choose_loader(cfg, data, device).cfg
    return make_train_loader(
        data,
        int(cfg.seed),
        int(cfg.trainer.batch_size),
        int(cfg.trainer.micro_batch_size),
        loader,
        pin_memory=bool(loader.pin_memory) and device.type == "cuda",
        start_step=start_step,
        shard=shard,
        device=device,
        overfit_batch=bool(cfg.trainer.overfit_batch),
    )


class Precision:
    """The AMP policy (layer 4): off (fp32), bf16 autocast, or fp16 autocast with a
    GradScaler (its state is saved in checkpoints)."""

    def __init__(self, amp: DictConfig, device: torch.device) -> None:
        self.enabled = bool(amp.enabled)
        self.dtype = torch.float16 if str(amp.dtype) == "float16" else torch.bfloat16
        self.device_type = device.type
        fp16 = self.enabled and self.dtype == torch.float16
        self.scaler = torch.amp.GradScaler(device.type, enabled=fp16)

    def autocast(self) -> AbstractContextManager:
        """The forward's autocast region; nothing at all when AMP is off (the loop runs
        outside any autocast region, so there is none to turn off)."""
        if not self.enabled:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)


@dataclass
class Training:
    """What a step needs, built from the config (:func:`build_training`)."""

    model: nn.Module
    task: Task
    optimizer: torch.optim.Optimizer
    schedule: Any  # a torch.optim.lr_scheduler.LRScheduler
    precision: Precision
    running_stats: RunningStats  # BatchNorm buffers, folded in micro-batch order
    seed: int  # the training seed (forward randomness is keyed by it)
    batch_size: int  # the global batch B: each micro-batch's summed loss is divided by it
    clip_grad_norm: float | None = None  # optim.clip_grad_norm: the global norm's limit
    ema: WeightAverage | None = None  # trainer.ema: the weights evaluations see
    channels_last: bool = False  # the model's memory format, so the inputs' (trainer.channels_last)
    window: Window = field(default_factory=Window)  # inference.*: how evaluation sees an image
    # the weights files the model's construction read ({path, sha256, bytes}): part of the bits
    pretrained_weights: list[dict[str, Any]] = field(default_factory=list)

    def evaluated_weights(self) -> AbstractContextManager:
        """Inside: the weights evaluations see -- the average with ``trainer.ema``, else the
        model's own."""
        return self.ema.applied() if self.ema is not None else nullcontext()

    @functools.cached_property
    def parameters(self) -> list[nn.Parameter]:
        """The model's parameters in ``model.parameters()`` order, listed once: walking the
        module tree again every step is host time a GPU step waits for."""
        return list(self.model.parameters())


def build_training(
    cfg: DictConfig,
    data: DataSplits,
    device: torch.device | Settled,
    built: tuple[nn.Module, list[dict[str, Any]]] | None = None,
) -> Training:
    """What a step needs. A run passes its :class:`repro.engine.settle.Settled` values and
    the model :func:`instantiate_model` built for them (``built``: the model, on the CPU, and
    the weights files it read); a tool passes a device, and the memory format is the one
    ``trainer.channels_last`` asks for there."""
    model, weights = built or instantiate_model(cfg, data)
    if isinstance(device, Settled):
        channels_last, device = device.channels_last, device.device
    else:
        channels_last = uses_channels_last(cfg.trainer.channels_last, model, device)
    model = place_model(model, cfg, device, channels_last)
    optimizer = build_optimizer(cfg, model)
    return Training(
        model=model,
        task=build_task(cfg, data),
        optimizer=optimizer,
        schedule=build_schedule(cfg, optimizer),
        precision=Precision(cfg.amp, device),
        running_stats=RunningStats(model),
        seed=int(cfg.seed),
        batch_size=int(cfg.trainer.batch_size),
        clip_grad_norm=_optional_float(cfg.optim.get("clip_grad_norm")),
        ema=_weight_average(cfg.trainer.ema, model),
        channels_last=channels_last,
        window=Window.from_config(cfg.get("inference"), data.image_size),
        pretrained_weights=weights,
    )


def _weight_average(ema: DictConfig, model: nn.Module) -> WeightAverage | None:
    return None if ema.decay is None else WeightAverage(model, ema.decay, ema.start)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
