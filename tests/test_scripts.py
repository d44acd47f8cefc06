"""The benchmark scripts run end to end (tiny settings, CPU) and write their files."""

import json
import subprocess
import sys

import pytest

import launch
from conftest import ROOT, user_env
from optional import require


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    out = launch.run(
        [sys.executable, str(ROOT / "scripts" / name), *args],
        capture_output=True,
        text=True,
        env=user_env(),
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.e2e
def test_benchmark_writes_a_table_with_strict_and_fast(tmp_path):
    run_script(
        "benchmark.py",
        "--steps",
        "4",
        "--warmup",
        "2",
        "--repeats",
        "1",
        "--models",
        "convnet",
        "--variants",
        "fp32-multi",
        "bf16-device",
        "--out",
        str(tmp_path),
    )
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("benchmark-*.json")]
    assert [(r["amp"], r["loader"]) for r in record["rows"]] == [
        ("fp32", "multi"),
        ("bf16", "device"),
    ]
    for r in record["rows"]:
        assert r["strict_over_fast"] > 0 and r["strict_distinct_weights"] == 1
        assert 1e8 < r["flops_per_image"] < 1e9 and r["strict_tflops"] > 0  # ConvNet: 0.17 G
    table = next(tmp_path.glob("benchmark-*.md")).read_text()
    assert "| convnet | fp32 | multi |" in table and "% of bf16 ceiling" in table


@pytest.mark.e2e
def test_dist_benchmark_compares_reductions_and_ddp(tmp_path):
    """Two processes only, ordered and DDP (a CI budget): world-size invariance is
    test_dist.py's, and so is dist.reduction=all_reduce (over 3 gloo processes)."""
    run_script(
        "dist_benchmark.py",
        "--world-sizes",
        "2",
        "--reductions",
        "ordered",
        "--steps",
        "22",
        "--repeats",
        "1",
        "--ddp",
        "--out",
        str(tmp_path),
        "--",
        "data.train_size=256",
        "data.val_size=64",
        "model.width=8",
        "determinism.cpu_threads=1",
    )
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("dist-*.json")]
    rows = {(r["world_size"], r["reduction"]): r for r in record["rows"]}
    assert set(rows) == {(2, "ordered"), (2, "ddp")}
    assert all(r["median"] > 0 for r in rows.values())
    assert "| 2 | ordered |" in next(tmp_path.glob("dist-*.md")).read_text()


@pytest.mark.e2e
def test_dist_benchmark_measures_a_fake_rank_beside_its_share(tmp_path):
    """--fake-world 2: rank 0 of 2 in one process (scripts/fake_rank.py), beside one process
    training the rank's share (batch 64 / 2)."""
    run_script(
        *("dist_benchmark.py", "--fake-world", "2", "--steps", "22", "--repeats", "1"),
        *("--reductions", "ordered"),  # two processes: the share, and the fake rank
        *("--out", str(tmp_path), "--", "trainer.batch_size=64", "trainer.micro_batch_size=16"),
        *("data.train_size=256", "data.val_size=64", "model.width=8"),
        "trainer.on_nonfinite=continue",  # a fake all-to-all may leave garbage (torch 2.11)
    )
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("dist-*.json")]
    assert record["fake_world"] == 2 and record["share_overrides"][-1] == "trainer.batch_size=32"
    rows = {(r["world_size"], r["reduction"]): r for r in record["rows"]}
    assert set(rows) == {(1, "ordered"), (2, "ordered")}
    assert all(r["median"] > 0 for r in rows.values())
    table = next(tmp_path.glob("dist-*-cpu.md")).read_text()  # one device: no "2x" in the name
    assert (
        "| 1 (the share) | (one process) |" in table and "| rank 0 of 2 (fake) | ordered |" in table
    )


