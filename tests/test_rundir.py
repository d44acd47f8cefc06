"""The run directory is the run's: one run at a time (a lock), a refused launch changes no
byte, and a directory holding someone else's files is not written into."""

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import launch
from conftest import SMALL_DATA, run_train, train_cmd, train_here, user_env
from repro.base.errors import CheckpointError, ConfigError
from repro.base.files import LOCK_FILE

QUICK = ["trainer.max_steps=4", "trainer.eval_every=4", *SMALL_DATA, "model.width=8"]


def tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (hidden ones included) and its SHA-256."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished run, launched as a user does (train.py: .hydra/ and train.log included)."""
    return run_train(tmp_path_factory.mktemp("rundir") / "run", *QUICK)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "extra, message",
    [
        (["seed=1"], "already holds a run"),
        (["seed=1", "trainer.resume=auto"], "written under another configuration"),
    ],
    ids=["new-run", "resume-with-another-config"],
)
def test_a_refused_launch_changes_no_byte(finished, tmp_path, extra, message):
    run_dir = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(finished.dir), str(run_dir)], check=True)
    before = tree(run_dir)
    assert ".hydra/overrides.yaml" in before and "train.log" in before
    refused = run_train(run_dir, *QUICK, *extra, check=False)
    assert refused.proc.returncode == 1 and message in refused.proc.stderr
    assert tree(run_dir) == before  # .hydra/ and train.log included


def test_a_config_that_cannot_build_is_refused_before_the_directory_is_touched(tmp_path):
    """The model (and the data) are built before the run directory is taken: a model that
    raises leaves nothing -- the folders the launch made for its run are removed again --
    and a directory that was there (empty) as it was."""
    run_dir = tmp_path / "new" / "run"
    refused = run_train(run_dir, *QUICK, "model.width=0", check=False, cwd=tmp_path)
    assert refused.proc.returncode == 1
    assert "model._target_='repro.models.ConvNet' could not be built" in refused.proc.stderr
    assert list(tmp_path.iterdir()) == []  # not even tmp_path/new
    run_dir.mkdir(parents=True)  # the user's own, empty
    assert (
        run_train(run_dir, *QUICK, "model.width=0", check=False, cwd=tmp_path).proc.returncode == 1
    )
    assert run_dir.is_dir() and list(run_dir.iterdir()) == []  # no .lock, .hydra/ or train.log


