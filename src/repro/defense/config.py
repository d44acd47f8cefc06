"""The config schema (docs/design.md, principle 5).

Dataclasses stored in Hydra's ``ConfigStore`` sit under the YAML files in ``conf/``: Hydra
checks types and enum choices while composing (``trainer.max_steps=abc`` and
``amp.dtype=int8`` fail there, naming the key), and :func:`validate` checks ranges and
relations (``loader.num_workers=-1``, a batch not divisible by the micro-batch) before
anything runs. Errors are one line naming the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import os
import re
import types
import typing
import uuid
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from repro.base.errors import ConfigError, MissingPackage
from repro.base.files import CHECKOUT_DIR, PACKAGE_DIR


class DeterminismMode(StrEnum):
    strict = "strict"
    fast = "fast"
    warn = "warn"


class AmpDtype(StrEnum):
    bfloat16 = "bfloat16"
    float16 = "float16"


class DistBackend(StrEnum):
    """``auto``: NCCL for CUDA tensors (gloo alongside for small CPU messages), gloo on CPU."""

    auto = "auto"
    nccl = "nccl"
    gloo = "gloo"


class Reduction(StrEnum):
    """How the ranks combine their gradients. ``ordered``: a reduce-scatter that finishes
    the fixed tree shard by shard (the bits do not depend on the world size; about 2x the
    gradient's bytes through each rank). ``ordered_allgather``: every rank gathers every
    partial sum whole and finishes the tree (the same bits; W x the bytes): for comparison.
    ``all_reduce``: one all-reduce, as plain DDP does (repeatable with pinned NCCL settings,
    but 1, 2 and 4 processes differ in the last bits): for measuring what ``ordered`` costs."""

    ordered = "ordered"
    ordered_allgather = "ordered_allgather"
    all_reduce = "all_reduce"


@dataclass
class DeterminismConfig:
    mode: DeterminismMode = DeterminismMode.strict
    # layer 0: the process environment (re-exec once when missing)
    pin_process_env: bool = True
    pythonhashseed: str = "0"
    cublas_workspace_config: str = ":4096:8"
    # layer 1: CPU
    cpu_threads: int | None = 2  # null: leave PyTorch's default (and record it)
    # layer 2: GPU kernels
    deterministic_algorithms: bool = True
    warn_only: bool = False
    cudnn_deterministic: bool = True
    cudnn_benchmark: bool = False
    allow_tf32: bool = False
    fill_uninitialized_memory: bool = False  # (strict.yaml says why)
    # set in every process before NCCL starts (multi-GPU runs; recorded in the report)
    nccl_env: dict[str, str] = field(default_factory=lambda: {"NCCL_NVLS_ENABLE": "0"})


@dataclass
class LoaderConfig:
    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    prefetch_factor: int | None = None
    on_device: bool = False  # keep the training split on the device, augment there
    auto: bool = False  # choose at the run's start: device where it fits on CUDA, else workers
    device_fraction: float = 0.25  # auto: the most of the free GPU memory device may take


@dataclass
class AmpConfig:
    enabled: bool = False
    dtype: AmpDtype = AmpDtype.bfloat16


COMPILE_MODES = ("off", "default", "max-autotune-no-cudagraphs")


@dataclass
class EmaConfig:
    """``trainer.ema``: an exponential moving average of the weights for evaluation."""

    decay: float | None = None  # e.g. 0.999; None: off
    start: int = 0  # up to this step the average is a copy of the weights


@dataclass
class TrainerConfig:
    max_steps: int = 300
    batch_size: int = 64
    micro_batch_size: int = 32
    eval_every: int = 100
    eval_batch_size: int = 256
    log_every: int = 10
    progress: bool = True
    checkpoint_name: str = "checkpoint.pt"
    checkpoint_every: int = 100  # also at the end; 0: only at the end
    keep_checkpoints: int = 2  # the newest N periodic checkpoints, plus the last good one
    resume: str | None = None  # auto (this run directory) | a checkpoint file | a run directory
    resume_force: bool = False  # resume even when config/environment differ (recorded)
    allow_existing_dir: bool = False  # a non-empty directory that is no run (never overwritten)
    on_nonfinite: str = "stop"  # stop | continue: a loss or gradient norm that is inf or nan
    compile: str = "off"  # off | default | max-autotune-no-cudagraphs: torch.compile the model
    channels_last: Any = "auto"  # auto | true | false: model and inputs in channels_last
    trace: bool = True  # write trace.jsonl (repro compare reads it)
    trace_every: int = 50  # digest every state-dict tensor every N steps (0: first/last only)
    ema: EmaConfig = field(default_factory=EmaConfig)  # evaluate an average of the weights
    test: bool = False  # at the end: best.pt (else the final checkpoint) on the test split
    overfit_batch: bool = False  # every step trains on the first step's batch (debug=overfit)


class InferenceMode(StrEnum):
    """``pipeline``: the evaluation pipeline's images, batched (a Resize's segmentation
    logits brought back to each mask's size); ``native``: each image at its own size, whole
    or in tiles (repro.engine.sliding_window)."""

    pipeline = "pipeline"
    native = "native"


@dataclass
class InferenceConfig:
    """How evaluation, the test and ``repro predict`` see an image (segmentation)."""

    mode: InferenceMode = InferenceMode.pipeline
    tile: Any = None  # native: [h, w] (null: data.image_size square, the training patch)
    overlap: float = 0.5  # native: the fraction of a tile its neighbour shares
    sigma: float = 0.125  # native: the Gaussian weight's σ, a fraction of the tile's side
    tile_batch: int = 64  # native: tiles a forward; part of the bits (recorded)
    mirror: bool = False  # native: test-time mirroring (4 forwards a tile, averaged)


@dataclass
class DistConfig:
    """Multi-process runs under ``torchrun`` (one process: ignored)."""

    backend: DistBackend = DistBackend.auto
    reduction: Reduction = Reduction.ordered
    # ordered: exchange each bucket of gradients during the last micro-batch's backward
    # pass, as soon as they are final (false: after it); the same bits either way
    overlap: bool = True
    bucket_mb: float = 25.0  # a bucket's gradient bytes (MiB; the first is at most 1 MiB)
    timeout_s: int = 1800  # a collective waiting longer than this fails the run


@dataclass
class PathsConfig:
    """Where this machine keeps data and writes runs (``conf/paths``)."""

    data_dir: str = "data"
    output_dir: str = "outputs"
    sweep_dir: str = "multirun"


@dataclass
class ReportConfig:
    """How ``repro report`` and ``repro confirm`` judge this config's runs (``report.*``):
    not what a run computes, so not in the config hash, and never a reason to refuse a
    resume or an evaluation."""

    # the smallest difference of the headline that matters (e.g. 0.01 Dice): verdicts
    # become better/worse by more than it, equivalent within ±sesoi, or can't tell
    # (docs/tools.md); null: none given (the report says what the seeds could resolve)
    sesoi: float | None = None


@dataclass
class TrainConfig:
    seed: int = 0
    device: str = "auto"
    determinism: DeterminismConfig = field(default_factory=DeterminismConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    amp: AmpConfig = field(default_factory=AmpConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    # Everything swappable arrives by ``_target_``: any keys, checked against the target's
    # signature in validate() (TARGET_GROUPS).
    model: Any = MISSING
    data: Any = MISSING
    augment: Any = MISSING  # {train, eval}: each a _target_ pipeline (conf/augment/), or null
    task: Any = MISSING
    optim: Any = MISSING  # a _partial_ optimizer (torch.optim.SGD ...), called with the params
    schedule: Any = MISSING  # a _partial_ schedule, called with the optimizer
    # name -> {_target_: a repro.records.loggers.Logger}: where the metrics go (conf/logger/)
    logger: Any = field(default_factory=dict)


def register_configs() -> None:
    """Store the schema; ``conf/train.yaml`` lists it first in its defaults, so every group
    file is merged into a typed node."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def _new_run_id() -> str:
    return f"{os.getpid() % 100000:05d}{uuid.uuid4().hex[:4]}"


def register_resolvers() -> None:
    """``${repro.run_id:}``: a short id, fixed for the whole launch (resolver cache is shared
    with every job of a sweep), distinct between two launches in the same second."""
    if not OmegaConf.has_resolver("repro.run_id"):
        OmegaConf.register_new_resolver("repro.run_id", _new_run_id, use_cache=True)


register_configs()
register_resolvers()


def locate(path: str) -> Any:
    """Import ``package.module.attr`` (the longest importable module prefix, then attributes)."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name is not None and not (
                err.name == module or module.startswith(f"{err.name}.")
            ):
                raise  # the module exists but imports something that does not: say what
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(f"no module named {parts[0]!r} (for {path!r})", name=parts[0])


def _fail(key: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"config error: {key}={value!r} is invalid; allowed: {allowed}.")


def _a_name_in_the_run(key: str, value: Any, example: str) -> None:
    """A file or folder the run writes, named by the config, stays inside its run directory
    and is none of the run's own records: a received run's overrides (``repro rerun``)
    cannot write elsewhere (docs/trust.md). Checked before anything is built."""
    from pathlib import PurePosixPath

    from repro.base.files import RUN_RECORDS

    text = str(value)
    parts = PurePosixPath(text.replace("\\", "/")).parts
    if (
        not parts
        or PurePosixPath(text).is_absolute()
        or text.startswith("~")
        or ".." in parts  # (PurePosixPath drops "." parts; "." alone has none)
        or parts[0] in RUN_RECORDS
    ):
        _fail(
            key,
            value,
            f"a relative name inside the run directory (e.g. {example}): no absolute path, "
            "no '..', none of the run's own records",
        )


def validate(cfg: DictConfig, training_data: bool = True) -> None:
    """Range and relation checks the type system cannot express. Raises :class:`ConfigError`.
    ``training_data`` False: the training data is not read (``repro evaluate --folder``,
    ``repro predict``: the checkpoint carries what they need of it), so ``data.path`` need not
    exist."""
    for group in cfg:
        if group != "hydra" and isinstance(cfg[group], DictConfig):
            for key in sorted(OmegaConf.missing_keys(cfg[group])):  # full keys, e.g. data.path
                raise ConfigError(
                    f"config error: {key} is required (??? in the config); set {key}=..."
                )
    known = {f.name for f in dataclasses.fields(TrainConfig)} | {"hydra", "experiment"}
    for key in cfg:
        if key not in known:
            raise ConfigError(
                f"config error: {key} is not a key of this config (known: "
                f"{', '.join(sorted(known - {'hydra'}))}); check its spelling."
            )
    _validate_finite(OmegaConf.to_container(cfg, resolve=False), "")
    _validate_run(cfg)
    _validate_trainer(cfg.trainer)
    _validate_inference(cfg.inference)
    sesoi = cfg.report.sesoi
    if sesoi is not None and not (math.isfinite(sesoi) and sesoi > 0):
        _fail("report.sesoi", sesoi, "a positive difference of the headline (e.g. 0.01), or null")
    validate_process_settings(cfg)
    for group in TARGET_GROUPS:
        _validate_target(cfg, group)
    _validate_loggers(cfg.get("logger"))
    _validate_augment(cfg)
    _validate_optim(cfg.optim)
    if cfg.schedule.get("warmup_steps", 0) < 0:
        _fail("schedule.warmup_steps", cfg.schedule.warmup_steps, "an integer >= 0")
    if training_data:
        check_data_path(cfg)


def check_data_path(cfg: DictConfig) -> None:
    """``data.path``, where the data has one, is there: a folder for the image folders."""
    if "path" in cfg.data and not Path(str(cfg.data.path)).expanduser().exists():
        raise ConfigError(
            f"config error: data.path={cfg.data.path!r} does not exist; point it at your data."
        )
    folder = str(cfg.data._target_).endswith(("image_folder", "image_mask_folder"))
    if folder and not Path(str(cfg.data.path)).expanduser().is_dir():
        raise ConfigError(
            f"config error: data.path={cfg.data.path!r} is a file; {cfg.data._target_} reads "
            "a folder: point data.path at it."
        )


def _validate_finite(node: Any, prefix: str) -> None:
    """No float key is inf or nan (``optim.lr=inf`` trains on NaN, silently)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if prefix or key != "hydra":
                _validate_finite(value, f"{prefix}{key}.")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _validate_finite(value, f"{prefix}{i}.")
    elif isinstance(node, float) and not math.isfinite(node):
        _fail(prefix.rstrip("."), node, "a finite number")


def _validate_run(cfg: DictConfig) -> None:
    if cfg.seed < 0 or cfg.seed >= 2**63:
        _fail("seed", cfg.seed, "an integer in [0, 2**63)")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", str(cfg.device)):
        _fail("device", cfg.device, "auto, cpu, cuda or cuda:N")
    import torch  # here, not at import: a bad command line is reported before torch loads

    if str(cfg.device).startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"config error: device={cfg.device} but no CUDA device is available; "
            "use device=auto or device=cpu."
        )
    if cfg.dist.timeout_s < 1:
        _fail("dist.timeout_s", cfg.dist.timeout_s, "an integer >= 1 (seconds)")
    if not cfg.dist.bucket_mb > 0:
        _fail("dist.bucket_mb", cfg.dist.bucket_mb, "a number > 0 (MiB)")


