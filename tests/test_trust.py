"""A received run directory is data (docs/trust.md): repro evaluate, predict, rerun and
confirm build nothing and launch nothing that its .hydra/overrides.yaml names and this
checkout does not hold, unless the user trusts it (--trust); a loader that runs the code a
file holds stays refused even then, unless named (--trust-loader). Each command's main runs
in this process; the check comes before anything else reads the directory, so a received
directory here is its .hydra/overrides.yaml (and a pickle whose unpickling makes a marker)."""

import json
import os
import pickle
import subprocess

import pytest

from conftest import preserved_global_state
from repro.base.errors import Untrusted
from repro.cli import main
from repro.records.trust import check_received

# Only what runs before the check reads these: small, should anything get that far
SMALL = ["data.train_size=256", "data.val_size=64", "data.test_size=64", "model.width=8"]


class Payload:
    """Unpickled, it makes the directory ``marker``: proof that the file's code ran."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def hostile(tmp_path, kind: str) -> list[str]:
    """Overrides that load a pickle from the received directory, one way or another."""
    payload = tmp_path / "weights.pkl"
    payload.write_bytes(pickle.dumps(Payload(tmp_path / "marker")))
    return {
        "torch.load": [
            "augment.eval._target_=torch.load",
            "~augment.eval.size",
            f"+augment.eval.f={payload}",
            "+augment.eval.weights_only=false",
        ],
        "numpy.load": [
            "augment.eval._target_=numpy.load",
            "~augment.eval.size",
            f"+augment.eval.file={payload}",
            "+augment.eval.allow_pickle=true",
        ],
        "interpolated": [  # the target spelled elsewhere, named by an interpolation
            "paths.data_dir=torch.load",
            "augment.eval._target_=${paths.data_dir}",
            "~augment.eval.size",
            f"+augment.eval.f={payload}",
        ],
    }[kind]


def received(tmp_path, command: str, overrides: list[str]):
    """A received run directory (a sweep of two finished trials for confirm), the arguments
    of ``repro COMMAND`` on it, and the record the refusal must name."""
    record = lambda d: d / ".hydra" / "overrides.yaml"  # noqa: E731

    def job(path, extra: list[str], value: float):
        record(path).parent.mkdir(parents=True)
        record(path).write_text("".join(f"- '{o}'\n" for o in [*SMALL, *overrides, *extra]))
        summary = {"headline": "val_accuracy", "val_accuracy": value}
        (path / "summary.json").write_text(json.dumps(summary))
        return path

    if command == "confirm":
        sweep = tmp_path / "sweep"
        job(sweep / "0_seed=0", ["optim.lr=0.1"], 0.5)
        best = job(sweep / "1_seed=0", ["optim.lr=0.2"], 0.6)  # rank 1: checked first
        return ["confirm", str(sweep), "--out", str(tmp_path / "out")], record(best)
    run = job(tmp_path / "run", [], 0.5)
    (tmp_path / "images").mkdir()
    args = {
        "evaluate": ["evaluate", str(run)],
        "predict": ["predict", str(run), str(tmp_path / "images"), "--out", f"{tmp_path}/p.csv"],
        "rerun": ["rerun", str(run), "--out", str(tmp_path / "out")],
    }[command]
    return args, record(run)


@pytest.fixture
def launches(monkeypatch):
    """What rerun and confirm would start (``python train.py ...``), recorded, not run
    (any other process, such as strict mode's probe of the hash seed, runs)."""
    started, real = [], subprocess.run

    def run(cmd, *args, **kwargs):
        if not any(str(c).endswith("train.py") for c in cmd):
            return real(cmd, *args, **kwargs)
        started.append(cmd)
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(subprocess, "run", run)
    return started


def repro_here(args, capsys) -> tuple[int, str]:
    with preserved_global_state():
        status = main(args)
    return status, capsys.readouterr().err


@pytest.mark.parametrize("command", ["evaluate", "predict", "rerun", "confirm"])
def test_a_received_torch_load_is_refused_by_every_command_and_its_pickle_never_runs(
    command, tmp_path, capsys, launches
):
    args, record = received(tmp_path, command, hostile(tmp_path, "torch.load"))
    status, err = repro_here(args, capsys)
    assert status == 2, err
    assert err == (
        f"repro {command}: {record} sets augment.eval._target_=torch.load without "
        "weights_only=true, a loader that runs the code the file it reads may hold, refused "
        "even with --trust (docs/trust.md): pass --trust-loader torch.load only if you trust "
        "that file.\n"
    )
    assert not (tmp_path / "marker").exists() and launches == []
    assert not (tmp_path / "out").exists() and not (tmp_path / "p.csv").exists()


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("numpy.load", "augment.eval._target_=numpy.load with allow_pickle=True, a loader"),
        ("interpolated", "augment.eval._target_=torch.load without weights_only=true, a "),
    ],
)
@pytest.mark.parametrize("command", ["evaluate", "rerun"])
def test_numpy_pickles_and_a_target_behind_an_interpolation_are_refused_too(
    command, kind, expected, tmp_path, capsys, launches
):
    args, record = received(tmp_path, command, hostile(tmp_path, kind))
    for trust in ([], ["--trust"]):
        status, err = repro_here([*args, *trust], capsys)
        assert status == 2 and err.startswith(f"repro {command}: {record} sets {expected}"), err
        assert len(err.splitlines()) == 1
    assert not (tmp_path / "marker").exists() and launches == []


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (  # Hydra instantiates its callbacks in the process rerun and confirm start
            ["+hydra.callbacks.x._target_=os.mkdir", "+hydra.callbacks.x.path=/tmp/m"],
            "sets +hydra.callbacks.x._target_=os.mkdir, one of Hydra's own settings",
        ),
        (["hydra.searchpath=[file:///tmp]"], "sets hydra.searchpath=[file:///tmp], one of"),
        (["+hydra.job.env_set.LD_PRELOAD=/tmp/x.so"], "sets +hydra.job.env_set.LD_PRELOAD"),
        (  # through the root package: the variable Hydra would set, as the line above
            ["+x@_global_.hydra.job.env_set={LD_PRELOAD:/tmp/x.so}"],
            "sets +x@_global_.hydra.job.env_set={LD_PRELOAD:/tmp/x.so}, one of Hydra's own",
        ),
        (["model@_global_.hydra.job=convnet"], "sets model@_global_.hydra.job=convnet, one of"),
        (["++hydra.callbacks.determinism._target_=os.getcwd"], "sets ++hydra.callbacks."),
        (["trainer.checkpoint_name=${oc.env:HOME}"], "whose ${oc.env:...} calls a resolver"),
        (["augment.eval._target_=builtins.exec"], "sets augment.eval._target_=builtins.exec,"),
        (["+augment.eval.x={_target_: os.system}"], "sets augment.eval.x._target_=os.system,"),
        (["augment.eval._target_=repro.cli.main"], "_target_=repro.cli.main, which is not in"),
        (  # an allowed name that is another's object
            ["augment.eval._target_=repro.data.augment.torch.load"],
            "=repro.data.augment.torch.load without weights_only=true",
        ),
        (["augment.eval._target_=pickle.loads"], "sets augment.eval._target_=pickle.loads, a"),
    ],
)
def test_hydra_settings_resolvers_and_targets_outside_the_checkout_are_refused(
    overrides, expected, tmp_path
):
    record = tmp_path / ".hydra" / "overrides.yaml"
    with pytest.raises(Untrusted, match="docs/trust.md") as refused:
        check_received(overrides, record)
    assert str(refused.value).startswith(f"{record} ") and expected in str(refused.value)
    assert len(str(refused.value).splitlines()) == 1


