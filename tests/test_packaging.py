"""Packaging: environment.yml and pyproject.toml agree; CI calls the README's test command."""

import re
import tomllib

import yaml

from conftest import ROOT


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
    assert {"dev", "cifar10", "images"} <= project["optional-dependencies"].keys()
    assert {_name(r) for r in project["dependencies"]} == {
        "torch",
        "numpy",
        "hydra-core",
        "omegaconf",
    }


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make train" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