# Checkpoints are named by their step in 8 digits (checkpoints/step-00000200.pt).
MAX_STEPS = 99_999_999


def _validate_trainer(t: DictConfig) -> None:
    _a_name_in_the_run("trainer.checkpoint_name", t.checkpoint_name, "checkpoint.pt")
    if not 1 <= t.max_steps <= MAX_STEPS:
        _fail(
            "trainer.max_steps",
            t.max_steps,
            f"an integer from 1 to {MAX_STEPS:,} (checkpoints are numbered with 8 digits)",
        )
    positive = ("batch_size", "micro_batch_size", "eval_every", "eval_batch_size")
    for key in (*positive, "log_every"):
        if t[key] < 1:
            _fail(f"trainer.{key}", t[key], "an integer >= 1")
    if t.checkpoint_every < 0:
        _fail(
            "trainer.checkpoint_every", t.checkpoint_every, "an integer >= 0 (0: at the end only)"
        )
    if t.keep_checkpoints < 1:
        _fail("trainer.keep_checkpoints", t.keep_checkpoints, "an integer >= 1")
    resume = t.resume
    if resume is not None and resume != "auto" and not Path(str(resume)).expanduser().exists():
        raise ConfigError(
            f"config error: trainer.resume={resume!r}: no such checkpoint file or run "
            "directory; give one, or trainer.resume=auto to resume this run directory."
        )
    if t.on_nonfinite not in ("stop", "continue"):
        _fail("trainer.on_nonfinite", t.on_nonfinite, "stop or continue")
    if t.compile in ("reduce-overhead", "max-autotune"):
        raise ConfigError(
            f"config error: trainer.compile={t.compile} records CUDA graphs, which replay into the same "
            "output memory while a step still holds the earlier micro-batches' results; use "
            "default or max-autotune-no-cudagraphs."
        )
    if t.compile not in COMPILE_MODES:
        _fail("trainer.compile", t.compile, " or ".join(COMPILE_MODES))
    if not (isinstance(t.channels_last, bool) or t.channels_last == "auto"):
        _fail("trainer.channels_last", t.channels_last, "auto, true or false")
    if t.trace_every < 0:
        _fail("trainer.trace_every", t.trace_every, "an integer >= 0 (0: initial and final only)")
    if t.ema.decay is not None and not 0 < t.ema.decay < 1:
        _fail("trainer.ema.decay", t.ema.decay, "a number in (0, 1), or null (off)")
    if t.ema.start < 0:
        _fail("trainer.ema.start", t.ema.start, "an integer >= 0")
    if t.batch_size % t.micro_batch_size != 0:
        raise ConfigError(
            f"config error: trainer.batch_size={t.batch_size} is not divisible by "
            f"trainer.micro_batch_size={t.micro_batch_size}; choose a batch size that is a "
            "multiple of the micro-batch size (a step is K equal micro-batches)."
        )


