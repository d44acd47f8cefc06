"""Intensity, bit depth and channels: images read at their depth (16-bit PNG, TIFF, .npy,
any number of channels), mapped by data.intensity when read, and float32 through the
shipped transforms, the loader and a training run (repro.components.data.intensity, repro.components.data.folders)."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch

from conftest import train_here
from optional import require
from repro.base.errors import ConfigError, DataError
from repro.components.data import (
    CenterResize,
    CropFlip,
    Intensity,
    KeyedPipeline,
    RandomResizedCrop,
    Resize,
    SegmentationAugment,
    image_folder,
    image_mask_folder,
    read_image,
    read_mask,
)
from repro.components.data.splits import stack_images

Image = require("PIL.Image")
tifffile = require("tifffile")


def twelve_bit(shape, seed=0):
    """12-bit values (0 .. 4095, both ends present) as uint16."""
    a = np.random.default_rng(seed).integers(0, 4096, shape).astype(np.uint16)
    a.flat[0], a.flat[1] = 0, 4095
    return a


def class_folders(root, images):
    """``root/a``, ``root/b``: the images (name -> array), saved by their suffix, alternately."""
    for i, (name, array) in enumerate(sorted(images.items())):
        folder = root / "ab"[i % 2]
        folder.mkdir(parents=True, exist_ok=True)
        save(folder / name, array)
    return root


def save(path, array):
    if path.suffix == ".npy":
        np.save(path, array)
    elif path.suffix == ".tif":  # C×H×W: a page a channel
        tifffile.imwrite(path, array, photometric="minisblack")
    else:
        Image.fromarray(array).save(path)


def fetched(d, split="train"):
    """Every image of a split, by file name, as the split's fetch gives it."""
    s = getattr(d, split)
    images, _ = s.fetch(torch.arange(len(s)))
    return {p.name: image for p, image in zip(s.files, images, strict=True)}


# ---------------------------------------------------------------- reading at depth


def test_a_12_bit_image_in_a_16_bit_png_is_read_at_its_depth(tmp_path):
    pixels = {f"{i}.png": twelve_bit((12, 10), seed=i) for i in range(4)}
    root = class_folders(tmp_path / "d", pixels)
    raw = read_image(root / "a" / "0.png", channels=1)
    assert raw.dtype == torch.uint16 and np.array_equal(raw[0].numpy(), pixels["0.png"])
    assert (read_image(root / "a" / "0.png", channels=3).numpy() == pixels["0.png"]).all()
    auto = fetched(image_folder(str(root), val_fraction=0.5, channels=1))
    fixed = image_folder(
        str(root), val_fraction=0.5, channels=1, intensity={"mode": "fixed", "range": [0, 4095]}
    )
    for name, image in auto.items():
        a = pixels[name].astype(np.float64)
        assert image.dtype == torch.float32 and image.shape == (1, 12, 10)
        assert torch.equal(image[0], torch.from_numpy((a / 65535).astype(np.float32)))
        assert float(image.max()) == np.float32(4095 / 65535)  # nothing clipped (was: 255)
    for name, image in fetched(fixed).items():  # exactly x / 4095, as float32 computes it
        x = torch.from_numpy(pixels[name].astype(np.float32))
        assert torch.equal(image[0], x / 4095)
    # a big-endian .npy is read by value, in native order
    np.save(tmp_path / "big.npy", pixels["0.png"].astype(">u2"))
    assert np.array_equal(read_image(tmp_path / "big.npy", 1)[0].numpy(), pixels["0.png"])


def test_a_16_bit_colour_png_is_refused_not_read_as_8_bits(tmp_path):
    a = twelve_bit((6, 5, 3)).astype(">u2")  # Pillow reads RGB;16B as 8 bits a channel
    raw = b"".join(b"\0" + row.tobytes() for row in a)

    def chunk(kind, data):
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", 5, 6, 16, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw))
    (tmp_path / "rgb48.png").write_bytes(png + chunk(b"IEND", b""))
    with pytest.raises(DataError, match=r"rgb48.png has 16 bits a channel .* TIFF or .npy"):
        read_image(tmp_path / "rgb48.png")


