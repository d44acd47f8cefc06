"""Augmentation pipelines as a forker writes them, plugged in by ``_target_``
(``augment.train._target_=augment_pipelines.DrawsFromEverything``): they know nothing of
keys."""

import random

import numpy as np
import torch

from repro.data.augment import resize_image


class DrawsFromEverything:
    """Draws from the three global generators a user's code reaches for: Python's
    ``random`` (a flip), NumPy's legacy ``np.random`` (a shift) and ``torch.rand`` (noise)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, image, target):
        image = resize_image(image, (self.size, self.size))
        if random.random() < 0.5:
            image = image.flip(-1)
        image = image.roll(int(np.random.randint(0, 4)), dims=1)
        noise = torch.rand(image.shape) * 16
        return (image.float() + noise).clamp(0, 255).to(torch.uint8), target


class PrivateGenerator(DrawsFromEverything):
    """Draws from a generator of its own, made at construction: no key reaches it."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.rng = np.random.default_rng()

    def __call__(self, image, target):
        image = resize_image(image, (self.size, self.size))
        noise = torch.from_numpy(self.rng.integers(0, 16, image.shape, dtype=np.uint8))
        return image.add(noise).clamp(0, 255).to(torch.uint8), target


class Identity:
    def __call__(self, image, target):
        return image, target
