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
(:mod:`repro.comparisons`).

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from repro.comparisons import compare_groups, format_comparisons, plot_comparison
from repro.config import RUN_CONTROL
from repro.errors import ReproError
from repro.files import ERROR_FILE, EVAL_FILE, METRICS_FILE, SUMMARY_FILE, finite_or_null
from repro.stats import mean_interval

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
    status: str  # ok | failed | incomplete | not started
    summary: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    source: int = 0  # which of the report's directories it came from
    fold: int | None = None  # data.fold of a cross-validated job (data.folds set), else None

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
        if self.status == NOT_STARTED:  # no directory to re-run from: its own command
            return "python train.py " + shlex.join(self.overrides)
        return f"repro rerun {self.dir}"


NOT_STARTED = "not started"


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


def _override_value(overrides: list[str], default: Any, key: str = "seed") -> Any:
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


def _job_status(job_dir: Path) -> tuple[str, dict[str, Any], str]:
    if (job_dir / SUMMARY_FILE).is_file():
        try:
            return "ok", json.loads((job_dir / SUMMARY_FILE).read_text()), ""
        except ValueError as err:  # UnicodeDecodeError included
            raise ReproError(
                f"{job_dir / SUMMARY_FILE}: not JSON ({err}); the file is damaged: "
                f"re-run the job (repro rerun {job_dir}) or move it out of the sweep."
            ) from None
    if (job_dir / ERROR_FILE).is_file():
        try:
            err = json.loads((job_dir / ERROR_FILE).read_text())
        except ValueError:
            return "failed", {}, f"{ERROR_FILE} is unreadable (cut short)"
        return "failed", {}, f"{err.get('type')}: {err.get('message')}"
    from repro.checkpoint import list_checkpoints  # torch: only for an unfinished job

    ckpts = list_checkpoints(job_dir)
    detail = (
        f"stopped after its step-{ckpts[0][0]} checkpoint: resume with trainer.resume=auto"
        if ckpts
        else "no summary: killed, still running, or never started"
    )
    return "incomplete", {}, detail


def load_yaml(
    path: Path, remedy: str = "fix it, or move its job directory out of the sweep"
) -> Any:
    """A YAML file as plain Python; one line naming it (and ``remedy``) if it is damaged."""
    try:
        return OmegaConf.to_container(OmegaConf.load(path))
    except Exception as err:  # yaml's parser and scanner errors, undecodable bytes
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ReproError(
            f"{path}: not valid YAML ({first}); the file is damaged: {remedy}."
        ) from None


def _job(job_dir: Path, num: int, source: int) -> Job | None:
    """The job a directory holds (None: not a run's directory)."""
    overrides_file = job_dir / ".hydra" / "overrides.yaml"
    if not overrides_file.is_file():
        return None
    overrides = [str(o) for o in load_yaml(overrides_file)]
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


