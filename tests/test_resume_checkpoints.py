"""Exact resume, part two: which checkpoint a resume may use. A damaged, foreign,
code-carrying, other-environment or pre-format checkpoint is detected and refused or fallen
back from, and one written before a config key existed still resumes to the same bits;
``best.pt`` is repaired or reported lost. The runs and helpers are test_resume.py's (this
file is its own so that ``make test``'s workers run the two halves side by side)."""

import io
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
from test_resume import (
    SCENARIOS,
    assert_same_as,
    best_weights,
    crash,
    metrics,
    resume,
    uninterrupted,
)

import launch
from conftest import (
    SMALL_DATA,
    run_train,
    train_here,
    user_env,
)
from repro.base.errors import (
    CheckpointError,
    ConfigError,
    Preempted,
)
from repro.records.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint, sidecar
from repro.records.trace import state_dict_sha256


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """test_resume.py's uninterrupted runs, trained again for this file's worker."""
    return uninterrupted(tmp_path_factory.mktemp("straight"))


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A mid-epoch run that died after step 25: checkpoints at 10 and 20."""
    run_dir = tmp_path_factory.mktemp("killed") / "run"
    crash(run_dir, SCENARIOS["mid-epoch"], after=25)
    return run_dir


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def drop_checksum(path: Path) -> None:
    sidecar(path).unlink()


def garble_checksum(path: Path) -> None:
    sidecar(path).write_bytes(b"\xff\xfe\x00 not text")


def foreign_weights(path: Path) -> None:
    """Another architecture's weights, under this run's config, with a valid checksum."""
    state = torch.load(path, weights_only=True)
    state["model"]["head.weight"] = torch.zeros(7, 3)
    save_checkpoint(path, state)


def damaged_without_checksum(path: Path) -> None:
    """Bytes changed in a checkpoint whose sidecar is gone: its own digest catches it."""
    state = torch.load(path, weights_only=True)
    state["model"]["head.bias"] = state["model"]["head.bias"] + 1  # the digest is not updated
    buf = io.BytesIO()
    torch.save(state, buf)
    path.write_bytes(buf.getvalue())
    drop_checksum(path)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "damage, message",
    [
        (truncate, "checksum mismatch (truncated or corrupted)"),
        (flip_bit, "checksum mismatch (truncated or corrupted)"),
        (garble_checksum, "checksum file damaged"),
        (damaged_without_checksum, "its content does not match its own digest (corrupted)"),
        (foreign_weights, "cannot be restored into this run: its 'head.weight' is (7, 3)"),
    ],
)
def test_a_damaged_checkpoint_is_detected_and_resume_falls_back(
    damage, message, killed, straight, tmp_path
):
    run_dir = shutil.copytree(killed, tmp_path / "run")
    damage(checkpoint_path(run_dir, 20))
    resumed = resume(run_dir, SCENARIOS["mid-epoch"])
    assert f"step-00000020.pt: {message}" in resumed.output
    assert "Falling back to the previous checkpoint" in resumed.output
    assert "set step-00000020.pt aside as step-00000020.pt.bad (unusable)" in resumed.output
    assert resumed.summary["resumes"][0]["step"] == 10
    assert_same_as(resumed, straight("mid-epoch"))
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    assert not [k for k in kept if k.endswith(".bad")]  # rotation deleted the damaged file first
    assert kept == [f"step-000000{s}.pt{x}" for s in (30, 40) for x in ("", ".sha256")]


def test_a_checkpoint_without_its_checksum_file_is_verified_by_its_own_digest(killed):
    """A sidecar lost (a kill between the checkpoint's rename and its sidecar's, a copy that
    left it behind): the checkpoint still proves itself intact, and loads."""
    from repro.records.checkpoint import read_checkpoint

    path = checkpoint_path(killed, 20)
    expected = load_checkpoint(path)
    copy = path.parent.parent.parent / "lone.pt"
    copy.write_bytes(path.read_bytes())
    loaded = read_checkpoint(copy)
    assert not loaded.by_sidecar and loaded.state["step"] == 20
    assert state_dict_sha256(loaded.state["model"]) == state_dict_sha256(expected["model"])
    assert loaded.sha256 == sidecar(path).read_text().split()[0]


@pytest.mark.e2e
def test_a_checkpoint_named_on_the_command_line_that_does_not_fit_is_refused(killed, tmp_path):
    run_dir = shutil.copytree(killed, tmp_path / "run")
    foreign_weights(checkpoint_path(run_dir, 20))
    with pytest.raises(CheckpointError, match=r"step-00000020.pt: cannot be restored into") as e:
        train_here(
            tmp_path / "new",
            *SCENARIOS["mid-epoch"],
            f"trainer.resume={run_dir}/checkpoints/step-00000020.pt",
        )
    assert "\n" not in str(e.value)
    assert not (tmp_path / "new").exists() or not list((tmp_path / "new").iterdir())


class Payload:
    """Unpickling this would create a marker file: what a malicious checkpoint does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.e2e
