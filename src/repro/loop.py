"""The training loop (DESIGN.md, principle 3): a step is K micro-batches of fixed size whose
gradients are summed by a fixed binary tree over k, whoever computes them.

``train(cfg, run_dir)`` is what ``train.py`` calls: it applies the determinism layers, builds
data and model, runs the steps, evaluates, and writes metrics, a checkpoint and
``summary.json`` into ``run_dir``.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import shutil
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

from repro.checkpoint import (
    CHECKPOINT_DIR,
    atomic_write,
    checkpoint_path,
    find_resume_point,
    mark_good,
    mismatches,
    remove_partial_writes,
    rotate,
    save_checkpoint,
    sidecar,
)
from repro.config import config_hash, resolved_container, validate
from repro.data import DataSplits, DeviceNormalizer, make_train_loader
from repro.determinism import apply_determinism
from repro.dist import (
    StopVote,
    World,
    all_gather_cpu,
    barrier,
    broadcast_object,
    check_same,
    device_for,
    on_main,
)
from repro.dist import init as init_world
from repro.errors import PREEMPTED_EXIT_CODE, CheckpointError, ConfigError, Preempted, ReproError
from repro.progress import Progress
from repro.reduction import Reducer, add_partials, check_split, share, tree_reduce
from repro.rng import derive_seed, global_rng_states, seed_forward, set_global_rng_states
from repro.running_stats import RunningStats
from repro.trace import (
    ENV_FILE,
    TRACE_FILE,
    BackgroundDigests,
    TraceWriter,
    environment,
    run_fingerprint,
    state_dict_sha256,
    state_digests,
    tensors_sha256,
)

log = logging.getLogger("repro")
CHECKPOINT_FORMAT = "repro.checkpoint.v1"


def resolve_device(name: str, world: World | None = None) -> torch.device:
    """``auto`` -> cuda when available, else cpu (``validate`` has checked the others); under
    torchrun, rank r's GPU is ``cuda:LOCAL_RANK``."""
    return device_for(name, world or World())


def instantiate_group(node: DictConfig, group: str, **kwargs: Any) -> Any:
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, ReproError):
            raise cause from None
        detail = f"{type(cause).__name__}: {cause}" if cause else str(err)
        raise ConfigError(
            f"{group}._target_={node._target_!r} could not be built ({detail.splitlines()[0]}); "
            f"check the {group}.* keys against its signature."
        ) from err


def build_model(cfg: DictConfig, splits: DataSplits, device: torch.device) -> nn.Module:
    """Instantiate ``cfg.model`` on the CPU with the generator keyed by ``(seed, "init")``, so
    the initial weights are the same on every device, then move it."""
    with torch.random.fork_rng(devices=[]):  # CPU generator only; restored afterwards
        torch.default_generator.manual_seed(derive_seed(int(cfg.seed), "init"))
        model = instantiate_group(
            cfg.model, "model", num_classes=splits.num_classes, in_channels=splits.in_channels
        )
    return model.to(device)


def build_optimizer(model: nn.Module, o: DictConfig) -> torch.optim.Optimizer:
    impl = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for_loop": {"foreach": False}}[
        str(o.implementation)
    ]
    if str(o.name) == "sgd":
        return torch.optim.SGD(
            model.parameters(),
            lr=o.lr,
            momentum=o.momentum,
            nesterov=o.nesterov,
            weight_decay=o.weight_decay,
            **impl,
        )
    return torch.optim.AdamW(
        model.parameters(),
        lr=o.lr,
        betas=tuple(o.betas),
        eps=o.eps,
        weight_decay=o.weight_decay,
        **impl,
    )


