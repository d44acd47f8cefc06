"""Data: the synthetic set, keyed augmentation, the keyed sampler, the loader, image folders."""

import errno
import hashlib
import itertools
import os
import pickle
import tarfile

import numpy as np
import pytest
import torch

from conftest import mixed_image_folder, run_train, train_here
from optional import require
from repro.base.errors import ConfigError, DataError
from repro.components.data import (
    CropFlip,
    DataSplits,
    DeviceBatches,
    KeyedBatches,
    KeyedBatchSampler,
    KeyedPipeline,
    Resize,
    TensorImages,
    cifar10,
    image_folder,
    make_train_loader,
    synthetic,
)
from repro.records.trace import tensors_sha256


def small(**kw):
    return synthetic(train_size=256, val_size=64, **kw)


def test_synthetic_depends_on_data_seed_only():
    a, b, c = small(seed=1), small(seed=1), small(seed=2)
    assert tensors_sha256(a.train.images, a.train.labels) == tensors_sha256(
        b.train.images, b.train.labels
    )
    assert tensors_sha256(a.train.images) != tensors_sha256(c.train.images)
    assert tensors_sha256(a.train.images) != tensors_sha256(a.val.images)  # distinct splits
    assert a.train.images.dtype == torch.uint8 and a.train.images.shape == (256, 3, 32, 32)
    assert torch.bincount(a.train.labels).tolist() == [26] * 6 + [25] * 4  # balanced


def test_synthetic_classes_are_separable_by_their_mean_image():
    # Learnable: a nearest-class-mean classifier on the raw pixels already beats chance.
    d = synthetic(train_size=2000, val_size=500, noise=0.35)
    x = d.train.images.float().flatten(1)
    means = torch.stack([x[d.train.labels == c].mean(0) for c in range(10)])
    xs = d.val.images.float().flatten(1)
    acc = (torch.cdist(xs, means).argmin(1) == d.val.labels).float().mean().item()
    assert acc > 0.2


def test_augmentation_is_keyed_by_epoch_and_index():
    d = small()
    ds = KeyedBatches(d.train, KeyedPipeline(CropFlip(), 0))
    images, labels = ds[[(0, 5)]]
    img = images[0]
    assert torch.equal(img, ds[[(0, 5)]][0][0])
    assert img.shape == d.train.images[5].shape and labels[0] == d.train.labels[5]
    # the batch it is fetched in does not matter: each sample's draws are its own
    batch, batch_labels = ds[[(0, 9), (2, 1), (0, 5), (1, 5)]]
    assert torch.equal(batch[2], img) and batch_labels.tolist()[2] == int(d.train.labels[5])
    others = [ds[[(e, 5)]][0][0] for e in range(1, 8)]
    assert any(not torch.equal(img, o) for o in others)  # a new crop/flip in other epochs
    assert torch.equal(batch[3], others[0])
    other_seed = KeyedBatches(d.train, KeyedPipeline(CropFlip(), 1))
    assert any(not torch.equal(ds[[(e, 5)]][0], other_seed[[(e, 5)]][0]) for e in range(8))
    plain = KeyedBatches(d.train, KeyedPipeline(None, 0))
    assert torch.equal(plain[[(3, 5)]][0][0], d.train.images[5])


def test_sampler_is_a_pure_function_of_the_step():
    s = KeyedBatchSampler(dataset_size=100, batch_size=32, micro_batch_size=8, seed=0)
    assert s.steps_per_epoch == 3
    stream = list(itertools.islice(iter(s), 4 * 10))  # 10 steps x 4 micro-batches
    assert all(len(mb) == 8 for mb in stream)
    resumed = KeyedBatchSampler(100, 32, 8, seed=0, start_step=7)
    assert list(itertools.islice(iter(resumed), 4 * 3)) == stream[4 * 7 :]
    epoch0 = [i for mb in stream[:12] for (e, i) in mb]
    assert len(set(epoch0)) == 96 and {e for mb in stream[:12] for (e, _) in mb} == {0}
    epoch1 = [i for mb in stream[12:24] for (_, i) in mb]
    assert epoch1 != epoch0  # reshuffled each epoch


def test_sampler_refuses_batches_larger_than_the_data():
    with pytest.raises(DataError, match="trainer.batch_size"):
        KeyedBatchSampler(10, 32, 8, seed=0)


