"""Seed sweeps: `repro report` (table, mean, SD, t interval, outliers, failed jobs),
the parallel launcher preset (same bits as sequential), `repro rerun` (same bits alone)."""

import json
import os
import shutil
import statistics
import subprocess
import sys

import pytest

import launch
from conftest import ROOT, train_cmd, user_env
from repro.report import describe, outliers, t_quantile, write_report

TINY = [
    "trainer.max_steps=6",
    "trainer.eval_every=3",
    "data.train_size=512",
    "data.val_size=128",
    "model.width=8",
]


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


def repro(*args, cwd=None):
    return launch.run(
        [sys.executable, "-m", "repro", *args],
        capture_output=True,
        text=True,
        env=user_env(),
        cwd=cwd,
    )


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


@pytest.mark.e2e
def test_parallel_launcher_gives_the_sequential_bits(sequential, tmp_path):
    """Two jobs at once (one round of the 2 joblib workers: a CI budget), the sequential
    sweep's first two jobs (lr 0.05, seeds 0 and 1), job by job."""
    proc, sweep_dir = sweep(
        tmp_path, "optim.lr=0.05", "seed=0,1", "hydra/launcher=parallel", real=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Joblib.Parallel(n_jobs=2" in proc.stdout + proc.stderr
    parallel, reference = digests(sweep_dir), digests(sequential)
    assert sorted(parallel) == ["0_seed=0", "1_seed=1"]
    assert parallel == {name: reference[name] for name in parallel}


@pytest.mark.e2e
def test_rerun_one_job_alone_gives_its_bits(sequential):
    job = next(sequential.glob("4_*"))
    out = repro("rerun", str(job))
    assert out.returncode == 0, out.stdout + out.stderr
    weights = json.loads((job / "summary.json").read_text())["weights_sha256"]
    assert out.stdout.splitlines()[0] == f"identical: 6 steps, weights {weights}"
    (rerun_dir,) = (job / "rerun").iterdir()
    assert json.loads((rerun_dir / "summary.json").read_text())["weights_sha256"] == weights


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
def test_report_errors_are_one_line(sequential, tmp_path):
    out = repro("report", str(tmp_path / "nope"))
    assert out.returncode == 2 and out.stderr.strip().endswith("no such sweep directory.")
    out = repro("report", str(tmp_path))
    assert out.returncode == 2 and "no job directories" in out.stderr
    for name, content, expected in (
        (".hydra/overrides.yaml", b"- seed=0\n- [unclosed\n", "overrides.yaml: not valid YAML"),
        ("summary.json", b'{"val_accuracy": 0.5, \xff', "summary.json: not JSON"),
    ):
        copy = tmp_path / name.replace("/", "_")
        shutil.copytree(sequential, copy)
        (next(copy.glob("1_*")) / name).write_bytes(content)
        out = repro("report", str(copy))
        assert out.returncode == 2 and expected in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


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
    stats = describe(values)
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
