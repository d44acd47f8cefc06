"""The augmentation self-check, before step 1 and before anything is written.

A pipeline is reproducible when its output is a function of the sample and its key alone.
The loop makes the global generators a function of the key and runs every call under one
thread with the run's flags (:class:`KeyedPipeline`,
:mod:`repro.components.data.sample_settings`), so what can still break the bits is whatever
else a transform's output depends on. The check builds each pipeline (``augment.train`` and
``augment.eval``) **afresh for each pass**, as every loader worker and every resume does,
and calls it on several samples spread over the split (its positions, hence sizes and
contents, and one sample of each class, where the split knows its labels: up to
:data:`MAX_CLASSES`), each under :data:`KEYS` keys:

- pass 1 in order, in this process; pass 2 on a new build, in the reverse order, **in
  another process at another time**: forked, as a loader worker is, with a worker's
  ``get_worker_info()`` and one thread (:func:`_as_a_worker`: its pid and its objects'
  addresses are its own), and the clock :data:`CLOCK_SHIFT` seconds later and
  :data:`CLOCK_STEP` seconds further at each call (:func:`shifted_clock`: a clock read in
  ``__init__`` or on every call shows, whatever its period; a whole-second shift hid a
  quarter-second one), read through ``time`` (``time``, ``monotonic``, ``perf_counter``,
  ``gmtime``, ``localtime``, ``strftime``...) or ``datetime``. Every (sample, key) must give
  the same bits in both; where it does not, more passes tell why and a composed pipeline's
  parts are tried one by one to name the transform: a random state of its own made at
  construction (a new build draws other numbers), the clock, the process (its pid, the
  worker's number, an address), or state carried from call to call (a counter, a
  curriculum, a cache: another order gives other outputs);
- pass 1 runs under the one-thread rule, and the CPU time the process spends on *other*
  threads meanwhile is measured: a transform whose work runs on a thread pool of its own
  (OpenCV's, an OpenBLAS under NumPy), which the rule cannot reach, is named in a warning
  and in the determinism report (:attr:`Checked.threaded`);
- the inputs are compared with copies after the calls: a pipeline that writes into its
  input would change the stored images of an in-memory split (:class:`KeyedPipeline` hands
  a pipeline that does not declare itself keyed a copy, so only a keyed one can);
- what comes out is a (C×H×W image, target) of the input's dtype and channels, of
  ``data.image_size`` (the eval pipeline's only when it is not native), a mask of the
  image's size; a transform that raises is one line naming it and the sample.

What it cannot prove is named in the determinism report (``not covered``, :data:`UNPROVEN`).
"""

from __future__ import annotations

import contextlib
import datetime
import io
import logging
import multiprocessing
import pickle
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data._utils import worker as _loader_worker

from repro.base.errors import ConfigError, ReproError
from repro.components.data.augment import (
    CenterResize,
    KeyedPipeline,
    RandomResizedCrop,
    Resize,
    SegmentationAugment,
    _copy,
    _name,
    one_line,
)
from repro.components.data.sample_settings import pinned_here

log = logging.getLogger("repro")

# samples checked per split: spread over its positions, plus the first of each class not
# among them (up to MAX_CLASSES classes in all); KEYS epochs each (a private coin closed for
# all of 6 x 4 draws at p = 0.3: 0.7**24 = 2e-4)
SAMPLES = 6
MAX_CLASSES = 100
KEYS = 4
# the clock of the second pass: its first read this many seconds later (just under an even
# number of seconds, 1_000_004, about 11.6 days: int(t * k) changes parity for every k up to
# 999 -- a second, a half, a quarter, a millisecond -- and int(t) % m for every m up to the
# prime 1_000_003: an hour, a day), and CLOCK_STEP further at each call of the pipeline
# (the golden ratio's fraction: over a pass's calls the phases of any period spread over
# the whole period)
CLOCK_SHIFT = 1_000_004 - 1e-3
CLOCK_STEP = 0.6180339887
# how far the check's clock moves at each read (shifted_clock)
READ_STEP = 1e-6
# the seed get_worker_info() gives in the second pass (a worker's base seed + its number)
PROCESS_SEED = 7919
# a pipeline runs on threads of its own when the process's other threads spend at least this
# many CPU seconds during pass 1, and at least THREADED_SHARE of the calling thread's
THREADED_SECONDS = 0.02
THREADED_SHARE = 0.25
# before the idle window that tells a pool's own work from what other threads do anyway
SETTLE = 0.3

