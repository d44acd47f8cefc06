"""`repro report`'s verdicts on fabricated sweeps whose truth is known by construction
(better, worse, equivalent within ±δ, can't tell, collapsed, bimodal, the evaluation
samples' share of the uncertainty, Holm), the two-level interval's coverage by simulation,
and the statistics SciPy lacks against computations of their own."""

import importlib.util
import json
import math
import statistics

import numpy as np
import pytest
import scipy.stats as sps

from conftest import ROOT
from repro.tools import stats
from repro.tools.comparisons import list_change
from repro.tools.report import build_report, format_markdown

IMAGES = 40


def job(sweep, num, lr, seed, scores, final_loss=0.5, headline="val_dice", per_sample=True):
    """A finished job of `python train.py -m optim.lr=... seed=...`: its launch record,
    summary and per-image scores (one headline column; NaN: not scored)."""
    d = sweep / f"{num}_seed={seed}"
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(f"- optim.lr={lr}\n- seed={seed}\n")
    (d / ".hydra" / "config.yaml").write_text(f"seed: {seed}\noptim:\n  lr: {lr}\n")
    finite = [v for v in scores if math.isfinite(v)]
    value = math.fsum(finite) / len(finite)
    summary = {headline: value, "val_loss": 1 - value, "final_loss": final_loss, "steps": 6}
    summary.update(headline=headline, higher_is_better=True, seed=seed)
    summary.update(metric_names=[headline, "val_loss"], weights_sha256=f"{num:064}")
    (d / "summary.json").write_text(json.dumps(summary))
    if per_sample:
        rows = ["step,sample,tp_fg,headline_fg"]
        rows += [f"6,img_{i:03d}.png,{i},{float(v)!r}" for i, v in enumerate(scores)]
        (d / "val_per_image.csv").write_text("\n".join(rows) + "\n")


def sweep(tmp_path, configs, seeds, per_sample=True, final_losses=None):
    """``configs``: lr -> function(seed) -> per-image scores."""
    out = tmp_path / "sweep"
    num = 0
    for lr, scores in configs.items():
        for s in seeds:
            loss = (final_losses or {}).get((lr, s), 0.5)
            job(out, num, lr, s, scores(s), final_loss=loss, per_sample=per_sample)
            num += 1
    return out


def design(seed_sd, image_sd, shift, key=0):
    """Per-image Dice around 0.7: a seed effect and an image effect each config shares,
    and the group's own effect (its shift, its seed and image noise)."""
    rng = np.random.default_rng(key)
    shared_seed = rng.normal(0, 0.05, 64)
    shared_image = rng.normal(0, 0.08, IMAGES)
    own_seed = rng.normal(0, seed_sd, 64)
    own_image = rng.normal(0, image_sd, IMAGES)
    noise = rng.normal(0, 0.002, (64, IMAGES))

    def base(s):
        return list(0.7 + shared_seed[s] + shared_image + noise[s])

    def group(s):
        return list(
            0.7 + shift + shared_seed[s] + shared_image + own_seed[s] + own_image + noise[s]
        )

    return {"0.05": base, "0.1": group}


def comparison(tmp_path, configs, seeds=range(8), sesoi=None, **kw):
    report = build_report(sweep(tmp_path, configs, seeds, **kw), sesoi=sesoi)
    c = report["comparisons"][0]
    assert c["metric"] == "val_dice"
    return report, c


def test_better_by_more_than_delta_over_seeds_and_samples(tmp_path):
    _, c = comparison(tmp_path, design(0.003, 0.003, 0.03), sesoi=0.01)
    assert c["decision"]["by"] == "seeds and samples" and c["two_level"]["samples"] == [IMAGES]
    assert c["path"] == "seeds and samples (two-level)"
    assert c["outcome"] == "better by more than δ"
    assert (
        c["verdict"].startswith("higher (better) by 0.0")
        and "by more than δ = 0.01" in c["verdict"]
    )


def test_worse(tmp_path):
    _, c = comparison(tmp_path, design(0.003, 0.003, -0.03))
    assert c["outcome"] == "worse" and c["verdict"].startswith("lower (worse) by 0.0")
    # without δ: says which difference the seeds resolve, no seeds_needed for the observed one
    assert "seeds_needed" not in c["decision"] and c["decision"]["resolvable"] < 0.03


def test_equivalent_within_delta_needs_the_90_percent_interval_inside(tmp_path):
    report, c = comparison(tmp_path, design(0.001, 0.001, 0.0005), sesoi=0.01)
    assert c["outcome"] == "equivalent" and c["verdict"].startswith("equivalent within ±0.01")
    lo, hi = c["decision"]["tost"]["ci90"]
    assert -0.01 < lo < hi < 0.01
    # the same runs, a δ inside the interval: not equivalent
    (tmp_path / "again").mkdir()
    _, tight = comparison(tmp_path / "again", design(0.001, 0.001, 0.0005), sesoi=0.0001)
    assert tight["outcome"] != "equivalent"
    assert "δ = 0.01 (--sesoi)" in format_markdown(report, {})


