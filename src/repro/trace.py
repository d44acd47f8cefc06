"""Fingerprints of a run (DESIGN.md, principle 4): digests of tensors, the per-step trace, the
environment fingerprint.

Every run writes two of them into its directory:

``trace.jsonl``
    one JSON object per line: ``{"step": 0, "tensors": ..., "weights_sha256": ...}`` for the
    initial weights, then one per optimizer step with ``step`` (1-based, as in ``metrics.csv``),
    ``epoch``, ``loss``, ``grad_norm``, ``lr``. JSON numbers are written with ``repr``, which
    round-trips a float exactly, so the file holds the exact bits. Every
    ``trainer.trace_every`` steps (and at the last one) a step also carries ``tensors``
    (a SHA-256 per state-dict entry after that step's update), ``weights_sha256`` and
    ``batch`` (the step's input and label digests); the first step always carries ``batch``;
    evaluation steps carry ``eval``; the last step ``"final": true``.
``env.json``
    :func:`run_fingerprint`: versions, hardware, the determinism flags read back, the
    relevant environment variables, the git state, the resolved config and its hash.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

TRACE_FILE = "trace.jsonl"
ENV_FILE = "env.json"
# Environment variables that can change the bits or the kernels chosen.
ENV_VARS = (
    "PYTHONHASHSEED",
    "CUBLAS_WORKSPACE_CONFIG",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_LAUNCH_BLOCKING",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "TORCHINDUCTOR_DETERMINISTIC",
)
ENV_PREFIXES = ("NCCL_",)


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


def environment() -> dict[str, Any]:
    """Versions and hardware that decide whether two runs can be bit-equal."""
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": str(torch.__version__),
        "numpy": str(np.__version__),
        "hydra": _version("hydra-core"),
        "omegaconf": _version("omegaconf"),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "gpu": None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env["gpu"] = props.name
        env["gpu_capability"] = f"{props.major}.{props.minor}"
        env["gpu_sm_count"] = props.multi_processor_count
        env["gpu_count"] = torch.cuda.device_count()
        env["gpu_driver"] = _nvidia_driver()
    return env


def determinism_flags() -> dict[str, Any]:
    """The flags that decide kernels and threads, as read back from torch (not as requested)."""
    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "fill_uninitialized_memory": torch.utils.deterministic.fill_uninitialized_memory,
        "cudnn_enabled": torch.backends.cudnn.enabled,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "intra_op_threads": torch.get_num_threads(),
        "inter_op_threads": torch.get_num_interop_threads(),
    }


def relevant_env_vars() -> dict[str, str | None]:
    env: dict[str, str | None] = {k: os.environ.get(k) for k in ENV_VARS}
    env.update({k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)})
    return env


def git_state(path: Path | None = None) -> dict[str, Any]:
    """Commit, dirty flag and a hash of the diff of the git checkout holding ``path`` (default:
    this package's source). Untracked files are not counted: run outputs would be."""
    where = str(path or Path(__file__).resolve().parent)

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", "-C", where, *args], capture_output=True, timeout=30, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.decode(errors="replace")

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None, "diff_sha256": None, "note": "not a git checkout"}
    diff = git("diff", "HEAD", "--binary") or ""
    return {
        "commit": commit.strip(),
        "dirty": bool(diff),
        "diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None,
    }


def run_fingerprint(
    config: dict[str, Any], config_hash: str, env: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``env.json``: everything outside the code's own logic that can change the bits.
    ``env``: :func:`environment`'s result, when the caller has it already."""
    return {
        "environment": env if env is not None else environment(),
        "flags": determinism_flags(),
        "env_vars": relevant_env_vars(),
        "git": git_state(),
        "config_hash": config_hash,
        "config": config,
    }


class TraceWriter:
    """Appends records to ``trace.jsonl``, one JSON object per line, flushed per batch."""

    def __init__(self, path: Path, mode: str = "w") -> None:
        self.path = Path(path)
        self.file = open(self.path, mode)

    def write(self, records: list[dict[str, Any]]) -> None:
        self.file.write("".join(json.dumps(r, allow_nan=True) + "\n" for r in records))
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    m = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return m.group(1).strip() if m else platform.processor() or platform.machine()


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout else None