def find_jobs(sweep_dir: Path, source: int = 0) -> list[Job]:
    """The jobs of a sweep's directory, the planned ones that never started included; or the
    one job of a run's directory."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise ReproError(f"{sweep_dir}: no such sweep directory.")
    alone = _job(sweep_dir, 0, source)  # `python train.py ...`'s run directory
    if alone is not None:
        return [alone]
    jobs = []
    for sub in sorted(p for p in sweep_dir.iterdir() if p.is_dir()):
        job = _job(sub, len(jobs), source)
        if job is not None:
            jobs.append(job)
    if not jobs:
        raise ReproError(
            f"{sweep_dir}: no job directories (with .hydra/overrides.yaml); give the directory "
            "of a `python train.py -m ...` sweep, e.g. multirun/<date>/<time>_<id>, or of a run."
        )
    started = {_what(j.overrides) for j in jobs}  # by what a job computes, not its folder
    default_seed = next((j.seed for j in jobs if j.seed is not None), None)
    default_fold = next((j.fold for j in jobs if j.fold is not None), None)
    for num, overrides in enumerate(planned_jobs(sweep_dir) or []):
        if _what(overrides) not in started:  # the sweep was stopped before this job
            seed = _override_value(overrides, default_seed)
            fold = _override_value(overrides, default_fold, "data.fold")
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
        if not isinstance(value, (int, float)) or not math.isfinite(value):
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
    """The training loss per step and ``metric`` per evaluation."""
    loss, evals = {}, {}
    if (job_dir / METRICS_FILE).is_file():
        with open(job_dir / METRICS_FILE) as f:
            loss = {int(r["step"]): float(r["loss"]) for r in csv.DictReader(f)}
    if (job_dir / EVAL_FILE).is_file():
        with open(job_dir / EVAL_FILE) as f:
            evals = {int(r["step"]): float(r[metric]) for r in csv.DictReader(f) if r.get(metric)}
    return loss, evals


def labels(dirs: list[Path]) -> list[str]:
    """The shortest trailing parts of the paths that tell the directories apart."""
    parts = [Path(d).resolve().parts for d in dirs]
    for k in range(1, max(len(p) for p in parts) + 1):
        names = ["/".join(p[-k:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [str(d) for d in dirs]  # the same directory twice


def build_report(
    dirs: Path | list[Path], baseline: str | None = None, metrics: list[str] | None = None
) -> dict[str, Any]:
    """The report of one sweep (or run) directory, or of several compared: the groups, their
    statistics, and each group compared with the ``baseline`` group (:mod:`repro.comparisons`)
    on the headline metric and ``metrics``."""
    dirs = [Path(d) for d in ([dirs] if isinstance(dirs, (str, Path)) else dirs)]
    jobs = [j for i, d in enumerate(dirs) for j in find_jobs(d, source=i)]
    dir_labels = labels(dirs)
    groups: dict[tuple[int, tuple[str, ...]], list[Job]] = {}
    for j in jobs:
        groups.setdefault((j.source, j.group), []).append(j)
    out_groups = []
    for (source, key), members in groups.items():  # in the order of their first job
        ok = [j for j in members if j.status == "ok"]
        metric_names = (ok or members)[0].metrics  # the group's task: headline first
        per_metric = {}
        for m in metric_names:
            values = [j.summary[m] for j in ok if isinstance(j.summary.get(m), (int, float))]
            values = [v for v in values if math.isfinite(v)]
            stats = mean_interval(values)
            stats["outliers"] = outliers(ok, m, stats)
            per_metric[m] = stats
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
                        **{m: j.summary.get(m) for m in (*metric_names, "steps", "weights_sha256")},
                        "rerun": j.rerun_command(),
                    }
                    for j in members
                ],
                "headline": metric_names[0],
                "higher_is_better": first.get("higher_is_better"),
                "metrics": per_metric,
                "distinct_weights": len({j.summary["weights_sha256"] for j in ok}),
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
    }
    report.update(compare_groups(out_groups, list(groups.values()), baseline, metrics))
    return report


def _num(x: Any, digits: int = 4) -> str:
    return f"{x:.{digits}f}" if isinstance(x, float) else ("–" if x is None else str(x))


def _seed_fold(entry: dict[str, Any]) -> str:
    """``seed 3``, or ``seed 3, fold 1`` for a cross-validated job."""
    fold = entry.get("fold")
    return f"seed {entry['seed']}" + (f", fold {fold}" if fold is not None else "")


def format_markdown(report: dict[str, Any], figures: dict[int, str]) -> str:
    counts = (
        f"{report['jobs']} jobs: {report['ok']} finished, {report['failed']} failed, "
        f"{report['incomplete']} incomplete"
    )
    if report.get("not_started"):  # the sweep was stopped before it started them all
        counts = counts.replace(" jobs: ", " jobs planned: ", 1)
        counts += f", {report['not_started']} never started"
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
            weights = f"`{j['weights_sha256'][:12]}`" if j["weights_sha256"] else "–"
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
                "independent: the intervals below, which treat them so, are too narrow "
                "(a corrected resampled t-test, Nadeau and Bengio 2003, would widen them).",
                "",
            ]
        for m, s in g["metrics"].items():
            if s["n"] == 0:
                lines.append(f"- **{m}**: no finished job.")
                continue
            if s["n"] == 1:
                lines.append(f"- **{m}**: {s['mean']:.4f} (n=1: no spread; run more seeds)")
                continue
            lines.append(
                f"- **{m}**: mean {s['mean']:.4f}, SD {s['sd']:.4f}, min {s['min']:.4f}, "
                f"max {s['max']:.4f}; 95% CI of the mean [{s['ci95'][0]:.4f}, "
                f"{s['ci95'][1]:.4f}] (Student t, n={s['n']}, df={s['df']}, t={s['t']:.3f})"
            )
            for o in s["outliers"]:
                lines.append(
                    f"  - {_seed_fold(o)} ({o['job']}): {o['value']:.4f} is {abs(o['z']):.1f} SD "
                    f"{'above' if o['z'] > 0 else 'below'} the mean"
                )
        problems = [j for j in g["jobs"] if j["status"] != "ok"]
        if problems:
            lines += ["", "Not in the statistics:"]
            lines += [
                f"- {j['job']} ({_seed_fold(j)}): {j['status']}: {j['error']}" for j in problems
            ]
        lines += [
            "",
            f"Distinct final weight digests: {g['distinct_weights']} of "
            f"{sum(j['status'] == 'ok' for j in g['jobs'])} finished jobs. Re-run one job alone "
            f"(same bits): `{g['jobs'][0]['rerun']}`.",
        ]
        if i in figures:
            lines += ["", f"![curves]({figures[i]})"]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], out_dir: Path) -> tuple[dict[int, str], str | None]:
    """One PNG per group: training loss and the headline metric of every seed, mean ± SD;
    with a comparison, ``comparison.png`` (:func:`repro.comparisons.plot_comparison`)."""
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
        fig.suptitle(g["title"] or "all jobs (only the seed varies)", fontsize=9)
        fig.tight_layout()
        name = "report.png" if len(report["groups"]) == 1 else f"report-{i}.png"
        fig.savefig(out_dir / name, dpi=110)
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
) -> tuple[dict[str, Any], str, list[Path]]:
    """Build the report and write report.md, report.json (and PNGs) into ``out``: by default
    the directory reported on, or for several a new ``reports/<date>_<time>`` here."""
    dirs = [Path(d) for d in ([dirs] if isinstance(dirs, (str, Path)) else dirs)]
    report = build_report(dirs, baseline, metrics)  # reads everything before writing a byte
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
    (out / "report.json").write_text(as_json(report))  # text first
    (out / "report.md").write_text(format_markdown(report, {}))
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
    (out / "report.md").write_text(text)
    (out / "report.json").write_text(as_json(report))
    written = [out / "report.md", out / "report.json"]
    written += [out / f for f in figures.values()]
    return report, text, written
