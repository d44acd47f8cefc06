"""``repro new NAME [--task classification|segmentation]``: a project of your own beside
the template, in one command.

It writes a model, a dataset and a task (``src/NAME/``), their YAMLs and a preset
(``conf/{model,data,task,experiment}/NAME.yaml``), and ``tests/test_NAME.py``, which checks the
template's promise for that experiment: the same bits twice, with loader workers, after a
kill and resume, and over two processes. Everything trains as written (segmentation: on an
image and mask folder; ``python -m NAME.data data/NAME`` writes an example one, and the test
writes its own); replace the bodies with your own, and keep the test. ``--remove-examples`` removes what only the template's
history needs: its dated benchmark records.

Nothing that exists is overwritten: a name whose files are there already is refused before
anything is written.
"""

from __future__ import annotations

import importlib.util
import keyword
import os
import re
import shutil
import sys
from pathlib import Path

from repro.base.errors import ReproError

# The files of a new classification project, by path (NAME is replaced).
CLASSIFICATION = {
    "src/{name}/__init__.py": '''"""{name}: a project built on the repro template (`repro new {name}`)."""
''',
    "src/{name}/models.py": '''"""{name}'s model. Any ``nn.Module`` works: the run passes ``num_classes`` and ``in_channels``
from the data when the signature names them, and the YAML's keys (conf/model/{name}.yaml)."""

from torch import nn


class Net(nn.Module):
    """Two convolutions (GroupNorm: independent of the batch), average pooling, dropout and a
    linear head. Its initial weights are drawn from a generator keyed by the seed."""

    def __init__(
        self, num_classes: int, in_channels: int = 3, width: int = 16, dropout: float = 0.1
    ) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.GroupNorm(4, width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),
            nn.GroupNorm(4, 2 * width),
            nn.ReLU(),
        )
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(2 * width, num_classes))

    def forward(self, x):
        return self.head(self.features(x).mean(dim=(2, 3)))
''',
    "src/{name}/data.py": '''"""{name}'s data: a function of its YAML's keys (conf/data/{name}.yaml) that returns
``repro.components.data.DataSplits``. Replace the body with your own reading; keep it a pure function
of its arguments (sorted file lists, generators keyed by ``seed``), so that every machine,
process and resume sees the same data. A folder of images per class needs no code:
``data=image_folder data.path=...``."""

import torch

from repro.components.data import DataSplits, TensorImages


def dataset(
    num_classes: int = 4,
    train_size: int = 1024,
    val_size: int = 256,
    image_size: int = 16,
    seed: int = 1234,
) -> DataSplits:
    """Noisy copies of one random pattern per class: uint8 images (N×C×H×W) and int64
    labels, held in memory."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randint(0, 256, (num_classes, 3, image_size, image_size), generator=g)

    def split(n: int) -> TensorImages:
        labels = torch.randint(0, num_classes, (n,), generator=g)
        noise = torch.randint(-80, 81, (n, 3, image_size, image_size), generator=g)
        images = (patterns[labels] + noise).clamp(0, 255).to(torch.uint8)
        return TensorImages(images, labels)

    return DataSplits(
        split(train_size),
        split(val_size),
        num_classes,
        image_size=image_size,
        class_names=tuple(f"class{{c}}" for c in range(num_classes)),
    )
''',
    "src/{name}/tasks.py": '''"""{name}'s task: the loss, and the metrics from additive statistics. This one keeps
classification's statistics and metrics and changes the loss (docs/extending.md, "A task")."""

import torch.nn.functional as F

from repro.components.tasks import Classification


class Task(Classification):
    """Cross-entropy with label smoothing, summed over the micro-batch (the loop divides by
    the batch size)."""

    def __init__(self, label_smoothing: float = 0.1) -> None:
        self.label_smoothing = label_smoothing

    def loss(self, outputs, targets):
        return F.cross_entropy(
            outputs.float(), targets, reduction="sum", label_smoothing=self.label_smoothing
        )
''',
    "conf/model/{name}.yaml": """# {name}'s model (src/{name}/models.py): `python train.py model={name}`.
_target_: {name}.models.Net
width: 16
dropout: 0.1
""",
    "conf/data/{name}.yaml": """# {name}'s data (src/{name}/data.py): `python train.py data={name}`.
_target_: {name}.data.dataset
num_classes: 4
train_size: 1024
val_size: 256
image_size: 16
seed: 1234        # the data's own seed: a seed sweep varies the training, never the data
""",
    "conf/task/{name}.yaml": """# {name}'s task (src/{name}/tasks.py): `python train.py task={name}`.
_target_: {name}.tasks.Task
label_smoothing: 0.1
""",
    "conf/experiment/{name}.yaml": """# @package _global_
# {name} in one word: `python train.py experiment={name}`. A preset selects its groups' YAMLs
# (it sets no model keys, so `experiment={name} model=other` works) and the run's size;
# overrides after it still apply.
defaults:
  - override /model: {name}
  - override /data: {name}
  - override /task: {name}

trainer:
  max_steps: 200
  batch_size: 64
  micro_batch_size: 32     # 2 micro-batches a step: 1 or 2 processes give the same bits
  eval_every: 50
""",
    "tests/test_{name}.py": '''"""The template's promise for the {name} experiment: the same bits twice, with loader
workers, after a kill and resume, and over two processes (written by `repro new {name}`).

Keep it as the experiment grows: the day a new layer or augmentation breaks determinism, CI
says so. SMALL shrinks the run (a few seconds each), not what is checked; runs are compared
with each other, never with a digest written down (another CPU gives other bits)."""

import pytest

from repro.tools.testing import assert_same_bits, train, train_killed

pytestmark = pytest.mark.e2e  # starts train.py: `make test`, not `make test-fast`

EXPERIMENT = ["experiment={name}"]
# On the CPU, on every machine (2 processes need no 2 GPUs); on a GPU, `repro doctor
# experiment={name}` checks the model's kernels there. When your data takes other keys than
# train_size and val_size, shrink it with those: a few batches are enough.
SMALL = [
    "device=cpu",
    "trainer.max_steps=8",
    "trainer.eval_every=4",
    "trainer.checkpoint_every=3",
    "trainer.batch_size=16",
    "trainer.micro_batch_size=8",
    "data.train_size=128",
    "data.val_size=32",
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The run everything is compared with: one process, loading in the main process."""
    run_dir = tmp_path_factory.mktemp("{name}") / "reference"
    return train(run_dir, *EXPERIMENT, *SMALL, "loader=single")


def test_{name}_repeats_bit_for_bit(reference, tmp_path):
    again = train(tmp_path / "again", *EXPERIMENT, *SMALL, "loader=single")
    assert_same_bits(reference, again)


def test_{name}_gives_the_same_bits_with_loader_workers(reference, tmp_path):
    workers = ["loader=multi", "loader.num_workers=2"]
    assert_same_bits(reference, train(tmp_path / "workers", *EXPERIMENT, *SMALL, *workers))


def test_{name}_killed_and_resumed_gives_the_uninterrupted_bits(reference, tmp_path):
    run_dir = tmp_path / "killed"
    train_killed(run_dir, *EXPERIMENT, *SMALL, "loader=single", after=5)
    resumed = train(run_dir, *EXPERIMENT, *SMALL, "loader=single", "trainer.resume=auto")
    assert resumed.summary["resumes"][-1]["step"] == 3  # from the step-3 checkpoint
    assert_same_bits(reference, resumed)


def test_{name}_on_two_processes_gives_the_one_process_bits(reference, tmp_path):
    two = train(tmp_path / "two", *EXPERIMENT, *SMALL, "loader=single", nproc=2)
    assert_same_bits(reference, two)
''',
}


