"""Seed sweeps: `repro report` (table, mean, SD, t interval, outliers, failed jobs; groups
and directories compared seed by seed), the parallel launcher preset (same bits as
sequential). `repro rerun` (same bits alone) is tested on a search's trial, in
test_search.py: the same command, with the search's overrides to leave out."""

import json
import math
import os
import shutil
import statistics
import subprocess
import sys

import pytest
import scipy.stats as scipy_stats  # the dev extra's reference statistics

import launch
from conftest import ROOT, TINY, repro, train_cmd, user_env
from optional import require
from repro.tools.report import outliers, write_report
from repro.tools.stats import mean_interval, t_quantile


def sweep(cwd, *overrides, real=False):
    """`python train.py -m ...` in cwd; returns (completed process, the sweep directory).
    ``real``: a real interpreter (joblib's loky workers, started from a forked test process,
    keep it from exiting for minutes)."""
    env = user_env(
        PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    )
    cwd.mkdir(parents=True, exist_ok=True)
    proc = launch.run(
        train_cmd("-m", *TINY, *overrides),
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        real=real,
    )
    (sweep_dir,) = (cwd / "multirun").glob("*/*/")
    return proc, sweep_dir


def digests(sweep_dir):
    return {
        p.parent.name: json.loads(p.read_text())["weights_sha256"]
        for p in sweep_dir.glob("*/summary.json")
    }