class _Loader:
    num_workers, persistent_workers, prefetch_factor = 0, False, None


def _batches(loader, n):
    return [(x.clone(), y.clone()) for x, y in itertools.islice(iter(loader), n)]


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 8 workers on 2 cores
@pytest.mark.parametrize(
    "workers, persistent, prefetch",
    [(2, False, 2), (2, True, 1), (8, False, 4), (3, True, None)],
    ids=["2-workers", "2-persistent-prefetch-1", "8-workers-prefetch-4", "3-persistent"],
)
def test_loader_output_does_not_depend_on_worker_count(workers, persistent, prefetch):
    """The loader promise (docs/design.md): 0, 2 or 8 workers, prefetch, persistent workers."""
    d = small().with_augmentation(KeyedPipeline(CropFlip(), 0), KeyedPipeline(None, 0))
    single = _batches(make_train_loader(d, 0, 32, 16, _Loader(), pin_memory=False), 20)
    multi_cfg = _Loader()
    multi_cfg.num_workers, multi_cfg.persistent_workers = workers, persistent
    multi_cfg.prefetch_factor = prefetch
    multi = _batches(make_train_loader(d, 0, 32, 16, multi_cfg, pin_memory=False), 20)
    assert len(single) == len(multi) == 20  # 2 micro-batches a step, 8 steps an epoch: 16 items
    for (xa, ya), (xb, yb) in zip(single, multi, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def _write_images(root, classes, per_class):
    from PIL import Image

    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (20, 12), (40 * c, 10 * i, 100)).save(root / name / f"{i}.png")


def test_image_folder_reads_class_folders(tmp_path):
    require("PIL")
    _write_images(tmp_path, ["cat", "dog", "emu"], 5)
    d = image_folder(str(tmp_path), image_size=16, val_fraction=0.2, seed=0, in_memory=True)
    assert isinstance(d, DataSplits) and d.num_classes == 3 and d.image_size == 16
    assert len(d.train) + len(d.val) == 15 and len(d.val) == 3
    assert {tuple(i.shape) for i in d.train.images} == {(3, 12, 20)}  # kept at its own size
    lazy = image_folder(str(tmp_path), image_size=16, val_fraction=0.2, seed=0)
    every = torch.arange(len(d.val))
    for data in (d, lazy):  # seen through the evaluation pipeline: at image_size
        data.with_augmentation(KeyedPipeline(CropFlip(16), 0), KeyedPipeline(Resize(16), 0))
    assert all(
        torch.equal(a, b) for a, b in zip(lazy.val.fetch(every), d.val.fetch(every), strict=True)
    )
    assert lazy.val.fetch(every)[0].shape == (3, 3, 16, 16)
    assert lazy.normalisation() == d.normalisation()
    held = image_folder(str(tmp_path), image_size=16, val_fraction=0.2, seed=0, test_fraction=0.2)
    names = {s: {str(f) for f in getattr(held, s).files} for s in ("train", "val", "test")}
    # a keyed hash of each name (tests/test_splits.py): these 15 names give 5 and 7
    assert len(names["test"]) == 5 and len(names["train"]) == 7
    assert not names["test"] & (names["train"] | names["val"])
    assert names["val"] == {str(f) for f in lazy.val.files}  # the same validation split
    assert d.test is None


def test_image_folder_names_its_classes_and_reads_grayscale_with_channels_1(tmp_path):
    require("PIL")
    _write_images(tmp_path, ["cat", "dog", "emu"], 4)
    gray = image_folder(str(tmp_path), image_size=16, val_fraction=0.25, seed=0, channels=1)
    rgb = image_folder(str(tmp_path), image_size=16, val_fraction=0.25, seed=0, in_memory=True)
    assert gray.class_names == rgb.class_names == ("cat", "dog", "emu")
    assert gray.in_channels == 1 and rgb.in_channels == 3
    images, _ = gray.train.fetch(torch.arange(2))
    assert [tuple(i.shape) for i in images] == [(1, 12, 20)] * 2
    # Pillow's L conversion of the RGB pixels: 299/587/114 weights, rounded
    r, g, b = (int(v) for v in rgb.train.images[0][:, 0, 0])
    assert int(images[0][0, 0, 0]) == (r * 299 + g * 587 + b * 114 + 500) // 1000
    with pytest.raises(DataError, match=r"data.channels=0 is invalid; allowed: an integer >= 1"):
        image_folder(str(tmp_path), channels=0)


