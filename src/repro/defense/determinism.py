"""The four layers of the defense (docs/design.md, principle 2) and the determinism report.

Applied by the entrypoint, in order, before the model or the loader exists:

0. process environment: ``PYTHONHASHSEED`` and ``CUBLAS_WORKSPACE_CONFIG`` only work when
   they are in place before the interpreter (resp. cuBLAS) starts, so strict mode re-executes
   the process once when they are missing (:mod:`repro.defense.process_env`, before torch is even
   imported), and this module verifies that they took effect;
1. CPU: ``random``, NumPy, torch's CPU generator; intra-op thread count fixed and recorded;
2. GPU: cuDNN deterministic/benchmark, ``use_deterministic_algorithms``, TF32, CUDA generators;
3. data: keyed sampler and per-sample augmentation seeds, ``worker_init_fn`` (``repro.components.data``);
4. ops: AMP policy (``repro.engine.build.Precision``), keyed forward randomness (``repro.engine.step``),
   pinned optimizer implementation (``conf/optim``).

Layers 3 and 4 are implemented where the data and the step live; the report records them.
The report says what was set, what was read back and found in effect, and what is not covered.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from repro.base import world
from repro.base.errors import DeterminismError
from repro.base.files import open_run_file
from repro.base.rng import seed_global_rngs
from repro.defense.process_env import REEXEC_MARKER, TF32_OVERRIDE, hash_seed_in_effect, strict_like

# PyTorch's own choice for this machine, read before any job of this process changes it: in a
# sweep, jobs share the process, and a fast job must not inherit a strict job's setting.
_DEFAULT_THREADS = torch.get_num_threads()

NOT_COVERED = [
    "bits across GPU models (cuBLAS/cuDNN pick kernels by architecture and SM count), "
    "across PyTorch/CUDA releases, and between CPU and GPU",
    "third-party code with its own RNG that does not draw from the seeded global generators",
    "custom CUDA extensions and ops PyTorch does not know to be nondeterministic",
]  # and what the augmentation self-check cannot prove: the run adds it with the data's rows


@contextmanager
def flags_restored() -> Iterator[None]:
    """Put torch's kernel-selection flags (layer 2) and thread count back as they were: for
    tools and tests that change them inside a running process (``repro doctor``)."""
    flags = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
        torch.get_num_threads(),
    )
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
        torch.utils.deterministic.fill_uninitialized_memory = flags[2]
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags[3:5]
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags[5:7]
        torch.set_float32_matmul_precision(flags[7])
        torch.set_num_threads(flags[8])


@dataclass
class Entry:
    layer: str
    name: str
    value: Any  # what is in effect, read back where possible
    requested: Any = None
    verified: bool | None = None  # True: read back and as requested; None: nothing to read back
    note: str = ""


@dataclass
class DeterminismReport:
    mode: str
    device: str
    entries: list[Entry] = field(default_factory=list)
    not_covered: list[str] = field(default_factory=lambda: list(NOT_COVERED))

    def add(
        self,
        layer: str,
        name: str,
        value: Any,
        requested: Any = None,
        verified: bool | None = None,
        note: str = "",
    ) -> None:
        """A row, after the last of its layer (a row the run adds once the model and data are
        built, the loader's, goes with its layer's)."""
        if verified is None and requested is not None:
            verified = value == requested
        at = max((i + 1 for i, e in enumerate(self.entries) if e.layer == layer), default=None)
        entry = Entry(layer, name, value, requested, verified, note)
        self.entries.insert(len(self.entries) if at is None else at, entry)

    @property
    def failures(self) -> list[Entry]:
        return [e for e in self.entries if e.verified is False]

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "device": self.device,
            "entries": [asdict(e) for e in self.entries],
            "not_covered": self.not_covered,
        }

    def format(self) -> str:
        mark = {True: "ok", False: "NOT IN EFFECT", None: "set"}
        lines = [f"determinism report: mode={self.mode}, device={self.device}"]
        layer = None
        for e in self.entries:
            if e.layer != layer:
                layer = e.layer
                lines.append(f"  [{layer}]")
            note = f"  ({e.note})" if e.note else ""
            lines.append(f"    {e.name:<34} {e.value!s:<28} {mark[e.verified]}{note}")
        lines.append("  not covered: " + "; ".join(self.not_covered))
        return "\n".join(lines)

    def save(self, run_dir: Path) -> None:
        for name, text in (
            ("determinism.json", json.dumps(self.to_dict(), indent=2, default=str)),
            ("determinism.txt", self.format() + "\n"),
        ):
            with open_run_file(run_dir / name, "w") as f:  # never through a link
                f.write(text)


def _layer0_process(report: DeterminismReport, dcfg: DictConfig, device: torch.device) -> None:
    name = "0 process environment"
    strict = strict_like(dcfg)
    seed = os.environ.get("PYTHONHASHSEED")
    if strict:
        in_effect = seed == str(dcfg.pythonhashseed) and hash_seed_in_effect(seed)
        report.add(
            name,
            "PYTHONHASHSEED",
            seed,
            str(dcfg.pythonhashseed),
            in_effect,
            "str hash of a probe matches a fresh interpreter's"
            if in_effect
            else "set it before the interpreter starts (train.py re-executes itself)",
        )
    else:
        report.add(name, "PYTHONHASHSEED", seed, note="not pinned in fast mode")
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    cuda_note = (
        "in the environment before CUDA initialised"
        if device.type == "cuda"
        else "no CUDA device: recorded only"
    )
    if strict:
        report.add(
            name,
            "CUBLAS_WORKSPACE_CONFIG",
            cublas,
            str(dcfg.cublas_workspace_config),
            note=cuda_note + "; torch>=2.10 no longer needs it",
        )
    else:
        report.add(name, "CUBLAS_WORKSPACE_CONFIG", cublas, note="not pinned in fast mode")
    override = os.environ.get(TF32_OVERRIDE)
    report.add(
        name,
        TF32_OVERRIDE,
        override,
        verified=None if dcfg.allow_tf32 else override != "1",
        note="'1' silently turns TF32 on",
    )
    report.add(name, "re-executed to pin the environment", bool(os.environ.get(REEXEC_MARKER)))
    if world.launched_world().distributed and device.type == "cuda":
        for var, value in dcfg.nccl_env.items():
            report.add(name, var, os.environ.get(var), str(value), note="read when NCCL starts")


def _layer1_cpu(report: DeterminismReport, cfg: DictConfig) -> None:
    name = "1 CPU"
    seeds = seed_global_rngs(int(cfg.seed))
    for rng, value in seeds.items():
        report.add(name, f"seed {rng}", value, note="derive_seed(seed, 'global', i)")
    threads = cfg.determinism.cpu_threads
    if threads is not None:
        torch.set_num_threads(int(threads))
        report.add(name, "torch intra-op threads", torch.get_num_threads(), int(threads))
    else:
        torch.set_num_threads(_DEFAULT_THREADS)
        report.add(
            name,
            "torch intra-op threads",
            torch.get_num_threads(),
            _DEFAULT_THREADS,
            note="PyTorch's default for this machine (differs between machines)",
        )
    report.add(name, "torch inter-op threads", torch.get_num_interop_threads())
    report.add(name, "cpu count", os.cpu_count())
    warn_if_busy(int(torch.get_num_threads()))


def machine_load() -> tuple[float, int | None, int] | None:
    """The 1-minute load average, the threads running now besides this one (Linux:
    ``/proc/loadavg``, the fewest of three looks; None elsewhere) and the machine's cores. Both count every process on
    the machine, so they are compared with all its cores, not this process's share (on a
    cluster node a job's 2 of 64 cores say nothing of the node's load); None where the
    system gives no load average (Windows)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    cores = os.cpu_count() or 1
    others: int | None = None
    for attempt in range(3):  # the fewest of 3 looks, 20 ms apart: not a passing daemon
        try:
            with open("/proc/loadavg") as f:
                now = int(f.read().split()[3].split("/")[0]) - 1  # less this thread
        except (OSError, ValueError, IndexError):
            break
        others = now if others is None else min(others, now)
        if others < cores or attempt == 2:  # idle at the first look: no waiting at start-up
            break
        time.sleep(0.02)
    return load, others, cores


