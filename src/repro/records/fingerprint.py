"""The environment fingerprint (docs/design.md, principle 4): everything outside the code's
own logic that can change a run's bits, written to ``env.json`` at the start of every run.

:func:`environment` is what decides whether two runs *can* be bit-equal: versions, the GPU
model and SM count, and on CPUs the instruction set the kernels dispatch to
(``cpu_capability``: PyTorch's ATen kernels pick AVX2 or AVX-512 code; oneDNN and MKL choose
their own paths from the ISA flags, AMX included). Two CPUs with the same model string can
dispatch differently, and then the same run gives other bits; ``repro compare`` lists these
entries when they differ, and resuming a CPU run across a different capability is refused.

A training run's environment also holds ``pretrained_weights``: every weights file the
model's construction read, ``[{path, sha256, bytes}]`` (empty when none; :mod:`repro.records.weights`),
added once the model is built (:meth:`repro.engine.loop.Run.resolved`). A zoo's pretrained weights
come from a cache filled at run time, so they decide the bits as much as the versions do.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

from repro.base.files import CHECKOUT_DIR, PACKAGE_DIR

# Variables that cap the instruction set a library dispatches to (forcing AVX2 on an AVX-512
# machine, say): they change the bits without changing the hardware.
CPU_DISPATCH_VARS = (
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_CBWR",
)
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
    "ONEDNN_DEFAULT_FPMATH_MODE",
    *CPU_DISPATCH_VARS,
)
ENV_PREFIXES = ("NCCL_",)
# /proc/cpuinfo flags that decide which vector code a CPU kernel can take
ISA_FLAG = re.compile(r"avx\w*|amx\w*|fma|f16c")


def environment() -> dict[str, Any]:
    """Versions and hardware that decide whether two runs can be bit-equal."""
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_isa": cpu_isa_flags(),
        "cpu_dispatch_limits": {k: os.environ[k] for k in CPU_DISPATCH_VARS if k in os.environ},
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
        # torch.compile's (recent torch sets it with use_deterministic_algorithms; None:
        # Inductor's config was never loaded)
        "inductor_deterministic": getattr(
            sys.modules.get("torch._inductor.config"), "deterministic", None
        ),
        "intra_op_threads": torch.get_num_threads(),
        "inter_op_threads": torch.get_num_interop_threads(),
    }


def relevant_env_vars() -> dict[str, str | None]:
    env: dict[str, str | None] = {k: os.environ.get(k) for k in ENV_VARS}
    env.update({k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)})
    return env


# Untracked files in these folders of the checkout are code or config a run may have used (a
# fork's new model before its first commit): they make the checkout dirty.
UNTRACKED_WATCHED = ("src", "conf")


def git_state(path: Path | None = None) -> dict[str, Any]:
    """Commit, dirty flag, a hash of the diff of the git checkout holding ``path`` (default:
    this package's source), and the untracked files under the project's ``src/`` and
    ``conf/`` (``path``, or the folder holding ``src/repro``; not ignored), each with the
    SHA-256 of its content: they count as dirty. Untracked files elsewhere are not counted:
    run outputs would be."""
    where = str(path or PACKAGE_DIR)

    def git(*args: str, cwd: str = where) -> str | None:
        try:
            out = subprocess.run(
                ["git", "-C", cwd, *args], capture_output=True, timeout=30, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.decode(errors="replace")

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None, "diff_sha256": None, "note": "not a git checkout"}
    diff = git("diff", "HEAD", "--binary") or ""
    # the project: the folder given, else the checkout holding this package (src/repro/..)
    root = str(path) if path is not None else str(CHECKOUT_DIR)
    listed = git(
        "ls-files", "--others", "--exclude-standard", "-z", "--", *UNTRACKED_WATCHED, cwd=root
    )
    untracked = {}
    for name in sorted(filter(None, (listed or "").split("\0"))):
        try:
            with open(Path(root) / name, "rb") as f:
                untracked[name] = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError:
            untracked[name] = None  # gone or unreadable since it was listed
    return {
        "commit": commit.strip(),
        "dirty": bool(diff or untracked),
        "diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None,
        "untracked": untracked,
    }


# environment's entry for what decided a folder's split besides the config (the file names,
# the group and split CSVs, as digests: repro.components.data.splitting.split_inputs)
SPLIT_KEY = "split_inputs"


def split_mismatches(recorded: Any, now: Any) -> list[str]:
    """One line for each input of the split (:data:`SPLIT_KEY`) that differs between a
    checkpoint's record and this run's, naming it: the folder's file names (their count),
    a CSV file (its path). Either side unrecorded (not a folder's data, or written before
    the record existed): no difference."""
    if not isinstance(recorded, dict) or not isinstance(now, dict):
        return []
    out = []
    for key in sorted(recorded.keys() | now.keys()):
        a, b = recorded.get(key) or {}, now.get(key) or {}
        if a.get("sha256") == b.get("sha256"):
            continue
        if key == "file_names":
            out.append(
                f"environment.{SPLIT_KEY}.file_names: the files under data.path, "
                f"{a.get('count')} (checkpoint) vs {b.get('count')} (now), names sha256 "
                f"{str(a.get('sha256'))[:12]} vs {str(b.get('sha256'))[:12]} (files added, "
                "removed or renamed: the split is another)"
            )
        else:
            path = b.get("path") or a.get("path")
            state = (
                f"sha256 {str(a.get('sha256'))[:12]} (checkpoint) vs "
                f"{str(b.get('sha256'))[:12]} (now)"
                if a and b
                else f"{'set' if a else 'unset'} (checkpoint) vs {'set' if b else 'unset'} (now)"
            )
            out.append(
                f"environment.{SPLIT_KEY}.{key}: data.{key}={path} changed, {state} (its "
                "rows decide the split)"
            )
    return out


def run_fingerprint(
    config: dict[str, Any], config_hash: str, env: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``env.json``: everything outside the code's own logic that can change the bits.
    ``env``: :func:`environment`'s result, when the caller has it already (a training run's
    carries its ``pretrained_weights``)."""
    return {
        "environment": env if env is not None else environment(),
        "flags": determinism_flags(),
        "env_vars": relevant_env_vars(),
        "git": git_state(),
        "config_hash": config_hash,
        "config": config,
    }


def cpu_model() -> str:
    text = _cpuinfo()
    m = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return m.group(1).strip() if m else platform.processor() or platform.machine()


def cpu_isa_flags() -> list[str] | None:
    """The CPU's vector-ISA flags (AVX, AVX-512, AMX, FMA...) from ``/proc/cpuinfo``, sorted;
    None where there is no such file (macOS, Windows)."""
    m = re.search(r"^flags\s*:\s*(.+)$", _cpuinfo(), re.MULTILINE)
    if not m:
        return None
    return sorted({f for f in m.group(1).split() if ISA_FLAG.fullmatch(f)})


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


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
