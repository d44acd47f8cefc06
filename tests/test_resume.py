"""Exact resume: kill anywhere (SIGKILL included), resume, same bits; and nothing lost.

Each scenario is compared with the uninterrupted run of the same config: identical
`weights_sha256`, identical metrics.csv (so every per-step loss before and after the resume
point), and `repro compare` finds the traces identical. The runs that are killed or
signalled are separate processes (`python train.py`), killed from outside (the storms of
SIGKILLs, SIGTERM, SIGUSR1/2, Ctrl-C); runs that die on an error, the uninterrupted runs
and the resumes train in this process (conftest.train_here), so the bits are also shown
not to depend on which process trained them. Which checkpoint a resume may use (damaged,
foreign, from before a config key existed): test_resume_checkpoints.py."""

import csv
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import launch
from conftest import (
    ROOT,
    SMALL_DATA,
    Run,
    one_thread,
    train_cmd,
    train_here,
    user_env,
    with_tests_on_path,
)
from repro.base.errors import (
    INTERRUPTED_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    CheckpointError,
    ConfigError,
)
from repro.components.tasks import Classification
from repro.records.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint, sidecar
from repro.records.trace import state_dict_sha256
from repro.tools.compare import compare_dirs

STEPS = 40
# strict (the default), 2 loader workers, dropout on (the ConvNet's default 0.1, at width 16)
BASE = [
    f"trainer.max_steps={STEPS}",
    "trainer.eval_every=20",
    "trainer.log_every=1",  # every step on disk at once: the test sees where the run is
    "trainer.trace_every=5",
    "loader=multi",
    "loader.num_workers=2",
    "model.width=16",
    "data.val_size=128",
]
SCENARIOS = {
    # 2048 samples / 64 = 32 steps an epoch: checkpoints at 10, 20, 30 are mid-epoch
    "mid-epoch": [*BASE, "data.train_size=2048", "trainer.checkpoint_every=10"],
    # 1024 / 64 = 16 steps an epoch: the checkpoint at step 16 is an epoch boundary
    "epoch-boundary": [*BASE, "data.train_size=1024", "trainer.checkpoint_every=16"],
    # bf16 autocast on a CPU is slow: a narrower ConvNet on 16x16 images (what resumes is
    # the same)
    "bf16": [
        *BASE,
        "data.train_size=2048",
        "amp=on",
        "trainer.checkpoint_every=10",
        "model.width=8",
        "data.image_size=16",
    ],
}


def metrics(run_dir: Path) -> str:
    return (run_dir / "metrics.csv").read_text()


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.csv"
    return max(0, len(path.read_text().splitlines()) - 1) if path.exists() else 0


def interrupt(
    run_dir: Path, overrides: list[str], after: int, sig=signal.SIGKILL, group: bool = False
):
    """Start train.py and send `sig` from outside once `after` steps are on disk (with
    `group`, to its whole process group, loader workers included, as a terminal does).
    Returns (exit status, steps on disk when the signal was sent)."""
    proc = launch.popen(
        train_cmd(f"hydra.run.dir={run_dir}", *overrides),
        cwd=run_dir.parent,
        env=user_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=group,
    )
    deadline = time.monotonic() + 300
    while steps_done(run_dir) < after:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"run ended before step {after}:\n{proc.communicate()[0]}")
        time.sleep(0.002)
    at = steps_done(run_dir)
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, at, out


class Crash(Exception):
    """What :func:`crash` raises inside the loop."""


def crash(run_dir: Path, overrides: list[str], after: int) -> None:
    """Train in this process until an exception after step ``after``: a run that dies on an
    error, leaving its checkpoints (the SIGKILLed runs are the storms' and the signals')."""

    def fail(done: int, model) -> None:
        if done == after:
            raise Crash(f"after step {done}")

    with pytest.raises(Crash):
        train_here(run_dir, *overrides, after_step=fail)


