"""The one-thread rule, at the sizes labs train at (docs/determinism.md#threads).

A CPU reduction over more than 32,768 elements is split across torch's intra-op threads, so
its last bits follow the thread count: a loader worker runs with one, the main process with
``determinism.cpu_threads``. A 3 × 128 × 128 image is past that size; the 32-64 px images of
the other tests are not, and hid it: the segmentation augmentations gave other bits under
``loader=single`` than under ``loader=multi``. Here the template's transforms are compared
under 1 and 2 threads at 128, 256 and 512 px (uint8 and float32, 1 and 3 channels); a
user's and torchvision's through the loader, in workers and in the main process; what a
transform can read of its process's settings, under fork and spawn; and the two segmentation
presets trained with ``loader=multi`` and ``loader=single`` on a folder at 128 px and on
16-bit images in 256-px patches: one set of bits."""

import inspect

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from conftest import CONF_DIR, train_here
from optional import require
from repro.components.data import (
    CenterResize,
    Compose,
    CropFlip,
    DataSplits,
    KeyedBatches,
    KeyedBatchSampler,
    KeyedPipeline,
    RandomResizedCrop,
    Resize,
    SegmentationAugment,
    TensorImages,
    make_train_loader,
)
from repro.components.data.augment import RandomPatch
from repro.components.data.synthetic import write_nuclei_folder, write_shapes_folder

SIZES = (128, 256, 512)
INPUTS = [(dtype, channels) for dtype in (torch.uint8, torch.float32) for channels in (1, 3)]


@pytest.fixture(autouse=True)
def threads_put_back():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def pipelines_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(CONF_DIR.parent / "tests"))  # augment_pipelines


SHIPPED = {
    "Resize": lambda size: Resize(size),
    "CropFlip": lambda size: CropFlip(size),
    "RandomResizedCrop": lambda size: RandomResizedCrop(size),
    "CenterResize": lambda size: CenterResize(size),
    "SegmentationAugment": lambda size: SegmentationAugment(size),
    "SegmentationAugment-elastic": lambda size: SegmentationAugment(size, elastic=4.0),
    "RandomPatch": lambda size: RandomPatch(size, brightness=0.2, contrast=0.2),
    "Compose": lambda size: Compose([Resize(size + 8), SegmentationAugment(size)]),
}


def sample(size: int, dtype: torch.dtype, channels: int, seed: int = 0):
    """A non-square image larger than ``size`` (uint8, or float32 in [0, 1] as a 16-bit file
    is mapped) and its 4-class mask."""
    g = torch.Generator().manual_seed(seed)
    h, w = size + 37, size * 3 // 2
    image = torch.rand(channels, h, w, generator=g)
    image = (image * 255).round().to(torch.uint8) if dtype == torch.uint8 else image
    return image, torch.randint(0, 4, (h, w), generator=g, dtype=torch.uint8)


def call(transform, image, target, key):
    """``transform`` as a pipeline is called: with the ``key`` or keyed ``generator`` its
    signature asks for (not through KeyedPipeline, which would pin the threads itself)."""
    params = inspect.signature(transform).parameters
    extra = {}
    if "key" in params:
        extra["key"] = (0, 1, key)
    if "generator" in params:
        extra["generator"] = torch.Generator().manual_seed(1000 + key)
    return transform(image.clone(), target.clone(), **extra)


@pytest.mark.parametrize("name", list(SHIPPED))
def test_each_shipped_transform_gives_one_result_under_one_and_two_threads(name):
    """The template's transforms reduce in a fixed order (NumPy's float64 mean), so their
    bits do not rest on the one-thread rule alone: called directly, as a fork's own code or
    another loader may call them."""
    differ = []
    for size in SIZES:
        transform = SHIPPED[name](size)
        for dtype, channels in INPUTS:
            image, mask = sample(size, dtype, channels)
            for key in range(3):
                torch.set_num_threads(1)
                one = call(transform, image, mask, key)
                torch.set_num_threads(2)
                two = call(transform, image, mask, key)
                assert one[0].shape[-2:] == (size, size)
                if not (torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])):
                    differ.append(f"{size} px {dtype} x{channels} key {key}")
    assert not differ, f"{name}: 1 and 2 threads differ at {', '.join(differ)}"