# what the check cannot prove: the determinism report's "not covered" entry
UNPROVEN = (
    f"augmentation: state that changes only after more calls than the self-check makes "
    f"({SAMPLES} samples and one of each class, up to {MAX_CLASSES} classes, x {KEYS} keys, "
    f"2 builds, 2 orders, 2 clocks, 2 processes), a draw only inputs it did not see trigger "
    f"(a class beyond the first {MAX_CLASSES}, a mask's content), a clock read through a "
    f"name bound at import (from time import time), the size of a thread pool of its own "
    f"(named when the check sees it busy), the CPU's flush-to-zero mode, and, where there "
    f"is no fork (Windows), what differs between processes "
    f"(repro.components.data.pipeline_check)"
)


# the shipped transforms that rescale whole images to data.image_size
RESIZING = (Resize, RandomResizedCrop, CenterResize, SegmentationAugment)

Make = Callable[[], KeyedPipeline]
Sample = tuple[int, torch.Tensor, Any]  # (index in the split, image, target)


@dataclass
class Checked:
    """What the check saw: for the determinism report."""

    samples: int
    keys: int
    random: bool  # does the training pipeline give other outputs under other keys?
    classes: tuple[int, int] | None = None  # (checked, in the split), where it has labels
    threaded: list[str] = field(default_factory=list)  # 'augment.train: name (ms elsewhere)'

    def summary(self) -> str:
        text = (
            f"{self.samples} samples x {self.keys} keys, 2 builds, 2 orders, 2 clocks, "
            f"{2 if CAN_FORK else 1} processes, 1 thread: ok"
        )
        if self.classes and self.classes[0] < self.classes[1]:
            text += f" ({self.classes[0]} of {self.classes[1]} classes)"
        if self.threaded:
            text += "; on threads of its own: " + ", ".join(self.threaded)
        return text


def check_pipelines(
    make_train: Make,
    make_eval: Make,
    train: Any,
    val: Any,
    size: int | None,
    native: bool = False,
) -> Checked:
    """Check both pipelines on samples of the ``train`` and ``val`` splits (see the module
    docstring); a failure is one line (:class:`ConfigError`) naming the key and transform."""
    train_samples, val_samples = spread(train), spread(val)
    first, outputs, threaded = _consistent(make_train, train_samples, "train")
    evaluation, eval_outputs, eval_threaded = _consistent(make_eval, val_samples, "eval")
    random = any(
        not _same(outputs[(i, 0)], outputs[(i, e)])
        for i, _, _ in train_samples
        for e in range(KEYS)
    )
    if not random:
        log.info(f"augment.train: {first.name} gives one output under two keys: not random")
    _shapes(first, outputs, "train", size)
    if not native:
        _shapes(evaluation, eval_outputs, "eval", size)
    image = outputs[(train_samples[0][0], 0)][0]
    if (
        native
        and isinstance(first.pipeline, RESIZING)
        and val_samples[0][1].shape[1:] != image.shape[1:]
    ):
        log.warning(
            f"augment.train: {first.name} brings every image to data.image_size, but "
            "inference.mode=native evaluates each at its own size: the model trains at another "
            "scale than it is scored at; augment=patches trains on patches at native scale."
        )
    return Checked(
        len(train_samples), KEYS, random, classes_checked(train, train_samples),
        [t for t in (threaded, eval_threaded) if t],
    )  # fmt: skip


