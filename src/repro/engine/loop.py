"""The training loop: build, resume, then for each step ``train_step → evaluate → log →
checkpoint``. ``train(cfg, run_dir)`` is what ``train.py`` calls.

Each concern has its own module; this one only puts them in order:

=====================  ===============================================================
``repro.records.rundir``       the run directory: start new, resume, or refuse
``repro.defense.determinism``  the four layers and the report
``repro.engine.build``        data, model, task, optimizer, schedule, precision from the config
``repro.engine.step``         one step: K micro-batches summed in a fixed order
``repro.engine.evaluation``   the task's metrics on the validation split
``repro.engine.inference``    trainer.test: the best checkpoint on the test split
``repro.records.logs``         ``trace.jsonl``, the console, the rows for the loggers
``repro.records.loggers``      the ``logger`` group: ``metrics.csv``/``eval.csv``, TensorBoard...
``repro.records.trace``        what the trace digests (inputs, weights)
``repro.records.checkpoint``   atomic, checksummed checkpoints and best.pt; restoring one
``repro.base.signals``      SIGTERM/SIGUSR1/Ctrl-C caught; before the first step: stop there
``repro.engine.preemption``   SIGTERM/SIGUSR1: stop after the step (the loop checkpoints first)
``repro.engine.dist``         torchrun: ranks, shares of a step, the reduction across ranks
=====================  ===============================================================
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from repro.base.errors import Diverged
from repro.base.files import (
    ENV_FILE,
    SUMMARY_FILE,
    TEST_FILE,
    TEST_PER_SAMPLE_FILE,
    VAL_PER_SAMPLE_FILE,
)
from repro.base.progress import Throughput, span
from repro.base.signals import PreemptionSignals, armed
from repro.base.world import World, barrier, broadcast_object, on_main
from repro.components.data import DataSplits, DeviceNormalizer, loading
from repro.components.data.intensity import describe as describe_intensity
from repro.components.data.pipeline_check import UNPROVEN as AUGMENT_UNPROVEN
from repro.components.data.sample_settings import SAMPLE_THREADS
from repro.defense.config import config_hash, resolved_container, validate
from repro.defense.determinism import DeterminismReport, apply_determinism
from repro.engine.build import Training, build_data, build_loader, build_training, instantiate_model
from repro.engine.dist import init as init_world
from repro.engine.doctor import explain_nondeterministic_op
from repro.engine.evaluation import check_task, evaluate_split
from repro.engine.inference import choose_checkpoint, evaluate_checkpoint
from repro.engine.nonfinite import FiniteGuard, Step
from repro.engine.preemption import Preemption
from repro.engine.reduction import Reducer, check_split, share
from repro.engine.settle import LoaderChoice, Settled, resolve_device, settle
from repro.engine.step import NotFinite, train_step
from repro.records.checkpoint import (
    Checkpointer,
    RunIdentity,
    cannot_restore,
    checkpoint_path,
    copy_checkpoint,
    read_checkpoint,
    restore_training,
)
from repro.records.fingerprint import SPLIT_KEY, environment, run_fingerprint
from repro.records.loggers import Loggers, RunInfo
from repro.records.logs import NullLog, TrainingLog
from repro.records.rundir import (
    ResumePoint,
    RunDirLock,
    adopt_logs,
    check_room,
    disk_error,
    prepare_run_dir,
    write_json,
)
from repro.records.scoring import scoring_record
from repro.records.trace import StepTracer, state_dict_sha256, state_digests
from repro.records.weights import KEY as WEIGHTS_KEY
from repro.records.weights import report_row

log = logging.getLogger("repro")


def train(
    cfg: DictConfig,
    run_dir: Path,
    *,
    after_step: Callable[[int, nn.Module], None] | None = None,
    accepted: Callable[[Path], None] | None = None,
) -> dict[str, Any]:
    """Run one training job into ``run_dir`` and return its summary.

    With ``trainer.resume`` set, continue from a checkpoint: the weights, trace and metrics
    are those the uninterrupted run produces. ``after_step(step, model)``, if given, is called
    after each optimizer step (1-based), before that step's digests are taken: a hook for
    instrumentation and for tests. ``accepted(run_dir)`` is called on rank 0 once the run
    directory is taken (``train.py`` writes the launch's ``.hydra/`` then), never for a
    refused launch. Under ``torchrun`` every rank calls this with the same ``run_dir``: each
    computes its share of every step's micro-batches, only rank 0 writes files, and the bits
    are those of one process (:mod:`repro.engine.reduction`)."""
    with armed() as signals:  # a notice from here on stops the run where it loses nothing
        run = Run.start(cfg, run_dir)
        signals.stop_before_training(run.dir)
        lock = RunDirLock(run.dir)  # rank 0 takes it, for the run's lifetime
        try:
            return _train(run, lock, signals, after_step, accepted)
        except OSError as err:  # a full or read-only disk: one line, with the way back
            explained = disk_error(err, run.dir)
            if explained is None:
                raise
            raise explained from err
        finally:
            try:
                run.loggers.close()  # also after a crash: a run stopped early is marked so
            finally:
                lock.release()


def _train(
    run: Run,
    lock: RunDirLock,
    signals: PreemptionSignals,
    after_step: Callable[[int, nn.Module], None] | None,
    accepted: Callable[[Path], None] | None,
) -> dict[str, Any]:
    cfg, t, world = run.cfg, run.cfg.trainer, run.world
    max_steps = int(t.max_steps)
    first, count = micro_batch_share(cfg, world)
    report = apply_determinism(cfg, run.device)  # layers 0-2, before model and loader exist
    # built before the run directory is touched: a config that cannot build changes nothing
    data = build_data(cfg, world)
    built = instantiate_model(cfg, data)  # on the CPU: the same initial weights everywhere
    settled = settle(cfg, run.device, data, built[0])  # every auto left, once; none after
    training = build_training(cfg, data, settled, built)
    run = run.resolved(settled, training, report, data)  # what is hashed: the settled config
    cfg, t = run.cfg, run.cfg.trainer
    report_data(report, settled.loader, data, cfg)  # loader=auto: the same bits whichever
    normalize = DeviceNormalizer(data, run.device, training.channels_last)
    metric_names = checked_task(run, training, data, normalize)  # before the run directory
    signals.stop_before_training(run.dir)
    # rank 0 takes the directory's lock and looks at it (and refuses before writing
    # anything); every rank gets its answer and the checkpoint to resume from
    resume, finished = on_main(functools.partial(take_run_dir, run, lock, training), world)
    if finished is not None:
        log.info(f"{run.dir}: already complete ({max_steps} steps); nothing to resume")
        return finished
    if world.main and accepted is not None:
        accepted(run.dir)
    start = resume.step if resume else 0
    write_run_start(run, report, start)
    if world.main:  # writable, with room for two checkpoints, before the first step
        check_room(run.dir, sum(v.nbytes for v in training.model.state_dict().values()))
    resumes = restore(run, training, resume) if resume else []
    loader = build_loader(cfg, data, run.device, start, (first, count), settled.loader.cfg)
    steps_per_epoch = loader.sampler.steps_per_epoch
    reducer = make_reducer(cfg, world)
    describe(run, training, data, count, settled.loader)
    logs = open_logs(run, training, steps_per_epoch, metric_names, resume)
    checkpoints = open_checkpoints(run, training, steps_per_epoch, resumes, resume, data)
    signals.stop_before_training(run.dir, start)
    tracer = StepTracer.for_run(t, world)
    training.model.train()
    with logs, closing(tracer), loading(loader) as batches:  # the workers start here
        preemption = Preemption(signals, world, max_steps)
        clock = Throughput(start, max_steps, training.batch_size, run.device)
        batches = clock.timed(batches)  # the time the loop waits for the loader
        eval_every, checkpoint_every = int(t.eval_every), int(t.checkpoint_every)  # read once
        replay = (run, training, data, settled.loader.cfg, normalize, (first, count), reducer)
        guard = finite_guard(run, training, start, functools.partial(replay_steps, *replay))
        upcoming = next_step_batches(batches, count, normalize)
        for step in range(start, max_steps):
            done = step + 1
            if isinstance(upcoming, Exception):  # the loader failed on this step's batches
                raise upcoming
            raw, micro = upcoming  # this rank's micro-batches: as loaded, and on the device
            if done < max_steps:  # queued before this step's host synchronisation: no gap
                try:
                    upcoming = next_step_batches(batches, count, normalize)
                except Exception as err:  # raised when its step comes: after this step's
                    upcoming = err  # checkpoint, as without the look-ahead
            record = tracer.inputs(done, raw)
            if resume and step == start:
                record["resumed"] = resumes[-1]
            lr = training.schedule.get_last_lr()[0]
            try:
                loss, grad_norm = train_step(training, micro, step, first=first, reducer=reducer)
            except RuntimeError as err:  # strict mode and an op with no deterministic kernel?
                explain_nondeterministic_op(err, training, *micro[0])  # one line if so
                raise
            if guard is not None:
                guard.note(Step(done, loss, grad_norm, lr, dict(record)))
            clock.tick(done)
            if after_step is not None:
                after_step(done, training.model)
            if guard is not None and guard.reads_at(done, tracer):
                stop_if_diverged(guard, run, checkpoints, logs, tracer)
            record.update(tracer.state(done, training.model))
            metrics = None
            if world.main and due(done, eval_every, max_steps):
                result = evaluate_split(training, data.val, normalize, int(t.eval_batch_size))
                result.write_per_sample(run.dir / VAL_PER_SAMPLE_FILE, step=done)
                metrics = result.metrics
            logs.step(done, loss, grad_norm, lr, record, metrics)
            if guard is None:  # trainer.on_nonfinite=continue
                logs.warn_if_diverged()
            if metrics is not None:  # before the step's checkpoint, which records the best
                checkpoints.consider_best(done, metrics, logs)
            if world.main and due(done, checkpoint_every, max_steps):
                checkpoints.save(done, logs)
            if preemption.poll(done):
                if guard is not None:
                    stop_if_diverged(guard, run, checkpoints, logs, tracer)
                save_before_stopping(run, checkpoints, logs, tracer, done)
                logs.close()  # all on disk before handing the signal over
                preemption.stop(done, checkpoint_path(run.dir, done), run.dir)
    clock.stop()
    done_with = (run, training, data, checkpoints, logs, tracer, clock, settled.loader)
    return broadcast_object(finish(*done_with) if world.main else None, world)


def checked_task(
    run: Run, training: Training, data: DataSplits, normalize: DeviceNormalizer
) -> list[str]:
    """The task's metric names, from its metrics on a few validation samples, and the model's
    class count checked against the data's (:func:`repro.engine.evaluation.check_task`): on rank 0,
    every rank getting the names or the error, before the run directory is touched."""
    check = functools.partial(check_task, training, data, normalize, run.cfg.model)
    return on_main(check, run.world)


def report_data(
    report: DeterminismReport, chosen: LoaderChoice, data: DataSplits, cfg: DictConfig
) -> None:
    """Layer 3's rows: the loader chosen, the augmentation (which preset chose it, and each
    pipeline's class) and what the augmentation self-check tried."""
    report.add("3 data", "loader", chosen.name, note=chosen.why)
    report.add("3 data", "augment", augment_choice(cfg))
    report.add(
        "3 data",
        "per-sample work",
        f"{SAMPLE_THREADS} thread, the run's flags",
        note="in workers and in this process alike (repro.components.data.sample_settings)",
    )
    if data.augment_check is not None:
        report.add("3 data", "augment self-check", data.augment_check.summary())
        report.not_covered.append(AUGMENT_UNPROVEN)


def augment_choice(cfg: DictConfig) -> str:
    """``augment=segmentation (experiment=segmentation): train SegmentationAugment, eval
    Resize``: the group's option and the preset the run was composed with (where Hydra
    composed it: ``train.py``), and the class of each pipeline's ``_target_``."""
    from hydra.core.hydra_config import HydraConfig

    node = cfg.get("augment") or {}
    parts = []
    for part in ("train", "eval"):
        target = (node.get(part) or {}).get("_target_") if node.get(part) else None
        parts.append(f"{part} {str(target).rsplit('.', 1)[-1] if target else 'none'}")
    option = preset = None
    if HydraConfig.initialized():
        option = HydraConfig.get().runtime.choices.get("augment")
        preset = HydraConfig.get().runtime.choices.get("experiment")
    chose = f" (experiment={preset})" if preset and option else ""
    return f"augment={option}{chose}: {', '.join(parts)}" if option else ", ".join(parts)


@dataclass(frozen=True)
class Run:
    """Where and as what this process trains."""

    cfg: DictConfig
    dir: Path
    world: World
    device: torch.device
    identity: RunIdentity
    started: float  # time.perf_counter() at the start
    loggers: Loggers = field(default_factory=Loggers)  # rank 0's, opened with the logs

    @classmethod
    def start(cls, cfg: DictConfig, run_dir: Path) -> Run:
        """Validate the config, join the process group (torchrun), pick the device."""
        started = time.perf_counter()
        validate(cfg)
        world = init_world(cfg.dist, dict(cfg.determinism.nccl_env), str(cfg.device))
        device = resolve_device(str(cfg.device), world)
        env = {**environment(), "world_size": world.size, "dist_backend": world.backend}
        identity = RunIdentity(resolved_container(cfg), config_hash(cfg), env, device.type)
        return cls(cfg, Path(run_dir), world, device, identity, started)

    def resolved(
        self, settled: Settled, training: Training, report: DeterminismReport, data: DataSplits
    ) -> Run:
        """This run with its settled values that decide the bits in the config
        (:meth:`repro.engine.settle.Settled.recorded`: ``trainer.channels_last=auto`` replaced
        by the format chosen) and its identity (the config hash, what a resume compares)
        recomputed: a resume across formats is refused as for an explicit change. The
        weights files the model's construction read join its environment (env.json and
        checkpoints record them; a resume across other files is refused:
        :func:`repro.records.weights.weights_mismatches`). Both go into the determinism
        report. So do what decided a folder's split besides the config (``data``'s
        ``split_inputs``: its file names, its group or split CSV, as digests): ``repro
        compare`` lists them, and a resume on other ones is refused
        (:func:`repro.records.fingerprint.split_mismatches`)."""
        layout, why = settled.memory_format
        report.add("4 ops", "memory format", layout, note=why)
        files, why = report_row(training.pretrained_weights)
        report.add("1 CPU", "pretrained weights", files, note=why)  # beside the keyed init
        cfg = settled.recorded(self.cfg)
        ident = self.identity
        env = {**ident.environment, WEIGHTS_KEY: training.pretrained_weights}
        if getattr(data, "split_inputs", None) is not None:  # a folder's
            env[SPLIT_KEY] = data.split_inputs
        if cfg is self.cfg:
            identity = dataclasses.replace(ident, environment=env)
        else:
            identity = RunIdentity(resolved_container(cfg), config_hash(cfg), env, ident.device)
        return dataclasses.replace(self, cfg=cfg, identity=identity)


def take_run_dir(
    run: Run, lock: RunDirLock, training: Training
) -> tuple[ResumePoint | None, dict[str, Any] | None]:
    """Rank 0: the run directory's lock, then :func:`repro.records.rundir.prepare_run_dir` (which
    passes over a checkpoint that cannot be restored into ``training``)."""
    lock.acquire()
    answer = prepare_run_dir(
        run.cfg, run.dir, run.identity, functools.partial(cannot_restore, training)
    )
    lock.accept()  # the log records held until now go into the directory's log file
    return answer


def save_before_stopping(
    run: Run, checkpoints: Checkpointer, logs: TrainingLog, tracer: StepTracer, done: int
) -> None:
    """Every rank, when the run stops early (pre-emption) after step ``done``: the ranks'
    digests not compared yet, then rank 0's checkpoint of ``done`` (unless it has one)."""
    tracer.check_pending()
    if run.world.main and checkpoints.last_saved != done:
        checkpoints.save(done, logs)


def finite_guard(
    run: Run, training: Training, start: int, replay: Callable[[list[int]], None]
) -> FiniteGuard | None:
    """``trainer.on_nonfinite=stop``: the guard that reads the steps where the host reads the
    device anyway (:mod:`repro.engine.nonfinite`); None for ``continue``."""
    t = run.cfg.trainer
    if t.on_nonfinite != "stop":
        return None
    return FiniteGuard(
        training,
        start,
        replay,
        loss_only=training.precision.scaler.is_enabled(),
        every=(int(t.log_every), int(t.eval_every), int(t.checkpoint_every), int(t.max_steps)),
    )


def replay_steps(
    run: Run,
    training: Training,
    data: DataSplits,
    loader_cfg: DictConfig,
    normalize: DeviceNormalizer,
    share: tuple[int, int],
    reducer: Reducer | None,
    steps: list[int],
) -> None:
    """Train ``steps`` (consecutive, 0-based) again, each checked at once
    (:class:`FiniteGuard`'s replay): their batches from a loader started at the first, as a
    resume starts one -- the same keys, the same bytes."""
    first, count = share
    loader = build_loader(run.cfg, data, run.device, steps[0], share, loader_cfg)
    with loading(loader) as batches:
        for step in steps:
            _, micro = next_step_batches(batches, count, normalize)
            train_step(training, micro, step, first=first, reducer=reducer, stop_if_not_finite=True)


def stop_if_diverged(
    guard: FiniteGuard, run: Run, checkpoints: Checkpointer, logs: TrainingLog, tracer: StepTracer
) -> None:
    """Every rank, where the loop reads the device: if a step since the last read was not
    finite (step N), the state is brought back to step N - 1 (:class:`FiniteGuard`), its
    checkpoint kept and step N's values logged; then the run stops. Nothing of step N or
    later is applied, logged, evaluated or saved."""
    bad = guard.verify()
    if bad is None:
        return
    logs.forget_from(bad.done)
    keep_last_finite(run, checkpoints, logs, tracer, bad.done - 1)
    logs.step(bad.done, bad.loss, bad.grad_norm, bad.lr, bad.record)
    logs.flush(wait=True)
    barrier(run.world)  # no rank exits (and has torchrun stop rank 0) before the save
    raise diverged(run, bad.done, NotFinite(bad.loss, bad.grad_norm)) from None


def keep_last_finite(
    run: Run, checkpoints: Checkpointer, logs: TrainingLog, tracer: StepTracer, step: int
) -> None:
    """Every rank, when step ``step + 1`` is not finite (on every rank: the loss and norm are
    the reduced ones): the ranks' digests not compared yet; then rank 0 keeps the checkpoint
    of ``step``, unless there is one (a periodic one, or the one this run resumed from) or
    nothing was trained yet."""
    tracer.check_pending()
    kept = checkpoint_path(run.dir, step)
    if run.world.main and step and checkpoints.last_saved != step and not kept.is_file():
        checkpoints.save(step, logs)


def diverged(run: Run, done: int, bad: NotFinite) -> Diverged:
    """The one line for step ``done``, whose loss or gradient norm is not finite: nothing of
    it was applied, and the checkpoint of the step before it holds the last finite state."""
    loss, norm = float(bad.loss), float(bad.grad_norm)
    if done == 1:
        kept = "at the first step, so there is nothing to keep"
    else:
        kept = f"the last finite step's checkpoint is {checkpoint_path(run.dir, done - 1)}"
    return Diverged(
        f"step {done}: the loss is {loss} and the gradient norm {norm}: training diverged; "
        f"{kept}. Lower optim.lr, or set trainer.on_nonfinite=continue to train on."
    )


def next_step_batches(
    batches: Any, count: int, normalize: DeviceNormalizer
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The next ``count`` micro-batches as loaded, and normalised on the device (queued
    there, not waited for)."""
    with span("repro.load"):
        raw = [next(batches) for _ in range(count)]
        return raw, [normalize(*b) for b in raw]


def due(done: int, every: int, max_steps: int) -> bool:
    """Is step ``done`` one of every ``every``-th (0: none) or the last?"""
    return done == max_steps or bool(every and done % every == 0)


def micro_batch_share(cfg: DictConfig, world: World) -> tuple[int, int]:
    """``(first, count)``: the micro-batches of each step this process computes."""
    k = int(cfg.trainer.batch_size) // int(cfg.trainer.micro_batch_size)
    check_split(k, world, int(cfg.trainer.batch_size))
    return share(k, world)


def make_reducer(cfg: DictConfig, world: World) -> Reducer | None:
    """The combination of the ranks' partial sums (``dist.*``); none for one process."""
    if not world.distributed:
        return None
    d = cfg.dist
    return Reducer(world, str(d.reduction), overlap=bool(d.overlap), bucket_mb=float(d.bucket_mb))


def write_run_start(run: Run, report: DeterminismReport, start: int) -> None:
    """Rank 0: the determinism report (printed too) and the environment fingerprint; a
    resumed process writes its own fingerprint beside the first one."""
    if not run.world.main:
        return
    report.save(run.dir)
    log.info(report.format())
    ident = run.identity
    fingerprint = run_fingerprint(ident.config, ident.config_hash, ident.environment)
    write_json(run.dir / (ENV_FILE if not start else f"env-resume-{start}.json"), fingerprint)


def restore(run: Run, training: Training, resume: ResumePoint) -> list[dict[str, Any]]:
    """Load the checkpoint into ``training``; rank 0 continues the source run's logs. Returns
    the run's resume history, this resume included."""
    restore_training(training, resume.state, resume.path)
    resume.state = None  # restored: let the checkpoint's tensors go
    this = {"from": str(resume.path), "step": resume.step, "forced": resume.forced}
    resumes = [*resume.history, {**this, "world_size": run.world.size}]
    if run.world.main:
        adopt_logs(resume.source_run, run.dir)
    log.info(f"resumed from {resume.path} at step {resume.step}")
    return resumes


def open_checkpoints(
    run: Run,
    training: Training,
    steps_per_epoch: int,
    resumes: list[dict[str, Any]],
    resume: ResumePoint | None,
    data: DataSplits,
) -> Checkpointer:
    """The run's checkpoint writer, knowing the best evaluation so far (from the checkpoint
    when resuming) and what scoring its checkpoints needs of ``data`` (their scoring record,
    :func:`repro.records.scoring.scoring_record`)."""
    keep = int(run.cfg.trainer.keep_checkpoints)
    best = resume.best if resume else None
    scoring = scoring_record(data, run.cfg)
    checkpoints = Checkpointer(
        run.dir, training, run.identity, keep, steps_per_epoch, resumes, best, scoring
    )
    if run.world.main and resume is not None:  # best.pt as the checkpoint knows it
        checkpoints.check_best(resume.step, resume.source_run)
    return checkpoints


def run_test(run: Run, data: DataSplits) -> dict[str, Any]:
    """``trainer.test``: best.pt (else the final checkpoint) on the test split, into
    ``test.json``, by ``repro evaluate``'s own function (so with its bits). Written before
    ``summary.json``: a run killed in between is not finished, and its resume tests again."""
    checkpoint = choose_checkpoint(run.dir, run.cfg)
    # the run's own checkpoint: a config it differs from was accepted (trainer.resume_force)
    # and is recorded
    result = evaluate_checkpoint(
        run.cfg, checkpoint, run.device, "test", data, True, run.dir / TEST_PER_SAMPLE_FILE
    )
    write_json(run.dir / TEST_FILE, result)
    metrics = ", ".join(f"{k} {v:.4f}" for k, v in result["metrics"].items())
    log.info(f"test: {result['checkpoint']} (step {result['step']}): {metrics}")
    return result


def metric_kinds(task: Any, names: list[str]) -> dict[str, Any]:
    """summary.json's ``metric_bounds`` (the range of each bounded metric: ``repro report``
    keeps its intervals inside it), ``count_metrics`` (counts: no interval of a mean) and
    ``metric_directions`` (whether higher is better, where known), as the task declares
    them (:meth:`repro.components.tasks.Task.bounds`, ``is_count``,
    ``higher_is_better_for``; a task that does not declare: none, its headline's way)."""
    bounds = getattr(task, "bounds", lambda name: None)
    count = getattr(task, "is_count", lambda name: False)
    direction = getattr(task, "higher_is_better_for", None)
    if direction is None:  # a task of its own that does not subclass Task: the headline's
        direction = lambda name: bool(task.higher_is_better) if name == task.headline else None  # noqa: E731
    return {
        "metric_bounds": {m: [float(v) for v in b] for m in names if (b := bounds(m))},
        "count_metrics": [m for m in names if count(m)],
        "metric_directions": {m: d for m in names if (d := direction(m)) is not None},
    }


def ema_summary(training: Training) -> dict[str, Any] | None:
    """``trainer.ema`` in summary.json: its settings and the final averages' digest."""
    ema = training.ema
    if ema is None:
        return None
    return {"decay": ema.decay, "start": ema.start, "weights_sha256": ema.digest()}


def describe(run: Run, training: Training, data: Any, count: int, chosen: LoaderChoice) -> None:
    t, world = run.cfg.trainer, run.world
    n_params = sum(p.numel() for p in training.model.parameters())
    split = f" ({count} on each of {world.size} processes)" if world.distributed else ""
    k = int(t.batch_size) // int(t.micro_batch_size)
    log.info(
        f"model {type(training.model).__name__} ({n_params:,} parameters) on {run.device}; "
        f"{len(data.train)} train / {len(data.val)} val samples; task "
        f"{type(training.task).__name__}; batch {t.batch_size} = {k} x {t.micro_batch_size}"
        f"{split}; {t.max_steps} steps; loader {chosen.name}"
        f"{'; channels_last' if training.channels_last else ''}"
    )
    if run.cfg.loader.get("auto"):
        log.info(f"loader {chosen.why}")
    if getattr(data, "intensity", None):  # an image folder's data.intensity and its clipping
        log.info(describe_intensity(data.intensity))


def open_logs(
    run: Run,
    training: Training,
    steps_per_epoch: int,
    metric_names: list[str],
    resume: ResumePoint | None,
) -> TrainingLog:
    """Rank 0's logs and loggers (continued at the checkpoint's step when resuming); the
    others' null."""
    if not run.world.main:
        return NullLog()
    t, task = run.cfg.trainer, training.task
    start = resume.step if resume else 0
    metadata = [
        "determinism.json",
        "determinism.txt",
        f"env-resume-{start}.json" if start else ENV_FILE,
    ]
    info = RunInfo(
        run.dir,
        run.identity.config,
        [run.dir / m for m in metadata],
        metric_names,
        start,
        resume is not None,
    )
    run.loggers.open(run.cfg.get("logger"), info)
    initial = None
    if bool(t.trace) and resume is None:  # step 0: the initial weights, and the task
        tensors, whole = state_digests(training.model.state_dict())
        initial = {"step": 0, "tensors": tensors, "weights_sha256": whole}
        initial["task"] = {"headline": task.headline, "higher_is_better": task.higher_is_better}
    return TrainingLog(
        run.dir,
        max_steps=int(t.max_steps),
        steps_per_epoch=steps_per_epoch,
        log_every=int(t.log_every),
        loggers=run.loggers,
        progress=bool(t.progress),
        trace=bool(t.trace),
        start=start,
        resumed=resume.last if resume else None,
        initial=initial,
    )


def finish(
    run: Run,
    training: Training,
    data: DataSplits,
    checkpoints: Checkpointer,
    logs: TrainingLog,
    tracer: StepTracer,
    clock: Throughput,
    chosen: LoaderChoice,
) -> dict[str, Any]:
    """Rank 0, after the last step: the final checkpoint next to ``summary.json``."""
    cfg = run.cfg
    max_steps = int(cfg.trainer.max_steps)
    final = checkpoint_path(run.dir, max_steps)
    if not final.is_file():  # resumed at the last step from another directory
        checkpoints.save(max_steps, logs)
    # the run's result, next to summary.json
    copy_checkpoint(read_checkpoint(final), run.dir / str(cfg.trainer.checkpoint_name))
    checkpoints.check_best(max_steps)  # intact, and the best evaluation's
    weights = tracer.final_weights or state_dict_sha256(training.model.state_dict())
    headline = training.task.headline
    test = run_test(run, data) if cfg.trainer.test else None  # before summary.json: see there
    summary = {
        "weights_sha256": weights,
        "steps": max_steps,
        "final_loss": logs.last_loss,
        **logs.last_metrics,
        "headline": headline,
        "higher_is_better": training.task.higher_is_better,
        "metric_names": list(logs.last_metrics),
        **metric_kinds(training.task, list(logs.last_metrics)),
        "class_names": list(data.class_names) if data.class_names else None,
        "seed": training.seed,
        "device": str(run.device),
        "world_size": run.world.size,
        "determinism": str(cfg.determinism.mode),
        "amp": str(cfg.amp.dtype) if cfg.amp.enabled else "off",
        "loader": chosen.name,
        "num_workers": int(chosen.cfg.num_workers),
        "channels_last": training.channels_last,
        "intensity": getattr(data, "intensity", None),  # rule and fraction clipped, or None
        "config_hash": run.identity.config_hash,
        "run_dir": str(run.dir),
        **clock.summary(),
        "wall_seconds": time.perf_counter() - run.started,
        "best": checkpoints.best_summary(),
        "ema": ema_summary(training),
        "test": test,
        "resumes": checkpoints.resumes,
        "environment": run.identity.environment,
    }
    run.loggers.finish(summary)  # before summary.json, which marks the run complete
    write_json(run.dir / SUMMARY_FILE, summary)
    value = logs.last_metrics.get(headline, float("nan"))
    log.info(
        f"done: {max_steps} steps, final loss {logs.last_loss:.4f}, "
        f"{headline.replace('_', ' ')} {value:.4f}\n"
        f"  run dir         {run.dir}\n  weights sha256  {weights}"
    )
    return summary