def test_multi_page_and_channels_last_tiff_and_npy_with_2_and_4_channels(tmp_path):
    for c in (2, 4):
        chw = twelve_bit((c, 9, 7), seed=c)
        hwc = np.ascontiguousarray(chw.transpose(1, 2, 0))
        tifffile.imwrite(tmp_path / f"pages{c}.tif", chw, photometric="minisblack")  # c pages
        tifffile.imwrite(
            tmp_path / f"last{c}.tif", hwc, photometric="minisblack", planarconfig="contig"
        )
        np.save(tmp_path / f"last{c}.npy", hwc)
        np.save(tmp_path / f"first{c}.npy", chw)
        names = [f"pages{c}.tif", f"last{c}.tif", f"last{c}.npy", f"first{c}.npy"]
        if c == 4:  # one page, the channels as planes of samples (tifffile's axes: SYX)
            tifffile.imwrite(
                tmp_path / "planes.tif", chw, photometric="rgb", planarconfig="separate"
            )
            names.append("planes.tif")
        with tifffile.TiffFile(tmp_path / f"pages{c}.tif") as tif:
            assert len(tif.pages) == c
        for name in names:
            image = read_image(tmp_path / name, channels=c)
            assert image.dtype == torch.uint16 and np.array_equal(image.numpy(), chw), name
    floats = np.random.default_rng(1).normal(size=(2, 9, 7)).astype(np.float32)
    tifffile.imwrite(tmp_path / "float.tif", floats)
    assert np.array_equal(read_image(tmp_path / "float.tif", 2).numpy(), floats)
    mapped, _ = Intensity()(read_image(tmp_path / "float.tif", 2), "float.tif")
    assert torch.equal(mapped, torch.from_numpy(floats))  # float32 as it is under auto


def test_a_channel_mismatch_is_one_line_naming_the_file(tmp_path):
    np.save(tmp_path / "four.npy", twelve_bit((9, 7, 4)))
    tifffile.imwrite(tmp_path / "three.tif", twelve_bit((3, 9, 7)), photometric="rgb")
    Image.fromarray(np.zeros((5, 5, 3), np.uint8)).save(tmp_path / "rgb.png")
    Image.fromarray(np.zeros((5, 5), np.uint8)).save(tmp_path / "gray.png")
    for name, channels, message in [
        ("four.npy", 2, r"four.npy has shape \(9, 7, 4\), with neither .* data.channels=2"),
        ("three.tif", 4, r"three.tif \(shape \(3, 9, 7\), axes SYX\) has 3 channel\(s\) but "),
        ("rgb.png", 2, r"rgb.png .* has 3 channel\(s\) but data.channels=2; set data.channels=3"),
        ("gray.png", 0, "data.channels=0 is invalid; allowed: an integer >= 1"),
    ]:
        with pytest.raises(DataError, match=message) as err:
            read_image(tmp_path / name, channels=channels)
        assert "\n" not in str(err.value)
    assert read_image(tmp_path / "gray.png", channels=3).shape == (3, 5, 5)  # replicated


def test_an_8_bit_image_under_default_settings_is_todays_uint8(tmp_path):
    g = np.random.default_rng(3)
    rgb = g.integers(0, 256, (11, 13, 3), dtype=np.uint8)
    gray = g.integers(0, 256, (11, 13), dtype=np.uint8)
    root = tmp_path / "d"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    Image.fromarray(rgb).save(root / "a" / "rgb.png")
    Image.fromarray(rgb).save(root / "a" / "rgb.jpg")
    Image.fromarray(rgb).save(root / "a" / "rgb.tif")
    Image.fromarray(rgb).convert("RGBA").save(root / "b" / "rgba.png")
    Image.fromarray(rgb).convert("P").save(root / "b" / "palette.png")
    Image.fromarray(gray).save(root / "b" / "gray.png")
    Image.fromarray(gray).save(root / "b" / "gray.tif")
    for channels, mode in ((3, "RGB"), (1, "L")):
        d = image_folder(str(root), val_fraction=0.2, channels=channels, in_memory=True)
        lazy = image_folder(str(root), val_fraction=0.2, channels=channels)
        images = {**fetched(lazy), **fetched(lazy, "val")}
        assert len(images) == 7
        for path in sorted(root.rglob("*.*")):
            with Image.open(path) as im:  # today's reader: Pillow's conversion, as bytes
                today = torch.from_numpy(np.array(im.convert(mode))).view(11, 13, channels)
            today = today.permute(2, 0, 1)
            assert images[path.name].dtype == torch.uint8, path.name
            assert torch.equal(images[path.name], today), path.name
            assert Intensity()(images[path.name], path)[0] is images[path.name]  # untouched
        assert {a.dtype for a in d.train.images} == {torch.uint8}