def test_a_checkpoint_carrying_code_is_refused_and_the_code_does_not_run(killed, tmp_path):
    run_dir = shutil.copytree(killed, tmp_path / "run")
    marker = tmp_path / "pwned"
    evil = checkpoint_path(run_dir, 30)  # the newest, with a valid checksum
    save_checkpoint(evil, {"model": {}, "step": 30, "payload": Payload(marker)})
    assert not marker.exists()

    out = launch.run(
        [sys.executable, "-m", "repro", "digest", str(evil)],
        env=user_env(),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "refused: it holds Python objects" in out.stderr
    with pytest.raises(CheckpointError, match="refused: it holds Python objects that loading"):
        train_here(tmp_path / "new", *SCENARIOS["mid-epoch"], f"trainer.resume={evil}")
    auto = resume(run_dir, SCENARIOS["mid-epoch"])  # newest refused: falls back to step 20
    assert auto.summary["resumes"][0]["step"] == 20
    assert not marker.exists()


@pytest.mark.e2e
def test_a_foreign_checkpoint_is_refused_with_the_differences_unless_forced(killed, tmp_path):
    other = SCENARIOS["mid-epoch"] + ["seed=1", "amp=on"]
    source = checkpoint_path(killed, 20)
    refused = run_train(tmp_path / "a", *other, f"trainer.resume={source}", check=False)
    assert refused.proc.returncode == 1
    err = refused.proc.stderr.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1
    assert "seed: 0 (checkpoint) vs 1 (now)" in err
    assert "amp.enabled: False (checkpoint) vs True (now)" in err
    assert "trainer.resume_force=true" in err
    assert not (tmp_path / "a" / "trace.jsonl").exists()  # refused before writing anything

    forced = train_here(
        tmp_path / "b", *other, f"trainer.resume={source}", "trainer.resume_force=true"
    )
    record = forced.summary["resumes"][0]
    assert record["step"] == 20 and "seed: 0 (checkpoint) vs 1 (now)" in record["forced"]
    trace = (tmp_path / "b" / "trace.jsonl").read_text()
    assert '"forced": ["amp.enabled' in trace  # the mismatch is in the trace, at step 21


@pytest.mark.e2e
def test_a_checkpoint_from_another_environment_is_refused(killed, tmp_path):
    run_dir = shutil.copytree(killed, tmp_path / "run")
    path = checkpoint_path(run_dir, 20)
    state = torch.load(path, weights_only=True)
    state["environment"] = {**state["environment"], "torch": "2.10.0", "gpu": "NVIDIA A100"}
    state["device"] = "cuda:0"
    save_checkpoint(path, state)
    with pytest.raises(CheckpointError) as refused:
        resume(run_dir, SCENARIOS["mid-epoch"])
    message = str(refused.value)
    assert f"environment.torch: 2.10.0 (checkpoint) vs {torch.__version__} (now)" in message
    assert "environment.gpu: NVIDIA A100 (checkpoint)" in message
    assert "device: cuda (checkpoint) vs cpu (now)" in message


@pytest.mark.e2e
def test_a_cpu_checkpoint_from_another_instruction_set_is_refused(killed, tmp_path):
    """On a CPU the kernels dispatch by instruction set (AVX2, AVX-512, AMX): another one
    gives other bits, so a resume across it is refused like any other environment change."""
    run_dir = shutil.copytree(killed, tmp_path / "run")
    path = checkpoint_path(run_dir, 20)
    state = torch.load(path, weights_only=True)
    now = state["environment"]["cpu_capability"]
    state["environment"]["cpu_capability"] = "AVX2" if now != "AVX2" else "AVX512"
    state["environment"]["cpu_dispatch_limits"] = {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    save_checkpoint(path, state)
    with pytest.raises(CheckpointError) as refused:
        resume(run_dir, SCENARIOS["mid-epoch"])
    message = str(refused.value)
    assert f"environment.cpu_capability: {state['environment']['cpu_capability']} " in message
    assert f"(checkpoint) vs {now} (now)" in message
    assert "environment.cpu_dispatch_limits: {'ONEDNN_MAX_CPU_ISA': 'AVX2'} (checkpoint)" in (
        message
    )


@pytest.mark.e2e
def test_resume_from_another_run_directory_continues_its_logs(killed, straight, tmp_path):
    resumed = train_here(tmp_path / "new", *SCENARIOS["mid-epoch"], f"trainer.resume={killed}")
    assert resumed.summary["resumes"][0]["step"] == 20
    assert_same_as(resumed, straight("mid-epoch"))


@pytest.mark.e2e
def test_resuming_into_another_run_or_a_pruned_run_is_refused(killed, straight, tmp_path):
    run = straight("mid-epoch")
    before = metrics(run.dir)
    with pytest.raises(ConfigError, match="already holds a run"):
        train_here(run.dir, *SCENARIOS["mid-epoch"], f"trainer.resume={killed}")
    pruned = shutil.copytree(run.dir, tmp_path / "pruned")
    shutil.rmtree(pruned / "checkpoints")
    with pytest.raises(CheckpointError, match="no checkpoints/ to resume from"):
        resume(pruned, SCENARIOS["mid-epoch"])
    assert metrics(run.dir) == before == metrics(pruned)


def test_third_party_randomness_resumes_exactly_because_the_rng_states_are_restored(tmp_path):
    """A model that draws from NumPy's global RNG (as third-party code may) is not keyed;
    it repeats because layer 1 seeds that RNG and resumes exactly because checkpoints hold
    the global RNG states. Pre-empted after step 5 (SIGTERM, as a cluster sends it)."""
    args = ["trainer.max_steps=12", "trainer.eval_every=6", "data.train_size=512"]
    args += ["data.val_size=64", "~model", "+model._target_=forked_project.NumpyNoiseNet"]
    straight = train_here(tmp_path / "straight", *args)

    def preempt(step, model):
        if step == 5:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Preempted):
        train_here(tmp_path / "run", *args, after_step=preempt)
    assert checkpoint_path(tmp_path / "run", 5).is_file()
    resumed = resume(tmp_path / "run", args)
    assert resumed.summary["resumes"][0]["step"] == 5
    assert resumed.summary["weights_sha256"] == straight.summary["weights_sha256"]
    assert metrics(resumed.dir) == metrics(straight.dir)


@pytest.mark.e2e
def test_a_checkpoint_from_before_the_optimizer_was_a_target_resumes(killed, straight, tmp_path):
    """Checkpoints written before the optimizer and the schedule were _target_s, and before
    tasks and the CPU's instruction set were recorded, hold the same settings in the old
    shape: they resume, to the same bits."""
    run_dir = shutil.copytree(killed, tmp_path / "run")
    path = checkpoint_path(run_dir, 20)
    state = torch.load(path, weights_only=True)
    config = state["config"]
    config["optim"] = {
        "name": "sgd",
        "lr": 0.05,
        "momentum": 0.9,
        "nesterov": True,
        "weight_decay": 5e-4,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "implementation": "foreach",
        "schedule": "cosine",
        "warmup_steps": 20,
    }
    del config["schedule"], config["task"]
    for key in ("cpu_capability", "cpu_isa", "cpu_dispatch_limits"):
        del state["environment"][key]
    save_checkpoint(path, state)
    resumed = resume(run_dir, SCENARIOS["mid-epoch"])
    assert resumed.summary["resumes"][0]["step"] == 20
    assert resumed.summary["resumes"][0]["forced"] == []
    assert_same_as(resumed, straight("mid-epoch"))


def test_the_cpu_instruction_set_decides_a_cpu_resume_not_a_gpu_one():
    from repro.records.checkpoint import mismatches

    env = {"torch": "2.13.0", "cpu_capability": "AVX512", "cpu_isa": ["avx2", "avx512f"]}
    env["cpu_dispatch_limits"] = {}
    other_isa = {**env, "cpu_isa": ["avx2", "avx512f", "amx_tile"]}
    other_capability = {**env, "cpu_capability": "AVX2"}
    cfg = {"task": {"_target_": "repro.tasks.Classification"}}
    on_cpu = {"config": cfg, "device": "cpu", "environment": env}
    on_gpu = {**on_cpu, "device": "cuda"}
    assert mismatches(on_cpu, cfg, env, "cpu") == []
    assert mismatches(on_cpu, cfg, other_isa, "cpu") == [
        "environment.cpu_isa: ['avx2', 'avx512f'] (checkpoint) vs "
        "['avx2', 'avx512f', 'amx_tile'] (now)"
    ]
    assert mismatches(on_gpu, cfg, other_capability, "cuda") == []  # the GPU computes the step
    assert mismatches(on_gpu, cfg, other_isa, "cuda") == []


def test_a_checkpoint_from_before_data_test_fraction_resumes_without_a_test_split():
    """image_folder and image_mask_folder gained data.test_fraction (0: none): their older
    checkpoints lack it, which meant no test split."""
    from repro.records.checkpoint import mismatches

    data = {"_target_": "repro.data.image_mask_folder", "path": "d", "num_classes": 3}
    before = {"config": {"seed": 0, "data": data}, "device": "cpu"}
    assert mismatches(before, {"seed": 0, "data": {**data, "test_fraction": 0.0}}, {}, "cpu") == []
    assert mismatches(before, {"seed": 0, "data": {**data, "test_fraction": 0.2}}, {}, "cpu") == [
        "data.test_fraction: 0.0 (checkpoint) vs 0.2 (now)"
    ]


@pytest.mark.e2e
def test_when_no_checkpoint_is_usable_resume_starts_again_from_step_0(killed, straight, tmp_path):
    """Every checkpoint damaged (and leftovers of interrupted writes beside them): resume=auto
    does not fail forever, as a requeue loop would; it sets them aside, says so in one
    warning, starts again from step 0 in the same directory and ends on the uninterrupted
    run's bits."""
    run_dir = shutil.copytree(killed, tmp_path / "run")
    for step in (10, 20):
        truncate(checkpoint_path(run_dir, step))
    (run_dir / "checkpoints" / ".step-00000030.pt.a8r2k_x1.tmp").write_bytes(b"partial")
    (run_dir / ".summary.json.q0v7zm3c.tmp").write_bytes(b"partial")
    resumed = resume(run_dir, SCENARIOS["mid-epoch"])
    warnings = [line for line in resumed.output.splitlines() if "no usable checkpoint" in line]
    assert len(warnings) == 1 and "starting again from step 0" in warnings[0], resumed.output
    assert "Falling back" not in resumed.output
    assert resumed.summary["resumes"] == []
    assert_same_as(resumed, straight("mid-epoch"))
    assert not list(run_dir.rglob("*.tmp")) and not list(run_dir.rglob("*.bad"))


def test_checkpoints_that_are_intact_but_do_not_fit_are_never_set_aside_to_start_again(
    killed, tmp_path
):
    """Every checkpoint intact but of another model (its code changed under the same
    config): resume=auto must not set them aside and start again from step 0 -- one line,
    nothing changed."""
    run_dir = shutil.copytree(killed, tmp_path / "run")
    for step in (10, 20):
        foreign_weights(checkpoint_path(run_dir, step))
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    with pytest.raises(CheckpointError, match="not every one is damaged") as err:
        resume(run_dir, SCENARIOS["mid-epoch"])
    assert "\n" not in str(err.value) and "nothing was changed" in str(err.value)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before


def test_a_resume_with_another_augmentation_is_refused(killed, tmp_path):
    run_dir = shutil.copytree(killed, tmp_path / "run")
    with pytest.raises(CheckpointError, match=r"augment.train._target_: repro.data.augment"):
        resume(run_dir, SCENARIOS["mid-epoch"], "augment=none")


def test_a_checkpoint_from_before_the_augment_group_resumes_to_the_same_bits(
    killed, straight, tmp_path
):
    """Written when the crop and flip was data.augment=true: the same augmentation."""
    run_dir = shutil.copytree(killed, tmp_path / "run")
    path = checkpoint_path(run_dir, 20)
    state = torch.load(path, weights_only=True)
    state["config"]["data"]["augment"] = True
    del state["config"]["augment"]
    save_checkpoint(path, state)
    resumed = resume(run_dir, SCENARIOS["mid-epoch"])
    assert (
        resumed.summary["resumes"][0]["step"] == 20
        and resumed.summary["resumes"][0]["forced"] == []
    )
    assert_same_as(resumed, straight("mid-epoch"))


BEST_EARLY = [
    "trainer.max_steps=12",
    "trainer.eval_every=4",
    "trainer.checkpoint_every=4",
    *SMALL_DATA,
    "model.width=8",
    "loader=single",
    "task._target_=test_resume.HighestLossIsBest",  # the best evaluation is an early one
]


@pytest.fixture(scope="module")
def best_early(tmp_path_factory):
    """The uninterrupted run (every checkpoint kept), and one crashed after step 10 (its
    newest checkpoint is step 8's; best.pt is the best evaluation's, at step 4 or 8)."""
    base = tmp_path_factory.mktemp("best")
    args = [*BEST_EARLY, "trainer.keep_checkpoints=3"]
    reference = train_here(base / "straight", *args)
    crash(base / "crashed", args, after=10)
    return reference, base / "crashed"


def delete(path: Path) -> None:
    path.unlink()
    sidecar(path).unlink()


@pytest.mark.parametrize("damage", [truncate, delete, flip_bit])
def test_a_damaged_or_missing_best_pt_is_rewritten_from_its_steps_checkpoint(
    damage, best_early, tmp_path
):
    reference, crashed = best_early
    run_dir = shutil.copytree(crashed, tmp_path / "run")
    damage(run_dir / "best.pt")
    resumed = resume(run_dir, [*BEST_EARLY, "trainer.keep_checkpoints=3"])
    step = reference.summary["best"]["step"]
    assert f"best.pt: rewritten from step-{step:08d}.pt" in resumed.output
    assert resumed.summary["best"] == reference.summary["best"]
    assert best_weights(resumed) == best_weights(reference)


def test_a_best_pt_whose_step_checkpoint_was_rotated_away_is_reported_lost(best_early, tmp_path):
    reference, crashed = best_early
    run_dir = shutil.copytree(crashed, tmp_path / "run")
    step = reference.summary["best"]["step"]
    delete(checkpoint_path(run_dir, step))  # rotated away, as with keep_checkpoints=1
    truncate(run_dir / "best.pt")
    resumed = resume(run_dir, [*BEST_EARLY, "trainer.keep_checkpoints=3"])
    lost = [line for line in resumed.output.splitlines() if "best.pt" in line and "lost" in line]
    assert len(lost) == 1, resumed.output
    assert not (run_dir / "best.pt").exists()  # not a file that cannot be read
    best = resumed.summary["best"]
    assert best["file"] is None and best["step"] == step and best["lost"]
    assert resumed.summary["weights_sha256"] == reference.summary["weights_sha256"]


def test_a_best_pt_damaged_during_the_run_is_repaired_at_the_end(best_early, tmp_path):
    reference, _ = best_early

    def damage(step, model):
        if step == 11:
            truncate(tmp_path / "run" / "best.pt")

    run = train_here(tmp_path / "run", *BEST_EARLY, "trainer.keep_checkpoints=3", after_step=damage)
    assert "best.pt: rewritten from" in run.output
    assert run.summary["best"] == reference.summary["best"]
    assert best_weights(run) == best_weights(reference)


def test_a_damaged_summary_of_a_finished_run_is_written_again(straight, tmp_path):
    run = straight("mid-epoch")
    # cut short in a string; nested too deep for json.loads (RecursionError)
    for name, damaged in (("end", b'{"weights_sha256": "\xff'), ("deep", b"[" * 100_000)):
        copy = shutil.copytree(run.dir, tmp_path / name)
        (copy / "summary.json").write_bytes(damaged)
        done = resume(copy, SCENARIOS["mid-epoch"])
        assert f"{copy / 'summary.json'} is damaged" in done.output
        for key in ("weights_sha256", "final_loss", "val_loss", "val_accuracy", "steps", "best"):
            assert done.summary[key] == run.summary[key], key
        assert (
            json.loads((copy / "summary.json").read_text())["weights_sha256"]
            == (run.summary["weights_sha256"])
        )


@pytest.mark.e2e
def test_logs_cut_short_or_deleted_are_rebuilt_from_the_trace(killed, straight, tmp_path):
    """metrics.csv truncated to its first rows, garbage appended after them, eval.csv
    deleted: the resume rebuilds the missing rows from trace.jsonl (which holds the same
    exact values) and ends with the uninterrupted run's files. Without a trace to rebuild
    from, it names the missing steps in one warning."""
    run_dir = shutil.copytree(killed, tmp_path / "run")
    lines = (run_dir / "metrics.csv").read_bytes().splitlines(keepends=True)
    (run_dir / "metrics.csv").write_bytes(b"".join(lines[:6]) + b"\x00\xff\xfe,garbage\n")
    (run_dir / "eval.csv").unlink()
    resumed = resume(run_dir, SCENARIOS["mid-epoch"])
    assert "metrics.csv: steps 6-20 rebuilt from trace.jsonl" in resumed.output
    assert "eval.csv: steps 20 rebuilt from trace.jsonl" in resumed.output
    assert_same_as(resumed, straight("mid-epoch"))

    blind = shutil.copytree(killed, tmp_path / "blind")
    (blind / "metrics.csv").write_bytes(b"".join(lines[:6]))
    (blind / "trace.jsonl").unlink()
    resumed = resume(blind, SCENARIOS["mid-epoch"])
    missing = [line for line in resumed.output.splitlines() if "metrics.csv" in line]
    assert len(missing) == 1 and "steps 6-20 are missing" in missing[0], resumed.output
    assert resumed.summary["weights_sha256"] == straight("mid-epoch").summary["weights_sha256"]
