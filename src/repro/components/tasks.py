"""Tasks: what is learned and how it is measured (``conf/task/``).

A task is the part of training that differs between projects; the loop never knows which
one it runs. It owns four things:

``loss(outputs, targets)``
    the loss of one micro-batch, **summed** over its samples (a scalar tensor). The loop
    divides it by the global batch size, so the fixed-order sum of the micro-batches'
    gradients is the gradient of the batch mean, whoever computed each micro-batch.
``statistics(outputs, targets)``
    the evaluation statistics of one batch as a dict of tensors that are **added** across
    batches: integer counts (exact, so the metrics derived from them do not depend on the
    eval batch size or the world size) and float64 sums.
``metrics(totals)``
    the metrics, from the summed statistics: ``{"val_loss": ..., "val_accuracy": ...}``.
``headline``
    the name of the one metric that ``summary.json``, ``repro report`` and ``repro compare
    --tolerance`` lead with (``higher_is_better`` says which way is better).
``per_sample(outputs, targets)`` (optional)
    one row per sample: a dict of 1-D tensors (integer counts), concatenated over the
    evaluation in sample order and written to ``<split>_per_image.csv`` beside the sample's
    name; ``metrics(totals, samples)`` then receives them too (the per-image mean Dice is
    computed from them). Exact integers, so how the batches are cut and summed, and the world
    size, cannot change them (the outputs themselves may differ in their last bits with
    the batch a network runs in: see ``inference.mode=native``, one image a forward).
``sample_scores(samples)`` (optional)
    each sample's share of the headline, from the concatenated ``per_sample`` rows: float
    columns named ``headline`` or ``headline_<part>``, written beside the counts, whose
    means over the samples with a finite value, averaged over the columns, are the
    headline. ``repro report`` resamples them to put the evaluation samples' uncertainty
    into its intervals (docs/tools.md); a task without them is judged by its seeds alone.

``outputs`` is what the model returns for a batch; ``targets`` is what the dataset gives
beside the inputs: class labels ``N``, or per-pixel class masks ``N×H×W``, which the keyed
crop and flip move with their images. Metrics are
named ``val_*``; the headline is one of them. A new task is a subclass named by
``task._target_=mypkg.MyTask``; it receives ``num_classes`` from the dataset when its
constructor takes it. See ``docs/extending.md``.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F

from repro.base.errors import ConfigError
from repro.components.ops import dense_cross_entropy


class Task:
    """The interface (see the module docstring); :class:`Classification` implements it."""

    headline: str = "val_loss"
    higher_is_better: bool = False
    # the model gives one output channel a class of the data (outputs.shape[1]): checked
    # before step 1; a task whose model gives more (an extra head) sets it False
    one_output_a_class: bool = False

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def higher_is_better_for(self, metric: str) -> bool | None:
        """Which way a metric is better: the headline's is :attr:`higher_is_better`, a loss
        is better lower, any other unknown (None) unless a task says. The one rule that
        ``repro report`` (better or worse), ``repro confirm``, a search's ranking and the
        collapse rule read, from ``summary.json``'s ``metric_directions``; a task with a
        lower-is-better metric of its own (a distance in mm) overrides it."""
        if metric == self.headline:
            return bool(self.higher_is_better)
        return False if "loss" in metric else None

    def bounds(self, metric: str) -> tuple[float, float] | None:
        """The range a metric's values lie in (``(0, 1)`` for an accuracy or a Dice), which
        ``repro report`` keeps its intervals inside; None: unbounded (a loss). Recorded in
        ``summary.json`` (``metric_bounds``) for every metric the run logs."""
        return None

    def is_count(self, metric: str) -> bool:
        """Whether a metric counts things (images without a class): ``repro report`` gives
        it a distribution, no interval of a mean. Recorded as ``count_metrics``."""
        return False

    def statistics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def metrics(self, totals: dict[str, torch.Tensor]) -> dict[str, float]:
        raise NotImplementedError

    def per_sample(
        self, outputs: torch.Tensor, targets: torch.Tensor
    ) -> dict[str, torch.Tensor] | None:
        """One row per sample (see the module docstring); None: no per-sample record."""
        return None

    def sample_scores(self, samples: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Each sample's share of the headline (see the module docstring); None: the
        headline is not a mean over the samples."""
        return None


