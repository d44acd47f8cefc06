"""The statistics of ``repro report`` and ``repro confirm``, on SciPy.

SciPy gives the distributions and the tests (Student's t, the paired and Welch t-tests, the
sign test, Shapiro-Wilk, the binomial interval). This module keeps what SciPy lacks:

- :func:`two_level`: the **paired two-level interval** -- the seeds both configs ran (the
  paired t-test's variance) and the evaluation samples both scored (matched by name: each
  sample's influence on the mean difference, the limit of a bootstrap of the samples),
  folds as strata -- whose standard error, split into its seed and its sample parts,
  gives a t interval (Satterthwaite's degrees of freedom). With the samples held fixed it
  is the paired t-test exactly.
- :func:`tost`: equivalence within ±δ (two one-sided tests: the 90% interval inside ±δ).
- :func:`holm`: Holm's step-down correction for several groups against one baseline.
- :func:`improvement`: the probability that the group beats the baseline on a seed, with
  its exact (Clopper-Pearson) interval -- what a collapsed seed cannot swamp.
- :func:`seeds_needed` and :func:`resolvable`: the seeds a smallest effect needs, and the
  smallest effect the seeds at hand resolve, at 80% power.

Differences are always ``group - baseline``. Two-sided tests at the 95% level throughout.
Nothing is drawn at random: the same runs give the same report, bit for bit.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np


def _scipy_stats() -> Any:
    """``scipy.stats``, imported on first use: its import costs about 1.7 s of CPU, which
    the commands that only read a run directory (``repro evaluate``, ``predict``,
    ``rerun``: they import :mod:`repro.tools.report` for its YAML reader) need not pay."""
    from scipy import stats

    return stats


LEVEL = 0.95  # of every interval
POWER = 0.80  # of seeds_needed and resolvable
MAX_SEEDS = 10_000  # seeds_needed stops counting here
ALPHA = 1.0 - LEVEL
SHAPE_MIN = 5  # values shape() needs: fewer say nothing of a distribution's shape


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p={p} is not in (0, 1)")
    return float(_scipy_stats().t.ppf(p, df))


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom."""
    return float(2.0 * _scipy_stats().t.sf(abs(t), df))


def _critical(df: float, level: float = LEVEL) -> float:
    return t_quantile(0.5 + level / 2.0, df)


def mean_interval(values: list[float]) -> dict[str, Any]:
    """n, mean, SD, min, max and the 95% interval of the mean (Student t, n - 1 degrees of
    freedom) of ``values``; the spread needs n >= 2. With n >= 2 also the median and the
    interquartile mean (the mean of the middle half: rliable's IQM)."""
    n = len(values)
    out: dict[str, Any] = {"n": n}
    if n == 0:
        return out
    mean = statistics.fmean(values)
    out.update(mean=mean, min=min(values), max=max(values))
    if n >= 2:
        sd = statistics.stdev(values)
        t = _critical(n - 1)
        half = t * sd / math.sqrt(n)
        out.update(sd=sd, ci95=[mean - half, mean + half], t=t, df=n - 1)
        out.update(median=statistics.median(values), iqm=iqm(values))
    return out


def iqm(values: list[float]) -> float:
    """The interquartile mean: the mean of the middle 50% (a quarter cut from each end,
    fractional observations weighted, as rliable computes it for whole quarters)."""
    x = np.sort(np.asarray(values, dtype=float))
    n = len(x)
    lo, hi = n / 4.0, 3.0 * n / 4.0
    total = 0.0
    for i, v in enumerate(x):  # the share of [i, i+1) inside [lo, hi)
        total += v * max(0.0, min(i + 1, hi) - max(i, lo))
    return float(total / (hi - lo))


def _test(mean_diff: float, se: float, df: float) -> dict[str, Any]:
    """t statistic, two-sided p and the interval of a difference with standard error
    ``se``. Values with no spread at all (``se`` 0) give no test: t and p are None (the
    same difference in every seed says nothing of the next seed's), the interval the
    point."""
    half = _critical(df) * se
    t = mean_diff / se if se > 0 else None
    p = t_two_sided_p(t, df) if t is not None else None
    return {
        "t": t,
        "df": df,
        "p_value": p,
        "se": se,
        "ci95": [mean_diff - half, mean_diff + half],
    }


