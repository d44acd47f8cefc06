"""What a dataset is to the rest of the run: its splits (in memory, or read when fetched)
and :class:`DataSplits`, which a dataset factory returns; the normalisation statistics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

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


class Split(Protocol):
    """What a split is to the loader, the evaluation and the trace: :class:`TensorImages`
    (in memory) and :class:`LazyImageMasks` (read when fetched) are two; a split of your own
    needs these three members (``to`` for ``loader=device``, ``device`` if it lives on one)."""

    channels: int

    def __len__(self) -> int: ...

    def fetch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 images N×C×H×W and the targets (labels N or masks N×H×W) at ``index``."""
        ...


@dataclass
class DataSplits:
    """What a dataset factory returns: a training and a validation split plus metadata."""

    train: Split
    val: Split
    num_classes: int
    augment: bool = True
    mean: tuple[float, ...] | None = None  # per channel, in [0, 1]; computed from train if None
    std: tuple[float, ...] | None = None
    test: Split | None = None  # held out until the end (trainer.test, repro evaluate)

    def __post_init__(self) -> None:
        if self.mean is None or self.std is None:
            self.mean, self.std = channel_statistics(statistics_sample(self.train))

    @property
    def in_channels(self) -> int:
        return self.train.channels


# At most this many training images give the normalisation of a split read from disk.
STATISTICS_SAMPLE = 256


def channel_statistics(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and standard deviation (at least 1e-3) of uint8 N×C×H×W images, in
    [0, 1]: what the inputs are normalised with."""
    x = images.to(torch.float64).div(255)
    return tuple(x.mean(dim=(0, 2, 3)).tolist()), tuple(
        x.std(dim=(0, 2, 3)).clamp_min(1e-3).tolist()
    )


def statistics_sample(split: Split) -> torch.Tensor:
    """The images the channel mean and std are computed from: all of an in-memory split; the
    first :data:`STATISTICS_SAMPLE` (in file order) of one read from disk (images only)."""
    if isinstance(split, TensorImages):
        return split.images
    index = torch.arange(min(len(split), STATISTICS_SAMPLE))
    fetch_images = getattr(split, "fetch_images", None)  # images without their masks
    return fetch_images(index) if fetch_images is not None else split.fetch(index)[0]