def test_cant_tell_and_the_seeds_delta_needs(tmp_path):
    _, c = comparison(tmp_path, design(0.02, 0.001, 0.002, key=3), seeds=range(4), sesoi=0.01)
    assert c["outcome"] == "can't tell"
    n = c["decision"]["seeds_needed"]
    assert 4 < n < stats.MAX_SEEDS and f"about {n} seeds" in c["verdict"]


def test_the_samples_uncertainty_widens_what_the_seeds_alone_would_call_better(tmp_path):
    """The lab's -0.004 Dice: the same images favour one config (an image effect, fixed
    split), the seeds agree. Seeds alone exclude 0; seeds and samples do not, and the
    samples dominate the variance; more seeds cannot resolve δ then."""
    _, c = comparison(tmp_path, design(0.0003, 0.03, -0.004, key=1), sesoi=0.002)
    assert c["ci95"][1] < 0  # the seeds-only paired t interval
    assert c["decision"]["by"] == "seeds and samples" and c["outcome"] == "can't tell"
    assert c["two_level"]["seed_share"] < 0.1 and "samples 100%, seed x sample 0%" in c["verdict"]
    assert "more seeds cannot resolve" in c["verdict"]


def test_without_per_sample_records_the_seeds_decide_and_it_says_so(tmp_path):
    _, c = comparison(tmp_path, design(0.003, 0.003, 0.03), per_sample=False)
    assert c["decision"]["by"] == "seeds" and "two_level" not in c
    assert "seeds only: 0_seed=0 (the baseline's seed 0): no val_per_image.csv" in c["verdict"]


def test_values_that_differ_by_round_off_are_the_same_not_significant(tmp_path):
    """Two configs whose per-seed values differ by an ulp or two (a metric summed in another
    order): the same, no test -- a t-test of such differences gives p = 1e-58."""
    base = design(0.003, 0.003, 0.0)["0.05"]
    out = sweep(tmp_path, {"0.05": base, "0.1": base}, range(5), per_sample=False)
    for summary in sorted(out.glob("*/summary.json"))[5:]:  # the group's jobs
        record = json.loads(summary.read_text())
        record["val_dice"] = math.nextafter(math.nextafter(record["val_dice"], 2), 2)
        summary.write_text(json.dumps(record))
    baseline = [json.loads(p.read_text())["val_dice"] for p in sorted(out.glob("*/summary.json"))]
    c = build_report(out)["comparisons"][0]
    assert c["group"].endswith("0.1") and c["mean_diff"] > 0  # two ulps apart, each seed
    assert c["within_resolution"] and c.get("p_value") is None and c["outcome"] == "same"
    assert "the same val_dice for every seed, to floating-point resolution" in c["verdict"]
    # a real difference the size of the values' spread is still tested
    moved = [v + 1e-9 * (i + 1) for i, v in enumerate(baseline[:5])]  # a million ulps
    assert stats.paired(baseline[:5], moved)["p_value"] < 0.05
    assert not stats.within_resolution([0.5], [0.5 + 1e-12])


def test_two_seeds_give_no_verdict_and_the_seeds_needed(tmp_path):
    """A clear difference on 2 seeds: no interval, no test (their error rates are not held
    below 3 seeds), the observed difference and the seeds δ needs."""
    report, c = comparison(tmp_path, design(0.003, 0.003, 0.03), seeds=range(2), sesoi=0.01)
    few = c["decision"]["few_seeds"]
    (row,) = [r for r in format_markdown(report, {}).splitlines() if r.startswith("| optim.lr=0.1")]
    assert "| – | no test (fewer than 3 seeds a config) | – | – |" in row  # no interval at all
    assert few["seeds"] == 2 and few["target"] == 0.01 and few["seeds_needed"] >= 2
    assert c["outcome"] == "can't tell" and "ci95" not in c["decision"]
    assert c["verdict"].startswith("can't tell, no test: 2 seeds a config, fewer than 3")
    assert f"about {few['seeds_needed']} seeds would resolve δ at this spread" in c["verdict"]
    assert c["path"] == "no test (fewer than 3 seeds a config)"
    (tmp_path / "three").mkdir()
    _, enough = comparison(tmp_path / "three", design(0.003, 0.003, 0.03), seeds=range(3))
    assert "few_seeds" not in enough["decision"] and "no test" not in enough["verdict"]