def test_image_folder_errors_name_the_path(tmp_path):
    require("PIL")
    with pytest.raises(DataError, match="data.path=.*not a directory"):
        image_folder(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="data.path=.*at least 2 class"):
        image_folder(str(tmp_path / "empty"))


def _cifar_folder(root, n=20):
    """A cifar-10-batches-py folder in the official format (protocol 2 pickles of dicts
    with bytes keys), ``n`` random images a batch."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    g = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            b"batch_label": name.encode(),
            b"labels": [int(v) for v in g.integers(0, 10, n)],
            b"data": g.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"filenames": [b"x.png"] * n,
        }
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    return folder


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_cifar10_reads_the_batches_folder_without_torchvision_or_running_code(tmp_path):
    folder = _cifar_folder(tmp_path)
    d = cifar10(root=str(tmp_path), download=False)
    assert len(d.train) == 100 and len(d.val) == 20 and d.train.images.shape[1:] == (3, 32, 32)
    first = pickle.loads((folder / "data_batch_1").read_bytes(), encoding="bytes")
    assert torch.equal(d.train.images[0].flatten(), torch.from_numpy(first[b"data"][0]))
    assert d.train.labels[:20].tolist() == first[b"labels"]
    marker = tmp_path / "code-ran"
    batch = {b"data": _RunsCode(marker), b"labels": [0]}
    (folder / "test_batch").write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(
        DataError, match=r"test_batch was refused \(refused global (posix|os)\.system"
    ):
        cifar10(root=str(tmp_path), download=False)
    assert not marker.exists()
    with pytest.raises(DataError, match="no cifar-10-batches-py folder in data.root="):
        cifar10(root=str(tmp_path / "none"), download=False)
    truncated = (folder / "data_batch_1").read_bytes()
    (folder / "test_batch").write_bytes(truncated[: len(truncated) // 2])
    with pytest.raises(DataError, match=r"cannot read .*test_batch \((UnpicklingError|EOFError)"):
        cifar10(root=str(tmp_path), download=False)  # damaged, not refused as code


def test_cifar10_downloads_checks_the_md5_and_extracts(tmp_path, monkeypatch):
    """The archive made here and served by a file:// URL: a wrong MD5 is refused and the
    file deleted; the right one is extracted and read."""
    import repro.components.data

    _cifar_folder(tmp_path / "src")
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "src" / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    with pytest.raises(DataError, match="gave a file whose MD5 is .*, not the published"):
        cifar10(root=str(tmp_path / "a"), url=archive.as_uri())
    assert not (tmp_path / "a" / archive.name).exists()
    monkeypatch.setattr(
        repro.components.data.cifar, "CIFAR10_MD5", hashlib.md5(archive.read_bytes()).hexdigest()
    )
    d = cifar10(root=str(tmp_path / "b"), url=archive.as_uri())
    assert len(d.train) == 100 and not (tmp_path / "b" / archive.name).exists()


def test_tensor_images_checks_its_input():
    with pytest.raises(ValueError, match="uint8 or float32"):
        TensorImages(torch.zeros(2, 3, 4, 4, dtype=torch.float64), torch.zeros(2))
    with pytest.raises(ValueError, match="N×C×H×W"):
        TensorImages(torch.zeros(2, 4, 4, dtype=torch.uint8), torch.zeros(2))
    assert TensorImages(torch.zeros(2, 3, 4, 4), torch.zeros(2)).channels == 3  # float32: mapped


def test_the_batched_crop_and_flip_is_the_naive_one_image_by_image():
    from repro.components.data import CROP_PAD, crop_flip_batch, keyed_crop_flip_params

    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (40, 3, 12, 10), dtype=torch.uint8, generator=g)
    params = keyed_crop_flip_params(7, torch.tensor([3]), torch.arange(40))
    assert params[:, 2].unique().tolist() == [0, 1] and params[:, :2].unique().numel() == 9
    batch = crop_flip_batch(images, params)

    def naive(image, dy, dx, flip):
        padded = torch.nn.functional.pad(image, (CROP_PAD,) * 4)
        out = padded[:, dy : dy + image.shape[1], dx : dx + image.shape[2]]
        return out.flip(-1) if flip else out

    one_by_one = torch.stack([naive(im, *p.tolist()) for im, p in zip(images, params, strict=True)])
    assert batch.dtype == torch.uint8 and torch.equal(batch, one_by_one)


def test_keyed_draws_are_uniform_and_a_pure_function_of_the_key():
    """The counter-based draws: the same values for a key in any batch (here: alone, and in
    a batch of other epochs), other values for another seed or purpose, and crop offsets
    and flips that are uniform (chi-square over 90,000 samples)."""
    from repro.base.rng import keyed_draws
    from repro.components.data import keyed_crop_flip_params

    epochs, index = torch.arange(300).repeat_interleave(300), torch.arange(300).repeat(300)
    draws = keyed_draws(5, "augment", epochs, index, draws=3)
    alone = keyed_draws(5, "augment", torch.tensor([17]), torch.tensor([123]), draws=3)
    assert torch.equal(draws[17 * 300 + 123], alone[0])
    assert draws.min() >= 0 and draws.max() < 2**32 and draws.unique().numel() > 269_000
    assert not torch.equal(draws, keyed_draws(6, "augment", epochs, index, draws=3))
    assert not torch.equal(draws, keyed_draws(5, "order", epochs, index, draws=3))
    params = keyed_crop_flip_params(5, epochs, index)
    for column, bins in ((0, 9), (1, 9), (2, 2)):
        counts = params[:, column].bincount(minlength=bins).double()
        expected = len(params) / bins
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 30, (column, counts)  # p < 0.001 is 26.1 at 8 degrees of freedom


def test_the_device_loaders_index_tensors_are_the_samplers_micro_batches():
    s = KeyedBatchSampler(dataset_size=100, batch_size=32, micro_batch_size=8, seed=0)
    s.start_step = 2  # across an epoch boundary (3 steps an epoch)
    lists = list(itertools.islice(iter(s), 4 * 5))
    tensors = list(itertools.islice(s.index_tensors(torch.device("cpu")), 4 * 5))
    for keys, (epoch, index) in zip(lists, tensors, strict=True):
        assert [(int(epoch), int(i)) for i in index] == keys


@pytest.mark.parametrize("targets", ["labels", "masks"])
@pytest.mark.parametrize("chunk_bytes", [1 << 27, 3 * 8 * 8 * 8], ids=["whole", "chunks-of-3"])
def test_the_device_loader_cuts_the_workers_micro_batches(targets, chunk_bytes, monkeypatch):
    """The device loader augments each epoch's split at once (in chunks when large) and
    gathers micro-batches from it: byte for byte the micro-batches the worker loader's
    dataset builds one by one, across an epoch boundary, for labels and masks."""
    monkeypatch.setattr(DeviceBatches, "CHUNK_BYTES", chunk_bytes)
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (20, 3, 8, 8), dtype=torch.uint8, generator=g)
    shape = (20,) if targets == "labels" else (20, 8, 8)
    split = TensorImages(images, torch.randint(0, 4, shape, generator=g))
    sampler = KeyedBatchSampler(dataset_size=20, batch_size=8, micro_batch_size=4, seed=3)
    sampler.start_step = 1  # 2 steps an epoch: steps 1-4 cross two epoch boundaries
    dataset = KeyedBatches(split, KeyedPipeline(CropFlip(), 3))
    keys = list(itertools.islice(iter(sampler), 8))
    cut = list(itertools.islice(iter(DeviceBatches(dataset, sampler)), 8))
    assert len({tensors_sha256(x) for x, _ in cut}) == 8  # the test sees different batches
    for k, (x, y) in zip(keys, cut, strict=True):
        want_x, want_y = dataset[k]
        assert torch.equal(x, want_x) and torch.equal(y, want_y)


def test_loader_on_device_gives_the_same_bits_as_the_worker_loader(tmp_path):
    """loader=device (here on the CPU: the same code path as on a GPU) vs loader=single."""
    args = ["trainer.max_steps=12", "trainer.eval_every=12", "data.train_size=512"]
    args += ["data.val_size=64"]
    single = train_here(tmp_path / "single", *args, "loader=single")
    device = train_here(tmp_path / "device", *args, "loader=device")
    assert device.summary["weights_sha256"] == single.summary["weights_sha256"]
    assert device.losses == single.losses
    refused = "loader.num_workers=2 is invalid; allowed: 0 with loader.on_device=true"
    with pytest.raises(ConfigError, match=refused):
        train_here(tmp_path / "bad", *args, "loader=device", "loader.num_workers=2")


def test_an_image_too_large_to_decode_names_its_file(tmp_path, monkeypatch):
    """PIL refuses a decompression bomb with its own exception type: still one line
    naming the file."""
    require("PIL")
    from PIL import Image

    from repro.components.data import read_image

    Image.new("RGB", (64, 64)).save(tmp_path / "huge.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 64×64 is then > 2× the limit
    with pytest.raises(DataError, match=r"cannot read image .*huge.png \(DecompressionBombError"):
        read_image(tmp_path / "huge.png")


def test_a_lazy_split_reads_files_when_fetched_and_stops_or_skips_a_bad_one(tmp_path):
    """stop: one line naming the file; skip: the next readable file (and its label) takes
    its place, the same one whoever reads it, named once in a warning."""
    require("PIL")
    from repro.components.data import LazyImages, read_image

    root = mixed_image_folder(tmp_path / "images", corrupt=("03.png",))
    files = sorted(root.glob("ant/0[2-4].*"))  # 02.jpg, 03.png (bad), 04.jpg
    labels = torch.tensor([0, 1, 2])
    with pytest.raises(DataError, match=r"^data: cannot read image .*ant/03.png \("):
        LazyImages(files, labels, "stop").fetch(torch.tensor([1]))
    split = LazyImages(files, labels, "skip")
    images, got = split.fetch(torch.tensor([1, 0, 1]))
    assert got.tolist() == [2, 0, 2]  # 04.jpg's label came with its image
    assert torch.equal(images[0], read_image(files[2])) and torch.equal(images[0], images[2])
    assert torch.equal(split.read_all().images[1], images[0])
    import repro.components.data

    def disk_fails(path, size=None):
        raise DataError(f"data: cannot read image {path}") from OSError(errno.EIO, "I/O error")

    with pytest.MonkeyPatch.context() as patch:  # the disk, not the file: never skipped
        patch.setattr(repro.components.data.folders, "read_image", disk_fails)
        with pytest.raises(DataError, match="cannot read image"):
            split.fetch(torch.tensor([0]))
    with pytest.raises(DataError, match="data.on_bad_image='ignore' is invalid"):
        image_folder(str(root), on_bad_image="ignore")


# a mixed folder (see _mixed_folder) with two unreadable files, read at 16x16; 4 steps an
# epoch, so 8 steps read every training file twice
MIXED = [
    "data=image_folder",
    "data.image_size=16",
    "data.on_bad_image=skip",
    "trainer.batch_size=16",
    "trainer.micro_batch_size=8",
    "trainer.max_steps=8",
    "trainer.eval_every=4",
    "trainer.checkpoint_every=3",
    "model.width=8",
]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """The mixed folder, and the run that reads it up front in the main process."""
    require("PIL")
    base = tmp_path_factory.mktemp("mixed")
    root = mixed_image_folder(base / "images", corrupt=("05.png", "10.jpg"))
    args = [*MIXED, f"data.path={root}"]
    return args, train_here(base / "memory", *args, "data.in_memory=true", "loader=single")


@pytest.mark.e2e
def test_image_folder_lazy_and_in_memory_give_the_same_bits_with_any_loader(mixed, tmp_path):
    """A folder of PNG and JPEG files of varied sizes, some unreadable (skipped): read in
    the main process up front, or per micro-batch in 2 loader workers, killed after step 5
    and resumed from its step-3 checkpoint -- the same bits; and best.pt after a run with
    evaluations."""
    args, memory = mixed

    class Killed(Exception):
        pass

    def kill(step, model):
        if step == 5:
            raise Killed

    lazy_args = [*args, "loader=multi", "loader.num_workers=2"]
    with pytest.raises(Killed):
        train_here(tmp_path / "lazy", *lazy_args, after_step=kill)
    lazy = train_here(tmp_path / "lazy", *lazy_args, "trainer.resume=auto")
    assert lazy.summary["resumes"][-1]["step"] == 3
    assert lazy.summary["weights_sha256"] == memory.summary["weights_sha256"]
    assert lazy.losses == memory.losses
    assert "05.png (" in memory.output and "Skipped (data.on_bad_image=skip)" in memory.output
    assert (lazy.dir / "best.pt").is_file() and lazy.summary["best"]["step"] in (4, 8)


@pytest.mark.e2e
def test_image_folder_read_lazily_by_two_processes_gives_the_one_process_bits(mixed, tmp_path):
    """torchrun, 2 processes (one micro-batch of each step on each), each reading its
    share of the files in 2 loader workers: the bits of one process reading them up front."""
    args, memory = mixed
    two = run_train(tmp_path / "two", *args, "loader=multi", "loader.num_workers=2", nproc=2)
    assert two.summary["world_size"] == 2
    assert two.summary["weights_sha256"] == memory.summary["weights_sha256"]
    assert two.losses == memory.losses


def test_a_skipped_image_is_logged_into_the_run_directory_only_once_it_is_the_runs(mixed, tmp_path):
    """The skip warnings come while the data is built, before the directory is taken: with
    Hydra's log file (opened at its first record) they must neither create train.log in a
    directory that is then refused, nor make a new run's directory look taken."""
    import logging

    from repro.base.errors import ConfigError

    args, _ = mixed
    root = logging.getLogger()

    def with_log_file(run_dir, *extra):
        handler = logging.FileHandler(run_dir / "train.log", delay=True)
        root.addHandler(handler)
        try:
            return train_here(run_dir, *args, "trainer.max_steps=1", *extra)
        finally:
            root.removeHandler(handler)
            handler.close()

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="holds no run of this project"):
        with_log_file(foreign)
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]  # not a byte written
    new = tmp_path / "new"
    new.mkdir()
    run = with_log_file(new)
    assert run.summary["steps"] == 1
    assert "Skipped (data.on_bad_image=skip)" in (new / "train.log").read_text()