def warn_if_busy(threads: int) -> None:
    """One warning when the machine is busy as this run starts -- as many other threads
    running right now as it has cores (where the system says; else the last minute's load
    above them): another run of this template, a test suite. Sharing cores, each run's
    threads wait on the others' (two strict runs with 2 threads and 2 loader workers each
    ran 40x slower on 2 cores). Not for a run that follows work that just ended (``make
    install``: the average still counts it, nothing runs now), nor on rank 1 and up."""
    measured = machine_load()
    if measured is None or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    load, others, cores = measured
    if (others < cores) if others is not None else (load <= cores):
        return
    logging.getLogger("repro").warning(
        "this machine is busy before the run starts (load average %.1f on %d cores, %s "
        "other threads running): its %d "
        "threads will wait on the others'; wait for the other jobs, or give each run fewer, "
        "e.g. determinism.cpu_threads=1 loader=single (the thread count is part of the "
        "config, and of the bits on a CPU: compare runs that used the same).",
        load, cores, "?" if others is None else others, threads,
    )  # fmt: skip


def _layer2_gpu(
    report: DeterminismReport, dcfg: DictConfig, device: torch.device, compiling: bool
) -> None:
    name = "2 GPU kernels"
    torch.backends.cudnn.deterministic = bool(dcfg.cudnn_deterministic)
    torch.backends.cudnn.benchmark = bool(dcfg.cudnn_benchmark)
    torch.use_deterministic_algorithms(
        bool(dcfg.deterministic_algorithms), warn_only=bool(dcfg.warn_only)
    )
    torch.utils.deterministic.fill_uninitialized_memory = bool(dcfg.fill_uninitialized_memory)
    torch.backends.cuda.matmul.allow_tf32 = bool(dcfg.allow_tf32)
    torch.backends.cudnn.allow_tf32 = bool(dcfg.allow_tf32)
    torch.set_float32_matmul_precision("high" if dcfg.allow_tf32 else "highest")

    report.add(
        name,
        "cudnn.deterministic",
        torch.backends.cudnn.deterministic,
        bool(dcfg.cudnn_deterministic),
    )
    report.add(name, "cudnn.benchmark", torch.backends.cudnn.benchmark, bool(dcfg.cudnn_benchmark))
    report.add(
        name,
        "use_deterministic_algorithms",
        torch.are_deterministic_algorithms_enabled(),
        bool(dcfg.deterministic_algorithms),
    )
    report.add(
        name,
        "deterministic warn_only",
        torch.is_deterministic_algorithms_warn_only_enabled(),
        bool(dcfg.warn_only),
    )
    report.add(
        name,
        "fill_uninitialized_memory",
        torch.utils.deterministic.fill_uninitialized_memory,
        bool(dcfg.fill_uninitialized_memory),
    )
    report.add(
        name, "cuda.matmul.allow_tf32", torch.backends.cuda.matmul.allow_tf32, bool(dcfg.allow_tf32)
    )
    report.add(name, "cudnn.allow_tf32", torch.backends.cudnn.allow_tf32, bool(dcfg.allow_tf32))
    if compiling:  # torch.compile: Inductor's kernels are chosen, and tuned, by it
        inductor = importlib.import_module("torch._inductor.config")
        if hasattr(inductor, "deterministic"):
            inductor.deterministic = bool(dcfg.deterministic_algorithms)
        report.add(
            name,
            "inductor deterministic",
            getattr(inductor, "deterministic", "not in this torch"),
            bool(dcfg.deterministic_algorithms),
            note="no benchmarking on the device that could choose other numerics",
        )
    report.add(
        name,
        "float32_matmul_precision",
        torch.get_float32_matmul_precision(),
        "high" if dcfg.allow_tf32 else "highest",
    )
    if device.type == "cuda":
        report.add(name, "gpu", torch.cuda.get_device_name(device))
        report.add(name, "cuda / cudnn", f"{torch.version.cuda} / {torch.backends.cudnn.version()}")
        report.add(name, "cuda generators", "seeded", note="torch.manual_seed covers all devices")
    else:
        report.add(name, "gpu", None, note="no CUDA device: the flags are set but not exercised")


