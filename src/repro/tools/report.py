"""``repro report DIR [DIR ...]``: seed sweeps as distributions, and groups compared seed
by seed.

"Which run is right?" has no answer; the distribution over seeds does. For each group of jobs
that share every override but the seed (``lr=0.1,0.01 seed=0,1,2`` gives two groups), the
report lists each job (seed, status, final metrics, weights digest), then per metric -- the
task's headline first (``val_accuracy`` for classification), its other metrics, the final
training loss -- the mean, the standard deviation, min/max, a 95% confidence interval for
the mean (Student t, n - 1 degrees of freedom), and any seed more than 2 SD from the mean.
Jobs that failed or did not finish are listed as such, never dropped. Cross-validation folds
(``data.fold=0,1,2,3,4 seed=0,1``) are pooled like seeds: a group is a distribution over
folds x seeds, each job listed with its fold beside its seed.

With two or more groups -- of one sweep, or of several directories (yesterday's sweep and
today's, single runs too) -- "is B better than A?" gets an answer: each group is compared
with a baseline, seed by seed -- (seed, fold) by (seed, fold) for folds
(:mod:`repro.tools.comparisons`).

Writes ``report.md``, ``report.json`` and, with matplotlib installed (``pip install -e
'.[report]'``), a figure of every seed's loss and headline-metric curves with the mean ± SD
band per group, and one of the seeds' values side by side (``comparison.png``).
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import math
import shlex
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from repro.base.errors import ReproError
from repro.base.files import (
    ERROR_FILE,
    EVAL_FILE,
    LAUNCH_DIR,
    METRICS_FILE,
    OVERRIDES_FILE,
    RUN_MARKERS,
    SUMMARY_FILE,
    finite_or_null,
    load_yaml,
    parse_json,
    save_figure,
    write_file,
)
from repro.defense.config import RUN_CONTROL
from repro.records.sample_records import collapse, never_predicted, read_scores
from repro.tools.comparisons import compare_groups, format_comparisons, plot_comparison
from repro.tools.stats import mean_interval, shape

# The headline and metrics of summaries written before tasks recorded them.
DEFAULT_METRICS = ("val_accuracy", "val_loss")


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


# Overrides whose values a group pools: the training seed, and the cross-validation fold.
POOLED = ("seed", "data.fold")


@dataclass
class Job:
    dir: Path
    num: int
    overrides: list[str]
    seed: int | None
    status: str  # ok | failed | incomplete | not started | no launch record
    summary: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    source: int = 0  # which of the report's directories it came from
    fold: int | None = None  # data.fold of a cross-validated job (data.folds set), else None
    # False: its .hydra/ is gone (overrides: the sweep's plan for its number)
    launch_record: bool = True
    # a finished job's per-sample headline scores, or why it has none (repro.records.sample_records)
    scores: Any = None
    collapsed: str | None = None  # why a finished job counts as collapsed, if it does
    never_predicted: list[str] = field(default_factory=list)  # classes it never predicts

    @property
    def metrics(self) -> list[str]:
        """The task's headline first, its other metrics, then the final training loss."""
        headline = self.summary.get("headline", DEFAULT_METRICS[0])
        names = self.summary.get("metric_names", DEFAULT_METRICS)
        return [headline, *(m for m in names if m != headline), "final_loss"]

    @property
    def group(self) -> tuple[str, ...]:
        return tuple(o for o in self.overrides if override_key(o) not in (*POOLED, *RUN_CONTROL))

    def rerun_command(self) -> str:
        if self.status == NOT_STARTED or not self.launch_record:  # its own command
            return "python train.py " + shlex.join(self.overrides)
        return f"repro rerun {self.dir}"


NOT_STARTED = "not started"
# A job directory whose launch record (.hydra/) is gone and whose overrides the sweep's plan
# does not give: listed on its own, in no group.
NO_LAUNCH = "no launch record"
# What a job's directory holds besides its launch record
RUN_FILES = (*(m for m in RUN_MARKERS if m != LAUNCH_DIR), ERROR_FILE)


