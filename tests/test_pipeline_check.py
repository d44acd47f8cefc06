"""The augmentation self-check (repro.components.data.pipeline_check): every way a user's transform can
make its output depend on something other than the sample and its key -- a private
generator behind a keyed coin, one used only for some classes, a write into its input, a
call counter, the clock, the eval pipeline -- refused before anything is written, in one
line naming the transform; a transform that raises, or returns other channels, likewise; a
transform's error in a loader worker keeps its message and the sample.

Built through ``repro.engine.build.build_data`` (the same call train.py makes), on a folder of 72
images of mixed sizes in 3 classes: no training, except the one worker test."""

import time

import pytest
import torch

from conftest import CONF_DIR, mixed_image_folder, train_here
from optional import require
from repro.base.errors import DataError, ReproError
from repro.components.data.loading import KeyedBatches
from repro.components.data.pipeline_check import UNPROVEN
from repro.defense.config import compose
from repro.engine.build import build_data

FOLDER = [
    "data=image_folder",
    "data.image_size=16",
    "model.width=8",
    "trainer.batch_size=16",
    "trainer.micro_batch_size=8",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return mixed_image_folder(tmp_path_factory.mktemp("check") / "images")


@pytest.fixture(autouse=True)
def pipelines_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(CONF_DIR.parent / "tests"))  # augment_pipelines


def user(target: str, part: str = "train", **keys) -> list[str]:
    """``augment.<part>`` set to ``augment_pipelines.<target>`` with ``keys``."""
    out = [f"augment.{part}._target_=augment_pipelines.{target}", f"augment.{part}.size=16"]
    if part == "train":
        out.append("~augment.train.pad")
    return out + [f"+augment.{part}.{k}={v}" for k, v in keys.items()]


def build(folder, *overrides):
    return build_data(compose([*FOLDER, f"data.path={folder}", *overrides], CONF_DIR))


