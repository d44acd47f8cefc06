"""The resumable keyed sampler, the micro-batches it keys, and the loaders: worker
processes (the DataLoader), the main process, or the device (:class:`DeviceBatches`)."""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from repro.base.errors import ConfigError, DataError, ReproError
from repro.base.rng import keyed_generator, keyed_permutation, worker_init_fn
from repro.components.data.augment import KeyedPipeline, Resize
from repro.components.data.sample_settings import pinned_here
from repro.components.data.splits import DataSplits, Split, TensorImages, stack_images


class KeyedBatches(Dataset):
    """Fetches a whole micro-batch by its keys ``(epoch, index)``: one fetch of the samples,
    then the training pipeline keyed by ``(seed, "augment", epoch, index)``
    (:class:`repro.components.data.augment.KeyedPipeline`): one vectorised call for a batch the
    pipeline can take whole (the default crop and flip), else sample by sample. The same
    sample in the same epoch gets the same augmentation in any worker, any process, after
    any restart, and in any batch. Works where the split is: on the CPU for the
    DataLoader, on the GPU for ``loader=device``."""

    def __init__(self, split: Split, pipeline: KeyedPipeline) -> None:
        self.split, self.pipeline = split, pipeline

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, keys: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        epochs, index = torch.tensor(keys, dtype=torch.int64).view(-1, 2).unbind(1)
        return self.fetch(epochs, index)

    def fetch(self, epochs: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples ``index`` (int64, on the split's device) in ``epochs`` (the same
        length, or one element), read and augmented under the pipeline's
        :class:`~repro.components.data.sample_settings.SampleSettings` (one thread, the run's
        flags) in whichever process fetches them: the same bits in a worker and here."""
        with self.pipeline.settings.pinned():
            images, targets = self.split.fetch(index)
            if self.pipeline.batched(images):
                return self.pipeline.keyed_batch(images, targets, epochs, index)
            return self.pipeline.samples(images, targets, epochs, index)


class KeyedBatchSampler:
    """Yields micro-batches of keys ``(epoch, index)``, forever, from global step ``start_step``.

    Step s covers positions ``[p*B, (p+1)*B)`` of epoch e's permutation (``e, p =
    divmod(s, steps_per_epoch)``), keyed by ``(seed, "order", e)``; the tail of an epoch that
    does not fill a global batch is dropped. Each step is split into K = B/m micro-batches.
    Where a step's samples come from is a pure function of the step: resuming is starting
    at another ``start_step``. ``shard=(first, count)`` yields only micro-batches ``first ...
    first + count - 1`` of each step: a process's share under torchrun (no sample is padded
    or repeated; the shares partition the global batch).
    """

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        micro_batch_size: int,
        seed: int,
        start_step: int = 0,
        shard: tuple[int, int] | None = None,
        same_step: bool = False,
    ) -> None:
        if dataset_size < batch_size:
            raise DataError(
                f"the training split has {dataset_size} samples, fewer than "
                f"trainer.batch_size={batch_size}; lower the batch size or use more data."
            )
        self.n, self.batch_size, self.micro = dataset_size, batch_size, micro_batch_size
        self.seed, self.start_step = seed, start_step
        self.first, self.count = shard or (0, batch_size // micro_batch_size)
        self.steps_per_epoch = dataset_size // batch_size
        self.same_step = same_step  # every step is step 0 (trainer.overfit_batch)
        self._cached_epoch, self._cached_perm = -1, []

    def step_keys(self, step: int) -> list[tuple[int, int]]:
        epoch, pos = divmod(0 if self.same_step else step, self.steps_per_epoch)
        perm = self._permutation(epoch)
        return [(epoch, i) for i in perm[pos * self.batch_size : (pos + 1) * self.batch_size]]

    def _permutation(self, epoch: int) -> list[int]:
        if self._cached_epoch != epoch:
            self._cached_epoch = epoch
            self._cached_perm = keyed_permutation(self.n, self.seed, "order", epoch).tolist()
        return self._cached_perm

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        step = self.start_step
        while True:
            keys = self.step_keys(step)
            for k in range(self.first, self.first + self.count):
                yield keys[k * self.micro : (k + 1) * self.micro]
            step += 1

    def index_tensors(self, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The same micro-batches as ``iter(self)``, as ``(epoch, indices)`` int64 tensors
        on ``device`` (a slice of the epoch's permutation, copied there once an epoch)."""
        step, held = self.start_step, (-1, None, None)
        while True:
            epoch, pos = divmod(0 if self.same_step else step, self.steps_per_epoch)
            if held[0] != epoch:
                perm = keyed_permutation(self.n, self.seed, "order", epoch).to(device)
                held = (epoch, perm, torch.tensor([epoch], dtype=torch.int64, device=device))
            _, perm, epoch_tensor = held
            start = pos * self.batch_size
            for k in range(self.first, self.first + self.count):
                a = start + k * self.micro
                yield epoch_tensor, perm[a : a + self.micro]
            step += 1