def fold_corrected(
    mean_diff: float,
    seed_var: float,
    pairs: int,
    folds: int,
    sample_var: float = 0.0,
    sample_dfs: float = 0.0,
) -> dict[str, Any]:
    """The test of a mean difference over ``pairs`` (seed, fold) pairs of a ``folds``-fold
    cross-validation, the seeds' part of its variance (``seed_var``: the pairs' differences'
    variance over ``pairs``) widened for the training files the folds share: the corrected
    resampled t-test (Nadeau and Bengio 2003; for repeated k-fold, Bouckaert and Frank 2004),
    whose variance is ``(1/n + n_test/n_train) s^2`` with ``n_test/n_train = 1/(k - 1)``,
    i.e. ``seed_var * (1 + pairs/(k - 1))``; plus ``sample_var`` (the evaluation samples'
    part, with ``sample_dfs`` degrees of freedom), Satterthwaite's degrees of freedom."""
    factor = 1.0 + pairs / (folds - 1)
    widened = seed_var * factor
    df = (
        _satterthwaite([widened, sample_var], [pairs - 1, sample_dfs])
        if sample_var > 0
        else max(1.0, float(pairs - 1))
    )
    return {**_test(mean_diff, math.sqrt(widened + sample_var), df), "factor": factor}


def correlation(a: list[float], b: list[float]) -> float | None:
    """Pearson's r of the pairs; None where either side has no spread."""
    if len(a) < 2 or statistics.pstdev(a) == 0 or statistics.pstdev(b) == 0:
        return None
    return float(_scipy_stats().pearsonr(a, b).statistic)


# Fewer seeds a config than this: a verdict is labelled unreliable. With 2 seeds the paired
# test has 1 degree of freedom, its variance estimate is one squared difference, and the
# false-positive rate measured by simulation was 7.6-9% at a nominal 5% where seeds carry
# about half the variance (issue statistics' error rates).
FEW_SEEDS = 3
# Differences of at most this many units in the last place of the values compared are
# round-off, not spread: a metric summed in another order (another reduction, another
# batch split) moves by a few ulps, and a t-test of such differences gives p = 1e-58.
RESOLUTION_ULPS = 16


def within_resolution(baseline: list[float], group: list[float]) -> bool:
    """Whether each pair differs by at most :data:`RESOLUTION_ULPS` units in the last place
    of the larger of the two (floating-point resolution): the same value, computed twice."""
    return all(
        abs(g - b) <= RESOLUTION_ULPS * math.ulp(max(abs(b), abs(g)))
        for b, g in zip(baseline, group, strict=True)
    )


def paired(baseline: list[float], group: list[float]) -> dict[str, Any]:
    """The paired t-test of ``group - baseline`` (the same seeds, in the same order): the
    t interval of the mean of the differences, with n - 1 degrees of freedom. Differences
    that are all round-off (:func:`within_resolution`, not all zero) get no test:
    ``within_resolution`` says so, and the values are the same."""
    if len(baseline) != len(group):
        raise ValueError("paired: the two sides differ in length")
    diffs = [g - b for b, g in zip(baseline, group, strict=True)]
    n = len(diffs)
    out: dict[str, Any] = {"paired": True, "n": n}
    if n == 0:
        return out
    out["mean_diff"] = statistics.fmean(diffs)
    if any(diffs) and within_resolution(baseline, group):
        out["within_resolution"] = True  # no spread to test: the same values, rounded apart
        out["sd_diff"] = statistics.stdev(diffs) if n >= 2 else None
        return out
    if n >= 2:
        sd = statistics.stdev(diffs)
        out["sd_diff"] = sd
        out.update(_test(out["mean_diff"], sd / math.sqrt(n), n - 1))
        out["correlation"] = correlation(baseline, group)
        out["signs"] = signs(baseline, group)
    return out


def signs(baseline: list[float], group: list[float]) -> dict[str, Any]:
    """How many pairs the group is higher, lower and the same in, and the exact two-sided
    sign test of "higher as often as lower" (the same left out)."""
    higher = sum(g > b for b, g in zip(baseline, group, strict=True))
    lower = sum(g < b for b, g in zip(baseline, group, strict=True))
    n = higher + lower
    p = float(_scipy_stats().binomtest(higher, n).pvalue) if n else 1.0
    return {"higher": higher, "lower": lower, "same": len(baseline) - n, "p_value": p}


