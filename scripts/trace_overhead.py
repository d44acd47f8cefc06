#!/usr/bin/env python
"""What the trace costs: training throughput with `trainer.trace=true` (the default) vs
`false`, measured side by side in one process, and the bits of both (the trace must not
change them).

    python scripts/trace_overhead.py                          # default model, on CUDA if any
    python scripts/trace_overhead.py --steps 1000 --repeats 3 -- model=resnet18

After one warm-up run, the two settings alternate (on, off, off, on, ...) `--repeats` times
each; the overhead is 1 - median(on) / median(off) of the loop's images/s. Writes
benchmarks/trace-overhead-<date>-<gpu>.md/.json with the versions and the exact command.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
from pathlib import Path

from _results import command_line, environment_line, today, write_results

from repro.defense.config import compose
from repro.defense.process_env import pin_process_environment
from repro.engine.loop import train

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks")
    p.add_argument("overrides", nargs="*", help="train.py overrides (after --)")
    args = p.parse_args()
    logging.getLogger("repro").setLevel(logging.WARNING)

    base = [
        f"trainer.max_steps={args.steps}",
        f"trainer.eval_every={args.steps}",
        "trainer.progress=false",
        *args.overrides,
    ]
    cfg0 = compose(base, ROOT / "conf")
    pin_process_environment(cfg0.determinism)  # strict: re-executes once with PYTHONHASHSEED...

    results: dict[str, list[dict]] = {"on": [], "off": []}
    order = ["on", "off"]
    with tempfile.TemporaryDirectory() as tmp:
        train(compose(base, ROOT / "conf"), Path(tmp) / "warmup")
        for i in range(args.repeats):
            for setting in order if i % 2 == 0 else order[::-1]:
                cfg = compose([*base, f"trainer.trace={setting == 'on'}"], ROOT / "conf")
                s = train(cfg, Path(tmp) / f"{setting}{i}")
                results[setting].append(s)
                print(
                    f"trace {setting:3} {i + 1}/{args.repeats}: {s['images_per_second']:9.0f} img/s"
                    f"  weights {s['weights_sha256'][:16]}",
                    flush=True,
                )

    env = results["on"][0]["environment"]
    ips = {k: [r["images_per_second"] for r in v] for k, v in results.items()}
    med = {k: statistics.median(v) for k, v in ips.items()}
    batch = int(cfg0.trainer.batch_size)
    overhead = 1 - med["on"] / med["off"]
    digests = {r["weights_sha256"] for v in results.values() for r in v}
    command, date = command_line(), today()
    record = {
        "date": date,
        "command": command,
        "environment": env,
        "model": cfg0.model._target_,
        "steps": args.steps,
        "batch": batch,
        "trace_every": int(cfg0.trainer.trace_every),
        "images_per_second": ips,
        "median_images_per_second": med,
        "overhead": overhead,
        "distinct_weights": len(digests),
    }
    lines = [
        f"# Trace overhead, {date}",
        "",
        f"`{command}`",
        "",
        f"{environment_line(env)}. Model `{cfg0.model._target_}`, batch {batch}, "
        f"{args.steps} steps per run, strict, trace_every {cfg0.trainer.trace_every}; one "
        f"process, warm-up run excluded, settings alternated.",
        "",
        "| trace | images/s median | min – max | step time (ms) |",
        "|---|---|---|---|",
    ]
    for k in ("on", "off"):
        lines.append(
            f"| {k} | {med[k]:.0f} | {min(ips[k]):.0f} – {max(ips[k]):.0f} | "
            f"{1000 * batch / med[k]:.3f} |"
        )
    lines += [
        "",
        f"Overhead of the trace: **{100 * overhead:.2f}%** of step time "
        f"(1 - median on / median off). Distinct final weight digests over all "
        f"{sum(len(v) for v in results.values())} runs: {len(digests)} (the trace does not "
        "change the bits).",
    ]
    text = "\n".join(lines) + "\n"
    write_results(args.out, "trace-overhead", date, env, text, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