def test_skip_passes_over_symlinks_that_lead_nowhere_and_folders_named_like_images(tmp_path):
    """A dangling symlink, a symlink loop and a directory called x.png are bad files, not a
    failing disk: data.on_bad_image=skip skips them (each named once), stop names them."""
    require("PIL")
    root = mixed_image_folder(tmp_path / "images")
    (root / "ant" / "90.png").symlink_to(root / "ant" / "gone.png")  # dangling
    (root / "bee" / "91.png").symlink_to(root / "bee" / "91.png")  # a loop
    (root / "cow" / "92.png").mkdir()  # a folder named like an image
    data = image_folder(str(root), image_size=16, on_bad_image="skip", val_fraction=0.5)
    splits = [data.train, data.val]
    bad = {"90.png", "91.png", "92.png"}
    assert bad <= {f.name for s in splits for f in s.files}  # listed: the splits do not change
    for split in splits:
        images, _ = split.fetch(torch.arange(len(split)))
        assert len(images) == len(split) and all(i.shape[0] == 3 for i in images)
    strict = image_folder(str(root), image_size=16, val_fraction=0.5)  # stop: named, at once
    for split in (strict.train, strict.val):
        for i, f in enumerate(split.files):
            if f.name in bad:
                with pytest.raises(DataError, match=rf"cannot read image .*/{f.name} \("):
                    split.fetch(torch.tensor([i]))