def improvement(baseline: list[float], group: list[float]) -> dict[str, Any]:
    """P(group > baseline) on a seed: the share of the paired seeds the group is higher in
    (the same left out), with its exact 95% interval (Clopper-Pearson). A collapsed seed
    counts once, as any seed: it cannot swamp this as it swamps a mean."""
    s = signs(baseline, group)
    n = s["higher"] + s["lower"]
    if n == 0:
        return {"p": None, "ci95": None, "n": 0}
    ci = _scipy_stats().binomtest(s["higher"], n).proportion_ci(LEVEL, method="exact")
    return {"p": s["higher"] / n, "ci95": [float(ci.low), float(ci.high)], "n": n}


def welch(baseline: list[float], group: list[float]) -> dict[str, Any]:
    """Welch's t-test of ``mean(group) - mean(baseline)`` (unequal variances, the
    Welch-Satterthwaite degrees of freedom); needs two values a side."""
    na, nb = len(baseline), len(group)
    out: dict[str, Any] = {"paired": False, "n": [na, nb]}
    if na == 0 or nb == 0:
        return out
    out["mean_diff"] = statistics.fmean(group) - statistics.fmean(baseline)
    if na >= 2 and nb >= 2:
        va, vb = statistics.variance(baseline) / na, statistics.variance(group) / nb
        se = math.sqrt(va + vb)
        df = (va + vb) ** 2 / (va**2 / (na - 1) + vb**2 / (nb - 1)) if se > 0 else na + nb - 2
        out["sd_diff"] = math.sqrt(statistics.variance(baseline) + statistics.variance(group))
        out.update(_test(out["mean_diff"], se, df))
    return out


def shape(values: list[float]) -> str | None:
    """Why a mean's t interval would mislead on ``values`` (per-seed values or differences):
    "bimodal or heavy-tailed (Shapiro-Wilk p = ...)" when a normal distribution is
    rejected at the 5% level (:data:`SHAPE_MIN` or more values with a spread), else None."""
    if len(values) < SHAPE_MIN or max(values) == min(values):
        return None
    p = float(_scipy_stats().shapiro(values).pvalue)
    return f"bimodal or heavy-tailed (Shapiro-Wilk p = {p:.2g})" if p < ALPHA else None


def tost(mean_diff: float, se: float, df: float, delta: float) -> dict[str, Any]:
    """Equivalence within ``±delta`` by two one-sided t-tests (Lakens): equivalent when both
    one-sided tests reject at 5%, i.e. when the 90% interval lies inside ``(-delta,
    delta)``. ``p_value`` is the larger one-sided p."""
    half = _critical(df, 1.0 - 2 * ALPHA) * se
    if se > 0:
        p_low = float(_scipy_stats().t.sf((mean_diff + delta) / se, df))  # H0: diff <= -delta
        p_high = float(_scipy_stats().t.cdf((mean_diff - delta) / se, df))  # H0: diff >= +delta
        p = max(p_low, p_high)
    else:
        p = 0.0 if abs(mean_diff) < delta else 1.0
    return {
        "delta": delta,
        "ci90": [mean_diff - half, mean_diff + half],
        "p_value": p,
        "equivalent": p < ALPHA,
    }


