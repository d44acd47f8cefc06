#!/usr/bin/env python
"""Verify the promise on this machine: train twice, and with single vs multi-worker loading,
then compare bit for bit. PASS (exit 0) or FAIL (exit 1) with `repro compare`'s output.

    make verify                                   # short strict runs of the default config
    python scripts/verify.py --steps 40 -- model=resnet18 amp=on   # your config

Each run is a separate `python train.py` process, as a user would start it; the run
directories are kept under --out (default outputs/verify/<date>_<time>).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import subprocess
import sys
import time
from pathlib import Path

from repro.base.errors import ReproError
from repro.tools.compare import compare_dirs

ROOT = Path(__file__).resolve().parents[1]

# (name, extra overrides) of each run; each pair in CHECKS must be bit-identical
RUNS = [
    ("a", ["loader=single"]),
    ("b", ["loader=single"]),
    ("multi", ["loader=multi", "loader.num_workers=2"]),
]
CHECKS = [
    ("repeat (run a vs run b)", "a", "b"),
    ("loader: 0 vs 2 workers", "a", "multi"),
]


def train(run_dir: Path, overrides: list[str]) -> None:
    cmd = [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run_dir}", *overrides]
    env = {**os.environ, "CI": "true"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-5:]
        raise SystemExit(f"verify: training failed ({' '.join(overrides)}):\n" + "\n".join(tail))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run (default 30)")
    p.add_argument("--out", type=Path, help="where the runs go (default outputs/verify/...)")
    p.add_argument("overrides", nargs="*", help="train.py overrides for every run (after --)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out = args.out or ROOT / "outputs" / "verify" / stamp
    if out.exists() and any(out.iterdir()):
        p.error(f"{out} exists and is not empty; give another --out (nothing is overwritten)")
    common = [
        "determinism=strict",
        f"trainer.max_steps={args.steps}",
        f"trainer.eval_every={args.steps}",
        f"trainer.trace_every={max(1, args.steps // 3)}",
        *args.overrides,
    ]
    print(f"verify: {len(RUNS)} runs of {args.steps} steps into {out}", flush=True)
    for name, extra in RUNS:
        t0 = time.perf_counter()
        train(out / name, [*extra, *common])
        print(f"  trained {name:<6} {' '.join(extra):<34} {time.perf_counter() - t0:5.1f} s")
    failed = 0
    for title, a, b in CHECKS:
        try:
            result = compare_dirs(out / a, out / b)
        except ReproError as err:
            raise SystemExit(f"verify: {err}") from None
        verdict = "PASS" if result.identical else "FAIL"
        failed += not result.identical
        print(f"\n{verdict}  {title}")
        print("\n".join("  " + line for line in result.lines))
    print(f"\nverify: {'FAIL' if failed else 'PASS'} ({len(CHECKS) - failed}/{len(CHECKS)} checks)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