def _validate_inference(i: DictConfig) -> None:
    tile = i.tile
    sides = list(tile) if OmegaConf.is_list(tile) else [tile]
    if tile is not None and not (
        len(sides) in (1, 2) and all(isinstance(t, int) and t >= 1 for t in sides)
    ):
        _fail("inference.tile", tile, "null, or [height, width] in pixels (integers >= 1)")
    if not 0 <= i.overlap < 1:
        _fail("inference.overlap", i.overlap, "a fraction in [0, 1)")
    if not i.sigma > 0:
        _fail("inference.sigma", i.sigma, "a number > 0 (a fraction of the tile's side)")
    if i.tile_batch < 1:
        _fail("inference.tile_batch", i.tile_batch, "an integer >= 1")


def validate_process_settings(cfg: DictConfig) -> None:
    """The loader and determinism values, checked without torch: what layer 0 puts into the
    process environment must be valid before it re-executes the process with it."""
    ld, d = cfg.loader, cfg.determinism
    for name in d.nccl_env:
        if not str(name).startswith("NCCL_"):
            _fail("determinism.nccl_env", name, "names of NCCL_* environment variables")
    if ld.num_workers < 0:
        _fail("loader.num_workers", ld.num_workers, "an integer >= 0 (0 loads in the main process)")
    if ld.on_device and ld.num_workers > 0:
        _fail(
            "loader.num_workers",
            ld.num_workers,
            "0 with loader.on_device=true (the device loads; there are no workers)",
        )
    if not 0 < ld.device_fraction <= 1:
        _fail("loader.device_fraction", ld.device_fraction, "a fraction in (0, 1]")
    if ld.auto and ld.on_device:
        _fail("loader.on_device", ld.on_device, "false with loader=auto (auto chooses it)")
    if ld.prefetch_factor is not None and ld.prefetch_factor < 1:
        _fail("loader.prefetch_factor", ld.prefetch_factor, "null or an integer >= 1")
    if d.cpu_threads is not None and d.cpu_threads < 1:
        _fail("determinism.cpu_threads", d.cpu_threads, "null or an integer >= 1")
    if not re.fullmatch(r"random|\d+", d.pythonhashseed) or (
        d.pythonhashseed != "random" and int(d.pythonhashseed) > 4294967295
    ):
        _fail(
            "determinism.pythonhashseed",
            d.pythonhashseed,
            "'random' or an integer in [0, 4294967295]",
        )
    if d.cublas_workspace_config not in (":4096:8", ":16:8"):
        _fail(
            "determinism.cublas_workspace_config", d.cublas_workspace_config, "':4096:8' or ':16:8'"
        )


