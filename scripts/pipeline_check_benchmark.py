#!/usr/bin/env python
"""What the augmentation self-check (``repro.components.data.pipeline_check``) costs at launch, for
each shipped pipeline on the data it is made for:

    python scripts/pipeline_check_benchmark.py --repeats 5

The default config (synthetic 32x32, ``augment=crop_flip``); ``augment=imagenet`` at 224 on
a folder of 300-500 px JPEGs; ``experiment=segmentation`` (64x64 shapes);
``experiment=segmentation_native`` (``augment=patches`` on 12-bit 150-260 px images);
``augment=torchvision`` where torchvision is installed; ``augment=none``. Each: the data
built once, then ``check_pipelines`` timed ``--repeats`` times (median, min-max): the two
builds of each pipeline, the samples' fetch and every call. Writes
``pipeline-check-<date>-<gpu or cpu>.md/.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time
from pathlib import Path

from _results import command_line, environment_line, today, write_results

ROOT = Path(__file__).resolve().parents[1]


def cases(root: Path) -> dict[str, list[str]]:
    from augment_benchmark import make_folder

    from repro.components.data.synthetic import write_nuclei_folder

    jpegs = make_folder(root, 200, 300, 500)
    nuclei = root / "nuclei"
    if not (nuclei / "images").is_dir():
        write_nuclei_folder(nuclei, count=40)
    out = {
        "default (crop_flip)": [],
        "imagenet, 224, JPEG folder": [
            "data=image_folder",
            f"data.path={jpegs}",
            "augment=imagenet",
            "data.image_size=224",
        ],
        "segmentation": ["experiment=segmentation"],
        "segmentation_native (patches)": [
            "experiment=segmentation_native",
            f"data.path={nuclei}",
            "data.num_classes=3",
        ],
        "none": ["augment=none"],
    }
    if importlib.util.find_spec("torchvision") is not None:
        out["torchvision, JPEG folder"] = [
            "data=image_folder",
            f"data.path={jpegs}",
            "augment=torchvision",
            "data.image_size=64",
        ]
    return out


def time_check(overrides: list[str], repeats: int) -> dict[str, float]:
    from repro.components.data import pipeline_check
    from repro.defense.config import compose
    from repro.engine.build import build_data

    cfg = compose(overrides, ROOT / "conf")
    seen: list[tuple] = []
    real = pipeline_check.check_pipelines

    def keep(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append((args, kwargs))
        return real(*args, **kwargs)

    import repro.engine.build

    repro.engine.build.check_pipelines = keep
    try:
        data = build_data(cfg)
    finally:
        repro.engine.build.check_pipelines = real
    args, kwargs = seen[0]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        checked = real(*args, **kwargs)
        times.append(time.perf_counter() - start)
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "samples": checked.samples,
        "keys": checked.keys,
        "train": data.train_pipeline.name,
        "eval": data.eval_pipeline.name,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "repro-folders")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks")
    args = p.parse_args()
    import torch

    from repro.records.fingerprint import environment

    torch.set_num_threads(1)  # as in a loader worker; the check runs in the main process
    env = environment()
    rows = {name: time_check(o, args.repeats) for name, o in cases(args.root).items()}
    lines = [
        f"# The augmentation self-check at launch ({today()})",
        "",
        f"- where: {environment_line(env)}",
        f"- command: `{command_line()}`",
        f"- each: `check_pipelines` on the built data, {args.repeats} repeats (median, min-max)",
        "",
        "| config | train pipeline | eval pipeline | samples x keys | seconds |",
        "|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | `{r['train']}` | `{r['eval']}` | {r['samples']} x {r['keys']} | "
            f"{r['median_s']:.3f} ({r['min_s']:.3f}-{r['max_s']:.3f}) |"
        )
    write_results(args.out, "pipeline-check", today(), env, "\n".join(lines) + "\n", rows)


if __name__ == "__main__":
    main()
