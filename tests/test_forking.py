"""Forking: a model, a task, an optimizer of your own plug in by ``_target_``; the loop is not
edited. The plug-ins live outside src/ (tests/forked_project.py), as a fork's would."""

import csv
import json
import shlex
import shutil
from pathlib import Path

import pytest
import torch

from conftest import CONF_DIR, ROOT, SMALL_DATA, train_here
from optional import require
from repro.base.errors import ConfigError
from repro.components.tasks import Classification, Task
from repro.defense.config import compose
from repro.engine.build import accepted

STEPS = ["trainer.max_steps=8", "trainer.eval_every=4", *SMALL_DATA]
# the default model's keys (width, dropout) go with it: ~model starts the model from none
TINY_NET = ["~model", "+model._target_=forked_project.TinyNet"]
SMOOTHING = "task._target_=forked_project.LabelSmoothing"


def test_a_model_and_a_task_of_your_own_repeat_bit_exactly_and_the_loss_matters(tmp_path):
    a = train_here(tmp_path / "a", *STEPS, *TINY_NET, SMOOTHING)
    b = train_here(tmp_path / "b", *STEPS, *TINY_NET, SMOOTHING)
    plain = train_here(tmp_path / "plain", *STEPS, *TINY_NET)
    assert "TinyNet" in a.output and "task LabelSmoothing" in a.output
    assert a.summary["weights_sha256"] == b.summary["weights_sha256"]
    assert a.losses == b.losses
    assert a.summary["weights_sha256"] != plain.summary["weights_sha256"]  # the loss counts
    assert a.losses[0] != plain.losses[0]  # from the first step: same init, another loss
    # the metrics are the parent's, from its statistics
    assert a.summary["headline"] == "val_accuracy" and 0 <= a.summary["val_accuracy"] <= 1
    with open(a.dir / "eval.csv") as f:
        assert next(csv.reader(f)) == ["step", "val_loss", "val_accuracy"]


def test_a_target_gets_only_the_keys_its_signature_takes():
    def named(num_classes, in_channels=3, width=8):
        pass

    def zoo(*, weights=None, **kwargs):
        pass

    def neither(width=8):
        pass

    available = {"num_classes": 10, "in_channels": 3}
    assert accepted(named, available, set()) == available
    assert accepted(named, available, {"num_classes"}) == {"in_channels": 3}  # config wins
    # **kwargs: num_classes, which every zoo constructor takes; in_channels is spelled
    # differently from zoo to zoo (timm: in_chans), so it is left to the YAML
    assert accepted(zoo, available, set()) == {"num_classes": 10}
    assert accepted(neither, available, set()) == {}


def test_a_zoo_style_constructor_plugs_in_by_its_target(tmp_path):
    zoo = ["~model", "+model._target_=forked_project.zoo_model"]
    run = train_here(tmp_path / "zoo", *STEPS, *zoo)
    assert run.summary["steps"] == 8 and "TinyNet" in run.output
    state = torch.load(run.dir / "checkpoint.pt", weights_only=True)["model"]
    assert state["head.weight"].shape == (10, 8)  # num_classes through **kwargs
    # a class count in the model's YAML that is not the data's: refused before step 1
    with pytest.raises(ConfigError) as err:
        train_here(tmp_path / "twelve", *STEPS, *zoo, "+model.num_classes=12")
    assert str(err.value) == (
        "config error: model._target_='forked_project.zoo_model' gives 12 output channel(s) a "
        "sample, the data has 10 classes: model.num_classes=12 in its YAML; leave it out."
    )
    assert not (tmp_path / "twelve").exists()  # stopped before the run directory


def test_a_zoo_model_that_wants_the_class_count_by_another_name_is_told_which(tmp_path):
    """smp's ``Unet(classes=1, **kwargs)``: given num_classes it trains a 1-channel model to
    Dice 0 without a word; here the run stops before step 1 naming ``classes``, and the line
    it suggests trains."""
    small = ["trainer.max_steps=2", "trainer.eval_every=2", "data.train_size=32"]
    small += ["data.val_size=8", "trainer.batch_size=8", "trainer.micro_batch_size=8"]
    small += ["data.image_size=32", "augment=none"]
    zoo = ["experiment=segmentation", "~model", "+model._target_=forked_project.ClassesNet"]
    with pytest.raises(ConfigError) as err:
        train_here(tmp_path / "one", *zoo, *small)
    assert not (tmp_path / "one").exists()
    assert str(err.value) == (
        "config error: model._target_='forked_project.ClassesNet' gives 1 output channel(s) a "
        "sample, the data has 4 classes: its constructor takes the count as 'classes', not "
        "num_classes; add classes: ${data.num_classes} to its YAML (or +model.classes=4)."
    )
    run = train_here(tmp_path / "four", *zoo, *small, "+model.classes=${data.num_classes}")
    assert run.summary["steps"] == 2 and run.summary["headline"] == "val_dice"
    # a wrong count in the YAML under that name: named as such
    with pytest.raises(ConfigError, match=r"model.classes=3 in its YAML; set it to"):
        train_here(tmp_path / "three", *zoo, *small, "+model.classes=3")