def _layer3_data(report: DeterminismReport, cfg: DictConfig) -> None:
    name = "3 data"
    report.add(name, "sample order", "keyed", note="randperm keyed (seed, 'order', epoch)")
    report.add(
        name,
        "augmentation",
        "keyed per sample",
        note="generator keyed (seed, 'augment', epoch, index)",
    )
    report.add(name, "loader generator", "keyed", note="(seed, 'loader'): worker base seeds")
    report.add(
        name,
        "worker_init_fn",
        "seeds numpy/random",
        note="from torch.initial_seed(), for third-party transforms only",
    )
    if not cfg.loader.get("auto"):  # else chosen with the data: the "loader" row
        report.add(
            name, "num_workers", int(cfg.loader.num_workers), note="does not change the bits"
        )
    if cfg.loader.get("on_device"):
        report.add(
            name, "loader on device", True, note="same keyed draws and bytes as the worker path"
        )


def _layer4_ops(report: DeterminismReport, cfg: DictConfig, device: torch.device) -> None:
    name = "4 ops"
    amp = "off" if not cfg.amp.enabled else f"{cfg.amp.dtype} autocast ({device.type})"
    report.add(
        name,
        "amp",
        amp,
        note="GradScaler on" if cfg.amp.enabled and str(cfg.amp.dtype) == "float16" else "",
    )
    report.add(
        name,
        "forward randomness",
        "keyed",
        note="generator re-seeded (seed, 'forward', step, micro_batch)",
    )
    t = cfg.trainer
    compiled = str(t.compile) != "off"
    report.add(
        name,
        "torch.compile",
        str(t.compile),
        note="static shapes; compiled and eager kernels differ in the last bits"
        if compiled
        else "",
    )
    k = int(cfg.trainer.batch_size) // int(cfg.trainer.micro_batch_size)
    report.add(
        name, "micro-batches per step", k, note="gradients summed by a fixed binary tree over k"
    )
    o = cfg.optim
    implementation = (
        "fused" if o.get("fused") else {True: "foreach", False: "for_loop"}.get(o.get("foreach"))
    )
    report.add(
        name,
        "optimizer implementation",
        f"{str(o._target_).rsplit('.', 1)[-1]} / {implementation or 'not pinned'}",
        note="pinned: fused, foreach and for-loop differ in the last bits",
    )


def apply_determinism(cfg: DictConfig, device: torch.device) -> DeterminismReport:
    """Apply layers 0-2, record layers 3-4, and return the report.

    Raises :class:`DeterminismError` in strict mode when something requested is not in
    effect (in warn mode it is reported, not raised)."""
    dcfg = cfg.determinism
    report = DeterminismReport(mode=str(dcfg.mode), device=str(device))
    _layer0_process(report, dcfg, device)
    _layer1_cpu(report, cfg)
    _layer2_gpu(report, dcfg, device, compiling=str(cfg.trainer.compile) != "off")
    _layer3_data(report, cfg)
    _layer4_ops(report, cfg, device)
    if str(dcfg.mode) == "strict" and report.failures:
        names = ", ".join(e.name for e in report.failures)
        raise DeterminismError(
            f"determinism=strict: {names} not in effect; start the run through train.py "
            "(it pins the process environment), or use determinism=warn to go on anyway."
        )
    return report
