"""The per-step trace of a run (docs/design.md, principle 4) and the tensor digests it holds.

Every run writes it into its directory (the environment fingerprint, ``env.json``, is
:mod:`repro.records.fingerprint`):

``trace.jsonl``
    one JSON object per line: ``{"step": 0, "tensors": ..., "weights_sha256": ..., "task":
    {"headline": ..., "higher_is_better": ...}}`` for the initial weights, then one per
    optimizer step with ``step`` (1-based, as in ``metrics.csv``),
    ``epoch``, ``loss``, ``grad_norm``, ``lr``. JSON numbers are written with ``repr``, which
    round-trips a float exactly, so the file holds the exact bits. Every
    ``trainer.trace_every`` steps (and at the last one) a step also carries ``tensors``
    (a SHA-256 per state-dict entry after that step's update), ``weights_sha256`` and
    ``batch`` (the step's input and label digests); the first step always carries ``batch``;
    evaluation steps carry ``eval``; the first step of a resumed process ``resumed`` (from
    where, and the differences a forced resume accepted); the last step ``"final": true``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from repro.base.files import open_run_file
from repro.base.progress import span
from repro.base.world import World, all_gather_cpu, check_same


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The raw bytes of a tensor's values, on the CPU, in row-major order."""
    t = tensor.detach().to("cpu").contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes()


def tensors_sha256(*tensors: torch.Tensor) -> str:
    """SHA-256 over the bytes of the tensors, in the order given."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(tensor_bytes(t))
    return h.hexdigest()


@dataclass
class _Snapshot:
    """A state dict's tensor bytes, copied at one moment (sorted keys, one uint8 buffer on the
    CPU, or being copied there until ``ready`` has passed)."""

    keys: list[str]
    sizes: list[int]
    data: torch.Tensor | None
    parts: list[torch.Tensor] | None = None  # tensors on several devices: one copy each
    ready: torch.cuda.Event | None = None


def _snapshot(state_dict: Mapping[str, Any], non_blocking: bool = False) -> _Snapshot:
    """Copy the state dict's tensors to the CPU in one transfer (one synchronisation, not one
    per tensor). With ``non_blocking`` and the tensors on one GPU, into pinned memory without
    waiting: hash only after ``ready``."""
    keys = sorted(k for k, v in state_dict.items() if isinstance(v, torch.Tensor))
    flat = [state_dict[k].detach().contiguous().reshape(-1).view(torch.uint8) for k in keys]
    sizes = [t.numel() for t in flat]
    devices = {t.device for t in flat}
    if len(devices) > 1:
        return _Snapshot(keys, sizes, None, parts=[t.to("cpu", copy=True) for t in flat])
    if not flat:
        return _Snapshot(keys, sizes, torch.empty(0, dtype=torch.uint8))
    data = torch.cat(flat)  # a copy: later steps cannot change it
    if data.device.type != "cuda":
        return _Snapshot(keys, sizes, data)
    if not non_blocking:
        return _Snapshot(keys, sizes, data.cpu())
    stream = torch.cuda.current_stream(data.device)  # the model's GPU, current or not
    with torch.cuda.stream(stream):
        host = torch.empty(data.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(data, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(stream)
    return _Snapshot(keys, sizes, host, ready=ready)


def _hash(snap: _Snapshot) -> tuple[dict[str, str], str]:
    if snap.ready is not None:
        snap.ready.synchronize()
    if snap.parts is not None:
        views = [t.numpy() for t in snap.parts]
    else:
        data, views, offset = snap.data.numpy(), [], 0
        for n in snap.sizes:
            views.append(data[offset : offset + n])
            offset += n
    whole, per = hashlib.sha256(), {}
    for k, v in zip(snap.keys, views, strict=True):
        whole.update(v)  # the buffer itself: no copy into bytes
        per[k] = hashlib.sha256(v).hexdigest()
    return per, whole.hexdigest()


def state_digests(state_dict: Mapping[str, Any]) -> tuple[dict[str, str], str]:
    """Per-entry SHA-256 of a state dict's tensors, and the digest of the whole.

    The tensors are copied to the CPU in one transfer. The whole digest hashes the entries'
    bytes in sorted key order: it is :func:`state_dict_sha256`."""
    return _hash(_snapshot(state_dict))


class BackgroundDigests:
    """:func:`state_digests` off the training loop's critical path: :meth:`submit` copies the
    state (on a GPU: one device-side copy and an asynchronous transfer into pinned memory) and
    returns a future; a worker thread hashes it once the transfer is done (hashlib releases
    the GIL), while the loop goes on launching steps. The digests are the same. At most one
    copy waits to be hashed: a submit first waits for the one before (with ``trace_every=1``
    a large model would otherwise pile up copies of its state)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="repro-digest")
        self._last: Future[tuple[dict[str, str], str]] | None = None

    def submit(self, state_dict: Mapping[str, Any]) -> Future[tuple[dict[str, str], str]]:
        if self._last is not None:
            self._last.exception()  # wait; its errors are raised where its result is read
        self._last = self._pool.submit(_hash, _snapshot(state_dict, non_blocking=True))
        return self._last

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def state_dict_sha256(state_dict: Mapping[str, Any]) -> str:
    """SHA-256 over the tensors of a state dict, in sorted key order, bytes of each on the CPU.

    This is ``weights_sha256`` in ``summary.json``: two runs agree here iff every tensor agrees
    bit for bit (given equal shapes and dtypes, which the config fixes)."""
    return state_digests(state_dict)[1]