class Classification(Task):
    """Single-label classification: cross-entropy on the logits (computed in float32, also
    under autocast), accuracy of the arg-max."""

    headline = "val_accuracy"
    higher_is_better = True
    one_output_a_class = True

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        _check_shapes("classification", outputs, targets, 2, 1)
        return F.cross_entropy(outputs.float(), targets, reduction="sum")

    def bounds(self, metric: str) -> tuple[float, float] | None:
        return (0.0, 1.0) if "accuracy" in metric else None

    def higher_is_better_for(self, metric: str) -> bool | None:
        return True if "accuracy" in metric else super().higher_is_better_for(metric)

    def statistics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            "loss_sum": self.loss(outputs, targets).double(),
            "correct": (outputs.argmax(dim=1) == targets).sum(),
            "count": torch.tensor(len(targets), dtype=torch.int64, device=targets.device),
        }

    def metrics(self, totals: dict[str, torch.Tensor]) -> dict[str, float]:
        count = int(totals["count"])
        return {
            "val_loss": totals["loss_sum"].item() / count,
            "val_accuracy": int(totals["correct"]) / count,
        }

    def per_sample(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each sample's class, the predicted one, and whether they agree."""
        prediction = outputs.argmax(dim=1)
        return {
            "target": targets.long(),
            "prediction": prediction,
            "correct": (prediction == targets).long(),
        }

    def sample_scores(self, samples: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The accuracy is the mean of each sample's 1 (right) or 0 (wrong)."""
        return {"headline": samples["correct"].double()}


def _check_shapes(
    name: str, outputs: torch.Tensor, targets: torch.Tensor, out_dim: int, target_dim: int
) -> None:
    """A model or dataset that does not fit the task is one line, at the pre-check."""
    fits = outputs.dim() == out_dim and targets.dim() == target_dim
    if fits and target_dim == 3:
        fits = outputs.shape[2:] == targets.shape[1:]
    if not fits:
        wanted = (
            "class labels (N) and N×classes logits"
            if target_dim == 1
            else "per-pixel masks (N×H×W) and N×classes×H×W logits"
        )
        other = "task=segmentation" if target_dim == 1 else "task=classification"
        raise ConfigError(
            f"task={name} needs {wanted}; the model gave {tuple(outputs.shape)} for targets "
            f"{tuple(targets.shape)}: pair the task with its data and model (or use {other}; "
            "experiment=segmentation sets all three)."
        )


CROSS_ENTROPY = {
    "repro": "repro.components.ops.dense_cross_entropy: deterministic on CUDA",
    "torch": "F.cross_entropy summed on N×C×H×W: raises in strict mode on CUDA",
    "torch_flat": "F.cross_entropy summed on (N·H·W)×C: the usual workaround",
}


class Segmentation(Task):
    """Per-pixel classification (``conf/task/segmentation.yaml``).

    **Loss** of one sample: ``cross_entropy_weight`` × its pixels' cross-entropy (the
    mean over its scored pixels, class-weighted by ``class_weights`` as ``F.cross_entropy``
    weights its mean) + ``dice_weight`` × its soft-Dice loss (1 − the mean over classes of
    ``(2 Σ p·y + 1) / (Σ p + Σ y + 1)`` on the softmax ``p``). Per sample, so a sample's loss
    does not depend on which micro-batch it is in; summed over the micro-batch, as the loop
    wants. Pixels whose mask is ``ignore_index`` (or not a class: a crop's padded border) are
    not scored. ``cross_entropy="repro"`` computes the cross-entropy with
    :func:`repro.components.ops.dense_cross_entropy`. The other two are for comparison (``repro doctor
    --cost``, ``scripts/benchmark.py``): what a PyTorch user writes, ``F.cross_entropy(...,
    reduction="sum")`` over H·W, on N×C×H×W (``"torch"``: no deterministic CUDA kernel,
    strict mode stops the run and says so) or on the pixels as rows (``"torch_flat"``, the
    usual workaround); without class weights and ignored pixels they equal ``"repro"``.

    **Metrics** (Metrics Reloaded's per-image aggregation; Maier-Hein et al., 2024), from
    each image's integer counts (:meth:`per_sample`: true positives, false positives and
    false negatives per class on the scored pixels; ``<split>_per_image.csv``):
    ``val_dice_<class>`` and ``val_iou_<class>`` are means over the images of each image's
    Dice and IoU. An image whose reference and prediction both lack the class is left out of
    that class's mean and counted (``val_empty_<class>``); one whose reference lacks it but
    whose prediction has it scores 0. ``val_dice`` (the headline) and ``val_iou`` are the
    means of those over the classes (the background, class 0, left out unless
    ``include_background``; a class no image defines is nan and left out). The pooled
    values -- one confusion matrix over every scored pixel of the split -- are kept as
    ``val_dice_pooled``, ``val_iou_pooled`` and ``val_dice_<class>_pooled``; also
    ``val_pixel_accuracy`` and ``val_loss`` (the mean per image). Classes are named by
    ``class_names`` (the data's, ``data.class_names``; else their index); ``unions`` names
    groups of classes scored as one (``{cell: [nucleus, boundary]}``: a pixel is ``cell`` in
    the reference or the prediction when its class is one of them), each with the same
    metrics. Every value comes from exact integers (per-image ratios summed by
    ``math.fsum``), so neither how the evaluation is batched nor the world size can change
    them for given outputs."""

    headline = "val_dice"
    higher_is_better = True
    one_output_a_class = True

    def __init__(
        self,
        num_classes: int,
        cross_entropy_weight: float = 1.0,
        dice_weight: float = 1.0,
        class_weights: list[float] | None = None,
        ignore_index: int = 255,
        include_background: bool = False,
        cross_entropy: str = "repro",
        class_names: list[str] | None = None,
        unions: dict[str, list[str | int]] | None = None,
    ) -> None:
        if cross_entropy not in CROSS_ENTROPY:
            raise ConfigError(
                f"task.cross_entropy={cross_entropy!r} is invalid; allowed: "
                + ", ".join(f"{k} ({v})" for k, v in CROSS_ENTROPY.items())
                + "."
            )
        if class_weights is not None and len(class_weights) != num_classes:
            raise ConfigError(
                f"task.class_weights has {len(class_weights)} entries for {num_classes} "
                "classes; give one weight per class, or null."
            )
        if cross_entropy_weight < 0 or dice_weight < 0 or cross_entropy_weight + dice_weight == 0:
            raise ConfigError(
                "task.cross_entropy_weight and task.dice_weight must be >= 0, not both 0."
            )
        self.num_classes, self.ignore_index = num_classes, ignore_index
        self.ce_weight, self.dice_weight = cross_entropy_weight, dice_weight
        self.class_weights = (
            None if class_weights is None else torch.tensor(class_weights, dtype=torch.float32)
        )
        self.include_background, self.cross_entropy = include_background, cross_entropy
        self.names = metric_names(class_names, num_classes)
        self.unions = _unions(unions or {}, self.names)
        _check_metric_names([*self.names, *self.unions])

    def scored(self, targets: torch.Tensor) -> torch.Tensor:
        """The pixels that count: a class, and not ``ignore_index``."""
        return (targets >= 0) & (targets < self.num_classes) & (targets != self.ignore_index)

    SCORES = ("val_dice", "val_iou", "val_pixel_accuracy")  # in [0, 1], higher is better

    def bounds(self, metric: str) -> tuple[float, float] | None:
        """Dice, IoU and the pixel accuracy lie in [0, 1]; the loss does not."""
        return (0.0, 1.0) if metric.startswith(self.SCORES) else None

    def higher_is_better_for(self, metric: str) -> bool | None:
        if metric.startswith(self.SCORES):
            return True
        return super().higher_is_better_for(metric)

    def is_count(self, metric: str) -> bool:
        """``val_empty_<class>``: the images with none of a class, reference and prediction."""
        return metric.startswith("val_empty_")

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        _check_shapes("segmentation", outputs, targets, 4, 3)
        logits, targets = outputs.float(), targets.long()
        scored = self.scored(targets)
        total = self.ce_weight * self.cross_entropy_sum(logits, targets, scored)
        if self.dice_weight:
            total = total + self.dice_weight * self.soft_dice_loss(logits, targets, scored).sum()
        return total

    def cross_entropy_sum(
        self, logits: torch.Tensor, targets: torch.Tensor, scored: torch.Tensor
    ) -> torch.Tensor:
        """The micro-batch's sum of per-image cross-entropies (see the class docstring)."""
        weight = None if self.class_weights is None else self.class_weights.to(logits.device)
        if self.cross_entropy == "repro":
            pixel = dense_cross_entropy(logits, targets, weight, self.ignore_index)
            pixel_weight = scored.float()
            if weight is not None:
                pixel_weight = pixel_weight * weight[targets.clamp(0, self.num_classes - 1)]
            return (pixel.sum((1, 2)) / pixel_weight.sum((1, 2)).clamp_min(1e-12)).sum()
        # What a PyTorch user writes: the pixels' sum, over the pixels of an image (equal to
        # the above without class weights and ignored pixels).
        if self.cross_entropy == "torch":
            inputs, labels = logits, targets
        else:  # the usual workaround for strict mode: the 2-D form, pixels as rows
            inputs, labels = logits.movedim(1, -1).flatten(0, -2), targets.flatten()
        total = F.cross_entropy(
            inputs, labels, weight, ignore_index=self.ignore_index, reduction="sum"
        )
        return total / targets[0].numel()

    def soft_dice_loss(
        self, logits: torch.Tensor, targets: torch.Tensor, scored: torch.Tensor
    ) -> torch.Tensor:
        """1 − the soft Dice per sample (N), over every class, on the scored pixels."""
        c = self.num_classes
        p = torch.softmax(logits, dim=1) * scored.unsqueeze(1)
        classes = torch.arange(c, device=logits.device).view(1, c, 1, 1)
        y = (targets.unsqueeze(1) == classes) & scored.unsqueeze(1)
        overlap = (p * y).sum((2, 3))
        dice = (2 * overlap + 1) / (p.sum((2, 3)) + y.sum((2, 3)) + 1)
        return 1 - dice.mean(1)

    def statistics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        c = self.num_classes
        targets = targets.long()
        scored = self.scored(targets)
        cell = torch.where(scored, targets * c + outputs.argmax(dim=1), c * c)
        confusion = torch.bincount(cell.flatten(), minlength=c * c + 1)[: c * c]
        return {
            "loss_sum": self.loss(outputs, targets).double(),
            "confusion": confusion.view(c, c),  # [true class, predicted class], int64
            "count": torch.tensor(len(targets), dtype=torch.int64, device=targets.device),
        }

    def per_sample(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each image's true positives, false positives and false negatives on its scored
        pixels, per class (``tp_<class>``...) and per union: int64, one entry per image."""
        targets = targets.long()
        scored = self.scored(targets)
        prediction = outputs.argmax(dim=1)
        rows: dict[str, torch.Tensor] = {}
        groups = [(name, [c]) for c, name in enumerate(self.names)] + list(self.unions.items())
        for name, members in groups:
            classes = torch.tensor(members, device=targets.device)
            truth = torch.isin(targets, classes) & scored
            predicted = torch.isin(prediction, classes) & scored
            rows[f"tp_{name}"] = (truth & predicted).sum((1, 2))
            rows[f"fp_{name}"] = (predicted & ~truth).sum((1, 2))
            rows[f"fn_{name}"] = (truth & ~predicted).sum((1, 2))
        return rows

    def sample_scores(self, samples: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each image's Dice of each class in the headline (``headline_<class>``; NaN where
        neither the reference nor the prediction has the class): ``val_dice`` is the mean
        over those columns of each one's mean over its finite values."""
        first = 0 if self.include_background else 1
        out = {}
        for name in self.names[first:]:
            tp, fp, fn = (samples[f"{k}_{name}"].double() for k in ("tp", "fp", "fn"))
            total = 2 * tp + fp + fn
            out[f"headline_{name}"] = torch.where(total > 0, 2 * tp / total, torch.nan)
        return out

    def metrics(
        self, totals: dict[str, torch.Tensor], samples: dict[str, torch.Tensor] | None = None
    ) -> dict[str, float]:
        """The metrics of the class docstring from the summed ``totals`` and the per-image
        ``samples`` (:meth:`per_sample`, concatenated); without ``samples`` only the pooled
        values and the loss."""
        confusion = totals["confusion"].cpu()
        tp = confusion.diag()
        fp, fn = confusion.sum(0) - tp, confusion.sum(1) - tp
        dice = [_ratio(2 * t, 2 * t + p + n) for t, p, n in zip(tp, fp, fn, strict=True)]
        iou = [_ratio(t, t + p + n) for t, p, n in zip(tp, fp, fn, strict=True)]
        first = 0 if self.include_background else 1
        out = {"val_loss": totals["loss_sum"].item() / int(totals["count"])}
        if samples is not None:
            per_image = {name: _per_image(samples, name) for name in self.names}
            out["val_dice"] = _mean([per_image[n][0] for n in self.names[first:]])
            out["val_iou"] = _mean([per_image[n][1] for n in self.names[first:]])
        out["val_dice_pooled"] = _mean(dice[first:])
        out["val_iou_pooled"] = _mean(iou[first:])
        out["val_pixel_accuracy"] = _ratio(tp.sum(), confusion.sum())
        if samples is None:
            out.update({f"val_dice_{n}_pooled": v for n, v in zip(self.names, dice, strict=True)})
            return out
        for name in [*self.names, *self.unions]:
            mean_dice, mean_iou, empty = _per_image(samples, name)
            t, p, n = (int(samples[f"{k}_{name}"].sum()) for k in ("tp", "fp", "fn"))
            out[f"val_dice_{name}"] = mean_dice
            out[f"val_iou_{name}"] = mean_iou
            out[f"val_dice_{name}_pooled"] = _ratio(2 * t, 2 * t + p + n)
            out[f"val_empty_{name}"] = empty
        return out


def metric_names(class_names: list[str] | tuple[str, ...] | None, num_classes: int) -> list[str]:
    """Each class's name in metric names: ``class_names`` with anything but letters, digits
    and ``_`` replaced by ``_`` (``val_dice_nucleus``), else the class index (``val_dice_1``)."""
    if class_names is None:
        return [str(c) for c in range(num_classes)]
    names = [re.sub(r"\W", "_", str(n)) for n in class_names]
    if len(names) != num_classes or len(set(names)) != num_classes or "" in names:
        raise ConfigError(
            f"class names {list(class_names)} do not name {num_classes} classes once each "
            "(in metric names: letters, digits, _); give one distinct name per class "
            "(data.class_names), or none."
        )
    return names


def _unions(unions: dict[str, list[str | int]], names: list[str]) -> dict[str, list[int]]:
    """``task.unions`` as class indices, each member a class name or index."""
    if not isinstance(unions, dict):
        raise ConfigError(
            f"task.unions={unions!r} is invalid; allowed: a mapping of names to classes, "
            "e.g. task.unions='{cell: [nucleus, boundary]}', or null."
        )
    out: dict[str, list[int]] = {}
    for union, members in unions.items():
        key = re.sub(r"\W", "_", str(union))
        indices = []
        for m in members if isinstance(members, list | tuple) else [members]:
            if str(m) in names:
                indices.append(names.index(str(m)))
            elif isinstance(m, int) and 0 <= m < len(names):
                indices.append(m)
            else:
                raise ConfigError(
                    f"task.unions.{union}: {m!r} is not a class (classes: {', '.join(names)}); "
                    "list class names or indices."
                )
        if key in names or key in out or len(set(indices)) < 2:
            raise ConfigError(
                f"task.unions.{union}: a union needs a name no class or other union has and "
                f"two or more distinct classes; got {list(members)}."
            )
        out[key] = sorted(set(indices))
    return out


def _check_metric_names(names: list[str]) -> None:
    """No two classes or unions give one metric name (a class ``pooled`` would be
    ``val_dice_pooled``; classes ``a`` and ``a_pooled`` would share ``val_dice_a_pooled``)."""
    taken: dict[str, str] = {f"val_dice_{k}": "" for k in ("pooled",)}
    for name in names:
        for key in (f"val_dice_{name}", f"val_dice_{name}_pooled"):
            if key in taken:
                raise ConfigError(
                    f"class or union name {name!r} gives the metric {key}, which "
                    f"{('class ' + repr(taken[key])) if taken[key] else 'the pooled mean'} "
                    "gives too; rename it (data.class_names, task.unions)."
                )
            taken[key] = name


def _per_image(samples: dict[str, torch.Tensor], name: str) -> tuple[float, float, int]:
    """(mean Dice, mean IoU, images left out) of one class over the images (see
    :class:`Segmentation`): exact per-image ratios, summed by ``math.fsum``."""
    tp, fp, fn = (samples[f"{k}_{name}"].tolist() for k in ("tp", "fp", "fn"))
    dice, iou, empty = [], [], 0
    for t, p, n in zip(tp, fp, fn, strict=True):
        if t + p + n == 0:  # neither the reference nor the prediction has the class
            empty += 1
            continue
        dice.append(2 * t / (2 * t + p + n))
        iou.append(t / (t + p + n))
    if not dice:
        return math.nan, math.nan, empty
    return math.fsum(dice) / len(dice), math.fsum(iou) / len(iou), empty


def _ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    return int(a) / int(b) if int(b) else math.nan


def _mean(values: list[float]) -> float:
    present = [v for v in values if not math.isnan(v)]
    return sum(present) / len(present) if present else math.nan
