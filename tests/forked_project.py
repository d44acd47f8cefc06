"""What a forker writes outside ``src/``: a model that takes ``num_classes`` only (as model-zoo
constructors do) and a task that changes the loss. Plugged in with ``_target_`` overrides:

    python train.py model._target_=forked_project.TinyNet task._target_=forked_project.LabelSmoothing
"""

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from repro.components.tasks import Classification


class TinyNet(nn.Module):
    """Takes ``num_classes`` and its own ``width``; no ``in_channels`` (RGB assumed)."""

    def __init__(self, num_classes: int, width: int = 8) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, stride=2, padding=1), nn.GroupNorm(4, width), nn.ReLU()
        )
        self.head = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.head(self.features(x).mean(dim=(2, 3)))


class LabelSmoothing(Classification):
    """Classification whose loss smooths the targets; the metrics stay the parent's."""

    def __init__(self, smoothing: float = 0.1) -> None:
        self.smoothing = smoothing

    def loss(self, outputs, targets):
        return F.cross_entropy(
            outputs.float(), targets, reduction="sum", label_smoothing=self.smoothing
        )


def zoo_model(*, weights=None, **kwargs):
    """A model-zoo style constructor: everything through ``**kwargs`` (as torchvision's)."""
    if weights is not None:
        raise ValueError("no pretrained weights here")
    return TinyNet(**kwargs)


class NumpyNoiseNet(TinyNet):
    """TinyNet whose input is perturbed with noise from NumPy's *global* RNG, as third-party
    code may draw it: not keyed, so only the seeded and checkpointed global state makes it
    repeat and resume."""

    def forward(self, x):
        noise = np.random.standard_normal(tuple(x.shape[1:])).astype(np.float32)
        return super().forward(x + 0.1 * torch.from_numpy(noise).to(x.device))


class LossHeadline(Classification):
    """Classification led by its loss: what summary.json, repro report and compare
    --tolerance lead with follows the task."""

    headline = "val_loss"
    higher_is_better = False


class MisnamedHeadline(Classification):
    headline = "val_f1"  # not one of Classification's metrics


class UnprefixedMetric(Classification):
    def metrics(self, totals):
        return {**super().metrics(totals), "accuracy": 0.0}


class TinySegNet(nn.Module):
    """A segmentation model that takes ``num_classes`` only: logits N×C×H×W at the input's
    size, for any preset that selects it (``experiment=segmentation model=...``)."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.GroupNorm(4, 8),
            nn.ReLU(),
            nn.Conv2d(8, num_classes, 1),
        )

    def forward(self, x):
        return self.body(x)


class ClassesNet(TinySegNet):
    """A zoo's segmentation constructor that takes its class count as ``classes`` (as
    segmentation_models_pytorch's ``Unet``) and swallows anything else in ``**kwargs``:
    given ``num_classes`` only, it silently has one output channel."""

    def __init__(self, encoder_depth: int = 5, in_channels: int = 3, classes: int = 1, **kwargs):
        super().__init__(classes)


class UnusedNormNet(TinySegNet):
    """A segmentation model with a BatchNorm block its forward never runs (as an encoder
    deeper than the decoder reads: smp's ``encoder_depth`` below 5)."""

    def __init__(self, num_classes: int) -> None:
        super().__init__(num_classes)
        self.deeper = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))
        self.norm = nn.BatchNorm2d(3)

    def forward(self, x):
        return self.body(self.norm(x))