# The files of a new segmentation project (`repro new NAME --task segmentation`).
SEGMENTATION = {
    "src/{name}/__init__.py": '''"""{name}: a segmentation project built on the repro template (`repro new {name}
--task segmentation`)."""
''',
    "src/{name}/models.py": '''"""{name}'s model. Any ``nn.Module`` that maps N×C×H×W images to N×classes×H×W logits
works: the run passes ``num_classes`` and ``in_channels`` from the data when the signature
names them, and the YAML's keys (conf/model/{name}.yaml). A zoo model is a YAML too
(docs/extending.md#a-model); its class count must arrive under the name its constructor
takes (smp: ``classes``), which the run checks before step 1."""

import torch
from torch import nn

from repro.components.ops import Upsample2x


def block(cin: int, cout: int) -> nn.Sequential:
    """Two 3×3 convolutions, each with GroupNorm (independent of the batch) and ReLU."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1),
        nn.GroupNorm(4, cout),
        nn.ReLU(),
        nn.Conv2d(cout, cout, 3, padding=1),
        nn.GroupNorm(4, cout),
        nn.ReLU(),
    )


class Net(nn.Module):
    """A two-level UNet (image sides must be even), upsampling by ``repro.components.ops.Upsample2x``
    (bilinear, deterministic on CUDA at nn.Upsample's speed). Its initial weights are drawn
    from a generator keyed by the seed."""

    def __init__(self, num_classes: int, in_channels: int = 3, width: int = 16) -> None:
        super().__init__()
        self.down = block(in_channels, width)
        self.bottom = nn.Sequential(nn.MaxPool2d(2), block(width, 2 * width), Upsample2x())
        self.up = block(3 * width, width)
        self.head = nn.Conv2d(width, num_classes, 1)

    def forward(self, x):
        skip = self.down(x)
        return self.head(self.up(torch.cat([skip, self.bottom(skip)], dim=1)))
''',
    "src/{name}/data.py": '''"""{name}'s data is a folder: ``images/<stem>.png`` and ``masks/<stem>.png`` (class
indices; 255: not scored), read by ``repro.components.data.image_mask_folder`` (conf/data/{name}.yaml;
conf/data/image_mask_folder.yaml documents every key: bit depth, channels, groups, folds,
``limit``). To try the project before your data is there, write an example folder:

    python -m {name}.data data/{name}      # then: python train.py experiment={name}
"""

import sys
from pathlib import Path

import numpy as np

CLASS_NAMES = ("background", "disc", "square")


def example_folder(path: str | Path, count: int = 64, size: int = 48, seed: int = 0) -> Path:
    """Write ``count`` noisy grey images, each with a bright disc and a dark square, and
    their masks (0 background, 1 disc, 2 square) as 8-bit PNGs under ``path``; a pure
    function of its arguments. Returns ``path``."""
    from PIL import Image  # Pillow: pip install -e .[images]

    root = Path(path)
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "masks").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size]
    for i in range(count):
        mask = np.zeros((size, size), np.uint8)
        cy, cx = rng.integers(size // 4, 3 * size // 4, 2)
        mask[(yy - cy) ** 2 + (xx - cx) ** 2 <= (size // 6) ** 2] = 1
        y0, x0 = rng.integers(0, size - size // 4, 2)
        mask[y0 : y0 + size // 4, x0 : x0 + size // 4] = 2
        image = np.choose(mask, [110, 200, 30]) + rng.normal(0, 25, (size, size))
        name = f"sample{{i:03d}}.png"
        Image.fromarray(image.clip(0, 255).astype(np.uint8)).save(root / "images" / name)
        Image.fromarray(mask).save(root / "masks" / name)
    return root


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "data/{name}")
    if target.exists():
        sys.exit(f"{{target}} exists; nothing was written (give another folder).")
    print(f"wrote {{example_folder(target)}}/images and masks/ (64 pairs)")
''',
    "src/{name}/tasks.py": '''"""{name}'s task: the template's segmentation task (cross-entropy + soft Dice per image;
Dice and IoU per image from exact counts, per class by name). Change the loss here
(docs/extending.md, "A task"): keep it a sum over the micro-batch's samples."""

from repro.components.tasks import Segmentation


class Task(Segmentation):
    """Cross-entropy and soft Dice, weighted by the YAML's keys (conf/task/{name}.yaml)."""

    def loss(self, outputs, targets):
        return super().loss(outputs, targets)
''',
    "conf/model/{name}.yaml": """# {name}'s model (src/{name}/models.py): `python train.py model={name}`.
_target_: {name}.models.Net
width: 16
""",
    "conf/data/{name}.yaml": """# {name}'s data: a folder of images/ and masks/ (src/{name}/data.py; every key:
# conf/data/image_mask_folder.yaml). An example folder: python -m {name}.data data/{name}
defaults:
  - image_mask_folder
  - _self_

path: ${{paths.data_dir}}/{name}
num_classes: 3
class_names: [background, disc, square]   # metrics by name: val_dice_disc
image_size: 48        # the side the training pipeline gives the model
channels: 1           # grayscale
limit: null           # N: at most N files of each split (a quick run on a large folder)
""",
    "conf/task/{name}.yaml": """# {name}'s task (src/{name}/tasks.py): `python train.py task={name}`.
defaults:
  - segmentation
  - _self_

_target_: {name}.tasks.Task
cross_entropy_weight: 1.0
dice_weight: 1.0
""",
    "conf/experiment/{name}.yaml": """# @package _global_
# {name} in one word: `python train.py experiment={name}`. A preset selects its groups' YAMLs
# (it sets no model keys, so `experiment={name} model=other` works) and the run's size;
# overrides after it still apply. The augmentation moves each mask with its image.
defaults:
  - override /model: {name}
  - override /data: {name}
  - override /task: {name}
  - override /augment: segmentation
  - override /optim: adamw

trainer:
  max_steps: 300
  batch_size: 16
  micro_batch_size: 8      # 2 micro-batches a step: 1 or 2 processes give the same bits
  eval_every: 100
""",
    "tests/test_{name}.py": '''"""The template's promise for the {name} experiment: the same bits twice, with loader
workers, after a kill and resume, and over two processes (written by `repro new {name}
--task segmentation`), on an example mask folder written here.

Keep it as the experiment grows: the day a new layer or augmentation breaks determinism, CI
says so. SMALL shrinks the run (a few seconds each), not what is checked; runs are compared
with each other, never with a digest written down (another CPU gives other bits)."""

import pytest

from optional import require
from repro.tools.testing import assert_same_bits, train, train_killed

pytestmark = pytest.mark.e2e  # starts train.py: `make test`, not `make test-fast`
require("PIL", "the mask folder is read with Pillow: pip install -e .[images]")  # else: skip

EXPERIMENT = ["experiment={name}"]
# On the CPU, on every machine (2 processes need no 2 GPUs); on a GPU, `repro doctor
# experiment={name}` checks the model's kernels there. data.limit keeps a few files of each
# split: point data.path at your own folder to check the promise on it.
SMALL = [
    "device=cpu",
    "trainer.max_steps=8",
    "trainer.eval_every=4",
    "trainer.checkpoint_every=3",
    "trainer.batch_size=8",
    "trainer.micro_batch_size=4",
    "data.image_size=32",
    "data.limit=16",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """An example folder (src/{name}/data.py) as the runs' data.path."""
    from {name}.data import example_folder

    return [f"data.path={{example_folder(tmp_path_factory.mktemp('{name}_data'), count=24)}}"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data):
    """The run everything is compared with: one process, loading in the main process."""
    run_dir = tmp_path_factory.mktemp("{name}") / "reference"
    return train(run_dir, *EXPERIMENT, *data, *SMALL, "loader=single")


def test_{name}_repeats_bit_for_bit(reference, data, tmp_path):
    again = train(tmp_path / "again", *EXPERIMENT, *data, *SMALL, "loader=single")
    assert_same_bits(reference, again)


def test_{name}_gives_the_same_bits_with_loader_workers(reference, data, tmp_path):
    workers = ["loader=multi", "loader.num_workers=2"]
    assert_same_bits(reference, train(tmp_path / "workers", *EXPERIMENT, *data, *SMALL, *workers))


def test_{name}_killed_and_resumed_gives_the_uninterrupted_bits(reference, data, tmp_path):
    run_dir = tmp_path / "killed"
    train_killed(run_dir, *EXPERIMENT, *data, *SMALL, "loader=single", after=5)
    resumed = train(run_dir, *EXPERIMENT, *data, *SMALL, "loader=single", "trainer.resume=auto")
    assert resumed.summary["resumes"][-1]["step"] == 3  # from the step-3 checkpoint
    assert_same_bits(reference, resumed)


def test_{name}_on_two_processes_gives_the_one_process_bits(reference, data, tmp_path):
    two = train(tmp_path / "two", *EXPERIMENT, *data, *SMALL, "loader=single", nproc=2)
    assert_same_bits(reference, two)
''',
}

