"""CIFAR-10 from its extracted archive, read without torchvision and without running pickled
code."""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from repro.base.errors import DataError
from repro.components.data.splits import DataSplits, TensorImages

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"  # published with the archive
CIFAR10_DIR = "cifar-10-batches-py"


def cifar10(
    root: str = "data/cifar10",
    download: bool = True,
    url: str = CIFAR10_URL,
) -> DataSplits:
    """CIFAR-10 from the standard extracted ``cifar-10-batches-py`` folder under ``root``:
    the five ``data_batch_*`` files train, ``test_batch`` validates. Read without
    torchvision, by an unpickler that builds plain NumPy arrays and nothing else
    (:func:`read_cifar_batch`): a file that would run code is refused. With ``download`` and
    no folder there, the archive is fetched from ``url``, checked against its published MD5
    and extracted (only regular files and folders)."""
    folder = Path(root).expanduser() / CIFAR10_DIR
    if not folder.is_dir():
        if not download:
            raise DataError(
                f"data=cifar10: no {CIFAR10_DIR} folder in data.root={root!r}; place the "
                "extracted archive there, or set data.download=true."
            )
        fetch_cifar10(Path(root).expanduser(), url)

    def load(names: list[str]) -> TensorImages:
        parts = [read_cifar_batch(folder / name) for name in names]
        images = torch.cat([p[0] for p in parts]).view(-1, 3, 32, 32)
        return TensorImages(images, torch.cat([p[1] for p in parts]))

    return DataSplits(
        load([f"data_batch_{i}" for i in range(1, 6)]),
        load(["test_batch"]),
        10,
        mean=(0.4914, 0.4822, 0.4465),
        std=(0.2470, 0.2435, 0.2616),
        image_size=32,
    )


class _RefusedGlobal(pickle.UnpicklingError):
    """A pickle names a global outside :class:`_PlainArrays`' list (truncated data raises
    the base class instead)."""


class _PlainArrays(pickle.Unpickler):
    """Builds what a CIFAR-10 batch holds -- a dict of lists, strings and NumPy arrays --
    and refuses every other global a pickle may name (the way pickled code runs)."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # how protocol 2 stores bytes
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise _RefusedGlobal(f"refused global {module}.{name}")
        return super().find_class(module, name)


def read_cifar_batch(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 N×3072 images, int64 labels) of one CIFAR-10 batch file; one line naming the
    file when it is missing, damaged or would run code."""
    try:
        with open(path, "rb") as f:
            batch = _PlainArrays(f, encoding="bytes").load()
        data, labels = batch[b"data"], batch[b"labels"]
        images = torch.from_numpy(np.asarray(data, dtype=np.uint8).reshape(-1, 3072).copy())
        targets = torch.tensor(list(labels), dtype=torch.int64)
    except _RefusedGlobal as err:
        raise DataError(
            f"data=cifar10: {path} was refused ({err}): it is not a plain CIFAR-10 batch "
            "and loading it could run code; replace it with the official archive's."
        ) from None
    except (OSError, EOFError, KeyError, TypeError, ValueError, pickle.UnpicklingError) as err:
        raise DataError(
            f"data=cifar10: cannot read {path} ({type(err).__name__}: {err}); extract the "
            "official archive there again."
        ) from None
    if len(images) != len(targets) or not targets.numel() or int(targets.max()) > 9:
        raise DataError(f"data=cifar10: {path} is not a CIFAR-10 batch (images and labels).")
    return images, targets


def fetch_cifar10(root: Path, url: str) -> None:
    """Download the archive into ``root``, check its MD5, extract the batches folder."""
    root.mkdir(parents=True, exist_ok=True)
    # everything in a private folder beside the destination, renamed into place at the end:
    # parallel jobs downloading at once never see each other's half-written files
    work = Path(tempfile.mkdtemp(prefix=".cifar10-", dir=root))
    try:
        _download_and_extract(url, work)
        try:
            os.rename(work / CIFAR10_DIR, root / CIFAR10_DIR)
        except OSError:
            if not (root / CIFAR10_DIR).is_dir():  # another job's rename won: use its copy
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _download_and_extract(url: str, work: Path) -> None:
    import hashlib
    import tarfile
    import urllib.request

    archive = work / Path(url).name
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(archive, "wb") as out:
            shutil.copyfileobj(response, out)
    except OSError as err:
        raise DataError(
            f"data=cifar10: could not download {url} ({err}); check the network, or place "
            f"the extracted {CIFAR10_DIR} folder in data.root."
        ) from None
    digest = hashlib.md5(archive.read_bytes()).hexdigest()
    if digest != CIFAR10_MD5:
        raise DataError(
            f"data=cifar10: {url} gave a file whose MD5 is {digest}, not the published "
            f"{CIFAR10_MD5}; it was deleted. Download the archive yourself."
        )
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.11.4 and later
            tar.extractall(work, filter="data")  # no links out, devices or absolute paths
        else:
            for member in tar.getmembers():
                parts = Path(member.name).parts
                if (
                    not (member.isfile() or member.isdir())
                    or member.name.startswith("/")
                    or ".." in parts
                ):
                    raise DataError(f"data=cifar10: {url} holds {member.name!r}; not extracted.")
            tar.extractall(work)
