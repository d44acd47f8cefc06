"""End to end, as a user runs it: the same bits twice, whatever the loader; seeds matter."""

import json
import math
import multiprocessing
import os
import re
import subprocess

import pytest
import torch
import yaml

import launch
from conftest import (
    ROOT,
    SMALL_DATA,
    run_train,
    train_cmd,
    train_here,
    user_env,
    with_tests_on_path,
)
from repro.base.rng import derive_seed

SUMMARY_KEYS = {"weights_sha256", "steps", "final_loss", "val_accuracy", "seed", "device"}
# a sweep's jobs, short and small: what is tested is the sweep, not the training
TINY = ["trainer.max_steps=4", "trainer.eval_every=4", *SMALL_DATA, "model.width=8"]


@pytest.fixture(scope="module")
def strict_runs(traced_runs):
    """Short strict runs of seed 0 (conftest: trained once for the suite): twice with
    loader=single, once with loader=multi; and seed 1."""
    return traced_runs


@pytest.mark.e2e
def test_strict_twice_gives_identical_bits(strict_runs):
    a, b = strict_runs["a"], strict_runs["b"]
    assert SUMMARY_KEYS <= a.summary.keys()
    assert a.summary["steps"] == 40 and len(a.losses) == 40
    assert a.summary["weights_sha256"] == b.summary["weights_sha256"]
    assert a.losses == b.losses  # every per-step loss, exactly
    assert a.summary["final_loss"] == b.summary["final_loss"]


@pytest.mark.e2e
def test_loader_workers_do_not_change_the_bits(strict_runs):
    a, multi = strict_runs["a"], strict_runs["multi"]
    assert multi.summary["num_workers"] == 2 and a.summary["num_workers"] == 0
    assert multi.summary["weights_sha256"] == a.summary["weights_sha256"]
    assert multi.losses == a.losses


@pytest.mark.e2e
def test_seeds_change_the_bits_and_zero_is_a_seed(strict_runs):
    a, one = strict_runs["a"], strict_runs["seed1"]
    assert a.summary["seed"] == 0 and one.summary["seed"] == 1
    assert one.summary["weights_sha256"] != a.summary["weights_sha256"]
    assert one.losses != a.losses
    # seed 0 was really applied (not skipped as falsy): the global RNGs got its derived seeds
    assert a.entry("seed torch")["value"] == derive_seed(0, "global", 2)
    assert one.entry("seed torch")["value"] == derive_seed(1, "global", 2)


@pytest.mark.e2e
def test_run_directory_holds_config_report_metrics_checkpoint_summary(strict_runs):
    d = strict_runs["a"].dir
    for name in (
        ".hydra/config.yaml",
        "determinism.json",
        "determinism.txt",
        "metrics.csv",
        "eval.csv",
        "checkpoint.pt",
        "summary.json",
    ):
        assert (d / name).is_file(), name
    assert not list(d.glob(".*.tmp"))  # atomic writes left no temporaries


def test_fast_and_amp_run_and_report_what_they_set(tmp_path):
    short = ["trainer.max_steps=4", "trainer.eval_every=4", *SMALL_DATA, "model.width=8"]
    fast = train_here(tmp_path / "fast", *short, "determinism=fast")
    assert fast.summary["determinism"] == "fast"
    assert fast.entry("cudnn.benchmark")["value"] is True
    assert fast.entry("cuda.matmul.allow_tf32")["value"] is True
    assert fast.entry("use_deterministic_algorithms")["value"] is False

    amp = train_here(tmp_path / "amp", *short, "amp=on")
    assert amp.summary["amp"] == "bfloat16"
    assert amp.entry("amp")["value"].startswith("bfloat16 autocast")
    assert "determinism report" in amp.output  # logged at start

    fp16 = train_here(tmp_path / "fp16", *short, "amp=on", "amp.dtype=float16")
    assert fp16.summary["amp"] == "float16" and fp16.entry("amp")["note"] == "GradScaler on"
    assert fp16.summary["weights_sha256"] != amp.summary["weights_sha256"]


