"""The schema: composition, defaults, and one clear line for every bad value."""

import shlex
import shutil
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

import launch
import repro.defense.config  # noqa: F401  (registers the schema)
from conftest import CONF_DIR, compose_every_option, compose_option, run_train, train_cmd, user_env
from repro.base.errors import ConfigError, MissingPackage
from repro.defense.config import check_overrides, config_hash, validate
from repro.defense.config import compose as repro_compose


def cfg(*overrides):
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return compose("train", overrides=list(overrides))


def test_defaults_are_as_documented():
    c = cfg()
    choices = {
        "determinism": "strict",
        "loader": "multi",
        "amp": "off",
        "model": "convnet",
        "data": "synthetic",
        "task": "classification",
        "optim": "sgd",
        "schedule": "cosine",
        "trainer": "default",
    }
    assert str(c.determinism.mode) == "strict"
    assert c.loader.num_workers == 2 and c.loader.pin_memory and c.amp.enabled is False
    assert c.model._target_ == "repro.models.ConvNet" and c.data._target_ == "repro.data.synthetic"
    assert c.optim._target_ == "torch.optim.SGD" and c.optim._partial_ and c.optim.foreach
    assert c.task._target_ == "repro.tasks.Classification" and c.seed == 0
    for group, option in choices.items():
        assert (CONF_DIR / group / f"{option}.yaml").is_file()
    validate(c)


GROUPS = ["determinism", "loader", "amp", "model", "data", "augment", "task", "optim"]
GROUPS += ["schedule", "trainer", "logger", "experiment", "hparams_search"]


OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF_DIR / g).glob("*.yaml"))]


