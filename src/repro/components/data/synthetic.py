"""The embedded datasets, generated from ``data.seed`` (not the training seed): a learnable
classification set (:func:`synthetic`) and a segmentation set of shapes
(:func:`synthetic_shapes`)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from repro.base.errors import DataError
from repro.base.rng import keyed_generator
from repro.components.data.splits import DataSplits, TensorImages


def synthetic(
    seed: int = 1234,
    num_classes: int = 10,
    train_size: int = 4096,
    val_size: int = 1024,
    image_size: int = 32,
    noise: float = 0.35,
    test_size: int = 0,
) -> DataSplits:
    """A learnable image-classification set generated from ``seed`` (the *data* seed), with
    a test split of ``test_size`` samples when it is not 0 (generated from its own keyed
    stream: the training and validation samples do not depend on it).

    Class c is an oriented sinusoidal grating (angle and frequency set by c) tinted with a
    class colour; every sample gets a random phase, contrast, slight rotation and Gaussian
    noise, so the task needs a few hundred SGD steps, not one.
    """
    if num_classes < 2 or train_size < 1 or val_size < 1 or image_size < 8 or test_size < 0:
        raise DataError(
            "data: synthetic needs num_classes >= 2, train_size/val_size >= 1, "
            "test_size >= 0 and image_size >= 8; fix the data.* values."
        )
    palette = torch.rand(num_classes, 3, generator=keyed_generator(seed, "synthetic-palette"))
    palette = 0.35 + 0.65 * palette

    def make(split: str, n: int) -> TensorImages:
        g = keyed_generator(seed, "synthetic-" + split)
        labels = torch.arange(n) % num_classes
        labels = labels[torch.randperm(n, generator=g)]
        angle = math.pi * labels / num_classes + 0.15 * torch.randn(n, generator=g)
        freq = 1.5 + (labels % 4).to(torch.float32) * 0.9
        phase = 2 * math.pi * torch.rand(n, generator=g)
        contrast = 0.5 + 0.5 * torch.rand(n, generator=g)
        coords = torch.linspace(-0.5, 0.5, image_size)
        yy, xx = torch.meshgrid(coords, coords, indexing="ij")
        proj = (
            xx[None] * torch.cos(angle)[:, None, None] + yy[None] * torch.sin(angle)[:, None, None]
        )
        wave = torch.sin(2 * math.pi * freq[:, None, None] * proj + phase[:, None, None])
        img = (
            0.5
            + 0.45
            * contrast[:, None, None, None]
            * wave[:, None]
            * palette[labels][:, :, None, None]
        )
        img = img + noise * torch.randn(n, 3, image_size, image_size, generator=g)
        images = (img.clamp(0, 1) * 255).round().to(torch.uint8)
        return TensorImages(images, labels)

    test = make("test", test_size) if test_size else None
    return DataSplits(
        make("train", train_size),
        make("val", val_size),
        num_classes,
        test=test,
        image_size=image_size,
    )


SHAPES = ("disc", "square", "triangle", "ring", "cross")


def _shape_masks(kind: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, r: torch.Tensor):
    """Which pixels each sample's shape covers: ``kind`` (N, an index into :data:`SHAPES`),
    pixel offsets from the centre ``dy``/``dx`` (N×H×W) and radius ``r`` (N×1×1)."""
    dist = (dy**2 + dx**2).sqrt()
    ay, ax = dy.abs(), dx.abs()
    covers = torch.stack(
        [
            dist <= r,  # disc
            torch.maximum(ay, ax) <= 0.85 * r,  # square
            (dy >= -r) & (dy <= r) & (ax <= (dy + r) / 2),  # triangle, apex up
            (dist <= r) & (dist >= 0.55 * r),  # ring
            ((ax <= r / 3) & (ay <= r)) | ((ay <= r / 3) & (ax <= r)),  # cross
        ]
    )
    return covers[kind, torch.arange(len(kind))]


def synthetic_shapes(
    seed: int = 1234,
    num_classes: int = 4,
    train_size: int = 1024,
    val_size: int = 256,
    image_size: int = 64,
    max_shapes: int = 3,
    noise: float = 0.2,
    test_size: int = 0,
) -> DataSplits:
    """A learnable segmentation set generated from ``seed`` (the *data* seed), with a test
    split of ``test_size`` samples when it is not 0 (its own keyed stream): class 0 is the
    background, classes 1 .. num_classes-1 are shapes (disc, square, triangle, ring, cross).

    Each image holds 1 to ``max_shapes`` shapes of random class, place and size, later ones
    in front, on a shaded background with Gaussian noise; a shape's colour leans to its class
    but varies, so the model must learn the outline too. The mask is the per-pixel class."""
    if not 2 <= num_classes <= len(SHAPES) + 1 or min(train_size, val_size) < 1 or test_size < 0:
        raise DataError(
            f"data: synthetic_shapes needs 2 <= num_classes <= {len(SHAPES) + 1} and "
            "train_size/val_size >= 1, test_size >= 0; fix the data.* values."
        )
    if image_size < 16 or max_shapes < 1:
        raise DataError("data: synthetic_shapes needs image_size >= 16 and max_shapes >= 1.")
    # each channel of a class colour is dark or bright, never the background's mid-grey
    bright = torch.rand(num_classes, 3, generator=keyed_generator(seed, "palette")) < 0.5
    palette = 0.15 + 0.7 * bright.float()

    def make(split: str, n: int) -> TensorImages:
        g = keyed_generator(seed, "synthetic-shapes-" + split)
        coords = torch.arange(image_size, dtype=torch.float32) + 0.5
        yy, xx = coords.view(1, -1, 1), coords.view(1, 1, -1)
        tilt = torch.rand(n, 3, 2, generator=g) - 0.5  # a shaded background
        img = (
            0.5
            + 0.2 * (torch.rand(n, 3, 1, 1, generator=g) - 0.5)
            + 0.3 * (tilt[..., 0, None, None] * yy + tilt[..., 1, None, None] * xx) / image_size
        ).expand(n, 3, image_size, image_size)
        mask = torch.zeros(n, image_size, image_size, dtype=torch.uint8)
        count = torch.randint(1, max_shapes + 1, (n,), generator=g)
        for slot in range(max_shapes):
            cls = torch.randint(1, num_classes, (n,), generator=g)
            centre = (0.15 + 0.7 * torch.rand(n, 2, generator=g)) * image_size
            r = (0.09 + 0.13 * torch.rand(n, generator=g)).view(n, 1, 1) * image_size
            colour = (palette[cls] + 0.6 * (torch.rand(n, 3, generator=g) - 0.5)).clamp(0, 1)
            dy = yy - centre[:, 0, None, None]
            dx = xx - centre[:, 1, None, None]
            covered = _shape_masks(cls - 1, dy, dx, r) & (slot < count).view(n, 1, 1)
            img = torch.where(covered[:, None], colour[:, :, None, None], img)
            mask = torch.where(covered, cls.to(torch.uint8).view(n, 1, 1), mask)
        img = img + noise * torch.randn(n, 3, image_size, image_size, generator=g)
        return TensorImages((img.clamp(0, 1) * 255).round().to(torch.uint8), mask)

    test = make("test", test_size) if test_size else None
    return DataSplits(
        make("train", train_size),
        make("val", val_size),
        num_classes,
        test=test,
        image_size=image_size,
        class_names=("background", *SHAPES[: num_classes - 1]),
    )


def write_shapes_folder(
    path: str | Path, count: int = 24, image_size: int = 32, num_classes: int = 4, seed: int = 9
) -> DataSplits:
    """Write ``count`` samples of the embedded shapes (:func:`synthetic_shapes`, generated
    from ``seed`` at ``image_size``) as a folder that
    :func:`repro.components.data.image_mask_folder` reads: RGB PNGs ``images/NNN.png`` and
    their class masks ``masks/NNN.png``. Returns the data they were drawn from (its training
    split holds them, in file order). An existing ``images/`` or ``masks/`` is an error:
    nothing is overwritten."""
    from repro.components.data.folders import _pillow

    Image = _pillow()
    data = synthetic_shapes(
        seed=seed, num_classes=num_classes, train_size=count, val_size=1, image_size=image_size
    )
    root = Path(path)
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    for i in range(count):
        image = data.train.images[i].permute(1, 2, 0).numpy()
        Image.fromarray(image).save(root / "images" / f"{i:03d}.png")
        Image.fromarray(data.train.labels[i].numpy(), mode="L").save(
            root / "masks" / f"{i:03d}.png"
        )
    return data


NUCLEI_CLASSES = ("background", "nucleus", "boundary")


def write_nuclei_folder(
    path: str | Path,
    count: int = 40,
    seed: int = 0,
    sizes: tuple[int, int] = (150, 260),
    bits: int = 12,
) -> list[Path]:
    """Write a microscopy-like segmentation folder that :func:`repro.components.data.image_mask_folder`
    reads: ``count`` grayscale images of their own non-square sizes (sides in ``sizes``),
    ``bits``-bit intensities stored as 16-bit PNGs (``images/cell_NNN.png``), and their masks
    (``masks/cell_NNN.png``): 0 background, 1 nucleus, 2 its 2-pixel boundary
    (:data:`NUCLEI_CLASSES`), 255 (not scored) in a corner block of every fourth image.
    Generated from ``seed``; returns the image files. Nothing is overwritten: an existing
    file is an error."""
    from repro.components.data.folders import _pillow

    Image = _pillow()
    root = Path(path)
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "masks").mkdir(parents=True, exist_ok=True)
    top = 2**bits - 1
    written = []
    for i in range(count):
        g = keyed_generator(seed, "nuclei", i)
        h, w = (int(v) for v in torch.randint(sizes[0], sizes[1] + 1, (2,), generator=g))
        w += int(h == w)  # never square
        yy = torch.arange(h, dtype=torch.float32).view(-1, 1) + 0.5
        xx = torch.arange(w, dtype=torch.float32).view(1, -1) + 0.5
        level = 0.06 + 0.04 * float(torch.rand((), generator=g))
        image = torch.full((h, w), level * top) + 0.02 * top * (yy / h - xx / w)
        mask = torch.zeros(h, w, dtype=torch.uint8)
        for _ in range(int(torch.randint(3, 10, (), generator=g))):
            cy, cx = float(torch.rand((), generator=g)) * h, float(torch.rand((), generator=g)) * w
            ry, rx = (6 + 12 * torch.rand(2, generator=g)).tolist()
            angle = math.pi * float(torch.rand((), generator=g))
            dy, dx = yy - cy, xx - cx
            u = dy * math.cos(angle) + dx * math.sin(angle)
            v = -dy * math.sin(angle) + dx * math.cos(angle)
            inside = (u / ry) ** 2 + (v / rx) ** 2 <= 1
            core = (u / (ry - 2)) ** 2 + (v / (rx - 2)) ** 2 <= 1
            bright = (0.35 + 0.45 * float(torch.rand((), generator=g))) * top
            image = torch.where(core, bright, image)
            image = torch.where(inside & ~core, bright * 1.25, image)
            mask = torch.where(core, 1, torch.where(inside, 2, mask)).to(torch.uint8)
        image = image + 0.015 * top * torch.randn(h, w, generator=g)
        if i % 4 == 3:
            mask[:12, :12] = 255
        pixels = image.round().clamp(0, top).to(torch.int32).numpy().astype("uint16")
        for folder, array in (("images", pixels), ("masks", mask.numpy())):
            target = root / folder / f"cell_{i:03d}.png"
            if target.exists():
                raise DataError(f"{target} exists; write the folder somewhere new.")
            Image.fromarray(array).save(target)
        written.append(root / "images" / f"cell_{i:03d}.png")
    return written