# ---------------------------------------------------------------- the modes


def test_a_value_outside_a_fixed_range_is_refused_naming_the_file(tmp_path):
    root = class_folders(tmp_path / "d", {f"{i}.png": twelve_bit((6, 5), i) for i in range(4)})
    d = image_folder(
        str(root), val_fraction=0.5, channels=1, intensity={"mode": "fixed", "range": [0, 1000]}
    )
    with pytest.raises(DataError) as err:
        d.train.fetch(torch.tensor([0]))
    message = str(err.value)
    assert str(d.train.files[0]) in message and "holds the value 4095" in message
    assert "data.intensity.range=[0, 1000]" in message and "\n" not in message


@pytest.mark.parametrize(
    "settings, key",
    [
        ({"mode": "fixed"}, "data.intensity.mode=fixed needs data.intensity.range"),
        ({"mode": "fixed", "range": [5, 5]}, r"data.intensity.range=\[5, 5\] is invalid"),
        ({"mode": "clamp"}, "data.intensity.mode='clamp' is invalid"),
        ({"mode": "percentile", "percentiles": [99, 1]}, "data.intensity.percentiles="),
        ({"mode": "zscore", "clip": -1}, "data.intensity.clip=-1 is invalid"),
        ({"range": [0, 4095]}, "data.intensity.range is set but data.intensity.mode=auto"),
        ({"mode": "zscore", "percentiles": [1, 99]}, "data.intensity.percentiles is set but"),
        ({"mode": "auto", "gain": 2}, "data.intensity.gain is not a setting"),
    ],
)
def test_bad_intensity_settings_are_one_line_naming_the_key(settings, key):
    with pytest.raises(ConfigError, match=key) as err:
        Intensity(settings)
    assert "\n" not in str(err.value)


def mask_folder(root, images, masks):
    """``root/images/<stem>`` and ``root/masks/<stem>``: the arrays, saved by suffix."""
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    for name, array in images.items():
        save(root / "images" / name, array)
    for name, array in masks.items():
        save(root / "masks" / name, array)
    return root


def percentile_map(x, low, high):
    """The percentile mapping and clipped count, per channel, in NumPy (float64)."""
    out, clipped = [], 0
    for xc in x.astype(np.float64):
        lo, hi = np.percentile(xc, [low, high])
        clipped += int(((xc < lo) | (xc > hi)).sum())
        out.append(np.clip((xc - lo) / (hi - lo), 0, 1))
    return np.stack(out).astype(np.float32), clipped


def zscore_map(x, clip):
    out, clipped = [], 0
    for xc in x.astype(np.float64):
        z = (xc - xc.mean()) / xc.std()
        clipped += int((np.abs(z) > clip).sum())
        out.append(np.clip(z, -clip, clip))
    return np.stack(out).astype(np.float32), clipped


@pytest.mark.parametrize(
    "settings, reference",
    [
        ({"mode": "percentile", "percentiles": [2.0, 98.0]}, lambda x: percentile_map(x, 2, 98)),
        ({"mode": "zscore", "clip": 1.5}, lambda x: zscore_map(x, 1.5)),
    ],
    ids=["percentile", "zscore"],
)
def test_percentile_and_zscore_map_each_image_and_channel_and_record_the_clipped_fraction(
    tmp_path, settings, reference
):
    g = np.random.default_rng(5)
    arrays = {f"{i:02d}.npy": twelve_bit((9, 11, 2), seed=i) for i in range(10)}
    arrays["10.npy"] = g.normal(100, 30, (2, 9, 11))  # float64, channels first
    masks = {f"{i:02d}.npy": g.integers(0, 3, (9, 11)).astype(np.uint8) for i in range(11)}
    root = mask_folder(tmp_path / "d", arrays, masks)
    d = image_mask_folder(
        str(root), num_classes=3, val_fraction=0.3, channels=2, intensity=settings
    )
    images, _ = d.train.fetch(torch.arange(len(d.train)))
    clipped = values = 0
    for path, image in zip(d.train.images, images, strict=True):
        x = np.load(path)
        x = x if x.shape[0] == 2 else x.transpose(2, 0, 1)
        expected, n = reference(x)
        assert image.dtype == torch.float32 and torch.equal(image, torch.from_numpy(expected))
        clipped, values = clipped + n, values + x.size
    assert 0 < clipped < values
    assert d.intensity is None  # recorded with the normalisation, from its sample
    d.with_augmentation(KeyedPipeline(Resize(8), 0), KeyedPipeline(Resize(8), 0))
    assert d.intensity == {
        **{k: v for k, v in settings.items()},
        "clipped_fraction": clipped / values,
        "sample_images": len(d.train),
    }