def planned_jobs(sweep_dir: Path) -> list[list[str]] | None:
    """Each job the sweep planned, in order (its overrides), from its ``multirun.yaml``: the
    expansion of its task overrides by Hydra's basic sweeper. None without that file, or
    when another sweeper (Optuna, say) chose the jobs as it went."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    path = Path(sweep_dir) / "multirun.yaml"
    if not path.is_file():
        return None
    hydra = (load_yaml(path) or {}).get("hydra") or {}
    sweeper = hydra.get("sweeper") or {}
    if not str(sweeper.get("_target_", "")).endswith("BasicSweeper"):
        return None
    params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
    task = [*params, *((hydra.get("overrides") or {}).get("task") or [])]
    try:
        batches = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(task), None)
    except Exception:  # glob() and friends need the config they were composed with
        return None
    return [list(job) for batch in batches for job in batch]


def _what(overrides: list[str]) -> tuple[str, ...]:
    """A job's overrides less those that only say how it ran (a resumed job records them)."""
    return tuple(o for o in overrides if override_key(o) not in RUN_CONTROL)


def override_value(overrides: list[str], default: Any, key: str = "seed") -> Any:
    """The value the override ``key`` (the seed, or ``data.fold``) gives, else ``default``."""
    for o in overrides:
        if override_key(o) == key:
            value = o.split("=", 1)[1]
            return int(value) if value.isdigit() else value
    return default


def _fold_of(config: Any) -> int | None:
    """A resolved config's ``data.fold`` when it cross-validates (``data.folds`` set)."""
    data = config.get("data") if isinstance(config, dict) else None
    if isinstance(data, dict) and data.get("folds"):
        return data.get("fold")
    return None


def _summary(job_dir: Path) -> dict[str, Any]:
    """A finished job's ``summary.json``; one line naming it where it is damaged: not JSON
    (:func:`repro.base.files.parse_json`: also a number no float holds, nesting too deep), not
    an object, or its headline and metric names not names."""
    path = job_dir / SUMMARY_FILE
    try:
        summary = parse_json(path.read_bytes())
        if not isinstance(summary, dict):
            raise TypeError("not a JSON object")
        names = summary.get("metric_names", [])
        if not isinstance(summary.get("headline", ""), str) or not (
            isinstance(names, list) and all(isinstance(n, str) for n in names)
        ):
            raise TypeError("its headline or metric_names are not names")
        if not isinstance(summary.get("environment") or {}, dict):
            raise TypeError("its environment is not a JSON object")
    except OSError as err:
        raise ReproError(
            f"{path}: cannot be read ({err.strerror or err}); make it readable, or move its job "
            "directory out of the sweep."
        ) from None
    except (ValueError, TypeError) as err:  # UnicodeDecodeError included
        what = "not JSON" if isinstance(err, ValueError) else "not a job's summary"
        raise ReproError(
            f"{path}: {what} ({err}); the file is damaged: "
            f"re-run the job (repro rerun {job_dir}) or move it out of the sweep."
        ) from None
    return summary


def _job_status(job_dir: Path) -> tuple[str, dict[str, Any], str]:
    if (job_dir / SUMMARY_FILE).is_file():
        return "ok", _summary(job_dir), ""
    if (job_dir / ERROR_FILE).is_file():
        try:
            err = parse_json((job_dir / ERROR_FILE).read_bytes())
            if not isinstance(err, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError):
            return "failed", {}, f"{ERROR_FILE} is unreadable (cut short or damaged)"
        return "failed", {}, f"{err.get('type')}: {err.get('message')}"
    from repro.records.checkpoint import list_checkpoints  # torch: only for an unfinished job

    ckpts = list_checkpoints(job_dir)
    detail = (
        f"stopped after its step-{ckpts[0][0]} checkpoint: resume with trainer.resume=auto"
        if ckpts
        else "started (its launch is recorded), no checkpoint yet: stopped before its first "
        "(killed, interrupted) or still running"
    )
    return "incomplete", {}, detail


def _job(job_dir: Path, num: int, source: int) -> Job | None:
    """The job a directory holds (None: not a run's directory)."""
    overrides_file = job_dir / OVERRIDES_FILE
    if not overrides_file.is_file():
        return None
    overrides = load_yaml(overrides_file)
    if not isinstance(overrides, list):
        raise ReproError(
            f"{overrides_file}: not a list of overrides; the file is damaged: fix it, or move "
            "its job directory out of the sweep."
        )
    overrides = [str(o) for o in overrides]
    config_file = job_dir / ".hydra" / "config.yaml"
    seed = fold = None
    if config_file.is_file():
        config = load_yaml(config_file)
        seed = config.get("seed") if isinstance(config, dict) else None
        fold = _fold_of(config)
    head = job_dir.name.split("_", 1)[0]
    num = int(head) if head.isdigit() else num
    status, summary, error = _job_status(job_dir)
    return Job(job_dir, num, overrides, seed, status, summary, error, source, fold)


