"""trainer.compile and trainer.channels_last: settings that choose other kernels, so other
bits, but bits that repeat and stay invariant to the loader (CPU here: Inductor's C++
backend; the CUDA tests are in test_cuda.py)."""

import pytest
import torch

from conftest import SMALL_DATA, Stop, run_defaults, stop_after, train_here
from repro.base.errors import CheckpointError, ConfigError
from repro.tools.compare import compare_dirs


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


COMPILED = [*TINY, "trainer.compile=default"]


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    return train_here(tmp_path_factory.mktemp("eager") / "run", *TINY)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The compiled run (main-process loader), uninterrupted: what the others must equal."""
    return train_here(tmp_path_factory.mktemp("compiled") / "run", *COMPILED)


@pytest.mark.e2e
def test_a_compiled_strict_run_repeats_with_any_loader_and_differs_from_eager_as_config(
    eager, compiled, tmp_path
):
    """Dropout draws inside the compiled graph too (keyed per micro-batch). The first run
    compiles; the others reuse its kernels."""
    single = compiled
    multi = train_here(tmp_path / "multi", *COMPILED, "loader=multi", "loader.num_workers=2")
    on_device = train_here(tmp_path / "device", *COMPILED, "loader=device")
    digests = {r.summary["weights_sha256"] for r in (single, multi, on_device)}
    assert len(digests) == 1 and single.losses == multi.losses == on_device.losses
    assert single.entry("inductor deterministic")["value"] is True
    assert single.entry("torch.compile")["value"] == "default"
    assert single.summary["warmup_seconds"] > 0  # compilation, apart from the throughput
    result = compare_dirs(eager.dir, single.dir)
    assert not result.identical and "trainer.compile" in result.text(), result.text()


@pytest.mark.e2e
def test_a_compiled_run_resumes_exactly_and_an_eager_one_cannot_resume_it(compiled, tmp_path):
    with pytest.raises(Stop):
        train_here(tmp_path / "resumed", *COMPILED, after_step=stop_after(5))  # checkpoint: 3
    resumed = train_here(tmp_path / "resumed", *COMPILED, "trainer.resume=auto")
    assert resumed.summary["resumes"][0]["step"] == 3
    assert resumed.summary["weights_sha256"] == compiled.summary["weights_sha256"]
    assert resumed.losses == compiled.losses
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
    assert single.summary["channels_last"] is True
    # the default, auto, is contiguous on a CPU: a resume across formats is refused
    differ = r"trainer.channels_last: True \(checkpoint\) vs False \(now\)"
    with pytest.raises(CheckpointError, match=differ):
        train_here(tmp_path / "auto", *TINY, f"trainer.resume={single.dir}")
    # evaluating it needs no flag: auto takes the format the run recorded (a GPU run's
    # checkpoint evaluated on a CPU), and gives the run's own final evaluation
    from repro.defense.config import compose
    from repro.engine.inference import evaluate_checkpoint

    cfg = compose(run_defaults(TINY))  # the run's
    got = evaluate_checkpoint(cfg, single.dir / "checkpoint.pt", torch.device("cpu"), "val")
    assert got["metrics"]["val_loss"] == single.summary["val_loss"]


@pytest.mark.e2e
def test_channels_last_auto_is_recorded_as_the_format_it_chose(eager):
    """auto on a CPU builds a contiguous model, and the run records false, not auto: its
    config (and hash) is that of trainer.channels_last=false, which gives the same bits."""
    from repro.defense.config import compose, config_hash

    assert compose(TINY).trainer.channels_last == "auto"  # the default
    assert eager.env["config"]["trainer"]["channels_last"] is False
    assert eager.summary["channels_last"] is False
    assert eager.entry("memory format")["value"] == "contiguous"
    assert eager.entry("memory format")["note"] == "auto: not on CUDA"
    assert eager.summary["config_hash"] == config_hash(
        compose(run_defaults([*TINY, "trainer.channels_last=false"]))  # as train_here
    )


def test_channels_last_auto_is_on_for_cuda_runs_of_models_with_2d_convolutions():
    from repro.engine.settle import memory_format_row, uses_channels_last

    conv, mlp = TinyNet(num_classes=3), torch.nn.Sequential(torch.nn.Linear(4, 3))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # the device object: no GPU needed
    assert uses_channels_last("auto", conv, cuda) is True
    assert uses_channels_last("auto", conv, cpu) is False
    assert uses_channels_last("auto", mlp, cuda) is False
    assert (
        uses_channels_last(True, mlp, cpu) is True
        and uses_channels_last(False, conv, cuda) is False
    )
    assert memory_format_row("auto", True, cuda)[1].startswith("auto: a CUDA run of a model")
    assert memory_format_row("auto", False, cuda) == ("contiguous", "auto: no 2-D convolution")
    assert memory_format_row(False, False, cuda) == ("contiguous", "")


def test_channels_last_takes_auto_true_or_false(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.channels_last='yes' is invalid; allowed: auto"):
        train_here(tmp_path / "run", *TINY, "trainer.channels_last=yes")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_compile_modes_that_record_cuda_graphs_are_refused_in_one_line(mode, tmp_path):
    with pytest.raises(ConfigError, match=f"trainer.compile={mode} records CUDA graphs"):
        train_here(tmp_path / "run", *TINY, f"trainer.compile={mode}")
    assert not (tmp_path / "run").exists()


def test_compiling_keeps_the_state_dict_keys():
    from repro.components.data import synthetic
    from repro.defense.config import compose
    from repro.engine.build import build_model

    cfg = compose(COMPILED)
    model = build_model(cfg, synthetic(train_size=64, val_size=16), torch.device("cpu"))
    assert all(not k.startswith("_orig_mod") for k in model.state_dict())
