#!/usr/bin/env python
"""What world-size invariance costs: step throughput under torchrun, the fixed-order
reduction (``dist.reduction=ordered``) against a plain all-reduce (``all_reduce``, DDP's
sum), side by side in one run, and whether the bits agree across world sizes.

    python scripts/dist_benchmark.py                                  # CPU, gloo: 1 and 2
    python scripts/dist_benchmark.py --world-sizes 1 2 4 --steps 300 -- model=resnet18 \\
        trainer.batch_size=256 trainer.micro_batch_size=64 amp=on     # GPUs, NCCL

Each world size W > 1 runs both reductions, alternated, ``--repeats`` times
(``torchrun --standalone --nproc_per_node=W train.py ...``); W = 1 is one plain process.
Throughput is ``steady_images_per_second`` from the run's summary: after the first 10
steps, to the last update (device synchronised at both ends). Overrides after ``--`` go to
every run. Writes benchmarks/dist-<date>-<gpu or cpu>.md/.json with the versions and the
exact command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from _results import (
    command_line,
    environment_line,
    run_checked,
    run_json,
    today,
    write_results,
)

ROOT = Path(__file__).resolve().parents[1]


def launch(run_dir: Path, world_size: int, reduction: str, steps: int, extra: list[str]) -> dict:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun.append(f"--nproc_per_node={world_size}")
    env = {**os.environ, "PYTHONHASHSEED": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    env.setdefault("NCCL_NVLS_ENABLE", "0")

    if reduction == "ddp":
        peer = [*torchrun, str(ROOT / "scripts" / "ddp_peer.py"), f"--steps={steps}", "--", *extra]
        result = run_json(peer, ROOT, env)
        return {
            "images_per_second": result["steady_images_per_second"],
            "weights": result["weights_sha256"],
            "environment": None,
        }
    run_checked(
        [
            *(torchrun if world_size > 1 else [sys.executable]),
            str(ROOT / "train.py"),
            f"hydra.run.dir={run_dir}",
            f"trainer.max_steps={steps}",
            f"trainer.eval_every={steps}",
            "trainer.checkpoint_every=0",
            "trainer.progress=false",
            f"dist.reduction={reduction}",
            *extra,
        ],
        ROOT,
        env,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "images_per_second": summary["steady_images_per_second"],
        "weights": summary["weights_sha256"],
        "environment": summary["environment"],
    }


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks")
    p.add_argument(
        "--ddp",
        action="store_true",
        help="also run plain DistributedDataParallel (scripts/ddp_peer.py) at every size",
    )
    p.add_argument(
        "--reductions",
        nargs="+",
        default=["ordered", "all_reduce"],
        choices=["ordered", "ordered_allgather", "all_reduce"],
        help="dist.reduction values run at every W > 1 (ordered_allgather: the older path)",
    )
    p.add_argument("--label", default="", help="names the result files: dist-LABEL-<date>-...")
    p.add_argument("overrides", nargs="*", help="train.py overrides for every run (after --)")
    args = p.parse_args()
    if args.steps <= 20:
        p.error("--steps must be > 20 (the first 10 are left out)")

    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        n = 0
        for i in range(args.repeats):
            for w in args.world_sizes:
                reductions = ["ordered"] if w == 1 else list(args.reductions)
                reductions += ["ddp"] if args.ddp else []
                for reduction in reductions if i % 2 == 0 else reductions[::-1]:
                    n += 1
                    r = launch(Path(tmp) / f"run{n}", w, reduction, args.steps, args.overrides)
                    results.setdefault(f"{w}/{reduction}", []).append(r)
                    print(
                        f"W={w} {reduction:17} {i + 1}/{args.repeats}: "
                        f"{r['images_per_second']:9.0f} img/s  {r['weights'][:12]}",
                        flush=True,
                    )
    env = results[f"{args.world_sizes[0]}/ordered"][0]["environment"]
    reference = results[f"{args.world_sizes[0]}/ordered"][0]["weights"]
    rows = []
    for key, runs in results.items():
        w, reduction = key.split("/")
        ips = [r["images_per_second"] for r in runs]
        rows.append(
            {
                "world_size": int(w),
                "reduction": reduction,
                "images_per_second": ips,
                "median": statistics.median(ips),
                "weights": sorted({r["weights"] for r in runs}),
                "same_bits_as_first": all(r["weights"] == reference for r in runs),
            }
        )
    order = {"ordered": 0, "ordered_allgather": 1, "all_reduce": 2, "ddp": 3}
    rows.sort(key=lambda r: (r["world_size"], order[r["reduction"]]))
    median = {(r["world_size"], r["reduction"]): r["median"] for r in rows}
    base = median[(args.world_sizes[0], "ordered")]

    command, date = command_line(), today()
    lines = [
        f"# World-size invariance: what the fixed-order reduction costs, {date}",
        "",
        f"`{command}`",
        "",
        f"{environment_line(env)}; backend "
        f"{'NCCL (+gloo for CPU messages)' if env.get('gpu') else 'gloo'}. "
        f"{args.steps} steps per run, images/s after the first 10; {args.repeats} repeats, "
        "the reductions alternated. Overrides: "
        f"`{' '.join(args.overrides) or '(defaults)'}`.",
        "",
        "`ddp`: plain DistributedDataParallel in a lean loop (`scripts/ddp_peer.py`: no "
        "trace, logs or checkpoints; bucketed all-reduce overlapped with the backward pass).",
        "",
        "| processes | reduction | img/s median (min–max) | ordered / this "
        f"| vs {args.world_sizes[0]} process(es) | weights | same bits as first row |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        w = r["world_size"]
        ratio = f"{median[(w, 'ordered')] / r['median']:.3f}" if r["reduction"] != "ordered" else ""
        ips = r["images_per_second"]
        lines.append(
            f"| {w} | {r['reduction']} | {r['median']:.0f} ({min(ips):.0f}–{max(ips):.0f}) | "
            f"{ratio} | {r['median'] / base:.2f}× | "
            f"{', '.join(d[:12] for d in r['weights'])} | "
            f"{'yes' if r['same_bits_as_first'] else 'no'} |"
        )
    text = "\n".join(lines) + "\n"
    record = {
        "date": date,
        "command": command,
        "environment": env,
        "steps": args.steps,
        "repeats": args.repeats,
        "overrides": args.overrides,
        "rows": rows,
    }
    kind = f"dist-{args.label}" if args.label else "dist"
    write_results(args.out, kind, date, env, text, record, devices=max(args.world_sizes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
