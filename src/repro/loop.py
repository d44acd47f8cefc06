"""The training loop (DESIGN.md, principle 3): a step is K micro-batches of fixed size whose
gradients are summed by a fixed binary tree over k, whoever computes them.

``train(cfg, run_dir)`` is what ``train.py`` calls: it applies the determinism layers, builds
data and model, runs the steps, evaluates, and writes metrics, a checkpoint and
``summary.json`` into ``run_dir``.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

from repro.checkpoint import atomic_write, save_checkpoint
from repro.config import config_hash, resolved_container, validate
from repro.data import DataSplits, DeviceNormalizer, make_train_loader
from repro.determinism import apply_determinism
from repro.errors import ConfigError, ReproError
from repro.progress import Progress
from repro.rng import derive_seed, seed_forward
from repro.trace import (
    ENV_FILE,
    TRACE_FILE,
    TraceWriter,
    run_fingerprint,
    state_dict_sha256,
    state_digests,
    tensors_sha256,
)

log = logging.getLogger("repro")
T = TypeVar("T")


def tree_reduce(lo: int, hi: int, leaf: Callable[[int], T], add: Callable[[T, T], T]) -> T:
    """Sum ``leaf(lo) + ... + leaf(hi - 1)`` as a fixed binary tree (split at the midpoint).

    Leaves are evaluated in order, left to right; at most ceil(log2 K) + 1 partial sums (one
    gradient copy each) are alive at once.
    Any contiguous power-of-two share of the leaves is a whole subtree, so processes that
    each own such a share can compute their subtree and combine in the same shape."""
    if hi - lo == 1:
        return leaf(lo)
    mid = lo + (hi - lo) // 2
    left = tree_reduce(lo, mid, leaf, add)
    return add(left, tree_reduce(mid, hi, leaf, add))


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu (``validate`` has checked the others)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over K micro-batches. Returns (loss, grad norm) as device tensors.

    Each micro-batch's loss is its summed cross-entropy / B, so the tree sum of the K
    gradients is the gradient of the mean loss over the global batch."""
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device

    def leaf(k: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        images, labels = micro_batches[k]
        seed_forward(device, seed, step, k)  # dropout masks keyed by (seed, step, k)
        with autocast():
            logits = model(images)
        loss = F.cross_entropy(logits.float(), labels, reduction="sum") / batch_size
        grads = torch.autograd.grad(scaler.scale(loss), params, materialize_grads=True)
        return loss.detach(), list(grads)

    def add(a, b):
        torch._foreach_add_(a[1], b[1])
        return a[0] + b[0], a[1]

    loss, grads = tree_reduce(0, len(micro_batches), leaf, add)
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
    """Append rows to a CSV in the run directory; floats as ``repr`` (round-trip exact)."""

    def __init__(self, path: Path, fields: list[str]) -> None:
        self.file = open(path, "w", newline="")
        self.writer = csv.writer(self.file)
        self.writer.writerow(fields)

    def write(self, rows: list[list[Any]]) -> None:
        self.writer.writerows([[repr(v) if isinstance(v, float) else v for v in r] for r in rows])
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def train(
    cfg: DictConfig,
    run_dir: Path,
    *,
    after_step: Callable[[int, nn.Module], None] | None = None,
) -> dict[str, Any]:
    """Run one training job into ``run_dir`` and return its summary.

    ``after_step(step, model)``, if given, is called after each optimizer step (1-based), before
    that step's digests are taken: a hook for instrumentation and for tests."""
    t_start = time.perf_counter()
    validate(cfg)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    device = resolve_device(str(cfg.device))

    report = apply_determinism(cfg, device)  # layers 0-2, before model and loader exist
    report.save(run_dir)
    log.info(report.format())
    cfg_container, cfg_hash = resolved_container(cfg), config_hash(cfg)
    fingerprint = run_fingerprint(cfg_container, cfg_hash)  # flags read back, now in effect
    _write_json(run_dir / ENV_FILE, fingerprint)

    seed, t = int(cfg.seed), cfg.trainer
    max_steps, trace_every = int(t.max_steps), int(t.trace_every)
    splits: DataSplits = instantiate_group(cfg.data, "data")
    model = build_model(cfg, splits, device)
    optimizer = build_optimizer(model, cfg.optim)
    schedule = build_schedule(optimizer, cfg.optim, max_steps)
    fp16 = bool(cfg.amp.enabled) and str(cfg.amp.dtype) == "float16"
    scaler = torch.amp.GradScaler(device.type, enabled=fp16)
    amp_dtype = torch.float16 if str(cfg.amp.dtype) == "float16" else torch.bfloat16

    def autocast() -> AbstractContextManager:
        return torch.autocast(device.type, dtype=amp_dtype, enabled=bool(cfg.amp.enabled))

    loader = make_train_loader(
        splits,
        seed,
        int(t.batch_size),
        int(t.micro_batch_size),
        cfg.loader,
        pin_memory=bool(cfg.loader.pin_memory) and device.type == "cuda",
    )
    steps_per_epoch = loader.batch_sampler.steps_per_epoch
    normalize = DeviceNormalizer(splits, device)
    k_micro = int(t.batch_size) // int(t.micro_batch_size)
    n_params = sum(p.numel() for p in model.parameters())
    log.info(
        f"model {type(model).__name__} ({n_params:,} parameters) on {device}; "
        f"{len(splits.train)} train / {len(splits.val)} val samples; "
        f"batch {t.batch_size} = {k_micro} x {t.micro_batch_size}; {max_steps} steps"
    )

    metrics = CsvLog(run_dir / "metrics.csv", ["step", "epoch", "loss", "grad_norm", "lr"])
    evals = CsvLog(run_dir / "eval.csv", ["step", "val_loss", "val_accuracy"])
    trace = TraceWriter(run_dir / TRACE_FILE) if t.trace else None
    if trace:
        tensors, whole = state_digests(model.state_dict())
        trace.write([{"step": 0, "tensors": tensors, "weights_sha256": whole}])
    # (step, loss, grad norm, lr, extra trace fields): losses stay on the device until a flush
    pending: list[tuple[int, torch.Tensor, torch.Tensor, float, dict[str, Any]]] = []
    progress = Progress(max_steps, enabled=bool(t.progress))
    last_loss, val_loss, val_acc = float("nan"), float("nan"), float("nan")

    def flush() -> None:
        nonlocal last_loss
        if not pending:
            return
        values = torch.stack(
            [torch.stack([loss, norm.float()]) for _, loss, norm, _, _ in pending]
        ).tolist()
        rows = [
            [s, (s - 1) // steps_per_epoch, v[0], v[1], lr]
            for (s, _, _, lr, _), v in zip(pending, values, strict=True)
        ]
        metrics.write(rows)
        if trace:
            trace.write(
                [
                    {"step": s, "epoch": e, "loss": loss, "grad_norm": norm, "lr": lr, **extra}
                    for (s, e, loss, norm, lr), (*_, extra) in zip(rows, pending, strict=True)
                ]
            )
        last_loss = rows[-1][2]
        pending.clear()

    model.train()
    batches = iter(loader)
    t_loop = time.perf_counter()
    try:
        for step in range(max_steps):
            done = step + 1
            traced = trace is not None and (
                done == 1 or done == max_steps or (trace_every and done % trace_every == 0)
            )
            raw = [next(batches) for _ in range(k_micro)]
            extra: dict[str, Any] = {}
            if traced:
                extra["batch"] = {
                    "inputs": tensors_sha256(*(images for images, _ in raw)),
                    "labels": tensors_sha256(*(labels for _, labels in raw)),
                }
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
            )
            schedule.step()
            if after_step is not None:
                after_step(done, model)
            if traced and (done == max_steps or (trace_every and done % trace_every == 0)):
                extra["tensors"], extra["weights_sha256"] = state_digests(model.state_dict())
            if done == max_steps:
                extra["final"] = True
            pending.append((done, loss, grad_norm, lr, extra))
            if done % int(t.eval_every) == 0 or done == max_steps:
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
            elif done % int(t.log_every) == 0:
                flush()
                progress.update(done, loss=f"{last_loss:.4f}")
    finally:
        progress.close()
        metrics.close()
        evals.close()
        if trace:
            trace.close()
    loop_seconds = time.perf_counter() - t_loop

    state = model.state_dict()
    weights = state_dict_sha256(state)
    env = fingerprint["environment"]
    save_checkpoint(
        run_dir / str(t.checkpoint_name),
        {
            "model": state,
            "optimizer": optimizer.state_dict(),
            "schedule": schedule.state_dict(),
            "scaler": scaler.state_dict(),
            "step": max_steps,
            "config": cfg_container,
            "config_hash": cfg_hash,
            "weights_sha256": weights,
            "environment": env,
        },
    )
    summary = {
        "weights_sha256": weights,
        "steps": max_steps,
        "final_loss": last_loss,
        "val_loss": val_loss,
        "val_accuracy": val_acc,
        "seed": seed,
        "device": str(device),
        "determinism": str(cfg.determinism.mode),
        "amp": str(cfg.amp.dtype) if cfg.amp.enabled else "off",
        "num_workers": int(cfg.loader.num_workers),
        "config_hash": cfg_hash,
        "run_dir": str(run_dir),
        "images_per_second": max_steps * int(t.batch_size) / loop_seconds,
        "wall_seconds": time.perf_counter() - t_start,
        "environment": env,
    }
    _write_json(run_dir / "summary.json", summary)
    log.info(
        f"done: {summary['steps']} steps, final loss {last_loss:.4f}, val accuracy {val_acc:.4f}\n"
        f"  run dir         {run_dir}\n  weights sha256  {weights}"
    )
    return summary


def _write_json(path: Path, obj: Any) -> None:
    atomic_write(path, lambda f: f.write((json.dumps(obj, indent=2) + "\n").encode()))
