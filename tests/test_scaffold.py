"""``repro new``: a fork's project in one command, in a copy of this checkout. Its generated
test passes there (the promise, checked for the fork's experiment), the template's config
tests stay green with the fork's YAMLs in conf/, its runs are marked dirty until the new
files are committed; nothing is overwritten; ``--remove-examples`` leaves no broken link."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, broken_links, compose_every_option, user_env
from optional import usable
from repro.tools.scaffold import FILES, TASKS, remove_examples

HAS_RUFF = usable("ruff") is None


def free_name() -> str:
    """A project name this checkout does not have and cannot import: ``mylab``, unless a fork
    of the template took it (then ``mylab2``...)."""
    import importlib.util

    for n in range(1, 100):
        name = "mylab" if n == 1 else f"mylab{n}"
        taken = (ROOT / "src" / name).exists() or (
            ROOT / "conf" / "model" / f"{name}.yaml"
        ).exists()
        if not taken and importlib.util.find_spec(name) is None:
            return name
    raise AssertionError("no free project name")


def project_copy(dest):
    """This checkout's files (tracked, and new ones not ignored) in ``dest``, committed in a
    fresh git repository there, as a fork's clone is."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    git = ["git", "-C", str(dest), "-c", "user.name=fork", "-c", "user.email=fork@example.com"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "fork"], check=True)
    return dest


