"""What ``repro report`` reads of a finished job besides its summary: each evaluation
sample's share of the headline, and whether the run collapsed.

A job's ``val_per_image.csv`` holds a row per validation sample of its last evaluation: the
sample's name, the task's counts and its headline scores (columns ``headline`` or
``headline_<part>``: :meth:`repro.components.tasks.Task.sample_scores`), whose means over the samples
with a finite value, averaged over the columns, are the headline. The report uses them only
when they give back the summary's headline (to 1e-9): a record of another evaluation, or of
a task that scores otherwise, is named and left out.

A **collapsed** run is one whose model learned the trivial answer. It is named as such
whatever its distance from the mean (with five seeds a collapse sits about 1.5 SD away, too
near for an outlier rule):

- diverged: its final training loss is not finite;
- one class everywhere: every sample predicted as one class (classification's
  ``prediction`` column), or a headline of 0 on every sample that has a score (a
  segmentation that predicts none of the scored classes) -- where higher is better: a 0
  of a lower-is-better headline (a distance) is a perfect score;
- at chance: a balanced accuracy (each class's share of right answers, averaged over the
  classes) no better than guessing, 1/K -- so a good model on imbalanced data is not one.

A run can also collapse in one class: a class present in the evaluated samples that it
never predicts (:func:`never_predicted`; a segmentation's ``tp_<class>`` and ``fp_<class>``
all 0 while ``fn_<class>`` is not, a classifier's ``prediction`` column without it). Its
mean over classes is dragged down by that class alone; the report names the class beside
the job.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from repro.base.files import VAL_PER_SAMPLE_FILE

TOLERANCE = 1e-9  # the recomputed headline against the summary's


@dataclass
class SampleScores:
    """A job's per-sample headline scores: ``names[i]``'s score in column ``columns[k]`` is
    ``values[i][k]`` (NaN where the sample does not count for that part)."""

    names: list[str]
    columns: list[str]
    values: list[list[float]]
    table: dict[str, list[str]]  # every column of the file, as text


def _read(path: Path) -> dict[str, list[str]] | str:
    """The CSV's columns (text), or why it cannot be used."""
    try:
        with open(path, newline="", errors="replace") as f:
            rows = list(csv.reader(f))
    except OSError as err:
        return f"{path.name} cannot be read ({err.strerror or err})"
    if not rows or "sample" not in rows[0]:
        return f"{path.name} has no sample column"
    head = rows[0]
    if any(len(r) != len(head) for r in rows[1:]):
        return f"{path.name} has a row of another length (cut short or damaged)"
    return {name: [r[i] for r in rows[1:]] for i, name in enumerate(head)}


def headline_of(values: list[list[float]]) -> float:
    """The headline from per-sample scores: each column's mean over its finite values, then
    the mean over the columns that have one."""
    means = []
    for k in range(len(values[0]) if values else 0):
        column = [row[k] for row in values if math.isfinite(row[k])]
        if column:
            means.append(math.fsum(column) / len(column))
    return math.fsum(means) / len(means) if means else math.nan


def read_scores(job_dir: Path, summary: dict[str, Any]) -> SampleScores | str:
    """The job's per-sample headline scores, or one phrase saying why there are none."""
    path = Path(job_dir) / VAL_PER_SAMPLE_FILE
    if not path.is_file():
        return f"no {VAL_PER_SAMPLE_FILE}"
    table = _read(path)
    if isinstance(table, str):
        return table
    columns = [c for c in table if c == "headline" or c.startswith("headline_")]
    if not columns:
        return f"{VAL_PER_SAMPLE_FILE} has no headline scores (its task gives none)"
    try:
        values = [[float(table[c][i]) for c in columns] for i in range(len(table["sample"]))]
    except ValueError:
        return f"{VAL_PER_SAMPLE_FILE} has a score that is not a number"
    names = table["sample"]
    if len(set(names)) != len(names):
        return f"{VAL_PER_SAMPLE_FILE} names a sample twice"
    headline = summary.get(summary.get("headline", ""))
    recomputed = headline_of(values) if values else math.nan
    if not (isinstance(headline, (int, float)) and abs(recomputed - headline) <= TOLERANCE):
        return (
            f"{VAL_PER_SAMPLE_FILE} gives {summary.get('headline')} {recomputed:.6g}, not the "
            f"summary's {headline}: a record of another evaluation"
        )
    return SampleScores(names, columns, values, table)


def collapse(summary: dict[str, Any], scores: SampleScores | str | None) -> str | None:
    """Why a finished job counts as collapsed (see the module docstring), or None."""
    loss = summary.get("final_loss")
    if (
        isinstance(loss, (int, float))
        and not math.isfinite(loss)
        or (
            "final_loss" in summary and loss is None  # a non-finite value is written as null
        )
    ):
        return "diverged (its final training loss is not finite)"
    if not isinstance(scores, SampleScores) or not scores.values:
        return None
    predictions = scores.table.get("prediction")
    if predictions and len(set(predictions)) == 1 and len(predictions) > 1:
        return f"one class everywhere (predicts class {predictions[0]} for every sample)"
    finite = [v for row in scores.values for v in row if math.isfinite(v)]
    headline = summary.get("headline")
    directions = summary.get("metric_directions") or {}
    lower_is_better = directions.get(headline, summary.get("higher_is_better")) is False
    if finite and all(v == 0 for v in finite) and not lower_is_better:  # 0 mm: perfect
        return (
            "one class everywhere (scores 0 on every sample: predicts none of the scored classes)"
        )
    targets = scores.table.get("target")
    if predictions and targets and len(set(targets)) > 1:
        classes = sorted(set(targets))
        recalls = []
        for t in classes:
            mine = [p for p, y in zip(predictions, targets, strict=True) if y == t]
            recalls.append(sum(p == t for p in mine) / len(mine))
        balanced = math.fsum(recalls) / len(classes)
        if balanced <= 1 / len(classes):
            return (
                f"at chance (balanced accuracy {balanced:.4f}: no better than guessing among "
                f"the {len(classes)} classes)"
            )
    return None


def never_predicted(scores: SampleScores | str | None) -> list[str]:
    """The classes present in a job's evaluated samples that it never predicts (see the
    module docstring), from its per-sample record; empty without one."""
    if not isinstance(scores, SampleScores):
        return []
    table = scores.table
    predictions, targets = table.get("prediction"), table.get("target")
    if predictions and targets:
        return sorted(set(targets) - set(predictions), key=lambda c: (len(c), c))
    out = []
    for column in table:
        if not column.startswith("fn_"):
            continue
        name = column[3:]
        try:
            missed = sum(int(v) for v in table[column])
            predicted = sum(int(v) for k in ("tp", "fp") for v in table.get(f"{k}_{name}", []))
        except ValueError:
            continue
        if missed > 0 and predicted == 0 and f"tp_{name}" in table:
            out.append(name)
    return out