@pytest.fixture(scope="module")
def sequential(tmp_path_factory):
    proc, sweep_dir = sweep(tmp_path_factory.mktemp("seq"), "optim.lr=0.05,0.1", "seed=0,1,2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep_dir


@pytest.mark.e2e
def test_report_gives_a_table_and_the_distribution_per_group(sequential):
    out = repro("report", str(sequential))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "6 jobs: 6 finished, 0 failed, 0 incomplete" in text
    assert "## optim.lr=0.05" in text and "## optim.lr=0.1" in text  # grouped by all but seed
    assert "| 0_seed=0 | 0 | ok |" in text and "| 5_seed=2 | 2 | ok |" in text
    assert text.count("(Student t, n=3, df=2, t=4.303)") == 6  # 3 metrics x 2 groups
    report = json.loads((sequential / "report.json").read_text())
    for group in report["groups"]:
        lr = group["overrides"][0]
        accs = [j["val_accuracy"] for j in group["jobs"]]
        stats = group["metrics"]["val_accuracy"]
        assert [j["seed"] for j in group["jobs"]] == [0, 1, 2], lr
        assert stats["mean"] == statistics.fmean(accs)
        assert stats["sd"] == statistics.stdev(accs)
        half = 4.302652729911275 * stats["sd"] / 3**0.5
        assert stats["ci95"] == pytest.approx([stats["mean"] - half, stats["mean"] + half])
        assert group["distinct_weights"] == 3
    assert (sequential / "report.md").read_text().startswith("# Sweep report")
    for png in ("report-0.png", "report-1.png"):  # the curves of each group, with matplotlib
        assert (sequential / png).stat().st_size > 10_000


@pytest.mark.e2e
def test_a_failed_job_is_reported_and_the_others_still_are(tmp_path):
    proc, sweep_dir = sweep(
        tmp_path, "model._target_=sweep_models.FailsForSeed", "+model.fail_seed=1", "seed=0,1,2"
    )
    assert proc.returncode == 1  # the sweep says a job failed ...
    assert sorted(digests(sweep_dir)) == ["0_seed=0", "2_seed=2"]  # ... after running the rest
    out = repro("report", str(sweep_dir))
    assert out.returncode == 1
    assert "3 jobs: 2 finished, 1 failed, 0 incomplete" in out.stdout
    assert "| 1_seed=1 | 1 | **failed** |" in out.stdout
    assert "this model refuses seed 1" in out.stdout
    assert "(Student t, n=2, df=1, t=12.706)" in out.stdout
    # the job's one line, then the sweep's: no second copy, no Hydra lines about it
    lines = proc.stderr.strip().splitlines()
    assert sum("this model refuses seed 1" in line for line in lines) == 1, proc.stderr[-2000:]
    assert lines[-1] == (
        f"error: a job of the sweep failed (1_seed=1: above); its other jobs ran: "
        f"repro report {sweep_dir.resolve()} lists them all"
    ), lines[-3:]
    assert "Error executing job" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr


@pytest.mark.parametrize("basic", [True, False])
def test_a_failed_job_that_said_why_gets_no_lines_from_hydra(basic, monkeypatch, capsys):
    """Hydra's sweepers read a job's result through JobReturn.return_value, which writes
    "Error executing job with overrides" for a failed one; train.py's JobFailed (the job has
    said why) skips that line, and ends a basic sweep with its own one line."""
    from hydra.core.utils import JobReturn, JobStatus

    from repro.base.errors import JobFailed
    from repro.engine.callbacks import quiet_reported_failures

    monkeypatch.setattr(JobReturn, "return_value", JobReturn.__dict__["return_value"])
    quiet_reported_failures(basic)
    failed = JobReturn(overrides=["seed=1"], status=JobStatus.FAILED)
    failed.return_value = JobFailed("a job of the sweep failed (1_seed=1: above)")
    with pytest.raises(SystemExit if basic else JobFailed):
        _ = failed.return_value
    err = capsys.readouterr().err
    assert err == ("error: a job of the sweep failed (1_seed=1: above)\n" if basic else "")
    other = JobReturn(overrides=["seed=2"], status=JobStatus.FAILED)
    other.return_value = ValueError("not reported by the job")  # Hydra's behaviour, kept
    with pytest.raises(ValueError):
        _ = other.return_value
    assert capsys.readouterr().err.startswith("Error executing job with overrides: ['seed=2']")
    done = JobReturn(overrides=["seed=3"], status=JobStatus.COMPLETED)
    done.return_value = 0.5
    assert done.return_value == 0.5


@pytest.fixture(scope="module")
def parallel(tmp_path_factory):
    """Two jobs at once (one round of the 2 joblib workers: a CI budget): lr 0.05, seeds 0
    and 1, the sequential sweep's first two jobs; another day's sweep, for the report."""
    require("hydra_plugins.hydra_joblib_launcher", "pip install -e '.[dev]'")
    proc, sweep_dir = sweep(
        tmp_path_factory.mktemp("par"),
        "optim.lr=0.05",
        "seed=0,1",
        "hydra/launcher=parallel",
        real=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Joblib.Parallel(n_jobs=2" in proc.stdout + proc.stderr
    return sweep_dir


@pytest.mark.e2e
def test_submitit_requeues_a_preempted_job_which_resumes_to_the_sequential_bits(
    sequential, tmp_path
):
    """hydra/launcher=submitit_local (the SLURM launcher's local executor): each job gets
    the pre-emption notice (SIGUSR2) after step 3; it checkpoints there, submitit requeues
    it, and with trainer.resume=auto it resumes: the sequential sweep's bits, and a report."""
    require("hydra_plugins.hydra_submitit_launcher", "pip install -e '.[dev]'")
    os.environ["REPRO_FAULT_KILL_AFTER_STEP"] = "3"  # the jobs inherit the sweep's
    os.environ["REPRO_FAULT_SIGNAL"] = "SIGUSR2"
    try:
        proc, sweep_dir = sweep(tmp_path, "optim.lr=0.05", "seed=0,1", "trainer.resume=auto",
                                "hydra/launcher=submitit_local", real=True)  # fmt: skip
    finally:
        del os.environ["REPRO_FAULT_KILL_AFTER_STEP"], os.environ["REPRO_FAULT_SIGNAL"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    for job in ("0_seed=0", "1_seed=1"):
        summary = json.loads((sweep_dir / job / "summary.json").read_text())
        assert [r["step"] for r in summary["resumes"]] == [3], job  # requeued, resumed
    assert digests(sweep_dir) == {k: v for k, v in digests(sequential).items() if k[0] in "01"}
    out = repro("report", str(sweep_dir))
    assert out.returncode == 0 and "2 jobs: 2 finished" in out.stdout, out.stderr


@pytest.mark.e2e
def test_parallel_launcher_gives_the_sequential_bits(sequential, parallel):
    parallel, reference = digests(parallel), digests(sequential)
    assert sorted(parallel) == ["0_seed=0", "1_seed=1"]
    assert parallel == {name: reference[name] for name in parallel}


@pytest.mark.e2e
def test_report_without_matplotlib_still_writes_the_text(sequential, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(sequential), str(copy)], check=True)
    for png in copy.glob("*.png"):
        png.unlink()
    report, text, written = write_report(copy)
    assert "matplotlib is not installed" in text and report["figures"] == []
    assert not list(copy.glob("*.png")) and (copy / "report.json").is_file()


@pytest.mark.e2e
def test_report_on_a_received_sweep_writes_nothing_through_its_links(sequential, tmp_path):
    """A received sweep with links planted at report.md, report.json and the figures' names
    (and one at a name a report does not write): the report replaces each link it writes
    by its file; what the links lead to is left byte for byte."""
    copy = tmp_path / "received"
    subprocess.run(["cp", "-r", str(sequential), str(copy)], check=True)
    victims = tmp_path / "victims"
    victims.mkdir()
    names = ["report.md", "report.json", "report.png", "report-0.png", "report-1.png"]
    names += ["comparison.png"]
    for name in names:
        (copy / name).unlink(missing_ok=True)
        (victims / name).write_bytes(b"the user's own file\n")
        (copy / name).symlink_to(victims / name)
    _, _, written = write_report(copy)
    assert {p.name for p in written} >= {"report.md", "report.json"}
    for path in written:
        assert not path.is_symlink() and path.stat().st_size > 0, path
    for name in names:
        assert (victims / name).read_bytes() == b"the user's own file\n", name


@pytest.mark.e2e
def test_report_errors_are_one_line(sequential, tmp_path):
    out = repro("report", str(tmp_path / "nope"))
    assert out.returncode == 2 and out.stderr.strip().endswith("no such sweep directory.")
    out = repro("report", str(tmp_path))
    assert out.returncode == 2 and "no job directories" in out.stderr
    for name, content, expected in (
        (".hydra/overrides.yaml", b"- seed=0\n- [unclosed\n", "overrides.yaml: not valid YAML"),
        ("summary.json", b'{"val_accuracy": 0.5, \xff', "summary.json: not JSON"),
        (".hydra/config.yaml", laughs(9), "config.yaml: expands to over 200,000 values"),
    ):
        copy = tmp_path / name.replace("/", "_")
        shutil.copytree(sequential, copy)
        (next(copy.glob("1_*")) / name).write_bytes(content)
        out = repro("report", str(copy))
        assert out.returncode == 2 and expected in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def laughs(levels: int) -> bytes:
    """A "billion laughs": each level a list of 10 aliases of the one before (10^levels)."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return ("\n".join(lines) + "\nseed: 0\n").encode()


def test_a_received_yaml_is_bounded_before_it_is_expanded(tmp_path):
    """A run's YAML records (read by report, compare, evaluate, rerun) are refused in one
    line past their size, depth or expansion, without building them: at once, not hours."""
    from repro.base.errors import ReproError
    from repro.base.files import YAML_MAX_BYTES, YAML_MAX_DEPTH, load_yaml

    path = tmp_path / "config.yaml"
    path.write_bytes(laughs(4))  # about 123,000 values through aliases: under the bound
    assert len(load_yaml(path)["a4"]) == 10
    for content, expected in (
        (laughs(9), "expands to over 200,000 values (anchors and aliases)"),
        (b"x: " + b"[" * (YAML_MAX_DEPTH + 1) + b"]" * (YAML_MAX_DEPTH + 1), "nested over"),
        (b"# " + b"x" * YAML_MAX_BYTES + b"\nseed: 0\n", "bytes, over"),
    ):
        path.write_bytes(content)
        with pytest.raises(ReproError) as err:
            load_yaml(path)
        assert str(err.value).startswith(f"{path}: ") and expected in str(err.value)
        assert "\n" not in str(err.value)


def test_t_quantiles_match_the_tables():
    for df, t in [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (29, 2.045)]:
        assert round(t_quantile(0.975, df), 3) == t


def test_outliers_beyond_two_sd_are_flagged():
    class J:
        def __init__(self, seed, v):
            self.seed, self.summary, self.dir = (
                seed,
                {"val_accuracy": v},
                type("D", (), {"name": f"{seed}"}),
            )

    values = [0.80, 0.81, 0.79, 0.80, 0.80, 0.80, 0.50]
    jobs = [J(i, v) for i, v in enumerate(values)]
    stats = mean_interval(values)
    flagged = outliers(jobs, "val_accuracy", stats)
    assert [f["seed"] for f in flagged] == [6] and flagged[0]["z"] < -2


@pytest.mark.e2e
def test_a_diverged_seed_does_not_break_the_report(sequential, tmp_path):
    copy = tmp_path / "nan"
    subprocess.run(["cp", "-r", str(sequential), str(copy)], check=True)
    job = next(copy.glob("1_*"))
    rows = (job / "metrics.csv").read_text().splitlines()
    rows[3:] = [
        ",".join([r.split(",")[0], r.split(",")[1], "nan", "nan", r.split(",")[-1]])
        for r in rows[3:]
    ]
    (job / "metrics.csv").write_text("\n".join(rows) + "\n")
    summary = json.loads((job / "summary.json").read_text())
    summary["final_loss"] = float("inf")
    (job / "summary.json").write_text(json.dumps(summary))
    report, text, _ = write_report(copy)
    assert "no figure" not in text and report["figures"]
    group = next(g for g in report["groups"] if any(j["job"] == job.name for j in g["jobs"]))
    assert group["metrics"]["final_loss"]["n"] == 2  # inf left out of the statistics
    assert group["metrics"]["val_accuracy"]["n"] == 3


@pytest.mark.e2e
def test_resumed_jobs_stay_in_their_group(sequential, tmp_path):
    copy = tmp_path / "resumed"
    subprocess.run(["cp", "-r", str(sequential), str(copy)], check=True)
    job = next(copy.glob("2_*"))
    overrides = job / ".hydra" / "overrides.yaml"
    overrides.write_text(overrides.read_text() + "- trainer.resume=auto\n")
    report, _, _ = write_report(copy)
    assert [len(g["jobs"]) for g in report["groups"]] == [3, 3]


@pytest.mark.e2e
def test_jobs_of_a_killed_sweep_that_never_started_are_listed(sequential, tmp_path):
    """A sweep SIGKILLed during its second job: one finished, one incomplete, four never
    started. The report counts the six jobs the sweep planned (from its multirun.yaml), not
    the two directories it finds."""
    copy = tmp_path / "killed"
    shutil.copytree(sequential, copy)
    for job in copy.glob("[2-5]_*"):
        shutil.rmtree(job)
    (next(copy.glob("1_*")) / "summary.json").unlink()
    report, text, _ = write_report(copy)
    assert "6 jobs planned: 1 finished, 0 failed, 1 incomplete, 4 never started" in text
    assert (report["jobs"], report["not_started"]) == (6, 4)
    missing = [j for g in report["groups"] for j in g["jobs"] if j["status"] == "not started"]
    assert sorted(j["job"] for j in missing) == ["2", "3", "4", "5"]
    assert {j["seed"] for j in missing} == {0, 1, 2}
    assert [len(g["jobs"]) for g in report["groups"]] == [3, 3]  # each lr's three seeds
    assert repro("report", str(copy)).returncode == 1
    # killed (SIGTERM, say) before its first checkpoint: started, not "never started"
    shutil.rmtree(next(copy.glob("1_*")) / "checkpoints")
    report, text, _ = write_report(copy)
    (early,) = [j for g in report["groups"] for j in g["jobs"] if j["status"] == "incomplete"]
    assert early["error"].startswith("started (its launch is recorded), no checkpoint yet")
    assert "never started" not in early["error"] and report["not_started"] == 4


def values(report, group, metric="val_accuracy"):
    """{seed: value} of a report group's finished jobs."""
    (g,) = [g for g in report["groups"] if g["title"] == group]
    return {j["seed"]: j[metric] for j in g["jobs"] if j["status"] == "ok"}


@pytest.mark.e2e
def test_two_groups_of_a_sweep_are_compared_seed_by_seed(sequential, tmp_path):
    """lr 0.05 and 0.1 over seeds 0-2: the second against the first, paired over the three
    seeds, numbers as SciPy's; --baseline turns it round; --metric adds one."""
    out = repro("report", str(sequential), "--metric", "val_loss", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["baseline"] == "optim.lr=0.05"
    acc, loss = report["comparisons"]
    assert (acc["group"], acc["metric"], loss["metric"]) == (
        "optim.lr=0.1",
        "val_accuracy",
        "val_loss",
    )
    for c in (acc, loss):  # the loss is continuous: its pairs are told apart by value
        a, b = (
            values(report, "optim.lr=0.05", c["metric"]),
            values(report, "optim.lr=0.1", c["metric"]),
        )
        ref = scipy_stats.ttest_rel([b[s] for s in (0, 1, 2)], [a[s] for s in (0, 1, 2)])
        assert c["paired"] and c["n"] == 3 and c["seeds"] == [0, 1, 2]
        diffs = [b[s] - a[s] for s in (0, 1, 2)]
        assert c["mean_diff"] == pytest.approx(statistics.fmean(diffs), abs=1e-15)
        assert c["sd_diff"] == pytest.approx(statistics.stdev(diffs), abs=1e-15)
        if math.isfinite(ref.pvalue):  # SciPy gives NaN for differences with no spread
            assert c["p_value"] == pytest.approx(ref.pvalue, rel=1e-8)
            ci = ref.confidence_interval()
            assert c["ci95"] == pytest.approx([ci.low, ci.high], rel=1e-8)
        welch = scipy_stats.ttest_ind(list(b.values()), list(a.values()), equal_var=False)
        assert c["welch"]["p_value"] == pytest.approx(welch.pvalue, rel=1e-8, nan_ok=True)
    assert len(set(values(report, "optim.lr=0.1", "val_loss").values())) == 3
    assert acc["config_differs"] == ["optim.lr: 0.05 -> 0.1"] and not acc["environment_differs"]
    n = acc["decision"]["n"]  # the pairs the deciding test used (collapsed jobs left out)
    assert acc["verdict"] in out.stdout and f"| optim.lr=0.1 | val_accuracy | {n} | " in out.stdout
    # the per-sample records are read: each group's headline gets its interval over seeds
    # and the 128 validation samples; a collapsed job (these tiny runs often are) is named
    # and left out of the comparison's interval, the loss (no per-sample records) by seeds
    for g in report["groups"]:
        assert g["metrics"]["val_accuracy"]["two_level"]["samples"] == 128
    kept = {0, 1, 2} - {x["seed"] for x in acc["collapsed"]}  # pairs with no collapsed side
    assert acc["decision"]["n"] == len(kept)
    if len(kept) >= 2:
        assert acc["two_level"]["samples"] == [128]
    assert loss["decision"]["by"] == "seeds"
    assert (tmp_path / "comparison.png").stat().st_size > 10_000
    flipped = repro("report", str(sequential), "--baseline", "optim.lr=0.1", "--out", str(tmp_path))
    assert flipped.returncode == 0, flipped.stderr
    (back,) = json.loads((tmp_path / "report.json").read_text())["comparisons"]
    assert back["mean_diff"] == pytest.approx(-acc["mean_diff"], abs=1e-15)
    assert back["group"] == "optim.lr=0.05"


@pytest.mark.e2e
def test_two_sweep_directories_are_compared_by_seed(sequential, parallel, tmp_path):
    """Another day's sweep (the parallel one: lr 0.05, seeds 0 and 1) against this one's lr
    0.05 group: paired over the two seeds both ran, the same bits, seed 2 listed as left
    out; environments that differ are labelled as such."""
    out = repro(
        "report",
        str(sequential),
        str(parallel),
        "--baseline",
        f"{sequential} optim.lr=0.05",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    (written,) = (tmp_path / "reports").iterdir()  # several directories: a new folder here
    report = json.loads((written / "report.json").read_text())
    assert report["dirs"] == [str(sequential), str(parallel)]
    same = next(c for c in report["comparisons"] if c["group"].startswith(parallel.name))
    assert same["paired"] and same["seeds"] == [0, 1] and same["same_weights"] == 2
    assert same["mean_diff"] == 0 and same["config_differs"] == []
    assert same["verdict"].startswith("the same val_accuracy for every seed")
    assert [(x["side"], x["seed"]) for x in same["left_out"]] == [("baseline", 2)]
    other = next(c for c in report["comparisons"] if c["group"].endswith("optim.lr=0.1"))
    assert other["n"] == 3 and other["config_differs"] == ["optim.lr: 0.05 -> 0.1"]
    # yesterday's sweep on another torch: still paired by seed, but labelled
    moved = tmp_path / "other-torch"
    shutil.copytree(parallel, moved)
    for path in moved.glob("*/summary.json"):
        summary = json.loads(path.read_text())
        summary["environment"]["torch"] = "2.0.0"
        path.write_text(json.dumps(summary))
    report, text, _ = write_report([sequential, moved], tmp_path / "env")
    (c,) = [c for c in report["comparisons"] if c["group"].startswith("other-torch")]
    assert c["environment_differs"] == [f"torch: {c_torch(sequential)} vs 2.0.0"]
    assert c["verdict"].startswith("across environments: ")


def c_torch(sweep_dir):
    return json.loads(next(sweep_dir.glob("*/summary.json")).read_text())["environment"]["torch"]


@pytest.mark.e2e
def test_a_failed_seed_is_left_out_of_the_pairs_and_listed(sequential, tmp_path):
    copy = tmp_path / "failed"
    shutil.copytree(sequential, copy)
    job = next(copy.glob("4_*"))  # lr 0.1, seed 1
    (job / "summary.json").unlink()
    (job / "error.json").write_text(json.dumps({"type": "RuntimeError", "message": "boom"}))
    report, text, _ = write_report(copy)
    (c,) = report["comparisons"]
    assert c["paired"] and c["seeds"] == [0, 2] and c["n"] == 2
    a, b = values(report, "optim.lr=0.05"), values(report, "optim.lr=0.1")
    assert c["mean_diff"] == pytest.approx(statistics.fmean(b[s] - a[s] for s in (0, 2)))
    left = {(x["side"], x["seed"]): x["why"] for x in c["left_out"]}
    assert left == {
        ("group", 1): "failed",
        ("baseline", 1): "no finished job of the group has this seed",
    }
    assert "left out: seed 1 of the group (failed)" in text


@pytest.mark.e2e
def test_runs_directories_compare_too_and_bad_choices_are_one_line(sequential, tmp_path):
    """Two single runs (one seed each) compare unpaired, with no spread to judge by; a
    baseline or metric that names nothing is one line."""
    run_a, run_b = next(sequential.glob("0_*")), next(sequential.glob("3_*"))
    report, text, _ = write_report([run_a, run_b], tmp_path / "runs")
    (c,) = report["comparisons"]
    assert not c["paired"] and c["n"] == 2 and "no spread to judge by" in c["verdict"]
    for args, expected in (
        (["--baseline", "optim.lr=0.3"], "--baseline 'optim.lr=0.3' names no group; the groups:"),
        (["--baseline", "trainer.max_steps=6"], "names 2 groups"),
        (["--metric", "val_dice"], "--metric val_dice: not a metric of the baseline's jobs"),
    ):
        out = repro("report", str(sequential), "--out", str(tmp_path / "x"), *args)
        assert out.returncode == 2 and expected in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.e2e
def test_confirm_ranks_a_seed_sweep_by_each_configs_mean_and_picks_fresh_seeds(sequential):
    """`repro confirm` on a plain sweep: a config that ran several seeds is ranked by its
    mean over them, not by its luckiest seed; the fresh seeds are those the sweep did not
    use (the re-runs themselves are tested on a search, tests/test_search.py)."""
    from repro.tools.search import fresh_seeds, top_trials

    trials, used, headline = top_trials(sequential, 2)
    report, _, _ = write_report(sequential, sequential.parent / "ranked")
    means = {g["title"]: g["metrics"][headline]["mean"] for g in report["groups"]}
    assert used == [0, 1, 2] and headline == "val_accuracy"
    assert [t.value for t in trials] == sorted(means.values(), reverse=True)
    assert all(t.seeds == [0, 1, 2] for t in trials)
    assert fresh_seeds(used, 3) == [3, 4, 5] and fresh_seeds([1, 3], 3) == [0, 2, 4]


# `repro report` on sweep directories fabricated as a finished sweep leaves them (no training)
HUGE = "1" + "0" * 400  # a JSON integer; float() of it raises OverflowError
DEEP = "[" * 100_000 + "]" * 100_000  # json.loads raises RecursionError
MULTIRUN = """hydra:
  sweeper:
    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper
    params: null
  overrides:
    task: ['seed={seeds}']
"""


def fake_sweep(sweep, values, planned=None):
    """A `python train.py -m seed=...` sweep's directory: job ``num_seed=S`` per (seed,
    val_accuracy, val_loss) of ``values`` (.hydra/, summary.json; a value None is JSON's
    null, as a non-finite one is written), and multirun.yaml planning seeds ``planned``."""
    for num, (seed, acc, loss) in enumerate(values):
        job = sweep / f"{num}_seed={seed}"
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(f"- seed={seed}\n")
        (job / ".hydra" / "config.yaml").write_text(f"seed: {seed}\n")
        summary = {"val_accuracy": acc, "val_loss": loss, "final_loss": 0.5, "steps": 6}
        summary.update(headline="val_accuracy", higher_is_better=True, seed=seed)
        summary.update(metric_names=["val_accuracy", "val_loss"], weights_sha256=f"{num:064}")
        (job / "summary.json").write_text(json.dumps(summary))
    if planned:
        (sweep / "multirun.yaml").write_text(MULTIRUN.format(seeds=",".join(map(str, planned))))
    return sweep


def test_a_summary_holding_what_no_run_writes_is_one_line_naming_it(tmp_path, capsys):
    from repro.cli import main
    from repro.tools.report import build_report

    for name, text in (
        ("huge", '{"val_accuracy": ' + HUGE + ', "headline": "val_accuracy"}'),
        ("deep", DEEP),
        ("deep-value", '{"val_accuracy": ' + DEEP + "}"),
        ("array", "[0.5]"),
        ("names", '{"val_accuracy": 0.5, "metric_names": 3}'),
    ):
        sweep = fake_sweep(tmp_path / name, [(0, 0.5, 1.0), (1, 0.6, 0.9)])
        (sweep / "1_seed=1" / "summary.json").write_text(text)
        assert main(["report", str(sweep)]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith(f"repro report: {sweep / '1_seed=1' / 'summary.json'}: "), err[:300]
        assert len(err.strip().splitlines()) == 1 and len(err) < 400, err[:300]
    # a failed job's error.json that cannot be read is a failed job whose error is unknown
    sweep = fake_sweep(tmp_path / "error", [(0, 0.5, 1.0), (1, 0.6, 0.9)])
    (sweep / "1_seed=1" / "summary.json").unlink()
    for text in (DEEP, '{"message": ' + HUGE + "}", "[1]"):
        (sweep / "1_seed=1" / "error.json").write_text(text)
        (g,) = build_report(sweep)["groups"]
        assert g["jobs"][1]["status"] == "failed", text[:20]
        assert g["jobs"][1]["error"] == "error.json is unreadable (cut short or damaged)"


def test_the_report_says_which_values_it_left_out_of_the_statistics(tmp_path):
    """Jobs that finished with trainer.on_nonfinite=continue (summary.json writes their NaN
    or infinite loss as null), and values that are not numbers: named, metric by metric."""
    from repro.tools.report import build_report, format_markdown

    values = [(0, 0.5, None), (1, 0.6, None), (2, "0.7", None), (3, math.nan, None)]
    report = build_report(fake_sweep(tmp_path / "sweep", values))
    (g,) = report["groups"]
    assert g["metrics"]["val_accuracy"]["n"] == 2 and g["metrics"]["final_loss"]["n"] == 4
    text = format_markdown(report, {})
    assert "- **val_loss**: non-finite in every finished job (4)." in text
    assert "no finished job" not in text
    assert (
        "  - left out: 2_seed=2 (seed 2): not a number ('0.7'); 3_seed=3 (seed 3): non-finite"
        in text
    )
    assert text.count("left out") == 1  # final_loss: every job's


def test_the_same_directory_twice_is_read_once(tmp_path, capsys):
    from repro.tools.report import build_report

    sweep = fake_sweep(tmp_path / "sweep", [(0, 0.5, 1.0), (1, 0.6, 0.9), (2, 0.7, 0.8)])
    (tmp_path / "link").symlink_to(sweep)
    for again in (sweep, tmp_path / "link", sweep / "1_seed=1"):
        report = build_report([sweep, again])
        assert report["jobs"] == 3 and report["dirs"] == [str(sweep)], again
        (g,) = report["groups"]
        assert g["metrics"]["val_accuracy"]["n"] == 3 and len(g["jobs"]) == 3
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"repro report: {again}: ") and "once" in line, line


def test_a_finished_job_without_its_launch_record_is_listed_as_finished(tmp_path):
    """A job whose .hydra/ is gone is finished (it has summary.json), not "never started":
    in its group where the sweep's plan names it, else listed on its own."""
    import shutil

    from repro.tools.report import build_report, format_markdown

    values = [(0, 0.5, 1.0), (1, 0.6, 0.9), (2, 0.7, 0.8), (7, 0.9, 0.1)]
    sweep = fake_sweep(tmp_path / "sweep", values, planned=[0, 1, 2, 3])
    shutil.rmtree(sweep / "1_seed=1" / ".hydra")
    shutil.move(sweep / "3_seed=7", sweep / "9_seed=7")  # a job the plan does not name
    shutil.rmtree(sweep / "9_seed=7" / ".hydra")
    report = build_report(sweep)
    assert (report["jobs"], report["ok"], report["not_started"]) == (4, 3, 1)
    (g,) = report["groups"]
    assert [(j["job"], j["status"], j["launch_record"]) for j in g["jobs"]] == [
        ("0_seed=0", "ok", True),
        ("1_seed=1", "ok", False),
        ("2_seed=2", "ok", True),
        ("3", "not started", True),
    ]
    assert g["metrics"]["val_accuracy"]["n"] == 3
    assert g["jobs"][1]["rerun"] == "python train.py seed=1"  # repro rerun needs .hydra/
    text = format_markdown(report, {})
    assert "4 jobs planned: 3 finished, 0 failed, 0 incomplete, 1 never started" in text
    assert "; 1 more job directory without a launch record (at the end)" in text
    assert "- 1_seed=1 (seed 1): its launch record (.hydra/) is gone: its overrides" in text
    ((unplaced),) = report["unplaced"]
    assert unplaced["job"] == "9_seed=7" and unplaced["error"].startswith("finished; its launch")
    # every planned job finished, and one directory in no group: the report is not all yes
    from repro.cli import main

    other = fake_sweep(tmp_path / "other", [(0, 0.5, 1.0), (1, 0.6, 0.9)], planned=[0, 1])
    assert main(["report", str(other), "--out", str(tmp_path / "o1")]) == 0
    shutil.copytree(sweep / "9_seed=7", other / "9_seed=7")
    assert main(["report", str(other), "--out", str(tmp_path / "o2")]) == 1
