"""Packaging: environment.yml and pyproject.toml agree; CI calls the README's test command."""

import ast
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tomllib

import pytest
import torch
import yaml

from conftest import ROOT, broken_links, user_env
from optional import usable


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;]", requirement.strip(), maxsplit=1)[0].lower()


def test_environment_yml_lists_the_core_dependencies_of_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {r.replace(" ", "") for r in project["dependencies"]}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    listed = {r.replace(" ", "") for r in pip if not r.startswith("-e")}
    assert listed == core  # same packages, same version ranges
    assert any(r.startswith("-e .[dev]") for r in pip)
    assert "python=3.11" in env["dependencies"] and "pip" in env["dependencies"]


def test_console_command_and_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["repro"] == "repro.cli:main"
    assert {"dev", "images"} <= project["optional-dependencies"].keys()
    assert "cifar10" not in project["optional-dependencies"]  # read without torchvision
    assert {_name(r) for r in project["dependencies"]} == {
        "torch",
        "numpy",
        "hydra-core",
        "omegaconf",
        "scipy",  # the statistics of repro report
    }


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make train" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_make_test_starts_pytest_with_what_the_suite_pins():
    """The Makefile gives pytest the environment conftest pins, so pytest starts once; were
    they to drift apart, every `make test` would pay for a second start."""
    from conftest import PINNED, SESSION

    makefile = (ROOT / "Makefile").read_text()
    given = re.search(r"^TEST_ENV := (.*)$", makefile, re.M)
    assert given, "Makefile: no TEST_ENV line"
    assert dict(kv.split("=", 1) for kv in given.group(1).split()) == {**PINNED, **SESSION}
    for target in ("test", "test-fast", "test-cuda"):
        recipe = re.search(rf"^{target}:.*\n\t(.*)$", makefile, re.M)
        assert recipe and recipe.group(1).startswith("$(TEST_ENV) "), target


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tests" / "README.md"]


def test_the_readme_fits_a_page_and_every_doc_link_resolves():
    assert len((ROOT / "README.md").read_bytes()) <= 15_000
    assert broken_links() == []


def test_no_issue_numbers_in_code_or_docs():
    files = [
        *DOCS,
        ROOT / "train.py",
        *(ROOT / "src").rglob("*.py"),
        *(ROOT / "conf").rglob("*.yaml"),
    ]
    files += [p for p in (ROOT / "scripts").glob("*") if p.is_file()]  # not __pycache__/
    files += [ROOT / "benchmarks" / "README.md"]
    for f in files:
        found = re.search(r"\bissues?[ -]?#?\d+", f.read_text(), re.IGNORECASE)
        assert not found, f"{f.relative_to(ROOT)}: {found.group(0)}"


def test_no_function_in_the_package_is_longer_than_100_lines():
    for path in (ROOT / "src" / "repro").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                assert length <= 100, f"{path.name}:{node.lineno} {node.name}: {length} lines"


def test_the_package_and_scripts_do_not_edit_sys_path():
    for path in [*(ROOT / "src").rglob("*.py"), *(ROOT / "scripts").glob("*.py")]:
        assert "sys.path" not in path.read_text(), path.name


