"""repro.tools.stats' t-based statistics, which it computes from their formulas with SciPy's
t distribution, against SciPy's own tests on many random inputs (intervals, the paired and
Welch t-tests, correlations, the sign test), and the seeds a difference needs against the
exact power of the noncentral t. The statistics SciPy lacks: tests/test_verdicts.py."""

import math
import random
import statistics

import pytest
import scipy.stats as scipy_stats  # the dev extra's: the reference, never the runtime's

from repro.tools import stats

CASES = 200


def close(a, b, rel=1e-9, abs_=1e-12):
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


def samples(rng, n, mean=0.8, sd=0.05):
    return [rng.gauss(mean, sd) for _ in range(n)]


def test_mean_intervals_match_scipy():
    rng = random.Random(1)
    for _ in range(CASES):
        values = samples(rng, rng.randint(2, 15))
        got = stats.mean_interval(values)
        lo, hi = scipy_stats.t.interval(
            0.95, len(values) - 1, loc=statistics.fmean(values), scale=scipy_stats.sem(values)
        )
        assert close(got["ci95"][0], lo) and close(got["ci95"][1], hi)
    assert stats.mean_interval([0.5]) == {"n": 1, "mean": 0.5, "min": 0.5, "max": 0.5}


def test_paired_t_tests_match_scipy_ttest_rel():
    rng = random.Random(2)
    for case in range(CASES):
        n = rng.randint(2, 12)
        a = samples(rng, n)
        b = [x + rng.gauss(rng.uniform(-0.02, 0.02), rng.uniform(0.001, 0.03)) for x in a]
        got = stats.paired(a, b)
        ref = scipy_stats.ttest_rel(b, a)
        ci = ref.confidence_interval(0.95)
        assert got["n"] == n and got["df"] == n - 1
        assert close(got["t"], ref.statistic), case
        assert close(got["p_value"], ref.pvalue, 1e-8, 1e-14), case
        assert close(got["ci95"][0], ci.low) and close(got["ci95"][1], ci.high), case
        assert close(got["mean_diff"], statistics.fmean(y - x for x, y in zip(a, b, strict=True)))
        r = scipy_stats.pearsonr(a, b).statistic
        assert close(got["correlation"], r, 1e-9, 1e-12)


def test_sign_counts_and_the_exact_sign_test_match_scipy_binomtest():
    rng = random.Random(4)
    for _ in range(CASES):
        n = rng.randint(1, 25)
        a = [rng.choice([0.5, 0.6, 0.7]) for _ in range(n)]
        b = [rng.choice([0.5, 0.6, 0.7]) for _ in range(n)]
        got = stats.signs(a, b)
        higher = sum(y > x for x, y in zip(a, b, strict=True))
        lower = sum(y < x for x, y in zip(a, b, strict=True))
        assert (got["higher"], got["lower"], got["same"]) == (higher, lower, n - higher - lower)
        ref = scipy_stats.binomtest(higher, higher + lower).pvalue if higher + lower else 1.0
        assert close(got["p_value"], ref, 1e-9, 1e-15)


def test_welch_t_tests_match_scipy_ttest_ind_unequal_variances():
    rng = random.Random(3)
    for case in range(CASES):
        a = samples(rng, rng.randint(2, 12), 0.8, rng.uniform(0.005, 0.1))
        b = samples(rng, rng.randint(2, 12), rng.uniform(0.75, 0.85), rng.uniform(0.005, 0.1))
        got = stats.welch(a, b)
        ref = scipy_stats.ttest_ind(b, a, equal_var=False)
        ci = ref.confidence_interval(0.95)
        assert got["n"] == [len(a), len(b)] and not got["paired"]
        assert close(got["t"], ref.statistic) and close(got["df"], ref.df), case
        assert close(got["p_value"], ref.pvalue, 1e-8, 1e-14), case
        assert close(got["ci95"][0], ci.low) and close(got["ci95"][1], ci.high), case


def test_no_spread_is_an_exact_difference_and_too_few_values_give_no_interval():
    same = stats.paired([0.5, 0.6, 0.7], [0.5, 0.6, 0.7])
    assert same["mean_diff"] == 0 and same["p_value"] is None and same["ci95"] == [0, 0]
    shifted = stats.paired([0.5, 0.6], [0.75, 0.85])  # SciPy: NaN, with a warning
    assert shifted["p_value"] is None and shifted["ci95"][0] == shifted["ci95"][1]
    assert stats.welch([0.5, 0.5], [0.6, 0.6])["p_value"] is None
    assert "ci95" not in stats.paired([0.5], [0.6]) and "ci95" not in stats.welch([0.5], [0.6, 0.7])
    assert stats.correlation([1.0, 1.0], [2.0, 3.0]) is None
    with pytest.raises(ValueError):
        stats.paired([0.5, 0.6], [0.5])


def power(n, diff, sd, paired):
    """The exact power of the two-sided 5% t-test (noncentral t) with n seeds (a side)."""
    df = n - 1 if paired else 2 * n - 2
    nc = diff / (sd / math.sqrt(n))
    c = scipy_stats.t.ppf(0.975, df)
    return scipy_stats.nct.sf(c, df, nc) + scipy_stats.nct.cdf(-c, df, nc)


@pytest.mark.parametrize("paired", [True, False])
def test_seeds_needed_gives_80_percent_power_and_one_fewer_does_not(paired):
    for ratio in (0.2, 0.35, 0.5, 0.8, 1.0, 1.5, 2.5):
        n = stats.seeds_needed(ratio * 0.01, 0.01, paired)
        assert power(n, ratio * 0.01, 0.01, paired) >= 0.80, (ratio, n)
        if n > 2:
            assert power(n - 1, ratio * 0.01, 0.01, paired) < 0.80, (ratio, n)
    assert stats.seeds_needed(0.0, 0.01, True) is None
    assert stats.seeds_needed(1e-9, 1.0, True) == stats.MAX_SEEDS
