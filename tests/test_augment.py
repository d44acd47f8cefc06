"""The augment group: any pipeline -- torchvision v2, albumentations, a user's own drawing
from np.random, random and torch.rand, the segmentation preset -- keyed per sample, so the
same bits repeated, with 0, 2 or 3 loader workers, after a SIGKILL mid-epoch and a resume,
and with 1 or 2 processes; a pipeline no key reaches refused before anything is written."""

import random
import signal
import time

import numpy as np
import pytest
import torch

import launch
from conftest import (
    CONF_DIR,
    mixed_image_folder,
    run_train,
    train_cmd,
    train_here,
    with_tests_on_path,
)
from optional import require
from repro.base.errors import ConfigError
from repro.components.data import CropFlip, KeyedPipeline, RandomResizedCrop, SegmentationAugment
from repro.components.data.augment import CenterResize, Resize, keyed_global_state
from repro.defense.config import check_overrides, compose

# a folder of 72 PNG and JPEG files of 12-24 x 14-26 pixels, read lazily at their own size;
# 4 steps an epoch (64 of the 65 training files), so step 7 is mid-epoch 1
FOLDER = [
    "data=image_folder",
    "data.image_size=16",
    "trainer.batch_size=16",
    "trainer.micro_batch_size=8",  # 2 micro-batches a step: one a process under torchrun
    "trainer.max_steps=10",
    "trainer.eval_every=5",
    "trainer.checkpoint_every=3",
    "trainer.log_every=1",
    "model.width=8",
]
PIPELINES = {
    "user": ["augment.train._target_=augment_pipelines.DrawsFromEverything", "~augment.train.pad"],
    "torchvision": ["augment=torchvision"],
    "albumentations": [
        "augment.train._target_=repro.data.augment.albumentations",
        "+augment.train.transforms=[{_target_: albumentations.RandomResizedCrop, size: [16, 16]},"
        " {_target_: albumentations.HorizontalFlip}, {_target_: albumentations.Rotate, limit: 15},"
        " {_target_: albumentations.RandomBrightnessContrast}]",
        "~augment.train.size",
        "~augment.train.pad",
    ],
    "segmentation": [
        "experiment=segmentation",
        "augment=segmentation",
        "data=image_mask_folder",
        "data.num_classes=4",
        "data.image_size=24",
        "model.width=8",
        "model.depth=2",
        "trainer.batch_size=16",
        "trainer.micro_batch_size=8",
        "trainer.max_steps=10",
        "trainer.eval_every=5",
        "trainer.eval_batch_size=8",
        "trainer.checkpoint_every=3",
        "trainer.log_every=1",
    ],
}
OPTIONAL = ("torchvision", "albumentations")  # skipped where not usable


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The image folder (classification) and an image/mask folder of 80 shapes at 32x32,
    read at 24x24 (segmentation)."""
    from test_segmentation import write_folder

    base = tmp_path_factory.mktemp("augment")
    write_folder(base / "masks", n=80, size=32)
    return {"images": mixed_image_folder(base / "images"), "masks": base / "masks"}


def overrides(kind: str, folders) -> list[str]:
    """On the CPU on every machine: two processes need no two GPUs there."""
    if kind == "segmentation":
        return ["device=cpu", *PIPELINES[kind], f"data.path={folders['masks']}"]
    return ["device=cpu", *FOLDER, f"data.path={folders['images']}", *PIPELINES[kind]]


def steps_done(run_dir) -> int:
    path = run_dir / "metrics.csv"
    return max(0, len(path.read_text().splitlines()) - 1) if path.exists() else 0


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["user", "segmentation", "torchvision", "albumentations"])
def test_any_pipeline_gives_the_same_bits_repeated_with_any_workers_resumed_and_on_two_processes(
    kind, folders, tmp_path, monkeypatch
):
    if kind in OPTIONAL:
        require(kind, f"make add PKG={kind}")
    monkeypatch.syspath_prepend(str(CONF_DIR.parent / "tests"))  # augment_pipelines
    args = overrides(kind, folders)
    ref = train_here(tmp_path / "ref", *args, "loader=single")
    again = train_here(tmp_path / "again", *args, "loader=single")
    two = train_here(tmp_path / "two", *args, "loader=multi", "loader.num_workers=2")
    three = train_here(tmp_path / "three", *args, "loader=multi", "loader.num_workers=3")
    for other in (again, two, three):
        assert other.summary["weights_sha256"] == ref.summary["weights_sha256"], other.dir.name
        assert other.losses == ref.losses
    # SIGKILLed after step 7 (mid-epoch, past the step-6 checkpoint), resumed
    killed = tmp_path / "killed"
    proc = launch.popen(
        train_cmd(f"hydra.run.dir={killed}", *args, "loader=multi", "loader.num_workers=2"),
        cwd=tmp_path,
        env=with_tests_on_path(),
    )
    deadline = time.monotonic() + 300
    while steps_done(killed) < 7:
        assert proc.poll() is None and time.monotonic() < deadline, "ended before step 7"
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = train_here(killed, *args, "loader=single", "trainer.resume=auto")
    assert resumed.summary["resumes"][0]["step"] in (6, 9)
    assert resumed.summary["weights_sha256"] == ref.summary["weights_sha256"]
    assert resumed.losses == ref.losses
    # one process, and two (one micro-batch of each step on each), under torchrun
    pair = run_train(tmp_path / "pair", *args, nproc=2, env=with_tests_on_path())
    assert pair.summary["world_size"] == 2
    assert pair.summary["weights_sha256"] == ref.summary["weights_sha256"]
    assert pair.losses == ref.losses
    # the augmentation did something: another seed draws other augmentations (and init)
    assert (
        ref.summary["weights_sha256"]
        != train_here(tmp_path / "s1", *args, "seed=1").summary["weights_sha256"]
    )


def test_a_pipeline_with_a_random_state_of_its_own_is_refused_before_anything_is_written(
    folders, tmp_path, monkeypatch
):
    monkeypatch.syspath_prepend(str(CONF_DIR.parent / "tests"))
    args = [*FOLDER, f"data.path={folders['images']}"]
    run_dir = tmp_path / "run"
    private = [
        "augment.train._target_=repro.data.augment.Compose",
        "+augment.train.transforms=[{_target_: repro.data.augment.Resize, size: 16},"
        " {_target_: augment_pipelines.PrivateGenerator, size: 16}]",
        "~augment.train.size",
        "~augment.train.pad",
    ]
    with pytest.raises(ConfigError) as err:
        train_here(run_dir, *args, *private)
    message = str(err.value)
    assert "\n" not in message and message.startswith(
        "augment.train: augment_pipelines.PrivateGenerator gives another output for the same "
        "sample and key"
    )
    assert "np.random.default_rng()" in message and "generator" in message
    assert not run_dir.exists()  # refused before the run directory was made
    # not random at all (augment=none): logged, trained
    run = train_here(tmp_path / "none", *args, "augment=none", "trainer.max_steps=1")
    assert "gives one output under two keys: not random" in run.output


def test_a_pipeline_whose_images_are_not_image_size_is_one_line(folders, tmp_path):
    args = [*FOLDER, f"data.path={folders['images']}"]
    with pytest.raises(
        ConfigError,
        match=r"augment.train: repro.components.data.augment.Resize gives \(20, 20\) images where data.image_size=16",
    ):
        train_here(tmp_path / "run", *args, "augment=none", "augment.train.size=20")
    with pytest.raises(ConfigError, match=r"augment.eval: .* gives \(\d+, \d+\) images where"):
        train_here(tmp_path / "run", *args, "augment.eval.size=null")


def test_data_augment_is_gone_and_the_error_names_its_replacement():
    for attempt in (
        lambda: check_overrides(["data.augment=false"], CONF_DIR),
        lambda: compose(["+data.augment=false"], CONF_DIR),
    ):
        with pytest.raises(ConfigError, match=r"data.augment is gone: .* augment=none"):
            attempt()


def test_the_device_loader_refuses_a_pipeline_it_cannot_run_on_the_device(folders, tmp_path):
    args = [*FOLDER, f"data.path={folders['images']}", "loader=device"]
    with pytest.raises(
        ConfigError,
        match=r"augment.train \(repro.components.data.augment.RandomResizedCrop\).* use loader=multi",
    ):
        train_here(tmp_path / "run", *args, "augment=imagenet")


def test_the_crop_and_flip_of_a_sample_is_its_crop_and_flip_in_any_batch():
    """The default pipeline sample by sample (a worker's path for images of their own
    sizes) and a whole batch at once (the in-memory and device path): the same bytes."""
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (6, 3, 16, 16), dtype=torch.uint8, generator=g)
    masks = torch.randint(0, 4, (6, 16, 16), dtype=torch.uint8, generator=g)
    pipeline = KeyedPipeline(CropFlip(16), seed=5)
    epochs, index = torch.tensor([0, 0, 1, 1, 2, 2]), torch.arange(6)
    whole = pipeline.keyed_batch(images, masks, epochs, index)
    one_by_one = pipeline.samples(list(images), list(masks), epochs, index)
    assert torch.equal(whole[0], one_by_one[0]) and torch.equal(whole[1], one_by_one[1])


def test_the_global_states_are_keyed_inside_and_put_back_after():
    before = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    draws = []
    for _ in range(2):
        with keyed_global_state(3, 1, 17):
            draws.append((torch.rand(2), np.random.rand(), random.random()))
    assert torch.equal(draws[0][0], draws[1][0]) and draws[0][1:] == draws[1][1:]
    with keyed_global_state(3, 1, 18):
        assert not torch.equal(torch.rand(2), draws[0][0])
    assert torch.equal(torch.get_rng_state(), before[0])
    assert (np.random.get_state()[1] == before[1]).all() and random.getstate() == before[2]


class _Spy:
    """Records the numbers it draws from its generator, and the key it is given."""

    keyed = True

    def __init__(self):
        self.seen = []

    def __call__(self, image, target, *, key, generator):
        self.seen.append((key, torch.rand(3, generator=generator)))
        return image, target


def test_the_transforms_of_a_composed_pipeline_draw_different_numbers():
    """One generator a sample, shared: the second transform draws where the first stopped;
    the second's key has its place folded in (two crop-and-flips do not crop alike)."""
    from repro.components.data.augment import Compose

    first, second = _Spy(), _Spy()
    pipeline = KeyedPipeline(Compose([first, second]), seed=2)
    image = torch.zeros(3, 4, 4, dtype=torch.uint8)
    for _ in range(2):
        pipeline(image, 0, 1, 7)
    (k1, a1), (k2, b1) = first.seen[0], second.seen[0]
    assert not torch.equal(a1, b1) and k1 == (2, 1, 7) and k2 != k1 and k2[1:] == (1, 7)
    assert torch.equal(first.seen[1][1], a1) and torch.equal(second.seen[1][1], b1)
    flips = Compose([CropFlip(4), CropFlip(4)])
    assert flips.transforms[0] is not flips.transforms[1]