def resume(run_dir: Path, overrides: list[str], *extra: str) -> Run:
    """Resume in this process (``trainer.resume=auto``)."""
    return train_here(run_dir, *overrides, "trainer.resume=auto", *extra)


def uninterrupted(base: Path):
    """The uninterrupted run of each scenario, trained on first use into ``base`` (started
    with resume=auto in a fresh directory, as a requeued cluster job is: there is nothing to
    resume, so it starts)."""
    cache: dict[str, Run] = {}

    def get(name: str) -> Run:
        if name not in cache:
            cache[name] = train_here(base / name, *SCENARIOS[name], "trainer.resume=auto")
        return cache[name]

    return get


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return uninterrupted(tmp_path_factory.mktemp("straight"))


def assert_same_as(run: Run, reference: Run) -> None:
    assert run.summary["weights_sha256"] == reference.summary["weights_sha256"]
    assert metrics(run.dir) == metrics(reference.dir)  # every step's loss, grad norm, lr
    result = compare_dirs(reference.dir, run.dir)
    assert result.identical, result.text()
    assert result.lines[0].startswith(f"identical: {STEPS} steps")
    # the best evaluation's checkpoint too, wherever the run was interrupted
    assert run.summary["best"] == reference.summary["best"]
    assert best_weights(run) == best_weights(reference)


def best_weights(run: Run) -> str:
    return state_dict_sha256(load_checkpoint(run.dir / "best.pt")["model"])


@pytest.mark.e2e
@pytest.mark.parametrize("scenario", ["epoch-boundary", "bf16"])  # mid-epoch: the storms below
def test_a_crash_then_resume_gives_the_uninterrupted_bits(scenario, straight, tmp_path):
    overrides = SCENARIOS[scenario]
    every = int(next(o for o in overrides if "checkpoint_every" in o).split("=")[1])
    run_dir = tmp_path / "run"
    crash(run_dir, overrides, after=every * 2 + 5)  # between two checkpoints
    resumed = resume(run_dir, overrides)
    assert resumed.summary["resumes"][0]["step"] == every * 2
    assert_same_as(resumed, straight(scenario))


@pytest.mark.e2e
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_preemption_signal_checkpoints_at_the_step_boundary_and_exits_75(sig, straight, tmp_path):
    overrides = SCENARIOS["mid-epoch"]
    run_dir = tmp_path / "run"
    status, at, out = interrupt(run_dir, overrides, after=25, sig=sig)
    assert status == PREEMPTED_EXIT_CODE == 75, out
    stopped = steps_done(run_dir)  # the step it finished before stopping
    assert checkpoint_path(run_dir, stopped).is_file() and stopped >= at
    assert f"{sig.name} received: stopped after step {stopped}/{STEPS}" in out
    resumed = resume(run_dir, overrides)
    assert resumed.summary["resumes"][0]["step"] == stopped
    assert_same_as(resumed, straight("mid-epoch"))


@pytest.mark.e2e
def test_ctrl_c_checkpoints_at_the_step_boundary_and_exits_130(straight, tmp_path):
    """SIGINT to the whole process group (what a terminal's Ctrl-C does; the loader workers
    get it too) during training."""
    overrides = SCENARIOS["mid-epoch"]
    run_dir = tmp_path / "run"
    status, at, out = interrupt(run_dir, overrides, after=25, sig=signal.SIGINT, group=True)
    assert status == INTERRUPTED_EXIT_CODE == 130, out
    stopped = steps_done(run_dir)
    assert checkpoint_path(run_dir, stopped).is_file() and stopped >= at
    assert f"SIGINT received: stopped after step {stopped}/{STEPS}" in out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    resumed = resume(run_dir, overrides)
    assert resumed.summary["resumes"][0]["step"] == stopped
    assert_same_as(resumed, straight("mid-epoch"))