@pytest.mark.parametrize("group, option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_of_every_group_composes(group, option):
    """Each option found in conf/ (a fork's too) composes and validates; one whose package is
    an optional one (pyproject.toml) not usable here -- not installed, or its import fails --
    is skipped, in one line."""
    result = compose_option(group, option)
    if result != "ok":
        pytest.skip(f"{result.removeprefix('skipped ')}: an optional package, not usable here")


def test_a_forks_options_compose_and_one_needing_a_missing_package_is_skipped(
    tmp_path, monkeypatch
):
    """The compose-every-option check in a fork: its own model, task and data YAMLs compose;
    one needing an optional package (declared in the fork's pyproject.toml) that is not
    installed is skipped in one line; a misspelt module, or a key the target does not take,
    still fails."""

    declared = {**repro.defense.config.optional_packages(), "zoo_pkg": ("zoo-pkg", "zoo")}
    monkeypatch.setattr(repro.defense.config, "optional_packages", lambda: declared)
    conf = shutil.copytree(CONF_DIR, tmp_path / "conf")
    (conf / "model" / "tiny.yaml").write_text("_target_: forked_project.TinyNet\nwidth: 4\n")
    (conf / "model" / "zoo.yaml").write_text("_target_: zoo_pkg.create_model\n")
    (conf / "task" / "smooth.yaml").write_text(
        "_target_: forked_project.LabelSmoothing\nsmoothing: 0.2\n"
    )
    (conf / "data" / "mine.yaml").write_text(
        "defaults:\n  - synthetic\n  - _self_\nnum_classes: 4\n"
    )
    results = {g: compose_every_option(g, conf) for g in ("model", "task", "data")}
    assert results["model"]["zoo"] == "skipped model=zoo: needs zoo_pkg"
    assert results["model"]["tiny"] == results["task"]["smooth"] == results["data"]["mine"] == "ok"
    assert results["model"]["convnet"] == "ok"
    with pytest.raises(MissingPackage, match=r"needs zoo-pkg, .*'zoo' extra.*make add PKG=zoo-pkg"):
        repro_compose(["model=zoo"], conf)
    (conf / "model" / "zoo.yaml").write_text("_target_: zoo_pgk.create_model\n")  # misspelt
    with pytest.raises(ConfigError, match="no module named 'zoo_pgk'; check its spelling"):
        compose_every_option("model", conf)
    (conf / "model" / "zoo.yaml").unlink()
    (conf / "model" / "tiny.yaml").write_text("_target_: forked_project.TinyNet\nwdth: 4\n")
    with pytest.raises(ConfigError, match="model.wdth is not an argument"):
        compose_every_option("model", conf)


def test_an_installed_package_that_raises_on_import_is_named_with_its_own_message(
    tmp_path, monkeypatch
):
    """A ``_target_`` whose package is installed but raises on import (a torchvision built for
    another torch: ``RuntimeError: operator torchvision::nms does not exist``) is named as
    broken, with the exception's own message -- not "check the dotted path"; declared optional
    (pyproject.toml), it is a MissingPackage, so the compose-every-option check skips it and
    says why. A name missing from a module that imports is still "check the dotted path"."""
    raising = 'raise RuntimeError("operator x::y does not exist")\n'
    for package in ("brokenzoo", "torchvision", "halfzoo"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("" if package == "halfzoo" else raising)
    (tmp_path / "halfzoo" / "models.py").write_text(raising)
    monkeypatch.syspath_prepend(str(tmp_path))
    for module in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
        monkeypatch.delitem(sys.modules, module)  # a real one imported before: the stub here
    with pytest.raises(ConfigError) as err:
        repro_compose(["model._target_=brokenzoo.Net"])
    message = str(err.value)
    assert "cannot be imported (RuntimeError: operator x::y does not exist)" in message
    assert "brokenzoo is installed but its import fails" in message
    assert "check the dotted path" not in message and not isinstance(err.value, MissingPackage)
    with pytest.raises(ConfigError, match="halfzoo is installed but importing halfzoo.models"):
        repro_compose(["model._target_=halfzoo.models.Net"])
    declared = {**repro.defense.config.optional_packages(), "brokenzoo": ("brokenzoo", "zoo")}
    monkeypatch.setattr(repro.defense.config, "optional_packages", lambda: declared)
    with pytest.raises(MissingPackage, match=r"\(make add PKG=brokenzoo checks it imports\)"):
        repro_compose(["model._target_=brokenzoo.Net"])
    with pytest.raises(MissingPackage, match=r"must match torch's \(make add PKG=torchvision"):
        repro_compose(["augment=torchvision"])
    result = compose_option("augment", "torchvision")
    assert result.startswith("skipped augment=torchvision: needs torchvision (installed but")
    assert result.endswith("import fails: RuntimeError: operator x::y does not exist)")
    with pytest.raises(ConfigError, match=r"\(AttributeError: .*ConvNett.*check the dotted path"):
        repro_compose(["model._target_=repro.models.ConvNett"])


def test_config_hash_tracks_values():
    assert config_hash(cfg()) == config_hash(cfg())
    assert config_hash(cfg()) != config_hash(cfg("seed=1"))


@pytest.mark.parametrize(
    "override", ["trainer.max_steps=abc", "amp.dtype=int8", "loader.num_workers=1.5"]
)
def test_type_errors_fail_at_composition(override):
    with pytest.raises(ConfigCompositionException) as err:
        cfg(override)
    assert isinstance(err.value.__cause__, ValidationError)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["loader.num_workers=-1"], "loader.num_workers"),
        (["trainer.batch_size=50"], "trainer.batch_size"),
        (["trainer.micro_batch_size=0"], "trainer.micro_batch_size"),
        (["trainer.max_steps=0"], "trainer.max_steps"),
        (["trainer.max_steps=100000000"], "trainer.max_steps=100000000 is invalid; allowed: an"),
        (["seed=-1"], "seed"),
        (["optim.lr=0"], "optim.lr"),
        (["optim.clip_grad_norm=0"], "optim.clip_grad_norm=0 is invalid; allowed: a number > 0"),
        (["optim.lr=inf"], "optim.lr=inf is invalid; allowed: a finite number"),
        (["optim.weight_decay=-inf"], "optim.weight_decay=-inf is invalid"),
        (["data.noise=nan"], "data.noise=nan is invalid; allowed: a finite number"),
        (
            ["experiment=segmentation", "task.class_weights=[1.0,inf,1.0,1.0]"],
            "task.class_weights.1=inf is invalid",
        ),
        (["device=tpu"], "device"),
        (["+foo=1"], "foo is not a key of this config"),
        (
            ["data=image_folder", "data.path=/etc/hostname"],
            "is a file; repro.data.image_folder",
        ),
        (["data=image_folder"], "data.path"),
        (["model._target_=no.such.Model"], "model._target_"),
        (["+model.bogus=3"], "model.bogus is not an argument of repro.models.ConvNet"),
        (["data.noise=abc"], "data.noise='abc' is invalid; allowed: a number"),
        (
            ["data=image_folder", "data.path=/no/such/folder"],
            "data.path='/no/such/folder' does not exist",
        ),
        (["determinism.pythonhashseed=abc"], "determinism.pythonhashseed"),
        (["device=cuda:abc"], "device='cuda:abc'"),
        (["dist.bucket_mb=0"], "dist.bucket_mb=0.0 is invalid; allowed: a number > 0 (MiB)"),
        (["dist.bucket_mb=inf"], "dist.bucket_mb=inf is invalid; allowed: a finite number"),
    ],
)
def test_range_and_relation_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        validate(cfg(*overrides))
    message = str(err.value)
    assert key in message and "\n" not in message


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["trainer.checkpoint_name=/tmp/elsewhere.pt"], "trainer.checkpoint_name"),
        (["trainer.checkpoint_name=../../x.pt"], "trainer.checkpoint_name"),
        (["trainer.checkpoint_name=sub/../../x.pt"], "trainer.checkpoint_name"),
        (["trainer.checkpoint_name='~/x.pt'"], "trainer.checkpoint_name"),
        (["trainer.checkpoint_name=."], "trainer.checkpoint_name"),
        (["trainer.checkpoint_name=summary.json"], "trainer.checkpoint_name"),
        (["trainer.checkpoint_name=checkpoints/step-00000010.pt"], "trainer.checkpoint_name"),
        (["trainer.checkpoint_name=.hydra/config.yaml"], "trainer.checkpoint_name"),
        (["logger=tensorboard", "logger.tensorboard.subdir=/tmp/tb"], "logger.tensorboard.subdir"),
        (["logger=tensorboard", "logger.tensorboard.subdir=../tb"], "logger.tensorboard.subdir"),
    ],
)
def test_a_file_the_run_writes_is_named_inside_its_directory(overrides, key):
    """A received run's recorded overrides (``repro rerun``) cannot write outside the run
    directory or over its records: refused in one line before anything is built."""
    with pytest.raises(ConfigError) as err:
        validate(cfg(*overrides))
    message = str(err.value)
    assert message.startswith(f"config error: {key}=") and "\n" not in message
    assert "inside the run directory" in message


