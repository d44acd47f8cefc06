#!/usr/bin/env python
"""What the one-thread rule costs ``loader=single``: micro-batches a second fetched in the main
process -- read from a folder and augmented, as ``loader=single`` does between steps --
with every fetch pinned to one thread (:mod:`repro.components.data.sample_settings`, what
every run does) against the same fetch left at the run's threads (``determinism.cpu_threads``,
the code before the rule; the augmentations' mean is the new one in both). Alternated, each
``--repeats`` times (median, min-max of micro-batches/s). Workers (``loader=multi``) run
with one thread either way: for them the rule changes nothing.

    python scripts/threads_benchmark.py --repeats 5 --out benchmarks

Cases: ``experiment=segmentation`` on a folder of 8-bit RGB images resized to 128 and 256
px; ``experiment=segmentation_native`` on 12-bit images (16-bit PNGs) in 256-px patches.
Writes ``threads-<date>-<gpu or cpu>.md/.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

from _results import command_line, environment_line, today, write_results

ROOT = Path(__file__).resolve().parents[1]


def cases(root: Path, images: int) -> dict[str, list[str]]:
    from repro.components.data.synthetic import write_nuclei_folder, write_shapes_folder

    rgb = root / "rgb"
    write_shapes_folder(rgb, count=images, image_size=96, seed=5)
    nuclei = root / "nuclei"
    write_nuclei_folder(nuclei, count=images, seed=0, sizes=(300, 420))
    return {
        "segmentation, 8-bit RGB -> 128 px": [
            "experiment=segmentation", "data=image_mask_folder", f"data.path={rgb}",
            "data.num_classes=4", "data.image_size=128",
        ],
        "segmentation, 8-bit RGB -> 256 px": [
            "experiment=segmentation", "data=image_mask_folder", f"data.path={rgb}",
            "data.num_classes=4", "data.image_size=256",
        ],
        "segmentation_native, 16-bit, 256-px patches": [
            "experiment=segmentation_native", f"data.path={nuclei}", "data.num_classes=3",
            "data.channels=1", "data.image_size=256",
        ],
    }  # fmt: skip


def fetch_rate(overrides: list[str], batches: int, batch: int, pinned: bool) -> float:
    """Micro-batches/s of ``batch`` samples fetched in this process (as loader=single), after
    one warm-up fetch, with per-sample work pinned to one thread or not."""
    import torch

    from repro.components.data import KeyedBatches, sample_settings
    from repro.defense.config import compose
    from repro.defense.determinism import apply_determinism
    from repro.engine.build import build_data

    cfg = compose([*overrides, f"trainer.batch_size={batch}", f"trainer.micro_batch_size={batch}"],
                  ROOT / "conf")  # fmt: skip
    apply_determinism(cfg, torch.device("cpu"))  # strict: determinism.cpu_threads threads
    data = build_data(cfg)
    fetcher = KeyedBatches(data.train, data.train_pipeline)
    real = sample_settings.SampleSettings.pinned
    if not pinned:  # the code before: the run's threads
        sample_settings.SampleSettings.pinned = lambda self: contextlib.nullcontext()
    try:
        n = len(data.train)
        keys = [torch.arange(i * batch, (i + 1) * batch) % n for i in range(batches + 1)]
        epoch = torch.zeros(1, dtype=torch.int64)
        fetcher.fetch(epoch, keys[0])
        start = time.perf_counter()
        for index in keys[1:]:
            fetcher.fetch(epoch, index)
        return batches / (time.perf_counter() - start)
    finally:
        sample_settings.SampleSettings.pinned = real


def entry_cost(repeats: int, calls: int = 20000) -> dict[str, list[float]]:
    """Microseconds to enter and leave :meth:`SampleSettings.pinned` with nothing inside: in
    the main process with the run's threads (2: set to 1 and back), and with one thread
    already (as in a loader worker, where nothing changes)."""
    import torch

    from repro.components.data import SampleSettings

    settings, out = SampleSettings.here(), {}
    for threads in (2, 1):
        torch.set_num_threads(threads)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                with settings.pinned():
                    pass
            times.append((time.perf_counter() - start) / calls * 1e6)
        out[f"{threads} thread{'s' * (threads > 1)} before"] = times
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--images", type=int, default=48)
    p.add_argument("--batches", type=int, default=6, help="micro-batches timed a repeat")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks")
    args = p.parse_args()

    from repro.defense.config import compose
    from repro.defense.process_env import pin_process_environment

    pin_process_environment(compose([]).determinism)  # strict: re-executes once, as train.py
    from repro.records.fingerprint import environment

    threads = compose([]).determinism.cpu_threads
    env = environment()
    rows = []
    for name, overrides in cases(
        Path(tempfile.mkdtemp(prefix="threads-bench-")), args.images
    ).items():
        rates = {"pinned": [], "unpinned": []}
        for r in range(args.repeats):
            order = ("pinned", "unpinned") if r % 2 == 0 else ("unpinned", "pinned")
            for which in order:
                rates[which].append(
                    fetch_rate(overrides, args.batches, args.batch, which == "pinned")
                )
        ratios = [a / b for a, b in zip(rates["pinned"], rates["unpinned"], strict=True)]
        rows.append({"case": name, **rates, "ratios": ratios})
        print(name, {k: [round(x, 2) for x in v] for k, v in rates.items()}, flush=True)

    entry = entry_cost(args.repeats)

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"

    lines = [
        f"# The one-thread rule's cost to loader=single ({today()})", "",
        f"- where: {environment_line(env)}; the run's torch threads: {threads} "
        "(determinism.cpu_threads)",
        f"- command: `{command_line()}`",
        f"- micro-batches of {args.batch} fetched in the main process (read + augmented, "
        f"as loader=single between steps), {args.batches} timed after one, alternating; "
        f"median (min–max) of {args.repeats} repeats", "",
        "| case | pinned (1 thread) batches/s | unpinned (run's threads) batches/s | "
        "pinned / unpinned |",
        "|---|---|---|---|",
        *(f"| {r['case']} | {cell(r['pinned'])} | {cell(r['unpinned'])} | "
          f"{cell(r['ratios'])} |" for r in rows),
        "", "Entering and leaving the pin with nothing inside, µs a call (20,000 calls, "
        f"median (min–max) of {args.repeats}):", "",
        *(f"- {name}: {cell(times)}" for name, times in entry.items()),
    ]  # fmt: skip
    record = {"environment": env, "command": command_line(), "rows": rows, "entry_us": entry}
    write_results(args.out, "threads", today(), env, "\n".join(lines) + "\n", record)


if __name__ == "__main__":
    main()
