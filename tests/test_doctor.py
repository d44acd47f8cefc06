"""`repro doctor` names the nondeterministic module, and only it."""

import sys

import pytest
import torch

import launch
from conftest import CONF_DIR, ROOT, user_env
from repro.defense.config import compose
from repro.engine.doctor import run_doctor

SMALL = ["data.train_size=256", "data.val_size=64", "device=cpu"]


def doctor(*overrides, repeats=3):
    cfg = compose([*SMALL, *overrides], CONF_DIR)
    return run_doctor(cfg, repeats=repeats, log=lambda m: None)


@pytest.mark.parametrize("model", ["JitterNet", "ShuffledSumNet"])
def test_names_the_module_that_differs_between_repeats(model):
    report = doctor(f"model._target_=nondeterministic_models.{model}")
    for findings in (report.fast, report.strict):  # neither is an op strict mode can fix
        assert [f.module for f in findings] == ["suspect"], report.format()
        assert findings[0].where == "forward"
    assert not report.clean
    text = report.format()
    assert "suspect" in text and "NOT deterministic under strict mode" in text
    assert "features" not in text and "head" not in text  # downstream modules are not blamed


def test_strict_repeats_run_without_the_nan_fill_so_an_uninitialized_read_shows():
    """Strict training leaves new memory unfilled; with the fill on, the doctor's strict
    repeats would read the same NaN each time and call the model clean."""
    report = doctor("model._target_=nondeterministic_models.UninitializedReadNet")
    assert [f.module for f in report.strict] == ["suspect"], report.format()
    assert not report.clean


def test_names_the_op_without_a_deterministic_kernel_at_the_innermost_module():
    report = doctor("model._target_=nondeterministic_models.UnpoolNet")
    assert [(f.module, f.kind) for f in report.strict_ops] == [("suspect.unpool", "MaxUnpool2d")]
    assert "max_unpool" in report.strict_ops[0].where
    assert report.fast == [] and report.strict == []  # the CPU kernel itself repeats
    assert not report.clean
    assert "replace each with a deterministic equivalent" in report.format()


@pytest.mark.e2e
def test_the_default_model_is_clean_and_the_command_says_so(tmp_path):
    out = launch.run(
        [sys.executable, "-m", "repro", "doctor", *SMALL, "--repeats", "2"],
        cwd=ROOT,
        env=user_env(),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no module is nondeterministic" in out.stdout
    assert "strict mode is clean" in out.stdout
    assert "not checked alone" not in out.stdout  # every module was re-run alone


@pytest.mark.e2e
def test_bad_overrides_are_one_line(tmp_path):
    out = launch.run(
        [sys.executable, "-m", "repro", "doctor", "model=nope"],
        cwd=tmp_path,
        env=user_env(),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert "model=nope is not an option" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_module_called_twice_is_named_by_its_call_number():
    """A reused module's calls: its name for the first, name#2 for the second (not #1)."""
    from torch import nn

    from repro.engine.doctor import Probe

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Linear(4, 4)

        def forward(self, x):
            return self.shared(self.shared(x))

    model = Twice()
    probe = Probe(model, keep_tensors=False)
    try:
        model(torch.zeros(2, 4, requires_grad=True)).sum().backward()
    finally:
        probe.remove()
    assert list(probe.calls) == ["", "shared", "shared#2"]