def test_keys_the_new_target_does_not_take_are_named_and_dropping_them_works():
    with pytest.raises(ConfigError) as err:
        compose(["model._target_=forked_project.TinyNet"])
    assert str(err.value) == (
        "config error: model.dropout is not an argument of forked_project.TinyNet; allowed: "
        "width; drop it (set by its YAML or a preset): '~model.dropout'"
    )
    cfg = compose(["model._target_=forked_project.TinyNet", "~model.dropout"])
    assert dict(cfg.model) == {"_target_": "forked_project.TinyNet", "width": 32}


def forked_conf(tmp_path: Path) -> Path:
    """This conf/ plus what a fork adds: a segmentation model taking only num_classes, and a
    preset of its own that sets model keys in its body."""
    conf = shutil.copytree(CONF_DIR, tmp_path / "conf")
    (conf / "model" / "tinyseg.yaml").write_text("_target_: forked_project.TinySegNet\n")
    (conf / "experiment" / "wide.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: unet\nmodel:\n  width: 64\n"
        "  depth: 2\n"
    )
    return conf


def test_a_shipped_preset_trains_with_a_model_taking_only_num_classes(tmp_path):
    conf = forked_conf(tmp_path)
    small = ["trainer.max_steps=2", "trainer.eval_every=2", "data.train_size=64"]
    small += ["data.val_size=16", "trainer.batch_size=16", "trainer.micro_batch_size=8"]
    run = train_here(
        tmp_path / "run", "experiment=segmentation", "model=tinyseg", *small, conf_dir=conf
    )
    assert run.summary["steps"] == 2 and "TinySegNet" in run.output
    assert run.summary["headline"] == "val_dice"


def test_a_preset_body_that_sets_model_keys_says_which_to_drop_and_that_works(tmp_path):
    conf = forked_conf(tmp_path)
    with pytest.raises(ConfigError) as err:
        compose(["experiment=wide", "model=tinyseg"], conf)
    message = str(err.value)
    assert message.startswith("config error: model.width, model.depth are not arguments of ")
    advice = shlex.split(message.rsplit(": ", 1)[1])
    assert advice == ["~model.width", "~model.depth"]
    assert dict(compose(["experiment=wide", "model=tinyseg", *advice], conf).model) == {
        "_target_": "forked_project.TinySegNet"
    }


def test_a_torchvision_model_plugs_in_with_one_line(tmp_path):
    require("torchvision", "make add PKG=torchvision")
    steps = ["trainer.max_steps=2", "trainer.eval_every=2", "data.train_size=128"]
    resnet = ["~model", "+model._target_=torchvision.models.resnet18"]
    run = train_here(tmp_path / "tv", *steps, "data.val_size=32", *resnet)
    state = torch.load(run.dir / "checkpoint.pt", weights_only=True)["model"]
    assert state["fc.weight"].shape == (10, 512)  # num_classes reached it through **kwargs


def test_what_is_not_a_task_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="is not a task .*subclass repro.components.tasks.Task"):
        train_here(tmp_path / "x", *STEPS, "task._target_=forked_project.zoo_model")


def test_an_unknown_task_key_names_the_allowed_ones():
    with pytest.raises(ConfigError, match="task.smoothing is not an argument of"):
        compose(["+task.smoothing=0.1"])
    cfg = compose([SMOOTHING, "+task.smoothing=0.2"])
    assert cfg.task.smoothing == 0.2


def test_the_optimizer_is_a_partial_target_whose_implementation_is_pinned(tmp_path):
    with pytest.raises(ConfigError, match="does not pin its implementation; set optim.foreach"):
        compose(["~optim.foreach"])
    with pytest.raises(ConfigError, match="optim.lr='fast' is invalid; allowed: a number"):
        compose(["optim.lr=fast"])
    constant = ["schedule=constant", "schedule.warmup_steps=2"]
    run = train_here(tmp_path / "adamw", *STEPS, "optim=adamw", *constant)
    assert run.entry("optimizer implementation")["value"] == "AdamW / foreach"
    state = torch.load(run.dir / "checkpoint.pt", weights_only=True)
    assert state["optimizer"]["param_groups"][0]["foreach"] is True
    assert state["schedule"]["_last_lr"][0] == 2.0e-3  # constant after the warm-up


