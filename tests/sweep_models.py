"""A model whose construction fails for one seed: a sweep job that fails at run time."""

import torch

from repro.models import ConvNet
from repro.rng import derive_seed


class FailsForSeed(ConvNet):
    """The default ConvNet, except that it raises when built for ``fail_seed`` (the loop seeds
    the CPU generator with ``derive_seed(seed, "init")`` right before building the model)."""

    def __init__(self, num_classes, in_channels=3, width=32, dropout=0.1, fail_seed=1):
        if torch.initial_seed() == derive_seed(fail_seed, "init"):
            raise RuntimeError(f"this model refuses seed {fail_seed} (a test of failing jobs)")
        super().__init__(num_classes, in_channels, width, dropout)
