"""Segmentation at each image's own size: the sliding window (fixed tile order, Gaussian
weights, fp32 sums), native training and evaluation on a folder of non-square 16-bit images,
per-image records, prediction at each input's size, and evaluation of an external folder.

The native run trains once for the module, in this process; what must equal it (another
loader, a repeat) trains here too."""

import json
import math

import numpy as np
import pytest
import torch

from conftest import NATIVE as SMALL_NATIVE
from conftest import Run, cuda, repro_here, run_defaults, train_here
from repro.base.errors import ConfigError, DataError
from repro.components.data.synthetic import write_nuclei_folder
from repro.defense.config import compose
from repro.engine.inference import choose_checkpoint, evaluate_folder, predict
from repro.engine.sliding_window import Window, gaussian_weights, predict_logits, tile_starts


def test_tiles_cover_each_axis_evenly_from_edge_to_edge():
    for size, tile, overlap in [(244, 64, 0.5), (220, 64, 0.0), (64, 64, 0.5), (65, 64, 0.9)]:
        starts = tile_starts(size, tile, overlap)
        assert starts[0] == 0 and starts[-1] == size - tile
        gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        assert all(0 < g <= tile * (1 - overlap) + 1 for g in gaps)  # rounding: at most 1 px
    assert tile_starts(50, 64, 0.5) == [0]  # smaller than a tile: one, padded


def test_gaussian_weights_peak_in_the_centre_and_are_never_zero():
    w = gaussian_weights((64, 48), 0.125)
    assert w.shape == (64, 48) and float(w.max()) == 1.0 and float(w.min()) > 0
    assert torch.equal(w, w.flip(0)) and torch.equal(w, w.flip(1))


def pointwise(x: torch.Tensor) -> torch.Tensor:
    """A 'model' whose output at a pixel depends on that pixel only: tiling cannot change it
    except by rounding."""
    return torch.cat([x.sum(1, keepdim=True), -x[:, :1] * 2], 1)


