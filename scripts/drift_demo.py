#!/usr/bin/env python
"""Drift demonstration: the same config and seed, trained N times in fast and in strict mode.

Fast mode (cuDNN autotuning, nondeterministic kernels allowed) on a ResNet-18-size net in
fp32 gives different weights from run to run; strict mode gives one digest. Each run is a
separate `python train.py` process, as a user would start it.

    python scripts/drift_demo.py                       # on a CUDA machine; writes benchmarks/
    python scripts/drift_demo.py --runs 3 --steps 40 --model resnet18 --out benchmarks

Output: a markdown table and a JSON file under --out, named by date, with the GPU, driver,
torch/CUDA/cuDNN versions and the exact command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _results import command_line, environment_line, today, write_results

ROOT = Path(__file__).resolve().parents[1]


def train(run_dir: Path, mode: str, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        f"hydra.run.dir={run_dir}",
        f"determinism={mode}",
        f"model={args.model}",
        f"seed={args.seed}",
        f"trainer.max_steps={args.steps}",
        f"trainer.eval_every={args.steps}",
        f"trainer.batch_size={args.batch}",
        f"trainer.micro_batch_size={args.micro}",
        f"device={args.device}",
        *args.overrides,
    ]
    env = {**os.environ, "CI": "true"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"drift_demo: training failed ({mode}):\n{proc.stderr[-2000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--micro", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks")
    p.add_argument("overrides", nargs="*", help="extra train.py overrides")
    args = p.parse_args()

    results: dict[str, list[dict]] = {"fast": [], "strict": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for mode in results:  # interleaved, so both modes see the same machine state
                s = train(Path(tmp) / f"{mode}{i}", mode, args)
                results[mode].append(s)
                print(
                    f"{mode:6} run {i + 1}/{args.runs}: weights {s['weights_sha256'][:16]}  "
                    f"final loss {s['final_loss']!r}  {s['images_per_second']:.0f} img/s",
                    flush=True,
                )

    env = results["strict"][0]["environment"]
    rows = []
    for mode, runs in results.items():
        rows.append(
            {
                "mode": mode,
                "runs": len(runs),
                "distinct_weights": len({r["weights_sha256"] for r in runs}),
                "distinct_final_loss": len({r["final_loss"] for r in runs}),
                "weights": [r["weights_sha256"] for r in runs],
                "final_loss": [r["final_loss"] for r in runs],
                "images_per_second_median": statistics.median(r["images_per_second"] for r in runs),
            }
        )
    command, date = command_line(), today()
    record = {
        "date": date,
        "command": command,
        "environment": env,
        "model": args.model,
        "steps": args.steps,
        "batch": args.batch,
        "micro_batch": args.micro,
        "results": rows,
    }

    lines = [
        f"# Drift demonstration, {date}",
        "",
        f"`{command}`",
        "",
        f"{environment_line(env)}.",
        f"Model `{args.model}`, fp32, {args.steps} steps, batch {args.batch} "
        f"(micro-batch {args.micro}), seed {args.seed}; each run a separate process.",
        "",
        "| mode | runs | distinct weight digests | distinct final losses | median img/s (incl. eval) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['runs']} | {r['distinct_weights']} | "
            f"{r['distinct_final_loss']} | {r['images_per_second_median']:.0f} |"
        )
    lines += [
        "",
        "Final losses: "
        + "; ".join(f"{r['mode']}: {', '.join(repr(v) for v in r['final_loss'])}" for r in rows),
    ]
    text = "\n".join(lines) + "\n"
    write_results(args.out, "drift", date, env, text, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
