"""The statistics of ``repro report`` and ``repro confirm``, on SciPy.

SciPy gives the distributions and the tests (Student's t, the paired and Welch t-tests, the
sign test, Shapiro-Wilk, the binomial interval). This module keeps what SciPy lacks:

- :func:`two_level`: the **paired two-level interval** -- over the seeds both configs ran
  and the evaluation samples both scored (matched by name; folds as strata): the variance
  of the mean difference decomposed as a crossed random-effects model of seeds x samples
  (method of moments: seeds, samples and seed-by-sample parts, the last counted once),
  each sample entering by its influence on its seed's headline (the delta method: a
  bootstrap of the samples' limit); a t interval with Satterthwaite's degrees of freedom.
  With the samples held fixed it is the paired t-test exactly.
  :func:`two_level_unpaired` is the same for configs that ran other seeds but scored the
  same samples; :func:`config_interval` for one config's headline.
- :func:`tost`: equivalence within ±δ (two one-sided tests: the 90% interval inside ±δ).
- :func:`holm`: Holm's step-down correction for several groups against one baseline.
- :func:`improvement`: the probability that the group beats the baseline on a seed, with
  its exact (Clopper-Pearson) interval.
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
    rows, m = _sorted_rows(np.asarray([values], dtype=float))
    return float(_median_iqm(rows, m)[1][0])


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


# Fewer seeds a config than this: no test (no interval, no verdict). With 2 seeds the paired
# test has 1 degree of freedom, its variance estimate is one squared difference, and the
# false-positive rate measured by simulation was 7.6-9% at a nominal 5% where seeds carry
# about half the variance.
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


def influence(x: np.ndarray) -> np.ndarray:
    """Each sample's influence on each seed's headline (``seeds x samples``) from the
    per-sample scores ``x[seed, sample, component]`` (NaN: not scored). The influence of
    sample i on a component's mean over the samples where it is scored, ``R_k = sum_i x_ik
    / sum_i p_ik``, is ``(x_ik - R_k p_ik) / mean_i p_ik``, averaged over the components
    each seed scores: the linearisation of the headline (the delta method), which is what a
    bootstrap of the samples converges to -- exactly, where the headline is the samples'
    plain mean -- without Monte-Carlo error and in time linear in seeds x samples x
    components. NaN where a seed scores no component."""
    present = np.isfinite(x)
    filled = np.where(present, x, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = present.mean(axis=1, keepdims=True)
        ratio = filled.sum(axis=1, keepdims=True) / present.sum(axis=1, keepdims=True)
        each = (filled - ratio * present) / share  # NaN: a component a seed never scores
        scored = np.isfinite(ratio).sum(axis=2)
        return np.nansum(each, axis=2) / scored


def _scored(phi: np.ndarray) -> np.ndarray:
    """The columns (samples) of ``phi`` that every seed scores."""
    return phi[:, np.isfinite(phi).all(axis=0)]


def _sample_piece(phi: np.ndarray) -> float:
    """The samples' raw piece of a mean's variance from their influences ``phi`` (``seeds x
    samples``): each sample's mean influence over the seeds, its variance over N. It is
    what a bootstrap of the samples (the same draws for every seed) converges to -- exactly,
    where the headline is the samples' plain mean -- and it holds the seed-by-sample noise
    once. 0 below 2 samples."""
    n = phi.shape[1]
    return float(np.var(phi.mean(axis=0), ddof=1)) / n if n > 1 else 0.0


def _interaction(phi: np.ndarray) -> float:
    """The seed-by-sample mean square of the influences ``phi`` (``seeds x samples``, each
    row summing to about 0): the residual of the crossed two-way decomposition, ``sum (phi
    - its sample's mean over seeds)^2 / ((S - 1)(N - 1))`` -- how much a sample's score moves
    from seed to seed beyond the seeds' and the samples' own effects. 0 below 2 x 2."""
    s, n = phi.shape
    if s < 2 or n < 2:
        return 0.0
    resid = phi - phi.mean(axis=0, keepdims=True)
    resid -= resid.mean(axis=1, keepdims=True)
    return float(np.sum(resid**2)) / ((s - 1) * (n - 1))


# The seeds' degrees of freedom from which a floored two-level total takes the
# interaction's degrees of freedom (see _crossed).
FLOOR_SEED_DF = 4


def _crossed(
    mean_diff: float,
    seeds: list[tuple[float, float, int]],
    samples: tuple[float, int],
    interaction: list[tuple[float, int]],
) -> dict[str, Any]:
    """The t test of ``mean_diff`` from the raw pieces of a crossed seeds x samples
    decomposition (each a variance of the mean): ``seeds``, one ``(raw, its seed-by-sample
    part, df)`` per config (the per-seed values' variance over S, which holds the
    seed-by-sample noise once); ``samples``, ``(raw, df)`` (each sample's influence's
    variance over N, which holds every config's seed-by-sample noise once); and
    ``interaction``, each config's (each fold's) seed-by-sample part ``MS_e / (S N)`` with
    its degrees of freedom ``(S - 1)(N - 1)``.

    The total, ``sum seeds + samples - sum interaction``, is the method of moments'
    unbiased estimate (the seed-by-sample noise counted once), floored at the interaction
    (every component is >= 0; below :data:`FLOOR_SEED_DF` seeds' degrees of freedom the
    floored total keeps the combination's denominator in its degrees of freedom). The
    components -- seeds ``raw - part``, samples ``raw - sum parts``, seed-by-sample ``sum
    parts`` -- are clamped at 0 for the shares. The degrees of
    freedom are Satterthwaite's for the total's combination of mean squares, the
    interaction's with a negative sign (fewer, so a wider interval, where the seeds' or the
    samples' own part is small: the price of counting the seed-by-sample noise once)."""
    inter = sum(v for v, _ in interaction)
    total = sum(raw for raw, _, _ in seeds) + samples[0] - inter
    # (value, df) of each raw piece with its sign in the total
    terms = [(raw, df) for raw, _, df in seeds] + [samples] + [(-v, d) for v, d in interaction]
    # every component is >= 0: the total is at least the interaction's. With few seeds its
    # degrees of freedom keep the unbiased combination's denominator (the floored total over
    # the combination's Satterthwaite terms) -- a seeds' part estimated as 0 from 2 or 3
    # degrees of freedom is not known to be 0 (the interaction's many instead gave 7.3%
    # false positives at a nominal 5% with 3 seeds, 5.4% with 4, by simulation); from
    # FLOOR_SEED_DF on, the interaction's own (5.2% with 5 seeds; the other rule there is
    # needlessly wide where the seed-by-sample noise dominates: 98% coverage)
    if total < inter:
        total = inter
        if min(df for _, _, df in seeds) >= FLOOR_SEED_DF:
            terms = list(interaction)
    den = sum(v**2 / df for v, df in terms if v and df > 0)
    df = total**2 / den if den > 0 else max(1.0, float(sum(d for _, d in terms)))
    out = _test(mean_diff, math.sqrt(total), max(1.0, df))
    components = {
        "seeds": sum(max(raw - part, 0.0) for raw, part, _ in seeds),
        "samples": max(samples[0] - inter, 0.0),
        "seed_x_sample": inter,
    }
    out["components"] = components
    clamped = sum(components.values())
    out["shares"] = {k: v / clamped for k, v in components.items()} if clamped > 0 else None
    return out


def two_level_unpaired(baseline: np.ndarray, group: np.ndarray) -> dict[str, Any]:
    """The two-level interval of ``group - baseline`` when the configs ran other seeds
    (``baseline[seed, sample, component]``, ``group[seed', sample, component]``) but scored
    the same samples: the crossed decomposition of :func:`two_level` with each config's own
    seeds and seed-by-sample noise and the samples' part of the difference the two share.

    Components (each a variance of the mean difference): each config's seeds', ``var(H)/S
    - MS_e/(S N)``; the samples', ``var_i(c_i)/N - sum MS_e/(S N)`` where ``c_i`` is sample
    i's influence on the difference of the configs' means over their seeds; each config's
    seed-by-sample, ``MS_e/(S N)``. Negative estimates clamp at 0. A t interval with
    Satterthwaite's degrees of freedom."""
    a, b = headline(baseline), headline(group)
    na, nb = len(a), len(b)
    mean_diff = float(np.mean(b) - np.mean(a))
    pa, pb = influence(baseline), influence(group)
    keep = np.isfinite(pa).all(axis=0) & np.isfinite(pb).all(axis=0)  # scored by every seed
    pa, pb = pa[:, keep], pb[:, keep]
    n = pa.shape[1]
    ia = _interaction(pa) / (na * n) if n else 0.0
    ib = _interaction(pb) / (nb * n) if n else 0.0
    got = _crossed(
        mean_diff,
        [
            (float(np.var(a, ddof=1)) / na if na > 1 else 0.0, ia, na - 1),
            (float(np.var(b, ddof=1)) / nb if nb > 1 else 0.0, ib, nb - 1),
        ],
        (_sample_piece(pb - pa.mean(axis=0)), n - 1),
        [(ia, (na - 1) * (n - 1)), (ib, (nb - 1) * (n - 1))],
    )
    return _level(got, mean_diff, [int(n)])


def _level(got: dict[str, Any], mean_diff: float, samples: list[int]) -> dict[str, Any]:
    """A two-level result's fields: the components' variances and shares by name."""
    comp, shares = got.pop("components"), got.pop("shares")
    return {
        "mean_diff": mean_diff,
        "seed_var": comp["seeds"],
        "sample_var": comp["samples"],
        "interaction_var": comp["seed_x_sample"],
        "shares": shares,
        "seed_share": None if shares is None else shares["seeds"],
        "samples": samples,
        "sample_method": "delta",  # the samples' influence: a bootstrap's limit, exactly
        "decomposition": "crossed",  # seeds x samples, method of moments
        **got,
    }


def two_level(strata: list[Stratum]) -> dict[str, Any]:
    """The paired two-level interval of ``group - baseline`` over seeds and evaluation
    samples (folds as strata; the difference is the mean over every (seed, fold) pair).

    The variance of the mean difference is decomposed as a crossed random-effects model of
    seeds x samples (method of moments): a pair's difference on sample i is ``mu + a_s +
    b_i + e_si`` and the mean's variance ``var(a)/S + var(b)/N + var(e)/(S N)``. Each
    sample's value enters by its influence on its seed's headline (:func:`influence`: the
    delta method, exact for a plain mean; what a bootstrap of the samples converges to), so
    a mean over classes or a ratio of sums is decomposed as a plain mean is. The raw pieces
    -- the per-pair differences' variance over the pairs (every (seed, fold) pair, so fold
    differences count as seed ones), each sample's mean influence's variance over the
    samples, and the seed-by-sample residual mean square :func:`_interaction` -- each hold
    the seed-by-sample noise once; it is subtracted from the first two and counted once
    (:func:`_crossed`). The interval is a t interval with
    Satterthwaite's degrees of freedom. With one sample (or none varying) it is the paired
    t-test exactly."""
    pairs = sum(s.baseline.shape[0] for s in strata)
    per_seed: list[float] = []
    for s in strata:
        per_seed.extend((headline(s.group) - headline(s.baseline)).tolist())
    mean_diff = statistics.fmean(per_seed)
    sample_raw, interaction, sample_df = 0.0, [], 0
    for s in strata:
        weight = (s.baseline.shape[0] / pairs) ** 2
        phi = _scored(influence(s.group) - influence(s.baseline))
        seeds, n = phi.shape
        if n > 1:
            sample_raw += weight * _sample_piece(phi)
            interaction.append((weight * _interaction(phi) / (seeds * n), (seeds - 1) * (n - 1)))
        sample_df += max(n - 1, 0)
    inter = sum(v for v, _ in interaction)
    seed_raw = statistics.variance(per_seed) / pairs if pairs > 1 else 0.0
    got = _crossed(mean_diff, [(seed_raw, inter, pairs - 1)], (sample_raw, sample_df), interaction)
    out = _level(got, mean_diff, [int(s.baseline.shape[1]) for s in strata])
    out["per_seed"] = per_seed
    out["pairs_var"] = seed_raw  # the pairs' differences' variance over the pairs
    return out


def config_interval(
    scores: np.ndarray, bounds: tuple[float, float] | None = None
) -> dict[str, Any]:
    """The 95% interval of one config's expected headline over new seeds *and* new
    evaluation samples drawn as these were, from its per-sample scores ``scores[seed,
    sample, component]`` (the same samples for every seed): :func:`two_level`'s crossed
    decomposition with one side (a seeds-only interval is conditional on this validation
    set). Kept inside ``bounds`` (a Dice's [0, 1]) where given."""
    h = headline(scores)
    s = len(h)
    mean = float(np.mean(h))
    phi = _scored(influence(scores))
    n = phi.shape[1]
    inter = _interaction(phi) / (s * n) if n else 0.0
    got = _crossed(
        mean,
        [(float(np.var(h, ddof=1)) / s if s > 1 else 0.0, inter, s - 1)],
        (_sample_piece(phi), n - 1),
        [(inter, (s - 1) * (n - 1))],
    )
    out = _level(got, mean, [int(n)])
    if bounds is not None:
        lo, hi = out["ci95"]
        out["ci95"] = [max(lo, bounds[0]), min(hi, bounds[1])]
    out["mean"] = out.pop("mean_diff")
    return out


BOOTSTRAP_DRAWS = 2000  # of robust_aggregates; fewer for large tables (its work is capped)
_BOOTSTRAP_WORK = 20_000_000  # values drawn in all, at most (then at least _BOOTSTRAP_MIN draws)
PROFILE_POINTS = 51  # thresholds of the performance profile
_BOOTSTRAP_CHUNK = 2_000_000  # values of the draws computed together
_BOOTSTRAP_MIN = 50  # draws however large the table (its Monte-Carlo error says so)


def per_sample_headline(x: np.ndarray) -> np.ndarray:
    """Each sample's own headline (``seeds x samples``) from the per-sample scores
    ``x[seed, sample, component]``: the mean over the components it is scored for (NaN
    where none)."""
    present = np.isfinite(x)
    count = present.sum(axis=2)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(present, x, 0.0).sum(axis=2) / np.where(count > 0, count, np.nan)


def _sorted_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row of ``x`` (``draws x values``) sorted, NaN last, and its count of finite
    values."""
    return np.sort(x, axis=1), np.isfinite(x).sum(axis=1)


def _median_iqm(rows: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The median and the interquartile mean (:func:`iqm`: a quarter cut from each end,
    fractional values weighted) of each sorted row's ``m`` finite values; NaN for none."""
    c, width = rows.shape
    k1, k2 = np.maximum((m - 1) // 2, 0), np.maximum(m // 2, 0)
    pick = np.take_along_axis
    median = (pick(rows, k1[:, None], 1)[:, 0] + pick(rows, k2[:, None], 1)[:, 0]) / 2.0
    idx = np.arange(width)[None, :]
    lo, hi = (m / 4.0)[:, None], (3.0 * m / 4.0)[:, None]
    w = np.clip(np.minimum(idx + 1, hi) - np.maximum(idx, lo), 0.0, None)
    with np.errstate(invalid="ignore", divide="ignore"):
        iqm_ = (w * np.where(idx < m[:, None], rows, 0.0)).sum(axis=1) / (hi - lo)[:, 0]
    empty = m == 0
    return np.where(empty, np.nan, median), np.where(empty, np.nan, iqm_)


def _improvement(x: np.ndarray, y: np.ndarray, paired: bool) -> np.ndarray:
    """P(B > A) of each draw (``draws x seeds x samples`` each side): a sample's score under
    the group against the baseline's on the same seed (paired) or every seed pair, ties a
    half, samples either side does not score left out."""
    if not paired:
        x, y = x[:, None, :, :], y[:, :, None, :]
    scored = np.isfinite(x) & np.isfinite(y)
    wins = ((y > x) + 0.5 * (y == x)) * scored
    axes = tuple(range(1, wins.ndim))
    with np.errstate(invalid="ignore", divide="ignore"):
        return wins.sum(axis=axes) / scored.sum(axis=axes)


def _profiles(rows: np.ndarray, m: np.ndarray, tau: np.ndarray) -> np.ndarray:
    """The share of each sorted row's finite values at or above each ``tau``."""
    out = np.empty((len(rows), len(tau)))
    for i, (row, k) in enumerate(zip(rows, m, strict=True)):
        out[i] = (k - np.searchsorted(row[:k], tau, side="left")) / max(int(k), 1)
    return out


def _aggregate_batch(
    x: np.ndarray, y: np.ndarray, paired: bool, tau: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The statistics of :func:`robust_aggregates` for a batch of draws (``draws x seeds x
    samples`` a side): ``draws x 7`` and the profiles ``draws x 2 x points``."""
    ra, ma = _sorted_rows(x.reshape(len(x), -1))
    rb, mb = _sorted_rows(y.reshape(len(y), -1))
    med_a, iqm_a = _median_iqm(ra, ma)
    med_b, iqm_b = _median_iqm(rb, mb)
    imp = _improvement(x, y, paired)
    stats_ = np.stack([med_a, iqm_a, med_b, iqm_b, med_b - med_a, iqm_b - iqm_a, imp], axis=1)
    return stats_, np.stack([_profiles(ra, ma, tau), _profiles(rb, mb, tau)], axis=1)


def _percentile_ci(draws: np.ndarray) -> dict[str, Any]:
    """The 95% percentile interval of bootstrap ``draws`` and its Monte-Carlo error: half
    the spread of the order statistics whose ranks a binomial puts within 1.96 SD of each
    end's rank, over 1.96 (the endpoints' standard error from the draws' count)."""
    x = np.sort(draws[np.isfinite(draws)])
    b = len(x)
    if b < 2:
        return {"ci95": None, "mc_error": None, "draws": b}
    ends, errors = [], []
    for p in (ALPHA / 2, 1 - ALPHA / 2):
        ends.append(float(np.quantile(x, p)))
        spread = 1.96 * math.sqrt(b * p * (1 - p))
        lo, hi = int(max(0, math.floor(b * p - spread))), int(min(b - 1, math.ceil(b * p + spread)))
        errors.append(float(x[hi] - x[lo]) / (2 * 1.96))
    return {"ci95": ends, "mc_error": max(errors), "draws": b}


def robust_aggregates(
    baseline: np.ndarray, group: np.ndarray, paired: bool, key: int = 0
) -> dict[str, Any]:
    """The median and interquartile mean of each config's per-(seed, sample) scores
    (:func:`per_sample_headline`) and of their difference, each with a 95% interval from a
    bootstrap that resamples the seeds and the samples together (the same sample draws for
    both configs, and the same seed draws where ``paired``; rliable's stratified bootstrap
    with the samples as its tasks, plus the samples' own draw); and P(B > A), the chance
    that the group's score on a sample beats the baseline's on a seed pair, averaged over
    the samples (rliable's probability of improvement; ties count a half), with its
    interval; and the performance profile -- the share of (seed, sample) scores at or above
    each threshold tau, with its pointwise band (rliable's score distribution). Keyed by
    ``key``: the same runs give the same report. The draws are capped
    (:data:`BOOTSTRAP_DRAWS`, fewer for very large tables) and each endpoint's Monte-Carlo
    error is reported."""
    a, b = per_sample_headline(baseline), per_sample_headline(group)
    sa, n = a.shape
    sb = b.shape[0]
    rng = np.random.default_rng([key, sa, sb, n])
    draws = int(min(BOOTSTRAP_DRAWS, max(_BOOTSTRAP_MIN, _BOOTSTRAP_WORK // ((sa + sb) * n))))

    finite = np.concatenate([a[np.isfinite(a)], b[np.isfinite(b)]])
    lo, hi = (float(finite.min()), float(finite.max())) if len(finite) else (0.0, 1.0)
    tau = np.linspace(lo, hi, PROFILE_POINTS)
    point, point_curves = _aggregate_batch(a[None], b[None], paired, tau)
    boot = np.empty((draws, point.shape[1]))
    curves = np.empty((draws, 2, PROFILE_POINTS))
    chunk = max(1, _BOOTSTRAP_CHUNK // ((sa + sb) * n))  # draws computed together
    for start in range(0, draws, chunk):
        c = min(chunk, draws - start)
        images = rng.integers(0, n, (c, 1, n))
        rows_a = rng.integers(0, sa, (c, sa, 1))
        rows_b = rows_a if paired else rng.integers(0, sb, (c, sb, 1))
        boot[start : start + c], curves[start : start + c] = _aggregate_batch(
            a[rows_a, images], b[rows_b, images], paired, tau
        )
    names = ["baseline_median", "baseline_iqm", "group_median", "group_iqm",
             "median_diff", "iqm_diff", "improvement"]  # fmt: skip
    out: dict[str, Any] = {"draws": draws, "resampled": "seeds and samples", "key": key}
    for i, name in enumerate(names):
        out[name] = {"value": float(point[0, i]), **_percentile_ci(boot[:, i])}
    band = np.quantile(curves, [ALPHA / 2, 1 - ALPHA / 2], axis=0)  # 2 x 2 x points
    out["profile"] = {
        "tau": tau.tolist(),
        **{
            side: {
                "share": point_curves[0, k].tolist(),
                "ci95": [band[0, k].tolist(), band[1, k].tolist()],
            }
            for k, side in enumerate(("baseline", "group"))
        },
    }
    return out
