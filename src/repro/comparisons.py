"""Is B better than A? The groups of a report, each compared with a baseline, seed by seed.

Every random draw here is keyed by the seed: two configs run with the same seed share their
initialisation (when the architecture is the same), sample order, augmentation and dropout
masks. The per-seed differences cancel that shared noise, so a **paired** comparison over the
seeds both groups finished (a t-test on the differences) is sharper than two means side by
side -- by how much, the pairs' correlation says. Where fewer than two seeds are common to
both, the groups are compared unpaired (Welch's t-test). The statistics are in
:mod:`repro.stats`; docs/tools.md explains how to read them. Cross-validated groups
(``data.fold``) pair a job with the other group's job of the same seed *and* fold: the same
training and validation files.

A verdict in words goes with each: "higher by 0.012 [0.004, 0.020], paired over 5 seeds", or
"can't tell: the interval spans 0; about N seeds would resolve a difference of this size at
this spread" (:func:`repro.stats.seeds_needed`). The config keys in which the groups differ
are listed from their resolved configs, and a comparison across environments (GPU, torch,
the CPU's instruction set) is labelled as one: there, the same seed no longer means the
same bits.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import Any

from repro import stats
from repro.config import RELEVANT_ENVIRONMENT, RELEVANT_ON_CPU, RUN_CONTROL, flatten
from repro.errors import ReproError

# Config keys that say where a run wrote and logged, not what it computed (and the pooled
# seed and fold).
NOT_LISTED = ("seed", "data.fold", *RUN_CONTROL, "paths", "logger")
_MAX_KEYS = 8  # config differences listed per comparison in report.md (all in report.json)


def compare_groups(
    groups: list[dict[str, Any]],
    members: list[list[Any]],
    baseline: str | None = None,
    metrics: list[str] | None = None,
) -> dict[str, Any]:
    """``{"baseline": title, "comparisons": [...]}`` for a report's ``groups`` (and the
    :class:`repro.report.Job` objects of each, in ``members``): every other group against
    the ``baseline`` group (a title, or overrides and directories that name one group; the
    first group without it) on the baseline's headline metric and ``metrics``."""
    if len(groups) < 2:
        if baseline:
            raise ReproError(
                f"--baseline {baseline!r}: the report has one group, nothing to compare."
            )
        return {"comparisons": []}
    b = pick_baseline(groups, baseline)
    names = list(groups[b]["metrics"])
    wanted = [groups[b]["headline"]]
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
            c["verdict"] = verdict(c)
            out["comparisons"].append(c)
    return out


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
    sd = out.get("sd_diff")
    out["seeds_needed"] = (
        stats.seeds_needed(out["mean_diff"], sd, out["paired"]) if sd is not None else None
    )
    return out


def _higher_is_better(group: dict[str, Any], metric: str) -> bool | None:
    """Which way is better: the task says for its headline; a loss is better lower."""
    if metric == group["headline"] and group.get("higher_is_better") is not None:
        return bool(group["higher_is_better"])
    return False if "loss" in metric else None


def _decimals(*values: float) -> int:
    """Enough decimals to show the smallest of ``values`` (nonzero) with 2 significant digits."""
    small = min((abs(v) for v in values if v and math.isfinite(v)), default=1.0)
    return min(8, max(3, 1 - math.floor(math.log10(small))))


def verdict(c: dict[str, Any]) -> str:
    """The comparison in one sentence."""
    seeds = "(seed, fold) pairs" if c.get("by_fold") else "seeds"
    how = (
        f"paired over {c['n']} {seeds}"
        if c["paired"]
        else f"unpaired (Welch), {c['n_baseline']} and {c['n_group']} {seeds}"
    )
    if c.get("by_fold"):
        how += "; folds share training files, so the interval is too narrow"
    prefix = "across environments: " if c.get("environment_differs") else ""
    if "mean_diff" not in c:
        side = "the baseline" if not c["n_baseline"] else "this group"
        return f"{prefix}can't tell: {side} has no finished seed with a value of {c['metric']}"
    if "ci95" not in c:
        return (
            f"{prefix}can't tell: {how}, no spread to judge by; run 2 or more seeds of each "
            "(seed='range(0,5)')"
        )
    d, (lo, hi) = c["mean_diff"], c["ci95"]
    if c["paired"] and d == 0 and c.get("sd_diff") == 0:
        same = " and the same weights" if c["same_weights"] == c["n"] else ""
        every = "every seed and fold" if c.get("by_fold") else "every seed"
        return f"{prefix}the same {c['metric']} for {every} ({how}{same})"
    if c.get("p_value") is None:  # the same nonzero difference in every seed: no spread
        places = _decimals(d)
        return (
            f"{prefix}can't tell: {'higher' if d > 0 else 'lower'} by {abs(d):.{places}f} in "
            f"every seed ({how}), no spread to judge the next seed by; run more seeds"
        )
    places = _decimals(d, lo, hi)
    interval = f"[{lo:.{places}f}, {hi:.{places}f}]"
    sign = c.get("signs")
    counted = (
        f"; higher in {sign['higher']} of {c['n']} {seeds}, lower in {sign['lower']}"
        + (f", the same in {sign['same']}" if sign["same"] else "")
        + f" (sign test p = {sign['p_value']:.2g})"
        if sign
        else ""
    )
    if lo > 0 or hi < 0:
        word = "higher" if d > 0 else "lower"
        better = c.get("higher_is_better")
        if better is not None and not c.get("caution"):
            word += " (better)" if (d > 0) == better else " (worse)"
        return (
            f"{prefix}{word} by {abs(d):.{places}f} {interval}, {how} "
            f"(p = {c['p_value']:.2g}){counted}"
        )
    n = c.get("seeds_needed")
    if n is None:
        size = "no difference in these seeds"
    elif n >= stats.MAX_SEEDS:
        size = (
            f"more than {stats.MAX_SEEDS} seeds would be needed to resolve a difference this small"
        )
    else:
        each = "seeds (each run with both configs)" if c["paired"] else "seeds of each config"
        size = f"about {n} {each} would resolve a difference of this size at this spread"
    return f"{prefix}can't tell: the interval {interval} spans 0 ({how}); {size}{counted}"


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


