#!/usr/bin/env python
"""Memory and speed of ``data=image_folder`` read per sample (lazy) or up front (in memory).

    python scripts/folder_benchmark.py --sizes 2000 20000 --workers 2 4 8
    python scripts/folder_benchmark.py --sizes 2000 --workers 2 8 --repeats 3 --on-device \
        --steps 300 -- device=cuda amp=on
    python scripts/folder_benchmark.py --sizes 2000 --sides 300 500 --image-size 224 \
        --workers 4 8 12 --modes lazy --on-device --device-augment crop_flip --repeats 3 \
        --steps 60 -- augment=imagenet '~model' +model._target_=torchvision.models.resnet50 \
        trainer.channels_last=true amp=on trainer.batch_size=128 trainer.micro_batch_size=128

Writes class folders of ``--image-size`` images (10 classes, PNG and JPEG, varied sizes;
or with ``--sides LOW HIGH`` JPEG files of LOW to HIGH pixels a side, as
``scripts/augment_benchmark.py`` makes them; kept in ``--root`` for the next call), then
trains ``--steps`` steps of the default
ConvNet on each folder size, loader and mode, one process per run (``python train.py``):
peak resident memory of the training process and of its largest child process (the
kernel's ``ru_maxrss``; children are forked, so a child's peak counts the pages it still
shares with the training process at the fork: the loader workers, and helpers such as
``git`` for the fingerprint), images/s over the steady steps, and the weights' digest (lazy and
in-memory must give one digest per folder). ``--on-device`` adds the in-memory split kept on
the GPU (``loader=device``, with ``--device-augment`` as its augmentation if the others' cannot run
on the device): the loader's ratio to data already there says whether the GPU waits on the
loader. ``--modes auto`` adds the lazy folder under ``loader=auto`` (the workers it chose
in the table). ``--repeats`` runs every cell of a folder size in turn that many times
(median, min and max reported). Writes ``folder-<date>-<gpu or cpu>.md/.json`` under ``--out``.
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
# runs inside the child: train.py's own entry, then this process's and its workers' peaks
CHILD_CODE = """
import json, os, resource, runpy, sys
sys.argv = ["train.py", *json.loads(os.environ["REPRO_FOLDER_BENCH_ARGS"])]
try:
    runpy.run_path("train.py", run_name="__main__")
except SystemExit as end:
    if end.code not in (0, None):
        raise
kib = lambda who: resource.getrusage(who).ru_maxrss
print("RSS " + json.dumps({"main_mib": kib(resource.RUSAGE_SELF) / 1024,
                           "worker_mib": kib(resource.RUSAGE_CHILDREN) / 1024}))
