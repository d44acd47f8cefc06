"""The `repro` command."""

import json
import subprocess
import sys

import pytest

from conftest import user_env


def repro(*args):
    return subprocess.run(
        [sys.executable, "-m", "repro", *args], capture_output=True, text=True, env=user_env()
    )


@pytest.mark.e2e
def test_digest_matches_summary(traced_runs):
    run = traced_runs["a"]
    out = repro("digest", str(run.dir))
    assert out.returncode == 0
    assert out.stdout.split()[0] == run.summary["weights_sha256"]


@pytest.mark.e2e
def test_digest_errors_are_one_line(tmp_path):
    missing = repro("digest", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "no such checkpoint" in missing.stderr
    bad = tmp_path / "checkpoint.pt"
    bad.write_bytes(b"not a checkpoint")
    corrupt = repro("digest", str(bad))
    assert corrupt.returncode == 2 and "not a readable checkpoint" in corrupt.stderr
    assert "Traceback" not in missing.stderr + corrupt.stderr


@pytest.mark.e2e
def test_env_prints_the_fingerprint():
    out = repro("env")
    env = json.loads(out.stdout)
    assert {"torch", "python", "cuda", "gpu"} <= env.keys()


@pytest.mark.e2e
def test_help_of_every_command_prints():
    for command in (
        [],
        ["digest"],
        ["compare"],
        ["doctor"],
        ["report"],
        ["rerun"],
        ["env"],
        ["evaluate"],
        ["predict"],
    ):
        out = repro(*command, "--help")
        assert out.returncode == 0 and "usage: repro" in out.stdout, (command, out.stderr)
