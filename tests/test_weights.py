"""Pretrained weights are part of the bits (repro.records.weights): every weights file a model's
construction reads is recorded with its SHA-256 -- in env.json, the determinism report and
checkpoints -- and a resume across other files is refused. In this process, with files in
tmp_path: nothing is downloaded."""

from __future__ import annotations

import hashlib
import io
import os
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import train_here
from optional import require
from repro.base.errors import CheckpointError
from repro.base.rng import derive_seed
from repro.components.data import synthetic
from repro.defense.config import compose
from repro.engine.build import build_model_and_weights, instantiate_target
from repro.records.checkpoint import checkpoint_path, load_checkpoint, mismatches
from repro.records.weights import KEY, recording_weights, report_row
from repro.tools.compare import RunRecords, context_differences


class LoadsWeights(nn.Module):
    """A model whose constructor reads its initial weights from a file, as a zoo model with
    pretrained weights does: ``reader`` ``torch`` (torch.load of the path) or ``safetensors``
    (safetensors.torch.load_file)."""

    def __init__(self, path: str, num_classes: int, reader: str = "torch") -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, num_classes)
        if reader == "torch":
            state = torch.load(path, weights_only=True)
        else:
            import safetensors.torch

            state = safetensors.torch.load_file(path)
        self.conv.load_state_dict(state)

    def forward(self, x):
        return self.head(self.conv(x).mean(dim=(2, 3)))


