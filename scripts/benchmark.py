#!/usr/bin/env python
"""Training throughput, strict vs fast, side by side in one process.

    python scripts/benchmark.py                       # on CUDA: both models, all variants
    python scripts/benchmark.py --steps 60 --warmup 10 --repeats 2 --models convnet
    python scripts/benchmark.py --reference           # the README's commands vs a hand loop

For each model (the default ConvNet at its default batch; the ResNet-18 preset at batch 256;
with ``--models unet unet-stock`` the segmentation UNet at 128×128, batch 32, with repro.components.ops
and with PyTorch's ops) and precision (amp off/on), every loader (single/multi/device) x determinism (strict/fast)
cell runs `--repeats` times, the cells rotated together. Throughput is images/s over the
steps after `--warmup` (timed with CUDA synchronisation at both ends, evaluation excluded);
the ratio strict / fast is of the medians. Every strict repeat's final weights digest is
recorded: they must agree, across loaders too. The input pipeline's cost is strict with a
loader over strict with ``loader=device`` (the training split already on the GPU).
``--lightning`` adds the peer (``scripts/lightning_peer.py``: the same model and data under
Lightning's ``seed_everything(workers=True)`` + ``Trainer(deterministic=True)``, each run its
own process) to the rotation of the single- and multi-worker variants, and the ratio
strict / Lightning. ``--reference`` (CUDA) instead runs each model's command as the README
gives it (``defaults``: ``python train.py``, ``experiment=resnet18``, ``experiment=segmentation``,
that UNet at 128×128, and ``experiment=segmentation_native`` on a generated folder of images of
their own sizes), the same with one setting changed (fast mode; one micro-batch a
step; compiled; ``loader=multi`` and contiguous, what the defaults were before they chose
for themselves), and the hand-written loop of the same model, precision and batch
(``scripts/reference_loop.py``) eager and compiled: ratios to both. Writes benchmarks/benchmark[-LABEL]-<date>-<gpu>.md/.json (``-2``, ``-3``
... when that name is taken) with the versions and the exact command.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _results import command_line, environment_line, run_json, today, write_results

from repro.defense.config import compose
from repro.defense.process_env import pin_process_environment
from repro.engine.loop import train

ROOT = Path(__file__).resolve().parents[1]

# The UNet preset at 128x128, batch 32 in one micro-batch: with repro.components.ops (the preset) and
# with PyTorch's ops (nn.Upsample, and F.cross_entropy on (N*H*W, C), the usual workaround
# for the 4-D form, which raises in strict mode). augment=crop_flip: the augmentation
# loader=device runs on the GPU, as the hand-written reference does (the preset's own,
# augment=segmentation, rotates and scales on the host).
UNET = [
    "experiment=segmentation",
    "augment=crop_flip",
    "model.width=32",
    "model.depth=4",
    "data.image_size=128",
    "trainer.batch_size=32",
    "trainer.micro_batch_size=32",
]
MODELS = {
    "convnet": [],  # default batch 64 = 2 x 32
    "resnet18": ["model=resnet18", "trainer.batch_size=256", "trainer.micro_batch_size=256"],
    "unet": UNET,
    "unet-stock": [*UNET, "model.upsample=torch", "task.cross_entropy=torch_flat"],
}
DEFAULT_MODELS = ["convnet", "resnet18"]
VARIANTS = [
    ("fp32", "single", ["amp=off", "loader=single"]),
    ("fp32", "multi", ["amp=off", "loader=multi"]),
    ("fp32", "device", ["amp=off", "loader=device"]),
    ("bf16", "single", ["amp=on", "loader=single"]),
    ("bf16", "multi", ["amp=on", "loader=multi"]),
    ("bf16", "device", ["amp=on", "loader=device"]),
]
VARIANT_NAMES = [f"{amp}-{loader}" for amp, loader, _ in VARIANTS]


def timed_run(overrides: list[str], steps: int, warmup: int, where: Path) -> dict:
    cfg = compose(
        [
            f"trainer.max_steps={steps}",
            f"trainer.eval_every={steps}",
            "trainer.progress=false",
            "trainer.checkpoint_every=0",
            *overrides,
        ],
        ROOT / "conf",
    )
    marks: dict[int, float] = {}

    def after_step(step: int, model: torch.nn.Module) -> None:
        if step in (warmup, steps):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            marks[step] = time.perf_counter()

    summary = train(cfg, where, after_step=after_step)
    t = cfg.trainer
    images = (steps - warmup) * int(t.batch_size)
    k = int(t.batch_size) // int(t.micro_batch_size)
    settings = [
        summary["amp"] if summary["amp"] != "off" else "fp32",
        f"{summary['determinism']}",
        f"K={k}",
        f"loader {summary['loader']}",
        "channels_last" if summary.get("channels_last") else "contiguous",
    ]
    if str(t.compile) != "off":
        settings.append("compiled")
    return {
        "images_per_second": images / (marks[steps] - marks[warmup]),
        "weights": summary["weights_sha256"],
        "warmup_seconds": summary.get("warmup_seconds"),
        "settings": ", ".join(settings),
    }


# --reference: each model's command as the README gives it (its preset, no other override
# but the step count), as it is and with one setting changed, against the hand-written loop
# (scripts/reference_loop.py) of the same model, precision and global batch, in one
# micro-batch (as one writes it by hand), eager and compiled.
READMES_COMMAND = {
    "convnet": [],  # python train.py: fp32, batch 64 = 2 x 32
    "resnet18": ["experiment=resnet18"],
    "segmentation": ["experiment=segmentation", "augment=crop_flip"],  # the 64x64 preset
    "unet": UNET,  # the preset's UNet at 128x128 (fp32)
    # images of their own sizes, 128-px patches cut on the host (augment=patches), bf16, batch
    # 16: on a generated folder (scripts/nuclei_folder.py: 60 12-bit images of 150-260 px)
    "native": [
        "experiment=segmentation_native",
        "data.path={nuclei}",
        "data.num_classes=3",
        "data.channels=1",
    ],
}
# (name, overrides added to the command -- or an int, that many micro-batches a step, the
# cell skipped when the command's K is that already -- or None for the reference; compiled)
REFERENCE_CELLS = [
    ("defaults", [], False),
    ("defaults, fast mode", ["determinism=fast"], False),
    ("defaults, one micro-batch", 1, False),
    ("defaults, 2 micro-batches", 2, False),
    ("defaults, compiled", ["trainer.compile=default"], False),
    ("loader=multi, contiguous", ["loader=multi", "trainer.channels_last=false"], False),
    ("reference eager", None, False),
    ("reference compile", None, True),
]


def reference_comparison(args: argparse.Namespace, tmp: Path) -> list[dict]:
    """Every cell of REFERENCE_CELLS for each model, rotated together."""
    from reference_loop import reference_run

    rows = []
    n = 0
    chosen = [c for c in REFERENCE_CELLS if c[0] in args.cells] if args.cells else REFERENCE_CELLS
    for model in args.models:
        base = READMES_COMMAND[model]
        cfg = compose(base, ROOT / "conf")
        batch, k = cfg.trainer.batch_size, cfg.trainer.batch_size // cfg.trainer.micro_batch_size
        one = [f"trainer.micro_batch_size={batch}"]
        cells = []
        for name, overrides, compiled in chosen:
            if isinstance(overrides, int):
                if overrides == k:
                    continue
                overrides = [f"trainer.micro_batch_size={batch // overrides}"]
            cells.append((name, overrides, compiled))
        res: dict[str, list[dict]] = {name: [] for name, _, _ in cells}
        for i in range(args.repeats):
            shift = i * len(cells) // args.repeats
            for name, overrides, compiled in cells[shift:] + cells[:shift]:
                n += 1
                if overrides is None:
                    t0 = time.perf_counter()
                    r = reference_run([*base, *one], args.steps, args.warmup, compiled)
                    r["warmup_seconds"] = None
                    r["run_seconds"] = time.perf_counter() - t0
                    precision = "bf16" if cfg.amp.enabled else "fp32"
                    how = ", compiled" if compiled else ""
                    r["settings"] = f"{precision}, K=1, hand-written, channels_last{how}"
                else:
                    r = timed_run([*base, *overrides], args.steps, args.warmup, tmp / f"r{n}")
                res[name].append(r)
                print(
                    f"{model:12} {name:34} {i + 1}/{args.repeats}: "
                    f"{r['images_per_second']:9.0f} img/s  {r['weights'][:12]}",
                    flush=True,
                )
        medians = {k: statistics.median(r["images_per_second"] for r in v) for k, v in res.items()}
        for name, overrides, _ in cells:
            ips = [r["images_per_second"] for r in res[name]]
            warm = [r["warmup_seconds"] for r in res[name] if r.get("warmup_seconds")]
            rows.append(
                {
                    "model": model,
                    "cell": name,
                    "command": [*base, *(overrides if overrides is not None else one)],
                    "settings": res[name][0]["settings"],
                    "images_per_second": ips,
                    "median": medians[name],
                    "over_reference_compile": (
                        medians[name] / medians["reference compile"]
                        if "reference compile" in medians
                        else None
                    ),
                    "over_reference_eager": medians[name] / medians["reference eager"],
                    "distinct_weights": len({r["weights"] for r in res[name]}),
                    "weights": sorted({r["weights"] for r in res[name]}),
                    "warmup_seconds": warm,
                }
            )
    return rows


def reference_table(rows: list[dict], flops: dict[str, float]) -> list[str]:
    lines = [
        "| model | run | as it ran | img/s median (min–max) | / reference compile "
        "| / reference eager | digests | TFLOP/s (% of bf16 ceiling) "
        "| warm-up s (compilation), first–last |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ips, tflops = r["images_per_second"], r["median"] * flops[r["model"]] / 1e12
        warm = r["warmup_seconds"]
        warm_text = f"{warm[0]:.1f}–{warm[-1]:.1f}" if warm else "–"
        lines.append(
            f"| {r['model']} | {r['cell']} | {r['settings']} "
            f"| {r['median']:.0f} ({min(ips):.0f}–{max(ips):.0f}) "
            f"| {_ratio(r['over_reference_compile'])} | {r['over_reference_eager']:.3f} "
            f"| {r['distinct_weights']} | {tflops:.1f} ({100 * tflops / H200_BF16_TFLOPS:.1f}%) "
            f"| {warm_text} |"
        )
    return lines


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def lightning_run(overrides: list[str], steps: int, warmup: int) -> dict:
    """One run of the Lightning peer in its own process (Lightning sets global flags)."""
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "lightning_peer.py"),
        f"--steps={steps}",
        f"--warmup={warmup}",
        "--",
        *overrides,
    ]
    result = run_json(cmd, ROOT)
    return {"images_per_second": result["images_per_second"], "weights": result["weights_sha256"]}


# The H200's bf16 dense matmul rate measured on random data (the device library's KINDS.md):
# the ceiling the achieved TFLOP/s are compared with.
H200_BF16_TFLOPS = 790.0


def flops_per_image(overrides: list[str]) -> float:
    """Forward + backward FLOPs of one training image (``torch.utils.flop_counter``: matmuls
    and convolutions, 2 per multiply-add), counted on the CPU with 8 images."""
    from torch.utils.flop_counter import FlopCounterMode

    from repro.engine.build import build_data, build_model, build_task

    cfg = compose(overrides, ROOT / "conf")
    splits = build_data(cfg)
    model = build_model(cfg, splits, torch.device("cpu"))
    task = build_task(cfg, splits)
    if isinstance(splits.train.images, list):  # images of their own sizes: training patches
        s = int(cfg.data.image_size)
        images, masks = splits.train.fetch(torch.arange(8))
        images = torch.stack([i[:, :s, :s] for i in images]).float()
        labels = torch.stack([m[:s, :s] for m in masks]).long()
    else:
        images, labels = splits.train.images[:8].float(), splits.train.labels[:8].long()
    with FlopCounterMode(display=False) as counter:
        task.loss(model(images), labels).backward()
    return counter.get_total_flops() / len(images)


def summarize(
    model: str, amp: str, loaders: list[str], res: dict[tuple[str, str], list[dict]]
) -> list[dict]:
    """One result row per loader of a model and precision, from its cells' runs: medians,
    ratios (strict / fast, strict / Lightning, strict / strict on-device) and digests."""
    group = []
    for loader in loaders:
        runs = {m: v for (lo, m), v in res.items() if lo == loader}
        ips = {m: [r["images_per_second"] for r in v] for m, v in runs.items()}
        med = {m: statistics.median(v) for m, v in ips.items()}
        row = {
            "model": model,
            "amp": amp,
            "loader": loader,
            "images_per_second": ips,
            "median": med,
            "strict_over_fast": med["strict"] / med["fast"],
            "strict_distinct_weights": len({r["weights"] for r in runs["strict"]}),
            "fast_distinct_weights": len({r["weights"] for r in runs["fast"]}),
            "strict_weights": sorted({r["weights"] for r in runs["strict"]}),
            "fast_weights": [r["weights"] for r in runs["fast"]],
        }
        if "lightning" in runs:
            row["strict_over_lightning"] = med["strict"] / med["lightning"]
            row["lightning_distinct_weights"] = len({r["weights"] for r in runs["lightning"]})
        group.append(row)
    on_device = next((r for r in group if r["loader"] == "device"), None)
    for row in group:  # the input pipeline against data already on the GPU
        if on_device is not None and row is not on_device:
            row["strict_over_on_device"] = row["median"]["strict"] / on_device["median"]["strict"]
    return group


def base_record(
    args: argparse.Namespace, env: dict, command: str, date: str, rows: list[dict]
) -> dict:
    """What every result JSON of this script holds: when, how, where, and its rows."""
    return {
        "date": date,
        "command": command,
        "environment": env,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "rows": rows,
    }


def default_loader() -> str:
    """The ``loader`` option of conf/train.yaml's defaults list."""
    from omegaconf import OmegaConf

    defaults = OmegaConf.load(ROOT / "conf" / "train.yaml").defaults
    return next(str(d["loader"]) for d in defaults if not isinstance(d, str) and "loader" in d)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--models",
        nargs="+",
        default=None,
        choices=sorted({*MODELS, *READMES_COMMAND}),
        help=f"default: {' '.join(DEFAULT_MODELS)}; with --reference: "
        f"{' '.join(READMES_COMMAND)} (the README's commands)",
    )
    p.add_argument("--variants", nargs="+", default=VARIANT_NAMES, choices=VARIANT_NAMES)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks")
    p.add_argument("--label", default="", help="names the result files: benchmark-LABEL-<date>-...")
    p.add_argument(
        "--lightning",
        action="store_true",
        help="also run the Lightning peer (scripts/lightning_peer.py; needs lightning)",
    )
    p.add_argument(
        "--reference",
        action="store_true",
        help="instead: the README's commands, as they are and with one setting changed, "
        "against the hand-written loop (scripts/reference_loop.py), eager and compiled "
        "(CUDA only)",
    )
    p.add_argument(
        "--cells",
        nargs="+",
        default=None,
        metavar="NAME",
        help="with --reference: only these cells (their names in the table; 'reference "
        "eager' is needed for the ratios, 'reference compile' for the second)",
    )
    args = p.parse_args()
    if not 0 < args.warmup < args.steps:
        p.error("need 0 < --warmup < --steps")
    known = READMES_COMMAND if args.reference else MODELS
    args.models = args.models or list(READMES_COMMAND if args.reference else DEFAULT_MODELS)
    if set(args.models) - set(known):
        p.error(f"--models: from {', '.join(known)}{' with --reference' * args.reference}")
    if args.reference:
        if not torch.cuda.is_available():
            p.error("--reference needs a CUDA GPU (the reference loop keeps its data there)")
        names = [name for name, _, _ in REFERENCE_CELLS]
        unknown = [c for c in args.cells or [] if c not in names]
        if unknown or (args.cells and "reference eager" not in args.cells):
            p.error(f"--cells: from {names}, 'reference eager' included ({unknown or 'missing'})")
        return main_reference(args)
    if args.lightning and not (
        importlib.util.find_spec("lightning") or importlib.util.find_spec("pytorch_lightning")
    ):
        p.error("--lightning needs Lightning 2.x: pip install -e '.[bench]'")
    logging.getLogger("repro").setLevel(logging.WARNING)
    pin_process_environment(compose([], ROOT / "conf").determinism)  # strict needs it pinned

    rows = []
    across: list[tuple[str, str, int]] = []  # (model, amp, strict digests over all loaders)
    with tempfile.TemporaryDirectory() as tmp:
        n = 0
        timed_run(MODELS[args.models[0]], args.warmup + 5, args.warmup, Path(tmp) / "warm")
        for model in args.models:
            for amp in dict.fromkeys(a for a, _, _ in VARIANTS):
                # every (loader, mode) cell of this model and precision, rotated together, so
                # that ratios across loaders are as side by side as those across modes
                variants = {
                    loader: overrides
                    for a, loader, overrides in VARIANTS
                    if a == amp and f"{a}-{loader}" in args.variants
                }
                if not variants:
                    continue
                cells = [
                    (loader, mode)
                    for loader in variants
                    for mode in ("strict", "fast", "lightning")
                    if mode != "lightning" or (args.lightning and loader != "device")
                ]  # Lightning takes a DataLoader: no on-device row
                res: dict[tuple[str, str], list[dict]] = {c: [] for c in cells}
                for i in range(args.repeats):
                    shift = i * len(cells) // args.repeats  # spread over the order, not by one
                    for loader, mode in cells[shift:] + cells[:shift]:
                        n += 1
                        overrides = [*MODELS[model], *variants[loader]]
                        if mode == "lightning":
                            r = lightning_run(overrides, args.steps, args.warmup)
                        else:
                            r = timed_run(
                                [*overrides, f"determinism={mode}"],
                                args.steps,
                                args.warmup,
                                Path(tmp) / f"run{n}",
                            )
                        res[loader, mode].append(r)
                        print(
                            f"{model:8} {amp} {loader:6} {mode:9} {i + 1}/{args.repeats}: "
                            f"{r['images_per_second']:9.0f} img/s  {r['weights'][:12]}",
                            flush=True,
                        )
                group = summarize(model, amp, list(variants), res)
                rows += group
                across.append((model, amp, len(set().union(*(r["strict_weights"] for r in group)))))

    from repro.records.fingerprint import environment

    flops = {model: flops_per_image(MODELS[model]) for model in args.models}
    for r in rows:
        r["flops_per_image"] = flops[r["model"]]
        r["strict_tflops"] = r["median"]["strict"] * flops[r["model"]] / 1e12

    env = environment()
    command, date = command_line(), today()
    record = base_record(args, env, command, date, rows)
    record["strict_digests_across_loaders"] = [
        {"model": m, "amp": a, "distinct": k} for m, a, k in across
    ]
    lines = [
        f"# Throughput, strict vs fast, {date}",
        "",
        f"`{command}`",
        "",
        f"{environment_line(env)}. {args.steps} steps per run, images/s over the last "
        f"{args.steps - args.warmup} (evaluation excluded); {args.repeats} repeats per cell, "
        "every loader and mode of a model and precision in turn, one process. Strict / strict on-device: strict with this loader over "
        "strict with the training split already on the GPU (`loader=device`); the default "
        f"loader is `{default_loader()}`.",
        "",
        "| model | amp | loader | strict img/s (min–max) | fast img/s (min–max) | strict / fast "
        "| strict digests | fast digests | strict TFLOP/s (% of bf16 ceiling) "
        "| Lightning img/s (min–max) | strict / Lightning | Lightning digests "
        "| strict / strict on-device |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s, f = r["images_per_second"]["strict"], r["images_per_second"]["fast"]
        light = "– | – | –"
        if "strict_over_lightning" in r:
            li = r["images_per_second"]["lightning"]
            light = (
                f"{r['median']['lightning']:.0f} ({min(li):.0f}–{max(li):.0f}) | "
                f"{r['strict_over_lightning']:.3f} | {r['lightning_distinct_weights']}"
            )
        lines.append(
            f"| {r['model']} | {r['amp']} | {r['loader']} | {r['median']['strict']:.0f} "
            f"({min(s):.0f}–{max(s):.0f}) | {r['median']['fast']:.0f} ({min(f):.0f}–{max(f):.0f})"
            f" | {r['strict_over_fast']:.3f} | {r['strict_distinct_weights']} | "
            f"{r['fast_distinct_weights']} | {r['strict_tflops']:.1f} "
            f"({100 * r['strict_tflops'] / H200_BF16_TFLOPS:.1f}%) | {light} | "
            + (f"{r['strict_over_on_device']:.3f} |" if "strict_over_on_device" in r else "– |")
        )
    lines += [
        "",
        "FLOPs per training image (forward + backward, `torch.utils.flop_counter`): "
        + ", ".join(f"{m} {f / 1e9:.3f} GFLOP" for m, f in flops.items())
        + f". Ceiling: the H200's measured bf16 matmul rate, {H200_BF16_TFLOPS:.0f} TFLOP/s "
        "(fp32 rows are further from theirs: fp32 runs on CUDA cores).",
    ]
    lines += [
        "",
        "Strict's weight digests over every loader and repeat (the loader must not change the "
        "bits): " + ", ".join(f"{m} {a}: {k}" for m, a, k in across) + ".",
    ]
    if args.lightning:
        lines += [
            "",
            "Lightning: `scripts/lightning_peer.py` (the same model, data, batch, optimizer and "
            "schedule; `seed_everything(workers=True)` + `Trainer(deterministic=True)`, "
            "`accumulate_grad_batches` = K, a shuffling DataLoader), one process per run. "
            "Lightning's `deterministic=True` leaves PyTorch's NaN fill of new tensors on "
            "(strict turns it off) and cuDNN's TF32 at PyTorch's default (on; strict turns "
            "it off, which matters to fp32 rows).",
        ]
    text = "\n".join(lines) + "\n"
    kind = f"benchmark-{args.label}" if args.label else "benchmark"
    write_results(args.out, kind, date, env, text, record)
    return 0


def main_reference(args: argparse.Namespace) -> int:
    logging.getLogger("repro").setLevel(logging.WARNING)
    pin_process_environment(compose([], ROOT / "conf").determinism)
    with tempfile.TemporaryDirectory() as tmp:
        if "native" in args.models:  # its folder, generated
            from repro.components.data.synthetic import write_nuclei_folder

            write_nuclei_folder(Path(tmp) / "nuclei", 60, 0, (150, 260))
            native = [o.format(nuclei=Path(tmp) / "nuclei") for o in READMES_COMMAND["native"]]
            READMES_COMMAND["native"] = native
        first = READMES_COMMAND[args.models[0]]
        timed_run(first, args.warmup + 5, args.warmup, Path(tmp) / "warm")
        rows = reference_comparison(args, Path(tmp))
        flops = {model: flops_per_image(READMES_COMMAND[model]) for model in args.models}
    from repro.records.fingerprint import environment

    env, command, date = environment(), command_line(), today()
    lines = [
        f"# One GPU: the README's commands against a hand-written loop, {date}",
        "",
        f"`{command}`",
        "",
        f"{environment_line(env)}. {args.steps} steps per run, images/s over the last "
        f"{args.steps - args.warmup}; {args.repeats} repeats per cell, every cell of a model in "
        "turn, one process. *defaults*: the model's command as the README gives it "
        + "; ".join(f"{m}: `python train.py {' '.join(READMES_COMMAND[m])}`" for m in args.models)
        + " (the last with the step count only); the other template rows change one setting "
        "of it. *As it ran*: precision, determinism mode, micro-batches a step (K), the loader "
        "and memory format the run chose (summary.json). The reference is "
        "`scripts/reference_loop.py`: the same model class, loss, optimizer, schedule, "
        "precision and global batch, in one micro-batch; data on the GPU, channels_last, "
        "deterministic algorithms, a random crop and flip per sample; no trace, checkpoint, "
        "keyed randomness, evaluation or check for a loss that is not finite. Warm-up: the "
        "template's first steps until steady (`warmup_seconds` in summary.json), compilation "
        "included.",
        "",
        *reference_table(rows, flops),
        "",
        "FLOPs per training image (forward + backward): "
        + ", ".join(f"{m} {f / 1e9:.3f} GFLOP" for m, f in flops.items())
        + f". Ceiling: the H200's measured bf16 matmul rate, {H200_BF16_TFLOPS:.0f} TFLOP/s.",
    ]
    record = {**base_record(args, env, command, date, rows), "flops_per_image": flops}
    kind = f"reference-{args.label}" if args.label else "reference"
    write_results(args.out, kind, date, env, "\n".join(lines) + "\n", record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
