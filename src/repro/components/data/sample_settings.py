"""Per-sample work runs under one set of settings in every process: the one-thread rule.

A CPU reduction's last bits follow torch's intra-op thread count: above 32,768 elements
(``at::internal::GRAIN_SIZE``) ATen splits a sum across the threads, and each split adds in
another order. A DataLoader worker runs with one thread (PyTorch sets it as the worker
starts), the main process with ``determinism.cpu_threads``; so the same transform --
``x - x.mean()`` over a 3 × 128 × 128 image -- gave other bits under ``loader=single`` than
under ``loader=multi``. Threads are not all: a worker started by ``spawn`` or ``forkserver``
(macOS's default; Python 3.14's on Linux) begins with PyTorch's defaults, not the run's
deterministic-algorithms flags, and the main process could be inside an autocast region.

:class:`SampleSettings` is what every per-sample computation -- reading a sample, mapping its
intensities, augmenting it -- runs under, wherever it runs: in the loader's workers and in
the main process (``loader=single``, evaluation, the augmentation self-check, ``repro
preview``, the normalisation statistics):

- **one intra-op thread**, as a worker has (:data:`SAMPLE_THREADS`);
- **autocast off** on the CPU, and **the CPU as the default device**;
- **the run's flags** as the main process had them when the pipeline was built
  (:meth:`SampleSettings.here`): ``use_deterministic_algorithms`` and its ``warn_only``,
  ``fill_uninitialized_memory`` (what ``torch.empty`` holds), the float32 matmul precision
  and the default dtype. The snapshot is part of the pickled pipeline, so a worker applies
  the main process's flags whatever its start method.

In the main process everything is put back afterwards; a loader worker keeps them (nothing
else runs there). The thread count and the flags are the process's, not a thread's: two
threads of one process doing per-sample work at once would share them.

Not pinned, because PyTorch cannot: a library's own thread pool (OpenCV's, an OpenBLAS
under NumPy) -- the self-check names a transform whose work runs on other threads
(:mod:`repro.components.data.pipeline_check`) -- and the CPU's flush-to-zero mode
(``torch.set_flush_denormal`` has no getter, so it could not be put back).
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass

import torch

# the intra-op threads of every per-sample computation: a DataLoader worker's
SAMPLE_THREADS = 1

# 1 while this thread is inside a pinned() block (a nested one changes nothing); 0 again in
# a process forked from inside one
_depth = threading.local()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: setattr(_depth, "value", 0))


@dataclass(frozen=True)
class SampleSettings:
    """The flags per-sample work runs under besides the thread count (see the module
    docstring); :meth:`here` reads them from this process."""

    deterministic: bool = False
    warn_only: bool = False
    fill_uninitialized_memory: bool = True
    matmul_precision: str = "highest"
    default_dtype: torch.dtype = torch.float32

    @classmethod
    def here(cls) -> SampleSettings:
        """This process's flags, now: taken when a pipeline is built (after the determinism
        layers), carried with it into the loader's workers."""
        return cls(
            deterministic=torch.are_deterministic_algorithms_enabled(),
            warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            fill_uninitialized_memory=bool(torch.utils.deterministic.fill_uninitialized_memory),
            matmul_precision=torch.get_float32_matmul_precision(),
            default_dtype=torch.get_default_dtype(),
        )

    def apply(self) -> None:
        """Make these this process's flags (each only where it differs)."""
        if (
            torch.are_deterministic_algorithms_enabled() != self.deterministic
            or torch.is_deterministic_algorithms_warn_only_enabled() != self.warn_only
        ):
            torch.use_deterministic_algorithms(self.deterministic, warn_only=self.warn_only)
        if torch.utils.deterministic.fill_uninitialized_memory != self.fill_uninitialized_memory:
            torch.utils.deterministic.fill_uninitialized_memory = self.fill_uninitialized_memory
        if torch.get_float32_matmul_precision() != self.matmul_precision:
            torch.set_float32_matmul_precision(self.matmul_precision)
        if torch.get_default_dtype() != self.default_dtype:
            torch.set_default_dtype(self.default_dtype)

    def pinned(self) -> contextlib.AbstractContextManager:
        """Inside: one intra-op thread, autocast off on the CPU, the CPU as the default
        device, and these flags; afterwards, in the main process, what was there before.
        (A class, not a generator: a fetch enters it on every step, in the loop's time.)"""
        return _Pinned(self)


class _Pinned:
    """:meth:`SampleSettings.pinned`'s block; a nested one (a fetch around its pipeline's
    calls) changes nothing."""

    __slots__ = ("settings", "outer", "before", "threads", "stack")

    def __init__(self, settings: SampleSettings) -> None:
        self.settings = settings

    def __enter__(self) -> None:
        self.outer = not getattr(_depth, "value", 0)
        if not self.outer:
            return
        worker = torch.utils.data.get_worker_info() is not None
        self.before = None if worker else SampleSettings.here()
        self.threads = torch.get_num_threads()
        if self.threads != SAMPLE_THREADS:
            torch.set_num_threads(SAMPLE_THREADS)
        self.settings.apply()
        _depth.value = 1
        self.stack = None
        try:
            off = torch.is_autocast_enabled("cpu")
            elsewhere = torch.get_default_device().type != "cpu"
            if off or elsewhere:
                self.stack = contextlib.ExitStack()
                if off:
                    self.stack.enter_context(torch.autocast("cpu", enabled=False))
                if elsewhere:
                    self.stack.enter_context(torch.device("cpu"))
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: object) -> None:
        if not self.outer:
            return
        try:
            if self.stack is not None:
                self.stack.close()
        finally:
            _depth.value = 0
            if self.before is not None:
                self.before.apply()
                if torch.get_num_threads() != self.threads:
                    torch.set_num_threads(self.threads)


def pinned_here() -> contextlib.AbstractContextManager:
    """:meth:`SampleSettings.pinned` with this process's flags: for per-sample work outside a
    pipeline (the host-side resize of ``loader=device``)."""
    return SampleSettings.here().pinned()