def conv_state(seed: int) -> dict[str, torch.Tensor]:
    """LoadsWeights' conv weights, made from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return {"weight": torch.randn(4, 3, 3, 3, generator=gen), "bias": torch.randn(4, generator=gen)}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def loads_weights(path: Path, reader: str = "torch") -> list[str]:
    return [
        "~model",
        "+model._target_=test_weights.LoadsWeights",
        f"+model.path={path}",
        f"+model.reader={reader}",
    ]


# Two steps of 16 samples, checkpointed after each
SMALL = ["device=cpu", "trainer.max_steps=2", "trainer.eval_every=2", "trainer.checkpoint_every=1"]
SMALL += ["data.train_size=64", "data.val_size=16", "trainer.batch_size=16"]
SMALL += ["trainer.micro_batch_size=16"]


def build(*overrides: str):
    cfg = compose([*SMALL, *overrides])
    return build_model_and_weights(cfg, synthetic(train_size=64, val_size=16), torch.device("cpu"))


def test_a_file_the_constructor_torch_loads_is_recorded_with_its_sha256(tmp_path):
    path = tmp_path / "encoder.pt"
    torch.save(conv_state(1), path)
    model, weights = build(*loads_weights(path))
    assert weights == [{"path": str(path), "sha256": sha256(path), "bytes": path.stat().st_size}]
    assert torch.equal(model.conv.weight, conv_state(1)["weight"])  # it did read them


def test_a_model_without_pretrained_weights_records_none_and_keeps_its_bits():
    """The default model: no file, and the initial weights are those of the keyed init
    without the recording around it (exact bits)."""
    cfg = compose(SMALL)
    data = synthetic(train_size=64, val_size=16)
    model, weights = build_model_and_weights(cfg, data, torch.device("cpu"))
    assert weights == [] and report_row(weights)[0] == "none"

    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(derive_seed(int(cfg.seed), "init"))
        plain = instantiate_target(
            cfg.model, "model", num_classes=data.num_classes, in_channels=data.in_channels
        )
    ours, theirs = model.state_dict(), plain.state_dict()
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_cached_torch_hub_file_is_recorded_where_torchvision_reads_it(tmp_path, monkeypatch):
    """torchvision's ``weights=`` reads through torch.hub.load_state_dict_from_url; a file
    already in <hub dir>/checkpoints is read as it is (no download: the URL is never
    opened)."""
    monkeypatch.setattr(torch.hub, "_hub_dir", str(tmp_path / "hub"))
    cached = tmp_path / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    cached.parent.mkdir(parents=True)
    torch.save(conv_state(2), cached)
    with recording_weights() as weights:
        state = torch.hub.load_state_dict_from_url("https://example.invalid/resnet18-f37072fd.pth")
    assert torch.equal(state["bias"], conv_state(2)["bias"])
    assert [(w["path"], w["sha256"]) for w in weights] == [(str(cached), sha256(cached))]


def test_downloads_into_the_caches_are_recorded_by_their_final_name(tmp_path, monkeypatch):
    """Written and renamed into the torch hub folder (torch.hub's .partial file), and a Hugging
    Face blob linked from its snapshot under a weights name: each recorded once, by the name
    a reader would open, though nothing read them here; the cache's other files are not."""
    monkeypatch.setattr(torch.hub, "_hub_dir", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.delitem(sys.modules, "huggingface_hub.constants", raising=False)
    hub = tmp_path / "hub" / "checkpoints"
    blobs, snapshot = tmp_path / "hf" / "m" / "blobs", tmp_path / "hf" / "m" / "snapshots" / "r"
    for folder in (hub, blobs, snapshot):
        folder.mkdir(parents=True)
    with recording_weights() as weights:
        (hub / "net.pth.1234.partial").write_bytes(b"torch hub")
        os.replace(hub / "net.pth.1234.partial", hub / "net.pth")
        (blobs / "0a1b.incomplete").write_bytes(b"hugging face")
        os.replace(blobs / "0a1b.incomplete", blobs / "0a1b")
        (snapshot / "model.safetensors").symlink_to(blobs / "0a1b")
        (snapshot / "config.json").write_text("{}")
    assert [(w["path"], w["sha256"]) for w in weights] == sorted(  # by path: a fixed order
        [
            (str(hub / "net.pth"), hashlib.sha256(b"torch hub").hexdigest()),
            (str(snapshot / "model.safetensors"), hashlib.sha256(b"hugging face").hexdigest()),
        ]
    )


def stub_safetensors() -> types.ModuleType:
    """A stand-in for safetensors whose reader raises no audit event Python's audit hook
    could see as a weights file (it reads a file of any name), as the real Rust reader:
    ``load_file`` calls ``safe_open`` through its module, as safetensors' does."""
    package = types.ModuleType("safetensors")
    module = types.ModuleType("safetensors.torch")

    def safe_open(filename, framework="pt", device="cpu"):
        return torch.load(io.BytesIO(Path(filename).read_bytes()), weights_only=True)

    def load_file(filename, device="cpu"):
        return module.safe_open(filename, framework="pt", device=device)

    def load_model(model, filename, strict=True, device="cpu"):
        return model.load_state_dict(load_file(filename, device), strict=strict)

    package.safe_open = module.safe_open = safe_open
    module.load_file, module.load_model = load_file, load_model
    package.torch = module
    return package


def test_safetensors_readers_are_recorded_then_restored(tmp_path, monkeypatch):
    """The stand-in's reader is invisible to the audit hook (a file name without a weights
    suffix): only the wrapped readers can record it, also a ``load_file`` bound before the
    context (through the ``safe_open`` it calls); afterwards the originals are back."""
    stub = stub_safetensors()
    monkeypatch.setitem(sys.modules, "safetensors", stub)
    monkeypatch.setitem(sys.modules, "safetensors.torch", stub.torch)
    originals = (stub.safe_open, stub.torch.load_file, stub.torch.load_model)
    early_bound = stub.torch.load_file  # as `from safetensors.torch import load_file` binds it
    path = tmp_path / "encoder.weights"
    torch.save(conv_state(3), path)
    with recording_weights() as weights:
        _, weights_seen = build(*loads_weights(path, reader="safetensors"))
        early_bound(str(path))
    assert weights_seen == [
        {"path": str(path), "sha256": sha256(path), "bytes": path.stat().st_size}
    ]
    assert weights == weights_seen
    assert (stub.safe_open, stub.torch.load_file, stub.torch.load_model) == originals
    with recording_weights() as unseen:  # the hook alone does not see such a file
        torch.load(io.BytesIO(path.read_bytes()), weights_only=True)
    assert unseen == []


def test_a_real_safetensors_file_is_recorded(tmp_path):
    require("safetensors", "an optional zoo dependency")
    import safetensors.torch as safetensors

    path = tmp_path / "model.safetensors"
    safetensors.save_file(conv_state(4), str(path))
    model, weights = build(*loads_weights(path, reader="safetensors"))
    assert [(w["path"], w["sha256"]) for w in weights] == [(str(path), sha256(path))]
    assert torch.equal(model.conv.bias, conv_state(4)["bias"])


def test_other_weights_refuse_a_resume_and_unrecorded_ones_do_not(tmp_path):
    """A run records the file in env.json, the determinism report and its checkpoints; a
    resume after the file changed is refused, naming it with both digests; a checkpoint
    written before the record existed (no entry) resumes."""
    path = tmp_path / "encoder.pt"
    torch.save(conv_state(5), path)
    args = [*SMALL, *loads_weights(path)]
    run = train_here(tmp_path / "run", *args)
    before = sha256(path)
    recorded = [{"path": str(path), "sha256": before, "bytes": path.stat().st_size}]
    assert run.env["environment"][KEY] == recorded
    row = run.entry("pretrained weights")
    assert row["layer"] == "1 CPU" and row["value"] == "encoder.pt" and before[:16] in row["note"]
    state = load_checkpoint(checkpoint_path(run.dir, 1))
    assert state["environment"][KEY] == recorded

    torch.save(conv_state(6), tmp_path / "other.pt")  # the cache now holds other weights
    os.replace(tmp_path / "other.pt", path)  # under the same name
    with pytest.raises(CheckpointError) as refused:
        train_here(tmp_path / "resumed", *args, f"trainer.resume={checkpoint_path(run.dir, 1)}")
    message = str(refused.value)
    assert f"{KEY} encoder.pt: {path} sha256 {before} (checkpoint)" in message
    assert f"vs {path} sha256 {sha256(path)} (now)" in message
    assert not (tmp_path / "resumed" / "trace.jsonl").exists()  # refused before writing

    now = {**state["environment"], KEY: [{**recorded[0], "sha256": sha256(path)}]}
    assert mismatches(state, state["config"], now, "cpu") != []
    old = {**state, "environment": {k: v for k, v in state["environment"].items() if k != KEY}}
    assert mismatches(old, state["config"], now, "cpu") == []  # unknown: not refused
    moved = {**now, KEY: [{**recorded[0], "path": "/elsewhere/encoder.pt"}]}
    assert mismatches(state, state["config"], moved, "cpu") == []  # same bytes elsewhere


def test_compare_lists_other_weights_among_the_environment(tmp_path):
    file = {"path": "/cache/encoder.pt", "sha256": "a" * 64, "bytes": 10}
    env = {"environment": {"torch": "2.13.0", KEY: [file]}, "config": {"seed": 0}}
    other = {**env, "environment": {"torch": "2.13.0", KEY: [{**file, "sha256": "b" * 64}]}}
    a, b = RunRecords(tmp_path / "a", [], env), RunRecords(tmp_path / "b", [], other)
    config, environment = context_differences(a, b)
    assert config == []
    assert len(environment) == 1 and environment[0].startswith(f"environment.{KEY}: ")
    assert "a" * 64 in environment[0] and "b" * 64 in environment[0]
    assert context_differences(a, RunRecords(tmp_path / "c", [], env)) == ([], [])
