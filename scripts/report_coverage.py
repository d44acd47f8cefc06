"""How often does `repro report`'s two-level interval hold the truth? A simulation.

Each experiment draws two configs' per-image scores for S seeds x I images: a baseline with
seed, image and seed-by-image effects (which the group shares: pairing cancels them), and a
group that adds a true difference of 0.005 plus its own seed effect, image effect and noise
in a given seed:image variance ratio. The paired two-level interval
(:func:`repro.tools.stats.two_level`) is computed; the coverage is the share of experiments whose
95% interval holds 0.005. The seeds-only paired t interval's coverage is printed beside it:
it ignores the images, so it falls short where they matter.

    python scripts/report_coverage.py                      # 10 and 5 seeds x 50 images, 200 each
    python scripts/report_coverage.py --experiments 2000 --out benchmarks/report-coverage-DATE-cpu.md

Prints a Markdown table (and writes it to --out, with the date, versions and command).
tests/test_verdicts.py runs :func:`coverage` for the 10-seed designs and requires >= 90%.
"""

from __future__ import annotations

import argparse
import math
import platform
from pathlib import Path

import numpy as np
import scipy
from _results import command_line, today

from repro.tools import stats

TRUTH = 0.005
DESIGNS = [(4, 1), (1, 1), (1, 4)]  # seed : image variance of the group's own effects


def experiment(
    rng: np.random.Generator, seeds: int, images: int, seed_var: float, image_var: float
):
    """One experiment's (baseline, group) per-image scores, each ``seeds x images x 1``."""
    base = (
        0.7
        + rng.normal(0, 0.05, (seeds, 1))
        + rng.normal(0, 0.1, (1, images))
        + rng.normal(0, 0.05, (seeds, images))
    )
    own = (
        rng.normal(0, math.sqrt(seed_var), (seeds, 1))
        + rng.normal(0, math.sqrt(image_var), (1, images))
        + rng.normal(0, math.sqrt(0.5), (seeds, images))
    )
    return base[..., None], (base + TRUTH + 0.01 * own)[..., None]


def coverage(
    seed_var: float,
    image_var: float,
    seeds: int = 10,
    images: int = 50,
    experiments: int = 200,
    key: int = 0,
) -> dict[str, float]:
    """The two-level and the seeds-only intervals' coverage of the true difference over
    ``experiments`` simulated experiments (keyed by ``key``: the same numbers every time),
    and the two-level interval's mean width."""
    rng = np.random.default_rng(key)
    hits = seeds_only = 0
    widths = []
    for _ in range(experiments):
        base, group = experiment(rng, seeds, images, seed_var, image_var)
        got = stats.two_level([stats.Stratum(base, group)])
        lo, hi = got["ci95"]
        hits += lo <= TRUTH <= hi
        widths.append(hi - lo)
        per_seed = stats.paired(base.mean(axis=(1, 2)).tolist(), group.mean(axis=(1, 2)).tolist())
        a, b = per_seed["ci95"]
        seeds_only += a <= TRUTH <= b
    return {
        "two_level": hits / experiments,
        "seeds_only": seeds_only / experiments,
        "width": float(np.mean(widths)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiments", type=int, default=200)
    parser.add_argument("--images", type=int, default=50)
    parser.add_argument("--seeds", type=int, nargs="+", default=[10, 5])
    parser.add_argument("--out", type=Path, help="also write the table here (Markdown)")
    args = parser.parse_args()
    lines = [
        "| seeds | images | seed:image variance | two-level 95% coverage | seeds-only t coverage "
        "| mean two-level width |",
        "|---|---|---|---|---|---|",
    ]
    for seeds in args.seeds:
        for key, (sv, iv) in enumerate(DESIGNS):
            got = coverage(sv, iv, seeds, args.images, args.experiments, key=key)
            lines.append(
                f"| {seeds} | {args.images} | {sv}:{iv} | {got['two_level']:.3f} | "
                f"{got['seeds_only']:.3f} | {got['width']:.4f} |"
            )
            print(lines[-1], flush=True)
    if args.out:
        header = [
            "# Coverage of `repro report`'s two-level interval (simulation)",
            "",
            f"Date {today()}; Python {platform.python_version()}, NumPy "
            f"{np.__version__}, SciPy {scipy.__version__}; {args.experiments} experiments a "
            f"design, the samples' part by their influence (the bootstrap's limit), true "
            f"difference {TRUTH}. Command: `{command_line()}`.",
            "",
        ]
        args.out.write_text("\n".join(header + lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
