"""Data: datasets, keyed augmentation, the resumable keyed sampler and the loaders.

Layer 3 of the defense. The sampler yields micro-batches of *keys* ``(epoch, index)``, not
bare indices; each sample's augmentation draws are a pure function of ``(seed, "augment",
epoch, index)``. Which worker loads a sample, how many workers there are, and whether the
batch is cut on the host or on the GPU cannot change them.

=====================  ===============================================================
``splits``             :class:`DataSplits` (what a dataset returns), in-memory splits
``synthetic``          the embedded datasets (classification, segmentation shapes)
``folders``            your images from disk: a folder per class, images with masks
``splitting``          each folder file's split or fold: a keyed hash of its name
``intensity``          how a folder image's values become the model's input (data.intensity)
``cifar``              CIFAR-10 from its archive, without running pickled code
``augment``            keyed augmentation
``sample_settings``    what per-sample work runs under in any process: one thread, the run's flags
``loading``            the keyed sampler, the micro-batches, the loaders
=====================  ===============================================================

A dataset is any function that returns :class:`DataSplits`; a config selects it with
``_target_`` (``conf/data/``). Images are ``C×H×W``, uint8 (8-bit files under
``data.intensity`` auto: divided by 255 on the device) or float32 (mapped when read,
:class:`Intensity`); they are normalised on the device (:class:`DeviceNormalizer`).
Targets are class indices, or per-pixel class masks ``H×W``
that the augmentation moves with their image.
"""

from repro.components.data.augment import (
    CROP_PAD,
    CenterResize,
    Compose,
    CropFlip,
    KeyedPipeline,
    RandomResizedCrop,
    Resize,
    SegmentationAugment,
    TorchvisionMasks,
    albumentations,
    crop_flip_batch,
    keyed_crop_flip_params,
)
from repro.components.data.cifar import (
    CIFAR10_DIR,
    CIFAR10_MD5,
    CIFAR10_URL,
    cifar10,
    fetch_cifar10,
    read_cifar_batch,
)
from repro.components.data.folders import (
    BAD_FILE_ERRNOS,
    BAD_IMAGE_CHOICES,
    IMAGE_SUFFIXES,
    LazyImageMasks,
    LazyImages,
    image_folder,
    image_mask_folder,
    read_image,
    read_image_sized,
    read_mask,
)
from repro.components.data.intensity import Intensity
from repro.components.data.loading import (
    DeviceBatches,
    DeviceNormalizer,
    InProcessBatches,
    KeyedBatches,
    KeyedBatchSampler,
    loading,
    make_train_loader,
    on_device,
)
from repro.components.data.sample_settings import SAMPLE_THREADS, SampleSettings
from repro.components.data.splits import (
    IGNORE,
    STATISTICS_SAMPLE,
    Augmented,
    DataSplits,
    ImageList,
    Split,
    TensorImages,
    channel_statistics,
    statistics_sample,
)
from repro.components.data.splitting import assign_splits, keyed_unit
from repro.components.data.synthetic import SHAPES, synthetic, synthetic_shapes

__all__ = [
    "BAD_FILE_ERRNOS",
    "BAD_IMAGE_CHOICES",
    "CIFAR10_DIR",
    "CIFAR10_MD5",
    "CIFAR10_URL",
    "SHAPES",
    "fetch_cifar10",
    "CROP_PAD",
    "Augmented",
    "CenterResize",
    "Compose",
    "CropFlip",
    "ImageList",
    "KeyedPipeline",
    "RandomResizedCrop",
    "Resize",
    "SegmentationAugment",
    "TorchvisionMasks",
    "albumentations",
    "assign_splits",
    "IGNORE",
    "IMAGE_SUFFIXES",
    "Intensity",
    "SAMPLE_THREADS",
    "STATISTICS_SAMPLE",
    "SampleSettings",
    "DataSplits",
    "DeviceBatches",
    "DeviceNormalizer",
    "InProcessBatches",
    "KeyedBatchSampler",
    "KeyedBatches",
    "LazyImageMasks",
    "LazyImages",
    "Split",
    "TensorImages",
    "channel_statistics",
    "cifar10",
    "crop_flip_batch",
    "image_folder",
    "image_mask_folder",
    "keyed_crop_flip_params",
    "keyed_unit",
    "loading",
    "make_train_loader",
    "on_device",
    "read_cifar_batch",
    "read_image",
    "read_image_sized",
    "read_mask",
    "statistics_sample",
    "synthetic",
    "synthetic_shapes",
]
