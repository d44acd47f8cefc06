"""A run directory is a sealed record.

A checkpoint scores the same for as long as it is kept: what scoring needs of the training
data (normalisation, intensity rule, channels, class names) is in the checkpoint's scoring
record (repro.records.scoring), so an external folder's per-image scores and a prediction's
bytes do not move when the training folder grows, and do not need it at all. A checkpoint
written before the record falls back to the training folder, with a warning.

What decided the split besides the config -- the folder's file names, a group or split
CSV's contents -- is in the run's fingerprint (env.json, checkpoints): repro compare names
it, and a resume on other ones is refused naming the file.

One native segmentation run (12-bit, non-square images, 6 steps) trains here, in this
process, on a folder of its own that the tests grow and rename; the split tests train two
short runs of their own beside it."""

import json
import logging
import re
import shutil

import pytest
import torch

from conftest import NATIVE, Stop, repro_here, run_defaults, stop_after, train_here
from repro.base.errors import CheckpointError, ConfigError
from repro.components.data.splitting import split_inputs
from repro.components.data.synthetic import write_nuclei_folder
from repro.defense.config import compose
from repro.engine.build import build_data
from repro.records.checkpoint import save_checkpoint
from repro.records.fingerprint import SPLIT_KEY, split_mismatches
from repro.records.scoring import SCORING_FORMAT, ScoringRecord
from repro.tools.compare import compare_dirs