@pytest.mark.parametrize("shape", [(3, 80, 130), (3, 40, 70), (3, 64, 64)])
def test_the_sliding_window_is_the_whole_image_forward_and_repeats_bit_for_bit(shape):
    image = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    window = Window(mode="native", tile=(64, 64), overlap=0.5, tile_batch=3)
    logits = predict_logits(pointwise, image, window)
    assert logits.shape == (2, *shape[1:]) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, pointwise(image[None])[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(logits, predict_logits(pointwise, image, window))  # deterministic
    mirrored = predict_logits(pointwise, image, Window("native", (64, 64), mirror=True))
    torch.testing.assert_close(mirrored, logits, rtol=1e-5, atol=1e-5)


def test_tiles_of_one_image_run_in_batches_of_tile_batch_in_a_fixed_order():
    seen = []

    def recording(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape[0])
        return pointwise(x)

    predict_logits(recording, torch.zeros(3, 128, 128), Window("native", (64, 64), tile_batch=4))
    assert seen == [4, 4, 1]  # 3 × 3 tiles in rows, 4 a forward


def test_the_tile_is_a_side_or_height_and_width_or_the_training_patch():
    def window(*overrides: str) -> Window:
        return Window.from_config(compose(["inference.mode=native", *overrides]).inference, 32)

    assert window("inference.tile=[96,64]").tile == (96, 64)
    assert window("inference.tile=80").tile == (80, 80)
    assert window().tile == (32, 32)  # data.image_size, the training patch's side


def test_bad_inference_settings_are_one_line(tmp_path):
    for override, key in [
        ("inference.overlap=1.0", "inference.overlap"),
        ("inference.tile_batch=0", "inference.tile_batch"),
        ("inference.tile=[0,4]", "inference.tile"),
    ]:
        with pytest.raises(ConfigError, match=key):
            compose([override])


# ---------------------------------------------------------------- native, end to end

NATIVE = [*SMALL_NATIVE, "task.unions={cell:[nucleus,boundary]}"]  # and a union


@pytest.fixture(scope="module")
def nuclei(tmp_path_factory):
    """A folder of 16 non-square 12-bit images (150-200 px) and 3-class masks."""
    root = tmp_path_factory.mktemp("nuclei") / "data"
    write_nuclei_folder(root, count=16, seed=3, sizes=(90, 130))
    return root


@pytest.fixture(scope="module")
def native_run(nuclei, tmp_path_factory) -> Run:
    """The native run, trained here, with the launch record train.py would write (which
    repro predict and evaluate compose the run's config from)."""
    overrides = list(run_defaults([*NATIVE, f"data.path={nuclei}"]))
    run = train_here(tmp_path_factory.mktemp("native") / "run", *overrides)
    (run.dir / ".hydra").mkdir()
    (run.dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    run.overrides = overrides
    return run


def test_native_runs_repeat_with_loader_workers_and_score_every_native_pixel(
    native_run, nuclei, tmp_path
):
    other = train_here(
        tmp_path / "multi", *NATIVE, f"data.path={nuclei}", "loader=multi", "loader.num_workers=2"
    )
    assert other.summary["weights_sha256"] == native_run.summary["weights_sha256"]
    for name in ("eval.csv", "val_per_image.csv", "metrics.csv"):
        assert (other.dir / name).read_text() == (native_run.dir / name).read_text()
    # each validation image scored at its own size: its rows count its native mask's pixels
    from PIL import Image

    for row in per_image_rows(native_run.dir):
        mask = np.array(Image.open(nuclei / "masks" / f"{row['sample']}.png"))
        for c, name in enumerate(("background", "nucleus", "boundary")):
            assert int(row[f"tp_{name}"]) + int(row[f"fn_{name}"]) == int((mask == c).sum())
        cell = int(row["tp_cell"]) + int(row["fn_cell"])
        assert cell == int(((mask == 1) | (mask == 2)).sum())
    summary = native_run.summary
    assert summary["headline"] == "val_dice" and "val_dice_cell" in summary
    assert math.isfinite(summary["val_dice_pooled"])


def per_image_rows(run_dir) -> list[dict]:
    rows = (run_dir / "val_per_image.csv").read_text().splitlines()
    return [dict(zip(rows[0].split(","), r.split(","), strict=True)) for r in rows[1:]]


def test_a_squashed_model_is_scored_against_each_native_mask(nuclei, tmp_path):
    """inference.mode=pipeline with a Resize: the model sees 32×32, its logits go back to
    each image's own grid and every native pixel is scored."""
    from PIL import Image

    run = train_here(
        tmp_path / "square", "experiment=segmentation", "data=image_mask_folder",
        f"data.path={nuclei}", "data.num_classes=3", "data.channels=1", "data.image_size=32",
        "data.val_fraction=0.3", "model.width=8", "model.depth=2", "trainer.batch_size=8",
        "trainer.micro_batch_size=8", "trainer.max_steps=2", "trainer.eval_every=2",
    )  # fmt: skip
    rows = per_image_rows(run.dir)
    assert rows
    for row in rows:
        mask = np.array(Image.open(nuclei / "masks" / f"{row['sample']}.png"))
        assert mask.shape != (32, 32)
        for c in range(3):
            assert int(row[f"tp_{c}"]) + int(row[f"fn_{c}"]) == int((mask == c).sum())


def test_predict_writes_each_mask_at_its_inputs_size_with_probabilities_and_overlay(
    native_run, nuclei, tmp_path
):
    import shutil

    from PIL import Image

    inputs = tmp_path / "inputs"  # 3 of the folder's images: each of its own size
    inputs.mkdir()
    for image in sorted((nuclei / "images").iterdir())[:3]:
        shutil.copy(image, inputs / image.name)
    out = tmp_path / "pred"
    assert repro_here("predict", native_run.dir, inputs, "--out", out, "--probabilities",
                      "--overlay") == 0  # fmt: skip
    for image in sorted(inputs.iterdir()):
        size = Image.open(image).size
        mask = Image.open(out / image.name)
        assert mask.size == size and mask.mode == "L"
        probs = np.load(out / image.with_suffix(".npy").name)
        assert probs.shape == (3, size[1], size[0]) and probs.dtype == np.float32
        np.testing.assert_allclose(probs.sum(0), 1, rtol=1e-5)
        assert Image.open(out / f"{image.stem}.overlay.png").size == size
    again = tmp_path / "again"  # again, in this process: the same bytes
    cfg = compose(native_run.overrides)
    predict(cfg, choose_checkpoint(native_run.dir, cfg), torch.device("cpu"), inputs, again)
    assert sorted(p.name for p in again.iterdir()) == sorted(p.name for p in inputs.iterdir())
    for mask in again.iterdir():
        assert mask.read_bytes() == (out / mask.name).read_bytes()


def test_an_external_annotated_folder_is_evaluated_whole(native_run, tmp_path):
    heldout = tmp_path / "heldout"
    write_nuclei_folder(heldout, count=5, seed=11, sizes=(80, 140))
    out = tmp_path / "external.json"
    assert repro_here("evaluate", native_run.dir, "--folder", heldout, "--out", out) == 0
    result = json.loads(out.read_text())
    assert result["samples"] == 5 and "external_dice" in result["metrics"]
    rows = (tmp_path / "external_per_image.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == [f"cell_{i:03d}" for i in range(5)]
    wrong = tmp_path / "wrong"
    write_nuclei_folder(wrong, count=2, seed=1)
    (wrong / "masks" / "cell_000.png").unlink()
    cfg = compose(native_run.overrides)
    with pytest.raises(DataError, match="--folder=.* have no mask, e.g. images/cell_000.png"):
        evaluate_folder(cfg, choose_checkpoint(native_run.dir, cfg), torch.device("cpu"), wrong)


@cuda
@pytest.mark.cuda
def test_native_segmentation_on_cuda_repeats_with_any_loader(nuclei, tmp_path):
    """Strict on the GPU: patches, the sliding window (Gaussian sums on the device), the
    per-image record: one set of bits for the main-process loader and for 2 workers."""
    runs = [
        train_here(tmp_path / name, *NATIVE, f"data.path={nuclei}", *loader)
        for name, loader in (
            ("single", ["loader=single"]),
            ("multi", ["loader=multi", "loader.num_workers=2"]),
        )  # fmt: skip
    ]
    assert runs[0].summary["device"].startswith("cuda")
    assert runs[0].summary["weights_sha256"] == runs[1].summary["weights_sha256"]
    for name in ("eval.csv", "val_per_image.csv"):
        assert (runs[0].dir / name).read_text() == (runs[1].dir / name).read_text()


def test_a_folder_lists_one_image_and_one_mask_a_stem(tmp_path):
    from PIL import Image

    from repro.base.errors import DataError
    from repro.components.data.folders import image_mask_pairs

    write_nuclei_folder(tmp_path / "one", count=1, seed=2, sizes=(40, 50))
    assert image_mask_pairs(tmp_path / "one", "--folder", least=1)[0] == ["cell_000"]
    with pytest.raises(DataError, match="need 2 or more"):
        image_mask_pairs(tmp_path / "one")  # a dataset splits: two at least
    Image.new("L", (4, 4)).save(tmp_path / "one" / "images" / "cell_000.tif")
    with pytest.raises(DataError, match="cell_000.png and images/cell_000.tif are two images"):
        image_mask_pairs(tmp_path / "one", "--folder", least=1)


def test_native_inference_on_class_labels_is_one_line():
    from repro.engine.build import build_data

    cfg = compose(["inference.mode=native", "data.train_size=64", "data.val_size=8"])
    with pytest.raises(ConfigError, match="inference.mode=native .* class labels"):
        build_data(cfg)
