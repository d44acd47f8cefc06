"""Shared by the benchmark scripts: write a result as dated markdown + JSON under --out."""

from __future__ import annotations

import datetime as dt
import json
import shlex
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


def write_results(
    out: Path,
    kind: str,
    date: str,
    env: dict[str, Any],
    text: str,
    record: Any,
    devices: int = 1,
) -> None:
    """Print ``text`` and write ``<out>/<kind>-<date>-<gpu or cpu>.md`` and ``.json``
    (``<N>x<gpu>`` when ``devices`` GPUs took part)."""
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    where = (env.get("gpu") or "cpu").replace(" ", "_")
    if devices > 1 and env.get("gpu"):
        where = f"{devices}x{where}"
    stem = f"{kind}-{date}-{where}"
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out / stem}.md/.json")
