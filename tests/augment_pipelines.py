"""Augmentation pipelines as a forker writes them, plugged in by ``_target_``
(``augment.train._target_=augment_pipelines.DrawsFromEverything``): they know nothing of
keys."""

import random

import numpy as np
import torch

from repro.components.data.augment import resize_image


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


# ---- the ways a transform can break the bits that the self-check must see (test_pipeline_check)


class PrivateBehindCoin(DrawsFromEverything):
    """torchvision's ``RandomApply(p=0.3)`` around a private generator: the coin is keyed
    (global ``random``), the noise is not; under a key whose coin is closed nothing shows."""

    def __init__(self, size: int, p: float = 0.3) -> None:
        super().__init__(size)
        self.p, self.rng = p, np.random.default_rng()

    def __call__(self, image, target):
        image = resize_image(image, (self.size, self.size))
        if random.random() < self.p:
            noise = torch.from_numpy(self.rng.integers(0, 16, image.shape, dtype=np.uint8))
            image = image.add(noise).clamp(0, 255).to(torch.uint8)
        return image, target


class PrivateForOneClass(DrawsFromEverything):
    """A private generator drawn from only for the samples of one class (2: not sample 0's)."""

    def __init__(self, size: int, only: int = 2) -> None:
        super().__init__(size)
        self.only, self.rng = only, np.random.default_rng()

    def __call__(self, image, target):
        image = resize_image(image, (self.size, self.size))
        if int(target) == self.only:
            image = image.roll(int(self.rng.integers(0, 4)), dims=-1)
        return image, target


class Cutout:
    """The classic Cutout: zeroes a keyed square of its input, in place."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, image, target):
        y, x = int(np.random.randint(0, 8)), int(np.random.randint(0, 8))
        image[:, y : y + 6, x : x + 6] = 0
        return resize_image(image, (self.size, self.size)), target


class CountsCalls(DrawsFromEverything):
    """A curriculum stepped per call: the flip turns on after the third call of this
    object -- in each loader worker anew, and anew after a resume."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.calls = 0

    def __call__(self, image, target):
        self.calls += 1
        image = resize_image(image, (self.size, self.size))
        return (image.flip(-1) if self.calls > 3 else image), target


class ReadsTheClock(DrawsFromEverything):
    """Flips on odd seconds."""

    def __call__(self, image, target):
        import time

        image = resize_image(image, (self.size, self.size))
        return (image.flip(-1) if int(time.time()) % 2 else image), target


class Raises(DrawsFromEverything):
    """Fails on some inputs (``in_worker``: only in a loader worker, past the check)."""

    def __init__(self, size: int, in_worker: bool = False) -> None:
        super().__init__(size)
        self.in_worker = in_worker

    def __call__(self, image, target):
        if not self.in_worker or torch.utils.data.get_worker_info() is not None:
            raise ValueError(f"cannot cut a {tuple(image.shape)} image")
        return resize_image(image, (self.size, self.size)), target


class ToGray(DrawsFromEverything):
    """Returns one channel of three."""

    def __call__(self, image, target):
        return resize_image(image, (self.size, self.size))[:1], target
