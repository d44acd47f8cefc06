"""Is B better than A? The groups of a report, each compared with a baseline, seed by seed
and evaluation sample by sample.

Every random draw here is keyed by the seed: two configs run with the same seed share their
initialisation (when the architecture is the same), sample order, augmentation and dropout
masks. The per-seed differences cancel that shared noise, so a **paired** comparison over the
seeds both groups finished (a t-test on the differences) is sharper than two means side by
side -- by how much, the pairs' correlation says. Where fewer than two seeds are common to
both, the groups are compared unpaired (Welch's t-test). Cross-validated groups
(``data.fold``) pair a job with the other group's job of the same seed *and* fold.

The seeds are one source of uncertainty; **which samples were annotated** is the other. For
the headline, where every job compared has its per-sample scores
(:mod:`repro.records.sample_records`), the interval that decides the verdict is the two-level
one (:func:`repro.tools.stats.two_level`, paired; :func:`repro.tools.stats.two_level_unpaired`
for configs that ran other seeds: seeds and evaluation samples, matched by name, a crossed
decomposition that counts the seed-by-sample noise once; folds as strata), and the report
says which source dominates; else the seeds' t interval decides, and the report says so.

The verdict is one of: better / worse (the deciding interval excludes 0; with a smallest
effect of interest δ, ``--sesoi``, whether by more than δ), equivalent within ±δ (two
one-sided tests: the 90% interval inside ±δ), or can't tell -- with the seeds a δ needs, or
without δ the smallest difference these seeds resolve. Several groups against one baseline
are corrected for multiple comparisons (Holm). A seed whose run collapsed is named as such
and left out of the interval (a failure is counted, not averaged). Below 3 seeds a config,
or for cross-validated configs that cannot be paired, there is no test: the report says
why and how many seeds the spread needs. Beside every verdict: the medians, interquartile
means, and P(B > A) on a seed with its exact interval, and the per-seed values' shape
where a normal one is rejected. The config keys in which the groups differ are listed from their
resolved configs (a list, such as a pipeline's transforms, by what was added, removed or
changed where), and a comparison across environments (GPU, torch, the CPU's instruction set)
is labelled as one: there, the same seed no longer means the same bits. The statistics are
in :mod:`repro.tools.stats`; docs/tools.md explains how to read them.
"""

from __future__ import annotations

import difflib
import math
import shlex
import statistics
from pathlib import Path
from typing import Any

from repro.base.errors import ReproError
from repro.base.files import load_yaml, save_figure
from repro.defense.config import RELEVANT_ENVIRONMENT, RELEVANT_ON_CPU, RUN_CONTROL, flatten
from repro.tools import stats

# Config keys that say where a run wrote and logged, or how runs are judged, not what it
# computed (and the pooled seed and fold).
NOT_LISTED = ("seed", "data.fold", *RUN_CONTROL, "paths", "logger", "report")
_MAX_KEYS = 8  # config differences listed per comparison in report.md (all in report.json)


def compare_groups(
    groups: list[dict[str, Any]],
    members: list[list[Any]],
    baseline: str | None = None,
    metrics: list[str] | None = None,
    sesoi: float | None = None,
    aggregates: bool = True,
) -> dict[str, Any]:
    """``{"baseline": title, "comparisons": [...]}`` for a report's ``groups`` (and the
    :class:`repro.tools.report.Job` objects of each, in ``members``): every other group against
    the ``baseline`` group (a title, or overrides and directories that name one group; the
    first group without it) on the baseline's headline metric and ``metrics``. ``sesoi``:
    the smallest effect of interest δ of the headline (else the baseline's config's
    ``report.sesoi``, if any). ``aggregates``: also the bootstrap intervals of the medians,
    IQMs and P(B > A) over seeds x samples (which describe, and decide nothing)."""
    if len(groups) < 2:
        if baseline:
            raise ReproError(
                f"--baseline {baseline!r}: the report has one group, nothing to compare."
            )
        return {"comparisons": []}
    b = pick_baseline(groups, baseline)
    names = list(groups[b]["metrics"])
    headline = groups[b]["headline"]
    wanted = [headline]
    for m in metrics or []:
        chosen = names if m == "all" else [m]
        if m != "all" and m not in names:
            raise ReproError(
                f"--metric {m}: not a metric of the baseline's jobs; give one of "
                f"{', '.join(names)} (or all)."
            )
        wanted += [c for c in chosen if c not in wanted]
    out: dict[str, Any] = {"baseline": groups[b]["title"], "comparisons": []}
    finished = [sum(j["status"] == "ok" for j in g["jobs"]) for g in groups]
    if len(groups) > 2 and max(finished) <= 1:
        out["comparison_note"] = (
            "every group finished at most one seed, so there is no spread to compare with: "
            "run seeds (seed='range(0,5)'); for a search, re-run its top trials over fresh "
            "seeds: repro confirm SWEEP_DIR --top 3 --seeds 5"
        )
        return out
    delta, source = _sesoi(sesoi, members[b])
    out["sesoi"] = {"delta": delta, "source": source} if delta is not None else None
    for i, g in enumerate(groups):
        if i == b:
            continue
        environment = environment_differences(members[b], members[i])
        config = config_differences(members[b], members[i])
        for m in wanted:
            if m not in g["metrics"]:
                continue  # another task's group: it has no such metric
            c = compare(groups[b], g, m)
            c["environment_differs"] = environment
            c["config_differs"] = config
            if "loss" in m and any(k.startswith("task.") for k in config):
                c["caution"] = (
                    "the task's config differs, so its loss is another function: compare the "
                    "loss only between configs that define it the same way"
                )
            first = m == headline  # δ and the per-sample scores are the headline's
            judge(c, members[b], members[i], delta if first else None, first, aggregates)
            out["comparisons"].append(c)
    # every test the report makes is one family: each group against the baseline, on the
    # headline and on every metric asked for (--metric), Holm-corrected together
    family = [
        c
        for c in out["comparisons"]
        if c.get("decision")
        and not c["decision"].get("no_verdict")
        and _p(c["decision"]) is not None
    ]
    if len(family) > 1:
        adjusted = stats.holm([_p(c["decision"]) for c in family])
        equivalence = stats.holm([(c["decision"].get("tost") or {}).get("p_value") for c in family])
        for c, p, q in zip(family, adjusted, equivalence, strict=True):
            c["decision"]["holm"] = {"comparisons": len(family), "p_value": p, "tost_p_value": q}
    for c in out["comparisons"]:
        c["verdict"] = verdict(c)
        c["outcome"] = outcome(c)
        c["path"] = path(c)
    return out