def spread(split: Any) -> list[Sample]:
    """:data:`SAMPLES` samples at evenly spread positions of ``split``, plus the first sample
    of each class not among them (where the split holds its class labels as a tensor), up to
    :data:`MAX_CLASSES` classes in all; fetched once."""
    n = len(split)
    picked = sorted({round(j * (n - 1) / max(SAMPLES - 1, 1)) for j in range(min(SAMPLES, n))})
    labels = _labels(split)
    if labels is not None:
        seen = {int(labels[i]) for i in picked}
        for c in labels.unique().tolist():
            if len(seen) >= MAX_CLASSES:
                break
            if c not in seen:
                picked.append(int((labels == c).nonzero()[0]))
                seen.add(c)
    index = torch.tensor(sorted(picked), dtype=torch.int64)
    with pinned_here():  # read as a loader worker reads them
        images, targets = split.fetch(index)
    return [(int(i), images[k], targets[k]) for k, i in enumerate(index.tolist())]


def _labels(split: Any) -> torch.Tensor | None:
    labels = getattr(split, "labels", None)
    if isinstance(labels, torch.Tensor) and labels.dim() == 1 and len(labels) == len(split):
        return labels
    return None


def classes_checked(split: Any, samples: list[Sample]) -> tuple[int, int] | None:
    """(classes among ``samples``, classes in ``split``), where the split knows its labels."""
    labels = _labels(split)
    if labels is None:
        return None
    return len({int(labels[i]) for i, _, _ in samples}), len(labels.unique())


def refuse_foreign(pipeline: KeyedPipeline, which: str) -> None:
    """albumentations' own ``Compose`` given as the ``_target_``: it takes keywords and
    returns a dict, and draws from a generator no key reaches."""
    p = pipeline.pipeline
    if p is not None and type(p).__module__.split(".")[0] == "albumentations":
        raise ConfigError(
            f"augment.{which}._target_ builds {_name(p)}, which takes image=/mask= keywords and "
            "draws from a generator of its own: wrap its transforms in the template's adapter, "
            "_target_: repro.components.data.augment.albumentations with transforms: [...] "
            "(docs/extending.md#augmentation)."
        )


# the conditions of a pass: (clock shifted, in another process)
HERE = (False, False)
ELSEWHERE = (True, True)
# another process is a forked one, as a loader worker is on Linux; where there is no fork
# (Windows) the second pass runs here, with the other clock only
CAN_FORK = "fork" in multiprocessing.get_all_start_methods()


def _consistent(
    make: Make, samples: list[Sample], which: str
) -> tuple[KeyedPipeline, dict[tuple[int, int], Any], str | None]:
    """A build, its outputs on ``samples`` (pass 1) and, if its work ran on threads of its
    own, what to call it; refused, naming the transform and why, when pass 2 (a new build,
    the reverse order, another clock, another process) differs, or when the inputs
    changed."""
    saved = [(image.clone(), _copy(target)) for _, image, target in samples]
    pipeline, ref, busy = _here(make, samples, which)
    other = _pass(make, samples[::-1], which, reverse=True, where=ELSEWHERE)
    for (index, image, target), before in zip(samples, saved, strict=True):
        if not _same((image, target), before):
            raise ConfigError(
                f"augment.{which}: {pipeline.name} changed its input (sample {index}) in place; "
                "with data.in_memory=true that is the stored image, so later epochs, workers "
                "and resumes would see another one: work on a copy (image.clone()) or return "
                "new tensors."
            )
    if any(not _same(ref[k], other[k]) for k in ref):
        raise ConfigError(_why(make, samples, which, ref))
    threaded = None
    if busy.threaded() and not busy.explained_by(busy_elsewhere_without(busy.wall)):
        name = _threaded_part(make, samples, which) or pipeline.name
        threaded = f"augment.{which}: {name}"
        log.warning(
            f"augment.{which}: {name} ran on threads of its own ({1000 * busy.elsewhere:.0f} "
            f"ms of CPU beside {1000 * busy.own:.0f} ms on the calling thread), which the "
            "one-thread rule of per-sample work cannot reach: its bits may follow that pool's "
            "size, which can differ between machines, and between a loader worker and the "
            "main process; pin that pool (cv2.setNumThreads(0); threadpoolctl for NumPy's "
            "BLAS) or keep the work in torch, which runs on one thread here, or in NumPy's "
            "element-wise functions and reductions (docs/determinism.md#threads)."
        )
    return pipeline, ref, threaded


