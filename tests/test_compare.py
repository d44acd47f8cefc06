"""The trace every run writes, and `repro compare`: identical, or where and how much."""

import csv
import hashlib
import json
import math
import shutil
import struct
import subprocess

import pytest
import torch

from conftest import SHORT, SMALL_DATA, repro, train_here
from repro.records.checkpoint import checkpoint_path
from repro.records.fingerprint import ISA_FLAG, git_state
from repro.records.trace import BackgroundDigests, state_digests
from repro.tools.compare import compare_dirs


def bits(x: float) -> bytes:
    return struct.pack(">d", x)


def trace(run_dir):
    return [json.loads(line) for line in (run_dir / "trace.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(traced_runs):
    """The short traced runs (conftest): seed 0, with 2 loader workers, seed 1."""
    return traced_runs


@pytest.mark.e2e
def test_trace_holds_the_exact_values_and_digests(runs):
    run = runs["a"]
    records = trace(run.dir)
    assert [r["step"] for r in records] == list(range(41))  # step 0: the initial weights
    with open(run.dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    for r, row in zip(records[1:], rows, strict=True):  # exact: same IEEE bits as metrics.csv
        assert bits(r["loss"]) == bits(float(row["loss"]))
        assert bits(r["grad_norm"]) == bits(float(row["grad_norm"]))
    assert set(records[0]["tensors"]) == set(
        torch.load(run.dir / "checkpoint.pt", weights_only=True)["model"]
    )
    assert "batch" in records[1] and {"inputs", "labels"} <= records[1]["batch"].keys()
    assert [r["step"] for r in records if "tensors" in r] == [0, 10, 20, 30, 40]
    assert records[-1]["final"] is True
    assert records[-1]["weights_sha256"] == run.summary["weights_sha256"]
    assert records[-1]["eval"]["val_accuracy"] == run.summary["val_accuracy"]


def test_trace_digests_are_the_state_after_their_step(tmp_path):
    """The periodic digests are hashed in the background and written when ready: each must
    be the weights after its own step (checkpoints hold those), and the trace complete."""
    args = [*SHORT, "trainer.trace_every=5", "trainer.log_every=5", "trainer.keep_checkpoints=9"]
    args += [*SMALL_DATA, "model.width=8"]
    held = train_here(tmp_path / "held", *args, "trainer.checkpoint_every=20")
    every = train_here(tmp_path / "every", *args, "trainer.checkpoint_every=5")
    digests = {}
    for run in (held, every):
        records = trace(run.dir)
        assert [r["step"] for r in records] == list(range(41))
        digests[run.dir.name] = {r["step"]: r["weights_sha256"] for r in records if "tensors" in r}
    assert sorted(digests["held"]) == list(range(0, 41, 5))
    assert digests["held"] == digests["every"]
    for step in range(5, 40, 5):
        state = torch.load(checkpoint_path(every.dir, step), weights_only=True)
        assert digests["every"][step] == state_digests(state["model"])[1], step


def check_background_digests(device: str) -> None:
    """The trace's periodic digests are hashed on a thread while training goes on: they must
    be those of the state when submitted, not after the next update."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32)).to(device)
    before = state_digests(model.state_dict())
    digests = BackgroundDigests()
    try:
        future = digests.submit(model.state_dict())
        with torch.no_grad():  # the next step's update, in place
            model[0].weight.add_(1)
        assert future.result() == before
        after = digests.submit(model.state_dict()).result()
        assert after == state_digests(model.state_dict()) and after[1] != before[1]
        assert after[0]["1.running_mean"] == before[0]["1.running_mean"]
    finally:
        digests.close()


def test_background_digests_hash_the_state_as_submitted():
    check_background_digests("cpu")


@pytest.mark.e2e
def test_env_json_records_versions_flags_variables_git_and_config(runs):
    run = runs["a"]
    env = json.loads((run.dir / "env.json").read_text())
    assert env["environment"]["torch"] == torch.__version__
    assert {"python", "numpy", "hydra", "cuda", "cudnn", "gpu", "cpu"} <= env["environment"].keys()
    assert env["flags"]["deterministic_algorithms"] is True  # read back, strict
    # read back as set: the tests' runs use one thread (conftest.run_defaults)
    assert env["flags"]["intra_op_threads"] == env["config"]["determinism"]["cpu_threads"] == 1
    assert env["env_vars"]["PYTHONHASHSEED"] == "0"
    assert "CUBLAS_WORKSPACE_CONFIG" in env["env_vars"]
    assert {"commit", "dirty", "diff_sha256", "untracked"} <= env["git"].keys()
    assert env["config_hash"] == run.summary["config_hash"]
    assert env["config"]["seed"] == 0
    # the CPU's instruction set: the kernels of a CPU run dispatch by it
    assert env["environment"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    isa = env["environment"]["cpu_isa"]
    assert isa is None or (isa == sorted(isa) and all(ISA_FLAG.fullmatch(f) for f in isa))
    assert env["environment"]["cpu_dispatch_limits"] == {}  # no variable caps it here
    assert "ONEDNN_MAX_CPU_ISA" in env["env_vars"] and "ATEN_CPU_CAPABILITY" in env["env_vars"]


def test_untracked_code_and_config_make_the_checkout_dirty_and_compare_names_them(runs, tmp_path):
    """A fork's new model file before its first commit: env.json names it (with a digest of
    its content) and calls the checkout dirty; files outside src/ and conf/ do not count;
    repro compare lists the difference."""
    repo = tmp_path / "repo"
    (repo / "src" / "mylab").mkdir(parents=True)
    (repo / "conf").mkdir()
    (repo / "README.md").write_text("x\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "init"], check=True)
    clean = git_state(repo)
    assert clean["dirty"] is False and clean["untracked"] == {}
    (repo / "outputs").mkdir()
    (repo / "outputs" / "run.log").write_text("a run's output\n")
    assert git_state(repo)["dirty"] is False
    (repo / "src" / "mylab" / "model.py").write_text("class Net: ...\n")
    state = git_state(repo)
    assert state["dirty"] is True and state["diff_sha256"] is None
    digest = hashlib.sha256(b"class Net: ...\n").hexdigest()
    assert state["untracked"] == {"src/mylab/model.py": digest}
    # one run from the clean checkout, one with the new file: compare names it
    for name, git in (("a", clean), ("b", state)):
        shutil.copytree(runs["a"].dir, tmp_path / name)
        env = json.loads((tmp_path / name / "env.json").read_text())
        env["git"] = git
        (tmp_path / name / "env.json").write_text(json.dumps(env))
    out = repro("compare", str(tmp_path / "a"), str(tmp_path / "b"))
    assert out.returncode == 0, out.stdout
    assert f"git.untracked.src/mylab/model.py: (absent) vs {digest}" in out.stdout
    assert "git.dirty: False vs True" in out.stdout


@pytest.mark.e2e
def test_identical_runs_compare_equal_and_name_the_harmless_differences(runs):
    out = repro("compare", str(runs["a"].dir), str(runs["multi"].dir))
    assert out.returncode == 0, out.stdout
    first = out.stdout.splitlines()[0]
    assert first == f"identical: 40 steps, weights {runs['a'].summary['weights_sha256']}"
    assert "loader.num_workers: 0 vs 2" in out.stdout


@pytest.mark.e2e
def test_another_seed_differs_at_the_initial_weights(runs):
    out = repro("compare", str(runs["a"].dir), str(runs["seed1"].dir))
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    assert lines[0] == "differ: first divergence at initial weights"
    assert lines[1].startswith("  first: tensor features.0.0.weight")
    assert "seed: 0 vs 1" in out.stdout
    assert "final weights: max abs diff" in out.stdout


def test_a_perturbed_parameter_is_found_at_its_step(tmp_path):
    """Two runs of one config; one nudges a parameter by one ulp after step 7. Compare names
    step 7 and that tensor, not a later symptom."""
    overrides = [*SHORT, "trainer.max_steps=12", "trainer.trace_every=1", *SMALL_DATA]

    def nudge(step, model):
        if step == 7:
            with torch.no_grad():
                b = model.head.bias
                b[3] = torch.nextafter(b[3], torch.tensor(math.inf, device=b.device))

    train_here(tmp_path / "straight", *overrides)
    train_here(tmp_path / "nudged", *overrides, after_step=nudge)
    result = compare_dirs(tmp_path / "straight", tmp_path / "nudged")
    assert not result.identical
    assert result.lines[0] == "differ: first divergence at step 7"
    assert result.lines[1] == "  first: tensor head.bias"
    assert "all tensors last agreed at step 6" in result.text()
    assert "a nondeterministic op? try `repro doctor`" in result.text()  # same config and env


@pytest.mark.e2e
def test_environment_differences_are_listed(runs, tmp_path):
    copy = shutil.copytree(runs["a"].dir, tmp_path / "elsewhere")
    env = json.loads((copy / "env.json").read_text())
    gpu = env["environment"]["gpu"]
    capability = env["environment"]["cpu_capability"]
    env["environment"].update(gpu="NVIDIA A100-SXM4-80GB", torch="2.10.0", cpu_capability="AVX2")
    env["env_vars"].update(ONEDNN_MAX_CPU_ISA="AVX2", OMP_NUM_THREADS="1")
    env["git"]["commit"] = "0" * 40
    (copy / "env.json").write_text(json.dumps(env))
    out = repro("compare", str(runs["a"].dir), str(copy))
    assert out.returncode == 0  # the bits agree; the listing says what else does not
    assert f"environment.gpu: {gpu} vs NVIDIA A100-SXM4-80GB" in out.stdout
    assert f"environment.torch: {torch.__version__} vs 2.10.0" in out.stdout
    assert f"environment.cpu_capability: {capability} vs AVX2" in out.stdout
    listed = [line.strip().split(":")[0] for line in out.stdout.splitlines()]
    order = [k.split(".")[0] for k in listed if k.startswith(("environment.", "env_vars.", "git."))]
    assert order == sorted(order, key=["environment", "env_vars", "git"].index)  # hardware first
    assert "env_vars.ONEDNN_MAX_CPU_ISA: None vs AVX2" in out.stdout
    assert "env_vars.ATEN_CPU_CAPABILITY" not in out.stdout  # unset in both: not a difference


@pytest.mark.e2e
def test_runs_of_different_lengths_compare_over_the_common_prefix(runs, tmp_path):
    copy = shutil.copytree(runs["a"].dir, tmp_path / "short")
    lines = (copy / "trace.jsonl").read_text().splitlines(keepends=True)
    (copy / "trace.jsonl").write_text("".join(lines[:21]) + lines[21][:30])  # killed mid-line
    result = compare_dirs(runs["a"].dir, copy)
    assert result.identical
    assert result.lines[0].startswith("identical: 20 steps, weights ")
    assert "common prefix" in result.lines[0]
    assert "last line cut short" in result.text()


@pytest.mark.e2e
def test_tolerance_mode_reports_the_largest_deviation(runs):
    a, b = str(runs["a"].dir), str(runs["seed1"].dir)
    loose = repro("compare", a, b, "--tolerance", "10")
    assert loose.returncode == 0 and loose.stdout.startswith("within tolerance 10")
    assert "loss curve (40 steps): largest deviation at step" in loose.stdout
    assert "val_accuracy (step 40)" in loose.stdout and "(headline, abs checked)" in loose.stdout
    headline = next(line for line in loose.stdout.splitlines() if "val_accuracy (step 40)" in line)
    accuracy = runs["a"].summary["val_accuracy"], runs["seed1"].summary["val_accuracy"]
    assert f"abs {abs(accuracy[0] - accuracy[1]):.3g}," in headline
    tight = repro("compare", a, b, "--tolerance", "1e-6")
    assert tight.returncode == 1 and tight.stdout.startswith("outside tolerance 1e-06")


@pytest.mark.e2e
def test_missing_or_damaged_runs_are_one_clear_line(runs, tmp_path):
    missing = repro("compare", str(tmp_path / "nope"), str(runs["a"].dir))
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"repro compare: {tmp_path / 'nope'}: no such run directory."
    (tmp_path / "empty").mkdir()
    empty = repro("compare", str(runs["a"].dir), str(tmp_path / "empty"))
    assert empty.returncode == 2 and "no trace.jsonl" in empty.stderr
    damaged = shutil.copytree(runs["a"].dir, tmp_path / "damaged")
    lines = (damaged / "trace.jsonl").read_text().splitlines(keepends=True)
    lines[5] = "{not json\n"
    (damaged / "trace.jsonl").write_text("".join(lines))
    bad = repro("compare", str(runs["a"].dir), str(damaged))
    assert bad.returncode == 2 and "trace.jsonl:6: not a trace record" in bad.stderr
    undecodable = shutil.copytree(runs["a"].dir, tmp_path / "undecodable")
    with open(undecodable / "trace.jsonl", "ab") as f:
        f.write(b'{"step": \xff\xfe\x80\n{"ste')  # not UTF-8, then a line cut short
    garbled = repro("compare", str(runs["a"].dir), str(undecodable))
    assert garbled.returncode == 2 and "trace.jsonl:42: not a trace record" in garbled.stderr
    for out in (missing, empty, bad, garbled):
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


@pytest.mark.e2e
def test_a_run_without_steps_is_nothing_to_compare(runs, tmp_path):
    copy = shutil.copytree(runs["a"].dir, tmp_path / "init-only")
    first = (copy / "trace.jsonl").read_text().splitlines()[0]
    (copy / "trace.jsonl").write_text(first + "\n")
    for args in ([], ["--tolerance", "1"]):
        out = repro("compare", str(runs["a"].dir), str(copy), *args)
        assert out.returncode == 1 and out.stdout.startswith("nothing to compare")


@pytest.mark.e2e
def test_tolerance_fails_when_a_run_has_no_evaluation_of_the_headline(runs, tmp_path):
    copy = shutil.copytree(runs["a"].dir, tmp_path / "no-eval")
    records = [json.loads(line) for line in (copy / "trace.jsonl").read_text().splitlines()]
    for r in records:
        r.pop("eval", None)
    (copy / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    result = compare_dirs(runs["a"].dir, copy, tolerance=10)
    assert not result.identical and result.lines[0].startswith("outside tolerance 10")
    assert f"val_accuracy (the headline): no evaluation in {copy} to compare" in result.text()


# What no run writes, in a trace line or env.json (by damage, or by hand): each is refused in
# one line naming the file (and the line), by `repro compare` exact and with a tolerance.
HUGE = "1" + "0" * 400  # a JSON integer; float() of it raises OverflowError
DEEP = "[" * 100_000 + "]" * 100_000  # json.loads raises RecursionError
BAD_RECORDS = {
    "huge loss": '{"step": 2, "loss": ' + HUGE + ', "grad_norm": 1.0, "lr": 0.1}',
    "deep": DEEP,
    "string loss": '{"step": 2, "loss": "0.5", "grad_norm": 1.0, "lr": 0.1}',
    "eval not an object": '{"step": 2, "loss": 0.5, "grad_norm": 1.0, "lr": 0.1, "eval": [1]}',
}


def fake_trace_run(run_dir, lines, env=None):
    """A run directory with only what compare reads: trace.jsonl (and env.json)."""
    run_dir.mkdir()
    (run_dir / "trace.jsonl").write_text("".join(line + "\n" for line in lines))
    if env is not None:
        (run_dir / "env.json").write_text(env)
    return run_dir


def test_a_trace_or_env_holding_what_no_run_writes_is_one_line_naming_it(tmp_path, capsys):
    from repro.cli import main

    step = {"grad_norm": 1.0, "lr": 0.1, "eval": {"val_accuracy": 0.5}}
    lines = [
        json.dumps({"step": 0, "weights_sha256": "0" * 64}),
        *(json.dumps({"step": s, "loss": 0.5, **step}) for s in (1, 2)),
    ]
    a = fake_trace_run(tmp_path / "a", lines, env="{}")
    cases = [
        (fake_trace_run(tmp_path / name.replace(" ", "-"), [*lines[:2], line]), "trace.jsonl:3")
        for name, line in BAD_RECORDS.items()
    ]
    envs = {
        "env-huge": '{"config": {"seed": ' + HUGE + "}}",
        "env-deep": DEEP,
        "env-config-a-number": '{"config": 5}',  # JSON, but not a run's record
        "env-environment-a-list": '{"config": {}, "environment": [1]}',
    }
    for name, env in envs.items():
        cases.append((fake_trace_run(tmp_path / name, lines, env=env), "env.json"))
    for b, where in cases:
        for args in ([], ["--tolerance", "1"]):
            assert main(["compare", str(a), str(b), *args]) == 2, (b, args)
            err = capsys.readouterr().err
            assert err.startswith(f"repro compare: {b / where}: "), err[:300]
            assert len(err.strip().splitlines()) == 1 and len(err) < 400, err[:300]