def test_a_bounded_metrics_interval_stays_inside_its_bounds_and_a_count_gets_none(tmp_path):
    """Dice near 1 over 3 seeds: the t interval of the mean would reach above 1; the task
    declares [0, 1] (summary.json's metric_bounds) and the report keeps it there. A count
    (val_empty_*) gets its distribution, no interval of a mean."""
    out = tmp_path / "sweep"
    for seed, dice in enumerate([0.999, 0.9995, 0.97]):
        job(out, seed, 0.1, seed, [dice] * 4)
        path = out / f"{seed}_seed={seed}" / "summary.json"
        summary = json.loads(path.read_text())
        summary.update(val_empty_fg=seed, count_metrics=["val_empty_fg"])
        summary["metric_bounds"] = {"val_dice": [0.0, 1.0]}
        summary["metric_names"].append("val_empty_fg")
        path.write_text(json.dumps(summary))
    report = build_report(out)
    (group,) = report["groups"]
    dice, empty = group["metrics"]["val_dice"], group["metrics"]["val_empty_fg"]
    unclipped = stats.mean_interval([0.999, 0.9995, 0.97])["ci95"]
    assert unclipped[1] > 1 and dice["ci95"] == [unclipped[0], 1.0] and dice["bounds"] == [0, 1]
    assert empty["count"] and "ci95" not in empty and empty["max"] == 2
    text = format_markdown(report, {})
    assert "kept inside [0, 1]" in text and "- **val_empty_fg**: a count;" in text


def test_a_collapsed_seed_is_named_and_left_out_of_the_interval(tmp_path):
    """Seed 1 trained to all-background (Dice 0 on every image) in both configs, about 1.5 SD
    from the mean of 5: named as collapsed, not by an outlier rule, and left out of the
    two-level interval, which keeps the images (the 4 other pairs decide)."""
    configs = design(0.003, 0.003, 0.01)

    def collapsing(f):
        return lambda s: [0.0] * IMAGES if s == 1 else f(s)

    collapsed = {k: collapsing(f) for k, f in configs.items()}
    report, c = comparison(tmp_path, collapsed, seeds=range(5))
    assert [(x["side"], x["seed"]) for x in c["collapsed"]] == [("baseline", 1), ("group", 1)]
    assert "predicts none of the scored classes" in c["collapsed"][0]["why"]
    d = c["decision"]
    assert d["excluded"] == 2 and d["n"] == 4 and d["by"] == "seeds and samples"
    assert c["two_level"]["per_seed"] == pytest.approx(
        [np.mean(configs["0.1"](s)) - np.mean(configs["0.05"](s)) for s in (0, 2, 3, 4)]
    )
    assert c["outcome"] == "better" and "2 collapsed jobs left out" in c["verdict"]
    group = report["groups"][0]["metrics"]["val_dice"]
    assert group["outliers"] == [] and [x["seed"] for x in group["collapsed"]] == [1]
    text = format_markdown(report, {})
    assert "**collapsed**: seed 1 (1_seed=1)" in text and "interquartile means" in text
    assert "P(B > A) on a seed 1.00 [0.40, 1.00] (exact)" in text
    # the table's p is the one the verdict rests on, and says which path
    assert c["path"] == "seeds and samples (two-level), collapsed seeds left out"
    (row,) = [r for r in text.splitlines() if r.startswith("| optim.lr=0.1 | val_dice |")]
    assert f"| {c['path']} | {d['p_value']:.2g} |" in row


def test_a_class_a_job_never_predicts_is_named(tmp_path):
    """A segmentation job that never predicts 'boundary' (its tp and fp 0 on every image, its
    fn not): the report names the class beside the job, which is not otherwise collapsed."""
    from repro.records.sample_records import SampleScores, never_predicted

    out = sweep(tmp_path, {"0.05": lambda s: [0.8, 0.6, 0.7]}, range(3))
    rows = ["step,sample,tp_nucleus,fp_nucleus,fn_nucleus,tp_boundary,fp_boundary,"
            "fn_boundary,headline_nucleus,headline_boundary"]  # fmt: skip
    rows += ["6,a,9,1,0,0,0,4,0.9,0.0", "6,b,8,0,2,0,0,3,0.8,0.0", "6,c,5,0,0,0,0,0,1.0,nan"]
    job_dir = out / "1_seed=1"
    (job_dir / "val_per_image.csv").write_text("\n".join(rows) + "\n")
    summary = json.loads((job_dir / "summary.json").read_text())
    summary["val_dice"] = (0.9 + 0.8 + 1.0) / 3 / 2  # the mean over the two classes
    (job_dir / "summary.json").write_text(json.dumps(summary))
    report = build_report(out)
    (listed,) = report["groups"][0]["metrics"]["val_dice"]["never_predicted"]
    assert (listed["seed"], listed["classes"]) == (1, ["boundary"])
    assert "**a class collapsed**: seed 1 (1_seed=1) never predicts boundary" in format_markdown(
        report, {}
    )
    table = {"prediction": ["0", "0", "2"], "target": ["0", "1", "2"]}  # class 1: never
    assert never_predicted(SampleScores(["a", "b", "c"], ["headline"], [[1.0]] * 3, table)) == ["1"]
    assert never_predicted("no val_per_image.csv") == []