def test_an_image_above_pillows_pixel_limit_is_one_warning_naming_it(tmp_path, monkeypatch, caplog):
    """Between PIL's limit and twice it, PIL warns (DecompressionBombWarning) and reads: the
    image is read, and the warning is one line of the run's log naming the file, not PIL's."""
    import warnings

    require("PIL")
    from PIL import Image

    from repro.components.data import read_image

    Image.new("RGB", (12, 12), (9, 9, 9)).save(tmp_path / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 144 pixels: warned, not refused
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning that escapes fails the test
        with caplog.at_level("WARNING", logger="repro"):
            image = read_image(tmp_path / "big.png")
    assert image.shape == (3, 12, 12) and int(image.max()) == 9
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "big.png" in lines[0] and "144 pixels" in lines[0], lines


def test_an_exif_orientation_is_named_once_and_the_pixels_are_read_as_stored(
    tmp_path, monkeypatch, caplog
):
    """A phone's JPEG says "rotate 90° clockwise" in its EXIF: the pixels are read as stored
    (the grid a mask of it was saved on), and the first such file is named in one warning."""
    Image = require("PIL.Image")
    import repro.components.data.folders as folders
    from repro.components.data import read_image

    monkeypatch.setattr(folders, "_warned_oriented", [])
    stored = np.zeros((4, 6, 3), np.uint8)
    stored[0, :, 0] = 255  # a red top row, 6 wide
    for name, orientation in (("a.png", 6), ("b.png", 6), ("plain.png", None)):
        image = Image.fromarray(stored)
        exif = Image.Exif()
        if orientation:
            exif[0x0112] = orientation
        image.save(tmp_path / name, exif=exif)
    with caplog.at_level("WARNING", logger="repro"):
        pixels = [read_image(tmp_path / n) for n in ("plain.png", "a.png", "b.png")]
    for p in pixels:
        assert p.shape == (3, 4, 6) and torch.equal(p, pixels[0])  # as stored, not turned
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "a.png has EXIF orientation 6 (a viewer shows it rotated 90° clockwise)" in lines[0]


SMALL_RUN = ["data.train_size=256", "data.val_size=64"]


def chosen(monkeypatch, *overrides, device="cuda", free_gib=100.0, cores=16, local=1):
    """repro.engine.settle.choose_loader for the composed config, on ``device`` with ``free_gib`` of
    free GPU memory, ``cores`` CPU cores and ``local`` processes on this host (no GPU
    needed: what CUDA would answer is given)."""
    from repro.defense.config import compose
    from repro.engine.build import build_data
    from repro.engine.settle import choose_loader

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (free_gib * 2**30, 141 * 2**30))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    cfg = compose(list(overrides))
    return choose_loader(cfg, build_data(cfg), torch.device(device))


