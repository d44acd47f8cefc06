#!/usr/bin/env python
"""What the training loader delivers, and what keying the augmentation costs: images/s of
``data=image_folder`` read lazily and augmented in the loader's workers, per worker count,
with the pipeline keyed per sample (as every run is) and unkeyed (the same pipeline, its
draws from one generator a worker and the global states left alone: what a peer does).

    python scripts/augment_benchmark.py --images 2000 --workers 1 2 --repeats 3
    python scripts/augment_benchmark.py --workers 4 8 12 -- augment=imagenet data.image_size=224

Writes ``--images`` JPEG files of ``--min-side`` to ``--max-side`` pixels a side (10 class
folders, smooth colour fields with noise; kept in ``--root`` for the next call), builds the
loader of the config (default ``augment=imagenet data.image_size=224``, micro-batches of
``--batch``) and times ``--batches`` micro-batches after ``--warmup``, every cell in turn
``--repeats`` times (median, min-max). No model: this is the host side alone. Also the
keying's own cost a sample (setting the global states from a key and putting them back; a
keyed generator). Writes ``augment-<date>-<gpu or cpu>.md/.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _results import command_line, environment_line, today, write_results

ROOT = Path(__file__).resolve().parents[1]


def make_folder(root: Path, n: int, low: int, high: int) -> Path:
    """``n`` JPEG images in 10 class folders, each side in ``[low, high]`` (reused when
    complete): a smooth colour field per image, a class tint, and noise."""
    import torch
    import torch.nn.functional as F
    from PIL import Image

    folder = root / f"jpeg-{n}-{low}-{high}"
    done = folder / ".complete"
    if done.is_file():
        return folder
    g = torch.Generator().manual_seed(n)
    for i in range(n):
        c = i % 10
        (folder / f"class{c}").mkdir(parents=True, exist_ok=True)
        h, w = (int(x) for x in torch.randint(low, high + 1, (2,), generator=g))
        coarse = torch.rand(1, 3, 6, 8, generator=g) * 200
        field = F.interpolate(coarse, size=(h, w), mode="bicubic", align_corners=False)[0]
        field[c % 3] += 30
        pixels = field + 12 * torch.randn(3, h, w, generator=g)
        image = pixels.clamp(0, 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
        Image.fromarray(image).save(folder / f"class{c}" / f"{i:06d}.jpg", quality=90)
    done.touch()
    return folder


def unkeyed() -> None:
    """Make every pipeline call unkeyed (in this process and the workers it forks): the
    pipeline's draws from one generator a process, the global states left as they are."""
    import torch

    from repro.components.data import augment

    generator = torch.Generator().manual_seed(0)

    def call(self, image, target, epoch, index):  # noqa: ANN001, ANN202
        if self.pipeline is None:
            return image, target
        kwargs = {}
        if augment._accepts(self.pipeline, "generator"):
            kwargs["generator"] = generator
        if augment._accepts(self.pipeline, "key"):
            kwargs["key"] = (self.seed, int(epoch), int(index))
        return self.pipeline(image, target, **kwargs)

    augment.KeyedPipeline.__call__ = call
    import repro.engine.build

    repro.engine.build.check_pipelines = lambda *a, **k: None  # it would (rightly) refuse this


def throughput(cfg, workers: int, batches: int, warmup: int) -> float:
    """Images/s of the training loader of ``cfg`` with ``workers`` workers."""
    import torch
    from omegaconf import OmegaConf

    from repro.components.data import loading
    from repro.engine.build import build_data, build_loader

    loader_cfg = OmegaConf.merge(cfg, {"loader": {"num_workers": workers}})
    data = build_data(loader_cfg)
    loader = build_loader(loader_cfg, data, torch.device("cpu"))
    with loading(loader) as stream:
        for _ in itertools.islice(stream, warmup):
            pass
        t0, n = time.perf_counter(), 0
        for images, _ in itertools.islice(stream, batches):
            n += len(images)
    return n / (time.perf_counter() - t0)


