"""Packaging: environment.yml and pyproject.toml agree; CI calls the README's test command."""

import ast
import re
import subprocess
import sys
import tomllib

import pytest
import torch
import yaml

from conftest import ROOT, broken_links, user_env


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


@pytest.mark.e2e
def test_make_add_installs_a_zoo_beside_the_installed_torch_without_replacing_it():
    """pip's dry run (PIP_DRY_RUN=1) of ``make add PKG=timm``: timm, and the torchvision that
    fits the installed torch; torch itself is not replaced (a plain ``pip install timm``
    would bring another torch and a CUDA stack). Skipped in one line where no package index
    answers."""
    command = ["make", "-s", "add", "PKG=timm", f"PY={sys.executable}"]
    out = subprocess.run(
        command,
        cwd=ROOT,
        env=user_env(PIP_DRY_RUN="1", PIP_TIMEOUT="10", PIP_RETRIES="0"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    # only timm itself not found, or the network: a torchvision that does not fit is a failure
    offline = r"for timm \(from versions: none\)|Failed to establish|unreachable|name resolution"
    if out.returncode != 0 and re.search(offline, out.stdout + out.stderr):
        pytest.skip("no package index answers here: make add was not tried")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.startswith(f"pip install timm, torch pinned at {torch.__version__}")
    line = next(x for x in out.stdout.splitlines() if x.startswith("Would install"))
    packages = line.split()[2:]
    assert any(p.startswith("timm-") for p in packages), line
    assert not any(p.startswith(("torch-", "nvidia-", "triton-")) for p in packages), line
