"""``repro confirm SWEEP_DIR --top 3 --seeds 5``: choose a search's winner on a distribution.

A hyperparameter search (``python train.py -m hparams_search=convnet``, Hydra's Optuna
sweeper) runs every trial at one seed, so the best of many trials is partly the luckiest
draw. This re-runs the ``top`` trials -- each an ordinary config, its overrides as the trial
recorded them, less the search's own -- over ``seeds`` fresh seeds (seeds the search did not
use), and reports them side by side with :mod:`repro.tools.report`: each trial compared with the
search's best, seed by seed. It works on any sweep whose jobs finished, not only a search's.
"""

from __future__ import annotations

import datetime as dt
import math
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from repro.base.errors import ReproError
from repro.base.files import OVERRIDES_FILE, hydra_quoted
from repro.defense.config import RUN_CONTROL, SEARCH_CONTROL, find_conf_dir
from repro.records.trust import check_received
from repro.tools.comparisons import seed_order
from repro.tools.report import (
    POOLED,
    Job,
    as_json,
    find_jobs,
    load_yaml,
    override_key,
    override_value,
    write_report,
)


@dataclass
class Trial:
    rank: int
    overrides: list[str]  # what the trial computes, less its seed and fold
    value: float  # its headline metric in the search (the mean over its seeds and folds)
    seeds: list[Any]  # the seeds it ran in the search
    job: Job
    folds: list[Any] = field(default_factory=list)  # the data.fold values it ran, if any


def _computes(o: str) -> bool:
    key = override_key(o)
    controls = (*POOLED, *RUN_CONTROL, *SEARCH_CONTROL)  # seeds and folds are replicates
    return not any(key == c or key.startswith(c + ".") for c in controls)


def _run_control(key: str) -> bool:
    """A config key that says how a run was launched (``trainer.resume=auto``), not what it
    computes."""
    return any(key == c or key.startswith(c + ".") for c in RUN_CONTROL)


def higher_is_better(sweep_dir: Path, jobs: list[Job]) -> bool:
    """Which way the headline is better: the task says (summary.json's
    ``metric_directions``, else its ``higher_is_better``), else the sweeper's
    ``direction``, else a loss is better lower."""
    for j in jobs:
        declared = (j.summary.get("metric_directions") or {}).get(j.summary.get("headline"))
        if isinstance(declared, bool):
            return declared
        if isinstance(j.summary.get("higher_is_better"), bool):
            return j.summary["higher_is_better"]
    multirun = sweep_dir / "multirun.yaml"
    if multirun.is_file():
        sweeper = ((load_yaml(multirun) or {}).get("hydra") or {}).get("sweeper") or {}
        if str(sweeper.get("direction", "")).lower().startswith("min"):
            return False
        if str(sweeper.get("direction", "")).lower().startswith("max"):
            return True
    headline = next((j.metrics[0] for j in jobs), "")
    return "loss" not in headline


def top_trials(sweep_dir: Path, top: int) -> tuple[list[Trial], list[Any], str]:
    """The ``top`` best distinct configs of a sweep's finished jobs, best first, by the
    headline metric (its mean over the seeds -- one seed in a search -- and the folds,
    ``data.fold``, a config ran: both are replicates), the seeds the sweep used, and the
    headline's name."""
    jobs = find_jobs(sweep_dir)
    done = [j for j in jobs if j.status == "ok"]
    if not done:
        raise ReproError(f"{sweep_dir}: no finished job to confirm; run the search first.")
    headline = done[0].metrics[0]
    better = higher_is_better(sweep_dir, done)
    configs: dict[tuple[str, ...], list[Job]] = {}
    for j in done:
        value = j.summary.get(headline)
        if isinstance(value, (int, float)) and math.isfinite(value):
            configs.setdefault(tuple(o for o in j.overrides if _computes(o)), []).append(j)
    means = {key: statistics.fmean(j.summary[headline] for j in js) for key, js in configs.items()}
    ranked = sorted(configs, key=lambda key: means[key], reverse=better)  # stable: ties by job
    trials = [
        Trial(
            i + 1, list(key), means[key], sorted({j.seed for j in configs[key]}, key=seed_order),
            configs[key][0], _folds(configs[key]),
        )
        for i, key in enumerate(ranked[:top])
    ]  # fmt: skip
    if not trials:
        raise ReproError(
            f"{sweep_dir}: no finished job has a finite {headline}; nothing to confirm."
        )
    seeds = sorted({j.seed for j in jobs if j.seed is not None}, key=seed_order)
    return trials, seeds, headline