def test_a_run_directory_in_use_is_refused_naming_its_holder(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(  # another process holds the directory's lock
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from repro.records.rundir import RunDirLock; "
            "RunDirLock(Path(sys.argv[1])).acquire(); print('held', flush=True); "
            "sys.stdin.read()",
            str(run_dir),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=user_env(),
    )
    try:
        assert holder.stdout.readline() == "held\n"
        before = tree(run_dir)
        with pytest.raises(
            ConfigError,
            match=rf"in use by another run \(host {socket.gethostname()}, pid {holder.pid}",
        ):
            train_here(run_dir, *QUICK)
        assert tree(run_dir) == before
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert train_here(run_dir, *QUICK).summary["steps"] == 4  # the holder is gone: free


def test_without_file_locks_a_lock_is_an_exclusive_file_and_a_left_one_is_named(
    tmp_path, monkeypatch
):
    """A filesystem without POSIX locks (Lustre without flock): the lock is a file created
    exclusively; one left by a killed run is refused, naming the file to delete."""
    import errno

    import repro.records.rundir

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(repro.records.rundir.fcntl, "lockf", no_locks)
    run_dir = tmp_path / "run"
    assert train_here(run_dir, *QUICK).summary["steps"] == 4
    assert not (run_dir / LOCK_FILE).exists()  # released
    (run_dir / LOCK_FILE).write_text(json.dumps({"host": "node17", "pid": 4242}))
    with pytest.raises(ConfigError, match=r"pid 4242.*delete .*\.lock \(this filesystem has no"):
        train_here(run_dir, *QUICK, "trainer.resume=auto")


def test_a_stale_lock_on_this_host_is_taken_over(tmp_path, capfd):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that is no longer running
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stale = {"host": socket.gethostname(), "pid": dead.pid, "started": time.time() - 60}
    (run_dir / LOCK_FILE).write_text(json.dumps(stale))
    run = train_here(run_dir, *QUICK)
    assert run.summary["steps"] == 4 and not (run_dir / LOCK_FILE).exists()  # released
    assert f"taking over the lock of pid {dead.pid}" in capfd.readouterr().err


@pytest.mark.e2e
def test_two_launches_into_one_directory_exactly_one_runs(tmp_path):
    run_dir = tmp_path / "run"
    args = ["trainer.max_steps=30", "trainer.eval_every=30", *SMALL_DATA, "loader=single"]
    procs = []
    for seed in (0, 1):
        procs.append(
            launch.popen(
                train_cmd(f"hydra.run.dir={run_dir}", *args, f"seed={seed}"),
                cwd=tmp_path,
                env=user_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        time.sleep(0.3)
    results = [(p.wait(timeout=300), p.communicate()[1]) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 1], results
    winner = next(seed for seed, (code, _) in enumerate(results) if code == 0)
    loser_err = next(err for code, err in results if code == 1)
    assert "in use by another run" in loser_err or "already holds a run" in loser_err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["seed"] == winner  # the winner's files only
    for line in (run_dir / "trace.jsonl").read_text().splitlines():
        json.loads(line)  # every line a record: one writer
    overrides = (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert f"seed={winner}" in overrides


def test_a_directory_of_someone_elses_files_is_refused_unless_allowed(tmp_path):
    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("my notes")
    with pytest.raises(ConfigError, match=r"not empty and holds no run .*\(notes.txt\)"):
        train_here(run_dir, *QUICK)
    assert tree(run_dir) == {"notes.txt": hashlib.sha256(b"my notes").hexdigest()}
    run = train_here(run_dir, *QUICK, "trainer.allow_existing_dir=true")
    assert run.summary["steps"] == 4 and (run_dir / "notes.txt").read_text() == "my notes"


def test_a_file_a_run_would_overwrite_is_never_overwritten(tmp_path):
    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    (run_dir / "metrics.csv").write_text("my own metrics\n")
    for allow in ("false", "true"):
        with pytest.raises(ConfigError, match="holds metrics.csv, which a run would overwrite"):
            train_here(run_dir, *QUICK, f"trainer.allow_existing_dir={allow}")
    assert (run_dir / "metrics.csv").read_text() == "my own metrics\n"
    assert sorted(os.listdir(run_dir)) == ["metrics.csv"]


def _take_in_turn(run_dir, results, start, done, trials: int, index: int) -> None:
    """One of the concurrent takers: for each trial, try to take the run directory's lock
    once all takers are ready, record whether it did, and let go once all have tried."""
    from repro.records.rundir import RunDirLock

    for trial in range(trials):
        start.wait()
        lock = RunDirLock(run_dir)
        try:
            lock.acquire()
            results[trial * 8 + index] = 1
        except ConfigError:
            results[trial * 8 + index] = 0
        done.wait()  # every taker has tried while the winner still holds it
        lock.release()
        done.wait()


def test_eight_processes_taking_over_a_dead_runs_lock_at_once_exactly_one_holds_it(tmp_path):
    """A requeued job and its duplicates all find the lock of a run that was SIGKILLed: in
    every one of 50 trials, exactly one of 8 concurrent takers holds the directory."""
    import multiprocessing

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that is no longer running
    stale = json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": 0.0})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    trials, context = 50, multiprocessing.get_context("fork")
    results = context.Array("i", [-1] * (trials * 8))
    start, done = context.Barrier(9), context.Barrier(9)
    takers = [
        context.Process(target=_take_in_turn, args=(run_dir, results, start, done, trials, i))
        for i in range(8)
    ]
    for p in takers:
        p.start()
    try:
        for _ in range(trials):
            (run_dir / LOCK_FILE).write_text(stale)  # what the killed run left
            start.wait(timeout=60)
            done.wait(timeout=60)
            done.wait(timeout=60)
    finally:
        for p in takers:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    holders = [sum(results[t * 8 : t * 8 + 8]) for t in range(trials)]
    assert holders == [1] * trials, holders


def test_an_empty_lock_left_by_a_launch_that_died_is_not_a_run_in_use(tmp_path):
    """A launch killed (or out of disk space) between creating .lock and writing its holder
    leaves an empty file: the next launch takes the directory."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_FILE).write_bytes(b"")
    run = train_here(run_dir, *QUICK)
    assert run.summary["steps"] == 4 and not (run_dir / LOCK_FILE).exists()


def test_a_lock_whose_holder_cannot_be_written_is_removed(tmp_path, monkeypatch):
    """ENOSPC while the lock records its holder: the launch fails in one line and leaves no
    lock behind, so the next launch (with space) runs."""
    import errno

    import repro.records.rundir

    def full(fd, holder):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    run_dir = tmp_path / "run"
    monkeypatch.setattr(repro.records.rundir, "_write_holder", full, raising=False)
    with pytest.raises(CheckpointError, match="No space left on device") as err:
        train_here(run_dir, *QUICK)
    assert "\n" not in str(err.value) and "trainer.resume=auto" in str(err.value)
    assert not (run_dir / LOCK_FILE).exists()
    monkeypatch.undo()
    assert train_here(run_dir, *QUICK).summary["steps"] == 4


def test_a_batch_larger_than_the_training_split_is_refused_before_the_directory_is_touched(
    tmp_path,
):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with pytest.raises(Exception, match=r"fewer than trainer.batch_size=2048"):
        train_here(run_dir, *QUICK, "trainer.batch_size=2048", "trainer.micro_batch_size=32")
    assert list(run_dir.iterdir()) == []


def test_the_printed_resume_command_pastes_back_the_run_directory(tmp_path, caplog):
    """Each place that prints the resume command (a notice before the first step, one after
    a checkpoint, a full disk) prints one that a shell splits and Hydra's override parser
    reads back as the run directory exactly: a default directory's `seed=0`, a space, a
    quote and backslashes included."""
    import errno
    import logging
    import shlex
    import signal

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from repro.base.errors import Preempted
    from repro.base.signals import PreemptionSignals
    from repro.base.world import World
    from repro.engine.preemption import Preemption
    from repro.records.rundir import disk_error

    run_dir = tmp_path / "outputs" / "2026-01-01" / "12-00-00_seed=0_ab" / "it's a \\b\\"
    notice = PreemptionSignals()
    notice.received = signal.SIGTERM
    with caplog.at_level(logging.INFO, logger="repro"):
        with pytest.raises(Preempted):
            notice.stop_before_training(run_dir)
        with pytest.raises(Preempted):
            Preemption(notice, World(), 10).stop(5, run_dir / "checkpoints" / "x.pt", run_dir)
    full = disk_error(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(run_dir)), run_dir)
    printed = [*(r.getMessage() for r in caplog.records), str(full)]
    assert len(printed) == 3
    parser = OverridesParser.create()
    for message in printed:
        words = shlex.split(message.rsplit(" plus ", 1)[1])
        assert words[0] == "trainer.resume=auto" and len(words) == 2, message
        override = parser.parse_override(words[1])
        assert override.key_or_group == "hydra.run.dir" and override.value() == str(run_dir)


def _refused_as_a_link(path: Path):
    message = (
        f"{path} is a symbolic link; a run's files are never written through links: remove it."
    )
    return pytest.raises(ConfigError, match=f"^{re.escape(message)}$")


def test_a_lock_or_log_that_is_a_link_is_refused_and_what_it_leads_to_is_unchanged(tmp_path):
    """`.lock` and `train.log` (Hydra's job log: a FileHandler that opens at its first
    record, conf/train.yaml) each a symbolic link to a file outside the run, in a run's
    directory relaunched with trainer.resume=auto (a requeued job): the launch is refused in
    one line naming it, and the file it leads to keeps its bytes."""
    import logging

    outside = tmp_path / "precious.txt"
    outside.write_text("mine\n")
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)  # a run's: killed before its first checkpoint
    job_log = logging.FileHandler(run_dir / "train.log", delay=True)
    logging.getLogger().addHandler(job_log)
    try:
        for name in (LOCK_FILE, "train.log"):
            (run_dir / name).symlink_to(outside)
            with _refused_as_a_link(run_dir / name):
                train_here(run_dir, *QUICK, "trainer.resume=auto")
            assert (run_dir / name).is_symlink() and sorted(os.listdir(run_dir)) == [".hydra", name]
            (run_dir / name).unlink()
    finally:
        logging.getLogger().removeHandler(job_log)
        job_log.close()
    assert outside.read_text() == "mine\n"


@pytest.mark.parametrize(
    "folder, mine", [(".hydra", "config.yaml"), ("checkpoints", "step-00000001.pt")]
)
def test_a_linked_launch_record_or_checkpoint_folder_is_refused_and_what_it_leads_to_is_unchanged(
    tmp_path, folder, mine
):
    """A received run directory whose ``.hydra/`` or ``checkpoints/`` is a link to a folder
    of the user's (which rotation would delete checkpoint-named files in): a resume into it
    is refused in one line before anything is written or deleted there."""
    outside = tmp_path / "mine"
    outside.mkdir()
    (outside / mine).write_text("mine\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / folder).symlink_to(outside, target_is_directory=True)
    message = (
        f"{run_dir / folder} is a symbolic link; a run's files are never written through links"
    )
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        train_here(run_dir, *QUICK, "trainer.resume=auto")
    assert sorted(os.listdir(outside)) == [mine]
    assert (outside / mine).read_text() == "mine\n"
    assert sorted(os.listdir(run_dir)) == [folder]


def test_every_file_a_run_appends_to_refuses_a_link(tmp_path):
    """The files a run writes in place rather than by rename (trace, CSV logs, the
    determinism report) never through a link; another run's logs adopted by a resume replace
    a link instead of writing through it."""
    from repro.base.files import open_run_file
    from repro.defense.determinism import DeterminismReport
    from repro.records.loggers import CsvLog
    from repro.records.rundir import adopt_logs
    from repro.records.trace import TraceWriter

    outside = tmp_path / "precious.txt"
    outside.write_text("mine\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in ("trace.jsonl", "metrics.csv", "determinism.json"):
        (run_dir / name).symlink_to(outside)
    writes = [
        (lambda: open_run_file(run_dir / "metrics.csv", "a"), "metrics.csv"),
        (lambda: TraceWriter(run_dir / "trace.jsonl"), "trace.jsonl"),
        (lambda: TraceWriter(run_dir / "trace.jsonl", mode="a"), "trace.jsonl"),
        (lambda: CsvLog(run_dir / "metrics.csv", ["step", "loss"]), "metrics.csv"),
        (lambda: DeterminismReport("strict", "cpu").save(run_dir), "determinism.json"),
    ]
    for write, name in writes:
        with _refused_as_a_link(run_dir / name):
            write()
    source = tmp_path / "source"
    source.mkdir()
    (source / "metrics.csv").write_text("step,loss\n1,0.5\n")
    adopt_logs(source, run_dir)
    assert not (run_dir / "metrics.csv").is_symlink()
    assert (run_dir / "metrics.csv").read_text() == "step,loss\n1,0.5\n"
    assert outside.read_text() == "mine\n"


def test_a_lock_file_holding_what_no_run_writes_is_taken_as_a_dead_runs(tmp_path):
    """A .lock nested too deep to parse, or naming a pid no float holds: its holder is
    unknown, and the lock (free: no process holds it) is taken, not a traceback."""
    from repro.records.rundir import RunDirLock

    for n, text in enumerate(("[" * 4096, '{"pid": 1' + "0" * 400 + "}")):
        run_dir = tmp_path / str(n)
        run_dir.mkdir()
        (run_dir / LOCK_FILE).write_text(text)
        lock = RunDirLock(run_dir)
        lock.acquire()
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
        lock.release()