def refused(folder, *overrides) -> str:
    with pytest.raises(ReproError) as err:
        build(folder, *overrides)
    message = str(err.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("seed", range(6))
def test_a_private_generator_behind_a_keyed_coin_is_refused_under_every_seed(folder, seed):
    """The coin (p=0.3) is keyed, the noise behind it is a generator made at construction;
    the check before this one called one sample under one key and passed seeds 1-4."""
    message = refused(folder, *user("PrivateBehindCoin"), f"seed={seed}")
    assert message.startswith("augment.train: augment_pipelines.PrivateBehindCoin gives another")
    assert "random state of its own" in message


def test_torchvision_random_apply_around_a_private_generator_is_refused(folder):
    require("torchvision", "make add PKG=torchvision")
    message = refused(
        folder,
        "augment.train._target_=torchvision.transforms.v2.Compose",
        "~augment.train.size",
        "~augment.train.pad",
        "+augment.train.transforms=[{_target_: torchvision.transforms.v2.RandomApply, p: 0.3,"
        " transforms: [{_target_: augment_pipelines.PrivateGenerator, size: 16}]},"
        " {_target_: torchvision.transforms.v2.Resize, size: [16, 16]}]",
    )
    assert "torchvision.transforms.v2" in message and "random state of its own" in message


def test_a_private_generator_used_for_one_class_only_is_refused(folder):
    message = refused(folder, *user("PrivateForOneClass"))
    assert "augment_pipelines.PrivateForOneClass" in message


def test_state_carried_from_call_to_call_is_refused(folder):
    message = refused(folder, *user("CountsCalls"))
    assert "augment_pipelines.CountsCalls" in message and "from call to call" in message
    assert "random state of its own" not in message


def test_a_transform_reading_the_clock_is_refused(folder):
    message = refused(folder, *user("ReadsTheClock"))
    assert "augment_pipelines.ReadsTheClock" in message and "reads the clock" in message


@pytest.mark.parametrize(
    "target",
    [
        "ReadsTheClockFourTimesASecond",  # a period that divides a whole-second shift
        "ReadsTheClockWhenBuilt",  # once, in __init__
        "ReadsTheCalendar",  # time.gmtime()
        "ReadsTheCalendar local=true",  # time.localtime()
    ],
)
def test_a_clock_read_any_way_is_refused(folder, target):
    name, *keys = target.split()
    message = refused(folder, *user(name, **dict(k.split("=") for k in keys)))
    assert f"augment_pipelines.{name}" in message and "reads the clock" in message


@pytest.mark.parametrize("target", ["ReadsTheProcessId", "ReadsTheWorkerId", "ReadsAnAddress"])
def test_what_differs_between_processes_is_refused(folder, target):
    """A worker has another pid, its own get_worker_info() and its own addresses: the
    check's second pass runs in a forked process, as a worker."""
    message = refused(folder, *user(target))
    assert f"augment_pipelines.{target}" in message and "reads the clock" not in message
    if target == "ReadsAnAddress":  # a new build here may move it too, as a random state
        assert "differs between processes" in message or "an object's address" in message
    else:
        assert "differs between processes" in message


def test_a_deterministic_transform_that_hashes_a_tensor_passes(folder):
    """A dict keyed by a tensor made at construction: a tensor hashes by its id(), which
    stays its own within the process that built it."""
    assert build(folder, *user("KeysByTensor")).augment_check.random is False


def test_a_private_generator_for_one_class_of_sixteen_is_refused():
    """Class 13 of 16: not among the 6 spread samples; the check takes one sample of each
    class (6 spread and 6 more, at most 12, missed 4 of 16 classes)."""
    cfg = ["data.num_classes=16", "data.train_size=512", "data.val_size=64",
           "data.image_size=16", "model.width=8"]  # fmt: skip
    with pytest.raises(ReproError, match="PrivateForOneClass gives another output"):
        build_data(compose([*cfg, *user("PrivateForOneClass", only=13)], CONF_DIR))
    checked = build_data(compose(cfg, CONF_DIR)).augment_check
    assert checked.classes == (16, 16)
    assert checked.samples >= 16


def test_a_transform_on_threads_of_its_own_is_named(folder, caplog):
    """NumPy's BLAS runs a matrix product on OpenBLAS's threads, which torch's one-thread
    pin cannot reach: named in a warning and in the report's self-check row."""
    import numpy as np

    from repro.components.data.pipeline_check import busy_elsewhere

    m = np.ones((384, 384))
    with busy_elsewhere() as busy:
        for _ in range(20):
            m.dot(m)
    if not busy.threaded():
        pytest.skip(
            "NumPy's BLAS runs on one thread here (one core, or OPENBLAS/OMP_NUM_THREADS=1)"
        )
    data = build(folder, *user("UsesNumpysThreads"))
    checked = data.augment_check
    assert checked.threaded == ["augment.train: augment_pipelines.UsesNumpysThreads"]
    assert "on threads of its own" in checked.summary()
    assert any("ran on threads of its own" in r.getMessage() for r in caplog.records)


def test_the_check_leaves_the_process_as_it_found_it(folder):
    """Its passes read a clock of their own, run one thread, set the global generators from
    each key; afterwards the clock's functions, the threads, the flags and the generators
    are what they were."""
    import datetime
    import random

    import numpy as np

    clocks = {n: getattr(time, n) for n in ("time", "monotonic", "gmtime", "strftime")}
    classes = (datetime.datetime, datetime.date)
    torch.set_num_threads(2)
    flags = (torch.are_deterministic_algorithms_enabled(), torch.get_default_dtype())
    states = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    build(folder, *user("DrawsFromEverything"))
    assert all(getattr(time, n) is f for n, f in clocks.items())
    assert (datetime.datetime, datetime.date) == classes
    assert torch.get_num_threads() == 2 and torch.utils.data.get_worker_info() is None
    assert (torch.are_deterministic_algorithms_enabled(), torch.get_default_dtype()) == flags
    assert torch.equal(torch.get_rng_state(), states[0])
    assert (np.random.get_state()[1] == states[1]).all() and random.getstate() == states[2]


def test_the_eval_pipeline_is_checked_as_the_training_one(folder):
    message = refused(folder, *user("PrivateGenerator", "eval"))
    assert message.startswith("augment.eval: augment_pipelines.PrivateGenerator gives another")


def test_a_write_into_the_input_cannot_change_the_stored_images(folder):
    """Cutout zeroes a square of its input in place; with data.in_memory=true that input
    was the stored image: later epochs (and each worker's copy, and a resume) saw another."""
    data = build(folder, *user("Cutout"), "data.in_memory=true")
    stored = [image.clone() for image in data.train.images]
    batches = KeyedBatches(data.train, data.train_pipeline)
    index = torch.arange(16)
    first = batches.fetch(torch.zeros(1, dtype=torch.int64), index)
    batches.fetch(torch.ones(1, dtype=torch.int64), index)
    again = batches.fetch(torch.zeros(1, dtype=torch.int64), index)
    assert all(torch.equal(a, b) for a, b in zip(stored, data.train.images, strict=True))
    assert torch.equal(first[0], again[0])
    assert not torch.equal(first[0], batches.fetch(torch.ones(1, dtype=torch.int64), index)[0])


def test_a_keyed_transform_that_writes_into_its_input_is_refused(folder, monkeypatch):
    """A transform that declares itself keyed gets no copy: the check compares its inputs."""
    import augment_pipelines

    monkeypatch.setattr(augment_pipelines.Cutout, "keyed", True, raising=False)
    message = refused(folder, *user("Cutout"), "data.in_memory=true")
    assert "augment_pipelines.Cutout changed its input" in message


def test_a_transform_that_raises_or_changes_the_channels_is_one_line_before_step_1(folder):
    message = refused(folder, *user("Raises"))
    assert "augment_pipelines.Raises raised ValueError: cannot cut a (3," in message
    assert "sample 0" in message
    message = refused(folder, *user("ToGray"))
    assert "turned a 3-channel image into a 1-channel one" in message


def test_albumentations_compose_given_directly_says_to_wrap_it(folder, monkeypatch):
    """Its own Compose takes keywords and returns a dict: name the adapter."""
    import augment_pipelines

    class Compose:  # what albumentations.Compose is to the check: its module
        def __call__(self, **inputs):
            return inputs

    Compose.__module__ = "albumentations.core.composition"
    monkeypatch.setattr(augment_pipelines, "FakeAlbumentations", Compose, raising=False)
    message = refused(
        folder,
        "augment.train._target_=augment_pipelines.FakeAlbumentations",
        "~augment.train.size",
        "~augment.train.pad",
    )
    assert "repro.components.data.augment.albumentations" in message and "wrap" in message


def test_the_shipped_pipelines_pass_quickly_and_the_report_names_what_is_not_proven(folder):
    for preset in ("crop_flip", "imagenet", "none"):
        start = time.perf_counter()
        data = build(folder, f"augment={preset}")
        assert data.augment_check is not None and "2 builds" in data.augment_check.summary()
        assert time.perf_counter() - start < 10  # the cost is measured in benchmarks/, not here
        assert data.augment_check.threaded == []  # the shipped ones run on the calling thread
    assert "self-check" in UNPROVEN and "not see" in UNPROVEN


@pytest.mark.e2e
def test_a_transform_error_in_a_loader_worker_keeps_its_message_and_sample(folder, tmp_path):
    with pytest.raises(ReproError) as err:
        train_here(
            tmp_path / "run",
            *FOLDER,
            f"data.path={folder}",
            *user("Raises", in_worker="true"),
            "loader=multi",
            "loader.num_workers=1",
            "trainer.max_steps=1",
        )
    message = str(err.value)
    assert isinstance(err.value, DataError) and "\n" not in message
    assert "augment_pipelines.Raises raised ValueError: cannot cut a" in message
    assert "on sample " in message
