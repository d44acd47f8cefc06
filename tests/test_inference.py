"""A trained run on data it did not train on: trainer.test, repro evaluate, repro predict."""

import csv
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import launch
from conftest import (
    ROOT,
    SMALL_DATA,
    TRACED,
    preserved_global_state,
    run_defaults,
    train_here,
    user_env,
)
from optional import require
from repro.base.errors import ConfigError
from repro.components.data import synthetic, synthetic_shapes
from repro.defense.config import compose
from repro.defense.determinism import apply_determinism
from repro.engine.inference import choose_checkpoint, evaluate_checkpoint, predict

TESTED = [
    "trainer.max_steps=8",
    "trainer.eval_every=4",
    "trainer.test=true",
    "data.test_size=96",
    *SMALL_DATA,
    "model.width=8",
    "loader=single",
    "determinism.cpu_threads=1",  # as every test's run (conftest.run_defaults)
]


def repro(*args: str) -> subprocess.CompletedProcess:
    return launch.run(
        [sys.executable, "-m", "repro", *map(str, args)],
        cwd=ROOT,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def write_images(folder, images: torch.Tensor) -> None:
    """The images as PNG files, every other one at another size (read back at image_size)."""
    from PIL import Image

    folder.mkdir()
    for i, image in enumerate(images):
        picture = Image.fromarray(image.permute(1, 2, 0).numpy())
        if i % 2:
            picture = picture.resize((picture.width + 7, picture.height + 3))
        picture.save(folder / f"{i:03d}.png")


@pytest.fixture(scope="module")
def tested(tmp_path_factory):
    """A run with trainer.test=true (evaluations at steps 4 and 8), trained in this process
    with the launch's overrides written where train.py writes them (.hydra/overrides.yaml),
    which is what repro evaluate and predict compose the run's config from."""
    run = train_here(tmp_path_factory.mktemp("tested") / "run", *TESTED)
    (run.dir / ".hydra").mkdir()
    (run.dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in TESTED))
    return run


@pytest.mark.e2e
def test_repro_evaluate_gives_the_test_metrics_trainer_test_gave_bit_for_bit(tested):
    test = tested.summary["test"]
    assert test == json.loads((tested.dir / "test.json").read_text())
    assert test["split"] == "test" and test["checkpoint"] == "best.pt"
    assert test["step"] == tested.summary["best"]["step"]
    assert set(test["metrics"]) == {"test_loss", "test_accuracy"}
    later = repro("evaluate", tested.dir)  # another process, a while later
    assert later.returncode == 0, later.stderr
    assert json.loads(later.stdout) == test  # exact floats: JSON round-trips them
    cfg = compose(TESTED, ROOT / "conf")
    assert choose_checkpoint(tested.dir, cfg, "last") == tested.dir / "checkpoint.pt"
    assert choose_checkpoint(tested.dir, cfg) == tested.dir / "best.pt"
    assert choose_checkpoint(tested.dir / "none", cfg) == tested.dir / "none" / "checkpoint.pt"
    other = compose([*TESTED, "trainer.eval_batch_size=7"], ROOT / "conf")
    with pytest.raises(ConfigError, match=r"trainer.eval_batch_size: 256 \(checkpoint\) vs 7"):
        evaluate_checkpoint(other, tested.dir / "best.pt", torch.device("cpu"))


@pytest.mark.e2e
def test_repro_predict_writes_the_same_bytes_twice_and_refuses_to_overwrite(tested, tmp_path):
    inputs = tmp_path / "inputs"
    write_images(inputs, synthetic(train_size=1, val_size=12).val.images)
    first, second = tmp_path / "first.csv", tmp_path / "second.csv"
    done = repro("predict", tested.dir, inputs, "--out", first)  # the command
    assert done.returncode == 0, done.stderr
    # and its function again, in this process (a second process costs CI time): the same bytes
    cfg = compose(TESTED, ROOT / "conf")
    with preserved_global_state():
        apply_determinism(cfg, torch.device("cpu"))
        predict(cfg, choose_checkpoint(tested.dir, cfg), torch.device("cpu"), inputs, second)
    assert first.read_bytes() == second.read_bytes()
    with open(first) as f:
        rows = list(csv.DictReader(f))
    assert [r["file"] for r in rows] == [f"{i:03d}.png" for i in range(12)]
    for row in rows:
        probs = [float(row[f"p{c}"]) for c in range(10)]
        assert int(row["prediction"]) == probs.index(max(probs))
        assert abs(sum(probs) - 1) < 1e-5
    before = first.read_bytes()
    refused = repro("predict", tested.dir, inputs, "--out", first)
    assert refused.returncode == 2 and "exists; give another --out" in refused.stderr
    assert first.read_bytes() == before


def test_a_grayscale_folder_run_records_its_class_names_and_predict_writes_them(tmp_path):
    require("PIL")
    from PIL import Image

    for c, name in enumerate(("cat", "dog")):
        (tmp_path / "images" / name).mkdir(parents=True)
        for i in range(12):
            Image.new("L", (16, 16), 60 + 120 * c + i).save(tmp_path / "images" / name / f"{i}.png")
    args = [f"data.path={tmp_path / 'images'}", "data=image_folder", "data.channels=1"]
    args += ["data.image_size=16", "data.val_fraction=0.25", "trainer.batch_size=8"]
    args += ["trainer.micro_batch_size=4", "trainer.max_steps=2", "trainer.eval_every=2"]
    run = train_here(tmp_path / "run", *args, "model.width=8")
    assert run.summary["class_names"] == ["cat", "dog"]
    weights = torch.load(run.dir / "checkpoint.pt", weights_only=True)["model"]
    assert next(w for w in weights.values() if w.dim() == 4).shape[1] == 1  # one channel in
    cfg = compose(run_defaults([*args, "model.width=8"]), ROOT / "conf")  # the run's
    out = tmp_path / "predictions.csv"
    predict(cfg, run.dir / "checkpoint.pt", torch.device("cpu"), tmp_path / "images", out)
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0])[:4] == ["file", "prediction", "class", "p0"]
    assert all(r["class"] == ("cat", "dog")[int(r["prediction"])] for r in rows) and len(rows) == 24