def test_loader_auto_keeps_the_multi_loader_on_a_cpu(monkeypatch):
    from omegaconf import OmegaConf

    from repro.defense.config import compose

    choice = chosen(monkeypatch, *SMALL_RUN, device="cpu")
    assert choice.name == "multi" and choice.why == "auto: multi on cpu (2 workers)"
    multi = OmegaConf.to_container(compose(["loader=multi"]).loader)
    multi.pop("auto")
    assert {k: choice.cfg[k] for k in multi} == multi  # loader=multi's settings, exactly


def test_loader_auto_on_cuda_puts_a_split_that_fits_on_the_device(monkeypatch):
    choice = chosen(monkeypatch, *SMALL_RUN)
    assert choice.name == "device" and choice.why.startswith("auto: fits")
    assert choice.cfg.on_device and choice.cfg.num_workers == 0
    # 256 images of 3 x 32 x 32 and their labels, twice, against a quarter of what is free
    tight = 2 * 256 * (3 * 32 * 32 + 8) / 2**30 / 0.25
    assert chosen(monkeypatch, *SMALL_RUN, free_gib=tight * 1.01).name == "device"
    assert chosen(monkeypatch, *SMALL_RUN, free_gib=tight * 0.99).name == "multi"
    choice = chosen(monkeypatch, *SMALL_RUN, "loader.device_fraction=1.0", free_gib=tight / 4)
    assert choice.name == "device"


@pytest.mark.parametrize(
    ("cores", "local", "workers"), [(16, 1, 12), (64, 1, 12), (16, 2, 6), (3, 1, 2)]
)
def test_loader_auto_on_cuda_falls_back_to_workers_for_the_hosts_cores(
    monkeypatch, cores, local, workers
):
    choice = chosen(monkeypatch, *SMALL_RUN, free_gib=1e-6, cores=cores, local=local)
    assert choice.name == "multi" and choice.cfg.num_workers == workers
    assert "the training split on the device would take" in choice.why


def test_loader_auto_on_cuda_leaves_a_host_augmentation_and_a_lazy_folder_to_workers(
    monkeypatch, tmp_path
):
    choice = chosen(monkeypatch, *SMALL_RUN, "augment=imagenet", "data.image_size=24")
    assert choice.name == "multi" and "augment.train" in choice.why
    require("PIL")
    root = mixed_image_folder(tmp_path / "images")
    choice = chosen(monkeypatch, *MIXED, f"data.path={root}")
    assert choice.name == "multi" and "read from disk per sample" in choice.why
    for loader in ("single", "multi", "device"):  # the others choose for themselves
        assert chosen(monkeypatch, *SMALL_RUN, f"loader={loader}").name == loader
