"""`repro preview` shows the training draw itself, and names a transform that does nothing."""

import copy
import random

import numpy as np
import pytest
import torch

from conftest import CONF_DIR
from optional import require
from repro.cli import main
from repro.components.data import (
    Compose,
    DataSplits,
    KeyedPipeline,
    SegmentationAugment,
    TensorImages,
)
from repro.defense.config import compose
from repro.engine.build import build_data, build_loader
from repro.tools.preview import CELL, GAP, preview_splits, rgb8, run_preview, write_preview

Image = require("PIL.Image", "pip install -e .[images]")  # decodes what the zlib writer wrote

# 16 segmentation samples of 32×32: 2 steps of 8 an epoch, so step 2 is epoch 1's first
SEGMENTATION = [
    "experiment=segmentation",
    "augment=segmentation",
    "data.train_size=16",
    "data.val_size=8",
    "data.image_size=32",
    "trainer.batch_size=8",
    "trainer.micro_batch_size=8",
    "loader=single",
    "device=cpu",
]
CLASSIFICATION = [
    "data.train_size=64",
    "data.val_size=16",
    "trainer.batch_size=8",
    "trainer.micro_batch_size=8",
]


class Noop:
    """Returns its sample as it came: what an elastic deformation of 0.01 px amounts to."""

    keyed = True

    def __call__(self, image, target):
        return image, target


class ShiftRight:
    """Moves the image (and mask) one pixel right, the column moved in from outside 0."""

    keyed = True

    def __call__(self, image, target):
        moved = torch.zeros_like(image)
        moved[..., 1:] = image[..., :-1]
        if isinstance(target, torch.Tensor) and target.dim() == 2:
            target = torch.cat([torch.full_like(target[:, :1], 255), target[:, :-1]], 1)
        return moved, target


class Brighter:
    """Scales the intensity by a factor drawn from the global torch state (as torchvision
    draws), rounded and clamped to 0..255: moves no pixel."""

    def __call__(self, image, target):
        factor = 1.2 + 0.2 * float(torch.rand(()))
        return (image.float() * factor).round().clamp(0, 255).to(image.dtype), target


class RandomRoll:
    """Rolls the image by 1-3 columns drawn from Python's ``random``."""

    def __call__(self, image, target):
        return image.roll(random.randint(1, 3), -1), target


class UserCompose:
    """A composition as a user (or torchvision's v2 ``Compose``) writes it: ``.transforms``,
    each called with ``(image, target)``; with ``then_flip``, it also flips after them, so
    its output is not its transforms' alone."""

    def __init__(self, transforms, then_flip=False):
        self.transforms, self.then_flip = transforms, then_flip

    def __call__(self, image, target):
        for t in self.transforms:
            image, target = t(image, target)
        return (image.flip(-1), target) if self.then_flip else (image, target)


@pytest.fixture(scope="module")
def segmentation():
    cfg = compose(SEGMENTATION, CONF_DIR)
    return cfg, build_data(cfg)


def splits(pipeline, channels=3, dtype=torch.uint8, seed=0):
    """Four 16×16 samples with masks, in memory, seen through ``pipeline``."""
    g = torch.Generator().manual_seed(5)
    images = torch.randint(0, 256, (4, channels, 16, 16), generator=g)
    masks = torch.randint(0, 3, (4, 16, 16), generator=g).to(torch.uint8)
    split = TensorImages(images.to(dtype), masks)
    data = DataSplits(train=split, val=split, num_classes=3)
    data.train_pipeline = KeyedPipeline(pipeline, seed)
    return data


