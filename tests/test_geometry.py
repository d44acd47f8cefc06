"""Geometry (DESIGN.md principle 7 and "Augmentation"): every shipped geometric transform
puts a mask on its image's sampling grid -- centre-aligned, nearest for the mask -- measured
as a user sees it: a bright disc in a non-square image, the disc's own mask, and where the
two land after the transform (the mask's centroid against the image's intensity centroid).

The old rule, top-left nearest (``floor(i·h/size)``, kept here as :func:`old_resize_mask`),
put each mask about half an output pixel down and right of its image; each centroid check
below also runs it and asserts that it fails the same bound, so each check can fail."""

import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

import repro.components.data.augment as augment
from optional import require
from repro.components.data import (
    IGNORE,
    CropFlip,
    KeyedPipeline,
    RandomResizedCrop,
    SegmentationAugment,
)
from repro.components.data.augment import CenterResize, Resize, _resized, resize_mask, source_pixels

MEAN_BOUND = 0.02  # output pixels: the mean signed offset, each axis
MAX_BOUND = 0.35  # output pixels: any one disc, each axis
SEED = 11


def old_resize_mask(mask: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """The rule ``resize_mask`` had: the source pixel at each output pixel's top-left corner."""
    h, w = mask.shape[-2:]
    rows = (torch.arange(size[0]) * h) // size[0]
    cols = (torch.arange(size[1]) * w) // size[1]
    return mask[rows[:, None], cols[None, :]]


def discs(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, int, tuple[float, float]]]:
    """``n`` images of 150-260 × 150-260 pixels (height and width drawn apart), each a bright
    disc (radius 25-55, at least 20 pixels clear of the border) on a dark background, 1 or 3
    channels, background 0 or 40: (image, mask, background, centroid); the mask is 1 inside
    the disc (pixel centre within the radius), 0 outside, the image 200 there, and the
    centroid is the mask's (row, column), in pixels of the native image."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        h, w = torch.randint(150, 261, (2,), generator=g).tolist()
        u = torch.rand(3, generator=g, dtype=torch.float64).tolist()
        r = 25 + 30 * u[0]
        cy, cx = r + 20 + (h - 2 * r - 40) * u[1], r + 20 + (w - 2 * r - 40) * u[2]
        y = torch.arange(h, dtype=torch.float64)[:, None]
        x = torch.arange(w, dtype=torch.float64)[None, :]
        mask = ((y - cy) ** 2 + (x - cx) ** 2 <= r * r).to(torch.uint8)
        background = 40 * (k // 2 % 2)
        image = (mask * (200 - background) + background).expand(1 + 2 * (k % 2), h, w)
        rows, cols = torch.nonzero(mask, as_tuple=True)
        centroid = (rows.double().mean().item(), cols.double().mean().item())
        out.append((image.contiguous(), mask, background, centroid))
    return out


@pytest.fixture(scope="module")
def samples():
    return discs(120, SEED)


def centroids(images: list[torch.Tensor], masks: list[torch.Tensor], backgrounds: list[int]):
    """Each output's image centroid (intensity above its background, so that a constant
    background weighs nothing; darker pixels -- padding moved in from outside -- weigh
    nothing either) and mask centroid (its pixels of class 1), as N×2 (row, column). The
    weights are whole numbers and every partial sum of them stays below 2**24: float32 adds
    them exactly, in any order."""

    def centre(weights: list[torch.Tensor]) -> torch.Tensor:
        along_rows = torch.stack([m.sum(1) for m in weights]).double()
        along_cols = torch.stack([m.sum(0) for m in weights]).double()
        rows, cols = (torch.arange(n, dtype=torch.float64) for n in weights[0].shape)
        total = along_rows.sum(1)
        return torch.stack([along_rows @ rows / total, along_cols @ cols / total], 1)

    light = [
        (i.sum(0, dtype=torch.float32) - i.shape[0] * b).clamp(min=0)
        for i, b in zip(images, backgrounds, strict=True)
    ]
    return centre(light), centre([(m == 1).float() for m in masks])


def clear_of_edges(mask: torch.Tensor) -> bool:
    """Is the disc, and 2 pixels around it, inside the output and away from pixels moved in
    from outside (:data:`IGNORE`)? Only then do both centroids see the whole disc."""
    near = F.max_pool2d((mask == 1).float()[None, None], 5, stride=1, padding=2)[0, 0] > 0
    edge = near[0].any() or near[-1].any() or near[:, 0].any() or near[:, -1].any()
    return bool((mask == 1).any()) and not edge and not bool((near & (mask == IGNORE)).any())


def summary(offsets: torch.Tensor) -> tuple[list[float], list[float]]:
    return offsets.mean(0).tolist(), offsets.abs().max(0).values.tolist()


def aligned(offsets: torch.Tensor, worst: float = MAX_BOUND) -> bool:
    mean, most = summary(offsets)
    return max(abs(v) for v in mean) < MEAN_BOUND and max(most) < worst


@pytest.mark.parametrize("size", [(64, 64), (48, 80), (97, 61), (300, 280)])
def test_resize_puts_the_mask_on_its_images_grid(samples, size):
    """Resize (square) and ``_resized`` (any shape; the path every transform takes): the mask
    sits where its image does, within 0.02 output pixels on average and 0.35 for any disc,
    down- and upsampled; the old top-left rule is about half a pixel off. The image itself is
    where the native disc was (centre-aligned: native ``c`` lands at ``(c + ½)·size/n − ½``)."""
    images, new, old, expected = [], [], [], []
    for image, mask, _, (row, col) in samples:
        h, w = mask.shape
        if size[0] == size[1]:
            out_image, out_mask = Resize(size[0])(image, mask)
        else:
            out_image, out_mask = _resized(image, mask, size)
        images.append(out_image)
        new.append(out_mask)
        old.append(old_resize_mask(mask, size))
        expected.append([(row + 0.5) * size[0] / h - 0.5, (col + 0.5) * size[1] / w - 0.5])
    backgrounds = [b for _, _, b, _ in samples]
    at_image, at_new = centroids(images, new, backgrounds)
    _, at_old = centroids(images, old, backgrounds)
    assert aligned(at_new - at_image), (size, summary(at_new - at_image))
    old_mean, _ = summary(at_old - at_image)
    assert not aligned(at_old - at_image) and min(old_mean) > 0.4, (size, old_mean)
    truth = at_image - torch.tensor(expected, dtype=torch.float64)
    assert max(abs(v) for v in truth.mean(0).tolist()) < MEAN_BOUND, summary(truth)
    assert float(truth.abs().max()) < 0.1, summary(truth)


def segmentation_geometry(elastic: float = 0.0) -> SegmentationAugment:
    t = SegmentationAugment(64, elastic=elastic)
    t.brightness = t.contrast = 0.0  # only the geometry moves the image
    return t


# name: (the transform, the epochs each disc is drawn in, the bound for any one disc)
TRANSFORMS = {
    "crop_flip": (lambda: CropFlip(64), (0,), MAX_BOUND),
    "random_resized_crop": (lambda: RandomResizedCrop(64), (0, 1, 2), MAX_BOUND),  # imagenet
    "center_resize": (lambda: CenterResize(64), (0,), MAX_BOUND),  # imagenet's eval
    # The mask is resampled twice (resized, then moved: nearest of nearest) and a near-
    # identity move (angle ~0, zoom ~1.05) drops or doubles whole rows of a disc's edge at
    # once: the worst of these 233 discs is 0.41 px off (0.44 in 240 others), with no bias
    # (the mean is within bound). That the move samples the mask on the image's grid is
    # checked pixel by pixel below.
    "segmentation": (segmentation_geometry, (0, 1), 0.5),
    # and deformed elastically (up to 3 px): image and mask by one field, on one grid
    "segmentation_elastic": (lambda: segmentation_geometry(elastic=3.0), (0, 1), 0.5),
}


def through(transform, samples, epochs) -> tuple[torch.Tensor, int]:
    """Each disc through ``transform`` with its keyed draws of each epoch, as the loader
    calls it (:class:`KeyedPipeline`: ``key=``, or a ``generator=`` made from the key); the
    mask's offset from its image for the discs that stay whole, and how many did."""
    pipeline = KeyedPipeline(transform, seed=SEED)
    images, masks, backgrounds = [], [], []
    for epoch in epochs:
        for index, (image, mask, background, _) in enumerate(samples):
            out_image, out_mask = pipeline(image, mask, epoch, index)
            if clear_of_edges(out_mask):
                images.append(out_image)
                masks.append(out_mask)
                backgrounds.append(background)
    at_image, at_mask = centroids(images, masks, backgrounds)
    return at_mask - at_image, len(masks)


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_each_geometric_transform_keeps_the_mask_on_its_images_grid(samples, name, monkeypatch):
    """CropFlip (resize, pad, crop, flip), RandomResizedCrop, CenterResize and the
    segmentation geometry (affine_grid + grid_sample: bilinear image, nearest mask, one
    grid), each with its keyed draws: the mask within the bounds of its image; with the old
    top-left resize inside them, not (half a pixel down; right too, where nothing flips)."""
    make, epochs, worst = TRANSFORMS[name]
    offsets, whole = through(make(), samples, epochs)
    assert whole >= 75, whole  # enough discs stay whole for the mean to mean something
    assert aligned(offsets, worst), (name, whole, summary(offsets))
    monkeypatch.setattr(augment, "resize_mask", old_resize_mask)
    offsets, whole = through(make(), samples, epochs[:1])
    assert not aligned(offsets, worst) and summary(offsets)[0][0] > 0.4, (name, summary(offsets))


