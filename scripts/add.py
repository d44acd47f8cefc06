"""``make add PKG=...``: install a package (a model zoo) beside the installed torch, never
replacing it, and only what imports.

A plain ``pip install timm`` may replace the installed torch (another release, another
build, a CUDA stack of 20 packages); pinning torch as a constraint stops that, but pip still
picks torch's companions (torchvision, torchaudio: compiled against one torch build) by
version alone, so a CPU torch gets PyPI's CUDA torchvision, and ``import torchvision`` then
fails (``operator torchvision::nms does not exist``). So, in order:

1. read the installed torch's version and build (the local label: ``+cpu``, ``+cu130``, or
   none: PyPI's default build, CUDA on Linux x86_64);
2. resolve with pip without installing (``--dry-run --report``), torch pinned at the
   installed version (and an installed companion at its own), and print what it would
   install;
3. refuse, installing nothing, when a companion it would install or that a package needs
   is of another build than torch: print the command that installs a matching pair;
4. stop there under ``PIP_DRY_RUN=1``; else install exactly what was resolved, then import,
   in a fresh interpreter, what was asked for and the companions: a failure is printed with
   the exception's own message and the ``pip uninstall`` that undoes the install.

Usage: ``python scripts/add.py PKG [more packages or pip options]`` (``make add PKG=...``).
Exit status: 0 done (or dry run), 1 refused or failed, 2 usage (no package, no torch).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

# PyTorch's own packages with compiled operators: each build fits one torch build only.
COMPANIONS = ("torchvision", "torchaudio")
PYTORCH_INDEX = "https://download.pytorch.org/whl"
# what pip says when it reached no index at all (with retries) or none offered the package
NO_INDEX = r"Failed to establish|NewConnectionError|name resolution|unreachable|timed out"
NOT_OFFERED = r"\(from versions: none\)"
# top-level folders a distribution may ship that are not what it is for
NOT_PACKAGES = {"tests", "test", "docs", "examples", "benchmarks", "scripts"}
# pip options whose value is the next argument (the common ones), not a package
VALUED_OPTIONS = ("-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-c", "-r")


class Refused(Exception):
    """What to tell the user (a line, and the commands to run): why nothing (more) was done."""


class NoTorch(Refused):
    """No torch to install beside: a usage error."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def label(version: str) -> str:
    """The local version label: ``cpu`` of ``2.13.0+cpu``; "" for none."""
    return version.partition("+")[2]


def public(version: str) -> str:
    return version.partition("+")[0]


def build(label_: str, cuda: str | None = None) -> str:
    """A build in words, from its label (``cuda``: torch.version.cuda, known for torch)."""
    if label_ == "cpu":
        return "a CPU build"
    if re.fullmatch(r"cu\d{3,}", label_):
        return f"a CUDA {label_[2:-1]}.{label_[-1]} build"
    if label_.startswith("rocm"):
        return f"a ROCm {label_[4:]} build"
    if label_:
        return f"a +{label_} build"
    if cuda is not None:
        return f"PyPI's default build (CUDA {cuda})"
    return "PyPI's default build (CUDA on Linux x86_64)"


def requirements(metadata: dict) -> list[Requirement]:
    """A package's ``requires_dist`` (pip's report) that apply here: no extra's."""
    found = []
    for line in metadata.get("requires_dist") or []:
        try:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                found.append(req)
        except (InvalidRequirement, ValueError, KeyError):  # unparsable; a marker it cannot read
            continue
    return found


def torch_requirement(metadata: dict) -> Requirement | None:
    """The ``torch`` requirement of a package (pip's report), if it states one."""
    return next((r for r in requirements(metadata) if canonical(r.name) == "torch"), None)


def mismatch(
    name: str, version: str, metadata: dict, torch_version: str, torch_cuda: str | None
) -> str:
    """Why companion ``name`` at ``version`` does not fit the installed torch, or ""."""
    mine, theirs = label(torch_version), label(version)
    if mine != theirs:
        return (
            f"{name} {version} is {build(theirs)} and the installed torch {torch_version} is "
            f"{build(mine, torch_cuda)}: its compiled operators would not load"
        )
    req = torch_requirement(metadata)
    if req is None:
        return ""
    pinned = [s.version for s in req.specifier if s.operator == "==" and "+" in s.version]
    if any(label(v) != mine for v in pinned) or not req.specifier.contains(
        torch_version, prereleases=True
    ):
        return f"{name} {version} requires {req}, not the installed torch {torch_version}"
    return ""


def named(args: list[str]) -> set[str]:
    """The canonical names of the packages among pip's arguments (options left out)."""
    names, value_follows = set(), False
    for arg in args:
        if value_follows or arg.startswith("-"):
            value_follows = not value_follows and arg in VALUED_OPTIONS
            continue
        try:
            names.add(canonical(Requirement(arg).name))
        except InvalidRequirement:
            continue
    return names