@pytest.mark.parametrize("target", ["runpy.run_path", "runpy.run_module"])
def test_runpy_runs_a_files_code_and_is_refused_even_with_trust(target, tmp_path):
    """Not left to Hydra's own blocklist (hydra-core 1.3.8 and later; >=1.3 is allowed)."""
    record = tmp_path / ".hydra" / "overrides.yaml"
    overrides = [f"augment.eval._target_={target}", "+augment.eval._args_=[/tmp/x.py]"]
    with pytest.raises(Untrusted, match=rf"sets augment.eval._target_={target}.*--trust-loader"):
        check_received(overrides, record, trust=True)
    check_received(overrides, record, trust=True, loaders=[target])  # named: the user's call


def test_trust_lets_a_harmless_target_through_but_a_loader_only_when_named(
    tmp_path, capsys, launches
):
    harmless = ["augment.eval._target_=augment_pipelines.Identity", "~augment.eval.size"]
    args, record = received(tmp_path, "rerun", harmless)
    status, err = repro_here(args, capsys)
    assert status == 2 and launches == [], err
    assert err.startswith(
        f"repro rerun: {record} sets augment.eval._target_=augment_pipelines.Identity, which "
        "is not in this checkout's src/ nor in the listed libraries (docs/trust.md); a "
        "received run directory does not run code: pass --trust if you wrote it"
    )
    status, err = repro_here([*args, "--trust"], capsys)
    assert len(launches) == 1  # the check let it through to train.py
    assert "augment.eval._target_=augment_pipelines.Identity" in launches[0]
    assert "the re-run failed" in err  # (the recorded launch "failed": nothing ran)
    args, _ = received(tmp_path / "loader", "rerun", hostile(tmp_path, "torch.load"))
    status, err = repro_here([*args, "--trust"], capsys)
    assert "pass --trust-loader torch.load" in err and len(launches) == 1
    status, err = repro_here([*args, "--trust", "--trust-loader", "torch.load"], capsys)
    assert len(launches) == 2, err  # the user named it: their call
    # and what the user types is theirs: a loader on the command line is still refused
    own = ["augment.eval._target_=torch.load", "~augment.eval.size"]
    with pytest.raises(Untrusted, match=r"^the command line sets augment.eval._target_=torch"):
        check_received([], record, own)
    check_received([], record, [*own, "+augment.eval.weights_only=true"])