def path(c: dict[str, Any]) -> str:
    """Which of the report's paths produced the verdict, in words (report.json's ``path``,
    the table's "decided by")."""
    d = c.get("decision") or {}
    if c.get("paired") and c.get("within_resolution"):
        return "the same to round-off (no test)"
    if not d:
        return "no test (no spread, or no value)"
    if d.get("few_seeds"):
        each = "(seed, fold) pairs" if c.get("by_fold") else "seeds a config"
        return f"no test (fewer than {stats.FEW_SEEDS} {each})"
    if d.get("no_verdict"):
        return "no test (cross-validated, unpaired)"
    if not c.get("paired"):
        if d.get("by") == "seeds and samples":
            return "seeds and samples, unpaired (two-level)"
        return "seeds, unpaired (Welch)"
    words = (
        "seeds and samples (two-level)"
        if d.get("by") == "seeds and samples"
        else ("seeds (paired t)")
    )
    if d.get("folds_corrected"):
        words += ", corrected for folds (Nadeau-Bengio)"
    if d.get("excluded"):
        words += ", collapsed seeds left out"
    return words


def _p(decision: dict[str, Any]) -> float | None:
    """The p-value a decision rests on."""
    return decision.get("p_value")


def _sesoi(given: float | None, base: list[Any]) -> tuple[float | None, str]:
    """δ and where it came from: ``--sesoi``, else ``report.sesoi`` of the baseline's
    resolved config (a preset sets it)."""
    if given is not None:
        if not (math.isfinite(given) and given > 0):
            raise ReproError(f"--sesoi {given}: give a positive difference, e.g. --sesoi 0.01.")
        return float(given), "--sesoi"
    config = _config(base)
    value = (config or {}).get("report.sesoi")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value), "report.sesoi of the baseline's config"
    return None, ""


def _job_key(job: Any) -> Any:
    """:func:`pair_key` of a :class:`repro.tools.report.Job`."""
    return job.seed if job.fold is None else (job.seed, job.fold)


def judge(
    c: dict[str, Any],
    base: list[Any],
    group: list[Any],
    delta: float | None = None,
    samples: bool = False,
    aggregates: bool = True,
) -> None:
    """Add to the comparison ``c`` what decides its verdict (``decision``): with
    ``samples`` (the headline), the two-level interval where every paired job has its
    per-sample scores, else the seeds';
    equivalence within ±``delta``; the seeds that collapsed (named, and left out of the
    interval); no test below :data:`repro.tools.stats.FEW_SEEDS` seeds; and the medians,
    IQMs, P(B > A) and the values' shape (:func:`_distribution`)."""
    from repro.records.sample_records import SampleScores

    seeds = c.get("seeds") or []
    ok: dict[str, dict[Any, Any]] = {"baseline": {}, "group": {}}
    for side, jobs in (("baseline", base), ("group", group)):
        for j in jobs:  # the job per_seed counted: the first finished one with a finite value
            value = j.summary.get(c["metric"]) if j.status == "ok" else None
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if number and math.isfinite(value):
                ok[side].setdefault(_job_key(j), j)
    c["collapsed"] = [
        {"side": side, **_key_fields(_job_key(j)), "job": j.dir.name, "why": j.collapsed}
        for side, jobs in (("baseline", base), ("group", group))
        for j in sorted(jobs, key=lambda j: seed_order(_job_key(j)))
        if j.status == "ok"
        and getattr(j, "collapsed", None)
        and (not c["paired"] or _job_key(j) in seeds)
    ]
    if "mean_diff" not in c or "ci95" not in c:
        return
    seeds, a, b, basic, out = _without_collapsed(c, ok, seeds)
    decision: dict[str, Any] = {"by": "seeds"}
    if out:
        decision["excluded"] = len(out)
        decision["seeds_only"] = {
            k: basic.get(k) for k in ("mean_diff", "ci95", "p_value", "se", "df", "sd_diff")
        }
    fewest = len(seeds) if c["paired"] else min(len(a), len(b))
    strata: list[Any] | str = []
    if samples and fewest >= 2 and (c["paired"] or not c.get("by_fold")):
        # other seeds but the same samples (unpaired): the samples' part is still there
        strata = _strata(seeds, ok, c["paired"], SampleScores)
        if isinstance(strata, str):
            decision["why_seeds_only"] = strata
        else:
            c["two_level"] = (
                stats.two_level(strata)
                if c["paired"]
                else stats.two_level_unpaired(strata[0].baseline, strata[0].group)
            )
            decision["by"] = "seeds and samples"
    source = c["two_level"] if decision["by"] == "seeds and samples" else basic
    decision.update({k: source.get(k) for k in ("mean_diff", "ci95", "p_value", "se", "df")})
    decision["n"] = [len(a), len(b)] if not c["paired"] else len(seeds)
    _correct_for_folds(c, decision, seeds)
    se, df = decision["se"], decision["df"]
    sd = basic.get("sd_diff")
    fixed = (c.get("two_level") or {}).get("sample_var", 0.0)
    images = min((c.get("two_level") or {}).get("samples") or [0]) or None
    if se:
        decision["resolvable"] = stats.resolvable(se, df)
    if delta is not None:
        decision["sesoi"] = delta
        if se:  # no spread: nothing to test equivalence against
            decision["tost"] = stats.tost(decision["mean_diff"], se, df, delta)
        if sd is not None:
            decision["seeds_needed"] = stats.seeds_needed(delta, sd, c["paired"], fixed, images)
            decision["samples_limit"] = stats.samples_limit(delta, fixed)
    if fewest < stats.FEW_SEEDS:  # the seeds the observed spread needs
        mean = decision.get("mean_diff")
        target = delta if delta is not None else (abs(mean) if mean is not None else None)
        needed = (
            stats.seeds_needed(target, sd, c["paired"], fixed, images) if sd and target else None
        )
        decision["few_seeds"] = {"seeds": fewest, "target": target, "seeds_needed": needed}
    _no_test(c, decision, fewest, len(out))
    decision["signs"] = basic.get("signs")
    decision["distribution"] = _distribution(a, b, c["paired"])
    if aggregates and decision["by"] == "seeds and samples" and not c.get("by_fold"):
        (one,) = strata  # the tables the two-level interval used
        decision["distribution"]["aggregates"] = stats.robust_aggregates(
            one.baseline, one.group, paired=c["paired"]
        )
    c["decision"] = decision