# `repro new NAME --task T`: each task's files.
TASKS = {"classification": CLASSIFICATION, "segmentation": SEGMENTATION}
FILES = CLASSIFICATION  # the default task's

# Words YAML reads as null or a boolean: `override /model: on` would not name the file on.yaml.
YAML_WORDS = {"null", "none", "true", "false", "yes", "no", "on", "off", "y", "n"}


def check_name(name: str, root: Path) -> None:
    """A new project's name: a lowercase Python identifier that does not shadow a module
    (``torch``, ``repro``, a module of the standard library on any system, a module beside
    ``train.py`` in the checkout), that Hydra's command line and YAML read back as itself
    (``nan`` and ``inf`` are floats there, ``null`` and ``on`` are not names), and whose
    files the filesystem can name."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or keyword.iskeyword(name) or name in YAML_WORDS:
        raise ReproError(
            f"{name!r} is not a valid project name; use a lowercase Python identifier "
            "(letters, digits, _), e.g. mylab."
        )
    read = _read_by_hydra(name)
    if read != name:
        raise ReproError(
            f"{name!r} is not a valid project name: Hydra reads experiment={name} as "
            f"{read!r} ({type(read).__name__}), not the name; choose another, e.g. my{name}."
        )
    longest = len(f"test_{name}.py".encode())  # its longest file name, tests/test_NAME.py
    limit = _name_max(root)
    if longest > limit:
        raise ReproError(
            f"a project name of {len(name)} characters is too long: this filesystem names "
            f"files of at most {limit} bytes, and tests/test_NAME.py adds 8; choose a shorter one."
        )
    if name in sys.stdlib_module_names:  # winreg too, which only Windows can import
        raise ReproError(
            f"{name!r} is a module of Python's standard library; choose another name, or "
            f"`import {name}` would find that one instead of yours."
        )
    beside = [p for p in (root / f"{name}.py", root / name / "__init__.py") if p.is_file()]
    if beside:  # `python train.py` puts the checkout's folder first on the path
        raise ReproError(
            f"{beside[0]} is what `import {name}` finds when train.py runs, not src/{name}/; "
            "choose another name."
        )
    own = (root / "src" / name).exists()
    if not own and importlib.util.find_spec(name) is not None:
        raise ReproError(
            f"{name!r} is already an importable module here; choose another name, or "
            f"`import {name}` would find that one instead of yours."
        )


def _read_by_hydra(name: str) -> object:
    """What ``experiment=NAME`` on Hydra's command line gives as the value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_override(f"experiment={name}").value()