def _folds(jobs: list[Job]) -> list[Any]:
    """The ``data.fold`` values a trial's jobs were launched with (a cross-validated search:
    the folds are replicates of one config, as the seeds are), in order."""
    folds = {override_value(j.overrides, None, "data.fold") for j in jobs}
    return sorted((f for f in folds if f is not None), key=seed_order)


def _fold_override(job: Job) -> list[str]:
    fold = override_value(job.overrides, None, "data.fold")
    return [] if fold is None else [f"data.fold={fold}"]


def check_the_config_repeats(trial: Trial, conf_dir: Path | None = None) -> None:
    """The trial's overrides without the search's (and its seed) must compose the config it
    ran (``.hydra/config.yaml``): a search preset that also set run keys, or a conf/ edited
    since, would have the re-runs train something else."""
    from omegaconf import OmegaConf

    from repro.defense.config import compose, flatten

    path = trial.job.dir / ".hydra" / "config.yaml"
    if not path.is_file():
        return
    cfg = compose(
        [*trial.overrides, f"seed={trial.job.seed}", *_fold_override(trial.job)], conf_dir
    )
    now = flatten(OmegaConf.to_container(cfg, resolve=False, enum_to_str=True))
    then = flatten(load_yaml(path))
    differ = sorted(
        k
        for k in set(now) | set(then)
        if now.get(k) != then.get(k) and not _run_control(k)  # how it ran, on both sides
    )
    if differ:
        raise ReproError(
            f"{trial.job.dir}: its overrides, less the search's, compose another config than it "
            f"ran ({', '.join(differ[:4])}{', ...' if len(differ) > 4 else ''}): a search preset "
            "(conf/hparams_search/) may set only hydra.sweeper, and conf/ must be as it was; "
            "move other keys into an experiment."
        )


def fresh_seeds(used: list[Any], count: int) -> list[int]:
    """The first ``count`` seeds 0, 1, 2, ... that the search did not use."""
    taken = {s for s in used if isinstance(s, int)}
    out: list[int] = []
    seed = 0
    while len(out) < count:
        if seed not in taken:
            out.append(seed)
        seed += 1
    return out