def _orphan(
    job_dir: Path, planned: list[list[str]], default_seed: Any, default_fold: Any, source: int
) -> Job:
    """A sweep's job directory whose launch record (``.hydra/``) is gone: its overrides are
    the sweep's plan for its number (``multirun.yaml``) where the plan has that job and its
    seed is the one the job recorded; else it is a job of its own kind (:data:`NO_LAUNCH`),
    in no group."""
    num = int(job_dir.name.split("_", 1)[0])
    status, summary, error = _job_status(job_dir)
    recorded = summary.get("seed")
    overrides = planned[num] if num < len(planned) else None
    seed = override_value(overrides or [], None)
    if None not in (seed, recorded) and seed != recorded:
        overrides = None  # another job's plan (the sweep's multirun.yaml was replaced?)
    seed = next((s for s in (seed, recorded, default_seed) if s is not None), None)
    fold = override_value(overrides or [], default_fold, "data.fold")
    gone = f"its launch record ({LAUNCH_DIR}/) is gone"
    if overrides is None:
        what = {"ok": "finished", "failed": f"failed ({error})", "incomplete": error}[status]
        error = f"{what}; {gone} and the sweep's plan does not name it: its overrides are unknown"
        return Job(job_dir, num, [], recorded, NO_LAUNCH, summary, error, source, fold, False)
    note = f"{gone}: its overrides are the sweep's plan for job {num}"
    error = f"{error}; {note}" if error else note
    return Job(job_dir, num, overrides, seed, status, summary, error, source, fold, False)


def find_jobs(sweep_dir: Path, source: int = 0) -> list[Job]:
    """The jobs of a sweep's directory, the planned ones that never started included; or the
    one job of a run's directory."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise ReproError(f"{sweep_dir}: no such sweep directory.")
    alone = _job(sweep_dir, 0, source)  # `python train.py ...`'s run directory
    if alone is not None:
        return [alone]
    jobs, orphans = [], []
    for sub in sorted(p for p in sweep_dir.iterdir() if p.is_dir()):
        job = _job(sub, len(jobs), source)
        if job is not None:
            jobs.append(job)
        elif sub.name.split("_", 1)[0].isdigit() and any((sub / f).exists() for f in RUN_FILES):
            orphans.append(sub)  # a job's directory whose launch record is gone
    if not jobs and not orphans:
        raise ReproError(
            f"{sweep_dir}: no job directories (with .hydra/overrides.yaml); give the directory "
            "of a `python train.py -m ...` sweep, e.g. multirun/<date>/<time>_<id>, or of a run."
        )
    default_seed = next((j.seed for j in jobs if j.seed is not None), None)
    default_fold = next((j.fold for j in jobs if j.fold is not None), None)
    planned = planned_jobs(sweep_dir) or []
    jobs += [_orphan(sub, planned, default_seed, default_fold, source) for sub in orphans]
    started = {_what(j.overrides) for j in jobs if j.status != NO_LAUNCH}  # what they compute
    for num, overrides in enumerate(planned):
        if _what(overrides) not in started:  # the sweep was stopped before this job
            seed = override_value(overrides, default_seed)
            fold = override_value(overrides, default_fold, "data.fold")
            jobs.append(
                Job(
                    sweep_dir / str(num),
                    num,
                    overrides,
                    seed,
                    NOT_STARTED,
                    {},
                    "never started",
                    source,
                    fold,
                )
            )
    return sorted(jobs, key=lambda j: j.num)


def as_json(report: dict[str, Any]) -> str:
    """The report as valid JSON: a value that is not finite is null."""
    return json.dumps(finite_or_null(report), indent=2, allow_nan=False) + "\n"


def outliers(jobs: list[Job], metric: str, stats: dict[str, Any]) -> list[dict[str, Any]]:
    """Seeds more than 2 SD from the group's mean (needs n >= 3)."""
    sd = stats.get("sd")
    if not sd or stats["n"] < 3:
        return []
    found = []
    for j in jobs:
        value = j.summary.get(metric)
        if not _finite(value):
            continue  # left out of the statistics too
        z = (value - stats["mean"]) / sd
        if abs(z) > 2:
            found.append(
                {
                    "seed": j.seed,
                    "fold": getattr(j, "fold", None),  # a Job, or a stand-in of a test
                    "job": j.dir.name,
                    "value": j.summary[metric],
                    "z": z,
                }
            )
    return found