def _without_collapsed(
    c: dict[str, Any], ok: dict[str, dict[Any, Any]], seeds: list[Any]
) -> tuple[list[Any], list[float], list[float], dict[str, Any], set[Any]]:
    """Leave the collapsed jobs (named in ``c["collapsed"]``) out of ``ok``: a collapse is a
    failure, counted as one, not a value that swamps a mean (nor a reason to drop the
    evaluation samples). The pairs left (paired), each side's values, the seeds' test of
    those (``c`` itself where nothing collapsed), and the ``(side, key)`` left out."""
    out = {
        (x["side"], (x["seed"], x["fold"]) if "fold" in x else x["seed"]) for x in c["collapsed"]
    }
    for side in ok:
        ok[side] = {k: j for k, j in ok[side].items() if (side, k) not in out}
    if c["paired"]:
        seeds = [k for k in seeds if k in ok["baseline"] and k in ok["group"]]
        a = [ok["baseline"][k].summary[c["metric"]] for k in seeds]
        b = [ok["group"][k].summary[c["metric"]] for k in seeds]
        return seeds, a, b, (stats.paired(a, b) if out else c), out
    a = [j.summary[c["metric"]] for j in ok["baseline"].values()]
    b = [j.summary[c["metric"]] for j in ok["group"].values()]
    return seeds, a, b, (stats.welch(a, b) if out else c), out


def _no_test(c: dict[str, Any], decision: dict[str, Any], fewest: int, excluded: int) -> None:
    """Where the report makes no test, say why (``no_verdict``) and drop the interval:
    fewer than :data:`repro.tools.stats.FEW_SEEDS` seeds a config (its error rates are not
    held there), or cross-validated configs that cannot be paired (no correction for the
    folds' shared training files applies)."""
    if fewest < stats.FEW_SEEDS:
        each = "(seed, fold) pairs" if c.get("by_fold") else "seeds a config"
        left = f" left once the {excluded} collapsed jobs are out" if excluded else ""
        decision["no_verdict"] = (
            f"{fewest} {each}{left}, fewer than {stats.FEW_SEEDS}: a test's error rates are "
            "not held there (with 2, one squared difference is its whole variance estimate)"
        )
    elif c.get("by_fold") and not decision.get("folds_corrected") and not c["paired"]:
        decision["no_verdict"] = (
            "cross-validated configs that share fewer than 2 (seed, fold) pairs: the folds' "
            "shared training files make an unpaired interval too narrow, and no correction "
            "applies; run both configs on the same seeds and folds"
        )
    if decision.get("no_verdict"):
        for k in ("ci95", "p_value", "tost", "resolvable"):
            decision.pop(k, None)


def _distribution(a: list[float], b: list[float], paired: bool) -> dict[str, Any]:
    """What a reviewer asks for beside the mean's interval: each side's median and
    interquartile mean over its seeds, the per-seed values' shape (Shapiro-Wilk), and, paired,
    the median difference and P(B > A) on a seed with its exact interval."""
    out: dict[str, Any] = {
        "baseline_median": statistics.median(a) if a else None,
        "group_median": statistics.median(b) if b else None,
        "baseline_iqm": stats.iqm(a) if a else None,
        "group_iqm": stats.iqm(b) if b else None,
    }
    named = [("the baseline's values", a), ("the group's values", b)]
    if paired:
        diffs = [y - x for x, y in zip(a, b, strict=True)]
        named.append(("the differences", diffs))
        out["median_diff"] = statistics.median(diffs) if diffs else None
        out["improvement"] = stats.improvement(a, b)
    out["shape"] = [f"{name}: {why}" for name, values in named if (why := stats.shape(values))]
    return out


def _correct_for_folds(c: dict[str, Any], decision: dict[str, Any], seeds: list[Any]) -> None:
    """Cross-validated jobs paired by (seed, fold): the folds share training files, so the
    pairs are not independent and the deciding interval is the corrected resampled t-test
    (:func:`repro.tools.stats.fold_corrected`) on the pairs' differences. Each fold
    validates on its own samples, so the pairs' spread already holds the samples' part:
    none is added (a stratified samples' part would count it twice). ``folds_corrected``
    records the fold count and the factor the variance grew by."""
    folds = len({k[1] for k in seeds if isinstance(k, tuple)})
    if not c.get("by_fold") or folds < 2 or not decision.get("se"):
        return
    level = c.get("two_level") if decision["by"] == "seeds and samples" else None
    pairs_var = level["pairs_var"] if level else decision["se"] ** 2
    got = stats.fold_corrected(decision["mean_diff"], pairs_var, len(seeds), folds)
    decision.update({k: got[k] for k in ("ci95", "p_value", "se", "df")})
    decision["folds_corrected"] = {"folds": folds, "factor": got["factor"]}


def score_tables(
    jobs: list[tuple[str, Any, Any]], kind: type, others: str
) -> tuple[Any, Any] | str:
    """The per-sample scores of ``jobs`` (``(side, key, job)``) as two arrays ``seeds x
    samples x components``, the baseline's and the group's, samples matched by name; or
    why they cannot be used (a job without them, or one that scored other samples than
    ``others``)."""
    import numpy as np

    names = columns = None
    tables: dict[str, list[Any]] = {"baseline": [], "group": []}
    for side, k, job in jobs:
        scores = getattr(job, "scores", None)
        if not isinstance(scores, kind):
            why = scores if isinstance(scores, str) else "no per-sample scores"
            return f"{job.dir.name} (the {side}'s seed {_key_text(k)}): {why}"
        if names is None:
            names, columns = sorted(scores.names), scores.columns
        elif sorted(scores.names) != names or scores.columns != columns:
            return (
                f"{job.dir.name} (the {side}'s seed {_key_text(k)}) scored other samples (or "
                f"classes) than {others}"
            )
        row = dict(zip(scores.names, scores.values, strict=True))
        tables[side].append([row[n] for n in names])
    return np.array(tables["baseline"], float), np.array(tables["group"], float)


def _strata(
    seeds: list[Any], ok: dict[str, dict[Any, Any]], paired: bool, kind: type
) -> list[Any] | str:
    """The per-sample score tables of the jobs compared, as
    :class:`repro.tools.stats.Stratum` objects: paired, one a fold of the paired ``seeds``
    (one in all without folds); unpaired (configs that ran other seeds), one of every
    finished job of each side. Or why the per-sample scores cannot be used."""
    if not paired:
        if not ok["baseline"] or not ok["group"]:
            return "a side has no finished job"
        jobs = [
            (side, k, job)
            for side in ("baseline", "group")
            for k, job in sorted(ok[side].items(), key=lambda kv: seed_order(kv[0]))
        ]
        tables = score_tables(jobs, kind, "the other jobs compared")
        return tables if isinstance(tables, str) else [stats.Stratum(*tables)]
    by_fold: dict[Any, list[Any]] = {}
    for k in seeds:
        by_fold.setdefault(k[1] if isinstance(k, tuple) else None, []).append(k)
    built = []
    for keys in by_fold.values():
        jobs = [(side, k, ok[side][k]) for k in keys for side in ("baseline", "group")]
        tables = score_tables(jobs, kind, "the other jobs of its fold")
        if isinstance(tables, str):
            return tables
        built.append(stats.Stratum(*tables))
    return built