def test_a_lower_is_better_metric_is_judged_the_task_s_way(tmp_path):
    """A fork's task whose headline is a distance (HD95 in mm, lower is better) and an extra
    metric it declares lower-is-better (summary.json's metric_directions, from
    Task.higher_is_better_for): the group with smaller values is better on both, and a
    distance of 0 on every image is a perfect score, not a collapse."""
    rng = np.random.default_rng(4)
    noise = rng.normal(0, 0.05, (2, 6, IMAGES))

    def mm(shift, i):
        return lambda s: list(2.0 + shift + noise[i, s])

    out = sweep(tmp_path, {"0.05": mm(0.0, 0), "0.1": mm(-0.5, 1)}, range(6))
    for path in out.glob("*/summary.json"):
        summary = json.loads(path.read_text())
        value = summary.pop("val_dice")
        summary.update(val_hd95=value, val_extra_mm=value, headline="val_hd95")
        summary.update(higher_is_better=False, metric_names=["val_hd95", "val_extra_mm"])
        summary["metric_directions"] = {"val_hd95": False, "val_extra_mm": False}
        path.write_text(json.dumps(summary))
    report = build_report(out, metrics=["val_extra_mm"])
    hd95, extra = report["comparisons"]
    assert (hd95["metric"], extra["metric"]) == ("val_hd95", "val_extra_mm")
    assert hd95["outcome"] == "better" and extra["outcome"] == "better"
    assert extra["verdict"].startswith("lower (better)")
    from repro.records.sample_records import SampleScores, collapse

    perfect = SampleScores(["a", "b"], ["headline"], [[0.0], [0.0]], {})
    declared = {"headline": "val_hd95", "metric_directions": {"val_hd95": False}}
    assert collapse(declared, perfect) is None
    assert collapse({"headline": "val_dice", "higher_is_better": True}, perfect)


def test_a_diverged_seed_is_collapsed(tmp_path):
    _, c = comparison(
        tmp_path, design(0.003, 0.003, 0.03), seeds=range(5), final_losses={("0.1", 2): None}
    )
    assert [(x["side"], x["seed"]) for x in c["collapsed"]] == [("group", 2)]
    assert c["collapsed"][0]["why"].startswith("diverged")


def test_bimodal_seeds_are_named_and_the_pairs_still_decide(tmp_path):
    """Half the seeds land near 0.3, half near 0.8 (no collapse): Shapiro-Wilk rejects a
    normal shape of the values, which the report says beside the medians; the paired
    differences do not share it, and the two-level interval decides: better."""
    rng = np.random.default_rng(7)
    levels = [0.3 if s % 2 else 0.8 for s in range(10)]
    noise = rng.normal(0, 0.01, (10, IMAGES))
    configs = {
        "0.05": lambda s: list(levels[s] + noise[s]),
        "0.1": lambda s: list(levels[s] + 0.02 + noise[s]),
    }
    report, c = comparison(tmp_path, configs, seeds=range(10))
    spread = c["decision"]["distribution"]
    assert any("bimodal or heavy-tailed" in w for w in spread["shape"])
    assert c["outcome"] == "better" and spread["improvement"]["p"] == 1.0
    assert c["decision"]["by"] == "seeds and samples"
    per_seed = [0.3 + noise[s].mean() if s % 2 else 0.8 + noise[s].mean() for s in range(10)]
    assert spread["baseline_median"] == pytest.approx(statistics.median(per_seed), abs=1e-12)
    assert "read the medians beside the mean" in format_markdown(report, {})


def test_several_groups_are_holm_corrected(tmp_path):
    """Three groups against one baseline; the middle p lies between 0.05/2 and 0.05:
    unadjusted it would be better, Holm's step-down keeps it can't tell."""
    d = design(0.01, 0.0001, 0.0, key=11)
    base = d["0.05"]
    rng = np.random.default_rng(12)
    own = rng.normal(0, 0.01, 64)
    configs = {"0.05": base}

    def shifted(shift):
        return lambda s: [v + shift + own[s] for v in base(s)]

    for lr, shift in (("0.1", 0.05), ("0.2", 0.0085), ("0.3", 0.0)):
        configs[lr] = shifted(shift)
    report = build_report(sweep(tmp_path, configs, range(8)))
    cs = {c["group"]: c for c in report["comparisons"]}
    raw = [cs[g]["decision"]["p_value"] for g in ("optim.lr=0.1", "optim.lr=0.2", "optim.lr=0.3")]
    assert raw[1] < 0.05 and cs["optim.lr=0.2"]["decision"]["holm"]["p_value"] >= 0.05
    assert stats.holm(raw) == [cs[g]["decision"]["holm"]["p_value"] for g in cs]
    assert (
        cs["optim.lr=0.1"]["outcome"] == "better" and cs["optim.lr=0.2"]["outcome"] == "can't tell"
    )
    assert "Holm-corrected over 3 comparisons" in cs["optim.lr=0.2"]["verdict"]
    # another metric asked for (--metric val_loss): its three tests join the family
    both = build_report(tmp_path / "sweep", metrics=["val_loss"])["comparisons"]
    assert len(both) == 6 and {c["decision"]["holm"]["comparisons"] for c in both} == {6}
    every = [c["decision"]["p_value"] for c in both]
    assert stats.holm(every) == [c["decision"]["holm"]["p_value"] for c in both]


