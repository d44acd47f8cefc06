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
    """Fails on some inputs (``in_worker``: only in the worker of a one-worker loader, past
    the check, whose second pass plays worker 1 of 2)."""

    def __init__(self, size: int, in_worker: bool = False) -> None:
        super().__init__(size)
        self.in_worker = in_worker

    def __call__(self, image, target):
        info = torch.utils.data.get_worker_info()
        if not self.in_worker or (info is not None and info.num_workers == 1):
            raise ValueError(f"cannot cut a {tuple(image.shape)} image")
        return resize_image(image, (self.size, self.size)), target


class ToGray(DrawsFromEverything):
    """Returns one channel of three."""

    def __call__(self, image, target):
        return resize_image(image, (self.size, self.size))[:1], target


# ---- what a worker has and the main process has not (test_pipeline_check, test_threads):
# each flips or shifts its image by something other than the sample and its key


class ReadsTheClockFourTimesASecond(DrawsFromEverything):
    """Flips in every other quarter second: a period that divides a whole-second shift."""

    def __call__(self, image, target):
        import time

        image = resize_image(image, (self.size, self.size))
        return (image.flip(-1) if int(time.time() * 4) % 2 else image), target


class ReadsTheClockWhenBuilt(DrawsFromEverything):
    """Reads the clock once, in ``__init__``: each worker and each resume builds it anew."""

    def __init__(self, size: int) -> None:
        import time

        super().__init__(size)
        self.flip = int(time.time()) % 2

    def __call__(self, image, target):
        image = resize_image(image, (self.size, self.size))
        return (image.flip(-1) if self.flip else image), target


class ReadsTheCalendar(DrawsFromEverything):
    """``time.gmtime()`` or ``time.localtime()`` with no argument: the clock, not through
    ``time.time``."""

    def __init__(self, size: int, local: bool = False) -> None:
        super().__init__(size)
        self.local = local

    def __call__(self, image, target):
        import time

        now = time.localtime() if self.local else time.gmtime()
        image = resize_image(image, (self.size, self.size))
        return (image.flip(-1) if now.tm_sec % 2 else image), target


class ReadsTheProcessId(DrawsFromEverything):
    """Seeds its noise with ``os.getpid()``: another in each loader worker."""

    def __call__(self, image, target):
        import os

        image = resize_image(image, (self.size, self.size))
        g = torch.Generator().manual_seed(os.getpid())
        return image.add(torch.randint(0, 16, image.shape, generator=g).to(image.dtype)), target


class ReadsAnAddress(DrawsFromEverything):
    """Seeds its noise with ``id()`` of its input: where the allocator put it."""

    def __call__(self, image, target):
        image = resize_image(image, (self.size, self.size))
        noise = torch.randint(
            0, 16, image.shape, generator=torch.Generator().manual_seed(id(image))
        )
        return image.add(noise.to(image.dtype)), target


class KeysByTensor(DrawsFromEverything):
    """Looks a factor up in a dict keyed by a tensor made at construction (a tensor hashes by
    identity): deterministic, and must pass."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.key = torch.tensor([1.0])
        self.table = {self.key: 2}

    def __call__(self, image, target):
        image = resize_image(image, (self.size, self.size))
        return image.flip(-1) if self.table[self.key] == 2 else image, target


class ReadsTheWorkerId(DrawsFromEverything):
    """Shifts by the loader worker's number (0 in the main process)."""

    def __call__(self, image, target):
        info = torch.utils.data.get_worker_info()
        image = resize_image(image, (self.size, self.size))
        return image.roll(1 + info.id if info is not None else 0, dims=-1), target


class UsesNumpysThreads(DrawsFromEverything):
    """Multiplies a matrix made of its image by itself in NumPy, whose BLAS (OpenBLAS)
    runs on threads of its own, beyond torch's thread count."""

    def __call__(self, image, target):
        image = resize_image(image, (self.size, self.size))
        m = np.resize(image.double().numpy(), (384, 384))
        m.dot(m)
        return image, target


class Standardises:
    """A per-image z-score in torch, a float32 image in and out: two reductions over the whole
    image (its mean and standard deviation), as a user writes one."""

    def __call__(self, image, target):
        x = image.float()
        return (x - x.mean()) / x.std().clamp_min(1e-6), target


class ReadsItsSettings:
    """Writes what its arithmetic runs under into its image's first row: torch's thread count,
    the deterministic-algorithms flag and its warn_only, fill_uninitialized_memory, CPU
    autocast, the default dtype and device, the float32 matmul precision."""

    def __call__(self, image, target):
        image = image.float().clone()
        seen = [
            torch.get_num_threads(),
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.utils.deterministic.fill_uninitialized_memory,
            torch.is_autocast_enabled("cpu"),
            torch.get_default_dtype() == torch.float32,
            torch.get_default_device().type == "cpu",
            torch.get_float32_matmul_precision() == "highest",
        ]
        image[0, 0, : len(seen)] = torch.tensor([float(v) for v in seen])
        return image, target