def companion_problems(
    items: list[dict],
    installed: dict[str, str],
    asked: set[str],
    torch_version: str,
    cuda: str | None,
) -> dict[str, str]:
    """``{companion: why it does not fit}`` for each companion pip would install, and each
    installed one that an item to install needs or the user named."""
    problems, wanted = {}, set(asked)
    for item in items:
        meta = item["metadata"]
        name = canonical(meta["name"])
        if name == "torch":
            problems["torch"] = f"pip would replace torch {torch_version} by {meta['version']}"
        elif name in COMPANIONS:
            why = mismatch(name, meta["version"], meta, torch_version, cuda)
            if why:
                problems[name] = why
        wanted |= {canonical(r.name) for r in requirements(meta)}
    to_install = {canonical(i["metadata"]["name"]) for i in items}
    for name in sorted((wanted & set(COMPANIONS) & installed.keys()) - to_install):
        try:
            meta = {"requires_dist": importlib.metadata.requires(name) or []}
        except importlib.metadata.PackageNotFoundError:  # in the list, gone since
            meta = {}
        why = mismatch(name, installed[name], meta, torch_version, cuda)
        if why:
            problems[name] = f"the installed {why}"
    return problems


def pair_command(python: str, torch_version: str, companions: dict[str, str]) -> str:
    """The pip command that installs torch and ``companions`` (name: version) of one build,
    from PyTorch's index for that build (PyPI for the default build)."""
    mine = label(torch_version)
    suffix = f"+{mine}" if mine else ""
    pins = [f"{n}=={public(v)}{suffix}" for n, v in sorted(companions.items())]
    index = f"{PYTORCH_INDEX}/{mine}" if mine else "https://pypi.org/simple"
    return f"{python} -m pip install torch=={torch_version} {' '.join(pins)} --index-url {index}"


def import_names(dist: str) -> list[str]:
    """The top-level modules an installed distribution provides (its ``top_level.txt``, else
    its RECORD), without tests and private modules; its usual import name where neither
    says."""
    try:
        found = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        found = None
    names: set[str] = set()
    if found is not None:
        text = found.read_text("top_level.txt")
        if text:
            names = set(text.split())
        else:
            for path in found.files or []:
                parts = Path(path).parts
                if len(parts) == 1 and path.suffix == ".py":
                    names.add(path.stem)
                elif len(parts) > 1 and path.name == "__init__.py":
                    names.add(parts[0])
    names = {n for n in names if n.isidentifier() and not n.startswith("_")} - NOT_PACKAGES
    if names:
        return sorted(names)
    try:  # the known exceptions to "-" -> "_" (imports torch and Hydra: only when needed)
        from repro.defense.config import IMPORT_NAMES
    except ImportError:
        IMPORT_NAMES = {}
    return [IMPORT_NAMES.get(canonical(dist), canonical(dist).replace("-", "_"))]


CHECK = """
import importlib, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as err:
        lines = str(err).strip().splitlines() or [""]
        print(f"{name}\\t{type(err).__name__}: {lines[0]}", flush=True)
"""


def failed_imports(python: str, names: list[str]) -> dict[str, str]:
    """``{module: "Type: message"}`` of the ``names`` a fresh interpreter cannot import."""
    out = subprocess.run(
        [python, "-c", CHECK, *names], capture_output=True, text=True, env=_without_dry_run()
    )
    failed = dict(line.split("\t", 1) for line in out.stdout.splitlines() if "\t" in line)
    if out.returncode != 0 and not failed:  # the interpreter itself died (a crash on import)
        failed = {" ".join(names): f"exit status {out.returncode}: {out.stderr.strip()[-300:]}"}
    return failed


def _without_dry_run() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PIP_DRY_RUN", "PIP_REPORT")}


def dry_run_asked() -> bool:
    return os.environ.get("PIP_DRY_RUN", "").strip().lower() in ("1", "true", "yes", "on")


def resolve(python: str, args: list[str], pins: Path, work: Path) -> list[dict]:
    """What ``pip install -c pins ARGS`` would install (pip's report), installing nothing."""
    report = work / "report.json"
    command = [python, "-m", "pip", "install", "--dry-run", "-q", "--report", str(report)]
    out = subprocess.run([*command, "-c", str(pins), *args], capture_output=True, text=True)
    if out.returncode != 0:
        said = out.stdout + out.stderr
        errors = [x for x in said.splitlines() if x.startswith("ERROR:")] or said.splitlines()
        first = errors[0].removeprefix("ERROR: ").strip() if errors else "no output"
        if "no such option: --report" in said:
            raise Refused(f"this pip is too old for --report: {python} -m pip install -U pip")
        if re.search(NO_INDEX, said):
            raise Refused(f"no package index answers here ({first}); check the network")
        if re.search(NOT_OFFERED, said):
            raise Refused(
                f"no package index offers {' '.join(args)} ({first}): check its spelling, "
                "and that an index answers here (the network; pip config list)"
            )
        raise Refused(f"pip cannot resolve {' '.join(args)} beside the installed torch: {first}")
    return json.loads(report.read_text())["install"]


