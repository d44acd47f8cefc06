"""The augmentation self-check, before step 1 and before anything is written.

A pipeline is reproducible when its output is a function of the sample and its key alone.
The loop makes the global generators a function of the key (:class:`KeyedPipeline`), so
what can still break the bits is whatever else a transform's output depends on. The check
builds each pipeline (``augment.train`` and ``augment.eval``) **afresh from its config for
each pass**, as every loader worker and every resume does, and calls it on several samples
spread over the split (its classes, where the split knows its labels; positions, hence
sizes and contents), each under :data:`KEYS` keys:

- pass 1 in order; pass 2 on a new build, in the reverse order, with the clock
  :data:`CLOCK_SHIFT` seconds later. Every (sample, key) must give the same bits in both;
  where it does not, three more passes tell why and a composed pipeline's parts are tried
  one by one to name the transform: a random state of its own made at construction (a new
  build draws other numbers), state carried from call to call (a counter, a curriculum, a
  cache: another order gives other outputs), or the clock;
- the inputs are compared with copies after the calls: a pipeline that writes into its
  input would change the stored images of an in-memory split (:class:`KeyedPipeline` hands
  a pipeline that does not declare itself keyed a copy, so only a keyed one can);
- what comes out is a (C×H×W image, target) of the input's dtype and channels, of
  ``data.image_size`` (the eval pipeline's only when it is not native), a mask of the
  image's size; a transform that raises is one line naming it and the sample.

What it cannot prove is named in the determinism report (``not covered``): state that
changes only after more calls than it makes, a draw that only inputs it did not see
trigger, a clock read through a name bound before the check (``from time import time``).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from repro.base.errors import ConfigError, ReproError
from repro.components.data.augment import (
    CenterResize,
    KeyedPipeline,
    RandomResizedCrop,
    Resize,
    SegmentationAugment,
    _copy,
    _name,
)

log = logging.getLogger("repro")

# samples checked per split: spread over its positions, plus the first of each class not
# among them, at most MAX_SAMPLES in all; KEYS epochs each (a private coin closed for all of
# SAMPLES x KEYS draws at p = 0.3: 0.7**24 = 2e-4)
SAMPLES = 6
MAX_SAMPLES = 12
KEYS = 4
# the clock of the second pass, this many seconds later: a prime of about 11.6 days (so that
# any period of a day, an hour or a second, or a parity, sees another value)
CLOCK_SHIFT = 1_000_003


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

    def summary(self) -> str:
        return f"{self.samples} samples x {self.keys} keys, 2 builds, 2 orders, 2 clocks: ok"


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
    first, outputs = _consistent(make_train, train_samples, "train")
    evaluation, eval_outputs = _consistent(make_eval, val_samples, "eval")
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
    return Checked(len(train_samples), KEYS, random)


def spread(split: Any) -> list[Sample]:
    """Up to :data:`SAMPLES` samples at evenly spread positions of ``split``, plus the first
    sample of each class not among them (where the split holds its class labels as a
    tensor), at most :data:`MAX_SAMPLES`; fetched once."""
    n = len(split)
    picked = sorted({round(j * (n - 1) / max(SAMPLES - 1, 1)) for j in range(min(SAMPLES, n))})
    labels = getattr(split, "labels", None)
    if isinstance(labels, torch.Tensor) and labels.dim() == 1 and len(labels) == n:
        seen = {int(labels[i]) for i in picked}
        for c in labels.unique().tolist():
            if len(picked) >= MAX_SAMPLES:
                break
            if c not in seen:
                picked.append(int((labels == c).nonzero()[0]))
                seen.add(c)
    index = torch.tensor(sorted(picked), dtype=torch.int64)
    images, targets = split.fetch(index)
    return [(int(i), images[k], targets[k]) for k, i in enumerate(index.tolist())]


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


def _consistent(
    make: Make, samples: list[Sample], which: str
) -> tuple[KeyedPipeline, dict[tuple[int, int], Any]]:
    """A build and its outputs on ``samples`` (pass 1); refused, naming the transform and
    why, when pass 2 (a new build, the reverse order, a later clock) differs, or when the
    inputs changed."""
    pipeline = make()
    refuse_foreign(pipeline, which)
    saved = [(image.clone(), _copy(target)) for _, image, target in samples]
    ref = _outputs(pipeline, samples, which)
    other = _outputs(make(), samples[::-1], which, reverse=True, shift=CLOCK_SHIFT)
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
    return pipeline, ref


def _outputs(
    pipeline: KeyedPipeline,
    samples: list[Sample],
    which: str,
    reverse: bool = False,
    keys: int = KEYS,
    shift: int = 0,
) -> dict[tuple[int, int], Any]:
    with shifted_clock(shift):  # every pass on one clock: a second's tick is no cause
        return _outputs_at(pipeline, samples, which, reverse, keys)


def _outputs_at(
    pipeline: KeyedPipeline, samples: list[Sample], which: str, reverse: bool, keys: int
) -> dict[tuple[int, int], Any]:
    out = {}
    for index, image, target in samples:
        for epoch in range(keys - 1, -1, -1) if reverse else range(keys):
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
            "made at construction?), which a new build (each loader worker, each resume) "
            "makes anew"
        )
    else:
        if _differs(make, samples, ref, which, shift=CLOCK_SHIFT):
            causes.append("reads the clock")
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
    shift: int = 0,
) -> bool:
    other = _outputs(make(), samples, which, reverse=reverse, shift=shift)
    return any(not _same(ref[k], other[k]) for k in ref)


def _culprit(make: Make, samples: list[Sample], which: str) -> str | None:
    """The first transform of a composed pipeline (``.transforms``: torchvision's, ours,
    albumentations') whose outputs differ between a build and the next (reverse order, later
    clock), each run alone on what the ones before it gave."""
    parts = getattr(make().pipeline, "transforms", None)
    if not isinstance(parts, list | tuple):
        return None
    seed = make().seed
    for place in range(len(parts)):

        def part(place: int = place) -> KeyedPipeline:
            return KeyedPipeline(make().pipeline.transforms[place], seed)

        try:
            ref = _outputs(part(), samples, which)
            other = _outputs(part(), samples[::-1], which, reverse=True, shift=CLOCK_SHIFT)
        except ReproError:  # a part that cannot run alone on this input: name the whole
            return None
        if any(not _same(ref[k], other[k]) for k in ref):
            return _name(parts[place])
        samples = [(i, *ref[(i, 0)]) for i, _, _ in samples]
    return None


@contextlib.contextmanager
def shifted_clock(seconds: int) -> Iterator[None]:
    """Inside: ``time.time``/``monotonic``/``perf_counter`` (and their ``_ns``) and
    ``datetime.datetime.now``/``utcnow``/``today``, as a transform reaches them through
    their modules, ``seconds`` later. The wall clock starts each time at the same whole
    second (:data:`_EPOCH`, plus ``seconds``) and runs from there: passes begun at other
    moments read one clock, so a second ticking between them is not taken for a cause."""
    names = ("time", "monotonic", "perf_counter")
    real = {n: getattr(time, n) for n in names} | {
        f"{n}_ns": getattr(time, f"{n}_ns") for n in names
    }
    real_datetime = datetime.datetime
    wall = _EPOCH + seconds - real["time"]()  # what the wall clock is moved by
    delta = datetime.timedelta(seconds=wall)

    class Later(real_datetime):
        @classmethod
        def now(cls, tz=None):  # noqa: ANN001, ANN206
            return real_datetime.now(tz) + delta

        @classmethod
        def utcnow(cls):  # noqa: ANN206
            return real_datetime.utcnow() + delta

        @classmethod
        def today(cls):  # noqa: ANN206
            return real_datetime.today() + delta

    for n, f in real.items():
        shift = wall if n.startswith("time") else seconds
        shift = int(shift * 1_000_000_000) if n.endswith("_ns") else shift
        setattr(time, n, lambda f=f, shift=shift: f() + shift)
    datetime.datetime = Later
    try:
        yield
    finally:
        for n, f in real.items():
            setattr(time, n, f)
        datetime.datetime = real_datetime


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
