"""Fingerprints of a run: digests of tensors and state dicts, the environment."""

from __future__ import annotations

import hashlib
import platform
import subprocess
import sys
from collections.abc import Mapping

import numpy as np
import torch


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The raw bytes of a tensor's values, on the CPU, in row-major order."""
    t = tensor.detach().to("cpu").contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes()


def state_dict_sha256(state_dict: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over the tensors of a state dict, in sorted key order, bytes of each on the CPU.

    This is ``weights_sha256`` in ``summary.json``: two runs agree here iff every tensor agrees
    bit for bit (given equal shapes and dtypes, which the config fixes)."""
    return tensors_sha256(
        *(state_dict[k] for k in sorted(state_dict) if isinstance(state_dict[k], torch.Tensor))
    )


def tensors_sha256(*tensors: torch.Tensor) -> str:
    """SHA-256 over the bytes of the tensors, in the order given."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(tensor_bytes(t))
    return h.hexdigest()


def environment() -> dict[str, object]:
    """Versions and hardware that decide whether two runs can be bit-equal."""
    env: dict[str, object] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": str(torch.__version__),
        "numpy": str(np.__version__),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "gpu": None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env["gpu"] = props.name
        env["gpu_capability"] = f"{props.major}.{props.minor}"
        env["gpu_sm_count"] = props.multi_processor_count
        env["gpu_driver"] = _nvidia_driver()
    return env


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