# Keys that say how a run was launched, not what it computes (a resumed job records them).
RUN_CONTROL = ("trainer.resume", "trainer.resume_force", "trainer.progress")
# The environment entries (env.json's, summary.json's "environment") that decide the bits:
# a resume across them is refused, a comparison across them is labelled.
RELEVANT_ENVIRONMENT = ("torch", "cuda", "cudnn", "gpu", "gpu_sm_count")
# Where the CPU computes the step, the kernels it dispatches to decide the bits too.
RELEVANT_ON_CPU = ("cpu_capability", "cpu_isa", "cpu_dispatch_limits")

# The groups built by ``_target_``, and the keys the run passes them (repro.engine.build) rather
# than the config: not config keys, so not listed as allowed ones.
TARGET_GROUPS = {
    "model": {"num_classes", "in_channels"},
    "data": set(),
    "task": {"num_classes", "class_names"},
    "optim": {"params"},  # _partial_: called with the model's parameters
    "schedule": {"optimizer", "max_steps"},  # _partial_: called with the optimizer
}
# Keys of a group that the loop reads itself: never passed to the group's _target_.
LOOP_KEYS = {"optim": {"clip_grad_norm"}}
# Fused, foreach and for-loop optimizers are each deterministic but not bit-equal, and
# PyTorch's default choice depends on the device: the config states it.
IMPLEMENTATION_KEYS = ("foreach", "fused")


def _validate_target(cfg: DictConfig, group: str) -> None:
    node = cfg.get(group)
    if not isinstance(node, DictConfig) or "_target_" not in node:
        raise ConfigError(
            f"config error: {group} has no _target_; pick a preset ({group}=...) or give "
            f"{group}._target_=package.module.Factory."
        )
    _check_arguments(group, node, _locate_target(group, str(node._target_)))


def _locate_target(key: str, dotted: str) -> Any:
    """The object a ``_target_`` names, or one line saying it cannot be imported. A package
    that is not installed is :class:`MissingPackage` when ``pyproject.toml`` declares it
    optional (an extra: the tests then skip the option), else a plain config error -- a
    misspelt module looks the same, and is not installed on anyone's advice. An installed
    package whose import raises (a torchvision built for another torch) is named as broken,
    with the exception's own message: no "check the dotted path" that would send the user
    hunting a typo (and :class:`MissingPackage` when optional, so the tests skip it too)."""
    try:
        return locate(dotted)
    except ModuleNotFoundError as err:
        package = (err.name or "").split(".")[0]
        own = (PACKAGE_DIR.parent / package).is_dir()  # src/<package>
        if not package or own or importlib.util.find_spec(package) is not None:
            raise ConfigError(
                f"config error: {key}._target_={dotted!r} cannot be imported "
                f"(ModuleNotFoundError: {err}); check the dotted path."
            ) from None
        declared = optional_packages()
        if package in declared:
            name, extra = declared[package]
            raise MissingPackage(
                f"config error: {key}._target_={dotted!r} needs {name}, an optional package "
                f"(pyproject.toml's {extra!r} extra) that is not installed here: make add "
                f"PKG={name} (beside the installed torch).",
                package,
            ) from None
        raise ConfigError(
            f"config error: {key}._target_={dotted!r} cannot be imported: no module named "
            f"{package!r}; check its spelling, or install the package that provides it (make "
            "add PKG=...) and list it in pyproject.toml's optional-dependencies."
        ) from None
    except Exception as err:
        cause = f"{type(err).__name__}: {_first_line(err)}"
        broken = _failing_import(dotted)
        if broken is None:  # every module of the path imports: a name that is not there
            raise ConfigError(
                f"config error: {key}._target_={dotted!r} cannot be imported ({cause}); "
                "check the dotted path."
            ) from None
        package = broken.split(".")[0]
        name, extra = optional_packages().get(package, (package, None))
        advice = (
            f"its build must match torch's (make add PKG={name} explains)"
            if package in TORCH_BUILT
            else f"reinstall it beside the installed torch (make add PKG={name} checks it imports)"
        )
        fails = "its import fails" if broken == package else f"importing {broken} fails"
        message = (
            f"config error: {key}._target_={dotted!r} cannot be imported ({cause}): {package} "
            f"is installed but {fails}; {advice}."
        )
        if extra is not None:  # an optional package: the tests skip the option, as if absent
            raise MissingPackage(message, package) from None
        raise ConfigError(message) from None


