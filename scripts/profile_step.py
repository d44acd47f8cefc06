#!/usr/bin/env python
"""Where a training step's time goes: ``torch.profiler`` over train.py's own loop.

    python scripts/profile_step.py -- model=resnet18 trainer.batch_size=256 amp=on
    python scripts/profile_step.py --nproc 2 -- device=cuda model=resnet18 ...   # torchrun
    python scripts/profile_step.py --fake-world 2 -- device=cuda model=resnet18 ...  # 1 GPU

Runs ``repro.engine.loop.train`` with the given overrides (the same config train.py composes) for
``--wait + --warmup + --active + 1`` steps and profiles the ``--active`` steady steps (no
evaluation, checkpoint or traced step falls inside them) on rank 0. Reports, per step: wall
time (device synchronised at both ends of the window), time the device was busy (kernels
and copies, summed), kernel launches and host-device synchronisations; then the top
operators by self CPU time and by self device time. ``--fake-world W`` runs one process as
rank 0 of W over torch's fake process group, whose collectives copy locally: the share of
the micro-batches, the reduction's host and device work and every message of a rank, without
the wire or the wait for peers (a rank's own cost, on a machine with one GPU). It measures
time, not values: torch 2.11's fake all-to-all leaves its output uninitialized, so should
such a run stop on a loss that is not finite, add ``trainer.on_nonfinite=continue``. Writes
``<out>/profile-<label>-<date>-<gpu or cpu>.md`` (``--trace`` adds a Chrome trace, large).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import command_line, environment_line, result_stem, today
from fake_rank import join_fake_world, rank_zero_env

ROOT = Path(__file__).resolve().parents[1]

CHILD = "REPRO_PROFILE_CHILD"


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nproc", type=int, default=1, help="processes (torchrun if > 1)")
    p.add_argument("--wait", type=int, default=10, help="steps before the profiler starts")
    p.add_argument("--warmup", type=int, default=5, help="profiler warm-up steps")
    p.add_argument("--active", type=int, default=10, help="steps profiled")
    p.add_argument(
        "--fake-world",
        type=int,
        default=0,
        metavar="W",
        help="one process as rank 0 of W, collectives copied locally (no wire, no peers)",
    )
    p.add_argument("--top", type=int, default=25, help="operators listed per table")
    p.add_argument("--label", default="run", help="goes into the file name")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks")
    p.add_argument("--trace", action="store_true", help="also write the Chrome trace")
    p.add_argument(
        "--reference",
        choices=["eager", "compile"],
        help="profile the hand-written loop (scripts/reference_loop.py) on the same config "
        "instead of the template's, for a side-by-side reading (one process)",
    )
    p.add_argument("overrides", nargs="*", help="train.py overrides (after --)")
    args = p.parse_args(argv)
    for name in ("nproc", "active"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.reference and args.nproc > 1:
        p.error("--reference profiles one process (the hand-written loop has no torchrun)")
    if args.fake_world and (args.nproc > 1 or args.reference or args.fake_world < 2):
        p.error("--fake-world W (W >= 2) is one process: not with --nproc or --reference")
    if args.wait < 0 or args.warmup < 1:
        p.error("--wait must be 0 or more and --warmup 1 or more (the profiler's start-up)")
    return args


def launch(args: argparse.Namespace) -> int:
    """Run this script again as the training process(es), under torchrun if --nproc > 1."""
    cmd = [sys.executable]
    if args.nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
    # the arguments travel in the environment: torchrun would parse options after the script
    env = {**os.environ, CHILD: json.dumps([command_line(), sys.argv[1:]])}
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    if args.fake_world:  # what torchrun would set for rank 0
        env.update(rank_zero_env(args.fake_world))
    return subprocess.run([*cmd, str(Path(__file__).resolve())], env=env).returncode


def profile(args: argparse.Namespace) -> None:
    import torch
    from torch.profiler import ProfilerActivity, schedule

    from repro.base.world import launched_world
    from repro.defense.config import compose
    from repro.defense.process_env import pin_process_environment
    from repro.engine.dist import shutdown
    from repro.engine.loop import train

    steps = args.wait + args.warmup + args.active + 1  # the last (traced) step is not profiled
    overrides = [
        *args.overrides,
        f"trainer.max_steps={steps}",
        f"trainer.eval_every={steps}",
        "trainer.checkpoint_every=0",
        "trainer.trace_every=0",  # digests only at steps 1 and the last, both outside
        "trainer.progress=false",
    ]
    cfg = compose(overrides, ROOT / "conf")
    pin_process_environment(cfg.determinism)  # strict: re-executes once (PYTHONHASHSEED, ...)
    world = launched_world()
    cuda = str(cfg.device) != "cpu" and torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = torch.profiler.profile(
        activities=activities,
        schedule=schedule(wait=args.wait, warmup=args.warmup, active=args.active, repeat=1),
    )
    first, last = args.wait + args.warmup, args.wait + args.warmup + args.active
    marks: dict[int, float] = {}

    def after_step(step: int, model: torch.nn.Module) -> None:
        if step in (first, last):
            if cuda:
                torch.cuda.synchronize()
            marks[step] = time.perf_counter()
        prof.step()

    if args.reference:  # the same config, trained by the hand-written loop
        from reference_loop import reference_run

        from repro.records.fingerprint import environment

        prof.start()
        device = "cuda" if cuda else "cpu"
        compiled = args.reference == "compile"
        reference_run(args.overrides, steps, first, compiled, device, after_step)
        prof.stop()
        overrides = [*args.overrides, f"(scripts/reference_loop.py, {args.reference})"]
        wall_ms = (marks[last] - marks[first]) * 1e3 / args.active
        report(args, prof, environment(), wall_ms, overrides, 1)
        return
    if args.fake_world:  # joined here, so repro.engine.dist.init finds the group and keeps it
        join_fake_world(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        if world.main:
            prof.start()
        summary = train(cfg, Path(tmp) / "run", after_step=after_step if world.main else None)
        if world.main:
            prof.stop()
    if world.main:
        wall_ms = (marks[last] - marks[first]) * 1e3 / args.active
        report(args, prof, summary["environment"], wall_ms, overrides, world.size)
    shutdown()


def report(args, prof, env: dict, wall_ms: float, overrides: list[str], nproc: int) -> None:
    from torch.autograd import DeviceType

    events = prof.key_averages()
    n = args.active
    host = [e for e in events if e.device_type == DeviceType.CPU]
    # kernels, copies and memsets on the device: not the operators' own device time (their
    # kernels'), nor the device-side copies of host annotations (ProfilerStep#, nccl:...,
    # Optimizer.step#...), which span kernels and gaps alike
    names = {e.key for e in host}
    device = [
        e
        for e in events
        if e.device_type != DeviceType.CPU and e.key not in names and "ProfilerStep" not in e.key
    ]

    def device_us(e) -> float:
        return float(getattr(e, "self_device_time_total", 0) or 0)

    busy_ms = sum(device_us(e) for e in device) / 1e3 / n
    launches = sum(e.count for e in host if "LaunchKernel" in e.key) / n
    syncs = (
        sum(
            e.count
            for e in host
            if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
        )
        / n
    )
    cpu_top = sorted(host, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
    ranges = sorted(
        (e for e in host if e.key.startswith(("repro.", "Optimizer.step"))),
        key=lambda e: e.cpu_time_total,
        reverse=True,
    )
    dev_top = sorted(device, key=device_us, reverse=True)[: args.top]

    def table(rows, value, unit_total, what="self ms/step", share="share") -> list[str]:
        lines = [f"| operator | calls/step | {what} | {share} |", "|---|---|---|---|"]
        for e in rows:
            v = value(e)
            if v <= 0:
                break
            name = e.key if len(e.key) <= 90 else e.key[:87] + "..."
            lines.append(
                f"| `{name}` | {e.count / n:g} | {v / 1e3 / n:.3f} | {v / unit_total:.1%} |"
            )
        return lines

    cpu_total = sum(e.self_cpu_time_total for e in host) or 1.0
    processes = f"{nproc} process(es)"
    if args.fake_world:
        processes = f"1 process as rank 0 of {nproc} (fake process group: no wire, no peers)"
    dev_total = sum(device_us(e) for e in device) or 1.0
    text = "\n".join(
        [
            f"# Where a step's time goes: {args.label}, {today()}",
            "",
            f"`{json.loads(os.environ[CHILD])[0]}`",
            "",
            f"{environment_line(env)}; {processes}, rank 0 profiled. Steps "
            f"{args.wait + args.warmup + 1}–{args.wait + args.warmup + n} of "
            f"`{' '.join(overrides)}`.",
            "",
            f"- wall time per step under the profiler: **{wall_ms:.2f} ms** (device "
            "synchronised at both ends; the profiler adds host time to every operator, so "
            "this is longer than the benchmark's step)",
            *(
                [
                    f"- device busy per step: **{busy_ms:.2f} ms** (kernels and copies summed; "
                    f"{busy_ms / wall_ms:.0%} of the wall time; overlapping streams can pass "
                    "100%, and a collective's kernel counts while it waits for the other ranks)",
                    f"- kernel launches per step: {launches:.0f}; host-device synchronisations "
                    f"per step: {syncs:g} (the window's own closing synchronisation included)",
                ]
                if device
                else []
            ),
            "",
            "## The step's named ranges",
            "",
            "Host time inside each `repro.*` range of `repro.engine.step`/`repro.engine.loop`, the operators "
            "it ran included (`repro.wait_finite`: the host waiting for the device).",
            "",
            *table(ranges, lambda e: e.cpu_time_total, wall_ms * 1e3 * n, "ms/step", "of the step"),
            "",
            "## Top operators by self CPU time",
            "",
            "`ProfilerStep*`'s self time is the host's time outside any operator (Python).",
            "",
            *table(cpu_top, lambda e: e.self_cpu_time_total, cpu_total),
            "",
        ]
    )
    if device:
        text += "\n".join(
            ["", "## Top kernels by device time", "", *table(dev_top, device_us, dev_total)]
        )
    text += "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    devices = 1 if args.fake_world else nproc  # the file name says what ran: one GPU
    stem = result_stem(f"profile-{args.label}", today(), env, devices=devices)
    (args.out / f"{stem}.md").write_text(text)
    if args.trace:
        prof.export_chrome_trace(str(args.out / f"{stem}.trace.json"))
    print(f"wrote {args.out / stem}.md")


def main() -> int:
    if not os.environ.get(CHILD):
        return launch(parse(sys.argv[1:]))
    profile(parse(json.loads(os.environ[CHILD])[1]))
    if os.environ.get("WORLD_SIZE", "1") != "1":  # as train.py under torchrun: skip the
        sys.stdout.flush()  # C++ teardown of the process group that can abort at exit
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