def test_the_shipped_transforms_draw_from_their_key_only():
    image = torch.randint(0, 256, (3, 30, 40), dtype=torch.uint8)
    mask = torch.randint(0, 3, (30, 40), dtype=torch.uint8)
    for transform in (
        RandomResizedCrop(16),
        SegmentationAugment(16),
        SegmentationAugment(16, elastic=2),
    ):
        pipeline = KeyedPipeline(transform, seed=1)
        a, b = pipeline(image, mask, 0, 4), pipeline(image, mask, 0, 4)
        c = pipeline(image, mask, 0, 5)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert not torch.equal(a[0], c[0])
        assert a[0].shape == (3, 16, 16) and a[1].shape == (16, 16)
    # the segmentation geometry moves the mask with the image; pixels from outside: ignored
    shift = SegmentationAugment(16, degrees=0, scale=(1, 1), translate=0.5, flip=0)
    shift.brightness = shift.contrast = 0.0
    moved_image, moved_mask = KeyedPipeline(shift, seed=0)(image, mask, 0, 1)
    assert bool((moved_mask == 255).any()) and bool((moved_mask < 3).any())
    flipped = SegmentationAugment(16, degrees=0, scale=(1, 1), translate=0, flip=1.0)
    flipped.brightness = flipped.contrast = 0.0
    fi, fm = KeyedPipeline(flipped, seed=0)(image, mask, 0, 1)
    ri, rm = Resize(16)(image, mask)
    assert torch.equal(fm, rm.flip(-1)) and torch.equal(fi, ri.flip(-1))
    # elastic 0 is the default's draws and bits; elastic > 0 moves pixels, image and mask
    plain, bent = SegmentationAugment(16), SegmentationAugment(16, elastic=2.0)
    a, b = (
        KeyedPipeline(plain, seed=3)(image, mask, 0, 2),
        KeyedPipeline(bent, seed=3)(image, mask, 0, 2),
    )
    assert not torch.equal(a[0], b[0]) and not torch.equal(a[1], b[1])
    assert torch.equal(
        a[0], KeyedPipeline(SegmentationAugment(16, elastic=0), seed=3)(image, mask, 0, 2)[0]
    )
    with pytest.raises(ConfigError, match="elastic=-1"):
        SegmentationAugment(16, elastic=-1)
    centre = CenterResize(16)(image, mask)
    assert centre[0].shape == (3, 16, 16) and centre[1].shape == (16, 16)