@pytest.mark.e2e
def test_profile_step_reports_where_a_steps_time_goes_as_rank_0_of_2(tmp_path):
    """--fake-world 2: one process is rank 0 of 2 (torch's fake process group), with its
    share of the micro-batches and the reduction between the ranks."""
    out = run_script(
        "profile_step.py",
        *("--wait", "1", "--warmup", "1", "--active", "2", "--fake-world", "2"),
        *("--label", "tiny", "--out", str(tmp_path), "--"),
        "trainer.batch_size=64",
        "trainer.micro_batch_size=16",
        "trainer.on_nonfinite=continue",  # a fake all-to-all may leave garbage (torch 2.11)
    )
    (report,) = tmp_path.glob("profile-tiny-*.md")
    text = report.read_text()
    assert text in out.stdout
    assert "1 process as rank 0 of 2" in text
    wall = float(text.split("wall time per step under the profiler: **")[1].split(" ms")[0])
    assert wall > 0
    assert "device busy" not in text  # no device on a CPU: no device lines
    # the profiled steps are 3 and 4 of 5 (the last, traced step is left out)
    assert "Steps 3–4 of" in text and "trainer.max_steps=5" in text
    # rank 0's 2 of the 4 micro-batches of 16 a step, each a forward and a backward through the 5
    # convolutions; the step's named ranges; the ranks' reduction once a step
    assert "| `aten::convolution_backward` | 10 |" in text
    assert "| `repro.forward` | 2 |" in text and "| `repro.backward` | 2 |" in text
    assert "| `repro.reduce` | 1 |" in text


@pytest.mark.e2e
def test_profile_step_profiles_the_hand_written_loop_on_the_same_config(tmp_path):
    args = ["--wait", "1", "--warmup", "1", "--active", "2", "--out", str(tmp_path)]
    run_script(
        "profile_step.py",
        *args,
        "--reference",
        "eager",
        "--label",
        "ref",
        "--",
        "trainer.batch_size=32",
        "trainer.micro_batch_size=16",
        "data.train_size=256",
    )
    text = next(tmp_path.glob("profile-ref-*.md")).read_text()
    assert "(scripts/reference_loop.py, eager)" in text
    assert "| `aten::convolution_backward` | 10 |" in text  # the same work: 2 x 5 a step


@pytest.mark.e2e
@pytest.mark.lightning
def test_benchmark_runs_the_lightning_peer_beside_strict(tmp_path):
    require("lightning", "pip install -e '.[bench]'")
    run_script(
        "benchmark.py",
        "--steps",
        "6",
        "--warmup",
        "2",
        "--repeats",
        "2",
        "--models",
        "convnet",
        "--variants",
        "fp32-multi",
        "bf16-device",
        "--lightning",
        "--out",
        str(tmp_path),
    )
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("benchmark-*.json")]
    multi, device = record["rows"]
    assert len(multi["images_per_second"]["lightning"]) == 2
    assert multi["strict_over_lightning"] > 0 and multi["strict_distinct_weights"] == 1
    assert "lightning" not in device["images_per_second"]  # Lightning takes a DataLoader
    table = next(tmp_path.glob("benchmark-*.md")).read_text()
    assert "| strict / Lightning |" in table and "seed_everything(workers=True)" in table


@pytest.mark.e2e
def test_folder_benchmark_writes_the_lazy_row(tmp_path):
    """A folder of PNG and JPEG files of varied sizes, read per sample by a worker: the
    memory, speed and digest row (lazy and in memory giving one digest is test_data's,
    in process; one train.py process here keeps the CI budget)."""
    require("PIL")
    args = ["--sizes", "24", "--workers", "1", "--steps", "4", "--image-size", "16"]
    run_script(
        "folder_benchmark.py",
        *args,
        "--modes",
        "lazy",
        "--root",
        str(tmp_path / "folders"),
        "--out",
        str(tmp_path),
        "--",
        "trainer.batch_size=8",
        "trainer.micro_batch_size=4",
        "model.width=8",
    )
    files = sorted(p.suffix for p in (tmp_path / "folders" / "images-24-16").glob("class*/*"))
    assert set(files) == {".jpg", ".png"}
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("folder-*.json")]
    (row,) = record["rows"]
    assert (row["mode"], row["workers"], len(row["weights"])) == ("lazy", 1, 1)
    assert row["main_mib"] > 0 and row["images_per_second"] > 0 and 0 <= row["loader_wait"] < 1
    assert "| 24 | lazy | 1 |" in next(tmp_path.glob("folder-*.md")).read_text()


@pytest.mark.e2e
def test_profile_step_refuses_a_window_without_warm_up():
    out = launch.run(
        [sys.executable, str(ROOT / "scripts" / "profile_step.py"), "--warmup", "0"],
        capture_output=True,
        text=True,
        env=user_env(),
    )
    assert out.returncode == 2 and "--warmup 1 or more" in out.stderr


