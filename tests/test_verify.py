"""`make verify` (scripts/verify.py): PASS when the bits agree, FAIL (exit 1) when not."""

import os
import sys

import pytest

import launch
from conftest import ROOT, SMALL_DATA, user_env


def verify(tmp_path, *args, env=None):
    return launch.run(
        [sys.executable, str(ROOT / "scripts" / "verify.py"), "--out", str(tmp_path), *args],
        capture_output=True,
        text=True,
        env=env or user_env(),
    )


@pytest.mark.e2e
def test_verify_passes_for_the_default_config(tmp_path):
    out = verify(tmp_path / "v", "--steps", "4", "--", *SMALL_DATA, "model.width=8")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS  repeat (run a vs run b)" in out.stdout
    assert "PASS  loader: 0 vs 2 workers" in out.stdout
    assert out.stdout.rstrip().endswith("verify: PASS (2/2 checks)")


@pytest.mark.e2e
def test_verify_fails_for_a_model_that_draws_unseeded_randomness(tmp_path):
    env = user_env(
        PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    )
    out = verify(
        tmp_path / "v",
        "--steps",
        "4",
        "--",
        "model._target_=nondeterministic_models.JitterNet",
        *SMALL_DATA,
        env=env,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAIL  repeat (run a vs run b)" in out.stdout
    assert "first divergence at step 1" in out.stdout
    assert out.stdout.rstrip().endswith("verify: FAIL (0/2 checks)")


@pytest.mark.e2e
def test_verify_does_not_overwrite_an_existing_directory(tmp_path):
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "keep.txt").write_text("mine")
    out = verify(tmp_path / "v")
    assert out.returncode == 2 and "is not empty" in out.stderr
    assert (tmp_path / "v" / "keep.txt").read_text() == "mine"
