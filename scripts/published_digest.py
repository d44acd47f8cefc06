#!/usr/bin/env python
"""Is this machine the one the README's default-run digest was measured on?

`make train` runs this after the default run. The digest a CPU gives depends on what decides
its kernels: the CPU model and its vector-ISA flags (AVX-512, AMX...: PyTorch and oneDNN pick
kernels by them, and two CPUs reporting one ``cpu_capability`` can still differ), the intra-op
thread count, and the PyTorch build. ``benchmarks/default-run.json`` records those entries
beside the digest; this script compares them with this machine's and says what to expect:

    python scripts/published_digest.py              # the newest run under outputs/
    python scripts/published_digest.py RUN_DIR      # that run
    python scripts/published_digest.py --record RUN_DIR   # publish RUN_DIR's digest (maintainers)

A different entry means another digest is expected, not an error: `make verify` checks the
promise on this machine (twice, and with loader workers: the same bits).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "benchmarks" / "default-run.json"
# The env.json entries that decide a CPU run's bits, as (section, key, what to call it).
DECIDING = (
    ("environment", "cpu", "CPU model"),
    ("environment", "cpu_capability", "PyTorch's CPU capability"),
    ("environment", "cpu_isa", "vector-ISA flags"),
    ("environment", "cpu_dispatch_limits", "ISA limits set in the environment"),
    ("flags", "intra_op_threads", "intra-op threads"),
    ("environment", "torch", "torch"),
    ("environment", "cuda", "CUDA"),
    ("environment", "gpu", "GPU"),
)


def deciding(env: dict[str, Any]) -> dict[str, Any]:
    """The entries of an ``env.json`` that decide the default run's bits."""
    return {key: env.get(section, {}).get(key) for section, key, _ in DECIDING}


def newest_run(outputs: Path) -> Path | None:
    """The newest finished run directory under ``outputs`` (by its summary's time)."""
    runs = [p.parent for p in outputs.glob("*/*/summary.json")]
    return max(runs, key=lambda p: (p / "summary.json").stat().st_mtime, default=None)


def describe(entries: dict[str, Any]) -> str:
    isa = entries.get("cpu_isa") or []
    amx = [f for f in isa if f.startswith("amx")]
    return (
        f"{entries.get('cpu')}, {entries.get('cpu_capability')} "
        f"({'AMX: ' + ' '.join(amx) if amx else 'no AMX'}; {len(isa)} ISA flags), "
        f"{entries.get('intra_op_threads')} threads, torch {entries.get('torch')}"
        + (f", GPU {entries['gpu']}" if entries.get("gpu") else "")
    )


def check(run: Path) -> int:
    record = json.loads(RECORD.read_text())
    env = json.loads((run / "env.json").read_text())
    got = json.loads((run / "summary.json").read_text())["weights_sha256"]
    here, there = deciding(env), record["deciding"]
    differ = [
        f"{name}: {here.get(key)} here vs {there.get(key)}"
        for _, key, name in DECIDING
        if here.get(key) != there.get(key)
    ]
    published = record["weights_sha256"]
    short = f"{published[:8]}…{published[-8:]}"
    if differ:
        print(
            f"published digest {short} was measured on {describe(there)}; this run differs "
            f"({'; '.join(differ)}): another digest is expected here, and is no error. "
            "`make verify` checks the promise on this machine."
        )
        return 0
    if got == published:
        print(f"published digest {short}: this machine decides the bits alike, and gave it.")
        return 0
    print(
        f"published digest {short}, measured on a machine whose deciding entries match this "
        f"one ({describe(there)}), but this run gave {got[:8]}…{got[-8:]}: was it the default "
        f"run (make train, no overrides)? If so, please report it with {run}/env.json: an entry "
        "that decides the bits is not recorded yet (this is not an error of your run).",
        file=sys.stderr,
    )
    return 0


def record_run(run: Path) -> None:
    env = json.loads((run / "env.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    record = {
        "what": "make train: the default run (python train.py, no overrides)",
        "date": dt.date.today().isoformat(),
        "weights_sha256": summary["weights_sha256"],
        "val_accuracy": summary.get("val_accuracy"),
        "deciding": deciding(env),
        "python": env["environment"].get("python"),
        "numpy": env["environment"].get("numpy"),
    }
    RECORD.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {RECORD.relative_to(ROOT)}: {describe(record['deciding'])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", nargs="?", type=Path, help="a run directory (default: newest)")
    parser.add_argument("--record", action="store_true", help="publish RUN's digest")
    args = parser.parse_args(argv)
    run = args.run or newest_run(ROOT / "outputs")
    if run is None or not (run / "summary.json").is_file() or not (run / "env.json").is_file():
        print(
            f"published_digest: {run or 'outputs/'} holds no finished run; give a run directory.",
            file=sys.stderr,
        )
        return 2
    if args.record:
        record_run(run)
        return 0
    return check(run)


if __name__ == "__main__":
    sys.exit(main())