@pytest.mark.parametrize(
    "override", ["trainer.checkpoint_name=final.pt", "trainer.checkpoint_name=out/final.pt"]
)
def test_a_relative_name_in_the_run_directory_is_accepted(override):
    validate(cfg(override))


@pytest.mark.e2e
@pytest.mark.parametrize(
    "override, expected",
    [
        ("loader.num_workers=-1", "loader.num_workers=-1 is invalid; allowed: an integer >= 0"),
        (
            "trainer.batch_size=50",
            "trainer.batch_size=50 is not divisible by trainer.micro_batch_size=32",
        ),
        ("trainer.max_steps=abc", "trainer.max_steps='abc' is invalid; allowed: an integer."),
        ("amp.dtype=int8", "amp.dtype='int8' is invalid; allowed: one of bfloat16, float16."),
        ("determinism=nope", "determinism=nope is not an option; allowed: fast, strict, "),
        ("amp.enabled=3", "amp.enabled=3 is invalid; allowed: true or false."),
        (
            "determinism.cpu_threads=x",
            "determinism.cpu_threads='x' is invalid; allowed: null or an integer.",
        ),
        # checked before strict mode re-executes the process with it (an interpreter would
        # refuse to start with PYTHONHASHSEED=abc)
        (
            "determinism.pythonhashseed=abc",
            "determinism.pythonhashseed='abc' is invalid; allowed: 'random' or an integer",
        ),
        ("trainer.bogus=1", "trainer.bogus is not a key of trainer (known: "),
        ("+trainer.bogus=1", "trainer.bogus is not a key of trainer (known: "),
        (
            "trainer.max_steps=99999999999999999999",
            "trainer.max_steps=99999999999999999999 is invalid; allowed: an integer from 1 to",
        ),
    ],
)
def test_cli_errors_are_one_line_and_stop_before_any_work(tmp_path, override, expected):
    """From the command line: exit 1, one line, no traceback, no run directory."""
    run_dir = tmp_path / "run"
    run = run_train(run_dir, override, check=False, cwd=tmp_path)
    assert run.proc.returncode == 1
    assert run.proc.stderr.strip() == f"error: config error: {expected}" or (
        expected in run.proc.stderr and len(run.proc.stderr.strip().splitlines()) == 1
    )
    assert run.proc.stdout == ""
    assert not run_dir.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.e2e
