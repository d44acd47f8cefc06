"""How often is `repro report` wrong? Each of its paths, simulated, under the null and under
a known effect.

Each experiment fabricates two configs' per-image scores (a baseline and a group: seeds x
images, with seed, image and seed-by-image effects that the group shares, and its own) and
runs them through the report's comparison (:func:`repro.tools.comparisons.compare_groups`,
in memory: the same code as ``repro report``, the same path choice). A scenario is one
path's situation:

    normal          paired, 5 seeds x 40 images, all three sources comparable
    seeds           paired, the seeds' own part dominates
    images          paired, the images' own part dominates (the samples decide)
    seed x image    paired, each image's score moves from seed to seed (the realistic case
                    for a segmentation: pairing leaves mostly this)
    collapsed seed  paired, 6 seeds; in a third of the experiments one job collapses
                    (Dice 0 on every image): named, left out
    non-normal      paired, bimodal seed levels (shared) and heavy-tailed (t, 3 df) noise
    unpaired        other seeds for each config (5 + 5), the same images
    folds           5 folds x 2 seeds, paired by (seed, fold), each fold validating on its
                    own images; each experiment's data set moves every pair alike (the
                    folds' shared training files: correlation 1/k between pairs, Nadeau and
                    Bengio's model)
    folds, 1 seed   the same with one seed: 5 (seed, fold) pairs
    3 seeds         paired, 3 seeds: the fewest with a test
    2 seeds         paired, 2 seeds: no test, no interval (the report's rule)
    no per-sample records   "normal" without per-image scores: the seeds' paired t decides,
                    an interval conditional on the validation set, whose own image effects
                    it cannot see (the report says "seeds only")

Under the null (no true difference) the false-positive rate is the share of experiments
called better or worse; under an effect, the power is the share called better; the
coverage is the share of printed 95% intervals that hold the true difference ("-" where
none is printed). Each rate has its Monte-Carlo standard error sqrt(p(1 - p)/n).

    python scripts/report_error_rates.py                        # 200 experiments a scenario
    python scripts/report_error_rates.py --experiments 2000 --out benchmarks/report-error-rates-DATE-cpu.md

tests/test_verdicts.py runs :func:`rates` with a few hundred experiments and requires every
false-positive rate <= 10% (a gross failure).
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import scipy
from _results import command_line, today

from repro.records.sample_records import SampleScores, collapse
from repro.tools.comparisons import compare_groups
from repro.tools.report import Job

EFFECT = 0.01  # the true difference under the alternative
HEADLINE = "val_dice"

# name: (seeds, images, folds, shared sd (seed, image, seed x image), own sd (seed, image,
# seed x image)); the own effects are the difference's
SCENARIOS: dict[str, dict[str, Any]] = {
    "normal": {"seeds": 5, "own": (0.006, 0.006, 0.03)},
    "seeds": {"seeds": 5, "own": (0.015, 0.002, 0.02)},
    "images": {"seeds": 5, "own": (0.001, 0.02, 0.01)},
    "seed x image": {"seeds": 5, "own": (0.002, 0.002, 0.08)},
    "collapsed seed": {"seeds": 6, "own": (0.006, 0.006, 0.03), "collapse": 1 / 3},
    "non-normal": {"seeds": 6, "own": (0.006, 0.006, 0.03), "bimodal": True},
    "unpaired": {"seeds": 5, "own": (0.006, 0.006, 0.03), "unpaired": True},
    "folds": {"seeds": 2, "folds": 5, "own": (0.006, 0.006, 0.03)},
    "folds, 1 seed": {"seeds": 1, "folds": 5, "own": (0.006, 0.006, 0.03)},
    "3 seeds": {"seeds": 3, "own": (0.006, 0.006, 0.03)},
    "2 seeds": {"seeds": 2, "own": (0.006, 0.006, 0.03)},
    "no per-sample records": {"seeds": 5, "own": (0.006, 0.006, 0.03), "no_samples": True},
}
IMAGES = 40


def _job(name: str, seed: int, fold: int | None, scores: np.ndarray, records: bool) -> Job:
    """A finished job with its per-image headline scores (one column; ``records`` False: a
    job without them)."""
    values = [[float(v)] for v in scores]
    samples = SampleScores([f"img_{i:03d}" for i in range(len(values))], ["headline"], values, {})
    summary = {
        HEADLINE: float(np.mean(scores)),
        "headline": HEADLINE,
        "higher_is_better": True,
        "final_loss": 0.5,
        "metric_names": [HEADLINE],
    }
    job = Job(Path("/nonexistent") / name, 0, [], seed, "ok", summary, fold=fold)
    job.scores = samples if records else "no val_per_image.csv"
    job.collapsed = collapse(summary, samples)
    return job


def _group(title: str, jobs: list[Job]) -> dict[str, Any]:
    return {
        "title": title,
        "headline": HEADLINE,
        "higher_is_better": True,
        "metric_directions": {},
        "metrics": {HEADLINE: {}},
        "jobs": [
            {
                "job": j.dir.name,
                "seed": j.seed,
                "fold": j.fold,
                "status": "ok",
                HEADLINE: j.summary[HEADLINE],
                "weights_sha256": None,
            }
            for j in jobs
        ],  # fmt: skip
    }


def experiment(rng: np.random.Generator, spec: dict[str, Any], truth: float) -> dict[str, Any]:
    """One fabricated comparison through the report's code: its ``decision`` and outcome."""
    seeds, folds = spec["seeds"], spec.get("folds") or 1
    units = seeds * folds  # a (seed, fold) pair is one unit of the seeds' part
    s_sd, i_sd, e_sd = spec["own"]
    images = IMAGES

    def noise(shape: tuple[int, ...], sd: float) -> np.ndarray:
        if spec.get("bimodal"):  # heavy tails: t with 3 degrees of freedom, the same sd
            return rng.standard_t(3, shape) * sd / math.sqrt(3.0)
        return rng.normal(0, sd, shape)

    fold_of = np.array([f for _ in range(seeds) for f in range(folds)])  # each unit's fold

    def per_image(sd: float) -> np.ndarray:  # each fold validates on its own images
        return noise((folds, images), sd)[fold_of]

    def config(shift: float, shared: np.ndarray) -> np.ndarray:
        return (
            0.7 + shift + shared + noise((units, 1), s_sd) + per_image(i_sd)
            + noise((units, images), e_sd)
        )  # fmt: skip

    level = rng.normal(0, 0.05, (units, 1))
    if spec.get("bimodal"):  # half the seeds land low, half high: in both configs alike
        level = np.where(rng.random((units, 1)) < 0.5, -0.2, 0.2)
    images_effect = rng.normal(0, 0.08, (folds, images))[fold_of]
    shared = level + images_effect + rng.normal(0, 0.03, (units, images))
    base = config(0.0, shared)
    if spec.get("unpaired"):  # other seeds: their own seed and seed-by-image draws
        other = rng.normal(0, 0.05, (units, 1)) + images_effect
        group = config(truth, other + rng.normal(0, 0.03, (units, images)))
    else:
        group = config(truth, shared)
    if folds > 1:  # the data set's draw moves every pair's difference alike: correlation
        # 1/k between pairs, i.e. a shared part of variance 1/(k - 1) the pairs' own
        own = 2 * (s_sd**2 + e_sd**2 / images)  # both configs' own seed noise
        group = group + rng.normal(0, math.sqrt(own / (folds - 1)))
    if spec.get("collapse") and rng.random() < spec["collapse"]:
        (base if rng.random() < 0.5 else group)[rng.integers(units)] = 0.0
    keys = [(s, f if folds > 1 else None) for s in range(seeds) for f in range(folds)]
    offset = seeds if spec.get("unpaired") else 0
    records = not spec.get("no_samples")
    a = [_job(f"a{u}", s, f, base[u], records) for u, (s, f) in enumerate(keys)]
    b = [_job(f"b{u}", s + offset, f, group[u], records) for u, (s, f) in enumerate(keys)]
    # the bootstrap of the medians and IQMs describes and decides nothing: not drawn here
    report = compare_groups([_group("A", a), _group("B", b)], [a, b], "A", aggregates=False)
    return report["comparisons"][0]