def test_a_second_result_the_same_day_keeps_the_first(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from _results import write_results
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    env = {"gpu": "NVIDIA H200"}
    write_results(tmp_path, "benchmark", "2026-11-29", env, "first\n", {"n": 1})
    write_results(tmp_path, "benchmark", "2026-11-29", env, "second\n", {"n": 2})
    first = tmp_path / "benchmark-2026-11-29-NVIDIA_H200.md"
    assert first.read_text() == "first\n"
    assert (tmp_path / "benchmark-2026-11-29-NVIDIA_H200-2.md").read_text() == "second\n"
    assert json.loads((tmp_path / "benchmark-2026-11-29-NVIDIA_H200-2.json").read_text()) == {
        "n": 2
    }


def test_the_reference_loop_repeats_its_bits():
    """scripts/reference_loop.py, the hand-written peer of benchmark.py --reference: on the
    CPU here (the benchmark runs it on a GPU), twice the same weights; a segmentation
    config too (the task's loss: plain cross-entropy would fail on the border's 255)."""
    import importlib.util

    from conftest import SMALL_DATA

    spec = importlib.util.spec_from_file_location(
        "reference_loop", ROOT / "scripts" / "reference_loop.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = [*SMALL_DATA, "model.width=8"]
    a, b = (module.reference_run(args, 6, 2, compiled=False, device="cpu") for _ in range(2))
    assert a["weights"] == b["weights"] and a["images_per_second"] > 0
    seg = ["experiment=segmentation", "data.train_size=16", "data.val_size=4", "model.width=4"]
    seg += ["trainer.batch_size=4", "trainer.micro_batch_size=2"]
    a, b = (module.reference_run(seg, 3, 1, compiled=False, device="cpu") for _ in range(2))
    assert a["weights"] == b["weights"] and a["images_per_second"] > 0


def test_the_reference_loops_native_patches_are_windows_of_their_images_turned_and_flipped(
    tmp_path,
):
    """benchmark.py --reference's hand loop for experiment=segmentation_native cuts every
    patch in one gather (NativePatches): each mask patch must be one of the 8 flips and turns
    of a window of its own mask (the image moves with it); and the loop repeats its bits."""
    import importlib.util

    import torch

    from repro.components.data.synthetic import write_nuclei_folder

    spec = importlib.util.spec_from_file_location(
        "reference_loop", ROOT / "scripts" / "reference_loop.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    masks = [torch.arange(h * w).view(h, w) + o for h, w, o in ((9, 12, 0), (14, 8, 1000))]
    images = [m[None].float() * 2 for m in masks]

    class Split:  # what NativePatches reads of a split: its length and fetch
        def __len__(self):
            return 2

        def fetch(self, index):
            return images, masks

    split = Split()
    patches = module.NativePatches(split, 5, torch.device("cpu"), torch.Generator().manual_seed(0))
    x, y = patches.batch(64)
    assert x.shape == (64, 1, 5, 5) and y.shape == (64, 5, 5)
    seen = set()
    for patch in y:
        k = next(k for k, m in enumerate(masks) if int(patch[0, 0]) in m)  # its image
        r, c = ((masks[k] == patch.min()).nonzero()[0]).tolist()  # the window's corner
        turns = [torch.rot90(patch, t).flip(f) if f else torch.rot90(patch, t)
                 for t in range(4) for f in ((), (-1,))]  # fmt: skip
        window = masks[k][r : r + 5, c : c + 5]
        assert any(torch.equal(t, window) for t in turns), patch
        seen.add(next(i for i, t in enumerate(turns) if torch.equal(t, window)))
    assert len(seen) == 8  # every flip and turn drawn
    folder = tmp_path / "nuclei"
    write_nuclei_folder(folder, 20, 0, (40, 60))
    native = ["experiment=segmentation_native", f"data.path={folder}", "data.num_classes=3",
              "data.channels=1", "data.image_size=32", "model.width=4", "amp=off",
              "trainer.batch_size=4", "trainer.micro_batch_size=4"]  # fmt: skip
    a, b = (module.reference_run(native, 3, 1, compiled=False, device="cpu") for _ in range(2))
    assert a["weights"] == b["weights"] and a["images_per_second"] > 0


@pytest.mark.e2e
def test_step_overhead_writes_the_pairs_and_their_median(tmp_path):
    run_script("step_overhead.py", "--repeats", "2", "--steps", "30", "--no-default-run",
               "--out", str(tmp_path))  # fmt: skip
    text = next(tmp_path.glob("step-overhead-*.md")).read_text()
    assert text.count("| 1 |") == 1 and text.count("| 2 |") == 1
    record = json.loads(next(tmp_path.glob("step-overhead-*.json")).read_text())
    assert len(record["pairs"]) == 2 and record["median_ratio"] > 0
    assert all(p["template"] > 0 and p["hand"] > 0 for p in record["pairs"])


@pytest.mark.e2e
def test_the_reference_benchmark_without_a_gpu_is_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: the benchmark would run")
    out = launch.run(
        [sys.executable, str(ROOT / "scripts" / "benchmark.py"), "--reference"],
        capture_output=True,
        text=True,
        env=user_env(),
    )
    assert out.returncode == 2 and "--reference needs a CUDA GPU" in out.stderr


@pytest.mark.e2e
def test_augment_benchmark_times_the_loader_keyed_and_unkeyed(tmp_path):
    run_script(
        "augment_benchmark.py",
        *("--images", "40", "--min-side", "30", "--max-side", "50", "--workers", "0"),
        *("--batch", "8", "--batches", "2", "--warmup", "1", "--repeats", "1"),
        *("--root", str(tmp_path / "folders"), "--out", str(tmp_path / "out")),
        *("--", "data.image_size=16"),
    )
    (record,) = [json.loads(p.read_text()) for p in (tmp_path / "out").glob("augment-*.json")]
    (row,) = record["rows"]
    assert row["workers"] == 0 and row["keyed"] > 0 and row["unkeyed"] > 0
    assert record["keying"]["global_states_us"] > 0
    assert len(list((tmp_path / "folders").rglob("*.jpg"))) == 40
    table = next((tmp_path / "out").glob("augment-*.md")).read_text()
    assert "| 0 |" in table and "keyed / unkeyed" in table


def test_make_train_says_whether_this_machine_is_the_published_digests(
    tmp_path, monkeypatch, capsys
):
    """scripts/published_digest.py: the README's digest with the fingerprint entries that
    decide it (benchmarks/default-run.json); a run whose entries match gave it or is named as
    a mismatch; one whose entries differ is told which, and that another digest is expected."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "published_digest", ROOT / "scripts" / "published_digest.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    record = json.loads(script.RECORD.read_text())
    assert set(record["deciding"]) == {key for _, key, _ in script.DECIDING}
    digest = record["weights_sha256"]
    readme = (ROOT / "README.md").read_text()
    assert f"`{digest[:8]}…{digest[-8:]}`" in readme  # the README quotes the record
    assert record["deciding"]["cpu_capability"] in readme

    def run(name, deciding, weights):
        run_dir = tmp_path / "outputs" / "day" / name
        run_dir.mkdir(parents=True)
        env = {"environment": {}, "flags": {}}
        for section, key, _ in script.DECIDING:
            env[section][key] = deciding[key]
        (run_dir / "env.json").write_text(json.dumps(env))
        (run_dir / "summary.json").write_text(json.dumps({"weights_sha256": weights}))
        return run_dir

    # the entries it compares are the ones a run's env.json records
    from repro.records.fingerprint import determinism_flags, environment

    recorded = {"environment": environment(), "flags": determinism_flags()}
    assert all(key in recorded[section] for section, key, _ in script.DECIDING)
    same = run("same", record["deciding"], digest)
    assert script.main([str(same)]) == 0
    assert "this machine decides the bits alike, and gave it" in capsys.readouterr().out
    assert script.newest_run(tmp_path / "outputs") == same
    other = run("other", {**record["deciding"], "intra_op_threads": 1}, "ab" * 32)
    monkeypatch.chdir(tmp_path)
    assert script.main([str(other)]) == 0  # another digest expected: no error
    said = capsys.readouterr().out
    assert "(intra-op threads: 1 here vs 2)" in said and "another digest is expected" in said
    broken = run("broken", record["deciding"], "cd" * 32)
    assert script.main([str(broken)]) == 0  # the same entries, other bits: said, not fatal
    assert "but this run gave cdcdcdcd…cdcdcdcd" in capsys.readouterr().err
    assert script.main([str(tmp_path / "none")]) == 2