def splits(images: torch.Tensor, num_classes: int = 2) -> DataSplits:
    labels = torch.arange(len(images)) % num_classes
    return DataSplits(TensorImages(images, labels), TensorImages(images[:2], labels[:2]), 2)


def loader_cfg(workers: int):
    return OmegaConf.create(
        {"num_workers": workers, "persistent_workers": False, "prefetch_factor": 2,
         "on_device": False}
    )  # fmt: skip


def batches(data: DataSplits, workers: int, count: int = 2) -> list[torch.Tensor]:
    """The first ``count`` micro-batches of 4 (keyed by seed 0) from ``workers`` loader
    workers, or from this process (0)."""
    loader = make_train_loader(data, 0, 8, 4, loader_cfg(workers), pin_memory=False)
    out = []
    for images, _ in loader:
        out.append(images)
        if len(out) == count:
            return out
    raise AssertionError("the loader ended")


def test_a_users_reduction_gives_a_workers_bits_in_the_main_process():
    """A per-image z-score in torch (two reductions over a 3 × 256 × 256 float32 image) in a
    loader worker and in the main process with 2 threads: the same bytes, because every
    pipeline call runs under one thread wherever it runs."""
    g = torch.Generator().manual_seed(3)
    data = splits(torch.rand(16, 3, 256, 256, generator=g))
    from augment_pipelines import Standardises

    torch.set_num_threads(2)
    data.train_pipeline = KeyedPipeline(Standardises(), seed=0)
    main, workers = batches(data, 0), batches(data, 2)
    assert torch.get_num_threads() == 2  # put back after each call
    assert all(torch.equal(a, b) for a, b in zip(main, workers, strict=True))


def test_torchvisions_color_jitter_gives_a_workers_bits_in_the_main_process():
    """torchvision's ColorJitter (adjust_contrast takes the mean of the grayscale image),
    drawing from the global generator the key sets, on 3 × 256 × 256 float32 images."""
    require("torchvision", "make add PKG=torchvision")
    from torchvision.transforms import v2

    g = torch.Generator().manual_seed(4)
    data = splits(torch.rand(16, 3, 256, 256, generator=g))
    torch.set_num_threads(2)
    jitter = v2.ColorJitter(brightness=0.3, contrast=0.3, saturation=0.3, hue=0.05)
    data.train_pipeline = KeyedPipeline(v2.Compose([v2.RandomHorizontalFlip(), jitter]), seed=0)
    main, workers = batches(data, 0), batches(data, 2)
    assert all(torch.equal(a, b) for a, b in zip(main, workers, strict=True))


@pytest.mark.parametrize(
    "preset",
    ["torchvision", "torchvision_segmentation", "albumentations_segmentation"],
)
def test_the_library_presets_give_a_workers_bits_in_the_main_process_at_256_px(preset):
    """The shipped presets of torchvision's and albumentations' transforms, built as a run
    builds them, on the embedded data at 256 px: the main process (2 threads) and 2 loader
    workers fetch the same bytes."""
    require(preset.split("_")[0], f"make add PKG={preset.split('_')[0]}")
    from repro.defense.config import compose
    from repro.engine.build import build_data

    data = ["data=synthetic_shapes"] if preset.endswith("segmentation") else []
    cfg = compose(
        [*data, f"augment={preset}", "data.image_size=256", "data.train_size=32",
         "data.val_size=8", "trainer.batch_size=8", "trainer.micro_batch_size=4"],
        CONF_DIR,
    )  # fmt: skip
    torch.set_num_threads(2)
    built = build_data(cfg)
    main, workers = batches(built, 0), batches(built, 2)
    assert all(torch.equal(a, b) for a, b in zip(main, workers, strict=True))