def installed_distributions() -> dict[str, str]:
    """``{canonical name: version}`` of what this interpreter has installed."""
    found = {}
    for dist in importlib.metadata.distributions():
        if dist.metadata["Name"]:  # a leftover folder without metadata has none
            found.setdefault(canonical(dist.metadata["Name"]), dist.version)
    return found


def shown(python: str) -> str:
    """The interpreter as the user would type it: relative to here when inside."""
    relative = os.path.relpath(python)
    return relative if not relative.startswith("..") else python


def add(args: list[str], python: str = sys.executable) -> None:
    """The whole of ``make add``; raises :class:`Refused` with the line to print."""
    try:
        torch = importlib.import_module("torch")
    except Exception as err:
        raise NoTorch(
            f"no usable torch in {shown(python)} ({err}): run make install first"
        ) from None
    torch_version, cuda = torch.__version__, torch.version.cuda
    print(f"pip install {' '.join(args)}, torch pinned at {torch_version}", flush=True)
    installed = installed_distributions()
    pins = [f"torch=={torch_version}"]
    pins += [f"{c}=={installed[c]}" for c in COMPANIONS if c in installed]
    with tempfile.TemporaryDirectory(prefix="make-add-") as tmp:
        work = Path(tmp)
        (work / "pins.txt").write_text("\n".join(pins) + "\n")
        items = resolve(python, args, work / "pins.txt", work)
        resolved = [(i["metadata"]["name"], i["metadata"]["version"]) for i in items]
        if resolved:
            print("Would install " + " ".join(f"{n}-{v}" for n, v in resolved), flush=True)
        asked = named(args)
        problems = companion_problems(items, installed, asked, torch_version, cuda)
        if problems:
            raise refusal(python, args, problems, items, installed, torch_version)
        if dry_run_asked():
            print("dry run (PIP_DRY_RUN): nothing installed")
            return
        if resolved:
            (work / "resolved.txt").write_text(
                "\n".join([*pins, *(f"{n}=={v}" for n, v in resolved)]) + "\n"
            )
            command = [python, "-m", "pip", "install", "-c", str(work / "resolved.txt"), *args]
            if subprocess.run(command, env=_without_dry_run()).returncode != 0:
                raise Refused("pip install failed (above)")
    importlib.invalidate_caches()
    check_imports(python, items, installed, asked)


def refusal(
    python: str,
    args: list[str],
    problems: dict[str, str],
    items: list[dict],
    installed: dict[str, str],
    torch_version: str,
) -> Refused:
    """The refusal: why, and the commands that install a matching pair and then ``args``."""
    versions = {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in items}
    pair = {c: versions.get(c) or installed[c] for c in problems if c in COMPANIONS}
    lines = [f"refused, nothing installed: {'; '.join(problems.values())}."]
    if pair:
        lines += [
            "Install a matching pair first (this torch again, and the companion of its build):",
            f"  {pair_command(shown(python), torch_version, pair)}",
            f"then again: make add PKG={shlex.quote(' '.join(args))}",
        ]
    return Refused("\n".join(lines))


def check_imports(python: str, items: list[dict], installed: dict, asked: set[str]) -> None:
    """Import what was asked for and the companions in a fresh interpreter: "ok: ..." or
    :class:`Refused` with each failure and the commands that undo the install."""
    new = {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in items}
    requested = {canonical(i["metadata"]["name"]) for i in items if i.get("requested")}
    now = installed_distributions()
    dists = [c for c in COMPANIONS if c in new or (c in installed and c in asked)]
    dists += sorted((requested | (asked & now.keys())) - set(dists))
    names = list(dict.fromkeys(n for d in dists for n in import_names(d)))
    if not names:
        print("ok: nothing to install or import")
        return
    failed = failed_imports(python, names)
    if not failed:
        print(f"ok: imported {', '.join(names)}")
        return
    lines = [f"import {name} fails ({why})" for name, why in failed.items()]
    if new:
        fresh = sorted(n for n in new if n not in installed)
        replaced = sorted(f"{n}=={installed[n]}" for n in new if n in installed)
        undo = f"{shown(python)} -m pip uninstall -y {' '.join(fresh)}" if fresh else ""
        if replaced:
            undo += f"{' && ' if undo else ''}{shown(python)} -m pip install {' '.join(replaced)}"
        lines.append(f"installed {', '.join(f'{n}-{v}' for n, v in new.items())}; to undo: {undo}")
    if set(failed) & {n for c in COMPANIONS for n in import_names(c)}:
        lines.append("a companion's build must match torch's: make add PKG=torchvision explains")
    raise Refused("\n".join(lines))


def main(argv: list[str]) -> int:
    if not argv:
        print("make add: give the package, e.g. make add PKG=timm", file=sys.stderr)
        return 2
    try:
        add(argv)
    except Refused as err:
        print(f"make add: {err}", file=sys.stderr)
        return 2 if isinstance(err, NoTorch) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
