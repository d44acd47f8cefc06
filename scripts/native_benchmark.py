"""Segmentation at each image's own size, on a GPU: what ``experiment=segmentation_native``
costs and whether it keeps the bits.

1. **strict vs fast**: the preset trained in strict and in fast mode, alternated, each
   ``--repeats`` times, on a generated folder of non-square 12-bit images
   (:func:`repro.components.data.synthetic.write_nuclei_folder`); steady images/s from summary.json and
   the ratio strict / fast of each pair.
2. **bits**: the preset trained with ``loader=multi`` twice and with ``loader=single`` once:
   one weights digest, one ``val_per_image.csv``, and ``repro predict`` on the folder from
   each: the same bytes.
3. **sliding window**: the preset's UNet on one image of 512² and 1024², images/s of a
   plain whole-image forward against :func:`repro.engine.sliding_window.predict_logits` (tiles of
   the training patch, overlap 0.5, Gaussian weights, ``--tile-batch``), strict flags.

    python scripts/native_benchmark.py --repeats 3 --out benchmarks
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _results import command_line, environment_line, run_checked, today, write_results

ROOT = Path(__file__).resolve().parents[1]


def train(run_dir: Path, folder: Path, steps: int, *overrides: str) -> dict:
    cmd = [sys.executable, str(ROOT / "train.py"), "experiment=segmentation_native",
           f"data.path={folder}", "data.num_classes=3", "data.channels=1",
           f"trainer.max_steps={steps}", f"trainer.eval_every={steps}",
           "trainer.progress=false", f"hydra.run.dir={run_dir}", *overrides]  # fmt: skip
    run_checked(cmd, ROOT)
    return json.loads((run_dir / "summary.json").read_text())


def predict_digest(run_dir: Path, folder: Path, out: Path) -> str:
    run_checked([sys.executable, "-m", "repro", "predict", str(run_dir), str(folder / "images"),
                 "--out", str(out)], ROOT)  # fmt: skip
    h = hashlib.sha256()
    for f in sorted(out.iterdir()):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def window_speed(tile_batch: int, sides: list[int], repeats: int) -> list[dict]:
    import torch

    from repro.components.data import DataSplits, TensorImages
    from repro.defense.config import compose
    from repro.defense.determinism import apply_determinism
    from repro.engine.sliding_window import Window, predict_logits

    cfg = compose(["experiment=segmentation_native", "data=synthetic_shapes", "data.num_classes=3",
                   "data.image_size=128", "augment=none"])  # fmt: skip
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    apply_determinism(cfg, device)
    from repro.engine.build import Precision, build_model

    images = torch.zeros(2, 1, 128, 128, dtype=torch.uint8)
    data = DataSplits(TensorImages(images, torch.zeros(2, 128, 128, dtype=torch.uint8)),
                      TensorImages(images, torch.zeros(2, 128, 128, dtype=torch.uint8)), 3)  # fmt: skip
    model = build_model(cfg, data, device).eval()
    precision = Precision(cfg.amp, device)  # the preset's: bf16 autocast

    def forward(x: torch.Tensor) -> torch.Tensor:
        with precision.autocast():
            return model(x)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    window = Window("native", (128, 128), 0.5, 0.125, tile_batch)
    rows = []
    for side in sides:
        x = torch.randn(1, side, side, device=device)

        def plain(x: torch.Tensor = x) -> None:
            forward(x[None])

        def tiled(x: torch.Tensor = x) -> None:
            predict_logits(forward, x, window)

        row = {"side": side, "tile_batch": tile_batch}
        with torch.no_grad():
            for name, fn in (("whole", plain), ("sliding", tiled)):
                times = []
                for _ in range(repeats + 1):
                    sync()
                    t = time.perf_counter()
                    for _ in range(10):
                        fn()
                    sync()
                    times.append((time.perf_counter() - t) / 10)
                row[f"{name}_images_per_second"] = 1 / statistics.median(times[1:])
        row["sliding_over_whole"] = (
            row["sliding_images_per_second"] / row["whole_images_per_second"]
        )
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--images", type=int, default=200)
    p.add_argument("--tile-batch", type=int, nargs="+", default=[4], help="tile batches timed")
    p.add_argument("--window-only", action="store_true", help="only part 3, the sliding window")
    p.add_argument("--sides", type=int, nargs="+", default=[512, 1024], help="image sides timed")
    p.add_argument(
        "--folder-sides",
        type=int,
        nargs=2,
        default=[150, 260],
        help="the generated images' sides: at least data.image_size for whole patches",
    )
    p.add_argument("--bits-only", action="store_true", help="only part 2, the bits")
    p.add_argument("--no-window", action="store_true", help="leave out part 3")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks")
    p.add_argument("overrides", nargs="*", help="added to every training run (e.g. amp=off)")
    args = p.parse_args()
    from repro.defense.config import compose
    from repro.defense.process_env import pin_process_environment

    pin_process_environment(compose([]).determinism)  # strict: re-executes once, as train.py
    from repro.components.data.synthetic import write_nuclei_folder
    from repro.records.fingerprint import environment

    env = environment()
    if args.window_only:
        speed = [
            row for tb in args.tile_batch for row in window_speed(tb, args.sides, args.repeats)
        ]
        lines = [
            f"# Sliding-window inference speed ({today()})", "",
            f"- where: {environment_line(env)}", f"- command: `{command_line()}`",
            "- the `experiment=segmentation_native` UNet (width 16, depth 3, bf16 autocast), "
            "strict flags, one image a call, 10 calls a repeat, median of the repeats", "",
            "| side | tile_batch | whole img/s | sliding img/s | sliding / whole |",
            "|---|---|---|---|---|",
            *(f"| {r['side']}² | {r['tile_batch']} | {r['whole_images_per_second']:.1f} | "
              f"{r['sliding_images_per_second']:.1f} | {r['sliding_over_whole']:.3f} |" for r in speed),
        ]  # fmt: skip
        record = {"environment": env, "command": command_line(), "window": speed}
        write_results(args.out, "sliding-window", today(), env, "\n".join(lines) + "\n", record)
        return
    work = Path(tempfile.mkdtemp(prefix="native-bench-"))
    folder = work / "nuclei"
    write_nuclei_folder(folder, count=args.images, seed=0, sizes=tuple(args.folder_sides))
    pairs = []
    for r in range(0 if args.bits_only else args.repeats):
        strict = train(
            work / f"strict-{r}", folder, args.steps, "determinism=strict", *args.overrides
        )
        fast = train(work / f"fast-{r}", folder, args.steps, "determinism=fast", *args.overrides)
        s, f = strict["steady_images_per_second"], fast["steady_images_per_second"]
        waits = (strict["loader_wait_fraction"], fast["loader_wait_fraction"])
        pairs.append({"strict": s, "fast": f, "ratio": s / f, "waits": waits})
        print(
            f"repeat {r}: strict {s:.0f} img/s, fast {f:.0f} img/s, ratio {s / f:.3f}", flush=True
        )
    bits = {}
    for name, loader in (("multi-a", "loader=multi"), ("multi-b", "loader=multi"),
                         ("single", "loader=single")):  # fmt: skip
        run = work / f"bits-{name}"
        summary = train(run, folder, args.steps // 3, loader, *args.overrides)
        bits[name] = {
            "weights_sha256": summary["weights_sha256"],
            "val_per_image_sha256": hashlib.sha256(
                (run / "val_per_image.csv").read_bytes()
            ).hexdigest(),
            "predict_sha256": predict_digest(run, folder, work / f"pred-{name}"),
            "val_dice": summary.get("val_dice"),
            "images_per_second": summary.get("steady_images_per_second"),
        }
    identical = (  # the speed aside
        len({json.dumps({k: v for k, v in b.items() if k != "images_per_second"}, sort_keys=True)
             for b in bits.values()}) == 1
    )  # fmt: skip
    speed = [] if args.no_window or args.bits_only else [
        row for tb in args.tile_batch for row in window_speed(tb, args.sides, args.repeats)
    ]  # fmt: skip
    ratios = [x["ratio"] for x in pairs] or [float("nan")]
    lines = [
        f"# Native-resolution segmentation ({today()})", "",
        f"- where: {environment_line(env)}", f"- command: `{command_line()}`",
        f"- data: {args.images} generated non-square 12-bit images ({args.folder_sides[0]}-"
        f"{args.folder_sides[1]} px, 16-bit PNG), 3 classes; `experiment=segmentation_native` "
        "(sliding-window validation), with the overrides in the command", "",
        "## strict / fast (steady img/s of training)", "",
        "| repeat | strict | fast | strict / fast | loader wait (strict, fast) |", "|---|---|---|---|---|",
        *(f"| {i} | {x['strict']:.0f} | {x['fast']:.0f} | {x['ratio']:.3f} | "
          f"{x['waits'][0]:.3f}, {x['waits'][1]:.3f} |" for i, x in enumerate(pairs)),
        "", f"median ratio **{statistics.median(ratios):.3f}** (min {min(ratios):.3f}, max {max(ratios):.3f})", "",
        "## the same bits across loaders and repeats", "",
        "| run | weights | val_per_image.csv | predict (all masks) | val_dice | img/s |",
        "|---|---|---|---|---|---|",
        *(f"| {k} | `{v['weights_sha256'][:16]}` | `{v['val_per_image_sha256'][:16]}` | "
          f"`{v['predict_sha256'][:16]}` | {v['val_dice']:.4f} | {v['images_per_second'] or 0:.0f} |"
          for k, v in bits.items()),
        "", f"identical: **{identical}**", "",
        "## sliding window vs a whole-image forward (strict flags, the preset's precision, tile 128², overlap 0.5)", "",
        "| side | tile_batch | whole img/s | sliding img/s | sliding / whole |", "|---|---|---|---|---|",
        *(f"| {r['side']}² | {r['tile_batch']} | {r['whole_images_per_second']:.1f} | "
          f"{r['sliding_images_per_second']:.1f} | {r['sliding_over_whole']:.3f} |" for r in speed),
    ]  # fmt: skip
    record = {"environment": env, "command": command_line(), "pairs": pairs, "bits": bits,
              "identical": identical, "window": speed}  # fmt: skip
    write_results(args.out, "native-segmentation", today(), env, "\n".join(lines) + "\n", record)


if __name__ == "__main__":
    main()