CTRL_C = [
    "trainer.max_steps=12",
    "trainer.eval_every=4",
    "trainer.checkpoint_every=4",
    "trainer.log_every=1",
    "data.train_size=512",
    "data.val_size=64",
    "trainer.eval_batch_size=16",  # 4 evaluation forwards per evaluation
    "loader=multi",
    "~model",
    "+model._target_=sweep_models.CtrlCInEvaluation",
    "+model.width=8",
    "+model.at_eval=6",  # the second evaluation (after step 8), mid-way
]


def ctrl_c_run(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return launch.run(
        train_cmd(f"hydra.run.dir={run_dir}", *CTRL_C, *extra),
        cwd=run_dir.parent,
        env=with_tests_on_path(),
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )


@pytest.mark.e2e
def test_ctrl_c_during_evaluation_finishes_it_checkpoints_and_exits_130(tmp_path):
    proc = ctrl_c_run(tmp_path / "run")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 130, out
    assert "SIGINT received: stopped after step 8/12" in out and "Traceback" not in out
    assert checkpoint_path(tmp_path / "run", 8).is_file()
    assert len((tmp_path / "run" / "eval.csv").read_text().splitlines()) == 3  # header, 4, 8


@pytest.mark.e2e
def test_a_second_ctrl_c_stops_at_once_and_the_last_checkpoint_still_resumes(tmp_path):
    run_dir = tmp_path / "run"
    proc = ctrl_c_run(run_dir, "+model.presses=2")
    assert proc.returncode == 130, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("interrupted: stopped at once.") and "trainer.resume=auto" in last
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not checkpoint_path(run_dir, 8).exists()  # stopped in step 8's evaluation
    # at_eval=0: no Ctrl-C in this process (it is pytest's); the differing key is recorded
    again = [*CTRL_C, "+model.presses=2", "model.at_eval=0", "trainer.resume_force=true"]
    resumed = train_here(run_dir, *again, "trainer.resume=auto")
    assert resumed.summary["resumes"][0]["step"] == 4 and resumed.summary["steps"] == 12


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS], ids=["full", "read-only"])
def test_a_full_or_read_only_disk_is_one_line_and_the_run_resumes_exactly(
    code, straight, tmp_path, monkeypatch
):
    """The step-20 checkpoint's write fails (a patched writer: the CI machine's root can
    write anywhere): one line naming the file, the free space, the last good checkpoint
    and the resume command; the resume from step 10 gives the uninterrupted bits."""
    import repro.records.checkpoint

    overrides = SCENARIOS["mid-epoch"]
    run_dir = tmp_path / "run"
    real = repro.records.checkpoint.save_checkpoint

    def failing(path, state):
        if state["step"] == 20 and Path(path).parent.name == "checkpoints":
            raise OSError(code, os.strerror(code), str(path))
        return real(path, state)

    monkeypatch.setattr(repro.records.checkpoint, "save_checkpoint", failing)
    with pytest.raises(CheckpointError) as err:
        train_here(run_dir, *overrides)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"cannot write {run_dir}/checkpoints/")
    assert os.strerror(code) in message and "MiB free there" in message
    assert "last good checkpoint is" in message and "step-00000010.pt" in message
    assert f"trainer.resume=auto hydra.run.dir={run_dir}" in message
    monkeypatch.setattr(repro.records.checkpoint, "save_checkpoint", real)
    assert_same_as(resume(run_dir, overrides), straight("mid-epoch"))


def test_a_run_directory_without_room_for_two_checkpoints_is_refused_before_training(
    tmp_path, monkeypatch
):
    import shutil as shutil_module

    usage = shutil_module.disk_usage(tmp_path)
    monkeypatch.setattr(
        "repro.records.rundir.shutil.disk_usage", lambda p: usage._replace(free=64 * 1024)
    )
    with pytest.raises(CheckpointError, match=r"0.1 MiB free, and two checkpoints of this model"):
        train_here(tmp_path / "run", *SCENARIOS["mid-epoch"])
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not (tmp_path / "run" / "metrics.csv").exists()  # no step was trained