class InProcessBatches:
    """``loader.num_workers=0`` (``loader=single``): the micro-batches fetched in this process
    -- what a DataLoader without workers does, the same :meth:`KeyedBatches.fetch` of the
    same keys (pinned for the copy to a GPU, as its ``pin_memory`` does) -- without the
    DataLoader's per-batch machinery, which cost a small model's step more than the fetch
    (about 30 us of 55 on the 2-core CPU)."""

    def __init__(self, batches: KeyedBatches, sampler: KeyedBatchSampler, pin_memory: bool) -> None:
        self.batches, self.sampler, self.pin_memory = batches, sampler, pin_memory

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for epoch, index in self.sampler.index_tensors(torch.device("cpu")):
            images, targets = self.batches.fetch(epoch, index)
            if self.pin_memory:
                images, targets = images.pin_memory(), targets.pin_memory()
            yield images, targets


class DeviceBatches:
    """``loader=device``: the training split lives on the device and every micro-batch is
    cut there, with no worker processes: the same keys, draws and bytes as the DataLoader
    path (:meth:`KeyedBatches.fetch`), so the choice of loader cannot change the bits.

    At each epoch's start the whole split is cropped and flipped with that epoch's draws
    (:meth:`KeyedBatches.fetch` over all of it, in chunks), into one augmented copy of the
    split on the device; a micro-batch is then a slice of the epoch's permutation and one
    gather of its images and targets. The crop is pure data movement, so augmenting a
    sample with the epoch or with its micro-batch gives the same bytes; what changes is
    the work on the host, which the loop's step waits for on a fast GPU: two launches a
    micro-batch instead of a dozen. The cost is device memory for that copy (the split's
    size again)."""

    # at most this many bytes of gather indices (int64, one per output pixel) per chunk of
    # the epoch's crop: bounds the transient memory of augmenting a large split
    CHUNK_BYTES = 1 << 27

    def __init__(self, batches: KeyedBatches, sampler: KeyedBatchSampler) -> None:
        self.batches, self.sampler = batches, sampler

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        device = getattr(self.batches.split, "device", torch.device("cpu"))
        held: tuple[torch.Tensor | None, Any] = (None, None)
        for epoch, index in self.sampler.index_tensors(device):
            if held[0] is not epoch:  # a new epoch (index_tensors makes one tensor an epoch)
                held = images = targets = None  # the last epoch's copy goes first
                held = (epoch, self.augmented(epoch, device))
            images, targets = held[1]
            yield images[index], targets[index]

    def augmented(self, epoch: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The whole split as the epoch ``epoch`` sees it: augmented with its draws (or as
        stored, without augmentation)."""
        b = self.batches
        every = torch.arange(len(b.split), device=device)
        if b.pipeline.identity_on(b.split):  # no augmentation (augment=none): the split itself
            return b.split.images, b.split.labels
        images, _ = b.split.fetch(every[:1])
        chunk = max(1, self.CHUNK_BYTES // (images[0, 0].numel() * 8))
        first = b.fetch(epoch, every[:chunk])
        if chunk >= len(every):
            return first
        out = tuple(
            torch.empty((len(every), *t.shape[1:]), dtype=t.dtype, device=t.device) for t in first
        )
        for i in range(0, len(every), chunk):
            part = first if i == 0 else b.fetch(epoch, every[i : i + chunk])
            for whole, t in zip(out, part, strict=True):
                whole[i : i + len(t)] = t
        return out


def on_device(split: Split, size: int | None, device: torch.device) -> TensorImages:
    """The whole split in memory on ``device``, every image (and mask) at ``size`` ×
    ``size`` (``loader=device``): read in and resized on the host first, as the samples'
    pipeline would (:func:`repro.components.data.augment.resize_image`), if not there already."""
    if isinstance(split, TensorImages) and (
        size is None or tuple(split.images.shape[-2:]) == (size, size)
    ):
        return split.to(device)
    with pinned_here():  # the resize a worker would do, as a worker does it
        images, targets = split.fetch(torch.arange(len(split)))
        resize = Resize(size)
        pairs = [resize(images[i], targets[i]) for i in range(len(images))]
    labels = (
        torch.stack([t for _, t in pairs])
        if isinstance(pairs[0][1], torch.Tensor) and pairs[0][1].dim() == 2
        else torch.as_tensor([int(t) for _, t in pairs])
    )
    return TensorImages(stack_images([i for i, _ in pairs]), labels).to(device)


def _init_worker(worker_id: int) -> None:
    """Seed the worker's global RNGs (``repro.base.rng.worker_init_fn``) and leave pre-emption
    signals and Ctrl-C to the main process: a cluster sends SIGTERM to every process of the
    job, a terminal sends SIGINT to its whole process group, and the main process must be able
    to finish its step and write a checkpoint before the workers go."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    worker_init_fn(worker_id)


def _worker_context() -> multiprocessing.context.BaseContext:
    """The start method for loader workers: the process's own if it is a standard one, else
    the platform's default. A parallel sweep runs each job in a joblib (loky) worker whose
    default is ``loky``, under which a DataLoader cannot start its workers."""
    method = multiprocessing.get_start_method(allow_none=True)
    if method not in multiprocessing.get_all_start_methods():
        method = multiprocessing.get_all_start_methods()[0]
    return multiprocessing.get_context(method)


def make_train_loader(
    splits: DataSplits,
    seed: int,
    batch_size: int,
    micro_batch_size: int,
    loader_cfg,
    pin_memory: bool,
    start_step: int = 0,
    shard: tuple[int, int] | None = None,
    device: torch.device | None = None,
    overfit_batch: bool = False,
) -> DataLoader | InProcessBatches | DeviceBatches:
    """The micro-batches of the training split (infinite; the loop counts):
    ``shard=(first, count)``: only those micro-batches of each step (this rank's share).
    A DataLoader whose every item is a whole micro-batch (:class:`KeyedBatches`, fetched in
    ``loader.num_workers`` workers), :class:`InProcessBatches` without workers, or with ``loader.on_device``,
    :class:`DeviceBatches` on ``device``. Either way ``.sampler`` is the
    :class:`KeyedBatchSampler`."""
    sampler = KeyedBatchSampler(
        len(splits.train), batch_size, micro_batch_size, seed, start_step, shard, overfit_batch
    )
    pipeline = splits.train_pipeline or KeyedPipeline(None, seed)
    if getattr(loader_cfg, "on_device", False):
        if not pipeline.device_capable:
            raise ConfigError(
                f"config error: loader=device augments on the device, which augment=crop_flip "
                f"and none can (their draws are counted from the key there); augment.train "
                f"({pipeline.name}) runs sample by sample on the host: use loader=multi."
            )
        split = on_device(splits.train, pipeline.size, device or torch.device("cpu"))
        return DeviceBatches(KeyedBatches(split, pipeline), sampler)
    workers = int(loader_cfg.num_workers)
    if workers == 0:
        return InProcessBatches(KeyedBatches(splits.train, pipeline), sampler, pin_memory)
    extra = {}
    if workers > 0:
        extra["persistent_workers"] = bool(loader_cfg.persistent_workers)
        if loader_cfg.prefetch_factor is not None:
            extra["prefetch_factor"] = int(loader_cfg.prefetch_factor)
    return DataLoader(
        KeyedBatches(splits.train, pipeline),
        sampler=sampler,
        batch_size=None,  # the sampler's items are whole micro-batches of keys
        num_workers=workers,
        pin_memory=pin_memory,
        worker_init_fn=_init_worker,
        multiprocessing_context=_worker_context() if workers > 0 else None,
        # the base seed of the workers' torch/random state: keyed, not the global RNG's
        generator=keyed_generator(seed, "loader"),
        **extra,
    )


@contextmanager
def loading(loader: DataLoader | InProcessBatches | DeviceBatches) -> Iterator[Iterator]:
    """Iterate ``loader``; on the way out (the last step, an error, pre-emption) stop its
    worker processes. They ignore SIGTERM, which is the main process's to handle, so none may
    outlive the run: multiprocessing's exit handler sends them SIGTERM and then waits for
    them, forever (an error in the middle of a run hung the process that way)."""
    batches = iter(loader)
    try:
        yield _one_line_errors(batches)
    finally:
        shutdown = getattr(batches, "_shutdown_workers", None)  # a multi-worker DataLoader
        if shutdown is not None:
            shutdown()


def _one_line_errors(batches: Iterator) -> Iterator:
    """``batches``, with a user error raised in a loader worker (a corrupt image, a bad mask)
    brought back to its one line: the DataLoader re-raises it in this process with the
    worker's traceback in the message."""
    while True:
        try:
            batch = next(batches)
        except ReproError as err:
            lines = [ln for ln in str(err).splitlines() if ln.strip()]
            if len(lines) > 1 and lines[0].startswith("Caught "):
                raise type(err)(lines[-1].split(": ", 1)[-1]) from None
            raise
        yield batch


class DeviceNormalizer:
    """Images -> normalised float32 on the device (in ``channels_last`` memory format if
    asked: the model's): uint8 ones divided by 255 first, float32 ones (mapped by
    ``data.intensity`` when read) as they are."""

    def __init__(
        self, splits: DataSplits, device: torch.device, channels_last: bool = False
    ) -> None:
        shape = (1, -1, 1, 1)
        self.device = device
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        mean, std = splits.normalisation()
        self.mean = torch.tensor(mean, device=device).view(shape)
        self.std = torch.tensor(std, device=device).view(shape)

    def normalised_zero(self) -> torch.Tensor:
        """What an input pixel of value 0 becomes, per channel (C, on the device): the value
        an image is padded with after normalisation, as a training crop pads before it."""
        return (-self.mean / self.std).view(-1)

    def __call__(
        self, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = images.to(self.device, non_blocking=True)
        if x.dtype == torch.uint8:  # 8-bit images: into [0, 1] here, as always
            x = x.float().div_(255).sub_(self.mean)
        else:  # float32, already mapped (data.intensity): a new tensor, the batch untouched
            x = x.float().sub(self.mean)
        x = x.div_(self.std).contiguous(memory_format=self.memory_format)
        return x, labels.to(self.device, non_blocking=True).long()  # uint8 masks too