def _name_max(root: Path) -> int:
    """The longest file name (bytes) the filesystem of ``root`` allows (255 where unknown)."""
    try:
        return int(os.pathconf(root, "PC_NAME_MAX"))
    except (OSError, ValueError, AttributeError):
        return 255


def new_project(name: str, root: Path, task: str = "classification") -> list[Path]:
    """Write the project's files for ``task`` (:data:`TASKS`) under ``root`` (the checkout:
    ``conf/``, ``src/``, ``tests/``): all of them or, when any exists or one cannot be
    written, none (what this call created is removed; nothing that was there is touched).
    Returns the paths written."""
    if task not in TASKS:
        raise ReproError(f"--task {task!r} is invalid; allowed: {', '.join(TASKS)}.")
    check_name(name, root)
    for folder in ("conf", "src", "tests"):
        if not (root / folder).is_dir():
            raise ReproError(
                f"{root} has no {folder}/; run repro new from the template's checkout."
            )
    files = {
        root / path.format(name=name): text.format(name=name) for path, text in TASKS[task].items()
    }
    existing = [p for p in files if p.exists()]
    if existing:
        raise ReproError(
            f"{existing[0]} exists; nothing was written (choose another name, or move "
            "the files away)."
        )
    written: list[Path] = []
    made: list[Path] = []  # the folders this call created, outermost first
    path = root
    try:
        for path, text in files.items():
            missing = [p for p in (path.parent, *path.parent.parents) if not p.exists()]
            for folder in reversed(missing):
                folder.mkdir()
                made.append(folder)
            with open(path, "x") as f:  # never over a file that appeared meanwhile
                written.append(path)
                f.write(text)
    except OSError as err:
        path = Path(err.filename) if err.filename else path  # a folder it could not make
        for done in reversed(written):
            done.unlink(missing_ok=True)
        for folder in reversed(made):
            try:
                folder.rmdir()
            except OSError:
                pass  # something else was put there meanwhile: left as it is
        raise ReproError(
            f"{path}: cannot be written ({err.strerror or err}); nothing was written: make "
            f"{path.parent} writable (or move what is there away) and run repro new again."
        ) from None
    return written


