"""Pretrained weights are part of the bits: the weights files a model's construction reads.

A zoo model built with pretrained weights (torchvision's ``weights=``, timm's
``pretrained=True``, smp's ``encoder_weights=``) reads them from a cache that is filled at run
time, so two runs of one config on machines whose caches hold different files start from
different weights. :func:`recording_weights` is put around the model's construction
(:func:`repro.engine.build.build_model`): every weights file read inside it is recorded, with its
SHA-256, for ``env.json``, the determinism report and the resume's comparison
(:func:`weights_mismatches`).

What it sees (read in torch 2.13's ``hub.py`` and ``serialization.py``, and measured):

- Python's ``open`` in read mode of a file with a weights suffix (:data:`WEIGHT_SUFFIXES`),
  seen through an audit hook (``sys.addaudithook``): ``torch.load`` of a path opens it so
  (``torch.serialization._open_file``), and ``torch.hub.load_state_dict_from_url``
  ``torch.load``-s ``<torch.hub.get_dir()>/checkpoints/<file>``; ``numpy.load`` too;
- safetensors' readers, whose file access is Rust and raises no audit event:
  ``safetensors.torch.load_file`` and ``load_model``, and ``safe_open`` (in ``safetensors`` and
  in ``safetensors.torch``, where ``load_file`` looks it up at each call) are wrapped for the
  context's duration and restored afterwards, when safetensors is installed;
- a download: a file written, renamed or linked into ``torch.hub.get_dir()`` or the Hugging
  Face cache under a weights name, by its final name (Hugging Face's blobs are named by
  their hash; their snapshot links carry the name).

What it cannot see: a reader in C or Rust other than safetensors' (h5py, say), and
``safe_open`` bound by ``from safetensors import safe_open`` before the context began. A file
gone by the end of the construction is not recorded: a failed open (a model probing for a
file) raises the same event.

The audit hook is installed once per process and records only while a context is open; it
records what any thread reads then (Hugging Face downloads in threads). Recording draws no
random number and changes no bit: it reads the files once more, to hash them.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.hub

# Names a weights file has (lower case): what an open in read mode records.
WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt", ".pkl", ".h5", ".npz")
# The key under which a run's environment (env.json, checkpoints) holds the record.
KEY = "pretrained_weights"
# safetensors' readers: (module, name, position of the file argument, its keyword)
SAFETENSORS_READERS = (
    ("safetensors", "safe_open", 0, "filename"),
    ("safetensors.torch", "safe_open", 0, "filename"),  # what load_file calls
    ("safetensors.torch", "load_file", 0, "filename"),
    ("safetensors.torch", "load_model", 1, "filename"),
)
_WRITING = os.O_CREAT | os.O_TRUNC | os.O_APPEND
_ACCESS = getattr(os, "O_ACCMODE", 3)  # O_RDONLY | O_WRONLY | O_RDWR


class _Recording:
    """What one open context has seen: paths read, downloads (written, renamed or linked into
    a download folder), by absolute path in the order seen."""

    def __init__(self, download_dirs: list[str]) -> None:
        self.download_dirs = download_dirs
        self.read: dict[str, None] = {}
        self.downloaded: dict[str, None] = {}
        self.lock = threading.Lock()

    def note_read(self, path: Any) -> None:
        name = _absolute(path)
        if name is not None:
            with self.lock:
                self.read.setdefault(name)

    def note_written(self, path: Any, old: Any = None) -> None:
        """``path`` written (or ``old`` renamed to it): a download when it lands in a download
        folder under a weights name."""
        name = _absolute(path)
        if name is None:
            return
        with self.lock:
            if old is not None:
                self.downloaded.pop(_absolute(old) or "", None)
            if _is_weights_name(name) and any(_inside(name, d) for d in self.download_dirs):
                self.downloaded.setdefault(name)

    def files(self) -> list[dict[str, Any]]:
        """``[{path, sha256, bytes}]`` of what was read or downloaded and still exists, one entry
        a file (a download and its read, a link and its target, are one), sorted by path."""
        seen, out = set(), []
        for name in [*self.read, *self.downloaded]:
            try:
                real = os.path.realpath(name)
                if real in seen or not os.path.isfile(real):
                    continue
                seen.add(real)
                digest, size = file_sha256(name)
            except OSError:  # gone or unreadable since: a failed open looks the same
                continue
            out.append({"path": name, "sha256": digest, "bytes": size})
        return sorted(out, key=lambda f: (f["path"], f["sha256"]))  # not the order threads read


_ACTIVE: list[_Recording] = []  # the open contexts, innermost last
_HOOKED = False
_WRAPPED: list[tuple[Any, str, Any]] = []  # (module, name, original) of safetensors' readers
_SETUP = threading.Lock()
_DIGESTS: dict[tuple[str, int, int, int], str] = {}  # (path, inode, size, mtime_ns) -> SHA-256


@contextmanager
def recording_weights() -> Iterator[list[dict[str, Any]]]:
    """Inside: the weights files read (and downloaded) are recorded; on leaving, the list it
    gives is filled with ``{"path", "sha256", "bytes"}`` for each, in the order first seen
    (empty when none). Nested contexts each record what is read inside them."""
    global _HOOKED
    files: list[dict[str, Any]] = []
    recording = _Recording(download_dirs())
    with _SETUP:
        if not _HOOKED:
            sys.addaudithook(_audit)  # cannot be removed: it does nothing while none is open
            _HOOKED = True
        if not _ACTIVE:  # the first open context wraps safetensors, the last one unwraps
            _WRAPPED[:] = _wrap_safetensors()
        _ACTIVE.append(recording)
    try:
        yield files
    finally:
        with _SETUP:
            _ACTIVE.remove(recording)
            if not _ACTIVE:
                for module, name, original in reversed(_WRAPPED):
                    setattr(module, name, original)
                _WRAPPED.clear()
        files.extend(recording.files())


def download_dirs() -> list[str]:
    """Where zoo downloads land: ``torch.hub.get_dir()`` (torchvision, older timm) and the
    Hugging Face hub cache (timm, smp >= 0.5): ``huggingface_hub``'s own setting when it is
    imported, else as it computes it from ``HF_HUB_CACHE``, ``HF_HOME`` and
    ``XDG_CACHE_HOME``."""
    dirs = [torch.hub.get_dir()]
    constants = sys.modules.get("huggingface_hub.constants")
    hf = getattr(constants, "HF_HUB_CACHE", None)
    if hf is None:
        home = os.environ.get("HF_HOME") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface"
        )
        hf = os.environ.get("HF_HUB_CACHE") or os.path.join(home, "hub")
    dirs.append(str(hf))
    return [os.path.abspath(os.path.expanduser(d)) for d in dirs]


def file_sha256(path: str | Path) -> tuple[str, int]:
    """``(SHA-256, size in bytes)`` of a file, hashed in chunks; cached in this process by
    (path, inode, size, modification time), so a file read by every build is hashed once."""
    stat = os.stat(path)
    key = (os.path.realpath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        with open(path, "rb") as f:
            _DIGESTS[key] = hashlib.file_digest(f, "sha256").hexdigest()
    return _DIGESTS[key], stat.st_size


def weights_mismatches(recorded: Any, now: Any) -> list[str]:
    """One line for each weights file whose SHA-256 differs between a checkpoint's record
    (``recorded``) and this run's (``now``), paired by file name; a file on one side only is
    a difference too. The same digests under other paths (another cache folder) are equal.
    Either side unrecorded (None: written before the record existed, or by a tool that
    builds no model) is unknown: no difference."""
    if not isinstance(recorded, list) or not isinstance(now, list):
        return []
    if sorted(f.get("sha256") or "" for f in recorded) == sorted(
        f.get("sha256") or "" for f in now
    ):
        return []
    old, new = _by_name(recorded), _by_name(now)
    out = []
    for name in sorted(old.keys() | new.keys()):
        a, b = old.get(name, []), new.get(name, [])
        if sorted(f.get("sha256") or "" for f in a) == sorted(f.get("sha256") or "" for f in b):
            continue
        out.append(
            f"environment.{KEY} {name}: {_listed(a)} (checkpoint) vs {_listed(b)} (now) (put "
            "the checkpoint's file, by its SHA-256, in place to resume with its bits)"
        )
    return out


def report_row(files: list[dict[str, Any]]) -> tuple[str, str]:
    """The determinism report's value and note for the weights files a model's construction
    read."""
    if not files:
        return "none", "the model's construction read no weights file"
    names = ", ".join(Path(f["path"]).name for f in files)
    digests = "; ".join(f"{f['path']} sha256 {f['sha256'][:16]}" for f in files)
    return names, f"part of the bits: {digests} (env.json: {KEY})"


def _by_name(files: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for f in files:
        out.setdefault(Path(str(f.get("path", "?"))).name, []).append(f)
    return out


def _listed(files: list[dict[str, Any]]) -> str:
    if not files:
        return "none"
    return ", ".join(f"{f.get('path')} sha256 {f.get('sha256')}" for f in files)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    """The audit hook: cheap when no context is open. What it raises would abort the
    operation it audits, so it raises nothing."""
    if not _ACTIVE:
        return
    try:
        if event == "open":
            path, _, flags = args
            if not isinstance(path, (str, bytes)):
                return  # a file descriptor
            writing = (flags & _ACCESS) != os.O_RDONLY or flags & _WRITING
            for recording in list(_ACTIVE):
                if writing:
                    recording.note_written(path)
                elif _is_weights_name(os.fsdecode(path)):
                    recording.note_read(path)
        elif event == "os.rename":  # os.rename and os.replace (shutil.move)
            src, dst, src_fd, dst_fd = args
            if src_fd in (None, -1) and dst_fd in (None, -1):
                for recording in list(_ACTIVE):
                    recording.note_written(dst, old=src)
        elif event == "os.symlink":  # a Hugging Face snapshot's named link to its blob
            _, dst, dir_fd = args
            if dir_fd in (None, -1):
                for recording in list(_ACTIVE):
                    recording.note_written(dst)
    except Exception:
        pass


def _wrap_safetensors() -> list[tuple[Any, str, Any]]:
    """Wrap safetensors' readers (those of :data:`SAFETENSORS_READERS` the installed version
    has) so that they record the file they are given; ``(module, name, original)`` for each,
    to put back. Nothing when safetensors is not installed."""
    try:
        if "safetensors" not in sys.modules and importlib.util.find_spec("safetensors") is None:
            return []
        modules = {m: importlib.import_module(m) for m in {m for m, *_ in SAFETENSORS_READERS}}
    except Exception:  # not installed, or broken: nothing it could read
        return []
    wrapped = []
    for module_name, name, position, keyword in SAFETENSORS_READERS:
        module = modules[module_name]
        original = getattr(module, name, None)
        if original is None:
            continue
        setattr(module, name, _recording_reader(original, position, keyword))
        wrapped.append((module, name, original))
    return wrapped


def _recording_reader(reader: Callable[..., Any], position: int, keyword: str) -> Any:
    @functools.wraps(reader, updated=())  # safe_open is a class: not its namespace
    def reading(*args: Any, **kwargs: Any) -> Any:
        path = args[position] if len(args) > position else kwargs.get(keyword)
        for recording in list(_ACTIVE):
            recording.note_read(path)
        return reader(*args, **kwargs)

    return reading


def _absolute(path: Any) -> str | None:
    try:
        return os.path.abspath(os.fsdecode(os.fspath(path)))
    except TypeError:
        return None


def _is_weights_name(path: str) -> bool:
    return path.lower().endswith(WEIGHT_SUFFIXES)


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)