def _key_text(key: Any) -> str:
    return f"{key[0]}, fold {key[1]}" if isinstance(key, tuple) else str(key)


def pick_baseline(groups: list[dict[str, Any]], spec: str | None) -> int:
    """The index of the group ``spec`` names: its title, or overrides (and directories) that
    only it has. No spec: the first group."""
    if not spec:
        return 0
    tokens = shlex.split(spec)

    def names(g: dict[str, Any], token: str) -> bool:
        if token in g["overrides"] or token in (g["label"], g["source"]):
            return True
        return Path(token).resolve() == Path(g["source"]).resolve()

    found = [i for i, g in enumerate(groups) if g["title"] == spec]
    found = found or [i for i, g in enumerate(groups) if all(names(g, t) for t in tokens)]
    titles = ", ".join(repr(g["title"] or g["label"]) for g in groups)
    if not found:
        raise ReproError(f"--baseline {spec!r} names no group; the groups: {titles}.")
    if len(found) > 1:
        raise ReproError(
            f"--baseline {spec!r} names {len(found)} groups ("
            + ", ".join(repr(groups[i]["title"]) for i in found)
            + "); add the override (or directory) that tells them apart."
        )
    return found[0]


def pair_key(job: dict[str, Any]) -> Any:
    """What pairs a job with the other group's: its seed, or ``(seed, fold)`` for a
    cross-validated job (the same seed on another fold trains on other files)."""
    return job["seed"] if job.get("fold") is None else (job["seed"], job["fold"])


def _key_fields(key: Any) -> dict[str, Any]:
    """A :func:`pair_key` as the ``seed`` (and ``fold``) entries of a left-out record."""
    return {"seed": key[0], "fold": key[1]} if isinstance(key, tuple) else {"seed": key}


def per_seed(group: dict[str, Any], metric: str) -> tuple[dict[Any, float], list[dict[str, Any]]]:
    """The metric's finite value of each finished seed (each ``(seed, fold)`` of a
    cross-validated group: :func:`pair_key`), and the jobs left out (and why)."""
    values: dict[Any, float] = {}
    left_out = []
    for j in group["jobs"]:
        v = j.get(metric)
        key = pair_key(j)
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        if j["status"] == "ok" and number and math.isfinite(v):
            if key in values:  # the group ran this seed twice (two directories' jobs)
                what = "seed and fold" if isinstance(key, tuple) else "seed"
                left_out.append(
                    {**_key_fields(key), "job": j["job"], "why": f"a second job of this {what}"}
                )
                continue
            values[key] = float(v)
        else:
            why = j["status"] if j["status"] != "ok" else f"{metric} is {v}"
            left_out.append({**_key_fields(key), "job": j["job"], "why": why})
    return values, left_out


def seed_order(seed: Any) -> tuple[Any, ...]:
    """Seeds in order: the integers by value, then the rest by name; ``(seed, fold)`` pairs
    by seed, then fold."""
    if isinstance(seed, tuple):
        return (*seed_order(seed[0]), seed[1])
    return (0, seed) if isinstance(seed, int) else (1, str(seed))


def compare(base: dict[str, Any], group: dict[str, Any], metric: str) -> dict[str, Any]:
    """``group`` against ``base`` on ``metric``: paired over their common finished seeds
    (``(seed, fold)`` pairs when cross-validated; two or more), else Welch's test; the other
    test's interval alongside, for contrast."""
    a, a_out = per_seed(base, metric)
    b, b_out = per_seed(group, metric)
    common = sorted(set(a) & set(b), key=seed_order)
    unpaired = stats.welch(list(a.values()), list(b.values()))
    if len(common) >= 2:
        result = stats.paired([a[s] for s in common], [b[s] for s in common])
        result["seeds"] = common
        result["welch"] = {k: unpaired.get(k) for k in ("mean_diff", "ci95", "p_value", "df")}
    else:
        result = unpaired
    weights = {
        side: {pair_key(j): j.get("weights_sha256") for j in g["jobs"] if j["status"] == "ok"}
        for side, g in (("baseline", base), ("group", group))
    }
    by_fold = any(isinstance(k, tuple) for k in (*a, *b))
    also = " and fold" if by_fold else ""
    out = {
        "baseline": base["title"],
        "group": group["title"],
        "metric": metric,
        "higher_is_better": _higher_is_better(base, metric),
        "by_fold": by_fold,
        **result,
        "n": len(common) if result["paired"] else len(a) + len(b),
        "n_baseline": len(a),
        "n_group": len(b),
        "same_weights": sum(
            weights["baseline"].get(s) is not None
            and weights["baseline"].get(s) == weights["group"].get(s)
            for s in common
        ),
        "left_out": [
            *({"side": "baseline", **x} for x in a_out),
            *({"side": "group", **x} for x in b_out),
            *(
                {
                    "side": "baseline",
                    **_key_fields(s),
                    "why": f"no finished job of the group has this seed{also}",
                }
                for s in sorted(set(a) - set(b), key=seed_order)
                if result["paired"]
            ),
            *(
                {
                    "side": "group",
                    **_key_fields(s),
                    "why": f"no finished job of the baseline has this seed{also}",
                }
                for s in sorted(set(b) - set(a), key=seed_order)
                if result["paired"]
            ),
        ],
    }
    return out


def _higher_is_better(group: dict[str, Any], metric: str) -> bool | None:
    """Which way is better: the task says (``metric_directions`` in its summary.json:
    :meth:`repro.components.tasks.Task.higher_is_better_for`); a run from before that
    record: the headline's ``higher_is_better``, a loss better lower, others unknown."""
    declared = group.get("metric_directions") or {}
    if isinstance(declared.get(metric), bool):
        return declared[metric]
    if metric == group["headline"] and group.get("higher_is_better") is not None:
        return bool(group["higher_is_better"])
    return False if "loss" in metric else None


def _decimals(*values: float) -> int:
    """Enough decimals to show the smallest of ``values`` (nonzero) with 2 significant digits."""
    small = min((abs(v) for v in values if v and math.isfinite(v)), default=1.0)
    return min(8, max(3, 1 - math.floor(math.log10(small))))


