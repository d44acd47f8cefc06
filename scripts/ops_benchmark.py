#!/usr/bin/env python
"""repro.components.ops against PyTorch's ops, forward + backward, strict vs fast flags, on CUDA.

    python scripts/ops_benchmark.py                 # the UNet preset's shapes, bf16 autocast
    python scripts/ops_benchmark.py --repeats 5 --calls 50

Bilinear 2× upsampling at each level of the UNet preset (width 32, depth 4, 128×128, batch
32) and the per-pixel cross-entropy on its logits, each timed as forward + backward under
``torch.autocast(bfloat16)`` as training runs them: PyTorch's op with fast flags, PyTorch's
op with strict flags (``use_deterministic_algorithms(True)``, cuDNN deterministic, no
autotuning), and repro.components.ops's with both. Every cell is the median of ``--calls``
calls; the cells are interleaved, ``--repeats`` times, and the table shows the median and
the spread of those medians. Writes benchmarks/ops-<date>-<gpu>.md/.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from _results import command_line, environment_line, today, write_results

import repro.components.ops as ops
from repro.defense.determinism import flags_restored
from repro.records.fingerprint import environment

ROOT = Path(__file__).resolve().parents[1]


def set_strict(strict: bool) -> None:
    torch.use_deterministic_algorithms(strict)
    torch.backends.cudnn.deterministic = strict
    torch.backends.cudnn.benchmark = not strict
    torch.utils.deterministic.fill_uninitialized_memory = False


def upsample_case(shape: tuple[int, ...], impl: str) -> Callable[[], None]:
    x0 = torch.randn(*shape, device="cuda").bfloat16()
    g = torch.randn(shape[0], shape[1], 2 * shape[2], 2 * shape[3], device="cuda")

    def run() -> None:
        x = x0.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if impl == "torch":
                y = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
            else:
                y = ops.upsample2x(x)
        y.backward(g)

    return run


def loss_case(impl: str, n: int = 32, c: int = 4, side: int = 128) -> Callable[[], None]:
    logits0 = torch.randn(n, c, side, side, device="cuda").bfloat16()
    target = torch.randint(0, c, (n, side, side), device="cuda")

    def run() -> None:
        x = logits0.clone().float().requires_grad_(True)
        if impl == "torch mean":
            loss = F.cross_entropy(x, target)
        elif impl == "torch none":
            loss = F.cross_entropy(x, target, reduction="none").sum()
        elif impl == "torch flat":
            loss = F.cross_entropy(x.movedim(1, -1).flatten(0, -2), target.flatten())
        else:
            loss = ops.dense_cross_entropy(x, target).sum()
        loss.backward()

    return run


def forward_facts(shape: tuple[int, ...]) -> dict[str, str]:
    """Forward bits of F.interpolate under strict vs fast flags, and upsample2x's against it."""
    x = torch.randn(*shape, device="cuda")
    out = {}
    with flags_restored():
        for strict in (False, True):
            set_strict(strict)
            with torch.no_grad():
                out[strict] = (
                    F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False),
                    ops.upsample2x(x),
                )

    def diff(a: torch.Tensor, b: torch.Tensor) -> str:
        if torch.equal(a, b):
            return "bit-equal"
        return f"differ in {(a != b).float().mean().item():.1%} of values, max abs {(a - b).abs().max().item():.2e}"

    return {
        f"F.interpolate forward on float32 {'×'.join(map(str, shape))}, strict vs fast flags": diff(
            out[True][0], out[False][0]
        ),
        "upsample2x forward, strict vs fast flags": diff(out[True][1], out[False][1]),
        "upsample2x vs F.interpolate, fast flags": diff(out[False][1], out[False][0]),
        "upsample2x vs F.interpolate, strict flags": diff(out[True][1], out[True][0]),
    }


def median_ms(fn: Callable[[], None], calls: int) -> float | None:
    times = []
    try:
        for _ in range(calls + 3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(1000 * (time.perf_counter() - t))
    except RuntimeError as err:
        if "deterministic" not in str(err):
            raise
        return None  # strict mode refuses the op
    return statistics.median(times[3:])


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    width, side, batch = 32, 128, 32
    # what each up-sampling of the preset receives: channels of level i+1 at side / 2^(i+1)
    levels = [(batch, width * 2 ** (i + 1), side >> (i + 1), side >> (i + 1)) for i in range(4)]
    cells: dict[tuple[str, str, str], Callable[[], None]] = {}
    for shape in levels:
        name = "upsample " + "×".join(map(str, shape))
        for impl in ("torch", "repro"):
            for mode in ("fast", "strict"):
                cells[name, impl, mode] = upsample_case(shape, impl)
    for impl in ("torch mean", "torch none", "torch flat", "repro"):
        for mode in ("fast", "strict"):
            cells["cross-entropy 32×4×128×128", impl, mode] = loss_case(impl)
    results: dict[tuple[str, str, str], list[float | None]] = {k: [] for k in cells}
    with flags_restored():
        for r in range(args.repeats):
            for key, fn in cells.items():
                set_strict(key[2] == "strict")
                results[key].append(median_ms(fn, args.calls))
            print(f"repeat {r + 1}/{args.repeats} done", flush=True)
    facts = forward_facts(levels[0])
    env, command, date = environment(), command_line(), today()
    lines = [
        f"# repro.components.ops vs PyTorch's ops, {date}",
        "",
        f"`{command}`",
        "",
        f"{environment_line(env)}. Forward + backward under bf16 autocast; each cell the "
        f"median of {args.calls} calls, {args.repeats} interleaved repeats: median "
        "(min–max of the repeats' medians). `raises`: strict mode refuses the op.",
        "",
        "| op | implementation | flags | ms |",
        "|---|---|---|---|",
    ]
    for (op, impl, mode), values in results.items():
        ok = [v for v in values if v is not None]
        cell = "raises" if not ok else f"{statistics.median(ok):.3f} ({min(ok):.3f}–{max(ok):.3f})"
        lines.append(f"| {op} | {impl} | {mode} | {cell} |")
    lines += ["", *(f"- {k}: {v}" for k, v in facts.items())]
    record = {
        "facts": facts,
        "date": date,
        "command": command,
        "environment": env,
        "rows": [
            {"op": op, "implementation": impl, "flags": mode, "ms": values}
            for (op, impl, mode), values in results.items()
        ],
    }
    text = "\n".join(lines) + "\n"
    print(text)
    write_results(args.out, "ops", date, env, text, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