def confirm(
    sweep_dir: Path,
    top: int = 3,
    seeds: int = 5,
    out: Path | None = None,
    extra: list[str] | None = None,
    log: Callable[[str], None] = print,
    trust: bool = False,
    trust_loaders: list[str] | None = None,
    sesoi: float | None = None,
) -> tuple[dict[str, Any], str, list[Path]]:
    """Re-run the ``top`` trials of ``sweep_dir`` over ``seeds`` fresh seeds (one sweep a
    trial, ``out/trial-<rank>``, with ``extra`` overrides such as ``hydra/launcher=parallel``)
    and write their report to ``out``: each compared with rank 1, seed by seed, with the
    report's verdicts (``sesoi``: the smallest difference that matters, δ); rank 1 is
    confirmed when it beats every other trial by more than δ. A trial's
    overrides are checked first (:func:`repro.records.trust.check_received`; ``trust``,
    ``trust_loaders``: ``--trust``, ``--trust-loader``): a received sweep runs no code."""
    if top < 2:
        raise ReproError(f"--top {top}: give 2 or more (the trials to compare).")
    if seeds < 2:
        raise ReproError(f"--seeds {seeds}: give 2 or more (a distribution needs a spread).")
    sweep_dir = Path(sweep_dir)
    trials, used, headline = top_trials(sweep_dir, top)
    if len(trials) < 2:
        raise ReproError(f"{sweep_dir}: one distinct config finished; nothing to compare it with.")
    conf = find_conf_dir(received=sweep_dir)  # the checkout's: never one inside the sweep
    for t in trials:  # before anything is composed and built from them, or launched
        record = t.job.dir / OVERRIDES_FILE
        check_received(
            t.overrides, record, extra or [], trust=trust, loaders=trust_loaders or [],
            conf_dir=conf,
        )  # fmt: skip
    for t in trials:
        check_the_config_repeats(t, conf)
    chosen = fresh_seeds(used, seeds)
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out = Path(out) if out else sweep_dir / f"confirm_{stamp}"
    if out.exists() and any(out.iterdir()):
        raise ReproError(f"{out}: exists and is not empty; give another --out.")
    train_py = conf.parent / "train.py"
    log(
        f"confirming the top {len(trials)} of {sweep_dir} by {headline}, each over seeds "
        f"{','.join(map(str, chosen))} (the search used {','.join(map(str, used))}), into {out}"
    )
    dirs, failed = {}, 0
    for t in trials:
        trial_dir = out / f"trial-{t.rank}"
        cmd = [
            sys.executable,
            str(train_py),
            "-m",
            *t.overrides,
            f"seed={','.join(map(str, chosen))}",
            *([f"data.fold={','.join(map(str, t.folds))}"] if t.folds else []),
            f"hydra.sweep.dir={hydra_quoted(str(trial_dir))}",
            *(extra or []),
        ]
        log(
            f"trial {t.rank}/{len(trials)} ({headline} {t.value:.4f} at seed "
            f"{','.join(map(str, t.seeds))}): " + " ".join(cmd[1:])
        )
        proc = subprocess.run(cmd, stdout=sys.stderr)  # training output to stderr
        failed += proc.returncode != 0
        if trial_dir.is_dir():
            dirs[t.rank] = trial_dir
    if not dirs:
        raise ReproError(f"no trial ran (see the errors above); nothing written to {out}.")
    report, text, written = write_report(list(dirs.values()), out, sesoi=sesoi)
    report["search"] = {
        "sweep_dir": str(sweep_dir),
        "headline": headline,
        "higher_is_better": higher_is_better(sweep_dir, [t.job for t in trials]),
        "search_seeds": used,
        "seeds": chosen,
        "trials": [
            {
                "rank": t.rank,
                "overrides": t.overrides,
                "search_value": t.value,
                "dir": str(dirs[t.rank]) if t.rank in dirs else None,
            }
            for t in trials
        ],
    }
    report["search"]["winner"] = winner(report)
    report["search"]["confirmation"] = confirmation(report)
    text = summary_text(report, trials) + "\n" + text
    (out / "report.json").write_text(as_json(report))
    (out / "report.md").write_text(text)
    report["failed_launches"] = failed
    return report, text, written


def _stats(report: dict[str, Any], trial: dict[str, Any]) -> dict[str, Any]:
    """The headline's statistics of a trial's group in the confirmation."""
    headline = report["search"]["headline"]
    for g in report["groups"]:
        if trial["dir"] is not None and g["source"] == trial["dir"]:
            return g["metrics"].get(headline) or {}
    return {}


def winner(report: dict[str, Any]) -> dict[str, Any]:
    """The trial with the best mean over the fresh seeds."""
    better = report["search"]["higher_is_better"]
    means = []
    for t in report["search"]["trials"]:
        stats = _stats(report, t)
        if stats.get("n"):
            means.append((stats["mean"], t["rank"]))
    if not means:
        return {}
    best = (max if better else min)(m for m, _ in means)
    ranks = sorted(r for m, r in means if m == best)
    return {"rank": ranks[0], "mean": best, "tied": ranks[1:]}