def test_holm_and_tost_against_hand_computations():
    assert stats.holm([0.01, 0.04, 0.03, None]) == [0.03, 0.06, 0.06, None]
    rng = np.random.default_rng(3)
    diffs = rng.normal(0.002, 0.004, 9)
    se = diffs.std(ddof=1) / 3
    got = stats.tost(diffs.mean(), se, 8, 0.01)
    lower = sps.ttest_1samp(diffs, -0.01, alternative="greater").pvalue
    upper = sps.ttest_1samp(diffs, 0.01, alternative="less").pvalue
    assert got["p_value"] == pytest.approx(max(lower, upper), rel=1e-10)
    half = sps.t.ppf(0.95, 8) * se
    assert got["ci90"] == pytest.approx([diffs.mean() - half, diffs.mean() + half], rel=1e-12)
    assert got["equivalent"] == (max(lower, upper) < 0.05)


def test_one_sample_gives_the_paired_t_test_exactly():
    rng = np.random.default_rng(4)
    a = rng.normal(0.7, 0.05, (6, 1, 1))
    b = a + rng.normal(0.01, 0.01, (6, 1, 1))
    got = stats.two_level([stats.Stratum(a, b)])
    ref = sps.ttest_rel(b.ravel(), a.ravel())
    assert got["p_value"] == pytest.approx(ref.pvalue, rel=1e-9) and got["df"] == 5
    ci = ref.confidence_interval()
    assert got["ci95"] == pytest.approx([ci.low, ci.high], rel=1e-9)


def test_interquartile_mean_is_the_mean_of_the_middle_half():
    values = [5.0, 1.0, 9.0, 3.0, 7.0, 100.0, -50.0, 4.0]
    assert stats.iqm(values) == pytest.approx(statistics.fmean(sorted(values)[2:6]))
    assert stats.iqm(values) == pytest.approx(sps.trim_mean(values, 0.25))
    five = [0.0, 0.8, 0.79, 0.81, 0.8]  # sorted, 1.25 cut from each end: 0.79 and 0.80 at 3/4
    middle = (0.75 * 0.79 + 0.8 + 0.75 * 0.8) / 2.5
    assert stats.iqm(five) == pytest.approx(middle)