# ---------------------------------------------------------------- masks


def test_a_16_bit_tiff_mask_is_read_mapped_and_checked(tmp_path):
    labels = np.zeros((9, 7), np.uint16)
    labels[2:5, 1:4], labels[6:, 3:] = 1000, 2
    tifffile.imwrite(tmp_path / "m.tif", labels)
    mask = read_mask(tmp_path / "m.tif", 3, {1000: 1})
    assert mask.dtype == torch.uint8 and torch.equal(
        mask, torch.from_numpy(np.where(labels == 1000, 1, labels).astype(np.uint8))
    )
    with pytest.raises(DataError, match="m.tif holds class 1000, not below data.num_classes=3"):
        read_mask(tmp_path / "m.tif", 3)
    with pytest.raises(DataError, match=r"m.tif is 7×9 but its image .*x.png is 8×9; a mask"):
        read_mask(tmp_path / "m.tif", 3, {1000: 1}, (tmp_path / "x.png", (8, 9)))
    tifffile.imwrite(tmp_path / "f.tif", labels.astype(np.float32))
    with pytest.raises(DataError, match="f.tif holds float32 values; masks must hold integer"):
        read_mask(tmp_path / "f.tif", 3)
    np.save(tmp_path / "n.npy", labels.astype(np.int32) - 1)
    with pytest.raises(DataError, match="n.npy holds the value -1, not a class"):
        read_mask(tmp_path / "n.npy", 3, {999: 1})
    # the folder finds masks/<stem>.tif, and refuses two masks of one stem
    image = twelve_bit((9, 7))
    root = mask_folder(
        tmp_path / "d",
        {"a.png": image, "b.tif": image},
        {"a.tif": labels, "b.npy": labels.astype(np.int64)},
    )
    d = image_mask_folder(
        str(root), num_classes=3, val_fraction=0.5, channels=1, mask_map={1000: 1}
    )
    for split in (d.train, d.val):
        _, masks = split.fetch(torch.tensor([0]))
        assert torch.equal(masks[0], mask)
    save(root / "masks" / "a.png", labels.astype(np.uint8))
    with pytest.raises(DataError, match=r"masks/a.png and masks/a.tif are two masks of one stem"):
        image_mask_folder(str(root), num_classes=3, channels=1)


# ---------------------------------------------------------------- downstream: float32


def float_sample():
    """A 2-channel float32 image from 12-bit data (auto: / 65535) and a 3-class mask."""
    x = twelve_bit((2, 21, 27), seed=7)
    image, _ = Intensity()(torch.from_numpy(x), "x.npy")
    mask = torch.from_numpy(np.random.default_rng(7).integers(0, 3, (21, 27)).astype(np.uint8))
    return image, mask


@pytest.mark.parametrize(
    "transform",
    [CropFlip(16), Resize(16), SegmentationAugment(16), RandomResizedCrop(16), CenterResize(16)],
    ids=lambda t: type(t).__name__,
)
def test_the_shipped_transforms_take_float32_and_are_keyed(transform):
    image, mask = float_sample()
    pipeline = KeyedPipeline(transform, seed=11)
    out, out_mask = pipeline(image, mask, 0, 3)
    assert out.dtype == torch.float32 and out.shape == (2, 16, 16) and out_mask.shape == (16, 16)
    again = pipeline(image.clone(), mask.clone(), 0, 3)
    assert torch.equal(again[0], out) and torch.equal(again[1], out_mask)
    if type(transform) not in (Resize, CenterResize):  # the random ones
        other = [pipeline(image, mask, e, i)[0] for e, i in ((0, 4), (1, 3))]
        assert not any(torch.equal(o, out) for o in other)  # another key, another draw
    if isinstance(transform, SegmentationAugment):  # neither rounded nor clamped to 0..255
        assert not torch.equal(out, out.round()) and float(out.max()) < 2
        u8 = pipeline((image * 255).round().to(torch.uint8), mask, 0, 3)[0]
        assert u8.dtype == torch.uint8  # the 8-bit path keeps its dtype too