def test_what_a_transform_reads_of_its_process_is_the_same_in_every_loader():
    """The main process with 2 threads, strict flags and CPU autocast on around the fetch; a
    worker forked from it; a worker spawned afresh (PyTorch's defaults: no deterministic
    algorithms): the transform sees one thread and the run's flags in all three."""
    from augment_pipelines import ReadsItsSettings

    from repro.defense.determinism import flags_restored

    with flags_restored():
        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(2)
        pipeline = KeyedPipeline(ReadsItsSettings(), seed=0)  # the flags as built
        data = splits(torch.rand(8, 1, 16, 16))
        data.train_pipeline = pipeline
        with torch.autocast("cpu", dtype=torch.bfloat16):
            main = batches(data, 0, count=1)[0]
        forked = batches(data, 1, count=1)[0]
        sampler = KeyedBatchSampler(8, 8, 4, seed=0)
        spawned = DataLoader(
            KeyedBatches(data.train, pipeline),
            sampler=sampler,
            batch_size=None,
            num_workers=1,
            multiprocessing_context="spawn",
        )
        spawned = next(iter(spawned))[0]
        assert torch.are_deterministic_algorithms_enabled() and torch.get_num_threads() == 2
    seen = main[:, 0, 0, :8]
    expected = torch.tensor([1.0, 1, 0, 1, 0, 1, 1, 1]).expand_as(seen)
    assert torch.equal(seen, expected), seen[0].tolist()
    assert torch.equal(forked[:, 0, 0, :8], expected), forked[0, 0, 0, :8].tolist()
    assert torch.equal(spawned[:, 0, 0, :8], expected), spawned[0, 0, 0, :8].tolist()


# ------------------------------------------------------- the presets, trained at real sizes


def same_weights(tmp_path, *overrides: str) -> None:
    """``overrides`` trained with ``loader=single`` (the main process, 2 threads) and with
    ``loader=multi`` (2 workers, 1 thread each): one weights digest, one loss a step."""
    threads = "determinism.cpu_threads=2"  # strict's own (the tests' runs use 1: conftest)
    single = train_here(tmp_path / "single", *overrides, threads, "loader=single")
    multi = train_here(
        tmp_path / "multi", *overrides, threads, "loader=multi", "loader.num_workers=2"
    )
    assert (multi.dir / "trace.jsonl").read_text() == (single.dir / "trace.jsonl").read_text()
    assert multi.summary["weights_sha256"] == single.summary["weights_sha256"]


def test_the_segmentation_preset_on_a_folder_at_128_px_gives_one_digest_with_any_loader(
    tmp_path,
):
    """The issue's case: ``experiment=segmentation data=image_mask_folder`` on 40-px RGB
    images, resized to data.image_size=128 (the folder's default) and augmented there."""
    root = tmp_path / "data"
    write_shapes_folder(root, count=24, image_size=40, seed=5)
    same_weights(
        tmp_path, "experiment=segmentation", "data=image_mask_folder", f"data.path={root}",
        "data.num_classes=4", "data.image_size=128", "model.width=4", "model.depth=2",
        "trainer.batch_size=8", "trainer.micro_batch_size=8", "trainer.max_steps=3",
        "trainer.eval_every=3", "trainer.trace_every=1",
    )  # fmt: skip


def test_the_native_preset_on_16_bit_images_in_256_px_patches_gives_one_digest_with_any_loader(
    tmp_path,
):
    """``experiment=segmentation_native`` on 12-bit images in 16-bit PNGs (float32 once
    read), trained on 256 × 256 patches with brightness and contrast (a mean over 65,536
    values), evaluated whole."""
    write_nuclei_folder(tmp_path / "data", count=8, seed=4, sizes=(260, 300))
    same_weights(
        tmp_path, "experiment=segmentation_native", f"data.path={tmp_path / 'data'}",
        "data.num_classes=3", "data.channels=1", "data.image_size=256", "data.val_fraction=0.2",
        "model.width=4", "model.depth=2", "trainer.batch_size=4", "trainer.micro_batch_size=4",
        "trainer.max_steps=2", "trainer.eval_every=2", "trainer.trace_every=1",
        "inference.tile_batch=4",
    )  # fmt: skip