class TraceWriter:
    """Appends records to ``trace.jsonl``, one JSON object per line, flushed per batch."""

    def __init__(self, path: Path, mode: str = "w") -> None:
        self.path = Path(path)
        self.file = open_run_file(self.path, mode)  # never through a link

    def write(self, records: list[dict[str, Any]]) -> None:
        self.file.write("".join(json.dumps(r, allow_nan=True) + "\n" for r in records))
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class StepTracer:
    """What the trace records of a step besides its loss (run on every rank: under torchrun
    the ranks gather each other's batch digests and compare their weights' digests).

    Traced steps (the first, every ``trainer.trace_every``-th and the last) get the digests
    of the step's inputs and labels over all K micro-batches; every ``trace_every``-th and
    the last step also the state digests after its update, hashed in the background except at
    the last step. Under torchrun the ranks compare each digest at the next digest step
    (every rank reaches it at once), or before a checkpoint (:meth:`check_pending`); a
    digest step that is also a checkpoint step, and the last step, are hashed and compared
    at once, so no checkpoint is written from ranks that were seen to differ."""

    def __init__(
        self, enabled: bool, every: int, max_steps: int, world: World, checkpoint_every: int = 0
    ) -> None:
        self.enabled, self.every, self.max_steps, self.world = enabled, every, max_steps, world
        self.checkpoint_every = checkpoint_every
        self.background = BackgroundDigests()
        self.final_weights: str | None = None  # the last step's weights_sha256, when traced
        self._unchecked: tuple[int, Future[tuple[dict[str, str], str]]] | None = None

    def _periodic(self, done: int) -> bool:
        return done == self.max_steps or bool(self.every and done % self.every == 0)

    def digest_step(self, done: int) -> bool:
        """Does :meth:`state` read the weights after step ``done``?"""
        return self.enabled and self._periodic(done)

    def _checkpoint(self, done: int) -> bool:
        """Does the loop write a periodic checkpoint after step ``done``?"""
        return bool(self.checkpoint_every and done % self.checkpoint_every == 0)

    def inputs(self, done: int, raw: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
        """``{"batch": {"inputs": ..., "labels": ...}}`` on traced steps (rank 0's only)."""
        if not (self.enabled and (done == 1 or self._periodic(done))):
            return {}
        with span("repro.trace"):
            images = torch.stack([b[0] for b in raw]).cpu()
            labels = torch.stack([b[1] for b in raw]).cpu()
            images = all_gather_cpu(images, self.world).flatten(0, 1)
            labels = all_gather_cpu(labels, self.world).flatten(0, 1)
            if not self.world.main:
                return {"batch": None}
            return {"batch": {"inputs": tensors_sha256(*images), "labels": tensors_sha256(*labels)}}

    def state(self, done: int, model: torch.nn.Module) -> dict[str, Any]:
        """The state digests after step ``done`` on digest steps; ``"final": true`` on the
        last step."""
        record: dict[str, Any] = {}
        if self.enabled and self._periodic(done):
            with span("repro.trace"):
                record.update(self._digests(done, model))
        elif self._checkpoint(done):
            self.check_pending()  # before this step's checkpoint is written
        if done == self.max_steps:
            record["final"] = True
            self.final_weights = record.get("weights_sha256")
        return record

    @classmethod
    def for_run(cls, trainer: Any, world: World) -> StepTracer:
        """The tracer for the ``trainer`` config group's settings."""
        t = trainer
        return cls(
            bool(t.trace), int(t.trace_every), int(t.max_steps), world, int(t.checkpoint_every)
        )

    def check_pending(self) -> None:
        """Under torchrun, on every rank at the same point: compare the ranks' digests of the
        last digest step not compared yet (raises, naming the ranks and the step, if they
        differ)."""
        if self._unchecked is not None:
            step, digest = self._unchecked
            self._unchecked = None
            check_same(digest.result()[1], self.world, "weights", step)

    def _digests(self, done: int, model: torch.nn.Module) -> dict[str, Any]:
        self.check_pending()  # the digest step before's
        if done == self.max_steps or (self.world.distributed and self._checkpoint(done)):
            # needed now (summary.json), or compared before the step's checkpoint is written
            tensors, whole = state_digests(model.state_dict())
            check_same(whole, self.world, "weights", done)
            return {"tensors": tensors, "weights_sha256": whole}
        # hashed in the background; written (in this place) at a later flush
        digest = self.background.submit(model.state_dict())
        if self.world.distributed:
            self._unchecked = (done, digest)
        return {"tensors": digest, "weights_sha256": None}

    def close(self) -> None:
        self.background.close()