@pytest.mark.e2e
def test_a_storm_of_kills_ends_on_the_uninterrupted_bits(straight, tmp_path):
    """Five SIGKILLs, mid-epoch checkpoints; the relaunches alternate between 2 loader
    workers and none (so both loaders are killed, mid-write included, and each resumes what
    the other wrote). The first kill comes right after the first checkpoint is renamed into
    place, before its checksum sidecar (injected at that point: tests/faults), so no earlier
    checkpoint exists to fall back on; two come after a seeded random number of steps, two
    while a checkpoint is being written (its temporary file exists: fsync is slowed to 0.3 s
    in these processes), one with each loader. Each relaunch resumes with
    trainer.resume=auto, and a last resume runs to the end. The uninterrupted run it must
    match used 2 workers throughout."""
    import random

    run_dir = tmp_path / "run"
    faults = os.pathsep.join([str(ROOT / "tests" / "faults"), str(ROOT)])
    schedule = random.Random(0)
    kinds = ["sidecar", "writing", "steps", "steps", "writing"]  # multi, single, multi, ...
    caught = {"multi": 0, "single": 0}  # kills while a checkpoint was being written
    for i, kind in enumerate(kinds):
        loader = "multi" if i % 2 == 0 else "single"
        overrides = [*SCENARIOS["mid-epoch"], f"loader={loader}", "trainer.resume=auto"]
        fault = {"REPRO_FAULT_KILL_AFTER_RENAME": "step-00000010.pt"} if kind == "sidecar" else {}
        proc = launch.popen(
            train_cmd(f"hydra.run.dir={run_dir}", *overrides),
            cwd=tmp_path,
            env=user_env(PYTHONPATH=faults, REPRO_FAULT_SLOW_FSYNC="0.3", **fault),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        target = steps_done(run_dir) + schedule.randint(1, 6)
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            if kind == "steps" and steps_done(run_dir) >= target:
                break
            if kind == "writing" and list((run_dir / "checkpoints").glob(".*.tmp")):
                caught[loader] += 1
                break
            time.sleep(0.002)
        proc.kill()
        proc.wait()
        if kind == "sidecar":  # killed by itself, at that point: the only checkpoint so far
            assert proc.returncode == -signal.SIGKILL
            assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-00000010.pt"]
    assert all(caught.values()), f"no kill during a checkpoint write with a loader: {caught}"
    resumed = resume(run_dir, SCENARIOS["mid-epoch"])
    assert resumed.summary["resumes"][0]["step"] == 10  # the checkpoint without a sidecar
    assert_same_as(resumed, straight("mid-epoch"))
    for path in (run_dir / "checkpoints").glob("step-*.pt"):
        assert sidecar(path).is_file()  # restored, for sha256sum -c


@pytest.mark.e2e
def test_a_crash_between_write_and_rename_leaves_the_previous_checkpoint(straight, tmp_path):
    """The process dies (os._exit) after step 30's checkpoint was written and fsynced but
    before its rename: the temporary file is left, step 20's checkpoint is intact."""
    overrides = SCENARIOS["mid-epoch"]
    run_dir = tmp_path / "run"
    crash = (
        "import os, runpy, sys\n"
        "real = os.replace\n"
        "def replace(src, dst, *a, **k):\n"
        "    if str(dst).endswith('step-00000030.pt'):\n"
        "        os._exit(70)\n"
        "    return real(src, dst, *a, **k)\n"
        "os.replace = replace\n"
        f"sys.argv = [{str(ROOT / 'train.py')!r}, *sys.argv[1:]]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    proc = launch.run(
        [sys.executable, "-c", crash, f"hydra.run.dir={run_dir}", *one_thread(overrides)],
        env=user_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 70, proc.stderr[-2000:]
    folder = run_dir / "checkpoints"
    assert list(folder.glob(".step-00000030.pt.*.tmp"))  # the interrupted write
    assert not checkpoint_path(run_dir, 30).exists()
    resumed = resume(run_dir, overrides)
    assert resumed.summary["resumes"][0]["step"] == 20
    assert not list(folder.glob("*.tmp"))
    assert "removed .step-00000030.pt." in resumed.output
    assert_same_as(resumed, straight("mid-epoch"))


@pytest.mark.e2e
def test_best_pt_is_the_checkpoint_of_the_best_evaluation(straight):
    """best.pt holds the state after the step whose evaluation had the best headline (the
    first of equal ones), verified by its sidecar; summary.json names it."""
    run = straight("mid-epoch")
    headline = run.summary["headline"]
    with open(run.dir / "eval.csv") as f:
        evaluations = [(float(row[headline]), int(row["step"])) for row in csv.DictReader(f)]
    assert len(evaluations) == 2
    value = max(v for v, _ in evaluations)  # accuracy: higher is better
    step = next(s for v, s in evaluations if v == value)
    assert run.summary["best"] == {
        "step": step,
        "metric": headline,
        "value": value,
        "file": "best.pt",
    }
    best = load_checkpoint(run.dir / "best.pt")  # refuses a file its sidecar does not match
    assert best["step"] == step and best["best"]["step"] == step
    trace = [json.loads(line) for line in (run.dir / "trace.jsonl").read_text().splitlines()]
    traced = next(r for r in trace if r.get("step") == step and r.get("weights_sha256"))
    assert state_dict_sha256(best["model"]) == traced["weights_sha256"]


class HighestLossIsBest(Classification):
    """A task whose best evaluation is the one with the highest loss: an early one, which
    later evaluations do not beat (the test below needs a best before the resume point)."""

    headline = "val_loss"
    higher_is_better = True


@pytest.mark.e2e
def test_a_best_evaluation_before_the_resume_point_survives_rotation_and_resumes(tmp_path):
    """The best is recorded in every checkpoint after it: a run resumed in its directory, or
    from another one (whose best.pt it adopts), ends with the uninterrupted run's best.pt,
    long after that step's own checkpoint was rotated away."""
    args = [
        "trainer.max_steps=12",
        "trainer.eval_every=4",
        "trainer.checkpoint_every=4",
        "trainer.keep_checkpoints=1",
        *SMALL_DATA,
        "model.width=8",
        "loader=single",
        "task._target_=test_resume.HighestLossIsBest",
    ]
    straight_run = train_here(tmp_path / "straight", *args)
    best_step = straight_run.summary["best"]["step"]
    assert best_step <= 8 and not checkpoint_path(straight_run.dir, best_step).exists()
    crash(tmp_path / "a", args, after=10)
    in_place = resume(tmp_path / "a", args)  # from step 8
    crash(tmp_path / "b", args, after=10)
    elsewhere = train_here(tmp_path / "c", *args, f"trainer.resume={tmp_path / 'b'}")
    for run in (in_place, elsewhere):
        assert run.summary["resumes"][0]["step"] == 8
        assert run.summary["best"] == straight_run.summary["best"]
        assert best_weights(run) == best_weights(straight_run)


@pytest.mark.e2e
def test_the_weight_average_resumes_and_changes_the_evaluations_not_the_training(tmp_path):
    """trainer.ema: the average is in every checkpoint, so a crashed and resumed run ends with
    the uninterrupted run's average and evaluations; the weights themselves are those of the
    same run without it."""
    args = [
        "trainer.max_steps=12",
        "trainer.eval_every=6",
        "trainer.checkpoint_every=4",
        *SMALL_DATA,
        "model.width=8",
        "loader=single",
    ]
    ema = [*args, "trainer.ema.decay=0.8", "trainer.ema.start=2"]
    straight_run = train_here(tmp_path / "straight", *ema)
    crash(tmp_path / "crashed", ema, after=10)
    resumed = resume(tmp_path / "crashed", ema)  # from step 8
    assert resumed.summary["resumes"][0]["step"] == 8
    assert resumed.summary["ema"] == straight_run.summary["ema"]
    assert (resumed.dir / "eval.csv").read_text() == (straight_run.dir / "eval.csv").read_text()
    plain = train_here(tmp_path / "plain", *args)
    assert plain.summary["ema"] is None
    assert plain.summary["weights_sha256"] == straight_run.summary["weights_sha256"]
    assert (plain.dir / "eval.csv").read_text() != (straight_run.dir / "eval.csv").read_text()


@pytest.mark.e2e
def test_keeps_the_newest_checkpoints_and_never_overwrites_a_run(straight):
    run = straight("mid-epoch")
    kept = sorted(p.name for p in (run.dir / "checkpoints").glob("step-*.pt"))
    assert kept == ["step-00000030.pt", "step-00000040.pt"]  # keep_checkpoints=2
    assert (run.dir / "checkpoint.pt").is_file() and sidecar(run.dir / "checkpoint.pt").is_file()
    before = metrics(run.dir)
    with pytest.raises(ConfigError, match="already holds a run .*trainer.resume=auto"):
        train_here(run.dir, *SCENARIOS["mid-epoch"])
    assert metrics(run.dir) == before


@pytest.mark.e2e
def test_resume_demo_script_prints_two_equal_digests(tmp_path):
    out = subprocess.run(
        # train.py overrides after --: smaller data than the default run's
        ["bash", str(ROOT / "scripts" / "resume_demo.sh"), "--", *SMALL_DATA, "model.width=8"],
        env=user_env(STEPS="12", KILL_AT="8", EVERY="5", PY=sys.executable, DEMO_DIR=str(tmp_path)),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    digests = [line.split()[-1] for line in out.stdout.splitlines() if "weights_sha256" in line]
    assert len(digests) == 2 and digests[0] == digests[1]
    assert "PASS: identical bits" in out.stdout


@pytest.mark.e2e
def test_resuming_a_finished_run_changes_nothing(straight):
    run = straight("mid-epoch")
    before = {p: (run.dir / p).read_bytes() for p in ("summary.json", "metrics.csv", "trace.jsonl")}
    again = resume(run.dir, SCENARIOS["mid-epoch"])
    assert "already complete" in again.output
    assert {p: (run.dir / p).read_bytes() for p in before} == before


def test_rotation_keeps_the_newest_and_the_last_good_checkpoint(tmp_path):
    from repro.records.checkpoint import list_checkpoints, mark_good, rotate

    for step in (10, 20, 30, 40):
        save_checkpoint(checkpoint_path(tmp_path, step), {"model": {}, "step": step})
        if step <= 20:  # 30 and 40 were written but never verified when read back
            assert mark_good(checkpoint_path(tmp_path, step))
    deleted = rotate(tmp_path, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [40, 30, 20]  # 20: the last good
    assert deleted == [checkpoint_path(tmp_path, 10)]
    assert not sidecar(checkpoint_path(tmp_path, 10)).exists()


@pytest.mark.e2e
def test_sigusr2_is_handed_to_a_launcher_that_listens_after_the_checkpoint(straight, tmp_path):
    """What submitit (hydra/launcher=slurm) does: its SIGUSR2 handler requeues the job.
    The loop catches SIGUSR2 only when such a handler exists, checkpoints at the step
    boundary, then calls it; the requeued run (resume=auto) gives the straight run's bits."""
    run_dir = tmp_path / "run"
    marker = tmp_path / "requeued"
    launcher = (
        "import runpy, signal, sys\n"
        "def requeue(signum, frame):\n"
        f"    open({str(marker)!r}, 'w').write('requeued')\n"
        "    raise SystemExit(3)\n"
        "signal.signal(signal.SIGUSR2, requeue)\n"
        f"sys.argv = [{str(ROOT / 'train.py')!r}, *sys.argv[1:]]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    overrides = SCENARIOS["mid-epoch"]
    proc = launch.popen(
        [sys.executable, "-c", launcher, f"hydra.run.dir={run_dir}", *one_thread(overrides)],
        env=user_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    while steps_done(run_dir) < 25:
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.002)
    proc.send_signal(signal.SIGUSR2)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 3, out
    stopped = steps_done(run_dir)
    assert f"SIGUSR2 received: stopped after step {stopped}/{STEPS}" in out
    assert marker.read_text() == "requeued" and checkpoint_path(run_dir, stopped).is_file()
    resumed = resume(run_dir, overrides)
    assert resumed.summary["resumes"][0]["step"] == stopped
    assert_same_as(resumed, straight("mid-epoch"))


@pytest.mark.e2e
def test_a_run_killed_after_its_last_checkpoint_gets_its_summary(straight, tmp_path):
    run = straight("mid-epoch")
    copy = shutil.copytree(run.dir, tmp_path / "end")
    (copy / "summary.json").unlink()  # killed between the final checkpoint and the summary
    done = resume(copy, SCENARIOS["mid-epoch"])
    for key in ("weights_sha256", "final_loss", "val_loss", "val_accuracy", "steps"):
        assert done.summary[key] == run.summary[key], key


@pytest.mark.e2e
@pytest.mark.parametrize("phase", ["model", "logger"])
def test_a_preemption_signal_before_the_first_step_exits_75_with_a_line(phase, tmp_path):
    """SIGTERM while the model is built, or while a logger starts (before the loop): the run
    stops there with exit status 75 and the resume command, not killed with status 143."""
    args = ["trainer.max_steps=4", *SMALL_DATA, "loader=single"]
    if phase == "model":
        args += ["~model", "+model._target_=sweep_models.TerminatedWhileBuilt"]
    else:
        args += ["model.width=8", "+logger.slow._target_=sweep_models.TerminatedWhileStarting"]
    proc = launch.run(
        train_cmd(f"hydra.run.dir={tmp_path / 'run'}", *args),
        cwd=tmp_path,
        env=with_tests_on_path(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == PREEMPTED_EXIT_CODE, out[-2000:]
    assert "SIGTERM received before the first step" in out
    assert "trainer.resume=auto" in out and "Traceback" not in out
    if phase == "logger":  # the directory was taken: the resume command finishes the run
        again = train_here(tmp_path / "run", *args[:-1], "trainer.resume=auto")
        assert again.summary["steps"] == 4


def test_a_write_that_finds_the_disk_full_names_the_file(tmp_path):
    from repro.base.files import atomic_write
    from repro.records.rundir import disk_error

    def full(f):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as f.write raises it

    target = tmp_path / "checkpoints" / "step-00000010.pt"
    with pytest.raises(OSError) as err:
        atomic_write(target, full)
    assert err.value.filename == str(target)
    message = str(disk_error(err.value, tmp_path))
    assert message.startswith(f"cannot write {target}: No space left on device")
    assert not list(target.parent.iterdir())  # no temporary file left
    assert "no checkpoint was written yet (a resume starts at step 0)" in message


def test_a_failed_write_names_the_checkpoint_a_resume_would_use(tmp_path):
    """The last good one; where its record is missing (a disk that turned read-only before
    it was written), the newest on disk, not "none"."""
    from repro.records.rundir import disk_error

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for step in (10, 20):
        (folder / f"step-{step:08d}.pt").write_bytes(b"a checkpoint")
    read_only = OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / "metrics.csv"))
    message = str(disk_error(read_only, tmp_path))
    assert f"the newest checkpoint is {folder / 'step-00000020.pt'} (resume checks it)" in message
    (folder / "last_good").write_text("step-00000010.pt\n")
    message = str(disk_error(read_only, tmp_path))
    assert f"the last good checkpoint is {folder / 'step-00000010.pt'}." in message
    assert "\n" not in message