def test_the_segmentation_move_samples_mask_and_image_on_one_grid_pixel_by_pixel():
    """The exact check behind the segmentation centroids: a 64×64 image (no resize) that
    holds its own coordinates (4·row, 4·column: bilinear interpolation of a ramp is the
    sampled coordinate itself, to ⅛ pixel after uint8 rounding) and masks that hold them too
    (row, column): wherever all the image's bilinear neighbours came from inside, the mask's
    source pixel is the one nearest to where the image sampled -- within ½ + ⅛ pixel --
    under 40 keyed draws (rotation, zoom, shift, flip)."""
    n = 64
    rows = torch.arange(n)[:, None].expand(n, n)
    cols = rows.t()
    image = torch.stack([4 * rows, 4 * cols, torch.full_like(rows, 200)]).to(torch.uint8)
    pipeline = KeyedPipeline(segmentation_geometry(), seed=SEED)
    checked = 0
    for index in range(40):
        moved, mask_rows = pipeline(image, rows.to(torch.uint8), 0, index)
        _, mask_cols = pipeline(image, cols.to(torch.uint8), 0, index)
        # the third channel is 200 only where no neighbour was padding; and around that too
        outside = (moved[2] != 200).float()[None, None]
        inside = F.max_pool2d(outside, 3, stride=1, padding=1)[0, 0] == 0
        for mask, channel in ((mask_rows, 0), (mask_cols, 1)):
            assert not bool((mask[inside] == IGNORE).any()), index
            gap = (mask.double() - moved[channel].double() / 4)[inside]
            assert float(gap.abs().max()) <= 0.5 + 0.125 + 1e-9, (
                index,
                channel,
                float(gap.abs().max()),
            )
        checked += int(inside.sum())
    assert checked > 40 * n * n // 2, checked


