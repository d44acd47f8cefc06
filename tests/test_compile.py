"""trainer.compile and trainer.channels_last: settings that choose other kernels, so other
bits, but bits that repeat and stay invariant to the loader (CPU here: Inductor's C++
backend; the CUDA tests are in test_cuda.py)."""

import pytest
import torch

from conftest import SMALL_DATA, train_here
from repro.compare import compare_dirs
from repro.errors import CheckpointError, ConfigError


class TinyNet(torch.nn.Module):
    """Small enough that Inductor compiles it in seconds on a 2-core CPU; dropout inside, so
    that keyed randomness is exercised in the compiled graph, and a BatchNorm, so that the
    running statistics' hooks are too."""

    def __init__(self, num_classes, in_channels=3, width=8, dropout=0.1):
        super().__init__()
        self.conv = torch.nn.Conv2d(in_channels, width, 3, stride=2, padding=1)
        self.norm = torch.nn.BatchNorm2d(width)
        self.dropout = torch.nn.Dropout(dropout)
        self.head = torch.nn.Linear(width, num_classes)

    def forward(self, x):
        x = torch.relu(self.norm(self.conv(x))).mean(dim=(2, 3))
        return self.head(self.dropout(x))


TINY = [
    "model._target_=test_compile.TinyNet",
    "trainer.max_steps=6",
    "trainer.eval_every=6",
    "trainer.checkpoint_every=3",
    "trainer.trace_every=3",
    *SMALL_DATA,
    "model.width=8",
]


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    return train_here(tmp_path_factory.mktemp("eager") / "run", *TINY)


@pytest.mark.e2e
def test_a_compiled_strict_run_repeats_with_any_loader_and_differs_from_eager_as_config(
    eager, tmp_path
):
    """Dropout draws inside the compiled graph too (keyed per micro-batch). The first run
    compiles; the others reuse its kernels."""
    compiled = [*TINY, "trainer.compile=default"]
    single = train_here(tmp_path / "single", *compiled, "loader=single")
    multi = train_here(tmp_path / "multi", *compiled, "loader=multi", "loader.num_workers=2")
    on_device = train_here(tmp_path / "device", *compiled, "loader=device")
    digests = {r.summary["weights_sha256"] for r in (single, multi, on_device)}
    assert len(digests) == 1 and single.losses == multi.losses == on_device.losses
    assert single.entry("inductor deterministic")["value"] is True
    assert single.entry("torch.compile")["value"] == "default"
    assert single.summary["warmup_seconds"] > 0  # compilation, apart from the throughput
    result = compare_dirs(eager.dir, single.dir)
    assert not result.identical and "trainer.compile" in result.text(), result.text()


class Stop(Exception):
    pass


def stop_after(step):
    def hook(done, model):
        if done == step:
            raise Stop

    return hook


@pytest.mark.e2e
def test_a_compiled_run_resumes_exactly_and_an_eager_one_cannot_resume_it(tmp_path):
    compiled = [*TINY, "trainer.compile=default"]
    straight = train_here(tmp_path / "straight", *compiled)
    with pytest.raises(Stop):
        train_here(tmp_path / "resumed", *compiled, after_step=stop_after(5))  # checkpoint: 3
    resumed = train_here(tmp_path / "resumed", *compiled, "trainer.resume=auto")
    assert resumed.summary["resumes"][0]["step"] == 3
    assert resumed.summary["weights_sha256"] == straight.summary["weights_sha256"]
    differ = r"trainer.compile: default \(checkpoint\) vs off \(now\)"
    with pytest.raises(CheckpointError, match=differ):
        train_here(tmp_path / "eager", *TINY, f"trainer.resume={tmp_path / 'resumed'}")


@pytest.mark.e2e
def test_channels_last_repeats_with_any_loader_and_is_recorded(tmp_path):
    nhwc = [*TINY, "trainer.channels_last=true"]
    single = train_here(tmp_path / "single", *nhwc, "loader=single")
    on_device = train_here(tmp_path / "device", *nhwc, "loader=device")
    assert single.summary["weights_sha256"] == on_device.summary["weights_sha256"]
    assert single.entry("memory format")["value"] == "channels_last"


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_compile_modes_that_record_cuda_graphs_are_refused_in_one_line(mode, tmp_path):
    with pytest.raises(ConfigError, match=f"trainer.compile={mode} records CUDA graphs"):
        train_here(tmp_path / "run", *TINY, f"trainer.compile={mode}")
    assert not (tmp_path / "run").exists()


def test_compiling_keeps_the_state_dict_keys():
    from repro.build import build_model
    from repro.config import compose
    from repro.data import synthetic

    cfg = compose([*TINY, "trainer.compile=default"])
    model = build_model(cfg, synthetic(train_size=64, val_size=16), torch.device("cpu"))
    assert all(not k.startswith("_orig_mod") for k in model.state_dict())