def _here(
    make: Make,
    samples: list[Sample],
    which: str,
    reverse: bool = False,
    clock: bool = False,
    keys: int = KEYS,
) -> tuple[KeyedPipeline, dict[tuple[int, int], Any], _Busy]:
    """A new build and its outputs on ``samples``, in this process, on the check's clock
    (:func:`shifted_clock`, moved when ``clock``); and the CPU time the calls took on this
    thread and on the process's others."""
    with shifted_clock(CLOCK_SHIFT if clock else 0, CLOCK_STEP if clock else 0.0) as tick:
        pipeline = make()
        refuse_foreign(pipeline, which)
        with busy_elsewhere() as busy:
            out = _outputs_at(pipeline, samples, which, reverse, keys, tick)
    return pipeline, out, busy


def _pass(
    make: Make,
    samples: list[Sample],
    which: str,
    reverse: bool = False,
    where: tuple[bool, bool] = HERE,
) -> dict[tuple[int, int], Any]:
    """The outputs of a new build on ``samples`` under ``where``'s conditions: the check's
    clock, moved or not, and this process or another (:func:`_as_a_worker`)."""
    clock, process = where
    if process and CAN_FORK:
        return _in_another_process(make, samples, which, reverse, clock)
    return _here(make, samples, which, reverse, clock)[1]