def load_script(name, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # its helpers (scripts/_results.py)
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCENARIOS = ["normal", "seeds", "images", "seed x image", "collapsed seed", "non-normal",
             "unpaired", "folds", "folds, 1 seed", "3 seeds", "2 seeds",
             "no per-sample records"]  # fmt: skip


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_no_path_of_the_report_gives_gross_false_positives(scenario, monkeypatch):
    """120 null experiments of each scenario of scripts/report_error_rates.py through the
    report's own comparison: a false-positive rate above 10% or a coverage below 85% at the
    nominal 95% is a gross failure (the 2,000-experiment rates, with their Monte-Carlo
    error, are in benchmarks/)."""
    script = load_script("report_error_rates", monkeypatch)
    assert sorted(SCENARIOS) == sorted(script.SCENARIOS)
    got = script.rates(scenario, 120, key=1, hypotheses=("null",))["null"]
    assert got["called"] <= 0.10, got
    assert got["coverage"] is None or got["coverage"] >= 0.85, got
    if scenario == "2 seeds":  # no test below 3 seeds: no interval printed
        assert got["printed"] == 0 and got["called"] == 0


def _anova(d):
    """The crossed two-way decomposition of ``d[seed, sample]`` by hand: the mean squares of
    seeds, samples and their interaction."""
    s, n = d.shape
    rows, cols, grand = d.mean(1), d.mean(0), d.mean()
    resid = d - rows[:, None] - cols[None, :] + grand
    return n * rows.var(ddof=1), s * cols.var(ddof=1), (resid**2).sum() / ((s - 1) * (n - 1))


def test_the_seed_by_sample_noise_is_counted_once():
    """Paired, unpaired and one config's two-level variance against the method of moments
    of a crossed seeds x samples design computed by hand: ``(MS_seeds + MS_samples -
    MS_interaction) / (S N)`` -- the seeds-only and samples-only variances each hold the
    interaction once, so their sum holds it twice, which is what the report used to give."""
    rng = np.random.default_rng(11)
    base = rng.normal(0.7, 0.05, (6, 50)) + rng.normal(0, 0.02, (6, 1))
    group = base + 0.01 + rng.normal(0, 0.01, (6, 1)) + rng.normal(0, 0.02, (1, 50))
    group += rng.normal(0, 0.05, (6, 50))  # seed x image: the larger part
    ms_r, ms_c, ms_e = _anova(group - base)
    got = stats.two_level([stats.Stratum(base[..., None], group[..., None])])
    assert got["se"] ** 2 == pytest.approx((ms_r + ms_c - ms_e) / 300, rel=1e-9)
    assert got["interaction_var"] == pytest.approx(ms_e / 300, rel=1e-9)
    assert got["seed_var"] == pytest.approx((ms_r - ms_e) / 300, rel=1e-9)
    assert got["se"] ** 2 < (ms_r + ms_c) / 300  # the old sum: the interaction twice
    one = stats.config_interval(group[..., None])
    r, c, e = _anova(group)
    assert one["se"] ** 2 == pytest.approx((r + c - e) / 300, rel=1e-9)
    assert one["mean"] == pytest.approx(group.mean(), rel=1e-12)
    other = group[:5] + rng.normal(0, 0.01, (5, 1))  # other seeds, 5 of them
    got = stats.two_level_unpaired(base[..., None], other[..., None])
    ra, _, ea = _anova(base)
    rb, _, eb = _anova(other)
    column = other.mean(0) - base.mean(0)
    want = ra / 300 + rb / 250 + column.var(ddof=1) / 50 - ea / 300 - eb / 250
    assert got["se"] ** 2 == pytest.approx(want, rel=1e-9)


def test_a_configs_interval_covers_seeds_and_samples_in_the_report(tmp_path):
    """A config whose images vary about as much as its seeds: the report's interval over seeds
    and samples is wider than the seeds-only one, and says which the other holds fixed."""
    configs = design(0.003, 0.003, 0.0)
    report = build_report(sweep(tmp_path, {"0.05": configs["0.05"]}, range(5)))
    s = report["groups"][0]["metrics"]["val_dice"]
    lo, hi = s["two_level"]["ci95"]
    assert hi - lo > 1.15 * (s["ci95"][1] - s["ci95"][0]) and lo < s["mean"] < hi
    assert s["two_level"]["samples"] == IMAGES
    assert "over seeds *and* evaluation samples" in format_markdown(report, {})


def test_medians_iqms_and_p_of_improvement_over_seeds_and_samples(tmp_path):
    """Beside the verdict: each config's median and IQM over its (seed, image) scores and
    their differences, P(B > A) on an image, each with a bootstrap interval over seeds and
    images, and the performance profile -- the same numbers on a second report (keyed), the
    point values as numpy computes them, each interval around its point."""
    from repro.tools.comparisons import plot_comparison

    configs = design(0.003, 0.003, 0.002)
    report, c = comparison(tmp_path, configs, seeds=range(5))
    agg = c["decision"]["distribution"]["aggregates"]
    base = np.array([configs["0.05"](s) for s in range(5)])
    group = np.array([configs["0.1"](s) for s in range(5)])
    assert agg["baseline_median"]["value"] == pytest.approx(np.median(base), abs=1e-12)
    assert agg["group_iqm"]["value"] == pytest.approx(stats.iqm(group.ravel().tolist()), abs=1e-12)
    wins = np.mean((group > base) + 0.5 * (group == base))
    assert agg["improvement"]["value"] == pytest.approx(wins, abs=1e-12)
    for name in ("baseline_median", "group_iqm", "median_diff", "iqm_diff", "improvement"):
        lo, hi = agg[name]["ci95"]
        assert lo <= agg[name]["value"] <= hi and 0 < agg[name]["mc_error"] < hi - lo
    share = agg["profile"]["group"]["share"]
    assert share[0] == 1.0 and all(x >= y for x, y in zip(share, share[1:], strict=False))
    (tmp_path / "again").mkdir()
    _, again = comparison(tmp_path / "again", configs, seeds=range(5))
    assert again["decision"]["distribution"]["aggregates"] == agg  # keyed: the same report
    assert "P(B > A) on a sample" in format_markdown(report, {})
    assert plot_comparison(report, tmp_path) == "comparison.png"
    # a sample a config does not score is no loss: the same scores, half the images unscored
    same = np.full((3, 8, 1), 0.5)
    same[:, ::2] = np.nan
    assert stats.robust_aggregates(same, same.copy(), True)["improvement"]["value"] == 0.5


def test_the_samples_part_is_the_limit_of_a_bootstrap_of_the_samples():
    """The samples' influence (the delta method) against a bootstrap of 4,000 draws of the
    samples, recomputing the headline -- a mean over 3 classes, one absent from a third of
    the images: equal within the draws' Monte-Carlo error; for a plain mean, exactly the
    samples' variance over n."""
    rng = np.random.default_rng(5)
    base = rng.uniform(0.5, 1.0, (4, 120, 3))
    base[:, rng.random(120) < 0.3, 1] = np.nan
    group = base + rng.normal(0, 0.05, base.shape)
    got = stats._sample_piece(stats.influence(group) - stats.influence(base))
    draws = rng.multinomial(120, np.full(120, 1 / 120), 4000)
    with np.errstate(invalid="ignore"):
        boot = np.mean(stats.headline(group, draws) - stats.headline(base, draws), axis=1)
    assert got == pytest.approx(np.var(boot) * 120 / 119, rel=0.08)
    plain = stats._sample_piece(stats.influence(group[..., :1]) - stats.influence(base[..., :1]))
    columns = (group[..., 0] - base[..., 0]).mean(axis=0)
    assert plain == pytest.approx(np.var(columns, ddof=1) / 120, rel=1e-12)


def test_unpaired_configs_that_scored_the_same_images_keep_the_images_part(tmp_path):
    """Configs that ran other seeds (no pair) but scored the same images: the interval that
    decides is two-level (Welch's seeds part plus the images'), not Welch over seeds alone,
    whose false-positive rate is far above 5% when each config has its own image effects
    (400 null experiments here: a gross-failure check; the record is in the note)."""
    rng = np.random.default_rng(7)
    welch = two = 0
    for _ in range(400):
        shared = rng.normal(0, 0.1, 40)
        a, b = (
            0.7 + shared + rng.normal(0, 0.005, (4, 1)) + rng.normal(0, 0.03, 40)
            + rng.normal(0, 0.02, (4, 40))
            for _ in range(2)
        )  # fmt: skip
        welch += (stats.welch(a.mean(1).tolist(), b.mean(1).tolist())["p_value"] or 1) < 0.05
        two += (stats.two_level_unpaired(a[..., None], b[..., None])["p_value"] or 1) < 0.05
    assert welch / 400 > 0.12 and two / 400 < 0.08, (welch, two)
    # in a report: the group's jobs are seeds 3-5, the baseline's 0-2, the same images
    d = design(0.003, 0.003, 0.03)
    out = sweep(tmp_path, {"0.05": d["0.05"]}, range(3))
    for num, s in enumerate(range(3, 6), start=3):
        job(out, num, 0.1, s, d["0.1"](s))
    c = build_report(out)["comparisons"][0]
    assert not c["paired"] and c["decision"]["by"] == "seeds and samples"
    assert c["path"] == "seeds and samples, unpaired (two-level)"
    assert c["two_level"]["samples"] == [IMAGES] and c["two_level"]["sample_var"] > 0
    welch_half = (c["ci95"][1] - c["ci95"][0]) / 2  # Welch over the seeds alone
    assert c["decision"]["se"] ** 2 == pytest.approx(
        c["two_level"]["seed_var"]
        + c["two_level"]["sample_var"]
        + c["two_level"]["interaction_var"],
        rel=1e-12,
    )
    assert c["decision"]["ci95"] != c["ci95"] and welch_half > 0


def test_a_list_difference_is_said_in_words():
    flip = {"_target_": "albumentations.HorizontalFlip", "p": 0.5}
    elastic = {"_target_": "albumentations.ElasticTransform", "alpha": 30}
    crop = {"_target_": "albumentations.RandomCrop", "height": 32}
    norm = {"_target_": "albumentations.Normalize"}
    old, new = [crop, flip, norm], [crop, flip, norm, elastic]
    assert list_change(old, new) == "ElasticTransform(alpha=30) added at position 4"
    assert list_change(new, old) == "ElasticTransform(alpha=30) removed from position 4"
    wider = [crop, {**flip, "p": 0.9}, norm]
    assert list_change(old, wider) == "HorizontalFlip at position 2: p 0.5 -> 0.9"


def test_confirm_confirms_only_a_best_that_beats_every_trial_by_more_than_delta():
    """repro confirm's verdict from the report's outcomes (each trial − rank 1, higher is
    better): confirmed only when every trial is worse by more than δ."""
    from repro.tools.search import confirmation, confirmation_text

    def report(*outcomes, delta=0.01):
        comparisons = [
            {"group": f"trial-{i + 2}", "metric": "val_dice", "outcome": o}
            for i, o in enumerate(outcomes)
        ]
        return {
            "search": {"headline": "val_dice"},
            "baseline": "trial-1",
            "sesoi": {"delta": delta} if delta else None,
            "comparisons": comparisons,
        }

    assert confirmation(report("worse by more than δ", "worse by more than δ"))["confirmed"]
    got = confirmation(report("worse by more than δ", "worse", "equivalent", "can't tell"))
    assert not got["confirmed"] and got["equivalent"] == ["trial-4"]
    assert got["less than δ"] == ["trial-3"] and got["can't tell"] == ["trial-5"]
    text = confirmation_text(got)
    assert text.startswith("**Not confirmed**: `trial-1` is equivalent to `trial-4`")
    assert confirmation(report("worse", delta=None))["confirmed"]  # no δ: better at all
    assert confirmation(report("better", delta=None))["better"] == ["trial-2"]
    few = report("worse by more than δ")  # but the report made no test (2 seeds a trial)
    few["comparisons"][0]["decision"] = {"no_verdict": "2 seeds a config, fewer than 3"}
    assert confirmation(few)["can't tell"] == ["trial-2"] and not confirmation(few)["confirmed"]


def test_a_presets_smallest_effect_is_read_and_is_not_in_the_config_hash(tmp_path):
    """report.sesoi in the baseline's resolved config sets δ (--sesoi wins); it says how
    runs are judged, so the config hash (and so a resume, an evaluation) ignores it."""
    from repro.defense.config import compose, config_hash

    out = sweep(tmp_path, design(0.001, 0.001, 0.0005), range(8))
    for config in out.glob("*/.hydra/config.yaml"):
        config.write_text(config.read_text() + "report:\n  sesoi: 0.02\n")
    report = build_report(out)
    assert report["sesoi"] == {"delta": 0.02, "source": "report.sesoi of the baseline's config"}
    assert report["comparisons"][0]["outcome"] == "equivalent"
    assert build_report(out, sesoi=0.0001)["sesoi"]["delta"] == 0.0001
    assert config_hash(compose([])) == config_hash(compose(["report.sesoi=0.01"]))


def test_folds_count_fold_to_fold_differences_as_the_seeds_part():
    """5 folds x 1 seed: no stratum has two seeds, yet the differences vary from fold to
    fold; the seed part is the paired t-test's over the (seed, fold) pairs, so the interval
    is no narrower than the seeds-only one."""
    rng = np.random.default_rng(9)
    strata = []
    for shift in (0.05, -0.04, 0.03, -0.02, 0.01):
        base = rng.normal(0.7, 0.05, (1, 30, 1))
        strata.append(stats.Stratum(base, base + shift + rng.normal(0, 0.001, (1, 30, 1))))
    got = stats.two_level(strata)
    diffs = got["per_seed"]
    ref = sps.ttest_1samp(diffs, 0.0).confidence_interval()
    width = got["ci95"][1] - got["ci95"][0]
    assert width >= 0.999 * (ref.high - ref.low) and got["p_value"] > 0.05


def test_at_chance_is_a_balanced_accuracy_of_one_over_the_classes(tmp_path):
    from repro.records.sample_records import collapse, read_scores

    def run(name, targets, predictions):
        d = tmp_path / name
        d.mkdir()
        rows = ["step,sample,target,prediction,correct,headline"]
        rows += [
            f"6,{i},{t},{p},{int(t == p)},{float(t == p)!r}"
            for i, (t, p) in enumerate(zip(targets, predictions, strict=True))
        ]
        (d / "val_per_image.csv").write_text("\n".join(rows) + "\n")
        acc = sum(t == p for t, p in zip(targets, predictions, strict=True)) / len(targets)
        summary = {"val_accuracy": acc, "headline": "val_accuracy", "higher_is_better": True}
        return collapse({**summary, "final_loss": 0.1}, read_scores(d, summary))

    imbalanced = [0] * 95 + [1] * 5
    good = [0] * 94 + [1] + [1] * 4 + [0]  # 94% accurate on a 95% majority: not collapsed
    assert run("good", imbalanced, good) is None
    guess = [0] * 90 + [1] * 5 + [0] * 5  # balanced accuracy (90/95 + 0/5) / 2 < 1/2
    assert run("guess", imbalanced, guess).startswith("at chance (balanced accuracy 0.4737")
    assert run("one", imbalanced, [0] * 100).startswith("one class everywhere (predicts class 0")


def test_the_command_line_takes_sesoi_and_refuses_a_bad_one(tmp_path, capsys):
    from repro.cli import main

    out = sweep(tmp_path, design(0.001, 0.001, 0.0005), range(8))
    assert main(["report", str(out), "--sesoi", "0.01", "--out", str(tmp_path / "r")]) == 0
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["sesoi"] == {"delta": 0.01, "source": "--sesoi"}
    assert report["comparisons"][0]["outcome"] == "equivalent"
    assert "equivalent within ±0.01" in capsys.readouterr().out
    for bad in ("0", "-1", "nan", "x"):
        with pytest.raises(SystemExit) as exit_:
            main(["report", str(out), "--sesoi", bad])
        assert exit_.value.code == 2
        assert f"--sesoi: {bad!r} is not a positive difference" in capsys.readouterr().err