def _curves(job_dir: Path, metric: str) -> tuple[dict[int, float], dict[int, float]]:
    """The training loss per step and ``metric`` per evaluation (a row that does not read as
    numbers, damaged, is left out of the figure)."""
    curves: list[dict[int, float]] = []
    for name, column in ((METRICS_FILE, "loss"), (EVAL_FILE, metric)):
        points = {}
        if (job_dir / name).is_file():
            with open(job_dir / name, errors="replace", newline="") as f:
                for r in csv.DictReader(f):
                    try:
                        points[int(r["step"])] = float(r[column])
                    except (KeyError, TypeError, ValueError):
                        continue
        curves.append(points)
    return curves[0], curves[1]


def labels(dirs: list[Path]) -> list[str]:
    """The shortest trailing parts of the paths that tell the directories apart."""
    parts = [Path(d).resolve().parts for d in dirs]
    for k in range(1, max(len(p) for p in parts) + 1):
        names = ["/".join(p[-k:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [str(d) for d in dirs]  # the same directory twice


def _read_once(dirs: list[Path]) -> tuple[list[Path], list[Job]]:
    """The directories and their jobs, each job once (by resolved path): a directory given
    again (under another name too), or one whose jobs another given directory holds (a
    sweep and one of its jobs), is left out, and a line on stderr says so."""
    kept: list[Path] = []
    jobs: list[Job] = []
    seen: dict[Path, Path] = {}  # a job's resolved directory -> the directory it was read from
    for d in dirs:
        found = find_jobs(d, source=len(kept))
        new = [j for j in found if j.dir.resolve() not in seen]
        if len(new) < len(found):
            first = seen[next(j.dir.resolve() for j in found if j.dir.resolve() in seen)]
            line = (
                ("given twice" if d == first else f"the same directory as {first}") + ": read once"
                if d.resolve() == first.resolve()
                else f"{len(found) - len(new)} of its {len(found)} jobs are also {first}'s: "
                "each counted once"
            )
            print(f"repro report: {d}: {line}", file=sys.stderr)
        if not new:
            continue
        seen.update((j.dir.resolve(), d) for j in new)
        kept.append(d)
        jobs += new
    return kept, jobs


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    """A number the statistics can use (an integer too large for a float is refused when
    its file is read: :func:`repro.base.files.parse_json`)."""
    return _number(value) and math.isfinite(value)


def _scalar(value: Any) -> Any:
    """A summary's value as a report shows it: a list or object (a damaged file, a hand)
    by its kind only."""
    return value if value is None or isinstance(value, (str, int, float)) else type(value).__name__


def _left_out(ok: list[Job], metric: str) -> list[dict[str, Any]]:
    """The finished jobs whose ``metric`` is not in its statistics, and why: not finite
    (``trainer.on_nonfinite=continue``: summary.json holds a NaN or infinity as null), not a
    number, or not recorded."""
    out = []
    for j in ok:
        value = j.summary.get(metric)
        if _finite(value):
            continue
        if metric not in j.summary:
            why = "not recorded"
        elif value is None or _number(value):
            why = "non-finite"
        else:
            why = f"not a number ({str(_scalar(value))[:24]!r})"
        out.append({"job": j.dir.name, "seed": j.seed, "fold": j.fold, "why": why})
    return out


def _metric_stats(ok: list[Job], m: str, headline: bool) -> dict[str, Any]:
    """A group's statistics of metric ``m`` over its finished jobs: the distribution, its
    shape, outliers, values left out and (the headline) the collapsed seeds."""
    values = [float(j.summary[m]) for j in ok if _finite(j.summary.get(m))]
    stats = mean_interval(values)
    first = ok[0].summary if ok else {}
    if m in (first.get("count_metrics") or []):  # a count: its distribution, no interval
        for key in ("ci95", "t", "df"):
            stats.pop(key, None)
        stats["count"] = True
    bounds = (first.get("metric_bounds") or {}).get(m)
    if bounds and "ci95" in stats:  # a Dice's interval ends at 1, as the Dice does
        lo, hi = bounds
        stats["ci95"] = [max(stats["ci95"][0], lo), min(stats["ci95"][1], hi)]
        stats["bounds"] = bounds
    if headline and "ci95" in stats and not stats.get("count"):
        level = _config_interval(ok, bounds)
        if level is not None:
            stats["two_level"] = level
    stats["shape"] = shape(values)  # bimodal or heavy-tailed: the median leads
    stats["outliers"] = outliers(ok, m, stats)
    stats["left_out"] = _left_out(ok, m)
    if headline:  # runs that learned the trivial answer
        stats["collapsed"] = [
            {"seed": j.seed, "fold": j.fold, "job": j.dir.name, "why": j.collapsed}
            for j in ok
            if j.collapsed
        ]
        stats["never_predicted"] = [
            {"seed": j.seed, "fold": j.fold, "job": j.dir.name, "classes": j.never_predicted}
            for j in ok
            if j.never_predicted and not j.collapsed
        ]
    return stats


def _config_interval(ok: list[Job], bounds: Any) -> dict[str, Any] | None:
    """The headline's interval over seeds *and* evaluation samples
    (:func:`repro.tools.stats.config_interval`) where every finished job scored the same
    samples, else None (the seeds' interval stands alone)."""
    from repro.records.sample_records import SampleScores
    from repro.tools.comparisons import score_tables
    from repro.tools.stats import config_interval

    tables = score_tables([("baseline", j.seed, j) for j in ok], SampleScores, "the others")
    if isinstance(tables, str) or len(tables[0]) < 2 or tables[0].shape[1] < 2:
        return None
    got = config_interval(tables[0], tuple(bounds) if bounds else None)
    keep = ("mean", "ci95", "se", "df", "seed_var", "sample_var", "interaction_var", "shares")
    return {k: got[k] for k in keep} | {"samples": int(tables[0].shape[1])}


def _read_samples(jobs: list[Job]) -> None:
    """Each finished job's per-sample headline scores, and whether it collapsed
    (:mod:`repro.records.sample_records`)."""
    for j in jobs:
        if j.status == "ok":
            j.scores = read_scores(j.dir, j.summary)
            j.collapsed = collapse(j.summary, j.scores)
            j.never_predicted = never_predicted(j.scores)


def build_report(
    dirs: Path | list[Path],
    baseline: str | None = None,
    metrics: list[str] | None = None,
    sesoi: float | None = None,
) -> dict[str, Any]:
    """The report of one sweep (or run) directory, or of several compared: the groups, their
    statistics, and each group compared with the ``baseline`` group (:mod:`repro.tools.comparisons`)
    on the headline metric and ``metrics``; ``sesoi``: the headline's smallest effect of
    interest."""
    dirs, jobs = _read_once([Path(d) for d in ([dirs] if isinstance(dirs, (str, Path)) else dirs)])
    _read_samples(jobs)
    unplaced = [j for j in jobs if j.status == NO_LAUNCH]
    jobs = [j for j in jobs if j.status != NO_LAUNCH]
    if not jobs:
        raise ReproError(
            f"{dirs[0]}: no job directory has its launch record ({LAUNCH_DIR}/overrides.yaml), "
            "nor does the sweep's plan (multirun.yaml) name them; put back a job's "
            f"{LAUNCH_DIR}/ directory to report on it."
        )
    dir_labels = labels(dirs)
    groups: dict[tuple[int, tuple[str, ...]], list[Job]] = {}
    for j in jobs:
        groups.setdefault((j.source, j.group), []).append(j)
    out_groups = []
    for (source, key), members in groups.items():  # in the order of their first job
        ok = [j for j in members if j.status == "ok"]
        metric_names = (ok or members)[0].metrics  # the group's task: headline first
        per_metric = {m: _metric_stats(ok, m, m == metric_names[0]) for m in metric_names}
        first = (ok or members)[0].summary
        out_groups.append(
            {
                "source": str(dirs[source]),
                "label": dir_labels[source],
                "overrides": list(key),
                "jobs": [
                    {
                        "job": j.dir.name,
                        "dir": str(j.dir),
                        "seed": j.seed,
                        "fold": j.fold,
                        "status": j.status,
                        "error": j.error,
                        **{
                            m: _scalar(j.summary.get(m))
                            for m in (*metric_names, "steps", "weights_sha256")
                        },
                        "rerun": j.rerun_command(),
                        "launch_record": j.launch_record,
                        "collapsed": j.collapsed,
                        "never_predicted": j.never_predicted,
                        "per_sample": (
                            None
                            if j.scores is None or isinstance(j.scores, str)
                            else len(j.scores.names)
                        ),
                    }
                    for j in members
                ],
                "headline": metric_names[0],
                "higher_is_better": first.get("higher_is_better"),
                "metric_directions": first.get("metric_directions") or {},
                "metrics": per_metric,
                "distinct_weights": len({str(j.summary.get("weights_sha256")) for j in ok}),
            }
        )
    common = [o for o in out_groups[0]["overrides"] if all(o in g["overrides"] for g in out_groups)]
    for g in out_groups:
        rest = " ".join(o for o in g["overrides"] if o not in common)
        g["title"] = rest if len(dirs) == 1 else f"{g['label']}: {rest}" if rest else g["label"]
    report = {
        "sweep_dir": str(dirs[0]),
        "dirs": [str(d) for d in dirs],
        "common_overrides": common,
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "jobs": len(jobs),
        "ok": sum(j.status == "ok" for j in jobs),
        "failed": sum(j.status == "failed" for j in jobs),
        "incomplete": sum(j.status == "incomplete" for j in jobs),
        "not_started": sum(j.status == NOT_STARTED for j in jobs),
        "groups": out_groups,
        # job directories whose launch record is gone and whose overrides are unknown
        "unplaced": [
            {"job": j.dir.name, "dir": str(j.dir), "seed": j.seed, "error": j.error}
            for j in unplaced
        ],
    }
    report.update(compare_groups(out_groups, list(groups.values()), baseline, metrics, sesoi))
    return report


def _num(x: Any, digits: int = 4) -> str:
    return f"{x:.{digits}f}" if isinstance(x, float) else ("–" if x is None else str(x))


def _seed_fold(entry: dict[str, Any]) -> str:
    """``seed 3``, or ``seed 3, fold 1`` for a cross-validated job."""
    fold = entry.get("fold")
    return f"seed {entry['seed']}" + (f", fold {fold}" if fold is not None else "")


def _metric_lines(m: str, s: dict[str, Any]) -> list[str]:
    """A group's statistics of metric ``m``: its distribution, outliers and values left out."""
    lines: list[str] = []
    left = s.get("left_out") or []  # finished jobs whose value is not a finite number
    if s["n"] == 0 and not left:
        lines.append(f"- **{m}**: no finished job.")
    elif s["n"] == 0 and all(x["why"] == "non-finite" for x in left):
        lines.append(f"- **{m}**: non-finite in every finished job ({len(left)}).")
        left = []
    elif s["n"] == 0:
        lines.append(f"- **{m}**: no finished job has a finite value.")
    elif s["n"] == 1:
        lines.append(f"- **{m}**: {s['mean']:.4f} (n=1: no spread; run more seeds)")
    elif s.get("count"):  # a count: its distribution only
        lines.append(
            f"- **{m}**: a count; mean {s['mean']:.4f}, SD {s['sd']:.4f}, min {s['min']:g}, "
            f"max {s['max']:g} (n={s['n']}; no interval: not an estimate)"
        )
    else:
        kept = f"; kept inside [{s['bounds'][0]:g}, {s['bounds'][1]:g}]" if s.get("bounds") else ""
        lines.append(
            f"- **{m}**: mean {s['mean']:.4f}, SD {s['sd']:.4f}, min {s['min']:.4f}, "
            f"max {s['max']:.4f}; 95% CI of the mean [{s['ci95'][0]:.4f}, "
            f"{s['ci95'][1]:.4f}] (Student t, n={s['n']}, df={s['df']}, t={s['t']:.3f}){kept}"
        )
        level = s.get("two_level")
        if level:
            lo, hi = level["ci95"]
            lines.append(
                f"  - over seeds *and* evaluation samples (the next seeds on another "
                f"{level['samples']} samples drawn alike): 95% CI [{lo:.4f}, {hi:.4f}] "
                f"(df={level['df']:.1f}); the interval above holds this validation set fixed"
            )
    for x in s.get("collapsed") or []:
        lines.append(f"  - **collapsed**: {_seed_fold(x)} ({x['job']}): {x['why']}")
    for x in s.get("never_predicted") or []:
        lines.append(
            f"  - **a class collapsed**: {_seed_fold(x)} ({x['job']}) never predicts "
            f"{', '.join(x['classes'])}, present in its evaluated samples"
        )
    why = "collapsed seeds" if s.get("collapsed") else s.get("shape")
    if s.get("n", 0) >= 2 and why:
        lines.append(
            f"  - {why}: read the median {s['median']:.4f} and the interquartile mean "
            f"{s['iqm']:.4f}, not the mean"
        )
    for o in s["outliers"]:
        lines.append(
            f"  - {_seed_fold(o)} ({o['job']}): {o['value']:.4f} is {abs(o['z']):.1f} SD "
            f"{'above' if o['z'] > 0 else 'below'} the mean"
        )
    if left:
        lines.append(
            "  - left out: " + "; ".join(f"{x['job']} ({_seed_fold(x)}): {x['why']}" for x in left)
        )
    return lines


def format_markdown(report: dict[str, Any], figures: dict[int, str]) -> str:
    counts = (
        f"{report['jobs']} jobs: {report['ok']} finished, {report['failed']} failed, "
        f"{report['incomplete']} incomplete"
    )
    if report.get("not_started"):  # the sweep was stopped before it started them all
        counts = counts.replace(" jobs: ", " jobs planned: ", 1)
        counts += f", {report['not_started']} never started"
    unplaced = report.get("unplaced") or []
    if unplaced:  # in no group: listed at the end
        many = "y" if len(unplaced) == 1 else "ies"
        counts += f"; {len(unplaced)} more job director{many} without a launch record (at the end)"
    dirs = report.get("dirs") or [report["sweep_dir"]]
    lines = [
        "# Sweep report: " + ", ".join(f"`{d}`" for d in dirs),
        "",
        f"{counts}. Generated {report['date']} by `repro report`.",
    ]
    if report["common_overrides"]:
        lines += ["", "Overrides of every job: `" + " ".join(report["common_overrides"]) + "`"]
    lines += format_comparisons(report)
    if -1 in figures:
        lines += ["", f"![seeds compared]({figures[-1]})"]
    for i, g in enumerate(report["groups"]):
        folds = any(j.get("fold") is not None for j in g["jobs"])  # cross-validated
        only = "only the seed and fold vary" if folds else "only the seed varies"
        title = g["title"] or f"all jobs ({only})"
        lines += ["", f"## {title}", ""]
        names = list(g["metrics"])
        lines += [
            f"| job | seed |{' fold |' if folds else ''} status | "
            + " | ".join(names)
            + " | steps | weights |",
            "|---|---|---|" + "---|" * (len(names) + folds) + "---|---|",
        ]
        for j in g["jobs"]:
            status = j["status"] if j["status"] == "ok" else f"**{j['status']}**"
            weights = f"`{str(j['weights_sha256'])[:12]}`" if j["weights_sha256"] else "–"
            values = " | ".join(_num(j[m]) for m in names)
            fold = f" {_num(j.get('fold'))} |" if folds else ""
            lines.append(
                f"| {j['job']} | {j['seed']} |{fold} {status} | {values} | {_num(j['steps'])} | "
                f"{weights} |"
            )
        lines.append("")
        if folds:
            lines += [
                "Note: folds share their training files, so jobs of one seed are not "
                "independent: the intervals of this group's statistics below, which treat "
                "them so, are too narrow (a description, not an estimate); the comparisons' "
                "verdicts are widened for it (the corrected resampled t-test, Nadeau and "
                "Bengio 2003).",
                "",
            ]
        for m, s in g["metrics"].items():
            lines += _metric_lines(m, s)
        problems = [j for j in g["jobs"] if j["status"] != "ok"]
        if problems:
            lines += ["", "Not in the statistics:"]
            lines += [
                f"- {j['job']} ({_seed_fold(j)}): {j['status']}: {j['error']}" for j in problems
            ]
        recovered = [
            j for j in g["jobs"] if j["status"] == "ok" and not j.get("launch_record", True)
        ]
        if recovered:
            lines += ["", "Finished without their launch record:"]
            lines += [f"- {j['job']} ({_seed_fold(j)}): {j['error']}" for j in recovered]
        lines += [
            "",
            f"Distinct final weight digests: {g['distinct_weights']} of "
            f"{sum(j['status'] == 'ok' for j in g['jobs'])} finished jobs. Re-run one job alone "
            f"(same bits): `{g['jobs'][0]['rerun']}`.",
        ]
        if i in figures:
            lines += ["", f"![curves]({figures[i]})"]
    if unplaced:
        lines += ["", "## Job directories without their launch record (in no group)", ""]
        lines += [f"- {j['job']} (seed {j['seed']}): {j['error']}" for j in unplaced]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], out_dir: Path) -> tuple[dict[int, str], str | None]:
    """One PNG per group: training loss and the headline metric of every seed, mean ± SD;
    with a comparison, ``comparison.png`` (:func:`repro.tools.comparisons.plot_comparison`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}, "matplotlib is not installed (pip install -e '.[report]'): no figure"
    figures: dict[int, str] = {}
    for i, g in enumerate(report["groups"]):
        members = [j for j in g["jobs"] if j["status"] == "ok"]
        if not members:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        headline = g["headline"]
        for ax, which, label in ((axes[0], 0, "training loss"), (axes[1], 1, headline)):
            curves = [_curves(Path(j["dir"]), headline)[which] for j in members]
            for j, c in zip(members, curves, strict=True):
                style = "o-" if which else "-"  # evaluations are few points
                ax.plot(
                    list(c),
                    list(c.values()),
                    style,
                    lw=0.8,
                    ms=3,
                    alpha=0.6,
                    label=_seed_fold(j),
                )
            common = sorted(set.intersection(*(set(c) for c in curves)))
            common = [s for s in common if all(math.isfinite(c[s]) for c in curves)]
            if common and len(curves) > 1:
                mean = [statistics.fmean(c[s] for c in curves) for s in common]
                sd = [statistics.stdev(c[s] for c in curves) for s in common]
                ax.plot(common, mean, color="black", lw=1.6, label="mean")
                ax.fill_between(
                    common,
                    [m - d for m, d in zip(mean, sd, strict=True)],
                    [m + d for m, d in zip(mean, sd, strict=True)],
                    color="black",
                    alpha=0.15,
                    label="mean ± SD",
                )
            ax.set_xlabel("step")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[1].legend(fontsize=7, loc="lower right")
        folds = any(j.get("fold") is not None for j in g["jobs"])
        varies = "the seed and the fold vary" if folds else "only the seed varies"
        fig.suptitle(g["title"] or f"all jobs ({varies})", fontsize=9)
        fig.tight_layout()
        name = "report.png" if len(report["groups"]) == 1 else f"report-{i}.png"
        save_figure(fig, out_dir / name)
        plt.close(fig)
        figures[i] = name
    name = plot_comparison(report, out_dir)
    if name:
        figures[-1] = name  # the comparison's, shown with its table
    return figures, None


def write_report(
    dirs: Path | list[Path],
    out: Path | None = None,
    baseline: str | None = None,
    metrics: list[str] | None = None,
    sesoi: float | None = None,
) -> tuple[dict[str, Any], str, list[Path]]:
    """Build the report and write report.md, report.json (and PNGs) into ``out``: by default
    the directory reported on, or for several a new ``reports/<date>_<time>`` here."""
    dirs = [Path(d) for d in ([dirs] if isinstance(dirs, (str, Path)) else dirs)]
    report = build_report(dirs, baseline, metrics, sesoi)  # reads everything before writing
    dirs = [Path(d) for d in report["dirs"]]  # each once
    if out is None:
        stamp = dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
        out = dirs[0] if len(dirs) == 1 else Path("reports") / stamp
        n = 1
        while len(dirs) > 1 and out.exists():  # another report in the same second
            n += 1
            out = Path("reports") / f"{stamp}_{n}"
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ReproError(f"--out {out}: exists and is not a directory; give a directory.")
    out.mkdir(parents=True, exist_ok=True)
    # each file written whole and renamed into place: a link planted at its name (a
    # received sweep's) is replaced, never written through
    write_file(out / "report.json", as_json(report))  # text first
    write_file(out / "report.md", format_markdown(report, {}))
    try:
        figures, note = plot(report, out)
    except Exception as err:  # a figure is a bonus: never lose the text report to it
        figures, note = {}, f"no figure ({type(err).__name__}: {err})"
    report["figures"] = list(figures.values())
    if note:
        report["note"] = note
    text = format_markdown(report, figures)
    if note:
        text += f"\n_{note}._\n"
    write_file(out / "report.md", text)
    write_file(out / "report.json", as_json(report))
    written = [out / "report.md", out / "report.json"]
    written += [out / f for f in figures.values()]
    return report, text, written
