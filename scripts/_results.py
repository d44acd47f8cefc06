"""Shared by the benchmark scripts: write a result as dated markdown + JSON under --out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_results(
    out: Path, kind: str, date: str, env: dict[str, Any], text: str, record: Any
) -> None:
    """Print ``text`` and write ``<out>/<kind>-<date>-<gpu or cpu>.md`` and ``.json``."""
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{kind}-{date}-{(env.get('gpu') or 'cpu').replace(' ', '_')}"
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out / stem}.md/.json")
