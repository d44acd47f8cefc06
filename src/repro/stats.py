"""The statistics of ``repro report``: Student t intervals, paired and Welch t-tests, and
how many seeds a difference needs -- in plain Python, so the runtime needs no SciPy (the
tests check every function here against SciPy's on many random inputs).

Differences are always ``group - baseline``. Two-sided tests at the 95% level throughout.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

LEVEL = 0.95  # of every interval
POWER = 0.80  # of :func:`seeds_needed`
MAX_SEEDS = 10_000  # :func:`seeds_needed` stops counting here


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), for a, b > 0 and 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on this side
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` (> 0, not necessarily whole) degrees of
    freedom."""
    if math.isnan(t):
        return math.nan
    if math.isinf(t):
        return 0.0
    return betainc(df / 2.0, 0.5, df / (df + t * t))


def t_cdf(t: float, df: float) -> float:
    half = 0.5 * t_two_sided_p(t, df)
    return 1.0 - half if t > 0 else half


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on
    :func:`t_cdf`, to about 1e-12)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p={p} is not in (0, 1)")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2.0


def _critical(df: float) -> float:
    return t_quantile(0.5 + LEVEL / 2.0, df)


def mean_interval(values: list[float]) -> dict[str, Any]:
    """n, mean, SD, min, max and the 95% interval of the mean (Student t, n - 1 degrees of
    freedom) of ``values``; the spread needs n >= 2."""
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
    return out


def _test(mean_diff: float, se: float, df: float) -> dict[str, Any]:
    """t statistic, two-sided p and the interval of a difference with standard error
    ``se``. Values with no spread at all (``se`` 0) give no test: t and p are None (the
    same difference in every seed says nothing of the next seed's), the interval the
    point."""
    half = _critical(df) * se
    t = mean_diff / se if se > 0 else None
    p = t_two_sided_p(t, df) if t is not None else None
    return {"t": t, "df": df, "p_value": p, "ci95": [mean_diff - half, mean_diff + half]}


def correlation(a: list[float], b: list[float]) -> float | None:
    """Pearson's r of the pairs; None where either side has no spread."""
    if len(a) < 2 or statistics.pstdev(a) == 0 or statistics.pstdev(b) == 0:
        return None
    return statistics.correlation(a, b)


def paired(baseline: list[float], group: list[float]) -> dict[str, Any]:
    """The paired t-test of ``group - baseline`` (the same seeds, in the same order): the
    t interval of the mean of the differences, with n - 1 degrees of freedom."""
    if len(baseline) != len(group):
        raise ValueError("paired: the two sides differ in length")
    diffs = [g - b for b, g in zip(baseline, group, strict=True)]
    n = len(diffs)
    out: dict[str, Any] = {"paired": True, "n": n}
    if n == 0:
        return out
    out["mean_diff"] = statistics.fmean(diffs)
    if n >= 2:
        sd = statistics.stdev(diffs)
        out["sd_diff"] = sd
        out.update(_test(out["mean_diff"], sd / math.sqrt(n), n - 1))
        out["correlation"] = correlation(baseline, group)
        out["signs"] = signs(baseline, group)
    return out


def signs(baseline: list[float], group: list[float]) -> dict[str, Any]:
    """How many pairs the group is higher, lower and the same in, and the exact two-sided
    sign test of "higher as often as lower" (the same left out): robust to the one collapsed
    seed that can swamp a mean."""
    higher = sum(g > b for b, g in zip(baseline, group, strict=True))
    lower = sum(g < b for b, g in zip(baseline, group, strict=True))
    n = higher + lower
    tail = sum(math.comb(n, k) for k in range(min(higher, lower) + 1)) / 2**n
    return {
        "higher": higher,
        "lower": lower,
        "same": len(baseline) - n,
        "p_value": min(1.0, 2 * tail),
    }


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


def seeds_needed(mean_diff: float, sd: float, is_paired: bool) -> int | None:
    """About how many seeds would resolve a true difference of ``mean_diff`` at this
    spread: the smallest n whose test has 80% power at the 5% level, by the usual
    approximation ``(t_{0.975} + t_{0.80}) * sd / sqrt(n) <= |mean_diff|``.

    ``sd`` is the SD of the per-seed differences when paired (n seeds run both configs), or
    ``sqrt(SD_a^2 + SD_b^2)`` when not (n seeds a config). Both are estimated from the few
    seeds there are, so the answer is a rough guide. None for no difference at all;
    :data:`MAX_SEEDS` when more than that would be needed."""
    if not mean_diff or not math.isfinite(mean_diff) or not math.isfinite(sd):
        return None
    if sd == 0:
        return 2
    z = statistics.NormalDist()
    normal = ((z.inv_cdf(0.5 + LEVEL / 2) + z.inv_cdf(POWER)) * sd / mean_diff) ** 2
    if normal > MAX_SEEDS:
        return MAX_SEEDS
    # t's quantiles exceed the normal's: no n below the normal approximation's is enough
    for n in range(max(2, math.floor(normal)), MAX_SEEDS + 1):
        df = n - 1 if is_paired else 2 * n - 2
        if (_critical(df) + t_quantile(POWER, df)) * sd / math.sqrt(n) <= abs(mean_diff):
            return n
    return MAX_SEEDS