def load_add():
    """scripts/add.py (``make add``) as a module."""
    spec = importlib.util.spec_from_file_location("add", ROOT / "scripts" / "add.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def label(version: str) -> str:
    return version.partition("+")[2]


@pytest.mark.e2e
def test_make_add_installs_a_zoo_beside_the_installed_torch_or_refuses_a_companion_that_misfits():
    """pip's dry run (PIP_DRY_RUN=1) of ``make add PKG=timm``: timm, and the torchvision that
    fits the installed torch's version; torch itself is not replaced (a plain ``pip install
    timm`` would bring another torch and a CUDA stack). A torchvision of another build than
    torch's (PyPI's default, CUDA, beside a CPU torch: its import fails) is refused, nothing
    installed, with the command that installs a matching pair. Skipped in one line where no
    package index answers, or where timm is already installed, usable or not (a fork's
    environment: make add then says so and stops)."""
    why = usable("timm")
    if why != "not installed":
        pytest.skip(f"timm is already installed here ({why or 'usable'}): make add PKG=timm stops")
    command = ["make", "-s", "add", "PKG=timm", f"PY={sys.executable}"]
    out = subprocess.run(
        command,
        cwd=ROOT,
        env=user_env(PIP_DRY_RUN="1", PIP_TIMEOUT="10", PIP_RETRIES="0"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode != 0 and re.search(
        r"make add: no package index (answers|offers)", out.stderr
    ):
        pytest.skip("no package index answers here: make add was not tried")
    assert out.stdout.startswith(f"pip install timm, torch pinned at {torch.__version__}")
    line = next(x for x in out.stdout.splitlines() if x.startswith("Would install"))
    packages = line.split()[2:]
    assert any(p.startswith("timm-") for p in packages), line
    assert not any(p.startswith(("torch-", "nvidia-", "triton-")) for p in packages), line
    chosen = [p.removeprefix("torchvision-") for p in packages if p.startswith("torchvision-")]
    try:
        companion = chosen[0] if chosen else importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:
        companion = None
    if companion is None or label(companion) == label(torch.__version__):
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        assert "nothing installed" in out.stdout
        return
    assert out.returncode != 0 and "make add: refused, nothing installed: " in out.stderr
    assert f"torchvision {companion} is " in out.stderr, out.stderr
    suffix = f"+{label(torch.__version__)}" if label(torch.__version__) else ""
    pair = f"torch=={torch.__version__} torchvision=={companion.partition('+')[0]}{suffix}"
    assert f" -m pip install {pair} --index-url https://" in out.stderr, out.stderr
    assert "\nthen again: make add PKG=timm\n" in out.stderr, out.stderr


def item(name: str, version: str, *requires: str, requested: bool = False) -> dict:
    """One entry of pip's ``--report``, as much of it as make add reads."""
    metadata = {"name": name, "version": version, "requires_dist": list(requires)}
    return {"metadata": metadata, "requested": requested}


def test_add_refuses_a_companion_whose_build_is_not_torchs():
    """The rule ``make add`` applies to pip's choice: a companion (torchvision) fits the
    installed torch when their local labels agree (+cpu with +cpu; none, PyPI's default
    build, with none) and its ``torch==`` requirement, where it pins a build, names torch's;
    the fix is the pair from PyTorch's index for torch's build."""
    add = load_add()
    zoo = item("timm", "1.0", "torch", "torchvision", requested=True)

    def problems(torch_version, torchvision, *requires, cuda=None, installed=None):
        items = [zoo, item("torchvision", torchvision, *requires)] if torchvision else [zoo]
        return add.companion_problems(items, installed or {}, {"timm"}, torch_version, cuda)

    why = problems("2.13.0+cpu", "0.28.0")["torchvision"]
    assert "torchvision 0.28.0 is PyPI's default build" in why and "+cpu is a CPU build" in why
    assert problems("2.13.0+cpu", "0.28.0+cpu", "torch==2.13.0") == {}
    assert problems("2.13.0", "0.28.0", "torch==2.13.0", cuda="13.0") == {}
    assert "CUDA 12.8 build" in problems("2.13.0+cu130", "0.28.0+cu128")["torchvision"]
    pinned = problems("2.13.0+cpu", "0.28.0+cpu", "torch==2.13.0+cu130")["torchvision"]
    assert "requires torch==2.13.0+cu130" in pinned
    assert problems("2.13.0+cpu", "0.28.0+cpu", "torch==2.13.0+cu130; extra == 'x'") == {}
    # installed already, of another build: refused when the zoo needs it, else left alone
    installed = {"torchvision": "0.28.0"}
    assert (
        "the installed torchvision 0.28.0 is"
        in problems("2.13.0+cpu", None, installed=installed)["torchvision"]
    )
    alone = [item("finezoo", "1.0", "numpy", requested=True)]
    assert add.companion_problems(alone, installed, {"finezoo"}, "2.13.0+cpu", None) == {}
    assert add.pair_command("py", "2.13.0+cpu", {"torchvision": "0.28.0"}) == (
        "py -m pip install torch==2.13.0+cpu torchvision==0.28.0+cpu "
        "--index-url https://download.pytorch.org/whl/cpu"
    )
    assert add.pair_command("py", "2.13.0+cu130", {"torchvision": "0.28.0"}).endswith(
        "torchvision==0.28.0+cu130 --index-url https://download.pytorch.org/whl/cu130"
    )


def test_add_names_a_package_that_installs_but_does_not_import_and_how_to_undo(
    tmp_path, monkeypatch
):
    """After the install, what was asked for is imported in a fresh interpreter: a package
    whose import raises is named with the exception's own message, and the ``pip uninstall``
    of what was just installed; one that imports is "ok: imported ..."."""
    add = load_add()
    for package, body in [("brokenzoo", 'raise RuntimeError("operator x::y does not exist")'),
                          ("finezoo", "")]:  # fmt: skip
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(body + "\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(add.Refused) as err:
        add.check_imports(sys.executable, [item("brokenzoo", "0.1", requested=True)], {}, set())
    lines = str(err.value).splitlines()
    assert lines[0] == "import brokenzoo fails (RuntimeError: operator x::y does not exist)"
    assert lines[1].endswith(" -m pip uninstall -y brokenzoo")
    add.check_imports(sys.executable, [item("finezoo", "0.1", requested=True)], {}, set())


@pytest.mark.e2e
def test_add_without_an_index_is_one_line(tmp_path, capsys, monkeypatch):
    """No index answers (none configured, no local wheels): one line, exit 1, nothing done."""
    add = load_add()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no index, constraint, find-links
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))  # an empty folder
    zoo = "repro-zoo-not-installed-anywhere"  # not timm: a fork may hold it, in any state
    assert add.main([zoo]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"make add: no package index offers {zoo}") and "\n" not in err


@pytest.mark.e2e
def test_a_forks_environment_with_a_broken_companion_and_a_zoo_collects_and_skips(tmp_path):
    """A fork's environment may hold any optional package, in any state: here, first on
    PYTHONPATH, a torchvision whose import raises (as PyPI's CUDA build does beside a CPU
    torch) and a timm that imports. The whole suite still collects, and the tests that probe
    torchvision skip saying its import fails (make add's test: that timm is there) -- none
    fails, none assumes either absent."""
    stubs = tmp_path / "stubs"
    for package, body in [
        ("torchvision", 'raise RuntimeError("operator torchvision::nms does not exist")'),
        ("timm", '"""A stand-in for the zoo: imports, holds nothing."""'),
    ]:
        (stubs / package).mkdir(parents=True)
        (stubs / package / "__init__.py").write_text(body + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(stubs), os.environ.get("PYTHONPATH", "")])
    probes = "(torchvision or make_add) and not without_torchvision"  # cifar: no probe
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-k", probes]
        + [f"--basetemp={tmp_path / 'inner'}", "tests"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]  # none failed
    skips = [x for x in out.stdout.splitlines() if x.startswith("SKIPPED")]
    broken = "import fails: RuntimeError: operator torchvision::nms does not exist"
    for name in ["augment", "config", "forking", "intensity", "pipeline_check"]:
        assert any(f"tests/test_{name}.py" in x and broken in x for x in skips), name
    assert any("test_packaging.py" in x and "timm is already installed" in x for x in skips)
