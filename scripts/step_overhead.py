#!/usr/bin/env python
"""The template's own cost per step: ``python train.py`` beside the hand-written loop
(``scripts/reference_loop.py``) on a model so small that its compute is negligible, so what
is left is the loop's host work (loader, trace, logs, keyed randomness, the checks).

    python scripts/step_overhead.py --repeats 3 --out benchmarks

Runs ``--repeats`` alternated pairs (template first, then the hand loop, the order swapped
every other pair), each a fresh process with ``--steps`` steps. The template's rate is
``steady_images_per_second`` from the run's summary.json (after its first 10 steps), the
hand loop's over its steps after the first 10; both divided by the batch size: steps/s.
The ratio is taken per pair; the median of the pairs' ratios is the result, their spread
beside it. Then the default run (``python train.py``, no override) once: the SHA-256 of its
``trace.jsonl`` and ``metrics.csv``, to compare with a run of the code before a change.
Writes ``<out>/step-overhead-<date>-<gpu or cpu>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from _results import command_line, environment_line, run_checked, run_json, today, write_results

ROOT = Path(__file__).resolve().parents[1]
# the tiny model: compute negligible, so the loop's own work is what is measured
TINY = [
    "model.width=2",
    "model.dropout=0",
    "data.image_size=8",
    "trainer.batch_size=8",
    "trainer.micro_batch_size=8",
    "loader=single",
    "augment=none",
    "determinism.cpu_threads=1",
    "optim=sgd",
]


def environment() -> dict[str, str]:
    """What ``make test`` and a strict run pin, with no progress bar."""
    return {**os.environ, "PYTHONHASHSEED": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "CI": "true"}


def template(run_dir: Path, steps: int, overrides: list[str]) -> dict:
    cmd = [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run_dir}", *overrides,
           f"trainer.max_steps={steps}", f"trainer.eval_every={steps}",
           "trainer.checkpoint_every=0"]  # fmt: skip
    run_checked(cmd, ROOT, environment())
    summary = json.loads((run_dir / "summary.json").read_text())
    batch = int(next(o.split("=")[1] for o in overrides if o.startswith("trainer.batch_size=")))
    return {"steps_per_second": summary["steady_images_per_second"] / batch,
            "weights": summary["weights_sha256"]}  # fmt: skip


def hand(steps: int, overrides: list[str]) -> dict:
    cmd = [sys.executable, str(ROOT / "scripts" / "reference_loop.py"), "--steps", str(steps),
           "--warmup", "10", "--device", "cpu", "--", *overrides]  # fmt: skip
    result = run_json(cmd, ROOT, environment())
    batch = int(next(o.split("=")[1] for o in overrides if o.startswith("trainer.batch_size=")))
    return {"steps_per_second": result["images_per_second"] / batch, "weights": result["weights"]}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=3, help="alternated pairs (default 3)")
    p.add_argument("--steps", type=int, default=3000, help="steps a run (default 3000)")
    p.add_argument("--no-default-run", action="store_true", help="skip the trace digest run")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks")
    args = p.parse_args()
    if args.repeats < 1 or args.steps < 20:
        p.error("--repeats must be at least 1 and --steps at least 20")
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            order = ("template", "hand") if i % 2 == 0 else ("hand", "template")
            got = {}
            for who in order:
                if who == "template":
                    got[who] = template(Path(tmp) / f"t{i}", args.steps, TINY)
                else:
                    got[who] = hand(args.steps, TINY)
            ratio = got["template"]["steps_per_second"] / got["hand"]["steps_per_second"]
            pairs.append({**{k: v["steps_per_second"] for k, v in got.items()}, "ratio": ratio,
                          "template_weights": got["template"]["weights"]})  # fmt: skip
            print(f"pair {i + 1}/{args.repeats}: template {got['template']['steps_per_second']:.1f}"
                  f" steps/s, hand {got['hand']['steps_per_second']:.1f}: {ratio:.3f}x",
                  flush=True)  # fmt: skip
        default = None
        if not args.no_default_run:
            run = Path(tmp) / "default"
            run_checked([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run}"], ROOT,
                        environment())  # fmt: skip
            default = {
                "trace_sha256": sha256(run / "trace.jsonl"),
                "metrics_sha256": sha256(run / "metrics.csv"),
                "weights_sha256": json.loads((run / "summary.json").read_text())["weights_sha256"],
            }
    from repro.records.fingerprint import environment as fingerprint

    env = fingerprint()
    ratios = [r["ratio"] for r in pairs]
    lines = [
        f"# The template's own cost per step: a tiny model beside a hand loop, {today()}",
        "",
        f"`{command_line()}`",
        "",
        f"{environment_line(env)}. Overrides, both sides: `{' '.join(TINY)}`; "
        f"{args.steps} steps a run, rates after the first 10 steps.",
        "",
        "| pair | template steps/s | hand loop steps/s | template / hand |",
        "|---|---|---|---|",
        *(
            f"| {i + 1} | {r['template']:.1f} | {r['hand']:.1f} | {r['ratio']:.3f} |"
            for i, r in enumerate(pairs)
        ),  # fmt: skip
        "",
        f"**Median ratio {statistics.median(ratios):.3f}** (min {min(ratios):.3f}, "
        f"max {max(ratios):.3f}); template weights "
        f"{', '.join(sorted({r['template_weights'][:16] for r in pairs}))}.",
    ]
    if default is not None:
        lines += [
            "",
            "The default run (`python train.py`): "
            f"trace.jsonl `{default['trace_sha256']}`, metrics.csv "
            f"`{default['metrics_sha256']}`, weights `{default['weights_sha256']}`.",
        ]
    record = {"command": command_line(), "environment": env, "overrides": TINY,
              "steps": args.steps, "pairs": pairs, "median_ratio": statistics.median(ratios),
              "default_run": default}  # fmt: skip
    write_results(args.out, "step-overhead", today(), env, "\n".join(lines) + "\n", record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