@pytest.mark.e2e
def test_multirun_makes_one_directory_per_seed_named_by_seed(tmp_path):
    """Under paths.sweep_dir (conf/paths: where this machine writes runs)."""
    proc = launch.run(
        train_cmd("-m", "seed=0,1", *TINY, "paths.sweep_dir=sweeps"),
        cwd=tmp_path,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    jobs = sorted(p.parent.name for p in tmp_path.glob("sweeps/*/*/*/summary.json"))
    assert jobs == ["0_seed=0", "1_seed=1"] and not (tmp_path / "multirun").exists()


@pytest.mark.e2e
def test_default_run_learns(train_run):
    """`make train`'s config, default loader included, over a third of its steps (a CI
    budget; the whole run is checked by hand from a fresh clone, README): accuracy well above
    chance (10 classes; 0.79 at 100 steps on the 2-core CPU)."""
    run = train_run("default", "loader=multi", "trainer.max_steps=100")
    assert run.summary["steps"] == 100
    assert run.summary["val_accuracy"] > 0.6
    assert run.summary["headline"] == "val_accuracy"
    assert run.summary["device"] in ("cpu", "cuda")
    assert run.summary["weights_sha256"] in run.output and "val accuracy" in run.output


@pytest.mark.e2e
def test_make_help_lists_the_targets():
    out = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True).stdout
    for target in ("help", "install", "train", "test", "lint", "clean"):
        assert f"make {target} " in out


