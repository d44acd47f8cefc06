"""What a dataset is to the rest of the run: its splits (in memory, or read when fetched)
and :class:`DataSplits`, which a dataset factory returns; the normalisation statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from repro.base.errors import DataError
from repro.components.data.intensity import clipped_record

# The mask value of pixels that are not scored: unlabelled pixels in a mask (as in Pascal
# VOC) and the border a crop pads in. task=segmentation ignores it (task.ignore_index).
IGNORE = 255


@dataclass
class TensorImages:
    """An in-memory split: ``images`` N×C×H×W, uint8 (divided by 255 on the device) or
    float32 (already the model's input scale: normalised only); ``labels`` the targets:
    class indices (int64, N) or per-pixel class masks (uint8 or int64, N×H×W, the images'
    H×W)."""

    images: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self) -> None:
        if self.images.dtype not in (torch.uint8, torch.float32) or self.images.dim() != 4:
            raise ValueError("images must be a uint8 or float32 tensor of shape N×C×H×W")
        if len(self.images) != len(self.labels):
            raise ValueError("images and labels differ in length")
        if self.labels.dim() == 3:
            if self.labels.shape[1:] != self.images.shape[2:]:
                raise ValueError("masks must have the images' height and width (N×H×W)")
            if self.labels.dtype.is_floating_point or self.labels.dtype == torch.bool:
                raise ValueError("masks must hold class indices (an integer dtype)")
            if self.labels.dtype not in (torch.uint8, torch.int64):
                self.labels = self.labels.to(torch.int64)
        elif self.labels.dim() == 1:
            self.labels = self.labels.to(torch.int64)
        else:
            raise ValueError(
                "targets must be class labels (N) or per-pixel class masks (N×H×W), got "
                f"shape {tuple(self.labels.shape)}"
            )

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def channels(self) -> int:
        return int(self.images.shape[1])

    @property
    def device(self) -> torch.device:
        return self.images.device

    def fetch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The images and targets at ``index`` (int64; on the split's device)."""
        return self.images[index], self.labels[index]

    def to(self, device: torch.device) -> TensorImages:
        return TensorImages(self.images.to(device), self.labels.to(device))


@dataclass
class ImageList:
    """An in-memory split of images of their own sizes (``image_folder`` with
    ``in_memory``): a list of uint8 or float32 C×H×W ``images`` (already mapped by
    ``intensity``, the folder's :class:`repro.components.data.intensity.Intensity`) and their targets
    (class indices N, or a list of H×W masks); ``clipped``: the values each of the first
    :data:`STATISTICS_SAMPLE` images had clipped, and how many it has (by index)."""

    images: list[torch.Tensor]
    labels: torch.Tensor | list[torch.Tensor]
    intensity: Any = None
    clipped: dict[int, tuple[int, int]] = field(default_factory=dict)
    names: list[str] | None = None  # each sample's name in per-sample records (its file)

    def __len__(self) -> int:
        return len(self.images)

    @property
    def channels(self) -> int:
        return int(self.images[0].shape[0])

    device = torch.device("cpu")

    def fetch(self, index: torch.Tensor) -> tuple[list[torch.Tensor], Any]:
        picked = index.tolist()
        images = [self.images[i] for i in picked]
        if isinstance(self.labels, torch.Tensor):
            return images, self.labels[index]
        return images, [self.labels[i] for i in picked]


class Split(Protocol):
    """What a split is to the loader, the evaluation and the trace: :class:`TensorImages`
    and :class:`ImageList` (in memory), :class:`repro.components.data.LazyImages` and
    :class:`repro.components.data.LazyImageMasks` (read when fetched) are four; a split of your own needs
    these members (``to`` for ``loader=device``, ``device`` if it lives on one)."""

    channels: int

    def __len__(self) -> int: ...

    def fetch(self, index: torch.Tensor) -> tuple[Any, Any]:
        """The samples at ``index``: images as the augmentation pipeline takes them, uint8
        (an 8-bit file under ``data.intensity`` auto) or float32 (anything else, already
        mapped) -- N×C×H×W, or a list of C×H×W tensors of their own sizes -- and their
        targets (labels N; masks N×H×W or a list of H×W)."""
        ...


class Augmented:
    """A split seen through a pipeline (:class:`repro.components.data.augment.KeyedPipeline`): what the
    evaluation, the test, ``repro predict`` and the normalisation statistics see of the
    validation, test and training splits (the ``eval`` pipeline, keyed by ``(seed,
    "augment", 0, index)``): images of one size, stacked."""

    def __init__(self, split: Split, pipeline: Any) -> None:
        self.split, self.pipeline = split, pipeline

    def __getattr__(self, name: str) -> Any:  # the split's own members (.files, .masks...)
        if name in ("split", "pipeline"):
            raise AttributeError(name)
        return getattr(self.split, name)

    def __len__(self) -> int:
        return len(self.split)

    @property
    def channels(self) -> int:
        return self.split.channels

    @property
    def device(self) -> torch.device:
        return getattr(self.split, "device", torch.device("cpu"))

    def fetch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples ``index``, read and through the pipeline under its settings (one
        thread, the run's flags: :mod:`repro.components.data.sample_settings`), as a loader
        worker would."""
        with self.pipeline.settings.pinned():
            return self.apply(*self.split.fetch(index), index)

    def apply(self, images: Any, targets: Any, index: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The samples ``index`` as fetched from the split (``images``, ``targets``) through
        the pipeline, keyed by ``(seed, "augment", 0, index)``, stacked."""
        epochs = torch.zeros(1, dtype=torch.int64, device=index.device)
        if self.pipeline.batched(images):
            return self.pipeline.keyed_batch(images, targets, epochs, index)
        return self.pipeline.samples(images, targets, epochs, index)


@dataclass
class DataSplits:
    """What a dataset factory returns: a training and a validation split plus metadata.

    ``image_size``: the side of the square images the model sees (``data.image_size``):
    the ``augment`` pipelines must give it. ``mean``/``std``: the normalisation; computed
    (:meth:`normalisation`) from the first training images through the evaluation pipeline
    when the dataset leaves them None. The augmentation is the ``augment`` config group's,
    attached by :func:`repro.engine.build.build_data` (:meth:`with_augmentation`)."""

    train: Split
    val: Split
    num_classes: int
    augment: Any = None  # gone: the ``augment`` config group chooses the augmentation
    mean: tuple[float, ...] | None = None  # per channel, in [0, 1]
    std: tuple[float, ...] | None = None
    test: Split | None = None  # held out until the end (trainer.test, repro evaluate)
    image_size: int | None = None
    class_names: tuple[str, ...] | None = None  # class i's name (a folder's); None: unnamed
    # data.intensity's rule and the fraction of the values it clipped in the statistics
    # sample (repro.components.data.intensity.clipped_record): set by normalisation(); None: no rule
    intensity: dict[str, Any] | None = None
    # what decided the split besides the config (a folder's file names, its group or split
    # CSV), as digests: repro.components.data.splitting.split_inputs; None: in the config
    split_inputs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.augment is not None:
            raise DataError(
                "data: DataSplits(augment=...) is gone: the augmentation is the augment config "
                "group (augment=crop_flip, none, imagenet...; docs/extending.md#augmentation); "
                "leave it out."
            )
        self.train_pipeline: Any = None  # the augment config's, once attached
        self.eval_pipeline: Any = None
        self.augment_check: Any = (
            None  # what the self-check saw (repro.components.data.pipeline_check)
        )

    @property
    def in_channels(self) -> int:
        return self.train.channels

    def with_augmentation(self, train: Any, evaluation: Any) -> DataSplits:
        """Attach the ``augment`` pipelines (:class:`repro.components.data.augment.KeyedPipeline`): the
        training one for the loader, the evaluation one in front of the validation and test
        splits. Then the normalisation, unless the dataset gave it."""
        self.train_pipeline, self.eval_pipeline = train, evaluation
        self.val = Augmented(self.val, evaluation)
        if self.test is not None:
            self.test = Augmented(self.test, evaluation)
        self.normalisation()
        return self

    def normalisation(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """``(mean, std)``: the dataset's, or computed once from :func:`statistics_sample`
        seen through the evaluation pipeline (so the same in every loader mode). Then the
        :attr:`intensity` record: the training split's ``data.intensity`` rule and the
        fraction of the values it clipped in that sample (its first
        :data:`STATISTICS_SAMPLE` images, read in this process: the same in every loader
        mode, worker count and process)."""
        if self.mean is None or self.std is None:
            sample = statistics_sample(self.train, self.eval_pipeline)
            self.mean, self.std = channel_statistics(sample)
        if self.intensity is None:
            self.intensity = clipped_record(self.train, min(len(self.train), STATISTICS_SAMPLE))
        return self.mean, self.std


# At most this many training images give the normalisation of a split read from disk.
STATISTICS_SAMPLE = 256


def channel_statistics(
    images: torch.Tensor | list[torch.Tensor],
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and standard deviation (at least 1e-3) of N×C×H×W images, or of a
    list of C×H×W images of their own sizes (every pixel counts once): uint8 in [0, 1]
    (divided by 255), float32 as they are -- what the inputs are normalised with."""
    if isinstance(images, torch.Tensor):
        x = _unit(images)
        return tuple(x.mean(dim=(0, 2, 3)).tolist()), tuple(
            x.std(dim=(0, 2, 3)).clamp_min(1e-3).tolist()
        )
    pixels = sum(int(i[0].numel()) for i in images)
    mean = sum(_unit(i).sum(dim=(1, 2)) for i in images) / pixels  # in image order: fixed
    squares = sum(((_unit(i) - mean.view(-1, 1, 1)) ** 2).sum(dim=(1, 2)) for i in images)
    std = (squares / max(pixels - 1, 1)).sqrt().clamp_min(1e-3)
    return tuple(mean.tolist()), tuple(std.tolist())


def _unit(images: torch.Tensor) -> torch.Tensor:
    """float64 images: uint8 ones divided by 255 (into [0, 1]), others as they are."""
    x = images.to(torch.float64)
    return x.div(255) if images.dtype == torch.uint8 else x


def statistics_sample(split: Split, pipeline: Any = None) -> torch.Tensor | list[torch.Tensor]:
    """The images the channel mean and std are computed from: all of a split in memory at
    one size (:class:`TensorImages`); else the first :data:`STATISTICS_SAMPLE` (in file
    order); seen through ``pipeline`` (the evaluation one), if given. Images of several
    sizes (no pipeline to one size: evaluation at each image's own) come as a list."""
    if pipeline is not None and pipeline.pipeline is None:
        pipeline = None  # none at all: the images as they are
    if isinstance(split, TensorImages) and (pipeline is None or pipeline.batched(split.images)):
        index = torch.arange(len(split), device=split.device)
    else:
        index = torch.arange(min(len(split), STATISTICS_SAMPLE))
    if pipeline is not None:
        return Augmented(split, pipeline).fetch(index)[0]
    images = split.fetch(index)[0]
    if isinstance(images, torch.Tensor):
        return images
    return stack_images(images) if len({tuple(i.shape) for i in images}) == 1 else list(images)


def stack_images(images: list[torch.Tensor]) -> torch.Tensor:
    """C×H×W images of one size and dtype stacked into N×C×H×W. uint8 beside float32 (8-bit
    files beside deeper ones under ``data.intensity`` auto) is refused in one line: auto
    gives each depth its own scale (8-bit /255, 16-bit /65535), so the same intensity would
    reach the model as two values; one rule for every file (``fixed``, ``percentile``) maps
    them alike."""
    if len({i.dtype for i in images}) > 1:
        raise DataError(
            "data: 8-bit images beside deeper ones (16-bit, float) under data.intensity.mode="
            "auto, which scales each depth by its own maximum; set data.intensity.mode=fixed "
            "with data.intensity.range=[low,high] (one scale for every file) or percentile."
        )
    return torch.stack(images)