def outcome(c: dict[str, Any]) -> str:
    """The verdict's kind: ``better`` or ``worse`` (``higher``/``lower`` where no direction is
    known), each ``... by more than δ`` where the interval clears ±δ; ``equivalent``;
    ``same`` (the same value for every seed); or ``can't tell``. The rules of
    :func:`verdict`."""
    d = c.get("decision")
    if c.get("paired") and c.get("within_resolution"):  # round-off apart: no test
        return "same"
    if "mean_diff" not in c or "ci95" not in c or not d:
        return "can't tell"
    if c["paired"] and c["mean_diff"] == 0 and c.get("sd_diff") == 0:
        return "same"
    better = c.get("higher_is_better")

    def kind(up: bool) -> str:
        if better is None or c.get("caution"):
            return "higher" if up else "lower"
        return "better" if up == better else "worse"

    if d.get("no_verdict"):
        return "can't tell"
    if d.get("p_value") is None:
        return "can't tell"
    holm = d.get("holm") or {}
    tost = d.get("tost")
    tost_p = holm.get("tost_p_value", (tost or {}).get("p_value"))
    if tost and tost_p is not None and tost_p < stats.ALPHA:
        return "equivalent"
    p = holm.get("p_value", d.get("p_value"))
    if p is not None and p < stats.ALPHA:
        lo, hi = d["ci95"]
        delta = d.get("sesoi")
        beyond = delta is not None and (lo > delta or hi < -delta)
        return kind(d["mean_diff"] > 0) + (" by more than δ" if beyond else "")
    return "can't tell"


def _unresolved(c: dict[str, Any], decision: dict[str, Any], places: int) -> str:
    """What a "can't tell" needs: seeds for ±δ, or the difference these seeds resolve."""
    delta = decision.get("sesoi")
    if delta is not None:
        n = decision.get("seeds_needed")
        each = "seeds (each run with both configs)" if c["paired"] else "seeds of each config"
        if c.get("by_fold"):
            each = "(seed, fold) pairs"
        if decision.get("samples_limit"):
            more = (
                f"more seeds cannot resolve ±{delta:g} here: the evaluation samples' "
                "uncertainty alone is too large (more samples would)"
            )
        elif n is not None and n < stats.MAX_SEEDS:
            more = f"about {n} {each} would resolve ±{delta:g}"
        else:
            more = f"more than {stats.MAX_SEEDS} seeds would be needed to resolve ±{delta:g}"
        return f"with these seeds neither better by δ = {delta:g} nor equivalent within it; {more}"
    if decision.get("resolvable") is not None:
        return (
            f"these seeds resolve a difference of about {decision['resolvable']:.{places}g} "
            "(80% power); give the smallest difference that matters (--sesoi) to test "
            "equivalence"
        )
    return "no spread to judge by"


def _sources(c: dict[str, Any], decision: dict[str, Any]) -> str:
    """What the deciding interval covers, for the verdict: the seeds and how many samples
    (and each one's share of the variance), or why the seeds alone."""
    if decision["by"] == "seeds and samples":
        level = c["two_level"]
        shares = level.get("shares")
        text = f" x {'+'.join(map(str, level['samples']))} evaluation samples"
        if shares is not None:
            text += (
                f"; of the variance seeds {shares['seeds']:.0%}, samples {shares['samples']:.0%}, "
                f"seed x sample {shares['seed_x_sample']:.0%}"
            )
        return text
    if decision.get("why_seeds_only"):
        return f"; seeds only: {decision['why_seeds_only']}"
    return ""


def _fmt(value: float, places: int) -> str:
    return f"{value:.{places}f}"


def verdict(c: dict[str, Any]) -> str:
    """The comparison in one sentence: better, worse, equivalent within ±δ or can't tell
    (see the module docstring), and on what it rests."""
    seeds = "(seed, fold) pairs" if c.get("by_fold") else "seeds"
    n = (c.get("decision") or {}).get("n")
    if c["paired"]:
        how = f"paired over {c['n'] if n is None else n} {seeds}"
    else:
        na, nb = n or (c["n_baseline"], c["n_group"])
        how = f"unpaired, {na} and {nb} {seeds}"
    excluded = (c.get("decision") or {}).get("excluded")
    if excluded:
        how += f"; {excluded} collapsed job{'s' if excluded > 1 else ''} left out (named below)"
    folded = (c.get("decision") or {}).get("folds_corrected")
    if folded:
        how += (
            f"; widened for the {folded['folds']} folds' shared training files (corrected "
            f"resampled t-test, Nadeau and Bengio 2003: the seeds' part x {folded['factor']:.3g})"
        )
    prefix = "across environments: " if c.get("environment_differs") else ""
    if "mean_diff" not in c:
        side = "the baseline" if not c["n_baseline"] else "this group"
        return f"{prefix}can't tell: {side} has no finished seed with a value of {c['metric']}"
    if c["paired"] and c.get("within_resolution"):
        every = "every seed and fold" if c.get("by_fold") else "every seed"
        return (
            f"{prefix}the same {c['metric']} for {every}, to floating-point resolution "
            f"({how}; each differs by at most {stats.RESOLUTION_ULPS} units in the last place: "
            "round-off, not spread, so no test)"
        )
    if "ci95" not in c:
        return (
            f"{prefix}can't tell: {how}, no spread to judge by; run 3 or more seeds of each "
            "(seed='range(0,5)')"
        )
    d = c["mean_diff"]
    if c["paired"] and d == 0 and c.get("sd_diff") == 0:
        same = " and the same weights" if c["same_weights"] == c["n"] else ""
        every = "every seed and fold" if c.get("by_fold") else "every seed"
        return f"{prefix}the same {c['metric']} for {every} ({how}{same})"
    decision = c.get("decision") or {"by": "seeds", **c}
    if decision.get("no_verdict"):
        return _no_verdict(c, decision, prefix, how)
    if decision.get("p_value") is None and decision["by"] == "seeds":
        places = _decimals(d)
        return (
            f"{prefix}can't tell: {'higher' if d > 0 else 'lower'} by {abs(d):.{places}f} in "
            f"every seed ({how}), no spread to judge the next seed by; run more seeds"
        )
    better = c.get("higher_is_better")

    def word(up: bool) -> str:
        w = "higher" if up else "lower"
        if better is not None and not c.get("caution"):
            w += " (better)" if up == better else " (worse)"
        return w

    kind = outcome(c)  # the rules; the sentence below only words them
    return _worded(c, decision, kind, prefix, how, seeds, word)


def _no_verdict(c: dict[str, Any], decision: dict[str, Any], prefix: str, how: str) -> str:
    """The sentence where no test is made (``decision["no_verdict"]`` says why): the
    difference observed, and, with too few seeds, how many the observed spread needs for δ
    (else for the observed difference)."""
    mean = decision.get("mean_diff")
    observed = "none left" if mean is None else f"{mean:+.{_decimals(mean)}f}"
    text = (
        f"{prefix}can't tell, no test: {decision['no_verdict']}; observed difference "
        f"{observed} ({how})"
    )
    few = decision.get("few_seeds")
    if few and few["seeds_needed"] is not None:
        what = "δ" if decision.get("sesoi") is not None else "the observed difference"
        text += f"; about {few['seeds_needed']} seeds would resolve {what} at this spread"
    return text