# Packages built against one torch build (their compiled operators): a CPU torch needs their
# +cpu build, a CUDA torch the build for its CUDA.
TORCH_BUILT = ("torchvision", "torchaudio")


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else ""


def _failing_import(dotted: str) -> str | None:
    """The first module of ``dotted`` whose import raises (an installed package that is
    broken: built for another torch, a dependency of the wrong version), or None when each
    imports and the path names something that is not there."""
    parts = dotted.split(".")
    for i in range(1, len(parts) + 1):
        module = ".".join(parts[:i])
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            return None if err.name == module else module
        except Exception:
            return module
    return None


# Distribution names whose import name is another (the rest: "-" becomes "_").
IMPORT_NAMES = {
    "pillow": "PIL",
    "opencv-python": "cv2",
    "opencv-python-headless": "cv2",
    "scikit-learn": "sklearn",
    "scikit-image": "skimage",
    "mlflow-skinny": "mlflow",
    "segmentation-models-pytorch": "segmentation_models_pytorch",
}


def optional_packages() -> dict[str, tuple[str, str]]:
    """``{import name: (distribution, extra)}`` of what this checkout's ``pyproject.toml``
    lists under ``optional-dependencies`` (a fork lists its model zoo there); empty for an
    installed package without its ``pyproject.toml``."""
    import tomllib

    try:
        project = tomllib.loads((CHECKOUT_DIR / "pyproject.toml").read_text()).get("project", {})
    except (OSError, ValueError):
        return {}
    found: dict[str, tuple[str, str]] = {}
    extras = sorted(
        (project.get("optional-dependencies") or {}).items(), key=lambda e: e[0] == "dev"
    )
    for extra, requirements in extras:  # a package's own extra before the dev extra
        for requirement in requirements:
            name = re.split(r"[<>=!~\[ ;]", requirement.strip(), maxsplit=1)[0].lower()
            found.setdefault(IMPORT_NAMES.get(name, name.replace("-", "_")), (name, extra))
    return found


GONE = {
    "data.augment": (
        "data.augment is gone: the augmentation is the augment config group: augment=crop_flip "
        "(the default), augment=none (none at all), imagenet, segmentation, torchvision, or your "
        "own (augment.train._target_=...; docs/extending.md#augmentation)"
    ),
}


def _validate_augment(cfg: DictConfig) -> None:
    """``augment.train`` and ``augment.eval``: each null or an importable ``_target_`` whose
    arguments fit; ``data.augment`` (before the group) is named with its replacement."""
    if "augment" in (cfg.get("data") or {}):
        raise ConfigError(f"config error: {GONE['data.augment']}.")
    node = cfg.get("augment")
    if not isinstance(node, DictConfig) or set(node) - {"train", "eval"}:
        keys = ", ".join(sorted(node)) if isinstance(node, DictConfig) else repr(node)
        raise ConfigError(
            f"config error: augment ({keys}) must hold train and eval pipelines (each a "
            "_target_, or null); pick a preset: augment=crop_flip, none, imagenet, segmentation."
        )
    for part in ("train", "eval"):
        entry = node.get(part)
        if entry is None:
            continue
        if not isinstance(entry, DictConfig) or "_target_" not in entry:
            raise ConfigError(
                f"config error: augment.{part} has no _target_; give "
                f"augment.{part}._target_=package.module.pipeline, or null for none."
            )
        target = _locate_target(f"augment.{part}", str(entry._target_))
        _check_arguments(f"augment.{part}", entry, target)
        for key, dotted in _nested_targets(entry, f"augment.{part}"):
            _locate_target(key, dotted)  # a library's transform: installed and importable


def _nested_targets(node: Any, key: str) -> list[tuple[str, str]]:
    """``(key, _target_)`` of every node inside ``node`` (not ``node`` itself) that names a
    ``_target_``: the transforms a pipeline's list builds (``augment.train.transforms.0``)."""
    found: list[tuple[str, str]] = []
    items: Any = (
        node.items() if isinstance(node, DictConfig) else enumerate(node)
        if isinstance(node, ListConfig) else []
    )  # fmt: skip
    for k, child in items:
        if k == "_target_" or not isinstance(child, DictConfig | ListConfig):
            continue
        if isinstance(child, DictConfig) and "_target_" in child:
            found.append((f"{key}.{k}", str(child._target_)))
        found += _nested_targets(child, f"{key}.{k}")
    return found


# the class every logger subclasses, by name: this layer is below the records (no import)
LOGGER_BASE = "repro.records.loggers.Logger"


def _class_names(cls: type) -> set[str]:
    return {f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__}


