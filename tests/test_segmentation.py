"""Segmentation end to end: the task (loss, exact metrics), the data (masks move with their
images, lazy folders), the UNet, and every promise of the template on a small UNet: repeats,
loader invariance, SIGKILL + resume, 1 vs 2 processes, a seed sweep and its report.

The reference run trains once for the module in this process; what must equal it trains
in this process too where a process is not the point, else as a user does (train.py)."""

import json
import math
import signal

import numpy as np
import pytest
import torch

import launch
from conftest import Run, cuda, run_train, train_cmd, train_here, user_env, with_tests_on_path
from optional import require
from repro.base.errors import ConfigError, DataError, DeterminismError
from repro.components.data import (
    IGNORE,
    CropFlip,
    DataSplits,
    KeyedBatches,
    KeyedPipeline,
    LazyImageMasks,
    Resize,
    TensorImages,
    image_mask_folder,
    synthetic_shapes,
)
from repro.components.data.synthetic import write_shapes_folder
from repro.components.models import UNet
from repro.components.tasks import Segmentation
from repro.records.trace import tensors_sha256
from repro.tools.compare import compare_dirs

# A small UNet on small shapes: 256 / 16 = 16 steps an epoch, checkpoints at 10 and 20
# (mid-epoch), 2 micro-batches of 8 a step (one per process under torchrun).
SEG = [
    "experiment=segmentation",
    "model.width=8",
    "model.depth=2",
    "data.image_size=32",
    "data.train_size=256",
    "data.val_size=64",
    "trainer.batch_size=16",
    "trainer.micro_batch_size=8",
    "trainer.eval_batch_size=32",
    "trainer.max_steps=30",
    "trainer.eval_every=15",
    "trainer.checkpoint_every=10",
    "trainer.trace_every=5",
    "trainer.log_every=1",
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted one-process run (strict, main-process loader)."""
    return train_here(tmp_path_factory.mktemp("seg") / "ref", *SEG)


def assert_same_bits(run: Run, reference: Run) -> None:
    assert run.summary["weights_sha256"] == reference.summary["weights_sha256"]
    for name in ("metrics.csv", "eval.csv"):
        assert (run.dir / name).read_text() == (reference.dir / name).read_text()
    result = compare_dirs(reference.dir, run.dir)
    assert result.identical, result.text()


# ------------------------------------------------------------------------- the task


def scored(task: Segmentation, outputs: torch.Tensor, targets: torch.Tensor) -> dict:
    """The task's metrics of one batch, as the evaluation computes them."""
    return task.metrics(task.statistics(outputs, targets), task.per_sample(outputs, targets))


def test_metrics_are_exact_counts_whatever_the_eval_batch_size():
    g = torch.Generator().manual_seed(0)
    outputs = torch.randn(10, 4, 12, 12, generator=g)
    targets = torch.randint(0, 4, (10, 12, 12), generator=g)
    targets[3, :4] = IGNORE
    task = Segmentation(num_classes=4)

    def summed(batch: int) -> tuple[dict, dict]:
        totals, rows = {}, []
        for i in range(0, 10, batch):
            part = outputs[i : i + batch], targets[i : i + batch]
            for k, v in task.statistics(*part).items():
                totals[k] = totals[k] + v if k in totals else v
            rows.append(task.per_sample(*part))
        return totals, {k: torch.cat([r[k] for r in rows]) for k in rows[0]}

    whole = summed(10)
    assert whole[0]["confusion"].dtype == torch.int64
    for batch in (1, 3, 4):
        totals = summed(batch)
        assert torch.equal(totals[0]["confusion"], whole[0]["confusion"])
        metrics, reference = task.metrics(*totals), task.metrics(*whole)
        assert {k: v for k, v in metrics.items() if k != "val_loss"} == {
            k: v for k, v in reference.items() if k != "val_loss"
        }
    assert int(whole[0]["confusion"].sum()) == 10 * 144 - 4 * 12  # ignored pixels not scored


def test_dice_and_iou_follow_their_definitions():
    # 1×6 image, classes 0..2; truth 0 0 1 1 2 2, prediction 0 1 1 1 2 0
    targets = torch.tensor([[[0, 0, 1, 1, 2, 2]]])
    pred = torch.tensor([[[0, 1, 1, 1, 2, 0]]])
    outputs = torch.nn.functional.one_hot(pred, 3).permute(0, 3, 1, 2).float()
    task = Segmentation(num_classes=3)
    m = scored(task, outputs, targets)
    # class 1: TP 2, FP 1, FN 0; class 2: TP 1, FP 0, FN 1; class 0: TP 1, FP 1, FN 1
    assert m["val_dice_1"] == 4 / 5 and m["val_iou_1"] == 2 / 3
    assert m["val_dice_2"] == 2 / 3 and m["val_iou_2"] == 1 / 2
    assert m["val_dice_0"] == 2 / 4
    assert m["val_dice"] == (4 / 5 + 2 / 3) / 2  # the background left out of the mean
    assert m["val_pixel_accuracy"] == 4 / 6
    with_background = Segmentation(num_classes=3, include_background=True)
    m = scored(with_background, outputs, targets)
    assert m["val_dice"] == (2 / 4 + 4 / 5 + 2 / 3) / 3


def one_hot_outputs(pred: torch.Tensor, classes: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(pred, classes).permute(0, 3, 1, 2).float()


def test_the_headline_is_the_per_image_mean_and_the_pooled_value_is_kept():
    # two 1×4 images, classes background / nucleus / boundary
    targets = torch.tensor([[[1, 1, 1, 1]], [[0, 0, 0, 2]]])
    pred = torch.tensor([[[1, 1, 1, 1]], [[0, 0, 1, 2]]])
    task = Segmentation(num_classes=3, class_names=["background", "nucleus", "boundary"])
    m = scored(task, one_hot_outputs(pred, 3), targets)
    # nucleus: image 0 Dice 1, image 1 has no reference nucleus but predicts one: 0
    assert m["val_dice_nucleus"] == (1 + 0) / 2
    assert m["val_dice_nucleus_pooled"] == 2 * 4 / (2 * 4 + 1 + 0)
    # boundary: image 0 has none in reference or prediction: left out and counted
    assert m["val_dice_boundary"] == 1.0 and m["val_empty_boundary"] == 1
    assert m["val_dice"] == (0.5 + 1.0) / 2
    assert m["val_dice_pooled"] == (8 / 9 + 1.0) / 2  # today's pooled value, kept
    samples = task.per_sample(one_hot_outputs(pred, 3), targets)
    assert samples["tp_nucleus"].tolist() == [4, 0] and samples["fp_nucleus"].tolist() == [0, 1]


def test_a_union_of_classes_is_scored_as_one_class():
    targets = torch.tensor([[[1, 2, 0, 0]]])
    pred = torch.tensor([[[2, 1, 0, 0]]])  # nucleus and boundary swapped: the cell is right
    task = Segmentation(
        num_classes=3,
        class_names=["background", "nucleus", "boundary"],
        unions={"cell": ["nucleus", 2]},
    )
    m = scored(task, one_hot_outputs(pred, 3), targets)
    assert m["val_dice_nucleus"] == 0 and m["val_dice_cell"] == 1.0
    assert "val_dice_cell" not in {f"val_dice_{n}" for n in task.names}  # not in the mean
    with pytest.raises(ConfigError, match="task.unions.cell"):
        Segmentation(num_classes=3, class_names=["a", "b", "c"], unions={"cell": ["b", "x"]})
    with pytest.raises(ConfigError, match="class names"):
        Segmentation(num_classes=3, class_names=["a", "a", "c"])
    with pytest.raises(ConfigError, match="task.unions=.* a mapping"):
        Segmentation(num_classes=3, unions=[1, 2])
    for names in (["a", "b", "pooled"], ["a", "a_pooled", "c"]):  # one metric, two meanings
        with pytest.raises(ConfigError, match="gives the metric val_dice_.*pooled"):
            Segmentation(num_classes=3, class_names=names)


def test_ignored_pixels_change_neither_loss_nor_metrics():
    g = torch.Generator().manual_seed(1)
    outputs = torch.randn(2, 3, 8, 8, generator=g)
    targets = torch.randint(0, 3, (2, 8, 8), generator=g)
    targets[:, :2] = IGNORE
    other = outputs.clone()
    other[:, :, :2] = torch.randn(2, 3, 2, 8, generator=g)  # predictions where not scored
    task = Segmentation(num_classes=3)
    assert torch.equal(task.loss(outputs, targets), task.loss(other, targets))
    assert scored(task, outputs, targets) == scored(task, other, targets)


def test_the_cross_entropy_formulations_agree():
    g = torch.Generator().manual_seed(2)
    outputs = torch.randn(3, 4, 8, 8, generator=g)
    targets = torch.randint(0, 4, (3, 8, 8), generator=g)
    losses = [
        Segmentation(num_classes=4, cross_entropy=ce).loss(outputs, targets)
        for ce in ("repro", "torch", "torch_flat")
    ]
    for loss in losses[1:]:
        torch.testing.assert_close(loss, losses[0], rtol=1e-6, atol=1e-6)


def test_class_weights_weigh_each_images_mean_as_pytorchs_do():
    g = torch.Generator().manual_seed(3)
    outputs = torch.randn(3, 4, 6, 6, generator=g)
    targets = torch.randint(0, 4, (3, 6, 6), generator=g).to(torch.uint8)  # as datasets give
    targets[1, :3] = IGNORE
    weights = [1, 2, 3, 4]  # integers, as a YAML list may give them
    task = Segmentation(num_classes=4, dice_weight=0, class_weights=weights)
    expected = sum(
        torch.nn.functional.cross_entropy(
            outputs[i : i + 1],
            targets[i : i + 1].long(),
            torch.tensor(weights, dtype=torch.float32),
            ignore_index=IGNORE,
        )
        for i in range(3)
    )
    torch.testing.assert_close(task.loss(outputs, targets), expected)
    for ce in ("torch", "torch_flat"):  # run with integer weights and uint8 targets too
        Segmentation(num_classes=4, class_weights=weights, cross_entropy=ce).loss(outputs, targets)


def test_a_task_given_the_wrong_data_or_model_says_so_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"task=segmentation needs per-pixel masks"):
        train_here(tmp_path / "a", "task=segmentation", "trainer.max_steps=1")
    with pytest.raises(ConfigError, match=r"task=classification needs class labels"):
        train_here(tmp_path / "b", "data=synthetic_shapes", "trainer.max_steps=1")


def test_bad_task_settings_are_one_line():
    with pytest.raises(ConfigError, match="task.cross_entropy='fast'"):
        Segmentation(num_classes=3, cross_entropy="fast")
    with pytest.raises(ConfigError, match="task.class_weights has 2 entries for 3 classes"):
        Segmentation(num_classes=3, class_weights=[1.0, 2.0])


# -------------------------------------------------------------------------- the model


def test_unet_gives_per_pixel_logits_and_names_a_bad_image_size():
    model = UNet(num_classes=5, width=4, depth=2)
    assert model(torch.randn(2, 3, 16, 24)).shape == (2, 5, 16, 24)
    with pytest.raises(ConfigError, match="divisible by 4, got 18×16"):
        model(torch.randn(1, 3, 18, 16))
    with pytest.raises(ConfigError, match="model.upsample='nearest'"):
        UNet(num_classes=2, upsample="nearest")


def test_unet_with_pytorchs_upsampling_computes_the_same_function():
    torch.manual_seed(0)
    ours = UNet(num_classes=3, width=4, depth=2)
    stock = UNet(num_classes=3, width=4, depth=2, upsample="torch")
    stock.load_state_dict(ours.state_dict())  # upsampling has no parameters
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(ours(x), stock(x), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- the data


def test_synthetic_shapes_are_a_function_of_the_data_seed():
    a = synthetic_shapes(seed=3, train_size=64, val_size=8, image_size=32)
    b = synthetic_shapes(seed=3, train_size=64, val_size=8, image_size=32)
    c = synthetic_shapes(seed=4, train_size=64, val_size=8, image_size=32)
    digest = lambda d: tensors_sha256(d.train.images, d.train.labels)  # noqa: E731
    assert digest(a) == digest(b) != digest(c)
    assert a.train.labels.shape == (64, 32, 32) and a.train.labels.dtype == torch.uint8
    assert sorted(a.train.labels.unique().tolist()) == [0, 1, 2, 3]  # every class occurs


def test_masks_get_their_images_crop_and_flip():
    g = torch.Generator().manual_seed(5)
    images = torch.randint(1, 256, (6, 3, 16, 16), dtype=torch.uint8, generator=g)
    masks = images[:, 0] % 4  # a mask that is a function of its image, pixel by pixel
    batches = KeyedBatches(TensorImages(images, masks), KeyedPipeline(CropFlip(), 0))
    keys = [(e, i) for e in range(3) for i in range(6)]
    out_images, out_masks = batches[keys]
    padded = out_images[:, 0] == 0  # the images hold no zero: 0 is the crop's padding
    assert bool(padded.any()) and not bool(padded.all())
    assert torch.equal(out_masks[~padded], out_images[:, 0][~padded] % 4)
    assert bool((out_masks[padded] == IGNORE).all())  # the padding is not scored


def write_folder(root, n=24, size=32, num_classes=4, seed=9):
    """An image/mask folder made of synthetic shapes (PNG images and masks); the data they
    were drawn from."""
    return write_shapes_folder(root, n, size, num_classes, seed)


def test_image_mask_folder_is_read_lazily_with_its_masks(tmp_path, monkeypatch):
    import repro.components.data

    source = write_folder(tmp_path / "data")
    reads = []
    read_image = repro.components.data.folders.read_image_sized
    monkeypatch.setattr(
        repro.components.data.folders,
        "read_image_sized",
        lambda p, *channels: reads.append(p) or read_image(p, *channels),
    )
    d = image_mask_folder(str(tmp_path / "data"), num_classes=4, image_size=32, val_fraction=0.25)
    assert isinstance(d.train, LazyImageMasks) and isinstance(d, DataSplits)
    assert reads == []  # listed, not read
    d.with_augmentation(KeyedPipeline(CropFlip(32), 0), KeyedPipeline(Resize(32), 0))
    assert len(reads) == len(d.train)  # the normalisation's sample (all 17 < 256), nothing else
    reads.clear()
    d.train.fetch(torch.tensor([3]))
    assert reads == [d.train.images[3]]  # a fetch reads what it is asked for
    # a keyed hash of each stem (tests/test_splits.py): these 24 stems give 17 and 7
    assert len(d.train) == 17 and len(d.val) == 7 and d.in_channels == 3
    stems = [int(p.stem) for p in d.train.images]
    images, masks = d.train.fetch(torch.tensor([0, 1]))
    assert torch.equal(torch.stack(masks), source.train.labels[stems[:2]])  # exact (PNG)
    assert torch.equal(torch.stack(images), source.train.images[stems[:2]])
    assert d.test is None
    held = image_mask_folder(
        str(tmp_path / "data"), num_classes=4, image_size=32, val_fraction=0.25, test_fraction=0.25
    )
    split = {s: set(getattr(held, s).images) for s in ("train", "val", "test")}
    assert len(split["test"]) == 6 and len(split["train"]) == 11
    assert not split["test"] & (split["train"] | split["val"])
    assert split["val"] == set(d.val.images)  # the same validation split as without it
    assert all(m.stem == i.stem for i, m in zip(held.test.images, held.test.masks, strict=True))


def test_image_mask_folder_errors_name_the_file(tmp_path):
    from PIL import Image

    write_folder(tmp_path / "d")
    with pytest.raises(DataError, match="needs the sub-folders images/ and masks/"):
        image_mask_folder(str(tmp_path / "missing"), num_classes=4)
    (tmp_path / "d" / "masks" / "003.png").unlink()
    with pytest.raises(DataError, match=r"1 image\(s\) have no mask, e.g. images/003.png"):
        image_mask_folder(str(tmp_path / "d"), num_classes=4)
    Image.new("RGB", (32, 32)).save(tmp_path / "d" / "masks" / "003.png")
    d = image_mask_folder(str(tmp_path / "d"), num_classes=4, val_fraction=0.5)
    split = d.train if any(p.stem == "003" for p in d.train.masks) else d.val
    index = next(i for i, p in enumerate(split.masks) if p.stem == "003")
    with pytest.raises(DataError, match="003.png is a RGB image; masks must be single-channel"):
        split.fetch(torch.tensor([index]))
    Image.fromarray(np.full((32, 32), 7, dtype=np.uint8), mode="L").save(
        tmp_path / "d" / "masks" / "003.png"
    )
    with pytest.raises(DataError, match="003.png holds class 7, not below data.num_classes=4"):
        split.fetch(torch.tensor([index]))


def test_binary_masks_stored_as_0_and_255_need_a_map(tmp_path):
    from PIL import Image

    write_folder(tmp_path / "d", n=4)
    binary = np.zeros((32, 32), dtype=np.uint8)
    binary[8:20, 8:20] = 255
    for i in range(4):
        Image.fromarray(binary, mode="L").save(tmp_path / "d" / "masks" / f"{i:03d}.png")
    d = image_mask_folder(str(tmp_path / "d"), num_classes=2, val_fraction=0.5, image_size=32)
    with pytest.raises(DataError, match=r"holds only 0 and 255.*data.mask_map='\{255: 1\}'"):
        d.train.fetch(torch.tensor([0]))
    mapped = image_mask_folder(
        str(tmp_path / "d"), num_classes=2, val_fraction=0.5, image_size=32, mask_map={255: 1}
    )
    assert torch.equal(mapped.train.fetch(torch.tensor([0]))[1][0], torch.tensor(binary // 255))
    Image.fromarray(binary > 0).save(tmp_path / "d" / "masks" / "000.png")  # mode "1": 0/1
    one_bit = image_mask_folder(str(tmp_path / "d"), num_classes=2, val_fraction=0.5)
    split = one_bit.train if any(p.stem == "000" for p in one_bit.train.masks) else one_bit.val
    index = next(i for i, p in enumerate(split.masks) if p.stem == "000")
    assert split.fetch(torch.tensor([index]))[1][0].max() == 1


def test_a_bad_mask_read_in_a_loader_worker_is_one_line(tmp_path):
    from omegaconf import OmegaConf
    from PIL import Image

    from repro.components.data import loading, make_train_loader

    write_folder(tmp_path / "d", n=8)
    for i in range(8):
        Image.fromarray(np.full((32, 32), 9, dtype=np.uint8), mode="L").save(
            tmp_path / "d" / "masks" / f"{i:03d}.png"
        )
    d = image_mask_folder(str(tmp_path / "d"), num_classes=4, image_size=32, val_fraction=0.25)
    workers = OmegaConf.create(
        {"num_workers": 2, "persistent_workers": False, "prefetch_factor": None}
    )
    loader = make_train_loader(d, 0, 4, 2, workers, pin_memory=False)
    with pytest.raises(DataError) as err, loading(loader) as batches:
        next(batches)
    assert str(err.value).startswith("data: mask ") and "\n" not in str(err.value)


# ------------------------------------------------------------------- the promises


def test_strict_twice_and_with_loader_workers_is_identical(reference, tmp_path):
    again = train_here(tmp_path / "again", *SEG)
    multi = train_here(tmp_path / "multi", *SEG, "loader=multi", "loader.num_workers=2")
    assert_same_bits(again, reference)
    assert_same_bits(multi, reference)


def test_summary_and_logs_lead_with_val_dice(reference):
    s = reference.summary
    assert s["headline"] == "val_dice" and 0 <= s["val_dice"] <= 1
    header = (reference.dir / "eval.csv").read_text().splitlines()[0].split(",")
    # the shapes' classes by name; per image, and pooled over the split's pixels
    assert {"val_dice", "val_iou", "val_dice_disc", "val_iou_triangle"} <= set(header)
    assert {"val_dice_pooled", "val_dice_disc_pooled", "val_empty_square"} <= set(header)
    rows = (reference.dir / "val_per_image.csv").read_text().splitlines()
    assert rows[0].startswith("step,sample,tp_background,fp_background,fn_background")
    assert len(rows) == 1 + 64 and rows[1].startswith("30,0,")  # the last evaluation's
    # each image's share of the headline (repro report resamples them), from its counts
    table = [dict(zip(rows[0].split(","), r.split(","), strict=True)) for r in rows[1:]]
    scored = [c.removeprefix("headline_") for c in rows[0].split(",") if c.startswith("headline")]
    assert scored == ["disc", "square", "triangle"]  # the background left out, as in val_dice
    means = []
    for name in scored:
        values = []
        for r in table:
            tp, fp, fn = (int(r[f"{k}_{name}"]) for k in ("tp", "fp", "fn"))
            got = float(r[f"headline_{name}"])
            if 2 * tp + fp + fn == 0:
                assert math.isnan(got)
                continue
            assert got == 2 * tp / (2 * tp + fp + fn)
            values.append(got)
        means.append(math.fsum(values) / len(values))
    assert math.fsum(means) / len(means) == pytest.approx(s["val_dice"], abs=1e-12)


def test_dice_rises_well_above_chance(tmp_path):
    run = train_here(tmp_path / "learn", *SEG, "trainer.max_steps=60", "trainer.eval_every=60")
    val = synthetic_shapes(train_size=1, val_size=64, image_size=32).val.labels
    share = torch.bincount(val.flatten().long(), minlength=4).double() / val.numel()
    chance = (2 * share * 0.25 / (share + 0.25))[1:].mean().item()  # uniform random guesses
    assert run.summary["val_dice"] > 3 * chance, (run.summary["val_dice"], chance)


@pytest.mark.e2e
def test_a_crash_then_resume_gives_the_uninterrupted_bits(reference, tmp_path):
    from test_resume import crash, resume

    run_dir = tmp_path / "crashed"
    crash(run_dir, [*SEG, "loader=multi"], after=15)
    resumed = resume(run_dir, SEG)
    assert resumed.summary["resumes"][0]["step"] == 10
    assert_same_bits(resumed, reference)


@pytest.mark.e2e
def test_two_processes_give_the_one_process_bits(reference, tmp_path):
    # on the CPU on any machine (2 processes need no 2 GPUs; on a GPU machine the reference
    # ran there, so the one-process run is trained on the CPU here)
    one = reference
    if not reference.summary["device"].startswith("cpu"):
        one = train_here(tmp_path / "one", *SEG, "device=cpu")
    two = run_train(tmp_path / "two", *SEG, "device=cpu", nproc=2)
    assert two.summary["world_size"] == 2
    assert_same_bits(two, one)


@pytest.mark.e2e
def test_image_mask_folder_trains_the_same_with_any_loader(tmp_path):
    write_folder(tmp_path / "data", n=40)
    folder = [
        *(o for o in SEG if not o.startswith("data.")),
        "data=image_mask_folder",
        f"data.path={tmp_path / 'data'}",
        "data.num_classes=4",
        "data.image_size=32",
        "trainer.max_steps=6",
        "trainer.eval_every=6",
        "augment=crop_flip",  # the segmentation augmentation loader=device also runs
    ]
    single = train_here(tmp_path / "single", *folder)
    multi = run_train(tmp_path / "multi", *folder, "loader=multi")
    assert_same_bits(multi, single)
    assert_same_bits(train_here(tmp_path / "device", *folder, "loader=device"), single)
    again = train_here(tmp_path / "again", *folder)
    assert again.summary["weights_sha256"] == single.summary["weights_sha256"]


@pytest.mark.e2e
def test_a_seed_sweep_reports_the_dice_distribution(tmp_path):
    sweep = tmp_path / "sweep"
    proc = launch.run(
        train_cmd("-m", *SEG, "loader=single", "seed=0,1", f"hydra.sweep.dir={sweep}"),
        cwd=tmp_path,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    from test_sweep import repro

    report = repro("report", str(sweep))
    assert report.returncode == 0, report.stderr
    dice = [json.loads(p.read_text())["val_dice"] for p in sorted(sweep.glob("*/summary.json"))]
    assert len(dice) == 2 and len(set(dice)) == 2  # the seed changes the result ...
    assert "val_dice" in report.stdout and "mean" in report.stdout  # ... and the report says how
    jobs = json.loads((sweep / "report.json").read_text())["groups"][0]["jobs"]
    images = [
        len((sweep / j["job"] / "val_per_image.csv").read_text().splitlines()) - 1 for j in jobs
    ]
    assert [j["per_sample"] for j in jobs] == images and images[0] > 0  # scores it can resample


@pytest.mark.e2e
def test_an_op_without_a_deterministic_kernel_stops_the_run_in_one_line(tmp_path):
    """MaxUnpool2d has no deterministic kernel, on the CPU too: the run stops with one line
    naming the op and the module, not a traceback."""
    run = run_train(
        tmp_path / "run",
        "~model",
        "+model._target_=nondeterministic_models.UnpoolNet",
        "trainer.max_steps=2",
        check=False,
        env=with_tests_on_path(),
    )
    assert run.proc.returncode == 1
    last = run.proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: strict mode: max_unpooling2d_forward_out has no deterministic")
    assert "in module suspect.unpool (MaxUnpool2d)" in last and "determinism=warn" in last
    assert "Traceback" not in run.proc.stderr


def test_the_explanation_is_a_determinism_error(tmp_path):
    with pytest.raises(DeterminismError, match="in module suspect.unpool"):
        train_here(
            tmp_path / "run",
            "~model",
            "+model._target_=nondeterministic_models.UnpoolNet",
            "trainer.max_steps=2",
        )


# ------------------------------------------------------------------------------ CUDA

ON_CUDA = [*SEG, "device=cuda", "amp=on"]


@cuda
@pytest.mark.cuda
def test_strict_unet_bf16_on_cuda_repeats_with_any_loader(tmp_path):
    # crop_flip: the segmentation augmentation loader=device also runs (on the GPU)
    on_cuda = [*ON_CUDA, "augment=crop_flip"]
    a = train_here(tmp_path / "a", *on_cuda)
    assert a.summary["device"].startswith("cuda")
    for loader in ("loader=single", "loader=device", "loader=multi"):
        assert_same_bits(train_here(tmp_path / loader, *on_cuda, loader), a)


@cuda
@pytest.mark.cuda
def test_sigkill_then_resume_on_cuda_gives_the_uninterrupted_bits(tmp_path):
    from test_resume import interrupt, resume

    straight = train_here(tmp_path / "straight", *ON_CUDA)
    status, at, _ = interrupt(tmp_path / "killed", ON_CUDA, after=15)
    assert status == -signal.SIGKILL and at % 10 != 0 and at < 30
    assert_same_bits(resume(tmp_path / "killed", ON_CUDA), straight)


@cuda
@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_gpus_under_nccl_give_the_one_gpu_bits(tmp_path):
    one = train_here(tmp_path / "one", *ON_CUDA)
    two = run_train(tmp_path / "two", *ON_CUDA, "loader=multi", nproc=2)
    assert "nccl" in two.summary["environment"]["dist_backend"]
    assert_same_bits(two, one)


@cuda
@pytest.mark.cuda
def test_pytorchs_4d_cross_entropy_stops_a_strict_cuda_run_in_one_line(tmp_path):
    run = run_train(tmp_path / "run", *ON_CUDA, "task.cross_entropy=torch", check=False)
    assert run.proc.returncode == 1 and "Traceback" not in run.proc.stderr
    last = run.proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: strict mode: nll_loss2d"), last
    assert "in the task's loss (Segmentation.loss)" in last
    assert "repro.components.ops.dense_cross_entropy" in last


@cuda
@pytest.mark.cuda
def test_doctor_cost_names_the_stock_upsampling_and_loss_and_finds_the_preset_cheap():
    from repro.defense.config import compose
    from repro.engine.doctor import run_cost

    bigger = ["model.width=16", "model.depth=3", "data.image_size=64"]
    stock = run_cost(
        compose([*ON_CUDA, *bigger, "model.upsample=torch", "task.cross_entropy=torch"]),
        repeats=5,
    )
    print(stock.format())
    named = {c.kind: c for c in stock.expensive}
    assert "Upsample" in named and "Upsample2x" in named["Upsample"].replacement
    assert named["Segmentation"].raises.startswith("nll_loss2d")
    assert "dense_cross_entropy" in named["Segmentation"].replacement
    preset = run_cost(compose([*ON_CUDA, *bigger]), repeats=5)
    print(preset.format())
    assert not [c for c in preset.expensive if c.kind in ("Upsample2x", "Segmentation")]


def test_a_mask_whose_size_differs_from_its_image_is_one_line_naming_it(tmp_path):
    require("PIL")
    from PIL import Image

    from repro.components.data import image_mask_folder

    root = tmp_path / "data"
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    for i in range(4):
        Image.new("RGB", (20, 16)).save(root / "images" / f"{i}.png")
        size = (20, 16) if i != 2 else (16, 20)  # one mask transposed
        Image.new("L", size).save(root / "masks" / f"{i}.png")
    data = image_mask_folder(str(root), num_classes=2, image_size=8, val_fraction=0.25)
    split = next(s for s in (data.train, data.val) if any(m.name == "2.png" for m in s.masks))
    i = next(i for i, m in enumerate(split.masks) if m.name == "2.png")
    with pytest.raises(
        DataError, match=r"mask .*masks/2.png is 16×20 .* image .*images/2.png is 20×16"
    ):
        split.fetch(torch.tensor([i]))
    ok = next(j for j in range(len(split)) if j != i)
    assert split.fetch(torch.tensor([ok]))[1][0].shape == (16, 20)  # its own size: H×W