# Dated records are named <what>-YYYY-MM-DD-<machine>...; a folder of them too.
_DATED = re.compile(r".*-\d{4}-\d{2}-\d{2}-.*")
_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)#\s]+)(#[^)]*)?\)")

REMOVED_MARK = "removed by `repro new --remove-examples`"
BENCHMARKS_INDEX = """# Measurements

Dated results of this project, each with the machine, the versions and the exact command
that produced it; `scripts/benchmark.py` and the other scripts write here. The template's
own records were removed by `repro new --remove-examples`: its docs quote their numbers.

| file | what |
|---|---|
"""


def remove_examples(root: Path) -> list[Path]:
    """Remove the template's dated benchmark records (``benchmarks/*-YYYY-MM-DD-*``) and
    start ``benchmarks/README.md`` afresh; links to them in the docs become plain text and
    their images go (so every link still resolves). Returns what was removed."""
    bench = root / "benchmarks"
    index = bench / "README.md"
    if index.is_file() and REMOVED_MARK in index.read_text():
        raise ReproError(
            "--remove-examples: the template's records were removed already; what benchmarks/ "
            "holds now is this project's own (nothing was removed)."
        )
    removed = (
        sorted(p for p in bench.glob("*") if _DATED.fullmatch(p.name)) if bench.is_dir() else []
    )
    for path in removed:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    if bench.is_dir():
        (bench / "README.md").write_text(BENCHMARKS_INDEX)
    gone = {p.resolve() for p in removed}
    docs = [root / "README.md", root / "tests" / "README.md", *sorted((root / "docs").glob("*.md"))]
    for doc in (d for d in docs if d.is_file()):
        text = doc.read_text()

        def unlink(m: re.Match, doc: Path = doc) -> str:
            target = (doc.parent / m.group(3)).resolve()
            if not any(target == g or g in target.parents for g in gone):
                return m.group(0)
            return "" if m.group(1) else m.group(2)  # an image goes; a link's text stays

        new = _LINK.sub(unlink, text)
        if new != text:
            doc.write_text(new)
    return removed
