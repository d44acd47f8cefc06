"""Every ``auto`` is settled once (repro.engine.settle), before anything is hashed, and a
resume compares only the settled values that decide the bits."""

from __future__ import annotations

import torch

from conftest import train_here
from repro.defense.config import compose, config_hash, resolved_container
from repro.engine import settle as settling
from repro.engine.build import build_data, instantiate_model

SMALL = ["data.train_size=256", "data.val_size=64"]


def settled_on(monkeypatch, device: str, free_gib: float, *overrides: str):
    """The config, and what :func:`settle` makes of it on ``device`` with ``free_gib`` of free
    GPU memory (what CUDA would answer is given: no GPU needed)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (free_gib * 2**30, 141 * 2**30))
    cfg = compose([*SMALL, *overrides])
    data = build_data(cfg)
    model, _ = instantiate_model(cfg, data)
    return cfg, settling.settle(cfg, torch.device(device), data, model)


def test_free_gpu_memory_changes_the_loader_but_not_what_a_resume_compares(monkeypatch):
    """On a GPU with room the split goes to the device; on a busy one, to worker processes.
    Either way the same bits, so the recorded config, its hash and what a resume compares
    are the same: a resume on a busier GPU is not refused."""
    cfg, roomy = settled_on(monkeypatch, "cuda", 100.0)
    _, busy = settled_on(monkeypatch, "cuda", 1e-6)
    assert (roomy.loader.name, busy.loader.name) == ("device", "multi")
    assert roomy.channels_last and busy.channels_last  # a CUDA run of a ConvNet: auto is on
    a, b = roomy.recorded(cfg), busy.recorded(cfg)
    assert resolved_container(a) == resolved_container(b)
    assert config_hash(a) == config_hash(b)


def test_the_memory_format_is_recorded_as_chosen_so_auto_and_explicit_are_one_config(monkeypatch):
    cfg, on_cuda = settled_on(monkeypatch, "cuda", 100.0)
    explicit, _ = settled_on(monkeypatch, "cuda", 100.0, "trainer.channels_last=true")
    assert config_hash(on_cuda.recorded(cfg)) == config_hash(explicit)
    assert config_hash(cfg) != config_hash(explicit)  # the unsettled config is another one
    cpu_cfg, on_cpu = settled_on(monkeypatch, "cpu", 0.0)
    assert not on_cpu.channels_last and on_cpu.loader.name == "multi"
    assert on_cpu.recorded(cpu_cfg).trainer.channels_last is False
    assert on_cpu.memory_format == ("contiguous", "auto: not on CUDA")


def test_a_run_settles_each_auto_once_and_nothing_after(monkeypatch, tmp_path):
    """Counted during a whole (short) run, evaluation and checkpoints included: the memory
    format is decided once and the loader chosen once, by settle."""
    calls = {"settle": 0, "uses_channels_last": 0, "choose_loader": 0}
    for name in calls:
        real = getattr(settling, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(settling, name, counted)
    monkeypatch.setattr("repro.engine.loop.settle", settling.settle)
    monkeypatch.setattr("repro.engine.build.uses_channels_last", settling.uses_channels_last)
    monkeypatch.setattr("repro.engine.build.choose_loader", settling.choose_loader)
    run = train_here(tmp_path / "run", *SMALL, "trainer.max_steps=4", "trainer.eval_every=2")
    assert run.summary["steps"] == 4
    assert calls == {"settle": 1, "uses_channels_last": 1, "choose_loader": 1}