def rates(
    name: str, experiments: int, key: int = 0, hypotheses: tuple[str, ...] = ("null", "effect")
) -> dict[str, Any]:
    """False-positive rate (null), power (effect) and both coverages of scenario ``name``
    over ``experiments`` experiments each (keyed: the same numbers every time)."""
    spec = SCENARIOS[name]
    out: dict[str, Any] = {"scenario": name, "experiments": experiments}
    for which, truth in (("null", 0.0), ("effect", EFFECT)):
        if which not in hypotheses:
            continue
        rng = np.random.default_rng([key, list(SCENARIOS).index(name), truth > 0])
        called = covered = printed = 0
        paths: dict[str, int] = {}
        for _ in range(experiments):
            c = experiment(rng, spec, truth)
            d = c.get("decision") or {}
            word = c["outcome"]
            called += word.startswith("better") if truth else word != "can't tell"
            paths[c["path"]] = paths.get(c["path"], 0) + 1
            if d.get("ci95"):
                printed += 1
                lo, hi = d["ci95"]
                covered += lo <= truth <= hi
        out[which] = {
            "called": called / experiments,
            "coverage": covered / printed if printed else None,
            "printed": printed,
            "paths": paths,
        }
    return out


def _rate(p: float | None, n: int) -> str:
    if p is None or not n:
        return "–"
    return f"{p:.3f} ± {math.sqrt(p * (1 - p) / n):.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiments", type=int, default=200)
    parser.add_argument("--scenario", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--out", type=Path, help="also write the table here (Markdown)")
    args = parser.parse_args()
    lines = [
        "| scenario | path (experiments under the null) | false positives (null) | coverage (null) "
        f"| power (effect {EFFECT}) | coverage (effect) |",
        "|---|---|---|---|---|---|",
    ]
    start = time.perf_counter()
    for i, name in enumerate(args.scenario):
        got = rates(name, args.experiments)
        null, eff = got["null"], got["effect"]
        path = "; ".join(f"{k} ({v})" for k, v in null["paths"].items())
        lines.append(
            f"| {name} | {path} | {_rate(null['called'], args.experiments)} | "
            f"{_rate(null['coverage'], null['printed'])} | "
            f"{_rate(eff['called'], args.experiments)} | "
            f"{_rate(eff['coverage'], eff['printed'])} |"
        )
        print(lines[-1], flush=True)
        print(
            f"  [{i + 1}/{len(args.scenario)}, {time.perf_counter() - start:.0f} s] paths: "
            f"{null['paths']}",
            file=sys.stderr,
            flush=True,
        )
    if args.out:
        header = [
            "# Error rates of `repro report`'s verdicts (simulation)",
            "",
            f"Date {today()}; Python {platform.python_version()}, NumPy {np.__version__}, "
            f"SciPy {scipy.__version__}; {args.experiments} experiments a scenario and "
            f"hypothesis, each through `repro.tools.comparisons.compare_groups`; true effect "
            f"{EFFECT} under the alternative; ± is the Monte-Carlo standard error. Scenarios: "
            "`scripts/report_error_rates.py`'s docstring. Command: "
            f"`{command_line()}`.",
            "",
        ]
        args.out.write_text("\n".join(header + lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