@pytest.fixture(scope="module")
def sealed(tmp_path_factory):
    """The run (with the launch record train.py writes, which repro evaluate and predict
    compose its config from), its training folder, and a held-out annotated folder."""
    root = tmp_path_factory.mktemp("sealed")
    training = root / "training"
    write_nuclei_folder(training, count=12, seed=3, sizes=(90, 130))
    heldout = root / "heldout"
    write_nuclei_folder(heldout, count=4, seed=11, sizes=(80, 120))
    overrides = list(run_defaults([*NATIVE, f"data.path={training}"]))
    run = train_here(root / "run", *overrides)
    (run.dir / ".hydra").mkdir()
    (run.dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    run.overrides = overrides
    return run, training, heldout


def scored(run_dir, heldout, out):
    """``repro evaluate RUN --folder HELDOUT`` and ``repro predict RUN HELDOUT/images
    --probabilities``, into the folder ``out``: the per-image CSV's bytes, each prediction
    file's bytes."""
    out.mkdir()
    assert repro_here("evaluate", run_dir, "--folder", heldout, "--out", out / "ext.json") == 0
    predictions = out / "pred"
    assert repro_here("predict", run_dir, heldout / "images", "--out", predictions,
                      "--probabilities") == 0  # fmt: skip
    files = {p.name: p.read_bytes() for p in sorted(predictions.iterdir())}
    return (out / "ext_per_image.csv").read_bytes(), files


def grow(training, tmp_path):
    """Add 8 images of 16-bit brightness (16 times the others' values) to the training
    folder: its first training images, and so its statistics, change. Returns the files."""
    extra = tmp_path / "extra"
    write_nuclei_folder(extra, count=8, seed=5, sizes=(90, 130), bits=16)
    added = []
    for kind in ("images", "masks"):
        for f in sorted((extra / kind).iterdir()):
            added.append(training / kind / f"extra_{f.name}")
            shutil.copy(f, added[-1])
    return added


def test_a_checkpoint_scores_the_same_after_its_training_folder_grows_and_is_renamed(
    sealed, tmp_path
):
    run, training, heldout = sealed
    before = scored(run.dir, heldout, tmp_path / "before")
    assert before[0].count(b"\n") == 5 and len(before[1]) == 8  # 4 rows; 4 masks, 4 .npy
    added = grow(training, tmp_path)
    try:
        grown = scored(run.dir, heldout, tmp_path / "grown")
        moved = training.with_name("training-moved")
        training.rename(moved)
        try:
            gone = scored(run.dir, heldout, tmp_path / "gone")  # data.path is not there
        finally:
            moved.rename(training)
        assert grown == before and gone == before

        # the same checkpoint without its record (as written before it existed): the
        # training folder as it is now decides the normalisation, and the scores move --
        # what the record prevents -- with one warning saying so
        old = tmp_path / "old-run"
        shutil.copytree(run.dir, old)
        for name in ("best.pt", "checkpoint.pt"):
            state = torch.load(old / name, weights_only=True)
            del state["scoring"], state["content_sha256"]
            save_checkpoint(old / name, state)
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("repro").addHandler(handler)
        try:
            fallback = scored(old, heldout, tmp_path / "old")
        finally:
            logging.getLogger("repro").removeHandler(handler)
    finally:
        for f in added:  # the folder as the run trained on it, for the module's other tests
            f.unlink()
    warned = [r.getMessage() for r in records if "scoring record" in r.getMessage()]
    assert len(warned) == 2 and f"data.path={training}" in warned[0], warned  # one a command
    assert fallback[0] != before[0] and fallback[1] != before[1]


def test_the_record_holds_the_statistics_the_run_trained_with(sealed):
    run, training, _ = sealed
    state = torch.load(run.dir / "checkpoint.pt", weights_only=True)
    record = ScoringRecord.from_state(state, run.dir / "checkpoint.pt")
    cfg = compose(run.overrides)
    data = build_data(cfg)  # the folder as the run saw it (the other test puts it back)
    mean, std = data.normalisation()
    assert (record.mean, record.std) == (tuple(mean), tuple(std))
    assert record.channels == 1 and record.num_classes == 3
    assert record.class_names == ("background", "nucleus", "boundary")
    assert record.intensity == {"mode": "auto"} and record.image_size == 64
    assert record.inference["mode"] == "native" and record.inference["tile_batch"] == 2
    assert record.eval_pipeline is None or "_target_" in record.eval_pipeline
    assert state["scoring"]["format"] == SCORING_FORMAT
    # the task's declarations, for repro report: bounded metrics and counts
    assert run.summary["metric_bounds"]["val_dice"] == [0.0, 1.0]
    assert "val_loss" not in run.summary["metric_bounds"]
    assert "val_empty_nucleus" in run.summary["count_metrics"]
    directions = run.summary["metric_directions"]
    assert directions["val_dice"] is True and directions["val_loss"] is False
    assert directions["val_iou_nucleus"] is True and "val_empty_nucleus" not in directions


@pytest.mark.parametrize(
    "change, message",
    [
        ({"format": "repro.scoring.v9"}, "format 'repro.scoring.v9', which this version"),
        ({"mean": [0.5, 0.5]}, "no channel statistics for its 1 channels"),
        ({"channels": 2, "mean": [0.5, 0.5]}, "2 means and 1 standard deviations"),
        ({"std": [0.0]}, "no channel statistics"),
        ({"class_names": ["a"]}, "names \\['a'\\] for 3 classes"),
        ({"num_classes": "3"}, "num_classes='3'"),
        ({"mask_map": {"1": 2}}, "mask_map="),
    ],
)
def test_a_damaged_or_foreign_record_is_one_line_naming_the_file(tmp_path, change, message):
    record = {
        "format": SCORING_FORMAT,
        "num_classes": 3,
        "channels": 1,
        "class_names": ["a", "b", "c"],
        "image_size": 64,
        "mean": [0.1],
        "std": [0.2],
        "intensity": {"mode": "auto"},
        "mask_map": None,
        "inference": {"mode": "native"},
        "eval_pipeline": None,
    }
    path = tmp_path / "checkpoint.pt"
    assert ScoringRecord.from_state({"scoring": record}, path).mean == (0.1,)
    assert ScoringRecord.from_state({}, path) is None  # before the record: the fallback
    one_for_all = {**record, "channels": 3}  # a dataset's own single mean and std: broadcast
    assert ScoringRecord.from_state({"scoring": one_for_all}, path).std == (0.2,)
    with pytest.raises(CheckpointError, match=f"^{path}: its scoring record .*{message}"):
        ScoringRecord.from_state({"scoring": {**record, **change}}, path)


# ---------------------------------------------------------------- what decided the split


def test_an_edited_group_csv_is_named_by_compare_and_refuses_the_resume(sealed, tmp_path):
    run, training, _ = sealed
    stems = sorted(f.stem for f in (training / "images").iterdir())
    groups = tmp_path / "groups.csv"
    first = "file,group\n" + "".join(f"{s},g{i // 2}\n" for i, s in enumerate(stems))
    groups.write_text(first)
    short = [*run.overrides, f"data.group_csv={groups}", "trainer.max_steps=4",
             "trainer.checkpoint_every=2", "trainer.eval_every=2"]  # fmt: skip
    with pytest.raises(Stop):
        train_here(tmp_path / "a", *short, after_step=stop_after(3))  # a checkpoint at step 2
    recorded = json.loads((tmp_path / "a" / "env.json").read_text())["environment"][SPLIT_KEY]
    assert recorded["file_names"]["count"] == 12
    assert recorded["group_csv"]["path"] == str(groups)

    groups.write_text(first.replace(f"{stems[0]},g0", f"{stems[0]},g5"))  # one row edited
    with pytest.raises(CheckpointError, match=re.escape(f"data.group_csv={groups} changed")):
        train_here(tmp_path / "a", *short, "trainer.resume=auto")
    edited = train_here(tmp_path / "b", *short, "trainer.resume=auto")  # from step 0
    groups.write_text(first)  # as the run trained: it resumes
    resumed = train_here(tmp_path / "a", *short, "trainer.resume=auto")
    assert resumed.summary["resumes"][0]["step"] == 2
    assert resumed.summary["config_hash"] == edited.summary["config_hash"]  # one config
    text = compare_dirs(resumed.dir, edited.dir).text()
    assert f"{SPLIT_KEY}.group_csv.sha256" in text, text


def test_the_split_inputs_are_digests_of_the_names_and_the_csv_bytes(tmp_path):
    names = [f"case{i:02d}" for i in range(6)]
    csv = tmp_path / "groups.csv"
    csv.write_text("file,group\n" + "".join(f"{n},{n[:5]}\n" for n in names))
    record = split_inputs(names, group_csv=str(csv))
    assert record == split_inputs(list(reversed(names)), group_csv=str(csv))  # order: none
    assert record["file_names"]["count"] == 6 and "split_file" not in record
    grown = split_inputs([*names, "case99"], group_csv=str(csv))
    assert grown["group_csv"] == record["group_csv"]
    lines = split_mismatches(record, grown)
    assert len(lines) == 1 and "the files under data.path, 6 (checkpoint) vs 7 (now)" in lines[0]
    csv.write_text(csv.read_text().replace("case00,case0", "case00,other"))
    edited = split_inputs(names, group_csv=str(csv))
    assert edited["file_names"] == record["file_names"]
    (line,) = split_mismatches(record, edited)
    assert f"data.group_csv={csv} changed, sha256" in line
    assert split_mismatches(record, None) == split_mismatches(None, record) == []  # unknown
    assert split_mismatches(record, split_inputs(names, group_csv=str(csv))) != []
    assert split_mismatches(edited, split_inputs(names, group_csv=str(csv))) == []


def test_evaluate_split_refuses_a_training_folder_whose_classes_changed(tmp_path, caplog):
    """``--split test`` draws the split from the training folder as it is now: a class
    folder added since (every label would shift) is refused in one line; a file added is
    said (the split is another set of files)."""
    from PIL import Image

    from repro.engine.inference import evaluate_checkpoint

    images = tmp_path / "images"
    for c, name in enumerate(("cat", "dog")):
        (images / name).mkdir(parents=True)
        for i in range(12):
            Image.new("L", (16, 16), 60 + 120 * c + i).save(images / name / f"{i}.png")
    args = [f"data.path={images}", "data=image_folder", "data.channels=1", "model.width=8",
            "data.image_size=16", "data.val_fraction=0.25", "data.test_fraction=0.25",
            "trainer.batch_size=8", "trainer.micro_batch_size=4", "trainer.max_steps=2",
            "trainer.eval_every=2"]  # fmt: skip
    run = train_here(tmp_path / "run", *args)
    cfg = compose(run_defaults(args))
    cpu = torch.device("cpu")
    first = evaluate_checkpoint(cfg, run.dir / "checkpoint.pt", cpu, "test", force=True)
    Image.new("L", (16, 16), 30).save(images / "dog" / "99.png")  # a file more
    with caplog.at_level(logging.WARNING, logger="repro"):
        evaluate_checkpoint(cfg, run.dir / "checkpoint.pt", cpu, "test", force=True)
    assert "the files under data.path, 24 (checkpoint) vs 25 (now)" in caplog.text
    (images / "ant").mkdir()  # a class more, sorted first: every label would move by one
    for i in range(4):
        Image.new("L", (16, 16), 10 + i).save(images / "ant" / f"{i}.png")
    with pytest.raises(ConfigError, match="the training data now has 3 classes"):
        evaluate_checkpoint(cfg, run.dir / "checkpoint.pt", cpu, "test", force=True)
    assert first["samples"] > 0