def holm(p_values: list[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values (None stays None): reject where the adjusted p is
    below 5% and the family-wise error rate of all the comparisons stays at 5%."""
    known = sorted((p, i) for i, p in enumerate(p_values) if p is not None)
    m = len(known)
    out: list[float | None] = [None] * len(p_values)
    running = 0.0
    for rank, (p, i) in enumerate(known):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out


def _normal_power_factor(df: float) -> float:
    return _critical(df) + t_quantile(POWER, df)


def resolvable(se: float, df: float) -> float:
    """The smallest true difference a test with standard error ``se`` (and ``df``) detects
    with 80% power at the 5% level: ``(t_{0.975} + t_{0.80}) * se``."""
    return _normal_power_factor(df) * se


def seeds_needed(
    delta: float, sd: float, is_paired: bool, fixed_var: float = 0.0, images: int | None = None
) -> int | None:
    """About how many seeds would resolve a true difference of ``delta`` (the smallest effect
    of interest, else the observed one) at this spread: the smallest n whose test has 80%
    power at the 5% level, ``(t_{0.975} + t_{0.80}) * se(n) <= |delta|``.

    ``sd`` is the SD of the per-seed differences when paired (n seeds run both configs), or
    ``sqrt(SD_a^2 + SD_b^2)`` when not (n seeds a config); ``se(n)^2 = sd^2 / n +
    fixed_var``, where ``fixed_var`` is the evaluation samples' share of the variance, which
    more seeds do not shrink (``images``: their count, for the degrees of freedom). Both are
    estimated from the few seeds there are, so the answer is a rough guide. None for no
    difference at all; :data:`MAX_SEEDS` when more than that would be needed (or when the
    samples' share alone exceeds what ``delta`` allows: more seeds cannot help)."""
    if not delta or not math.isfinite(delta) or not math.isfinite(sd):
        return None
    z = statistics.NormalDist()
    factor = z.inv_cdf(0.5 + LEVEL / 2) + z.inv_cdf(POWER)
    room = (delta / factor) ** 2 - fixed_var
    if room <= 0:
        return MAX_SEEDS
    if sd == 0:
        return 2
    normal = sd**2 / room
    if normal > MAX_SEEDS:
        return MAX_SEEDS
    # t's quantiles exceed the normal's: no n below the normal approximation's is enough
    for n in range(max(2, math.floor(normal)), MAX_SEEDS + 1):
        df = n - 1 if is_paired else 2 * n - 2
        if fixed_var and images:
            df = _satterthwaite([sd**2 / n, fixed_var], [df, images - 1])
        if _normal_power_factor(df) * math.sqrt(sd**2 / n + fixed_var) <= abs(delta):
            return n
    return MAX_SEEDS


def samples_limit(delta: float, fixed_var: float) -> bool:
    """Whether the evaluation samples' part of the variance alone keeps a difference of
    ``delta`` from being resolved at 80% power, however many seeds."""
    z = statistics.NormalDist()
    factor = z.inv_cdf(0.5 + LEVEL / 2) + z.inv_cdf(POWER)
    return (delta / factor) ** 2 <= fixed_var


def _satterthwaite(variances: list[float], dfs: list[float]) -> float:
    """Welch-Satterthwaite degrees of freedom of a sum of variance components."""
    num = sum(variances) ** 2
    den = sum(v**2 / d for v, d in zip(variances, dfs, strict=True) if d > 0)
    return num / den if den > 0 else max(1.0, float(sum(dfs)))


@dataclass
class Stratum:
    """One fold's paired per-sample scores: ``baseline[s, i, k]`` and ``group[s, i, k]``
    for seed ``s``, evaluation sample ``i`` (matched by name) and headline component ``k``
    (a class for a segmentation's mean over classes); NaN where a sample does not count
    for a component (an image without the class)."""

    baseline: np.ndarray
    group: np.ndarray


def headline(scores: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """The headline of each seed from its per-sample scores ``[..., seeds, samples,
    components]``: each component's mean over the samples where it is finite, then the
    mean over components -- with each sample counted ``weights[..., i]`` times (all ones
    when None)."""
    present = np.isfinite(scores)
    filled = np.where(present, scores, 0.0)
    if weights is None:
        weights = np.ones(scores.shape[-2])
    num = np.einsum("...i,sik->...sk", weights, filled)
    den = np.einsum("...i,sik->...sk", weights, present.astype(float))
    with np.errstate(invalid="ignore", divide="ignore"):
        per_component = num / den
    return (
        np.nanmean(per_component, axis=-1) if per_component.shape[-1] > 1 else per_component[..., 0]
    )


def _sample_variance(s: Stratum) -> float:
    """The variance of a stratum's mean difference that comes from which samples were
    evaluated: the samples' variance over n of each sample's influence on the mean over
    seeds of ``headline(group) - headline(baseline)`` (the same samples for both configs and
    every seed, so what they share cancels). The influence of sample i on a component's
    mean over the samples where it is scored, ``R_k = sum_i x_ik / sum_i p_ik``, is
    ``(x_ik - R_k p_ik) / mean_i p_ik``, averaged over the components each seed scores: the
    linearisation of the headline (the delta method), which is what a bootstrap of the
    samples converges to (its infinitely many draws) -- exactly, where the headline is the
    samples' plain mean -- without Monte-Carlo error and in time linear in seeds x samples
    x components. 0 with one sample."""
    n = s.baseline.shape[1]
    if n < 2:
        return 0.0
    column = influence(s.group).mean(axis=0) - influence(s.baseline).mean(axis=0)
    column = column[np.isfinite(column)]  # each sample's, over the seeds
    return float(np.var(column, ddof=1)) / n if len(column) > 1 else 0.0


def influence(x: np.ndarray) -> np.ndarray:
    """Each sample's influence on each seed's headline (``seeds x samples``) from the
    per-sample scores ``x[seed, sample, component]`` (NaN: not scored): see
    :func:`_sample_variance`."""
    present = np.isfinite(x)
    filled = np.where(present, x, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = present.mean(axis=1, keepdims=True)
        ratio = filled.sum(axis=1, keepdims=True) / present.sum(axis=1, keepdims=True)
        each = (filled - ratio * present) / share  # NaN: a component a seed never scores
        scored = np.isfinite(ratio).sum(axis=2)
        return np.nansum(each, axis=2) / scored


def two_level_unpaired(baseline: np.ndarray, group: np.ndarray) -> dict[str, Any]:
    """The two-level interval of ``group - baseline`` when the configs ran other seeds
    (``baseline[seed, sample, component]``, ``group[seed', sample, component]``) but scored
    the same samples: the seeds' part Welch's (each config's per-seed headlines' variance
    over its seeds), the samples' part as :func:`two_level`'s (each sample's influence on
    the difference of the two configs' means over their seeds, its variance over n); a t
    interval with Satterthwaite's degrees of freedom. Like the paired one, it counts the
    seed-by-sample noise in both parts (wide, never narrow)."""
    a, b = headline(baseline), headline(group)
    na, nb, n = len(a), len(b), baseline.shape[1]
    mean_diff = float(np.mean(b) - np.mean(a))
    va = float(np.var(a, ddof=1)) / na if na > 1 else 0.0
    vb = float(np.var(b, ddof=1)) / nb if nb > 1 else 0.0
    column = influence(group).mean(axis=0) - influence(baseline).mean(axis=0)
    column = column[np.isfinite(column)]
    v_sample = float(np.var(column, ddof=1)) / n if len(column) > 1 else 0.0
    total = va + vb + v_sample
    out = {
        "mean_diff": mean_diff,
        "seed_var": va + vb,
        "sample_var": v_sample,
        "seed_share": (va + vb) / total if total > 0 else None,
        "samples": [int(n)],
        "sample_method": "delta",
    }
    df = _satterthwaite([va, vb, v_sample], [na - 1, nb - 1, n - 1])
    out.update(_test(mean_diff, math.sqrt(total), df))
    return out


def two_level(strata: list[Stratum]) -> dict[str, Any]:
    """The paired two-level interval of ``group - baseline`` over seeds and evaluation
    samples (folds as strata; the difference is the mean over every (seed, fold) pair).

    The seed part of the variance is the paired t-test's over every (seed, fold) pair: the
    per-pair differences' variance over the pairs (so fold-to-fold differences count as
    seed-to-seed ones do). The sample part is the evaluation samples' (:func:`_sample_variance`:
    each sample's influence on the mean difference over the seeds -- the limit of a
    bootstrap of the samples, the same draws for both configs and every seed -- its
    variance over n), fold by fold. The sum counts the seed-by-sample noise twice (a little
    wide, never narrow); the interval is a t interval with Satterthwaite's degrees of
    freedom. With one sample (or none varying) it is the paired t-test exactly."""
    pairs = sum(s.baseline.shape[0] for s in strata)
    per_seed: list[float] = []
    for s in strata:
        per_seed.extend((headline(s.group) - headline(s.baseline)).tolist())
    mean_diff = statistics.fmean(per_seed)
    v_seed = statistics.variance(per_seed) / pairs if pairs > 1 else 0.0
    parts, dfs = [v_seed], [pairs - 1]
    for s in strata:
        parts.append((s.baseline.shape[0] / pairs) ** 2 * _sample_variance(s))
        dfs.append(s.baseline.shape[1] - 1)
    v_sample = sum(parts[1:])
    out = {
        "mean_diff": mean_diff,
        "per_seed": per_seed,
        "seed_var": v_seed,
        "sample_var": v_sample,
        "seed_share": v_seed / (v_seed + v_sample) if v_seed + v_sample > 0 else None,
        "samples": [int(s.baseline.shape[1]) for s in strata],
        "sample_method": "delta",  # the samples' influence: a bootstrap's limit, exactly
    }
    out.update(_test(mean_diff, math.sqrt(v_seed + v_sample), _satterthwaite(parts, dfs)))
    return out