def _worded(
    c: dict[str, Any],
    decision: dict[str, Any],
    kind: str,
    prefix: str,
    how: str,
    seeds: str,
    word: Any,
) -> str:
    """The verdict's sentence for the decided ``kind`` (see :func:`verdict`)."""
    mean = decision["mean_diff"]
    lo, hi = decision["ci95"]
    places = _decimals(mean, lo, hi)
    interval = f"[{_fmt(lo, places)}, {_fmt(hi, places)}]"
    holm = decision.get("holm")
    p = (holm or {}).get("p_value", decision.get("p_value"))
    how += _sources(c, decision)
    corrected = f"; Holm-corrected over {holm['comparisons']} comparisons" if holm else ""
    p_text = f"p = {p:.2g}{corrected}" if p is not None else "no spread"
    delta = decision.get("sesoi")
    if kind == "equivalent":
        a, b = decision["tost"]["ci90"]
        trivial = (
            f"; it differs from 0 ({p_text}), by less than δ"
            if p is not None and p < stats.ALPHA
            else ""
        )
        return (
            f"{prefix}equivalent within ±{delta:g}: the 90% interval [{_fmt(a, places)}, "
            f"{_fmt(b, places)}] lies inside ±{delta:g} (two one-sided tests; 95% interval "
            f"{interval}), {how}{trivial}"
        )
    sign = decision.get("signs")
    counted = (
        f"; higher in {sign['higher']} of {decision['n']} {seeds}, lower in {sign['lower']}"
        + (f", the same in {sign['same']}" if sign["same"] else "")
        + f" (sign test p = {sign['p_value']:.2g})"
        if sign
        else ""
    )
    if kind != "can't tell":  # better, worse, higher or lower (by more than δ)
        beyond = ""
        if delta is not None:
            beyond = (
                f", by more than δ = {delta:g}"
                if kind.endswith("by more than δ")
                else f", possibly by less than δ = {delta:g} (the interval reaches inside ±δ)"
            )
        return (
            f"{prefix}{word(mean > 0)} by {abs(mean):.{places}f} {interval}{beyond}, {how} "
            f"({p_text}){counted}"
        )
    size = _unresolved(c, decision, places)
    if lo > 0 or hi < 0:  # the raw interval excludes 0; Holm's correction does not
        spans = f"excludes 0, but not after Holm's correction ({how}, {p_text})"
    else:
        spans = f"spans 0 ({how}{f', {p_text}' if holm else ''})"
    return f"{prefix}can't tell: the interval {interval} {spans}; {size}{counted}"


def _first(jobs: list[Any], finished: bool = True) -> Any:
    done = [j for j in jobs if j.status == "ok"]
    return (done or ([] if finished else jobs) or [None])[0]


def _short(value: Any) -> str:
    text = str(value)
    if isinstance(value, list):
        text = f"{len(value)} entries"
    return text if len(text) <= 48 else text[:45] + "..."


def environment_differences(base: list[Any], group: list[Any]) -> list[str]:
    """``key: baseline's vs group's`` for the environment entries that decide the bits and
    differ between the two groups' first finished jobs (the device first)."""
    a, b = _first(base), _first(group)
    if a is None or b is None:
        return []
    out = []
    da, db = (str(j.summary.get("device", "")).split(":")[0] for j in (a, b))
    if da != db:
        out.append(f"device: {da} vs {db}")
    ea, eb = a.summary.get("environment") or {}, b.summary.get("environment") or {}
    keys = RELEVANT_ENVIRONMENT + (RELEVANT_ON_CPU if "cpu" in (da, db) else ())
    for key in keys:
        if key in ea and key in eb and ea[key] != eb[key]:
            out.append(f"{key}: {_short(ea[key])} vs {_short(eb[key])}")
    return out


def _config(jobs: list[Any]) -> dict[str, Any] | None:
    """The flattened resolved config (``.hydra/config.yaml``) of the first finished job of
    ``jobs`` that has one (else of any)."""
    for j in sorted(jobs, key=lambda j: j.status != "ok"):
        path = j.dir / ".hydra" / "config.yaml"
        if path.is_file():
            loaded = load_yaml(path)
            return flatten(loaded) if isinstance(loaded, dict) else None
    return None


def config_differences(base: list[Any], group: list[Any]) -> list[str]:
    """``key: baseline's -> group's`` for each key of the resolved configs (``.hydra/
    config.yaml`` of a job of each) that differs, less the seed and where runs wrote; a
    list (a pipeline's transforms) by what was added, removed or changed where
    (:func:`list_change`)."""
    a, b = _config(base), _config(group)
    if a is None or b is None:
        return []
    missing = "(absent)"
    out = []
    for k in sorted(set(a) | set(b)):
        if any(k == p or k.startswith(p + ".") for p in NOT_LISTED):
            continue
        x, y = a.get(k, missing), b.get(k, missing)
        if x == y:
            continue
        if isinstance(x, list) and isinstance(y, list):
            out.append(f"{k}: {list_change(x, y)}")
        else:
            out.append(f"{k}: {x} -> {y}")
    return out


def _entry(value: Any) -> str:
    """A list entry in words: a ``_target_`` by its class name (and settings), else its
    value."""
    if isinstance(value, dict) and "_target_" in value:
        name = str(value["_target_"]).rsplit(".", 1)[-1]
        rest = {k: v for k, v in value.items() if k != "_target_"}
        return name + (f"({', '.join(f'{k}={v}' for k, v in rest.items())})" if rest else "")
    return str(value)


def _name(value: Any) -> str:
    return (
        str(value["_target_"]).rsplit(".", 1)[-1]
        if isinstance(value, dict) and "_target_" in value
        else str(value)
    )


def list_change(old: list[Any], new: list[Any]) -> str:
    """What turned list ``old`` into ``new``, in words: "ElasticTransform added at position
    4" (positions count from 1, in the new list for additions, the old for removals);
    an entry whose settings changed, by the settings."""
    parts = []
    matcher = difflib.SequenceMatcher(a=[_entry(v) for v in old], b=[_entry(v) for v in new])
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            continue
        if op == "replace" and i2 - i1 == j2 - j1:
            for i, j in zip(range(i1, i2), range(j1, j2), strict=True):
                x, y = old[i], new[j]
                if _name(x) == _name(y) and isinstance(x, dict) and isinstance(y, dict):
                    keys = [k for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)]
                    changed = ", ".join(
                        f"{k} {x.get(k, '(absent)')} -> {y.get(k, '(absent)')}" for k in keys
                    )
                    parts.append(f"{_name(x)} at position {i + 1}: {changed}")
                else:
                    parts.append(f"{_entry(x)} at position {i + 1} replaced by {_entry(y)}")
            continue
        if op in ("delete", "replace"):
            parts += [f"{_entry(old[i])} removed from position {i + 1}" for i in range(i1, i2)]
        if op in ("insert", "replace"):
            parts += [f"{_entry(new[j])} added at position {j + 1}" for j in range(j1, j2)]
    return "; ".join(parts) or "the same entries"