def test_source_pixels_is_the_exact_centre_rule_off_ties_and_alternates_on_them():
    """``source_pixels`` is ``floor((i + ½)·n/size)`` in exact arithmetic, down and up, and
    PyTorch's ``nearest-exact`` (float32), except where ``(i + ½)·n/size`` is a whole number
    (an output centre exactly between two source pixels: every pixel of a 2× reduction):
    there it takes the pixel before for even ``i`` and the one after for odd ``i``."""
    pairs = [(n, s) for n in (150, 173, 192, 256, 260, 26, 7) for s in (11, 48, 61, 64, 97, 300)]
    for n, s in pairs + [(128, 64), (256, 64), (96, 48)]:
        i = torch.arange(s)
        exact = torch.tensor([math.floor((k + Fraction(1, 2)) * n / s) for k in range(s)])
        tie = (((2 * i + 1) * n) % (2 * s) == 0) & (exact > 0)
        expected = torch.where(tie & (i % 2 == 0), exact - 1, exact)
        assert torch.equal(source_pixels(n, s), expected), (n, s)
        torch_rule = F.interpolate(
            torch.arange(n, dtype=torch.float32)[None, None, :, None],
            size=(s, 1),
            mode="nearest-exact",
        )[0, 0, :, 0].long()
        assert not bool(((torch_rule != exact) & ~tie).any()), (n, s)
    assert source_pixels(128, 64)[:4].tolist() == [0, 3, 4, 7]  # 2×: alternating sides