def test_a_pipeline_must_return_the_dtype_it_got():
    image, mask = float_sample()
    to_bytes = KeyedPipeline(lambda im, t: ((im * 255).to(torch.uint8), t), seed=0)
    with pytest.raises(DataError, match="turned a torch.float32 image into a torch.uint8 one"):
        to_bytes(image, mask, 0, 0)


def test_8_bit_beside_deeper_images_under_auto_is_one_line():
    """auto scales 8-bit by 255 and 16-bit by 65535: one batch of both would give the same
    intensity two values (and on CUDA, casting 8-bit on the host would not be the device's
    division): refused, naming the rule that maps them alike."""
    g = torch.Generator().manual_seed(0)
    u8 = torch.randint(0, 256, (4, 1, 5, 6), dtype=torch.uint8, generator=g)
    deep = torch.rand(4, 1, 5, 6, generator=g)
    with pytest.raises(DataError, match="data.intensity.mode=fixed"):
        stack_images([u8[0], deep[1], u8[2], deep[3]])
    assert torch.equal(stack_images(list(u8)), u8)  # one dtype: as torch.stack gives it
    assert torch.equal(stack_images(list(deep)), deep)


def test_torchvision_v2_recipes_run_on_float32_inputs():
    v2 = require("torchvision.transforms.v2", "make add PKG=torchvision")
    image, mask = float_sample()
    image = torch.cat([image, image[:1]])  # 3 channels: v2's ColorJitter takes 1 or 3
    recipe = v2.Compose(
        [
            v2.RandomResizedCrop(16, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.ColorJitter(brightness=0.2, contrast=0.2),
            v2.RandomRotation(10),
        ]
    )
    pipeline = KeyedPipeline(lambda im, t: (recipe(im), t), seed=1)
    out = pipeline(image, 0, 0, 2)[0]
    assert out.dtype == torch.float32 and out.shape == (3, 16, 16)
    assert torch.equal(pipeline(image, 0, 0, 2)[0], out)


# ---------------------------------------------------------------- a run, bit for bit


def test_a_4_channel_16_bit_mask_folder_trains_to_the_same_bits_with_loader_workers(tmp_path):
    g = np.random.default_rng(9)
    images, masks = {}, {}
    for i in range(20):
        labels = g.integers(0, 3, (24, 24)).astype(np.uint16)
        x = twelve_bit((4, 24, 24), seed=i) // 2 + labels.astype(np.uint16)[None] * 1200
        if i % 2:
            images[f"{i:02d}.tif"] = x  # multi-page: a page a channel
        else:
            images[f"{i:02d}.npy"] = np.ascontiguousarray(x.transpose(1, 2, 0))  # H×W×C
        masks[f"{i:02d}.tif"] = labels
    root = mask_folder(tmp_path / "d", images, masks)
    args = [
        "experiment=segmentation",
        "augment=segmentation",
        "data=image_mask_folder",
        f"data.path={root}",
        "data.num_classes=3",
        "data.channels=4",
        "data.intensity.mode=percentile",
        "data.image_size=16",
        "data.val_fraction=0.2",
        "model.width=8",
        "model.depth=2",
        "trainer.batch_size=8",
        "trainer.micro_batch_size=4",
        "trainer.eval_batch_size=8",
        "trainer.max_steps=3",
        "trainer.eval_every=3",
        "trainer.checkpoint_every=3",
        "trainer.log_every=1",
    ]
    single = train_here(tmp_path / "single", *args, "loader=single")
    multi = train_here(tmp_path / "multi", *args, "loader=multi", "loader.num_workers=2")
    assert single.summary["weights_sha256"] == multi.summary["weights_sha256"]
    assert single.losses == multi.losses and len(single.losses) == 3
    record = single.summary["intensity"]
    assert record == multi.summary["intensity"]
    assert record["mode"] == "percentile" and record["percentiles"] == [0.5, 99.5]
    assert 0 < record["clipped_fraction"] < 0.05 and record["sample_images"] >= 10
    assert "data.intensity percentile" in single.output