def test_the_task_interface_is_what_the_docs_say():
    """docs/extending.md documents the interface the loop calls; Classification implements
    it."""
    docs = (ROOT / "docs" / "extending.md").read_text()
    for name in ("loss", "statistics", "metrics"):
        assert f"| `{name}(" in docs, name
        assert getattr(Classification, name) is not getattr(Task, name)
    assert "| `headline: str`, `higher_is_better: bool` |" in docs
    assert Classification.headline == "val_accuracy" and Classification.higher_is_better
    task = Classification()
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]])
    labels = torch.tensor([0, 0, 0])
    stats = task.statistics(logits, labels)
    assert stats["correct"].dtype == torch.int64 and int(stats["correct"]) == 2
    # additive: two halves summed give the metrics of the whole
    halves = [task.statistics(logits[:1], labels[:1]), task.statistics(logits[1:], labels[1:])]
    total = {k: halves[0][k] + halves[1][k] for k in stats}
    assert task.metrics(total)["val_accuracy"] == task.metrics(stats)["val_accuracy"] == 2 / 3
    assert torch.equal(task.loss(logits, labels), stats["loss_sum"].float())


def test_a_task_with_another_headline_leads_the_summary_compare_and_report(tmp_path):
    from repro.tools.compare import compare_dirs
    from repro.tools.report import build_report, format_markdown

    task = "task._target_=forked_project.LossHeadline"
    runs = [train_here(tmp_path / f"{s}_seed={s}", *STEPS, task, f"seed={s}") for s in (0, 1)]
    assert runs[0].summary["headline"] == "val_loss"
    assert runs[0].summary["metric_names"] == ["val_loss", "val_accuracy"]
    first = json.loads((runs[0].dir / "trace.jsonl").read_text().splitlines()[0])
    assert first["task"] == {"headline": "val_loss", "higher_is_better": False}
    tolerance = compare_dirs(runs[0].dir, runs[1].dir, tolerance=10).text()
    assert "val_loss (step 8):" in tolerance and "(headline, abs checked)" in tolerance
    assert "val_accuracy (step 8):" in tolerance and "(listed)" in tolerance
    for run in runs:  # a sweep directory around the two runs, as Hydra writes it
        (run.dir / ".hydra").mkdir()
        (run.dir / ".hydra" / "overrides.yaml").write_text(
            f"- {task}\n- seed={run.summary['seed']}\n"
        )
        (run.dir / ".hydra" / "config.yaml").write_text(f"seed: {run.summary['seed']}\n")
    report = build_report(tmp_path)
    (group,) = report["groups"]
    assert list(group["metrics"]) == ["val_loss", "val_accuracy", "final_loss"]
    assert "| job | seed | status | val_loss | val_accuracy | final_loss |" in format_markdown(
        report, {}
    )


def test_a_headline_or_metric_name_the_task_does_not_have_fails_before_the_first_step(tmp_path):
    with pytest.raises(ConfigError, match="its headline 'val_f1' is not one of its metrics"):
        train_here(tmp_path / "a", *STEPS, "task._target_=forked_project.MisnamedHeadline")
    assert not (tmp_path / "a" / "metrics.csv").exists()  # no step was taken
    with pytest.raises(ConfigError, match="metric 'accuracy' must be named val_"):
        train_here(tmp_path / "b", *STEPS, "task._target_=forked_project.UnprefixedMetric")


def test_optimizer_settings_it_refuses_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="optim.fused=true with optim.foreach=true; choose one"):
        compose(["optim.fused=true"])
    assert compose(["optim.fused=true", "optim.foreach=false"]).optim.fused
    with pytest.raises(ConfigError, match="does not pin its implementation"):
        compose(["optim.foreach=null", "optim.fused=false"])  # fused off alone pins nothing
    with pytest.raises(ConfigError) as err:
        train_here(tmp_path / "eps", *STEPS, "optim=adamw", "optim.eps=-1")
    message = str(err.value)
    assert message.startswith("optim: torch.optim.adamw.AdamW refused its settings (ValueError")
    assert "\n" not in message


def test_a_model_with_layers_it_never_runs_trains_and_they_are_named(tmp_path):
    """An encoder deeper than its decoder reads (smp's encoder_depth below 5) builds BatchNorm
    layers no forward runs: named in one warning, left as initialised, and the run trains."""
    small = ["trainer.max_steps=2", "trainer.eval_every=2", "data.train_size=32"]
    small += ["data.val_size=8", "trainer.batch_size=8", "trainer.micro_batch_size=4"]
    small += ["data.image_size=32", "augment=none"]
    model = ["experiment=segmentation", "~model", "+model._target_=forked_project.UnusedNormNet"]
    run = train_here(tmp_path / "run", *model, *small)
    assert run.summary["steps"] == 2
    warned = [line for line in run.output.splitlines() if "never ran" in line]
    assert len(warned) == 1 and warned[0].startswith("BatchNorm layer(s) deeper.1 never ran")
    state = torch.load(run.dir / "checkpoint.pt", weights_only=True, map_location="cpu")["model"]
    assert int(state["deeper.1.num_batches_tracked"]) == 0
    assert int(state["norm.num_batches_tracked"]) == 4  # 2 steps of 2 micro-batches
    assert torch.equal(state["deeper.1.running_mean"], torch.zeros(8))