def config_differences(base: list[Any], group: list[Any]) -> list[str]:
    """``key: baseline's -> group's`` for each key of the resolved configs (``.hydra/
    config.yaml`` of a job of each) that differs, less the seed and where runs wrote."""
    from repro.report import load_yaml

    def config(jobs: list[Any]) -> dict[str, Any] | None:
        for j in sorted(jobs, key=lambda j: j.status != "ok"):
            path = j.dir / ".hydra" / "config.yaml"
            if path.is_file():
                loaded = load_yaml(path)
                return flatten(loaded) if isinstance(loaded, dict) else None
        return None

    a, b = config(base), config(group)
    if a is None or b is None:
        return []
    missing = "(absent)"
    return [
        f"{k}: {a.get(k, missing)} -> {b.get(k, missing)}"
        for k in sorted(set(a) | set(b))
        if not any(k == p or k.startswith(p + ".") for p in NOT_LISTED)
        and a.get(k, missing) != b.get(k, missing)
    ]


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
    lines = [
        "",
        f"## Compared with `{report['baseline'] or 'the first group'}`, {by}",
        "",
        "Difference = group − baseline. Paired: a t-test on the per-seed differences over the "
        "seeds both finished; unpaired: Welch's test. r: the pairs' correlation (what pairing "
        "gains). docs/tools.md#is-b-better-than-a says how to read it.",
        "",
        "| group | metric | n | paired | difference | 95% CI | p | r | unpaired 95% CI |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        places = _decimals(*(v for v in [c.get("mean_diff"), *(c.get("ci95") or [])] if v))
        ci = c.get("ci95")
        welch = (c.get("welch") or {}).get("ci95") if c["paired"] else None
        r = c.get("correlation")

        def fmt(v: Any, places: int = places) -> str:
            return "–" if v is None else f"{v:.{places}f}"

        lines.append(
            f"| {c['group']} | {c['metric']} | {c['n']} | {'yes' if c['paired'] else 'no'} | "
            f"{fmt(c.get('mean_diff'))} | "
            + (f"[{fmt(ci[0])}, {fmt(ci[1])}]" if ci else "–")
            + f" | {'–' if c.get('p_value') is None else format(c['p_value'], '.2g')} | "
            + ("–" if r is None else f"{r:.2f}")
            + " | "
            + (f"[{fmt(welch[0])}, {fmt(welch[1])}]" if welch else "–")
            + " |"
        )
    lines.append("")
    for c in comparisons:
        lines.append(f"- **{c['group']}**, {c['metric']}: {c['verdict']}.")
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


def plot_comparison(report: dict[str, Any], out_dir: Path) -> str | None:
    """``comparison.png``: each group's seed values of the headline metric as dots, the mean
    and its 95% interval beside them, lines joining the same seed across groups."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comparisons = report.get("comparisons") or []
    if not comparisons:
        return None
    metric = comparisons[0]["metric"]
    groups = [g for g in report["groups"] if metric in g["metrics"]]
    first = next(i for i, g in enumerate(groups) if g["title"] == report["baseline"])
    groups.insert(0, groups.pop(first))  # the baseline at the left
    fig, ax = plt.subplots(figsize=(max(4.5, 1.6 * len(groups) + 1.5), 4.2))
    by_seed: dict[Any, list[tuple[int, float]]] = {}
    for x, g in enumerate(groups):
        values, _ = per_seed(g, metric)
        for seed, v in values.items():
            by_seed.setdefault(seed, []).append((x, v))
        ax.plot([x] * len(values), list(values.values()), "o", ms=4, alpha=0.7, color="C0")
        s = g["metrics"][metric]
        if s.get("n"):
            lo, hi = s.get("ci95", [s["mean"], s["mean"]])
            ax.errorbar(
                x + 0.18,
                s["mean"],
                yerr=[[s["mean"] - lo], [hi - s["mean"]]],
                fmt="s",
                color="black",
                ms=5,
                capsize=4,
                label="mean, 95% CI" if x == 0 else None,
            )
    for points in by_seed.values():
        if len(points) > 1:
            ax.plot(*zip(*points, strict=True), "-", color="gray", lw=0.7, alpha=0.5)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([(g["title"] or g["label"]).replace(" ", "\n") for g in groups], fontsize=7)
    ax.set_ylabel(metric)
    ax.set_title("seeds (dots; lines join a seed across groups)", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "comparison.png", dpi=110)
    plt.close(fig)
    return "comparison.png"