def test_a_run_as_train_py_records_it_passes(traced_runs, tmp_path, capsys, launches):
    run = traced_runs["a"].dir  # its .hydra/overrides.yaml as Hydra wrote it
    status, err = repro_here(["rerun", str(run), "--out", str(tmp_path / "again")], capsys)
    assert len(launches) == 1 and "the re-run failed" in err, err
    check_received(["experiment=segmentation", "augment=torchvision"], tmp_path / "o.yaml")


@pytest.mark.parametrize("layout", ["inside", "beside", "linked"])
def test_a_received_directorys_own_conf_and_train_py_are_never_used(
    tmp_path, monkeypatch, capsys, launches, layout
):
    """A conf/ and train.py the sender put in the received directory (``cd RUN && repro
    rerun .``), beside it in the bundle it came in (``cd BUNDLE && repro rerun run``), or
    linked into it from elsewhere choose nothing: the checkout's compose the config and
    are launched."""
    import shutil
    from pathlib import Path

    from conftest import CONF_DIR, ROOT
    from repro.cli import _run_config

    args, record = received(tmp_path, "rerun", [])
    run = record.parent.parent
    planted = {"inside": run, "beside": run.parent, "linked": tmp_path / "elsewhere"}[layout]
    shutil.copytree(CONF_DIR, planted / "conf")
    text = (planted / "conf" / "train.yaml").read_text().replace("seed: 0 ", "seed: 4242 ")
    (planted / "conf" / "train.yaml").write_text(text)
    (planted / "train.py").write_text("raise SystemExit('the sender train.py ran')\n")
    if layout == "linked":
        (run / "conf").symlink_to(planted / "conf", target_is_directory=True)
        (run / "train.py").symlink_to(planted / "train.py")
    where = run.parent if layout == "beside" else run
    target = Path("run") if layout == "beside" else Path(".")
    monkeypatch.chdir(where)
    assert "seed: 4242" in text and int(_run_config(target, []).seed) == 0
    status, _ = repro_here(["rerun", str(target), "--out", str(tmp_path / "out")], capsys)
    assert status != 0 and len(launches) == 1  # the launch recorded, not run
    assert Path(launches[0][1]) == ROOT / "train.py"