def test_the_preview_shows_the_sample_as_the_training_loader_gives_it(segmentation, tmp_path):
    cfg, data = segmentation
    loader = build_loader(cfg, data, torch.device("cpu"))
    batches = iter(loader)
    for step in range(3):  # steps 0 (epoch 0) and 2 (epoch 1)
        images, masks = next(batches)
        if step == 1:
            continue
        keys = loader.sampler.step_keys(step)
        (epoch,) = {e for e, _ in keys}
        preview = preview_splits(data, [i for _, i in keys], epoch)
        for k, (image, mask) in enumerate(preview.augmented):
            assert image.dtype == images.dtype and torch.equal(image, images[k])
            assert mask.dtype == masks.dtype and torch.equal(mask, masks[k])
    assert not torch.equal(preview.augmented[0][0], preview.raw[0][0])  # it did augment

    # the picture: a row per sample, columns raw, augmented, mask over augmented
    path = tmp_path / "preview.png"
    write_preview(preview, path)
    picture = np.asarray(Image.open(path).convert("RGB"))
    zoom = max(1, CELL // 32)
    cell = 32 * zoom
    assert picture.shape == (GAP + 8 * (cell + GAP), GAP + 3 * (cell + GAP), 3)
    # a sample with pixels moved in from outside (mask 255), its augmented cell and overlay
    k = next(k for k, (_, mask) in enumerate(preview.augmented) if (mask == 255).any())
    top, left = GAP + k * (cell + GAP), GAP + 1 * (cell + GAP)
    shown = picture[top : top + cell : zoom, left : left + cell : zoom]
    assert np.array_equal(shown, preview.augmented[k][0].permute(1, 2, 0).numpy())
    overlay = picture[top : top + cell : zoom, left + cell + GAP : left + 2 * cell + GAP : zoom]
    ignored = (preview.augmented[k][1] == 255).numpy()
    assert (overlay[ignored] == 160).all()  # not scored: grey
    assert not (overlay[~ignored] == 160).all(axis=-1).all()


def test_a_transform_that_changes_nothing_is_flagged_and_a_rotation_is_not(segmentation):
    data = copy.copy(segmentation[1])  # the fixture's pipeline stays as it was
    seed = data.train_pipeline.seed
    data.train_pipeline = KeyedPipeline(Compose([Noop(), SegmentationAugment(32)]), seed)
    assert SegmentationAugment(32).degrees == 15
    preview = preview_splits(data, list(range(4)))
    noop, rotation = preview.effects
    assert noop.name == "Noop()" and noop.flagged
    assert noop.displacement == 0 and noop.intensity == 0
    assert not rotation.flagged and rotation.displacement > 1 and not preview.notes
    assert "no visible effect (check its parameters)" in preview.format().splitlines()[3]
    assert "no visible effect" not in preview.format().splitlines()[4]


def test_each_step_of_a_users_composition_is_measured_under_the_training_draw():
    data = splits(UserCompose([RandomRoll(), Noop(), ShiftRight(), Brighter()]))
    preview = preview_splits(data, [0, 1, 2, 3], epoch=3)
    assert not preview.notes  # the replay ended on training's own output
    roll, noop, shift, brighter = preview.effects
    assert noop.flagged and not (roll.flagged or shift.flagged or brighter.flagged)
    # a one-pixel shift moves every pixel that stays in the image by one pixel, exactly
    assert shift.displacement == pytest.approx(1.0, abs=1e-9)
    # an intensity change moves nothing (its rounding: at most a fraction of a pixel)
    assert brighter.displacement < 0.2 and brighter.intensity > 0.05 * 255


def test_a_composition_that_does_more_than_its_transforms_is_measured_as_a_whole():
    data = splits(UserCompose([Noop(), ShiftRight()], then_flip=True))
    preview = preview_splits(data, [0, 1])
    (whole,) = preview.effects
    assert whole.name.startswith("UserCompose(") and not whole.flagged
    assert preview.notes == [
        "measured as a whole: its transforms called one by one do not give training's output."
    ]


def test_a_pipeline_that_is_not_a_composition_is_one_line_and_flagged_if_it_does_nothing():
    preview = preview_splits(splits(Noop(), channels=1, dtype=torch.float32), [0, 1, 2])
    (whole,) = preview.effects
    assert whole.flagged and whole.displacement == 0
    assert "float32" in preview.format()


@pytest.mark.parametrize("channels", [1, 3, 5])
def test_images_are_shown_as_grey_rgb_or_their_first_three_channels(channels):
    image = torch.rand(channels, 4, 6) * 7 - 2  # float32, stretched from its own min/max
    shown = rgb8(image)
    assert shown.dtype == torch.uint8 and shown.shape == (3, 4, 6)
    first = image[:3] if channels >= 3 else image[:1].expand(3, 4, 6)
    low, high = first.min(), first.max()
    assert torch.equal(shown, ((first - low) / (high - low) * 255).round().to(torch.uint8))


def test_the_command_writes_the_png_and_overwrites_nothing_without_force(tmp_path, capsys):
    out = tmp_path / "p.png"
    assert main(["preview", "--n", "2", "--out", str(out), *CLASSIFICATION]) == 0
    printed = capsys.readouterr()
    assert "CropFlip(pad=4)" in printed.out and f"wrote {out}" in printed.err
    cell = 32 * max(1, CELL // 32)
    assert Image.open(out).size == (GAP + 2 * (cell + GAP), GAP + 2 * (cell + GAP))
    before = out.read_bytes()
    assert main(["preview", "--n", "1", "--out", str(out), "augment=none"]) == 2
    err = capsys.readouterr().err
    assert err == f"repro preview: {out}: exists; give another --out, or --force to overwrite it.\n"
    assert out.read_bytes() == before
    assert main(["preview", "--n", "0"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_without_augmentation_it_says_so_and_writes_the_raw_samples(tmp_path):
    cfg = compose([*CLASSIFICATION, "augment=none"], CONF_DIR)
    preview = run_preview(cfg, n=3)
    assert preview.augmented is None and preview.columns() == ["raw"]
    assert "nothing to preview beyond the raw samples" in preview.format()
    write_preview(preview, tmp_path / "raw.png")
    cell = 32 * max(1, CELL // 32)
    assert Image.open(tmp_path / "raw.png").size == (GAP + cell + GAP, GAP + 3 * (cell + GAP))


def test_a_geometric_step_that_moves_pixels_under_half_a_pixel_is_flagged(segmentation):
    """An elastic deformation whose alpha is too small for its sigma (albumentations'
    defaults): it changes the intensity (resampling smooths) and moves pixels 0.1 px."""
    data = copy.copy(segmentation[1])
    weak = SegmentationAugment(32, degrees=0, scale=(1, 1), translate=0, flip=0, elastic=0.25)
    weak.brightness = weak.contrast = 0.0
    data.train_pipeline = KeyedPipeline(Compose([weak, Brighter()]), data.train_pipeline.seed)
    preview = preview_splits(data, list(range(4)))
    elastic, brighter = preview.effects
    assert elastic.barely_moves and not elastic.flagged, elastic
    assert 0.05 < elastic.displacement < 0.5
    assert not brighter.barely_moves, brighter  # a colour step moves nothing
    assert (
        preview.format()
        .splitlines()[3]
        .endswith("moves pixels under half a pixel (check its parameters)")
    )