def _in_another_process(
    make: Make, samples: list[Sample], which: str, reverse: bool, clock: bool
) -> dict[tuple[int, int], Any]:
    """:func:`_as_a_worker` in a forked process (nothing pickled on the way in: ``make``
    may be a closure), its outputs or its error sent back (torch.save's bytes: tensors and
    plain values), the error raised here as it was raised there."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(
        target=_as_a_worker, args=(send, make, samples, which, reverse, clock), daemon=True
    )
    child.start()
    send.close()
    try:
        answer = receive.recv_bytes()
    except EOFError:
        child.join()
        raise ConfigError(
            f"augment.{which}: the self-check's second pass, in a process of its own as a "
            f"loader worker is, ended without an answer (exit code {child.exitcode}): the "
            "pipeline crashed the process; run it in a loader worker to see how "
            "(loader=multi)."
        ) from None
    finally:
        receive.close()
    child.join()
    kind, value = pickle.loads(answer)
    if kind == "error":
        raise value
    return torch.load(io.BytesIO(value), weights_only=True)


def _as_a_worker(
    send: Any, make: Make, samples: list[Sample], which: str, reverse: bool, clock: bool
) -> None:
    """Pass 2 in a forked process, as a loader worker runs a pipeline: one intra-op thread,
    ``get_worker_info()`` a worker's (number 1 of 2), its own pid; the check's clock moved
    when ``clock``. Before each call a small tensor and object are kept aside, so that the
    call's copy of its input does not take the address the one before freed, as in pass 1
    every call's did: an ``id()`` read shows. Sends ``("ok", outputs)`` or ``("error",
    exception)``."""
    try:
        torch.set_num_threads(1)
        if hasattr(_loader_worker, "_worker_info"):
            _loader_worker._worker_info = _loader_worker.WorkerInfo(
                id=1, num_workers=2, seed=PROCESS_SEED, dataset=None
            )
        kept: list[Any] = []
        with shifted_clock(CLOCK_SHIFT if clock else 0, CLOCK_STEP if clock else 0.0) as tick:

            def tick_and_move() -> None:
                tick()
                kept.append((torch.empty(0), object(), [None]))

            pipeline = make()
            refuse_foreign(pipeline, which)
            out = _outputs_at(pipeline, samples, which, reverse, KEYS, tick_and_move)
        buffer = io.BytesIO()
        torch.save(out, buffer)
        answer = pickle.dumps(("ok", buffer.getvalue()))
    except BaseException as err:  # noqa: BLE001 -- sent back and raised there
        try:
            answer = pickle.dumps(("error", err))
        except Exception:  # an exception that does not pickle: its one line
            answer = pickle.dumps(("error", ConfigError(f"augment.{which}: {one_line(err)}")))
    send.send_bytes(answer)
    send.close()


def _outputs_at(
    pipeline: KeyedPipeline,
    samples: list[Sample],
    which: str,
    reverse: bool,
    keys: int,
    tick: Callable[[], None],
) -> dict[tuple[int, int], Any]:
    out = {}
    for index, image, target in samples:
        for epoch in range(keys - 1, -1, -1) if reverse else range(keys):
            tick()
            # a transform that raises: one line naming it and the sample (KeyedPipeline)
            result = pipeline(image, target, epoch, index)
            if isinstance(result[0], torch.Tensor) and result[0].shape[0] != image.shape[0]:
                raise ConfigError(
                    f"augment.{which}: {pipeline.name} turned a {image.shape[0]}-channel image "
                    f"into a {result[0].shape[0]}-channel one; the model takes the data's "
                    "channels (data.channels): keep them."
                )
            out[(index, epoch)] = result
    return out


def _same(x: tuple[torch.Tensor, Any], y: tuple[torch.Tensor, Any]) -> bool:
    def equal(u: Any, v: Any) -> bool:
        if isinstance(u, torch.Tensor) or isinstance(v, torch.Tensor):
            return (
                isinstance(u, torch.Tensor)
                and isinstance(v, torch.Tensor)
                and (u.shape == v.shape and torch.equal(u, v))
            )
        return u == v

    return equal(x[0], y[0]) and equal(x[1], y[1])


def _why(make: Make, samples: list[Sample], which: str, ref: dict) -> str:
    """The one line refusing a pipeline whose outputs differ between passes: which transform
    (the first part of a composed pipeline that differs alone), and what it depends on."""
    causes = []
    if _differs(make, samples, ref, which):
        causes.append(
            "draws from a random state of its own (a np.random.default_rng() or random.Random "
            "made at construction?) or reads an object's address (id(), hash()), which a new "
            "build (each loader worker, each resume) makes anew"
        )
    else:
        if _differs(make, samples, ref, which, where=(True, False)):
            causes.append("reads the clock")
        if _differs(make, samples, ref, which, where=(False, True)):
            causes.append(
                "reads what differs between processes (os.getpid(), a thread id, "
                "get_worker_info(), an object's id() or hash())"
            )
        if _differs(make, samples[::-1], ref, which, reverse=True):
            causes.append(
                "carries state from call to call (a counter, a curriculum, a cache, a "
                "generator seeded once), so each loader worker and each resume sees another"
            )
    name = _culprit(make, samples, which) or make().name
    why = " and ".join(causes) or "gives other outputs when built again"
    return (
        f"augment.{which}: {name} gives another output for the same sample and key: it {why}; "
        "draw from the global np.random, random or torch generators, or accept a `generator` "
        "or `key` argument, and keep nothing between calls (docs/extending.md#augmentation)."
    )


def _differs(
    make: Make,
    samples: list[Sample],
    ref: dict,
    which: str,
    reverse: bool = False,
    where: tuple[bool, bool] = HERE,
) -> bool:
    other = _pass(make, samples, which, reverse=reverse, where=where)
    return any(not _same(ref[k], other[k]) for k in ref)


def _parts(make: Make) -> list[Make] | None:
    """One maker per part of a composed pipeline (``.transforms``: torchvision's, ours,
    albumentations'), each building the part alone; None for a pipeline of one piece."""
    parts = getattr(make().pipeline, "transforms", None)
    if not isinstance(parts, list | tuple):
        return None
    seed = make().seed

    def part(place: int) -> Make:
        return lambda: KeyedPipeline(make().pipeline.transforms[place], seed)

    return [part(place) for place in range(len(parts))]


def _culprit(make: Make, samples: list[Sample], which: str) -> str | None:
    """The first transform of a composed pipeline whose outputs differ between a build and
    the next (reverse order, another clock and process), each run alone on what the ones
    before it gave."""
    for part in _parts(make) or []:
        try:
            ref = _pass(part, samples, which)
            other = _pass(part, samples[::-1], which, reverse=True, where=ELSEWHERE)
        except ReproError:  # a part that cannot run alone on this input: name the whole
            return None
        if any(not _same(ref[k], other[k]) for k in ref):
            return part().name
        samples = [(i, *ref[(i, 0)]) for i, _, _ in samples]
    return None


def _threaded_part(make: Make, samples: list[Sample], which: str) -> str | None:
    """The first transform of a composed pipeline whose work runs on threads of its own,
    each run alone on what the ones before it gave."""
    for part in _parts(make) or []:
        try:
            _, ref, busy = _here(part, samples, which)
        except ReproError:
            return None
        if busy.threaded():
            return part().name
        samples = [(i, *ref[(i, 0)]) for i, _, _ in samples]
    return None


class _Busy:
    """CPU seconds of the calling thread and of the process's other threads over a block,
    and its wall time."""

    own = elsewhere = wall = 0.0

    def threaded(self) -> bool:
        return self.elsewhere >= max(THREADED_SECONDS, THREADED_SHARE * self.own)

    def explained_by(self, idle: tuple[float, float]) -> bool:
        """Would the other threads have spent at least half of it anyway, at the rate
        ``idle`` (CPU seconds, wall seconds) of a moment when this one did nothing?"""
        spent, wall = idle
        return spent / max(wall, 1e-9) * self.wall >= self.elsewhere / 2


@contextlib.contextmanager
def busy_elsewhere() -> Iterator[_Busy]:
    """Inside: the block; afterwards the yielded record holds the CPU time this thread spent
    on it (``own``), the time the process's other threads spent meanwhile (``elsewhere``:
    the process's CPU clock less this thread's) and the wall time."""
    busy = _Busy()
    start = (_REAL_PROCESS_TIME(), _REAL_THREAD_TIME(), _REAL_PERF())
    try:
        yield busy
    finally:
        process, thread = _REAL_PROCESS_TIME() - start[0], _REAL_THREAD_TIME() - start[1]
        busy.own, busy.elsewhere = thread, max(0.0, process - thread)
        busy.wall = _REAL_PERF() - start[2]


def busy_elsewhere_without(seconds: float) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of the process's other threads while this one waits
    ``seconds`` (at most one), after :data:`SETTLE` seconds for a pool the pipeline used to
    go idle (OpenBLAS's threads spin about 0.1 s after a call): what they do anyway (an
    OpenMP pool told to spin, a logging thread)."""
    time.sleep(SETTLE)
    with busy_elsewhere() as busy:
        time.sleep(min(seconds, 1.0))
    return busy.elsewhere, busy.wall


# the real clocks, for measuring: the check's passes move time's own
_REAL_PROCESS_TIME, _REAL_THREAD_TIME, _REAL_PERF = (
    time.process_time,
    time.thread_time,
    time.perf_counter,
)


@contextlib.contextmanager
def shifted_clock(seconds: float, step: float = 0.0) -> Iterator[Callable[[], None]]:
    """Inside: a clock that stands still but for what reads it, as a transform reads it
    through the ``time`` and ``datetime`` modules -- ``time.time``/``monotonic``/
    ``perf_counter`` (and their ``_ns``), ``clock_gettime``, ``gmtime``/``localtime``/
    ``ctime``/``asctime``/``strftime`` without a time given, ``datetime.datetime.now``/
    ``utcnow``/``today``, ``datetime.date.today``: the wall clock at the whole second
    :data:`_EPOCH` plus ``seconds`` (the others at where they were, plus ``seconds``), one
    :data:`READ_STEP` further at each read (a loop waiting for time to pass still ends), and
    ``step`` further at each call of the yielded ``tick`` (the check calls it before each
    call of the pipeline: a clock read on every call sees its period's phases, one read at
    construction the shift alone). So a pass's clock is a function of its reads and calls,
    not of when it ran or how long it took: a second ticking between passes, or a slow call,
    is never taken for a cause."""
    names = ("time", "monotonic", "perf_counter")
    start = {n: getattr(time, n)() for n in names}
    start["time"] = _EPOCH
    calendar = {n: getattr(time, n) for n in ("gmtime", "localtime", "ctime", "asctime")}
    real_strftime = time.strftime
    real_clock_gettime = getattr(time, "clock_gettime", None)
    real_clock_gettime_ns = getattr(time, "clock_gettime_ns", None)
    real_datetime, real_date = datetime.datetime, datetime.date
    counts = {"ticks": 0, "reads": 0}

    def tick() -> None:
        counts["ticks"] += 1

    def now(name: str = "time") -> float:
        counts["reads"] += 1
        return start[name] + seconds + counts["ticks"] * step + counts["reads"] * READ_STEP

    def clock_gettime(clock: int) -> float:
        if clock in (time.CLOCK_PROCESS_CPUTIME_ID, time.CLOCK_THREAD_CPUTIME_ID):
            return real_clock_gettime(clock)
        return now("time" if clock == time.CLOCK_REALTIME else "monotonic")

    class Later(real_datetime):  # its instances are datetimes and Laters alike
        @classmethod
        def now(cls, tz=None):  # noqa: ANN001, ANN206
            return cls.fromtimestamp(now(), tz)

        @classmethod
        def utcnow(cls):  # noqa: ANN206
            return cls.fromtimestamp(now(), datetime.UTC).replace(tzinfo=None)

        @classmethod
        def today(cls):  # noqa: ANN206
            return cls.fromtimestamp(now())

    class LaterDate(real_date):
        @classmethod
        def today(cls):  # noqa: ANN206
            return cls.fromtimestamp(now())

    patched: dict[str, Callable] = {}
    for n in names:
        patched[n] = lambda n=n: now(n)
        patched[f"{n}_ns"] = lambda n=n: int(now(n) * 1_000_000_000)
    patched |= {
        "gmtime": lambda secs=None: calendar["gmtime"](now() if secs is None else secs),
        "localtime": lambda secs=None: calendar["localtime"](now() if secs is None else secs),
        "ctime": lambda secs=None: calendar["ctime"](now() if secs is None else secs),
        "asctime": lambda t=None: calendar["asctime"](
            calendar["localtime"](now()) if t is None else t
        ),
        "strftime": lambda fmt, t=None: real_strftime(
            fmt, calendar["localtime"](now()) if t is None else t
        ),
    }
    if real_clock_gettime is not None:  # Unix
        patched["clock_gettime"] = clock_gettime
        patched["clock_gettime_ns"] = lambda clock: (
            real_clock_gettime_ns(clock)
            if clock in (time.CLOCK_PROCESS_CPUTIME_ID, time.CLOCK_THREAD_CPUTIME_ID)
            else int(clock_gettime(clock) * 1_000_000_000)
        )
    originals = {n: getattr(time, n) for n in patched}
    try:
        for n, f in patched.items():
            setattr(time, n, f)
        datetime.datetime, datetime.date = Later, LaterDate
        yield tick
    finally:
        for n, f in originals.items():
            setattr(time, n, f)
        datetime.datetime, datetime.date = real_datetime, real_date


# the whole second every pass's wall clock starts at (shifted_clock)
_EPOCH = float(int(time.time()))


def _shapes(
    pipeline: KeyedPipeline, outputs: dict[tuple[int, int], Any], which: str, size: int | None
) -> None:
    """Every output ``size`` x ``size`` (``data.image_size``)."""
    for image, _ in outputs.values():
        if size and tuple(image.shape[1:]) != (size, size):
            native_hint = (
                "; or evaluate each image at its own size: inference.mode=native"
                if which == "eval"
                else ""
            )
            raise ConfigError(
                f"augment.{which}: {pipeline.name} gives {tuple(image.shape[1:])} images "
                f"where data.image_size={size} asks for ({size}, {size}); end it with a "
                f"resize or crop to data.image_size{native_hint}."
            )