@pytest.mark.parametrize(
    "sweep, expected",
    [
        ("seed=0,1,x", "error: config error: seed='x' is invalid; allowed: an integer."),
        # a type-correct value that fails a relation, in the *second* job: no job may run first
        (
            "trainer.batch_size=64,50",
            "trainer.batch_size=50 is not divisible by trainer.micro_batch_size=32",
        ),
    ],
)
def test_a_bad_value_in_a_sweep_stops_the_whole_sweep_before_it_starts(tmp_path, sweep, expected):
    proc = launch.run(
        train_cmd("-m", sweep, "trainer.max_steps=1"),
        cwd=tmp_path,
        env=user_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert expected in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.e2e
def test_a_data_folder_a_sweep_cannot_read_stops_it_once_before_the_first_job(tmp_path):
    """An image mask folder with an image without its mask: one line, naming the file and
    the job, before the sweep's directory exists -- not the same failure in every job."""
    from repro.components.data.synthetic import write_nuclei_folder

    data = tmp_path / "data"
    write_nuclei_folder(data, count=4, seed=1, sizes=(40, 60))
    (data / "masks" / "cell_002.png").unlink()
    work = tmp_path / "work"
    work.mkdir()
    proc = launch.run(
        train_cmd("-m", "seed=0,1", "experiment=segmentation_native", f"data.path={data}",
                  "data.num_classes=3", "data.channels=1", "trainer.max_steps=1"),
        cwd=work, env=user_env(), capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "images/cell_002.png" in lines[0], lines
    assert "seed=0" in lines[0].split("(in the sweep job ")[1]  # the first job's, once
    assert list(work.iterdir()) == []


def test_check_overrides_leaves_what_it_does_not_know_to_hydra():
    check_overrides(
        [
            "+model.extra=1",
            "model.width=abc",
            "seed=range(0,3)",
            "~data.noise",
            "hydra.run.dir=x",
            "--multirun",
            "model=custom",
            "hydra.searchpath=[file://x]",
            "optim=glob(*)",
        ],
        CONF_DIR,
    )
    check_overrides(["--config-dir=extra", "model=small"], CONF_DIR)
    with pytest.raises(ConfigError, match="model=custom is not an option; allowed: .*convnet"):
        check_overrides(["model=custom"], CONF_DIR)


def test_an_experiment_preset_sets_its_groups_and_keys_and_overrides_still_win(tmp_path):
    c = cfg("experiment=resnet18")
    assert c.model._target_ == "repro.models.ResNet18" and c.amp.enabled
    assert (c.trainer.batch_size, c.trainer.micro_batch_size) == (256, 256)
    c = cfg("experiment=resnet18", "amp=off", "trainer.batch_size=512")
    assert not c.amp.enabled and c.trainer.batch_size == 512
    assert cfg().model._target_ == "repro.models.ConvNet"  # no preset by default
    # a preset comes after train.yaml itself: it may set any key, the seed included
    conf = shutil.copytree(CONF_DIR, tmp_path / "conf")
    (conf / "experiment" / "seeded.yaml").write_text("# @package _global_\nseed: 7\n")
    assert repro_compose(["experiment=seeded"], conf).seed == 7


@pytest.mark.e2e
@pytest.mark.parametrize(
    "run_dir, reason",
    [
        ("/sys/repro-run", ("Operation not permitted", "Read-only file system")),
        ("/proc/repro-run", ("No such file or directory",)),
        ("runs/" + "x" * 300, ("File name too long",)),
    ],
    ids=["read-only", "proc", "too-long"],
)
def test_a_run_directory_that_cannot_be_created_is_one_line(tmp_path, run_dir, reason):
    proc = launch.run(
        train_cmd(f"hydra.run.dir={run_dir}", "trainer.max_steps=1"),
        cwd=tmp_path,
        env=user_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("error: config error: hydra.run.dir=")
    assert any(r in proc.stderr for r in reason), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "choose another hydra.run.dir" in proc.stderr


def test_keys_a_schema_group_does_not_have_are_one_line():
    for override in ("trainer.bogus=1", "+trainer.bogus=1", "loader.workers=2", "amp.bogus.x=1"):
        with pytest.raises(ConfigError, match=r"is not a key of (trainer|loader|amp) \(known: "):
            check_overrides([override], CONF_DIR)
    check_overrides(["trainer.ema.decay=0.9", "+model.extra=1", "dist.timeout_s=5"], CONF_DIR)


# Every config error that advises a change: the bad command line, the advice as printed, and
# the command line that follows it. None: the advice is the overrides ending the message.
ADVICE = [
    (["model._target_=forked_project.TinyNet"], None, None),
    (["task._target_=forked_project.LabelSmoothing", "task.smoothing=0.2"], None, None),
    (["optim.fused=true"], "optim.fused=true optim.foreach=false", None),
    (["optim.foreach=null"], "optim.foreach=true", None),
    (["trainer.compile=reduce-overhead"], "use default", ["trainer.compile=default"]),
    (["trainer.resume=/nonexistent"], "trainer.resume=auto", None),
    (["data.augment=false"], "augment=none (none at all)", ["augment=none"]),
    (["trainer.batch_size=50"], "a multiple of the micro-batch size", ["trainer.batch_size=64"]),
    (["~model._target_"], "pick a preset (model=...)", ["model=convnet"]),
    (["~augment.train._target_"], ", or null for none", ["augment.train=null"]),
    (["data=image_folder"], "set data.path=...", ["data=image_folder", "data.path=/tmp"]),
]
if not torch.cuda.is_available():
    ADVICE.append((["device=cuda"], "device=cpu", None))


def _key(override: str) -> str:
    return override.lstrip("+~").split("=")[0]


@pytest.mark.parametrize("bad, printed, fixed", ADVICE, ids=[" ".join(c[0]) for c in ADVICE])
def test_every_advice_of_the_config_errors_works(bad, printed, fixed):
    """The advice a config error prints, followed as a user would: the command line it gives
    composes. Overrides the message spells out replace the bad ones of the same key."""
    with pytest.raises(ConfigError) as err:
        repro_compose(bad)
    message = str(err.value)
    assert "\n" not in message
    if printed is None:
        printed = message.rsplit(": ", 1)[1]
    assert printed in message, message
    if fixed is None:
        advice = shlex.split(printed)
        fixed = [b for b in bad if _key(b) not in map(_key, advice)] + advice
    repro_compose(fixed)