@pytest.mark.e2e
def test_a_run_without_a_test_split_is_one_line(traced_runs, tmp_path):
    run = traced_runs["a"]
    cfg = compose(TRACED, ROOT / "conf")
    with pytest.raises(ConfigError, match=r"has no test split; give it one \(data.test_size"):
        evaluate_checkpoint(cfg, run.dir / "checkpoint.pt", torch.device("cpu"))
    out = repro("evaluate", run.dir)  # the command line names the way out, which works
    assert out.returncode == 2 and out.stderr.strip().endswith("validation split: --split val.")
    val = repro("evaluate", run.dir, "--split", "val")
    assert val.returncode == 0, val.stderr
    with pytest.raises(ConfigError, match="trainer.test=true, but data .* has no test split"):
        train_here(tmp_path / "run", *SMALL_DATA, "trainer.max_steps=1", "trainer.test=true")
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


def test_segmentation_predictions_are_masks_and_repeat(tmp_path):
    seg = [
        "experiment=segmentation",
        "trainer.max_steps=2",
        "trainer.eval_every=2",
        "trainer.batch_size=8",
        "trainer.micro_batch_size=4",
        "data.train_size=16",
        "data.val_size=8",
        "data.image_size=32",
    ]
    run = train_here(tmp_path / "run", *seg)
    cfg = compose(run_defaults(seg), ROOT / "conf")  # the run's
    inputs = tmp_path / "inputs"
    write_images(inputs, synthetic_shapes(train_size=1, val_size=3, image_size=32).val.images)
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        assert predict(cfg, choose_checkpoint(run.dir, cfg), torch.device("cpu"), inputs, out) == 3
    names = sorted(p.name for p in outs[0].iterdir())
    assert names == ["000.png", "001.png", "002.png"]
    assert all((outs[0] / n).read_bytes() == (outs[1] / n).read_bytes() for n in names)
    from PIL import Image

    # the model saw 32x32; the mask is on its input's own grid (39x35), back at its size
    with Image.open(outs[0] / "001.png") as mask, Image.open(inputs / "001.png") as image:
        assert image.size != (32, 32) and mask.size == image.size
        assert int(np.asarray(mask).max()) < 4


@pytest.mark.parametrize("override", ["data.test_size=512", "data.noise=0.9", "data.seed=7"])
def test_evaluate_refuses_every_setting_that_changes_the_score(tested, override):
    """The test split's size, the data's noise or seed: another score for the same
    checkpoint, so evaluate refuses them, naming the key."""
    cfg = compose([*TESTED, override], ROOT / "conf")
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{key}: .* \(checkpoint\) vs .* \(now\)") as err:
        evaluate_checkpoint(cfg, tested.dir / "best.pt", torch.device("cpu"))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "override", ["data.image_size=64", "data.noise=0.9", "trainer.eval_batch_size=1"]
)
def test_predict_refuses_settings_that_change_its_bytes(tested, tmp_path, override):
    inputs = tmp_path / "inputs"
    write_images(inputs, synthetic(train_size=1, val_size=2).val.images)
    cfg = compose([*TESTED, override], ROOT / "conf")
    with pytest.raises(ConfigError, match=rf"{override.split('=')[0]}: .* \(checkpoint\) vs"):
        predict(
            cfg, choose_checkpoint(tested.dir, cfg), torch.device("cpu"), inputs, tmp_path / "o"
        )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ["evaluate", "predict", "rerun"])
def test_a_damaged_launch_record_is_one_line(tested, tmp_path, capsys, command):
    """repro evaluate, predict and rerun compose the run's config from its
    .hydra/overrides.yaml: a damaged one is one line naming it (exit 2), never a traceback.
    (A damaged config.yaml beside it is not read: the command works.)"""
    import shutil

    from repro.cli import main

    run_dir = shutil.copytree(tested.dir, tmp_path / "run")
    (run_dir / ".hydra" / "overrides.yaml").write_bytes(b"- [unclosed\n\xff\xfe: {")
    (run_dir / ".hydra" / "config.yaml").write_bytes(b"\xff\xfe: {")
    args = {
        "evaluate": ["evaluate", str(run_dir)],
        "predict": ["predict", str(run_dir), str(tmp_path), "--out", str(tmp_path / "p.csv")],
        "rerun": ["rerun", str(run_dir), "--out", str(tmp_path / "again")],
    }[command]
    with preserved_global_state():
        status = main(args)
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith(f"repro {command}: {run_dir}/.hydra/overrides.yaml: "), err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "again").exists() and not (tmp_path / "p.csv").exists()
    if command == "evaluate":  # the launch's record restored: config.yaml is not read
        (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in TESTED))
        with preserved_global_state():
            assert main(args) == 0, capsys.readouterr().err
