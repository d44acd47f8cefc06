"""The `repro` command."""

import json
import signal
import subprocess
import sys

import pytest

from conftest import repro, user_env


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


@pytest.mark.e2e
def test_output_into_a_closed_pipe_ends_quietly(traced_runs):
    """`repro compare A B | head -1`: the reader is gone before compare writes; compare
    stops as Unix tools do, without a traceback."""
    a, b = traced_runs["a"].dir, traced_runs["seed1"].dir
    proc = subprocess.Popen(
        [sys.executable, "-m", "repro", "compare", str(a), str(b)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=user_env(),
    )
    proc.stdout.close()  # the reader went away
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert err == "" and proc.returncode == -signal.SIGPIPE  # as `yes | head` ends: 141


@pytest.mark.parametrize(
    "argv, overrides",
    [
        (["predict", "R", "IMGS", "--out", "F", "device=cpu"], ["device=cpu"]),
        (["predict", "R", "IMGS", "device=cpu", "--out", "F", "x=1"], ["device=cpu", "x=1"]),
        (["evaluate", "R", "--split", "val", "device=cpu"], ["device=cpu"]),
        (["evaluate", "R", "device=cpu", "--", "x=1"], ["device=cpu", "x=1"]),
    ],
)
def test_overrides_go_before_or_after_the_options(argv, overrides, monkeypatch):
    import repro.cli

    seen = {}
    for name in ("cmd_predict", "cmd_evaluate"):
        monkeypatch.setattr(repro.cli, name, lambda args: seen.update(vars(args)) or 0)
    assert repro.cli.main(argv) == 0
    assert seen["run_dir"] == "R" and seen["overrides"] == overrides


def test_an_unknown_option_is_still_a_usage_error(capsys):
    from repro.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["evaluate", "R", "device=cpu", "--nope"])
    assert stop.value.code == 2
    assert "unrecognized arguments: --nope" in capsys.readouterr().err


def test_rerun_passes_its_directory_to_hydra_exactly(tmp_path, monkeypatch):
    """A re-run's --out with a quote, backslashes and '=' reaches Hydra as that path."""
    import subprocess

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from repro.cli import main

    job = tmp_path / "0_seed=1"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("- seed=1\n")
    out = tmp_path / "it's a\\ dir=x\\"
    seen = []
    monkeypatch.setattr(
        subprocess, "run", lambda cmd, **kw: seen.append(cmd) or subprocess.CompletedProcess(cmd, 0)
    )
    assert main(["rerun", str(job), "--out", str(out)]) == 0
    last = OverridesParser.create().parse_override(seen[0][-1])
    assert last.key_or_group == "hydra.run.dir" and last.value() == str(out)
    # a received job whose rerun/ leads elsewhere: its default --out is refused, not followed
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (job / "rerun").symlink_to(elsewhere, target_is_directory=True)
    assert main(["rerun", str(job)]) == 2 and len(seen) == 1
    assert list(elsewhere.iterdir()) == []