def in_copy(copy, *args, timeout=600):
    """A command in the copy, importing the copy's packages (its src/ first on the path)."""
    env = user_env(
        PYTHONPATH=os.pathsep.join([str(copy / "src"), os.environ.get("PYTHONPATH", "")])
    )
    return subprocess.run(args, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.e2e
def test_repro_new_writes_a_project_whose_own_test_and_the_templates_config_tests_pass(
    tmp_path, monkeypatch
):
    name = free_name()
    copy = project_copy(tmp_path / "fork")
    new = in_copy(copy, sys.executable, "-m", "repro", "new", name)
    assert new.returncode == 0, new.stderr
    expected = [path.format(name=name) for path in FILES]
    assert [line.removeprefix("wrote ") for line in new.stdout.splitlines()[:-1]] == expected
    assert all((copy / p).is_file() for p in expected)
    # a second time: refused in one line, nothing changed
    before = {p: (copy / p).read_bytes() for p in expected}
    again = in_copy(copy, sys.executable, "-m", "repro", "new", name)
    assert again.returncode == 2 and again.stdout == ""
    assert again.stderr == (
        f"repro new: {copy / 'src' / name / '__init__.py'} exists; nothing was written (choose "
        "another name, or move the files away).\n"
    )
    assert {p: (copy / p).read_bytes() for p in expected} == before
    # the generated code passes the template's lint
    if HAS_RUFF:  # a dev extra (a GPU image may lack it: the rest runs)
        lint = in_copy(
            copy, sys.executable, "-m", "ruff", "check", f"src/{name}", f"tests/test_{name}.py"
        )
        assert lint.returncode == 0, lint.stdout
    # a segmentation project beside it: a UNet on an image and mask folder
    seg = f"{name}_cells"
    new_seg = in_copy(copy, sys.executable, "-m", "repro", "new", seg, "--task", "segmentation")
    assert new_seg.returncode == 0, new_seg.stderr
    seg_files = [path.format(name=seg) for path in TASKS["segmentation"]]
    assert [line.removeprefix("wrote ") for line in new_seg.stdout.splitlines()[:-1]] == seg_files
    assert f"python -m {seg}.data data/{seg}" in new_seg.stdout.splitlines()[-1]
    if HAS_RUFF:  # a dev extra (a GPU image may lack it: the rest runs)
        lint = in_copy(
            copy, sys.executable, "-m", "ruff", "check", f"src/{seg}", f"tests/test_{seg}.py"
        )
        assert lint.returncode == 0, lint.stdout
    # the generated tests: their runs are `python train.py experiment=NAME ...` in the fork
    runs = tmp_path / "runs"
    tests = in_copy(
        copy,
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--basetemp={runs}",
        f"tests/test_{name}.py",
        f"tests/test_{seg}.py",
    )
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    assert "8 passed" in tests.stdout, tests.stdout
    seg_run = json.loads(next(runs.glob(f"{seg}[0-9]*/reference/summary.json")).read_text())
    assert seg_run["headline"] == "val_dice" and "val_dice_disc" in seg_run
    # until committed, the new files mark each run dirty, named with their digests
    found = sorted(runs.glob(f"{name}[0-9]*/reference"))
    assert len(found) == 1, found
    reference = found[0]
    git = json.loads((reference / "env.json").read_text())["git"]
    assert git["dirty"] is True and f"src/{name}/models.py" in git["untracked"]
    assert f"conf/experiment/{name}.yaml" in git["untracked"]
    # and the template's tests that read conf/ stay green with the fork's YAMLs in it
    monkeypatch.syspath_prepend(str(copy / "src"))  # the fork's package, as its tests see it
    results = {g: compose_every_option(g, copy / "conf") for g in ("model", "data", "task")}
    assert all(results[g][name] == "ok" for g in results), results
    assert all(results[g][seg] == "ok" for g in ("model", "task")), results
    assert results["data"][seg] == (  # its folder (data/NAME) is not in the copy
        f"skipped data={seg}: its data.path is not on this machine"
    )
    experiments = compose_every_option("experiment", copy / "conf")
    assert experiments[name] == "ok"
    assert experiments[seg] == f"skipped experiment={seg}: its data.path is not on this machine"
    for module in [m for m in sys.modules if m.split(".")[0] in (name, seg)]:
        del sys.modules[module]  # the fork's packages: not this checkout's


def test_repro_new_refuses_bad_names_before_writing_anything(tmp_path):
    from repro.base.errors import ReproError
    from repro.tools.scaffold import new_project

    for folder in ("conf", "src", "tests"):
        (tmp_path / folder).mkdir()
    for name, message in (
        ("My-Lab", "is not a valid project name; use a lowercase Python identifier"),
        ("class", "is not a valid project name"),
        ("torch", "'torch' is already an importable module here; choose another name"),
        ("winreg", "'winreg' is a module of Python's standard library"),  # Windows only
        ("on", "is not a valid project name"),  # YAML reads it as true
        ("nan", "Hydra reads experiment=nan as nan \\(float\\), not the name"),
        ("inf", "Hydra reads experiment=inf as inf \\(float\\), not the name"),
        ("a" * 300, "a project name of 300 characters is too long"),
    ):
        with pytest.raises(ReproError, match=message):
            new_project(name, tmp_path)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["conf", "src", "tests"]
    name = free_name()
    (tmp_path / "conf" / "task").mkdir()
    (tmp_path / "conf" / "task" / f"{name}.yaml").write_text("mine\n")
    with pytest.raises(ReproError, match=f"conf/task/{name}.yaml exists; nothing was written"):
        new_project(name, tmp_path)
    assert not (tmp_path / "src" / name).exists()
    assert (tmp_path / "conf" / "task" / f"{name}.yaml").read_text() == "mine\n"


def test_repro_new_refuses_a_name_a_module_beside_train_py_takes(tmp_path):
    """`python train.py` puts the checkout's folder first on the path: a project named as a
    script there (train.py itself, or one of the fork's own) could not be imported."""
    from repro.base.errors import ReproError
    from repro.tools.scaffold import new_project

    for folder in ("conf", "src", "tests"):
        (tmp_path / folder).mkdir()
    name = free_name()
    (tmp_path / f"{name}.py").write_text("")
    with pytest.raises(ReproError, match=f"{name}.py is what `import {name}` finds when train"):
        new_project(name, tmp_path)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["conf", f"{name}.py", "src", "tests"]


def test_repro_new_refusals_are_one_line_and_exit_status_2(tmp_path, monkeypatch, capsys):
    from repro.cli import main

    for folder in ("conf", "src", "tests"):
        (tmp_path / folder).mkdir()
    monkeypatch.setattr("repro.defense.config.find_conf_dir", lambda: tmp_path / "conf")
    for name in ("nan", "a" * 300, "winreg"):
        assert main(["new", name]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith("repro new: ") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["conf", "src", "tests"]


def test_repro_new_writes_all_its_files_or_none(tmp_path, monkeypatch):
    """A file that cannot be written (a read-only conf/task/, a full disk) after others were:
    what this call wrote and the folders it made are removed, what was there is kept."""
    import builtins

    from repro.base.errors import ReproError
    from repro.tools.scaffold import FILES, new_project

    for folder in ("conf/model", "src", "tests"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "conf" / "model" / "mine.yaml").write_text("mine\n")
    before = sorted(tmp_path.rglob("*"))
    name = free_name()
    calls = []

    def refuse_the_fourth(path, mode="r", *args, **kwargs):
        calls.append(path)
        if len(calls) == 4:
            raise PermissionError(13, "Permission denied", str(path))
        return builtins.open(path, mode, *args, **kwargs)

    monkeypatch.setattr("repro.tools.scaffold.open", refuse_the_fourth, raising=False)
    with pytest.raises(ReproError) as err:
        new_project(name, tmp_path)
    message = str(err.value)
    assert message.startswith(f"{calls[3]}: cannot be written (Permission denied); nothing was")
    assert len(message.splitlines()) == 1 and len(FILES) > 4
    assert sorted(tmp_path.rglob("*")) == before
    assert (tmp_path / "conf" / "model" / "mine.yaml").read_text() == "mine\n"
    monkeypatch.undo()
    assert len(new_project(name, tmp_path)) == len(FILES)  # and it can be run again


def test_repro_new_names_the_folder_it_could_not_make(tmp_path, monkeypatch):
    """A read-only conf/ (conf/model/ cannot be made) after src/NAME/ was written: that is
    removed, and the line names conf/model and the folder to make writable."""
    from pathlib import Path

    from repro.base.errors import ReproError
    from repro.tools.scaffold import new_project

    for folder in ("conf", "src", "tests"):
        (tmp_path / folder).mkdir()
    mkdir, refused = Path.mkdir, tmp_path / "conf" / "model"

    def refuse_conf_model(self, *args, **kwargs):
        if self == refused:
            raise PermissionError(13, "Permission denied", str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refuse_conf_model)
    with pytest.raises(ReproError) as err:
        new_project(free_name(), tmp_path)
    assert str(err.value).startswith(
        f"{refused}: cannot be written (Permission denied); nothing was written: make "
        f"{tmp_path / 'conf'} writable"
    )
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["conf", "src", "tests"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_repro_new_into_a_read_only_folder_writes_nothing(tmp_path):
    from repro.base.errors import ReproError
    from repro.tools.scaffold import new_project

    for folder in ("conf/task", "src", "tests"):
        (tmp_path / folder).mkdir(parents=True)
    before = sorted(tmp_path.rglob("*"))
    (tmp_path / "conf" / "task").chmod(0o555)
    try:
        with pytest.raises(ReproError, match=r"conf/task/\w+\.yaml: cannot be written"):
            new_project(free_name(), tmp_path)
    finally:
        (tmp_path / "conf" / "task").chmod(0o755)
    assert sorted(tmp_path.rglob("*")) == before


def test_remove_examples_removes_the_dated_records_once_and_leaves_no_broken_link(tmp_path):
    """On a made-up tree: dated records (a file, a folder) go, an undated file stays; links
    to them become their text, an image of them goes, other links stay; a second call
    refuses (what benchmarks/ holds then is the project's own)."""
    from repro.base.errors import ReproError

    bench, docs = tmp_path / "benchmarks", tmp_path / "docs"
    (bench / "sweep-2026-01-02-cpu").mkdir(parents=True)
    (bench / "sweep-2026-01-02-cpu" / "report.png").write_bytes(b"png")
    (bench / "run-2026-01-01-cpu.md").write_text("numbers\n")
    (bench / "notes.txt").write_text("kept\n")
    (bench / "README.md").write_text("# Measurements\n\n| `run-2026-01-01-cpu.md` | x |\n")
    docs.mkdir()
    (docs / "results.md").write_text(
        "See [the run](../benchmarks/run-2026-01-01-cpu.md) and [the index]"
        "(../benchmarks/README.md).\n![curves](../benchmarks/sweep-2026-01-02-cpu/report.png)\n"
    )
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "README.md").write_text("[docs](../docs/results.md)\n")
    (tmp_path / "README.md").write_text("[results](docs/results.md#x)\n")
    assert broken_links(tmp_path) == []
    removed = remove_examples(tmp_path)
    assert [p.name for p in removed] == ["run-2026-01-01-cpu.md", "sweep-2026-01-02-cpu"]
    assert sorted(p.name for p in bench.iterdir()) == ["README.md", "notes.txt"]
    assert (docs / "results.md").read_text() == (
        "See the run and [the index](../benchmarks/README.md).\n\n"
    )
    assert broken_links(tmp_path) == []
    with pytest.raises(ReproError, match=r"removed already; .* \(nothing was removed\)"):
        remove_examples(tmp_path)
    assert sorted(p.name for p in bench.iterdir()) == ["README.md", "notes.txt"]


def test_remove_examples_on_this_checkouts_docs_leaves_no_broken_link(tmp_path):
    """The template's own records and docs, copied: every dated record goes, every link
    still resolves. (In a fork that removed them already there is nothing left to check.)"""
    if (
        "removed by `repro new --remove-examples`"
        in (ROOT / "benchmarks" / "README.md").read_text()
    ):
        pytest.skip("this checkout's benchmark records were removed already")
    for part in ("benchmarks", "docs"):
        shutil.copytree(ROOT / part, tmp_path / part)
    (tmp_path / "tests").mkdir()
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copy(ROOT / "tests" / "README.md", tmp_path / "tests" / "README.md")
    before = set(broken_links(tmp_path))
    removed = remove_examples(tmp_path)
    assert removed and all(re.search(r"-\d{4}-\d{2}-\d{2}-", p.name) for p in removed)
    assert set(broken_links(tmp_path)) <= before  # links into the copy's neighbours aside