@pytest.mark.e2e
def test_two_sweeps_in_the_same_second_do_not_collide(tmp_path):
    """The configured sweep dir with its date and time frozen (as if both started in the same
    second): what is left of the pattern must still keep the two sweeps apart. The jobs fail
    at once (a model that cannot be built), after Hydra has made their directories, each of
    which then records the failure."""
    pattern = yaml.safe_load((ROOT / "conf" / "train.yaml").read_text())["hydra"]["sweep"]["dir"]
    frozen = re.sub(r"\$\{now:[^}]*\}", "same-second", pattern)
    assert frozen != pattern
    cmd = train_cmd("-m", "seed=0", *TINY, "model.width=0", f"hydra.sweep.dir={frozen}")
    procs = [
        launch.popen(
            cmd,
            cwd=tmp_path,
            env=user_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for p in procs:
        assert p.wait(timeout=600) == 1 and "could not be built" in p.communicate()[1]
    jobs = sorted(tmp_path.glob("multirun/**/0_seed=0/error.json"))
    assert len(jobs) == 2 and jobs[0].parent != jobs[1].parent


@pytest.mark.e2e
def test_a_model_added_by_one_module_and_one_yaml(tmp_path):
    """The README's recipe: a module on the path and a YAML in a config group; no loop edit."""
    (tmp_path / "mylab").mkdir()
    (tmp_path / "mylab" / "__init__.py").write_text("")
    (tmp_path / "mylab" / "models.py").write_text(
        "from torch import nn\n\n\n"
        "class TinyMLP(nn.Module):\n"
        "    def __init__(self, num_classes, in_channels=3, hidden=256, image_size=32):\n"
        "        super().__init__()\n"
        "        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size**2, hidden),\n"
        "                                 nn.ReLU(), nn.Linear(hidden, num_classes))\n\n"
        "    def forward(self, x):\n"
        "        return self.net(x)\n"
    )
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "tiny_mlp.yaml").write_text(
        "_target_: mylab.models.TinyMLP\nhidden: 64\n"
    )
    env = user_env()
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    run = run_train(
        tmp_path / "run",
        f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
        "model=tiny_mlp",
        "trainer.max_steps=3",
        "trainer.eval_every=3",
        *SMALL_DATA,
        env=env,
    )
    assert "TinyMLP" in run.output
    assert run.summary["steps"] == 3


def test_an_error_mid_run_leaves_no_loader_worker_behind(tmp_path):
    """The workers ignore SIGTERM (pre-emption is the main process's to handle), so one left
    alive after an error would hold the process at exit forever: the loop stops them."""
    failing = ["model._target_=sweep_models.FailsOnRank", "+model.fail_rank=0"]
    with pytest.raises(RuntimeError, match="this rank's forward fails") as error:
        train_here(tmp_path / "x", *TINY, "trainer.max_steps=8", "loader=multi", *failing)
    # the traceback still holds the loop's frame (and its loader), as at a process's exit
    assert error.traceback and multiprocessing.active_children() == []


@pytest.mark.e2e
def test_an_error_mid_run_ends_the_process_with_the_default_loader(tmp_path):
    failing = ["model._target_=sweep_models.FailsOnRank", "+model.fail_rank=0"]
    proc = launch.run(
        train_cmd(f"hydra.run.dir={tmp_path / 'x'}", *TINY, "trainer.max_steps=8", *failing),
        cwd=tmp_path,
        env=with_tests_on_path(),
        capture_output=True,
        text=True,
        timeout=120,  # it hung forever before the loop stopped its workers
        real=True,  # the hang was at the interpreter's exit
    )
    assert proc.returncode == 1 and "this rank's forward fails" in proc.stderr
    # one line on the terminal; the traceback is kept in the run's log
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: RuntimeError: this rank's forward fails") and "train.log" in last
    assert "Traceback" not in proc.stderr
    assert "Traceback" in (tmp_path / "x" / "train.log").read_text()


def test_a_new_run_does_not_keep_an_earlier_attempts_eval_rows(tmp_path):
    """resume=auto where an earlier attempt died before its first checkpoint: the run starts
    at step 0, and its eval.csv holds its own evaluations only."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "determinism.json").write_text("{}")  # the earlier attempt's report ...
    (run_dir / "eval.csv").write_text("step,val_loss,val_accuracy\n4,9.0,0.0\n8,9.0,0.0\n")
    run = train_here(run_dir, *TINY, "trainer.eval_every=2", "trainer.resume=auto")
    rows = (run_dir / "eval.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows] == ["step", "2", "4"]
    assert rows[-1].endswith(repr(run.summary["val_accuracy"]))


def test_json_files_stay_valid_json_when_a_value_is_not_finite(tmp_path):
    """A diverged loss or the Dice of a class that never occurs is null in summary.json,
    env.json and report.json, not a bare NaN (which strict JSON parsers refuse)."""
    from repro.records.rundir import write_json

    write_json(tmp_path / "s.json", {"loss": float("nan"), "dice": [float("inf"), 0.5], "n": 3})

    def refuse(constant):
        raise AssertionError(f"{constant} in JSON")

    loaded = json.loads((tmp_path / "s.json").read_text(), parse_constant=refuse)
    assert loaded == {"loss": None, "dice": [None, 0.5], "n": 3}


@pytest.mark.parametrize(
    "model, log_every",
    [(["model.width=8"], 10), (["model=resnet18", "model.width=4"], 2)],
    ids=["groupnorm-unread", "batchnorm-read"],
)
def test_a_loss_that_is_not_finite_stops_the_run_after_a_checkpoint_of_the_last_finite_step(
    model, log_every, tmp_path
):
    """optim.lr=1e6 diverges within a few steps. The loop reads the steps' values in blocks
    of trainer.log_every steps (no digest, evaluation or checkpoint in between here), and
    copies the state far less often (repro.engine.nonfinite): the step that is not finite
    comes inside a block whose later steps ran on -- with log_every=10 in the first block
    read, with 2 after blocks read but not copied. Either way the run must stop at that step
    with nothing of it or later applied, logged or saved (BatchNorm's running statistics
    included), and keep the checkpoint of the step before it: the whole state (weights,
    optimizer, schedule, generators) bit for bit as the uninterrupted run
    (trainer.on_nonfinite=continue) checkpointed it."""
    from repro.base.errors import Diverged
    from repro.records.checkpoint import content_sha256, load_checkpoint

    diverging = [*TINY, *model, "optim.lr=1e6", "trainer.max_steps=40"]
    diverging += [f"trainer.log_every={log_every}"]
    diverging += ["trainer.eval_every=40", "trainer.trace_every=0"]
    with pytest.raises(Diverged, match=r"^step (\d+): the loss is (nan|inf)") as err:
        train_here(tmp_path / "stop", *diverging, "trainer.checkpoint_every=0")
    message = str(err.value)
    bad = int(message.split(":")[0].split()[1])
    first_read = log_every if log_every < 10 else 1  # a block read and held before it
    assert first_read < bad < 10, "the divergence is to come where the docstring says"
    kept = tmp_path / "stop" / "checkpoints" / f"step-{bad - 1:08d}.pt"
    assert f"last finite step's checkpoint is {kept}" in message
    assert "\n" not in message and not (tmp_path / "stop" / "summary.json").exists()
    assert sorted((tmp_path / "stop" / "checkpoints").glob("step-*.pt")) == [kept]
    state = load_checkpoint(kept)
    assert state["step"] == bad - 1
    assert all(bool(torch.isfinite(v).all()) for v in state["model"].values())

    went_on = train_here(
        tmp_path / "on",
        *diverging,
        "trainer.on_nonfinite=continue",
        "trainer.checkpoint_every=1",
        "trainer.keep_checkpoints=50",
    )
    assert went_on.summary["steps"] == 40
    assert json.loads((tmp_path / "on" / "summary.json").read_text())["final_loss"] is None
    theirs = load_checkpoint(tmp_path / "on" / "checkpoints" / f"step-{bad - 1:08d}.pt")
    for part in ("model", "optimizer", "schedule", "scaler", "rng", "ema", "last"):
        assert content_sha256({part: state[part]}) == content_sha256({part: theirs[part]}), part
    # the rows up to the step that diverged, as the uninterrupted run wrote them; none after
    stopped = (tmp_path / "stop" / "metrics.csv").read_text().splitlines()
    assert stopped == (tmp_path / "on" / "metrics.csv").read_text().splitlines()[: bad + 1]
    trace = [json.loads(line) for line in (tmp_path / "stop" / "trace.jsonl").open()]
    assert [r["step"] for r in trace] == list(range(bad + 1))
    assert trace[-1]["loss"] is None or not math.isfinite(trace[-1]["loss"])


def test_a_loader_error_met_while_looking_ahead_comes_after_the_step_before_it(
    tmp_path, monkeypatch
):
    """The loop fetches step s+1's batches during step s. A loader error there (a corrupt
    image) is raised when step s+1 comes: step s is trained and checkpointed first, as
    without the look-ahead."""
    import repro.engine.loop
    from repro.base.errors import DataError

    real, calls = repro.engine.loop.next_step_batches, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:  # the batches of step 5, fetched during step 4
            raise DataError("data: cannot read image bad.png")
        return real(*args, **kwargs)

    monkeypatch.setattr(repro.engine.loop, "next_step_batches", failing)
    run_dir = tmp_path / "run"
    with pytest.raises(DataError, match="bad.png"):
        train_here(run_dir, *TINY, "trainer.max_steps=8", "trainer.checkpoint_every=4")
    assert (run_dir / "checkpoints" / "step-00000004.pt").is_file()
    assert (run_dir / "metrics.csv").read_text().splitlines()[-1].startswith("4,")


def test_debug_smoke_runs_the_pipeline_in_four_steps(tmp_path):
    run = train_here(tmp_path / "smoke", "debug=smoke", *SMALL_DATA, "model.width=8")
    assert run.summary["steps"] == 4
    evaluated = (run.dir / "eval.csv").read_text().splitlines()[1:]
    assert [line.split(",")[0] for line in evaluated] == ["2", "4"]
    kept = sorted(p.name for p in (run.dir / "checkpoints").glob("step-*.pt"))
    assert kept == ["step-00000004.pt"] and (run.dir / "best.pt").is_file()


def test_debug_overfit_trains_on_one_batch_until_it_fits(tmp_path):
    """The traced steps' inputs (1, 20, ..., 120) all have the first step's digest, and the
    loss on that batch falls far below its start."""
    run = train_here(
        tmp_path / "overfit",
        "debug=overfit",
        *SMALL_DATA,
        "model.width=8",
        "trainer.max_steps=120",
        "trainer.trace_every=20",
    )
    records = [json.loads(line) for line in (run.dir / "trace.jsonl").read_text().splitlines()]
    batches = [json.dumps(r["batch"]) for r in records if r.get("batch")]
    assert len(batches) == 7 and len(set(batches)) == 1
    losses = [float(x) for x in run.losses]
    assert losses[-1] < 0.2 * losses[0]