def _validate_loggers(node: Any) -> None:
    """Every ``logger`` entry names an importable logger whose arguments fit, and the package
    it needs is installed (else: the ``pip install``), before anything is written."""
    if node is None:
        return
    if not isinstance(node, DictConfig):
        _fail("logger", node, "a choice of conf/logger/ (logger=csv, logger=[csv,tensorboard])")
    for name, entry in node.items():
        if not isinstance(entry, DictConfig) or "_target_" not in entry:
            raise ConfigError(
                f"config error: logger.{name} has no _target_; choose loggers from conf/logger/ "
                "(logger=[csv,tensorboard]), or give logger.{name}._target_=module.YourLogger."
            )
        target = _locate_target(f"logger.{name}", str(entry._target_))
        if not (inspect.isclass(target) and LOGGER_BASE in _class_names(target)):
            raise ConfigError(
                f"config error: logger.{name}._target_={entry._target_!r} is not a subclass "
                "of repro.records.loggers.Logger (docs/extending.md, 'A logger')."
            )
        _check_arguments(f"logger.{name}", entry, target)
        if "subdir" in entry:  # the folder a logger writes into (tensorboard)
            _a_name_in_the_run(f"logger.{name}.subdir", entry.subdir, "tensorboard")
        module, extra = target.requires or (None, None)
        if module is not None and importlib.util.find_spec(module) is None:
            raise MissingPackage(
                f"config error: logger={name} needs the {module} package, which is not "
                f"installed: pip install -e '.[{extra}]' (or leave {name} out of logger=).",
                module,
            )
        arguments = OmegaConf.to_container(entry, resolve=True)
        target(**{k: v for k, v in arguments.items() if not k.startswith("_")})  # its checks


def _validate_optim(o: DictConfig) -> None:
    clip = o.get("clip_grad_norm")
    if clip is not None and (
        isinstance(clip, bool) or not isinstance(clip, int | float) or not clip > 0
    ):
        _fail("optim.clip_grad_norm", clip, "a number > 0, or null (no clipping)")
    if "lr" in o and not o.lr > 0:
        _fail("optim.lr", o.lr, "a number > 0")
    if o.get("weight_decay", 0) < 0:
        _fail("optim.weight_decay", o.weight_decay, "a number >= 0")
    if not 0 <= o.get("momentum", 0) < 1:
        _fail("optim.momentum", o.momentum, "a number in [0, 1)")
    if o.get("nesterov") and o.get("momentum", 0) == 0:
        _fail("optim.nesterov", True, "false when optim.momentum=0 (Nesterov needs momentum)")
    try:
        params = inspect.signature(locate(o._target_)).parameters
    except (TypeError, ValueError):
        return
    if not any(k in params for k in IMPLEMENTATION_KEYS):
        return
    if o.get("fused") and o.get("foreach"):
        raise ConfigError(
            "config error: optim.fused=true with optim.foreach=true; choose one: "
            "optim.fused=true optim.foreach=false, or leave fused out."
        )
    if not o.get("fused") and o.get("foreach") is None:
        raise ConfigError(
            f"config error: optim ({o._target_}) does not pin its implementation; set "
            "optim.foreach=true, optim.fused=true or optim.foreach=false (the for-loop): they "
            "are not bit-equal, and PyTorch's default depends on the device."
        )


def _check_arguments(group: str, node: DictConfig, target: Any) -> None:
    """The keys of a ``_target_`` node against the callable's signature: unknown names, and
    values that do not fit an int/float/bool/str annotation, are named before anything runs."""
    try:
        signature = inspect.signature(target)
        hints = typing.get_type_hints(target.__init__ if inspect.isclass(target) else target)
    except (TypeError, ValueError, NameError):
        return  # not introspectable: leave it to the call
    params = signature.parameters
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    own = [k for k in node if not k.startswith("_") and k not in LOOP_KEYS.get(group, ())]
    unknown = [] if takes_kwargs else [k for k in own if k not in params]
    if unknown:
        # The keys may come from the option's YAML or from a preset's body (experiment=...):
        # deleting each one works wherever it was set.
        passed = TARGET_GROUPS.get(group, set())
        allowed = ", ".join(k for k in params if k not in passed and k != "self") or "none"
        names = ", ".join(f"{group}.{k}" for k in unknown)
        verb = "is not an argument" if len(unknown) == 1 else "are not arguments"
        drop = " ".join(f"'~{group}.{k}'" for k in unknown)
        raise ConfigError(
            f"config error: {names} {verb} of {node._target_}; allowed: {allowed}; drop "
            f"{'it' if len(unknown) == 1 else 'them'} (set by its YAML or a preset): {drop}"
        )
    for key in own:
        value = node[key]
        hint = _checkable(hints.get(key))
        if hint is not None:
            ok, phrase = _accepts(hint, value)
            if not ok:
                _fail(f"{group}.{key}", value, phrase)


_SIMPLE = (int, float, bool, str)


def _checkable(hint: Any) -> Any:
    """The part of an annotation a config value can be checked against: a simple type, or an
    optional one (``float | torch.Tensor`` -> ``float``: a config holds no tensors); None for
    anything else (lists, unions of several kinds), which is left to the call."""
    if hint in _SIMPLE:
        return hint
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return None
    args = typing.get_args(hint)
    simple = [a for a in args if a in _SIMPLE]
    others = [a for a in args if a not in _SIMPLE and a is not type(None)]
    if len(simple) != 1 or not all(
        isinstance(a, type) and a.__module__.startswith("torch") for a in others
    ):
        return None
    return simple[0] | None if type(None) in args else simple[0]


