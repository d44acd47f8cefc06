#!/usr/bin/env python
"""What world-size invariance costs: step throughput under torchrun, the fixed-order
reduction (``dist.reduction=ordered``) against a plain all-reduce (``all_reduce``, DDP's
sum), side by side in one run, and whether the bits agree across world sizes.

    python scripts/dist_benchmark.py                                  # CPU, gloo: 1 and 2
    python scripts/dist_benchmark.py --world-sizes 1 2 4 --steps 300 -- model=resnet18 \\
        trainer.batch_size=256 trainer.micro_batch_size=64 amp=on     # GPUs, NCCL
    python scripts/dist_benchmark.py --fake-world 2 --reductions ordered ordered_no_overlap \\
        -- device=cuda model=resnet18 ...                             # a rank's cost, 1 GPU

Each world size W > 1 runs every reduction of ``--reductions`` (``ordered_no_overlap``:
``ordered`` with ``dist.overlap=false``, the exchange after the backward pass), alternated,
``--repeats`` times (``torchrun --standalone --nproc_per_node=W train.py ...``); W = 1 is one
plain process. ``--fake-world W`` instead runs each reduction in one process as rank 0 of W
over torch's fake process group (``scripts/fake_rank.py``: the rank's own work, no wire, no
peers; the weights mean nothing), beside one process training the rank's share alone
(``trainer.batch_size`` / W): what being a rank costs beyond its micro-batches.
Throughput is ``steady_images_per_second`` from the run's summary: after the first 10
steps, to the last update (device synchronised at both ends); it counts the global batch.
Overrides after ``--`` go to every run. Writes benchmarks/dist-<date>-<gpu or cpu>.md/.json
with the versions and the exact command.
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


# the train.py overrides of each --reductions entry
REDUCTIONS = {
    "ordered": ["dist.reduction=ordered"],
    "ordered_no_overlap": ["dist.reduction=ordered", "dist.overlap=false"],
    "ordered_allgather": ["dist.reduction=ordered_allgather"],
    "all_reduce": ["dist.reduction=all_reduce"],
}
ORDER = {name: i for i, name in enumerate([*REDUCTIONS, "ddp"])}


def launch(
    run_dir: Path, world_size: int, reduction: str, steps: int, extra: list[str], fake: bool
) -> dict:
    """One run; ``fake``: one process as rank 0 of ``world_size`` (scripts/fake_rank.py)."""
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
    settings = [
        f"trainer.max_steps={steps}",
        f"trainer.eval_every={steps}",
        "trainer.checkpoint_every=0",
        "trainer.progress=false",
        *REDUCTIONS[reduction],
        *extra,
    ]
    if fake and world_size > 1:
        script = [str(ROOT / "scripts" / "fake_rank.py"), f"--world={world_size}"]
        run_checked([sys.executable, *script, f"--run-dir={run_dir}", "--", *settings], ROOT, env)
    else:
        launcher = torchrun if world_size > 1 else [sys.executable]
        run_checked(
            [*launcher, str(ROOT / "train.py"), f"hydra.run.dir={run_dir}", *settings], ROOT, env
        )
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "images_per_second": summary["steady_images_per_second"],
        "weights": summary["weights_sha256"],
        "environment": summary["environment"],
    }


def share_overrides(overrides: list[str], world_size: int) -> list[str]:
    """``overrides`` with ``trainer.batch_size`` divided by ``world_size``: one rank's
    micro-batches, trained by one process."""
    from repro.defense.config import compose

    batch = int(compose(overrides, ROOT / "conf").trainer.batch_size)
    if batch % world_size:
        sys.exit(f"trainer.batch_size={batch} cannot be shared by {world_size} ranks")
    kept = [o for o in overrides if not o.startswith("trainer.batch_size=")]
    return [*kept, f"trainer.batch_size={batch // world_size}"]


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
        choices=list(REDUCTIONS),
        help="what runs at every W > 1: a dist.reduction, or ordered_no_overlap (ordered, "
        "the exchange after the backward pass); ordered_allgather: the older path",
    )
    p.add_argument(
        "--fake-world",
        type=int,
        metavar="W",
        help="one GPU: each reduction as rank 0 of W over the fake process group, beside one "
        "process training the rank's share (trainer.batch_size / W); not with --ddp",
    )
    p.add_argument("--label", default="", help="names the result files: dist-LABEL-<date>-...")
    p.add_argument("overrides", nargs="*", help="train.py overrides for every run (after --)")
    args = p.parse_args()
    if args.steps <= 20:
        p.error("--steps must be > 20 (the first 10 are left out)")
    if args.fake_world is not None:
        if args.fake_world < 2 or args.ddp:
            p.error("--fake-world W needs W >= 2, and runs no DDP peer (it needs W processes)")
        args.world_sizes = [1, args.fake_world]
    share = share_overrides(args.overrides, args.fake_world) if args.fake_world else None
    if "ordered" not in args.reductions:  # every ratio is to it
        args.reductions.insert(0, "ordered")

    fake = args.fake_world
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        n = 0
        for i in range(args.repeats):
            for w in args.world_sizes:
                reductions = ["ordered"] if w == 1 else list(args.reductions)
                reductions += ["ddp"] if args.ddp else []
                for reduction in reductions if i % 2 == 0 else reductions[::-1]:
                    n += 1
                    extra = share if share and w == 1 else args.overrides
                    r = launch(Path(tmp) / f"run{n}", w, reduction, args.steps, extra, bool(fake))
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
    rows.sort(key=lambda r: (r["world_size"], ORDER[r["reduction"]]))
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
        "trace, logs or checkpoints; bucketed all-reduce overlapped with the backward pass). "
        "`ordered_no_overlap`: `ordered` with `dist.overlap=false` (the exchange after the "
        "backward pass).",
        "",
    ]
    if fake:
        lines += [
            f"**Fake world**: each W = {fake} row is one process as rank 0 of {fake} over "
            "torch's fake process group (`scripts/fake_rank.py`: the rank's micro-batches and "
            "the reduction's work, no wire, no peers; its weights mean nothing). The W = 1 "
            f"row trains the rank's share alone (`trainer.batch_size` / {fake}: "
            f"`{' '.join(share or [])}`). Images/s counts the global batch, so "
            f"'of the share's speed' = img/s / ({fake} × the share's).",
            "",
            "| processes | reduction | img/s median (min–max) | ordered / this "
            "| of the share's speed | weights |",
            "|---|---|---|---|---|---|",
        ]
    else:
        lines += [
            "| processes | reduction | img/s median (min–max) | ordered / this "
            f"| vs {args.world_sizes[0]} process(es) | weights | same bits as first row |",
            "|---|---|---|---|---|---|---|",
        ]
    for r in rows:
        w = r["world_size"]
        ratio = f"{median[(w, 'ordered')] / r['median']:.3f}" if r["reduction"] != "ordered" else ""
        ips = r["images_per_second"]
        digests = ", ".join(d[:12] for d in r["weights"])
        if fake:
            who = f"rank 0 of {w} (fake)" if w > 1 else "1 (the share)"
            how = r["reduction"] if w > 1 else "(one process)"
            speed = r["median"] / (w * base) if w > 1 else 1.0
            lines.append(
                f"| {who} | {how} | {r['median']:.0f} ({min(ips):.0f}–{max(ips):.0f}) "
                f"| {ratio} | {speed:.2f} | {digests} |"
            )
            continue
        lines.append(
            f"| {w} | {r['reduction']} | {r['median']:.0f} ({min(ips):.0f}–{max(ips):.0f}) | "
            f"{ratio} | {r['median'] / base:.2f}× | {digests} | "
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
        "fake_world": fake,
        "share_overrides": share,
        "rows": rows,
    }
    kind = f"dist-{args.label}" if args.label else "dist"
    devices = 1 if fake else max(args.world_sizes)  # the file name says what ran: one GPU
    write_results(args.out, kind, date, env, text, record, devices=devices)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