def test_a_2x_reduction_leaves_no_shift_on_average():
    """At 2× every output centre is a tie: one fixed side would shift each mask a quarter
    of an output pixel; alternating sides leave the discs' mean offset under 0.02."""
    g = torch.Generator().manual_seed(5)
    offsets = []
    for _ in range(100):
        h, w = (
            2 * int(torch.randint(60, 120, (), generator=g)),
            2 * int(torch.randint(60, 120, (), generator=g)),
        )
        cy, cx = (
            float(v) for v in torch.rand(2, generator=g) * torch.tensor([h - 80, w - 80]) + 40
        )
        r = 15 + 20 * float(torch.rand((), generator=g))
        yy, xx = torch.meshgrid(torch.arange(h) + 0.5, torch.arange(w) + 0.5, indexing="ij")
        mask = ((yy - cy) ** 2 + (xx - cx) ** 2 <= r * r).to(torch.uint8)
        image = mask[None] * 200
        out_image, out_mask = _resized(image, mask, (h // 2, w // 2))
        at_image, at_mask = centroids([out_image], [out_mask], [0])
        offsets.append((at_mask - at_image)[0])
    mean, most = summary(torch.stack(offsets))
    assert max(abs(v) for v in mean) < MEAN_BOUND and max(most) < MAX_BOUND, (mean, most)

    mask = torch.randint(
        0, 4, (173, 211), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    under = [
        [math.floor((k + Fraction(1, 2)) * n / s) for k in range(s)]
        for n, s in ((173, 61), (211, 97))
    ]
    assert torch.equal(
        resize_mask(mask, (61, 97)), mask[torch.tensor(under[0])[:, None], torch.tensor(under[1])]
    )


def nuclei(n: int, seed: int) -> list[torch.Tensor]:
    """``n`` native masks of 150-260 × 150-260: 6 discs each (radius 8-16), class 1 inside,
    2 on a 2-pixel boundary ring, 0 around them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        h, w = torch.randint(150, 261, (2,), generator=g).tolist()
        y = torch.arange(h, dtype=torch.float64)[:, None]
        x = torch.arange(w, dtype=torch.float64)[None, :]
        mask = torch.zeros(h, w, dtype=torch.uint8)
        for _ in range(6):
            u = torch.rand(3, generator=g, dtype=torch.float64).tolist()
            r = 8 + 8 * u[0]
            d = ((y - r - (h - 2 * r) * u[1]) ** 2 + (x - r - (w - 2 * r) * u[2]) ** 2).sqrt()
            mask[d <= r] = 2
            mask[d <= r - 2] = 1
        out.append(mask)
    return out


def dice(pairs: list[tuple[torch.Tensor, torch.Tensor]], cls: int) -> float:
    both = sum(int(((a == cls) & (b == cls)).sum()) for a, b in pairs)
    each = sum(int((a == cls).sum() + (b == cls).sum()) for a, b in pairs)
    return 2 * both / each


def test_a_mask_taken_to_training_size_and_back_keeps_more_of_itself():
    """Native (non-square) -> 64×64 -> native, the way a prediction at training size goes
    back to the annotation's grid: centre-aligned both ways beats the old top-left rule (both
    ways, or down only) on every foreground class, the thin boundary ring included."""
    masks = nuclei(12, SEED)

    def round_trip(down, up):
        return [(m, up(down(m, (64, 64)), tuple(m.shape))) for m in masks]

    new = round_trip(resize_mask, resize_mask)
    old = round_trip(old_resize_mask, old_resize_mask)
    old_down = round_trip(old_resize_mask, resize_mask)
    for cls in (1, 2):
        assert dice(new, cls) > max(dice(old, cls), dice(old_down, cls)), (
            cls,
            dice(new, cls),
            dice(old, cls),
            dice(old_down, cls),
        )


# the shipped presets for the two libraries users bring: measured where they are usable
LIBRARY_PRESETS = {
    "torchvision_segmentation": "torchvision",
    "albumentations_segmentation": "albumentations",
}


def library_preset(preset: str, size: int = 64):
    """``augment=<preset>``'s training pipeline at ``size``, its colour step left out (it
    moves the intensity centroid, not the geometry)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from repro.defense.config import compose

    cfg = compose(["experiment=segmentation", f"augment={preset}", f"data.image_size={size}"])
    node = OmegaConf.to_container(cfg.augment.train, resolve=True)
    colour = ("ColorJitter", "RandomBrightnessContrast")
    node["transforms"] = [t for t in node["transforms"] if not t["_target_"].endswith(colour)]
    return instantiate(node, _convert_="all")


@pytest.mark.parametrize("preset", list(LIBRARY_PRESETS))
def test_the_library_presets_keep_the_mask_on_its_grid_and_pad_it_with_255(samples, preset):
    """augment=torchvision_segmentation and albumentations_segmentation, as docs/segmentation.md
    recommends them: resized with the mask on its image's grid and moved by an affine, the
    mask stays within the bounds of its image, and what the affine moves in is 255 (not
    scored), never a class."""
    require(LIBRARY_PRESETS[preset], f"make add PKG={LIBRARY_PRESETS[preset]}")
    offsets, whole = through(library_preset(preset), samples, (0, 1))
    assert whole >= 75, whole
    assert aligned(offsets, 0.5), (preset, whole, summary(offsets))
    # a mask of class 1 everywhere: after the affine, only 1 and (where moved in) 255
    pipeline = KeyedPipeline(library_preset(preset), seed=SEED)
    image, full = samples[0][0], torch.ones_like(samples[0][1])
    seen = set()
    for epoch in range(8):
        _, mask = pipeline(image, full, epoch, 0)
        seen |= set(mask.unique().tolist())
    assert seen == {1, IGNORE}, seen