def keying_cost(repeats: int = 2000) -> dict[str, float]:
    """Microseconds a sample: the global states set from a key (in a loader worker; in the
    main process also put back afterwards); a keyed generator made."""
    from unittest import mock

    import torch

    from repro.base.rng import derive_seed
    from repro.components.data.augment import keyed_global_state

    def per_sample() -> float:
        t0 = time.perf_counter()
        for i in range(repeats):
            with keyed_global_state(0, 1, i):
                pass
        return (time.perf_counter() - t0) / repeats * 1e6

    main_process = per_sample()
    with mock.patch("torch.utils.data.get_worker_info", return_value=object()):
        states = per_sample()
    t0 = time.perf_counter()
    for i in range(repeats):
        torch.Generator().manual_seed(derive_seed(0, "augment-generator", 1, i))
    generator = (time.perf_counter() - t0) / repeats * 1e6
    return {
        "global_states_us": states,
        "global_states_main_process_us": main_process,
        "generator_us": generator,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--min-side", type=int, default=300)
    p.add_argument("--max-side", type=int, default=500)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch", type=int, default=64, help="images a micro-batch")
    p.add_argument("--batches", type=int, default=20, help="micro-batches timed a cell")
    p.add_argument("--warmup", type=int, default=4, help="micro-batches before the timing")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "repro-folders")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks")
    p.add_argument("overrides", nargs="*", help="train.py overrides (after --)")
    p.add_argument("--cell", help=argparse.SUPPRESS)  # one cell, in its own process
    args = p.parse_args()
    if args.cell:
        return run_cell(args.cell)

    from repro.defense.config import compose
    from repro.defense.process_env import required_process_env
    from repro.records.fingerprint import environment

    folder = make_folder(args.root, args.images, args.min_side, args.max_side)
    overrides = [
        "data=image_folder",
        f"data.path={folder}",
        "data.image_size=224",
        "data.val_fraction=0.05",
        "augment=imagenet",
        f"trainer.batch_size={args.batch}",
        f"trainer.micro_batch_size={args.batch}",
        "loader=multi",
        *args.overrides,
    ]
    cfg = compose(overrides, ROOT / "conf")  # a bad override: one line, before any work
    pinned = required_process_env(cfg.determinism)  # what train.py would start with
    cost = keying_cost()
    cells = [(keyed, w) for keyed in (True, False) for w in args.workers]
    speeds: dict[tuple[bool, int], list[float]] = {c: [] for c in cells}
    for repeat in range(args.repeats):  # every cell in turn: drift hits them alike
        for keyed in (True, False):
            for w in args.workers:
                speed = _cell(overrides, w, keyed, args.batches, args.warmup, pinned)
                speeds[(keyed, w)].append(speed)
                print(
                    f"#{repeat} {'keyed' if keyed else 'unkeyed':8} workers {w:2d}: "
                    f"{speed:8.1f} img/s",
                    flush=True,
                )
    env = environment()
    rows = []
    for w in args.workers:
        keyed, plain = speeds[(True, w)], speeds[(False, w)]
        rows.append(
            {
                "workers": w,
                "keyed": statistics.median(keyed),
                "keyed_all": keyed,
                "unkeyed": statistics.median(plain),
                "unkeyed_all": plain,
                "keyed_over_unkeyed": statistics.median(
                    k / u for k, u in zip(keyed, plain, strict=True)
                ),
            }
        )
    overrides = " ".join(args.overrides) or "none"
    lines = [
        f"# The training loader: images/s, and what keying the augmentation costs, {today()}",
        "",
        f"`{command_line()}`",
        "",
        f"{environment_line(env)}. {args.images} JPEG files, each side {args.min_side}-"
        f"{args.max_side} px (smooth colour fields with noise, quality 90), read lazily "
        f"(`data=image_folder`) and augmented in the loader's workers, `augment=imagenet` at "
        f"224 (extra overrides: {overrides}); micro-batches of {args.batch}, "
        f"{args.batches} timed after {args.warmup}; no model. Median (min-max) of "
        f"{args.repeats} repeats, every cell in turn. *Unkeyed*: the same pipeline drawing from "
        "one generator a worker, the global states untouched (a peer's loader). Keying's own "
        f"cost a sample: {cost['global_states_us']:.1f} µs to set the global torch, NumPy and "
        f"`random` states from a key in a worker ({cost['global_states_main_process_us']:.1f} "
        "µs in the main process, which also puts them back; pipelines that draw from them: "
        f"torchvision's, yours), {cost['generator_us']:.1f} µs for a keyed generator (the "
        "shipped `imagenet` and `segmentation` transforms).",
        "",
        "| workers | keyed img/s | unkeyed img/s | keyed / unkeyed | img/s a worker (keyed) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        k, u = r["keyed_all"], r["unkeyed_all"]
        lines.append(
            f"| {r['workers']} | {r['keyed']:.1f} ({min(k):.0f}-{max(k):.0f}) | "
            f"{r['unkeyed']:.1f} ({min(u):.0f}-{max(u):.0f}) | {r['keyed_over_unkeyed']:.3f} | "
            f"{r['keyed'] / max(r['workers'], 1):.1f} |"
        )
    record = {"command": command_line(), "environment": env, "keying": cost, "rows": rows}
    write_results(args.out, "augment", today(), env, "\n".join(lines) + "\n", record)


def _cell(
    overrides: list[str],
    workers: int,
    keyed: bool,
    batches: int,
    warmup: int,
    pinned: dict[str, str],
) -> float:
    """One cell's images/s, in a process of its own (strict, as a run is; the unkeyed
    patch stays in it): this script again, with ``--cell``."""
    import json
    import subprocess

    cell = json.dumps([overrides, workers, keyed, batches, warmup])
    out = subprocess.run(
        [sys.executable, __file__, "--cell", cell],
        capture_output=True,
        text=True,
        env={**os.environ, **pinned, "CI": "true"},
        check=False,
    )
    if out.returncode != 0:
        sys.exit(f"a cell failed:\n{out.stderr[-3000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def run_cell(cell: str) -> None:
    """``--cell``: print one cell's images/s."""
    import json

    import torch

    from repro.defense.config import compose
    from repro.defense.determinism import apply_determinism

    overrides, workers, keyed, batches, warmup = json.loads(cell)
    if not keyed:
        unkeyed()
    cfg = compose(overrides, ROOT / "conf")
    apply_determinism(cfg, torch.device("cpu"))
    print(throughput(cfg, workers, batches, warmup))


if __name__ == "__main__":
    main()