def _unknown_key(key: str) -> tuple[str, list[str]] | None:
    """``(group, its keys)`` when ``key`` names no key of a schema dataclass it goes into
    (``trainer.bogus``); None when it does, or when the schema does not type that part
    (``model.*``, ``determinism.nccl_env.*``)."""
    cls: Any = TrainConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return (".".join(parts[:i]), sorted(hints)) if i else None
        if not dataclasses.is_dataclass(hints[part]):
            return None
        cls = hints[part]
    return None


def _field_type(key: str) -> Any:
    """The schema's type annotation for a dotted key, or None when the schema does not type it
    (``model.*``, ``data.*``, unknown keys: Hydra or :func:`validate` handles those)."""
    cls: Any = TrainConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return None
        if dataclasses.is_dataclass(hints[part]):
            cls = hints[part]
        elif i == len(parts) - 1 and hints[part] is not Any:
            return hints[part]
        else:
            return None
    return None


def _accepts(tp: Any, value: Any) -> tuple[bool, str]:
    """Does a value parsed by Hydra's override grammar fit the annotation? And a phrase for it."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        inner = next(a for a in args if a is not type(None))
        ok, phrase = _accepts(inner, value)
        return ok or value is None, f"null or {phrase}"
    if isinstance(tp, type) and issubclass(tp, Enum):
        return str(value) in tp.__members__, "one of " + ", ".join(tp.__members__)
    if tp is bool:
        return isinstance(value, bool), "true or false"
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), "an integer"
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    if tp is str:  # OmegaConf turns numbers and booleans into their text
        return isinstance(value, (str, int, float, bool)), "a string"
    return True, ""  # lists and the rest: left to OmegaConf


def check_overrides(args: list[str], conf_dir: Path, multirun: bool | None = None) -> None:
    """Check command-line overrides of config groups and schema-typed keys before Hydra
    composes anything, so that ``trainer.max_steps=abc`` or ``determinism=nope`` is one line
    naming the key and what is allowed. Sweeps (``seed=0,1,x``) are checked value by value.
    What this does not recognise is left to Hydra, which reports it in its own words.
    ``multirun``: whether ``train.py`` was given ``-m`` (None: not a command line)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    candidates = [a for a in args if "=" in a and not a.startswith("-")]
    # other config directories can add group options this check does not see
    extra_search_path = any(a.startswith("hydra.searchpath") for a in candidates) or any(
        a.split("=")[0] in ("--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn")
        for a in args
    )
    try:
        overrides = OverridesParser.create().parse_overrides(candidates)
    except Exception:
        return  # a syntax error: Hydra explains it
    if not extra_search_path:
        inspecting = any(a in ("--cfg", "-c", "--info", "--help", "-h") for a in args)
        _check_search(overrides, conf_dir, multirun, inspecting)
    for o in overrides:
        key = o.key_or_group
        if key in GONE:
            raise ConfigError(f"config error: {GONE[key]}.")
        if o.is_delete() or key.startswith("hydra") or "@" in key:
            continue
        if o.is_sweep_override() and not o.is_discrete_sweep():
            continue  # interval sweeps are for the sweeper to expand
        try:
            values = list(o.sweep_iterator()) if o.is_sweep_override() else [o.value()]
        except Exception:
            continue  # glob() and friends need Hydra's config loader: checked per job later
        group_dir = conf_dir / key
        if "." not in key and group_dir.is_dir() and not extra_search_path:
            options = sorted(p.stem for p in group_dir.glob("*.yaml"))
            for v in values:
                chosen = v if isinstance(v, list) else [v]  # logger=[csv,tensorboard]
                for one in chosen:
                    if one is None and key in _optional_groups(conf_dir):
                        continue  # null: none of an optional group (experiment=null)
                    if str(one) not in options:
                        raise ConfigError(
                            f"config error: {key}={one} is not an option; allowed: "
                            f"{', '.join(options)}."
                        )
            continue
        unknown = _unknown_key(key)
        if unknown is not None:
            group, known = unknown
            raise ConfigError(
                f"config error: {key} is not a key of {group} (known: {', '.join(known)}); "
                "check its spelling."
            )
        tp = _field_type(key)
        if tp is None:
            if o.is_add() or o.is_force_add() or extra_search_path:
                continue
            _check_target_key(key, o.input_line or key, args, conf_dir)
            continue
        for v in values:
            ok, phrase = _accepts(tp, v)
            if not ok:
                raise ConfigError(f"config error: {key}={v!r} is invalid; allowed: {phrase}.")


def _optional_groups(conf_dir: Path) -> set[str]:
    """The groups ``train.yaml``'s defaults list leaves empty (``- experiment: null``)."""
    try:
        text = (conf_dir / "train.yaml").read_text()
    except OSError:
        return set()
    return set(re.findall(r"^\s*-\s*(?:optional\s+)?([\w/]+):\s*null\b", text, re.MULTILINE))


# Overrides that choose how a sweep picks its jobs, not what a job computes: a job of a search
# is re-run, evaluated or confirmed without them.
SEARCH_CONTROL = ("hparams_search", "hydra/sweeper", "hydra.sweeper")
SEARCH_PLUGIN = ("hydra-optuna-sweeper", "hydra_plugins.hydra_optuna_sweeper")