def confirmation(report: dict[str, Any]) -> dict[str, Any]:
    """Whether the search's best-ranked trial that ran is confirmed: better than every other
    re-run trial (by more than δ where δ is given), by the report's verdicts on the
    headline; else which trials it is equivalent to, cannot be told apart from, or loses
    to. A comparison the report makes no test of (fewer than 3 seeds a trial) confirms
    nothing: it counts as can't tell."""
    headline = report["search"]["headline"]
    delta = (report.get("sesoi") or {}).get("delta")
    by_trial: dict[str, list[str]] = {
        "equivalent": [],
        "less than δ": [],
        "can't tell": [],
        "better": [],
    }
    for c in report.get("comparisons") or []:
        if c["metric"] != headline:
            continue
        kind = c.get("outcome", "can't tell")
        if (c.get("decision") or {}).get("no_verdict"):  # no test (too few seeds): not consumed
            kind = "can't tell"
        # the comparison is trial - best: the best is confirmed where the trial is worse
        if kind == "worse by more than δ" or (kind == "worse" and delta is None):
            continue
        if kind.startswith("worse"):
            by_trial["less than δ"].append(c["group"])  # worse, but maybe by less than δ
        elif kind in ("equivalent", "same"):
            by_trial["equivalent"].append(c["group"])
        elif kind.startswith("better"):
            by_trial["better"].append(c["group"])
        else:
            by_trial["can't tell"].append(c["group"])
    compared = [c for c in report.get("comparisons") or [] if c["metric"] == headline]
    confirmed = bool(compared) and not any(by_trial.values())
    return {"confirmed": confirmed, "baseline": report.get("baseline"), "delta": delta, **by_trial}


def summary_text(report: dict[str, Any], trials: list[Trial]) -> str:
    """The search's ranks against the fresh seeds', and the verdict, first in report.md."""
    s = report["search"]
    headline = s["headline"]
    lines = [
        f"# Confirming the top {len(trials)} trials of `{s['sweep_dir']}`",
        "",
        f"Each trial re-run over the seeds {', '.join(map(str, s['seeds']))}; the search ran "
        f"seed {', '.join(map(str, s['search_seeds']))}. `{headline}`, "
        f"{'higher' if s['higher_is_better'] else 'lower'} is better.",
        "",
        f"| search rank | trial | {headline} in the search | mean over the fresh seeds "
        "| 95% CI | n |",
        "|---|---|---|---|---|---|",
    ]
    common = [o for o in trials[0].overrides if all(o in t.overrides for t in trials)]
    for t, record in zip(trials, s["trials"], strict=True):
        st = _stats(report, record)
        ci = st.get("ci95")
        own = " ".join(o for o in t.overrides if o not in common)
        lines.append(
            f"| {t.rank} | {own or '(the defaults)'} | {t.value:.4f} | "
            + (f"{st['mean']:.4f}" if st.get("n") else "–")
            + " | "
            + (f"[{ci[0]:.4f}, {ci[1]:.4f}]" if ci else "–")
            + f" | {st.get('n', 0)} |"
        )
    w = s.get("winner") or {}
    if w:
        tied = "".join(f" (tied with rank {r})" for r in w.get("tied", []))
        lines += [
            "",
            f"**Best mean over the fresh seeds: search rank {w['rank']}**{tied}, "
            f"{w['mean']:.4f}. Each trial against the best-ranked one that ran, seed by seed:",
        ]
        for c in report.get("comparisons") or []:
            if c["metric"] == headline:
                lines.append(
                    f"- {c['group']} against {c['baseline']}: **{c.get('outcome')}**: "
                    f"{c['verdict']}."
                )
        lines += ["", confirmation_text(s.get("confirmation") or {})]
    return "\n".join(lines) + "\n"


def confirmation_text(k: dict[str, Any]) -> str:
    """The confirmation in one paragraph."""
    if not k:
        return ""
    by = f" by more than δ = {k['delta']:g}" if k.get("delta") is not None else ""
    if k["confirmed"]:
        return f"**Confirmed**: `{k['baseline']}` is better than every other trial{by}."
    parts = []
    for kind, words in (
        ("better", "does worse than"),
        ("equivalent", "is equivalent to" if k.get("delta") is not None else "gives the same as"),
        ("less than δ", "is better, but possibly by less than δ, than"),
        ("can't tell", "cannot be told apart from"),
    ):
        if k.get(kind):
            parts.append(f"{words} " + ", ".join(f"`{g}`" for g in k[kind]))
    no_delta = (
        "" if k.get("delta") is not None
        else " Give the smallest difference that matters (--sesoi) to test equivalence."
    )  # fmt: skip
    return f"**Not confirmed**: `{k['baseline']}` " + "; ".join(parts) + "." + no_delta