"""


def make_folder(root: Path, n: int, size: int) -> Path:
    """``n`` images in 10 class folders (reused when complete)."""
    import torch
    from PIL import Image

    folder = root / f"images-{n}-{size}"
    done = folder / ".complete"
    if done.is_file():
        return folder
    g = torch.Generator().manual_seed(n)
    for i in range(n):
        c = i % 10
        (folder / f"class{c}").mkdir(parents=True, exist_ok=True)
        h, w = size + (i % 7) * 4, size + (i % 5) * 4
        pixels = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g)
        pixels[..., c % 3] = 40 + 20 * c
        Image.fromarray(pixels.numpy()).save(
            folder / f"class{c}" / f"{i:06d}.{'png' if i % 2 else 'jpg'}"
        )
    done.touch()
    return folder


def run(overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        args = [*overrides, f"hydra.run.dir={tmp}/run", "trainer.progress=false"]
        env = {**os.environ, "REPRO_FOLDER_BENCH_ARGS": json.dumps(args), "CI": "true"}
        # strict mode's process environment, set here: train.py would otherwise re-execute
        # itself with it, and this wrapper (which reads the peaks) would be replaced
        env.update(PYTHONHASHSEED="0", CUBLAS_WORKSPACE_CONFIG=":4096:8")
        proc = subprocess.run(
            [sys.executable, "-c", CHILD_CODE], cwd=ROOT, env=env, capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise SystemExit(f"run failed ({' '.join(overrides)}):\n{proc.stdout}\n{proc.stderr}")
        rss = json.loads(proc.stdout.rsplit("RSS ", 1)[1])
        summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
    return {
        **rss,
        "images_per_second": summary["steady_images_per_second"],
        "loader_wait": summary["loader_wait_fraction"],
        "weights": summary["weights_sha256"],
        "environment": summary["environment"],
        "num_workers": summary["num_workers"],
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", type=int, nargs="+", default=[2000, 20000])
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--modes",
        nargs="+",
        choices=["memory", "lazy", "auto"],
        default=["memory", "lazy"],
        help="in memory (main process, and workers[0] workers), lazy (each of --workers), "
        "auto (lazy, as many workers as loader=auto chooses)",
    )
    p.add_argument("--on-device", action="store_true", help="add the split kept on the GPU")
    p.add_argument(
        "--device-augment",
        help="the on-device cell's augment preset (e.g. crop_flip, when the others' is imagenet)",
    )
    p.add_argument(
        "--sides",
        type=int,
        nargs=2,
        metavar=("LOW", "HIGH"),
        help="JPEG files of LOW to HIGH pixels a side (default: --image-size, PNG and JPEG)",
    )
    p.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "repro-folders")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks")
    p.add_argument("overrides", nargs="*", help="train.py overrides (after --)")
    args = p.parse_args()
    rows = []
    for n in args.sizes:
        if args.sides:
            from augment_benchmark import make_folder as make_jpeg_folder

            folder = make_jpeg_folder(args.root, n, *args.sides)
        else:
            folder = make_folder(args.root, n, args.image_size)
        base = [
            "data=image_folder",
            f"data.path={folder}",
            f"data.image_size={args.image_size}",
            f"trainer.max_steps={args.steps}",
            f"trainer.eval_every={args.steps}",
            "trainer.checkpoint_every=0",
            "data.val_fraction=0.05",
            *args.overrides,
        ]
        cells = []
        if "memory" in args.modes:
            cells += [("in memory", 0, ["data.in_memory=true", "loader=single"])]
            cells += [
                ("in memory", w, ["data.in_memory=true", "loader=multi", f"loader.num_workers={w}"])
                for w in args.workers[:1]
            ]
        if "lazy" in args.modes:
            cells += [
                ("lazy", w, ["loader=multi", f"loader.num_workers={w}"]) for w in args.workers
            ]
        if "auto" in args.modes:
            cells += [("lazy, auto", "auto", ["loader=auto"])]
        if args.on_device:
            device = ["data.in_memory=true", "loader=device"]
            if args.device_augment:
                device.append(f"augment={args.device_augment}")
            cells.append(("on device", 0, device))
        runs: dict[int, list[dict]] = {i: [] for i in range(len(cells))}
        for repeat in range(args.repeats):  # every cell in turn: drift hits them alike
            for i, (mode, workers, extra) in enumerate(cells):
                r = run([*base, *extra])
                runs[i].append(r)
                print(
                    f"{n:6d} {mode:9} workers {workers} #{repeat}: main {r['main_mib']:7.0f} MiB, "
                    f"largest child {r['worker_mib']:6.0f} MiB, "
                    f"{r['images_per_second']:7.1f} img/s, waits {r['loader_wait']:.1%}  "
                    f"{r['weights'][:12]}",
                    flush=True,
                )
        for i, (mode, workers, _) in enumerate(cells):
            rs = runs[i]
            speeds = sorted(r["images_per_second"] for r in rs)
            rows.append(
                {
                    "images": n,
                    "mode": mode,
                    "workers": rs[0]["num_workers"] if workers == "auto" else workers,
                    "main_mib": max(r["main_mib"] for r in rs),
                    "worker_mib": max(r["worker_mib"] for r in rs),
                    "images_per_second": statistics.median(speeds),
                    "images_per_second_all": [r["images_per_second"] for r in rs],
                    "loader_wait": statistics.median(r["loader_wait"] for r in rs),
                    "weights": sorted({r["weights"] for r in rs}),
                    "environment": rs[0]["environment"],
                }
            )
        if args.on_device:
            device_speed = rows[-1]["images_per_second"]
            for r in rows[-len(cells) :]:
                r["vs_on_device"] = r["images_per_second"] / device_speed
    env = rows[0]["environment"]
    for r in rows:
        del r["environment"]
    source = (
        f"JPEG files of {args.sides[0]}-{args.sides[1]} px a side, read at their own size, "
        f"brought to {args.image_size}×{args.image_size} by the augmentation"
        if args.sides
        else f"{args.image_size}×{args.image_size} images (PNG and JPEG, varied sizes before "
        "resizing)"
    )
    lines = [
        f"# image_folder read per sample vs up front, {today()}",
        "",
        f"`{command_line()}`",
        "",
        f"{environment_line(env)}. {source}, 10 classes, {args.steps} steps, the model and "
        "settings of the overrides in the command (none: the default ConvNet, batch 64), "
        "one `python train.py` process per row. Memory: peak resident set of the training "
        "process, and of its largest child (`ru_maxrss`; forked children, the loader workers "
        "and helpers, count the pages they share with the training process at the fork). "
        f"Memory is the largest over {args.repeats} repeat(s); img/s the median (min–max) "
        "of the repeats, every cell of a size in turn. *vs on device*: the median's ratio to the "
        "split kept on the GPU (`loader=device`, `data.in_memory=true`"
        + (f", `augment={args.device_augment}`" if args.device_augment else "")
        + "). *Waits*: the median "
        "part of the steady steps the loop spent waiting for the loader "
        "(`summary.json` `loader_wait_fraction`).",
        "",
        "| images | mode | workers | training process MiB | largest child MiB | img/s | "
        "vs on device | waits | weights |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        speeds = r["images_per_second_all"]
        spread = f" ({min(speeds):.0f}–{max(speeds):.0f})" if len(speeds) > 1 else ""
        ratio = f"{r['vs_on_device']:.3f}" if "vs_on_device" in r else "–"
        lines.append(
            f"| {r['images']} | {r['mode']} | {r['workers']} | {r['main_mib']:.0f} | "
            f"{r['worker_mib']:.0f} | {r['images_per_second']:.1f}{spread} | {ratio} | "
            f"{r['loader_wait']:.1%} | " + ", ".join(f"`{w[:12]}`" for w in r["weights"]) + " |"
        )
    record = {"command": command_line(), "environment": env, "rows": rows}
    write_results(args.out, "folder", today(), env, "\n".join(lines) + "\n", record)


if __name__ == "__main__":
    main()