def build_schedule(optimizer: torch.optim.Optimizer, o: DictConfig, max_steps: int):
    warmup = int(o.warmup_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if str(o.schedule) == "constant":
            return 1.0
        progress = (step - warmup) / max(1, max_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    step: int,
    seed: int,
    batch_size: int,
    autocast: Callable[[], AbstractContextManager],
    first: int = 0,
    reducer: Reducer | None = None,
    running_stats: RunningStats | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over K micro-batches. Returns (loss, grad norm) as device tensors.

    Each micro-batch's loss is its summed cross-entropy / B, so the tree sum of the K
    gradients is the gradient of the mean loss over the global batch. Under torchrun this
    process holds micro-batches ``first, first + 1, ...`` (a whole subtree) and ``reducer``
    combines the ranks' partial sums; BatchNorm statistics are folded in afterwards, in
    micro-batch order (:class:`RunningStats`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    recorded: list[list[torch.Tensor]] = []
    stats = running_stats if running_stats else None  # None: no BatchNorm to reconcile

    def leaf(k: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        images, labels = micro_batches[k - first]
        seed_forward(device, seed, step, k)  # dropout masks keyed by (seed, step, k)
        with autocast(), stats.capture() if stats else nullcontext([]) as batch_stats:
            logits = model(images)
        recorded.append(batch_stats)
        loss = F.cross_entropy(logits.float(), labels, reduction="sum") / batch_size
        grads = torch.autograd.grad(scaler.scale(loss), params, materialize_grads=True)
        return loss.detach(), list(grads)

    loss, grads = tree_reduce(first, first + len(micro_batches), leaf, add_partials)
    if reducer is not None:
        loss, grads, recorded = reducer(loss, grads, recorded)
    if stats:
        stats.update(recorded)
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    scaler.unscale_(optimizer)  # a no-op unless fp16
    grad_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm


@torch.no_grad()
def evaluate(
    model: nn.Module,
    splits: DataSplits,
    normalize: DeviceNormalizer,
    batch_size: int,
    autocast: Callable[[], AbstractContextManager],
) -> tuple[float, float]:
    """Mean loss and accuracy on the validation split (fixed order, no augmentation)."""
    model.eval()
    val = splits.val
    loss_sum = torch.zeros((), dtype=torch.float64, device=normalize.device)
    correct = torch.zeros((), dtype=torch.int64, device=normalize.device)
    for i in range(0, len(val), batch_size):
        images, labels = normalize(val.images[i : i + batch_size], val.labels[i : i + batch_size])
        with autocast():
            logits = model(images)
        loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum").double()
        correct += (logits.argmax(dim=1) == labels).sum()
    model.train()
    return loss_sum.item() / len(val), correct.item() / len(val)


class CsvLog:
    """Append rows to a CSV in the run directory; floats as ``repr`` (round-trip exact).

    ``resume_at=s`` keeps the rows of steps <= s already there (a resumed run) and appends."""

    def __init__(self, path: Path, fields: list[str], resume_at: int | None = None) -> None:
        if resume_at is not None and path.is_file():
            with open(path, newline="") as f:
                rows = list(csv.reader(f))[1:]
            kept, last = [], 0
            for r in rows:  # the clean prefix: complete rows, steps rising, up to resume_at
                if len(r) != len(fields) or not r[0].isdigit() or not last < int(r[0]) <= resume_at:
                    break
                kept.append(r)
                last = int(r[0])
            buf = io.StringIO()
            csv.writer(buf).writerows([fields, *kept])
            atomic_write(path, lambda f: f.write(buf.getvalue().encode()))
            self.file = open(path, "a", newline="")
            self.writer = csv.writer(self.file)
        else:
            self.file = open(path, "w", newline="")
            self.writer = csv.writer(self.file)
            self.writer.writerow(fields)
        self.file.flush()

    def write(self, rows: list[list[Any]]) -> None:
        self.writer.writerows([[repr(v) if isinstance(v, float) else v for v in r] for r in rows])
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class PreemptionSignals:
    """SIGTERM / SIGUSR1 (a cluster's notice before it kills or requeues a job) set a flag;
    the loop checkpoints at the next step boundary and exits with ``PREEMPTED_EXIT_CODE``.

    SIGUSR2 is caught too when some Python code already handles it: submitit (Hydra's SLURM
    launcher) requeues a job on SIGUSR2. The loop checkpoints first, then hands the signal to
    that handler (:meth:`hand_over`), so the requeued job resumes from this very step."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> PreemptionSignals:
        if threading.current_thread() is threading.main_thread():
            signals = [signal.SIGTERM, signal.SIGUSR1]
            if callable(signal.getsignal(signal.SIGUSR2)):
                signals.append(signal.SIGUSR2)
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:  # the first notice decides (and is the one handed over)
            self.received = signal.Signals(signum)

    def hand_over(self) -> None:
        """Call the handler that was there before us for the received signal, if any."""
        previous = self._previous.get(self.received) if self.received else None
        if callable(previous):
            self.__exit__()
            previous(int(self.received), None)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def _keep_trace_prefix(path: Path, step: int) -> int:
    """Keep the records of steps <= ``step`` of a trace (a resumed run); return the last
    step kept (less than ``step`` when records are missing)."""
    kept: list[str] = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                break  # a line cut short by the kill
            if record.get("step") != len(kept) or record["step"] > step:
                break
            kept.append(line + "\n")
    atomic_write(path, lambda f: f.write("".join(kept).encode()))
    return len(kept) - 1


def _copy_logs(source: Path, run_dir: Path) -> None:
    """Resuming from another run's directory: start from its logs."""
    for name in (TRACE_FILE, "metrics.csv", "eval.csv", ENV_FILE):
        if (source / name).is_file() and source.resolve() != run_dir.resolve():
            shutil.copyfile(source / name, run_dir / name)


def _refuse_to_overwrite(run_dir: Path) -> None:
    existing = [n for n in (CHECKPOINT_DIR, TRACE_FILE, "summary.json") if (run_dir / n).exists()]
    if existing:
        raise ConfigError(
            f"{run_dir} already holds a run ({', '.join(existing)}); resume it with "
            "trainer.resume=auto, or choose another hydra.run.dir (nothing was overwritten)."
        )


def _resume_point(
    cfg: DictConfig, run_dir: Path, config: dict[str, Any], env: dict[str, Any], device: str
):
    """(path, state, mismatches) to resume from, or None to start at step 0."""
    t = cfg.trainer
    if t.resume is None:
        _refuse_to_overwrite(run_dir)
        return None
    source = run_dir if str(t.resume) == "auto" else Path(str(t.resume)).expanduser()
    source_run = source.parent if source.is_file() else source
    if source_run.name == CHECKPOINT_DIR:
        source_run = source_run.parent
    if source_run.resolve() != run_dir.resolve():
        _refuse_to_overwrite(run_dir)  # resuming another run writes here: it must be new
    for leftover in remove_partial_writes(run_dir):
        log.info(f"resume: removed {leftover.name}, a write interrupted before its rename")
    found = find_resume_point(source, log.warning)
    if found is None:
        if str(t.resume) != "auto":
            raise CheckpointError(f"{source}: holds no checkpoints/ to resume from.")
        finished = [n for n in ("summary.json", str(t.checkpoint_name)) if (run_dir / n).exists()]
        if finished:
            raise CheckpointError(
                f"{run_dir} holds a run ({', '.join(finished)}) but no checkpoints/ to resume "
                "from; choose another hydra.run.dir (nothing was overwritten)."
            )
        log.info(f"resume=auto: no checkpoint in {run_dir} yet; starting at step 0")
        return None
    path, state = found
    differ = mismatches(state, config, env, device)
    if differ and not t.resume_force:
        raise CheckpointError(
            f"{path} was written under another configuration or environment, so resuming "
            "would not give the uninterrupted run's bits; resume with the checkpoint's "
            "settings, or set trainer.resume_force=true to go on anyway (recorded). "
            "Differences: " + "; ".join(differ)
        )
    for d in differ:
        log.warning(f"resume_force: {d}")
    return path, state, differ


def train(
    cfg: DictConfig,
    run_dir: Path,
    *,
    after_step: Callable[[int, nn.Module], None] | None = None,
) -> dict[str, Any]:
    """Run one training job into ``run_dir`` and return its summary.

    With ``trainer.resume`` set, continue from a checkpoint: the weights, trace and metrics
    are those the uninterrupted run produces. ``after_step(step, model)``, if given, is called
    after each optimizer step (1-based), before that step's digests are taken: a hook for
    instrumentation and for tests.

    Under ``torchrun`` every rank calls this with the same ``run_dir``: each computes its
    share of every step's micro-batches, and only rank 0 writes files. The bits are those of
    one process (:mod:`repro.reduction`)."""
    t_start = time.perf_counter()
    validate(cfg)
    world = init_world(cfg.dist, dict(cfg.determinism.nccl_env), str(cfg.device))
    run_dir = Path(run_dir)
    device = resolve_device(str(cfg.device), world)
    seed, t = int(cfg.seed), cfg.trainer
    max_steps, trace_every = int(t.max_steps), int(t.trace_every)
    checkpoint_every, keep = int(t.checkpoint_every), int(t.keep_checkpoints)
    k_micro = int(t.batch_size) // int(t.micro_batch_size)
    check_split(k_micro, world)
    first, count = share(k_micro, world)

    cfg_container, cfg_hash = resolved_container(cfg), config_hash(cfg)
    env = {**environment(), "world_size": world.size, "dist_backend": world.backend}

    def prepare() -> tuple[Any, dict[str, Any] | None]:
        """(resume point or None, the summary of a run that is already complete)."""
        run_dir.mkdir(parents=True, exist_ok=True)
        found = _resume_point(cfg, run_dir, cfg_container, env, device.type)
        at = int(found[1]["step"]) if found else 0
        if at > max_steps:
            raise CheckpointError(
                f"{found[0]} is at step {at}, beyond trainer.max_steps={max_steps}."
            )
        if found and at == max_steps and (run_dir / "summary.json").is_file():
            return found, json.loads((run_dir / "summary.json").read_text())
        return found, None

    # rank 0 looks at the run directory (and refuses before writing anything); every rank
    # gets the checkpoint it chose
    resume, finished = on_main(prepare, world)
    if finished is not None:
        log.info(f"{run_dir}: already complete ({max_steps} steps); nothing to resume")
        return finished
    start = int(resume[1]["step"]) if resume else 0

    report = apply_determinism(cfg, device)  # layers 0-2, before model and loader exist
    fingerprint = run_fingerprint(cfg_container, cfg_hash, env)  # flags read back, in effect
    if world.main:
        report.save(run_dir)
        log.info(report.format())
        _write_json(run_dir / (ENV_FILE if not resume else f"env-resume-{start}.json"), fingerprint)

    if not world.main:
        barrier(world)  # rank 0 builds the data first (a download, say) ...
    splits: DataSplits = instantiate_group(cfg.data, "data")
    if world.main:
        barrier(world)  # ... then the others read what it left
    model = build_model(cfg, splits, device)
    running_stats = RunningStats(model)
    optimizer = build_optimizer(model, cfg.optim)
    schedule = build_schedule(optimizer, cfg.optim, max_steps)
    fp16 = bool(cfg.amp.enabled) and str(cfg.amp.dtype) == "float16"
    scaler = torch.amp.GradScaler(device.type, enabled=fp16)
    amp_dtype = torch.float16 if str(cfg.amp.dtype) == "float16" else torch.bfloat16
    resumes: list[dict[str, Any]] = []
    if resume:
        path, state, differ = resume
        try:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            schedule.load_state_dict(state["schedule"])
            scaler.load_state_dict(state["scaler"])
            set_global_rng_states(state["rng"])
        except (KeyError, RuntimeError, ValueError, TypeError) as err:
            first_line = (str(err).strip().splitlines() or [""])[0][:200]
            raise CheckpointError(
                f"{path}: cannot be restored into this run ({type(err).__name__}: "
                f"{first_line}); resume with the settings it was written with."
            ) from None
        resumes = [
            *state.get("resumes", []),
            {"from": str(path), "step": start, "forced": differ, "world_size": world.size},
        ]
        if world.main:
            _copy_logs(
                path.parent.parent if path.parent.name == CHECKPOINT_DIR else path.parent, run_dir
            )
        log.info(f"resumed from {path} at step {start}")
        del state

    def autocast() -> AbstractContextManager:
        return torch.autocast(device.type, dtype=amp_dtype, enabled=bool(cfg.amp.enabled))

    loader = make_train_loader(
        splits,
        seed,
        int(t.batch_size),
        int(t.micro_batch_size),
        cfg.loader,
        pin_memory=bool(cfg.loader.pin_memory) and device.type == "cuda",
        start_step=start,
        shard=(first, count),
        device=device,
    )
    steps_per_epoch = loader.sampler.steps_per_epoch
    normalize = DeviceNormalizer(splits, device)
    reducer = Reducer(world, str(cfg.dist.reduction)) if world.distributed else None
    n_params = sum(p.numel() for p in model.parameters())
    split = f" ({count} on each of {world.size} processes)" if world.distributed else ""
    log.info(
        f"model {type(model).__name__} ({n_params:,} parameters) on {device}; "
        f"{len(splits.train)} train / {len(splits.val)} val samples; "
        f"batch {t.batch_size} = {k_micro} x {t.micro_batch_size}{split}; {max_steps} steps"
    )

    at = start if resume else None
    tracing = bool(t.trace)
    metrics: CsvLog | NullLog = NullLog()
    evals: CsvLog | NullLog = NullLog()
    trace: TraceWriter | None = None
    if world.main:
        metrics = CsvLog(run_dir / "metrics.csv", ["step", "epoch", "loss", "grad_norm", "lr"], at)
        evals = CsvLog(run_dir / "eval.csv", ["step", "val_loss", "val_accuracy"], at)
        if resume and not tracing and (run_dir / TRACE_FILE).is_file():
            _keep_trace_prefix(run_dir / TRACE_FILE, start)  # no records past the checkpoint
        if tracing and resume:
            kept = _keep_trace_prefix(run_dir / TRACE_FILE, start)
            if kept != start:
                log.warning(f"{TRACE_FILE} held steps up to {kept} only: the trace has a gap")
            trace = TraceWriter(run_dir / TRACE_FILE, mode="a")
        elif tracing:
            trace = TraceWriter(run_dir / TRACE_FILE)
            tensors, whole = state_digests(model.state_dict())
            trace.write([{"step": 0, "tensors": tensors, "weights_sha256": whole}])
    # (step, loss, grad norm, lr, extra trace fields): losses stay on the device until a flush
    pending: list[tuple[int, torch.Tensor, torch.Tensor, float, dict[str, Any]]] = []
    digests = BackgroundDigests()  # the trace's periodic state digests, hashed off the loop
    progress = Progress(max_steps, enabled=bool(t.progress) and world.main, start=start)
    last_loss, val_loss, val_acc = float("nan"), float("nan"), float("nan")
    if resume:  # the values the straight run would hold at this step
        last = resume[1].get("last") or {}
        last_loss = last.get("loss", last_loss)
        val_loss, val_acc = last.get("val_loss", val_loss), last.get("val_accuracy", val_acc)
    resume = resume and (resume[0], None, resume[2])  # the state is restored: let it go

    held: list[dict[str, Any]] = []  # trace records whose state digest is still hashing

    def flush(wait: bool = False) -> None:
        """Write the pending steps' metrics rows, and their trace records up to the first one
        whose state digest the background thread is still hashing (all, with ``wait``)."""
        nonlocal last_loss
        if pending:
            values = torch.stack(
                [torch.stack([loss, norm.float()]) for _, loss, norm, _, _ in pending]
            ).tolist()
            rows = [
                [s, (s - 1) // steps_per_epoch, v[0], v[1], lr]
                for (s, _, _, lr, _), v in zip(pending, values, strict=True)
            ]
            metrics.write(rows)
            if trace:
                held.extend(
                    {"step": s, "epoch": e, "loss": loss, "grad_norm": norm, "lr": lr, **extra}
                    for (s, e, loss, norm, lr), (*_, extra) in zip(rows, pending, strict=True)
                )
            last_loss = rows[-1][2]
            pending.clear()
        ready = 0
        for record in held:
            digest = record.get("tensors")
            if isinstance(digest, Future):
                if not (wait or digest.done()):
                    break
                record["tensors"], record["weights_sha256"] = digest.result()
            ready += 1
        if trace and ready:
            trace.write(held[:ready])
            del held[:ready]

    def checkpoint(step: int) -> Path:
        flush(wait=True)  # the logs on disk cover every step the checkpoint does
        path = checkpoint_path(run_dir, step)
        save_checkpoint(
            path,
            {
                "format": CHECKPOINT_FORMAT,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "schedule": schedule.state_dict(),
                "scaler": scaler.state_dict(),
                "step": step,
                "device": device.type,
                "last": {"loss": last_loss, "val_loss": val_loss, "val_accuracy": val_acc},
                "epoch": step // steps_per_epoch,
                "position_in_epoch": step % steps_per_epoch,
                "rng": global_rng_states(),
                "config": cfg_container,
                "config_hash": cfg_hash,
                "environment": env,
                "resumes": resumes,
            },
        )
        if not mark_good(path):
            log.warning(f"{path}: did not verify when read back; keeping the last good one")
        rotate(run_dir, keep)
        return path

    def batch_digests(raw: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, str] | None:
        """The step's input and label digests over all K micro-batches (gathered from every
        rank: only rank 0 returns them)."""
        images = all_gather_cpu(torch.stack([b[0] for b in raw]).cpu(), world).flatten(0, 1)
        labels = all_gather_cpu(torch.stack([b[1] for b in raw]).cpu(), world).flatten(0, 1)
        if not world.main:
            return None
        return {"inputs": tensors_sha256(*images), "labels": tensors_sha256(*labels)}

    final_weights: str | None = None
    model.train()
    batches = iter(loader)
    vote = StopVote(world) if world.distributed else None
    warm = start + min(10, (max_steps - start) // 2)  # steps left out of the steady rate
    marks: dict[int, float] = {}
    t_loop = time.perf_counter()
    try:
        with PreemptionSignals() as signals:
            for step in range(start, max_steps):
                done = step + 1
                traced = tracing and (
                    done == 1 or done == max_steps or (trace_every and done % trace_every == 0)
                )
                raw = [next(batches) for _ in range(count)]
                extra: dict[str, Any] = {}
                if traced:
                    extra["batch"] = batch_digests(raw)
                if resume and step == start:
                    extra["resumed"] = resumes[-1]
                micro = [normalize(*b) for b in raw]
                lr = schedule.get_last_lr()[0]
                loss, grad_norm = train_step(
                    model,
                    optimizer,
                    scaler,
                    micro,
                    step=step,
                    seed=seed,
                    batch_size=int(t.batch_size),
                    autocast=autocast,
                    first=first,
                    reducer=reducer,
                    running_stats=running_stats,
                )
                schedule.step()
                if done in (warm, max_steps) and done > start:  # steady-state throughput
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    marks[done] = time.perf_counter()
                if after_step is not None:
                    after_step(done, model)
                if traced and (done == max_steps or (trace_every and done % trace_every == 0)):
                    if world.distributed or done == max_steps:  # compared, or needed, now
                        digest = state_digests(model.state_dict())
                        extra["tensors"], extra["weights_sha256"] = digest
                        check_same(extra["weights_sha256"], world, "weights", done)
                    else:  # hashed in the background; written (in this place) at the flush
                        extra["tensors"] = digests.submit(model.state_dict())
                        extra["weights_sha256"] = None
                if done == max_steps:
                    extra["final"] = True
                    final_weights = extra.get("weights_sha256")  # digested just above if traced
                if world.main:
                    pending.append((done, loss, grad_norm, lr, extra))
                if world.main and (done % int(t.eval_every) == 0 or done == max_steps):
                    val_loss, val_acc = evaluate(
                        model, splits, normalize, int(t.eval_batch_size), autocast
                    )
                    extra["eval"] = {"val_loss": val_loss, "val_accuracy": val_acc}
                    flush()
                    evals.write([[done, val_loss, val_acc]])
                    progress.close()
                    log.info(
                        f"step {done}/{max_steps}  loss {last_loss:.4f}  "
                        f"val_loss {val_loss:.4f}  val_acc {val_acc:.4f}"
                    )
                elif world.main and done % int(t.log_every) == 0:
                    flush()
                    progress.update(done, loss=f"{last_loss:.4f}")
                saved = None
                if world.main and (
                    done == max_steps or (checkpoint_every and done % checkpoint_every == 0)
                ):
                    saved = checkpoint(done)
                if vote is None:
                    stop = signals.received is not None
                else:  # every rank stops after the same step (the vote of the step before)
                    stop = vote.outcome()
                    if not stop and done < max_steps:
                        vote.cast(signals.received is not None)
                if stop and done < max_steps:
                    if world.main:
                        saved = saved or checkpoint(done)
                    barrier(world)  # no rank leaves (and has torchrun stop the others) early
                    progress.close()
                    name = signals.received.name if signals.received else "a signal to a peer"
                    (log.warning if world.main else log.info)(
                        f"{name} received: stopped after step {done}/{max_steps}, "
                        f"checkpoint {saved or checkpoint_path(run_dir, done)}; exit status "
                        f"{PREEMPTED_EXIT_CODE}. Resume with the same command plus "
                        f"trainer.resume=auto hydra.run.dir={run_dir}"
                    )
                    for f in (metrics, evals, trace):  # all on disk before handing over
                        if f:
                            f.close()
                    signals.hand_over()  # e.g. submitit: requeue this job (and exit)
                    raise Preempted(done, name)
    finally:
        digests.close()
        progress.close()
        metrics.close()
        evals.close()
        if trace:
            trace.close()
    loop_seconds = time.perf_counter() - t_loop

    summary = None
    if world.main:
        final = checkpoint_path(run_dir, max_steps)
        if not final.is_file():  # resumed at the last step from another directory
            checkpoint(max_steps)
        final_copy = run_dir / str(t.checkpoint_name)
        shutil.copyfile(final, final_copy)  # the run's result, next to summary.json
        shutil.copyfile(sidecar(final), sidecar(final_copy))
        weights = final_weights or state_dict_sha256(model.state_dict())
        summary = {
            "weights_sha256": weights,
            "steps": max_steps,
            "final_loss": last_loss,
            "val_loss": val_loss,
            "val_accuracy": val_acc,
            "seed": seed,
            "device": str(device),
            "world_size": world.size,
            "determinism": str(cfg.determinism.mode),
            "amp": str(cfg.amp.dtype) if cfg.amp.enabled else "off",
            "num_workers": int(cfg.loader.num_workers),
            "config_hash": cfg_hash,
            "run_dir": str(run_dir),
            "images_per_second": (max_steps - start) * int(t.batch_size) / loop_seconds,
            # from the end of step `warm` to the last update; evaluation and checkpoints
            # in between count, the final ones do not
            "steady_images_per_second": (
                (max_steps - warm) * int(t.batch_size) / (marks[max_steps] - marks[warm])
                if warm in marks and max_steps in marks and max_steps > warm
                else None
            ),
            "wall_seconds": time.perf_counter() - t_start,
            "resumes": resumes,
            "environment": env,
        }
        _write_json(run_dir / "summary.json", summary)
        log.info(
            f"done: {summary['steps']} steps, final loss {last_loss:.4f}, "
            f"val accuracy {val_acc:.4f}\n"
            f"  run dir         {run_dir}\n  weights sha256  {weights}"
        )
    return broadcast_object(summary, world)


class NullLog:
    """What ranks other than 0 log to: nothing."""

    def write(self, rows: list[list[Any]]) -> None:
        pass

    def close(self) -> None:
        pass


def _write_json(path: Path, obj: Any) -> None:
    atomic_write(path, lambda f: f.write((json.dumps(obj, indent=2) + "\n").encode()))
