"""The four layers: the process environment is pinned before start, the rest read back."""

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, SMALL_DATA, train_here, user_env

# one step of a small model: what is tested is the set-up, not the training
ONE = ["trainer.max_steps=1", "trainer.eval_every=1", *SMALL_DATA, "model.width=8"]


def _hash_seed_in_effect(env_value, set_later=False):
    code = (
        "from repro.defense.process_env import hash_seed_in_effect; print(hash_seed_in_effect('0'))"
    )
    if set_later:  # what the seed tutorials do: assign it inside the running process
        code = "import os; os.environ['PYTHONHASHSEED'] = '0'; " + code
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if env_value is not None:
        env["PYTHONHASHSEED"] = env_value
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.mark.e2e
def test_hash_seed_check_tells_started_with_from_set_later():
    assert _hash_seed_in_effect("0") == "True"
    assert _hash_seed_in_effect("17") == "False"
    assert _hash_seed_in_effect(None) == "False"  # randomized hashing
    assert _hash_seed_in_effect(None, set_later=True) == "False"  # too late to matter


@pytest.mark.e2e
def test_strict_re_executes_to_pin_the_environment(train_run):
    run = train_run("strict", *ONE, env=user_env(False))
    assert run.entry("re-executed to pin the environment")["value"] is True
    for name in (
        "PYTHONHASHSEED",
        "CUBLAS_WORKSPACE_CONFIG",
        "use_deterministic_algorithms",
        "cudnn.deterministic",
        "cudnn.benchmark",
        "cuda.matmul.allow_tf32",
        "torch intra-op threads",
    ):
        assert run.entry(name)["verified"] is True, name
    assert run.entry("PYTHONHASHSEED")["value"] == "0"
    assert run.entry("per-sample work")["value"].startswith("1 thread")
    assert "2 processes, 1 thread: ok" in run.entry("augment self-check")["value"]
    assert any(line.startswith("augmentation: ") for line in run.report["not_covered"])


@pytest.mark.e2e
def test_strict_refuses_to_run_without_the_environment(train_run):
    run = train_run(
        "nopin", *ONE, "determinism.pin_process_env=false", check=False, env=user_env(False)
    )
    assert run.proc.returncode == 1
    assert "PYTHONHASHSEED" in run.proc.stderr and "Traceback" not in run.proc.stderr
    # with the variables exported by the user, no re-exec is needed
    env = user_env(PYTHONHASHSEED="0", CUBLAS_WORKSPACE_CONFIG=":4096:8")
    ok = train_run("exported", *ONE, env=env)
    assert ok.entry("re-executed to pin the environment")["value"] is False
    assert ok.entry("PYTHONHASHSEED")["verified"] is True


@pytest.mark.e2e
def test_tf32_override_is_removed_in_strict(train_run):
    run = train_run("tf32", *ONE, env=user_env(False, TORCH_ALLOW_TF32_CUBLAS_OVERRIDE="1"))
    assert run.entry("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE")["value"] is None


@pytest.mark.e2e
def test_a_job_of_a_sweep_does_not_inherit_the_previous_jobs_threads(tmp_path):
    """Jobs of a sweep share one process: job 1 (threads left to PyTorch) must not keep
    job 0's fixed thread count."""
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "-m",
            "determinism.cpu_threads=1,null",
            "determinism=fast",
            *ONE,
        ],
        cwd=tmp_path,
        env=user_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    threads = {}
    for path in tmp_path.glob("multirun/**/determinism.json"):
        entries = json.loads(path.read_text())["entries"]
        threads[path.parent.name] = next(
            e for e in entries if e["name"] == "torch intra-op threads"
        )
    # what PyTorch gives a new interpreter here (the cores; this test process's own count is
    # whatever the tests before it in this worker left)
    fresh = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        capture_output=True, text=True, check=True, env=user_env(),
    ).stdout  # fmt: skip
    if int(fresh) == 1:
        pytest.skip("one core: PyTorch's own choice is the fixed count (1) too")
    assert threads["0_seed=0"]["value"] == 1
    assert threads["1_seed=0"]["value"] == threads["1_seed=0"]["requested"] == int(fresh)
    assert torch.get_num_threads() != 1 or os.cpu_count() == 1  # else this test proves nothing


def test_warn_mode_is_strict_with_warnings_and_the_nan_fill(tmp_path):
    """warn = strict + warnings + new tensors filled with NaN; the fill changes no bit."""
    steps = ["trainer.max_steps=3", "trainer.eval_every=3", *SMALL_DATA]
    run = train_here(tmp_path / "warn", *steps, "determinism=warn")
    strict = train_here(tmp_path / "strict", *steps)
    assert run.report["mode"] == "warn"
    assert run.entry("deterministic warn_only")["value"] is True
    assert run.entry("use_deterministic_algorithms")["value"] is True
    assert run.entry("fill_uninitialized_memory")["value"] is True
    assert strict.entry("fill_uninitialized_memory")["value"] is False
    assert run.summary["weights_sha256"] == strict.summary["weights_sha256"]


def test_a_busy_machine_is_one_warning_before_the_run_and_an_idle_one_none(monkeypatch, caplog):
    """Two runs at once on 2 cores each pin 2 threads and start 2 loader workers: both crawl.
    A run that starts while as many other threads run as there are cores (or, without that
    count, the last minute's load is above them) says so, with the fix; one run on an idle
    machine says nothing, nor one right after work that has ended (the average still counts
    it, nothing runs now), nor rank 1 of a launch."""
    from repro.defense import determinism

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    cases = [  # (1-minute load, other threads running now, warned?) on 2 cores
        (0.3, 0, False),
        (2.6, 0, False),  # make install just ended
        (2.6, 1, False),
        (1.2, 3, True),  # a run started 20 s ago: its threads run, the average lags
        (1.9, None, False),  # no /proc/loadavg: the average alone
        (3.7, None, True),
    ]
    for load, others, warned in cases:
        monkeypatch.setattr(determinism, "machine_load", lambda c=(load, others): (*c, 2))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="repro"):
            determinism.warn_if_busy(2)
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == int(warned), (load, others, lines)
    assert lines[0].startswith(
        "this machine is busy before the run starts (load average 3.7 on 2 c"
    )
    assert "its 2 threads will wait on the others'" in lines[0]
    assert "determinism.cpu_threads=1 loader=single" in lines[0]
    monkeypatch.setenv("LOCAL_RANK", "1")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="repro"):
        determinism.warn_if_busy(2)
    assert caplog.records == []
    load, others, cores = determinism.machine_load()  # this machine: numbers, not None
    assert load >= 0 and cores >= 1 and (others is None or others >= 0)
