"""What a dataset is to the rest of the run: its splits (in memory, or read when fetched)
and :class:`DataSplits`, which a dataset factory returns; the normalisation statistics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from repro.errors import DataError

# The mask value of pixels that are not scored: unlabelled pixels in a mask (as in Pascal
# VOC) and the border a crop pads in. task=segmentation ignores it (task.ignore_index).
IGNORE = 255


@dataclass
class TensorImages:
    """An in-memory split: ``images`` uint8 N×C×H×W; ``labels`` the targets: class indices
    (int64, N) or per-pixel class masks (uint8 or int64, N×H×W, the images' H×W)."""

    images: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.dim() != 4:
            raise ValueError("images must be a uint8 tensor of shape N×C×H×W")
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
    ``in_memory``): a list of uint8 C×H×W ``images`` and their targets (class indices N, or
    a list of H×W masks)."""

    images: list[torch.Tensor]
    labels: torch.Tensor | list[torch.Tensor]

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
    and :class:`ImageList` (in memory), :class:`repro.data.LazyImages` and
    :class:`repro.data.LazyImageMasks` (read when fetched) are four; a split of your own needs
    these members (``to`` for ``loader=device``, ``device`` if it lives on one)."""

    channels: int

    def __len__(self) -> int: ...

    def fetch(self, index: torch.Tensor) -> tuple[Any, Any]:
        """The samples at ``index``: uint8 images (N×C×H×W, or a list of C×H×W tensors of
        their own sizes) and their targets (labels N; masks N×H×W or a list of H×W)."""
        ...


class Augmented:
    """A split seen through a pipeline (:class:`repro.data.augment.KeyedPipeline`): what the
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
        images, targets = self.split.fetch(index)
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
    attached by :func:`repro.build.build_data` (:meth:`with_augmentation`)."""

    train: Split
    val: Split
    num_classes: int
    augment: Any = None  # gone: the ``augment`` config group chooses the augmentation
    mean: tuple[float, ...] | None = None  # per channel, in [0, 1]
    std: tuple[float, ...] | None = None
    test: Split | None = None  # held out until the end (trainer.test, repro evaluate)
    image_size: int | None = None
    class_names: tuple[str, ...] | None = None  # class i's name (a folder's); None: unnamed

    def __post_init__(self) -> None:
        if self.augment is not None:
            raise DataError(
                "data: DataSplits(augment=...) is gone: the augmentation is the augment config "
                "group (augment=crop_flip, none, imagenet...; docs/extending.md#augmentation); "
                "leave it out."
            )
        self.train_pipeline: Any = None  # the augment config's, once attached
        self.eval_pipeline: Any = None

    @property
    def in_channels(self) -> int:
        return self.train.channels

    def with_augmentation(self, train: Any, evaluation: Any) -> DataSplits:
        """Attach the ``augment`` pipelines (:class:`repro.data.augment.KeyedPipeline`): the
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
        seen through the evaluation pipeline (so the same in every loader mode)."""
        if self.mean is None or self.std is None:
            sample = statistics_sample(self.train, self.eval_pipeline)
            self.mean, self.std = channel_statistics(sample)
        return self.mean, self.std


# At most this many training images give the normalisation of a split read from disk.
STATISTICS_SAMPLE = 256


def channel_statistics(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and standard deviation (at least 1e-3) of uint8 N×C×H×W images, in
    [0, 1]: what the inputs are normalised with."""
    x = images.to(torch.float64).div(255)
    return tuple(x.mean(dim=(0, 2, 3)).tolist()), tuple(
        x.std(dim=(0, 2, 3)).clamp_min(1e-3).tolist()
    )


def statistics_sample(split: Split, pipeline: Any = None) -> torch.Tensor:
    """The images the channel mean and std are computed from: all of a split in memory at
    one size (:class:`TensorImages`); else the first :data:`STATISTICS_SAMPLE` (in file
    order); seen through ``pipeline`` (the evaluation one), if given."""
    if isinstance(split, TensorImages) and (pipeline is None or pipeline.batched(split.images)):
        index = torch.arange(len(split), device=split.device)
    else:
        index = torch.arange(min(len(split), STATISTICS_SAMPLE))
    if pipeline is not None:
        return Augmented(split, pipeline).fetch(index)[0]
    images = split.fetch(index)[0]
    return images if isinstance(images, torch.Tensor) else torch.stack(images)