def format_comparisons(report: dict[str, Any]) -> list[str]:
    """The report.md section: a table, then each comparison's verdict and what it left out."""
    if report.get("comparison_note"):
        note = report["comparison_note"]
        if len(report.get("dirs") or [1]) == 1:
            note = note.replace("SWEEP_DIR", shlex.quote(report["sweep_dir"]))
        return ["", "## Comparison", "", note[0].upper() + note[1:] + "."]
    comparisons = report.get("comparisons") or []
    if not comparisons:
        return []
    by = "by seed and fold" if any(c.get("by_fold") for c in comparisons) else "seed by seed"
    delta = report.get("sesoi") or {}
    smallest = (
        f" The smallest difference that matters: δ = {delta['delta']:g} ({delta['source']})."
        if delta
        else " No smallest difference that matters was given (--sesoi, report.sesoi)."
    )
    lines = [
        "",
        f"## Compared with `{report['baseline'] or 'the first group'}`, {by}",
        "",
        "Difference = group − baseline. The interval that decides (95%): over seeds *and* "
        "evaluation samples where every paired job has its per-sample scores (the paired "
        "two-level interval), else over seeds (a paired t-test; Welch's unpaired). "
        "Seeds only: the seeds' t interval (paired; Welch's unpaired), for contrast. r: the pairs' correlation (what "
        "pairing gains)." + smallest + " docs/tools.md#is-b-better-than-a says how to read it.",
        "",
        "| group | metric | n | difference | 95% CI | decided by | p | seeds-only 95% CI | r |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        d = c.get("decision") or {}
        ci = d.get("ci95") if d else c.get("ci95")  # none where no test is made
        # the paired t interval, or Welch's when unpaired; none where the report makes no test
        seeds_ci = None if d.get("no_verdict") else c.get("ci95")
        places = _decimals(*(v for v in [c.get("mean_diff"), *(ci or [])] if v))
        r = c.get("correlation")
        # the p the verdict rests on: Holm's, else the sign test's where a mean misleads
        p = ((d.get("holm") or {}).get("p_value", _p(d))) if d else c.get("p_value")
        by_what = c.get("path") or path(c)

        def fmt(v: Any, places: int = places) -> str:
            return "–" if v is None else f"{v:.{places}f}"

        lines.append(
            f"| {c['group']} | {c['metric']} | {_n(c)} | {fmt(d.get('mean_diff', c.get('mean_diff')))} | "
            + (f"[{fmt(ci[0])}, {fmt(ci[1])}]" if ci else "–")
            + f" | {by_what} | {'–' if p is None else format(p, '.2g')} | "
            + (f"[{fmt(seeds_ci[0])}, {fmt(seeds_ci[1])}]" if seeds_ci else "–")
            + " | "
            + ("–" if r is None else f"{r:.2f}")
            + " |"
        )
    lines.append("")
    for c in comparisons:
        lines.append(f"- **{c['group']}**, {c['metric']}: {c['verdict']}.")
        d = c.get("decision") or {}
        spread = d.get("distribution")
        if spread and spread["baseline_median"] is not None and spread["group_median"] is not None:
            line = (
                f"  - medians {spread['baseline_median']:.4f} (baseline) and "
                f"{spread['group_median']:.4f}; interquartile means {spread['baseline_iqm']:.4f} "
                f"and {spread['group_iqm']:.4f}"
            )
            imp = spread.get("improvement") or {}
            if imp.get("p") is not None:
                lo, hi = imp["ci95"]
                line += f"; P(B > A) on a seed {imp['p']:.2f} [{lo:.2f}, {hi:.2f}] (exact)"
            if spread["shape"]:
                line += "; " + "; ".join(spread["shape"]) + ": read the medians beside the mean"
            lines.append(line)
            lines += _aggregate_lines(spread.get("aggregates"))
        for x in c.get("collapsed") or []:
            fold = f" fold {x['fold']}" if x.get("fold") is not None else ""
            lines.append(
                f"  - **collapsed**: seed {x['seed']}{fold} of the {x['side']} ({x['job']}): {x['why']}"
            )
        if c.get("caution"):
            lines.append(f"  - **caution**: {c['caution']}")
        if c["environment_differs"]:
            lines.append("  - environments differ: " + "; ".join(c["environment_differs"]))
        keys = c["config_differs"]
        if keys:
            more = (
                f" (and {len(keys) - _MAX_KEYS} more in report.json)"
                if len(keys) > _MAX_KEYS
                else ""
            )
            lines.append("  - config: " + "; ".join(f"`{k}`" for k in keys[:_MAX_KEYS]) + more)
        for x in c["left_out"]:
            fold = f" fold {x['fold']}" if x.get("fold") is not None else ""
            lines.append(f"  - left out: seed {x['seed']}{fold} of the {x['side']} ({x['why']})")
    return lines


def _plot_seeds(left: Any, groups: list[dict[str, Any]], metric: str, by_fold: bool) -> None:
    """Each group's seed values of the headline on ``left``, lines joining a seed across
    groups, collapsed seeds as red crosses, the axis from 0 for a metric in [0, 1]."""
    by_seed: dict[Any, list[tuple[int, float]]] = {}
    everything: list[float] = []
    for x, g in enumerate(groups):
        values, _ = per_seed(g, metric)
        collapsed = {pair_key(j) for j in g["jobs"] if j.get("collapsed")}
        for seed, v in values.items():
            by_seed.setdefault(seed, []).append((x, v))
        everything += values.values()
        plain = [v for k, v in values.items() if k not in collapsed]
        fallen = [v for k, v in values.items() if k in collapsed]
        left.plot([x] * len(plain), plain, "o", ms=4, alpha=0.7, color="C0")
        if fallen:
            left.plot(
                [x] * len(fallen), fallen, "x", ms=8, mew=2, color="C3",
                label="collapsed seed" if x == 0 or not left.get_legend_handles_labels()[1] else None,
            )  # fmt: skip
    for points in by_seed.values():
        if len(points) > 1:
            left.plot(*zip(*points, strict=True), "-", color="gray", lw=0.7, alpha=0.5)
    if everything and 0 <= min(everything) and max(everything) <= 1:
        left.set_ylim(0, 1.02)
    left.set_xticks(range(len(groups)))
    left.set_xticklabels(
        [(g["title"] or g["label"]).replace(" ", "\n") for g in groups], fontsize=7
    )
    left.set_ylabel(metric)
    left.set_title(
        "each (seed, fold) pair (lines join one across groups)"
        if by_fold
        else "each seed (lines join a seed across groups)",
        fontsize=9,
    )
    left.grid(alpha=0.3, axis="y")
    if left.get_legend_handles_labels()[1]:
        left.legend(fontsize=7)


def _plot_profiles(
    ax: Any, profiles: list[tuple[dict[str, Any], dict[str, Any]]], metric: str
) -> None:
    """The performance profiles (``robust_aggregates``' ``profile``) on ``ax``: the
    baseline's once, each group's, each with its band."""
    for i, (c, prof) in enumerate(profiles):
        sides = (
            (("baseline", c["baseline"]), ("group", c["group"]))
            if i == 0
            else (("group", c["group"]),)
        )
        for side, title in sides:
            color = "black" if side == "baseline" else f"C{i}"
            ax.plot(prof["tau"], prof[side]["share"], color=color, lw=1.2, label=title[:40])
            lo, hi = prof[side]["ci95"]
            ax.fill_between(prof["tau"], lo, hi, color=color, alpha=0.15, lw=0)
    ax.set_xlabel(f"threshold τ (a sample's {metric})")
    ax.set_ylabel("share of (seed, sample) scores ≥ τ")
    ax.set_title("performance profile (95% band: seeds, samples)", fontsize=9)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _n(c: dict[str, Any]) -> str:
    """The table's n: the pairs (or each side's seeds) the deciding test used."""
    n = (c.get("decision") or {}).get("n", c["n"])
    return "+".join(map(str, n)) if isinstance(n, list) else str(n)


def _aggregate_lines(agg: dict[str, Any] | None) -> list[str]:
    """The median, IQM and P(B > A) over seeds x samples with their bootstrap intervals."""
    if not agg:
        return []

    def ci(entry: dict[str, Any], places: int = 4) -> str:
        if entry["ci95"] is None:
            return f"{entry['value']:.{places}f}"
        lo, hi = entry["ci95"]
        return f"{entry['value']:.{places}f} [{lo:.{places}f}, {hi:.{places}f}]"

    worst = max(
        (e["mc_error"] for e in agg.values() if isinstance(e, dict) and e.get("mc_error")),
        default=0.0,
    )
    return [
        f"  - over seeds x samples (each sample's score; bootstrap of seeds and samples together, "
        f"{agg['draws']} draws, Monte-Carlo error of an end ≤ {worst:.2g}): median "
        f"{ci(agg['baseline_median'])} → {ci(agg['group_median'])}, difference "
        f"{ci(agg['median_diff'])}; interquartile mean {ci(agg['baseline_iqm'])} → "
        f"{ci(agg['group_iqm'])}, difference {ci(agg['iqm_diff'])}; P(B > A) on a sample "
        f"{ci(agg['improvement'], 2)}"
    ]


def plot_comparison(report: dict[str, Any], out_dir: Path) -> str | None:
    """``comparison.png``, drawn to be read right. Left: each group's seed values of the
    headline, lines joining a seed across groups, collapsed seeds as red crosses, the axis
    from 0 for a metric in [0, 1] (so that a small difference looks small). Right: each
    group's per-seed differences from the baseline, the deciding 95% interval beside them,
    zero and ±δ marked. Third, where the headline's per-sample scores were compared: the
    performance profile -- the share of (seed, sample) scores at or above each threshold,
    each config with its 95% bootstrap band over seeds and samples."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comparisons = report.get("comparisons") or []
    if not comparisons:
        return None
    metric = comparisons[0]["metric"]
    shown = [c for c in comparisons if c["metric"] == metric]
    groups = [g for g in report["groups"] if metric in g["metrics"]]
    first = next(i for i, g in enumerate(groups) if g["title"] == report["baseline"])
    groups.insert(0, groups.pop(first))  # the baseline at the left
    profiles = [
        (c, agg["profile"])
        for c in shown
        if (agg := ((c.get("decision") or {}).get("distribution") or {}).get("aggregates"))
    ]
    width = max(8.0, 1.6 * (len(groups) + len(shown)) + 3) + (4.5 if profiles else 0.0)
    fig, axes = plt.subplots(1, 3 if profiles else 2, figsize=(width, 4.4))
    left, right = axes[0], axes[1]
    if profiles:
        _plot_profiles(axes[2], profiles, metric)
    by_fold = any(c.get("by_fold") for c in shown)
    _plot_seeds(left, groups, metric, by_fold)
    delta = (report.get("sesoi") or {}).get("delta")
    right.axhline(0, color="black", lw=1)
    if delta:
        right.axhspan(-delta, delta, color="C2", alpha=0.15, label=f"±δ = {delta:g}")
    for x, c in enumerate(shown):
        d = c.get("decision") or {}
        per = (c.get("two_level") or {}).get("per_seed")
        if per is None and c["paired"]:
            (base,) = [g for g in groups if g["title"] == c["baseline"]]
            (grp,) = [g for g in groups if g["title"] == c["group"]]
            a, b = per_seed(base, metric)[0], per_seed(grp, metric)[0]
            per = [b[k] - a[k] for k in c.get("seeds") or []]
        if per:
            right.plot([x] * len(per), per, "o", ms=4, alpha=0.7, color="C0")
        ci = d.get("ci95") if d else c.get("ci95")  # none where no test is made
        mean = d.get("mean_diff", c.get("mean_diff"))
        if ci and mean is not None:
            right.errorbar(
                x + 0.2, mean, yerr=[[mean - ci[0]], [ci[1] - mean]], fmt="s", color="black",
                ms=5, capsize=4, label="difference, 95% CI (deciding)" if x == 0 else None,
            )  # fmt: skip
    right.set_xticks(range(len(shown)))
    right.set_xticklabels(
        [c["group"].replace(" ", "\n") + "\n− baseline" for c in shown], fontsize=7
    )
    right.set_ylabel(f"{metric}, group − baseline")
    right.set_title(
        f"paired differences per {'(seed, fold) pair' if by_fold else 'seed'}; 0 and ±δ marked",
        fontsize=9,
    )
    right.grid(alpha=0.3, axis="y")
    if right.get_legend_handles_labels()[1]:
        right.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, out_dir / "comparison.png")
    plt.close(fig)
    return "comparison.png"