def _check_search(
    overrides: list[Any], conf_dir: Path, multirun: bool | None, inspecting: bool = False
) -> None:
    """``hparams_search=NAME``: the sweeper's package is installed, ``-m`` is given (one run
    would ignore the search; ``inspecting``: ``--cfg``, ``--info`` or ``--help`` runs
    nothing), and a search named after a preset runs with some experiment."""
    chosen = {o.key_or_group: o for o in overrides if not o.is_delete()}
    search = chosen.get("hparams_search")
    if search is None or search.is_sweep_override() or search.value() in (None, "null"):
        return
    name = str(search.value())
    if not (conf_dir / "hparams_search" / f"{name}.yaml").is_file():
        return  # not an option: the group check names the allowed ones
    try:
        found = importlib.util.find_spec(SEARCH_PLUGIN[1]) is not None
    except ModuleNotFoundError:  # no hydra_plugins at all
        found = False
    if not found:
        raise MissingPackage(
            f"config error: hparams_search={name} needs Hydra's Optuna sweeper, an optional "
            f"package (pyproject.toml's 'optuna' extra) that is not installed here: make add "
            f"PKG={SEARCH_PLUGIN[0]}.",
            SEARCH_PLUGIN[0],
        )
    if multirun is False and not inspecting:
        raise ConfigError(
            f"config error: hparams_search={name} runs a search of many runs: add -m "
            f"(python train.py -m hparams_search={name} ...)."
        )
    # a preset's search without any experiment: the default run lacks the keys it searches
    # (another experiment may be a variant of the preset's: the user's call)
    if (conf_dir / "experiment" / f"{name}.yaml").is_file() and "experiment" not in chosen:
        raise ConfigError(
            f"config error: hparams_search={name} searches the keys of experiment={name}, "
            f"but the run is the default one: add experiment={name}."
        )


def _check_target_key(key: str, override: str, args: list[str], conf_dir: Path) -> None:
    """``task.gamma=1.0`` where the composed ``task`` has no ``gamma``: one line naming the
    group's target and the ``+`` that adds the key, instead of Hydra's five. A key some YAML of
    the group (or a preset) sets is left to Hydra: this composes only for the others."""
    group, _, name = key.partition(".")
    if "." in name or not (conf_dir / group).is_dir():
        return
    for path in [*(conf_dir / group).glob("*.yaml"), *(conf_dir / "experiment").glob("*.yaml")]:
        try:
            text = path.read_text()
        except OSError:
            continue
        if re.search(rf"^\s*{re.escape(name)}\s*:", text, re.MULTILINE):
            return  # set somewhere: most likely in this run's option too; Hydra has the last word
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    others = [a for a in args if "=" in a and not a.startswith("-") and a != override]
    try:
        with initialize_config_dir(config_dir=str(conf_dir.resolve()), version_base="1.3"):
            node = hydra_compose("train", overrides=others).get(group)
    except (HydraException, OmegaConfBaseException):
        return  # another override is wrong: Hydra names it
    if not isinstance(node, DictConfig) or name in node or "_target_" not in node:
        return
    target = node._target_
    raise ConfigError(
        f"config error: {key} is not a key of {group} ({target}); if {target} takes it, add "
        f"it with a +: +{override}"
    )


def resolved_container(cfg: DictConfig) -> dict[str, Any]:
    """The fully resolved config as plain Python (enums as their names), without ``hydra``."""
    container = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    assert isinstance(container, dict)
    container.pop("hydra", None)
    return container


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (dotted keys, as on the command line)."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


# Config keys that say how runs are judged, not what they compute: left out of the hash.
NOT_HASHED = ("report",)


def config_hash(cfg: DictConfig) -> str:
    """SHA-256 of the resolved config (canonical JSON, sorted keys), less
    :data:`NOT_HASHED`."""
    container = resolved_container(cfg)
    for key in NOT_HASHED:
        container.pop(key, None)
    blob = json.dumps(container, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def find_conf_dir(received: Path | None = None) -> Path:
    """``./conf`` when it holds ``train.yaml``, else the ``conf/`` next to this checkout's
    ``src/`` (an editable install).

    ``received``: a directory a command reads (a received run or sweep), whose sender may
    have put a ``conf/`` (and a ``train.py``) beside it or in it: then this checkout's own
    ``conf/`` comes first, wherever the command is run from (``cd BUNDLE && repro evaluate
    run``, ``cd SWEEP && repro rerun 0``), and a ``conf/`` inside ``received`` -- by its path
    or by where its links lead -- is never the one. ``./conf`` serves only a package
    installed without its checkout."""
    candidates = [Path.cwd() / "conf", CHECKOUT_DIR / "conf"]
    if received is not None:
        candidates.reverse()  # the checkout's own first
    skipped = []
    for candidate in candidates:
        if not (candidate / "train.yaml").is_file():
            continue
        if received is not None and _inside(candidate, Path(received)):
            skipped.append(candidate)
            continue
        return candidate
    if skipped:
        raise ConfigError(
            f"{skipped[0]} is inside {received}, a directory this command reads, and its "
            "conf/ is never used; run the command from your project's root (where its own "
            "conf/train.yaml is)."
        )
    raise ConfigError(
        "no conf/train.yaml found in the current directory or next to the repro package; "
        "run from the project root or pass --config-dir."
    )


def _inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` lies in ``folder``, by their absolute paths or where links lead."""
    absolute = Path(os.path.abspath(path)).is_relative_to(os.path.abspath(folder))
    return absolute or path.resolve().is_relative_to(folder.resolve())


def compose(
    overrides: list[str], conf_dir: Path | None = None, training_data: bool = True
) -> DictConfig:
    """Compose ``train.yaml`` with command-line style overrides, as ``train.py`` would, and
    validate it (``training_data``: see :func:`validate`): for tools that take the training
    overrides (``repro doctor``)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    conf_dir = Path(conf_dir) if conf_dir else find_conf_dir()
    check_overrides(overrides, conf_dir)
    try:
        with initialize_config_dir(config_dir=str(conf_dir.resolve()), version_base="1.3"):
            cfg = hydra_compose("train", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"config error: {first}") from None
    validate(cfg, training_data)
    return cfg
