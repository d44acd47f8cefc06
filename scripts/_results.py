"""Shared by the benchmark scripts: write a result as dated markdown + JSON under --out."""

from __future__ import annotations

import datetime as dt
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any


def command_line() -> str:
    """The exact command that is running (``python scripts/<name> <args>``)."""
    return f"python scripts/{Path(sys.argv[0]).name} " + shlex.join(sys.argv[1:])


def today() -> str:
    return dt.date.today().isoformat()


def environment_line(env: dict[str, Any]) -> str:
    """Where it ran, for the markdown: the GPU with driver, SMs and versions, or the CPU."""
    if env.get("gpu"):
        return (
            f"{env['gpu']} (driver {env.get('gpu_driver')}, {env.get('gpu_sm_count')} SMs), "
            f"torch {env.get('torch')}, CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}"
        )
    return f"CPU {env.get('cpu')} ({env.get('cpu_count')} cores), torch {env.get('torch')}"


def result_stem(kind: str, date: str, env: dict[str, Any], devices: int = 1) -> str:
    """``<kind>-<date>-<gpu or cpu>`` (``<N>x<gpu>`` when ``devices`` GPUs took part)."""
    where = (env.get("gpu") or "cpu").replace(" ", "_")
    if devices > 1 and env.get("gpu"):
        where = f"{devices}x{where}"
    return f"{kind}-{date}-{where}"


def run_checked(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    """Run a command for a benchmark; its stdout. Exits with the command and the end of its
    stderr if it fails."""
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{shlex.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def run_json(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a peer script whose last line of output is one JSON object (:func:`run_checked`)."""
    return json.loads(run_checked(cmd, cwd, env).strip().splitlines()[-1])


def write_results(
    out: Path,
    kind: str,
    date: str,
    env: dict[str, Any],
    text: str,
    record: Any,
    devices: int = 1,
) -> None:
    """Print ``text`` and write ``<out>/<stem>.md`` and ``.json`` (:func:`result_stem`); a
    result already there (an earlier run the same day) is kept: the new one gets ``-2``,
    ``-3``, ... after the stem."""
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    base = stem = result_stem(kind, date, env, devices)
    n = 1
    while (out / f"{stem}.md").exists() or (out / f"{stem}.json").exists():
        n += 1
        stem = f"{base}-{n}"
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out / stem}.md/.json")
